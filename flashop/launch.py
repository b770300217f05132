"""Launchers: choose tiles, allocate outputs, compute grids and launch the attention kernels.

Every kernel is launched through ``torch.library.wrap_triton`` so that, inside a
``triton_op``, Inductor sees the Triton kernels themselves. Under Triton's CPU interpreter
``wrap_triton`` hands back the interpreted kernel, which runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
from torch.library import wrap_triton
from triton.runtime.interpreter import InterpretedFunction

from flashop.kernels.backward import (
    attention_bwd_dkdv_kernel,
    attention_bwd_dq_kernel,
    attention_bwd_preprocess_kernel,
)
from flashop.kernels.common import LOG2E
from flashop.kernels.forward import attention_fwd_kernel

# Triton decides when a kernel is decorated whether it is interpreted (TRITON_INTERPRET=1).
INTERPRETING = isinstance(attention_fwd_kernel, InterpretedFunction)


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch options of one kernel."""

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int = 4
    num_stages: int = 1


# Under the interpreter every program runs one after another in numpy: small tiles keep the
# tests' sequences spanning several tiles, and BLOCK_M != BLOCK_N exercises the causal split.
_INTERPRETER_TILES = {
    "fwd": Tiles(32, 16),
    "dkdv": Tiles(16, 32),
    "dq": Tiles(32, 16),
}


# fp32 inputs take twice the shared memory of 16-bit ones: small tiles, one stage (the fp32
# path is for accuracy, not speed)
_FP32_TILES = {"fwd": Tiles(64, 32, 4, 1), "dkdv": Tiles(32, 32, 4, 1), "dq": Tiles(32, 32, 4, 1)}


def _gpu_tiles(kind: str, head_dim: int, device: torch.device) -> Tiles:
    """Tiles of 16-bit inputs per kernel and head dim, the fastest of benchmarks/tune.py's
    sweep on an H200 (docs/performance.md). GPUs before Hopper have less shared memory:
    smaller tiles at head dims above 128 there."""
    hopper = torch.cuda.get_device_capability(device)[0] >= 9
    if kind == "fwd":
        if head_dim <= 128:
            return Tiles(128, 64, 8, 3)
        return Tiles(128, 64, 8, 2) if hopper else Tiles(64, 32, 4, 2)
    if kind == "dkdv":
        if head_dim <= 64:
            return Tiles(32, 128, 4, 3)
        if head_dim <= 128:
            return Tiles(64, 64, 4, 2)
        return Tiles(64, 64, 8, 2) if hopper else Tiles(32, 64, 8, 1)
    # dq
    if head_dim <= 128:
        return Tiles(128, 64, 8, 3)
    return Tiles(64, 32, 4, 1)


def tiles_for(kind: str, head_dim: int, dtype: torch.dtype, device: torch.device) -> Tiles:
    if INTERPRETING:
        return _INTERPRETER_TILES[kind]
    if dtype == torch.float32:
        return _FP32_TILES[kind]
    return _gpu_tiles(kind, head_dim, device)


def _block_dim(d: int) -> int:
    """Head-dim block: the next power of two. tl.dot needs >= 16. On GPUs at least 64: with
    triton 3.6 on an H200 a 32-wide block holding DV=24 gave wrong outputs and illegal
    accesses in the forward (docs/performance.md), while masked 64-wide blocks are sound."""
    return max(16 if INTERPRETING else 64, triton.next_power_of_2(d))


def resolve_scale(scale: Optional[float], head_dim: int) -> float:
    return head_dim ** -0.5 if scale is None else float(scale)


def _kernel_args(q: torch.Tensor) -> dict:
    """Compile-time options that follow from the inputs' dtype."""
    return dict(
        # bf16 tl.dot is wrong under the interpreter: compute it on exact fp32 copies there
        UPCAST=INTERPRETING and q.dtype == torch.bfloat16,
        # fp32 inputs get full fp32 products, as torch.matmul's default (no TF32)
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


def _unit_stride_last(x: torch.Tensor) -> torch.Tensor:
    """The kernels index the head dim with unit stride; other strides are passed as they are.
    A tensor whose last dimension is strided is copied (the only copy the launchers make)."""
    if x.size(-1) > 1 and x.stride(-1) != 1:
        return x.contiguous()
    return x


def _check_offsets(*tensors: torch.Tensor) -> None:
    """The kernels offset rows within one (batch, head) slice in 32-bit integers."""
    for x in tensors:
        if x.shape[1] * x.stride(1) >= 2**31:
            raise ValueError(
                f"flashop.attention: a tensor of shape {tuple(x.shape)} and strides "
                f"{x.stride()} spans 2**31 elements or more along its sequence dimension, past "
                f"the kernels' 32-bit row offsets; split the sequence or the heads")


def _strides(x: torch.Tensor) -> tuple:
    """(batch, seq, head) strides of a (B, S, H, D) tensor."""
    return x.stride(0), x.stride(1), x.stride(2)


def attention_forward_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Allocate (out, lse) for the forward: out (B, S_q, H, DV) in q's dtype, lse (B, H, S_q)
    fp32, both contiguous. The real op and its fake both allocate here."""
    B, S_q, H, _ = q.shape
    out = q.new_empty((B, S_q, H, v.shape[-1]))
    lse = q.new_empty((B, H, S_q), dtype=torch.float32)
    return out, lse


def attention_backward_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Allocate (dq, dk, dv), contiguous, in the inputs' dtype."""
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def attention_forward(q, k, v, causal: bool, scale: Optional[float]):
    """Launch the forward; returns (out, lse)."""
    q, k, v = (_unit_stride_last(x) for x in (q, k, v))
    out, lse = attention_forward_outputs(q, k, v)
    _check_offsets(q, k, v, out)
    B, S_q, H, D = q.shape
    S_k, H_kv, DV = k.shape[1], k.shape[2], v.shape[3]
    if out.numel() == 0:
        return out, lse
    sm_scale = resolve_scale(scale, D)
    t = tiles_for("fwd", max(D, DV), q.dtype, q.device)
    grid = (triton.cdiv(S_q, t.BLOCK_M), H, B)
    wrap_triton(attention_fwd_kernel)[grid](
        q, k, v, out, lse,
        *_strides(q), *_strides(k), *_strides(v), *_strides(out),
        S_q, S_k, H, H // H_kv, sm_scale * LOG2E.value,
        D=D, DV=DV, BLOCK_D=_block_dim(D), BLOCK_DV=_block_dim(DV),
        BLOCK_M=t.BLOCK_M, BLOCK_N=t.BLOCK_N, IS_CAUSAL=causal, **_kernel_args(q),
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out, lse


def attention_backward(dout, dlse, q, k, v, out, lse, causal: bool, scale: Optional[float]):
    """Launch the backward; returns (dq, dk, dv)."""
    q, k, v, out, dout = (_unit_stride_last(x) for x in (q, k, v, out, dout))
    lse = lse.contiguous()  # (B, H, S_q) fp32: the kernels index it as contiguous
    dq, dk, dv = attention_backward_outputs(q, k, v)
    _check_offsets(q, k, v, out, dout)
    B, S_q, H, D = q.shape
    S_k, H_kv, DV = k.shape[1], k.shape[2], v.shape[3]
    if B == 0 or H == 0:
        return dq, dk, dv
    if S_q == 0 or S_k == 0:
        # nothing attends anything: every gradient is zero (dq needs writing when S_k == 0)
        return dq.zero_(), dk.zero_(), dv.zero_()
    sm_scale = resolve_scale(scale, D)
    delta = torch.empty_like(lse)
    BLOCK_D, BLOCK_DV = _block_dim(D), _block_dim(DV)
    common = dict(D=D, DV=DV, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, IS_CAUSAL=causal,
                  **_kernel_args(q))

    pre_block = 64 if not INTERPRETING else 32
    wrap_triton(attention_bwd_preprocess_kernel)[(triton.cdiv(S_q, pre_block), H, B)](
        out, dout, dlse, delta, *_strides(out), *_strides(dout), *dlse.stride(),
        S_q, H, DV=DV, BLOCK_DV=BLOCK_DV, BLOCK_M=pre_block,
    )
    # arguments the dK/dV and dQ kernels share: input strides, then lengths, heads and scales
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(dout))
    scalars = (S_q, S_k, H, H // H_kv, sm_scale, sm_scale * LOG2E.value)
    t = tiles_for("dkdv", max(D, DV), q.dtype, q.device)
    wrap_triton(attention_bwd_dkdv_kernel)[(triton.cdiv(S_k, t.BLOCK_N), H_kv, B)](
        q, k, v, dout, lse, delta, dk, dv, *strides, *_strides(dk), *_strides(dv), *scalars,
        BLOCK_M=t.BLOCK_M, BLOCK_N=t.BLOCK_N, **common,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    t = tiles_for("dq", max(D, DV), q.dtype, q.device)
    wrap_triton(attention_bwd_dq_kernel)[(triton.cdiv(S_q, t.BLOCK_M), H, B)](
        q, k, v, dout, lse, delta, dq, *strides, *_strides(dq), *scalars,
        BLOCK_M=t.BLOCK_M, BLOCK_N=t.BLOCK_N, **common,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return dq, dk, dv
