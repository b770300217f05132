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

What flashop does not implement raises ``NotImplementedError`` naming the argument:
``dropout_p > 0`` (no dropout yet) and ``block_table`` (paged KV caches).
``deterministic`` is accepted: flashop's backward is deterministic unless
``FLASHOP_DQ_ATOMICS=1`` (``flashop.config``) opts into dQ by atomics, which
``deterministic=True`` then refuses.
``flash_attn_with_kvcache`` is not provided yet.
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor

from flashop import api, config

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
           "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func"]


def _check_unsupported(name: str, dropout_p: float, deterministic: bool,
                       block_table: Optional[Tensor] = None) -> None:
    if dropout_p != 0.0:
        # dropout: wire it here once flashop's kernels have it
        raise NotImplementedError(
            f"flashop.flash_attn.{name}: dropout_p={dropout_p} is not supported (flashop has "
            f"no attention dropout yet); pass dropout_p=0.0")
    if block_table is not None:
        raise NotImplementedError(
            f"flashop.flash_attn.{name}: block_table (a paged KV cache) is not supported; "
            f"pass contiguous k and v with cu_seqlens_k")
    if deterministic and config.settings.dq_atomics:
        raise RuntimeError(
            f"flashop.flash_attn.{name}: deterministic=True, but FLASHOP_DQ_ATOMICS=1 makes "
            f"the backward add dQ by atomics; turn that switch off "
            f"(flashop.config.override(dq_atomics=False))")


def _window(window_size: Sequence[int]) -> tuple:
    # flash-attn treats any negative side as unbounded; flashop spells that -1
    left, right = window_size
    return (-1 if left < 0 else int(left), -1 if right < 0 else int(right))


def _dense(name, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
           alibi_slopes, deterministic, return_attn_probs):
    _check_unsupported(name, dropout_p, deterministic)
    options = dict(causal=causal, scale=softmax_scale, window_size=_window(window_size),
                   softcap=softcap)
    if return_attn_probs:
        out, lse = api.attention_with_lse(q, k, v, None, alibi_slopes, **options)
        return out, lse, None
    return api.attention(q, k, v, None, alibi_slopes, **options)


def _packed(name, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, block_table=None):
    _check_unsupported(name, dropout_p, deterministic, block_table)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes)
    options = dict(causal=causal, scale=softmax_scale, window_size=_window(window_size),
                   softcap=softcap)
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
                    return_attn_probs=False):
    """flash-attn's ``flash_attn_func``: q (batch, seqlen_q, nheads, headdim), k and v
    (batch, seqlen_k, nheads_k, headdim), ``nheads % nheads_k == 0``. Returns out
    (batch, seqlen_q, nheads, headdim), or ``(out, softmax_lse (batch, nheads, seqlen_q),
    None)`` with ``return_attn_probs=True``."""
    return _dense("flash_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size,
                  softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """flash-attn's ``flash_attn_qkvpacked_func``: qkv (batch, seqlen, 3, nheads, headdim)."""
    name = "flash_attn_qkvpacked_func"
    q, k, v = _unstack(name, qkv, 2, 3, "qkv (batch, seqlen, 3, nheads, headdim)")
    return _dense(name, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, deterministic, return_attn_probs)


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
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn's ``flash_attn_varlen_func``: q (total_q, nheads, headdim), k and v
    (total_k, nheads_k, headdim), ``cu_seqlens_q/k`` (batch + 1,) int32, ``max_seqlen_q/k``
    ints. Returns out (total_q, nheads, headdim), or ``(out, softmax_lse (nheads, total_q),
    None)`` with ``return_attn_probs=True``. ``block_table`` must be None."""
    return _packed("flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, deterministic, return_attn_probs, block_table)


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
