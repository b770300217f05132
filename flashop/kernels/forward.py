"""FlashAttention-2 forward: one program per (query tile, head, batch), online softmax in exp2.

Scores are kept in base-2 units (``qk_scale = scale * log2(e)``); the log-sum-exp is
written in natural-log units, the convention of the public API.
"""

import triton
import triton.language as tl

from flashop.kernels.common import LN2, dot_operand, key_tile_range, load_tile


@triton.jit
def _fwd_key_tiles(
    acc, l_i, m_i, b_q, k, v, stride_ks, stride_vs, o_m, lo, hi, S_q, S_k, qk_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MASK: tl.constexpr, IS_CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold the key tiles in [lo, hi) into the running (acc, l_i, m_i).

    ``MASK`` tiles may cross the causal diagonal or the end of the keys; the others are
    attended by every row of the query tile and skip all masking.
    """
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        o_n = start_n + tl.arange(0, BLOCK_N)
        m_n = o_n < S_k
        # K^T tile [BLOCK_D, BLOCK_N]
        b_kt = load_tile(k + o_n[None, :] * stride_ks + o_d[:, None], m_n[None, :],
                         o_d[:, None] < D, MASK, BLOCK_D != D)
        # [BLOCK_M, BLOCK_N]
        b_s = tl.dot(b_q, dot_operand(b_kt, UPCAST), input_precision=DOT_PRECISION) * qk_scale
        if MASK:
            m_keep = m_n[None, :]
            if IS_CAUSAL:
                m_keep = m_keep & (o_n[None, :] <= o_m[:, None] + (S_k - S_q))
            b_s = tl.where(m_keep, b_s, float("-inf"))
            # [BLOCK_M]
            m_new = tl.maximum(m_i, tl.max(b_s, 1))
            # a row with no key so far keeps m = -inf; subtract 0 so exp2 gives 0, not NaN
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            # [BLOCK_M]
            m_new = tl.maximum(m_i, tl.max(b_s, 1))
            m_sub = m_new
        b_p = tl.math.exp2(b_s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        # [BLOCK_M]
        l_i = l_i * alpha + tl.sum(b_p, 1)
        b_v = load_tile(v + o_n[:, None] * stride_vs + o_dv[None, :], m_n[:, None],
                        o_dv[None, :] < DV, MASK, BLOCK_DV != DV)
        # [BLOCK_M, BLOCK_DV]
        acc = tl.dot(dot_operand(b_p.to(v.dtype.element_ty), UPCAST), dot_operand(b_v, UPCAST),
                     acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attention_fwd_kernel(
    q, k, v, o, lse,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    S_q, S_k, H, G, qk_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """o[b, i, h] = softmax_j(scale * q[b, i, h] . k[b, j, h // G]) v[b, j, h // G].

    Also writes lse[b, h, i] (natural log) into the contiguous (B, H, S_q) fp32 ``lse``.
    """
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor may pass a Python float as fp64
    i_m = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    i_b = tl.program_id(2).to(tl.int64)
    i_hk = i_h // G
    q += i_b * stride_qb + i_h * stride_qh
    k += i_b * stride_kb + i_hk * stride_kh
    v += i_b * stride_vb + i_hk * stride_vh
    o += i_b * stride_ob + i_h * stride_oh
    lse += (i_b * H + i_h) * S_q

    start_m = i_m * BLOCK_M
    o_m = start_m + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    m_m = o_m < S_q
    # [BLOCK_M, BLOCK_D]
    b_q = load_tile(q + o_m[:, None] * stride_qs + o_d[None, :], m_m[:, None], o_d[None, :] < D,
                    True, BLOCK_D != D)
    b_q = dot_operand(b_q, UPCAST)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    lo_mask, hi = key_tile_range(start_m, S_q, S_k, IS_CAUSAL, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_key_tiles(
        acc, l_i, m_i, b_q, k, v, stride_ks, stride_vs, o_m, 0, lo_mask, S_q, S_k, qk_scale,
        D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, False, IS_CAUSAL, UPCAST, DOT_PRECISION)
    acc, l_i, m_i = _fwd_key_tiles(
        acc, l_i, m_i, b_q, k, v, stride_ks, stride_vs, o_m, lo_mask, hi, S_q, S_k, qk_scale,
        D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, True, IS_CAUSAL, UPCAST, DOT_PRECISION)

    # rows that attend no key (causal with S_q > S_k, or S_k == 0): output 0, lse -inf
    m_empty = l_i == 0.0
    l_safe = tl.where(m_empty, 1.0, l_i)
    b_o = acc / l_safe[:, None]
    tl.store(o + o_m[:, None] * stride_os + o_dv[None, :], b_o.to(o.dtype.element_ty),
             mask=m_m[:, None] & (o_dv[None, :] < DV))
    b_lse = tl.where(m_empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    tl.store(lse + o_m, b_lse, mask=m_m)
