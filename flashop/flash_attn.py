"""flash-attn 2.x's functions on flashop's kernels: code written for ``flash_attn`` runs after
changing its import::

    from flashop.flash_attn import flash_attn_func, flash_attn_varlen_func

Each function takes flash-attn 2.x's arguments with their names, positions and defaults and
returns what flash-attn returns: ``out``, or with ``return_attn_probs=True`` the tuple
``(out, softmax_lse, None)`` with ``softmax_lse`` in flash-attn's layout, (batch, nheads,
seqlen) or (nheads, total_q) for packed batches, float32, natural log. flash-attn's third
element (the attention probabilities, returned only with dropout) is ``None``: flashop never
materializes them. Causal masks and windows are aligned to the bottom-right corner, as in
flash-attn >= 2.1.

``dropout_p > 0`` runs flashop's attention dropout (flash-attn applies dropout whenever it is
given, training or not: pass 0.0 in evaluation); the mask comes from torch's generator of
q's device, so ``torch.manual_seed`` reproduces it, and the backward regenerates the same
mask (docs/modifiers.md). ``block_table`` of ``flash_attn_varlen_func`` runs the paged
prefill (k and v paged caches, forward only, as in flash-attn). ``deterministic=True`` makes
the backward bitwise reproducible, as in flash-attn; by default the fastest backward runs,
which may add dQ by atomics (``flashop.attention``'s ``deterministic``).

``flash_attn_with_kvcache`` (decoding over a dense or paged KV cache, appending new keys and
values in place, with flash-attn's rotary embedding inside the call and its left-padded
caches) runs ``flashop.attention_with_kvcache``.

The functions FlashAttention-3 gives ``attention_chunk`` (``flash_attn_func``,
``flash_attn_qkvpacked_func``, ``flash_attn_varlen_func``, ``flash_attn_with_kvcache``) take
it as a keyword, with its meaning (chunked attention, ``flashop.attention``'s
``attention_chunk``), forward and backward (FlashAttention-3's backward refuses it).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from flashop import api
from flashop._ops.checks import unbounded_if_negative

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
           "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache"]


def _window(window_size: Sequence[int]) -> tuple:
    # flash-attn treats any negative side as unbounded; flashop spells that -1
    return unbounded_if_negative(*window_size)


def _dense(name, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
           alibi_slopes, deterministic, return_attn_probs, **more):
    options = dict(causal=causal, scale=softmax_scale, window_size=_window(window_size),
                   softcap=softcap, dropout_p=float(dropout_p), deterministic=deterministic,
                   **more)
    if return_attn_probs:
        out, lse = api.attention_with_lse(q, k, v, None, alibi_slopes, **options)
        return out, lse, None
    return api.attention(q, k, v, None, alibi_slopes, **options)


def _packed(name, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, block_table=None, **more):
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes)
    options = dict(causal=causal, scale=softmax_scale, window_size=_window(window_size),
                   softcap=softcap, dropout_p=float(dropout_p), deterministic=deterministic,
                   **more)
    if block_table is not None:  # paged prefill: forward only
        options["block_table"] = block_table
    if return_attn_probs:
        out, lse = api.attention_varlen_with_lse(*args, **options)
        return out, lse, None
    return api.attention_varlen(*args, **options)


def _unstack(name: str, packed: Tensor, dim: int, count: int, layout: str) -> tuple:
    if packed.dim() <= dim or packed.shape[dim] != count:
        raise ValueError(f"flashop.flash_attn.{name}: expected {layout}, got shape "
                         f"{tuple(packed.shape)}")
    return packed.unbind(dim)  # views: gradients flow back into the packed tensor


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, q_descale=None, k_descale=None, v_descale=None,
                    attention_chunk=0):
    """flash-attn's ``flash_attn_func``: q (batch, seqlen_q, nheads, headdim), k and v
    (batch, seqlen_k, nheads_k, headdim), ``nheads % nheads_k == 0``. Returns out
    (batch, seqlen_q, nheads, headdim), or ``(out, softmax_lse (batch, nheads, seqlen_q),
    None)`` with ``return_attn_probs=True``. float8_e4m3fn q, k, v with FlashAttention-3's
    ``q_descale``, ``k_descale``, ``v_descale`` (batch, nheads_k) run the fp8 forward
    (bf16 out; docs/fp8.md). ``attention_chunk`` (FlashAttention-3's): chunked attention."""
    return _dense("flash_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size,
                  softcap, alibi_slopes, deterministic, return_attn_probs,
                  q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                  attention_chunk=attention_chunk)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, attention_chunk=0):
    """flash-attn's ``flash_attn_qkvpacked_func``: qkv (batch, seqlen, 3, nheads, headdim)."""
    name = "flash_attn_qkvpacked_func"
    q, k, v = _unstack(name, qkv, 2, 3, "qkv (batch, seqlen, 3, nheads, headdim)")
    return _dense(name, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, deterministic, return_attn_probs,
                  attention_chunk=attention_chunk)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """flash-attn's ``flash_attn_kvpacked_func``: q (batch, seqlen_q, nheads, headdim), kv
    (batch, seqlen_k, 2, nheads_k, headdim)."""
    name = "flash_attn_kvpacked_func"
    k, v = _unstack(name, kv, 2, 2, "kv (batch, seqlen_k, 2, nheads_k, headdim)")
    return _dense(name, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None,
                           q_descale=None, k_descale=None, v_descale=None, attention_chunk=0):
    """flash-attn's ``flash_attn_varlen_func``: q (total_q, nheads, headdim), k and v
    (total_k, nheads_k, headdim), ``cu_seqlens_q/k`` (batch + 1,) int32, ``max_seqlen_q/k``
    ints. Returns out (total_q, nheads, headdim), or ``(out, softmax_lse (nheads, total_q),
    None)`` with ``return_attn_probs=True``. With ``block_table`` (batch, max_num_blocks)
    int32, k and v are paged caches (num_blocks, page_block_size, nheads_k, headdim) and
    sequence b's keys (as many as cu_seqlens_k counts) are its first keys in its pages:
    paged prefill, forward only (flashop.attention_varlen). float8_e4m3fn inputs with
    ``q_descale``, ``k_descale``, ``v_descale`` (batch, nheads_k) run the fp8 forward.
    ``attention_chunk``: chunked attention, restarting in every sequence."""
    return _packed("flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, deterministic, return_attn_probs, block_table,
                   q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                   attention_chunk=attention_chunk)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: qkv (total, 3, nheads, headdim)."""
    name = "flash_attn_varlen_qkvpacked_func"
    q, k, v = _unstack(name, qkv, 1, 3, "qkv (total, 3, nheads, headdim)")
    return _packed(name, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: q (total_q, nheads, headdim), kv
    (total_k, 2, nheads_k, headdim)."""
    name = "flash_attn_varlen_kvpacked_func"
    k, v = _unstack(name, kv, 1, 2, "kv (total_k, 2, nheads_k, headdim)")
    return _packed(name, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   deterministic, return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None,
                            cache_seqlens: Optional[Union[int, Tensor]] = None,
                            cache_batch_idx: Optional[Tensor] = None,
                            cache_leftpad: Optional[Tensor] = None,
                            block_table: Optional[Tensor] = None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, k_descale=None, v_descale=None,
                            q_descale=None, attention_chunk=0):
    """flash-attn's ``flash_attn_with_kvcache`` on :func:`flashop.attention_with_kvcache`:
    q (batch, seqlen, nheads, headdim); k_cache, v_cache (batch_cache, seqlen_cache,
    nheads_k, headdim), or (num_blocks, page_block_size, nheads_k, headdim) with
    ``block_table`` (batch, max_num_blocks_per_seq) int32 (flashop takes pages of 16 to 256
    keys, a power of two). ``k``, ``v`` (batch, seqlen_new, nheads_k, headdim), when given,
    are written into the caches in place at positions ``cache_seqlens[b]`` onwards before
    attending. ``cache_seqlens``: an int or (batch,) int32, each sequence's cached length; None
    attends the whole cache (every position of its row, or of its pages), and then ``k``,
    ``v`` cannot be given. For inference: the output carries no gradient, as in flash-attn.
    Returns out (batch, seqlen, nheads, headdim), or ``(out, softmax_lse)`` with
    ``return_softmax_lse=True``, softmax_lse (batch, nheads, seqlen) float32, natural log.

    ``rotary_cos``, ``rotary_sin`` (seqlen_ro, rotary_dim / 2) in q's dtype, with ``k``,
    ``v``: the new keys are rotated at positions ``cache_seqlens[b] + s`` before they are
    written, and q at ``cache_seqlens[b] + i`` where causal or windowed, else at
    ``cache_seqlens[b]``; ``rotary_interleaved`` pairs dims (0, 1), ... (GPT-J) or (0,
    rotary_dim / 2), ... (GPT-NeoX). ``cache_leftpad`` (batch,) int32, dense caches only:
    sequence b's keys start at row ``cache_leftpad[b]``.

    ``k_cache``, ``v_cache`` may be ``torch.float8_e4m3fn`` with 16-bit q, k, v, with
    FlashAttention-3's ``k_descale``, ``v_descale`` (batch, nheads_k) float32 (None: 1): the
    cache holds the keys divided by ``k_descale[b, h]``; new keys are quantized so as they
    are appended, and attention reads the cache times the descales. Over such a cache q may
    be ``torch.float8_e4m3fn`` too, with ``q_descale`` (batch, nheads_k) float32: the
    output is then bfloat16, and new keys and values must be bfloat16.

    ``attention_chunk`` (FlashAttention-3's): chunked attention over each sequence's keys,
    chunks counted from its first key (after ``cache_leftpad``).
    """
    name = "flashop.flash_attn.flash_attn_with_kvcache"
    if cache_seqlens is None:
        if k is not None or v is not None:
            raise ValueError(
                f"{name}: k and v (new keys and values to append) need cache_seqlens, the "
                f"position each sequence's new keys are written at; pass cache_seqlens")
        # None: every sequence attends all the positions its cache row (or pages) holds
        cache_seqlens = (k_cache.shape[1] if block_table is None
                         else block_table.shape[-1] * k_cache.shape[1])
    # flash-attn's kernel has no autograd: its output carries no gradient either
    with torch.no_grad():
        return api.attention_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
            cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
            block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
            rotary_interleaved=rotary_interleaved, causal=causal,
            scale=softmax_scale, window_size=_window(window_size),
            attention_chunk=attention_chunk, softcap=softcap,
            alibi_slopes=alibi_slopes, num_splits=num_splits, k_descale=k_descale,
            v_descale=v_descale, q_descale=q_descale, return_lse=return_softmax_lse)
