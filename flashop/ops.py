"""Registration of the ``torch.ops.flashop`` operators.

- ``flashop::attention_forward(q, k, v, attn_mask, alibi_slopes, g, sinks, dropout_seed, *,
  causal, scale, window_size, softcap, dropout_p) -> (out, lse, lse_log2)``: the forward
  kernel, with autograd through ``flashop::attention_backward``. ``lse_log2`` is lse in base
  2 as the kernel computed it, without the queries' gate, kept for the backward (not
  differentiable): converting the natural-log lse back would cost the recomputed
  probabilities about 1e-5 of relative accuracy at scores of a few hundred. ``dropout_seed``
  (int64, one element) is required where ``dropout_p > 0``: the composites draw it.
- ``flashop::attention_backward(dout, dlse, q, k, v, out, lse_log2, attn_mask, alibi_slopes,
  g, dropout_seed, *, ..., dropout_p, attn_mask_grad) -> (dq, dk, dv, dg, dattn_mask)``:
  the backward kernels, reusing the forward's ``lse_log2`` (which includes the sinks, so
  the backward takes none) and its dropout seed; ``dg`` / ``dattn_mask`` are empty where
  there is no gate / no mask gradient. The sinks' gradient is computed by the autograd
  formula from lse_log2 and delta (launch.sink_grad).
- ``flashop::attention_with_lse(q, k, v, attn_mask, alibi_slopes, g, sinks, *, ...,
  dropout_p) -> (out, lse)`` and ``flashop::attention(...) -> out``: CompositeImplicitAutograd
  over ``attention_forward``, so they trace into the same forward and backward; where
  ``dropout_p > 0`` they draw the dropout seed from torch's generator of q's device
  (dropout_seed), so ``torch.manual_seed`` makes runs reproducible and compiled graphs and
  CUDA graph replays draw a fresh one each call.
- ``flashop::attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, alibi_slopes, g, sinks, dropout_seed, *, causal, scale, window_size,
  softcap, dropout_p) -> (out, lse, lse_log2)``, its backward
  ``flashop::attention_varlen_backward`` and the composites
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


def dropout_seed(q: Tensor, dropout_p: float) -> Optional[Tensor]:
    """The dropout seed of one call: an int64 tensor of one element drawn on q's device from
    torch's generator (a device tensor: no host sync, and a fresh draw on every compiled or
    CUDA-graph replayed call); None where ``dropout_p`` is 0."""
    if dropout_p == 0:
        return None
    return torch.randint(0, 2**62, (1,), device=q.device, dtype=torch.int64)


# window_size=None is (-1, -1): torch.library infers schemas only with None/scalar defaults
@_register("flashop::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                      alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None,
                      sinks: Optional[Tensor] = None, dropout_seed: Optional[Tensor] = None,
                      *, causal: bool = False, scale: Optional[float] = None,
                      window_size: Optional[Sequence[int]] = None, softcap: float = 0.0,
                      dropout_p: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    return run_forward(q, k, v, attn_mask, alibi_slopes, g, causal, scale, window_size,
                       softcap, sinks, dropout_seed, dropout_p)


def run_forward(q, k, v, attn_mask, alibi_slopes, g, causal, scale, window_size, softcap,
                sinks=None, dropout_seed=None, dropout_p=0.0):
    """attention_forward's body: checks, then the kernel; (out, lse, lse_log2)."""
    mods = _modifiers(attn_mask, alibi_slopes, g, causal, window_size, softcap, sinks,
                      dropout_p, dropout_seed)
    check_attention_inputs(q, k, v, scale, mods, interpreting=INTERPRETING)
    return launch.attention_forward(q, k, v, scale, mods)


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, attn_mask=None, alibi_slopes=None, g=None, sinks=None,
                            dropout_seed=None, *, causal=False, scale=None, window_size=None,
                            softcap=0.0, dropout_p=0.0):
    mods = _modifiers(attn_mask, alibi_slopes, g, causal, window_size, softcap, sinks,
                      dropout_p, dropout_seed)
    check_attention_inputs(q, k, v, scale, mods, interpreting=INTERPRETING)
    return launch.attention_forward_outputs(q, k, v)


@_register("flashop::attention_backward", mutates_args=())
def attention_backward(dout: Tensor, dlse: Tensor, q: Tensor, k: Tensor, v: Tensor,
                       out: Tensor, lse_log2: Tensor, attn_mask: Optional[Tensor] = None,
                       alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None,
                       dropout_seed: Optional[Tensor] = None, *, causal: bool = False,
                       scale: Optional[float] = None,
                       window_size: Optional[Sequence[int]] = None, softcap: float = 0.0,
                       dropout_p: float = 0.0, attn_mask_grad: bool = False
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return run_backward(dout, dlse, q, k, v, out, lse_log2, attn_mask, alibi_slopes, g,
                        dropout_seed, causal=causal, scale=scale, window_size=window_size,
                        softcap=softcap, dropout_p=dropout_p, attn_mask_grad=attn_mask_grad)


def run_backward(dout, dlse, q, k, v, out, lse_log2, attn_mask=None, alibi_slopes=None,
                 g=None, dropout_seed=None, *, causal=False, scale=None, window_size=None,
                 softcap=0.0, dropout_p=0.0, attn_mask_grad=False):
    """attention_backward's body: checks, then the kernels; (dq, dk, dv, dg, dattn_mask)."""
    mods = _modifiers(attn_mask, alibi_slopes, g, causal, window_size, softcap,
                      dropout_p=dropout_p, dropout_seed=dropout_seed)
    check_backward_inputs(dout, dlse, q, k, v, out, lse_log2, scale, mods, attn_mask_grad,
                          interpreting=INTERPRETING)
    return launch.attention_backward(dout, dlse, q, k, v, out, lse_log2, scale, mods,
                                     attn_mask_grad)


@attention_backward.register_fake
def _attention_backward_fake(dout, dlse, q, k, v, out, lse_log2, attn_mask=None,
                             alibi_slopes=None, g=None, dropout_seed=None, *, causal=False,
                             scale=None, window_size=None, softcap=0.0, dropout_p=0.0,
                             attn_mask_grad=False):
    mods = _modifiers(attn_mask, alibi_slopes, g, causal, window_size, softcap,
                      dropout_p=dropout_p, dropout_seed=dropout_seed)
    check_backward_inputs(dout, dlse, q, k, v, out, lse_log2, scale, mods, attn_mask_grad,
                          interpreting=INTERPRETING)
    return launch.attention_backward_outputs(q, k, v, g, attn_mask, attn_mask_grad)


_N_INPUTS = 8  # q, k, v, attn_mask, alibi_slopes, g, sinks, dropout_seed


def save_for_grads(ctx, inputs: tuple, out: Tensor, lse_log2: Tensor, kwargs: dict) -> None:
    """Save on ``ctx`` what attention_grads reads: the forward's tensor inputs (q, k, v,
    attn_mask, alibi_slopes, g, sinks, dropout_seed; trailing ones may be left out), out,
    lse_log2 and the keyword options."""
    inputs = tuple(inputs) + (None,) * (_N_INPUTS - len(inputs))
    q, k, v, attn_mask, alibi_slopes, g, sinks, seed = inputs
    ctx.save_for_backward(q, k, v, out, lse_log2, attn_mask, alibi_slopes, g, sinks, seed)
    ctx.kwargs = dict(kwargs)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    out, _, lse_log2 = output
    ctx.mark_non_differentiable(lse_log2)
    save_for_grads(ctx, inputs, out, lse_log2, keyword_only_inputs)


def attention_grads(saved: tuple, needs: tuple, kwargs: dict, dout: Tensor,
                    dlse: Tensor, direct: bool = False) -> tuple:
    """Gradients of (q, k, v, attn_mask, alibi_slopes, g, sinks, dropout_seed) through
    attention_backward (and launch.sink_grad), from the tensors save_for_grads saves and the
    inputs' ``needs_input_grad`` (shared with the Python API's direct eager path,
    flashop/api.py, which passes ``direct``: the operator's body is run without the
    dispatcher)."""
    q, k, v, out, lse_log2, attn_mask, alibi_slopes, g, sinks, seed = saved
    needs = tuple(needs) + (False,) * (_N_INPUTS - len(needs))
    if needs[4]:
        raise RuntimeError(
            "flashop.attention: alibi_slopes get no gradient (as in FlashAttention); detach "
            "them, or pass the ALiBi bias as a float attn_mask, whose gradient is computed")
    backward = run_backward if direct else torch.ops.flashop.attention_backward
    dq, dk, dv, dg, dmask = backward(dout, dlse, q, k, v, out, lse_log2, attn_mask,
                                     alibi_slopes, g, seed, attn_mask_grad=needs[3], **kwargs)
    dsinks = (launch.sink_grad(sinks, out, dout, lse_log2, dlse, g) if needs[6]
              else None)
    return (dq, dk, dv, dmask if needs[3] else None, None, dg if needs[5] else None, dsinks,
            None)


def _backward(ctx, dout, dlse, _):
    # the dispatcher drops trailing arguments left at their defaults (None)
    given = len(ctx.needs_input_grad)
    return attention_grads(ctx.saved_tensors, ctx.needs_input_grad, ctx.kwargs, dout,
                           dlse)[:given]


attention_forward.register_autograd(_backward, setup_context=_setup_context)

_lib = torch.library.Library("flashop", "FRAGMENT")
_ARGS = ("(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, Tensor? alibi_slopes=None, "
         "Tensor? g=None, Tensor? sinks=None, *, bool causal=False, float? scale=None, "
         "SymInt[]? window_size=None, float softcap=0.0, float dropout_p=0.0)")
_lib.define("attention_with_lse" + _ARGS + " -> (Tensor, Tensor)")
_lib.define("attention" + _ARGS + " -> Tensor")


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                       alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None,
                       sinks: Optional[Tensor] = None, *, causal: bool = False,
                       scale: Optional[float] = None,
                       window_size: Optional[Sequence[int]] = None, softcap: float = 0.0,
                       dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    out, lse, _ = torch.ops.flashop.attention_forward(
        q, k, v, attn_mask, alibi_slopes, g, sinks, dropout_seed(q, dropout_p),
        causal=causal, scale=scale, window_size=window_size, softcap=softcap,
        dropout_p=dropout_p)
    return out, lse


def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
              alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None,
              sinks: Optional[Tensor] = None, *, causal: bool = False,
              scale: Optional[float] = None, window_size: Optional[Sequence[int]] = None,
              softcap: float = 0.0, dropout_p: float = 0.0) -> Tensor:
    return torch.ops.flashop.attention_forward(
        q, k, v, attn_mask, alibi_slopes, g, sinks, dropout_seed(q, dropout_p),
        causal=causal, scale=scale, window_size=window_size, softcap=softcap,
        dropout_p=dropout_p)[0]


_lib.impl("attention_with_lse", attention_with_lse, "CompositeImplicitAutograd")
_lib.impl("attention", attention, "CompositeImplicitAutograd")


# --- packed variable-length batches ---------------------------------------------------------


def _packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Packing:
    return Packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


@_register("flashop::attention_varlen_forward", mutates_args=())
def attention_varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                             cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                             alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None,
                             sinks: Optional[Tensor] = None,
                             dropout_seed: Optional[Tensor] = None, *, causal: bool = False,
                             scale: Optional[float] = None,
                             window_size: Optional[Sequence[int]] = None, softcap: float = 0.0,
                             dropout_p: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    mods = _modifiers(None, alibi_slopes, g, causal, window_size, softcap, sinks, dropout_p,
                      dropout_seed)
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                        mods, interpreting=INTERPRETING)
    return launch.attention_forward(
        q, k, v, scale, mods, _packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


@attention_varlen_forward.register_fake
def _attention_varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, alibi_slopes=None, g=None, sinks=None,
                                   dropout_seed=None, *, causal=False, scale=None,
                                   window_size=None, softcap=0.0, dropout_p=0.0):
    mods = _modifiers(None, alibi_slopes, g, causal, window_size, softcap, sinks, dropout_p,
                      dropout_seed)
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                        mods, interpreting=INTERPRETING)
    return launch.attention_forward_outputs(q, k, v, packed=True)


@_register("flashop::attention_varlen_backward", mutates_args=())
def attention_varlen_backward(dout: Tensor, dlse: Tensor, q: Tensor, k: Tensor, v: Tensor,
                              out: Tensor, lse_log2: Tensor, cu_seqlens_q: Tensor,
                              cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                              alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None,
                              dropout_seed: Optional[Tensor] = None, *, causal: bool = False,
                              scale: Optional[float] = None,
                              window_size: Optional[Sequence[int]] = None, softcap: float = 0.0,
                              dropout_p: float = 0.0
                              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    mods = _modifiers(None, alibi_slopes, g, causal, window_size, softcap,
                      dropout_p=dropout_p, dropout_seed=dropout_seed)
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
                                    g=None, dropout_seed=None, *, causal=False, scale=None,
                                    window_size=None, softcap=0.0, dropout_p=0.0):
    mods = _modifiers(None, alibi_slopes, g, causal, window_size, softcap,
                      dropout_p=dropout_p, dropout_seed=dropout_seed)
    check_varlen_backward_inputs(dout, dlse, q, k, v, out, lse_log2, cu_seqlens_q,
                                 cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, mods,
                                 interpreting=INTERPRETING)
    return launch.attention_backward_outputs(q, k, v, g, None, False)[:4]


_N_VARLEN_INPUTS = 11  # q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes, g, sinks, seed


def _varlen_setup_context(ctx, inputs, keyword_only_inputs, output):
    inputs = tuple(inputs) + (None,) * (_N_VARLEN_INPUTS - len(inputs))
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, g, sinks,
     seed) = inputs
    out, _, lse_log2 = output
    ctx.mark_non_differentiable(lse_log2)
    ctx.save_for_backward(q, k, v, out, lse_log2, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                          g, sinks, seed)
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
    ctx.kwargs = dict(keyword_only_inputs)


def _varlen_backward(ctx, dout, dlse, _):
    (q, k, v, out, lse_log2, cu_seqlens_q, cu_seqlens_k, alibi_slopes, g, sinks,
     seed) = ctx.saved_tensors
    given = len(ctx.needs_input_grad)  # trailing arguments left at None are dropped
    needs = ctx.needs_input_grad + (False,) * (_N_VARLEN_INPUTS - given)
    if needs[7]:
        raise RuntimeError(
            "flashop.attention_varlen: alibi_slopes get no gradient (as in FlashAttention); "
            "detach them")
    dq, dk, dv, dg = torch.ops.flashop.attention_varlen_backward(
        dout, dlse, q, k, v, out, lse_log2, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens,
        alibi_slopes, g, seed, **ctx.kwargs)
    dsinks = (launch.sink_grad(sinks, out, dout, lse_log2, dlse, g,
                                Packing(cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens))
              if needs[9] else None)
    grads = (dq, dk, dv, None, None, None, None, None, dg if needs[8] else None, dsinks, None)
    return grads[:given]


attention_varlen_forward.register_autograd(_varlen_backward,
                                           setup_context=_varlen_setup_context)

_VARLEN_ARGS = ("(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                "SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? alibi_slopes=None, "
                "Tensor? g=None, Tensor? sinks=None, *, bool causal=False, float? scale=None, "
                "SymInt[]? window_size=None, float softcap=0.0, float dropout_p=0.0)")
_lib.define("attention_varlen_with_lse" + _VARLEN_ARGS + " -> (Tensor, Tensor)")
_lib.define("attention_varlen" + _VARLEN_ARGS + " -> Tensor")


def attention_varlen_with_lse(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                              cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                              alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None,
                              sinks: Optional[Tensor] = None, *, causal: bool = False,
                              scale: Optional[float] = None,
                              window_size: Optional[Sequence[int]] = None, softcap: float = 0.0,
                              dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    out, lse, _ = torch.ops.flashop.attention_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, g,
        sinks, dropout_seed(q, dropout_p), causal=causal, scale=scale,
        window_size=window_size, softcap=softcap, dropout_p=dropout_p)
    return out, lse


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None,
                     sinks: Optional[Tensor] = None, *, causal: bool = False,
                     scale: Optional[float] = None, window_size: Optional[Sequence[int]] = None,
                     softcap: float = 0.0, dropout_p: float = 0.0) -> Tensor:
    return torch.ops.flashop.attention_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, g,
        sinks, dropout_seed(q, dropout_p), causal=causal, scale=scale,
        window_size=window_size, softcap=softcap, dropout_p=dropout_p)[0]


_lib.impl("attention_varlen_with_lse", attention_varlen_with_lse, "CompositeImplicitAutograd")
_lib.impl("attention_varlen", attention_varlen, "CompositeImplicitAutograd")
