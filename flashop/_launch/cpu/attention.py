"""The CPU path of the attention operators: the forward (dense, packed, paged prefill, fp8)
and the backward (dense, packed), into the outputs the launchers allocate.

A dense call is one problem (dense.Problem); a packed one is one problem per sequence (the
offsets read on the host, which costs nothing on a CPU). Plain problems (no modifier but a
causal bound with S_q == S_k, no dropout, D == DV) take SDPA's CPU flash-attention kernels
(sdpa_serves); the rest run dense.forward and dense.backward.
"""

from __future__ import annotations

from typing import Optional

import torch

from flashop._launch import gates
from flashop._launch.common import unit_stride_last
from flashop._launch.cpu import dense, outside_autocast
from flashop._launch.cpu.bounds import Bounds
from flashop._launch.options import Modifiers, Packing
from flashop._launch.scores import LOG2E, sink_log2
from flashop.reference import dequantize, gather_kvcache


def sdpa_serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mods: Modifiers,
                offset: int, differentiable: bool = True) -> bool:
    """Whether SDPA's CPU flash-attention kernels compute this problem (forward, and
    backward where ``differentiable``): no modifier and no dropout, causal only where its
    top-left alignment is flashop's bottom-right one (``offset`` 0), one head dim, some
    queries and keys (none: a floating-point exception in torch 2.13), 16-bit inputs where a
    backward may follow. SDPA's backward recomputes P from the natural-log lse its forward
    rounded, which reaches it through lse_log2 and back, one fp32 rounding apart: where a
    row's probability sits on one key that moves P by |lse| * 2**-24, which fp32 gradients
    notice (16-bit ones do not)."""
    return (mods.is_plain and (not mods.causal or offset == 0)
            and q.dtype in ((torch.bfloat16, torch.float16) if differentiable
                            else (torch.float32, torch.bfloat16, torch.float16))
            and q.shape[-1] == v.shape[-1] and q.shape[1] > 0 and k.shape[1] > 0)


def _sdpa_layout(*tensors: torch.Tensor) -> list:
    """(B, S, H, D) tensors as SDPA's (B, H, S, D) views, their head dim of unit stride
    (torch<=2.13: the CPU flash-attention kernels read a strided head dim as contiguous)."""
    return [unit_stride_last(x).transpose(1, 2) for x in tensors]


def _sdpa_forward(q, k, v, scale: float, causal: bool):
    """(out (B, S_q, H, DV) in q's dtype, lse (B, H, S_q) fp32) by SDPA's CPU kernel."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *_sdpa_layout(q, k, v), 0.0, causal, scale=scale)
    return out.transpose(1, 2), lse


def _sdpa_backward(dout, dlse, q, k, v, out, lse_log2, scale: float, causal: bool,
                   grads: tuple) -> None:
    """The backward of a problem whose forward SDPA's kernels computed, by SDPA's backward
    kernel (which recomputes P as its forward rounded it), into ``grads`` (dq, dk, dv).
    An lse cotangent adds dS = P dlse: a second call with zero values, ``dout`` a unit
    vector e and ``out`` = -dlse e gives dS = P (dout . v - dout . out) = P dlse."""
    lse = (lse_log2.double() / LOG2E).float()
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    parts = backward(*_sdpa_layout(dout, q, k, v, out), lse, 0.0, causal, scale=scale)
    if bool(dlse.any()):
        e = torch.zeros_like(q)
        e[..., 0] = 1.0
        rows = -dlse.transpose(1, 2)[..., None].to(q.dtype) * e  # (B, S_q, H, D)
        extra = backward(*_sdpa_layout(e, q, k, torch.zeros_like(k), rows), lse, 0.0,
                         causal, scale=scale)
        parts = (parts[0] + extra[0], parts[1] + extra[1], parts[2])
    for x, d in zip(grads, parts):
        x.copy_(d.transpose(1, 2))


def _gate_rows(g: Optional[torch.Tensor], packing: Optional[Packing], rows: tuple):
    """The gate as the kernels read it: the keys' cumulative sums (B, H, S_k) or (H,
    total_k), and the queries' G_i in lse's layout ``rows``; (None, None) without a gate."""
    if g is None:
        return None, None
    return gates.gate_cumsum(g, packing)[0], gates.query_gates(g, rows, packing)


def problem(q, k, v, scale: float, mods: Modifiers, offset: int, batch: torch.Tensor,
            alibi: Optional[torch.Tensor] = None, g_cum: Optional[torch.Tensor] = None,
            attn_mask: Optional[torch.Tensor] = None) -> dense.Problem:
    """The dense problem of q (B, S_q, H, D), k, v (B, S_k, H_kv, .) with ``mods``' bounds,
    softcap and dropout, query i at key position i + ``offset``; ``batch`` the batch
    indices of dropout's draws, ``alibi`` (B or 1, H) slopes, ``g_cum`` (B, H, S_k) the
    keys' cumulative gates, ``attn_mask`` broadcastable to (B, H, S_q, S_k)."""
    H_kv = k.shape[2]
    G = q.shape[2] // H_kv
    left, right = mods.bounds
    seed = int(mods.dropout_seed.item()) if mods.dropout else 0
    # 16-bit queries hold the scores' scale (exact enough), fp32 ones are scaled per tile
    c = dense.Problem.product_scale(scale, mods.softcap)
    folded, tile_scale = (1.0, c) if q.dtype == torch.float32 else (c, 1.0)
    bounds = Bounds(offset, left, right, mods.attention_chunk)
    pb = dense.Problem(dense.rows(q, H_kv, folded), dense.rows(k, H_kv), dense.rows(v, H_kv),
                       scale, bounds, mods.softcap,
                       dropout_p=mods.dropout_p, seed=seed, batch=batch, folded=folded,
                       tile_scale=tile_scale)
    if alibi is not None:
        slopes = alibi.float().reshape(-1, H_kv, 1, G, 1)
        pb.alibi_log2 = slopes * -LOG2E
    if g_cum is not None:
        pb.gate_log2 = (g_cum * LOG2E).unflatten(1, (H_kv, G))[:, :, None]
    if attn_mask is not None:
        pb.attn_mask = _mask_rows(attn_mask, H_kv, G)
    return pb


def _mask_rows(attn_mask: torch.Tensor, H_kv: int, G: int) -> torch.Tensor:
    """``attn_mask`` (2 to 4 dims, broadcastable to (B, H, S_q, S_k)) as a rows view (B or
    1, H_kv or 1, S_q or 1, G or 1, S_k or 1)."""
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    m = m.unflatten(1, (H_kv, G)) if m.shape[1] > 1 else m.unsqueeze(1)
    return m.transpose(2, 3)


def _from_rows(x: torch.Tensor) -> torch.Tensor:
    """fp32 rows (B, H_kv, S, G, D) as (B, S, H, D) (a view)."""
    return x.transpose(1, 2).flatten(2, 3)


def _row_lse(x: torch.Tensor) -> torch.Tensor:
    """Per-row values (B, H_kv, S, G) as (B, H, S) (a view)."""
    return x.transpose(2, 3).flatten(1, 2)


def forward_problem(q, k, v, scale: float, mods: Modifiers, out, lse, lse_log2, offset: int,
                    batch: torch.Tensor, alibi=None, g_cum=None, g_q=None, attn_mask=None,
                    differentiable: bool = True) -> None:
    """One dense problem's forward, written into out (B, S_q, H, DV), lse and lse_log2
    (B, H, S_q); ``differentiable``: a backward may follow (backward_problem)."""
    if sdpa_serves(q, k, v, mods, offset, differentiable):
        o, lse_nat = _sdpa_forward(q, k, v, scale, mods.causal)
        out.copy_(o)
        lse.copy_(lse_nat)
        lse_log2.copy_(lse_nat.double() * LOG2E)
        return
    pb = problem(q, k, v, scale, mods, offset, batch, alibi, g_cum, attn_mask)
    o, l2 = dense.forward(pb, _sink_rows(mods.sinks, g_q, q, k.shape[2]))
    out.copy_(_from_rows(o))
    l2 = _row_lse(l2)
    lse_log2.copy_(l2)
    lse.copy_(l2 * dense.LN2 if g_q is None else l2 * dense.LN2 + g_q)


def _sink_rows(sinks: Optional[torch.Tensor], g_q: Optional[torch.Tensor], q: torch.Tensor,
               H_kv: int) -> Optional[torch.Tensor]:
    """The sinks in the forward's frame of base-2 scores (scores.sink_log2), as rows of q's
    (B, H_kv, S_q, G); None without sinks."""
    if sinks is None:
        return None
    frame = sink_log2(sinks, g_q)  # (H, 1), or (B, H, S_q) with a gate
    return dense.row_values(frame.expand(q.shape[0], q.shape[2], q.shape[1]), H_kv)


def _dequantized(q, k, v, descales: Optional[tuple], b: Optional[int] = None) -> tuple:
    """e4m3 q, k, v (B, S, H, D) times their descales (B, H_kv) in fp32 (``b``: the rows of
    sequence b of a packed batch, whose descale row is b)."""
    descales = descales or (None, None, None)
    if b is not None:
        descales = tuple(None if d is None else d[b:b + 1] for d in descales)
    return tuple(dequantize(x, d, torch.float32) for x, d in zip((q, k, v), descales))


@outside_autocast
def attention_forward(q, k, v, scale: float, mods: Modifiers, packing: Optional[Packing],
                      descales: Optional[tuple], outputs: tuple) -> tuple:
    """The forward of a dense or packed call (paged where packing has a block table; e4m3
    inputs dequantized with ``descales``; both forward-only), written into ``outputs``
    (out, lse, lse_log2, as launch.attention_forward_outputs allocates them)."""
    out, lse, lse_log2 = outputs
    fp8 = q.dtype == torch.float8_e4m3fn
    if packing is None:
        B, S_q, H, _ = q.shape
        if fp8:
            q, k, v = _dequantized(q, k, v, descales)
        g_cum, g_q = _gate_rows(mods.g, None, (B, H, S_q))
        forward_problem(q, k, v, scale, mods, out, lse, lse_log2, k.shape[1] - S_q,
                        torch.arange(B), mods.alibi_slopes, g_cum, g_q, mods.attn_mask,
                        differentiable=not fp8)
        return out, lse, lse_log2
    paged = packing.block_table is not None
    g_cum, g_q = _gate_rows(mods.g, packing, lse.shape)
    for b, (qs, ks) in enumerate(sequences(packing)):
        if paged:
            kb, vb = (gather_kvcache(x, ks.stop - ks.start, b, block_table=packing.block_table)
                      for x in (k, v))
        else:
            kb, vb = k[ks], v[ks]
        qb, kb, vb = q[qs][None], kb[None], vb[None]
        if fp8:
            qb, kb, vb = _dequantized(qb, kb, vb, descales, b)
        forward_problem(qb, kb, vb, scale, mods, out[qs][None], lse[:, qs][None],
                        lse_log2[:, qs][None], kb.shape[1] - qb.shape[1], torch.tensor([b]),
                        slopes_row(mods.alibi_slopes, b),
                        None if g_cum is None else g_cum[None, :, ks],
                        None if g_q is None else g_q[None, :, qs],
                        differentiable=not (fp8 or paged))
    return out, lse, lse_log2


def slopes_row(slopes: Optional[torch.Tensor], b: int) -> Optional[torch.Tensor]:
    """Sequence b's ALiBi slopes: (H,) as they are, row b of (batch, H)."""
    return slopes[b:b + 1] if slopes is not None and slopes.dim() == 2 else slopes


def sequences(packing: Packing):
    """Each packed sequence's (query slice, key slice) of the tokens."""
    cu_q, cu_k = packing.cu_seqlens_q.tolist(), packing.cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        yield slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])


# --- backward ---------------------------------------------------------------------------------


def backward_problem(dout, dlse, q, k, v, out, lse_log2, scale: float, mods: Modifiers,
                     grads: tuple, offset: int, batch: torch.Tensor, alibi=None, g_cum=None,
                     attn_mask=None, mask_grad: bool = False):
    """One dense problem's backward: dq, dk, dv written into ``grads``' first three (B, S,
    H, .); returns the gate's halves (B, H, S_q), (B, H, S_k) (None without a gate) and
    the mask's gradient in the mask's shape (None without)."""
    dq, dk, dv = grads
    if sdpa_serves(q, k, v, mods, offset):
        _sdpa_backward(dout, dlse, q, k, v, out, lse_log2, scale, mods.causal, grads)
        return None, None, None
    H_kv = k.shape[2]
    pb = problem(q, k, v, scale, mods, offset, batch, alibi, g_cum, attn_mask)
    mask_shape = None
    if mask_grad:
        mask_shape = _mask_rows(attn_mask, H_kv, q.shape[2] // H_kv).shape
    g = dense.backward(pb, dense.rows(out, H_kv), dense.rows(dout, H_kv),
                       dense.row_values(lse_log2, H_kv), dense.row_values(dlse, H_kv),
                       gate=g_cum is not None, mask_shape=mask_shape)
    for x, d in zip((dq, dk, dv), (g.dq, g.dk, g.dv)):
        x.copy_(_from_rows(d))
    dg_q = dg_k = dmask = None
    if g_cum is not None:
        dg_q, dg_k = _row_lse(g.dg_q), _row_lse(g.dg_k)
    if mask_grad:
        dmask = g.dmask.transpose(2, 3).flatten(1, 2).reshape(attn_mask.shape)
    return dg_q, dg_k, dmask


@outside_autocast
def attention_backward(dout, dlse, q, k, v, out, lse_log2, scale: float, mods: Modifiers,
                       attn_mask_grad: bool, packing: Optional[Packing],
                       grads: tuple) -> tuple:
    """The backward of a dense or packed call from the CPU forward's out and lse_log2,
    written into ``grads`` (dq, dk, dv, dg, dattn_mask, as
    launch.attention_backward_outputs allocates them)."""
    dq, dk, dv, dg, dmask = grads
    if packing is None:
        B, S_q, H, _ = q.shape
        g_cum, _ = _gate_rows(mods.g, None, (B, H, S_q))
        dg_q, dg_k, dm = backward_problem(dout, dlse, q, k, v, out, lse_log2, scale, mods,
                                          (dq, dk, dv), k.shape[1] - S_q, torch.arange(B),
                                          mods.alibi_slopes, g_cum, mods.attn_mask,
                                          attn_mask_grad)
        if dg_q is not None:
            dg.copy_(gates.gate_grad(dg_q, dg_k, None))
        if dm is not None:
            dmask.copy_(dm)
        return dq, dk, dv, dg, dmask
    H = q.shape[1]
    g_cum, _ = _gate_rows(mods.g, packing, lse_log2.shape)
    dq.zero_()
    dk.zero_()
    dv.zero_()
    dg_q = dg_k = None
    if g_cum is not None:
        dg_q, dg_k = lse_log2.new_zeros((H, q.shape[0])), lse_log2.new_zeros((H, k.shape[0]))
    for b, (qs, ks) in enumerate(sequences(packing)):
        parts = backward_problem(
            dout[qs][None], dlse[:, qs][None], q[qs][None], k[ks][None], v[ks][None],
            out[qs][None], lse_log2[:, qs][None], scale, mods,
            (dq[qs][None], dk[ks][None], dv[ks][None]),
            (ks.stop - ks.start) - (qs.stop - qs.start), torch.tensor([b]),
            slopes_row(mods.alibi_slopes, b), None if g_cum is None else g_cum[None, :, ks])
        if dg_q is not None:
            dg_q[:, qs], dg_k[:, ks] = parts[0][0], parts[1][0]
    if dg_q is not None:
        dg.copy_(gates.gate_grad(dg_q, dg_k, packing))
    return dq, dk, dv, dg, dmask

