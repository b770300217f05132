"""The CPU path: every operator's computation in PyTorch's CPU operations, for CPU tensors
where Triton's interpreter is off (or config.settings.cpu_path is on under it).

The same semantics as the Triton kernels (docs/modifiers.md, docs/decoding.md): grouped
heads, every modifier, bottom-right causal, packed and paged batches, sinks, dropout with
the kernels' own Philox mask, fp8 inputs and caches (dequantized), and the base-2
``lse_log2`` that the backward reads. Plain calls take SDPA's CPU flash-attention kernels
(``dense.sdpa_serves``); the rest run a blocked forward and backward (online softmax over
key tiles; the backward recomputes P from lse_log2 tile by tile), which hold one tile of
scores at a time, never a (S_q, S_k) matrix.

The launchers route here (``serves``); the operators call their opaque twins where such a
call is traced (``traced``): Inductor then calls the operator as it is, its body running
eagerly on the CPU (flashop/_ops/attention.py).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from flashop import config
from flashop._launch.common import is_traced
from flashop.kernels import INTERPRETING


def serves(x: torch.Tensor) -> bool:
    """Whether a call whose first tensor is ``x`` runs on the CPU path: CPU tensors, unless
    Triton's interpreter runs the kernels on them (TRITON_INTERPRET=1 without
    config.settings.cpu_path)."""
    return x.device.type == "cpu" and (not INTERPRETING or config.settings.cpu_path)


def outside_autocast(entry: Callable) -> Callable:
    """Run a CPU path's entry point with autocast off: it computes in fp32 on the inputs
    as the operator received them (autocast's casts, where a region asks for them, are the
    operator's, flashop/_ops/autocast.py), and the eager path runs it inside the caller's
    region."""
    @functools.wraps(entry)
    def run(*args, **kwargs):
        with torch.autocast("cpu", enabled=False):
            return entry(*args, **kwargs)
    return run


def traced(x: torch.Tensor) -> bool:
    """Whether a call of ``x`` is traced for a graph (torch.compile, export) and runs on the
    CPU path when the graph runs: the operator then calls its opaque twin, whose body runs
    eagerly (the CPU path reads values on the host, which a trace has not)."""
    return serves(x) and is_traced(x)
