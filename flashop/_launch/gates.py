"""The log-decay gate's host-side parts: its cumulative sum before the kernels, and its
gradient from the two halves the backward kernels write (docs/modifiers.md).

The kernels add ``g_cum[i + S_k - S_q] - g_cum[j]`` with ``g_cum = cumsum(g)`` over the keys.
"""

from __future__ import annotations

import torch

from flashop._launch.options import Packing


def token_sequences(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """The sequence of each of ``total`` packed tokens (int64), without a host sync."""
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens, tokens, right=True) - 1


def gate_cumsum(g: torch.Tensor, packing: "Packing | None"):
    """The cumulative gate the kernels read, fp32, and its (batch, seq, head) strides.

    Dense: (B, S_k, H) -> (B, H, S_k), so that a tile's gates are one contiguous load (a scan
    along a contiguous last dim: CUDA's scan along an outer dim runs one thread per column).
    Packed: (total_k, H) -> (H, total_k), restarted at each sequence (summed in fp64 over
    the whole packing, then the sequence's start subtracted)."""
    if packing is None:
        g_cum = torch.cumsum(g.transpose(1, 2).contiguous(), dim=-1, dtype=torch.float32)
        return g_cum, (g_cum.stride(0), g_cum.stride(2), g_cum.stride(1))
    total, H = g.shape
    C = torch.cumsum(g.t().contiguous(), dim=-1, dtype=torch.float64)
    C0 = torch.cat([C.new_zeros(H, 1), C], dim=1)  # C0[:, t] = sum of the first t tokens
    start = packing.cu_seqlens_k.long()[token_sequences(packing.cu_seqlens_k, total)]
    g_cum = (C - C0[:, start]).float()
    return g_cum, (0, g_cum.stride(1), g_cum.stride(0))


def query_gates(g: torch.Tensor, rows: tuple, packing: "Packing | None") -> torch.Tensor:
    """The queries' gates G_i = g_cum[i + S_k - S_q] the kernels read (0 where that position
    is before the first key), in the layout ``rows`` of lse: (B, H, S_q) dense, (H, total_q)
    packed."""
    g_cum, _ = gate_cumsum(g, packing)  # (B, H, S_k) dense, (H, total_k) packed
    if g_cum.shape[-1] == 0:  # no key: every query is before the first
        return g_cum.new_zeros(*g_cum.shape[:-1], rows[-1])
    if packing is None:
        S_q, S_k = rows[-1], g_cum.shape[-1]
        position = torch.arange(S_q, device=g.device) + (S_k - S_q)
        at = position.clamp(min=0).expand(*g_cum.shape[:-1], S_q)
        return torch.where(position >= 0, torch.gather(g_cum, -1, at), 0.0)
    cu_q, cu_k = packing.cu_seqlens_q.long(), packing.cu_seqlens_k.long()
    total_q = rows[-1]
    seq = token_sequences(packing.cu_seqlens_q, total_q).long()
    position = (torch.arange(total_q, device=g.device) - cu_q[seq]
                + (cu_k[seq + 1] - cu_k[seq]) - (cu_q[seq + 1] - cu_q[seq]))
    # (a sequence without keys, whose positions are all before its first, may be last)
    at = (cu_k[seq] + position.clamp(min=0)).clamp(max=g_cum.shape[-1] - 1)
    at = at.expand(g_cum.shape[0], total_q)
    return torch.where(position >= 0, torch.gather(g_cum, -1, at), 0.0)


def _reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    """out[..., t] = sum of x[..., t:]: the gradient of a cumulative sum."""
    return torch.flip(torch.cumsum(torch.flip(x, [-1]), dim=-1), [-1])


def gate_grad(dgq: torch.Tensor, dgk: torch.Tensor, packing: "Packing | None"
              ) -> torch.Tensor:
    """dg from the kernels' halves (dgq per query, dgk per key; (B, H, S) dense, (H, total)
    packed): the gradient of g_cum at key position p is dgk[p] + dgq[p - (S_k - S_q)]
    (query i sits at key position i + S_k - S_q), then dg is its reverse cumulative sum.
    Returns (B, S_k, H) dense, (total_k, H) packed."""
    if packing is not None:
        return _packed_gate_grad(dgq, dgk, packing)
    S_q, S_k = dgq.shape[-1], dgk.shape[-1]
    off = S_k - S_q
    if off >= 0:
        dg_cum = torch.cat([dgk[..., :off], dgk[..., off:] + dgq], dim=-1)
    else:
        dg_cum = dgk + dgq[..., -off:]
    return _reverse_cumsum(dg_cum).transpose(1, 2)


def _packed_gate_grad(dgq: torch.Tensor, dgk: torch.Tensor, packing: Packing) -> torch.Tensor:
    """As gate_grad for a packed batch: dgq (H, total_q), dgk (H, total_k) -> dg
    (total_k, H), the reverse cumulative sums restarted at each sequence."""
    (H, total_q), total_k = dgq.shape, dgk.shape[1]
    cu_q, cu_k = packing.cu_seqlens_q.long(), packing.cu_seqlens_k.long()
    seq = token_sequences(packing.cu_seqlens_q, total_q)
    # query token t of sequence b sits at key token t + (end_k(b) - end_q(b)); tokens before
    # their sequence's keys attend nothing and go to a spare column
    pos = torch.arange(total_q, device=dgq.device) + (cu_k[seq + 1] - cu_q[seq + 1])
    pos = torch.where(pos >= cu_k[seq], pos, total_k)
    dg_cum = torch.cat([dgk, dgk.new_zeros(H, 1)], dim=1).double()
    dg_cum.index_add_(1, pos, dgq.double())  # one query per key position: no summing order
    R = _reverse_cumsum(dg_cum[:, :total_k])
    R0 = torch.cat([R, R.new_zeros(H, 1)], dim=1)  # R0[:, t] = sum from token t on
    end = cu_k[token_sequences(packing.cu_seqlens_k, total_k) + 1]
    return (R - R0[:, end]).t()
