"""Helpers every launcher uses: head-dim blocks, the dtype's compile-time options, scales,
strides, the GPU's generation and Triton's scratch allocator. (The kernels' launches are
flashop/_launch/launches.py's; the check on their row offsets is problem.py's.)"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch
import triton
from triton.runtime import _allocation

from flashop.kernels import INTERPRETING

# the types of an eager call's tensors: plain tensors (a parameter is one to the dispatcher),
# not a tracer's stand-ins (fake, functional) or another subclass, whose shapes may be symbolic
EAGER_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def is_traced(x: torch.Tensor) -> bool:
    """Whether ``x`` is a tracer's stand-in (fake or functional tensor) rather than data, or
    torch.compile is tracing the call."""
    return type(x) not in EAGER_TENSOR_TYPES or torch.compiler.is_compiling()


def decline(why: Optional[list], reason: str) -> bool:
    """A rule's answer where it rules something out: False, with ``reason`` added to ``why``
    (where given: a choice being explained, flashop/_launch/choice.py)."""
    if why is not None:
        why.append(reason)
    return False


def cdiv(n, d: int):
    """ceil(n / d) for an int or a symbolic n (triton.cdiv costs microseconds of host time
    per call)."""
    return (n + d - 1) // d


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def block_dim(d: int) -> int:
    """Head-dim block: the next power of two, at least 16 (tl.dot) and on GPUs 64."""
    # triton<=3.6: a 32-wide block holding DV=24 gave wrong outputs and illegal accesses in
    # the forward on Hopper, while masked 64-wide blocks are sound
    return max(16 if INTERPRETING else 64, next_power_of_2(d))


def head_blocks(d: int) -> tuple:
    """(BLOCK_D, BLOCK_DT): the tl kernels' blocks of q's and k's head dim: block_dim(d) and
    no second one (0), or, where a 128-wide block and a second, narrower one cover ``d``
    with less padding than one power-of-two block, those two (d = 192: 128 and 64 instead
    of 256; on GPUs 128 < d <= 192)."""
    whole = block_dim(d)
    if d > 128 and 128 + block_dim(d - 128) < whole:
        return 128, block_dim(d - 128)
    return whole, 0


def resolve_scale(scale: Optional[float], head_dim: int) -> float:
    return head_dim ** -0.5 if scale is None else float(scale)


# Compile-time options that follow from the inputs' dtype
_DTYPE_CONSTEXPRS = {dtype: dict(
    # bf16 tl.dot is wrong under the interpreter: compute it on exact fp32 copies there
    UPCAST=INTERPRETING and dtype == torch.bfloat16,
    # fp32 inputs get full fp32 products, as torch.matmul's default (no TF32)
    DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
) for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)}


def dtype_constexprs(dtype: torch.dtype) -> dict:
    """The kernels' compile-time options for inputs of ``dtype`` (UPCAST, DOT_PRECISION)."""
    return _DTYPE_CONSTEXPRS[dtype]


def unit_stride_last(x: torch.Tensor) -> torch.Tensor:
    """The kernels index the head dim with unit stride; other strides are passed as they are.
    A tensor whose last dimension is strided is copied (the only copy the launchers make)."""
    if x.size(-1) > 1 and x.stride(-1) != 1:
        return x.contiguous()
    return x


class TensorMeta(NamedTuple):
    """What a launcher's plan reads of a tensor: its shape, strides, dtype and device."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device


def tensor_meta(t: Optional[torch.Tensor]) -> Optional[TensorMeta]:
    return None if t is None else TensorMeta(t.shape, t.stride(), t.dtype, t.device)


def on_inputs_device(launcher: Callable) -> Callable:
    """Run ``launcher`` with its first argument's GPU as the current device: Triton launches
    on the current device, and a tensor on another GPU (a model spread over GPUs) would
    otherwise be read from the wrong one."""
    @functools.wraps(launcher)
    def on_device(x: torch.Tensor, *args, **kwargs):
        if x.is_cuda and x.device.index != torch.cuda.current_device():
            with torch.cuda.device(x.device):
                return launcher(x, *args, **kwargs)
        return launcher(x, *args, **kwargs)
    return on_device


@functools.lru_cache(maxsize=None)
def is_hopper(device: torch.device) -> bool:
    """Whether ``device`` is Hopper or newer (looked up once per device: a call's host time
    counts at short sequences)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


@functools.lru_cache(maxsize=None)
def max_shared_memory(device_index: int) -> int:
    """Bytes of shared memory one program may take on GPU ``device_index`` (looked up
    once)."""
    return triton.runtime.driver.active.utils.get_device_properties(
        device_index)["max_shared_mem"]


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (looked up once); off a GPU (the
    interpreter) a nominal 4, so that the tests' small batches take several decode splits."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def known_shorter(n, bound: int) -> bool:
    """Whether the length ``n`` is known to be below ``bound``: a symbolic length (under
    torch.compile with dynamic shapes) counts as long, so that no guard is put on it."""
    return isinstance(n, int) and n < bound


def tma_aligned(x: torch.Tensor) -> bool:
    """Whether a tensor descriptor can address ``x``'s rows: 16-byte aligned start and
    strides."""
    size = x.element_size()
    if any(s * size % 16 for s in x.stride()[:-1]):
        return False
    if type(x) in EAGER_TENSOR_TYPES:
        return x.data_ptr() % 16 == 0
    # a fake or functional tensor (tracing): its storage is aligned
    return x.storage_offset() * size % 16 == 0


def _torch_scratch(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_triton_allocator() -> None:
    """Descriptors made in a kernel take scratch memory from Triton's allocator. Where the
    caller set none (Triton's default raises), PyTorch's caching allocator serves it; an
    allocator the caller set is left as it is. (Inductor sets its own before its launches.)"""
    if INTERPRETING:
        return
    current = getattr(_allocation, "_allocator", None)
    if current is not None and isinstance(current.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)
