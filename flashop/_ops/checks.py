"""Input checks shared by the ops and their fake (meta) functions.

Each error names the offending shapes, dtypes or devices and says how to fix the call.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8 = torch.float8_e4m3fn  # FlashAttention-3's fp8: forward only (flashop::attention_fp8)
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256

_LAYOUT = "(batch, seqlen, heads, head_dim)"


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _shapes(q, k, v) -> str:
    return f"q {_shape(q)}, k {_shape(k)}, v {_shape(v)}"


def window_bounds(op: str, window_size) -> tuple[int, int]:
    """The operators' ``window_size_left``, ``window_size_right`` of the Python API's
    ``window_size`` pair (-1: unbounded); the bounds' range is checked with the other
    modifiers (check_modifiers)."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        left = right = None
    if not (isinstance(left, (int, torch.SymInt)) and isinstance(right, (int, torch.SymInt))):
        _bad_window(op, tuple(window_size) if isinstance(window_size, (list, tuple))
                    else window_size)
    return left, right


def _bad_window(op: str, got) -> None:
    """The one message of a window that is not a pair of ints, each -1 or more."""
    raise ValueError(f"{op}: window_size must be (left, right) with each >= 0, or -1 for no "
                     f"bound, got {got}")


def unbounded_if_negative(left: Optional[int], right: Optional[int]) -> tuple[int, int]:
    """A window in flash-attn's and aten's convention (a negative side, or None, is
    unbounded) in flashop's (-1)."""
    return (-1 if left is None or left < 0 else int(left),
            -1 if right is None or right < 0 else int(right))


def check_packing_arguments(op: str, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k) -> None:
    """The four arguments that describe a packed batch come together, or not at all."""
    if cu_seqlens_q is cu_seqlens_k is max_seqlen_q is max_seqlen_k is None:
        return
    given = {name: x is not None for name, x in (
        ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
        ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k))}
    if any(given.values()) and not all(given.values()):
        missing = ", ".join(name for name, there in given.items() if not there)
        raise ValueError(
            f"{op}: a packed batch is described by cu_seqlens_q, cu_seqlens_k, max_seqlen_q "
            f"and max_seqlen_k together, but {missing} {'is' if ',' not in missing else 'are'} "
            f"None; pass all four (flashop.attention_varlen), or none for a dense batch")


def check_attention_inputs(q, k, v, scale: Optional[float], mods=None, packing=None, *,
                           op: Optional[str] = None, fp8: bool = False) -> None:
    """Validate q (B, S_q, H, D), k (B, S_k, H_kv, D), v (B, S_k, H_kv, DV), scale and the
    score modifiers ``mods`` (an ``options.Modifiers``; None: no modifiers); where
    ``packing`` (an ``options.Packing``) is given, a packed batch (check_varlen_inputs).
    ``fp8``: the inputs are e4m3 (the fp8 operator), else 16- or 32-bit."""
    if packing is not None:
        check_varlen_inputs(q, k, v, packing.cu_seqlens_q, packing.cu_seqlens_k,
                            packing.max_seqlen_q, packing.max_seqlen_k, scale, mods,
                            op=op or "flashop.attention_varlen",
                            fp8=fp8)
        return
    op = op or "flashop.attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{op}: {name} must be a 4-D tensor {_LAYOUT}, got shape {_shape(t)}")
    _check_qkv(q, k, v, scale, op=op, packed=False, fp8=fp8)
    B, H = q.shape[0], q.shape[2]
    if mods is not None and not mods.is_plain:
        check_modifiers(q, mods, op, B, q.shape[1], k.shape[1], H)


def _check_qkv(q, k, v, scale: Optional[float], *, op: str, packed: bool,
               fp8: bool = False) -> None:
    """The checks dense and packed inputs share: dtypes, devices, matching shapes (dims
    named as the caller sees them: packed tensors have no batch dim), head dims, scale."""
    if not q.dtype == k.dtype == v.dtype:
        fp8_hint = (", or all three to float8_e4m3fn" if FP8 in (q.dtype, k.dtype, v.dtype)
                    else "")
        raise ValueError(
            f"{op}: q, k and v must have the same dtype, got q {q.dtype}, k {k.dtype}, "
            f"v {v.dtype}; cast them to one of float16, bfloat16, float32{fp8_hint}")
    _check_dtype(op, q.dtype, fp8)
    if not q.device == k.device == v.device:
        raise ValueError(
            f"{op}: q, k and v must be on the same device, got q on {q.device}, "
            f"k on {k.device}, v on {v.device}")
    check_device(op, q.device)
    s = 0 if packed else 1  # the tokens' dim; heads and head dim follow it
    if not packed and (k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]):
        raise ValueError(f"{op}: q, k and v must have the same batch size (dim 0), got "
                         f"{_shapes(q, k, v)}")
    if k.shape[s] != v.shape[s]:
        what = "number of tokens" if packed else "sequence length"
        raise ValueError(
            f"{op}: k and v must have the same {what} (dim {s}), got {_shapes(q, k, v)}")
    H, D = q.shape[s + 1], q.shape[s + 2]
    H_kv = k.shape[s + 1]
    if v.shape[s + 1] != H_kv:
        raise ValueError(
            f"{op}: k and v must have the same number of heads (dim {s + 1}), got "
            f"{_shapes(q, k, v)}")
    if k.shape[s + 2] != D:
        raise ValueError(
            f"{op}: q and k must have the same head dim (dim {s + 2}), got "
            f"{_shapes(q, k, v)}")
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(
            f"{op}: the number of query heads ({H}) must be a multiple of the number of "
            f"key/value heads ({H_kv}) for grouped-query attention, got {_shapes(q, k, v)}"
            f"{'' if packed else _transposed_hint(q, k, v)}")
    DV = v.shape[s + 2]
    if not (1 <= D <= MAX_HEAD_DIM and 1 <= DV <= MAX_HEAD_DIM):
        raise ValueError(
            f"{op}: head dims from 1 to {MAX_HEAD_DIM} are supported, got {D} for q and k "
            f"and {DV} for v ({_shapes(q, k, v)})")
    check_scale(op, scale)


def _check_dtype(op: str, dtype: torch.dtype, fp8: bool) -> None:
    """16- or 32-bit inputs, or where ``fp8``, e4m3 ones; an fp8 call of the differentiable
    operators is told where fp8 goes."""
    if fp8:
        if dtype != FP8:
            raise ValueError(f"{op}: the fp8 operator takes float8_e4m3fn q, k and v, got "
                             f"{dtype}; run 16- and 32-bit inputs through flashop.attention")
        return
    if dtype == FP8:
        raise ValueError(
            f"{op}: float8_e4m3fn inputs are forward-only and run on flashop::attention_fp8: "
            f"call flashop.attention / attention_with_lse / attention_varlen(_with_lse), which "
            f"route them there (with q_descale, k_descale, v_descale), or "
            f"torch.ops.flashop.attention_fp8")
    if dtype not in SUPPORTED_DTYPES:
        fp8_hint = (" (of the fp8 types, float8_e4m3fn, FlashAttention-3's)"
                    if dtype.is_floating_point and dtype.itemsize == 1 else "")
        raise ValueError(
            f"{op}: dtype {dtype} is not supported; use float16, bfloat16 or float32"
            f"{fp8_hint}")


def check_fp8_inputs(q, k, v, descales: tuple, out_dtype: Optional[torch.dtype], scale,
                     mods, packing, *, op: str) -> None:
    """Validate an fp8 call: e4m3 q, k, v as check_attention_inputs (dense or packed), each
    descale None or (B, H_kv) float32 on q's device (B the batch, or the packed batch's
    number of sequences), the output's dtype 16-bit (None: bfloat16)."""
    check_attention_inputs(q, k, v, scale, mods, packing, op=op, fp8=True)
    B = q.shape[0] if packing is None else packing.batch
    for name, d in zip(("q_descale", "k_descale", "v_descale"), descales):
        check_descale(op, name, d, B, k.shape[-2], q.device)
    check_fp8_out_dtype(op, out_dtype)


def check_descale(op: str, name: str, d: Optional[torch.Tensor], B, H_kv,
                  device: torch.device) -> None:
    """A descale: None, or (B, H_kv) float32 on ``device`` (FlashAttention-3's: one factor
    per sequence and key/value head)."""
    if d is None:
        return
    if _shape(d) != (B, H_kv):
        raise ValueError(
            f"{op}: {name} must have shape (batch, kv_heads) = ({B}, {H_kv}) (one factor "
            f"per sequence and key/value head, FlashAttention-3's), got {_shape(d)}")
    _check_tensor(op, name, d, (torch.float32,), device)


def check_fp8_arguments_need_fp8(op: str, q: torch.Tensor, inputs: str, **given) -> None:
    """The fp8 arguments (descales, out_dtype) passed with ``given`` (their names and
    values) apply to float8_e4m3fn ``inputs`` only: with q of another dtype, each given one
    is refused by name."""
    names = [name for name, value in given.items() if value is not None]
    if names and q.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"{op}: {', '.join(names)} appl{'y' if len(names) > 1 else 'ies'} to "
            f"float8_e4m3fn {inputs} only, got q of dtype "
            f"{q.dtype}; drop {'them' if len(names) > 1 else 'it'}, or pass float8_e4m3fn "
            f"{inputs}")


def check_fp8_out_dtype(op: str, out_dtype: Optional[torch.dtype]) -> None:
    """The output's dtype of fp8 inputs: 16-bit, or None (bfloat16)."""
    if out_dtype is not None and out_dtype not in FP8_OUT_DTYPES:
        raise ValueError(f"{op}: out_dtype must be torch.bfloat16 or torch.float16 (or None: "
                         f"bfloat16), got {out_dtype}")


def check_scale(op: str, scale: Optional[float]) -> None:
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"{op}: scale must be a finite float or None (1/sqrt(head_dim)), "
                         f"got {scale}")


def _transposed_hint(q, k, v) -> str:
    """Where 4-D q, k, v that fail the head counts would pass them in SDPA's (batch, heads,
    seqlen, head_dim) layout, the likely mistake and its fix; else nothing."""
    H, H_kv = q.shape[1], k.shape[1]
    if H_kv == 0 or H % H_kv or v.shape[1] != H_kv or v.shape[2] != k.shape[2]:
        return ""
    return ("; if they are (batch, heads, seqlen, head_dim), SDPA's layout, pass "
            "q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2) (flashop takes "
            "(batch, seqlen, heads, head_dim)) and transpose the output back")


def check_device(op: str, device: torch.device) -> None:
    """flashop runs on CUDA GPUs (its Triton kernels) and on the CPU (its CPU path, or the
    kernels in Triton's interpreter); meta tensors pass (they trace)."""
    if device.type not in ("cuda", "cpu", "meta"):
        raise RuntimeError(
            f"{op}: the inputs are on {device}, but flashop runs on CUDA GPUs and on the "
            f"CPU; move the tensors to one of them")


def check_modifiers(q, mods, op: str, B, S_q, S_k, H, g_shape: Optional[tuple] = None) -> None:
    """Validate window_size, softcap, alibi_slopes, g and attn_mask for a batch of B
    sequences of S_q queries (H heads; dtype and device of ``q``) and S_k keys; ``g_shape``
    replaces g's expected (B, S_k, H)."""
    left, right = mods.window_size_left, mods.window_size_right
    if left < -1 or right < -1:
        _bad_window(op, (left, right))
    if mods.causal and right > 0:
        raise ValueError(
            f"{op}: causal=True attends no key after the query, but window_size=({left}, "
            f"{right}) asks for {right} after it; pass window_size=({left}, 0) (or -1) with "
            f"causal=True, or causal=False for a two-sided window")
    check_attention_chunk(op, mods.attention_chunk)
    if not (math.isfinite(mods.softcap) and mods.softcap >= 0):
        raise ValueError(f"{op}: softcap must be a finite float >= 0 (0 turns it off), "
                         f"got {mods.softcap}")
    slopes = mods.alibi_slopes
    if slopes is not None:
        if _shape(slopes) not in ((H,), (B, H)):
            raise ValueError(
                f"{op}: alibi_slopes must have shape (H,) = ({H},) or (B, H) = ({B}, {H}), "
                f"got {_shape(slopes)}")
        _check_tensor(op, "alibi_slopes", slopes, (torch.float32,), q.device)
    g = mods.g
    if g is not None:
        if not mods.causal:
            raise ValueError(
                f"{op}: the log-decay gate g requires causal=True (as in flash-linear-"
                f"attention: the decay G_i - G_j is a decay only for keys j before query i)")
        if g_shape is not None:
            if _shape(g) != g_shape:
                raise ValueError(
                    f"{op}: g must have shape (total_k, H) = {g_shape} (one log-decay per key "
                    f"token and query head), got {_shape(g)}")
        elif _shape(g) != (B, S_k, H):
            raise ValueError(
                f"{op}: g must have shape (B, S_k, H) = ({B}, {S_k}, {H}) (one log-decay per "
                f"key position and query head; query i sits at position i + S_k - S_q), "
                f"got {_shape(g)}")
        _check_tensor(op, "g", g, _float_dtypes(q), q.device)
    mask = mods.attn_mask
    if mask is not None:
        target = (B, H, S_q, S_k)
        if mask.dim() > 4 or any(m not in (1, t) for m, t in zip(reversed(mask.shape),
                                                                  reversed(target))):
            raise ValueError(
                f"{op}: attn_mask of shape {_shape(mask)} does not broadcast to (B, H, S_q, "
                f"S_k) = {target}; give it that shape, or 1 in the dims it shares")
        _check_tensor(op, "attn_mask", mask, (torch.bool,) + _float_dtypes(q), q.device)
        if S_q * S_k >= 2**31:
            raise ValueError(
                f"{op}: attn_mask covers S_q * S_k = {S_q} * {S_k} pairs per head, past the "
                f"kernels' 32-bit offsets within a head; use window_size / causal instead, "
                f"or split the queries")
    check_training_options(q, mods, op, H)


def check_attention_chunk(op: str, chunk) -> None:
    """``attention_chunk``: an int >= 0 (0: off), FlashAttention-3's."""
    if not (isinstance(chunk, (int, torch.SymInt)) and not isinstance(chunk, bool)
            and chunk >= 0):
        raise ValueError(
            f"{op}: attention_chunk must be an int >= 0 (the chunk's length in keys: each "
            f"query attends only the keys of its chunk; 0 turns chunking off), got "
            f"{chunk!r}")


def check_training_options(q, mods, op: str, H) -> None:
    """Validate the attention sinks (one logit per query head) and dropout: 0 <= dropout_p
    < 1, and where it is above 0, the seed the ops draw (an int64 tensor of one element on
    q's device)."""
    sinks = mods.sinks
    if sinks is not None:
        if _shape(sinks) != (H,):
            raise ValueError(
                f"{op}: sinks must have shape (H,) = ({H},): one logit per query head, got "
                f"{_shape(sinks)}")
        _check_tensor(op, "sinks", sinks, _float_dtypes(q), q.device)
    p = mods.dropout_p
    if not (isinstance(p, (int, float)) and math.isfinite(p) and 0.0 <= p < 1.0):
        raise ValueError(f"{op}: dropout_p must be a float with 0 <= dropout_p < 1 (the "
                         f"probability of dropping an attention probability), got {p}")
    if p > 0:
        seed = mods.dropout_seed
        if seed is None:
            raise ValueError(
                f"{op}: dropout_p > 0 needs dropout_seed, an int64 tensor of one element "
                f"(flashop.attention and the composite ops draw it from torch's generator)")
        if seed.dtype != torch.int64 or seed.numel() != 1:
            raise ValueError(f"{op}: dropout_seed must be an int64 tensor of one element, got "
                             f"{seed.dtype} of shape {_shape(seed)}")
        if seed.device != q.device:
            raise ValueError(f"{op}: dropout_seed must be on {q.device} like q, got "
                             f"{seed.device}")


def _float_dtypes(q) -> tuple:
    """A floating modifier's dtypes: fp32, or q's where 16-bit (fp8 calls take fp32)."""
    return (torch.float32,) if q.dtype in (torch.float32, FP8) else (torch.float32, q.dtype)


def _check_tensor(op, name, t, dtypes, device) -> None:
    if t.dtype not in dtypes:
        names = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{op}: {name} must be {names}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{op}: {name} must be on {device} like q, got {t.device}")


def check_backward_inputs(dout, dlse, q, k, v, out, lse_log2, scale: Optional[float], mods,
                          attn_mask_grad: bool, packing=None) -> None:
    """Validate the backward's inputs against the forward's shapes (dense, or packed where
    ``packing`` is given)."""
    op = "flashop.attention_backward"
    check_attention_inputs(q, k, v, scale, mods, packing, op=op)
    if attn_mask_grad and (mods.attn_mask is None or mods.attn_mask.dtype == torch.bool):
        raise ValueError(f"{op}: attn_mask_grad=True needs a float attn_mask")
    if packing is None:
        B, S_q, H, _ = q.shape
        out_shape, lse_shape = (B, S_q, H, v.shape[3]), (B, H, S_q)
    else:
        total_q, H, _ = q.shape
        out_shape, lse_shape = (total_q, H, v.shape[2]), (H, total_q)
    _check_forward_results(op, q, out, dout, lse_log2, dlse, out_shape, lse_shape)


def _check_forward_results(op, q, out, dout, lse_log2, dlse, out_shape, lse_shape) -> None:
    """out and dout of ``out_shape`` in q's dtype, lse_log2 and dlse of ``lse_shape`` in fp32,
    all on q's device."""
    for name, t in (("out", out), ("dout", dout)):
        if _shape(t) != out_shape:
            raise ValueError(f"{op}: {name} must have shape {out_shape}, got {_shape(t)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{op}: {name} must be {q.dtype} on {q.device} like q, "
                             f"got {t.dtype} on {t.device}")
    for name, t in (("lse_log2", lse_log2), ("dlse", dlse)):
        if _shape(t) != lse_shape:
            raise ValueError(f"{op}: {name} must have shape {lse_shape}, got {_shape(t)}")
        if t.dtype != torch.float32 or t.device != q.device:
            raise ValueError(f"{op}: {name} must be float32 on {q.device}, "
                             f"got {t.dtype} on {t.device}")


_PACKED = "(total_tokens, heads, head_dim)"


def check_offsets(op: str, q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  total_k: Optional[int]) -> None:
    """A packed batch's int32 cu_seqlens (batch + 1,) on q's device and its longest lengths,
    for q's total_q query tokens and ``total_k`` key tokens (None: keys in a paged cache,
    whose offsets only count them)."""
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]),
                            ("cu_seqlens_k", cu_seqlens_k, total_k)):
        if cu.dim() != 1 or cu.shape[0] < 1 or cu.dtype != torch.int32:
            end = "" if total is None else f", {total}"
            raise ValueError(
                f"{op}: {name} must be a 1-D int32 tensor of batch + 1 cumulative offsets "
                f"(0, len_0, len_0 + len_1, ...{end}), got {cu.dtype} of shape "
                f"{_shape(cu)}")
        if cu.device != q.device:
            raise ValueError(f"{op}: {name} must be on {q.device} like q, got {cu.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"{op}: cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
            f"{_shape(cu_seqlens_q)} and {_shape(cu_seqlens_k)}")
    for name, m, total in (("max_seqlen_q", max_seqlen_q, q.shape[0]),
                           ("max_seqlen_k", max_seqlen_k, total_k)):
        if m < 0 or (m == 0 and total is not None and total > 0):
            raise ValueError(
                f"{op}: {name} must be the longest sequence's length (>= 1 with {total} "
                f"tokens), got {m}")


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        scale: Optional[float], mods, *, op: str = "flashop.attention_varlen",
                        fp8: bool = False) -> None:
    """Validate a packed batch: q (total_q, H, D), k (total_k, H_kv, D), v (total_k, H_kv,
    DV), int32 cu_seqlens of length batch + 1, the longest lengths, scale and modifiers.

    The offsets' values stay on the device (reading them would synchronize with the host):
    they must start at 0, not decrease, end at total_q / total_k, and no sequence may be
    longer than max_seqlen; other values read or write outside the sequences' tokens."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(
                f"{op}: {name} must be a 3-D tensor {_PACKED} of packed sequences, got shape "
                f"{_shape(t)}; for padded (batch, seqlen, heads, head_dim) tensors use "
                f"flashop.attention, or flashop.unpad_input to pack them")
    _check_qkv(q, k, v, scale, op=op, packed=True, fp8=fp8)
    check_offsets(op, q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, k.shape[0])
    if mods is None or mods.is_plain:
        return
    if mods.attn_mask is not None:
        raise ValueError(f"{op}: attn_mask is not supported with packed sequences; use "
                         f"causal / window_size, or flashop.attention on a padded batch")
    check_modifiers(q, mods, op, cu_seqlens_q.shape[0] - 1, q.shape[0], k.shape[0], q.shape[1],
                    g_shape=(k.shape[0], q.shape[1]))
