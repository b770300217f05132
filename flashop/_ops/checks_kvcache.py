"""Input checks of attention over a key/value cache, shared by the op and its fake.

Only what the shapes, dtypes and devices show is checked: the values of cache_seqlens,
cache_batch_idx and block_table stay on the device (reading them would synchronize with the
host and break CUDA graph capture). docs/decoding.md says what happens when they are wrong.
"""

from __future__ import annotations

from typing import Optional

import torch

from flashop._ops.checks import (
    SUPPORTED_DTYPES, check_descale, check_device, check_fp8_arguments_need_fp8,
    check_fp8_out_dtype, check_modifiers, check_offsets, check_scale,
)
from flashop._ops.checks_mla import (
    cache_aliasing, check_cache_aliasing, check_head_dims, check_latent_options, is_mla,
)

OP = "flashop.attention_with_kvcache"
MAX_NUM_SPLITS = 128
FP8_CACHE_DTYPE = torch.float8_e4m3fn  # FlashAttention-3's
_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2",
                                                 "float8_e4m3fnuz", "float8_e5m2fnuz",
                                                 "float8_e8m0fnu") if hasattr(torch, n))


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                         block_table, scale: Optional[float], mods, num_splits: int, *,
                         op: str = OP, rotary_cos=None, rotary_sin=None,
                         cache_leftpad=None, k_descale=None, v_descale=None, q_descale=None,
                         out_dtype: Optional[torch.dtype] = None,
                         aliasing: Optional[tuple] = None) -> None:
    """Validate q (B, S_q, H, D); a dense cache (B_cache, S_cache, H_kv, D / DV) or a paged
    one (num_blocks, page_size, H_kv, D / DV) with block_table (B, max_blocks), v_cache of
    its own or k_cache[..., :DV] (``aliasing``, checks_mla.cache_aliasing's, computed where
    None), MLA's latent cache at head dims (576, 512) with its options
    (check_latent_options); k, v (B, S_new, H_kv, D / DV), or neither, or k alone at MLA's
    head dims (the new values then k[..., :512]); the dtypes (check_dtypes, with
    out_dtype); int32 cache_seqlens (B,), cache_batch_idx (B,) and cache_leftpad (B,)
    (dense caches);
    rotary_cos, rotary_sin (check_rotary, in the dtype the kernels compute in); fp32
    k_descale, v_descale (B, H_kv) with an fp8 cache, q_descale (B, H_kv) with fp8 q;
    scale, the modifiers and num_splits."""
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    aliasing = cache_aliasing(k_cache, v_cache, k, v) if aliasing is None else aliasing
    if (k is None) != (v is None) and not (v is None and is_mla(k_cache, v_cache)):
        raise ValueError(f"{op}: pass both k and v (the new keys and values to append) or "
                         f"neither, got k {'None' if k is None else _shape(k)} and v "
                         f"{'None' if v is None else _shape(v)}")
    tensors.update({n: t for n, t in (("k", k), ("v", v)) if t is not None})
    layouts = {"q": "(batch, seqlen_q, heads, head_dim)",
               "k_cache": "(batch_cache, seqlen_cache, kv_heads, head_dim) or (num_blocks, "
                          "page_size, kv_heads, head_dim)",
               "k": "(batch, seqlen_new, kv_heads, head_dim)"}
    for name, t in tensors.items():
        if t.dim() != 4:
            kind = layouts[name.replace("v", "k")]
            raise ValueError(f"{op}: {name} must be a 4-D tensor {kind}, got shape "
                             f"{_shape(t)}")
    check_cache_aliasing(op, k_cache, v_cache, k, v, aliasing)
    compute = check_dtypes(op, tensors, k_descale, v_descale, q_descale, out_dtype)
    index = {"cache_seqlens": cache_seqlens, "cache_batch_idx": cache_batch_idx,
             "block_table": block_table, "cache_leftpad": cache_leftpad,
             "alibi_slopes": None if mods is None else mods.alibi_slopes,
             "sinks": None if mods is None else mods.sinks, "rotary_cos": rotary_cos,
             "rotary_sin": rotary_sin, "k_descale": k_descale, "v_descale": v_descale,
             "q_descale": q_descale}
    devices = {n: t.device for n, t in {**tensors, **index}.items() if t is not None}
    if len(set(devices.values())) != 1:
        got = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"{op}: all tensors must be on one device, got {got}")
    check_device(op, q.device)

    B, S_q, H, D = q.shape
    caches = f"q {_shape(q)}, k_cache {_shape(k_cache)}, v_cache {_shape(v_cache)}"
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"{op}: k_cache and v_cache must agree in their first three dims "
                         f"(blocks or batch, positions, kv_heads), got {caches}")
    H_kv, DV = k_cache.shape[2], v_cache.shape[3]
    if k_cache.shape[3] != D:
        raise ValueError(f"{op}: q and k_cache must have the same head dim (dim 3), got "
                         f"{caches}")
    _check_heads(op, H, H_kv, D, DV, caches, mla=True)
    if is_mla(k_cache, v_cache):
        check_latent_options(op, mods, k_cache, rotary_cos, k_descale, v_descale, q_descale)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.size(-1) > 1 and cache.stride(-1) != 1:
            raise ValueError(
                f"{op}: {name} must have unit stride in its last dim (it is written in "
                f"place, so it cannot be copied), got strides {cache.stride()}")

    paged = block_table is not None
    if paged:
        _check_block_table(op, block_table, B, k_cache, caches)
        if cache_batch_idx is not None:
            raise ValueError(f"{op}: cache_batch_idx selects rows of a dense cache; with a "
                             f"block_table (paged cache) map the sequences' pages instead")
        if cache_leftpad is not None:
            raise ValueError(f"{op}: cache_leftpad is not supported with a block_table "
                             f"(paged cache), as in flash-attn; start each sequence at the "
                             f"first row of its first page")
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        if cache_batch_idx is not None:
            if (cache_batch_idx.dim() != 1 or cache_batch_idx.dtype != torch.int32
                    or cache_batch_idx.shape[0] != B):
                raise ValueError(
                    f"{op}: cache_batch_idx must be a 1-D int32 tensor of {B} cache rows "
                    f"(one per sequence of q), got {cache_batch_idx.dtype} of shape "
                    f"{_shape(cache_batch_idx)}")
        elif k_cache.shape[0] < B:
            raise ValueError(
                f"{op}: the dense cache has {k_cache.shape[0]} rows (dim 0) for a batch of "
                f"{B} sequences: sequence b uses row b; pass cache_batch_idx to pick rows, or "
                f"a larger cache ({caches})")
        capacity = k_cache.shape[1]
        if cache_leftpad is not None and (cache_leftpad.dim() != 1
                                          or cache_leftpad.dtype != torch.int32
                                          or cache_leftpad.shape[0] != B):
            raise ValueError(
                f"{op}: cache_leftpad must be a 1-D int32 tensor of {B} start rows (one per "
                f"sequence: its keys are rows cache_leftpad[b] .. cache_seqlens[b] + S_new - "
                f"1), got {cache_leftpad.dtype} of shape {_shape(cache_leftpad)}")
    if (cache_seqlens.dim() != 1 or cache_seqlens.dtype != torch.int32
            or cache_seqlens.shape[0] != B):
        raise ValueError(
            f"{op}: cache_seqlens must be a 1-D int32 tensor of {B} lengths (one per "
            f"sequence; or a Python int for all), got {cache_seqlens.dtype} of shape "
            f"{_shape(cache_seqlens)}")

    if k is not None:
        S_new = k.shape[1]
        new = f"k {_shape(k)}, v {'None' if v is None else _shape(v)}"
        v_shape = (B, S_new, H_kv, DV) if v is None else _shape(v)
        if _shape(k) != (B, S_new, H_kv, D) or v_shape != (B, S_new, H_kv, DV):
            raise ValueError(
                f"{op}: k and v must be (batch, seqlen_new, kv_heads, head_dim) = ({B}, "
                f"S_new, {H_kv}, {D}) and ({B}, S_new, {H_kv}, {DV}) to match q and the "
                f"caches, got {new} ({caches})")
        if S_new > capacity:
            raise ValueError(
                f"{op}: {S_new} new keys do not fit a cache of {capacity} positions per "
                f"sequence ({new}, {caches}); allocate a larger cache")

    check_rotary(op, q, k, rotary_cos, rotary_sin, capacity, compute)
    for name, descale in (("k_descale", k_descale), ("v_descale", v_descale),
                          ("q_descale", q_descale)):
        check_descale(op, name, descale, B, H_kv, q.device)
    check_scale(op, scale)
    if not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"{op}: num_splits must be 0 (chosen from the GPU and the shapes) "
                         f"or from 1 to {MAX_NUM_SPLITS}, got {num_splits}")
    if mods is not None and not mods.is_plain:
        check_modifiers(q, mods, op, B, S_q, capacity, H)


def compute_dtype(q: torch.Tensor, out_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The dtype the kernels compute in and write out in: q's, or out_dtype (None:
    bfloat16) for fp8 queries, which are converted to it (exactly) first."""
    if q.dtype == FP8_CACHE_DTYPE:
        return out_dtype or torch.bfloat16
    return q.dtype


def check_dtypes(op: str, tensors: dict, k_descale, v_descale, q_descale=None,
                 out_dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """``tensors`` (q, k_cache, v_cache and k, v where given) of one 16-bit or fp32 dtype;
    or float8_e4m3fn caches (both) with q and k, v of one 16-bit dtype, the only case that
    takes k_descale / v_descale; or float8_e4m3fn q (with q_descale) over such caches, k
    and v in out_dtype (16-bit; None: bfloat16). out_dtype only with fp8 q. Returns the
    dtype the kernels compute in (compute_dtype)."""
    q, k_cache, v_cache = tensors["q"], tensors["k_cache"], tensors["v_cache"]
    if q.dtype not in _FP8_DTYPES:
        check_fp8_arguments_need_fp8(op, q, "queries", q_descale=q_descale)
        if out_dtype is not None and out_dtype != q.dtype:
            raise ValueError(f"{op}: out_dtype sets the output's dtype of fp8 queries; {q.dtype}"
                             f" queries give outputs in {q.dtype}, got out_dtype {out_dtype}; "
                             f"drop out_dtype, or cast the output")
    elif q.dtype != FP8_CACHE_DTYPE:
        raise ValueError(f"{op}: fp8 queries must be {FP8_CACHE_DTYPE} (FlashAttention-3's "
                         f"format), got q {q.dtype}; quantize q to {FP8_CACHE_DTYPE}")
    elif k_cache.dtype != FP8_CACHE_DTYPE or v_cache.dtype != FP8_CACHE_DTYPE:
        raise ValueError(f"{op}: fp8 queries attend an fp8 ({FP8_CACHE_DTYPE}) cache only, got "
                         f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype}; pass 16-bit "
                         f"queries (q.to(dtype) * q_descale) over a 16-bit cache")
    else:
        check_fp8_out_dtype(op, out_dtype)
        compute = compute_dtype(q, out_dtype)
        new = {n: tensors[n].dtype for n in ("k", "v") if n in tensors}
        if any(d != compute for d in new.values()):
            got = ", ".join(f"{n} {d}" for n, d in new.items())
            raise ValueError(f"{op}: with fp8 queries the new keys and values must be in the "
                             f"output's dtype {compute} (out_dtype; they are quantized as they "
                             f"are appended), got {got}; cast k and v to {compute}, or pass "
                             f"out_dtype={new.get('k')}")
        return compute
    fp8 = [n for n in ("k_cache", "v_cache") if tensors[n].dtype in _FP8_DTYPES]
    other = [n for n in fp8 if tensors[n].dtype != FP8_CACHE_DTYPE]
    if other:
        raise ValueError(f"{op}: an fp8 cache must be {FP8_CACHE_DTYPE} (FlashAttention-3's "
                         f"format), got {other[0]} {tensors[other[0]].dtype}; quantize the "
                         f"cache to {FP8_CACHE_DTYPE}")
    if len(fp8) == 1:
        raise ValueError(f"{op}: k_cache and v_cache must both be {FP8_CACHE_DTYPE} or "
                         f"neither, got k_cache {k_cache.dtype} and v_cache {v_cache.dtype}")
    if not fp8:
        if k_descale is not None or v_descale is not None:
            given = " and ".join(n for n, d in (("k_descale", k_descale),
                                                ("v_descale", v_descale)) if d is not None)
            raise ValueError(f"{op}: {given} scale an fp8 ({FP8_CACHE_DTYPE}) cache, but "
                             f"the cache is {k_cache.dtype}; drop the descales, or pass "
                             f"{FP8_CACHE_DTYPE} caches")
        dtypes = {name: t.dtype for name, t in tensors.items()}
        if len(set(dtypes.values())) != 1:
            got = ", ".join(f"{n} {d}" for n, d in dtypes.items())
            raise ValueError(f"{op}: q, the caches and k, v must have the same dtype, got "
                             f"{got}; cast them to one of float16, bfloat16, float32")
        if q.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{op}: dtype {q.dtype} is not supported; use float16, bfloat16 "
                             f"or float32")
        return q.dtype
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{op}: an fp8 cache takes float16 or bfloat16 queries, got q "
                         f"{q.dtype}; cast q (and k, v) to one of them")
    new = {n: tensors[n].dtype for n in ("k", "v") if n in tensors}
    if any(d != q.dtype for d in new.values()):
        got = ", ".join(f"{n} {d}" for n, d in new.items())
        raise ValueError(f"{op}: with an fp8 cache the new keys and values must have q's dtype "
                         f"{q.dtype} (they are quantized as they are appended), got {got}; "
                         f"cast k and v to {q.dtype}")
    return q.dtype


def _check_heads(op: str, H, H_kv, D, DV, caches: str, mla: bool = False) -> None:
    """H a multiple of the cache's H_kv; the head dims (checks_mla.check_head_dims: MLA's
    too where ``mla``)."""
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(
            f"{op}: the number of query heads ({H}) must be a multiple of the cache's number "
            f"of key/value heads ({H_kv}) for grouped-query attention, got {caches}")
    check_head_dims(op, D, DV, caches, mla)


def _check_block_table(op: str, block_table, B, k_cache, caches: str) -> None:
    """block_table (B, max_blocks) int32; the cache's pages (dim 1) a power of two from 16 to
    256 keys."""
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.shape[0] != B:
        raise ValueError(
            f"{op}: block_table must be a 2-D int32 tensor (batch, max_blocks) = ({B}, "
            f"...) of page indices into the caches' first dim, got {block_table.dtype} of "
            f"shape {_shape(block_table)}")
    page = k_cache.shape[1]
    if page < 16 or page > 256 or page & (page - 1):
        raise ValueError(
            f"{op}: the paged cache's page size (k_cache dim 1) must be a power of two "
            f"from 16 to 256, got {page} ({caches})")


def check_paged_varlen_inputs(q, k_cache, v_cache, packing, scale: Optional[float], mods, *,
                              op: str = "flashop.attention_varlen") -> None:
    """Validate a paged prefill: packed q (total_q, H, D) with int32 cu_seqlens_q/k (batch
    + 1,) and the longest lengths, paged caches (num_blocks, page_size, H_kv, D / DV) with
    ``packing.block_table`` (batch, max_blocks) int32 of room for max_seqlen_k keys; scale
    and the modifiers (the operator takes no gate and no dropout)."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            f"{op}: with a block_table, q must be packed (total_q, heads, head_dim) and k, v "
            f"paged caches (num_blocks, page_size, kv_heads, head_dim), got q {_shape(q)}, k "
            f"{_shape(k_cache)}, v {_shape(v_cache)}")
    caches = f"q {_shape(q)}, k {_shape(k_cache)}, v {_shape(v_cache)}"
    tensors = dict(q=q, k=k_cache, v=v_cache, cu_seqlens_q=packing.cu_seqlens_q,
                   cu_seqlens_k=packing.cu_seqlens_k, block_table=packing.block_table,
                   alibi_slopes=mods.alibi_slopes, sinks=mods.sinks)
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"{op}: q, k and v must have the same dtype, got q {q.dtype}, k "
                         f"{k_cache.dtype}, v {v_cache.dtype}; cast them to one of float16, "
                         f"bfloat16, float32")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{op}: dtype {q.dtype} is not supported; use float16, bfloat16 or "
                         f"float32")
    devices = {n: t.device for n, t in tensors.items() if t is not None}
    if len(set(devices.values())) != 1:
        got = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"{op}: all tensors must be on one device, got {got}")
    check_device(op, q.device)
    H, D = q.shape[1], q.shape[2]
    H_kv, DV = k_cache.shape[2], v_cache.shape[3]
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != D:
        raise ValueError(f"{op}: k and v must be pages of one shape (num_blocks, page_size, "
                         f"kv_heads) with q's head dim in k, got {caches}")
    _check_heads(op, H, H_kv, D, DV, caches)
    check_offsets(op, q, packing.cu_seqlens_q, packing.cu_seqlens_k, packing.max_seqlen_q,
                  packing.max_seqlen_k, None)
    B = packing.batch
    _check_block_table(op, packing.block_table, B, k_cache, caches)
    capacity = packing.block_table.shape[1] * k_cache.shape[1]
    if packing.max_seqlen_k > capacity:
        raise ValueError(
            f"{op}: max_seqlen_k = {packing.max_seqlen_k} keys do not fit the block table's "
            f"{packing.block_table.shape[1]} pages of {k_cache.shape[1]} ({capacity} keys per "
            f"sequence); give each sequence enough pages")
    check_scale(op, scale)
    if not mods.is_plain:
        check_modifiers(q, mods, op, B, packing.max_seqlen_q, packing.max_seqlen_k, H)


def check_rotary(op: str, q, k, rotary_cos, rotary_sin, capacity,
                 dtype: Optional[torch.dtype] = None) -> None:
    """rotary_cos and rotary_sin both or neither, with new keys to rotate; of one shape
    (seqlen_ro, rotary_dim / 2) with 2 <= rotary_dim <= D and a row for each of the cache's
    ``capacity`` positions; in q's dtype (as flash-attn takes them), or ``dtype``, the one
    the kernels compute in (fp8 queries: compute_dtype)."""
    if rotary_cos is None and rotary_sin is None:
        return
    if rotary_cos is None or rotary_sin is None:
        given = "rotary_cos" if rotary_sin is None else "rotary_sin"
        raise ValueError(f"{op}: pass both rotary_cos and rotary_sin or neither, got only "
                         f"{given}")
    if k is None:
        raise ValueError(
            f"{op}: rotary_cos/rotary_sin rotate q and the new keys as they are appended, "
            f"but no k, v were given (as in flash-attn); pass the new keys and values, or "
            f"rotate q before the call")
    D = q.shape[-1]
    shapes = f"rotary_cos {_shape(rotary_cos)}, rotary_sin {_shape(rotary_sin)}"
    if (rotary_cos.dim() != 2 or rotary_sin.shape != rotary_cos.shape
            or not 1 <= rotary_cos.shape[1] <= D // 2):
        raise ValueError(
            f"{op}: rotary_cos and rotary_sin must be 2-D of one shape (seqlen_ro, "
            f"rotary_dim / 2) with 2 <= rotary_dim <= head_dim = {D}, got {shapes}")
    if rotary_cos.shape[0] < capacity:
        raise ValueError(
            f"{op}: rotary_cos and rotary_sin need a row for each of the cache's {capacity} "
            f"positions (dim 0 at least {capacity}), got {shapes}")
    dtype = dtype or q.dtype
    if rotary_cos.dtype != dtype or rotary_sin.dtype != dtype:
        whose = "q's dtype" if dtype == q.dtype else "the output's dtype (out_dtype)"
        raise ValueError(
            f"{op}: rotary_cos and rotary_sin must have {whose} {dtype} (as in "
            f"flash-attn), got {rotary_cos.dtype} and {rotary_sin.dtype}")


def check_no_grad(op: str, **tensors) -> None:
    """The cache kernels have no backward: inputs requiring grad (grad mode on) are refused."""
    if not torch.is_grad_enabled():
        return
    needing = [n for n, t in tensors.items() if t is not None and t.requires_grad]
    if needing:
        raise RuntimeError(
            f"{op}: is for inference and has no backward, but {', '.join(needing)} "
            f"require(s) grad; call it under torch.no_grad() / torch.inference_mode(), or "
            f"detach the inputs (for training use flashop.attention)")
