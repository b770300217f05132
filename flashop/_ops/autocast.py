"""Autocast: inside a ``torch.autocast`` region the operators take their floating inputs in
the region's dtype, as SDPA does, so fp32 (or mixed) q, k, v run in bf16 or fp16 and give
outputs in that dtype, with gradients flowing back through the casts to fp32 leaves.

What is cast: q, k and v (and the new keys and values of a cache append, and the rotary
tables, which must have q's dtype) of any floating dtype but float64 (which autocast leaves
alone); the modifiers flashop takes in fp32 or the
inputs' dtype (``attn_mask``, ``g``, ``sinks``) only where they are 16-bit of another dtype,
since fp32 ones are read in fp32 anyway (more accurate than SDPA's cast of its mask). ALiBi
slopes stay fp32, and integers as they are. The key/value caches are written in place, so a
call that appends keeps them as they are (under autocast they must be in the region's dtype
then); a call that only reads them (no new keys, as transformers' decoding steps, whose
caches autocast left in mixed dtypes) reads them cast, but an fp8 cache as it is (its
descales say what it holds), and fp8 queries likewise.

Registered as the operators' Autocast kernels for CPU and CUDA (traced and dispatched
calls), and applied by the eager path itself (flashop/_ops/eager.py), which runs the
operators' bodies without the dispatcher.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

# the autocast devices registered for
DEVICE_TYPES = ("cpu", "cuda")
# the arguments cast to the region's dtype, and those cast only from another 16-bit dtype
_INPUTS = {"attention_forward": (("q", "k", "v"), ("attn_mask", "g", "sinks")),
           "attention_with_kvcache": (("q", "k", "v", "rotary_cos", "rotary_sin"), ("sinks",)),
           "attention_varlen_paged": (("q", "k_cache", "v_cache"), ("sinks",))}


def region_dtype(x: Tensor) -> Optional[torch.dtype]:
    """The dtype of the autocast region enabled for ``x``'s device type, or None."""
    device_type = x.device.type
    if device_type not in DEVICE_TYPES or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def cast_input(x: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """``x`` in ``dtype`` where it is a floating tensor other than float64 (as autocast
    casts) or fp8 (whose descales say what it holds); else as it is."""
    if (x is None or not x.is_floating_point() or x.dtype in (dtype, torch.float64)
            or x.element_size() == 1):
        return x
    return x.to(dtype)


def cast_modifier(x: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """A modifier flashop takes in fp32 or the inputs' dtype: in ``dtype`` where it is in
    another 16-bit dtype; else as it is."""
    if x is None or x.dtype not in (torch.float16, torch.bfloat16) or x.dtype == dtype:
        return x
    return x.to(dtype)


def cast_arguments(name: str, arguments: dict, dtype: torch.dtype) -> dict:
    """The operator ``name``'s arguments (by name) cast for an autocast region of
    ``dtype``."""
    inputs, modifiers = _INPUTS[name]
    if (name == "attention_with_kvcache" and arguments.get("k") is None
            and arguments["k_cache"].dtype != torch.float8_e4m3fn):
        inputs = inputs + ("k_cache", "v_cache")  # read, not written: a cast copy serves
    cast = dict(arguments)
    for arg in inputs:
        if arg in cast:
            cast[arg] = cast_input(cast[arg], dtype)
    for arg in modifiers:
        if arg in cast:
            cast[arg] = cast_modifier(cast[arg], dtype)
    return cast


def register(library: torch.library.Library, name: str) -> None:
    """Register the operator ``name``'s Autocast kernels (CPU and CUDA): its arguments cast
    for the region (cast_arguments), then the operator below autocast."""
    op = getattr(torch.ops.flashop, name).default
    names = [argument.name for argument in op._schema.arguments]
    for device_type in DEVICE_TYPES:
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        below = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def kernel(_keyset, *args, _device_type=device_type, _below=below, **kwargs):
            arguments = cast_arguments(name, dict(zip(names, args), **kwargs),
                                       torch.get_autocast_dtype(_device_type))
            with torch._C._ExcludeDispatchKeyGuard(_below):
                return op(**arguments)

        library.impl(name, kernel, key, with_keyset=True)
