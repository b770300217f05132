"""FlashAttention-2 backward: the dK/dV kernel (this module) and the dQ kernel
(backward_dq.py), deterministic (no atomics) by default.

Scores are recomputed from q, k and the forward's base-2 log-sum-exp (``lse_log2``); the
N x N probabilities are never stored. ``lse_log2`` and ``delta`` are contiguous (B, H, S_q)
fp32.

- ``attention_bwd_dq_kernel`` (backward_dq.py): one program per query tile of one query
  head. It runs first:
  it also computes delta = rowsum(dO * O) - dlse for its rows and stores it for the dK/dV
  kernel.
- ``attention_bwd_dkdv_kernel``: one program per key tile of one key/value head; it loops
  over the G query heads of its group, so dK and dV are summed over the group in registers.
- With ``DQ_ATOMIC`` (opt-in, see flashop/_launch/choice.py) the dK/dV kernel adds dQ into
  an fp32 buffer by atomics instead (not bitwise reproducible), and no dQ kernel runs:
  backward_buffer.py's kernels compute delta and zero the buffer before it, and write the
  buffer out after it.

With a softcap, dS is multiplied by its derivative ``1 - tanh^2`` before the dQ and dK
products. The gate's gradient is split in two halves written by the kernels that own the
rows: dQ writes ``sum_j dS[i, j]`` per query, dK/dV writes ``-sum_i dS[i, j]`` per key
(both (B, H, S) fp32); the launcher adds them and undoes the cumulative sum. An additive
``attn_mask`` that requires grad gets dS itself, written by dQ.

With dropout (``DROPOUT``) the kernels draw the forward's keep mask again (dropout_keep, a
function of the seed and the pair's indices alone). With Z = keep / (1 - p): dV = (P * Z)^T
dO, dP = Z * (dO V^T), dS = P * (dP - delta); delta = rowsum(dO * O) - dlse holds as it is,
O being the dropped output. An attention sink needs nothing here: the forward's lse
includes it, and its gradient is computed from lse and delta outside the kernels.

The dK/dV and dQ kernels do not read their ``seq_bucket`` argument: it is the autotuner's
key for the lengths (flashop/_launch/tiles.py).
"""

import triton
import triton.language as tl

from flashop.kernels.common import (
    LOG2E, attention_scores, dot_operand, dropout_keep, exp2_shifted, load_tile, lse_rows,
    query_tile_range, round_to, row_descriptors, score_dot, score_dot_parts,
)


@triton.jit
def _dkdv_query_tiles(
    grads, b_k, b_k2, b_v, b_gk, q, do, descs, lse_log2, delta, attn_mask, mask_strides,
    dq_acc, stride_qs, stride_dos, stride_dqas, start_n, o_n, m_n, lo, hi, S_q, S_k, scales,
    bounds,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EDGE_TILE: tl.constexpr, CHECK_ROWS: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_GATE: tl.constexpr,
    ATTN_MASK_KIND: tl.constexpr, DQ_ATOMIC: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, dropout, DROPOUT: tl.constexpr,
    FOLD_SCALE: tl.constexpr, PARTS: tl.constexpr = 3, BLOCK_DT: tl.constexpr = 0,
    TMA: tl.constexpr = False,
):
    """Accumulate into ``grads`` (b_dk, b_dk2, b_dv, b_dgk) the query tiles in [lo, hi) of
    one query head, and return them; where ``DQ_ATOMIC``, also add dS K into the fp32
    ``dq_acc`` (rows of stride ``stride_dqas``). ``mask_strides``, ``scales``, ``bounds`` and
    ``dropout``: tuples, as docs/design.md's vocabulary says. ``PARTS`` (as
    attention_bwd_dkdv_kernel's) leaves out dV's product (2) or dP's, dS's and dK's (1).
    Where ``BLOCK_DT``, the head dims from BLOCK_D on are a second tile: K's in ``b_k2``,
    dK's in ``b_dk2`` (placeholders without). Where ``TMA``, q's and dO's tiles are read
    through ``descs`` (q's, q's past BLOCK_D, dO's tensor descriptors of this head's rows:
    rows past S_q and columns past D read as 0); ``q`` and ``do`` then give their dtypes
    only.

    Where ``CHECK_ROWS`` (a range that may reach past S_q), rows past S_q load q = dO = 0 and
    lse = +inf, so they add nothing; elsewhere the loads are unmasked (faster). Keys past
    S_k were loaded as 0 and their rows of dk,
    dv and dgk are never stored, so no key mask is needed.
    """
    b_dk, b_dk2, b_dv, b_dgk = grads
    q_desc, q2_desc, do_desc = descs
    stride_amq, stride_amk = mask_strides
    qk_scale, softcap_log2, alibi_log2 = scales
    left, right, chunk = bounds
    seed, i_b, i_h, dropout_p = dropout
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    # counted from 0 rather than range(lo, hi, BLOCK_M): the compiled loop is faster
    for i_t in range(0, tl.cdiv(hi - lo, BLOCK_M)):
        start_m = tl.multiple_of(lo + i_t * BLOCK_M, BLOCK_M)
        o_m = start_m + tl.arange(0, BLOCK_M)
        m_m = o_m < S_q
        # Q^T tile [BLOCK_D, BLOCK_M]
        if TMA:
            b_qt = tl.trans(q_desc.load([start_m, 0]))
        else:
            b_qt = load_tile(q + o_m[None, :] * stride_qs + o_d[:, None], m_m[None, :],
                             o_d[:, None] < D, CHECK_ROWS, BLOCK_D > D)
        if CHECK_ROWS:
            b_lse = lse_rows(tl.load(lse_log2 + o_m, mask=m_m, other=float("inf")))
        else:
            b_lse = lse_rows(tl.load(lse_log2 + o_m))
        # S^T = K Q^T [BLOCK_N, BLOCK_M]
        if BLOCK_DT > 0:
            # Q^T's head dims past BLOCK_D [BLOCK_DT, BLOCK_M]
            o_dt = BLOCK_D + tl.arange(0, BLOCK_DT)
            if TMA:
                b_qt2 = tl.trans(q2_desc.load([start_m, BLOCK_D]))
            else:
                b_qt2 = load_tile(q + o_m[None, :] * stride_qs + o_dt[:, None], m_m[None, :],
                                  o_dt[:, None] < D, CHECK_ROWS, BLOCK_D + BLOCK_DT > D)
            b_st = score_dot_parts(b_k, dot_operand(b_qt, UPCAST), b_k2,
                                   dot_operand(b_qt2, UPCAST), DOT_PRECISION)
        else:
            b_st = score_dot(b_k, dot_operand(b_qt, UPCAST), DOT_PRECISION)
        b_st, b_tt = attention_scores(
            b_st, qk_scale, o_m[None, :], o_n[:, None], m_m[None, :], m_n[:, None], S_q, S_k,
            left, right, chunk, softcap_log2, alibi_log2, b_gk, attn_mask, stride_amq,
            stride_amk, EDGE_TILE, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_SOFTCAP, HAS_ALIBI,
            HAS_GATE, ATTN_MASK_KIND, not FOLD_SCALE)
        b_pt = exp2_shifted(b_st, qk_scale, b_lse[None, :], FOLD_SCALE)
        # dO tile [BLOCK_M, BLOCK_DV]
        if TMA:
            b_do = do_desc.load([start_m, 0])
        else:
            b_do = load_tile(do + o_m[:, None] * stride_dos + o_dv[None, :], m_m[:, None],
                             o_dv[None, :] < DV, CHECK_ROWS, BLOCK_DV != DV)
        b_do = dot_operand(b_do, UPCAST)
        if PARTS & 2:
            # dP^T = V dO^T [BLOCK_N, BLOCK_M], issued before dV's product (faster)
            b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PRECISION)
        if DROPOUT:
            b_keep = dropout_keep(seed, i_b, i_h, o_m, start_n, dropout_p, BLOCK_N, True)
            b_zpt = tl.where(b_keep, b_pt * (1.0 / (1.0 - dropout_p)), 0.0)
            if PARTS & 2:
                b_dpt = tl.where(b_keep, b_dpt * (1.0 / (1.0 - dropout_p)), 0.0)
        else:
            b_zpt = b_pt
        if PARTS & 1:
            # dV += P^T dO [BLOCK_N, BLOCK_DV]
            b_dv = tl.dot(dot_operand(round_to(b_zpt, do.dtype.element_ty), UPCAST), b_do, b_dv,
                          input_precision=DOT_PRECISION)
        if PARTS & 2:
            if CHECK_ROWS:
                b_delta = tl.load(delta + o_m, mask=m_m, other=0.0)
            else:
                b_delta = tl.load(delta + o_m)
            b_dst = b_pt * (b_dpt - b_delta[None, :])
            if HAS_GATE:
                # [BLOCK_N]
                b_dgk -= tl.sum(b_dst, 1)
            if HAS_SOFTCAP:
                b_dst = b_dst * (1.0 - b_tt * b_tt)
            b_dst = dot_operand(round_to(b_dst, q.dtype.element_ty), UPCAST)
            # dK += dS^T Q [BLOCK_N, BLOCK_D]
            b_dk = tl.dot(b_dst, tl.trans(dot_operand(b_qt, UPCAST)), b_dk,
                          input_precision=DOT_PRECISION)
            if BLOCK_DT > 0:
                b_dk2 = tl.dot(b_dst, tl.trans(dot_operand(b_qt2, UPCAST)), b_dk2,
                               input_precision=DOT_PRECISION)
            if DQ_ATOMIC:
                # dQ += dS K [BLOCK_M, BLOCK_D], summed over the key tiles by fp32 atomics. Rows
                # of keys past S_k are zeroed: unmasked, their P = exp2(0 - lse) overflows to inf
                # where lse < -128, and inf times their zero keys made dQ NaN.
                b_dst = tl.where(m_n[:, None], b_dst, 0.0)
                b_dq = tl.dot(tl.trans(b_dst), b_k, input_precision=DOT_PRECISION)
                tl.atomic_add(dq_acc + o_m[:, None] * stride_dqas + o_d[None, :], b_dq,
                              mask=m_m[:, None] & (o_d[None, :] < D), sem="relaxed")
                if BLOCK_DT > 0:
                    b_dq2 = tl.dot(tl.trans(b_dst), b_k2, input_precision=DOT_PRECISION)
                    tl.atomic_add(dq_acc + o_m[:, None] * stride_dqas + o_dt[None, :], b_dq2,
                                  mask=m_m[:, None] & (o_dt[None, :] < D), sem="relaxed")
    return b_dk, b_dk2, b_dv, b_dgk


@triton.jit
def attention_bwd_dkdv_kernel(
    q, k, v, do, lse_log2, delta, alibi, g_cum, attn_mask, dropout_seed, cu_seqlens_q,
    cu_seqlens_k, dk, dv, dgk, dq_acc,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_ab, stride_ah,
    stride_gb, stride_gs, stride_gh,
    stride_amb, stride_amh, stride_amq, stride_amk,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_lb, stride_lh, stride_dgkb, stride_dgkh,
    stride_dqab, stride_dqas, stride_dqah,
    S_q, S_k, G, sm_scale, qk_scale, softcap_log2, left, right, chunk, dropout_p, seq_bucket,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_GATE: tl.constexpr, ATTN_MASK_KIND: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,
    DROPOUT: tl.constexpr, IS_VARLEN: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FOLD_SCALE: tl.constexpr, PARTS: tl.constexpr = 3,
    BLOCK_DT: tl.constexpr = 0, TMA: tl.constexpr = False,
):
    """dK, dV of one key tile of key/value head i_hk, summed over its G query heads; with a
    gate, also dgk[b, h, j] = -sum_i dS[i, j] for each of those heads. Where ``DQ_ATOMIC``,
    also dQ / scale, added with fp32 atomics into the zeroed ``dq_acc`` (laid out as q), so
    that no dQ kernel recomputes S and dP (faster, not bitwise deterministic).

    ``PARTS``: 3 computes both gradients; 1 dV alone (and S^T), 2 dK alone (and S^T, dP^T,
    dS^T, the gate's and dQ's shares): at large head dims one program holding both [BLOCK_N,
    D] accumulators spills, so the launcher runs the kernel twice, once per part, computing
    S^T twice. ``BLOCK_DT``: q's and k's head dims in two tiles, as the forward's. ``TMA``:
    q's and dO's tiles read through tensor descriptors made per query head (16-bit inputs
    whose rows meet their alignment)."""
    sm_scale = tl.cast(sm_scale, tl.float32)  # Inductor may pass Python floats as fp64
    qk_scale = tl.cast(qk_scale, tl.float32)
    softcap_log2 = tl.cast(softcap_log2, tl.float32)
    dropout_p = tl.cast(dropout_p, tl.float32)
    seed = 0
    if DROPOUT:
        seed = tl.load(dropout_seed)
    i_n = tl.program_id(0)
    i_hk = tl.program_id(1).to(tl.int64)
    i_b = tl.program_id(2).to(tl.int64)
    # torch<=2.13: the packed sequence's offsets and lengths are loaded inline, not by a
    # helper (see the end of common.py)
    q_start = 0
    k_start = 0
    if IS_VARLEN:
        q_start = tl.load(cu_seqlens_q + i_b).to(tl.int64)
        k_start = tl.load(cu_seqlens_k + i_b).to(tl.int64)
        S_q = (tl.load(cu_seqlens_q + i_b + 1) - q_start).to(tl.int32)
        S_k = (tl.load(cu_seqlens_k + i_b + 1) - k_start).to(tl.int32)
    start_n = i_n * BLOCK_N
    if IS_VARLEN:
        if start_n >= S_k:  # a tile past this sequence's end
            return
    k += i_b * stride_kb + k_start * stride_ks + i_hk * stride_kh
    v += i_b * stride_vb + k_start * stride_vs + i_hk * stride_vh
    dk += i_b * stride_dkb + k_start * stride_dks + i_hk * stride_dkh
    dv += i_b * stride_dvb + k_start * stride_dvs + i_hk * stride_dvh

    o_n = start_n + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    m_n = o_n < S_k
    # [BLOCK_N, BLOCK_D], [BLOCK_N, BLOCK_DV]
    b_k = dot_operand(load_tile(k + o_n[:, None] * stride_ks + o_d[None, :], m_n[:, None],
                                o_d[None, :] < D, True, BLOCK_D > D), UPCAST)
    b_k2 = b_k  # [BLOCK_N, BLOCK_DT]: the head dims past BLOCK_D (placeholders without)
    b_dk2 = 0.0
    if BLOCK_DT > 0:
        o_dt = BLOCK_D + tl.arange(0, BLOCK_DT)
        b_k2 = dot_operand(load_tile(k + o_n[:, None] * stride_ks + o_dt[None, :],
                                     m_n[:, None], o_dt[None, :] < D, True,
                                     BLOCK_D + BLOCK_DT > D), UPCAST)
        b_dk2 = tl.zeros([BLOCK_N, BLOCK_DT], dtype=tl.float32)
    b_v = dot_operand(load_tile(v + o_n[:, None] * stride_vs + o_dv[None, :], m_n[:, None],
                                o_dv[None, :] < DV, True, BLOCK_DV != DV), UPCAST)
    b_dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    lo, u_lo, u_hi, hi = query_tile_range(start_n, S_q, S_k, left, right, chunk, HAS_LEFT,
                                          HAS_RIGHT, HAS_CHUNK, BLOCK_M, BLOCK_N)
    for i_g in range(0, G):
        i_h = i_hk * G + i_g
        p_q = q + i_b * stride_qb + q_start * stride_qs + i_h * stride_qh
        p_do = do + i_b * stride_dob + q_start * stride_dos + i_h * stride_doh
        descs = (p_q, p_q, p_do)  # (placeholders without TMA)
        if TMA:
            descs = row_descriptors(p_q, p_do, S_q, stride_qs, stride_dos, D, DV, BLOCK_M,
                                    BLOCK_D, BLOCK_DT, BLOCK_DV)
        row = i_b * stride_lb + i_h * stride_lh + q_start  # lse, delta: rows of this head
        p_lse = lse_log2 + row
        p_delta = delta + row
        p_dqa = dq_acc
        if DQ_ATOMIC:
            p_dqa = dq_acc + i_b * stride_dqab + q_start * stride_dqas + i_h * stride_dqah
        alibi_log2 = 0.0
        if HAS_ALIBI:
            alibi_log2 = -tl.load(alibi + i_b * stride_ab + i_h * stride_ah) * LOG2E
        b_gk = 0.0
        if HAS_GATE:
            p_g = g_cum + i_b * stride_gb + k_start * stride_gs + i_h * stride_gh
            b_gk = tl.load(p_g + o_n * stride_gs, mask=m_n, other=0.0)[:, None]
        p_attn_mask = attn_mask
        if ATTN_MASK_KIND != 0:
            p_attn_mask = attn_mask + i_b * stride_amb + i_h * stride_amh
        # [BLOCK_N]
        b_dgk = tl.zeros([BLOCK_N], dtype=tl.float32)
        # [lo, u_lo) masked (causal bound, a chunk's start), [u_lo, u_full) unmasked without
        # row masks (the tiles wholly inside S_q), [u_full, u_hi) unmasked with them (the
        # last, partial one), [u_hi, hi) masked (a window's left bound, a chunk's end)
        u_full = tl.maximum(u_lo, tl.minimum(u_hi, (S_q // BLOCK_M) * BLOCK_M))
        for part in tl.static_range(4):
            if (part != 0 or HAS_RIGHT or HAS_CHUNK) and (part != 3 or HAS_LEFT or HAS_CHUNK):
                if part == 0:
                    start_m, end_m = lo, u_lo
                elif part == 1:
                    start_m, end_m = u_lo, u_full
                elif part == 2:
                    start_m, end_m = u_full, u_hi
                else:
                    start_m, end_m = u_hi, hi
                # triton<=3.6: p_attn_mask (None without a mask) cannot be a tuple's element
                b_dk, b_dk2, b_dv, b_dgk = _dkdv_query_tiles(
                    (b_dk, b_dk2, b_dv, b_dgk), b_k, b_k2, b_v, b_gk, p_q, p_do, descs, p_lse,
                    p_delta, p_attn_mask, (stride_amq, stride_amk), p_dqa, stride_qs, stride_dos,
                    stride_dqas, start_n, o_n, m_n, start_m, end_m, S_q, S_k,
                    (qk_scale, softcap_log2, alibi_log2), (left, right, chunk),
                    D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, part == 0 or part == 3, part != 1,
                    HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_SOFTCAP, HAS_ALIBI, HAS_GATE,
                    ATTN_MASK_KIND, DQ_ATOMIC, UPCAST, DOT_PRECISION,
                    (seed, i_b, i_h, dropout_p), DROPOUT, FOLD_SCALE, PARTS, BLOCK_DT, TMA)
        if HAS_GATE and PARTS & 2:
            tl.store(dgk + i_b * stride_dgkb + i_h * stride_dgkh + k_start + o_n, b_dgk,
                     mask=m_n)

    if PARTS & 2:
        b_dk = b_dk * sm_scale
        tl.store(dk + o_n[:, None] * stride_dks + o_d[None, :],
                 round_to(b_dk, dk.dtype.element_ty), mask=m_n[:, None] & (o_d[None, :] < D))
        if BLOCK_DT > 0:
            tl.store(dk + o_n[:, None] * stride_dks + o_dt[None, :],
                     round_to(b_dk2 * sm_scale, dk.dtype.element_ty),
                     mask=m_n[:, None] & (o_dt[None, :] < D))
    if PARTS & 1:
        tl.store(dv + o_n[:, None] * stride_dvs + o_dv[None, :],
                 round_to(b_dv, dv.dtype.element_ty), mask=m_n[:, None] & (o_dv[None, :] < DV))
