"""Registration of the ``torch.ops.flashop`` operators.

- ``flashop::attention_with_lse(q, k, v, *, causal, scale) -> (out, lse)``: the forward, with
  autograd through ``flashop::attention_backward``.
- ``flashop::attention_backward(dout, dlse, q, k, v, out, lse, *, causal, scale)
  -> (dq, dk, dv)``: the backward, reusing the forward's lse.
- ``flashop::attention(q, k, v, *, causal, scale) -> out``: CompositeImplicitAutograd over
  ``attention_with_lse``, so it traces into the same forward and backward.

On a GPU the two kernel ops are ``torch.library.triton_op``s, so Inductor sees into their
Triton kernels. Under Triton's CPU interpreter (TRITON_INTERPRET=1) a ``triton_op`` cannot
be traced (its kernels would run on fake tensors), so they are registered as opaque
``torch.library.custom_op``s; both registrations share the bodies, fakes and autograd below.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from flashop import launch
from flashop.validation import check_attention_inputs, check_backward_inputs

_register = torch.library.custom_op if launch.INTERPRETING else torch.library.triton_op


@_register("flashop::attention_with_lse", mutates_args=())
def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                       scale: Optional[float] = None) -> tuple[Tensor, Tensor]:
    check_attention_inputs(q, k, v, scale, interpreting=launch.INTERPRETING)
    return launch.attention_forward(q, k, v, causal, scale)


@attention_with_lse.register_fake
def _attention_with_lse_fake(q, k, v, *, causal=False, scale=None):
    check_attention_inputs(q, k, v, scale, interpreting=launch.INTERPRETING)
    return launch.attention_forward_outputs(q, k, v)


@_register("flashop::attention_backward", mutates_args=())
def attention_backward(dout: Tensor, dlse: Tensor, q: Tensor, k: Tensor, v: Tensor,
                       out: Tensor, lse: Tensor, *, causal: bool = False,
                       scale: Optional[float] = None) -> tuple[Tensor, Tensor, Tensor]:
    check_backward_inputs(dout, dlse, q, k, v, out, lse, scale,
                          interpreting=launch.INTERPRETING)
    return launch.attention_backward(dout, dlse, q, k, v, out, lse, causal, scale)


@attention_backward.register_fake
def _attention_backward_fake(dout, dlse, q, k, v, out, lse, *, causal=False, scale=None):
    check_backward_inputs(dout, dlse, q, k, v, out, lse, scale,
                          interpreting=launch.INTERPRETING)
    return launch.attention_backward_outputs(q, k, v)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal = keyword_only_inputs["causal"]
    ctx.scale = keyword_only_inputs["scale"]


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.flashop.attention_backward(
        dout, dlse, q, k, v, out, lse, causal=ctx.causal, scale=ctx.scale)
    return dq, dk, dv


attention_with_lse.register_autograd(_backward, setup_context=_setup_context)

_lib = torch.library.Library("flashop", "FRAGMENT")
_lib.define("attention(Tensor q, Tensor k, Tensor v, *, bool causal=False, float? scale=None)"
            " -> Tensor")


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
              scale: Optional[float] = None) -> Tensor:
    return torch.ops.flashop.attention_with_lse(q, k, v, causal=causal, scale=scale)[0]


_lib.impl("attention", attention, "CompositeImplicitAutograd")
