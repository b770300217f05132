"""Launchers of the key/value-cache kernels (flashop/kernels/decode.py): the append of new
keys and values, the split-KV attention and the merge of its splits.

Every choice here (tiles, number of splits, grid) depends on shapes, the dtype and the
device only, never on the values of ``cache_seqlens``: a call needs no host
synchronization, can be captured in a CUDA graph, and compiles once for all lengths.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import NamedTuple, Optional

import torch

from flashop._launch import cpu
from flashop._launch.cpu import kvcache as cpu_kvcache
from flashop._launch.common import (
    TensorMeta, block_dim, cdiv, dtype_constexprs, max_shared_memory, next_power_of_2,
    on_inputs_device, resolve_scale, unit_stride_last,
)
from flashop._launch.calls import call_plan
from flashop._launch.choice import Choice
from flashop._launch.decode_tiles import (
    call_splits, decode_tiles, fit_shared_memory, short_run_tiles,
)
from flashop._launch.launches import Planned, launch_planned
from flashop._launch.options import Modifiers
from flashop._launch.problem import check_row_offsets
from flashop._launch.scores import score_args, sink_args
from flashop.kernels import INTERPRETING
from flashop.kernels.decode import (
    attention_decode_kernel, attention_decode_merge_kernel, kvcache_append_kernel,
)

def kvcache_outputs(q: torch.Tensor, v_cache: torch.Tensor,
                    dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs' allocation, shared by the op and its fake: out (B, S_q, H, DV) in q's
    dtype (or ``dtype``) and lse (B, H, S_q) fp32, both contiguous."""
    B, S_q, H, _ = q.shape
    out = q.new_empty(B, S_q, H, v_cache.shape[-1], dtype=dtype)
    lse = q.new_empty(B, H, S_q, dtype=torch.float32)
    return out, lse


class _Plan(NamedTuple):
    """A call's launches: the append (None without new keys), the split-KV attention (None
    where the output is empty), the merge of its splits (None with one split), and the
    shapes of the splits' partial outputs and lse (None with one split); the attention
    kernel's name (flashop.explain's, and which one the launcher launches)."""

    append: Optional[Planned]
    decode: Optional[Planned]
    merge: Optional[Planned]
    parts: Optional[tuple]
    kernel: str = "attention_decode_kernel"


def _contiguous_strides(shape: tuple) -> tuple:
    """The strides of a contiguous tensor of ``shape`` (the splits' partial outputs)."""
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= size
    return tuple(reversed(strides))


def _rotary_args(cos: Optional[TensorMeta], interleaved: bool) -> dict:
    """The kernels' rotary arguments (rotate_rows): none (ROTARY_DIM 0) without cos."""
    if cos is None:
        return dict(stride_rs=0, seqlen_ro=0, ROTARY_DIM=0, ROTARY_INTERLEAVED=False)
    return dict(stride_rs=cos.stride[0], seqlen_ro=cos.shape[0], ROTARY_DIM=2 * cos.shape[1],
                ROTARY_INTERLEAVED=interleaved)


def _fp8_args(k_cache: TensorMeta, k_descale: Optional[TensorMeta],
              v_descale: Optional[TensorMeta]) -> dict:
    """The kernels' fp8-cache arguments: FP8_CACHE where the caches are float8_e4m3fn, and
    each descale's flag and row stride (a descale (B, H_kv) has unit stride along its heads,
    as the launcher makes it)."""
    return dict(stride_kdb=0 if k_descale is None else k_descale.stride[0],
                stride_vdb=0 if v_descale is None else v_descale.stride[0],
                FP8_CACHE=k_cache.dtype == torch.float8_e4m3fn,
                HAS_K_DESCALE=k_descale is not None, HAS_V_DESCALE=v_descale is not None)


def _append_launch(k: TensorMeta, v: TensorMeta, k_cache: TensorMeta, v_cache: TensorMeta,
                   block_table: Optional[TensorMeta], batch_idx: bool,
                   rotary: dict, fp8: dict) -> Optional[Planned]:
    """The append of k, v (B, S_new, H_kv, .) into the caches at positions
    cache_seqlens[b] + s, in place (the keys rotated where ``rotary``, _rotary_args, says;
    quantized where ``fp8``, _fp8_args, says); positions past the cache's capacity are
    dropped. None where there is nothing to write."""
    B, S_new, H_kv, D = k.shape
    DV = v.shape[-1]
    if B == 0 or S_new == 0 or H_kv == 0:
        return None
    paged = block_table is not None
    D, DV, page = int(D), int(DV), int(k_cache.shape[1])
    capacity = block_table.shape[1] * page if paged else page
    # a one-token append (a decode step) takes one row per program: the masked rows of a
    # wider tile are computed all the same, and an fp8 cache's quantization (a correctly
    # rounded division per element) made them a 1-token step's longest kernel
    block_s = 1 if S_new == 1 else 16 if INTERPRETING else 32
    return Planned((cdiv(S_new, block_s), H_kv, B), dict(
        stride_kb=k.stride[0], stride_ks=k.stride[1], stride_kh=k.stride[2],
        stride_vb=v.stride[0], stride_vs=v.stride[1], stride_vh=v.stride[2],
        stride_kcb=k_cache.stride[0], stride_kcs=k_cache.stride[1],
        stride_kch=k_cache.stride[2],
        stride_vcb=v_cache.stride[0], stride_vcs=v_cache.stride[1],
        stride_vch=v_cache.stride[2],
        stride_tb=block_table.stride[0] if paged else 0,
        S_new=S_new, capacity=capacity, **rotary, **fp8,
        D=D, DV=DV, BLOCK_D=block_dim(D), BLOCK_DV=block_dim(DV), BLOCK_S=block_s,
        PAGE_SIZE=page if paged else 1, IS_PAGED=paged, HAS_BATCH_IDX=batch_idx,
        num_warps=4, num_stages=1))


def merge_launch(num_splits: int, B, S_q, H, DV: int, block_dv: int) -> tuple:
    """The merge of ``num_splits`` splits' partial outputs into out (B, S_q, H, DV) and lse:
    (its launch, the partials' shapes (partial outputs, partial lse), their contiguous
    strides (output, lse)); with one split (None, None) and zero strides."""
    if num_splits <= 1:
        return None, None, (0, 0, 0, 0), (0, 0, 0, 0)
    parts = ((num_splits, B, S_q, H, DV), (num_splits, B, H, S_q))
    sp, lp = _contiguous_strides(parts[0]), _contiguous_strides(parts[1])
    merge = Planned((S_q, H, B), dict(
        stride_pp=sp[0], stride_pb=sp[1], stride_ps=sp[2], stride_ph=sp[3],
        stride_lpp=lp[0], stride_lpb=lp[1], stride_lph=lp[2],
        n_splits=num_splits, DV=DV, BLOCK_DV=block_dv,
        BLOCK_SPLITS=max(2, next_power_of_2(num_splits)), num_warps=4, num_stages=1))
    return merge, parts, sp, lp


def plain_append_launch(k: TensorMeta, v: Optional[TensorMeta], k_cache: TensorMeta,
                        v_cache: TensorMeta, block_table: Optional[TensorMeta],
                        batch_idx: bool) -> Optional[Planned]:
    """The append (_append_launch) of k, v into 16-bit or fp32 caches without rotary. ``v``
    None: the caches' rows hold the values too (v_cache a view of k_cache's leading
    columns, MLA's latent cache), each row written once from k: the kernel's value columns
    are none (DV = 0 compiles its values' load and store out), and it is launched with
    ``v=None, v_cache=None``, so that k_cache is the one tensor it writes (a tensor passed
    as two written arguments would be cloned twice by functionalization, one clone's
    writes lost)."""
    if v is None:
        def no_columns(m: TensorMeta) -> TensorMeta:
            return m._replace(shape=tuple(m.shape[:-1]) + (0,))

        v, v_cache = no_columns(k), no_columns(k_cache)
    return _append_launch(k, v, k_cache, v_cache, block_table, batch_idx,
                          _rotary_args(None, True), _fp8_args(k_cache, None, None))


def rotary_per_query(mods: Modifiers, capacity) -> bool:
    """Whether the queries are rotated each at its own position (cache_seqlens[b] + i)
    rather than all at cache_seqlens[b]: flash-attn's rule, causal or a window bound, a
    bound at or past the cache's capacity counting as none; FlashAttention-3's with a
    chunk (local attention there)."""
    left, right = mods.bounds
    return (0 <= left < capacity or 0 <= right < capacity or mods.causal
            or mods.attention_chunk > 0)


def input_strides(q: TensorMeta, k_cache: TensorMeta, v_cache: TensorMeta) -> dict:
    """The decoding kernels' strides of q (batch, query, head) and of the caches (batch row
    or page, position, head); the last dims have unit stride."""
    return dict(stride_qb=q.stride[0], stride_qs=q.stride[1], stride_qh=q.stride[2],
                stride_kcb=k_cache.stride[0], stride_kcs=k_cache.stride[1],
                stride_kch=k_cache.stride[2], stride_vcb=v_cache.stride[0],
                stride_vcs=v_cache.stride[1], stride_vch=v_cache.stride[2])


def _make_plan(metas: tuple, options: tuple) -> _Plan:
    """The launches of a call whose tensors (q, k_cache, v_cache, k, v, cache_batch_idx,
    block_table, alibi_slopes, sinks, cache_leftpad, rotary_cos, rotary_sin, k_descale,
    v_descale, and the scores' descale: k_descale, or its product with q_descale) have the
    (shape, strides, dtype, device) ``metas`` (None for None; calls.eager_meta), with
    ``options`` (the call's Modifiers without their tensors, scale, num_splits,
    rotary_interleaved). The outputs' strides are the call's to add."""
    (q, k_cache, v_cache, k, v, batch_idx, block_table, alibi, sinks, leftpad, cos,
     _, k_descale, v_descale, scores_descale) = (None if m is None else TensorMeta(*m)
                                                 for m in metas)
    mods, scale, num_splits, interleaved = options
    paged = block_table is not None
    rotary = _rotary_args(cos, interleaved)
    append = None
    S_new = 0
    if k is not None:
        S_new = k.shape[1]
        append = _append_launch(k, v, k_cache, v_cache, block_table, batch_idx is not None,
                                rotary, _fp8_args(k_cache, k_descale, v_descale))
    B, S_q, H, D = q.shape
    H_kv, DV = k_cache.shape[2], v_cache.shape[3]
    if B * S_q * H * DV == 0:
        return _Plan(append, None, None, None)
    # what sets tiles, splits and compile-time arguments is a plain int (symbolic shapes
    # under torch.compile(dynamic=True) are specialized here; the lengths never are)
    D, DV, G, page = int(D), int(DV), int(H // H_kv), int(k_cache.shape[1])
    capacity = block_table.shape[1] * page if paged else page
    page_size = page if paged else 0  # the tile rules' page (0: a dense cache)
    block_d, block_dv = block_dim(D), block_dim(DV)
    itemsize = q.dtype.itemsize
    t = decode_tiles(int(G * S_q), block_d, block_dv, q.dtype, page_size,
                     k_cache.dtype == torch.float8_e4m3fn)
    if not INTERPRETING:
        t = fit_shared_memory(t, block_d, block_dv, itemsize,
                              max_shared_memory(q.device.index))
    row_tiles = cdiv(G * S_q, t.BLOCK_M)
    # the most keys a program's queries attend, which the splits share: the capacity, or
    # under a chunk what their S_q positions' chunks hold (causal: from the first one's
    # chunk start to the last position; else up to the last one's chunk end)
    keys = int(capacity)
    if mods.attention_chunk:
        spans = mods.attention_chunk * (1 if mods.causal else 2) + int(S_q)
        keys = min(keys, spans)
    num_splits = call_splits(num_splits, int(B * H_kv * row_tiles), keys, t, block_d,
                             block_dv, itemsize, q.device)
    t = short_run_tiles(t, keys, num_splits, page_size)
    split = num_splits > 1
    merge, parts, sp, lp = merge_launch(num_splits, B, S_q, H, DV, block_dv)
    decode = Planned((num_splits, H_kv * row_tiles, B), dict(
        **input_strides(q, k_cache, v_cache),
        stride_pp=sp[0], stride_pb=sp[1], stride_ps=sp[2], stride_ph=sp[3],
        stride_lpp=lp[0], stride_lpb=lp[1], stride_lph=lp[2],
        stride_tb=block_table.stride[0] if paged else 0,
        **score_args(mods, resolve_scale(scale, D), alibi), **sink_args(sinks), **rotary,
        **_fp8_args(k_cache, scores_descale, v_descale),
        S_q=S_q, S_new=S_new, capacity=capacity, G=G,
        D=D, DV=DV, BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_M=t.BLOCK_M, BLOCK_N=t.BLOCK_N,
        PAGE_SIZE=page if paged else 1, IS_PAGED=paged,
        TILE_PAGE=paged and page >= t.BLOCK_N and not t.key_page_ids,
        HAS_BATCH_IDX=batch_idx is not None, HAS_LEFTPAD=leftpad is not None, SPLIT=split,
        ROTARY_PER_QUERY=cos is not None and rotary_per_query(mods, capacity),
        **dtype_constexprs(q.dtype), num_warps=t.num_warps, num_stages=t.num_stages))
    return _Plan(append, decode, merge, parts)


def index_tensors(cache_seqlens: torch.Tensor, cache_batch_idx: Optional[torch.Tensor],
                  cache_leftpad: Optional[torch.Tensor],
                  block_table: Optional[torch.Tensor]) -> tuple:
    """The lengths, cache rows, left pads (contiguous) and block table (unit stride along a
    sequence's pages) as the kernels index them: copies of small int32 tensors where not."""
    cache_seqlens = cache_seqlens.contiguous()
    if cache_batch_idx is not None:
        cache_batch_idx = cache_batch_idx.contiguous()
    if cache_leftpad is not None:
        cache_leftpad = cache_leftpad.contiguous()
    if block_table is not None:
        block_table = unit_stride_last(block_table)
    return cache_seqlens, cache_batch_idx, cache_leftpad, block_table


# eager calls of one signature share their plan (a decode loop repeats one signature; the
# plan is most of a step's host time otherwise)
_plan = functools.lru_cache(maxsize=1024)(_make_plan)


@on_inputs_device
def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                           cache_seqlens: torch.Tensor, cache_batch_idx: Optional[torch.Tensor],
                           block_table: Optional[torch.Tensor], scale: Optional[float],
                           mods: Modifiers, num_splits: int,
                           cache_leftpad: Optional[torch.Tensor] = None,
                           rotary_cos: Optional[torch.Tensor] = None,
                           rotary_sin: Optional[torch.Tensor] = None,
                           rotary_interleaved: bool = True,
                           k_descale: Optional[torch.Tensor] = None,
                           v_descale: Optional[torch.Tensor] = None,
                           q_descale: Optional[torch.Tensor] = None, plan_only: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Append k, v into the caches (in place; the keys rotated where rotary_cos is given;
    quantized to an fp8 cache's e4m3 with the descales), then attend; returns (out, lse) as
    kvcache_outputs allocates them. ``q_descale`` (B, H_kv), where given, scales the scores
    with k_descale (the queries' descale, q itself converted to 16 bits). ``num_splits`` 0
    picks the splits (auto_splits). The launches' arguments but the tensors are planned
    once per signature of eager calls (_plan; traced calls plan each time). ``plan_only``:
    return the plan (a _Plan) and launch nothing (flashop.explain). CPU tensors take the
    CPU path (cpu.serves)."""
    if cpu.serves(q):
        if plan_only:
            return None
        capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
        return cpu_kvcache.attention_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
            resolve_scale(scale, q.shape[-1]), mods, cache_leftpad, rotary_cos, rotary_sin,
            rotary_interleaved, rotary_per_query(mods, capacity), k_descale, v_descale,
            q_descale, kvcache_outputs(q, v_cache))
    cache_seqlens, cache_batch_idx, cache_leftpad, block_table = index_tensors(
        cache_seqlens, cache_batch_idx, cache_leftpad, block_table)
    if k is not None:
        k, v = unit_stride_last(k), unit_stride_last(v)
    if rotary_cos is not None:
        rotary_cos, rotary_sin = rotary_cos.contiguous(), rotary_sin.contiguous()
    if k_descale is not None:
        k_descale = unit_stride_last(k_descale)
    if v_descale is not None:
        v_descale = unit_stride_last(v_descale)
    # the scores' descale, which the decode kernel folds into the scores' scale: k_descale,
    # times q_descale where the queries have one (one factor per (b, h_kv))
    scores_descale = k_descale
    if q_descale is not None:
        scores_descale = (q_descale * k_descale if k_descale is not None
                          else unit_stride_last(q_descale))
    q = unit_stride_last(q)
    alibi, sinks = mods.alibi_slopes, mods.sinks
    tensors = (q, k_cache, v_cache, k, v, cache_batch_idx, block_table, alibi, sinks,
               cache_leftpad, rotary_cos, rotary_sin, k_descale, v_descale, scores_descale)
    # the plan's key holds the modifiers' values; their tensors are the call's
    values = mods if alibi is None and sinks is None else replace(mods, alibi_slopes=None,
                                                                    sinks=None)
    options = (values, scale, num_splits, rotary_interleaved)
    plan = call_plan(_plan, tensors, options)
    if plan_only:
        return plan
    if plan.append is not None:
        launch_planned(kvcache_append_kernel, plan.append, k=k, v=v, k_cache=k_cache,
                       v_cache=v_cache, cache_seqlens=cache_seqlens,
                       cache_batch_idx=cache_batch_idx, block_table=block_table,
                       rotary_cos=rotary_cos, rotary_sin=rotary_sin, k_descale=k_descale,
                       v_descale=v_descale)
    return launch_split_kv(
        attention_decode_kernel, plan, q, v_cache, q=q, k_cache=k_cache, v_cache=v_cache,
        cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, block_table=block_table,
        alibi=alibi, sinks=sinks, cache_leftpad=cache_leftpad, rotary_cos=rotary_cos,
        rotary_sin=rotary_sin, k_descale=scores_descale, v_descale=v_descale)


def launch_split_kv(kernel, plan: _Plan, q: torch.Tensor, v_cache: torch.Tensor, /,
                    launch=None, **tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-KV attention of ``plan`` (a decode launcher's, after its append): out and
    lse allocated (kvcache_outputs(q, v_cache)), ``kernel`` launched with the call's
    ``tensors`` by name (the kernel's q and v_cache among them), writing out and lse
    directly (one split) or the splits' partial outputs, which the merge kernel combines;
    no launch where the output is empty; ``launch(kernel, planned, **arguments)``
    launches it (default launch_planned). Returns (out, lse)."""
    out, lse = kvcache_outputs(q, v_cache)
    if plan.decode is None:
        return out, lse
    check_row_offsets("flashop.attention_with_kvcache", (q, out), (q.stride(1), out.stride(1)),
                      (q.shape[1], q.shape[1]))
    o_part = lse_part = None  # one split: the kernel writes out and lse directly
    if plan.parts is not None:
        o_part = q.new_empty(plan.parts[0], dtype=torch.float32)
        lse_part = q.new_empty(plan.parts[1], dtype=torch.float32)
    so, sl = out.stride(), lse.stride()
    outputs = dict(o=out, lse=lse, stride_ob=so[0], stride_os=so[1], stride_oh=so[2],
                   stride_lb=sl[0], stride_lh=sl[1])
    (launch or launch_planned)(kernel, plan.decode, o_part=o_part, lse_part=lse_part,
                               **tensors, **outputs)
    if plan.merge is not None:
        launch_planned(attention_decode_merge_kernel, plan.merge, o_part=o_part,
                       lse_part=lse_part, **outputs)
    return out, lse


def plan_choice(plan: _Plan, tiles: Optional[str] = None) -> Choice:
    """A decode call's plan as flashop.explain tells it: the append, the split-KV attention
    kernel (plan.kernel) with its tiles (``tiles`` where given, else the `tl` kernels'
    arguments) and splits, the merge."""
    kernels = []
    if plan.append is not None:
        kernels.append(("kvcache_append_kernel", None))
    if plan.decode is None:
        return Choice("nothing to attend (an empty output)", kernels)
    d = plan.decode.static
    if tiles is None:
        tiles = (f"{d['BLOCK_M']}x{d['BLOCK_N']} tiles (query rows x keys), "
                 f"{d['num_warps']} warps, {d['num_stages']} stage"
                 f"{'s' if d['num_stages'] > 1 else ''}")
    kernels.append((plan.kernel, tiles))
    splits = plan.decode.grid[0]
    if plan.merge is not None:
        kernels.append(("attention_decode_merge_kernel", None))
    return Choice("split-KV decode" if splits > 1 else "decode", kernels,
                  {"splits of each sequence's keys": splits})
