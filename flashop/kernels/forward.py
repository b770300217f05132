"""FlashAttention-2 forward: one program per (query tile, head, batch), online softmax in exp2.

Scores are kept in base-2 units (``qk_scale = scale * log2(e)``); the log-sum-exp is
written in natural-log units, the convention of the public API. Score modifiers (window,
softcap, ALiBi, gate, ``attn_mask``) are compile-time flags: without them the kernel is the
plain one.
"""

import triton
import triton.language as tl

from flashop.kernels.common import (
    LN2, LOG2E, attention_scores, dot_operand, key_tile_range, load_tile,
)


@triton.jit
def _fwd_key_tiles(
    acc, l_i, m_i, b_q, k, v, g, mask, stride_ks, stride_vs, stride_gs, stride_mq,
    stride_mk, o_m, m_m, lo, hi, S_q, S_k, qk_scale, softcap2, alibi2, left, right,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_GATE: tl.constexpr,
    MASK_KIND: tl.constexpr, TMA: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold the key tiles in [lo, hi) into the running (acc, l_i, m_i).

    ``MASK`` tiles may cross the window (causal) bounds or the end of the keys; the others
    are inside for every row of the query tile and skip that masking. Where ``TMA``, ``k``
    and ``v`` are tensor descriptors of this (batch, head)'s keys and values, whose loads
    read rows past S_k and columns past D as 0.
    """
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        o_n = start_n + tl.arange(0, BLOCK_N)
        m_n = o_n < S_k
        # K^T tile [BLOCK_D, BLOCK_N]
        if TMA:
            b_kt = tl.trans(k.load([start_n, 0]))
        else:
            b_kt = load_tile(k + o_n[None, :] * stride_ks + o_d[:, None], m_n[None, :],
                             o_d[:, None] < D, MASK, BLOCK_D != D)
        # [BLOCK_M, BLOCK_N]
        b_s = tl.dot(b_q, dot_operand(b_kt, UPCAST), input_precision=DOT_PRECISION) * qk_scale
        b_gk = 0.0
        if HAS_GATE:
            b_gk = tl.load(g + o_n * stride_gs, mask=m_n, other=0.0)[None, :] * LOG2E
        b_s, _ = attention_scores(
            b_s, o_m[:, None], o_n[None, :], m_m[:, None], m_n[None, :], S_q, S_k, left, right,
            softcap2, alibi2, b_gk, mask, stride_mq, stride_mk, MASK, HAS_LEFT, HAS_RIGHT,
            HAS_SOFTCAP, HAS_ALIBI, HAS_GATE, MASK_KIND)
        # [BLOCK_M]
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        if MASK or MASK_KIND != 0:
            # a row with no key so far keeps m = -inf; subtract 0 so exp2 gives 0, not NaN
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        b_p = tl.math.exp2(b_s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        # [BLOCK_M]
        l_i = l_i * alpha + tl.sum(b_p, 1)
        if TMA:
            b_v = v.load([start_n, 0])
        else:
            b_v = load_tile(v + o_n[:, None] * stride_vs + o_dv[None, :], m_n[:, None],
                            o_dv[None, :] < DV, MASK, BLOCK_DV != DV)
        # [BLOCK_M, BLOCK_DV]
        acc = tl.dot(dot_operand(b_p.to(b_v.dtype), UPCAST), dot_operand(b_v, UPCAST),
                     acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attention_fwd_kernel(
    q, k, v, o, lse, lse_log2, alibi, g, mask, cu_seqlens_q, cu_seqlens_k,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_ab, stride_ah,
    stride_gb, stride_gs, stride_gh,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_lb, stride_lh,
    S_q, S_k, G, qk_scale, softcap2, left, right, seq_bucket,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_GATE: tl.constexpr, MASK_KIND: tl.constexpr, IS_VARLEN: tl.constexpr,
    TMA: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """o[b, i, h] = softmax_j(score(i, j)) v[b, j, h // G], score as attention_scores.

    Also writes lse[b, h, i] (natural log, fp32) at ``b * stride_lb + h * stride_lh + i``,
    and the same in base 2 at the same place of ``lse_log2``: the backward's P = exp2(s -
    lse_log2) with the forward's own rounding (the round trip through natural-log units
    costs P about 1e-5 of relative accuracy at scores of a few hundred).
    Where ``IS_VARLEN``, batch entry b is the packed sequence ``cu_seqlens_q[b] ..
    cu_seqlens_q[b + 1]`` (keys likewise; S_q, S_k are then the longest lengths) and the
    tensors' batch strides are 0.
    ``alibi`` (slopes), ``g`` (the cumulative gate, fp32, read through its (batch, seq,
    head) strides) and ``mask`` are read only where their flag is set. ``seq_bucket`` is
    not read: it is the autotuner's key for the lengths (flashop/launch.py).
    Where ``TMA``, the key and value tiles are read through tensor descriptors (Hopper's
    copy engine) made per program; the launcher sets it only where k and v meet the
    descriptors' alignment (16-byte base and row strides).
    """
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor may pass a Python float as fp64
    softcap2 = tl.cast(softcap2, tl.float32)
    i_m = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    i_b = tl.program_id(2).to(tl.int64)
    i_hk = i_h // G
    # the sequence's offsets and lengths where packed (not through a helper's return
    # values: torch < 2.13 would then count cu_seqlens as written, see common.py)
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
    o += i_b * stride_ob + q_start * stride_os + i_h * stride_oh
    lse += i_b * stride_lb + i_h * stride_lh + q_start
    lse_log2 += i_b * stride_lb + i_h * stride_lh + q_start
    if TMA:
        # (a sequence without keys loads no tile; its descriptors keep one row)
        n_rows = tl.maximum(S_k, 1)
        k = tl.make_tensor_descriptor(k, shape=[n_rows, D], strides=[stride_ks, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])
        v = tl.make_tensor_descriptor(v, shape=[n_rows, DV], strides=[stride_vs, 1],
                                      block_shape=[BLOCK_N, BLOCK_DV])

    o_m = start_m + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    m_m = o_m < S_q
    # [BLOCK_M, BLOCK_D]
    b_q = load_tile(q + o_m[:, None] * stride_qs + o_d[None, :], m_m[:, None], o_d[None, :] < D,
                    True, BLOCK_D != D)
    b_q = dot_operand(b_q, UPCAST)

    alibi2 = 0.0
    if HAS_ALIBI:
        alibi2 = -tl.load(alibi + i_b * stride_ab + i_h * stride_ah) * LOG2E
    b_gq = 0.0
    if HAS_GATE:
        g += i_b * stride_gb + k_start * stride_gs + i_h * stride_gh
        # query i sits at key position i + S_k - S_q
        o_gq = o_m + (S_k - S_q)
        b_gq = tl.load(g + o_gq * stride_gs, mask=m_m & (o_gq >= 0), other=0.0) * LOG2E
    if MASK_KIND != 0:
        mask += i_b * stride_mb + i_h * stride_mh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    lo, u_lo, u_hi, hi = key_tile_range(start_m, S_q, S_k, left, right, HAS_LEFT, HAS_RIGHT,
                                        BLOCK_M, BLOCK_N)
    if HAS_LEFT:
        acc, l_i, m_i = _fwd_key_tiles(
            acc, l_i, m_i, b_q, k, v, g, mask, stride_ks, stride_vs, stride_gs, stride_mq,
            stride_mk, o_m, m_m, lo, u_lo, S_q, S_k, qk_scale, softcap2, alibi2, left, right,
            D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
            HAS_GATE, MASK_KIND, TMA, UPCAST, DOT_PRECISION)
    acc, l_i, m_i = _fwd_key_tiles(
        acc, l_i, m_i, b_q, k, v, g, mask, stride_ks, stride_vs, stride_gs, stride_mq,
        stride_mk, o_m, m_m, u_lo, u_hi, S_q, S_k, qk_scale, softcap2, alibi2, left, right,
        D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
        HAS_GATE, MASK_KIND, TMA, UPCAST, DOT_PRECISION)
    acc, l_i, m_i = _fwd_key_tiles(
        acc, l_i, m_i, b_q, k, v, g, mask, stride_ks, stride_vs, stride_gs, stride_mq,
        stride_mk, o_m, m_m, u_hi, hi, S_q, S_k, qk_scale, softcap2, alibi2, left, right,
        D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
        HAS_GATE, MASK_KIND, TMA, UPCAST, DOT_PRECISION)

    # rows that attend no key (outside the window, masked out, or S_k == 0): output 0, lse -inf
    m_empty = l_i == 0.0
    l_safe = tl.where(m_empty, 1.0, l_i)
    b_o = acc / l_safe[:, None]
    tl.store(o + o_m[:, None] * stride_os + o_dv[None, :], b_o.to(o.dtype.element_ty),
             mask=m_m[:, None] & (o_dv[None, :] < DV))
    # the queries' gate G_i, constant along each row, only shifts the log-sum-exp
    b_lse2 = tl.where(m_empty, float("-inf"), m_i + tl.math.log2(l_safe) + b_gq)
    tl.store(lse_log2 + o_m, b_lse2, mask=m_m)
    tl.store(lse + o_m, b_lse2 * LN2, mask=m_m)
