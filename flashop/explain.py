"""``flashop.explain``: what a call will run, and why, without running it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from flashop import api
from flashop._launch import attention as launch
from flashop._launch.choice import Choice
from flashop._ops import attention as ops, attention_fp8 as fp8_ops, kvcache as kvcache_ops
from flashop._ops.checks import window_bounds


@dataclass
class Explanation:
    """What a call runs: ``forward`` (a Choice: the kernels' family in ``path``, each
    kernel and its tiles in ``kernels``, the options chosen in ``options``, and in ``why``
    each rule that ruled something out) and ``backward`` (likewise; None where the call has
    no backward). ``str()`` prints them."""

    call: str
    forward: Choice
    backward: Optional[Choice] = None

    def __str__(self) -> str:
        text = f"{self.call}\nforward: {self.forward}"
        if self.backward is not None:
            text += f"\nbackward: {self.backward}"
        return text


def _describe(name: str, **tensors) -> str:
    shown = [f"{n} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
             for n, t in tensors.items() if isinstance(t, torch.Tensor)]
    device = next(t.device for t in tensors.values() if isinstance(t, torch.Tensor))
    return f"{name} on {device}: " + ", ".join(shown)


def _attention(fn, q, k, v, attn_mask=None, alibi_slopes=None, g=None, sinks=None, *,
               causal=False, scale=None, window_size=(-1, -1), softcap=0.0, dropout_p=0.0,
               deterministic=False, q_descale=None, k_descale=None, v_descale=None,
               out_dtype=None) -> Explanation:
    op = "flashop.attention"
    left, right = window_bounds(op, window_size)
    call = _describe(f"flashop.{fn.__name__}", q=q, k=k, v=v)
    options = dict(causal=causal, scale=scale, window_size_left=left, window_size_right=right,
                   softcap=softcap)
    if api._takes_fp8(op, q, (q_descale, k_descale, v_descale), out_dtype, attn_mask, g,
                      dropout_p):
        mods, packed, _ = fp8_ops._fp8_call(q, k, v, None, None, None, None, q_descale,
                                            k_descale, v_descale, alibi_slopes, sinks,
                                            out_dtype=out_dtype, **options)
        return Explanation(call, *launch.choices(q, k, v, scale, mods, packed, fp8=True))
    mods, packed = ops._call(q, k, v, None, None, None, None, attn_mask, alibi_slopes, g, sinks,
                             dropout_p=dropout_p, **options)
    return Explanation(call, *launch.choices(q, k, v, scale, mods, packed, backward=True,
                                             deterministic=deterministic))


def _attention_varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      alibi_slopes=None, g=None, sinks=None, *, causal=False, scale=None,
                      window_size=(-1, -1), softcap=0.0, dropout_p=0.0, deterministic=False,
                      block_table=None, q_descale=None, k_descale=None, v_descale=None,
                      out_dtype=None) -> Explanation:
    op = "flashop.attention_varlen"
    left, right = window_bounds(op, window_size)
    call = _describe(f"flashop.{fn.__name__}", q=q, k=k, v=v, block_table=block_table)
    options = dict(causal=causal, scale=scale, window_size_left=left, window_size_right=right,
                   softcap=softcap)
    packing_args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if api._takes_fp8(op, q, (q_descale, k_descale, v_descale), out_dtype, g=g,
                      dropout_p=dropout_p, block_table=block_table):
        mods, packed, _ = fp8_ops._fp8_call(q, k, v, *packing_args, q_descale, k_descale,
                                            v_descale, alibi_slopes, sinks,
                                            out_dtype=out_dtype, **options)
        return Explanation(call, *launch.choices(q, k, v, scale, mods, packed, fp8=True))
    if block_table is not None:
        mods, packed = kvcache_ops._paged_call(q, k, v, *packing_args, block_table,
                                               alibi_slopes, sinks, **options)
        return Explanation(call, *launch.choices(q, k, v, scale, mods, packed))
    mods, packed = ops._call(q, k, v, *packing_args, None, alibi_slopes, g, sinks,
                             dropout_p=dropout_p, **options)
    return Explanation(call, *launch.choices(q, k, v, scale, mods, packed, backward=True,
                                             deterministic=deterministic))


_EXPLAINERS = {api.attention: _attention, api.attention_with_lse: _attention,
               api.attention_varlen: _attention_varlen,
               api.attention_varlen_with_lse: _attention_varlen}


def explain(fn: Callable, *args, **kwargs) -> Explanation:
    """What ``fn(*args, **kwargs)`` would run, and why, without running it: ``fn`` is
    ``flashop.attention``, ``attention_with_lse``, ``attention_varlen`` or
    ``attention_varlen_with_lse``, and the arguments are the call's own (they are checked
    as the call checks them: a bad call raises the call's error).

    Returns an :class:`Explanation`: the forward's kernels, tiles and options and the
    backward's (where the call has one), each with the rules that ruled something out
    (the Gluon kernels, the warp-specialized kernel, tensor descriptors, two query tiles
    per program, dQ by atomics, the dK/dV kernel's parts). ``print()`` it::

        print(flashop.explain(flashop.attention, q, k, v, causal=True))
    """
    explainer = _EXPLAINERS.get(fn)
    if explainer is None:
        names = ", ".join(f"flashop.{f.__name__}" for f in _EXPLAINERS)
        raise ValueError(f"flashop.explain: explains calls of {names}; got {fn!r}")
    return explainer(fn, *args, **kwargs)
