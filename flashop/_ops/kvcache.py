"""Registration of the operators over key/value caches: ``attention_with_kvcache``
(decoding) and ``attention_varlen_paged`` (paged prefill).

``flashop::attention_with_kvcache(q, k_cache!, v_cache!, cache_seqlens, k, v,
cache_batch_idx, block_table, alibi_slopes, sinks, rotary_cos, rotary_sin, cache_leftpad,
k_descale, v_descale, q_descale, *, causal, scale, window_size_left, window_size_right,
attention_chunk, softcap, rotary_interleaved, num_splits, out_dtype) -> (out, lse)``: appends
k, v (when
given; the keys rotated where rotary_cos and rotary_sin are given, as the queries then are;
quantized as ``k / k_descale[b, h]`` into a float8_e4m3fn cache) into the caches in place,
then attends over each sequence's first ``cache_seqlens[b] + S_new`` keys (from row
``cache_leftpad[b]`` of a dense cache where it is given), an fp8 cache's keys and values
read as ``k_cache * k_descale[b, h]`` and ``v_cache * v_descale[b, h]``. float8_e4m3fn q
(over an fp8 cache) is read as ``q * q_descale[b, h // (H // H_kv)]``: converted to
out_dtype (bfloat16 where None; exact) before the kernels, q_descale folded into the
scores' scale with k_descale; out in out_dtype.
The schema declares the caches' mutation (``Tensor(a!) k_cache, Tensor(b!) v_cache``), so
functionalization, Inductor and CUDA graphs see it. The op always returns lse (B, H, S_q)
fp32 natural log; ``flashop.attention_with_kvcache`` drops it unless ``return_lse``. No
autograd: inference only.

``flashop::attention_varlen_paged(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k,
max_seqlen_q, max_seqlen_k, block_table, alibi_slopes, sinks, *, causal, scale,
window_size_left, window_size_right, attention_chunk, softcap) -> (out, lse)``: packed
queries over paged
caches that it only reads (``flashop.attention_varlen(..., block_table=...)``), run by the
packed forward kernel reading the pages. An operator of its own rather than a
``block_table`` argument of the training operator ``attention_forward``: it is forward-only
(its registered backward raises, as flash-attn has none), takes no gate or dropout, and
leaves that operator's schema, autograd and backward as they are.

On a GPU the ops are ``torch.library.triton_op``s (Inductor sees into their kernels); under
Triton's CPU interpreter opaque ``torch.library.custom_op``s, as flashop/_ops/attention.py
explains. Both registrations share the bodies and fakes below.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula, sdpa_flop_count

from flashop._launch import attention as launch_attention
from flashop._launch import cpu
from flashop._launch import kvcache as launch
from flashop._launch import mla as launch_mla
from flashop._launch import mla_gluon as launch_mla_gluon
from flashop._launch.common import is_traced
from flashop._launch.plans import PlannedBody
from flashop._launch.options import Packing, modifiers
from flashop._ops import autocast
from flashop._ops.attention import bhsd_shapes, register_forward_only, register_opaque, values
from flashop._ops.checks_kvcache import (
    FP8_CACHE_DTYPE, check_kvcache_inputs, check_paged_varlen_inputs, compute_dtype,
)
from flashop._ops.checks_mla import cache_aliasing, is_mla
from flashop.kernels import INTERPRETING

_register = torch.library.custom_op if INTERPRETING else torch.library.triton_op

def _checked(q, k_cache, v_cache, cache_seqlens, k=None, v=None, cache_batch_idx=None,
             block_table=None, alibi_slopes=None, sinks=None, rotary_cos=None, rotary_sin=None,
             cache_leftpad=None, k_descale=None, v_descale=None, q_descale=None, *,
             causal=False, scale=None, window_size_left=-1, window_size_right=-1,
             attention_chunk=0, softcap=0.0, rotary_interleaved=True, num_splits=0,
             out_dtype=None):
    """The call's Modifiers and its tensors' aliasing (checks_mla.cache_aliasing: whether the
    values are the keys' leading columns), its inputs checked (check_kvcache_inputs). An
    eager call of a signature that passed runs by its plan (planned_attention_with_kvcache),
    without them."""
    mods = modifiers(None, alibi_slopes, None, causal, window_size_left, window_size_right,
                     softcap, sinks, attention_chunk=attention_chunk)
    aliasing = cache_aliasing(k_cache, v_cache, k, v)
    check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                         block_table, scale, mods, num_splits,
                         rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                         cache_leftpad=cache_leftpad, k_descale=k_descale, v_descale=v_descale,
                         q_descale=q_descale, out_dtype=out_dtype, aliasing=aliasing)
    return mods, aliasing


@_register("flashop::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                           k: Optional[Tensor] = None, v: Optional[Tensor] = None,
                           cache_batch_idx: Optional[Tensor] = None,
                           block_table: Optional[Tensor] = None,
                           alibi_slopes: Optional[Tensor] = None,
                           sinks: Optional[Tensor] = None,
                           rotary_cos: Optional[Tensor] = None,
                           rotary_sin: Optional[Tensor] = None,
                           cache_leftpad: Optional[Tensor] = None,
                           k_descale: Optional[Tensor] = None,
                           v_descale: Optional[Tensor] = None,
                           q_descale: Optional[Tensor] = None, *, causal: bool = False,
                           scale: Optional[float] = None, window_size_left: int = -1,
                           window_size_right: int = -1, attention_chunk: int = 0,
                           softcap: float = 0.0, rotary_interleaved: bool = True,
                           num_splits: int = 0,
                           out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    return run_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens, k, v, cache_batch_idx, block_table, alibi_slopes,
        sinks, rotary_cos, rotary_sin, cache_leftpad, k_descale, v_descale, q_descale,
        causal=causal, scale=scale,
        window_size_left=window_size_left, window_size_right=window_size_right,
        attention_chunk=attention_chunk, softcap=softcap, rotary_interleaved=rotary_interleaved,
        num_splits=num_splits, out_dtype=out_dtype)


def run_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=None, v=None,
                               cache_batch_idx=None, block_table=None, alibi_slopes=None,
                               sinks=None, rotary_cos=None, rotary_sin=None,
                               cache_leftpad=None, k_descale=None, v_descale=None,
                               q_descale=None, *, scale=None, num_splits=0,
                               rotary_interleaved=True, out_dtype=None, plan_only=False,
                               **options):
    """attention_with_kvcache's body (its arguments): checks, then the kernels; (out, lse).
    Also run directly by the eager path (flashop/_ops/eager.py). MLA's head dims (576, 512)
    go to the latent-cache kernel, which reads each row once where v_cache is
    k_cache[..., :512] (the checks' aliasing). A traced call of CPU tensors (cpu.traced),
    or that the Gluon MLA kernel takes in a graph compiled here (_gluon_traced), runs it
    through attention_with_kvcache_opaque. ``plan_only``: the launcher's plan and
    whether it is MLA's, launching nothing (flashop.explain; None over CPU tensors)."""
    mods, aliasing = _checked(q, k_cache, v_cache, cache_seqlens, k, v, cache_batch_idx,
                            block_table, alibi_slopes, sinks, rotary_cos, rotary_sin,
                            cache_leftpad, k_descale, v_descale, q_descale, scale=scale,
                            num_splits=num_splits, rotary_interleaved=rotary_interleaved,
                            out_dtype=out_dtype, **options)
    if cpu.traced(q) or _gluon_traced(q, k_cache, v_cache, block_table, cache_leftpad,
                                      aliasing):
        return torch.ops.flashop.attention_with_kvcache_opaque(
            q, k_cache, v_cache, cache_seqlens, k, v, cache_batch_idx, block_table,
            alibi_slopes, sinks, rotary_cos, rotary_sin, cache_leftpad, k_descale, v_descale,
            q_descale, scale=scale, num_splits=num_splits,
            rotary_interleaved=rotary_interleaved, out_dtype=out_dtype, **options)
    if is_mla(k_cache, v_cache):
        result = launch_mla.attention_with_latent_cache(
            q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, scale,
            mods, num_splits, cache_leftpad, values_in_keys=aliasing[0] is True,
            plan_only=plan_only)
        return (result, True) if plan_only else result
    if q.dtype == FP8_CACHE_DTYPE:
        q = q.to(compute_dtype(q, out_dtype))  # exact: every e4m3 value is a 16-bit one
    result = launch.attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, scale, mods,
        num_splits, cache_leftpad, rotary_cos, rotary_sin, rotary_interleaved, k_descale,
        v_descale, q_descale, plan_only=plan_only)
    return (result, False) if plan_only else result


def _gluon_traced(q, k_cache, v_cache, block_table, cache_leftpad, aliasing) -> bool:
    """Whether a traced call runs the Gluon MLA kernel when its graph runs (a graph compiled
    here: mla_gluon.serves), through attention_with_kvcache_opaque, which Inductor does not
    trace into."""
    return (is_traced(q) and is_mla(k_cache, v_cache) and launch_mla_gluon.serves(
        q, k_cache, aliasing[0] is True, block_table, cache_leftpad, traced=True))


def _cache_aliasing(args: tuple) -> tuple:
    """The aliasing of a call's caches and new keys and values (checks_mla.cache_aliasing),
    which its plan's key holds: shapes and strides alone do not tell a view of k_cache from
    a tensor of its own."""
    k_cache, v_cache, _, k, v = args[1:6]
    return cache_aliasing(k_cache, v_cache, k, v)


# the body as the direct eager path runs it: by plans made once per signature of calls (a
# decode loop repeats one; plans.PlannedBody, flashop/_ops/eager.py)
planned_attention_with_kvcache = PlannedBody(run_attention_with_kvcache, _cache_aliasing)

_lib = torch.library.Library("flashop", "FRAGMENT")  # kept: its registrations live with it
autocast.register(_lib, "attention_with_kvcache")


@attention_with_kvcache.register_fake
def _attention_with_kvcache_fake(q, k_cache, v_cache, *args, out_dtype=None, **options):
    _checked(q, k_cache, v_cache, *args, out_dtype=out_dtype, **options)
    return launch.kvcache_outputs(q, v_cache, compute_dtype(q, out_dtype))


register_opaque("attention_with_kvcache", run_attention_with_kvcache,
                _attention_with_kvcache_fake)


@register_flop_formula(torch.ops.flashop.attention_with_kvcache, get_raw=True)
def _flops(q, k_cache, v_cache, cache_seqlens, k=None, v=None, cache_batch_idx=None,
           block_table=None, alibi_slopes=None, sinks=None, rotary_cos=None, rotary_sin=None,
           cache_leftpad=None, *args, out_val=None, **options) -> int:
    """SDPA's count (torch.utils.flop_counter) over each sequence's keys after the append,
    ``cache_seqlens[b] + S_new`` up to the cache's capacity, less ``cache_leftpad[b]`` (the
    capacity for each where the lengths have no values: fake or meta tensors)."""
    B, S_q, H, D = q.shape
    DV = v_cache.shape[3]  # grouped-query heads counted as query heads (bhsd_shapes)
    capacity = (block_table.shape[1] * k_cache.shape[1] if block_table is not None
                else k_cache.shape[1])
    S_new = 0 if k is None else k.shape[1]
    cached = values(cache_seqlens)
    pads = [0] * B if cache_leftpad is None else values(cache_leftpad)
    lengths = ([capacity] * B if cached is None or pads is None
               else [max(min(n + S_new, capacity) - p, 0) for n, p in zip(cached, pads)])
    return sum(sdpa_flop_count((1, H, S_q, D), (1, H, L, D), (1, H, L, DV))
               for L in lengths)


# --- paged prefill: packed queries over paged keys and values (forward only) ----------------


def _paged_call(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                block_table, alibi_slopes=None, sinks=None, *, causal=False, scale=None,
                window_size_left=-1, window_size_right=-1, attention_chunk=0, softcap=0.0):
    """A paged prefill's Modifiers and Packing (with its block table), checked."""
    mods = modifiers(None, alibi_slopes, None, causal, window_size_left, window_size_right,
                     softcap, sinks, attention_chunk=attention_chunk)
    packing = Packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table)
    check_paged_varlen_inputs(q, k_cache, v_cache, packing, scale, mods)
    return mods, packing


@_register("flashop::attention_varlen_paged", mutates_args=())
def attention_varlen_paged(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor,
                           cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           block_table: Tensor, alibi_slopes: Optional[Tensor] = None,
                           sinks: Optional[Tensor] = None, *, causal: bool = False,
                           scale: Optional[float] = None, window_size_left: int = -1,
                           window_size_right: int = -1, attention_chunk: int = 0,
                           softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    return run_attention_varlen_paged(
        q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        block_table, alibi_slopes, sinks, causal=causal, scale=scale,
        window_size_left=window_size_left, window_size_right=window_size_right,
        attention_chunk=attention_chunk, softcap=softcap)


def run_attention_varlen_paged(q, k_cache, v_cache, *args, scale=None, **options):
    """attention_varlen_paged's body (its arguments): checks, then the forward kernel
    reading the pages; (out (total_q, H, DV), lse (H, total_q)). Also run directly by the
    eager path (flashop/_ops/eager.py); a traced call of CPU tensors runs it through
    attention_varlen_paged_opaque (cpu.traced)."""
    mods, packing = _paged_call(q, k_cache, v_cache, *args, scale=scale, **options)
    if cpu.traced(q):
        return torch.ops.flashop.attention_varlen_paged_opaque(q, k_cache, v_cache, *args,
                                                               scale=scale, **options)
    out, lse, _ = launch_attention.attention_forward(q, k_cache, v_cache, scale, mods, packing)
    return out, lse


# the body as the direct eager path runs it, by plans (plans.PlannedBody)
planned_attention_varlen_paged = PlannedBody(run_attention_varlen_paged)


@attention_varlen_paged.register_fake
def _attention_varlen_paged_fake(q, k_cache, v_cache, *args, **options):
    _paged_call(q, k_cache, v_cache, *args, **options)
    out, lse, _ = launch_attention.attention_forward_outputs(q, k_cache, v_cache, packed=True)
    return out, lse


register_opaque("attention_varlen_paged", run_attention_varlen_paged,
                _attention_varlen_paged_fake)


register_forward_only(attention_varlen_paged, (
    "flashop.attention_varlen: no backward over paged keys and values (block_table): "
    "paged prefill is forward-only, as in flash-attn; for training pass k and v packed "
    "(total_k, kv_heads, head_dim) with cu_seqlens_k, or run the paged call under "
    "torch.no_grad() / torch.inference_mode()"))
autocast.register(_lib, "attention_varlen_paged")


@register_flop_formula(torch.ops.flashop.attention_varlen_paged, get_raw=True)
def _paged_flops(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 *args, out_val=None, **options) -> int:
    """SDPA's count per sequence, as the packed forward's (each sequence's keys counted from
    cu_seqlens_k)."""
    k, v = k_cache[:0, 0], v_cache[:0, 0]  # (0, H_kv, .): heads and head dims as packed keys
    return sum(sdpa_flop_count(*shapes) for shapes in bhsd_shapes(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
