"""The CPU path's attention over one dense problem (a batch, or one packed sequence or
cached sequence), blocked over keys: the forward's online softmax and the backward's
recomputation of P from the forward's base-2 lse, one tile of scores at a time.

Rows are kept as (B, H_kv, S, G, ...) in fp32 (G = H / H_kv), so that a tile of queries
of every head of a group is one matrix (tile rows x G) against its key/value head: one
product per tile, and dK, dV summed over the group by the product itself. Scores are in
base 2 (``s2 = s * log2 e``) as the kernels keep them, with the queries' gate left out
(it is added to the natural-log lse). 16-bit queries are stored times the scale in those
units (exact enough: a 16-bit value times an fp32 scale), so that a tile's product needs
no pass of its own; fp32 ones are scaled in each tile, as plain PyTorch rounds q k^T
before its scale. The gradients take their factors once at the end. The forward and the
backward compute every score with the same function on the same tiles, so that P
recomputed from lse_log2 rounds as the forward's did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

from flashop._launch.cpu import dropout
from flashop._launch.cpu.bounds import Bounds, key_tiles, tile_sizes
from flashop._launch.scores import LOG2E

LN2 = math.log(2.0)
_INF = float("inf")


def rows(x: torch.Tensor, H_kv: int, factor: float = 1.0) -> torch.Tensor:
    """(B, S, H, D) as fp32 rows (B, H_kv, S, G, D), contiguous, times ``factor``."""
    B, S, H, D = x.shape
    out = torch.empty((B, H_kv, S, H // H_kv, D), dtype=torch.float32)
    out.copy_(x.unflatten(2, (H_kv, H // H_kv)).transpose(1, 2))
    return out if factor == 1.0 else out.mul_(factor)


def row_values(x: torch.Tensor, H_kv: int) -> torch.Tensor:
    """Per-row values (B, H, S) as (B, H_kv, S, G), fp32 (a view where x is fp32)."""
    return x.float().unflatten(1, (H_kv, x.shape[1] // H_kv)).transpose(2, 3)


def cut(x: Optional[torch.Tensor], index: tuple) -> Optional[torch.Tensor]:
    """``x`` (rows, its first two dims the batch and the key/value heads, each full or 1)
    at ``index`` (a part's batch and head slices), a broadcast dim kept whole."""
    if x is None:
        return None
    return x[tuple(i if n > 1 else slice(None) for i, n in zip(index, x.shape))]


@dataclass
class Problem:
    """One dense attention problem on the CPU, as the kernels see a call: q (B, S_q, H, D),
    k (B, S_k, H_kv, D), v (B, S_k, H_kv, DV) as fp32 rows, and the score modifiers in the
    frame of base-2 scores: ``x = c q k^T`` with ``c = scale * log2 e``, or ``softcap *
    log2 e * tanh(x)`` with ``c = scale / softcap``. q is stored times ``folded`` and each
    tile's product multiplied by ``tile_scale``: c and 1, or 1 and c (fp32 inputs)."""

    q: torch.Tensor  # (B, H_kv, S_q, G, D) fp32, times ``folded``
    k: torch.Tensor  # (B, H_kv, S_k, 1, D) fp32
    v: torch.Tensor  # (B, H_kv, S_k, 1, DV) fp32
    scale: float
    bounds: Bounds
    softcap: float = 0.0
    alibi_log2: Optional[torch.Tensor] = None  # -slope * log2 e, (B or 1, H_kv, 1, G, 1)
    gate_log2: Optional[torch.Tensor] = None  # the keys' g_cum * log2 e, (B, H_kv, 1, G, S_k)
    attn_mask: Optional[torch.Tensor] = None  # a view (B or 1, ., S_q or 1, ., S_k or 1)
    dropout_p: float = 0.0
    seed: int = 0
    batch: Optional[torch.Tensor] = None  # (B,) the draws' batch indices, with dropout
    folded: float = 1.0  # the factor q is stored with
    tile_scale: float = 1.0  # the factor of each tile's product of the stored q
    head0: int = 0  # the first query head's index (dropout's draws), in a part

    @staticmethod
    def product_scale(scale: float, softcap: float) -> float:
        """``c``: the factor of q k^T in the scores (in the softcap's tanh under one)."""
        return scale / softcap if softcap > 0 else scale * LOG2E

    @property
    def grad_scale(self) -> float:
        """dL/dx of x = c q k^T is ``grad_scale`` times the backward's dS (natural-log
        units; times 1 - tanh^2 under a softcap): ln 2 from base 2, or the softcap."""
        return self.softcap if self.softcap > 0 else LN2

    @property
    def shape(self) -> tuple:
        B, H_kv, S_q, G, D = self.q.shape
        return B, H_kv, G, S_q, self.k.shape[2], D, self.v.shape[-1]

    def parts(self):
        """(part, its (batch, key/value head) index into rows, M, N): the problem cut
        into parts of a few (batch entry, key/value head) pairs each, whose tiles of M
        queries and N keys (bounds.tile_sizes) hold about TILE_ELEMENTS scores."""
        B, H_kv, G, S_q, S_k, _, _ = self.shape
        M, N, pairs = tile_sizes(G, S_q, S_k, self.bounds.bounded)
        if pairs >= H_kv:
            step = pairs // H_kv
            cuts = [(b, min(b + step, B), 0, H_kv) for b in range(0, B, step)]
        else:
            cuts = [(b, b + 1, h, min(h + pairs, H_kv)) for b in range(B)
                    for h in range(0, H_kv, pairs)]
        for b0, b1, h0, h1 in cuts:
            index = (slice(b0, b1), slice(h0, h1))
            yield replace(
                self, q=self.q[index], k=self.k[index], v=self.v[index],
                alibi_log2=cut(self.alibi_log2, index), gate_log2=cut(self.gate_log2, index),
                attn_mask=cut(self.attn_mask, index),
                batch=None if self.batch is None else self.batch[b0:b1],
                head0=self.head0 + h0 * G), index, M, N

    def scores(self, i0: int, i1: int, j0: int, j1: int):
        """The base-2 scores of queries [i0, i1) and keys [j0, j1), (B, H_kv, M, G, N)
        fp32, -inf where masked; and tanh of the softcap's argument (None without)."""
        B, H_kv, G, _, _, D, _ = self.shape
        q = self.q[:, :, i0:i1].reshape(B, H_kv, (i1 - i0) * G, D)
        k = self.k[:, :, j0:j1, 0]
        s = torch.matmul(q, k.transpose(-1, -2)).view(B, H_kv, i1 - i0, G, j1 - j0)
        if self.tile_scale != 1.0:
            s.mul_(self.tile_scale)
        t = None
        if self.softcap > 0:
            t = s.tanh_()
            s = t * (self.softcap * LOG2E)
        if self.alibi_log2 is not None:
            p = torch.arange(i0, i1) + self.bounds.offset
            distance = (p[:, None] - torch.arange(j0, j1)[None, :]).abs().float()
            s.addcmul_(distance[:, None, :], self.alibi_log2)
        if self.gate_log2 is not None:
            s.sub_(self.gate_log2[..., j0:j1])
        if self.attn_mask is not None:
            tile = rows_tile(self.attn_mask, i0, i1, j0, j1)
            if tile.dtype == torch.bool:
                s.masked_fill_(~tile, -_INF)
            else:
                s.add_(tile.float() * LOG2E)
        keep = self.bounds.keep(i0, i1, j0, j1)
        if keep is not None:
            s.masked_fill_(~keep[:, None, :], -_INF)
        return s, t

    def keep_scale(self, i0: int, i1: int, j0: int, j1: int) -> Optional[torch.Tensor]:
        """Dropout's Z of the tile, keep / (1 - p), (B, H_kv, M, G, N); None without."""
        if self.dropout_p == 0:
            return None
        _, H_kv, G, _, _, _, _ = self.shape
        heads = torch.arange(self.head0, self.head0 + H_kv * G)
        keep = dropout.keep(self.seed, self.batch, heads, i0, i1, j0, j1, self.dropout_p)
        z = keep.unflatten(1, (H_kv, G)).permute(0, 1, 3, 2, 4)
        return z * (1.0 / (1.0 - self.dropout_p))


def forward(pb: Problem, sink_log2: Optional[torch.Tensor] = None):
    """(out, lse_log2) of the problem, out as fp32 rows (B, H_kv, S_q, G, DV), lse_log2 as
    (B, H_kv, S_q, G), base 2 without the queries' gate; ``sink_log2`` (rows, broadcast to
    lse_log2's): the sinks in that frame. Rows that attend nothing get out 0 and lse_log2
    -inf (the sink with sinks)."""
    B, H_kv, G, S_q, S_k, D, DV = pb.shape
    out = torch.zeros((B, H_kv, S_q, G, DV))
    lse_log2 = torch.full((B, H_kv, S_q, G), -_INF)
    if sink_log2 is not None:
        sink_log2 = sink_log2.expand(B, H_kv, S_q, G)
    for part, index, M, N in pb.parts():
        for i0 in range(0, S_q, M):
            i1 = min(i0 + M, S_q)
            sink = None if sink_log2 is None else sink_log2[index][:, :, i0:i1]
            _forward_rows(part, sink, out[index][:, :, i0:i1], lse_log2[index][:, :, i0:i1],
                          i0, i1, N)
    return out, lse_log2


def _forward_rows(pb: Problem, sink: Optional[torch.Tensor], out: torch.Tensor,
                  lse_log2: torch.Tensor, i0: int, i1: int, N: int) -> None:
    """The forward of queries [i0, i1) of a part, over key tiles of N, into its rows of
    ``out`` and ``lse_log2``: the online softmax, its running max and sum started at the
    sink (whose exp2 is 1 at its own max) where there is one."""
    B, H_kv, G, _, S_k, _, DV = pb.shape
    rows = (B, H_kv, i1 - i0, G)
    if sink is None:
        m, l_sum = torch.full(rows, -_INF), torch.zeros(rows)
    else:
        m, l_sum = sink.clone(), torch.ones(rows)
    acc = out.view(B, H_kv, (i1 - i0) * G, DV)
    for j0, j1 in key_tiles(pb.bounds, i0, i1, S_k, N):
        s, _ = pb.scores(i0, i1, j0, j1)
        m_new = torch.maximum(m, s.amax(-1))
        shift = m_new.nan_to_num(neginf=0.0)  # rows with nothing yet: 0, not -inf
        p = s.sub_(shift[..., None]).exp2_()
        alpha = (m - shift).exp2_()
        l_sum.mul_(alpha).add_(p.sum(-1))
        z = pb.keep_scale(i0, i1, j0, j1)
        if z is not None:
            p.mul_(z)
        out.mul_(alpha[..., None])
        acc.add_(torch.matmul(p.view(B, H_kv, (i1 - i0) * G, j1 - j0), pb.v[:, :, j0:j1, 0]))
        m = m_new
    attended = l_sum > 0
    out.div_(torch.where(attended, l_sum, 1.0)[..., None])
    lse_log2.copy_(torch.where(attended, m + l_sum.log2(), -_INF))


@dataclass
class Grads:
    """The backward's results as fp32 rows: dq (B, H_kv, S_q, G, D), dk (B, H_kv, S_k, 1,
    D), dv, and where asked for, the gate's halves (B, H_kv, ., G) (dL/dG of each query's
    and each key's cumulative gate) and the mask's gradient in the mask's rows."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg_q: Optional[torch.Tensor] = None
    dg_k: Optional[torch.Tensor] = None
    dmask: Optional[torch.Tensor] = None

    def part(self, index: tuple) -> "Grads":
        return Grads(*(cut(x, index) for x in (self.dq, self.dk, self.dv, self.dg_q,
                                                 self.dg_k, self.dmask)))


def rows_tile(x: torch.Tensor, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
    """The tile of queries [i0, i1) and keys [j0, j1) of ``x``, a mask in rows (B, H_kv,
    S_q, G, S_k), each dim full or 1 (a broadcast one: kept whole)."""
    rows = slice(i0, i1) if x.shape[2] > 1 else slice(None)
    keys = slice(j0, j1) if x.shape[4] > 1 else slice(None)
    return x[:, :, rows, :, keys]


def backward(pb: Problem, out: torch.Tensor, dout: torch.Tensor, lse_log2: torch.Tensor,
             dlse: torch.Tensor, gate: bool = False, mask_shape=None) -> Grads:
    """The gradients of the problem from its forward's ``out`` (rows, as the forward's
    caller stored it) and ``lse_log2`` (rows), the cotangents ``dout`` (rows) and ``dlse``
    (rows, natural log): dS = P (dP - delta), delta = rowsum(dO O) - dlse. ``gate``: also
    the gate's halves. ``mask_shape``: also the float mask's gradient, in that rows shape;
    delta is then summed from P and dP (as the kernels do: the stored output's rounding
    would otherwise add up in a broadcast mask's sum of dS). The parts and tiles are the
    forward's."""
    B, H_kv, G, S_q, S_k, D, DV = pb.shape
    grads = Grads(torch.zeros_like(pb.q), torch.zeros_like(pb.k), torch.zeros_like(pb.v))
    if gate:
        grads.dg_q = torch.zeros((B, H_kv, S_q, G))
        grads.dg_k = torch.zeros((B, H_kv, S_k, G))
    if mask_shape is not None:
        grads.dmask = torch.zeros(mask_shape)
    # rows that attend nothing (lse_log2 -inf) get P = 0
    shift = lse_log2.masked_fill(lse_log2 == -_INF, _INF).expand(B, H_kv, S_q, G)
    dlse = dlse.expand(B, H_kv, S_q, G)
    for part, index, M, N in pb.parts():
        for i0 in range(0, S_q, M):
            i1 = min(i0 + M, S_q)
            rows = (index[0], index[1], slice(i0, i1))
            _backward_rows(part, out[rows], dout[rows], shift[rows], dlse[rows],
                           grads.part(index), i0, i1, N)
    # dL/dq = c dL/dx k and dL/dk = dL/dx (q folded), x = c q k^T = tile_scale (q folded) k^T
    grads.dq.mul_(pb.grad_scale * Problem.product_scale(pb.scale, pb.softcap))
    grads.dk.mul_(pb.grad_scale * pb.tile_scale)
    return grads


def _backward_rows(pb: Problem, out, dout, shift, dlse, grads: Grads, i0: int, i1: int,
                   N: int) -> None:
    """The backward of queries [i0, i1) of a part (``out``, ``dout``, ``shift`` (lse_log2,
    +inf where it is -inf), ``dlse``: their rows), adding into the part's ``grads``."""
    B, H_kv, G, _, S_k, D, DV = pb.shape
    do = dout.reshape(B, H_kv, (i1 - i0) * G, DV)
    tiles = list(key_tiles(pb.bounds, i0, i1, S_k, N))
    if grads.dmask is None:
        delta = (dout * out).sum(-1)
    else:
        delta = torch.zeros((B, H_kv, i1 - i0, G))
        for j0, j1 in tiles:
            p, dp, _, _ = _probabilities(pb, shift, do, i0, i1, j0, j1)
            delta.add_((p * dp).sum(-1))
    delta.sub_(dlse)
    dq = grads.dq[:, :, i0:i1].view(B, H_kv, (i1 - i0) * G, D)
    q = pb.q[:, :, i0:i1].reshape(B, H_kv, (i1 - i0) * G, D)
    for j0, j1 in tiles:
        p, dp, t, z = _probabilities(pb, shift, do, i0, i1, j0, j1)
        pz = p if z is None else p * z
        pz = pz.view(B, H_kv, (i1 - i0) * G, j1 - j0).transpose(-1, -2)
        grads.dv[:, :, j0:j1, 0].add_(torch.matmul(pz, do))
        ds = dp.sub_(delta[..., None]).mul_(p)  # dL/ds, natural-log units
        if grads.dmask is not None:
            dims = [d for d in range(5) if grads.dmask.shape[d] == 1 and ds.shape[d] > 1]
            rows_tile(grads.dmask, i0, i1, j0, j1).add_(ds.sum(dims, keepdim=True) if dims
                                                        else ds)
        if grads.dg_q is not None:
            grads.dg_q[:, :, i0:i1].add_(ds.sum(-1))
            grads.dg_k[:, :, j0:j1].sub_(ds.sum(2).transpose(-1, -2))
        if t is not None:  # d tanh(x) / dx = 1 - tanh(x)**2
            ds.addcmul_(ds * t, t, value=-1.0)
        ds = ds.view(B, H_kv, (i1 - i0) * G, j1 - j0)
        dq.add_(torch.matmul(ds, pb.k[:, :, j0:j1, 0]))
        grads.dk[:, :, j0:j1, 0].add_(torch.matmul(ds.transpose(-1, -2), q))


def _probabilities(pb: Problem, shift: torch.Tensor, do: torch.Tensor, i0: int, i1: int,
                   j0: int, j1: int):
    """A tile's (P, Z dP, tanh, Z) in the backward, (B, H_kv, M, G, N) each: P recomputed
    from the forward's lse_log2 (``shift``, the tile's rows), dP = dO V^T, and dropout's Z
    (keep / (1 - p); None without dropout)."""
    s, t = pb.scores(i0, i1, j0, j1)
    p = s.sub_(shift[..., None]).exp2_()
    dp = torch.matmul(do, pb.v[:, :, j0:j1, 0].transpose(-1, -2)).view_as(p)
    z = pb.keep_scale(i0, i1, j0, j1)
    if z is not None:
        dp.mul_(z)
    return p, dp, t, z
