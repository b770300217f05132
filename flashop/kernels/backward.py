"""FlashAttention-2 backward: dK/dV and dQ, deterministic (no atomics) by default.

Scores are recomputed from q, k and the forward's base-2 log-sum-exp (``lse_log2``); the
N x N probabilities are never stored. ``lse_log2`` and ``delta`` are contiguous (B, H, S_q)
fp32.

- ``attention_bwd_dq_kernel``: one program per query tile of one query head. It runs first:
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

from flashop.kernels.backward_buffer import delta_rows
from flashop.kernels.common import (
    LOG2E, attention_scores, dot_operand, dropout_keep, exp2_shifted, key_tile_range,
    load_tile, query_tile_range, round_to, score_dot,
)


@triton.jit
def _lse_rows(lse_log2):
    """The forward's base-2 lse of a tile of rows; a row that attended nothing (-inf)
    becomes +inf, so its recomputed probabilities exp2(s - lse) are exactly 0."""
    return tl.where(lse_log2 == float("-inf"), float("inf"), lse_log2)


@triton.jit
def _dkdv_query_tiles(
    b_dk, b_dv, b_dgk, b_k, b_v, b_gk, q, do, lse_log2, delta, attn_mask, dq_acc,
    stride_qs, stride_dos, stride_amq, stride_amk, stride_dqas, start_n, o_n, m_n, lo, hi,
    S_q, S_k, qk_scale, softcap_log2, alibi_log2, left, right, chunk,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EDGE_TILE: tl.constexpr, CHECK_ROWS: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_GATE: tl.constexpr,
    ATTN_MASK_KIND: tl.constexpr, DQ_ATOMIC: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, seed, i_b, i_h, dropout_p, DROPOUT: tl.constexpr,
    FOLD_SCALE: tl.constexpr, PARTS: tl.constexpr = 3,
):
    """Accumulate into (b_dk, b_dv, b_dgk) the query tiles in [lo, hi) of one query head;
    where ``DQ_ATOMIC``, also add dS K into the fp32 ``dq_acc`` (rows of stride
    ``stride_dqas``). ``PARTS`` (as attention_bwd_dkdv_kernel's) leaves out dV's product
    (2) or dP's, dS's and dK's (1).

    Where ``CHECK_ROWS`` (a range that may reach past S_q), rows past S_q load q = dO = 0 and
    lse = +inf, so they add nothing; elsewhere the loads are unmasked (faster). Keys past
    S_k were loaded as 0 and their rows of dk,
    dv and dgk are never stored, so no key mask is needed.
    """
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    # counted from 0 rather than range(lo, hi, BLOCK_M): the compiled loop is faster
    for i_t in range(0, tl.cdiv(hi - lo, BLOCK_M)):
        start_m = tl.multiple_of(lo + i_t * BLOCK_M, BLOCK_M)
        o_m = start_m + tl.arange(0, BLOCK_M)
        m_m = o_m < S_q
        # Q^T tile [BLOCK_D, BLOCK_M]
        b_qt = load_tile(q + o_m[None, :] * stride_qs + o_d[:, None], m_m[None, :],
                         o_d[:, None] < D, CHECK_ROWS, BLOCK_D != D)
        if CHECK_ROWS:
            b_lse = _lse_rows(tl.load(lse_log2 + o_m, mask=m_m, other=float("inf")))
        else:
            b_lse = _lse_rows(tl.load(lse_log2 + o_m))
        # S^T = K Q^T [BLOCK_N, BLOCK_M]
        b_st = score_dot(b_k, dot_operand(b_qt, UPCAST), DOT_PRECISION)
        b_st, b_tt = attention_scores(
            b_st, qk_scale, o_m[None, :], o_n[:, None], m_m[None, :], m_n[:, None], S_q, S_k,
            left, right, chunk, softcap_log2, alibi_log2, b_gk, attn_mask, stride_amq,
            stride_amk, EDGE_TILE, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_SOFTCAP, HAS_ALIBI,
            HAS_GATE, ATTN_MASK_KIND, not FOLD_SCALE)
        b_pt = exp2_shifted(b_st, qk_scale, b_lse[None, :], FOLD_SCALE)
        # dO tile [BLOCK_M, BLOCK_DV]
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
            if DQ_ATOMIC:
                # dQ += dS K [BLOCK_M, BLOCK_D], summed over the key tiles by fp32 atomics. Rows
                # of keys past S_k are zeroed: unmasked, their P = exp2(0 - lse) overflows to inf
                # where lse < -128, and inf times their zero keys made dQ NaN.
                b_dst = tl.where(m_n[:, None], b_dst, 0.0)
                b_dq = tl.dot(tl.trans(b_dst), b_k, input_precision=DOT_PRECISION)
                tl.atomic_add(dq_acc + o_m[:, None] * stride_dqas + o_d[None, :], b_dq,
                              mask=m_m[:, None] & (o_d[None, :] < D), sem="relaxed")
    return b_dk, b_dv, b_dgk


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
):
    """dK, dV of one key tile of key/value head i_hk, summed over its G query heads; with a
    gate, also dgk[b, h, j] = -sum_i dS[i, j] for each of those heads. Where ``DQ_ATOMIC``,
    also dQ / scale, added with fp32 atomics into the zeroed ``dq_acc`` (laid out as q), so
    that no dQ kernel recomputes S and dP (faster, not bitwise deterministic).

    ``PARTS``: 3 computes both gradients; 1 dV alone (and S^T), 2 dK alone (and S^T, dP^T,
    dS^T, the gate's and dQ's shares): at large head dims one program holding both [BLOCK_N,
    D] accumulators spills, so the launcher runs the kernel twice, once per part, computing
    S^T twice."""
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
    # torch<2.13: the packed sequence's offsets and lengths are loaded inline, not by a
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
                                o_d[None, :] < D, True, BLOCK_D != D), UPCAST)
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
                b_dk, b_dv, b_dgk = _dkdv_query_tiles(
                    b_dk, b_dv, b_dgk, b_k, b_v, b_gk, p_q, p_do, p_lse, p_delta, p_attn_mask,
                    p_dqa, stride_qs, stride_dos, stride_amq, stride_amk, stride_dqas,
                    start_n, o_n, m_n, start_m, end_m, S_q, S_k, qk_scale, softcap_log2,
                    alibi_log2, left, right, chunk,
                    D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, part == 0 or part == 3, part != 1,
                    HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_SOFTCAP, HAS_ALIBI, HAS_GATE,
                    ATTN_MASK_KIND,
                    DQ_ATOMIC, UPCAST, DOT_PRECISION, seed, i_b, i_h, dropout_p, DROPOUT,
                    FOLD_SCALE, PARTS)
        if HAS_GATE and PARTS & 2:
            tl.store(dgk + i_b * stride_dgkb + i_h * stride_dgkh + k_start + o_n, b_dgk,
                     mask=m_n)

    if PARTS & 2:
        b_dk = b_dk * sm_scale
        tl.store(dk + o_n[:, None] * stride_dks + o_d[None, :],
                 round_to(b_dk, dk.dtype.element_ty), mask=m_n[:, None] & (o_d[None, :] < D))
    if PARTS & 1:
        tl.store(dv + o_n[:, None] * stride_dvs + o_dv[None, :],
                 round_to(b_dv, dv.dtype.element_ty), mask=m_n[:, None] & (o_dv[None, :] < DV))


@triton.jit
def _dq_key_tiles(
    b_dq, b_dgq, b_q, b_do, b_lse, b_delta, k, v, g_cum, attn_mask, dattn_mask, stride_ks,
    stride_vs, stride_gs, stride_amq, stride_amk, stride_damq, o_m, m_m, lo, hi, S_q, S_k,
    qk_scale, softcap_log2, alibi_log2, left, right, chunk,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, EDGE_TILE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_GATE: tl.constexpr,
    ATTN_MASK_KIND: tl.constexpr, ATTN_MASK_GRAD: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, seed, i_b, i_h, dropout_p, DROPOUT: tl.constexpr,
    FOLD_SCALE: tl.constexpr, DELTA_PASS: tl.constexpr,
):
    """Accumulate into (b_dq, b_dgq) the key tiles in [lo, hi); ``EDGE_TILE`` as in the forward.
    Where ``ATTN_MASK_GRAD``, write dS into ``dattn_mask`` (rows of stride ``stride_damq``).
    Where ``DELTA_PASS``, only add rowsum(Z * dP) (= rowsum(dO * O) of the unrounded output)
    into ``b_dgq``."""
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    for i_t in range(0, tl.cdiv(hi - lo, BLOCK_N)):  # counted from 0, as in _dkdv_query_tiles
        start_n = tl.multiple_of(lo + i_t * BLOCK_N, BLOCK_N)
        o_n = start_n + tl.arange(0, BLOCK_N)
        m_n = o_n < S_k
        # K^T [BLOCK_D, BLOCK_N], V^T [BLOCK_DV, BLOCK_N]
        b_kt = dot_operand(load_tile(k + o_n[None, :] * stride_ks + o_d[:, None], m_n[None, :],
                                     o_d[:, None] < D, EDGE_TILE, BLOCK_D != D), UPCAST)
        b_vt = dot_operand(load_tile(v + o_n[None, :] * stride_vs + o_dv[:, None], m_n[None, :],
                                     o_dv[:, None] < DV, EDGE_TILE, BLOCK_DV != DV), UPCAST)
        # [BLOCK_M, BLOCK_N]
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
            b_dq = tl.dot(dot_operand(round_to(b_ds, k.dtype.element_ty), UPCAST), tl.trans(b_kt),
                          b_dq, input_precision=DOT_PRECISION)
    return b_dq, b_dgq


@triton.jit
def _dq_key_ranges(
    b_dgq, b_q, b_do, b_lse, b_delta, k, v, g_cum, attn_mask, dattn_mask, stride_ks, stride_vs,
    stride_gs, stride_amq, stride_amk, stride_damq, o_m, m_m, lo, u_lo, u_hi, hi, S_q, S_k,
    qk_scale, softcap_log2, alibi_log2, left, right, chunk,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_GATE: tl.constexpr, ATTN_MASK_KIND: tl.constexpr, ATTN_MASK_GRAD: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, seed, i_b, i_h, dropout_p,
    DROPOUT: tl.constexpr, FOLD_SCALE: tl.constexpr, DELTA_PASS: tl.constexpr,
):
    """_dq_key_tiles over a query tile's key ranges (key_tile_range): the left edge tiles, the
    tiles every row attends, the right edge tiles; returns (dQ unscaled, b_dgq)."""
    b_dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if HAS_LEFT or HAS_CHUNK:
        b_dq, b_dgq = _dq_key_tiles(
            b_dq, b_dgq, b_q, b_do, b_lse, b_delta, k, v, g_cum, attn_mask, dattn_mask, stride_ks,
            stride_vs, stride_gs, stride_amq, stride_amk, stride_damq, o_m, m_m, lo, u_lo, S_q,
            S_k, qk_scale, softcap_log2, alibi_log2, left, right, chunk, D, DV, BLOCK_D, BLOCK_DV,
            BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_SOFTCAP, HAS_ALIBI, HAS_GATE,
            ATTN_MASK_KIND,
            ATTN_MASK_GRAD, UPCAST, DOT_PRECISION, seed, i_b, i_h, dropout_p, DROPOUT,
            FOLD_SCALE, DELTA_PASS)
    b_dq, b_dgq = _dq_key_tiles(
        b_dq, b_dgq, b_q, b_do, b_lse, b_delta, k, v, g_cum, attn_mask, dattn_mask, stride_ks,
        stride_vs, stride_gs, stride_amq, stride_amk, stride_damq, o_m, m_m, u_lo, u_hi, S_q,
        S_k, qk_scale, softcap_log2, alibi_log2, left, right, chunk, D, DV, BLOCK_D, BLOCK_DV,
        BLOCK_N, False, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_SOFTCAP, HAS_ALIBI, HAS_GATE,
        ATTN_MASK_KIND,
        ATTN_MASK_GRAD, UPCAST, DOT_PRECISION, seed, i_b, i_h, dropout_p, DROPOUT, FOLD_SCALE,
        DELTA_PASS)
    b_dq, b_dgq = _dq_key_tiles(
        b_dq, b_dgq, b_q, b_do, b_lse, b_delta, k, v, g_cum, attn_mask, dattn_mask, stride_ks,
        stride_vs, stride_gs, stride_amq, stride_amk, stride_damq, o_m, m_m, u_hi, hi, S_q, S_k,
        qk_scale, softcap_log2, alibi_log2, left, right, chunk, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N,
        True, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_SOFTCAP, HAS_ALIBI, HAS_GATE, ATTN_MASK_KIND,
        ATTN_MASK_GRAD,
        UPCAST, DOT_PRECISION, seed, i_b, i_h, dropout_p, DROPOUT, FOLD_SCALE, DELTA_PASS)
    return b_dq, b_dgq


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
    DOT_PRECISION: tl.constexpr, FOLD_SCALE: tl.constexpr,
):
    """dQ of one query tile of query head i_h, and the tile's rows of delta (stored for the
    dK/dV kernel, launched after this one); with a gate, also dgq[b, h, i] = sum_j dS[i, j];
    where ``ATTN_MASK_GRAD``, dS into the contiguous (B, H, S_q, S_k) ``dattn_mask`` (``H``,
    the query heads, is read only for its offsets)."""
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
    # torch<2.13: the packed sequence's offsets and lengths are loaded inline, not by a
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

    o_m = start_m + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    m_m = o_m < S_q
    # [BLOCK_M, BLOCK_D], [BLOCK_M, BLOCK_DV]
    b_q = dot_operand(load_tile(q + o_m[:, None] * stride_qs + o_d[None, :], m_m[:, None],
                                o_d[None, :] < D, True, BLOCK_D != D), UPCAST)
    b_do = dot_operand(load_tile(do + o_m[:, None] * stride_dos + o_dv[None, :], m_m[:, None],
                                 o_dv[None, :] < DV, True, BLOCK_DV != DV), UPCAST)
    row = i_b * stride_lb + i_h * stride_lh + q_start + o_m  # lse, delta, dgq
    b_lse = _lse_rows(tl.load(lse_log2 + row, mask=m_m, other=float("inf")))
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
        _, b_sum = _dq_key_ranges(
            b_sum, b_q, b_do, b_lse, b_delta, k, v, g_cum, attn_mask, dattn_mask, stride_ks,
            stride_vs, stride_gs, stride_amq, stride_amk, S_k, o_m, m_m, lo, u_lo, u_hi, hi,
            S_q, S_k, qk_scale, softcap_log2, alibi_log2, left, right, chunk, D, DV, BLOCK_D,
            BLOCK_DV, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_SOFTCAP, HAS_ALIBI,
            HAS_GATE, ATTN_MASK_KIND, ATTN_MASK_GRAD, UPCAST, DOT_PRECISION, seed, i_b, i_h,
            dropout_p, DROPOUT, FOLD_SCALE, True)
        b_delta = b_sum - b_dlse
    tl.store(delta + row, b_delta, mask=m_m)
    b_dq, b_dgq = _dq_key_ranges(
        tl.zeros([BLOCK_M], dtype=tl.float32), b_q, b_do, b_lse, b_delta, k, v, g_cum,
        attn_mask, dattn_mask, stride_ks, stride_vs, stride_gs, stride_amq, stride_amk, S_k, o_m,
        m_m, lo, u_lo, u_hi, hi, S_q, S_k, qk_scale, softcap_log2, alibi_log2, left, right,
        chunk, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_CHUNK,
        HAS_SOFTCAP, HAS_ALIBI, HAS_GATE, ATTN_MASK_KIND, ATTN_MASK_GRAD, UPCAST, DOT_PRECISION,
        seed, i_b, i_h, dropout_p, DROPOUT, FOLD_SCALE, False)
    b_dq = b_dq * sm_scale
    tl.store(dq + o_m[:, None] * stride_dqs + o_d[None, :], round_to(b_dq, dq.dtype.element_ty),
             mask=m_m[:, None] & (o_d[None, :] < D))
    if HAS_GATE:
        tl.store(dgq + row, b_dgq, mask=m_m)
