"""Public Python API: the documented calls of the ``torch.ops.flashop`` operators.

Each function checks its window, then runs the operator of its name: the operator's body
directly for an eager call of plain tensors (flashop/_ops/eager.py), else the composite
operator's body, which traces into the same operators (``torch.ops.flashop.<name>`` gets the
same checks, messages and results). The functions take the window as FlashAttention's
``window_size=(left, right)`` pair; the operators take its two ints.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from flashop._ops import eager
from flashop._ops.checks import check_fp8_arguments_need_fp8, window_bounds
from flashop._ops.checks_kvcache import check_no_grad


def _options(op: str, causal, scale, window_size, softcap, attention_chunk=0, **more) -> dict:
    """The operators' keyword options of the API's arguments."""
    left, right = window_bounds(op, window_size)
    return dict(causal=causal, scale=scale, window_size_left=left, window_size_right=right,
                attention_chunk=attention_chunk, softcap=softcap, **more)


def _takes_fp8(op: str, q: Tensor, descales: tuple, out_dtype, attn_mask=None, g=None,
               dropout_p: float = 0.0, block_table=None) -> bool:
    """Whether the call runs the fp8 operator (flashop/_ops/attention_fp8.py): e4m3 inputs.
    The fp8 arguments with other inputs, or what the fp8 forward does not take, raise."""
    if q.dtype != torch.float8_e4m3fn:
        q_descale, k_descale, v_descale = descales
        if not (out_dtype is q_descale is k_descale is v_descale is None):
            check_fp8_arguments_need_fp8(op, q, "q, k, v", **dict(zip(
                ("q_descale", "k_descale", "v_descale"), descales)), out_dtype=out_dtype)
        return False
    refused = [what for what, there in (
        ("attn_mask", attn_mask is not None), ("the gate g", g is not None),
        ("dropout_p", dropout_p != 0), ("block_table", block_table is not None)) if there]
    if refused:
        refused = [f"dropout_p={dropout_p}" if what == "dropout_p" else what for what in refused]
        raise ValueError(
            f"{op}: {', '.join(refused)} is not supported with float8_e4m3fn inputs (the fp8 "
            f"forward takes causal, window_size, attention_chunk, softcap, alibi_slopes, sinks, "
            f"grouped-query heads and packed batches); run this call on 16-bit inputs")
    return True


def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
              alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None,
              sinks: Optional[Tensor] = None, *, causal: bool = False,
              scale: Optional[float] = None, window_size: Sequence[int] = (-1, -1),
              attention_chunk: int = 0, softcap: float = 0.0, dropout_p: float = 0.0,
              deterministic: bool = False, q_descale: Optional[Tensor] = None,
              k_descale: Optional[Tensor] = None, v_descale: Optional[Tensor] = None,
              out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """Scaled dot-product attention, FlashAttention-2 style; differentiable (but in fp8).

    Args:
        q: (B, S_q, H, D) queries.
        k: (B, S_k, H_kv, D) keys; ``H % H_kv == 0`` (grouped-query attention: query head
            ``h`` uses key/value head ``h // (H // H_kv)``).
        v: (B, S_k, H_kv, DV) values.
        attn_mask: as SDPA's: a boolean keep-mask (True = attend) or an additive float bias
            (float32 or the inputs' dtype; may hold -inf; gets its gradient when it
            requires grad), broadcastable to (B, H, S_q, S_k).
        alibi_slopes: (H,) or (B, H) float32: adds ``-slope * |i + S_k - S_q - j|``
            (FlashAttention's convention). No gradient.
        g: (B, S_k, H) log-decay gate (flash-linear-attention's ``g``; float32 or the
            inputs' dtype): adds ``G[i + S_k - S_q] - G[j]`` with ``G = cumsum(g, dim=1)``.
            Needs ``causal=True``. Differentiable.
        causal: mask keys after each query, aligned to the bottom-right corner: query ``i``
            attends key ``j`` iff ``j <= i + S_k - S_q``.
        scale: multiplies ``q . k``; default ``1 / sqrt(D)``.
        window_size: ``(left, right)``: query ``i`` attends keys ``j`` with
            ``i + S_k - S_q - left <= j <= i + S_k - S_q + right``; -1 leaves that side
            unbounded. Key tiles outside the window are skipped.
        attention_chunk: chunked attention (FlashAttention-3's ``attention_chunk``, Llama 4's
            local layers): if > 0, query ``i`` attends only the keys of its chunk of
            ``attention_chunk`` positions, ``j // attention_chunk == p // attention_chunk``
            with ``p = i + S_k - S_q`` (a query before key 0 attends none), within the
            window and causal bounds: with ``causal=True``, keys ``(p // C) * C <= j <= p``;
            without, the whole chunk on both sides. Key tiles outside the chunk are
            skipped. 0 (the default) turns it off.
        softcap: if > 0, scores become ``softcap * tanh(score / softcap)`` (after scaling,
            before the additive terms and masks).
        sinks: (H,) attention sinks (gpt-oss; transformers' ``s_aux``), float32 or the
            inputs' dtype: head ``h``'s logit ``sinks[h]`` joins every query's softmax
            denominator and attends nothing. Differentiable.
        dropout_p: dropout on the attention probabilities (as SDPA's and FlashAttention's):
            each is zeroed with probability ``dropout_p`` and the rest scaled by
            ``1 / (1 - dropout_p)``; the mask comes from torch's generator of q's device
            (``torch.manual_seed`` reproduces it). Pass 0 (the default) in evaluation.
        deterministic: make the backward bitwise reproducible (dQ summed in a fixed order),
            as ``torch.use_deterministic_algorithms(True)`` does for every call. By default
            the fastest backward runs, which may add dQ by fp32 atomics (run to run, the
            gradients may then differ in their last bits).
        q_descale, k_descale, v_descale: with ``float8_e4m3fn`` q, k, v (fp8, forward
            only; docs/fp8.md): (B, H_kv) float32 factors, None for 1; query head ``h``
            of batch entry ``b`` is ``q * q_descale[b, h // (H // H_kv)]``, key/value head
            ``h_kv`` is ``k * k_descale[b, h_kv]`` (FlashAttention-3's scaling). fp8 calls
            take causal, window_size, attention_chunk, softcap, alibi_slopes and sinks
            (fp32), not attn_mask, g or dropout; a backward through them raises.
        out_dtype: the output's dtype of an fp8 call: torch.bfloat16 (None) or
            torch.float16.

    Queries that attend no key (all masked) get output 0. docs/modifiers.md has the exact
    formula and the order in which the modifiers apply.

    Returns:
        (B, S_q, H, DV) tensor in the inputs' dtype (float16, bfloat16 or float32; fp8
        inputs: ``out_dtype``). Any strides are accepted; only a non-unit stride in the
        last dimension causes a copy.
    """
    return attention_with_lse(q, k, v, attn_mask, alibi_slopes, g, sinks, causal=causal,
                              scale=scale, window_size=window_size,
                              attention_chunk=attention_chunk, softcap=softcap,
                              dropout_p=dropout_p, deterministic=deterministic,
                              q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                              out_dtype=out_dtype)[0]


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                       alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None,
                       sinks: Optional[Tensor] = None, *, causal: bool = False,
                       scale: Optional[float] = None, window_size: Sequence[int] = (-1, -1),
                       attention_chunk: int = 0, softcap: float = 0.0, dropout_p: float = 0.0,
                       deterministic: bool = False, q_descale: Optional[Tensor] = None,
                       k_descale: Optional[Tensor] = None, v_descale: Optional[Tensor] = None,
                       out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """As :func:`attention`, also returning the log-sum-exp of the scores.

    Returns:
        ``(out, lse)``: ``lse`` is (B, H, S_q) float32 in natural-log units,
        ``lse[b, h, i] = log(sum_j exp(score(i, j)))`` over the keys query ``i`` attends
        (``-inf`` where it attends none), plus ``exp(sinks[h])`` inside the log where
        there are sinks: the log of the softmax's denominator. Dropout leaves it
        unchanged. Both outputs are differentiable.
    """
    op = "flashop.attention"
    descales = (q_descale, k_descale, v_descale)
    if _takes_fp8(op, q, descales, out_dtype, attn_mask, g, dropout_p):
        return eager.attention_fp8(q, k, v, None, None, None, None, *descales, alibi_slopes,
                                   sinks, **_options(op, causal, scale, window_size, softcap,
                                                     attention_chunk, out_dtype=out_dtype))
    options = _options(op, causal, scale, window_size, softcap, attention_chunk,
                       dropout_p=dropout_p, deterministic=deterministic)
    return eager.attention(q, k, v, None, None, None, None, attn_mask, alibi_slopes, g, sinks,
                           **options)


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None,
                     sinks: Optional[Tensor] = None, *, causal: bool = False,
                     scale: Optional[float] = None, window_size: Sequence[int] = (-1, -1),
                     attention_chunk: int = 0, softcap: float = 0.0, dropout_p: float = 0.0,
                     deterministic: bool = False,
                     block_table: Optional[Tensor] = None, q_descale: Optional[Tensor] = None,
                     k_descale: Optional[Tensor] = None, v_descale: Optional[Tensor] = None,
                     out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """Attention over a packed batch of sequences of different lengths (FlashAttention's
    ``flash_attn_varlen_func`` layout); differentiable.

    Args:
        q: (total_q, H, D): the batch's query tokens, sequence after sequence.
        k, v: (total_k, H_kv, D) and (total_k, H_kv, DV).
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 cumulative offsets on q's device:
            sequence ``b`` is ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]``. They start at 0,
            never decrease (zero-length sequences are allowed), and end at total_q / total_k.
            They are not read on the host (no synchronization), so they are not checked.
        max_seqlen_q, max_seqlen_k: Python ints, the longest sequence's lengths (they size
            the grid; a smaller value leaves tokens unattended).
        alibi_slopes: (H,) or (batch, H); g: (total_k, H) log-decays (the cumulative sum
            restarts at each sequence); sinks (H,); causal, scale, window_size,
            attention_chunk, softcap, dropout_p, deterministic: as :func:`attention`,
            applied within each sequence, aligned to its own end (chunks counted from each
            sequence's first key).
        block_table: (batch, max_blocks) int32, paged prefill (flash-attn's
            ``flash_attn_varlen_func(..., block_table=...)``): k and v are then paged
            caches (num_blocks, page_size, H_kv, D / DV), page_size a power of two from 16
            to 256, and sequence b's ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` keys are its
            first keys in the pages ``block_table[b]`` (key ``j`` at row ``j % page_size``
            of page ``block_table[b, j // page_size]``): a cached prefix and the new tokens
            already written there. The forward kernel reads the pages in place (no gather).
            Forward only, as in flash-attn: no gate, no dropout, and a backward through the
            output raises.
        q_descale, k_descale, v_descale, out_dtype: fp8 inputs, as :func:`attention`'s;
            the descales are (batch, H_kv), one row per sequence.

    Returns:
        (total_q, H, DV) in the inputs' dtype. Packed batches from padded ones:
        :func:`flashop.unpad_input`.
    """
    return attention_varlen_with_lse(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, g,
        sinks, causal=causal, scale=scale, window_size=window_size,
        attention_chunk=attention_chunk, softcap=softcap, dropout_p=dropout_p,
        deterministic=deterministic, block_table=block_table,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype)[0]


def attention_varlen_with_lse(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                              cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                              alibi_slopes: Optional[Tensor] = None, g: Optional[Tensor] = None,
                              sinks: Optional[Tensor] = None, *, causal: bool = False,
                              scale: Optional[float] = None,
                              window_size: Sequence[int] = (-1, -1),
                              attention_chunk: int = 0, softcap: float = 0.0,
                              dropout_p: float = 0.0, deterministic: bool = False,
                              block_table: Optional[Tensor] = None,
                              q_descale: Optional[Tensor] = None,
                              k_descale: Optional[Tensor] = None,
                              v_descale: Optional[Tensor] = None,
                              out_dtype: Optional[torch.dtype] = None
                              ) -> tuple[Tensor, Tensor]:
    """As :func:`attention_varlen`, also returning lse, (H, total_q) float32 (FlashAttention's
    packed layout); both differentiable (without a block_table)."""
    op = "flashop.attention_varlen"
    options = _options(op, causal, scale, window_size, softcap, attention_chunk)
    descales = (q_descale, k_descale, v_descale)
    if _takes_fp8(op, q, descales, out_dtype, g=g, dropout_p=dropout_p,
                  block_table=block_table):
        return eager.attention_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, *descales, alibi_slopes, sinks,
                                   out_dtype=out_dtype, **options)
    if block_table is not None:
        if g is not None or dropout_p != 0:
            given = "the gate g" if g is not None else f"dropout_p={dropout_p}"
            raise ValueError(
                f"{op}: {given} is not supported with a block_table: attention over paged "
                f"keys and values is forward-only (as in flash-attn), for inference; pass k "
                f"and v packed (total_k, kv_heads, head_dim) for training")
        return eager.attention_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k, block_table, alibi_slopes, sinks,
                                            **options)
    return eager.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           None, alibi_slopes, g, sinks, dropout_p=dropout_p,
                           deterministic=deterministic, **options)


# --- attention over a key/value cache (decoding) --------------------------------------------


def attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                           k: Optional[Tensor] = None, v: Optional[Tensor] = None, *,
                           cache_seqlens, cache_batch_idx: Optional[Tensor] = None,
                           cache_leftpad: Optional[Tensor] = None,
                           block_table: Optional[Tensor] = None,
                           rotary_cos: Optional[Tensor] = None,
                           rotary_sin: Optional[Tensor] = None, rotary_interleaved: bool = True,
                           causal: bool = False, scale: Optional[float] = None,
                           window_size: Sequence[int] = (-1, -1), attention_chunk: int = 0,
                           softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                           sinks: Optional[Tensor] = None, num_splits: int = 0,
                           k_descale: Optional[Tensor] = None,
                           v_descale: Optional[Tensor] = None,
                           q_descale: Optional[Tensor] = None,
                           out_dtype: Optional[torch.dtype] = None, return_lse: bool = False):
    """Attention of new queries over a key/value cache, appending new keys and values to it
    first (FlashAttention's ``flash_attn_with_kvcache``); for inference (no gradient).

    Args:
        q: (B, S_q, H, D) queries, any S_q >= 1 (1 to decode one token; more for
            speculative decoding or chunked prefill). In the cache's dtype, or 16-bit over
            an fp8 cache, or ``torch.float8_e4m3fn`` over an fp8 cache (with
            ``q_descale``).
        k_cache, v_cache: the cache, either dense, (B_cache, S_cache, H_kv, D) and
            (B_cache, S_cache, H_kv, DV), or paged, (num_blocks, page_size, H_kv, D / DV)
            with ``block_table``; page_size a power of two from 16 to 256. Unit stride in
            the last dim. Written in place where ``k``, ``v`` are given. float16, bfloat16 or
            float32 as q; or ``torch.float8_e4m3fn`` (both) with 16-bit q, an fp8 cache
            whose real values are ``k_cache * k_descale[b, h]`` and ``v_cache *
            v_descale[b, h]`` (FlashAttention-3's; docs/decoding.md, "fp8 cache").
            MLA's latent cache (DeepSeek-V2/V3, Kimi K2): k_cache of head dim 576 (512
            latent + 64 rotary) and ``v_cache = k_cache[..., :512]``, a view of the one
            cache; q then has head dim 576 and out 512 (docs/decoding.md, "MLA"). A
            v_cache sharing k_cache's memory must be such a view (its leading columns).
        k, v: (B, S_new, H_kv, D / DV) new keys and values, or None. They are written into
            the cache at positions ``cache_seqlens[b] .. cache_seqlens[b] + S_new - 1`` of
            each sequence before attending; nothing else in the caches changes. Positions
            at or past the cache's capacity are dropped (docs/decoding.md). At MLA's head
            dims v may be None (the values are k[..., :512]); where v_cache is
            k_cache[..., :512], v must be None or ``k[..., :512]`` and each row is written
            once.
        cache_seqlens: (B,) int32 tensor on q's device (or a Python int for all): each
            sequence's cached length before the append. Not advanced here: add S_new to it
            for the next step.
        cache_batch_idx: (B,) int32: the dense cache's row of each sequence (default row b).
        cache_leftpad: (B,) int32, dense caches only: sequence b's keys start at row
            ``cache_leftpad[b]`` of its cache row (rows before it are left padding, never
            attended); it attends rows ``cache_leftpad[b] .. cache_seqlens[b] + S_new - 1``,
            ``L = cache_seqlens[b] + S_new - cache_leftpad[b]`` keys (flash-attn's).
        block_table: (B, max_blocks) int32: sequence b's key ``j`` is in page
            ``block_table[b, j // page_size]`` at row ``j % page_size``.
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2) in q's dtype, seqlen_ro at least
            the cache's capacity; with ``k``, ``v`` only. The rotary embedding of the first
            rotary_dim dims is applied inside the kernels, as flash-attn's
            ``flash_attn_with_kvcache`` applies it: new key ``s`` rotated at position
            ``cache_seqlens[b] + s`` before it is written, query ``i`` at
            ``cache_seqlens[b] + i`` where causal, a window bound (below the capacity) or a
            chunk is set, else every query at ``cache_seqlens[b]``.
        rotary_interleaved: pairs dims (0, 1), (2, 3), ... (GPT-J) where True, else
            (0, rotary_dim / 2), (1, rotary_dim / 2 + 1), ... (GPT-NeoX, Llama).
        causal: bottom-right aligned over the sequence's ``L = cache_seqlens[b] + S_new``
            keys: query ``i`` attends key ``j`` iff ``j <= i + L - S_q``.
        scale, window_size, attention_chunk, softcap, alibi_slopes: as :func:`attention`,
            with ``S_k = L`` per sequence (ALiBi distance ``|i + L - S_q - j|``; chunks
            counted from the sequence's first key, after ``cache_leftpad``). ``scale``
            defaults to 1/sqrt(576) over an MLA cache, as FlashMLA's; MLA takes causal,
            scale, num_splits, cache_batch_idx and cache_leftpad, and refuses the other
            options by name.
        sinks: (H,) attention sinks, float32 or q's dtype, as :func:`attention`: head
            ``h``'s logit joins every query's softmax once (however many splits), and lse
            includes it.
        k_descale, v_descale: (B, H_kv) float32 on q's device, fp8 caches only (None: 1):
            sequence b's key/value head h of the cache holds its real keys divided by
            ``k_descale[b, h]`` (values by ``v_descale[b, h]``). New keys and values (q's
            dtype) are written as ``k / k_descale`` rounded to e4m3 (to nearest, ties to
            even, saturating at +-448); attention reads the cache times the descales.
        q_descale: (B, H_kv) float32, fp8 queries only (None: 1): query head h of sequence b
            is ``q * q_descale[b, h // (H // H_kv)]`` (FlashAttention-3's). fp8 queries are
            converted to ``out_dtype`` (exactly) before the kernels, and q_descale is folded
            into the scores' scale.
        out_dtype: the output's dtype with fp8 queries, torch.bfloat16 (None) or
            torch.float16; the new keys and values and the rotary tables are then in it.
        num_splits: how many programs share each sequence's keys (split-KV, "flash
            decoding"); 0 chooses from the GPU's size, the batch, H_kv and the cache's
            capacity, or the keys a chunk holds (never from the lengths, so a call needs
            no host synchronization).
        return_lse: also return lse.

    Sequence b attends its first ``cache_seqlens[b] + S_new`` keys; a sequence with no key
    (an empty cache and nothing appended) gets output 0 and lse -inf (lse = sink with
    sinks). The lengths, ``cache_batch_idx`` and ``block_table`` are not checked on the
    host (that would synchronize): docs/decoding.md says what happens with values out of
    range.

    Returns:
        out (B, S_q, H, DV) in q's dtype (fp8 queries: ``out_dtype``); with
        ``return_lse``, ``(out, lse)`` with lse (B, H, S_q) float32, natural log.
    """
    check_no_grad("flashop.attention_with_kvcache", q=q, k_cache=k_cache, v_cache=v_cache,
                  k=k, v=v, alibi_slopes=alibi_slopes, sinks=sinks, rotary_cos=rotary_cos,
                  rotary_sin=rotary_sin, k_descale=k_descale, v_descale=v_descale,
                  q_descale=q_descale)
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32,
                                   device=q.device)
    options = _options("flashop.attention_with_kvcache", causal, scale, window_size, softcap,
                       attention_chunk)
    out, lse = eager.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens, k, v, cache_batch_idx, block_table, alibi_slopes,
        sinks, rotary_cos, rotary_sin, cache_leftpad, k_descale, v_descale, q_descale,
        num_splits=num_splits, rotary_interleaved=rotary_interleaved, out_dtype=out_dtype,
        **options)
    return (out, lse) if return_lse else out
