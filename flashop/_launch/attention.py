"""Launchers of the attention kernels: allocate outputs, describe the call once, pick the
kernel and its tiles, and launch it by keyword.

Every kernel is launched through ``torch.library.wrap_triton`` (fastpath.launch_kernel)
so that, inside a ``triton_op``, Inductor sees the Triton kernels themselves. Under Triton's
CPU interpreter ``wrap_triton`` hands back the interpreted kernel, which runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.library import wrap_triton

from flashop import config
from flashop._launch import cpu, gates, gluon, tiles
from flashop._launch.cpu import attention as cpu_attention
from flashop._launch.cpu.dropout import dropout_mask as cpu_dropout_mask
from flashop._launch.common import (
    block_dim, cdiv, check_row_offsets, dtype_constexprs, ensure_triton_allocator, is_hopper,
    known_shorter, on_inputs_device, resolve_scale, tensor_meta, tma_aligned, unit_stride_last,
)
from flashop._launch.fastpath import launch_kernel
from flashop._launch.options import PLAIN, Modifiers, Packing
from flashop._launch.scores import LOG2E, score_args, sink_args, sink_log2
from flashop.kernels import INTERPRETING
from flashop.kernels.backward import (
    attention_bwd_cast_kernel, attention_bwd_dkdv_kernel, attention_bwd_dq_kernel,
    attention_bwd_preprocess_kernel,
)
from flashop.kernels.dropout import dropout_mask_kernel
from flashop.kernels.forward import attention_fwd_kernel, attention_fwd_ws_kernel
from flashop.kernels.layout import keys_last_kernel


def attention_forward_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              packed: bool = False, out_dtype: Optional[torch.dtype] = None):
    """Allocate (out, lse, lse_log2) for the forward, all contiguous: out (B, S_q, H, DV) in
    ``out_dtype`` (default q's dtype), lse and lse_log2 (B, H, S_q) fp32; packed, out
    (total_q, H, DV) and the lses (H, total_q). The real ops and their fakes both allocate
    here."""
    dtype = out_dtype or q.dtype
    if packed:
        total_q, H, _ = q.shape
        out, rows = q.new_empty((total_q, H, v.shape[-1]), dtype=dtype), (H, total_q)
    else:
        B, S_q, H, _ = q.shape
        out, rows = q.new_empty((B, S_q, H, v.shape[-1]), dtype=dtype), (B, H, S_q)
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


# --- one call, as the kernels see it ----------------------------------------------------------

_NO_GATE_OR_MASK = dict(g_cum=None, attn_mask=None, stride_gb=0, stride_gs=0, stride_gh=0,
                        stride_amb=0, stride_amh=0, stride_amq=0, stride_amk=0, HAS_GATE=False,
                        ATTN_MASK_KIND=0)


def _modifier_args(q: torch.Tensor, k: torch.Tensor, mods: Modifiers, sm_scale: float,
                   packing: Optional[Packing]) -> tuple[dict, dict]:
    """The kernels' modifier arguments by name (scores.score_args; the ALiBi slopes, the
    gate's cumulative sum and the attn_mask with their strides, None where absent) and
    their compile-time flags (the upper-case names) apart."""
    if mods.is_plain:  # the common call: its arguments but the scale are made once
        causal = mods.causal
        return dict(_PLAIN_ARGS[causal], qk_scale=sm_scale * LOG2E), _PLAIN_FLAGS[causal]
    args = score_args(mods, sm_scale, tensor_meta(mods.alibi_slopes))
    args.update(_NO_GATE_OR_MASK, alibi=mods.alibi_slopes)
    if mods.g is not None:
        g_cum, (sb, ss, sh) = gates.gate_cumsum(mods.g, packing)
        args.update(g_cum=g_cum, stride_gb=sb, stride_gs=ss, stride_gh=sh, HAS_GATE=True)
    if mods.attn_mask is not None:  # dense batches only
        B, S_q, H, _ = q.shape
        mask = mods.attn_mask.expand(B, H, S_q, k.shape[1])
        args.update(attn_mask=mask, ATTN_MASK_KIND=2 if mask.dtype == torch.bool else 1,
                    **dict(zip(("stride_amb", "stride_amh", "stride_amq", "stride_amk"),
                               mask.stride())))
    return _split_flags(args)


def _split_flags(args: dict) -> tuple[dict, dict]:
    """``args`` apart from its compile-time flags (the upper-case names), and the flags."""
    flags = {name: value for name, value in args.items() if name.isupper()}
    return {name: value for name, value in args.items() if name not in flags}, flags


# the arguments (but the scale) and flags of calls without modifiers (but causal)
_PLAIN_ARGS, _PLAIN_FLAGS = {}, {}
for _causal in (False, True):
    _PLAIN_ARGS[_causal], _PLAIN_FLAGS[_causal] = _split_flags(
        {**score_args(PLAIN[_causal], 1.0, None), **_NO_GATE_OR_MASK, "alibi": None})


def _dropout_args(mods: Modifiers) -> dict:
    """The kernels' dropout arguments: its seed tensor (None without dropout), probability
    (as the kernels draw it) and flag."""
    return dict(dropout_seed=mods.dropout_seed, dropout_p=mods.dropout_p, DROPOUT=mods.dropout)


_NO_SINKS = dict(sinks=None, **sink_args(None))


def _sinks(mods: Modifiers) -> dict:
    """The forward's sink arguments (scores.sink_args, and the tensor: None without)."""
    if mods.sinks is None:
        return _NO_SINKS
    return dict(sinks=mods.sinks, **sink_args(tensor_meta(mods.sinks)))


def _seq_strides(x: torch.Tensor, packing: Optional[Packing]) -> tuple:
    """The kernels' (batch, seq, head) strides: a packed (total, H, D) tensor has batch
    stride 0 (each program offsets its sequence's start instead); a paged cache (pages,
    page_size, H_kv, D) gives its page stride as the batch's. The tensors themselves are
    passed as they are: a broadcast view of an output would hide the kernel's writes from
    functionalization under torch.compile."""
    strides = x.stride()
    return strides[:3] if packing is None or x.dim() == 4 else (0, *strides[:2])


_NOT_PAGED = dict(block_table=None, stride_tb=0, capacity=0, PAGE_SIZE=1, IS_PAGED=False)


def _paging(packing: Optional[Packing], k: torch.Tensor) -> dict:
    """The forward's paging arguments: a paged prefill's block table, its row stride, its
    capacity in keys and the page size (k's dim 1); none otherwise."""
    if packing is None or packing.block_table is None:
        return _NOT_PAGED
    table, page = unit_stride_last(packing.block_table), int(k.shape[1])
    return dict(block_table=table, stride_tb=table.stride(0), capacity=table.shape[1] * page,
                PAGE_SIZE=page, IS_PAGED=True)


@dataclass
class Problem:
    """One call of the forward or backward: shapes, scale, packing and modifier arguments,
    built once and handed to each kernel by name."""

    q: torch.Tensor  # gives the dtype and device
    packing: Optional[Packing]
    B: int
    S_q: int  # the longest sequences' where packed
    S_k: int
    H: int
    H_kv: int
    D: int
    DV: int
    sm_scale: float
    modifier_args: dict
    flags: dict

    @classmethod
    def describe(cls, op: str, q, k, v, x, scale: Optional[float], mods: Modifiers,
                 packing: Optional[Packing]) -> "Problem":
        """The call of q, k, v and ``x`` (out or dout, laid out as q): checks that the
        kernels' 32-bit row offsets reach every row."""
        if packing is None:
            B, S_q, S_k = q.shape[0], q.shape[1], k.shape[1]
        else:
            B, S_q, S_k = packing.batch, packing.max_seqlen_q, packing.max_seqlen_k
        # a paged cache's rows are offset within a page (pages by 64-bit offsets)
        S_kv = S_k if packing is None or packing.block_table is None else k.shape[1]
        check_row_offsets(op, (q, k, v, x),
                          tuple(_seq_strides(t, packing)[1] for t in (q, k, v, x)),
                          (S_q, S_kv, S_kv, S_q))
        H, D, H_kv, DV = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
        sm_scale = resolve_scale(scale, D)
        args, flags = _modifier_args(q, k, mods, sm_scale, packing)
        return cls(q, packing, B, S_q, S_k, H, H_kv, D, DV, sm_scale, args, flags)

    @property
    def packed(self) -> bool:
        return self.packing is not None

    @property
    def head_dim(self) -> int:
        return max(self.D, self.DV)

    def strides(self, prefix: str, x: torch.Tensor) -> dict:
        """``stride_<prefix>b``, ``..s``, ``..h`` of a (batch, seq, head, dim) tensor."""
        return dict(zip((f"stride_{prefix}b", f"stride_{prefix}s", f"stride_{prefix}h"),
                        _seq_strides(x, self.packing)))

    def row_strides(self, prefix: str, x: torch.Tensor) -> dict:
        """``stride_<prefix>b``, ``..h`` of per-row fp32 values: (B, H, S) dense, (H, total)
        packed (whose rows are offset by the sequence's start)."""
        strides = (0, x.stride(0)) if self.packed else (x.stride(0), x.stride(1))
        return dict(zip((f"stride_{prefix}b", f"stride_{prefix}h"), strides))

    def sequences(self) -> dict:
        """Lengths, group size and the packed offsets (None where dense)."""
        cu_q, cu_k = ((self.packing.cu_seqlens_q, self.packing.cu_seqlens_k) if self.packed
                      else (None, None))
        return dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, S_q=self.S_q, S_k=self.S_k,
                    G=self.H // self.H_kv, IS_VARLEN=self.packed)

    def constexprs(self) -> dict:
        """Head dims, their blocks and the dtype's options."""
        return dict(D=self.D, DV=self.DV, BLOCK_D=block_dim(self.D), BLOCK_DV=block_dim(self.DV),
                    **dtype_constexprs(self.q.dtype))


def _launch(kernel, kind: str, t: tiles.Tiles, grid: Callable, lengths: tuple,
            autotune: bool = False, **kwargs):
    """Launch ``kernel`` by keyword on ``grid(BLOCK_M, BLOCK_N)`` with the tiles ``t``, or,
    where ``autotune``, the autotuned kernel on the tiles it picks; the kernel's
    ``seq_bucket`` argument is the bucket of ``lengths`` then, else 0 (a constant, so that
    Triton's integer specialisation compiles no extra variants of the plain kernels)."""
    if autotune:
        tuned = tiles.autotuned(kernel, kind, kwargs["BLOCK_D"], kwargs["BLOCK_DV"],
                                kwargs["q"].element_size(), kwargs["q"].device.index)
        wrap_triton(tuned)[lambda m: grid(m["BLOCK_M"], m["BLOCK_N"])](
            seq_bucket=tiles.seq_bucket(*lengths), **kwargs)
    else:
        launch_kernel(kernel, grid(t.BLOCK_M, t.BLOCK_N), seq_bucket=0, **t.constexprs(kind),
                      num_warps=t.num_warps, num_stages=t.num_stages, **kwargs)


# --- forward ----------------------------------------------------------------------------------

# Tensor descriptors (Hopper's copy engine, TMA) for the forward's key and value tiles: by
# default at head dims above 128 over at least TMA_MIN_KEYS keys on Hopper (fewer keys, or
# smaller head dims, measured slower); config.settings.tma forces them on or off.
TMA_MIN_KEYS = 4096


def _tma_by_default(head_dim: int, S_k, device: torch.device) -> bool:
    """The descriptors' default rule: head dims above 128 and at least TMA_MIN_KEYS keys (the
    longest sequence's where packed) on a Hopper GPU. Where S_k is symbolic (torch.compile
    with dynamic shapes) the rule takes it as long: no guard on it."""
    return (head_dim > 128 and not known_shorter(S_k, TMA_MIN_KEYS) and device.type == "cuda"
            and is_hopper(device))


def _uses_tma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, S_k) -> bool:
    """Whether the forward reads k and v through tensor descriptors: 16-bit inputs that meet
    their alignment, where the switch (or its default rule) selects them."""
    setting = config.settings.tma
    if q.dtype == torch.float32 or setting is False:
        return False
    if setting is None and not _tma_by_default(head_dim, S_k, q.device):
        return False
    return tma_aligned(k) and tma_aligned(v)


def _ws_query_layout(q: torch.Tensor) -> Optional[bool]:
    """How attention_fwd_ws_kernel reads ``q`` (B, S_q, H, D) as one 2-D array of rows:
    True where its (batch, head) slices of S_q rows follow one another (a head-major
    layout), False where its (batch, seq) rows hold the H heads side by side and D is a
    block width (the tile's columns stay in one head), None where neither holds."""
    B, S_q, H, D = q.shape
    sb, ss, sh = q.stride()[:3]
    if (H == 1 or sh == D) and (B == 1 or sb == S_q * ss) and D == block_dim(D):
        return False
    if (H == 1 or sh == S_q * ss) and (B == 1 or sb == H * S_q * ss):
        return True
    return None


def _uses_ws(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flags: dict, head_dim: int,
             S_k, packed: bool) -> bool:
    """Whether the forward runs the warp-specialized attention_fwd_ws_kernel: 16-bit dense
    inputs without modifiers or bounds, S_k a known multiple of its BLOCK_N (that kernel has
    no masked key tile; a symbolic S_k under torch.compile gets no guard: the split kernel),
    rows that descriptors can address, q in one of its layouts; and, unless the switch
    forces it, Hopper at head dims in (64, 128]."""
    setting = config.settings.warp_specialize
    if setting is False or packed or q.dtype == torch.float32:
        return False
    if any(flags.values()):  # a modifier or a bound
        return False
    block_n = tiles.tiles_for("fwd_ws", head_dim, q.dtype, q.device).BLOCK_N
    if not isinstance(S_k, int) or S_k == 0 or S_k % block_n:
        return False
    if setting is None and not (64 < head_dim <= 128 and q.device.type == "cuda"
                                and is_hopper(q.device)):
        return False
    if q.dtype == torch.float8_e4m3fn:  # v keys-last (_fp8_values): its head dim's rows
        v_aligned = keys_last(v) and tma_aligned(v.transpose(-3, -1))
    else:
        v_aligned = tma_aligned(v)
    return (tma_aligned(q) and tma_aligned(k) and v_aligned
            and _ws_query_layout(q) is not None)


def folds_scale(qk_scale: float, flags: dict, dtype: torch.dtype) -> bool:
    """Whether the kernels fold ``qk_scale`` into their exponent's FMA (FOLD_SCALE): P =
    exp2(fma(q.k, qk_scale, -shift)), one instruction per score (see
    flashop/kernels/forward.py's _fwd_fold), where the scale is positive (the row max of the
    unscaled scores then scales to the scaled scores' max), no modifier comes between the
    product and the softmax (softcap, ALiBi, gate, a float attn_mask) and the inputs are
    16-bit or fp8. The forward and both backward kernels take the same rule, as the Gluon
    kernels (16-bit) always fold: the backward recomputes P against the forward's lse.

    fp32 inputs never fold: their scaled products are rounded on their own (common.py's
    rounded_product), in every kernel. With scores in the thousands the fold's exact
    product is not on the fp32 grid of the stored lse: a row whose probability sits on one
    key recomputed it as exp2(s * qk_scale - lse) = 1 - 2e-5, and fp32's dQ left the
    accuracy rule (1.1e-2 against 2.7e-3); rounded, that key's P is exactly 1."""
    return (qk_scale > 0 and dtype != torch.float32
            and not (flags["HAS_SOFTCAP"] or flags["HAS_ALIBI"] or flags["HAS_GATE"]
                     or flags["ATTN_MASK_KIND"] == 1))


def forward_takes_gluon(q, k, v, scale: Optional[float], mods: Modifiers,
                        packing: Optional[Packing], traced: bool = False) -> bool:
    """Whether attention_forward launches the Gluon kernel for this call (gluon.serves);
    ``traced``: whether a call traced for a graph compiled here may take it when the graph
    runs (the operator then calls the eager launcher through an opaque operator)."""
    qk_scale = resolve_scale(scale, q.shape[-1]) * LOG2E
    return gluon.serves(q, k, v, mods.causal, qk_scale,
                        mods.is_plain_but_dropout and packing is None, mods.dropout, traced)


def keys_last(v: torch.Tensor) -> bool:
    """Whether ``v`` (B, S_k, H_kv, DV) or packed (total_k, H_kv, DV) has unit stride along
    its keys (a head dim of one element counts as a unit stride in the last dim)."""
    return v.stride(-3) == 1 and v.size(-1) > 1


def _fp8_values(v: torch.Tensor) -> torch.Tensor:
    """e4m3 values as the forward reads them: keys-last (unit stride along the keys), the
    layout Hopper's fp8 products read without a transpose (the values' tiles are their
    second operand, summed along the keys); values in another layout are copied so (a read
    and a write of v, kernels/layout.py; pass them keys-last to skip it: for (B, S_k, H_kv,
    DV), ``v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)``)."""
    if keys_last(v) or v.numel() == 0:
        return v
    v = unit_stride_last(v)
    packed = v.dim() == 3
    x = v.unsqueeze(0) if packed else v
    B, S, H, D = x.shape
    y = x.new_empty((B, H, D, S))
    launch_kernel(keys_last_kernel, (cdiv(S, 64), H, B), x=x, y=y, S=S,
                  stride_xb=x.stride(0), stride_xs=x.stride(1), stride_xh=x.stride(2),
                  stride_yb=y.stride(0), stride_yh=y.stride(1), stride_yd=y.stride(2), D=D,
                  BLOCK_S=64, BLOCK_D=block_dim(D))
    y = y.permute(0, 3, 1, 2)
    return y[0] if packed else y


_NOT_FP8 = dict(q_descale=None, k_descale=None, v_descale=None, stride_dsb=0, FP8=False)


def _fp8_args(q: torch.Tensor, descales: Optional[tuple], B: int, H_kv: int) -> dict:
    """The forward's fp8 arguments: for e4m3 inputs the three descales, (B, H_kv) fp32
    (ones where None: a fill, which an eager call's plan replays), and their batch stride;
    none otherwise."""
    if q.dtype != torch.float8_e4m3fn:
        return _NOT_FP8
    given = descales or (None, None, None)
    q_ds, k_ds, v_ds = (q.new_full((B, H_kv), 1.0, dtype=torch.float32) if d is None
                        else d.contiguous() for d in given)
    return dict(q_descale=q_ds, k_descale=k_ds, v_descale=v_ds, stride_dsb=H_kv, FP8=True)


@on_inputs_device
def attention_forward(q, k, v, scale: Optional[float], mods: Modifiers,
                      packing: Optional[Packing] = None, descales: Optional[tuple] = None,
                      out_dtype: Optional[torch.dtype] = None):
    """Launch the forward; returns (out, lse, lse_log2) (see attention_forward_outputs):
    lse in natural-log units, and in base 2 for the backward. e4m3 inputs take their
    ``descales`` (q's, k's, v's: (B, H_kv) fp32 or None) and give out in ``out_dtype``.
    CPU tensors take the CPU path (cpu.serves)."""
    if cpu.serves(q):
        outputs = attention_forward_outputs(q, k, v, packing is not None, out_dtype)
        return cpu_attention.attention_forward(q, k, v, resolve_scale(scale, q.shape[-1]), mods,
                                               packing, descales, outputs)
    q, k = unit_stride_last(q), unit_stride_last(k)
    v = _fp8_values(v) if q.dtype == torch.float8_e4m3fn else unit_stride_last(v)
    out, lse, lse_log2 = attention_forward_outputs(q, k, v, packed=packing is not None,
                                                   out_dtype=out_dtype)
    if out.numel() == 0:
        return out, lse, lse_log2
    p = Problem.describe("flashop.attention", q, k, v, out, scale, mods, packing)
    if p.packed and p.B == 0:  # no sequences: no token attends anything
        return out.zero_(), lse.fill_(float("-inf")), lse_log2.fill_(float("-inf"))
    grid = lambda bm, bn: (cdiv(p.S_q, bm), p.H, p.B)  # noqa: E731
    io = dict(q=q, k=k, v=v, o=out, lse=lse, lse_log2=lse_log2, **p.strides("q", q),
              **p.strides("k", k), **p.strides("v", v), **p.strides("o", out),
              **p.row_strides("l", lse))
    stride_vd = v.stride(-1)
    qk_scale = p.modifier_args["qk_scale"]
    fp8 = _fp8_args(q, descales, p.B, p.H_kv)
    if not fp8["FP8"] and forward_takes_gluon(q, k, v, scale, mods, packing):
        gluon.attention_forward(q, k, v, out, lse, lse_log2, mods.causal, qk_scale,
                                **_dropout_args(mods))
        return out, lse, lse_log2
    # sinks and dropout: the general kernel; pages: the general kernel without descriptors
    paging = _paging(packing, k)
    ws = (mods.sinks is None and not mods.dropout
          and _uses_ws(q, k, v, p.flags, p.head_dim, p.S_k, p.packed))
    tma = (not (ws or paging["IS_PAGED"]) and stride_vd == 1
           and _uses_tma(q, k, v, p.head_dim, p.S_k))
    if ws or tma:  # descriptors made in the kernels
        ensure_triton_allocator()
    if ws:
        _launch(attention_fwd_ws_kernel, "fwd_ws",
                tiles.tiles_for("fwd_ws", p.head_dim, q.dtype, q.device), grid, lengths=(),
                **io, S_q=p.S_q, S_k=p.S_k, G=p.H // p.H_kv, qk_scale=qk_scale,
                **p.constexprs(), FOLD_SCALE=folds_scale(qk_scale, p.flags, q.dtype),
                Q_HEAD_MAJOR=_ws_query_layout(q),
                **fp8, stride_vd=stride_vd)
        return out, lse, lse_log2
    t = tiles.forward_tiles(p.head_dim, q.dtype, q.device, p.flags, p.S_k)
    _launch(attention_fwd_kernel, "fwd", t, grid, lengths=(p.S_q, p.S_k),
            autotune=tiles.autotunes(q.dtype), **io, **p.sequences(), **paging,
            **p.modifier_args, **_sinks(mods), **_dropout_args(mods), **fp8,
            stride_vd=stride_vd,
            **p.constexprs(), **p.flags, FOLD_SCALE=folds_scale(qk_scale, p.flags, q.dtype),
            TMA=tma)
    return out, lse, lse_log2


def sink_grad(sinks: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
              lse_log2: torch.Tensor, dlse: torch.Tensor, g: Optional[torch.Tensor],
              packing: Optional[Packing] = None) -> torch.Tensor:
    """dsinks[h] = -sum_{b, i} P_sink[b, h, i] * delta[b, h, i], delta = rowsum(dO * O) -
    dlse (docs/modifiers.md), in sinks' dtype. Dense: out, dout (B, S_q, H, DV), lse_log2,
    dlse (B, H, S_q); packed: (total_q, H, DV) and (H, total_q).

    P_sink = exp2(sink_i - lse_log2) in the forward's own frame, as the backward kernels
    recompute P: sink_i = sink * log2 e, less the query's gate G_i * log2 e where there is a
    gate, rounded as the forward's FMA rounds it. (From the natural-log lse, which adds G_i
    back, a gate summed to a few hundred would cost P_sink its last five bits.) Rows with
    lse = -inf (a sink of -inf and no key) add nothing."""
    rows = torch.sum(dout.float() * out.float(), dim=-1).transpose(-1, -2)  # as lse_log2
    g_rows = None if g is None else gates.query_gates(g, lse_log2.shape, packing)
    frame = sink_log2(sinks, g_rows)
    p_sink = torch.where(lse_log2 == float("-inf"), 0.0, torch.exp2(frame - lse_log2))
    dsinks = -(p_sink * (rows - dlse))
    if dsinks.dim() == 3:
        dsinks = dsinks.sum(0)
    return dsinks.sum(-1).to(sinks.dtype)


# --- backward ---------------------------------------------------------------------------------


def deterministic_backward(requested: bool = False) -> bool:
    """Whether the backward must be bitwise reproducible (dQ summed in a fixed order: the dQ
    kernel sums each row in one program; the Gluon backward adds its key tiles' shares in
    order): where the caller asks for it (``deterministic=True``), under
    torch.use_deterministic_algorithms (warn_only too: a deterministic kernel exists), or
    with the atomics switched off (config.settings.dq_atomics False). Otherwise the fastest
    backward runs, which adds dQ by fp32 atomics where that measured faster (PyTorch's
    convention, as FlashAttention's and cuDNN's backwards)."""
    return (requested or torch.are_deterministic_algorithms_enabled()
            or config.settings.dq_atomics is False)


def gluon_backward_order(q, k, v, dout, mods: Modifiers, attn_mask_grad: bool,
                         packing: Optional[Packing], deterministic: bool,
                         traced: bool = False) -> Optional[bool]:
    """Whether attention_backward launches the Gluon backward for this call, and how it adds
    dQ: None (it does not), False (by atomics: unless ``deterministic``, where
    gluon.serves_backward's rule takes the call), True (in key-tile order, where its rule
    takes the call). Plain dense calls only (dropout allowed). ``traced``: as in
    forward_takes_gluon."""
    if mods.g is not None or attn_mask_grad or packing is not None:
        return None
    if not mods.is_plain_but_dropout:
        return None
    call = (q, k, v, dout, mods.causal, True)
    if not deterministic and gluon.serves_backward(*call, False, mods.dropout, traced):
        return False
    if gluon.serves_backward(*call, True, mods.dropout, traced):
        return True
    return None


@on_inputs_device
def attention_backward(dout, dlse, q, k, v, out, lse_log2, scale: Optional[float],
                       mods: Modifiers, attn_mask_grad: bool, packing: Optional[Packing] = None,
                       deterministic: bool = False):
    """Launch the backward from the forward's ``out`` and base-2 ``lse_log2``; returns (dq,
    dk, dv, dg, dattn_mask) (the last two as in attention_backward_outputs).

    Unless the backward must be reproducible (deterministic_backward(deterministic)),
    plain calls that the Gluon backward serves with dQ by atomics (gluon.serves_backward)
    take it. Plain calls it serves in key-tile order take it so (bitwise reproducible).
    The rest take the tl kernels: dQ from the dQ kernel (each row summed in one program),
    or, where the atomics are forced (config.settings.dq_atomics) and there is no gate and
    no mask gradient, added by the dK/dV kernel by fp32 atomics, with no second pass over S
    and dP. CPU tensors take the CPU path (cpu.serves), reproducible whatever
    ``deterministic`` says."""
    if cpu.serves(q):
        grads = attention_backward_outputs(q, k, v, mods.g, mods.attn_mask, attn_mask_grad)
        return cpu_attention.attention_backward(dout, dlse, q, k, v, out, lse_log2,
                                                resolve_scale(scale, q.shape[-1]), mods,
                                                attn_mask_grad, packing, grads)
    q, k, v, out, dout = (unit_stride_last(x) for x in (q, k, v, out, dout))
    lse_log2 = lse_log2.contiguous()  # fp32 rows: the kernels index them with a unit stride
    dq, dk, dv, dg, dmask = attention_backward_outputs(q, k, v, mods.g, mods.attn_mask,
                                                       attn_mask_grad)
    if (packing is not None and packing.batch == 0) or q.numel() == 0 or k.numel() == 0:
        # nothing attends anything: every gradient is zero (dq needs writing when S_k == 0)
        return dq.zero_(), dk.zero_(), dv.zero_(), dg.zero_(), dmask.zero_()
    p = Problem.describe("flashop.attention_backward", q, k, v, dout, scale, mods, packing)
    delta = lse_log2.new_empty(lse_log2.shape)
    has_gate = mods.g is not None
    # the gate's gradient halves: rows of the queries (as lse) and of the keys
    dgq = dgk = None
    if has_gate:
        dgq = lse_log2.new_empty(lse_log2.shape)
        dgk = lse_log2.new_empty((p.B, p.H, p.S_k) if packing is None else (p.H, k.shape[0]))
    # dS of every (query, key) pair; pairs outside the window are never visited: zeros
    dS = lse_log2.new_zeros((p.B, p.H, p.S_q, p.S_k)) if attn_mask_grad else None
    deterministic = deterministic_backward(deterministic)
    causal = p.flags["HAS_RIGHT"]
    # the Gluon backward serves plain calls: dQ by atomics unless the backward must be
    # reproducible (or that rule declines the call), else in key-tile order; the tl kernels
    # the rest
    ordered = gluon_backward_order(q, k, v, dout, mods, attn_mask_grad, packing, deterministic)
    use_gluon = ordered is not None
    dq_atomic = (config.settings.dq_atomics is True and not deterministic
                 and not (has_gate or attn_mask_grad or use_gluon))
    # fp32 buffer laid out as q: the tl dK/dV kernel adds dQ / scale into it
    acc = dq_acc = (torch.empty(q.shape, device=q.device, dtype=torch.float32) if dq_atomic
                    else None)
    short = tiles.is_short(p.S_k)
    o_strides = p.strides("o", out)
    dlse_strides = dict(zip(("stride_dlb", "stride_dlh", "stride_dls"),
                            dlse.stride() if packing is None else (0, *dlse.stride())))
    if use_gluon:
        split = gluon.backward_split(q, k, causal, ordered)
        acc, dq_acc, dq_sem, dk_acc, dv_acc = gluon.backward_buffer(q, k, ordered, split)
    if dq_atomic or use_gluon:
        # delta alone (no dQ kernel computes it), and the buffer that the kernels add into
        # zeroed; a packed batch is one sequence of total_q rows here, delta being row-wise
        B_pre, rows_pre = (p.B, p.S_q) if packing is None else (1, q.shape[0])
        pre_block = 64 if not INTERPRETING else 32
        pre_grid = (cdiv(rows_pre, pre_block), p.H, B_pre)
        launch_kernel(
            attention_bwd_preprocess_kernel, pre_grid,
            o=out, do=dout, dlse=dlse, delta=delta, **o_strides, **p.strides("do", dout),
            **dlse_strides, S_q=rows_pre, H=p.H, zero=acc, zero_n=acc.numel(),
            zero_chunk=cdiv(acc.numel(), pre_grid[0] * pre_grid[1] * pre_grid[2]),
            DV=p.DV, BLOCK_DV=block_dim(p.DV), BLOCK_M=pre_block,
            ZERO_BLOCK=1024 if not INTERPRETING else 64)
    if use_gluon:
        gluon.attention_backward(q, k, v, dout, lse_log2, delta, dq_acc, dq_sem,
                                 dk if split == 1 else dk_acc, dv if split == 1 else dv_acc,
                                 causal, p.sm_scale, p.modifier_args["qk_scale"],
                                 **_dropout_args(mods), split=split)
        # the kernel adds dQ itself, scaled
        _cast_grads(acc, dq, 1.0, *((dk, dv) if split > 1 else ()))
        return dq, dk, dv, dg, dmask
    # what the dK/dV and dQ kernels share
    common = dict(q=q, k=k, v=v, do=dout, lse_log2=lse_log2, delta=delta, **p.strides("q", q),
                  **p.strides("k", k), **p.strides("v", v), **p.strides("do", dout),
                  **p.row_strides("l", lse_log2), sm_scale=p.sm_scale, **p.sequences(),
                  **p.modifier_args, **_dropout_args(mods), **p.constexprs(), **p.flags,
                  FOLD_SCALE=folds_scale(p.modifier_args["qk_scale"], p.flags, q.dtype))
    if not dq_atomic:
        # the dQ kernel first: it also stores delta, which the dK/dV kernel reads
        _launch(
            attention_bwd_dq_kernel, "dq",
            tiles.tiles_for("dq", p.head_dim, q.dtype, q.device, mask_grad=attn_mask_grad,
                            causal=causal, short=short),
            lambda bm, bn: (cdiv(p.S_q, bm), p.H, p.B), lengths=(p.S_q, p.S_k),
            autotune=tiles.autotunes(q.dtype) and not attn_mask_grad, **common,
            dq=dq, dgq=dgq, dattn_mask=dS, o=out, dlse=dlse, **p.strides("dq", dq),
            **o_strides, **dlse_strides, H=p.H, ATTN_MASK_GRAD=attn_mask_grad)
    kind = "dkdv_atomic" if dq_atomic else "dkdv"
    _launch(
        attention_bwd_dkdv_kernel, kind,
        tiles.tiles_for(kind, p.head_dim, q.dtype, q.device, causal=causal, short=short),
        lambda bm, bn: (cdiv(p.S_k, bn), p.H_kv, p.B), lengths=(p.S_q, p.S_k),
        autotune=tiles.autotunes(q.dtype) and not dq_atomic, **common,
        dk=dk, dv=dv, dgk=dgk, dq_acc=dq_acc, **p.strides("dk", dk), **p.strides("dv", dv),
        **(p.row_strides("dgk", dgk) if has_gate else dict(stride_dgkb=0, stride_dgkh=0)),
        **(p.strides("dqa", dq_acc) if dq_atomic else dict(stride_dqab=0, stride_dqas=0,
                                                             stride_dqah=0)),
        DQ_ATOMIC=dq_atomic)
    if dq_atomic:
        _cast_grads(acc, dq, p.sm_scale)
        return dq, dk, dv, dg, dmask
    # into the tensors attention_backward_outputs allocated (the fake's strides)
    if has_gate:
        dg.copy_(gates.gate_grad(dgq, dgk, packing))
    if attn_mask_grad:
        dmask.copy_(dS.sum_to_size(mods.attn_mask.shape))
    return dq, dk, dv, dg, dmask


def _cast_grads(acc: torch.Tensor, dq: torch.Tensor, dq_scale: float,
                dk: Optional[torch.Tensor] = None, dv: Optional[torch.Tensor] = None) -> None:
    """Write the gradients that the kernels added into the fp32 buffer ``acc`` (dQ, then dK
    and dV where given, each laid out as its contiguous output) into ``dq`` (times
    ``dq_scale``), ``dk`` and ``dv``, in one launch."""
    n_q, n_kv = dq.numel(), 0 if dk is None else dk.numel()
    block = 1024 if not INTERPRETING else 256
    grid = (cdiv(max(n_q, n_kv), block), 1 if dk is None else 3)
    launch_kernel(attention_bwd_cast_kernel, grid, acc=acc, dq=dq, dk=dk, dv=dv, n_q=n_q,
                  n_kv=n_kv, dq_scale=dq_scale, KV=dk is not None, BLOCK=block)


# --- dropout's mask, for tests ----------------------------------------------------------------


@on_inputs_device
def dropout_mask(dropout_seed: torch.Tensor, B: int, H: int, S_q: int, S_k: int,
                 dropout_p: float) -> torch.Tensor:
    """The (B, H, S_q, S_k) boolean keep-mask that the kernels draw for ``dropout_seed`` (an
    int64 tensor of one element) and ``dropout_p`` as the kernels draw it (options.modifiers
    rounds it); packed batches use [b, h, :len_q, :len_k] of the longest lengths' mask for
    sequence b."""
    if cpu.serves(dropout_seed):
        return cpu_dropout_mask(dropout_seed, B, H, S_q, S_k, dropout_p)
    keep = torch.empty((B, H, S_q, S_k), dtype=torch.uint8, device=dropout_seed.device)
    if keep.numel():
        block_m, block_n = (16, 32) if INTERPRETING else (64, 64)
        launch_kernel(
            dropout_mask_kernel, (cdiv(S_q, block_m), H, B), dropout_seed=dropout_seed,
            keep=keep, S_q=S_q, S_k=S_k,
            dropout_p=dropout_p, BLOCK_M=block_m, BLOCK_N=block_n)
    return keep.bool()
