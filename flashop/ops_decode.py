"""Registration of ``torch.ops.flashop.attention_with_kvcache``.

``flashop::attention_with_kvcache(q, k_cache!, v_cache!, cache_seqlens, k, v,
cache_batch_idx, block_table, alibi_slopes, sinks, *, causal, scale, window_size,
softcap, num_splits) -> (out, lse)``: appends k, v (when given) into the caches in place, then
attends over each sequence's first ``cache_seqlens[b] + S_new`` keys. The schema declares
the caches' mutation (``Tensor(a!) k_cache, Tensor(b!) v_cache``), so functionalization,
Inductor and CUDA graphs see it. The op always returns lse (B, H, S_q) fp32 natural log;
``flashop.attention_with_kvcache`` drops it unless ``return_lse``. No autograd: inference
only.

On a GPU the op is a ``torch.library.triton_op`` (Inductor sees into its kernels); under
Triton's CPU interpreter an opaque ``torch.library.custom_op``, as flashop/ops.py explains.
Both share the body and the fake below.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from flashop import launch_decode
from flashop.kernels import INTERPRETING
from flashop.options import modifiers
from flashop.validation_decode import check_kvcache_inputs

_register = torch.library.custom_op if INTERPRETING else torch.library.triton_op


def _check(q, k_cache, v_cache, cache_seqlens, k, v, cache_batch_idx, block_table,
           alibi_slopes, sinks, causal, scale, window_size, softcap, num_splits):
    mods = modifiers(None, alibi_slopes, None, causal, window_size, softcap, sinks)
    check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                         block_table, scale, mods, num_splits, interpreting=INTERPRETING)
    return mods


# window_size=None is (-1, -1): torch.library infers schemas only with None/scalar defaults
@_register("flashop::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                           k: Optional[Tensor] = None, v: Optional[Tensor] = None,
                           cache_batch_idx: Optional[Tensor] = None,
                           block_table: Optional[Tensor] = None,
                           alibi_slopes: Optional[Tensor] = None,
                           sinks: Optional[Tensor] = None, *, causal: bool = False,
                           scale: Optional[float] = None,
                           window_size: Optional[Sequence[int]] = None, softcap: float = 0.0,
                           num_splits: int = 0) -> tuple[Tensor, Tensor]:
    return run_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k, v,
                                      cache_batch_idx, block_table, alibi_slopes, sinks,
                                      causal, scale, window_size, softcap, num_splits)


def run_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, cache_batch_idx,
                               block_table, alibi_slopes, sinks, causal, scale, window_size,
                               softcap, num_splits):
    """attention_with_kvcache's body: checks, then the kernels; (out, lse). Also run
    directly by the Python API's eager path (flashop/api.py)."""
    mods = _check(q, k_cache, v_cache, cache_seqlens, k, v, cache_batch_idx, block_table,
                  alibi_slopes, sinks, causal, scale, window_size, softcap, num_splits)
    return launch_decode.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens,
                                                cache_batch_idx, block_table, scale, mods,
                                                num_splits)


@attention_with_kvcache.register_fake
def _attention_with_kvcache_fake(q, k_cache, v_cache, cache_seqlens, k=None, v=None,
                                 cache_batch_idx=None, block_table=None, alibi_slopes=None,
                                 sinks=None, *, causal=False, scale=None, window_size=None,
                                 softcap=0.0, num_splits=0):
    _check(q, k_cache, v_cache, cache_seqlens, k, v, cache_batch_idx, block_table,
           alibi_slopes, sinks, causal, scale, window_size, softcap, num_splits)
    return launch_decode.kvcache_outputs(q, v_cache)
