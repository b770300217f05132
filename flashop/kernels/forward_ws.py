"""The warp-specialized forward (``attention_fwd_ws_kernel``): the plain forward with its key
loop split between a load warp group and two consumer warp groups by Triton's Hopper pass
(flashop/_launch/choice.py's uses_ws says where it runs). Same outputs as
forward.attention_fwd_kernel."""

import triton
import triton.language as tl

from flashop.kernels.common import dot_operand, rounded_product, score_dot
from flashop.kernels.forward import fwd_fold, fwd_rows_out


@triton.jit
def _ws_fold(acc, l_i, m_i, b_q, b_kt, b_v, qk_scale, FOLD_SCALE: tl.constexpr,
                 UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr):
    """One query tile of attention_fwd_ws_kernel against one key tile, none of it masked:
    its scores, then forward.fwd_fold."""
    b_s = score_dot(b_q, b_kt, DOT_PRECISION)
    if not FOLD_SCALE:
        b_s = rounded_product(b_s, qk_scale)
    return fwd_fold(acc, l_i, m_i, b_s, b_v, qk_scale, False, FOLD_SCALE, UPCAST,
                     DOT_PRECISION, 0, False, FP8)


@triton.jit
def attention_fwd_ws_kernel(
    q, k, v, o, lse, lse_log2,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, q_descale, k_descale, v_descale, stride_dsb, stride_vd,
    S_q, S_k, G, qk_scale, seq_bucket,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FOLD_SCALE: tl.constexpr,
    Q_HEAD_MAJOR: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    """The plain forward (no modifier, no window or causal bound, dense inputs) with its key
    loop warp-specialized: Triton's Hopper pass gives the tensor-descriptor loads a producer
    warp group and each of the program's two query tiles (BLOCK_M / 2 rows) a consumer warp
    group, so that one tile's softmax runs while the other's matmuls do (FlashAttention-3's
    ping-pong). Same outputs as attention_fwd_kernel.

    Needs S_k to be a multiple of BLOCK_N: the loop has no masked tile (triton 3.6's pass
    accepts one loop, without a branch in it, and masking every tile costs more than it saves).
    Needs q to be
    one 2-D array of rows: ``Q_HEAD_MAJOR``, (batch, head) slices of S_q rows of stride
    stride_qs one after another; else (batch, seq) rows holding the H heads side by side,
    D == BLOCK_D (choice.ws_query_layout). ``seq_bucket`` is not read (the launcher's
    convention, see attention_fwd_kernel). Where ``FP8``, e4m3 inputs with their descales as
    attention_fwd_kernel's, and v stored keys-last (``stride_vs`` 1, its head dim
    ``stride_vd`` apart): its descriptor reads [BLOCK_DV, BLOCK_N] tiles, transposed for the
    P V product."""
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor may pass a Python float as fp64
    i_m = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    i_b = tl.program_id(2).to(tl.int64)
    i_hk = i_h // G
    v_scale = 1.0
    if FP8:
        o_ds = i_b * stride_dsb + i_hk
        qk_scale = qk_scale * (tl.load(q_descale + o_ds) * tl.load(k_descale + o_ds))
        v_scale = tl.load(v_descale + o_ds)
    k += i_b * stride_kb + i_hk * stride_kh
    v += i_b * stride_vb + i_hk * stride_vh
    o += i_b * stride_ob + i_h * stride_oh
    lse += i_b * stride_lb + i_h * stride_lh
    lse_log2 += i_b * stride_lb + i_h * stride_lh
    TILE_M: tl.constexpr = BLOCK_M // 2
    # triton<=3.6: the queries' descriptor spans the whole tensor read as 2-D: one made over a
    # program's
    # (batch, head) raced with the loop under triton 3.6 (wrong outputs), and the
    # pass refuses descriptors of more dimensions. Rows past S_q are the next sequence's (or
    # past the tensor's end, 0): they are computed and not stored.
    if Q_HEAD_MAJOR:  # (batch, head) slices of S_q rows one after another: columns [0, D)
        q = tl.make_tensor_descriptor(q, shape=[tl.num_programs(2) * tl.num_programs(1) * S_q,
                                                D], strides=[stride_qs, 1],
                                      block_shape=[TILE_M, BLOCK_D])
        q_row = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * S_q
        q_col = 0
    else:  # (batch, seq) rows of H heads side by side (D == BLOCK_D: no column of the next)
        q = tl.make_tensor_descriptor(q, shape=[tl.num_programs(2) * S_q,
                                                tl.num_programs(1) * D],
                                      strides=[stride_qs, 1], block_shape=[TILE_M, BLOCK_D])
        q_row = tl.program_id(2) * S_q
        q_col = tl.program_id(1) * D
    k = tl.make_tensor_descriptor(k, shape=[S_k, D], strides=[stride_ks, 1],
                                  block_shape=[BLOCK_N, BLOCK_D])
    if FP8:
        v = tl.make_tensor_descriptor(v, shape=[DV, S_k], strides=[stride_vd, 1],
                                      block_shape=[BLOCK_DV, BLOCK_N])
    else:
        v = tl.make_tensor_descriptor(v, shape=[S_k, DV], strides=[stride_vs, 1],
                                      block_shape=[BLOCK_N, BLOCK_DV])
    start_m = i_m * BLOCK_M
    b_q = dot_operand(q.load([q_row + start_m, q_col]), UPCAST)
    b_q2 = dot_operand(q.load([q_row + start_m + TILE_M, q_col]), UPCAST)
    m_i = tl.full([TILE_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([TILE_M], dtype=tl.float32)
    acc = tl.zeros([TILE_M, BLOCK_DV], dtype=tl.float32)
    m_i2 = tl.full([TILE_M], float("-inf"), dtype=tl.float32)
    l_i2 = tl.zeros([TILE_M], dtype=tl.float32)
    acc2 = tl.zeros([TILE_M, BLOCK_DV], dtype=tl.float32)
    for start_n in tl.range(0, S_k, BLOCK_N, warp_specialize=True):
        b_kt = dot_operand(tl.trans(k.load([start_n, 0])), UPCAST)
        if FP8:
            b_v = tl.trans(v.load([0, start_n]))
        else:
            b_v = v.load([start_n, 0])
        acc, l_i, m_i = _ws_fold(acc, l_i, m_i, b_q, b_kt, b_v, qk_scale, FOLD_SCALE,
                                     UPCAST, DOT_PRECISION, FP8)
        acc2, l_i2, m_i2 = _ws_fold(acc2, l_i2, m_i2, b_q2, b_kt, b_v, qk_scale,
                                        FOLD_SCALE, UPCAST, DOT_PRECISION, FP8)
    o_m = start_m + tl.arange(0, TILE_M)
    fwd_rows_out(acc, l_i, m_i, o, lse, lse_log2, lse, o_m, o_m < S_q, S_q, S_k, stride_os,
                  0, DV, BLOCK_DV, False, 0.0, False, v_scale, FP8)
    o_m2 = o_m + TILE_M
    fwd_rows_out(acc2, l_i2, m_i2, o, lse, lse_log2, lse, o_m2, o_m2 < S_q, S_q, S_k,
                  stride_os, 0, DV, BLOCK_DV, False, 0.0, False, v_scale, FP8)
