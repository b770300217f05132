"""Launchers: choose tiles, allocate outputs, compute grids and launch the attention kernels.

Every kernel is launched through ``torch.library.wrap_triton`` so that, inside a
``triton_op``, Inductor sees the Triton kernels themselves. Under Triton's CPU interpreter
``wrap_triton`` hands back the interpreted kernel, which runs eagerly.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import triton
from torch.library import wrap_triton
from triton.runtime import _allocation
from triton.runtime.interpreter import InterpretedFunction

from flashop.kernels.backward import (
    attention_bwd_dkdv_kernel,
    attention_bwd_dq_kernel,
    attention_bwd_preprocess_kernel,
)
from flashop.kernels.common import LOG2E
from flashop.kernels.forward import attention_fwd_kernel, attention_fwd_ws_kernel

# Triton decides when a kernel is decorated whether it is interpreted (TRITON_INTERPRET=1).
INTERPRETING = isinstance(attention_fwd_kernel, InterpretedFunction)


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch options of one kernel. ``split_m`` (the forward only): the
    program's BLOCK_M rows are two query tiles of BLOCK_M / 2 whose softmax and matmuls
    interleave (flashop/kernels/forward.py)."""

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int = 4
    num_stages: int = 1
    split_m: bool = False

    def constexprs(self, kind: str) -> dict:
        """The kernel's compile-time tile arguments."""
        args = {"BLOCK_M": self.BLOCK_M, "BLOCK_N": self.BLOCK_N}
        if kind == "fwd":
            args["SPLIT_M"] = self.split_m
        return args


# Under the interpreter every program runs one after another in numpy: small tiles keep the
# tests' sequences spanning several tiles, and BLOCK_M != BLOCK_N exercises the causal split.
_INTERPRETER_TILES = {
    "fwd": Tiles(32, 16),
    "fwd_ws": Tiles(32, 16, split_m=True),
    "dkdv": Tiles(16, 32),
    "dkdv_atomic": Tiles(16, 32),
    "dq": Tiles(32, 16),
}


# fp32 inputs take twice the shared memory of 16-bit ones: small tiles, one stage (the fp32
# path is for accuracy, not speed)
_FP32_TILES = {"fwd": Tiles(64, 32, 4, 1), "dkdv": Tiles(32, 32, 4, 1),
               "dkdv_atomic": Tiles(32, 32, 4, 1), "dq": Tiles(32, 32, 4, 1)}


def _two_query_tiles(head_dim: int) -> bool:
    """Head dims whose forward takes two query tiles per program (Tiles.split_m) on Hopper:
    +14% on an H200 at D=128 (docs/performance-notes.md, entry 22); slower at D=64, and the
    registers do not hold two tiles above 128."""
    return 64 < head_dim <= 128


# Below this many keys (where the length is known) programs are short: the table takes
# smaller tiles under a causal-like bound there, and the forward one query tile per program
SHORT_KEYS = 4096


def _gpu_tiles(kind: str, head_dim: int, hopper: bool, causal: bool = False,
               short: bool = False) -> Tiles:
    """Tiles of 16-bit inputs per kernel and head dim, the fastest of benchmarks/tune.py's
    sweep on an H200 (docs/performance.md). GPUs before Hopper have less shared memory:
    smaller tiles at head dims above 128 there. ``causal``: under a causal-like bound, whose
    programs are short and unequal; at D <= 64 smaller backward tiles with three stages
    measured 10-21% faster there (docs/performance-notes.md, entry 29). ``short``: fewer
    than SHORT_KEYS keys; with a causal-like bound there, 64-row forward tiles with 4 warps
    and smaller backward tiles measured 2-9% faster at N = 1k-2k (entry 36)."""
    short_causal = causal and short
    if kind == "fwd":
        if hopper and short_causal and head_dim <= 128:
            return Tiles(64, 64, 4, 3)
        if hopper and _two_query_tiles(head_dim):
            return Tiles(256, 64, 8, 3, split_m=True)
        if head_dim <= 128:
            return Tiles(128, 64, 8, 3)
        return Tiles(128, 64, 8, 2) if hopper else Tiles(64, 32, 4, 2)
    if kind == "dkdv_atomic":
        if head_dim <= 128:
            return Tiles(64, 128, 8, 3)
        # one stage: with two, the fp32 dQ tile staged for the atomics took the shared
        # memory to 262656 bytes on an H200 (227 KiB there)
        return Tiles(64, 64, 8, 1) if hopper else Tiles(32, 64, 8, 1)
    if kind == "dkdv":
        if head_dim <= 64:
            return Tiles(32, 64, 4, 3) if causal or short else Tiles(32, 128, 4, 3)
        if head_dim <= 128:
            if not hopper:
                return Tiles(64, 64, 4, 2)
            return Tiles(32, 64, 4, 3) if short_causal else Tiles(64, 128, 8, 3)
        return Tiles(64, 64, 8, 2) if hopper else Tiles(32, 64, 8, 1)
    # dq
    if head_dim <= 64 and causal:
        return Tiles(64, 32, 4, 3) if short else Tiles(64, 64, 4, 3)
    if head_dim <= 128:
        return Tiles(128, 64, 8, 3)
    # three stages take 160 KiB of shared memory at D=256
    return Tiles(64, 32, 4, 3) if hopper else Tiles(64, 32, 4, 1)


@functools.lru_cache(maxsize=None)
def _is_hopper(device: torch.device) -> bool:
    """Whether ``device`` is Hopper or newer (looked up once per device: a call's host time
    counts at short sequences)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def tiles_for(kind: str, head_dim: int, dtype: torch.dtype, device: torch.device,
              mask_grad: bool = False, causal: bool = False, short: bool = False) -> Tiles:
    """The tiles of ``kind`` (see _gpu_tiles for ``causal`` and ``short``)."""
    if INTERPRETING:
        t = _INTERPRETER_TILES[kind]
        if kind == "fwd" and _two_query_tiles(head_dim):  # as on Hopper GPUs
            t = replace(t, split_m=True)
        return t
    if dtype == torch.float32:
        return _FP32_TILES[kind]
    t = _gpu_tiles(kind, head_dim, _is_hopper(device), causal, short)
    if mask_grad and t.BLOCK_M > 64:
        # dQ storing its fp32 dS tile for the attn_mask gradient: a 128x64 tile with 3
        # stages needs 256 KiB of shared memory on an H200 (227 KiB there)
        t = Tiles(64, t.BLOCK_N, 4, 2)
    return t


def _known_shorter(S_k, n: int) -> bool:
    """Whether the key length ``S_k`` is known to be below ``n``: a symbolic length (under
    torch.compile with dynamic shapes) counts as long, so that no guard is put on it."""
    return isinstance(S_k, int) and S_k < n


def _short(S_k) -> bool:
    """Whether ``S_k`` keys count as short for the table (fewer than SHORT_KEYS, known)."""
    return _known_shorter(S_k, SHORT_KEYS)


def forward_tiles(head_dim: int, dtype: torch.dtype, device: torch.device, flags: dict,
                  S_k) -> Tiles:
    """The forward's tiles for its modifier flags: tiles_for's, with one query tile of
    BLOCK_M / 2 rows instead of two where two measured slower or spill registers:
    - an attn_mask (its loads in both tiles spill 1.3 KB at D=128 with triton 3.6);
    - a window's left bound (short programs whose masked bands double: -10-12% at N=16k);
    - causal-like with fewer than SHORT_KEYS keys, where S_k is known (split, such programs
      were 2-11% slower at S_k = 512-2048 on an H200, entry 22; under torch.compile with
      dynamic shapes S_k is symbolic: no guard on it, two tiles). On Hopper the table's
      short causal tiles are not split in the first place."""
    short = _short(S_k)
    t = tiles_for("fwd", head_dim, dtype, device, causal=flags["HAS_RIGHT"], short=short)
    short_causal = flags["HAS_RIGHT"] and short
    if t.split_m and (flags["MASK_KIND"] != 0 or flags["HAS_LEFT"] or short_causal):
        t = replace(t, BLOCK_M=t.BLOCK_M // 2, split_m=False)
    return t


# Autotuning (FLASHOP_AUTOTUNE=1, read at import): instead of the table above, each kernel
# times the candidates below that fit the GPU's shared memory on its first call per key
# (head dims, modifier flags, dtypes and the lengths rounded up to a power of two, so a
# new length re-tunes only when it crosses a power of two). Off by default: the table holds
# the sweep's winners (benchmarks/tune.py times the same candidates) and a first call then
# costs no tuning. fp32 inputs, the dQ-by-atomics backward (it accumulates, so repeated
# runs would add up; its candidates serve benchmarks/tune.py only) and dQ with the
# attn_mask gradient keep their table tiles.
AUTOTUNE = os.environ.get("FLASHOP_AUTOTUNE", "0") == "1"

TILE_CANDIDATES = {
    "fwd": [Tiles(256, 64, 8, 3, split_m=True), Tiles(128, 64, 8, 3), Tiles(128, 128, 8, 3),
            Tiles(128, 64, 8, 2), Tiles(128, 32, 8, 2), Tiles(64, 64, 4, 3), Tiles(64, 32, 4, 2)],
    "dkdv": [Tiles(64, 64, 4, 2), Tiles(32, 128, 4, 3), Tiles(64, 128, 8, 3),
             Tiles(32, 64, 4, 3), Tiles(64, 64, 8, 2), Tiles(32, 64, 8, 1)],
    "dkdv_atomic": [Tiles(64, 128, 8, 3), Tiles(64, 64, 8, 2), Tiles(32, 128, 4, 3),
                    Tiles(64, 64, 4, 2), Tiles(64, 64, 8, 1)],
    "dq": [Tiles(128, 64, 8, 3), Tiles(128, 32, 4, 3), Tiles(64, 64, 4, 2),
           Tiles(64, 32, 4, 3), Tiles(64, 32, 4, 2), Tiles(64, 32, 4, 1)],
}


def shared_memory_bytes(kind: str, t: Tiles, block_d: int, block_dv: int,
                        itemsize: int) -> int:
    """Shared memory of a kernel's operand tiles: those it loads in its loop take
    ``num_stages`` buffers (Triton's software pipelining), those it loads once take one;
    the dK/dV kernel with dQ atomics also stages its fp32 dQ tile."""
    once, per_stage = {
        "fwd": (t.BLOCK_M * block_d, t.BLOCK_N * (block_d + block_dv)),
        "dq": (t.BLOCK_M * (block_d + block_dv), t.BLOCK_N * (block_d + block_dv)),
    }.get(kind, (t.BLOCK_N * (block_d + block_dv), t.BLOCK_M * (block_d + block_dv)))
    dq_tile = 4 * t.BLOCK_M * block_d if kind == "dkdv_atomic" else 0
    return itemsize * (once + t.num_stages * per_stage) + dq_tile


def prune_tiles(kind: str, block_d: int, block_dv: int, itemsize: int,
                shared_memory: int) -> list:
    """The candidates of ``kind`` whose operand tiles fit ``shared_memory`` bytes (what
    Triton adds for layout conversions is not counted: a candidate that still does not fit
    fails to compile, and the autotuner skips it)."""
    return [t for t in TILE_CANDIDATES[kind]
            if shared_memory_bytes(kind, t, block_d, block_dv, itemsize) <= shared_memory]


# The autotuner's key: every compile-time choice that moves the best tiles, and the lengths'
# bucket (tensor dtypes are added by Triton)
_AUTOTUNE_KEY = ["seq_bucket", "D", "DV", "HAS_LEFT", "HAS_RIGHT", "HAS_SOFTCAP",
                 "HAS_ALIBI", "HAS_GATE", "MASK_KIND", "IS_VARLEN", "TMA"]


def autotune_key(kernel) -> list:
    """The names of _AUTOTUNE_KEY that are ``kernel``'s arguments (newer Tritons refuse a
    key that names something else; only the forward has TMA)."""
    return [name for name in _AUTOTUNE_KEY if name in kernel.arg_names]


@functools.lru_cache(maxsize=None)
def _autotuned(kernel, kind: str, block_d: int, block_dv: int, itemsize: int,
               device_index: int):
    """``kernel`` autotuned over the candidates of ``kind`` that fit this GPU."""
    props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    tiles = prune_tiles(kind, block_d, block_dv, itemsize, props["max_shared_mem"])
    configs = [triton.Config(t.constexprs(kind), num_warps=t.num_warps,
                             num_stages=t.num_stages) for t in tiles]
    return triton.autotune(configs=configs, key=autotune_key(kernel))(kernel)


def _cdiv(n, d: int):
    """ceil(n / d) for an int or a symbolic n (triton.cdiv costs ~2 µs of host per call)."""
    return (n + d - 1) // d


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def seq_bucket(*lengths) -> int:
    """The autotuner's bucket of the lengths: the longest rounded up to a power of two (0,
    one key for every length, where they are symbolic under torch.compile)."""
    if not all(isinstance(n, int) for n in lengths):
        return 0
    return _next_power_of_2(max(*lengths, 1))


def _launch(kernel, kind: str, t: Tiles, grid: Callable, *args, lengths: tuple,
            autotune: bool = False, **meta):
    """Launch ``kernel`` on ``grid(BLOCK_M, BLOCK_N)`` with the tiles ``t``, or, where
    ``autotune``, the autotuned kernel on the tiles it picks; the kernel's last positional
    argument, ``seq_bucket``, is the bucket of ``lengths`` then, else 0 (a constant, so that
    Triton's integer specialisation compiles no extra variants of the plain kernels)."""
    if autotune:
        tuned = _autotuned(kernel, kind, meta["BLOCK_D"], meta["BLOCK_DV"],
                           args[0].element_size(), args[0].device.index)
        wrap_triton(tuned)[lambda m: grid(m["BLOCK_M"], m["BLOCK_N"])](
            *args, seq_bucket(*lengths), **meta)
    else:
        wrap_triton(kernel)[grid(t.BLOCK_M, t.BLOCK_N)](
            *args, 0, **t.constexprs(kind), num_warps=t.num_warps, num_stages=t.num_stages,
            **meta)


def _autotunes(q: torch.Tensor) -> bool:
    """Whether this call's kernels are autotuned (FLASHOP_AUTOTUNE=1, 16-bit, on a GPU)."""
    return AUTOTUNE and not INTERPRETING and q.dtype != torch.float32


def _block_dim(d: int) -> int:
    """Head-dim block: the next power of two. tl.dot needs >= 16. On GPUs at least 64: with
    triton 3.6 on an H200 a 32-wide block holding DV=24 gave wrong outputs and illegal
    accesses in the forward (docs/performance.md), while masked 64-wide blocks are sound."""
    return max(16 if INTERPRETING else 64, _next_power_of_2(d))


def resolve_scale(scale: Optional[float], head_dim: int) -> float:
    return head_dim ** -0.5 if scale is None else float(scale)


# Compile-time options that follow from the inputs' dtype
_KERNEL_ARGS = {dtype: dict(
    # bf16 tl.dot is wrong under the interpreter: compute it on exact fp32 copies there
    UPCAST=INTERPRETING and dtype == torch.bfloat16,
    # fp32 inputs get full fp32 products, as torch.matmul's default (no TF32)
    DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
) for dtype in (torch.float16, torch.bfloat16, torch.float32)}


def _kernel_args(q: torch.Tensor) -> dict:
    """Compile-time options that follow from the inputs' dtype."""
    return _KERNEL_ARGS[q.dtype]


def _unit_stride_last(x: torch.Tensor) -> torch.Tensor:
    """The kernels index the head dim with unit stride; other strides are passed as they are.
    A tensor whose last dimension is strided is copied (the only copy the launchers make)."""
    if x.size(-1) > 1 and x.stride(-1) != 1:
        return x.contiguous()
    return x


def _check_offsets(tensors: tuple, seq_strides: tuple, rows: tuple) -> None:
    """The kernels offset rows within one (batch, head) slice, or within one packed
    sequence, in 32-bit integers: ``rows[i]`` rows of ``tensors[i]``, whose (batch, seq,
    head) strides are ``seq_strides[i]``."""
    for x, strides, n in zip(tensors, seq_strides, rows):
        if n * strides[1] >= 2**31:
            raise ValueError(
                f"flashop.attention: a tensor of shape {tuple(x.shape)} and strides "
                f"{x.stride()} spans 2**31 elements or more along its sequence dimension, past "
                f"the kernels' 32-bit row offsets; split the sequence or the heads")


@dataclass(frozen=True)
class Modifiers:
    """Score modifiers of one call, as the ops receive them (docs/modifiers.md)."""

    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: Optional[torch.Tensor] = None  # (H,) or (B, H) fp32
    g: Optional[torch.Tensor] = None  # (B, S_k, H) log-decay gate
    attn_mask: Optional[torch.Tensor] = None  # bool keep-mask or additive float bias


# Calls without modifiers (but causal) share these, so the plain path adds little host time
PLAIN = {False: Modifiers(), True: Modifiers(causal=True)}
_PLAIN_FLAGS = {causal: dict(HAS_LEFT=False, HAS_RIGHT=causal, HAS_SOFTCAP=False,
                             HAS_ALIBI=False, HAS_GATE=False, MASK_KIND=0)
                for causal in (False, True)}


def _modifier_args(q: torch.Tensor, k: torch.Tensor, mods: Modifiers, sm_scale: float,
                   packing: Optional["Packing"] = None):
    """Kernel arguments of the modifiers: (tensors, strides, scalars, flags).

    Tensors a flag leaves unread are replaced by ``q`` (never read) with zero strides.
    """
    if mods is PLAIN[mods.causal]:
        return ((q, q, q), (0,) * 9, (sm_scale * LOG2E.value, 0.0, 0, 0),
                _PLAIN_FLAGS[mods.causal])
    left, right = mods.window_size
    if mods.causal:
        right = 0
    alibi, alibi_strides = q, (0, 0)
    if mods.alibi_slopes is not None:
        alibi = mods.alibi_slopes
        alibi_strides = alibi.stride() if alibi.dim() == 2 else (0, alibi.stride(0))
    g, g_strides = q, (0, 0, 0)
    if mods.g is not None:
        # the cumulative gate, fp32: score(i, j) += G[i + S_k - S_q] - G[j], stored (B, H, S_k)
        # so that a tile's gates are one contiguous load
        # (a scan along a contiguous last dim: CUDA's scan along an outer dim runs one
        # thread per column, milliseconds at S_k = 16k)
        if packing is None:
            g = torch.cumsum(mods.g.transpose(1, 2).contiguous(), dim=-1, dtype=torch.float32)
            g_strides = (g.stride(0), g.stride(2), g.stride(1))  # (batch, seq, head)
        else:  # (H, total_k), restarted at each sequence
            g = _packed_cumsum(mods.g, packing.cu_seqlens_k)
            g_strides = (0, g.stride(1), g.stride(0))
    mask, mask_strides, mask_kind = q, (0, 0, 0, 0), 0
    if mods.attn_mask is not None:  # dense batches only
        B, S_q, H, _ = q.shape
        mask = mods.attn_mask.expand(B, H, S_q, k.shape[1])
        if mask.dtype == torch.bool:
            mask, mask_kind = mask.view(torch.uint8), 2
        else:
            mask_kind = 1
        mask_strides = mask.stride()
    if mods.softcap > 0:
        # tanh(scale * q.k / softcap) * softcap, in base-2 units
        scalars = (sm_scale / mods.softcap, mods.softcap * LOG2E.value)
    else:
        scalars = (sm_scale * LOG2E.value, 0.0)
    scalars += (max(left, 0), max(right, 0))
    flags = dict(HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, HAS_SOFTCAP=mods.softcap > 0,
                 HAS_ALIBI=mods.alibi_slopes is not None, HAS_GATE=mods.g is not None,
                 MASK_KIND=mask_kind)
    return (alibi, g, mask), (*alibi_strides, *g_strides, *mask_strides), scalars, flags


@dataclass(frozen=True)
class Packing:
    """A packed batch (flash_attn_varlen's convention): sequence b holds the query tokens
    ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` and the key tokens likewise; the longest
    lengths size the grid."""

    cu_seqlens_q: torch.Tensor  # (batch + 1,) int32
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1


def _token_sequences(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """The sequence of each of ``total`` packed tokens (int64), without a host sync."""
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens, tokens, right=True) - 1


def _packed_cumsum(g: torch.Tensor, cu_seqlens_k: torch.Tensor) -> torch.Tensor:
    """(total_k, H) gate -> (H, total_k) fp32 cumulative sums restarted at each sequence
    (summed in fp64 over the whole packing, then the sequence's start subtracted)."""
    total, H = g.shape
    C = torch.cumsum(g.t().contiguous(), dim=-1, dtype=torch.float64)
    C0 = torch.cat([C.new_zeros(H, 1), C], dim=1)  # C0[:, t] = sum of the first t tokens
    start = cu_seqlens_k.long()[_token_sequences(cu_seqlens_k, total)]
    return (C - C0[:, start]).float()


def attention_forward_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              packed: bool = False):
    """Allocate (out, lse, lse_log2) for the forward, all contiguous: out (B, S_q, H, DV) in
    q's dtype, lse and lse_log2 (B, H, S_q) fp32; packed, out (total_q, H, DV) and the lses
    (H, total_q). The real ops and their fakes both allocate here."""
    if packed:
        total_q, H, _ = q.shape
        out, rows = q.new_empty((total_q, H, v.shape[-1])), (H, total_q)
    else:
        B, S_q, H, _ = q.shape
        out, rows = q.new_empty((B, S_q, H, v.shape[-1])), (B, H, S_q)
    return (out, q.new_empty(rows, dtype=torch.float32),
            q.new_empty(rows, dtype=torch.float32))


def attention_backward_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               g: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor],
                               attn_mask_grad: bool):
    """Allocate (dq, dk, dv, dg, dattn_mask), contiguous, in the inputs' dtypes; dg and
    dattn_mask are empty (0 elements) where there is no gate / no mask gradient."""
    dg = q.new_empty(0) if g is None else g.new_empty(g.shape)
    dmask = (attn_mask.new_empty(attn_mask.shape) if attn_mask_grad and attn_mask is not None
             else q.new_empty(0))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dg, dmask


def _problem(q, k, packing: Optional[Packing]):
    """(B, S_q, S_k, cu_seqlens_q, cu_seqlens_k): the grid's batch and lengths, and the
    offsets the kernels read where packed (``q`` stands in for them otherwise)."""
    if packing is None:
        return q.shape[0], q.shape[1], k.shape[1], q, q
    return (packing.batch, packing.max_seqlen_q, packing.max_seqlen_k, packing.cu_seqlens_q,
            packing.cu_seqlens_k)


def _seq_strides(x: torch.Tensor, packing: Optional["Packing"]) -> tuple:
    """The kernels' (batch, seq, head) strides: a packed (total, H, D) tensor has batch
    stride 0 (each program offsets its sequence's start instead). The tensors themselves are
    passed as they are: a broadcast view of an output would hide the kernel's writes from
    functionalization under torch.compile."""
    strides = x.stride()
    return strides[:3] if packing is None else (0, *strides[:2])


def _row_strides(x: torch.Tensor, packing: Optional[Packing]) -> tuple:
    """(batch, head) strides of a per-row fp32 tensor: (B, H, S) dense, (H, total) packed."""
    return (0, x.stride(0)) if packing is not None else (x.stride(0), x.stride(1))


# Tensor descriptors (Hopper's copy engine, TMA) for the forward's key and value tiles: by
# default at head dims above 128 over at least TMA_MIN_KEYS keys on Hopper (D=256 on an H200:
# 2-10% faster from 4096 keys, 7-22% slower at 512-2048 where each program's descriptors cost
# more than they save; at D <= 128 1-4% slower: docs/performance-notes.md, entries 21 and 32).
# FLASHOP_TMA=1 takes them everywhere, FLASHOP_TMA=0 nowhere; read at import (and at tracing
# time under torch.compile). None: the default rule (_tma_by_default).
TMA: Optional[bool] = {"1": True, "0": False}.get(os.environ.get("FLASHOP_TMA", ""))
TMA_MIN_KEYS = 4096


def _tma_aligned(x: torch.Tensor) -> bool:
    """Whether a descriptor can address ``x``'s rows: 16-byte aligned start and strides."""
    size = x.element_size()
    if any(s * size % 16 for s in x.stride()[:-1]):
        return False
    try:
        return x.data_ptr() % 16 == 0
    except RuntimeError:  # a fake or functional tensor (tracing): its storage is aligned
        return x.storage_offset() * size % 16 == 0


def _tma_by_default(head_dim: int, S_k, device: torch.device) -> bool:
    """The descriptors' default rule (TMA unset): head dims above 128 and at least
    TMA_MIN_KEYS keys (the longest sequence's where packed) on a Hopper GPU. Where S_k is
    symbolic (torch.compile with dynamic shapes) the rule takes it as long: no guard on it."""
    return (head_dim > 128 and not _known_shorter(S_k, TMA_MIN_KEYS) and device.type == "cuda"
            and _is_hopper(device))


def _uses_tma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, S_k) -> bool:
    """Whether the forward reads k and v through tensor descriptors (see TMA): 16-bit inputs
    that meet their alignment, where TMA (or its default rule) selects them."""
    if q.dtype == torch.float32 or TMA is False:
        return False
    if TMA is None and not _tma_by_default(head_dim, S_k, q.device):
        return False
    return _tma_aligned(k) and _tma_aligned(v)


def _torch_scratch(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_triton_allocator() -> None:
    """Descriptors made in a kernel take scratch memory from Triton's allocator. Where the
    caller set none (Triton's default raises), PyTorch's caching allocator serves it; an
    allocator the caller set is left as it is. (Inductor sets its own before its launches.)"""
    current = getattr(_allocation, "_allocator", None)
    if current is not None and isinstance(current.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


# The plain forward with a warp-specialized key loop (attention_fwd_ws_kernel): by default on
# Hopper at head dims in (64, 128] without modifiers, a causal bound or packing, where the
# key length is known to be a multiple of its BLOCK_N (that kernel has no masked key tile;
# under torch.compile with dynamic shapes S_k is symbolic: no guard on it, the split kernel).
# 4 warps per group, 2 stages: with 3, triton 3.6's pass gave NaNs on an H200 (entry 39).
# FLASHOP_WS=1 takes it wherever the inputs allow it, FLASHOP_WS=0 nowhere; read at import.
WARP_SPECIALIZE: Optional[bool] = {"1": True, "0": False}.get(os.environ.get("FLASHOP_WS", ""))
WS_TILES = Tiles(256, 128, 4, 2, split_m=True)


def _ws_tiles() -> Tiles:
    return _INTERPRETER_TILES["fwd_ws"] if INTERPRETING else WS_TILES


def _ws_query_layout(q: torch.Tensor) -> Optional[bool]:
    """How attention_fwd_ws_kernel reads ``q`` (B, S_q, H, D) as one 2-D array of rows:
    True where its (batch, head) slices of S_q rows follow one another (a head-major
    layout), False where its (batch, seq) rows hold the H heads side by side and D is a
    block width (the tile's columns stay in one head), None where neither holds."""
    B, S_q, H, D = q.shape
    sb, ss, sh = q.stride()[:3]
    if (H == 1 or sh == D) and (B == 1 or sb == S_q * ss) and D == _block_dim(D):
        return False
    if (H == 1 or sh == S_q * ss) and (B == 1 or sb == H * S_q * ss):
        return True
    return None


def _uses_ws(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flags: dict, head_dim: int,
             S_k, packed: bool) -> bool:
    """Whether the forward runs attention_fwd_ws_kernel (see WARP_SPECIALIZE): 16-bit dense
    inputs without modifiers, S_k a known multiple of its BLOCK_N, rows that descriptors can
    address, q in one of its layouts; and on Hopper at head dims in (64, 128] unless
    FLASHOP_WS=1."""
    if WARP_SPECIALIZE is False or packed or q.dtype == torch.float32:
        return False
    if flags != _PLAIN_FLAGS[False]:  # a modifier or a bound
        return False
    if not isinstance(S_k, int) or S_k == 0 or S_k % _ws_tiles().BLOCK_N:
        return False
    if WARP_SPECIALIZE is None and not (64 < head_dim <= 128 and q.device.type == "cuda"
                                        and _is_hopper(q.device)):
        return False
    return (_tma_aligned(q) and _tma_aligned(k) and _tma_aligned(v)
            and _ws_query_layout(q) is not None)


def _folds_scale(qk_scale: float, flags: dict, t: Tiles, head_dim: int) -> bool:
    """Whether the forward folds ``qk_scale`` into its exponent (FOLD_SCALE, see
    flashop/kernels/forward.py's _fwd_fold): the scale is positive, so that the row max of
    the unscaled scores scales to the scaled scores' max, and no modifier adds to the scores
    between the product and the softmax (softcap, ALiBi, gate, a float attn_mask).

    Only where it measured faster on an H200 (docs/performance-notes.md, entry 24): at head
    dims up to 128, and not with two query tiles under a causal-like bound (that kernel ran
    4-9% slower with it, even folding only its unmasked tiles; D=256 0.7-2.7% slower). ``t``:
    the table's tiles (the autotuner's choice may differ, which changes speed, not results)."""
    return (qk_scale > 0 and head_dim <= 128
            and not (flags["HAS_SOFTCAP"] or flags["HAS_ALIBI"] or flags["HAS_GATE"]
                     or flags["MASK_KIND"] == 1 or (t.split_m and flags["HAS_RIGHT"])))


def attention_forward(q, k, v, scale: Optional[float], mods: Modifiers,
                      packing: Optional[Packing] = None):
    """Launch the forward; returns (out, lse, lse_log2) (see attention_forward_outputs):
    lse in natural-log units, and in base 2 for the backward."""
    q, k, v = _unit_stride_last(q), _unit_stride_last(k), _unit_stride_last(v)
    out, lse, lse_log2 = attention_forward_outputs(q, k, v, packed=packing is not None)
    if out.numel() == 0:
        return out, lse, lse_log2
    B, S_q, S_k, cu_q, cu_k = _problem(q, k, packing)
    if packing is not None and B == 0:  # no sequences: no token attends anything
        return out.zero_(), lse.fill_(float("-inf")), lse_log2.fill_(float("-inf"))
    lse_strides = _row_strides(lse, packing)
    seq_strides = tuple(_seq_strides(x, packing) for x in (q, k, v, out))
    _check_offsets((q, k, v, out), seq_strides, rows=(S_q, S_k, S_k, S_q))
    H, D = q.shape[-2], q.shape[-1]
    H_kv, DV = k.shape[-2], v.shape[-1]
    sm_scale = resolve_scale(scale, D)
    tensors, mod_strides, mod_scalars, flags = _modifier_args(q, k, mods, sm_scale, packing)
    head_dim = max(D, DV)
    grid = lambda bm, bn: (_cdiv(S_q, bm), H, B)  # noqa: E731
    dims = dict(D=D, DV=DV, BLOCK_D=_block_dim(D), BLOCK_DV=_block_dim(DV))
    ws = _uses_ws(q, k, v, flags, head_dim, S_k, packing is not None)
    tma = not ws and _uses_tma(q, k, v, head_dim, S_k)
    if (ws or tma) and not INTERPRETING:  # descriptors made in the kernels
        _ensure_triton_allocator()
    if ws:
        _launch(
            attention_fwd_ws_kernel, "fwd_ws", _ws_tiles(), grid,
            q, k, v, out, lse, lse_log2, *seq_strides[0], *seq_strides[1], *seq_strides[2],
            *seq_strides[3], *lse_strides, S_q, S_k, H // H_kv, mod_scalars[0], lengths=(),
            **dims, FOLD_SCALE=mod_scalars[0] > 0, Q_HEAD_MAJOR=_ws_query_layout(q),
            **_kernel_args(q),
        )
        return out, lse, lse_log2
    t = forward_tiles(head_dim, q.dtype, q.device, flags, S_k)
    _launch(
        attention_fwd_kernel, "fwd", t, grid,
        q, k, v, out, lse, lse_log2, *tensors, cu_q, cu_k,
        *seq_strides[0], *seq_strides[1], *seq_strides[2], *seq_strides[3], *mod_strides,
        *lse_strides,
        S_q, S_k, H // H_kv, *mod_scalars, lengths=(S_q, S_k), autotune=_autotunes(q),
        **dims, **flags, FOLD_SCALE=_folds_scale(mod_scalars[0], flags, t, head_dim),
        IS_VARLEN=packing is not None, TMA=tma, **_kernel_args(q),
    )
    return out, lse, lse_log2


# dQ by fp32 atomics in the dK/dV kernel (one pass over S and dP instead of two) measured
# slower than the dQ kernel at most shapes on an H100 (docs/performance.md), so it is opt-in:
# FLASHOP_DQ_ATOMICS=1, read at import (and at tracing time under torch.compile).
DQ_ATOMICS = os.environ.get("FLASHOP_DQ_ATOMICS", "0") == "1"


def deterministic_backward() -> bool:
    """Whether backwards sum dQ in one program per query tile (the dQ kernel, bitwise
    reproducible) rather than by fp32 atomics: always, unless atomics were opted into, and
    always under torch.use_deterministic_algorithms."""
    return not DQ_ATOMICS or torch.are_deterministic_algorithms_enabled()


def _gate_grad(dgq: torch.Tensor, dgk: torch.Tensor) -> torch.Tensor:
    """dg from the kernels' halves: dG[p] = dgk[p] + dgq[p - (S_k - S_q)] (query i sits at
    key position i + S_k - S_q), then dg = reverse cumulative sum of dG (G = cumsum(g))."""
    S_q, S_k = dgq.shape[-1], dgk.shape[-1]
    off = S_k - S_q
    if off >= 0:
        dG = torch.cat([dgk[..., :off], dgk[..., off:] + dgq], dim=-1)
    else:
        dG = dgk + dgq[..., -off:]
    return _reverse_cumsum(dG).transpose(1, 2)  # (B, S_k, H)


def _reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    """out[..., t] = sum of x[..., t:]: the gradient of a cumulative sum."""
    return torch.flip(torch.cumsum(torch.flip(x, [-1]), dim=-1), [-1])


def _packed_gate_grad(dgq: torch.Tensor, dgk: torch.Tensor, packing: Packing) -> torch.Tensor:
    """As _gate_grad for a packed batch: dgq (H, total_q), dgk (H, total_k) -> dg
    (total_k, H), the reverse cumulative sums restarted at each sequence."""
    (H, total_q), total_k = dgq.shape, dgk.shape[1]
    cu_q, cu_k = packing.cu_seqlens_q.long(), packing.cu_seqlens_k.long()
    seq = _token_sequences(packing.cu_seqlens_q, total_q)
    # query token t of sequence b sits at key token t + (end_k(b) - end_q(b)); tokens before
    # their sequence's keys attend nothing and go to a spare column
    pos = torch.arange(total_q, device=dgq.device) + (cu_k[seq + 1] - cu_q[seq + 1])
    pos = torch.where(pos >= cu_k[seq], pos, total_k)
    dG = torch.cat([dgk, dgk.new_zeros(H, 1)], dim=1).double()
    dG.index_add_(1, pos, dgq.double())  # one query per key position: no accumulation order
    R = _reverse_cumsum(dG[:, :total_k])
    R0 = torch.cat([R, R.new_zeros(H, 1)], dim=1)  # R0[:, t] = sum from token t on
    end = cu_k[_token_sequences(packing.cu_seqlens_k, total_k) + 1]
    return (R - R0[:, end]).t()


def attention_backward(dout, dlse, q, k, v, out, lse_log2, scale: Optional[float],
                       mods: Modifiers, attn_mask_grad: bool, packing: Optional[Packing] = None,
                       deterministic: Optional[bool] = None):
    """Launch the backward from the forward's ``out`` and base-2 ``lse_log2``; returns (dq,
    dk, dv, dg, dattn_mask) (the last two as in attention_backward_outputs).

    dQ comes from the dQ kernel (each row summed in one program) unless ``deterministic``
    is False (default: not deterministic_backward(), i.e. FLASHOP_DQ_ATOMICS=1) and there is
    no gate and no mask gradient: then the dK/dV kernel adds it by fp32 atomics, with no
    second pass over S and dP."""
    q, k, v, out, dout = (_unit_stride_last(x) for x in (q, k, v, out, dout))
    lse_log2 = lse_log2.contiguous()  # fp32 rows: the kernels index them with a unit stride
    dq, dk, dv, dg, dmask = attention_backward_outputs(q, k, v, mods.g, mods.attn_mask,
                                                       attn_mask_grad)
    B, S_q, S_k, cu_q, cu_k = _problem(q, k, packing)
    if B == 0 or q.numel() == 0 or k.numel() == 0:
        # nothing attends anything: every gradient is zero (dq needs writing when S_k == 0)
        return dq.zero_(), dk.zero_(), dv.zero_(), dg.zero_(), dmask.zero_()
    lse_strides = _row_strides(lse_log2, packing)
    seq_strides = tuple(_seq_strides(x, packing) for x in (q, k, v, dout))
    _check_offsets((q, k, v, dout), seq_strides, rows=(S_q, S_k, S_k, S_q))
    H, D = q.shape[-2], q.shape[-1]
    H_kv, DV = k.shape[-2], v.shape[-1]
    sm_scale = resolve_scale(scale, D)
    tensors, mod_strides, mod_scalars, flags = _modifier_args(q, k, mods, sm_scale, packing)
    delta = torch.empty_like(lse_log2)
    has_gate = mods.g is not None
    dgq = torch.empty_like(lse_log2) if has_gate else delta  # rows of the queries, as lse
    if not has_gate:
        dgk = delta
    elif packing is None:
        dgk = lse_log2.new_empty((B, H, S_k))
    else:
        dgk = lse_log2.new_empty((H, k.shape[0]))
    dgk_strides = _row_strides(dgk, packing) if has_gate else (0, 0)
    # dS of every (query, key) pair; pairs outside the window are never visited: zeros
    dS = lse_log2.new_zeros((B, H, S_q, S_k)) if attn_mask_grad else delta
    if deterministic is None:
        deterministic = deterministic_backward()
    dq_atomic = not (deterministic or has_gate or attn_mask_grad)
    # zeroed fp32 dQ / scale, laid out as q, where the dK/dV kernel adds into it
    dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if dq_atomic else delta
    dqa_strides = _seq_strides(dq_acc, packing) if dq_atomic else (0, 0, 0)
    BLOCK_D, BLOCK_DV = _block_dim(D), _block_dim(DV)
    short = _short(S_k)
    common = dict(D=D, DV=DV, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, **flags,
                  IS_VARLEN=packing is not None, **_kernel_args(q))

    # arguments the dK/dV and dQ kernels share: input strides, then lengths, group size, scales
    strides = (*seq_strides[0], *seq_strides[1], *seq_strides[2], *seq_strides[3],
               *mod_strides)
    scalars = (S_q, S_k, H // H_kv, sm_scale, *mod_scalars)
    o_strides = _seq_strides(out, packing)
    dlse_strides = dlse.stride() if packing is None else (0, *dlse.stride())
    if dq_atomic:
        # delta alone (no dQ kernel computes it); a packed batch is one sequence of total_q
        # rows here, delta being row-wise
        B_pre, rows_pre = (B, S_q) if packing is None else (1, q.shape[0])
        pre_block = 64 if not INTERPRETING else 32
        wrap_triton(attention_bwd_preprocess_kernel)[
            (_cdiv(rows_pre, pre_block), H, B_pre)](
            out, dout, dlse, delta, *o_strides, *seq_strides[3], *dlse_strides, rows_pre, H,
            DV=DV, BLOCK_DV=BLOCK_DV, BLOCK_M=pre_block,
        )
    else:
        # the dQ kernel first: it also stores delta, which the dK/dV kernel reads
        _launch(
            attention_bwd_dq_kernel, "dq",
            tiles_for("dq", max(D, DV), q.dtype, q.device, mask_grad=attn_mask_grad,
                      causal=flags["HAS_RIGHT"], short=short),
            lambda bm, bn: (_cdiv(S_q, bm), H, B),
            q, k, v, dout, lse_log2, delta, *tensors, cu_q, cu_k, dq, dgq, dS, out, dlse,
            *strides, *_seq_strides(dq, packing), *lse_strides, *o_strides, *dlse_strides,
            *scalars, H, lengths=(S_q, S_k), autotune=_autotunes(q) and not attn_mask_grad,
            MASK_GRAD=attn_mask_grad, **common,
        )
    kind = "dkdv_atomic" if dq_atomic else "dkdv"
    _launch(
        attention_bwd_dkdv_kernel, kind,
        tiles_for(kind, max(D, DV), q.dtype, q.device, causal=flags["HAS_RIGHT"], short=short),
        lambda bm, bn: (_cdiv(S_k, bn), H_kv, B),
        q, k, v, dout, lse_log2, delta, *tensors, cu_q, cu_k, dk, dv, dgk, dq_acc,
        *strides, *_seq_strides(dk, packing), *_seq_strides(dv, packing), *lse_strides,
        *dgk_strides, *dqa_strides, *scalars, lengths=(S_q, S_k),
        autotune=_autotunes(q) and not dq_atomic, DQ_ATOMIC=dq_atomic, **common,
    )
    if dq_atomic:
        dq.copy_(dq_acc.mul_(sm_scale))
        return dq, dk, dv, dg, dmask
    # into the tensors attention_backward_outputs allocated (the fake's strides)
    if has_gate:
        dg.copy_(_gate_grad(dgq, dgk) if packing is None else
                 _packed_gate_grad(dgq, dgk, packing))
    if attn_mask_grad:
        dmask.copy_(dS.sum_to_size(mods.attn_mask.shape))
    return dq, dk, dv, dg, dmask
