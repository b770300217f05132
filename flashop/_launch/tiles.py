"""Tile sizes of the attention kernels: the table of measured winners, the rules that pick
from it per GPU generation, head dim and bound, and the opt-in autotuner over the same
candidates (``FLASHOP_AUTOTUNE=1``, flashop/config.py). The measurements behind each rule
are in docs/notes/."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace

import torch
import triton

from flashop import config
from flashop._launch.common import (
    decline, is_hopper, known_shorter, max_shared_memory, next_power_of_2,
)
from flashop.kernels import INTERPRETING


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
    "dv": Tiles(16, 32),
    "dk": Tiles(16, 32),
    "dq": Tiles(32, 16),
}

# fp32 inputs take twice the shared memory of 16-bit ones: small tiles, one stage (the fp32
# path is for accuracy, not speed)
_FP32_TILES = {"fwd": Tiles(64, 32, 4, 1), "dkdv": Tiles(32, 32, 4, 1),
               "dkdv_atomic": Tiles(32, 32, 4, 1), "dq": Tiles(32, 32, 4, 1)}

# The warp-specialized forward: 4 warps per group and 2 stages (with 3, triton 3.6's pass
# gave NaNs on Hopper)
WS_TILES = Tiles(256, 128, 4, 2, split_m=True)

# Below this many keys (where the length is known) programs are short: the table takes
# smaller tiles under a causal-like bound there, and the forward one query tile per program
SHORT_KEYS = 4096


def two_query_tiles(head_dim: int) -> bool:
    """Head dims whose forward takes two query tiles per program (Tiles.split_m) on Hopper:
    faster at 64 < D <= 128, slower at D=64, and above 128 the registers do not hold two
    (D = 192 / 128: 196-348 B spilled, 0.87-0.95x one tile from 4k keys, H200)."""
    return 64 < head_dim <= 128


def splits_dkdv(head_dim: int, dtype: torch.dtype, device: torch.device, why=None,
                head_in_parts: bool = False, value_dim: int = 0) -> bool:
    """Whether the backward's dK/dV kernel runs as two launches, a dV part and a dK part
    (its ``PARTS``), each program holding one [BLOCK_N, D] accumulator: 16-bit inputs at
    head dims above 128 on Hopper, where one program holding both spills at every tile that
    fits (1.09-1.26x the whole backward at D = 256 on an H200, though S^T is computed
    twice). Not where q's and k's head dim is in two tiles (``head_in_parts``,
    choice.head_in_parts) and the values' ``value_dim`` is at most 128: there one program
    of 32 key rows holds both without spilling, and the backward runs 1.16-1.29x the parts'
    (D = 192 / 128, H200). The interpreter takes the Hopper rule, so that CI runs both
    forms."""
    what = "the dK/dV kernel in two parts"
    if head_dim <= 128:
        return decline(why, f"{what}: above head dim 128 only (one program holds dK and dV)")
    if dtype == torch.float32:
        return decline(why, f"{what}: not for float32 inputs")
    if not (INTERPRETING or (device.type == "cuda" and is_hopper(device))):
        return decline(why, f"{what}: on Hopper GPUs only")
    if head_in_parts and value_dim <= 128:
        return decline(why, f"{what}: not with q's and k's head dim in two tiles and values "
                            f"at most 128 wide (one program holds dK and dV)")
    return True


def is_short(S_k) -> bool:
    """Whether ``S_k`` keys count as short for the table (fewer than SHORT_KEYS, known)."""
    return known_shorter(S_k, SHORT_KEYS)


def _gpu_tiles(kind: str, head_dim: int, hopper: bool, causal: bool = False,
               short: bool = False, value_dim: int = 0, head_in_parts: bool = False,
               masked: bool = False) -> Tiles:
    """Tiles of 16-bit inputs per kernel and head dim: the fastest of benchmarks/tune.py's
    sweep on Hopper. GPUs before Hopper have less shared memory: smaller tiles at head dims
    above 128 there. ``causal``: under a causal-like bound, whose programs are short and
    unequal (smaller backward tiles with three stages at D <= 64). ``short``: fewer than
    SHORT_KEYS keys (with a causal-like bound, 64-row forward tiles with 4 warps and smaller
    backward tiles). ``value_dim``: the values' head dim where it is below ``head_dim``
    (the forward above 128 keeps a third stage of key and value tiles where the values'
    are at most 128 wide; so do the dK/dV kernel's parts where ``head_in_parts``, q's and
    k's head dim in two tiles: choice.head_in_parts). ``masked``: an attn_mask, whose tiles
    are pipelined with the keys': no third stage above head dim 128 (a float mask's took
    the shared memory past Hopper's 227 KiB at D = 176, DV = 128)."""
    third = 0 < value_dim <= 128 and not masked
    short_causal = causal and short
    if kind == "fwd":
        if hopper and short_causal and head_dim <= 128:
            return Tiles(64, 64, 4, 3)
        if hopper and two_query_tiles(head_dim):
            return Tiles(256, 64, 8, 3, split_m=True)
        if head_dim <= 128:
            return Tiles(128, 64, 8, 3)
        if not hopper:
            return Tiles(64, 32, 4, 2)
        # three stages fit where the values' tiles are at most 128 wide (D = 192, DV = 128:
        # 208 KiB; 1.18x two stages, H200), not at DV = 256 (256 KiB)
        return Tiles(128, 64, 8, 3 if third else 2)
    if kind == "dkdv_atomic":
        if head_dim <= 128:
            return Tiles(64, 128, 8, 3)
        # one stage: with two, the staged fp32 dQ tile takes the shared memory past 227 KiB
        return Tiles(64, 64, 8, 1) if hopper else Tiles(32, 64, 8, 1)
    # the dK/dV kernel's parts (splits_dkdv): head dims above 128; a third stage where the
    # head dim is in two tiles (D = 192: 128 + 64) and the values' are at most 128 wide
    # (DV = 128: dK 1.06-1.16x, dV 1.02-1.09x two stages, H200)
    stages = 3 if head_in_parts and third else 2
    if kind == "dv":
        return Tiles(64, 128, 8, stages)
    if kind == "dk":
        return Tiles(32, 128, 8, stages)
    if kind == "dkdv":
        if head_dim <= 64:
            return Tiles(32, 64, 4, 3) if causal or short else Tiles(32, 128, 4, 3)
        if head_dim <= 128:
            if not hopper:
                return Tiles(64, 64, 4, 2)
            return Tiles(32, 64, 4, 3) if short_causal else Tiles(64, 128, 8, 3)
        if head_in_parts:  # one pass (splits_dkdv): 32 key rows hold both accumulators
            # without spills at D = 192 / 128 (16: 0.67-0.82x the backward; 64 spill); a
            # third stage 1.0-1.15x two (H200)
            return Tiles(32, 128, 8, stages)
        return Tiles(64, 64, 8, 2) if hopper else Tiles(32, 64, 8, 1)
    # dq
    if head_dim <= 64 and causal:
        return Tiles(64, 32, 4, 3) if short else Tiles(64, 64, 4, 3)
    if head_dim <= 128:
        return Tiles(128, 64, 8, 3)
    if not hopper:
        return Tiles(64, 32, 4, 1)
    # one 256-wide head-dim tile: 128 rows with 8 warps (the backward 1.05-1.09x the 64-row
    # tile's at 2k-16k keys, H200); q's and k's head dim in two tiles (D = 192) keeps 64 rows
    # (128 within 1%). Three stages take 160 KiB (64 rows) and 224 KiB (128) at D = 256; an
    # attn_mask's staged tiles take the 128 rows' past Hopper's 227 KiB (232-256 KiB)
    return Tiles(64, 32, 4, 3) if head_in_parts or masked else Tiles(128, 32, 8, 3)


# Tiles forced per kind by force() (benchmarks/tune.py times candidates this way); a plan's
# key holds them (calls.environment)
FORCED: dict = {}


@contextlib.contextmanager
def force(kind: str, tiles: Tiles):
    """Within the block, every launch of ``kind`` ("fwd", "dkdv", "dkdv_atomic", "dq") takes
    ``tiles`` instead of the table's (and the forward keeps them as they are)."""
    saved = FORCED.get(kind)
    FORCED[kind] = tiles
    try:
        yield
    finally:
        if saved is None:
            FORCED.pop(kind)
        else:
            FORCED[kind] = saved


def forced() -> tuple:
    """The tiles force() sets, by kind (a plan's key holds them: flashop/_launch/calls.py)."""
    return tuple(FORCED.items())


def tiles_for(kind: str, head_dim: int, dtype: torch.dtype, device: torch.device,
              mask_grad: bool = False, causal: bool = False, short: bool = False,
              value_dim: int = 0, head_in_parts: bool = False, masked: bool = False) -> Tiles:
    """The tiles of ``kind`` (see _gpu_tiles for ``causal``, ``short``, ``value_dim``,
    ``head_in_parts`` and ``masked``)."""
    if kind in FORCED:
        return FORCED[kind]
    if INTERPRETING:
        t = _INTERPRETER_TILES[kind]
        if kind == "fwd" and two_query_tiles(head_dim):  # as on Hopper GPUs
            t = replace(t, split_m=True)
        return t
    if kind == "fwd_ws":
        return WS_TILES
    if dtype == torch.float32:
        return _FP32_TILES[kind]
    if dtype == torch.float8_e4m3fn and kind == "fwd" and head_dim > 128 and is_hopper(device):
        # e4m3 tiles take half the bytes: 128 keys with three stages fit at D = 256 (the
        # autotuner's pick on an H200, 1.5x the 16-bit table's tiles there)
        return Tiles(128, 128, 8, 3)
    t = _gpu_tiles(kind, head_dim, is_hopper(device), causal, short, value_dim, head_in_parts,
                   masked)
    if mask_grad and t.BLOCK_M > 64:
        # dQ storing its fp32 dS tile for the attn_mask gradient: a 128x64 tile with 3
        # stages needs 256 KiB of shared memory on Hopper (227 KiB there)
        t = Tiles(64, t.BLOCK_N, 4, 2)
    return t


def forward_tiles(head_dim: int, dtype: torch.dtype, device: torch.device, flags: dict,
                  S_k, why=None, value_dim: int = 0) -> Tiles:
    """The forward's tiles for its modifier flags: tiles_for's, with one query tile of
    BLOCK_M / 2 rows instead of two where two measured slower or spill registers: an
    attn_mask (its loads in both tiles spill), a window's left bound (short programs whose
    masked bands double; a chunk's start is such a bound), causal-like with fewer than
    SHORT_KEYS keys where S_k is known (symbolic under torch.compile with dynamic shapes:
    no guard on it, two tiles)."""
    if "fwd" in FORCED:
        return FORCED["fwd"]
    short = is_short(S_k)
    t = tiles_for("fwd", head_dim, dtype, device, causal=flags["HAS_RIGHT"], short=short,
                  value_dim=value_dim, masked=flags["ATTN_MASK_KIND"] != 0)
    short_causal = flags["HAS_RIGHT"] and short
    if t.split_m:
        one = ("an attn_mask" if flags["ATTN_MASK_KIND"] != 0
               else "a window's left bound" if flags["HAS_LEFT"]
               else "a chunk" if flags["HAS_CHUNK"]
               else f"causal over fewer than {SHORT_KEYS} keys" if short_causal else None)
        if one is not None:
            decline(why, f"two query tiles per program: not with {one}")
            t = replace(t, BLOCK_M=t.BLOCK_M // 2, split_m=False)
    return t


# Autotuning (config.settings.autotune): instead of the table above, each kernel times the
# candidates below that fit the GPU's shared memory on its first call per key (head dims,
# modifier flags, dtypes and the lengths rounded up to a power of two, so a new length
# re-tunes only when it crosses a power of two). Off by default: the table holds the
# sweep's winners (benchmarks/tune.py times the same candidates) and a first call then
# costs no tuning. fp32 inputs, the dQ-by-atomics backward (it accumulates, so repeated
# runs would add up; its candidates serve benchmarks/tune.py only) and dQ with the
# attn_mask gradient keep their table tiles.
TILE_CANDIDATES = {
    "fwd": [Tiles(256, 64, 8, 3, split_m=True), Tiles(128, 64, 8, 3), Tiles(128, 128, 8, 3),
            Tiles(128, 64, 8, 2), Tiles(128, 32, 8, 2), Tiles(64, 64, 4, 3), Tiles(64, 32, 4, 2)],
    "dkdv": [Tiles(64, 64, 4, 2), Tiles(32, 128, 4, 3), Tiles(64, 128, 8, 3),
             Tiles(32, 128, 8, 3), Tiles(32, 64, 4, 3), Tiles(64, 64, 8, 2),
             Tiles(32, 64, 8, 1)],
    "dkdv_atomic": [Tiles(64, 128, 8, 3), Tiles(64, 64, 8, 2), Tiles(32, 128, 4, 3),
                    Tiles(64, 64, 4, 2), Tiles(64, 64, 8, 1)],
    "dv": [Tiles(64, 128, 8, 2), Tiles(32, 128, 8, 2), Tiles(64, 64, 8, 3), Tiles(32, 64, 8, 3)],
    "dk": [Tiles(32, 128, 8, 2), Tiles(64, 64, 8, 2), Tiles(16, 128, 8, 2), Tiles(32, 64, 8, 3)],
    "dq": [Tiles(128, 64, 8, 3), Tiles(128, 32, 8, 3), Tiles(128, 32, 4, 3), Tiles(64, 64, 4, 2),
           Tiles(64, 32, 4, 3), Tiles(64, 32, 4, 2), Tiles(64, 32, 4, 1)],
}


def autotunes(dtype: torch.dtype) -> bool:
    """Whether this call's kernels are autotuned (the switch, 16-bit, on a GPU)."""
    return config.settings.autotune and not INTERPRETING and dtype != torch.float32


def shared_memory_bytes(kind: str, t: Tiles, block_d: int, block_dv: int,
                        itemsize: int) -> int:
    """Shared memory of a kernel's operand tiles: those it loads in its loop take
    ``num_stages`` buffers (Triton's software pipelining), those it loads once take one;
    the dK/dV kernel with dQ atomics also stages its fp32 dQ tile; its dV part reads no V."""
    once, per_stage = {
        "fwd": (t.BLOCK_M * block_d, t.BLOCK_N * (block_d + block_dv)),
        "dq": (t.BLOCK_M * (block_d + block_dv), t.BLOCK_N * (block_d + block_dv)),
        "dv": (t.BLOCK_N * block_d, t.BLOCK_M * (block_d + block_dv)),
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
_AUTOTUNE_KEY = ["seq_bucket", "D", "DV", "HAS_LEFT", "HAS_RIGHT", "HAS_CHUNK",
                 "HAS_SOFTCAP", "HAS_ALIBI", "HAS_GATE", "ATTN_MASK_KIND", "IS_VARLEN", "TMA",
                 "PAGE_SIZE"]


def autotune_key(kernel) -> list:
    """The names of _AUTOTUNE_KEY that are ``kernel``'s arguments (newer Tritons refuse a
    key that names something else; only the forward has TMA and PAGE_SIZE: 1 unpaged, else
    the page whose size against BLOCK_N sets how the key tiles find their pages)."""
    return [name for name in _AUTOTUNE_KEY if name in kernel.arg_names]


@functools.lru_cache(maxsize=None)
def autotuned(kernel, kind: str, block_d: int, block_dv: int, itemsize: int,
              device_index: int):
    """``kernel`` autotuned over the candidates of ``kind`` that fit this GPU."""
    tiles = prune_tiles(kind, block_d, block_dv, itemsize, max_shared_memory(device_index))
    configs = [triton.Config(t.constexprs(kind), num_warps=t.num_warps,
                             num_stages=t.num_stages) for t in tiles]
    return triton.autotune(configs=configs, key=autotune_key(kernel))(kernel)


def seq_bucket(*lengths) -> int:
    """The autotuner's bucket of the lengths: the longest rounded up to a power of two (0,
    one key for every length, where they are symbolic under torch.compile)."""
    if not all(isinstance(n, int) for n in lengths):
        return 0
    return next_power_of_2(max(*lengths, 1))
