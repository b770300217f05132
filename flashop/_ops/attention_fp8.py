"""Registration of the fp8 attention operator: e4m3 queries, keys and values with
FlashAttention-3's descales; forward only.

``flashop::attention_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
q_descale, k_descale, v_descale, alibi_slopes, sinks, *, causal, scale, window_size_left,
window_size_right, attention_chunk, softcap, out_dtype) -> (out, lse)``: q, k, v in
``float8_e4m3fn``, dense
(B, S, H, D) or packed (the four packing arguments given, as ``attention_forward``'s); the
real value of query head h of sequence b is ``q * q_descale[b, h // (H // H_kv)]``, of key
and value head h_kv ``k * k_descale[b, h_kv]`` (values likewise), each descale (B, H_kv)
fp32 or None for 1. out in ``out_dtype`` (bfloat16 where None), lse fp32 natural log, as the
16-bit operators'. Causal, windows, chunks, softcap, ALiBi, GQA, packing and sinks as
there (the same forward kernel); the
gate, attn_mask and dropout are not taken.

An operator of its own rather than arguments of ``attention_forward``: it is forward-only
(its registered backward raises, as FlashAttention-3 has no fp8 backward), so the training
operator's schema, autograd and backward stay as they are. The public functions
(flashop.attention, attention_with_lse, attention_varlen(_with_lse)) route e4m3 inputs here.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula, sdpa_flop_count

from flashop._launch import attention as launch
from flashop._launch import cpu
from flashop._launch.options import modifiers, packing
from flashop._launch.plans import PlannedBody
from flashop._ops.attention import bhsd_shapes, register_forward_only, register_opaque
from flashop._ops.checks import check_fp8_inputs, check_packing_arguments
from flashop.kernels import INTERPRETING

_register = torch.library.custom_op if INTERPRETING else torch.library.triton_op
OP = "flashop.attention"


def _fp8_call(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
              max_seqlen_k=None, q_descale=None, k_descale=None, v_descale=None,
              alibi_slopes=None, sinks=None, *, causal=False, scale=None, window_size_left=-1,
              window_size_right=-1, attention_chunk=0, softcap=0.0, out_dtype=None):
    """An fp8 call's Modifiers, Packing (None: dense) and descales, checked."""
    check_packing_arguments(OP, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    mods = modifiers(None, alibi_slopes, None, causal, window_size_left, window_size_right,
                     softcap, sinks, attention_chunk=attention_chunk)
    packed = packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    descales = (q_descale, k_descale, v_descale)
    check_fp8_inputs(q, k, v, descales, out_dtype, scale, mods, packed,
                     op=OP if packed is None else "flashop.attention_varlen")
    return mods, packed, descales


@_register("flashop::attention_fp8", mutates_args=())
def attention_fp8(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor] = None,
                  cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
                  max_seqlen_k: Optional[int] = None, q_descale: Optional[Tensor] = None,
                  k_descale: Optional[Tensor] = None, v_descale: Optional[Tensor] = None,
                  alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None, *,
                  causal: bool = False, scale: Optional[float] = None,
                  window_size_left: int = -1, window_size_right: int = -1,
                  attention_chunk: int = 0, softcap: float = 0.0,
                  out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    return run_attention_fp8(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_descale, k_descale,
        v_descale, alibi_slopes, sinks, causal=causal, scale=scale,
        window_size_left=window_size_left, window_size_right=window_size_right,
        attention_chunk=attention_chunk, softcap=softcap, out_dtype=out_dtype)


def run_attention_fp8(q, k, v, *args, scale=None, out_dtype=None, **options):
    """attention_fp8's body (its arguments): checks, then the forward kernel; (out, lse).
    Also run directly by the eager path (flashop/_ops/eager.py); a traced call of CPU
    tensors runs it through attention_fp8_opaque (cpu.traced)."""
    mods, packed, descales = _fp8_call(q, k, v, *args, scale=scale, out_dtype=out_dtype,
                                       **options)
    if cpu.traced(q):
        return torch.ops.flashop.attention_fp8_opaque(q, k, v, *args, scale=scale,
                                                      out_dtype=out_dtype, **options)
    out, lse, _ = launch.attention_forward(q, k, v, scale, mods, packed, descales=descales,
                                           out_dtype=out_dtype or torch.bfloat16)
    return out, lse


# the body as the direct eager path runs it: by plans made once per signature of calls
# (plans.PlannedBody; flashop/_ops/eager.py)
planned_attention_fp8 = PlannedBody(run_attention_fp8)


@attention_fp8.register_fake
def _attention_fp8_fake(q, k, v, *args, out_dtype=None, **options):
    _, packed, _ = _fp8_call(q, k, v, *args, out_dtype=out_dtype, **options)
    out, lse, _ = launch.attention_forward_outputs(q, k, v, packed=packed is not None,
                                                   out_dtype=out_dtype or torch.bfloat16)
    return out, lse


register_opaque("attention_fp8", planned_attention_fp8, _attention_fp8_fake)


register_forward_only(attention_fp8, (
    "flashop.attention: fp8 (float8_e4m3fn) attention is forward-only, as "
    "FlashAttention-3's: no gradient flows to fp8 q, k, v; for training run the 16-bit "
    "inputs (bfloat16 or float16), or run the fp8 call under torch.no_grad() / "
    "torch.inference_mode()"))


@register_flop_formula(torch.ops.flashop.attention_fp8, get_raw=True)
def _fp8_flops(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
               max_seqlen_k=None, *args, out_val=None, **options) -> int:
    """SDPA's count, as the 16-bit forward's (the FLOPs of the same attention in bf16)."""
    return sum(sdpa_flop_count(*shapes) for shapes in bhsd_shapes(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
