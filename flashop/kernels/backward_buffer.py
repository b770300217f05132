"""The kernels around a backward that adds its gradients into an fp32 buffer (dQ by atomics
in the tl dK/dV kernel; the Gluon backward): ``attention_bwd_preprocess_kernel`` computes
the rows' delta = rowsum(dO * O) - dlse (which the dQ kernel otherwise computes) and zeroes
the buffer, ``attention_bwd_cast_kernel`` writes the buffer out in the gradients' dtype."""

import triton
import triton.language as tl

from flashop.kernels.common import round_to


@triton.jit
def attention_bwd_preprocess_kernel(
    o, do, dlse, delta,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    stride_dlb, stride_dlh, stride_dls,
    S_q, H, zero, zero_n, zero_chunk,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    ZERO_BLOCK: tl.constexpr,
):
    """delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d] - dlse[b, h, i]; and the fp32
    buffer ``zero`` of ``zero_n`` elements (the accumulators that the kernels after this one
    add into) zeroed, ``zero_chunk`` elements by each program (0: none)."""
    i_m = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    i_b = tl.program_id(2).to(tl.int64)
    # this program's chunk of the buffer
    i_p = (i_b * H + i_h) * tl.num_programs(0) + i_m
    z_start = i_p * zero_chunk
    z_end = tl.minimum(z_start + zero_chunk, zero_n)
    for z in range(z_start, z_end, ZERO_BLOCK):
        o_z = z + tl.arange(0, ZERO_BLOCK)
        tl.store(zero + o_z, tl.zeros([ZERO_BLOCK], tl.float32), mask=o_z < z_end)
    # 64-bit rows: a packed batch comes here as one sequence of all its tokens
    o_m = (i_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    o_dv = tl.arange(0, BLOCK_DV)
    m_m = o_m < S_q
    m_dv = o_dv < DV
    # [BLOCK_M, BLOCK_DV]
    b_o = tl.load(o + i_b * stride_ob + i_h * stride_oh + o_m[:, None] * stride_os + o_dv[None, :],
                  mask=m_m[:, None] & m_dv[None, :], other=0.0)
    b_do = tl.load(do + i_b * stride_dob + i_h * stride_doh + o_m[:, None] * stride_dos
                   + o_dv[None, :], mask=m_m[:, None] & m_dv[None, :], other=0.0)
    b_dlse = tl.load(dlse + i_b * stride_dlb + i_h * stride_dlh + o_m * stride_dls, mask=m_m,
                     other=0.0)
    tl.store(delta + (i_b * H + i_h) * S_q + o_m, delta_rows(b_o, b_do, b_dlse), mask=m_m)


@triton.jit
def attention_bwd_cast_kernel(acc, dq, dk, dv, n_q, n_kv, dq_scale, KV: tl.constexpr,
                              BLOCK: tl.constexpr):
    """The gradients that the kernels added into the fp32 buffer ``acc`` (dQ's ``n_q``
    elements, then, where ``KV``, dK's and dV's ``n_kv`` each), in the contiguous outputs'
    dtype: dQ times ``dq_scale``, dK and dV as they are (``dk`` and ``dv`` None where not
    ``KV``). Grid: (blocks of the longest, 3 where ``KV``, else 1)."""
    i_blk = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    o = i_blk * BLOCK + tl.arange(0, BLOCK)
    if which == 0:
        m_q = o < n_q
        # an fp32 product, as torch's in-place multiply by a Python float (Inductor passes
        # the float as fp64)
        b_dq = tl.load(acc + o, mask=m_q, other=0.0) * tl.cast(dq_scale, tl.float32)
        tl.store(dq + o, round_to(b_dq, dq.dtype.element_ty), mask=m_q)
    elif KV:
        m_kv = o < n_kv
        b_kv = tl.load(acc + n_q + (which - 1) * n_kv + o, mask=m_kv, other=0.0)
        if which == 1:
            tl.store(dk + o, round_to(b_kv, dk.dtype.element_ty), mask=m_kv)
        else:
            tl.store(dv + o, round_to(b_kv, dv.dtype.element_ty), mask=m_kv)


@triton.jit
def delta_rows(b_o, b_do, b_dlse):
    """delta = rowsum(dO * O) - dlse of a [BLOCK_M, BLOCK_DV] tile, in fp32."""
    return tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1) - b_dlse
