"""``flashop.explain``: what a call will run, and why, without running it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from flashop import api
from flashop._launch import attention as launch, kvcache as launch_kvcache
from flashop._launch import mla as launch_mla, mla_gluon as launch_mla_gluon
from flashop._launch.choice import Choice
from flashop._ops import attention as ops, attention_fp8 as fp8_ops, kvcache as kvcache_ops
from flashop._ops.checks_mla import cache_aliasing


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
               causal=False, scale=None, window_size=(-1, -1), attention_chunk=0,
               softcap=0.0, dropout_p=0.0, deterministic=False, q_descale=None,
               k_descale=None, v_descale=None, out_dtype=None) -> Explanation:
    op = "flashop.attention"
    call = _describe(f"flashop.{fn.__name__}", q=q, k=k, v=v)
    options = api._options(op, causal, scale, window_size, softcap, attention_chunk)
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
                      window_size=(-1, -1), attention_chunk=0, softcap=0.0, dropout_p=0.0,
                      deterministic=False, block_table=None, q_descale=None, k_descale=None,
                      v_descale=None, out_dtype=None) -> Explanation:
    op = "flashop.attention_varlen"
    call = _describe(f"flashop.{fn.__name__}", q=q, k=k, v=v, block_table=block_table)
    options = api._options(op, causal, scale, window_size, softcap, attention_chunk)
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


def _kvcache(fn, q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, causal=False,
             scale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
             return_lse=False, **tensors_and_options) -> Explanation:
    op = "flashop.attention_with_kvcache"
    call = _describe(f"flashop.{fn.__name__}", q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v,
                     block_table=tensors_and_options.get("block_table"))
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32,
                                   device=q.device)
    options = api._options(op, causal, scale, window_size, softcap,
                           attention_chunk=attention_chunk)
    plan, mla = kvcache_ops.run_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens, k, v, **tensors_and_options, **options,
        plan_only=True)
    if plan is None:  # CPU tensors: the CPU path
        return Explanation(call, Choice(
            "CPU path", [], {"computed by": "PyTorch's CPU operations, each sequence's keys "
                                            "at once after the append"},
            ["Triton kernels: CPU tensors without Triton's interpreter (the CPU path)"]))
    gluon = plan.decode is not None and plan.kernel == launch_mla_gluon.KERNEL_NAME
    choice = launch_kvcache.plan_choice(
        plan, launch_mla_gluon.describe(plan.decode.static) if gluon else None)
    if mla:
        choice.why.append("MLA's latent cache (head dims 576 and 512): its own kernel, each "
                          "cached row read once for both products")
        if not gluon:
            why = []
            values_in_keys = cache_aliasing(k_cache, v_cache, k, v)[0] is True
            launch_mla_gluon.serves(q, k_cache, values_in_keys,
                                    tensors_and_options.get("block_table"),
                                    tensors_and_options.get("cache_leftpad"), why=why)
            if plan.decode is not None:
                choice.options["tensor descriptors"] = launch_mla.explain_descriptors(
                    plan.decode.static, q, k_cache, v_cache, values_in_keys, why)
            choice.why.extend(why)
    asked = tensors_and_options.get("num_splits", 0)
    choice.why.append(f"splits: as num_splits={asked} asks" if asked else
                      "splits: num_splits=0, chosen from the GPU's size, the batch, the key/"
                      "value heads and the keys a query can attend (never the lengths)")
    return Explanation(call, choice)


_EXPLAINERS = {api.attention: _attention, api.attention_with_lse: _attention,
               api.attention_varlen: _attention_varlen,
               api.attention_varlen_with_lse: _attention_varlen,
               api.attention_with_kvcache: _kvcache}


def explain(fn: Callable, *args, **kwargs) -> Explanation:
    """What ``fn(*args, **kwargs)`` would run, and why, without running it: ``fn`` is
    ``flashop.attention``, ``attention_with_lse``, ``attention_varlen``,
    ``attention_varlen_with_lse`` or ``attention_with_kvcache``, and the arguments are the
    call's own (they are checked as the call checks them: a bad call raises the call's
    error; a decode call's new keys are not written).

    Returns an :class:`Explanation`: the forward's kernels, tiles and options and the
    backward's (where the call has one), each with the rules that ruled something out
    (the Gluon kernels, the warp-specialized kernel, tensor descriptors, two query tiles
    per program, dQ by atomics, the dK/dV kernel's parts); for a decode call, its kernels,
    tiles and splits. ``print()`` it::

        print(flashop.explain(flashop.attention, q, k, v, causal=True))
    """
    explainer = _EXPLAINERS.get(fn)
    if explainer is None:
        names = ", ".join(f"flashop.{f.__name__}" for f in _EXPLAINERS)
        raise ValueError(f"flashop.explain: explains calls of {names}; got {fn!r}")
    return explainer(fn, *args, **kwargs)
