"""Registration of the ``torch.ops.flashop`` operators.

- ``flashop::attention_forward(q, k, v, attn_mask, alibi_slopes, g, *, causal, scale,
  window_size, softcap) -> (out, lse, lse_log2)``: the forward kernel, with autograd through
  ``flashop::attention_backward``. ``lse_log2`` is lse in base 2 as the kernel computed it,
  without the queries' gate, kept for the backward (not differentiable): converting the
  natural-log lse back would cost the recomputed probabilities about 1e-5 of relative
  accuracy at scores of a few hundred.
- ``flashop::attention_backward(dout, dlse, q, k, v, out, lse_log2, attn_mask, alibi_slopes,
  g, *, ..., attn_mask_grad) -> (dq, dk, dv, dg, dattn_mask)``: the backward kernels,
  reusing the forward's ``lse_log2``; ``dg`` / ``dattn_mask`` are empty where there is no
  gate / no mask gradient.
- ``flashop::attention_with_lse(...) -> (out, lse)`` and ``flashop::attention(...) -> out``:
  CompositeImplicitAutograd over ``attention_forward``, so they trace into the same forward
  and backward.
- ``flashop::attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, alibi_slopes, g, *, causal, scale, window_size, softcap) -> (out, lse,
  lse_log2)``, its backward ``flashop::attention_varlen_backward`` and the composites
  ``flashop::attention_varlen_with_lse`` (-> (out, lse)) and ``flashop::attention_varlen``
  (-> out): the same for packed sequences (flash_attn_varlen's layout).

The optional tensors are positional-or-keyword: custom ops take no keyword-only tensors.
``window_size=None`` means ``(-1, -1)`` (no window).

On a GPU the kernel ops are ``torch.library.triton_op``s, so Inductor sees into their
Triton kernels. Under Triton's CPU interpreter (TRITON_INTERPRET=1) a ``triton_op`` cannot
be traced (its kernels would run on fake tensors), so they are registered as opaque
``torch.library.custom_op``s; both registrations share the bodies, fakes and autograd below.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from flashop import launch
from flashop.kernels import INTERPRETING
from flashop.options import Packing, modifiers as _modifiers
from flashop.validation import (
    check_attention_inputs, check_backward_inputs, check_varlen_backward_inputs,
    check_varlen_inputs,
)

_register = torch.library.custom_op if INTERPRETING else torch.library.triton_op


# window_size=None is (-1, -1): torch.library infers schemas only with None/scalar defaults
@_register("flashop::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                      alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None, *,
                      causal: bool = False, scale: Optional[float] = None,
                      window_size: Optional[Sequence[int]] = None, softcap: float = 0.0
                      ) -> tuple[Tensor, Tensor, Tensor]:
    return run_forward(q, k, v, attn_mask, alibi_slopes, g, causal, scale, window_size,
                       softcap)


def run_forward(q, k, v, attn_mask, alibi_slopes, g, causal, scale, window_size, softcap):
    """attention_forward's body: checks, then the kernel; (out, lse, lse_log2)."""
    mods = _modifiers(attn_mask, alibi_slopes, g, causal, window_size, softcap)
    check_attention_inputs(q, k, v, scale, mods, interpreting=INTERPRETING)
    return launch.attention_forward(q, k, v, scale, mods)


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, attn_mask=None, alibi_slopes=None, g=None, *,
                            causal=False, scale=None, window_size=None, softcap=0.0):
    mods = _modifiers(attn_mask, alibi_slopes, g, causal, window_size, softcap)
    check_attention_inputs(q, k, v, scale, mods, interpreting=INTERPRETING)
    return launch.attention_forward_outputs(q, k, v)


@_register("flashop::attention_backward", mutates_args=())
def attention_backward(dout: Tensor, dlse: Tensor, q: Tensor, k: Tensor, v: Tensor,
                       out: Tensor, lse_log2: Tensor, attn_mask: Optional[Tensor] = None,
                       alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None, *,
                       causal: bool = False, scale: Optional[float] = None,
                       window_size: Optional[Sequence[int]] = None, softcap: float = 0.0,
                       attn_mask_grad: bool = False
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    mods = _modifiers(attn_mask, alibi_slopes, g, causal, window_size, softcap)
    check_backward_inputs(dout, dlse, q, k, v, out, lse_log2, scale, mods, attn_mask_grad,
                          interpreting=INTERPRETING)
    return launch.attention_backward(dout, dlse, q, k, v, out, lse_log2, scale, mods,
                                     attn_mask_grad)


@attention_backward.register_fake
def _attention_backward_fake(dout, dlse, q, k, v, out, lse_log2, attn_mask=None,
                             alibi_slopes=None, g=None, *, causal=False, scale=None,
                             window_size=None, softcap=0.0, attn_mask_grad=False):
    mods = _modifiers(attn_mask, alibi_slopes, g, causal, window_size, softcap)
    check_backward_inputs(dout, dlse, q, k, v, out, lse_log2, scale, mods, attn_mask_grad,
                          interpreting=INTERPRETING)
    return launch.attention_backward_outputs(q, k, v, g, attn_mask, attn_mask_grad)


def save_for_grads(ctx, inputs: tuple, out: Tensor, lse_log2: Tensor, kwargs: dict) -> None:
    """Save on ``ctx`` what attention_grads reads: the six inputs (q, k, v, attn_mask,
    alibi_slopes, g), out, lse_log2 and the keyword options."""
    q, k, v, attn_mask, alibi_slopes, g = inputs
    ctx.save_for_backward(q, k, v, out, lse_log2, attn_mask, alibi_slopes, g)
    ctx.kwargs = dict(kwargs)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    out, _, lse_log2 = output
    ctx.mark_non_differentiable(lse_log2)
    save_for_grads(ctx, inputs, out, lse_log2, keyword_only_inputs)


def attention_grads(saved: tuple, needs: tuple, kwargs: dict, dout: Tensor,
                    dlse: Tensor) -> tuple:
    """Gradients of (q, k, v, attn_mask, alibi_slopes, g) through attention_backward, from
    the tensors save_for_grads saves and the six inputs' ``needs_input_grad`` (shared with
    the Python API's direct eager path, flashop/api.py)."""
    q, k, v, out, lse_log2, attn_mask, alibi_slopes, g = saved
    if needs[4]:
        raise RuntimeError(
            "flashop.attention: alibi_slopes get no gradient (as in FlashAttention); detach "
            "them, or pass the ALiBi bias as a float attn_mask, whose gradient is computed")
    dq, dk, dv, dg, dmask = torch.ops.flashop.attention_backward(
        dout, dlse, q, k, v, out, lse_log2, attn_mask, alibi_slopes, g,
        attn_mask_grad=needs[3], **kwargs)
    return dq, dk, dv, dmask if needs[3] else None, None, dg if needs[5] else None


def _backward(ctx, dout, dlse, _):
    # the dispatcher drops trailing arguments left at their defaults (None)
    given = len(ctx.needs_input_grad)
    needs = ctx.needs_input_grad + (False,) * (6 - given)
    return attention_grads(ctx.saved_tensors, needs, ctx.kwargs, dout, dlse)[:given]


attention_forward.register_autograd(_backward, setup_context=_setup_context)

_lib = torch.library.Library("flashop", "FRAGMENT")
_ARGS = ("(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, Tensor? alibi_slopes=None, "
         "Tensor? g=None, *, bool causal=False, float? scale=None, SymInt[]? window_size=None, "
         "float softcap=0.0)")
_lib.define("attention_with_lse" + _ARGS + " -> (Tensor, Tensor)")
_lib.define("attention" + _ARGS + " -> Tensor")


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                       alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None, *,
                       causal: bool = False, scale: Optional[float] = None,
                       window_size: Optional[Sequence[int]] = None, softcap: float = 0.0
                       ) -> tuple[Tensor, Tensor]:
    out, lse, _ = torch.ops.flashop.attention_forward(
        q, k, v, attn_mask, alibi_slopes, g, causal=causal, scale=scale,
        window_size=window_size, softcap=softcap)
    return out, lse


def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
              alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None, *,
              causal: bool = False, scale: Optional[float] = None,
              window_size: Optional[Sequence[int]] = None, softcap: float = 0.0) -> Tensor:
    return torch.ops.flashop.attention_forward(
        q, k, v, attn_mask, alibi_slopes, g, causal=causal, scale=scale,
        window_size=window_size, softcap=softcap)[0]


_lib.impl("attention_with_lse", attention_with_lse, "CompositeImplicitAutograd")
_lib.impl("attention", attention, "CompositeImplicitAutograd")


# --- packed variable-length batches ---------------------------------------------------------


def _packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Packing:
    return Packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


@_register("flashop::attention_varlen_forward", mutates_args=())
def attention_varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                             cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                             alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None,
                             *, causal: bool = False, scale: Optional[float] = None,
                             window_size: Optional[Sequence[int]] = None, softcap: float = 0.0
                             ) -> tuple[Tensor, Tensor, Tensor]:
    mods = _modifiers(None, alibi_slopes, g, causal, window_size, softcap)
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                        mods, interpreting=INTERPRETING)
    return launch.attention_forward(
        q, k, v, scale, mods, _packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


@attention_varlen_forward.register_fake
def _attention_varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, alibi_slopes=None, g=None, *, causal=False,
                                   scale=None, window_size=None, softcap=0.0):
    mods = _modifiers(None, alibi_slopes, g, causal, window_size, softcap)
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                        mods, interpreting=INTERPRETING)
    return launch.attention_forward_outputs(q, k, v, packed=True)


@_register("flashop::attention_varlen_backward", mutates_args=())
def attention_varlen_backward(dout: Tensor, dlse: Tensor, q: Tensor, k: Tensor, v: Tensor,
                              out: Tensor, lse_log2: Tensor, cu_seqlens_q: Tensor,
                              cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                              alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None,
                              *, causal: bool = False, scale: Optional[float] = None,
                              window_size: Optional[Sequence[int]] = None, softcap: float = 0.0
                              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    mods = _modifiers(None, alibi_slopes, g, causal, window_size, softcap)
    check_varlen_backward_inputs(dout, dlse, q, k, v, out, lse_log2, cu_seqlens_q,
                                 cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, mods,
                                 interpreting=INTERPRETING)
    packing = _packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dq, dk, dv, dg, _ = launch.attention_backward(dout, dlse, q, k, v, out, lse_log2, scale,
                                                  mods, False, packing)
    return dq, dk, dv, dg


@attention_varlen_backward.register_fake
def _attention_varlen_backward_fake(dout, dlse, q, k, v, out, lse_log2, cu_seqlens_q,
                                    cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes=None,
                                    g=None, *, causal=False, scale=None, window_size=None,
                                    softcap=0.0):
    mods = _modifiers(None, alibi_slopes, g, causal, window_size, softcap)
    check_varlen_backward_inputs(dout, dlse, q, k, v, out, lse_log2, cu_seqlens_q,
                                 cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, mods,
                                 interpreting=INTERPRETING)
    return launch.attention_backward_outputs(q, k, v, g, None, False)[:4]


def _varlen_setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, g = inputs
    out, _, lse_log2 = output
    ctx.mark_non_differentiable(lse_log2)
    ctx.save_for_backward(q, k, v, out, lse_log2, cu_seqlens_q, cu_seqlens_k, alibi_slopes, g)
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
    ctx.kwargs = dict(keyword_only_inputs)


def _varlen_backward(ctx, dout, dlse, _):
    q, k, v, out, lse_log2, cu_seqlens_q, cu_seqlens_k, alibi_slopes, g = ctx.saved_tensors
    given = len(ctx.needs_input_grad)  # trailing arguments left at None are dropped
    needs = ctx.needs_input_grad + (False,) * (9 - given)
    if needs[7]:
        raise RuntimeError(
            "flashop.attention_varlen: alibi_slopes get no gradient (as in FlashAttention); "
            "detach them")
    dq, dk, dv, dg = torch.ops.flashop.attention_varlen_backward(
        dout, dlse, q, k, v, out, lse_log2, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens,
        alibi_slopes, g, **ctx.kwargs)
    grads = (dq, dk, dv, None, None, None, None, None, dg if needs[8] else None)
    return grads[:given]


attention_varlen_forward.register_autograd(_varlen_backward,
                                           setup_context=_varlen_setup_context)

_VARLEN_ARGS = ("(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                "SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? alibi_slopes=None, "
                "Tensor? g=None, *, bool causal=False, float? scale=None, "
                "SymInt[]? window_size=None, float softcap=0.0)")
_lib.define("attention_varlen_with_lse" + _VARLEN_ARGS + " -> (Tensor, Tensor)")
_lib.define("attention_varlen" + _VARLEN_ARGS + " -> Tensor")


def attention_varlen_with_lse(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                              cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                              alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None,
                              *, causal: bool = False, scale: Optional[float] = None,
                              window_size: Optional[Sequence[int]] = None, softcap: float = 0.0
                              ) -> tuple[Tensor, Tensor]:
    out, lse, _ = torch.ops.flashop.attention_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, g,
        causal=causal, scale=scale, window_size=window_size, softcap=softcap)
    return out, lse


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None, *,
                     causal: bool = False, scale: Optional[float] = None,
                     window_size: Optional[Sequence[int]] = None, softcap: float = 0.0) -> Tensor:
    return torch.ops.flashop.attention_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, g,
        causal=causal, scale=scale, window_size=window_size, softcap=softcap)[0]


_lib.impl("attention_varlen_with_lse", attention_varlen_with_lse, "CompositeImplicitAutograd")
_lib.impl("attention_varlen", attention_varlen, "CompositeImplicitAutograd")
