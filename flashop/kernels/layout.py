"""Layout copies the attention kernels need: values stored keys-last for the fp8 forward."""

import triton
import triton.language as tl


@triton.jit
def keys_last_kernel(x, y, S, stride_xb, stride_xs, stride_xh, stride_yb, stride_yh, stride_yd,
                     D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """y[b, h, d, s] = x[b, s, h, d] for one tile of BLOCK_S keys of one (batch, head): Hopper's
    fp8 products read their second operand (the values) along the keys. x has unit stride in
    its head dim, y in its keys."""
    i_s = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    i_b = tl.program_id(2).to(tl.int64)
    o_s = i_s * BLOCK_S + tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, BLOCK_D)
    m_s = o_s < S
    m_d = o_d < D
    # [BLOCK_S, BLOCK_D]
    b_x = tl.load(x + i_b * stride_xb + i_h * stride_xh + o_s[:, None] * stride_xs + o_d[None, :],
                  mask=m_s[:, None] & m_d[None, :])
    tl.store(y + i_b * stride_yb + i_h * stride_yh + o_d[:, None] * stride_yd + o_s[None, :],
             tl.trans(b_x), mask=m_d[:, None] & m_s[None, :])
