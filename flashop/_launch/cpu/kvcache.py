"""The CPU path of ``attention_with_kvcache``: the append of new keys and values into the
caches, in place (rotated and quantized as the append kernel writes them), then each
sequence's attention over its cached keys as one dense problem (docs/decoding.md).
"""

from __future__ import annotations

from typing import Optional

import torch

from flashop._launch.cpu import outside_autocast
from flashop._launch.cpu.attention import forward_problem, slopes_row
from flashop._launch.options import Modifiers
from flashop.reference import quantize_e4m3, rotary

_FP8 = torch.float8_e4m3fn


def _capacity(k_cache: torch.Tensor, block_table: Optional[torch.Tensor]) -> int:
    page = k_cache.shape[1]
    return page * block_table.shape[1] if block_table is not None else page


def append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, rotary_cos,
           rotary_sin, rotary_interleaved: bool, k_descale, v_descale) -> None:
    """Write k, v (B, S_new, H_kv, .) into the caches at positions ``cache_seqlens[b] + s``
    below the capacity (row ``cache_batch_idx[b]`` or b of a dense cache; page
    ``block_table[b, pos // page_size]`` of a paged one): the keys rotated at their
    positions, and into an e4m3 cache both quantized with their descales."""
    B, S_new = k.shape[:2]
    positions = cache_seqlens.long()[:, None] + torch.arange(S_new)  # (B, S_new)
    if rotary_cos is not None:
        k = rotary(k, rotary_cos, rotary_sin, positions, rotary_interleaved)
    if k_cache.dtype == _FP8:  # (MLA refuses fp8 caches: v is given here)
        k, v = quantize_e4m3(k, k_descale), quantize_e4m3(v, v_descale)
    written = (positions >= 0) & (positions < _capacity(k_cache, block_table))
    b = torch.arange(B)[:, None].expand(B, S_new)[written]
    pos = positions[written]
    if block_table is not None:
        page = k_cache.shape[1]
        slot = (block_table.long()[b, pos // page], pos % page)
    else:
        row = b if cache_batch_idx is None else cache_batch_idx.long()[b]
        slot = (row, pos)
    k_cache.index_put_(slot, k[written].to(k_cache.dtype))
    if v is not None:  # (None: the values are the keys' leading columns, MLA's latent cache)
        v_cache.index_put_(slot, v[written].to(v_cache.dtype))


def _cached(cache: torch.Tensor, b: int, start: int, end: int, cache_batch_idx,
            block_table) -> torch.Tensor:
    """Sequence b's cached rows [start, end) (end - start, H_kv, .)."""
    if block_table is None:
        row = b if cache_batch_idx is None else int(cache_batch_idx[b])
        return cache[row, start:end]
    page = cache.shape[1]
    pages = block_table[b, :-(-end // page)].long()
    return cache[pages].flatten(0, 1)[start:end]


@outside_autocast
def attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                           block_table, scale: float, mods: Modifiers, cache_leftpad,
                           rotary_cos, rotary_sin, rotary_interleaved: bool, rotary_per_query,
                           k_descale, v_descale, q_descale, outputs: tuple) -> tuple:
    """Append, then attend (launch.kvcache.attention_with_kvcache's contract), writing
    ``outputs`` (out, lse as kvcache_outputs allocates them). ``rotary_per_query``: the
    queries rotated each at its position (else all at cache_seqlens[b])."""
    out, lse = outputs
    B, S_q, H, _ = q.shape
    S_new = 0
    if k is not None and k.shape[1] > 0 and B > 0:
        S_new = k.shape[1]
        append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
               rotary_cos, rotary_sin, rotary_interleaved, k_descale, v_descale)
    if out.numel() == 0:
        return out, lse
    if rotary_cos is not None:
        offsets = torch.arange(S_q) if rotary_per_query else torch.zeros(S_q, dtype=torch.long)
        q = rotary(q, rotary_cos, rotary_sin, cache_seqlens.long()[:, None] + offsets,
                   rotary_interleaved)
    capacity = _capacity(k_cache, block_table)
    lengths = (cache_seqlens.long() + S_new).tolist()
    starts = [0] * B if cache_leftpad is None else cache_leftpad.tolist()
    H_kv = k_cache.shape[2]
    for b, (length, start) in enumerate(zip(lengths, starts)):
        end = max(min(length, capacity), start)
        kb = _cached(k_cache, b, start, end, cache_batch_idx, block_table)[None]
        vb = _cached(v_cache, b, start, end, cache_batch_idx, block_table)[None]
        qb = q[b:b + 1]
        if k_cache.dtype == _FP8:  # read as fp32 times the descales
            kb = kb.float() if k_descale is None else kb.float() * k_descale[b, :, None]
            vb = vb.float() if v_descale is None else vb.float() * v_descale[b, :, None]
            qb = qb.float()
            if q_descale is not None:
                qb = (qb.unflatten(2, (H_kv, H // H_kv))
                      * q_descale[b, :, None, None]).flatten(2, 3)
        # query i sits at cache position i + length - S_q, key j of kb at start + j
        forward_problem(qb, kb, vb, scale, mods, out[b:b + 1], lse[b:b + 1],
                        torch.empty_like(lse[b:b + 1]), length - S_q - start,
                        torch.tensor([b]), slopes_row(mods.alibi_slopes, b), differentiable=False)
    return out, lse
