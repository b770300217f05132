"""Launcher of the Gluon forward (flashop/kernels/forward_gluon.py): when it serves a call,
the inputs as its descriptors read them, and the launch.

The Gluon kernel is written for one Triton release (GLUON_TRITON): under any other, and
under Triton's interpreter, its module is never imported and every call takes the ``tl``
kernels. It serves eager calls (and CUDA graphs captured from them). A traced call
(``torch.compile``, ``torch.export``) keeps the ``tl`` kernels, which Inductor compiles
with the rest of the graph.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton

from flashop import config
from flashop.kernels import INTERPRETING
from flashop.launch_common import cdiv, is_hopper, tma_aligned

# triton==3.6: the Gluon API the kernel is written against
GLUON_TRITON = (3, 6)
BLOCK_M = BLOCK_N = 128
STAGES = 3
CONSUMER_REGS, LOAD_REGS = 232, 24
HEAD_DIMS = (128,)
# The default rule (config.settings.gluon unset): causal calls, and calls over at least
# GLUON_MIN_KEYS keys, where it measured faster than the tl kernels
GLUON_MIN_KEYS = 16384


def triton_version() -> tuple:
    return tuple(int(part) for part in triton.__version__.split(".")[:2])


@functools.lru_cache(maxsize=None)
def available(device: torch.device) -> bool:
    """Whether the Gluon kernel can run on ``device``: the Triton release it was written
    for, not interpreting, a Hopper GPU (sm_90; its wgmma and TMA are Hopper's)."""
    return (not INTERPRETING and triton_version() == GLUON_TRITON and device.type == "cuda"
            and is_hopper(device) and torch.cuda.get_device_capability(device) == (9, 0))


@functools.lru_cache(maxsize=None)
def _kernel():
    from flashop.kernels.forward_gluon import attention_fwd_gluon_kernel
    return attention_fwd_gluon_kernel


def rows_view(x: torch.Tensor, S: int) -> Optional[tuple]:
    """``x`` (B, S, H, D) as one 2-D array of rows for a descriptor: (shape, strides, row_b,
    row_h, col_h), where position i of (batch b, head h) is row ``b * row_b + h * row_h + i``
    from column ``h * col_h``; None where x is neither head-major ((batch, head) slices of S
    rows one after another) nor sequence-major ((batch, position) rows holding the H heads
    side by side)."""
    B, _, H, D = x.shape
    sb, ss, sh, sd = x.stride()
    if sd != 1:
        return None
    if (H == 1 or sh == D) and (B == 1 or sb == S * ss):  # sequence-major
        return [B * S, H * D], [ss, 1], S, 0, D
    if (H == 1 or sh == S * ss) and (B == 1 or sb == H * S * ss):  # head-major
        return [B * H * S, D], [ss, 1], H * S, S, 0
    return None


def _is_traced(x: torch.Tensor) -> bool:
    """Whether ``x`` is a tracer's stand-in (fake or functional tensor) rather than data."""
    return type(x) not in (torch.Tensor, torch.nn.Parameter) or torch.compiler.is_compiling()


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, qk_scale: float,
           plain: bool) -> bool:
    """Whether the Gluon kernel takes this forward: where available, an eager call of the
    plain forward (``plain``: no modifier, no sinks, no dropout, dense; ``causal`` the only
    bound) with 16-bit inputs, D == DV in HEAD_DIMS, qk_scale > 0, S_k a multiple of
    BLOCK_N, S_q == S_k where causal, inputs its descriptors can address; and unless the
    switch forces it, causal or over at least GLUON_MIN_KEYS keys."""
    setting = config.settings.gluon
    if setting is False or not plain or not available(q.device):
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or _is_traced(q):
        return False
    (B, S_q, H, D), S_k, DV = q.shape, k.shape[1], v.shape[-1]
    if D != DV or D not in HEAD_DIMS or qk_scale <= 0 or S_k == 0 or S_k % BLOCK_N:
        return False
    if causal and S_q != S_k:
        return False
    if setting is None and not (causal or S_k >= GLUON_MIN_KEYS):
        return False
    views = [rows_view(x, n) for x, n in ((q, S_q), (k, S_k), (v, S_k))]
    return (all(view is not None and view[0][0] < 2**31 for view in views)
            and all(tma_aligned(x) for x in (q, k, v)))


def _descriptor(x: torch.Tensor, S: int, block_rows: int):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    shape, strides, row_b, row_h, col_h = rows_view(x, S)
    D = x.shape[-1]
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([block_rows, D], dtype)
    return TensorDescriptor(x, shape, strides, [block_rows, D], layout), (row_b, row_h, col_h)


def attention_forward(q, k, v, out, lse, lse_log2, causal: bool, qk_scale: float) -> None:
    """Launch the Gluon forward into ``out`` (B, S_q, H, DV), ``lse`` and ``lse_log2``
    (B, H, S_q), where serves() said it takes the call."""
    B, S_q, H, D = q.shape
    S_k, H_kv, DV = k.shape[1], k.shape[2], v.shape[-1]
    q_desc, (q_rb, q_rh, q_ch) = _descriptor(q, S_q, BLOCK_M)
    k_desc, (k_rb, k_rh, k_ch) = _descriptor(k, S_k, BLOCK_N)
    v_desc, (v_rb, v_rh, v_ch) = _descriptor(v, S_k, BLOCK_N)
    sob, sos, soh, sod = out.stride()
    _kernel()[(cdiv(S_q, BLOCK_M), B * H)](
        q_desc, k_desc, v_desc, out, lse, lse_log2,
        q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch,
        sob, sos, soh, sod, lse.stride(0), lse.stride(1),
        S_q, S_k, H, H // H_kv, qk_scale,
        D=D, DV=DV, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES, CAUSAL=causal,
        CONSUMER_REGS=CONSUMER_REGS, LOAD_REGS=LOAD_REGS, num_warps=4)
