"""Shared test helpers: inputs, output poisoning, and the accuracy check."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

import flashop
from flashop.testing import check_attention

DEVICE = "cpu" if flashop.INTERPRETING else "cuda"


@dataclass(frozen=True)
class Case:
    """One attention problem: q (B, S_q, H_kv * G, D), k (B, S_k, H_kv, D), v (.., DV)."""

    B: int
    S_q: int
    S_k: int
    H_kv: int
    G: int
    D: int
    DV: int
    dtype: torch.dtype
    causal: bool = False
    scale: Optional[float] = None
    layout: str = "contiguous"  # "contiguous" | "bhsd" (heads-major storage) | "padded"

    @property
    def H(self) -> int:
        return self.H_kv * self.G


def _strided_randn(shape, dtype, layout, generator):
    """A (B, S, H, D) tensor of random normals stored in the given layout."""
    B, S, H, D = shape
    if layout == "bhsd":
        return torch.randn(B, H, S, D, dtype=dtype, device=DEVICE, generator=generator
                           ).transpose(1, 2)
    if layout == "padded":
        return torch.randn(B, S, H + 1, D + 3, dtype=dtype, device=DEVICE, generator=generator
                           )[:, :, 1:, :D]
    return torch.randn(shape, dtype=dtype, device=DEVICE, generator=generator)


def make_inputs(case: Case, seed: int = 0):
    """q, k, v (requiring grad) and the output cotangents dout, dlse."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = _strided_randn((case.B, case.S_q, case.H, case.D), case.dtype, case.layout, g)
    k = _strided_randn((case.B, case.S_k, case.H_kv, case.D), case.dtype, case.layout, g)
    v = _strided_randn((case.B, case.S_k, case.H_kv, case.DV), case.dtype, case.layout, g)
    dout = torch.randn(case.B, case.S_q, case.H, case.DV, dtype=case.dtype, device=DEVICE,
                       generator=g)
    dlse = torch.randn(case.B, case.H, case.S_q, dtype=torch.float32, device=DEVICE,
                       generator=g)
    return [t.requires_grad_() for t in (q, k, v)], dout, dlse


@contextlib.contextmanager
def poisoned_outputs():
    """Within this block torch.empty fills floating-point memory with NaN, so an element a
    kernel fails to write shows up as NaN (torch.utils.deterministic.fill_uninitialized_memory)."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def run_flashop(case: Case, inputs, dout, dlse):
    """out, lse and (dq, dk, dv) from flashop, with poisoned output memory."""
    with poisoned_outputs():
        out, lse = flashop.attention_with_lse(*inputs, causal=case.causal, scale=case.scale)
        grads = torch.autograd.grad((out, lse), inputs, (dout, dlse))
    return out, lse, grads


def check_case(case: Case, seed: int = 0):
    """Run flashop (outputs poisoned) and apply the accuracy rule (flashop.testing) to out,
    lse (2x) and dq, dk, dv (3x) against the fp64 reference and plain PyTorch in case.dtype."""
    inputs, dout, dlse = make_inputs(case, seed)
    out, lse, grads = run_flashop(case, inputs, dout, dlse)
    assert out.dtype == case.dtype and lse.dtype == torch.float32
    assert all(g.dtype == case.dtype for g in grads)
    for result in check_attention(*inputs, dout, dlse, out, lse, grads, causal=case.causal,
                                  scale=case.scale):
        assert result.ok, str(result)
