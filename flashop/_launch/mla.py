"""Launcher of the kernel over MLA's latent cache (flashop/kernels/mla.py): the append of
new rows, the split-KV attention and the merge of its splits (decode.py's merge kernel).

As the decode launcher (flashop/_launch/kvcache.py), whose tile type, split rule, append and
launches of the attention and the merge (launch_split_kv) it shares: every choice depends
on shapes, the dtype and the device, never on the values of ``cache_seqlens`` (no host
synchronization, CUDA-graph capture, one compilation for all lengths), and an eager call's
launches are planned once per signature.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from flashop import config
from flashop._launch import cpu, mla_gluon, tiles as tile_table
from flashop._launch.cpu import kvcache as cpu_kvcache
from flashop._launch.common import (
    TensorMeta, cdiv, decline, dtype_constexprs, ensure_triton_allocator, is_hopper,
    max_shared_memory, next_power_of_2, on_inputs_device, resolve_scale, tma_aligned,
    unit_stride_last,
)
from flashop._launch.calls import call_plan
from flashop._launch.launches import Planned, launch_planned
from flashop._launch.decode_tiles import DecodeTiles, call_splits, fit_shared_memory
from flashop._launch.kvcache import (
    _Plan, index_tensors, input_strides, kvcache_outputs, launch_split_kv, merge_launch,
    plain_append_launch,
)
from flashop._launch.options import PLAIN, Modifiers
from flashop._launch.scores import score_args
from flashop.kernels import INTERPRETING
from flashop.kernels.decode import kvcache_append_kernel
from flashop.kernels.mla import mla_decode_kernel

# the tiles force("mla", DecodeTiles(...)) sets take the table's place (benchmarks sweep so)
TILE_KIND = "mla"


# what the compiled kernel takes of shared memory beyond held_bytes: up to 4 KiB at 2 stages
# or more (layout conversions), 8 KiB at 64 rows and 64 keys in 2 stages (P passing between
# the two warp groups: 229376 B in all), measured for sm_90 with triton 3.6.0 and 3.9.0
MARGIN = 8 * 1024


def mla_tiles(rows: int, dtype: torch.dtype, page: int,
              shared_memory: int = 232448, own_values: int = 0) -> DecodeTiles:
    """The kernel's tiles for ``rows = G * S_q`` query rows per KV head over a cache of
    pages of ``page`` keys (0: dense), 576-dim rows, on a GPU of ``shared_memory`` bytes
    per block; ``own_values``: the dims of a value cache of its own (0: the values are the
    keys' leading dims), whose tiles are staged beside the keys'.

    Each program holds a [BLOCK_M, 512] fp32 accumulator: 64 rows at most (8 warps: 128
    registers a thread for it), fewer for fewer rows (16 at least, tl.dot's). The sweeps'
    winners on an H200 (benchmarks/decode.py --mla --sweep, benchmarks/tuning/
    2026-11-29-h200-mla-tiles*.csv): up to 16 rows over a dense cache or pages of a
    multiple of 64 keys, 64 keys per step with 4 warps, 3 stages dense and 5 paged, which
    is what holds two key tiles in flight either way (held_bytes; 0.85-0.88 of copy
    bandwidth at H = 16, B = 32, 8k keys, against 0.74 with 32 keys in 2 stages); other
    pages and up to 32 rows (their 64-key tiles spill), 32 keys per step in 2 stages with 4
    warps; 64 rows, 64 keys in 2 stages with 8 warps (two key buffers: 250-285 TFLOP/s
    at H = 128, B = 32, 8k keys, against 183-191 in one stage, before the kernel's regions
    split S between the warp groups: 272-291 since), one stage where that does
    not fit. A paged tile that lies in one page loads its one page id. fp32: 16 keys.
    Under the interpreter, small tiles."""
    block_m = max(16, next_power_of_2(rows))
    if INTERPRETING:
        return DecodeTiles(16, 16)
    block_m = min(block_m, 64)
    if dtype == torch.float32:
        return DecodeTiles(min(block_m, 32), 16, 4, 2)
    held = (576, dtype.itemsize, page > 0, shared_memory, own_values)  # fits' others
    if block_m == 16 and page % 64 == 0:
        t = DecodeTiles(16, 64, 4, 5 if page else 3)
        if fits(t, *held):
            return t
    if block_m <= 32:
        return DecodeTiles(block_m, 32, 4, 2)
    t = DecodeTiles(64, 64, 8, 2)
    return t if fits(t, *held) else DecodeTiles(64, 64, 8, 1)


# tensor descriptors by default from tiles of this many query rows: on an H200, +4-9% over
# pages of 64 and +0-4% dense at 64 rows; half the speed at 16 rows, where they spill
TMA_MIN_ROWS = 64


def descriptor_setting(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       values_in_keys: bool, why: Optional[list] = None) -> Optional[bool]:
    """Whether the `tl` kernel may read the cache's key tiles through tensor descriptors:
    False where it cannot or must not (FLASHOP_TMA=0; not 16-bit; values of their own;
    k_cache's start, strides, latent or rotary dims not 16-byte aligned; by default, a
    device but a Hopper GPU), True where FLASHOP_TMA=1 asks for them, None where the
    default rule decides by the plan's tiles (uses_descriptors). The alignment is each
    call's: the plan's key has it."""
    setting = config.settings.tma
    if setting is False:
        return decline(why, "tensor descriptors: off (FLASHOP_TMA=0)")
    if setting is None and (q.device.type != "cuda" or not is_hopper(q.device)):
        # (first: a decode step's host time counts, so no more checks)
        return decline(why, "tensor descriptors: by default on Hopper GPUs only")
    if q.dtype not in (torch.float16, torch.bfloat16):
        return decline(why, "tensor descriptors: 16-bit caches only")
    if not values_in_keys:
        return decline(why, "tensor descriptors: not with a value cache of its own")
    DV, size = v_cache.shape[-1], k_cache.element_size()
    if not (k_cache.stride(-1) == 1 and tma_aligned(k_cache) and DV * size % 16 == 0
            and (k_cache.shape[-1] - DV) * size % 16 == 0):
        return decline(why, "tensor descriptors: k_cache not 16-byte aligned")
    return setting


def uses_descriptors(setting: Optional[bool], t: DecodeTiles, paged: bool, tile_page: bool,
                     why: Optional[list] = None) -> bool:
    """Whether a plan's kernel reads its inner key tiles through descriptors: where
    descriptor_setting allows them, a dense cache or tiles that lie in one page, and
    FLASHOP_TMA=1 or, by default (on a Hopper GPU: descriptor_setting), tiles of
    TMA_MIN_ROWS rows or more."""
    if setting is False:
        return False
    if paged and not tile_page:
        return decline(why, "tensor descriptors: not for tiles that cross pages")
    if setting is None and t.BLOCK_M < TMA_MIN_ROWS:
        return decline(why, f"tensor descriptors: by default from {TMA_MIN_ROWS} query "
                            f"rows a program, not {t.BLOCK_M}")
    return True


def explain_descriptors(static: dict, q: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, values_in_keys: bool, why: list) -> bool:
    """flashop.explain's account of a plan's descriptors (its ``static`` arguments): the
    plan's choice, with the rules that declined them added to ``why``."""
    setting = descriptor_setting(q, k_cache, v_cache, values_in_keys, why)
    uses_descriptors(setting, DecodeTiles(static["BLOCK_M"], static["BLOCK_N"]),
                     static["IS_PAGED"], static["TILE_PAGE"], why)
    return static["TMA"]


def fits(t: DecodeTiles, D: int, itemsize: int, paged: bool, shared_memory: int,
         own_values: int = 0) -> bool:
    """Whether the kernel at tiles ``t`` fits ``shared_memory``: held_bytes, with MARGIN
    to spare."""
    return held_bytes(t, D, itemsize, paged, own_values) <= shared_memory - MARGIN


def held_bytes(t: DecodeTiles, D: int, itemsize: int, paged: bool,
               own_values: int = 0) -> int:
    """Shared memory of the compiled kernel's query tile and key tiles (rows of ``D``, and
    of ``own_values`` dims from a value cache of its own, staged alike), as
    Triton's pipeliner lays them out for sm_90 (triton 3.6.0 and 3.9.0 alike, compiled
    offline at 1-5 stages): the key loads run ``num_stages - 1`` tiles ahead, a paged
    tile's half that (its page id's load takes the other half), in one buffer at least;
    64-row tiles, whose products (wgmma) read their operands from shared memory while they
    run, take one buffer more where pipelined."""
    ahead = max(0, t.num_stages - 1)
    if paged:
        ahead //= 2
    buffers = max(1, ahead) + (1 if t.BLOCK_M >= 64 and t.num_stages > 1 else 0)
    # (unpipelined, a value tile of its own takes the key tile's buffer once S is computed)
    values = own_values * buffers * t.BLOCK_N if t.num_stages > 1 else 0
    return itemsize * (D * (t.BLOCK_M + buffers * t.BLOCK_N) + values)


def _make_plan(metas: tuple, options: tuple) -> _Plan:
    """The launches of a call whose tensors (q, k_cache, v_cache, k, v, cache_batch_idx,
    block_table, cache_leftpad) have the (shape, strides, dtype, device) ``metas`` (None
    for None), with ``options`` (causal, scale, num_splits, whether v_cache is
    k_cache[..., :DV], the forced tiles, whether the Gluon kernel takes the call:
    mla_gluon.serves). The outputs' strides are the call's to add."""
    q, k_cache, v_cache, k, v, batch_idx, block_table, leftpad = (
        None if m is None else TensorMeta(*m) for m in metas)
    causal, scale, num_splits, values_in_keys, forced, use_gluon, descriptors = options
    paged = block_table is not None
    append = None
    S_new = 0
    if k is not None:
        S_new = k.shape[1]
        append = plain_append_launch(k, None if values_in_keys else v, k_cache, v_cache,
                                     block_table, batch_idx is not None)
    B, S_q, H, D = q.shape
    H_kv, DV = k_cache.shape[2], int(v_cache.shape[3])
    if B * S_q * H == 0:
        return _Plan(append, None, None, None)
    D, G, page = int(D), int(H // H_kv), int(k_cache.shape[1])
    capacity = block_table.shape[1] * page if paged else page
    page_size = page if paged else 0
    qk_scale = score_args(PLAIN[causal], resolve_scale(scale, D), None)["qk_scale"]
    if use_gluon:
        num_splits = call_splits(num_splits, int(B * S_q * H // mla_gluon.ROWS),
                                 int(capacity), mla_gluon.TILES, D, 0, q.dtype.itemsize,
                                 q.device)
        merge, parts, _, _ = merge_launch(num_splits, B, S_q, H, DV, DV)
        decode = mla_gluon.decode_launch(
            num_splits, B, S_q, H, S_new, capacity, page, paged, batch_idx is not None,
            causal, qk_scale, block_table.stride[0] if paged else 0)
        return _Plan(append, decode, merge, parts, mla_gluon.KERNEL_NAME)
    itemsize = q.dtype.itemsize
    own_values = 0 if values_in_keys else DV
    t = dict(forced).get(TILE_KIND)
    if t is None:
        if INTERPRETING:
            t = mla_tiles(int(G * S_q), q.dtype, page_size)
        else:  # the rows' staged blocks: D dims, and DV more where the values are their own
            shared_memory = max_shared_memory(q.device.index)
            t = mla_tiles(int(G * S_q), q.dtype, page_size, shared_memory, own_values)
            if not fits(t, D, itemsize, paged, shared_memory, own_values):
                t = fit_shared_memory(t, D, own_values, itemsize, shared_memory)
    row_tiles = cdiv(G * S_q, t.BLOCK_M)
    num_splits = call_splits(num_splits, int(B * H_kv * row_tiles), int(capacity), t, D, 0,
                             itemsize, q.device)
    merge, parts, _, _ = merge_launch(num_splits, B, S_q, H, DV, DV)
    tile_page = paged and page >= t.BLOCK_N and not t.key_page_ids
    decode = Planned((num_splits, H_kv * row_tiles, B), dict(
        **input_strides(q, k_cache, v_cache),
        stride_tb=block_table.stride[0] if paged else 0,
        S_q=S_q, S_new=S_new, capacity=capacity, G=G,
        qk_scale=qk_scale, DV=DV, D_ROPE=D - DV, BLOCK_M=t.BLOCK_M, BLOCK_N=t.BLOCK_N,
        PAGE_SIZE=page if paged else 1, IS_PAGED=paged,
        TILE_PAGE=tile_page, HAS_BATCH_IDX=batch_idx is not None,
        HAS_LEFTPAD=leftpad is not None, IS_CAUSAL=causal, V_IN_K=values_in_keys,
        TMA=uses_descriptors(descriptors, t, paged, tile_page),
        SPLIT=num_splits > 1, **dtype_constexprs(q.dtype),
        num_warps=t.num_warps, num_stages=t.num_stages))
    return _Plan(append, decode, merge, parts, "mla_decode_kernel")


# eager calls of one signature share their plan (a decode loop repeats one signature)
_plan = functools.lru_cache(maxsize=1024)(_make_plan)


@on_inputs_device
def attention_with_latent_cache(q: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, k: Optional[torch.Tensor],
                                v: Optional[torch.Tensor], cache_seqlens: torch.Tensor,
                                cache_batch_idx: Optional[torch.Tensor],
                                block_table: Optional[torch.Tensor], scale: Optional[float],
                                mods: Modifiers, num_splits: int,
                                cache_leftpad: Optional[torch.Tensor] = None,
                                values_in_keys: bool = True, plan_only: bool = False
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Append k (B, S_new, H_kv, D) into k_cache in place, then attend; returns (out
    (B, S_q, H, DV), lse) as kvcache_outputs allocates them. Where ``values_in_keys``
    (v_cache is k_cache[..., :DV], MLA's latent cache) each row is written once, all D
    dims, and read once for both products; else ``v`` (None: k[..., :DV]) is appended to
    v_cache too and the values are read from it. ``mods`` holds causal alone (the checks
    refuse the other modifiers). ``num_splits`` 0 picks the splits (auto_splits).
    ``plan_only``: return the plan and launch nothing (flashop.explain)."""
    if cpu.serves(q):
        if plan_only:
            return None
        if k is not None and not values_in_keys:
            v = k[..., :v_cache.shape[-1]] if v is None else v
        return cpu_kvcache.attention_with_kvcache(
            q, k_cache, v_cache, k, None if values_in_keys else v, cache_seqlens,
            cache_batch_idx, block_table, resolve_scale(scale, q.shape[-1]), mods,
            cache_leftpad, None, None, True, False, None, None, None,
            kvcache_outputs(q, v_cache))
    cache_seqlens, cache_batch_idx, cache_leftpad, block_table = index_tensors(
        cache_seqlens, cache_batch_idx, cache_leftpad, block_table)
    if k is not None:
        k = unit_stride_last(k)
        if values_in_keys:
            v = None  # (k's leading columns, or None: the checks' aliasing)
        else:
            v = k[..., :v_cache.shape[-1]] if v is None else unit_stride_last(v)
    q = unit_stride_last(q)
    tensors = (q, k_cache, v_cache, k, v, cache_batch_idx, block_table, cache_leftpad)
    forced = tile_table.forced()  # (tiles forced for the `tl` kernel's sweeps: that kernel)
    use_gluon = TILE_KIND not in dict(forced) and mla_gluon.serves(
        q, k_cache, values_in_keys, block_table, cache_leftpad)
    descriptors = None if use_gluon else descriptor_setting(q, k_cache, v_cache, values_in_keys)
    options = (mods.causal, scale, num_splits, values_in_keys, forced, use_gluon, descriptors)
    plan = call_plan(_plan, tensors, options)
    if plan_only:
        return plan
    if plan.append is not None:
        launch_planned(kvcache_append_kernel, plan.append, k=k, v=v, k_cache=k_cache,
                       v_cache=None if values_in_keys else v_cache,
                       cache_seqlens=cache_seqlens,
                       cache_batch_idx=cache_batch_idx, block_table=block_table,
                       rotary_cos=None, rotary_sin=None, k_descale=None, v_descale=None)
    if use_gluon:
        return launch_split_kv(
            mla_gluon.kernel(), plan, q, v_cache, launch=mla_gluon.launch,
            **mla_gluon.descriptors(q, k_cache), cache_seqlens=cache_seqlens,
            cache_batch_idx=cache_batch_idx, block_table=block_table)
    if plan.decode is not None and plan.decode.static["TMA"]:
        ensure_triton_allocator()
    return launch_split_kv(mla_decode_kernel, plan, q, v_cache, q=q, k_cache=k_cache,
                           v_cache=k_cache if values_in_keys else v_cache,
                           cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
                           block_table=block_table, cache_leftpad=cache_leftpad)
