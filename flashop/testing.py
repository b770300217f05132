"""The accuracy rule flashop is held to, shared by the tests and ``python -m flashop``.

flashop's largest error to a float64 reference must be at most ``factor`` (2 for outputs,
3 for gradients) times the largest error of plain PyTorch computing in the inputs' dtype,
plus ``rounding_noise``: FlashAttention's test rule. Plain PyTorch holds the modifiers (ALiBi
slopes, the gate's cumulative sum, a float mask, the sinks) in fp32 and rounds each row's
scores to the inputs' dtype for the softmax (``attention_reference`` with
``compute_dtype=None``; docs/testing.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashop.reference import attention_reference, attention_varlen_reference


def rounding_noise(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """The rule's tiny absolute term: two units of rounding of ``dtype`` at the reference's
    magnitude (+0.3, as FlashAttention-3's tests). For fp32 inputs the unit is 16 fp32 ulps:
    the kernels reduce over the head dim and the keys in another order than PyTorch
    (delta = rowsum(dO * O) and dP = dO V^T cancel in a different order)."""
    unit = max(torch.finfo(dtype).eps, 16 * torch.finfo(torch.float32).eps)
    return 2 * unit * (ref.abs().max().item() + 0.3)


@dataclass
class Accuracy:
    name: str
    error: float  # flashop's max |error| to the reference
    plain_error: float  # plain PyTorch's max |error| in the same dtype
    bound: float  # factor * plain_error + rounding noise
    infinities_match: bool

    @property
    def ok(self) -> bool:
        return self.infinities_match and self.error <= self.bound  # False for NaN errors

    def __str__(self) -> str:
        if not self.infinities_match:
            return f"{self.name}: infinities (or NaNs) differ from the reference"
        return (f"{self.name}: max error {self.error:.3e}, bound {self.bound:.3e} "
                f"(plain PyTorch {self.plain_error:.3e})")


def accuracy(name: str, actual: torch.Tensor, ref: torch.Tensor, plain: torch.Tensor,
             factor: float, dtype: torch.dtype) -> Accuracy:
    """Apply the rule; infinite reference entries (lse -inf) must be matched exactly."""
    if actual.shape != ref.shape:
        raise ValueError(f"{name}: shape {tuple(actual.shape)} != {tuple(ref.shape)}")
    actual, ref, plain = actual.double(), ref.double(), plain.double()
    inf = torch.isinf(ref)
    match = torch.equal(torch.isinf(actual), inf) and torch.equal(actual[inf], ref[inf])
    actual, ref, plain = actual[~inf], ref[~inf], plain[~inf]
    if ref.numel() == 0:
        return Accuracy(name, 0.0, 0.0, 0.0, match)
    error = (actual - ref).abs().max().item()
    plain_error = (plain - ref).abs().max().item()
    bound = factor * plain_error + rounding_noise(ref, dtype)
    return Accuracy(name, error, plain_error, bound, match)


def differentiable_inputs(q, k, v, attn_mask=None, g=None, sinks=None) -> dict:
    """The inputs flashop differentiates, by gradient name: q, k, v, then g, a float
    attn_mask and sinks where they require grad."""
    inputs = {"dq": q, "dk": k, "dv": v}
    if g is not None and g.requires_grad:
        inputs["dg"] = g
    if attn_mask is not None and attn_mask.requires_grad:
        inputs["dattn_mask"] = attn_mask
    if sinks is not None and sinks.requires_grad:
        inputs["dsinks"] = sinks
    return inputs


def check_attention(q, k, v, dout, dlse, out, lse, grads, attn_mask=None, alibi_slopes=None,
                    g=None, sinks=None, **options) -> list[Accuracy]:
    """The rule applied to flashop's ``out``, ``lse`` (2x) and ``grads`` (3x; in the order of
    :func:`differentiable_inputs`), given the cotangents ``dout`` and ``dlse`` they were
    computed with, against the float64 reference and plain PyTorch in the inputs' dtype
    (its modifiers in fp32).
    ``options`` are the keyword options of ``flashop.attention`` (causal, scale, ...; with
    ``dropout_p``, also the reference's ``dropout_mask``: :func:`dropout_mask`)."""
    return _apply_rule(
        lambda dtype: attention_reference(q, k, v, attn_mask, alibi_slopes, g, sinks,
                                          compute_dtype=dtype, **options),
        differentiable_inputs(q, k, v, attn_mask, g, sinks), dout, dlse, out, lse, grads)


def check_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, dout, dlse, out, lse, grads,
                           alibi_slopes=None, g=None, sinks=None, **options) -> list[Accuracy]:
    """:func:`check_attention` for a packed batch, against the reference of each sequence."""
    return _apply_rule(
        lambda dtype: attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                 alibi_slopes=alibi_slopes, g=g, sinks=sinks,
                                                 compute_dtype=dtype, **options),
        differentiable_inputs(q, k, v, None, g, sinks), dout, dlse, out, lse, grads)


def dropout_mask(dropout_seed: torch.Tensor, B: int, H: int, S_q: int, S_k: int,
                 dropout_p: float) -> torch.Tensor:
    """The (B, H, S_q, S_k) boolean keep-mask flashop's kernels draw for the seed tensor
    ``dropout_seed`` (int64, one element, as ``torch.ops.flashop.attention_forward`` takes
    it) and ``dropout_p``: pair (i, j) of head h of batch entry b is kept where True. For a
    packed batch, sequence b's mask is [b, :, :len_q, :len_k] of the longest lengths'."""
    from flashop._launch import attention as launch
    from flashop._launch.options import modifiers

    mods = modifiers(dropout_p=dropout_p, dropout_seed=dropout_seed)  # p as the kernels draw it
    return launch.dropout_mask(dropout_seed, B, H, S_q, S_k, mods.dropout_p)


def _apply_rule(reference, inputs, dout, dlse, out, lse, grads) -> list[Accuracy]:
    """``reference(compute_dtype)`` gives (out, lse) differentiable in ``inputs``."""
    refs = []
    for compute_dtype in (torch.float64, None):
        o, l = reference(compute_dtype)
        gr = torch.autograd.grad((o, l), tuple(inputs.values()),
                                 (dout.to(o.dtype), dlse.to(l.dtype)), allow_unused=True)
        gr = [torch.zeros_like(x) if d is None else d for d, x in zip(gr, inputs.values())]
        refs.append((o, l, *gr))
    names = ("out", "lse", *inputs)
    factors = (2, 2) + (3,) * len(inputs)
    dtype = inputs["dq"].dtype
    # (sinks in fp32 with 16-bit inputs: their gradient is held to the inputs' precision)
    return [accuracy(name, actual, ref, plain, factor, dtype)
            for name, factor, actual, ref, plain in zip(
                names, factors, (out, lse, *grads), refs[0], refs[1])]
