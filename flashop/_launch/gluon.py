"""Launchers of the Gluon forward and backward (flashop/kernels/forward_gluon.py and
backward_gluon.py): when each serves a call, the inputs as its descriptors read them, and
the launches.

The Gluon kernel is written for one Triton release (GLUON_TRITON): under any other, and
under Triton's interpreter, its module is never imported and every call takes the ``tl``
kernels. It serves eager calls (and CUDA graphs captured from them), and the calls of
graphs that ``torch.compile`` runs here (compiled_here): Inductor cannot trace Gluon
kernels, so there the operators call them through an opaque operator
(flashop/_ops/attention.py), which launches them as an eager call does. An exported graph
(``torch.export``, AOTInductor's packages) keeps the ``tl`` kernels, which Inductor
compiles with the rest of the graph.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from flashop import config
from flashop._launch.common import (
    cdiv, decline, head_blocks, is_traced, known_shorter, sm_count, tma_aligned,
)
from flashop._launch.launches import launch_now, triton_version
from flashop.kernels import INTERPRETING

# triton==3.6: the Gluon API the kernel is written against
GLUON_TRITON = (3, 6)
# the forward's tiles per head dim: (BLOCK_M query rows, FWD_GROUP_ROWS per consumer group;
# BLOCK_N keys, a multiple of FWD_GROUP_ROWS, so that a causal group's diagonal is one key
# tile; STAGES of K and V in shared memory). Three groups at D = 64, where they measured
# fastest; at D = 256, 64 keys in two stages (what fits Hopper's shared memory beside the Q
# tile), whose K and V buffers are released apart (FWD_KV_APART), so the next K loads sooner;
# at D = 192 (DV = 128), 64 keys in three stages (1.07-1.25x 128 keys in two, H200)
FWD_GROUP_ROWS = 64
FWD_TILES = {64: (192, 128, 3), 128: (128, 128, 3), 256: (128, 64, 2), 192: (128, 64, 3)}
# the values' head dim the forward takes for each of q's and k's head dims: the same, but
# 128 at D = 192 (DeepSeek's prefill; q's and k's head dim in two tiles, 128 + 64: Gluon's
# tiles are powers of two)
FWD_VALUE_DIMS = {64: 64, 128: 128, 256: 256, 192: 128}
FWD_KV_APART = {256}
# where each consumer group stores its output by TMA through its Q buffer, Q released after
# the store (D = 64 keeps the pointer store, which releases Q sooner)
FWD_O_TMA = {128, 256}
# registers per thread of each consumer group (by the number of groups) and of the load
# warp, within the 65536 of an SM (three groups measured fastest at 160)
CONSUMER_REGS = {2: 232, 3: 160}
LOAD_REGS = 24
MAX_GRID_Y = 65535  # the backward grid's second dimension: B * H_kv * split (dQ by atomics)
MAX_GRID_X = 2 ** 31 - 1  # its first: every program where deterministic
# The default rule (config.settings.gluon unset), where it measured faster than the tl
# kernels: calls of at least GLUON_MIN_QUERIES queries (no shorter call was measured) over at
# least GLUON_MIN_KEYS[D, causal] keys
GLUON_MIN_QUERIES = 1024
GLUON_MIN_KEYS = {(64, False): 2048, (64, True): 4096, (128, False): 1024, (128, True): 1024,
                  (256, False): 1024, (256, True): 1024, (192, False): 1024,
                  (192, True): 1024}
# with dropout, the (D, causal) where the Gluon forward measured faster than the tl one
# (elsewhere its draws cost more; at D = 192, DV = 128 1.01-1.17x, causal and not); at D = 64
# in two consumer groups of more registers (three spill the draws)
GLUON_DROPOUT = {(128, False), (64, False), (192, False), (192, True)}
FWD_DROPOUT_TILES = {64: (128, 128, 3)}
# the backward: key tiles of BWD_BLOCK_N (a consumer group's half each), query tiles of
# BWD_BLOCK_M, Q and dO BWD_STAGES deep
BWD_BLOCK_M, BWD_BLOCK_N = 64, 128
BWD_STAGES = 2
BWD_CONSUMER_REGS, BWD_LOAD_REGS = 240, 24
# where deterministic, the key tiles of one (batch, KV head) that run side by side
BWD_KEY_GROUP = 4
# where deterministic and not causal, at these head dims, with no more key tiles than SMs:
# all of a (batch, KV head)'s key tiles side by side instead, each starting on its own query
# tile, dQ's adds into a query tile in the order the key tiles reach it (backward_rotates;
# on an H200 +4-8% at D = 128 over 1k-8k keys, 1% at 16k; 1-4% slower at D = 64 from 2k)
BWD_ROTATE = True
BWD_ROTATE_DIMS = (128,)
# dQ by atomics: a causal grouped-query call of fewer programs (key tiles x batch x KV heads)
# than BWD_SPLIT_PROGRAMS per SM splits each group's query heads between programs
# (backward_split; measured faster up to 2048 programs, performance-notes)
BWD_SPLIT_PROGRAMS = 16
BWD_HEAD_DIMS = (64, 128)
# The deterministic backward's default rule (its dQ adds in a fixed order: key-tile order,
# or rotated, BWD_ROTATE), where it measured faster than the tl kernels: at least
# BWD_MIN_KEYS[D, causal] keys (at D = 64, none: slower at every length measured)
BWD_MIN_KEYS = {(128, False): 2048, (128, True): 1536}
# The default backward (dQ by atomics, no order asked for): at least BWD_ATOMIC_MIN_KEYS
# keys at every (D, causal), where it measured faster than the tl kernels' deterministic
# backward (at 1k keys as fast or slower: the deterministic kernels keep those calls)
BWD_ATOMIC_MIN_KEYS = {(64, False): 2048, (64, True): 2048, (128, False): 2048,
                       (128, True): 2048}
# With dropout, the backward's rule instead: at least BWD_DROPOUT_MIN_KEYS[D, causal] keys,
# where it measured faster than the tl kernels (its draws cost less; shorter calls were not
# measured)
BWD_DROPOUT_MIN_KEYS = {(128, False): 1024, (128, True): 4096, (64, False): 1024,
                        (64, True): 1024}


@functools.lru_cache(maxsize=None)
def unavailable(device: torch.device) -> Optional[str]:
    """Why the Gluon kernels cannot run on ``device``, or None where they can: the Triton
    release they are written for, not interpreting, a Hopper GPU (sm_90; their wgmma and TMA
    are Hopper's)."""
    if INTERPRETING:
        return "not under Triton's interpreter"
    if triton_version() != GLUON_TRITON:
        return (f"triton {'.'.join(map(str, triton_version()))} is not "
                f"{'.'.join(map(str, GLUON_TRITON))}")
    if device.type != "cuda":
        return f"{device.type} tensors"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "not a Hopper GPU (sm_90)"
    return None


def available(device: torch.device) -> bool:
    """Whether the Gluon kernels can run on ``device`` (unavailable)."""
    return unavailable(device) is None


@functools.lru_cache(maxsize=None)
def _kernel():
    from flashop.kernels.forward_gluon import attention_fwd_gluon_kernel
    return attention_fwd_gluon_kernel


@functools.lru_cache(maxsize=None)
def _bwd_kernel():
    from flashop.kernels.backward_gluon import attention_bwd_gluon_kernel
    return attention_bwd_gluon_kernel


def compiled_here(x: torch.Tensor) -> bool:
    """Whether ``x`` is a stand-in of a call that torch.compile traces into a graph run in
    this process, rather than data or a call traced for export (``torch.export``, and
    AOTInductor's compilation of an exported program, whose packages must hold only the
    kernels Inductor sees and no Python-registered operator)."""
    if not is_traced(x) or torch.compiler.is_exporting():
        return False
    from torch._inductor.virtualized import V
    return not V.aot_compilation


def takes_call(q: torch.Tensor, plain: bool, traced: bool, why, what: str) -> bool:
    """What both Gluon kernels ask of a call: the switch not off, a plain call (``plain``),
    the kernels available on q's device, 16-bit inputs, an eager call (``traced``: a call
    traced for a graph compiled here, compiled_here). ``what``: the kernel, for ``why``."""
    if config.settings.gluon is False:
        return decline(why, f"{what}: off (FLASHOP_GLUON=0)")
    missing = unavailable(q.device)
    if missing is not None:
        return decline(why, f"{what}: {missing}")
    if not plain:
        return decline(why, f"{what}: dense calls with no modifier but causal and dropout")
    if q.dtype not in (torch.float16, torch.bfloat16):
        return decline(why, f"{what}: float16 or bfloat16 inputs only")
    if not (compiled_here(q) if traced else not is_traced(q)):
        return decline(why, f"{what}: not in exported graphs (the tl kernels are exported)")
    return True


def _same_length(S_q, S_k) -> bool:
    """S_q == S_k, known without a guard where the lengths are symbolic (torch.compile's
    dynamic shapes: the same symbol, as in self-attention)."""
    return statically_known_true(S_q == S_k)


def _addressable(*tensors: torch.Tensor) -> bool:
    """Whether the descriptors can address every tensor: a unit-stride last dimension and
    16-byte aligned start and strides."""
    return all(x.stride(-1) == 1 and tma_aligned(x) for x in tensors)


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, qk_scale: float,
           plain: bool, dropout: bool = False, traced: bool = False, why=None) -> bool:
    """Whether the Gluon kernel takes this forward: where available, an eager call of the
    plain forward (``plain``: no modifier, no sinks, dense; ``causal`` the only bound, and
    ``dropout``) with 16-bit inputs, (D, DV) in FWD_VALUE_DIMS, qk_scale > 0, S_k > 0,
    S_q == S_k where causal, and inputs its descriptors can address
    (unit-stride head dim, 16-byte aligned start and strides); unless the switch forces it,
    the default rule above. ``traced``: whether a call traced for a graph compiled here
    (compiled_here) may take it when the graph runs; symbolic lengths then count as long
    (no guard: the eager launcher that the opaque operator runs decides on the lengths)."""
    what = "Gluon forward"
    setting = config.settings.gluon
    if not takes_call(q, plain, traced, why, what):
        return False
    B, S_q, H, D = q.shape
    S_k, DV = k.shape[1], v.shape[-1]
    D = int(D)  # (symbolic where traced with dynamic shapes: the kernels specialize on it)
    if FWD_VALUE_DIMS.get(D) != DV:
        takes = ", ".join(f"{d} / {dv}" for d, dv in FWD_VALUE_DIMS.items())
        return decline(why, f"{what}: head dims (D / DV) {takes} only, not {D} / {DV}")
    if qk_scale <= 0 or S_k == 0:
        return decline(why, f"{what}: a positive scale and at least one key")
    if causal and not _same_length(S_q, S_k):
        return decline(why, f"{what}: causal calls with S_q = S_k only")
    if setting is None:
        if known_shorter(S_q, GLUON_MIN_QUERIES):
            return decline(why, f"{what}: by default from {GLUON_MIN_QUERIES} queries, not "
                                f"at {S_q}")
        if known_shorter(S_k, GLUON_MIN_KEYS[D, causal]):
            return decline(why, f"{what}: by default from {GLUON_MIN_KEYS[D, causal]} keys "
                                f"at D = {D}{' causal' if causal else ''}, not at {S_k}")
        if dropout and (D, causal) not in GLUON_DROPOUT:
            return decline(why, f"{what}: by default no dropout at D = {D}"
                                f"{' causal' if causal else ''}")
    if not _addressable(q, k, v):
        return decline(why, f"{what}: q, k or v not 16-byte aligned with a unit-stride head "
                            f"dim")
    return True


def serves_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                    causal: bool, plain: bool, deterministic: bool,
                    dropout: bool = False, traced: bool = False, why=None) -> bool:
    """Whether the Gluon backward takes this call, with dQ's adds in key-tile order
    (``deterministic``) or not (dQ by atomics): where available, an eager call of the plain
    backward (and ``dropout``) with 16-bit inputs, D == DV in BWD_HEAD_DIMS, S_q == S_k
    where causal, a grid within bounds, and inputs its descriptors can address; unless a
    switch forces it (config.settings.gluon, or dq_atomics for the atomics), the default
    rules above (BWD_DROPOUT_MIN_KEYS with dropout, else BWD_MIN_KEYS where deterministic,
    else BWD_ATOMIC_MIN_KEYS). config.settings.gluon False turns it off. ``traced``: as in
    serves()."""
    what = ("Gluon backward, dQ in key-tile order" if deterministic
            else "Gluon backward, dQ by atomics")
    if not takes_call(q, plain, traced, why, what):
        return False
    B, S_q, H, D = q.shape
    S_k, H_kv, DV = k.shape[1], k.shape[2], v.shape[-1]
    D = int(D)  # (as in serves)
    if D != DV or D not in BWD_HEAD_DIMS:
        return decline(why, f"{what}: head dims {', '.join(map(str, BWD_HEAD_DIMS))} with "
                            f"DV = D only, not D = {D}, DV = {DV}")
    if causal and not _same_length(S_q, S_k):
        return decline(why, f"{what}: causal calls with S_q = S_k only")
    # (known without a guard: a symbolic grid is checked when the graph runs)
    if statically_known_true(B * H_kv * cdiv(S_k, BWD_BLOCK_N) > MAX_GRID_X if deterministic
                             else B * H_kv > MAX_GRID_Y):
        return decline(why, f"{what}: a grid past its bounds")
    rule = (BWD_DROPOUT_MIN_KEYS if dropout else BWD_MIN_KEYS if deterministic
            else BWD_ATOMIC_MIN_KEYS)
    forced = config.settings.gluon or (not (deterministic or dropout)
                                       and config.settings.dq_atomics)
    min_keys = rule.get((D, causal))
    if not forced and (min_keys is None or known_shorter(S_k, min_keys)):
        at = f"D = {D}{' causal' if causal else ''}{' with dropout' if dropout else ''}"
        if min_keys is None:
            return decline(why, f"{what}: not by default at {at} (slower there)")
        return decline(why, f"{what}: by default from {min_keys} keys at {at}, not at {S_k}")
    if not _addressable(q, k, v, dout):
        return decline(why, f"{what}: q, k, v or dout not 16-byte aligned with a unit-stride "
                            f"head dim")
    return True


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@functools.lru_cache(maxsize=None)
def _tile_layout(block: tuple, dtype: torch.dtype):
    """The shared-memory layout of a descriptor's tile ``block`` (looked up once: a call's
    host time counts at short sequences)."""
    from triton.experimental.gluon import language as gl
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, _GL_DTYPES[dtype]))


@functools.lru_cache(maxsize=None)
def _descriptor_type():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    class Descriptor(TensorDescriptor):
        """A host-made tensor descriptor that equals another of the same dtype and block
        (``spec``; its layout follows from them, _tile_layout), what Triton specialises a
        kernel on, so that a launch's key (launches.launch_now) can hold it."""

        def __eq__(self, other):
            return type(other) is Descriptor and self.spec == other.spec

        def __hash__(self):
            return hash(self.spec)

        def rebased(self, x: torch.Tensor) -> "Descriptor":
            """This descriptor of ``x``, a tensor of its base's shape, strides and dtype (a
            plan's replay: plans._PlannedLaunch); of None, a template that keeps no
            tensor alive."""
            d = object.__new__(Descriptor)  # (copy.copy's protocol costs several µs)
            d.__dict__.update(self.__dict__)
            d.base = x
            return d

        def launch_key(self) -> "Descriptor":
            """An equal descriptor that holds no tensor, as a launch cache keeps it (a
            cached key must not keep its first call's tensors alive)."""
            kept = object.__new__(Descriptor)
            kept.spec = self.spec
            return kept

    return Descriptor


def _descriptor(x: torch.Tensor, block_rows: int, block_cols: Optional[int] = None):
    """A descriptor of ``x`` (B, S, H, D) as it is strided, its tiles [1, block_rows, 1,
    block_cols] (default: D). Made without TensorDescriptor's checks, which serves() and
    serves_backward() have made (_addressable; no empty dimension reaches a launch)."""
    return descriptor_of(x, (1, block_rows, 1, block_cols or x.shape[-1]))


def descriptor_of(x: torch.Tensor, block: tuple):
    """A descriptor of ``x`` as it is strided, its tiles ``block`` (as _descriptor)."""
    d = object.__new__(_descriptor_type())
    d.base, d.shape, d.strides, d.block_shape = x, list(x.shape), list(x.stride()), list(block)
    d.layout, d.padding, d.spec = _tile_layout(block, x.dtype), "zero", (x.dtype, block)
    return d


def _strides(prefix: str, x: torch.Tensor) -> dict:
    """``stride_<prefix>b``, ``..s``, ``..h``, ``..d`` of a (B, S, H, D) tensor."""
    return dict(zip((f"stride_{prefix}{d}" for d in "bshd"), x.stride()))


def work_units(S_q: int, bh: int, block_m: int, causal: bool) -> int:
    """The Gluon forward's work units (its kernel's _work_item): each (batch, head)'s query
    tiles, or where causal its pairs of them (the middle tile of an odd count alone). Its
    grid holds one program per SM (its registers and shared memory hold one), each taking
    units in turn, so that one program's epilogue runs while its next unit's tiles load."""
    tiles = cdiv(S_q, block_m)
    return bh * (cdiv(tiles, 2) if causal else tiles)


def forward_tiles(D: int, dropout: bool) -> tuple:
    """The Gluon forward's (BLOCK_M, BLOCK_N, STAGES) at head dim D (FWD_TILES; with
    dropout, FWD_DROPOUT_TILES where given)."""
    return FWD_DROPOUT_TILES.get(D, FWD_TILES[D]) if dropout else FWD_TILES[D]


def forward_head_tiles(D: int) -> tuple:
    """The Gluon forward's tiles of q's and k's head dim: (D, 0), or where D is no power of
    two (Gluon's tiles are) two, common.head_blocks' (D = 192: 128 and 64)."""
    return head_blocks(D) if D & (D - 1) else (D, 0)


def attention_forward(q, k, v, out, lse, lse_log2, causal: bool, qk_scale: float,
                      dropout_seed: torch.Tensor, dropout_p: float, DROPOUT: bool) -> None:
    """Launch the Gluon forward into ``out`` (B, S_q, H, DV), ``lse`` and ``lse_log2``
    (B, H, S_q), where serves() said it takes the call (``out`` as
    attention.attention_forward_outputs allocates it, which its descriptor can address); the
    dropout arguments as the ``tl`` forward takes them (problem.dropout_args)."""
    B, S_q, H, D = q.shape
    S_k, H_kv, DV = k.shape[1], k.shape[2], v.shape[-1]
    BLOCK_M, BLOCK_N, STAGES = forward_tiles(D, DROPOUT)
    units = work_units(S_q, B * H, BLOCK_M, causal)
    # (the kernel's second descriptors are its first where there is no second tile)
    d1, d2 = forward_head_tiles(D)
    q_desc, k_desc = _descriptor(q, FWD_GROUP_ROWS, d1), _descriptor(k, BLOCK_N, d1)
    launch_now(
        _kernel(), (min(units, sm_count(q.device)),),
        q_desc=q_desc, k_desc=k_desc, v_desc=_descriptor(v, BLOCK_N),
        q_desc2=_descriptor(q, FWD_GROUP_ROWS, d2) if d2 else q_desc,
        k_desc2=_descriptor(k, BLOCK_N, d2) if d2 else k_desc,
        o_desc=_descriptor(out, FWD_GROUP_ROWS), o=out,
        lse=lse, lse_log2=lse_log2, **_strides("o", out), stride_lb=lse.stride(0),
        stride_lh=lse.stride(1),
        S_q=S_q, S_k=S_k, H=H, G=H // H_kv, n_units=units, qk_scale=qk_scale,
        dropout_seed=dropout_seed, dropout_p=dropout_p,
        D=D, DV=DV, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES,
        KV_APART=D in FWD_KV_APART, O_TMA=D in FWD_O_TMA, CAUSAL=causal,
        MASK_LAST=causal or S_k % BLOCK_N != 0, DROPOUT=DROPOUT,
        CONSUMER_REGS=CONSUMER_REGS[BLOCK_M // FWD_GROUP_ROWS], LOAD_REGS=LOAD_REGS,
        num_warps=4)


def backward_split(q: torch.Tensor, k: torch.Tensor, causal: bool,
                   deterministic: bool) -> int:
    """Between how many programs (a divisor of G) the Gluon backward splits each (batch,
    KV head, key tile)'s G query heads; its grid then holds key tiles x batch x KV heads x
    split programs. 1 where deterministic (dK and dV are then each summed in one program).
    Where causal (key tiles of unequal work), the fewest that bring the grid to
    BWD_SPLIT_PROGRAMS per SM, or the most allowed; where not, the most that keep the
    grid within one program per SM (one wave of equal programs: more waves cost more
    than the atomics save), or 1. Never a grid past MAX_GRID_Y."""
    B, S_k, H_kv = k.shape[0], k.shape[1], k.shape[2]
    G = q.shape[2] // H_kv
    programs = B * H_kv * cdiv(S_k, BWD_BLOCK_N)
    sms = sm_count(q.device)
    if deterministic:
        return 1
    split = 1
    for s in range(2, G + 1):
        if G % s or B * H_kv * s > MAX_GRID_Y:
            continue
        if causal:
            if programs * split >= BWD_SPLIT_PROGRAMS * sms:
                break
        elif programs * s > sms:
            break
        split = s
    return split


def backward_buffer(q: torch.Tensor, k: torch.Tensor, deterministic: bool, split: int):
    """The fp32 buffers of the Gluon backward, from one allocation that the preprocess kernel
    zeroes (attention.attention_backward): dQ's, laid out as q (contiguous); where
    ``split`` > 1 (backward_split), dK's and dV's, laid out as k (contiguous), after it;
    where ``deterministic``, dQ's int32 counters (one per query tile), last:
    (buf, dq_acc, dq_sem or None, dk_acc or None, dv_acc or None)."""
    B, S_q, H, D = q.shape
    n_q = q.numel()
    n_kv = k.numel() if split > 1 else 0
    n_sem = B * H * cdiv(S_q, BWD_BLOCK_M) if deterministic else 0
    buf = torch.empty(n_q + 2 * n_kv + n_sem, device=q.device, dtype=torch.float32)
    dq_acc = buf[:n_q].view(q.shape)
    dk_acc = dv_acc = None
    if split > 1:
        dk_acc = buf[n_q:n_q + n_kv].view(k.shape)
        dv_acc = buf[n_q + n_kv:n_q + 2 * n_kv].view(k.shape)
    dq_sem = buf[n_q + 2 * n_kv:].view(torch.int32) if deterministic else None
    return buf, dq_acc, dq_sem, dk_acc, dv_acc


def backward_rotates(causal: bool, D: int, S_q: int, S_k: int, device: torch.device) -> bool:
    """Whether the Gluon backward with dQ in a fixed order (the reproducible one) runs that
    order rotated (BWD_ROTATE; choice.choose_backward asks): not causal, at
    BWD_ROTATE_DIMS, no more key tiles than the GPU's SMs, so that every key tile of a
    (batch, KV head), each of which may wait on any other's adds, can be resident at once
    (a program per SM at least; the programs launched before them finish without waiting
    on them), and at least as many query tiles as key tiles (with fewer, key tiles start
    on the same query tile and their adds wait on each other there)."""
    n_tiles = cdiv(S_k, BWD_BLOCK_N)
    return (BWD_ROTATE and not causal and D in BWD_ROTATE_DIMS
            and n_tiles <= sm_count(device) and cdiv(S_q, BWD_BLOCK_M) >= n_tiles)


def attention_backward(q, k, v, dout, lse_log2, delta, dq_acc, dq_sem, dk, dv, causal: bool,
                       sm_scale: float, qk_scale: float, dropout_seed: torch.Tensor,
                       dropout_p: float, DROPOUT: bool, split: int = 1,
                       rotate: bool = False) -> None:
    """Launch the Gluon backward where serves_backward() said it takes the call: dK and dV
    into ``dk``, ``dv`` (B, S_k, H_kv, D), where ``split`` > 1 (backward_split) added into
    the zeroed fp32 buffers that backward_buffer() made; dQ added into ``dq_acc`` in a
    fixed order where ``dq_sem`` is given (rotated where ``rotate``: backward_rotates, else
    key-tile order), by atomics where it is None;
    ``delta`` = rowsum(dO * O) - dlse as the preprocess kernel stores it; the dropout
    arguments as the ``tl`` kernels take them (problem.dropout_args)."""
    B, S_q, H, D = q.shape
    S_k, H_kv, DV = k.shape[1], k.shape[2], v.shape[-1]
    deterministic = dq_sem is not None
    n_tiles = cdiv(S_k, BWD_BLOCK_N)
    launch_now(
        _bwd_kernel(),
        (B * H_kv * n_tiles,) if deterministic else (n_tiles, B * H_kv * split),
        q_desc=_descriptor(q, BWD_BLOCK_M), k_desc=_descriptor(k, BWD_BLOCK_N),
        v_desc=_descriptor(v, BWD_BLOCK_N), do_desc=_descriptor(dout, BWD_BLOCK_M),
        dq_desc=_descriptor(dq_acc, BWD_BLOCK_M, D // 2),
        dq_sem=dq_sem, lse_log2=lse_log2, delta=delta,
        dk=dk, dv=dv, stride_lb=lse_log2.stride(0), stride_lh=lse_log2.stride(1),
        **_strides("dk", dk), **_strides("dv", dv),
        S_q=S_q, S_k=S_k, H_kv=H_kv, G=H // H_kv, sm_scale=sm_scale, qk_scale=qk_scale,
        dropout_seed=dropout_seed, dropout_p=dropout_p,
        D=D, DV=DV, BLOCK_M=BWD_BLOCK_M, BLOCK_N=BWD_BLOCK_N, STAGES=BWD_STAGES,
        CAUSAL=causal, MASK_KEYS=S_k % BWD_BLOCK_N != 0, DETERMINISTIC=deterministic,
        KEY_GROUP=BWD_KEY_GROUP,
        ROTATE=rotate,
        SPLIT=split, DROPOUT=DROPOUT,
        CONSUMER_REGS=BWD_CONSUMER_REGS, LOAD_REGS=BWD_LOAD_REGS, num_warps=4)
