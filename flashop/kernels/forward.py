"""FlashAttention-2 forward: one program per (query tile, head, batch), online softmax in exp2.

Scores are kept in base-2 units (``qk_scale = scale * log2(e)``); the log-sum-exp is
written in natural-log units, the convention of the public API. Score modifiers (window,
softcap, ALiBi, gate, ``attn_mask``) are compile-time flags: without them the kernel is the
plain one.
"""

import triton
import triton.language as tl

from flashop.kernels.common import (
    INTERPRETED, LN2, LOG2E, attention_scores, dot_operand, dropout_keep, exp2_shifted,
    heaviest_tiles_first, key_tile_range, load_tile, round_to, round_to_e4m3, row_descriptors,
    score_dot, score_dot_parts,
)

# fp8 inputs: P is scaled by 448 (e4m3's largest value, 2^P_SHIFT) before its cast to e4m3
# for the P V product, so that probabilities down to 2^-6 / 448 keep e4m3's 3-bit mantissa
# (unscaled, those under 2^-6 would be subnormal: spacing 2^-9, the typical P at 16k keys
# is 2^-6 to 2^-10); the sum l and the accumulator carry the same factor, which cancels.
P_SHIFT = tl.constexpr(8.807354922057604)  # log2(448)


@triton.jit
def _fwd_scores(
    b_q, b_kt, b_qt, b_ktt, b_gk, o_m, m_m, o_n, m_n, attn_mask, stride_amq, stride_amk, S_q,
    S_k, qk_scale, softcap_log2, alibi_log2, left, right, chunk, EDGE_TILE: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_GATE: tl.constexpr, ATTN_MASK_KIND: tl.constexpr, FOLD_SCALE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_DT: tl.constexpr,
):
    """Scores [rows, BLOCK_N] of the query rows ``o_m`` against one key tile, base 2; where
    ``FOLD_SCALE``, not yet multiplied by ``qk_scale`` (fwd_fold does it). Where
    ``BLOCK_DT``, the head dims past the first block are in ``b_qt`` and ``b_ktt``."""
    if BLOCK_DT > 0:
        b_qk = score_dot_parts(b_q, dot_operand(b_kt, UPCAST), b_qt,
                               dot_operand(b_ktt, UPCAST), DOT_PRECISION)
    else:
        b_qk = score_dot(b_q, dot_operand(b_kt, UPCAST), DOT_PRECISION)
    b_s, _ = attention_scores(
        b_qk, qk_scale, o_m[:, None], o_n[None, :], m_m[:, None], m_n[None, :], S_q, S_k,
        left, right, chunk, softcap_log2, alibi_log2, b_gk, attn_mask, stride_amq, stride_amk,
        EDGE_TILE, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_SOFTCAP, HAS_ALIBI, HAS_GATE,
        ATTN_MASK_KIND, not FOLD_SCALE)
    return b_s


@triton.jit
def fwd_fold(acc, l_i, m_i, b_s, b_v, qk_scale, MASKED: tl.constexpr,
              FOLD_SCALE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
              b_keep, DROPOUT: tl.constexpr, FP8: tl.constexpr):
    """Fold one tile of scores and its value tile into the running (acc, l_i, m_i): the
    online softmax. ``MASKED``: some scores may be -inf. Where ``FOLD_SCALE`` (a positive
    ``qk_scale`` and no additive modifier), ``b_s`` is not yet scaled: the row max is
    scaled once per row (the same value, rounding being monotonic) and the scale goes into
    the exponent's argument, one FMA per score instead of a multiply and a subtraction.
    Where ``DROPOUT``, only the probabilities ``b_keep`` keeps reach acc (the denominator
    l_i counts them all; the 1 / (1 - p) is applied at the end, fwd_rows_out). Where
    ``FP8`` (e4m3 values), P is 2^P_SHIFT times the probabilities (see P_SHIFT), in e4m3."""
    # [rows]
    if FOLD_SCALE:
        m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)
    else:
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
    if MASKED:
        # a row with no key so far keeps m = -inf; subtract 0 so exp2 gives 0, not NaN
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    m_exp = m_sub
    if FP8:
        m_exp = m_sub - P_SHIFT
    b_p = exp2_shifted(b_s, qk_scale, m_exp[:, None], FOLD_SCALE)
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(b_p, 1)
    if DROPOUT:
        b_p = tl.where(b_keep, b_p, 0.0)
    if FP8 and INTERPRETED:
        b_p = round_to_e4m3(b_p)  # triton<=3.9: the interpreter's cast does not round to even
    # [rows, BLOCK_DV]
    acc = tl.dot(dot_operand(round_to(b_p, b_v.dtype), UPCAST), dot_operand(b_v, UPCAST),
                 acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _fwd_key_tiles(
    state, state2, tile, tile2, b_qt, b_qt2, k, k_t, v, k_strides, v_strides, g_cum, stride_gs,
    attn_mask, mask_strides, lo, hi, S_q, S_k, scales, bounds, D: tl.constexpr,
    DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    EDGE_TILE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_GATE: tl.constexpr, ATTN_MASK_KIND: tl.constexpr, FOLD_SCALE: tl.constexpr,
    SPLIT_M: tl.constexpr, TMA: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, dropout, DROPOUT: tl.constexpr, block_table,
    PAGE_SIZE: tl.constexpr, IS_PAGED: tl.constexpr, FP8: tl.constexpr, BLOCK_DT: tl.constexpr,
):
    """Fold the key tiles in [lo, hi) into the running ``state`` (acc, l_i, m_i) of the query
    ``tile`` (b_q, o_m, m_m: its block, rows and their mask), and where ``SPLIT_M`` into
    ``state2`` of ``tile2`` as well; returns both states' values. The other tuples
    (docs/design.md's vocabulary): ``k_strides`` (stride_kb, stride_ks), ``v_strides``
    (stride_vb, stride_vs, stride_vd), ``mask_strides`` (stride_amq, stride_amk),
    ``scales`` (qk_scale, softcap_log2, alibi_log2), ``bounds`` (left, right, chunk),
    ``dropout`` (seed, i_b, i_h, dropout_p).
    Where ``BLOCK_DT``, the head dims from BLOCK_D on are a second tile of BLOCK_DT: the
    queries' in ``b_qt`` (``b_qt2`` for ``tile2``), the keys' read with them (through ``k_t``
    where ``TMA``).

    ``EDGE_TILE`` tiles may cross the window (causal) or chunk bounds or the end of the keys;
    the others are inside for every row of the program and skip that masking. Where ``TMA``,
    ``k`` and ``v`` are tensor descriptors of this (batch, head)'s keys and values, whose loads
    read rows past S_k and columns past D as 0. Where ``IS_PAGED``, key ``j`` is row
    ``j % PAGE_SIZE`` of page ``block_table[j // PAGE_SIZE]`` (``block_table`` at this
    sequence's row; pages ``stride_kb`` / ``stride_vb`` apart): a tile's one page id where
    the tile lies in one page (PAGE_SIZE >= BLOCK_N), else each key's.

    With two query tiles the order is: both tiles' scores, then each tile's softmax and P V
    product. Triton waits for a scores product where it is issued but lets a P V product,
    which accumulates, run until the end of the iteration: the tensor cores work on the
    first tile's P V while the second tile's softmax runs.

    Where ``DROPOUT``, each tile's keep mask is drawn from ``seed`` (dropout_keep).
    """
    acc, l_i, m_i = state
    acc2, l_i2, m_i2 = state2
    b_q, o_m, m_m = tile
    b_q2, o_m2, m_m2 = tile2
    stride_kb, stride_ks = k_strides
    stride_vb, stride_vs, stride_vd = v_strides
    stride_amq, stride_amk = mask_strides
    qk_scale, softcap_log2, alibi_log2 = scales
    left, right, chunk = bounds
    seed, i_b, i_h, dropout_p = dropout
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        o_n = start_n + tl.arange(0, BLOCK_N)
        m_n = o_n < S_k
        if IS_PAGED:
            if PAGE_SIZE >= BLOCK_N:
                i_page = tl.load(block_table + start_n // PAGE_SIZE).to(tl.int64)
                o_row = start_n % PAGE_SIZE + tl.arange(0, BLOCK_N)
            else:
                i_page = tl.load(block_table + o_n // PAGE_SIZE, mask=m_n, other=0).to(tl.int64)
                o_row = o_n % PAGE_SIZE
            o_kn = i_page * stride_kb + o_row * stride_ks
            o_vn = i_page * stride_vb + o_row * stride_vs
        else:
            o_kn = o_n * stride_ks
            o_vn = o_n * stride_vs
        # K^T tile [BLOCK_D, BLOCK_N]
        if TMA:
            b_kt = tl.trans(k.load([start_n, 0]))
        else:
            b_kt = load_tile(k + o_kn[None, :] + o_d[:, None], m_n[None, :],
                             o_d[:, None] < D, EDGE_TILE, BLOCK_D > D)
        b_ktt = b_kt
        if BLOCK_DT > 0:  # [BLOCK_DT, BLOCK_N]
            if TMA:
                b_ktt = tl.trans(k_t.load([start_n, BLOCK_D]))
            else:
                o_dt = BLOCK_D + tl.arange(0, BLOCK_DT)
                b_ktt = load_tile(k + o_kn[None, :] + o_dt[:, None], m_n[None, :],
                                  o_dt[:, None] < D, EDGE_TILE, BLOCK_D + BLOCK_DT > D)
        b_gk = 0.0
        if HAS_GATE:
            b_gk = tl.load(g_cum + o_n * stride_gs, mask=m_n, other=0.0)[None, :]
        # [TILE_M, BLOCK_N]
        b_s = _fwd_scores(
            b_q, b_kt, b_qt, b_ktt, b_gk, o_m, m_m, o_n, m_n, attn_mask, stride_amq, stride_amk,
            S_q, S_k, qk_scale, softcap_log2, alibi_log2, left, right, chunk, EDGE_TILE,
            HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_SOFTCAP, HAS_ALIBI, HAS_GATE, ATTN_MASK_KIND,
            FOLD_SCALE, UPCAST, DOT_PRECISION, BLOCK_DT)
        if SPLIT_M:
            b_s2 = _fwd_scores(
                b_q2, b_kt, b_qt2, b_ktt, b_gk, o_m2, m_m2, o_n, m_n, attn_mask, stride_amq,
                stride_amk, S_q, S_k, qk_scale, softcap_log2, alibi_log2, left, right, chunk,
                EDGE_TILE, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_SOFTCAP, HAS_ALIBI, HAS_GATE,
                ATTN_MASK_KIND, FOLD_SCALE, UPCAST, DOT_PRECISION, BLOCK_DT)
        if TMA:
            b_v = v.load([start_n, 0])
        else:
            b_v = load_tile(v + o_vn[:, None] + o_dv[None, :] * stride_vd, m_n[:, None],
                            o_dv[None, :] < DV, EDGE_TILE, BLOCK_DV != DV)
        b_keep = 0
        b_keep2 = 0
        if DROPOUT:
            b_keep = dropout_keep(seed, i_b, i_h, o_m, start_n, dropout_p, BLOCK_N, False)
            if SPLIT_M:
                b_keep2 = dropout_keep(seed, i_b, i_h, o_m2, start_n, dropout_p, BLOCK_N,
                                       False)
        acc, l_i, m_i = fwd_fold(acc, l_i, m_i, b_s, b_v, qk_scale,
                                  EDGE_TILE or ATTN_MASK_KIND != 0, FOLD_SCALE, UPCAST,
                                  DOT_PRECISION, b_keep, DROPOUT, FP8)
        if SPLIT_M:
            acc2, l_i2, m_i2 = fwd_fold(acc2, l_i2, m_i2, b_s2, b_v, qk_scale,
                                         EDGE_TILE or ATTN_MASK_KIND != 0, FOLD_SCALE, UPCAST,
                                         DOT_PRECISION, b_keep2, DROPOUT, FP8)
    # flat, not two tuples: triton<=3.6 fails on a nested tuple as an assignment target
    return acc, l_i, m_i, acc2, l_i2, m_i2


@triton.jit
def _sink_rows(sink_log2, g_cum, o_m, m_m, S_q, S_k, stride_gs, i_b, i_h, k_start, stride_gb,
               stride_gh, HAS_GATE: tl.constexpr):
    """The sink of the rows ``o_m`` in the kernels' frame of scores, base 2: the sink itself,
    less the queries' gate G_i where ``HAS_GATE`` (the scores leave G_i out, see
    attention_scores; fwd_rows_out adds it back to lse)."""
    b_sink = tl.zeros(o_m.shape, dtype=tl.float32) + sink_log2
    if HAS_GATE:
        # torch<=2.13: the gate's pointer is offset here, not returned (see common.py's end)
        o_gq = o_m + (S_k - S_q)
        b_gq = tl.load(g_cum + i_b * stride_gb + k_start * stride_gs + i_h * stride_gh
                       + o_gq * stride_gs, mask=m_m & (o_gq >= 0), other=0.0)
        b_sink = tl.fma(-b_gq, LOG2E, b_sink)  # one rounding, as _launch.attention.sink_grad
    return b_sink


@triton.jit
def fwd_rows_out(acc, l_i, m_i, o, lse, lse_log2, g_cum, o_m, m_m, S_q, S_k, stride_os,
                  stride_gs, DV: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_GATE: tl.constexpr,
                  dropout_p, DROPOUT: tl.constexpr, v_scale, FP8: tl.constexpr):
    """Store the output rows ``o_m`` (acc / l, and / (1 - dropout_p) where ``DROPOUT``;
    where ``FP8``, times the values' descale ``v_scale``, l holding P's factor 2^P_SHIFT)
    and their log-sum-exp, natural and base 2."""
    o_dv = tl.arange(0, BLOCK_DV)
    # rows that attend no key (outside the window, masked out, or S_k == 0) and no sink:
    # output 0, lse -inf
    m_empty = l_i == 0.0
    l_safe = tl.where(m_empty, 1.0, l_i)
    if DROPOUT:
        b_o = acc / (l_safe * (1.0 - dropout_p))[:, None]
    elif FP8:
        b_o = acc * (v_scale / l_safe)[:, None]
    else:
        b_o = acc / l_safe[:, None]
    tl.store(o + o_m[:, None] * stride_os + o_dv[None, :], round_to(b_o, o.dtype.element_ty),
             mask=m_m[:, None] & (o_dv[None, :] < DV))
    b_log2_l = tl.math.log2(l_safe)
    if FP8:
        b_log2_l -= P_SHIFT
    b_lse_log2 = tl.where(m_empty, float("-inf"), m_i + b_log2_l)
    tl.store(lse_log2 + o_m, b_lse_log2, mask=m_m)
    b_lse = b_lse_log2 * LN2
    if HAS_GATE:
        # the queries' gate G_i, constant along each row, only shifts the log-sum-exp. The
        # base-2 lse kept for the backward goes without it, as do the scores the backward
        # recomputes: a round trip through lse + G_i would cost P its last bits. Query i
        # sits at key position i + S_k - S_q.
        o_gq = o_m + (S_k - S_q)
        b_lse += tl.load(g_cum + o_gq * stride_gs, mask=m_m & (o_gq >= 0), other=0.0)
    tl.store(lse + o_m, b_lse, mask=m_m)


@triton.jit
def attention_fwd_kernel(
    q, k, v, o, lse, lse_log2, alibi, g_cum, attn_mask, sinks, dropout_seed, cu_seqlens_q,
    cu_seqlens_k, block_table, q_descale, k_descale, v_descale,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh,
    stride_ab, stride_ah,
    stride_gb, stride_gs, stride_gh,
    stride_amb, stride_amh, stride_amq, stride_amk,
    stride_lb, stride_lh, stride_sh, stride_tb, stride_dsb,
    S_q, S_k, G, qk_scale, softcap_log2, left, right, chunk, dropout_p, seq_bucket, capacity,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_GATE: tl.constexpr, ATTN_MASK_KIND: tl.constexpr, HAS_SINK: tl.constexpr,
    DROPOUT: tl.constexpr, FOLD_SCALE: tl.constexpr, IS_VARLEN: tl.constexpr,
    IS_PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, SPLIT_M: tl.constexpr, TMA: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr,
    BLOCK_DT: tl.constexpr,
):
    """o[b, i, h] = softmax_j(score(i, j)) v[b, j, h // G], score as attention_scores.

    Also writes lse[b, h, i] (natural log, fp32) at ``b * stride_lb + h * stride_lh + i``,
    and the same in base 2 at the same place of ``lse_log2``: the backward's P = exp2(s -
    lse_log2) with the forward's own rounding (the round trip through natural-log units
    costs P about 1e-5 of relative accuracy at scores of a few hundred).
    Where ``IS_VARLEN``, batch entry b is the packed sequence ``cu_seqlens_q[b] ..
    cu_seqlens_q[b + 1]`` (keys likewise; S_q, S_k are then the longest lengths) and the
    tensors' batch strides are 0. Where also ``IS_PAGED`` (paged prefill), k and v are
    paged caches (pages, PAGE_SIZE rows, heads, dims; ``stride_kb`` / ``stride_vb`` their
    page strides): sequence b's ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` keys are its first
    keys in the pages ``block_table[b * stride_tb + j // PAGE_SIZE]`` (_fwd_key_tiles), and
    no key past the table's ``capacity`` (max_blocks * PAGE_SIZE) is read: a longer
    sequence counts as that long.
    ``alibi`` (slopes), ``g_cum`` (the cumulative gate, fp32, read through its (batch, seq,
    head) strides) and ``attn_mask`` are read only where their flag is set. ``seq_bucket`` is
    not read: it is the autotuner's key for the lengths (flashop/_launch/tiles.py).
    Where ``SPLIT_M``, the program's BLOCK_M query rows are two tiles of BLOCK_M / 2, whose
    softmax and matmuls interleave over the same key tiles (see _fwd_key_tiles); under a
    right bound or a chunk, the key tiles past the first tile's last key run for the second
    alone. Where ``HAS_CHUNK``, query i (at position p = i + S_k - S_q) attends only the
    keys of its chunk of ``chunk`` positions, ``j // chunk == p // chunk`` (with the window's
    bounds), and the key tiles outside every row's chunk are skipped (key_tile_range).
    Where ``FOLD_SCALE``, the scale multiplies the row max and goes into the exponent's FMA
    (see fwd_fold; the launcher's rule is choice.folds_scale: 16-bit or fp8 inputs, a
    positive scale and no modifier between the product and the softmax; the backward
    kernels fold alike).
    Where ``TMA``, the key and value tiles are read through tensor descriptors (Hopper's
    copy engine) made per program; the launcher sets it only where k and v meet the
    descriptors' alignment (16-byte base and row strides) and ``stride_vd`` is 1. Other
    inputs have unit stride in their head dim, and v too but where FP8: Hopper's fp8
    products read their second operand along the keys, so v may come with unit stride
    along its keys instead (``stride_vd`` its head dim's stride).
    Where ``HAS_SINK``, head h's logit ``sinks[h * stride_sh]`` joins every row's softmax
    denominator (attending nothing): the running max and sum start from it, so a row that
    attends no key gets lse = sink and output 0. Where ``DROPOUT``, the probabilities are
    dropped with probability ``dropout_p`` by the mask dropout_keep draws from the int64
    ``dropout_seed[0]``, and the rest scaled by 1 / (1 - dropout_p); lse is unaffected.
    Where ``FP8``, q, k and v are e4m3 and their real values are times the fp32 descales
    ``q_descale``, ``k_descale``, ``v_descale`` at ``b * stride_dsb + h // G`` (one per
    sequence and key/value head, FlashAttention-3's scaling): the query and key descales
    multiply the score scale, the value descale the output; P goes to the P V product in
    e4m3 (see P_SHIFT).
    Where ``BLOCK_DT`` (not 0), q's and k's head dims are two tiles, the first BLOCK_D wide
    and whole, the rest BLOCK_DT wide (D = 192: 128 and 64, where one power-of-two tile
    would be 256 wide, a third of it padding); with ``SPLIT_M``, each query tile's own.
    """
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor may pass a Python float as fp64
    softcap_log2 = tl.cast(softcap_log2, tl.float32)
    dropout_p = tl.cast(dropout_p, tl.float32)
    if HAS_RIGHT and SPLIT_M:
        # causal-like: later query tiles attend more keys. With two query tiles per program
        # (one program per SM at D=128), the grid's last programs ran alone: heaviest
        # first (with one query tile this order is slower)
        i_m, i_h, i_b = heaviest_tiles_first()
    else:
        i_m = tl.program_id(0)
        i_h = tl.program_id(1).to(tl.int64)
        i_b = tl.program_id(2).to(tl.int64)
    i_hk = i_h // G
    v_scale = 1.0
    if FP8:
        o_ds = i_b * stride_dsb + i_hk
        qk_scale = qk_scale * (tl.load(q_descale + o_ds) * tl.load(k_descale + o_ds))
        v_scale = tl.load(v_descale + o_ds)
    # torch<=2.13: the packed sequence's offsets and lengths are loaded inline, not by a
    # helper (see the end of common.py)
    q_start = 0
    k_start = 0
    if IS_VARLEN:
        q_start = tl.load(cu_seqlens_q + i_b).to(tl.int64)
        k_start = tl.load(cu_seqlens_k + i_b).to(tl.int64)
        S_q = (tl.load(cu_seqlens_q + i_b + 1) - q_start).to(tl.int32)
        S_k = (tl.load(cu_seqlens_k + i_b + 1) - k_start).to(tl.int32)
    start_m = i_m * BLOCK_M
    if IS_VARLEN:
        if start_m >= S_q:  # a tile past this sequence's end
            return
    q += i_b * stride_qb + q_start * stride_qs + i_h * stride_qh
    if IS_PAGED:  # the pages are offset per key tile (_fwd_key_tiles)
        S_k = tl.minimum(S_k, capacity)
        block_table += i_b * stride_tb
        k += i_hk * stride_kh
        v += i_hk * stride_vh
    else:
        k += i_b * stride_kb + k_start * stride_ks + i_hk * stride_kh
        v += i_b * stride_vb + k_start * stride_vs + i_hk * stride_vh
    o += i_b * stride_ob + q_start * stride_os + i_h * stride_oh
    lse += i_b * stride_lb + i_h * stride_lh + q_start
    lse_log2 += i_b * stride_lb + i_h * stride_lh + q_start
    k_t = k  # the descriptor of the keys' head dims past BLOCK_D, where TMA and BLOCK_DT
    if TMA:
        k, k_t, v = row_descriptors(k, v, S_k, stride_ks, stride_vs, D, DV, BLOCK_N, BLOCK_D,
                                    BLOCK_DT, BLOCK_DV)

    if SPLIT_M:
        TILE_M: tl.constexpr = BLOCK_M // 2
    else:
        TILE_M: tl.constexpr = BLOCK_M
    # the (first) query tile's rows; the second tile's are o_m + TILE_M
    o_m = start_m + tl.arange(0, TILE_M)
    o_d = tl.arange(0, BLOCK_D)
    m_m = o_m < S_q
    # [TILE_M, BLOCK_D]
    b_q = load_tile(q + o_m[:, None] * stride_qs + o_d[None, :], m_m[:, None], o_d[None, :] < D,
                    True, BLOCK_D > D)
    b_q = dot_operand(b_q, UPCAST)
    b_qt = b_q  # [TILE_M, BLOCK_DT]: the head dims past BLOCK_D (a placeholder without)
    if BLOCK_DT > 0:
        o_dt = BLOCK_D + tl.arange(0, BLOCK_DT)
        b_qt = load_tile(q + o_m[:, None] * stride_qs + o_dt[None, :], m_m[:, None],
                         o_dt[None, :] < D, True, BLOCK_D + BLOCK_DT > D)
        b_qt = dot_operand(b_qt, UPCAST)
    m_i = tl.full([TILE_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([TILE_M], dtype=tl.float32)
    sink_log2 = 0.0
    # the sink's term of the sum: exp2(0), times P's factor where FP8
    if FP8:
        P_ONE: tl.constexpr = 448.0
    else:
        P_ONE: tl.constexpr = 1.0
    if HAS_SINK:
        # the sink as one more score of every row: the running sum starts at exp2(0) = 1
        sink_log2 = tl.load(sinks + i_h * stride_sh).to(tl.float32) * LOG2E
        m_i = _sink_rows(sink_log2, g_cum, o_m, m_m, S_q, S_k, stride_gs, i_b, i_h,
                         k_start, stride_gb, stride_gh, HAS_GATE)
        l_i = tl.where(m_i == float("-inf"), 0.0, P_ONE)
    acc = tl.zeros([TILE_M, BLOCK_DV], dtype=tl.float32)
    # the second tile's (placeholders without SPLIT_M)
    o_m2 = o_m + TILE_M
    m_m2 = o_m2 < S_q
    b_q2 = b_q
    b_qt2 = b_qt  # [TILE_M, BLOCK_DT]: its head dims past BLOCK_D
    m_i2 = 0.0
    l_i2 = 0.0
    acc2 = 0.0
    if SPLIT_M:
        b_q2 = load_tile(q + o_m2[:, None] * stride_qs + o_d[None, :], m_m2[:, None],
                         o_d[None, :] < D, True, BLOCK_D > D)
        b_q2 = dot_operand(b_q2, UPCAST)
        if BLOCK_DT > 0:
            b_qt2 = load_tile(q + o_m2[:, None] * stride_qs + o_dt[None, :], m_m2[:, None],
                              o_dt[None, :] < D, True, BLOCK_D + BLOCK_DT > D)
            b_qt2 = dot_operand(b_qt2, UPCAST)
        m_i2 = tl.full([TILE_M], float("-inf"), dtype=tl.float32)
        l_i2 = tl.zeros([TILE_M], dtype=tl.float32)
        if HAS_SINK:
            m_i2 = _sink_rows(sink_log2, g_cum, o_m2, m_m2, S_q, S_k, stride_gs, i_b, i_h,
                              k_start, stride_gb, stride_gh, HAS_GATE)
            l_i2 = tl.where(m_i2 == float("-inf"), 0.0, P_ONE)
        acc2 = tl.zeros([TILE_M, BLOCK_DV], dtype=tl.float32)
    seed = 0
    if DROPOUT:
        seed = tl.load(dropout_seed)

    alibi_log2 = 0.0
    if HAS_ALIBI:
        alibi_log2 = -tl.load(alibi + i_b * stride_ab + i_h * stride_ah) * LOG2E
    if HAS_GATE:
        g_cum += i_b * stride_gb + k_start * stride_gs + i_h * stride_gh
    if ATTN_MASK_KIND != 0:
        attn_mask += i_b * stride_amb + i_h * stride_amh

    # the key tiles of all BLOCK_M rows
    lo, u_lo, u_hi, hi = key_tile_range(start_m, S_q, S_k, left, right, chunk, HAS_LEFT,
                                        HAS_RIGHT, HAS_CHUNK, BLOCK_M, BLOCK_N)
    # [lo, u_lo) masked (a window's left bound, a chunk's start), [u_lo, u_hi) unmasked,
    # [u_hi, hi) masked; with two query tiles under a right bound or a chunk, the first
    # tile's keys end before the second's: [u_hi, mid) for both tiles, [mid, hi) for the
    # second alone
    mid = hi
    if SPLIT_M and (HAS_RIGHT or HAS_CHUNK):
        # the first tile's last key: the key range's end for its TILE_M rows
        _, _, _, hi_a = key_tile_range(start_m, S_q, S_k, left, right, chunk, HAS_LEFT,
                                       HAS_RIGHT, HAS_CHUNK, TILE_M, BLOCK_N)
        mid = tl.minimum(tl.maximum(tl.cdiv(hi_a, BLOCK_N) * BLOCK_N, u_hi), hi)
    for part in tl.static_range(3):
        if part != 0 or HAS_LEFT or HAS_CHUNK:
            if part == 0:
                start_n, end_n = lo, u_lo
            elif part == 1:
                start_n, end_n = u_lo, u_hi
            else:
                start_n, end_n = u_hi, mid
            acc, l_i, m_i, acc2, l_i2, m_i2 = _fwd_key_tiles(
                (acc, l_i, m_i), (acc2, l_i2, m_i2), (b_q, o_m, m_m), (b_q2, o_m2, m_m2), b_qt,
                b_qt2, k, k_t, v, (stride_kb, stride_ks), (stride_vb, stride_vs, stride_vd), g_cum,
                stride_gs, attn_mask, (stride_amq, stride_amk), start_n, end_n, S_q, S_k,
                (qk_scale, softcap_log2, alibi_log2), (left, right, chunk), D, DV, BLOCK_D,
                BLOCK_DV, BLOCK_N, part != 1, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_SOFTCAP,
                HAS_ALIBI, HAS_GATE, ATTN_MASK_KIND, FOLD_SCALE, SPLIT_M, TMA, UPCAST,
                DOT_PRECISION, (seed, i_b, i_h, dropout_p), DROPOUT, block_table, PAGE_SIZE,
                IS_PAGED, FP8, BLOCK_DT)
    if SPLIT_M and (HAS_RIGHT or HAS_CHUNK):
        # the second tile alone (its state passed as the first tile's; the placeholders
        # come back unchanged)
        acc2, l_i2, m_i2, _, _, _ = _fwd_key_tiles(
            (acc2, l_i2, m_i2), (acc2, l_i2, m_i2), (b_q2, o_m2, m_m2), (b_q2, o_m2, m_m2), b_qt2,
            b_qt2, k, k_t, v, (stride_kb, stride_ks), (stride_vb, stride_vs, stride_vd), g_cum,
            stride_gs, attn_mask, (stride_amq, stride_amk), mid, hi, S_q, S_k,
            (qk_scale, softcap_log2, alibi_log2), (left, right, chunk), D, DV, BLOCK_D,
            BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_SOFTCAP, HAS_ALIBI,
            HAS_GATE, ATTN_MASK_KIND, FOLD_SCALE, False, TMA, UPCAST, DOT_PRECISION,
            (seed, i_b, i_h, dropout_p), DROPOUT, block_table, PAGE_SIZE, IS_PAGED, FP8,
            BLOCK_DT)

    fwd_rows_out(acc, l_i, m_i, o, lse, lse_log2, g_cum, o_m, m_m, S_q, S_k, stride_os, stride_gs,
                  DV, BLOCK_DV, HAS_GATE, dropout_p, DROPOUT, v_scale, FP8)
    if SPLIT_M:
        fwd_rows_out(acc2, l_i2, m_i2, o, lse, lse_log2, g_cum, o_m2, m_m2, S_q, S_k, stride_os,
                      stride_gs, DV, BLOCK_DV, HAS_GATE, dropout_p, DROPOUT, v_scale, FP8)
