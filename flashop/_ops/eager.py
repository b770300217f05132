"""The eager path of the Python API: a call of plain tensors with nothing watching (no
torch.compile, export, FX or JIT tracing, dispatch mode or functorch transform:
is_direct) runs the operators' bodies directly, skipping the dispatcher's layers and the
registered operator's generated autograd function, a large part of a short call's host
time. The bodies run by plans (plans.PlannedBody): a signature's first call runs
the body, its checks included, and later calls replay its allocations and launches. The
attention forward runs in an autograd function (where a gradient is wanted) whose backward
runs the backward operator's body the same way. Results, checks and messages are the
operators'; ``FLASHOP_DIRECT_EAGER=0`` (``flashop.config``) sends every call through them.
Every other call goes through the operators (their composites' Python bodies, which trace
the same).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from flashop import config
from flashop._launch.calls import aliasing, environment, make_key, plan_key, signature
from flashop._launch.common import EAGER_TENSOR_TYPES
from flashop._ops import attention as ops
from flashop._ops import attention_fp8 as attention_fp8_ops
from flashop._ops import autocast, kvcache

# the attention operators' bodies as the direct path runs them
_forward, _backward = ops.planned_forward, ops.planned_backward


def is_direct(q: torch.Tensor, *tensors: Optional[torch.Tensor]) -> bool:
    """Whether a call with ``q`` and these tensors takes the direct eager path (the
    operators' bodies run without the dispatcher): eager tensors (no subclass: fake,
    functional, DTensor, ...) with data (not on the meta device, whose calls the operators'
    fakes answer), nothing that must see the operator (a compiler or tracer, a dispatch
    mode, a functorch transform), and config.settings.direct_eager."""
    return (config.settings.direct_eager and not q.is_meta and type(q) in EAGER_TENSOR_TYPES
            and not torch.compiler.is_compiling()
            and all(t is None or type(t) in EAGER_TENSOR_TYPES for t in tensors)
            and not torch._C._len_torch_dispatch_stack()
            and not torch._C._are_functorch_transforms_active()
            and not torch._C._get_tracing_state())


# fp32 zeros by (device, shape), each a view of one zero element, never written: the
# gradient of an lse that no loss reads
_ZEROS: dict = {}
_MAX_ZEROS = 256


def _zero_rows(lse: Tensor) -> Tensor:
    """Zeros of ``lse``'s shape in fp32, as a view of one zero element (strides 0, which the
    backward kernels index like any strides): no allocation or fill per backward, and the
    view itself made once per shape. Made afresh while a CUDA graph is captured (a tensor
    made then belongs to the graph's memory)."""
    if lse.is_cuda and torch.cuda.is_current_stream_capturing():
        return lse.new_zeros(()).expand(lse.shape)
    key = (lse.device, lse.shape)
    zero = _ZEROS.get(key)
    if zero is None:
        if len(_ZEROS) >= _MAX_ZEROS:
            _ZEROS.clear()
        zero = _ZEROS[key] = lse.new_zeros(()).expand(lse.shape)
    return zero


# the forward's keyword options, in the order its plans' keys take them
_OPTIONS = ("causal", "scale", "window_size_left", "window_size_right", "attention_chunk",
            "softcap", "dropout_p", "deterministic")
# the forward's inputs that may take a gradient, as _DirectAttention takes them, and their
# places in FORWARD_INPUTS
_DIFFERENTIABLE = ("q", "k", "v", "attn_mask", "alibi_slopes", "g", "sinks")
_PLACES = tuple(ops.FORWARD_INPUTS.index(name) for name in _DIFFERENTIABLE)
_NOT_NEEDED = (False,) * len(ops.FORWARD_INPUTS)


class _Context(NamedTuple):
    """What ops.attention_grads reads of an autograd context: needs_input_grad in
    FORWARD_INPUTS' order, and what save_for_grads set."""

    needs_input_grad: tuple
    max_seqlens: tuple
    options: dict


class _DirectAttention(torch.autograd.Function):
    """The forward operator's body with autograd through the backward operator's, as the
    operator's registered autograd does it (flashop/_ops/attention.py); returns (out, lse).
    Takes the call (the forward's inputs in FORWARD_INPUTS' order, its options and its
    plan's key), then, for autograd, the inputs that may take a gradient
    (_DIFFERENTIABLE)."""

    @staticmethod
    def forward(ctx, call, *differentiable):
        inputs, options, key = call
        out, lse, lse_log2 = _forward.run(key, inputs, options)
        ops.save_for_grads(ctx, inputs, out, lse_log2, options)
        ctx.key = key
        # an output that no loss reads gets no gradient (None) rather than a zeroed tensor
        # made and filled on every backward: see _zero_rows
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        saved = ctx.saved_tensors
        out, lse_log2 = saved[-2:]
        if dout is None:
            dout = torch.zeros_like(out)
        if dlse is None:
            dlse = _zero_rows(lse_log2)  # the lse's shape, fp32
        needs = list(_NOT_NEEDED)
        for place, need in zip(_PLACES, ctx.needs_input_grad[1:]):
            needs[place] = need
        context = _Context(tuple(needs), ctx.max_seqlens, ctx.options)
        if is_direct(dout, dlse) and not torch.is_grad_enabled():
            # the backward operator's body, as the forward's (a backward that builds a graph,
            # create_graph=True, goes through the operator, which has no derivative); its
            # plans' key: the forward's, which holds every saved tensor's signature
            forward_key = ctx.key

            def backward(*args, **options):
                key = forward_key and make_key((
                    forward_key, signature(args[:2]), aliasing(args),
                    options["attn_mask_grad"], environment()))
                return _backward.run(key, args, options)

            grads = ops.attention_grads(context, saved, dout, dlse, backward=backward)
        else:
            grads = ops.attention_grads(context, saved, dout, dlse)
        return (None, *[grads[place] for place in _PLACES])


def attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor],
              cu_seqlens_k: Optional[Tensor], max_seqlen_q: Optional[int],
              max_seqlen_k: Optional[int], attn_mask: Optional[Tensor],
              alibi_slopes: Optional[Tensor], g: Optional[Tensor], sinks: Optional[Tensor],
              **options) -> tuple[Tensor, Tensor]:
    """(out, lse) of a dense call (the packing arguments None) or a packed one, through the
    direct path where it applies (an autograd function where a gradient is wanted, else the
    forward's body alone), else the composite operator's body; ``options`` the operators'
    keyword options."""
    if is_direct(q, k, v, cu_seqlens_q, cu_seqlens_k, attn_mask, alibi_slopes, g, sinks):
        dtype = autocast.region_dtype(q)
        if dtype is not None:  # the operator's Autocast kernel, which the dispatcher would run
            q, k, v, attn_mask, g, sinks = autocast.cast_arguments(
                "attention_forward", dict(q=q, k=k, v=v, attn_mask=attn_mask, g=g,
                                          sinks=sinks), dtype).values()
        inputs = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_mask,
                  alibi_slopes, g, sinks, ops.dropout_seed(q, options.get("dropout_p", 0.0)))
        options = {name: options[name] for name in _OPTIONS}
        key = plan_key(inputs, options)
        differentiable = (q, k, v, attn_mask, alibi_slopes, g, sinks)
        if torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in differentiable):
            return _DirectAttention.apply((inputs, options, key), *differentiable)
        out, lse, _ = _forward.run(key, inputs, options)
        return out, lse
    if cu_seqlens_q is None:
        return ops.attention_with_lse(q, k, v, attn_mask, alibi_slopes, g, sinks, **options)
    return ops.attention_varlen_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, alibi_slopes, g, sinks, **options)


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, cache_batch_idx,
                           block_table, alibi_slopes, sinks, rotary_cos=None, rotary_sin=None,
                           cache_leftpad=None, k_descale=None, v_descale=None, q_descale=None,
                           **options):
    """(out, lse) of attention_with_kvcache: the operator's body itself where the direct
    path applies (a decode step's host time), else the operator."""
    if is_direct(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                 alibi_slopes, sinks, rotary_cos, rotary_sin, cache_leftpad, k_descale,
                 v_descale, q_descale):
        dtype = autocast.region_dtype(q)
        if dtype is not None:  # the operator's Autocast kernel, which the dispatcher would run
            q, k_cache, v_cache, k, v, sinks, rotary_cos, rotary_sin = autocast.cast_arguments(
                "attention_with_kvcache", dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v,
                                               sinks=sinks, rotary_cos=rotary_cos,
                                               rotary_sin=rotary_sin), dtype).values()
        return kvcache.planned_attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens, k, v, cache_batch_idx, block_table,
            alibi_slopes, sinks, rotary_cos, rotary_sin, cache_leftpad, k_descale, v_descale,
            q_descale, **options)
    return kvcache.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k, v,
                                          cache_batch_idx, block_table, alibi_slopes, sinks,
                                          rotary_cos, rotary_sin, cache_leftpad, k_descale,
                                          v_descale, q_descale, **options)


def _direct_forward_only(*tensors) -> bool:
    """Whether a forward-only operator's body runs directly: the direct path applies and no
    input requires grad (one that does goes through the operator, whose autograd refuses a
    backward)."""
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    return not grads and is_direct(*tensors)


def attention_varlen_paged(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, block_table, alibi_slopes, sinks, **options):
    """(out, lse) of a paged prefill: the operator's body itself where the direct path
    applies and no input requires grad, else the operator (whose autograd refuses a
    backward)."""
    args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, alibi_slopes)
    if _direct_forward_only(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table,
                            alibi_slopes, sinks):
        dtype = autocast.region_dtype(q)
        if dtype is not None:  # the operator's Autocast kernel, which the dispatcher would run
            q, k_cache, v_cache, sinks = autocast.cast_arguments(
                "attention_varlen_paged", dict(q=q, k_cache=k_cache, v_cache=v_cache,
                                               sinks=sinks), dtype).values()
        return kvcache.planned_attention_varlen_paged(q, k_cache, v_cache, *args, sinks,
                                                      **options)
    return kvcache.attention_varlen_paged(q, k_cache, v_cache, *args, sinks, **options)


def attention_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_descale,
                  k_descale, v_descale, alibi_slopes, sinks, **options):
    """(out, lse) of an fp8 call: the operator's body by its plans where the direct path
    applies and no input requires grad, else the operator (whose autograd refuses a
    backward). Autocast leaves e4m3 inputs as they are."""
    if _direct_forward_only(q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale,
                            v_descale, alibi_slopes, sinks):
        return attention_fp8_ops.planned_attention_fp8(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_descale,
            k_descale, v_descale, alibi_slopes, sinks, **options)
    return attention_fp8_ops.attention_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                           max_seqlen_k, q_descale, k_descale, v_descale,
                                           alibi_slopes, sinks, **options)
