"""Attention over a key/value cache (decoding): the append of new keys and values into the
cache, the split-KV ("flash decoding") attention kernel and the merge of its splits.

Vocabulary as in common.py, plus: ``L`` a sequence's keys (``cache_seqlens[b] + S_new``),
``capacity`` the keys its cache can hold (``S_cache``, or ``max_blocks * PAGE_SIZE`` for a
paged cache), ``PAGE_SIZE`` the keys of one page. A paged cache's key ``j`` of sequence
``b`` lives in page ``block_table[b, j // PAGE_SIZE]`` at row ``j % PAGE_SIZE``. A dense
cache's sequence may start at row ``cache_leftpad[b]`` (``HAS_LEFTPAD``): its key ``j`` is
row ``cache_leftpad[b] + j``.

Rotary embeddings (``ROTARY_DIM > 0``, flash-attn's ``rotary_cos``/``rotary_sin`` of shape
(seqlen_ro, ROTARY_DIM / 2)): the append rotates the new keys before writing them, the
attention kernel rotates the queries as it loads them (rotate_rows).

An fp8 cache (``FP8_CACHE``, float8_e4m3fn, with 16-bit queries and new keys) holds keys
whose real value is ``k_cache[...] * k_descale[b, h]`` (values likewise with
``v_descale``; a scale absent (``HAS_K_DESCALE`` / ``HAS_V_DESCALE`` unset) is 1): the append
writes ``new / descale`` rounded to e4m3 (ties to even, saturating at +-448); the attention
converts each fp8 tile to q's dtype (exact; bf16 queries are taken to fp16 times a power
of two, to_scaled_f16, and the tiles to fp16), folds ``k_descale[b, h]`` into the score scale
and multiplies each program's normalized output by ``v_descale[b, h]`` (once, before the
splits' merge, which only averages them).

Scores are in base-2 units inside the kernels; lse is written in natural-log units, except
the splits' partial lse (base 2), which only the merge reads.
"""

import triton
import triton.language as tl

from flashop.kernels.common import (
    LN2, LOG2E, attention_scores, dot_operand, key_range, load_tile, round_to, to_e4m3,
)
from flashop.kernels.decode_steps import (
    cache_bases, key_tile, normalized_rows, pv_step, query_rows, sequence_keys, softmax_step,
    split_run,
)


@triton.jit
def rotate_rows(b_x, p_x, m_rows, o_pos, rotary_cos, rotary_sin, stride_rs, seqlen_ro,
                BLOCK_D: tl.constexpr, ROTARY_DIM: tl.constexpr,
                ROTARY_INTERLEAVED: tl.constexpr):
    """The rows ``b_x`` [ROWS, BLOCK_D] (loaded from ``p_x[:, None] + d``) rotated at the
    positions ``o_pos`` [ROWS]: dims ``d < ROTARY_DIM`` pair up, (2p, 2p + 1) where
    ``ROTARY_INTERLEAVED`` (GPT-J), else (p, p + ROTARY_DIM / 2) (GPT-NeoX), and each pair
    (x1, x2) becomes (x1 cos - x2 sin, x1 sin + x2 cos) with cos, sin = rotary_cos[pos, p],
    rotary_sin[pos, p]; the other dims are kept. Positions at or past ``seqlen_ro`` are
    left unrotated (the checks make every cached position have a row).

    Products of 16-bit numbers are exact in fp32 and products of fp32 ones in fp64: computed
    in that width, the one rounding is the sum's (fused into an FMA or not), then the
    dtype's, so the result is the reference's bit for bit (flashop.reference.rotary)."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    o_d = tl.arange(0, BLOCK_D)
    m_rot = o_d < ROTARY_DIM
    if ROTARY_INTERLEAVED:
        o_pair = o_d // 2
        o_partner = o_d ^ 1
        first = o_d % 2 == 0
    else:
        first = o_d < HALF
        o_pair = tl.where(first, o_d, o_d - HALF)
        o_partner = tl.where(first, o_d + HALF, o_d - HALF)
    m = m_rows[:, None] & m_rot[None, :]
    b_partner = tl.load(p_x[:, None] + o_partner[None, :], mask=m, other=0.0)
    m_cs = m & (o_pos < seqlen_ro)[:, None]
    o_cs = o_pos[:, None].to(tl.int64) * stride_rs + o_pair[None, :]
    b_cos = tl.load(rotary_cos + o_cs, mask=m_cs, other=1.0).to(tl.float32)
    b_sin = tl.load(rotary_sin + o_cs, mask=m_cs, other=0.0).to(tl.float32)
    b_sin = tl.where(first[None, :], -b_sin, b_sin)
    if b_x.dtype == tl.float32:
        b_rot = (b_x.to(tl.float64) * b_cos.to(tl.float64)
                 + b_partner.to(tl.float64) * b_sin.to(tl.float64)).to(tl.float32)
    else:
        b_rot = round_to(b_x.to(tl.float32) * b_cos + b_partner.to(tl.float32) * b_sin,
                         b_x.dtype)
    return tl.where(m_rot[None, :], b_rot, b_x)


@triton.jit
def load_descale(descale, i_b, i_h, stride_db, HAS_DESCALE: tl.constexpr):
    """The fp32 scale ``descale[i_b, i_h]`` (row stride ``stride_db``, unit head stride),
    or 1 without one."""
    if HAS_DESCALE:
        return tl.load(descale + i_b * stride_db + i_h)
    return 1.0


@triton.jit
def to_scaled_f16(x):
    """The bf16 tile ``x`` times a power of two 2^e, in fp16, and 2^-e: e puts the tile's
    largest magnitude in [2^14, 2^15) (e at most 100), so the largest stays below fp16's
    65504 and every element above 2^-28 of it converts exactly (fp16 holds bf16's 8
    significant bits where it is normal). An inf or NaN element stays one."""
    b_x = x.to(tl.float32)
    b_max = tl.max(tl.max(tl.abs(b_x), 1), 0)
    e = tl.minimum(141 - ((b_max.to(tl.int32, bitcast=True) >> 23) & 0xFF), 100)
    unit = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - e) << 23).to(tl.float32, bitcast=True)
    return (b_x * unit).to(tl.float16), inverse


@triton.jit
def quantize_e4m3(b_x, ds, HAS_DESCALE: tl.constexpr):
    """``b_x / ds`` (fp32, correctly rounded) rounded to float8_e4m3fn: ties to even,
    saturating at +-448, the sign of a zero kept (to_e4m3)."""
    b_x = b_x.to(tl.float32)
    if HAS_DESCALE:
        b_x = tl.math.div_rn(b_x, tl.zeros_like(b_x) + ds)
    return to_e4m3(b_x)


@triton.jit
def kvcache_append_kernel(
    k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table, rotary_cos,
    rotary_sin, k_descale, v_descale,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    stride_tb, stride_rs, stride_kdb, stride_vdb,
    S_new, capacity, seqlen_ro,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr, PAGE_SIZE: tl.constexpr, IS_PAGED: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr, ROTARY_DIM: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr,
    FP8_CACHE: tl.constexpr, HAS_K_DESCALE: tl.constexpr, HAS_V_DESCALE: tl.constexpr,
):
    """k_cache[slot(b, cache_seqlens[b] + s), h] = k[b, s, h] (v likewise, unless DV = 0:
    the values are the keys' leading columns, v and v_cache None) for the BLOCK_S new
    tokens ``s`` of this program. Positions at or past ``capacity`` are dropped: nothing
    outside the named slots is written. ``slot`` is row ``cache_batch_idx[b]`` (or ``b``)
    of a dense cache, or the page ``block_table[b, pos // PAGE_SIZE]`` of a paged one.
    Where ``ROTARY_DIM > 0`` the keys are written rotated at their positions
    ``cache_seqlens[b] + s`` (rotate_rows). Where ``FP8_CACHE`` the (rotated) keys and the
    values are written quantized, ``k / k_descale[b, h]`` (quantize_e4m3).

    The cache offsets are computed here, not in a helper: torch <= 2.13's mutation analysis
    follows a helper's results to all of its arguments (see common.py)."""
    i_s = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    i_b = tl.program_id(2).to(tl.int64)
    o_s = i_s * BLOCK_S + tl.arange(0, BLOCK_S)
    o_pos = tl.load(cache_seqlens + i_b) + o_s
    m_s = (o_s < S_new) & (o_pos >= 0) & (o_pos < capacity)
    o_pos = tl.where(m_s, o_pos, 0)
    if IS_PAGED:
        i_page = tl.load(block_table + i_b * stride_tb + o_pos // PAGE_SIZE, mask=m_s,
                         other=0).to(tl.int64)
        o_row = o_pos % PAGE_SIZE
        o_kc = i_page * stride_kcb + o_row * stride_kcs
        o_vc = i_page * stride_vcb + o_row * stride_vcs
    else:
        i_row = i_b
        if HAS_BATCH_IDX:
            i_row = tl.load(cache_batch_idx + i_b).to(tl.int64)
        o_kc = i_row * stride_kcb + o_pos.to(tl.int64) * stride_kcs
        o_vc = i_row * stride_vcb + o_pos.to(tl.int64) * stride_vcs
    o_d = tl.arange(0, BLOCK_D)
    m_k = m_s[:, None] & (o_d[None, :] < D)
    # [BLOCK_S, BLOCK_D]
    p_k = k + i_b * stride_kb + i_h * stride_kh + o_s * stride_ks
    b_k = tl.load(p_k[:, None] + o_d[None, :], mask=m_k)
    if ROTARY_DIM > 0:
        b_k = rotate_rows(b_k, p_k, m_s, o_pos, rotary_cos, rotary_sin, stride_rs, seqlen_ro,
                          BLOCK_D, ROTARY_DIM, ROTARY_INTERLEAVED)
    if FP8_CACHE:
        b_k = quantize_e4m3(b_k, load_descale(k_descale, i_b, i_h, stride_kdb, HAS_K_DESCALE),
                            HAS_K_DESCALE)
    tl.store(k_cache + i_h * stride_kch + o_kc[:, None] + o_d[None, :], b_k, mask=m_k)
    if DV > 0:
        o_dv = tl.arange(0, BLOCK_DV)
        m_v = m_s[:, None] & (o_dv[None, :] < DV)
        # [BLOCK_S, BLOCK_DV]
        b_v = tl.load(v + i_b * stride_vb + i_h * stride_vh + o_s[:, None] * stride_vs
                      + o_dv[None, :], mask=m_v)
        if FP8_CACHE:
            b_v = quantize_e4m3(b_v, load_descale(v_descale, i_b, i_h, stride_vdb,
                                                  HAS_V_DESCALE), HAS_V_DESCALE)
        tl.store(v_cache + i_h * stride_vch + o_vc[:, None] + o_dv[None, :], b_v, mask=m_v)


@triton.jit
def _decode_key_tiles(
    acc, l_i, m_i, b_q, k_cache, v_cache, block_table, o_i, m_r, alibi2, start, end, L_read,
    L, S_q, stride_kcb, stride_kcs, stride_vcb, stride_vcs, qk_scale, softcap_log2, left,
    right, chunk, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    IS_PAGED: tl.constexpr, TILE_PAGE: tl.constexpr, EDGE_TILE: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    FP8_CACHE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold the key tiles in [start, end) (multiples of BLOCK_N from a multiple of BLOCK_N)
    into the running (acc, l_i, m_i) of the query rows. ``k_cache`` / ``v_cache`` point at
    this KV head (and, dense, this sequence's row); ``block_table`` at this sequence's
    pages: where ``TILE_PAGE`` (the tiles lie in one page) each tile's one page id is
    loaded, else each key's (a vector, which the pipeliner prefetches). ``EDGE_TILE`` tiles
    may reach past the ``L_read`` readable keys or cross the window / causal / chunk bounds; the
    others are inside for every row and skip that masking. Where ``FP8_CACHE`` each K and V
    tile is converted to the query tile's dtype (exact; the scales are the caller's)."""
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        o_n, m_n, o_kn, o_vn = key_tile(
            block_table, start_n, L_read, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
            BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, IS_PAGED=IS_PAGED, TILE_PAGE=TILE_PAGE,
            EDGE_TILE=EDGE_TILE)
        # K^T tile [BLOCK_D, BLOCK_N]
        b_kt = load_tile(k_cache + o_kn[None, :] + o_d[:, None], m_n[None, :],
                         o_d[:, None] < D, EDGE_TILE, BLOCK_D != D)
        if FP8_CACHE:
            b_kt = b_kt.to(b_q.dtype)
        # [ROWS, BLOCK_N]
        b_qk = tl.dot(b_q, dot_operand(b_kt, UPCAST), input_precision=DOT_PRECISION)
        b_s, _ = attention_scores(
            b_qk, qk_scale, o_i[:, None], o_n[None, :], m_r[:, None], m_n[None, :], S_q, L,
            left, right, chunk, softcap_log2, alibi2[:, None], 0.0, k_cache, 0, 0, EDGE_TILE,
            HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_SOFTCAP, HAS_ALIBI, False, 0, True)
        # V tile [BLOCK_N, BLOCK_DV]
        b_v = load_tile(v_cache + o_vn[:, None] + o_dv[None, :], m_n[:, None],
                        o_dv[None, :] < DV, EDGE_TILE, BLOCK_DV != DV)
        if FP8_CACHE:
            b_v = b_v.to(b_q.dtype)
        b_p, alpha, l_i, m_i = softmax_step(b_s, m_i, l_i, EDGE_TILE=EDGE_TILE)
        # [ROWS, BLOCK_DV]
        acc = pv_step(acc, alpha, round_to(b_p, b_v.dtype), b_v, UPCAST=UPCAST,
                      DOT_PRECISION=DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def attention_decode_kernel(
    q, k_cache, v_cache, o, lse, o_part, lse_part, cache_seqlens, cache_batch_idx,
    block_table, alibi, sinks, cache_leftpad, rotary_cos, rotary_sin, k_descale, v_descale,
    stride_qb, stride_qs, stride_qh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    stride_pp, stride_pb, stride_ps, stride_ph,
    stride_lpp, stride_lpb, stride_lph,
    stride_tb, stride_ab, stride_ah, stride_sh, stride_rs, stride_kdb, stride_vdb,
    S_q, S_new, capacity, G, qk_scale, softcap_log2, left, right, chunk, seqlen_ro,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    IS_PAGED: tl.constexpr, TILE_PAGE: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINK: tl.constexpr,
    SPLIT: tl.constexpr, ROTARY_DIM: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr,
    ROTARY_PER_QUERY: tl.constexpr, FP8_CACHE: tl.constexpr, HAS_K_DESCALE: tl.constexpr,
    HAS_V_DESCALE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Attention of q[b, i, h] over the first ``L = cache_seqlens[b] + S_new`` keys of
    sequence b's cache, query i at key position ``i + L - S_q``; grid (splits, H_kv *
    row tiles, B).

    A program's query tile is BLOCK_M rows ``r = i * G + g`` of the G query heads of one KV
    head (grouped-query heads packed: each key tile is read once for all of them) at S_q
    positions. The keys the tile attends (window / causal bounds; where ``HAS_CHUNK``, the
    chunk of ``chunk`` positions of each query, positions counted from the sequence's first
    key; at most ``capacity``) are
    cut into ``splits`` runs of whole key tiles, one per program; a run past the keys is
    empty. Where ``SPLIT``, each program writes its run's normalized output (fp32) to
    ``o_part`` [split, b, i, h] and its base-2 lse to ``lse_part`` [split, b, h, i] (-inf
    and 0 for an empty run); attention_decode_merge_kernel combines them. Else (one split)
    it writes ``o`` and the natural-log ``lse`` [b, h, i] directly. Rows that attend no key
    get 0 and -inf.

    Where ``HAS_SINK``, head h's logit ``sinks[h * stride_sh]`` joins each row's softmax
    once: split 0 alone starts its running max at the sink and its sum at 1 (as the dense
    forward does), so its partial output and lse include it and the merge counts it once.
    A row with no key then gets 0 and lse = sink.

    Where ``HAS_LEFTPAD`` (dense caches), sequence b's keys start at row
    ``cache_leftpad[b]`` of its cache row: ``L = cache_seqlens[b] + S_new -
    cache_leftpad[b]`` keys, of which those below ``capacity - cache_leftpad[b]`` are read.
    Where ``ROTARY_DIM > 0`` the queries are rotated as they are loaded (rotate_rows), query
    i at position ``cache_seqlens[b] + i`` where ``ROTARY_PER_QUERY``, else all at
    ``cache_seqlens[b]`` (flash-attn's rule), and rounded to q's dtype before the products.
    Where ``FP8_CACHE`` the tiles are read as q's dtype (fp16 for bf16 queries, which are
    scaled into fp16 by a power of two that the score scale takes back), ``k_descale[b, h]``
    scales the scores (with qk_scale) and ``v_descale[b, h]`` this program's normalized
    output, so the merge of the splits sees each output scaled once.

    The lengths are read here: the launch depends on shapes only, so it can be captured in a
    CUDA graph and compiled once for all lengths.
    """
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor may pass a Python float as fp64
    softcap_log2 = tl.cast(softcap_log2, tl.float32)
    i_b, i_hk, o_i, o_h, m_r, i_first, i_last = query_rows(G, S_q, BLOCK_M=BLOCK_M)
    cached, lp, L, L_read = sequence_keys(cache_seqlens, cache_leftpad, i_b, S_new, capacity,
                                          HAS_LEFTPAD=HAS_LEFTPAD)
    off = L - S_q  # query i sits at key position i + off
    if HAS_K_DESCALE:
        qk_scale *= load_descale(k_descale, i_b, i_hk, stride_kdb, True)

    o_d = tl.arange(0, BLOCK_D)
    # [BLOCK_M, BLOCK_D]
    p_q = q + i_b * stride_qb + o_i * stride_qs + o_h * stride_qh
    b_q = tl.load(p_q[:, None] + o_d[None, :], mask=m_r[:, None] & (o_d[None, :] < D),
                  other=0.0)
    if ROTARY_DIM > 0:
        o_pos = cached + o_i
        if not ROTARY_PER_QUERY:
            o_pos = cached + 0 * o_i
        b_q = rotate_rows(b_q, p_q, m_r, o_pos, rotary_cos, rotary_sin, stride_rs, seqlen_ro,
                          BLOCK_D, ROTARY_DIM, ROTARY_INTERLEAVED)
    if FP8_CACHE and q.dtype.element_ty == tl.bfloat16:
        # the products in fp16: e4m3 converts to fp16 in one instruction per pair, to bf16
        # in several (measured: the conversion bounded the step)
        b_q, q_unit = to_scaled_f16(b_q)
        qk_scale *= q_unit
    b_q = dot_operand(b_q, UPCAST)
    alibi2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        alibi2 = -tl.load(alibi + i_b * stride_ab + o_h * stride_ah, mask=m_r,
                          other=0.0) * LOG2E

    # the keys of the tile's first and last query: [lo, hi), unmasked in [u_lo, u_hi)
    lo, u_lo, u_hi, hi = key_range(i_first + off, i_last + off, tl.maximum(L_read, 0), left,
                                   right, chunk, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, BLOCK_N)
    # this split's run of key tiles
    i_split = tl.program_id(0).to(tl.int64)
    s_lo, s_hi = split_run(lo, hi, i_split, BLOCK_N=BLOCK_N)
    s_mid_lo = tl.minimum(tl.maximum(u_lo, s_lo), s_hi)
    s_mid_hi = tl.minimum(tl.maximum(u_hi, s_mid_lo), s_hi)

    # the caches at this sequence and KV head
    k_base, v_base = cache_bases(
        k_cache, v_cache, cache_batch_idx, i_b, i_hk, lp, stride_kcb, stride_kcs, stride_kch,
        stride_vcb, stride_vcs, stride_vch, IS_PAGED=IS_PAGED, HAS_BATCH_IDX=HAS_BATCH_IDX,
        HAS_LEFTPAD=HAS_LEFTPAD)
    if IS_PAGED:  # the block table's row of this sequence
        block_table += i_b * stride_tb

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINK:
        # the sink as one more score of split 0's rows only: its sum starts at exp2(0) = 1
        b_sink = tl.load(sinks + o_h * stride_sh, mask=m_r, other=float("-inf"))
        m_i = tl.where(i_split == 0, b_sink.to(tl.float32) * LOG2E, float("-inf"))
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # [s_lo, s_mid_lo) edge tiles (a window's left bound, a chunk's start), [s_mid_lo,
    # s_mid_hi) inside,
    # [s_mid_hi, s_hi) edge tiles (the keys' end, a right bound)
    for part in tl.static_range(3):
        if part != 0 or HAS_LEFT or HAS_CHUNK:
            if part == 0:
                start, end = s_lo, s_mid_lo
            elif part == 1:
                start, end = s_mid_lo, s_mid_hi
            else:
                start, end = s_mid_hi, s_hi
            acc, l_i, m_i = _decode_key_tiles(
                acc, l_i, m_i, b_q, k_base, v_base, block_table, o_i, m_r, alibi2, start,
                end, L_read, L, S_q, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                qk_scale, softcap_log2, left, right, chunk, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N,
                PAGE_SIZE, IS_PAGED, TILE_PAGE, part != 1, HAS_LEFT, HAS_RIGHT, HAS_CHUNK,
                HAS_SOFTCAP,
                HAS_ALIBI, FP8_CACHE, UPCAST, DOT_PRECISION)

    b_o, b_lse2 = normalized_rows(acc, l_i, m_i)
    if HAS_V_DESCALE:
        b_o *= load_descale(v_descale, i_b, i_hk, stride_vdb, True)
    o_dv = tl.arange(0, BLOCK_DV)
    m_o = m_r[:, None] & (o_dv[None, :] < DV)
    if SPLIT:
        tl.store(o_part + i_split * stride_pp + i_b * stride_pb + o_i[:, None] * stride_ps
                 + o_h[:, None] * stride_ph + o_dv[None, :], b_o, mask=m_o)
        tl.store(lse_part + i_split * stride_lpp + i_b * stride_lpb + o_h * stride_lph + o_i,
                 b_lse2, mask=m_r)
    else:
        tl.store(o + i_b * stride_ob + o_i[:, None] * stride_os + o_h[:, None] * stride_oh
                 + o_dv[None, :], round_to(b_o, o.dtype.element_ty), mask=m_o)
        tl.store(lse + i_b * stride_lb + o_h * stride_lh + o_i, b_lse2 * LN2, mask=m_r)


@triton.jit
def attention_decode_merge_kernel(
    o_part, lse_part, o, lse,
    stride_pp, stride_pb, stride_ps, stride_ph,
    stride_lpp, stride_lpb, stride_lph,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    n_splits,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
):
    """o[b, i, h] and lse[b, h, i] from the splits' partial outputs and base-2 lses, each
    weighted by exp2(lse_split - lse); grid (S_q, H, B). All splits empty: 0 and -inf. A
    sink is in split 0's partials (attention_decode_kernel), so it counts once here."""
    i_i = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    i_b = tl.program_id(2).to(tl.int64)
    o_p = tl.arange(0, BLOCK_SPLITS)
    m_p = o_p < n_splits
    # [BLOCK_SPLITS]
    b_lse = tl.load(lse_part + o_p * stride_lpp + i_b * stride_lpb + i_h * stride_lph + i_i,
                    mask=m_p, other=float("-inf"))
    m = tl.max(b_lse, 0)
    m_sub = tl.where(m == float("-inf"), 0.0, m)
    b_w = tl.math.exp2(b_lse - m_sub)
    w_sum = tl.sum(b_w, 0)
    o_dv = tl.arange(0, BLOCK_DV)
    # [BLOCK_SPLITS, BLOCK_DV]
    b_o = tl.load(o_part + o_p[:, None] * stride_pp + i_b * stride_pb + i_i * stride_ps
                  + i_h * stride_ph + o_dv[None, :], mask=m_p[:, None] & (o_dv[None, :] < DV),
                  other=0.0)
    w_safe = tl.where(w_sum == 0.0, 1.0, w_sum)
    # [BLOCK_DV]
    b_out = tl.sum(b_o * b_w[:, None], 0) / w_safe
    tl.store(o + i_b * stride_ob + i_i * stride_os + i_h * stride_oh + o_dv,
             round_to(b_out, o.dtype.element_ty), mask=o_dv < DV)
    b_lse_out = tl.where(w_sum == 0.0, float("-inf"), (m_sub + tl.math.log2(w_safe)) * LN2)
    tl.store(lse + i_b * stride_lb + i_h * stride_lh + i_i, b_lse_out)
