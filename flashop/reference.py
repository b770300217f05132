"""Plain PyTorch attention with flashop's signature and conventions, for checking and for
machines without a GPU. It materialises the (S_q, S_k) scores: use it on small inputs."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from flashop._launch.options import round_dropout_p


def dequantize(x: Tensor, descale: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    """e4m3 ``x`` (B, S, H, D) in ``dtype`` times its descale (B, H_kv) (None: 1), head h
    taking ``descale[:, h // (H // H_kv)]`` (FlashAttention-3's scaling)."""
    x = x.to(dtype)
    if descale is None:
        return x
    group = x.shape[2] // descale.shape[1]
    return x * descale.to(dtype).repeat_interleave(group, dim=1)[:, None, :, None]


def fp8_attention_reference(q: Tensor, k: Tensor, v: Tensor, q_descale: Optional[Tensor] = None,
                            k_descale: Optional[Tensor] = None,
                            v_descale: Optional[Tensor] = None, *,
                            compute_dtype: Optional[torch.dtype] = torch.float64,
                            out_dtype: torch.dtype = torch.bfloat16,
                            **options) -> tuple[Tensor, Tensor]:
    """(out, lse) of e4m3 q, k, v with their descales (as flashop.attention's fp8 call;
    ``options`` as attention_reference's: alibi_slopes, sinks, causal, scale, window_size,
    softcap). ``compute_dtype`` float64 (or float32): the exact attention of the dequantized
    inputs. None: plain PyTorch in fp8, the accuracy rule's baseline: the dequantized inputs
    in fp32 (their products are exact there), the probabilities rounded to e4m3 for the
    product with v (p_e4m3), out rounded to ``out_dtype``."""
    dtype = torch.float32 if compute_dtype is None else compute_dtype
    out, lse = attention_reference(
        dequantize(q, q_descale, dtype), dequantize(k, k_descale, dtype),
        dequantize(v, v_descale, dtype), compute_dtype=dtype, p_e4m3=compute_dtype is None,
        **options)
    return (out.to(out_dtype), lse) if compute_dtype is None else (out, lse)


def keys_in_bounds(S_q: int, S_k: int, causal: bool, window_size: Sequence[int],
                   device=None, attention_chunk: int = 0) -> Tensor:
    """(S_q, S_k) bool: whether query i may attend key j under the causal, window and chunk
    bounds, aligned bottom-right: with p = i + S_k - S_q, ``p - left <= j <= p + right``
    (causal: right = 0; -1: no bound) and, where ``attention_chunk`` C > 0, ``j // C == p //
    C`` (floor division: a query before key 0 attends no key)."""
    i = torch.arange(S_q, device=device)[:, None] + (S_k - S_q)
    j = torch.arange(S_k, device=device)[None, :]
    left, right = window_size
    if causal:
        right = 0
    keep = torch.ones(S_q, S_k, dtype=torch.bool, device=device)
    if right >= 0:
        keep = keep & (j <= i + right)
    if left >= 0:
        keep = keep & (j >= i - left)
    if attention_chunk > 0:
        keep = keep & (torch.div(j, attention_chunk, rounding_mode="floor")
                       == torch.div(i, attention_chunk, rounding_mode="floor"))
    return keep


def attention_reference(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                        alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None,
                        sinks: Optional[Tensor] = None, *, causal: bool = False,
                        scale: Optional[float] = None, window_size: Sequence[int] = (-1, -1),
                        attention_chunk: int = 0, softcap: float = 0.0, dropout_p: float = 0.0,
                        dropout_mask: Optional[Tensor] = None,
                        compute_dtype: Optional[torch.dtype] = torch.float32,
                        p_e4m3: bool = False) -> tuple[Tensor, Tensor]:
    """(out, lse) of attention with flashop's modifiers, computed in ``compute_dtype``.
    ``None``: as plain PyTorch in the inputs' dtype, the baseline of flashop's accuracy rule
    (flashop.testing): q, k, v, their products and the softmax in q's dtype, the modifiers'
    terms (ALiBi's distances, the gate's cumulative sum, a float ``attn_mask``, the sinks)
    in fp32 at least, as users hold them, each row's scores rounded to q's dtype once
    they are summed. ``p_e4m3``: the probabilities go to the product with v rounded to
    float8_e4m3fn, each row scaled so that its largest is 448 (e4m3's), as an fp8 P V
    product takes them (plain PyTorch's fp8 attention: see fp8_attention_reference).

    Layout as ``flashop.attention``: q (B, S_q, H, D), k (B, S_k, H_kv, D), v (B, S_k, H_kv,
    DV); out (B, S_q, H, DV) and lse (B, H, S_q), both in ``compute_dtype``. The score of
    query i and key j (docs/modifiers.md), with ``off = S_k - S_q``:

        s = scale * q_i . k_j;  s = softcap * tanh(s / softcap)  (softcap > 0)
        s += -slope_h * |i + off - j|  (alibi_slopes)  +  G[i + off] - G[j]  (g; G = cumsum)
          +  attn_mask[i, j]  (float)
        masked (-inf) unless  i + off - left <= j <= i + off + right  (window_size; causal:
        right = 0; -1: no bound),  j // C == (i + off) // C  (attention_chunk C > 0; floor
        division)  and  attn_mask[i, j]  (bool)

    ``sinks`` (H,): head h's logit joins every row's softmax as one more score that attends
    nothing: ``P = exp(s - lse)`` with ``lse = log(sum_j exp(s_j) + exp(sinks[h]))``.
    ``dropout_p`` > 0 needs ``dropout_mask``, a boolean keep-mask broadcastable to (B, H,
    S_q, S_k) (flashop.testing.dropout_mask gives the kernels' for a seed): out = (P *
    keep / (1 - p)) V, lse unchanged, with p = dropout_p rounded to a multiple of 2**-16
    as the ops round it (_launch.options.round_dropout_p).

    A query whose keys are all masked gets out 0 and lse -inf (lse = sink with sinks).
    Differentiable in q, k, v, g, a float attn_mask and sinks.
    """
    dtype = q.dtype if compute_dtype is None else compute_dtype
    # the modifiers' terms: fp32 at least (a 16-bit modifier is cast exactly)
    mdtype = torch.promote_types(dtype, torch.float32)
    B, S_q, H, D = q.shape
    S_k, H_kv = k.shape[1], k.shape[2]
    group = H // H_kv
    scale = D ** -0.5 if scale is None else scale
    qf = q.to(dtype).transpose(1, 2)  # (B, H, S_q, D)
    kf = k.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    vf = v.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # (B, H, S_q, S_k)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.to(mdtype)
    i = torch.arange(S_q, device=q.device)[:, None] + (S_k - S_q)  # query positions
    j = torch.arange(S_k, device=q.device)[None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(mdtype).reshape(-1, H, 1, 1)  # (1 or B, H, 1, 1)
        s = s - slopes * (i - j).abs().to(mdtype)
    if g is not None:
        G = torch.cumsum(g.to(mdtype), dim=1).transpose(1, 2)  # (B, H, S_k)
        # queries before position 0 (S_q > S_k) attend nothing under causal: G_q = 0 there
        pad = max(S_q - S_k, 0)
        G_q = torch.nn.functional.pad(G, (pad, 0))[..., S_k + pad - S_q:]
        s = s + G_q[..., :, None] - G[..., None, :]
    keep = keys_in_bounds(S_q, S_k, causal, window_size, q.device, attention_chunk).expand(
        B, H, S_q, S_k)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = keep & attn_mask
        else:
            bias = attn_mask.to(mdtype)
            s = s + bias
            keep = keep & (bias != float("-inf"))
    if sinks is not None:
        # the sink as one more key, kept in every row, whose value is zero
        sink = sinks.to(mdtype).reshape(1, H, 1, 1).expand(B, H, S_q, 1)
        s = torch.cat([s.expand(B, H, S_q, S_k), sink], dim=-1)
        keep = torch.cat([keep, keep.new_ones(B, H, S_q, 1)], dim=-1)
        vf = torch.cat([vf, vf.new_zeros(B, H, 1, vf.shape[-1])], dim=-2)
    empty = ~keep.any(-1, keepdim=True)  # rows that attend nothing
    # softmax over the row's own keys; empty rows get a softmax of zeros that is then zeroed,
    # so no NaN appears in the forward or the backward
    s = s.masked_fill(~keep, float("-inf")).masked_fill(empty, 0.0).to(dtype)
    p = torch.softmax(s, dim=-1).masked_fill(~keep, 0.0)
    if p_e4m3 and p.numel():
        top = p.amax(-1, keepdim=True)
        top = torch.where(top > 0, top, 1.0) / 448
        p = (p / top).to(torch.float8_e4m3fn).to(dtype) * top
    if dropout_p > 0:
        if dropout_mask is None:
            raise ValueError("attention_reference: dropout_p > 0 needs the dropout_mask")
        drop = dropout_mask.expand(B, H, S_q, S_k)
        if sinks is not None:
            drop = torch.cat([drop, drop.new_ones(B, H, S_q, 1)], dim=-1)
        p = p * drop.to(dtype) / (1 - round_dropout_p(dropout_p))
    out = torch.matmul(p, vf).transpose(1, 2)
    lse = torch.logsumexp(s, dim=-1).masked_fill(empty.squeeze(-1), float("-inf"))
    return out, lse


def attention_varlen_reference(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                               cu_seqlens_k: Tensor, max_seqlen_q: int = 0,
                               max_seqlen_k: int = 0, alibi_slopes: Optional[Tensor] = None,
                               g: Optional[Tensor] = None, sinks: Optional[Tensor] = None, *,
                               dropout_mask: Optional[Tensor] = None,
                               compute_dtype: Optional[torch.dtype] = torch.float32,
                               **options) -> tuple[Tensor, Tensor]:
    """:func:`attention_reference` applied to each sequence of a packed batch (q (total_q,
    H, D), k/v (total_k, H_kv, .), g (total_k, H), sinks (H,)): out (total_q, H, DV) and
    lse (H, total_q). The max_seqlen arguments are accepted for the op's signature and
    unused. ``dropout_mask`` (batch, H, >= longest S_q, >= longest S_k): sequence b's keep
    mask is its [b, :, :len_q, :len_k]."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        mask = None
        if dropout_mask is not None:
            mask = dropout_mask[b:b + 1, :, :cu_q[b + 1] - cu_q[b], :cu_k[b + 1] - cu_k[b]]
        o, l = attention_reference(
            q[None, qs], k[None, ks], v[None, ks], None, slopes,
            None if g is None else g[None, ks], sinks, dropout_mask=mask,
            compute_dtype=compute_dtype, **options)
        outs.append(o[0])
        lses.append(l[0])
    dtype = q.dtype if compute_dtype is None else compute_dtype
    if not outs:
        return (q.new_zeros(*q.shape[:2], v.shape[-1], dtype=dtype),
                q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=dtype))
    return torch.cat(outs), torch.cat(lses, dim=1)


# --- attention over a key/value cache (decoding) --------------------------------------------


def rotary(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor,
           interleaved: bool = True) -> Tensor:
    """``x`` (B, S, H, D) with the rotary embedding of flash-attn's rotary_cos / rotary_sin
    (seqlen_ro, rotary_dim / 2) applied at ``positions`` (B, S): dims below rotary_dim pair
    up, (2p, 2p + 1) where ``interleaved`` (GPT-J) else (p, p + rotary_dim / 2) (GPT-NeoX),
    and each pair (x1, x2) becomes (x1 cos - x2 sin, x1 sin + x2 cos) at cos, sin =
    cos[pos, p], sin[pos, p]; the other dims, and rows at positions outside 0 .. seqlen_ro
    - 1, are kept. Computed in fp32 for 16-bit inputs and fp64 for fp32 ones, where the
    products are exact, then rounded to x's dtype: the kernels' arithmetic
    (decode.rotate_rows), bit for bit."""
    wide = torch.float64 if x.dtype == torch.float32 else torch.float32
    half = cos.shape[1]
    inside = ((positions >= 0) & (positions < cos.shape[0]))[:, :, None, None]
    index = positions.clamp(0, cos.shape[0] - 1).long()
    c = cos.to(wide)[index][:, :, None, :]  # (B, S, 1, half)
    s = sin.to(wide)[index][:, :, None, :]
    xr = x[..., :2 * half].to(wide)
    x1, x2 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., :half], xr[..., half:])
    r1, r2 = x1 * c + x2 * -s, x1 * s + x2 * c
    rot = torch.stack((r1, r2), -1).flatten(-2) if interleaved else torch.cat((r1, r2), -1)
    rot = torch.where(inside, rot.to(x.dtype), x[..., :2 * half])
    return torch.cat((rot, x[..., 2 * half:]), -1)


def quantize_e4m3(x: Tensor, descale: Optional[Tensor]) -> Tensor:
    """``x`` (B, S, H_kv, .) as an fp8 cache holds it: ``x / descale[b, h]`` in fp32
    (``descale`` (B, H_kv); None: 1) rounded to float8_e4m3fn, to nearest with ties to even,
    saturating at +-448."""
    x = x.float()
    if descale is not None:
        x = x / descale[:, None, :, None]
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


def kvcache_append_reference(k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor],
                             v: Optional[Tensor], cache_seqlens: Tensor,
                             cache_batch_idx: Optional[Tensor] = None,
                             block_table: Optional[Tensor] = None,
                             rotary_cos: Optional[Tensor] = None,
                             rotary_sin: Optional[Tensor] = None,
                             rotary_interleaved: bool = True,
                             k_descale: Optional[Tensor] = None,
                             v_descale: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Copies of the caches with k, v (B, S_new, H_kv, .) written at positions
    ``cache_seqlens[b] + s`` of each sequence's slots (row ``cache_batch_idx[b]`` or ``b`` of a
    dense cache; pages ``block_table[b, pos // page_size]`` of a paged one), k rotated at
    those positions where ``rotary_cos``, ``rotary_sin`` are given (:func:`rotary`), then,
    into a float8_e4m3fn cache, quantized with the descales (:func:`quantize_e4m3`).
    Positions at or past the cache's capacity are dropped, as the kernel drops them. ``v``
    None with ``k``: the values are k's leading columns (MLA's latent cache,
    ``k[..., :DV]``)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    if k is None:
        return k_cache, v_cache
    if v is None:
        v = k[..., :v_cache.shape[-1]]
    if rotary_cos is not None:
        positions = cache_seqlens[:, None] + torch.arange(k.shape[1], device=k.device)
        k = rotary(k, rotary_cos, rotary_sin, positions, rotary_interleaved)
    if k_cache.dtype == torch.float8_e4m3fn:
        k, v = quantize_e4m3(k, k_descale), quantize_e4m3(v, v_descale)
    B, S_new = k.shape[:2]
    page = k_cache.shape[1]
    capacity = page * block_table.shape[1] if block_table is not None else page
    lengths = cache_seqlens.tolist()
    for b in range(B):
        for s in range(S_new):
            pos = lengths[b] + s
            if not 0 <= pos < capacity:
                continue
            if block_table is not None:
                slot = (int(block_table[b, pos // page]), pos % page)
            else:
                slot = (b if cache_batch_idx is None else int(cache_batch_idx[b]), pos)
            k_cache[slot] = k[b, s]
            v_cache[slot] = v[b, s]
    return k_cache, v_cache


def gather_kvcache(cache: Tensor, length: int, b: int, cache_batch_idx: Optional[Tensor] = None,
                   block_table: Optional[Tensor] = None, start: int = 0) -> Tensor:
    """Sequence ``b``'s first ``length`` cached positions (length, H_kv, .) in key order
    (of a dense cache: its positions ``start`` .. ``length - 1``)."""
    if block_table is None:
        row = b if cache_batch_idx is None else int(cache_batch_idx[b])
        return cache[row, start:length]
    page = cache.shape[1]
    pages = block_table[b, :-(-length // page)].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[:length]


def _dequantize(x: Tensor, descale: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    """An fp8 cache's (S, H_kv, .) keys or values times ``descale`` (H_kv,) (exact in
    fp64), rounded once to ``dtype``."""
    d = None if descale is None else descale[None]
    return dequantize(x[None], d, torch.float64)[0].to(dtype)


def attention_with_kvcache_reference(
        q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
        v: Optional[Tensor] = None, *, cache_seqlens, cache_batch_idx: Optional[Tensor] = None,
        cache_leftpad: Optional[Tensor] = None, block_table: Optional[Tensor] = None,
        rotary_cos: Optional[Tensor] = None, rotary_sin: Optional[Tensor] = None,
        rotary_interleaved: bool = True, causal: bool = False,
        scale: Optional[float] = None, window_size: Sequence[int] = (-1, -1),
        attention_chunk: int = 0, softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
        sinks: Optional[Tensor] = None, k_descale: Optional[Tensor] = None,
        v_descale: Optional[Tensor] = None, q_descale: Optional[Tensor] = None,
        out_dtype: Optional[torch.dtype] = None,
        compute_dtype: Optional[torch.dtype] = torch.float32) -> tuple[Tensor, Tensor]:
    """(out, lse) of ``flashop.attention_with_kvcache`` in plain PyTorch, leaving the caches
    unchanged: the append is applied to copies (:func:`kvcache_append_reference`), each
    sequence's ``L = cache_seqlens[b] + S_new`` keys are gathered (of a dense cache, from
    position ``cache_leftpad[b]``: L less that many), and :func:`attention_reference`
    attends over them (query i at key position i + L - S_q, as its bottom-right alignment
    puts it). With ``rotary_cos``, ``rotary_sin`` the new keys are rotated at their
    positions and the queries at ``cache_seqlens[b] + i`` where causal, a window bound
    below the capacity or a chunk is set, else all at ``cache_seqlens[b]`` (flash-attn's
    rule; :func:`rotary`). Chunks count positions from each sequence's first gathered key.
    out (B, S_q, H, DV) and lse (B, H, S_q) in ``compute_dtype``.
    ``sinks`` (H,) join each query's softmax as in attention_reference (a sequence with no
    key: out 0, lse = sink). A float8_e4m3fn cache is appended to as the kernel quantizes
    and each sequence's keys read as ``k_cache * k_descale[b, h]`` (values with
    ``v_descale``; None: 1), exactly, then rounded once to ``compute_dtype`` (or q's dtype).
    float8_e4m3fn q is read as ``q * q_descale[b, h // (H // H_kv)]`` likewise, its dtype
    (where ``compute_dtype`` is None) ``out_dtype`` (None: bfloat16).
    Every sequence must fit its cache (L <= capacity)."""
    B, S_q, H, D = q.shape
    if q.dtype == torch.float8_e4m3fn:
        dtype = out_dtype or torch.bfloat16
        q = dequantize(q, q_descale, torch.float64).to(compute_dtype or dtype)
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=q.device)
    k_cache, v_cache = kvcache_append_reference(k_cache, v_cache, k, v, cache_seqlens,
                                                cache_batch_idx, block_table, rotary_cos,
                                                rotary_sin, rotary_interleaved, k_descale,
                                                v_descale)
    S_new = 0 if k is None else k.shape[1]
    page = k_cache.shape[1]
    capacity = page * block_table.shape[1] if block_table is not None else page
    if rotary_cos is not None:
        per_query = (causal or any(0 <= w < capacity for w in window_size)
                     or attention_chunk > 0)
        offsets = torch.arange(S_q, device=q.device) if per_query else q.new_zeros(
            S_q, dtype=torch.long)
        q = rotary(q, rotary_cos, rotary_sin, cache_seqlens[:, None] + offsets,
                   rotary_interleaved)
    starts = [0] * B if cache_leftpad is None else cache_leftpad.tolist()
    outs, lses = [], []
    for b, cached in enumerate(cache_seqlens.tolist()):
        L = cached + S_new
        if L > capacity:
            raise ValueError(f"sequence {b}: {L} keys do not fit the cache's {capacity}")
        kb = gather_kvcache(k_cache, L, b, cache_batch_idx, block_table, starts[b])
        vb = gather_kvcache(v_cache, L, b, cache_batch_idx, block_table, starts[b])
        if k_cache.dtype == torch.float8_e4m3fn:
            dtype = q.dtype if compute_dtype is None else compute_dtype
            kb, vb = (_dequantize(x, None if d is None else d[b], dtype)
                      for x, d in ((kb, k_descale), (vb, v_descale)))
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        o, l = attention_reference(q[b:b + 1], kb[None], vb[None], None, slopes, None, sinks,
                                   causal=causal, scale=scale, window_size=window_size,
                                   attention_chunk=attention_chunk, softcap=softcap,
                                   compute_dtype=compute_dtype)
        outs.append(o)
        lses.append(l)
    dtype = q.dtype if compute_dtype is None else compute_dtype
    if not outs:
        return (q.new_zeros(0, S_q, H, v_cache.shape[-1], dtype=dtype),
                q.new_zeros(0, H, S_q, dtype=dtype))
    return torch.cat(outs), torch.cat(lses)
