"""Launchers of the attention kernels: allocate outputs, describe the call once, pick the
kernel and its tiles, and launch it by keyword.

Every kernel is launched through ``torch.library.wrap_triton`` (launches.launch_kernel)
so that, inside a ``triton_op``, Inductor sees the Triton kernels themselves. Under Triton's
CPU interpreter ``wrap_triton`` hands back the interpreted kernel, which runs eagerly.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.library import wrap_triton

from flashop._launch import choice, cpu, gates, gluon, tiles
from flashop._launch.cpu import attention as cpu_attention
from flashop._launch.cpu.dropout import dropout_mask as cpu_dropout_mask
from flashop._launch.common import (
    block_dim, cdiv, ensure_triton_allocator, on_inputs_device, resolve_scale,
    unit_stride_last,
)
from flashop._launch.launches import launch_kernel
from flashop._launch.options import Modifiers, Packing
from flashop._launch.problem import (
    Problem, dropout_args, fp8_args, paging_args, sinks_args,
)
from flashop._launch.scores import sink_log2
from flashop.kernels import INTERPRETING
from flashop.kernels.backward import attention_bwd_dkdv_kernel
from flashop.kernels.backward_dq import attention_bwd_dq_kernel
from flashop.kernels.backward_buffer import (
    attention_bwd_cast_kernel, attention_bwd_preprocess_kernel,
)
from flashop.kernels.dropout import dropout_mask_kernel
from flashop.kernels.forward import attention_fwd_kernel
from flashop.kernels.forward_ws import attention_fwd_ws_kernel
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


def _launch(kernel, kind: str, t: tiles.Tiles, grid: Callable, lengths: tuple,
            autotune: bool = False, **kwargs):
    """Launch ``kernel`` by keyword on ``grid(BLOCK_M, BLOCK_N)`` with the tiles ``t``, or,
    where ``autotune``, the autotuned kernel on the tiles it picks; the kernel's
    ``seq_bucket`` argument is the bucket of ``lengths`` then, else 0 (a constant, so that
    Triton's integer specialisation compiles no extra variants of the plain kernels)."""
    if autotune:
        block_d = kwargs["BLOCK_D"] + kwargs.get("BLOCK_DT", 0)
        tuned = tiles.autotuned(kernel, kind, block_d, kwargs["BLOCK_DV"],
                                kwargs["q"].element_size(), kwargs["q"].device.index)
        wrap_triton(tuned)[lambda m: grid(m["BLOCK_M"], m["BLOCK_N"])](
            seq_bucket=tiles.seq_bucket(*lengths), **kwargs)
    else:
        launch_kernel(kernel, grid(t.BLOCK_M, t.BLOCK_N), seq_bucket=0, **t.constexprs(kind),
                      num_warps=t.num_warps, num_stages=t.num_stages, **kwargs)


# --- forward ----------------------------------------------------------------------------------


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


@on_inputs_device
def attention_forward(q, k, v, scale: Optional[float], mods: Modifiers,
                      packing: Optional[Packing] = None, descales: Optional[tuple] = None,
                      out_dtype: Optional[torch.dtype] = None):
    """Launch the forward; returns (out, lse, lse_log2) (see attention_forward_outputs):
    lse in natural-log units, and in base 2 for the backward. e4m3 inputs take their
    ``descales`` (q's, k's, v's: (B, H_kv) fp32 or None) and give out in ``out_dtype``.
    CPU tensors take the CPU path (cpu.serves)."""
    out, lse, lse_log2 = attention_forward_outputs(q, k, v, packing is not None, out_dtype)
    if cpu.serves(q):
        return cpu_attention.attention_forward(q, k, v, resolve_scale(scale, q.shape[-1]), mods,
                                               packing, descales, (out, lse, lse_log2))
    q, k = unit_stride_last(q), unit_stride_last(k)
    v = _fp8_values(v) if q.dtype == torch.float8_e4m3fn else unit_stride_last(v)
    if out.numel() == 0:
        return out, lse, lse_log2
    p = Problem.describe("flashop.attention", q, k, v, out, scale, mods, packing)
    if p.packed and p.B == 0:  # no sequences: no token attends anything
        return out.zero_(), lse.fill_(float("-inf")), lse_log2.fill_(float("-inf"))
    fp8 = fp8_args(q, descales, p.B, p.H_kv)
    c = choice.choose_forward(q, k, v, p, mods, fp8=fp8["FP8"])
    qk_scale = p.modifier_args["qk_scale"]
    if c.path == "Gluon forward":
        gluon.attention_forward(q, k, v, out, lse, lse_log2, mods.causal, qk_scale,
                                **dropout_args(mods))
        return out, lse, lse_log2
    grid = lambda bm, bn: (cdiv(p.S_q, bm), p.H, p.B)  # noqa: E731
    io = dict(q=q, k=k, v=v, o=out, lse=lse, lse_log2=lse_log2, **p.strides("q", q),
              **p.strides("k", k), **p.strides("v", v), **p.strides("o", out),
              **p.row_strides("l", lse), **fp8, stride_vd=v.stride(-1))
    ws = c.kernels[0][0] == "attention_fwd_ws_kernel"
    if ws or c.tma:  # descriptors made in the kernels
        ensure_triton_allocator()
    if ws:
        _launch(attention_fwd_ws_kernel, "fwd_ws", c.tiles, grid, lengths=(), **io, S_q=p.S_q,
                S_k=p.S_k, G=p.H // p.H_kv, qk_scale=qk_scale, **p.constexprs(),
                FOLD_SCALE=c.fold, Q_HEAD_MAJOR=choice.ws_query_layout(q))
        return out, lse, lse_log2
    _launch(attention_fwd_kernel, "fwd", c.tiles, grid, lengths=(p.S_q, p.S_k),
            autotune=c.autotune, **io, **p.sequences(), **paging_args(p.packing, k),
            **p.modifier_args, **sinks_args(mods), **dropout_args(mods),
            **p.constexprs(c.head_in_parts), **p.flags, FOLD_SCALE=c.fold, TMA=c.tma)
    return out, lse, lse_log2


def choices(q, k, v, scale: Optional[float], mods: Modifiers,
            packing: Optional[Packing] = None, fp8: bool = False, backward: bool = False,
            deterministic: bool = False) -> tuple:
    """The forward's choice (choice.choose_forward) and, where ``backward``, the backward's
    (choice.choose_backward, for a dout laid out as the forward's output), as the launchers
    make them for a checked call; launches nothing and allocates no output (meta tensors
    stand in for them: the rules read shapes, strides and alignment)."""
    q, k = unit_stride_last(q), unit_stride_last(k)
    if fp8 and not keys_last(v):  # the copy the forward would make (_fp8_values)
        *lead, S, H, D = v.shape
        v = torch.empty((*lead, H, D, S), device="meta", dtype=v.dtype).movedim(-1, -3)
    elif not fp8:
        v = unit_stride_last(v)
    out = torch.empty((*q.shape[:-1], v.shape[-1]), device="meta", dtype=q.dtype)
    p = Problem.describe("flashop.attention", q, k, v, out, scale, mods, packing)
    if cpu.serves(q):
        paged = packing is not None and packing.block_table is not None
        forward = choice.ForwardChoice(*choice.cpu_path(q, k, v, p, mods,
                                                        differentiable=not (fp8 or paged)))
        if not backward:
            return forward, None
        return forward, choice.BackwardChoice(*choice.cpu_path(q, k, v, p, mods, True))
    forward = choice.choose_forward(q, k, v, p, mods, fp8=fp8)
    if not backward:
        return forward, None
    deterministic = choice.deterministic_backward(deterministic)
    mask_grad = mods.attn_mask is not None and mods.attn_mask.requires_grad
    return forward, choice.choose_backward(q, k, v, out, p, mods, mask_grad, deterministic)


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


@on_inputs_device
def attention_backward(dout, dlse, q, k, v, out, lse_log2, scale: Optional[float],
                       mods: Modifiers, attn_mask_grad: bool, packing: Optional[Packing] = None,
                       deterministic: bool = False):
    """Launch the backward from the forward's ``out`` and base-2 ``lse_log2``; returns (dq,
    dk, dv, dg, dattn_mask) (the last two as in attention_backward_outputs).

    The kernels are choice.choose_backward's: the Gluon backward where its rule takes the
    call, else the tl kernels (the dQ kernel, then the dK/dV kernel, or its two parts; or
    the dK/dV kernel adding dQ by atomics alone). ``deterministic`` as
    choice.deterministic_backward gives it. CPU tensors take the CPU path (cpu.serves),
    reproducible whatever ``deterministic`` says."""
    grads = attention_backward_outputs(q, k, v, mods.g, mods.attn_mask, attn_mask_grad)
    if cpu.serves(q):
        return cpu_attention.attention_backward(dout, dlse, q, k, v, out, lse_log2,
                                                resolve_scale(scale, q.shape[-1]), mods,
                                                attn_mask_grad, packing, grads)
    dq, dk, dv, dg, dmask = grads
    q, k, v, out, dout = (unit_stride_last(x) for x in (q, k, v, out, dout))
    lse_log2 = lse_log2.contiguous()  # fp32 rows: the kernels index them with a unit stride
    if (packing is not None and packing.batch == 0) or q.numel() == 0 or k.numel() == 0:
        # nothing attends anything: every gradient is zero (dq needs writing when S_k == 0)
        return dq.zero_(), dk.zero_(), dv.zero_(), dg.zero_(), dmask.zero_()
    p = Problem.describe("flashop.attention_backward", q, k, v, dout, scale, mods, packing)
    c = choice.choose_backward(q, k, v, dout, p, mods, attn_mask_grad, deterministic)
    delta = lse_log2.new_empty(lse_log2.shape)
    o_strides = p.strides("o", out)
    dlse_strides = dict(zip(("stride_dlb", "stride_dlh", "stride_dls"),
                            dlse.stride() if packing is None else (0, *dlse.stride())))
    use_gluon = c.ordered is not None
    if use_gluon:
        acc, dq_acc, dq_sem, dk_acc, dv_acc = gluon.backward_buffer(q, k, c.ordered, c.split)
    else:
        # fp32 buffer laid out as q: the tl dK/dV kernel adds dQ / scale into it
        acc = dq_acc = (torch.empty(q.shape, device=q.device, dtype=torch.float32)
                        if c.dq_atomic else None)
    if c.dq_atomic or use_gluon:
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
        split = c.split
        gluon.attention_backward(q, k, v, dout, lse_log2, delta, dq_acc, dq_sem,
                                 dk if split == 1 else dk_acc, dv if split == 1 else dv_acc,
                                 p.flags["HAS_RIGHT"], p.sm_scale, p.modifier_args["qk_scale"],
                                 **dropout_args(mods), split=split, rotate=c.rotated)
        # the kernel adds dQ itself, scaled
        _cast_grads(acc, dq, 1.0, *((dk, dv) if split > 1 else ()))
        return dq, dk, dv, dg, dmask
    has_gate = mods.g is not None
    # the gate's gradient halves: rows of the queries (as lse) and of the keys
    dgq = dgk = None
    if has_gate:
        dgq = lse_log2.new_empty(lse_log2.shape)
        dgk = lse_log2.new_empty((p.B, p.H, p.S_k) if packing is None else (p.H, k.shape[0]))
    # dS of every (query, key) pair; pairs outside the window are never visited: zeros
    dS = lse_log2.new_zeros((p.B, p.H, p.S_q, p.S_k)) if attn_mask_grad else None
    # what the dK/dV and dQ kernels share
    common = dict(q=q, k=k, v=v, do=dout, lse_log2=lse_log2, delta=delta, **p.strides("q", q),
                  **p.strides("k", k), **p.strides("v", v), **p.strides("do", dout),
                  **p.row_strides("l", lse_log2), sm_scale=p.sm_scale, **p.sequences(),
                  **p.modifier_args, **dropout_args(mods), **p.constexprs(c.head_in_parts),
                  **p.flags, FOLD_SCALE=choice.folds_scale(p.modifier_args["qk_scale"], p.flags, q.dtype),
                  TMA=c.tma)
    if c.tma:  # descriptors made in the kernels
        ensure_triton_allocator()
    if not c.dq_atomic:
        # the dQ kernel first: it also stores delta, which the dK/dV kernel reads
        _launch(
            attention_bwd_dq_kernel, "dq", c.tiles["dq"],
            lambda bm, bn: (cdiv(p.S_q, bm), p.H, p.B), lengths=(p.S_q, p.S_k),
            autotune=c.autotune and not attn_mask_grad, **common,
            dq=dq, dgq=dgq, dattn_mask=dS, o=out, dlse=dlse, **p.strides("dq", dq),
            **o_strides, **dlse_strides, H=p.H, ATTN_MASK_GRAD=attn_mask_grad)
    # the dK/dV kernel, or its dV and dK parts as two launches
    for kind, part in c.parts:
        _launch(
            attention_bwd_dkdv_kernel, kind, c.tiles[kind],
            lambda bm, bn: (cdiv(p.S_k, bn), p.H_kv, p.B), lengths=(p.S_q, p.S_k),
            autotune=c.autotune and not c.dq_atomic, **common,
            dk=dk, dv=dv, dgk=dgk, dq_acc=dq_acc, **p.strides("dk", dk), **p.strides("dv", dv),
            **(p.row_strides("dgk", dgk) if has_gate else dict(stride_dgkb=0, stride_dgkh=0)),
            **(p.strides("dqa", dq_acc) if c.dq_atomic else dict(stride_dqab=0, stride_dqas=0,
                                                                   stride_dqah=0)),
            DQ_ATOMIC=c.dq_atomic, PARTS=part)
    if c.dq_atomic:
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
