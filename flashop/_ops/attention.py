"""The attention operators: one forward and one backward for dense and packed batches.

- ``flashop::attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, attn_mask, alibi_slopes, g, sinks, dropout_seed, *, causal, scale,
  window_size_left, window_size_right, attention_chunk, softcap, dropout_p) -> (out, lse,
  lse_log2)``: the
  forward kernels, with autograd through ``flashop::attention_backward``. A dense batch
  leaves the four packing arguments None: q (B, S_q, H, D), lse (B, H, S_q). A packed batch
  (flash_attn_varlen's layout) passes all four: q (total_q, H, D), lse (H, total_q).
  ``lse_log2`` is lse in base 2 as the kernel computed it, without the queries' gate, kept
  for the backward (not differentiable): converting the natural-log lse back would cost the
  recomputed probabilities about 1e-5 of relative accuracy at scores of a few hundred.
  ``dropout_seed`` (int64, one element) is required where ``dropout_p > 0``: the composites
  draw it. The window is two ints, -1 unbounded (FlashAttention-3's and aten's spelling);
  ``attention_chunk`` an int, 0 off (FlashAttention-3's chunked attention).
- ``flashop::attention_backward(dout, dlse, q, k, v, out, lse_log2, cu_seqlens_q,
  cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_mask, alibi_slopes, g, dropout_seed, *,
  ..., dropout_p, attn_mask_grad) -> (dq, dk, dv, dg, dattn_mask)``: the backward kernels,
  reusing the forward's ``lse_log2`` (which includes the sinks, so the backward takes none)
  and its dropout seed; ``dg`` / ``dattn_mask`` are empty where there is no gate / no mask
  gradient. The sinks' gradient is computed by the autograd formula from lse_log2 and delta
  (flashop._launch.attention.sink_grad).
- ``flashop::attention_with_lse`` (-> (out, lse)) and ``flashop::attention`` (-> out) over a
  dense batch, ``flashop::attention_varlen_with_lse`` and ``flashop::attention_varlen`` over
  a packed one: CompositeImplicitAutograd over ``attention_forward``, so they trace into the
  same forward and backward; where ``dropout_p > 0`` they draw the dropout seed from torch's
  generator of q's device (dropout_seed), so ``torch.manual_seed`` makes runs reproducible
  and compiled graphs and CUDA graph replays draw a fresh one each call.

The optional tensors are positional-or-keyword: custom ops take no keyword-only tensors.

On a GPU the kernel ops are ``torch.library.triton_op``s, so Inductor sees into their
Triton kernels. Under Triton's CPU interpreter (TRITON_INTERPRET=1) a ``triton_op`` cannot
be traced (its kernels would run on fake tensors), so they are registered as opaque
``torch.library.custom_op``s; both registrations share the bodies, fakes and autograd below.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import (
    register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count,
)

from flashop._launch import attention as launch, choice
from flashop._launch.plans import PlannedBody
from flashop._launch.options import Modifiers, Packing, modifiers, packing
from flashop._ops import autocast
from flashop._ops.checks import (
    check_attention_inputs, check_backward_inputs, check_packing_arguments,
)
from flashop.kernels import INTERPRETING

_register = torch.library.custom_op if INTERPRETING else torch.library.triton_op

# the forward's inputs, in its schema's order
FORWARD_INPUTS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                  "max_seqlen_k", "attn_mask", "alibi_slopes", "g", "sinks", "dropout_seed")
# the tensors autograd saves (the forward's but the two lengths, then its out and lse_log2)
_SAVED = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "attn_mask", "alibi_slopes", "g",
          "sinks", "dropout_seed", "out", "lse_log2")


def dropout_seed(q: Tensor, dropout_p: float) -> Optional[Tensor]:
    """The dropout seed of one call: an int64 tensor of one element drawn on q's device from
    torch's generator (a device tensor: no host sync, and a fresh draw on every compiled or
    CUDA-graph replayed call); None where ``dropout_p`` is 0."""
    if dropout_p == 0:
        return None
    return torch.randint(0, 2**62, (1,), device=q.device, dtype=torch.int64)


def _call(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
          attn_mask=None, alibi_slopes=None, g=None, sinks=None, dropout_seed=None, *,
          causal=False, scale=None, window_size_left=-1, window_size_right=-1,
          attention_chunk=0, softcap=0.0, dropout_p=0.0, deterministic=False
          ) -> tuple[Modifiers, Optional[Packing]]:
    """A forward call's modifiers and packing (None: dense), checked (``deterministic``
    concerns the backward alone)."""
    check_packing_arguments("flashop.attention_forward", cu_seqlens_q, cu_seqlens_k,
                            max_seqlen_q, max_seqlen_k)
    mods = modifiers(attn_mask, alibi_slopes, g, causal, window_size_left, window_size_right,
                     softcap, sinks, dropout_p, dropout_seed, attention_chunk=attention_chunk)
    packed = packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    check_attention_inputs(q, k, v, scale, mods, packed)
    return mods, packed


@_register("flashop::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor] = None,
                      cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
                      max_seqlen_k: Optional[int] = None, attn_mask: Optional[Tensor] = None,
                      alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None,
                      sinks: Optional[Tensor] = None, dropout_seed: Optional[Tensor] = None,
                      *, causal: bool = False, scale: Optional[float] = None,
                      window_size_left: int = -1, window_size_right: int = -1,
                      attention_chunk: int = 0, softcap: float = 0.0, dropout_p: float = 0.0,
                      deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    return run_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       attn_mask, alibi_slopes, g, sinks, dropout_seed, causal=causal,
                       scale=scale, window_size_left=window_size_left,
                       window_size_right=window_size_right, attention_chunk=attention_chunk,
                       softcap=softcap, dropout_p=dropout_p, deterministic=deterministic)


def run_forward(q, k, v, *args, scale=None, **options):
    """attention_forward's body (its arguments): checks, then the kernels; (out, lse,
    lse_log2). A traced call whose eager call takes what Inductor cannot trace (the Gluon
    kernel, in a graph compiled here; the CPU path, which reads values on the host) calls
    it through attention_forward_opaque."""
    mods, packed = _call(q, k, v, *args, scale=scale, **options)
    if choice.forward_runs_opaque(q, k, v, scale, mods, packed):
        return torch.ops.flashop.attention_forward_opaque(q, k, v, *args, scale=scale,
                                                          **options)
    return launch.attention_forward(q, k, v, scale, mods, packed)


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, *args, **options):
    _, packed = _call(q, k, v, *args, **options)
    return launch.attention_forward_outputs(q, k, v, packed=packed is not None)


def _backward_call(dout, dlse, q, k, v, out, lse_log2, cu_seqlens_q=None, cu_seqlens_k=None,
                   max_seqlen_q=None, max_seqlen_k=None, attn_mask=None, alibi_slopes=None,
                   g=None, dropout_seed=None, *, causal=False, scale=None,
                   window_size_left=-1, window_size_right=-1, attention_chunk=0, softcap=0.0,
                   dropout_p=0.0, attn_mask_grad=False, deterministic=False
                   ) -> tuple[Modifiers, Optional[Packing]]:
    """A backward call's modifiers and packing (None: dense), checked."""
    check_packing_arguments("flashop.attention_backward", cu_seqlens_q, cu_seqlens_k,
                            max_seqlen_q, max_seqlen_k)
    mods = modifiers(attn_mask, alibi_slopes, g, causal, window_size_left, window_size_right,
                     softcap, dropout_p=dropout_p, dropout_seed=dropout_seed,
                     attention_chunk=attention_chunk)
    packed = packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    check_backward_inputs(dout, dlse, q, k, v, out, lse_log2, scale, mods, attn_mask_grad,
                          packed)
    return mods, packed


@_register("flashop::attention_backward", mutates_args=())
def attention_backward(dout: Tensor, dlse: Tensor, q: Tensor, k: Tensor, v: Tensor,
                       out: Tensor, lse_log2: Tensor, cu_seqlens_q: Optional[Tensor] = None,
                       cu_seqlens_k: Optional[Tensor] = None,
                       max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                       attn_mask: Optional[Tensor] = None,
                       alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None,
                       dropout_seed: Optional[Tensor] = None, *, causal: bool = False,
                       scale: Optional[float] = None, window_size_left: int = -1,
                       window_size_right: int = -1, attention_chunk: int = 0,
                       softcap: float = 0.0, dropout_p: float = 0.0,
                       attn_mask_grad: bool = False, deterministic: bool = False
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return run_backward(dout, dlse, q, k, v, out, lse_log2, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q, max_seqlen_k, attn_mask, alibi_slopes, g, dropout_seed,
                        causal=causal, scale=scale, window_size_left=window_size_left,
                        window_size_right=window_size_right, attention_chunk=attention_chunk,
                        softcap=softcap, dropout_p=dropout_p, attn_mask_grad=attn_mask_grad,
                        deterministic=deterministic)


def run_backward(dout, dlse, q, k, v, out, lse_log2, *args, scale=None, attn_mask_grad=False,
                 deterministic=False, **options):
    """attention_backward's body (its arguments): checks, then the kernels; (dq, dk, dv, dg,
    dattn_mask). As run_forward, through attention_backward_opaque where a traced call's
    eager call takes the Gluon backward or the CPU path; ``deterministic`` is resolved where
    the call is traced (choice.deterministic_backward: torch.use_deterministic_algorithms as
    then)."""
    mods, packed = _backward_call(dout, dlse, q, k, v, out, lse_log2, *args, scale=scale,
                                  attn_mask_grad=attn_mask_grad, **options)
    deterministic = choice.deterministic_backward(deterministic)
    if choice.backward_runs_opaque(q, k, v, dout, mods, attn_mask_grad, packed,
                                   deterministic):
        return torch.ops.flashop.attention_backward_opaque(
            dout, dlse, q, k, v, out, lse_log2, *args, scale=scale,
            attn_mask_grad=attn_mask_grad, deterministic=deterministic, **options)
    return launch.attention_backward(dout, dlse, q, k, v, out, lse_log2, scale, mods,
                                     attn_mask_grad, packed, deterministic)


@attention_backward.register_fake
def _attention_backward_fake(dout, dlse, q, k, v, out, lse_log2, *args, attn_mask_grad=False,
                             **options):
    mods, _ = _backward_call(dout, dlse, q, k, v, out, lse_log2, *args,
                             attn_mask_grad=attn_mask_grad, **options)
    return launch.attention_backward_outputs(q, k, v, mods.g, mods.attn_mask, attn_mask_grad)


# --- the eager kernels in compiled graphs -----------------------------------------------------

_lib = torch.library.Library("flashop", "FRAGMENT")


# the forward's and backward's bodies as eager calls run them: by plans made once per
# signature of calls (plans.PlannedBody), for the direct eager path (flashop/_ops/eager.py)
# and the opaque operators
planned_forward = PlannedBody(run_forward)
planned_backward = PlannedBody(run_backward)


def register_opaque(name: str, body, fake) -> None:
    """``flashop::<name>_opaque``: the operator ``name``'s schema, its body run as an eager
    call runs it (by its plans, the kernels launched directly, not through wrap_triton), and
    its fake.
    Opaque to Inductor, which calls it as it is: a compiled graph reaches what Inductor
    cannot trace (the Gluon kernels; the CPU path) through it, and keeps fullgraph, dynamic
    shapes and CUDA graphs. Graphs exported for a GPU never hold it (gluon.compiled_here);
    traced calls of CPU tensors always do (cpu.traced)."""
    schema = str(getattr(torch.ops.flashop, name).default._schema)
    _lib.define(f"{name}_opaque{schema[schema.index('('):]}")

    _lib.impl(f"{name}_opaque", body, "CompositeExplicitAutograd")
    torch.library.register_fake(f"flashop::{name}_opaque", fake, lib=_lib)


register_opaque("attention_forward", planned_forward, _attention_forward_fake)
register_opaque("attention_backward", planned_backward, _attention_backward_fake)


# --- autograd ---------------------------------------------------------------------------------


def register_forward_only(op, message: str) -> None:
    """Autograd for a forward-only operator: a backward through its outputs raises
    ``message`` (a RuntimeError); nothing is saved."""
    def backward(ctx, *grads):
        raise RuntimeError(message)

    def setup_context(ctx, inputs, keyword_only_inputs, output):
        pass

    op.register_autograd(backward, setup_context=setup_context)


def save_for_grads(ctx, inputs: tuple, out: Tensor, lse_log2: Tensor, options: dict) -> None:
    """Save on ``ctx`` what attention_grads reads: the forward's inputs (in FORWARD_INPUTS'
    order; trailing ones may be left out), out, lse_log2 and the keyword options."""
    given = dict(zip(FORWARD_INPUTS, inputs), out=out, lse_log2=lse_log2)
    ctx.save_for_backward(*[given.get(name) for name in _SAVED])
    ctx.max_seqlens = (given.get("max_seqlen_q"), given.get("max_seqlen_k"))
    ctx.options = dict(options)


def attention_grads(ctx, saved: tuple, dout: Tensor, dlse: Tensor,
                    backward: Optional[Callable] = None) -> tuple:
    """The gradients of the forward's inputs (in FORWARD_INPUTS' order, None where none is
    needed) through attention_backward and the sinks' formula (launch.sink_grad), from what
    save_for_grads saved on ``ctx`` (``saved``: its saved tensors) and its
    ``needs_input_grad``. Shared with the eager path (flashop/_ops/eager.py), which passes
    the ``backward`` to run instead of the operator: its body, without the dispatcher."""
    saved = dict(zip(_SAVED, saved))
    needs = dict(zip(FORWARD_INPUTS, ctx.needs_input_grad))
    dense = saved["cu_seqlens_q"] is None
    if needs.get("alibi_slopes"):
        hint = (", or pass the ALiBi bias as a float attn_mask, whose gradient is computed"
                if dense else "")
        raise RuntimeError(
            f"flashop.attention{'' if dense else '_varlen'}: alibi_slopes get no gradient (as "
            f"in FlashAttention); detach them{hint}")
    backward = backward or torch.ops.flashop.attention_backward
    mask_grad = bool(needs.get("attn_mask"))
    dq, dk, dv, dg, dmask = backward(
        dout, dlse, saved["q"], saved["k"], saved["v"], saved["out"], saved["lse_log2"],
        saved["cu_seqlens_q"], saved["cu_seqlens_k"], *ctx.max_seqlens, saved["attn_mask"],
        saved["alibi_slopes"], saved["g"], saved["dropout_seed"], attn_mask_grad=mask_grad,
        **ctx.options)
    grads = dict(q=dq, k=dk, v=dv, attn_mask=dmask if mask_grad else None,
                 g=dg if needs.get("g") else None)
    if needs.get("sinks"):
        packed = None if dense else Packing(saved["cu_seqlens_q"], saved["cu_seqlens_k"],
                                            *ctx.max_seqlens)
        grads["sinks"] = launch.sink_grad(saved["sinks"], saved["out"], dout,
                                          saved["lse_log2"], dlse, saved["g"], packed)
    return tuple([grads.get(name) for name in FORWARD_INPUTS])


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    out, _, lse_log2 = output
    ctx.mark_non_differentiable(lse_log2)
    save_for_grads(ctx, inputs, out, lse_log2, keyword_only_inputs)


def _backward(ctx, dout, dlse, _):
    # the dispatcher drops trailing arguments left at their defaults (None)
    return attention_grads(ctx, ctx.saved_tensors, dout, dlse)[:len(ctx.needs_input_grad)]


attention_forward.register_autograd(_backward, setup_context=_setup_context)


# --- the composites ---------------------------------------------------------------------------


def _out_and_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_mask,
                 alibi_slopes, g, sinks, *, dropout_p=0.0, **options) -> tuple[Tensor, Tensor]:
    out, lse, _ = torch.ops.flashop.attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_mask,
        alibi_slopes, g, sinks, dropout_seed(q, dropout_p), dropout_p=dropout_p, **options)
    return out, lse


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                       alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None,
                       sinks: Optional[Tensor] = None, **options) -> tuple[Tensor, Tensor]:
    return _out_and_lse(q, k, v, None, None, None, None, attn_mask, alibi_slopes, g, sinks,
                        **options)


def attention(q: Tensor, k: Tensor, v: Tensor, *args, **options) -> Tensor:
    return attention_with_lse(q, k, v, *args, **options)[0]


def attention_varlen_with_lse(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                              cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                              alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None,
                              sinks: Optional[Tensor] = None, **options
                              ) -> tuple[Tensor, Tensor]:
    return _out_and_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None,
                        alibi_slopes, g, sinks, **options)


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, *args, **options) -> Tensor:
    return attention_varlen_with_lse(q, k, v, *args, **options)[0]


_OPTIONS = ("*, bool causal=False, float? scale=None, SymInt window_size_left=-1, "
            "SymInt window_size_right=-1, SymInt attention_chunk=0, float softcap=0., "
            "float dropout_p=0., bool deterministic=False)")
_DENSE = ("(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, Tensor? alibi_slopes=None, "
          "Tensor? g=None, Tensor? sinks=None, ")
_PACKED = ("(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
           "SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? alibi_slopes=None, "
           "Tensor? g=None, Tensor? sinks=None, ")
autocast.register(_lib, "attention_forward")
for _fn, _args, _returns in ((attention_with_lse, _DENSE, "(Tensor, Tensor)"),
                             (attention, _DENSE, "Tensor"),
                             (attention_varlen_with_lse, _PACKED, "(Tensor, Tensor)"),
                             (attention_varlen, _PACKED, "Tensor")):
    _lib.define(_fn.__name__ + _args + _OPTIONS + " -> " + _returns)
    _lib.impl(_fn.__name__, _fn, "CompositeImplicitAutograd")


# --- FLOP counting ----------------------------------------------------------------------------


def values(x: Tensor) -> Optional[list]:
    """``x``'s values as a list (FLOP counting reads lengths); None where it has none (a
    fake, functional or meta tensor, as while tracing)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    if isinstance(x, (FakeTensor, FunctionalTensor)) or x.is_meta:
        return None
    return x.tolist()


def _lengths(cu_seqlens: Tensor, longest: int) -> list:
    """Each packed sequence's length; the longest for each where the offsets have no values
    (a bound)."""
    offsets = values(cu_seqlens)
    if offsets is None:
        return [longest] * (cu_seqlens.shape[0] - 1)
    return [end - start for start, end in zip(offsets, offsets[1:])]


def bhsd_shapes(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q=None, cu_seqlens_k=None,
                max_seqlen_q=None, max_seqlen_k=None):
    """(q, k, v) shapes in SDPA's (B, H, S, D) layout: the batch's, or each packed sequence's
    (flop_counter's formulas take those), k and v with q's heads (grouped-query heads each
    do a query head's work; torch<2.13's formulas refuse fewer key/value heads)."""
    if cu_seqlens_q is None:
        B, S_q, H, D = q.shape
        yield (B, H, S_q, D), (B, H, k.shape[1], D), (B, H, v.shape[1], v.shape[3])
        return
    H = q.shape[1]
    for s_q, s_k in zip(_lengths(cu_seqlens_q, max_seqlen_q),
                        _lengths(cu_seqlens_k, max_seqlen_k)):
        yield (1, H, s_q, q.shape[2]), (1, H, s_k, k.shape[2]), (1, H, s_k, v.shape[2])


@register_flop_formula(torch.ops.flashop.attention_forward, get_raw=True)
def _forward_flops(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                   max_seqlen_k=None, *args, out_val=None, **options) -> int:
    """SDPA's count (torch.utils.flop_counter): the two products over every (query, key)
    pair, causal or windowed or not, per sequence of a packed batch."""
    return sum(sdpa_flop_count(*shapes) for shapes in bhsd_shapes(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


@register_flop_formula(torch.ops.flashop.attention_backward, get_raw=True)
def _backward_flops(dout, dlse, q, k, v, out, lse_log2, cu_seqlens_q=None, cu_seqlens_k=None,
                    max_seqlen_q=None, max_seqlen_k=None, *args, out_val=None,
                    **options) -> int:
    """SDPA's backward count: five products over every (query, key) pair (the scores
    recomputed, dP, dV, dQ, dK), as the forward's."""
    return sum(sdpa_backward_flop_count((*qs[:3], vs[3]), qs, ks, vs)
               for qs, ks, vs in bhsd_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                             max_seqlen_q, max_seqlen_k))
