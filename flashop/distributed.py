"""Context parallelism: attention over a sequence split across the ranks of a process group.

``import flashop.distributed`` (not imported by ``import flashop``). Three calls:

- :func:`shard_sequence` cuts this rank's shard out of a full sequence, in the zigzag layout;
- :func:`ring_attention` attends each rank's query shard to the whole sequence, passing the
  key/value shards around the ring of ranks (differentiable in q, k, v);
- :func:`gather_sequence` puts the full sequence back together from the shards.

The zigzag layout: the sequence of S tokens is cut into 2W chunks of C = S / (2W) tokens
(W ranks); rank r holds chunks r and 2W-1-r, in that order (its shard has 2C tokens). Under
causal attention every rank then has the same work: each ring step costs every rank 2C^2
scores. docs/context-parallel.md has a picture.

Each ring step, a rank holds the key/value shard of another rank (``src``); the attention of
its two query chunks to that shard's two key chunks is a handful of calls of the flashop
kernels on contiguous slices (``_plan``), whose partial outputs merge by their log-sum-exp
(in base 2, fp32). The backward runs the kernels' backward per call with the *merged* output
and log-sum-exp, which gives each call's exact share of the gradients (FlashAttention-2's
backward recomputes the global probabilities from the global lse and delta), and sends each
key/value shard's fp32 gradient accumulators around the ring with the shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

import flashop  # registers torch.ops.flashop.*
from flashop._launch.options import modifiers
from flashop._ops.checks import check_attention_chunk, check_attention_inputs, window_bounds

__all__ = ["shard_sequence", "gather_sequence", "ring_attention", "ring_attention_with_lse"]

_LN2 = math.log(2.0)


# --- the process group ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Ring:
    rank: int  # this rank's index in the group
    size: int  # W
    ranks: tuple  # the group's global ranks, by group index (P2P ops take global ranks)
    group: Optional[dist.ProcessGroup]

    @property
    def next(self) -> int:
        return self.ranks[(self.rank + 1) % self.size]

    @property
    def prev(self) -> int:
        return self.ranks[(self.rank - 1) % self.size]


def _ring(group, op: str) -> _Ring:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{op}: torch.distributed has no initialized process group; call "
            f"torch.distributed.init_process_group(...) first (e.g. under torchrun), or call "
            f"flashop.attention on the whole sequence on one device")
    ranks = tuple(dist.get_process_group_ranks(group if group is not None
                                               else dist.group.WORLD))
    return _Ring(dist.get_rank(group), dist.get_world_size(group), ranks, group)


# The backend whose point-to-point sends take each device type's tensors, as named in a
# message: gloo sends host memory only (a CUDA tensor handed to it failed inside gloo,
# "writev ... Bad address")
_P2P_BACKENDS = {"cuda": ("nccl", "the NCCL backend for CUDA tensors"),
                 "cpu": ("gloo", "the gloo backend for CPU tensors")}


def _check_backend(backend_config: str, device: torch.device, op: str) -> None:
    """Raise unless a group whose backends are ``backend_config`` (as
    ``dist.get_backend_config`` gives them: "cpu:gloo,cuda:gloo"; a bare name serves every
    device type) sends ``device``'s tensors point to point."""
    backends = dict(part.split(":", 1) if ":" in part else (device.type, part)
                    for part in backend_config.split(","))
    backend = backends.get(device.type)
    if backend is not None and not (backend == "gloo" and device.type != "cpu"):
        return
    has = (f"its backend for {device.type} tensors is gloo, which sends CPU tensors only"
           if backend else f"it has no backend for {device.type} tensors (its backends: "
                           f"{backend_config})")
    if device.type in _P2P_BACKENDS:
        name, what = _P2P_BACKENDS[device.type]
        use = (f"a group with {what} (init_process_group(\"{name}\") or "
               f"new_group(backend=\"{name}\"))")
    else:
        use = (f"a group whose backend sends {device.type} tensors (NCCL for CUDA tensors, "
               f"gloo for CPU tensors)")
    raise RuntimeError(f"{op}: q, k and v are on {device}, but the process group cannot send "
                       f"them: {has}; use {use}")


def _exchange(ring: _Ring, send: Sequence[Tensor], recv: Sequence[Tensor]) -> list:
    """Send ``send`` to the next rank and receive ``recv`` from the previous one,
    asynchronously; returns the requests to wait on."""
    ops = [dist.P2POp(dist.isend, t, ring.next, ring.group) for t in send]
    ops += [dist.P2POp(dist.irecv, t, ring.prev, ring.group) for t in recv]
    return dist.batch_isend_irecv(ops)


def _wait(reqs: list) -> None:
    for req in reqs:
        req.wait()


# --- the layout -----------------------------------------------------------------------------


def _chunk_len(S: int, W: int, op: str, what: str) -> int:
    if S % (2 * W):
        raise ValueError(
            f"{op}: the {what} ({S}) must be divisible into 2 * world_size = {2 * W} equal "
            f"chunks (the zigzag layout: rank r holds chunks r and {2 * W - 1} - r); pad the "
            f"sequence to a multiple of {2 * W}")
    return S // (2 * W)


def _check_dim(x: Tensor, dim: int, op: str) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{op}: dim={dim} is out of range for a tensor of shape "
                         f"{tuple(x.shape)}")
    return dim % x.dim()


def shard_sequence(x: Tensor, group: Optional[dist.ProcessGroup] = None, dim: int = 1
                   ) -> Tensor:
    """This rank's shard of the full sequence ``x`` (the same on every rank), in the zigzag
    layout :func:`ring_attention` expects: with W ranks, dimension ``dim`` (S tokens) is cut
    into 2W chunks of S / (2W); rank r gets chunks r and 2W-1-r, concatenated (S / W tokens).
    Differentiable (the gradient of ``x`` is nonzero on this rank's chunks only).

    Raises ValueError if S is not a multiple of 2W."""
    op = "flashop.distributed.shard_sequence"
    ring = _ring(group, op)
    dim = _check_dim(x, dim, op)
    C = _chunk_len(x.shape[dim], ring.size, op, f"sequence length (dim {dim})")
    r, W = ring.rank, ring.size
    return torch.cat([x.narrow(dim, r * C, C), x.narrow(dim, (2 * W - 1 - r) * C, C)], dim)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ring, dim):
        ctx.ring, ctx.dim = ring, dim
        shards = [torch.empty_like(x, memory_format=torch.contiguous_format)
                  for _ in range(ring.size)]
        dist.all_gather(shards, x.contiguous(), group=ring.group)
        C = x.shape[dim] // 2
        firsts = [s.narrow(dim, 0, C) for s in shards]
        seconds = [s.narrow(dim, C, C) for s in reversed(shards)]
        return torch.cat(firsts + seconds, dim)

    @staticmethod
    def backward(ctx, grad):
        r, W, dim = ctx.ring.rank, ctx.ring.size, ctx.dim
        C = grad.shape[dim] // (2 * W)
        return (torch.cat([grad.narrow(dim, r * C, C),
                           grad.narrow(dim, (2 * W - 1 - r) * C, C)], dim), None, None)


def gather_sequence(x: Tensor, group: Optional[dist.ProcessGroup] = None, dim: int = 1
                    ) -> Tensor:
    """The full sequence from every rank's zigzag shard ``x`` (the inverse of
    :func:`shard_sequence`; an all-gather). Every rank gets the whole tensor.

    Differentiable: the backward returns this rank's shard of the incoming gradient (no
    communication), which is the gradient when every rank computes the same loss from the
    gathered tensor. Where ranks compute different losses from it, all-reduce (sum) the
    gradient first.

    Raises ValueError if the shard's length along ``dim`` is odd."""
    op = "flashop.distributed.gather_sequence"
    ring = _ring(group, op)
    dim = _check_dim(x, dim, op)
    if x.shape[dim] % 2:
        raise ValueError(
            f"{op}: a zigzag shard holds two equal chunks, so its length along dim {dim} must "
            f"be even, got shape {tuple(x.shape)}; pass what shard_sequence returned")
    return _Gather.apply(x, ring, dim)


# --- which kernel calls one ring step makes -------------------------------------------------


@dataclass(frozen=True)
class _Call:
    """One kernel call: queries ``q[:, q0:q1]`` of this rank's shard against keys
    ``k[:, k0:k1]`` of the shard in hand, with the kernels' bottom-right-aligned masks."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool = False
    window: tuple = (-1, -1)
    # ALiBi: "native" passes the slopes to the kernel (query and key ranges end at the same
    # global position, so the kernel's distances are the global ones); "bias" adds
    # -slope * |i - j| as a float attn_mask from the ranges' global starts (qg, kg)
    alibi: Optional[str] = None
    qg: int = 0
    kg: int = 0


def _chunks(rank: int, W: int, C: int) -> tuple:
    """(local offset, global start) of the two chunks of ``rank``'s shard."""
    return (0, rank * C), (C, (2 * W - 1 - rank) * C)


def _pair_call(q_chunk, k_chunk, C: int, left: float, right: float,
               alibi: bool) -> Optional[_Call]:
    """The call for one query chunk against one key chunk (C tokens each, global starts
    a and b) under the global band ``i - left <= j <= i + right`` (math.inf: unbounded), or
    None where no pair is visible.

    The slices keep only queries that see a key and keys that a query sees. For the
    slices [q_lo, q_hi) and [k_lo, k_hi), the kernel (queries aligned to the keys' end:
    row i'' sits at key column i'' + (S_k - S_q)) keeps ``i'' + d - left' <= j'' <= i'' + d +
    right'`` with d = S_k - S_q; in global positions that is the band with ``left' = left +
    t`` and ``right' = right - t`` for t = k_hi - q_hi, which are >= 0 for these slices."""
    (qo, a), (ko, b) = q_chunk, k_chunk
    q_lo, q_hi = max(a, b - right), min(a + C, b + C + left)
    k_lo, k_hi = max(b, a - left), min(b + C, a + C + right)
    if q_lo >= q_hi or k_lo >= k_hi:
        return None
    q_lo, q_hi, k_lo, k_hi = int(q_lo), int(q_hi), int(k_lo), int(k_hi)
    t = k_hi - q_hi
    n_q, n_k = q_hi - q_lo, k_hi - k_lo
    wl, wr = left + t, right - t
    assert wl >= 0 and wr >= 0, (q_chunk, k_chunk, C, left, right)
    wl = -1 if wl >= n_k - 1 else int(wl)  # a bound that cuts nothing is no bound
    wr = -1 if wr >= n_q - 1 else int(wr)
    causal = wr == 0
    mode = None if not alibi else ("native" if t == 0 else "bias")
    return _Call(qo + q_lo - a, qo + q_hi - a, ko + k_lo - b, ko + k_hi - b, causal,
                 (wl, -1 if causal else wr), mode, q_lo, k_lo)


def _plan(rank: int, src: int, W: int, C: int, causal: bool, window: tuple,
          alibi: bool) -> list:
    """The calls of the ring step where ``rank`` holds ``src``'s key/value shard."""
    left, right = window
    if W == 1:  # the whole sequence: one call as the caller made it
        return [_Call(0, 2 * C, 0, 2 * C, causal, tuple(window),
                      "native" if alibi else None)]
    if window == (-1, -1) and not alibi:
        if not causal:
            return [_Call(0, 2 * C, 0, 2 * C)]
        if src == rank:  # the shard's chunks in global order: causal within it
            return [_Call(0, 2 * C, 0, 2 * C, causal=True)]
        if src < rank:  # src's first chunk precedes both query chunks; its second follows
            return [_Call(0, 2 * C, 0, C)]
        return [_Call(C, 2 * C, 0, 2 * C)]  # only the second query chunk sees src, all of it
    left = math.inf if left == -1 else left
    right = 0 if causal else (math.inf if right == -1 else right)
    calls = (_pair_call(qc, kc, C, left, right, alibi)
             for qc in _chunks(rank, W, C) for kc in _chunks(src, W, C))
    return [c for c in calls if c is not None]


def _alibi_bias(call: _Call, slopes: Tensor) -> Tensor:
    """-slope * |i - j| over the call's global query and key positions, (B or 1, H, n_q, n_k)
    float32: the ALiBi term where the kernel's own distances are not the global ones."""
    i = torch.arange(call.qg, call.qg + call.q1 - call.q0, device=slopes.device)
    j = torch.arange(call.kg, call.kg + call.k1 - call.k0, device=slopes.device)
    dist_ij = (i[:, None] - j[None, :]).abs().to(torch.float32)
    s = slopes if slopes.dim() == 2 else slopes[None]
    return -s[:, :, None, None] * dist_ij


def _call_args(call: _Call, alibi_slopes: Optional[Tensor]) -> tuple:
    """(attn_mask, alibi_slopes, keyword options) of one call."""
    mask, slopes = None, None
    if call.alibi == "native":
        slopes = alibi_slopes
    elif call.alibi == "bias":
        mask = _alibi_bias(call, alibi_slopes)
    left, right = call.window
    return mask, slopes, dict(causal=call.causal, window_size_left=left,
                              window_size_right=right)


# --- the ring -------------------------------------------------------------------------------


def _merge(out_acc: Tensor, lse_acc: Tensor, out: Tensor, lse_log2: Tensor) -> None:
    """Merge one call's (out, lse_log2) into the fp32 accumulators (views of the rows it
    covers), in place. Rows that attend no key yet have lse -inf."""
    lse_new = torch.logaddexp2(lse_acc, lse_log2)
    ref = lse_new.masked_fill(lse_new == -math.inf, 0.0)  # rows with no key: both weights 0
    w_acc = torch.exp2(lse_acc - ref).transpose(1, 2).unsqueeze(-1)
    w_out = torch.exp2(lse_log2 - ref).transpose(1, 2).unsqueeze(-1)
    out_acc.mul_(w_acc).add_(out.to(torch.float32) * w_out)
    lse_acc.copy_(lse_new)


def _forward(ring: _Ring, q, k, v, causal, scale, window, softcap, alibi_slopes):
    """(out, lse, lse_log2) of this rank's queries against the whole sequence."""
    B, S, H, _ = q.shape
    C, W = S // 2, ring.size
    out_acc = q.new_zeros((B, S, H, v.shape[3]), dtype=torch.float32)
    lse_acc = q.new_full((B, H, S), -math.inf, dtype=torch.float32)
    k_cur, v_cur = k, v
    for step in range(W):
        reqs = []
        if step + 1 < W:  # the next shard travels while this one is attended
            k_next, v_next = torch.empty_like(k_cur), torch.empty_like(v_cur)
            reqs = _exchange(ring, (k_cur, v_cur), (k_next, v_next))
        src = (ring.rank - step) % W
        for call in _plan(ring.rank, src, W, C, causal, window, alibi_slopes is not None):
            mask, slopes, kw = _call_args(call, alibi_slopes)
            out, _, lse_log2 = torch.ops.flashop.attention_forward(
                q[:, call.q0:call.q1], k_cur[:, call.k0:call.k1], v_cur[:, call.k0:call.k1],
                attn_mask=mask, alibi_slopes=slopes, scale=scale, softcap=softcap, **kw)
            _merge(out_acc[:, call.q0:call.q1], lse_acc[:, :, call.q0:call.q1], out,
                   lse_log2)
        _wait(reqs)
        if reqs:
            k_cur, v_cur = k_next, v_next
    return out_acc.to(q.dtype), lse_acc * _LN2, lse_acc


def _backward(ring: _Ring, dout, dlse, q, k, v, out, lse_log2, causal, scale, window, softcap,
              alibi_slopes):
    """(dq, dk, dv): each call's share through the kernels' backward with the merged out and
    lse; dK/dV accumulate in fp32 and travel with their key/value shard."""
    S, W = q.shape[1], ring.size
    C = S // 2
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    k_cur, v_cur = k, v
    dkv_reqs, dkv_in = [], None
    for step in range(W):
        kv_reqs = []
        if step + 1 < W:
            k_next, v_next = torch.empty_like(k_cur), torch.empty_like(v_cur)
            kv_reqs = _exchange(ring, (k_cur, v_cur), (k_next, v_next))
        src = (ring.rank - step) % W
        parts = []
        for call in _plan(ring.rank, src, W, C, causal, window, alibi_slopes is not None):
            mask, slopes, kw = _call_args(call, alibi_slopes)
            rows = slice(call.q0, call.q1)
            dq, dk, dv, _, _ = torch.ops.flashop.attention_backward(
                dout[:, rows], dlse[:, :, rows].contiguous(), q[:, rows],
                k_cur[:, call.k0:call.k1], v_cur[:, call.k0:call.k1], out[:, rows],
                lse_log2[:, :, rows].contiguous(), attn_mask=mask, alibi_slopes=slopes,
                scale=scale, softcap=softcap, **kw)
            dq_acc[:, rows] += dq
            parts.append((call, dk, dv))
        # src's accumulators arrive from the previous rank (which added its share last step)
        _wait(dkv_reqs)
        if dkv_in is None:
            dk_acc = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv_acc = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        else:
            dk_acc, dv_acc = dkv_in
        for call, dk, dv in parts:
            dk_acc[:, call.k0:call.k1] += dk
            dv_acc[:, call.k0:call.k1] += dv
        # after the last step the next rank gets its own (complete) accumulators
        dkv_in = torch.empty_like(dk_acc), torch.empty_like(dv_acc)
        dkv_reqs = _exchange(ring, (dk_acc, dv_acc), dkv_in)
        _wait(kv_reqs)
        if kv_reqs:
            k_cur, v_cur = k_next, v_next
    _wait(dkv_reqs)
    dk_acc, dv_acc = dkv_in
    return dq_acc.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, causal, scale, window, softcap, alibi_slopes):
        if ring.size == 1:  # the whole sequence on one rank: the kernels' own results
            out, lse, lse_log2 = torch.ops.flashop.attention_forward(
                q, k, v, alibi_slopes=alibi_slopes, causal=causal, scale=scale,
                window_size_left=window[0], window_size_right=window[1], softcap=softcap)
        else:
            out, lse, lse_log2 = _forward(ring, q, k, v, causal, scale, window, softcap,
                                          alibi_slopes)
        ctx.save_for_backward(q, k, v, out, lse_log2, alibi_slopes)
        ctx.args = (ring, causal, scale, window, softcap)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse_log2, alibi_slopes = ctx.saved_tensors
        ring, causal, scale, window, softcap = ctx.args
        dout = dout.to(q.dtype)
        if ring.size == 1:
            dq, dk, dv, _, _ = torch.ops.flashop.attention_backward(
                dout, dlse, q, k, v, out, lse_log2, alibi_slopes=alibi_slopes, causal=causal,
                scale=scale, window_size_left=window[0], window_size_right=window[1],
                softcap=softcap)
        else:
            dq, dk, dv = _backward(ring, dout, dlse, q, k, v, out, lse_log2, causal, scale,
                                   window, softcap, alibi_slopes)
        return dq, dk, dv, None, None, None, None, None, None


def ring_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, *,
                            group: Optional[dist.ProcessGroup] = None, causal: bool = False,
                            scale: Optional[float] = None,
                            window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                            alibi_slopes: Optional[Tensor] = None,
                            attention_chunk: int = 0) -> tuple:
    """As :func:`ring_attention`, also returning this rank's rows of the log-sum-exp,
    (B, H, S / W) float32 in natural-log units (as :func:`flashop.attention_with_lse`);
    both outputs are differentiable."""
    op = "flashop.distributed.ring_attention"
    ring = _ring(group, op)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be a 4-D shard (batch, seqlen / world_size, "
                             f"heads, head_dim), got shape {tuple(t.shape)}")
    if not q.shape[1] == k.shape[1] == v.shape[1]:
        raise ValueError(
            f"{op}: q, k and v shards must have the same length (dim 1), got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; ring attention is "
            f"self-attention over one sequence sharded with flashop.distributed.shard_sequence")
    if ring.size > 1 and q.shape[1] % 2:
        raise ValueError(
            f"{op}: a zigzag shard holds two equal chunks, so its length (dim 1) must be even, "
            f"got q {tuple(q.shape)}; shard a sequence of a multiple of 2 * world_size = "
            f"{2 * ring.size} tokens with flashop.distributed.shard_sequence")
    window = window_bounds(op, window_size)
    check_attention_chunk(op, attention_chunk)
    if attention_chunk:
        raise ValueError(
            f"{op}: attention_chunk={attention_chunk} is not supported: ring attention's calls "
            f"see blocks of the zigzag layout, not the whole sequence's chunk boundaries; run "
            f"chunked layers with flashop.attention(..., attention_chunk=...) on sequences "
            f"split at chunk boundaries (each chunk attends only itself, so no ring is needed)")
    check_attention_inputs(q, k, v, scale,
                           modifiers(None, alibi_slopes, None, causal, *window, softcap),
                           op=op)
    _check_backend(dist.get_backend_config(group), q.device, op)
    if alibi_slopes is not None and alibi_slopes.requires_grad:
        raise RuntimeError(f"{op}: alibi_slopes get no gradient (as in FlashAttention); "
                           f"detach them")
    if ring.size > 1:
        k, v = k.contiguous(), v.contiguous()  # they are sent as they are
    return _RingAttention.apply(q, k, v, ring, bool(causal), scale, window, float(softcap),
                                alibi_slopes)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group: Optional[dist.ProcessGroup] = None,
                   causal: bool = False, scale: Optional[float] = None,
                   window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                   alibi_slopes: Optional[Tensor] = None, attention_chunk: int = 0) -> Tensor:
    """Attention of this rank's query shard to the whole sequence, whose key/value shards
    travel around the ring of the group's ranks; differentiable in q, k and v.

    Args:
        q: (B, S / W, H, D) this rank's query shard, in the zigzag layout of
            :func:`shard_sequence` (W = the group's size; S a multiple of 2W).
        k, v: (B, S / W, H_kv, D) and (B, S / W, H_kv, DV), the same rank's key/value
            shards (grouped-query attention as in :func:`flashop.attention`).
        group: the process group the sequence is split over (default: the world).
        causal, scale, window_size, softcap, alibi_slopes: as :func:`flashop.attention`, in
            the whole sequence's positions (query i attends key j iff j <= i under causal,
            and i - left <= j <= i + right under a window; ALiBi adds -slope * |i - j|).
        attention_chunk: 0 only; chunked attention raises (see ring_attention_with_lse).

    Returns:
        (B, S / W, H, DV), this rank's rows of the output, in the zigzag layout (the same
        values as :func:`flashop.attention` on the whole sequence, up to fp32 rounding of the
        merge; :func:`gather_sequence` puts them together).

    Every rank of the group must make the same call (the same shapes and options), in the
    same order as its other communication on the group.
    """
    return ring_attention_with_lse(q, k, v, group=group, causal=causal, scale=scale,
                                   window_size=window_size, softcap=softcap,
                                   alibi_slopes=alibi_slopes,
                                   attention_chunk=attention_chunk)[0]
