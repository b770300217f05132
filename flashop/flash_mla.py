"""FlashMLA's decoding functions (deepseek-ai/FlashMLA, ``flash_mla``) on flashop's kernels:
serving code written for FlashMLA's dense decoding runs after changing its import::

    from flashop.flash_mla import flash_mla_with_kvcache, get_mla_metadata

    tile_scheduler_metadata, num_splits = get_mla_metadata(
        cache_seqlens, s_q * h_q // h_kv, h_kv)
    out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512,
                                      tile_scheduler_metadata, num_splits,
                                      softmax_scale=scale, causal=True)

``q`` is (batch, seq_len_q, num_heads_q, 576), ``k_cache`` the paged latent cache
(num_blocks, page_block_size, num_heads_k, 576) whose first ``head_dim_v`` = 512 dims are
the values, ``block_table`` (batch, max_num_blocks_per_seq) int32, ``cache_seqlens``
(batch,) int32; ``out`` is (batch, seq_len_q, num_heads_q, 512) in q's dtype and ``lse``
(batch, num_heads_q, seq_len_q) float32, natural log, as FlashMLA returns them. ``causal``
aligns the queries to the end of each sequence (query i of s_q attends keys up to
``cache_seqlens[b] - s_q + i``). Each call is ``flashop.attention_with_kvcache(q, k_cache,
k_cache[..., :head_dim_v], cache_seqlens=..., block_table=..., scale=softmax_scale,
causal=causal, return_lse=True)``, bit for bit: pages of any power of two from 16 to 256
keys (FlashMLA's are 64), float16 or bfloat16 (or float32), without a host
synchronization (CUDA graphs, ``torch.compile(fullgraph=True)``).

The metadata: flashop plans its split of the keys per call from the shapes alone
(``num_splits=0`` of attention_with_kvcache), so ``flash_mla_with_kvcache`` does not read
``tile_scheduler_metadata`` and ``num_splits``; ``get_mla_metadata`` returns tensors of
FlashMLA's shapes and dtypes (on cache_seqlens' device, made without reading its values)
for code that allocates or passes them around. What FlashMLA takes beyond dense decoding
of 16-bit caches (its fp8 cache ``is_fp8_kvcache``, sparse attention's ``indices`` /
``topk``, ``attn_sink``, the extra caches) is refused with an error that names it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from flashop import api

__all__ = ["get_mla_metadata", "flash_mla_with_kvcache"]

# FlashMLA's TileSchedulerMetaDataSize: the int32 fields of one SM part's work
TILE_SCHEDULER_METADATA_SIZE = 8
# FlashMLA's rows of query heads per block of its kernel (num_sm_parts' rule)
_BLOCK_ROWS = 64


def _refuse(given: dict, fix: str) -> None:
    """A ValueError naming the first of FlashMLA's options in ``given`` that is set."""
    for name, value in given.items():
        if value is not None and value is not False:
            raise ValueError(f"flashop.flash_mla: {name} is not supported (flashop takes "
                             f"FlashMLA's dense decoding of 16-bit caches); {fix}")


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def get_mla_metadata(cache_seqlens: Tensor, num_q_tokens_per_head_k: Optional[int] = None,
                     num_heads_k: int = 1, num_heads_q: Optional[int] = None,
                     is_fp8_kvcache: bool = False, topk: Optional[int] = None, *,
                     num_heads_per_head_k: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """FlashMLA's ``get_mla_metadata``: ``(tile_scheduler_metadata, num_splits)``.

    Args:
        cache_seqlens: (batch,) int32 lengths (only its size and device are read).
        num_q_tokens_per_head_k: ``seq_len_q * num_heads_q // num_heads_k`` (FlashMLA's
            first releases name it ``num_heads_per_head_k``, also taken by that name).
        num_heads_k: key/value heads of the cache (MLA: 1).
        num_heads_q, is_fp8_kvcache, topk: FlashMLA's later arguments; an fp8 cache and
            sparse attention (``topk``) are refused.

    Returns:
        tile_scheduler_metadata: (num_sm_parts, 8) int32, num_sm_parts = the GPU's SMs //
        num_heads_k // ceil(num_q_tokens_per_head_k / 64) (at least 1), as FlashMLA sizes
        it; zeros. num_splits: (batch + 1,) int32, ``0, 1, ..., batch``. Neither is read by
        flash_mla_with_kvcache (flashop plans its splits per call from the shapes).
    """
    _refuse({"is_fp8_kvcache=True": is_fp8_kvcache, "topk (sparse attention)": topk},
            "pass is_fp8_kvcache=False and topk=None")
    rows = num_q_tokens_per_head_k if num_heads_per_head_k is None else num_heads_per_head_k
    if rows is None or rows < 1 or num_heads_k < 1:
        raise ValueError(f"flashop.flash_mla.get_mla_metadata: num_q_tokens_per_head_k "
                         f"(seq_len_q * num_heads_q // num_heads_k) and num_heads_k must be "
                         f"positive, got {rows} and {num_heads_k}")
    device = cache_seqlens.device
    parts = max(1, _sm_count(device) // num_heads_k // -(-rows // _BLOCK_ROWS))
    metadata = torch.zeros(parts, TILE_SCHEDULER_METADATA_SIZE, dtype=torch.int32,
                           device=device)
    num_splits = torch.arange(cache_seqlens.shape[0] + 1, dtype=torch.int32, device=device)
    return metadata, num_splits


def flash_mla_with_kvcache(q: Tensor, k_cache: Tensor, block_table: Optional[Tensor],
                           cache_seqlens: Optional[Tensor], head_dim_v: int,
                           tile_scheduler_metadata: Any = None, num_splits: Any = None,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           is_fp8_kvcache: bool = False, indices: Optional[Tensor] = None,
                           attn_sink: Optional[Tensor] = None,
                           extra_k_cache: Optional[Tensor] = None,
                           extra_indices_in_kvcache: Optional[Tensor] = None,
                           topk_length: Optional[Tensor] = None,
                           extra_topk_length: Optional[Tensor] = None
                           ) -> tuple[Tensor, Tensor]:
    """FlashMLA's ``flash_mla_with_kvcache`` (dense decoding): ``(out, softmax_lse)``.

    Args:
        q: (batch, seq_len_q, num_heads_q, head_dim), head_dim 576 (MLA's).
        k_cache: (num_blocks, page_block_size, num_heads_k, head_dim), pages of a power of
            two from 16 to 256 keys; its first ``head_dim_v`` dims are the values.
        block_table: (batch, max_num_blocks_per_seq) int32.
        cache_seqlens: (batch,) int32: each sequence's keys.
        head_dim_v: the values' dims, 512.
        tile_scheduler_metadata, num_splits: get_mla_metadata's (not read; any value).
        softmax_scale: the scores' scale; None: 1 / sqrt(head_dim).
        causal: bottom-right aligned (query i attends keys up to cache_seqlens[b] -
            seq_len_q + i).
        is_fp8_kvcache, indices, attn_sink, extra_k_cache, extra_indices_in_kvcache,
            topk_length, extra_topk_length: FlashMLA's fp8 and sparse decoding: refused.

    Returns:
        out (batch, seq_len_q, num_heads_q, head_dim_v) in q's dtype, softmax_lse
        (batch, num_heads_q, seq_len_q) float32, natural log.
    """
    _refuse({"is_fp8_kvcache=True": is_fp8_kvcache, "indices (sparse attention)": indices,
             "attn_sink": attn_sink, "extra_k_cache": extra_k_cache,
             "extra_indices_in_kvcache": extra_indices_in_kvcache, "topk_length": topk_length,
             "extra_topk_length": extra_topk_length},
            "decode over the paged cache with block_table and cache_seqlens")
    if block_table is None or cache_seqlens is None:
        raise ValueError("flashop.flash_mla.flash_mla_with_kvcache: dense decoding takes a "
                         "block_table and cache_seqlens (FlashMLA's paged cache), got "
                         f"block_table {None if block_table is None else 'given'} and "
                         f"cache_seqlens {None if cache_seqlens is None else 'given'}")
    return api.attention_with_kvcache(q, k_cache, k_cache[..., :head_dim_v],
                                      cache_seqlens=cache_seqlens, block_table=block_table,
                                      scale=softmax_scale, causal=causal, return_lse=True)
