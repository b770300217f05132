"""One attention call as the kernels see it (attention.py's launchers, and choice.py's rules
read it): its shapes, scale, modifier arguments and flags, made once by Problem.describe,
and the kernels' keyword arguments that follow from it (strides, sequences, pages, sinks,
dropout, fp8 descales, head-dim blocks); the check that the kernels' 32-bit row offsets
reach every row (check_row_offsets, which the decoding launchers make too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from flashop._launch import gates
from flashop._launch.common import (
    block_dim, dtype_constexprs, head_blocks, resolve_scale, tensor_meta, unit_stride_last,
)
from flashop._launch.options import PLAIN, Modifiers, Packing
from flashop._launch.scores import LOG2E, score_args, sink_args

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
        return dict(PLAIN_ARGS[causal], qk_scale=sm_scale * LOG2E), PLAIN_FLAGS[causal]
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
PLAIN_ARGS, PLAIN_FLAGS = {}, {}
for _causal in (False, True):
    PLAIN_ARGS[_causal], PLAIN_FLAGS[_causal] = _split_flags(
        {**score_args(PLAIN[_causal], 1.0, None), **_NO_GATE_OR_MASK, "alibi": None})


def dropout_args(mods: Modifiers) -> dict:
    """The kernels' dropout arguments: its seed tensor (None without dropout), probability
    (as the kernels draw it) and flag."""
    return dict(dropout_seed=mods.dropout_seed, dropout_p=mods.dropout_p, DROPOUT=mods.dropout)


_NO_SINKS = dict(sinks=None, **sink_args(None))


def sinks_args(mods: Modifiers) -> dict:
    """The forward's sink arguments (scores.sink_args, and the tensor: None without)."""
    if mods.sinks is None:
        return _NO_SINKS
    return dict(sinks=mods.sinks, **sink_args(tensor_meta(mods.sinks)))


_NOT_FP8 = dict(q_descale=None, k_descale=None, v_descale=None, stride_dsb=0, FP8=False)


def fp8_args(q: torch.Tensor, descales: Optional[tuple], B: int, H_kv: int) -> dict:
    """The forward's fp8 arguments: for e4m3 inputs the three descales, (B, H_kv) fp32
    (ones where None: a fill, which an eager call's plan replays), and their batch stride;
    none otherwise."""
    if q.dtype != torch.float8_e4m3fn:
        return _NOT_FP8
    given = descales or (None, None, None)
    q_ds, k_ds, v_ds = (q.new_full((B, H_kv), 1.0, dtype=torch.float32) if d is None
                        else d.contiguous() for d in given)
    return dict(q_descale=q_ds, k_descale=k_ds, v_descale=v_ds, stride_dsb=H_kv, FP8=True)


def _seq_strides(x: torch.Tensor, packing: Optional[Packing]) -> tuple:
    """The kernels' (batch, seq, head) strides: a packed (total, H, D) tensor has batch
    stride 0 (each program offsets its sequence's start instead); a paged cache (pages,
    page_size, H_kv, D) gives its page stride as the batch's. The tensors themselves are
    passed as they are: a broadcast view of an output would hide the kernel's writes from
    functionalization under torch.compile."""
    strides = x.stride()
    return strides[:3] if packing is None or x.dim() == 4 else (0, *strides[:2])


def check_row_offsets(op: str, tensors: tuple, row_strides: tuple, rows: tuple) -> None:
    """The kernels offset rows within one (batch, head) slice, or within one packed
    sequence, in 32-bit integers: ``rows[i]`` rows of ``tensors[i]`` of row stride
    ``row_strides[i]`` must span fewer than 2**31 elements."""
    for x, stride, n in zip(tensors, row_strides, rows):
        if n * stride >= 2**31:
            raise ValueError(
                f"{op}: a tensor of shape {tuple(x.shape)} and strides {x.stride()} spans "
                f"2**31 elements or more along its sequence dimension, past the kernels' "
                f"32-bit row offsets; split the sequence or the heads")


_NOT_PAGED = dict(block_table=None, stride_tb=0, capacity=0, PAGE_SIZE=1, IS_PAGED=False)


def paging_args(packing: Optional[Packing], k: torch.Tensor) -> dict:
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
    packed: bool  # a packed batch (packing given)
    head_dim: int  # max(D, DV): the tile table's row

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
        return cls(q, packing, B, S_q, S_k, H, H_kv, D, DV, sm_scale, args, flags,
                   packing is not None, max(D, DV))

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

    def constexprs(self, head_in_parts: Optional[bool] = None) -> dict:
        """Head dims, their blocks and the dtype's options. The tl forward's and backward's
        (``head_in_parts`` given) add BLOCK_DT: q's and k's head dim in common.head_blocks'
        two blocks where ``head_in_parts``, else in one (BLOCK_DT 0)."""
        blocks = dict(BLOCK_D=block_dim(self.D))
        if head_in_parts is not None:
            blocks = dict(zip(("BLOCK_D", "BLOCK_DT"), head_blocks(self.D) if head_in_parts
                              else (block_dim(self.D), 0)))
        return dict(D=self.D, DV=self.DV, **blocks, BLOCK_DV=block_dim(self.DV),
                    **dtype_constexprs(self.q.dtype))
