"""FlashAttention-2 backward: the dQ kernel (the dK/dV kernel and what both read are in
backward.py's docstring).

``attention_bwd_dq_kernel``: one program per query tile of one query head; it runs before
the dK/dV kernel and also stores delta = rowsum(dO * O) - dlse for its rows, which that
kernel reads. dQ is summed in one program per row, in key-tile order: bitwise
reproducible. Where ``BLOCK_DT``, q's and k's head dims are two tiles, as the forward's
(D = 192: 128 + 64): S one accumulator of two products, dQ two accumulators.
"""

import triton
import triton.language as tl

from flashop.kernels.backward_buffer import delta_rows
from flashop.kernels.common import (
    LOG2E, attention_scores, dot_operand, dropout_keep, exp2_shifted, key_tile_range,
    load_tile, lse_rows, round_to, row_descriptors, score_dot, score_dot_parts,
)


@triton.jit
def _dq_key_tiles(
    grads, b_q, b_q2, b_do, b_lse, b_delta, k, v, descs, g_cum, attn_mask, dattn_mask,
    stride_ks, stride_vs, stride_gs, mask_strides, stride_damq, o_m, m_m, lo, hi, S_q, S_k,
    scales, bounds,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, EDGE_TILE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_GATE: tl.constexpr,
    ATTN_MASK_KIND: tl.constexpr, ATTN_MASK_GRAD: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, dropout, DROPOUT: tl.constexpr,
    FOLD_SCALE: tl.constexpr, DELTA_PASS: tl.constexpr, BLOCK_DT: tl.constexpr,
    TMA: tl.constexpr,
):
    """Accumulate into ``grads`` (b_dq, b_dq2, b_dgq) the key tiles in [lo, hi), and return
    them; ``EDGE_TILE`` as in the forward; where ``BLOCK_DT``, the head dims past BLOCK_D are
    in ``b_q2`` and ``b_dq2``. ``mask_strides``, ``scales``, ``bounds`` and ``dropout``:
    tuples, as docs/design.md's vocabulary says.
    Where ``ATTN_MASK_GRAD``, write dS into ``dattn_mask`` (rows of stride ``stride_damq``).
    Where ``DELTA_PASS``, only add rowsum(Z * dP) (= rowsum(dO * O) of the unrounded output)
    into ``b_dgq``. Where ``TMA``, the key and value tiles are read through ``descs`` (k's,
    k's past BLOCK_D, v's tensor descriptors: rows past S_k and columns past D read as 0);
    ``k`` then gives its dtype only."""
    b_dq, b_dq2, b_dgq = grads
    k_desc, k2_desc, v_desc = descs
    stride_amq, stride_amk = mask_strides
    qk_scale, softcap_log2, alibi_log2 = scales
    left, right, chunk = bounds
    seed, i_b, i_h, dropout_p = dropout
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    for i_t in range(0, tl.cdiv(hi - lo, BLOCK_N)):  # counted from 0, as in _dkdv_query_tiles
        start_n = tl.multiple_of(lo + i_t * BLOCK_N, BLOCK_N)
        o_n = start_n + tl.arange(0, BLOCK_N)
        m_n = o_n < S_k
        # K^T [BLOCK_D, BLOCK_N], V^T [BLOCK_DV, BLOCK_N]
        if TMA:
            b_kt = tl.trans(k_desc.load([start_n, 0]))
            b_vt = tl.trans(v_desc.load([start_n, 0]))
        else:
            b_kt = load_tile(k + o_n[None, :] * stride_ks + o_d[:, None], m_n[None, :],
                             o_d[:, None] < D, EDGE_TILE, BLOCK_D > D)
            b_vt = load_tile(v + o_n[None, :] * stride_vs + o_dv[:, None], m_n[None, :],
                             o_dv[:, None] < DV, EDGE_TILE, BLOCK_DV != DV)
        b_kt = dot_operand(b_kt, UPCAST)
        b_vt = dot_operand(b_vt, UPCAST)
        # [BLOCK_M, BLOCK_N]
        if BLOCK_DT > 0:
            # K^T's head dims past BLOCK_D [BLOCK_DT, BLOCK_N]
            o_dt = BLOCK_D + tl.arange(0, BLOCK_DT)
            if TMA:
                b_kt2 = tl.trans(k2_desc.load([start_n, BLOCK_D]))
            else:
                b_kt2 = load_tile(k + o_n[None, :] * stride_ks + o_dt[:, None], m_n[None, :],
                                  o_dt[:, None] < D, EDGE_TILE, BLOCK_D + BLOCK_DT > D)
            b_kt2 = dot_operand(b_kt2, UPCAST)
            b_s = score_dot_parts(b_q, b_kt, b_q2, b_kt2, DOT_PRECISION)
        else:
            b_s = score_dot(b_q, b_kt, DOT_PRECISION)
        # dP = dO V^T [BLOCK_M, BLOCK_N]
        b_dp = tl.dot(b_do, b_vt, input_precision=DOT_PRECISION)
        b_gk = 0.0
        if HAS_GATE:
            b_gk = tl.load(g_cum + o_n * stride_gs, mask=m_n, other=0.0)[None, :]
        b_s, b_t = attention_scores(
            b_s, qk_scale, o_m[:, None], o_n[None, :], m_m[:, None], m_n[None, :], S_q, S_k,
            left, right, chunk, softcap_log2, alibi_log2, b_gk, attn_mask, stride_amq,
            stride_amk, EDGE_TILE, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_SOFTCAP, HAS_ALIBI,
            HAS_GATE, ATTN_MASK_KIND, not FOLD_SCALE)
        b_p = exp2_shifted(b_s, qk_scale, b_lse[:, None], FOLD_SCALE)
        if DROPOUT:
            b_keep = dropout_keep(seed, i_b, i_h, o_m, start_n, dropout_p, BLOCK_N, False)
            b_dp = tl.where(b_keep, b_dp * (1.0 / (1.0 - dropout_p)), 0.0)
        if DELTA_PASS:
            b_dgq += tl.sum(b_p * b_dp, 1)
        else:
            b_ds = b_p * (b_dp - b_delta[:, None])
            if ATTN_MASK_GRAD:
                tl.store(dattn_mask + o_m[:, None] * stride_damq + o_n[None, :], b_ds,
                         mask=m_m[:, None] & m_n[None, :])
            if HAS_GATE:
                # [BLOCK_M]
                b_dgq += tl.sum(b_ds, 1)
            if HAS_SOFTCAP:
                b_ds = b_ds * (1.0 - b_t * b_t)
            # dQ += dS K [BLOCK_M, BLOCK_D]
            b_ds = dot_operand(round_to(b_ds, k.dtype.element_ty), UPCAST)
            b_dq = tl.dot(b_ds, tl.trans(b_kt), b_dq, input_precision=DOT_PRECISION)
            if BLOCK_DT > 0:
                b_dq2 = tl.dot(b_ds, tl.trans(b_kt2), b_dq2, input_precision=DOT_PRECISION)
    return b_dq, b_dq2, b_dgq


@triton.jit
def _dq_key_ranges(
    b_dgq, b_q, b_q2, b_do, b_lse, b_delta, k, v, descs, g_cum, attn_mask, dattn_mask,
    stride_ks, stride_vs, stride_gs, mask_strides, stride_damq, o_m, m_m, lo, u_lo, u_hi, hi,
    S_q, S_k, scales, bounds,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_GATE: tl.constexpr, ATTN_MASK_KIND: tl.constexpr, ATTN_MASK_GRAD: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, dropout,
    DROPOUT: tl.constexpr, FOLD_SCALE: tl.constexpr, DELTA_PASS: tl.constexpr,
    BLOCK_DT: tl.constexpr, TMA: tl.constexpr,
):
    """_dq_key_tiles over a query tile's key ranges (key_tile_range): the left edge tiles, the
    tiles every row attends, the right edge tiles; returns (dQ unscaled, its head dims past
    BLOCK_D where ``BLOCK_DT``, b_dgq). The tuples are passed on as they come."""
    b_dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    b_dq2 = 0.0
    if BLOCK_DT > 0:
        b_dq2 = tl.zeros([BLOCK_M, BLOCK_DT], dtype=tl.float32)
    if HAS_LEFT or HAS_CHUNK:
        b_dq, b_dq2, b_dgq = _dq_key_tiles(
            (b_dq, b_dq2, b_dgq), b_q, b_q2, b_do, b_lse, b_delta, k, v, descs, g_cum, attn_mask,
            dattn_mask, stride_ks, stride_vs, stride_gs, mask_strides, stride_damq, o_m, m_m, lo,
            u_lo, S_q, S_k, scales, bounds, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, True, HAS_LEFT,
            HAS_RIGHT, HAS_CHUNK, HAS_SOFTCAP, HAS_ALIBI, HAS_GATE, ATTN_MASK_KIND, ATTN_MASK_GRAD,
            UPCAST, DOT_PRECISION, dropout, DROPOUT, FOLD_SCALE, DELTA_PASS, BLOCK_DT, TMA)
    b_dq, b_dq2, b_dgq = _dq_key_tiles(
        (b_dq, b_dq2, b_dgq), b_q, b_q2, b_do, b_lse, b_delta, k, v, descs, g_cum, attn_mask,
        dattn_mask, stride_ks, stride_vs, stride_gs, mask_strides, stride_damq, o_m, m_m,
        u_lo, u_hi, S_q, S_k, scales, bounds, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, False, HAS_LEFT,
        HAS_RIGHT, HAS_CHUNK, HAS_SOFTCAP, HAS_ALIBI, HAS_GATE, ATTN_MASK_KIND, ATTN_MASK_GRAD,
        UPCAST, DOT_PRECISION, dropout, DROPOUT, FOLD_SCALE, DELTA_PASS, BLOCK_DT, TMA)
    b_dq, b_dq2, b_dgq = _dq_key_tiles(
        (b_dq, b_dq2, b_dgq), b_q, b_q2, b_do, b_lse, b_delta, k, v, descs, g_cum, attn_mask,
        dattn_mask, stride_ks, stride_vs, stride_gs, mask_strides, stride_damq, o_m, m_m,
        u_hi, hi, S_q, S_k, scales, bounds, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, True, HAS_LEFT,
        HAS_RIGHT, HAS_CHUNK, HAS_SOFTCAP, HAS_ALIBI, HAS_GATE, ATTN_MASK_KIND, ATTN_MASK_GRAD,
        UPCAST, DOT_PRECISION, dropout, DROPOUT, FOLD_SCALE, DELTA_PASS, BLOCK_DT, TMA)
    return b_dq, b_dq2, b_dgq


@triton.jit
def attention_bwd_dq_kernel(
    q, k, v, do, lse_log2, delta, alibi, g_cum, attn_mask, dropout_seed, cu_seqlens_q,
    cu_seqlens_k, dq, dgq, dattn_mask,
    o, dlse,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_ab, stride_ah,
    stride_gb, stride_gs, stride_gh,
    stride_amb, stride_amh, stride_amq, stride_amk,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh,
    stride_ob, stride_os, stride_oh,
    stride_dlb, stride_dlh, stride_dls,
    S_q, S_k, G, sm_scale, qk_scale, softcap_log2, left, right, chunk, dropout_p, H, seq_bucket,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_GATE: tl.constexpr, ATTN_MASK_KIND: tl.constexpr,
    ATTN_MASK_GRAD: tl.constexpr,
    DROPOUT: tl.constexpr, IS_VARLEN: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FOLD_SCALE: tl.constexpr, BLOCK_DT: tl.constexpr = 0,
    TMA: tl.constexpr = False,
):
    """dQ of one query tile of query head i_h, and the tile's rows of delta (stored for the
    dK/dV kernel, launched after this one); with a gate, also dgq[b, h, i] = sum_j dS[i, j];
    where ``ATTN_MASK_GRAD``, dS into the contiguous (B, H, S_q, S_k) ``dattn_mask`` (``H``,
    the query heads, is read only for its offsets). ``TMA``: k's and v's tiles read through
    tensor descriptors (16-bit inputs whose rows meet their alignment)."""
    sm_scale = tl.cast(sm_scale, tl.float32)  # Inductor may pass Python floats as fp64
    qk_scale = tl.cast(qk_scale, tl.float32)
    softcap_log2 = tl.cast(softcap_log2, tl.float32)
    dropout_p = tl.cast(dropout_p, tl.float32)
    seed = 0
    if DROPOUT:
        seed = tl.load(dropout_seed)
    i_m = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    i_b = tl.program_id(2).to(tl.int64)
    i_hk = i_h // G
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
    k += i_b * stride_kb + k_start * stride_ks + i_hk * stride_kh
    v += i_b * stride_vb + k_start * stride_vs + i_hk * stride_vh
    do += i_b * stride_dob + q_start * stride_dos + i_h * stride_doh
    o += i_b * stride_ob + q_start * stride_os + i_h * stride_oh
    dq += i_b * stride_dqb + q_start * stride_dqs + i_h * stride_dqh
    descs = (k, k, v)  # (placeholders without TMA)
    if TMA:
        descs = row_descriptors(k, v, S_k, stride_ks, stride_vs, D, DV, BLOCK_N, BLOCK_D,
                                BLOCK_DT, BLOCK_DV)

    o_m = start_m + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    m_m = o_m < S_q
    # [BLOCK_M, BLOCK_D], [BLOCK_M, BLOCK_DV]
    b_q = dot_operand(load_tile(q + o_m[:, None] * stride_qs + o_d[None, :], m_m[:, None],
                                o_d[None, :] < D, True, BLOCK_D > D), UPCAST)
    b_q2 = b_q  # [BLOCK_M, BLOCK_DT]: the head dims past BLOCK_D (a placeholder without)
    if BLOCK_DT > 0:
        o_dt = BLOCK_D + tl.arange(0, BLOCK_DT)
        b_q2 = dot_operand(load_tile(q + o_m[:, None] * stride_qs + o_dt[None, :],
                                     m_m[:, None], o_dt[None, :] < D, True,
                                     BLOCK_D + BLOCK_DT > D), UPCAST)
    b_do = dot_operand(load_tile(do + o_m[:, None] * stride_dos + o_dv[None, :], m_m[:, None],
                                 o_dv[None, :] < DV, True, BLOCK_DV != DV), UPCAST)
    row = i_b * stride_lb + i_h * stride_lh + q_start + o_m  # lse, delta, dgq
    b_lse = lse_rows(tl.load(lse_log2 + row, mask=m_m, other=float("inf")))
    b_o = load_tile(o + o_m[:, None] * stride_os + o_dv[None, :], m_m[:, None],
                    o_dv[None, :] < DV, True, BLOCK_DV != DV)
    b_dlse = tl.load(dlse + i_b * stride_dlb + i_h * stride_dlh + (q_start + o_m) * stride_dls,
                     mask=m_m, other=0.0)
    b_delta = delta_rows(b_o, b_do, b_dlse)

    alibi_log2 = 0.0
    if HAS_ALIBI:
        alibi_log2 = -tl.load(alibi + i_b * stride_ab + i_h * stride_ah) * LOG2E
    if HAS_GATE:
        g_cum += i_b * stride_gb + k_start * stride_gs + i_h * stride_gh
    if ATTN_MASK_KIND != 0:
        attn_mask += i_b * stride_amb + i_h * stride_amh
    if ATTN_MASK_GRAD:
        dattn_mask += (i_b * H + i_h) * S_q * S_k

    lo, u_lo, u_hi, hi = key_tile_range(start_m, S_q, S_k, left, right, chunk, HAS_LEFT,
                                        HAS_RIGHT, HAS_CHUNK, BLOCK_M, BLOCK_N)
    if ATTN_MASK_GRAD:
        # a broadcast mask's gradient sums dS over keys and rows; a row's dS sums to its lse
        # cotangent, so delta's rounding (from the output stored in q's dtype) is what such a
        # sum adds up: delta from Z dP instead, one pass more over the keys (the gate's row
        # sums take delta as it is: a pass more cost a gated D = 128 call 23%)
        b_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        _, _, b_sum = _dq_key_ranges(
            b_sum, b_q, b_q2, b_do, b_lse, b_delta, k, v, descs, g_cum, attn_mask, dattn_mask,
            stride_ks, stride_vs, stride_gs, (stride_amq, stride_amk), S_k, o_m, m_m, lo, u_lo,
            u_hi, hi, S_q, S_k, (qk_scale, softcap_log2, alibi_log2), (left, right, chunk), D, DV,
            BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_SOFTCAP,
            HAS_ALIBI, HAS_GATE, ATTN_MASK_KIND, ATTN_MASK_GRAD, UPCAST, DOT_PRECISION,
            (seed, i_b, i_h, dropout_p), DROPOUT, FOLD_SCALE, True, BLOCK_DT, TMA)
        b_delta = b_sum - b_dlse
    tl.store(delta + row, b_delta, mask=m_m)
    b_dq, b_dq2, b_dgq = _dq_key_ranges(
        tl.zeros([BLOCK_M], dtype=tl.float32), b_q, b_q2, b_do, b_lse, b_delta, k, v, descs,
        g_cum, attn_mask, dattn_mask, stride_ks, stride_vs, stride_gs, (stride_amq, stride_amk),
        S_k, o_m, m_m, lo, u_lo, u_hi, hi, S_q, S_k, (qk_scale, softcap_log2, alibi_log2),
        (left, right, chunk), D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT,
        HAS_CHUNK, HAS_SOFTCAP, HAS_ALIBI, HAS_GATE, ATTN_MASK_KIND, ATTN_MASK_GRAD, UPCAST,
        DOT_PRECISION, (seed, i_b, i_h, dropout_p), DROPOUT, FOLD_SCALE, False, BLOCK_DT, TMA)
    b_dq = b_dq * sm_scale
    tl.store(dq + o_m[:, None] * stride_dqs + o_d[None, :], round_to(b_dq, dq.dtype.element_ty),
             mask=m_m[:, None] & (o_d[None, :] < D))
    if BLOCK_DT > 0:
        tl.store(dq + o_m[:, None] * stride_dqs + o_dt[None, :],
                 round_to(b_dq2 * sm_scale, dq.dtype.element_ty),
                 mask=m_m[:, None] & (o_dt[None, :] < D))
    if HAS_GATE:
        tl.store(dgq + row, b_dgq, mask=m_m)
