"""The plain forward on Hopper in Gluon (``triton.experimental.gluon``), written for triton
3.6: its API changes between releases, so flashop imports this module only under that
version (flashop/launch_gluon.py). Triton's interpreter cannot run Gluon: the ``tl`` forward
(flashop/kernels/forward.py) stays the reference, and the GPU suite checks this kernel
against the same reference.

One program takes BLOCK_M query rows of one (batch, head) and runs three partitions:
- a load warp: Q once, then K and V tile by tile through tensor descriptors (TMA) into
  STAGES shared buffers, refilling a buffer once both consumer groups released it;
- two consumer warp groups of BLOCK_M / 2 rows each: S = Q K^T and O += P V by wgmma, with
  S_{j+1} issued together with P_j V_j, so the softmax of S_{j+1} runs while P_j V_j does.
Where CAUSAL (S_q == S_k, BLOCK_M == BLOCK_N) each program's last key tile is the diagonal
one, the only one masked, and the programs run heaviest first.

The descriptors read each (B, S, H, D) input as it is strided, a tile being [1, rows, 1, D]:
rows past a sequence's end read as 0. The last key tile of each program is masked (keys
past S_k, where S_k is not a multiple of BLOCK_N; where causal, the diagonal); query rows
past S_q are computed and not stored.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

LN2: gl.constexpr = gl.constexpr(0.6931471805599453)


@gluon.jit
def _softmax_tile(b_s, m_i, l_i, qk_scale, dtype: gl.constexpr, p_layout: gl.constexpr):
    """One key tile's online softmax, in base 2 with m in scaled units (the scale folds into
    exp2's FMA; qk_scale > 0): (P as the PV wgmma's register operand, new m, new l, the
    rescale alpha of the rows' earlier tiles)."""
    # [ROWS]
    m_new = gl.maximum(m_i, gl.max(b_s, 1) * qk_scale)
    # [ROWS, BLOCK_N]
    b_p = gl.exp2(gl.fma(b_s, qk_scale, -gl.expand_dims(m_new, 1)))
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(b_p, 1)
    return gl.convert_layout(b_p.to(dtype), p_layout), m_new, l_new, alpha


@gluon.jit
def _softmax_diagonal_tile(b_s, m_i, l_i, qk_scale, o_q, o_k, dtype: gl.constexpr,
                           p_layout: gl.constexpr):
    """_softmax_tile with the keys past each row's query masked (the causal diagonal)."""
    b_s = gl.where(gl.expand_dims(o_k, 0) <= gl.expand_dims(o_q, 1), b_s, float("-inf"))
    return _softmax_tile(b_s, m_i, l_i, qk_scale, dtype, p_layout)


@gluon.jit
def _softmax_last_tile(b_s, m_i, l_i, qk_scale, o_q, o_k, S_k, dtype: gl.constexpr,
                       p_layout: gl.constexpr, CAUSAL: gl.constexpr):
    """_softmax_tile of a program's last key tile: the causal diagonal (S_q == S_k, which
    also masks the keys past S_k for every stored row), else the keys past S_k."""
    if CAUSAL:
        return _softmax_diagonal_tile(b_s, m_i, l_i, qk_scale, o_q, o_k, dtype, p_layout)
    b_s = gl.where(gl.expand_dims(o_k < S_k, 0), b_s, float("-inf"))
    return _softmax_tile(b_s, m_i, l_i, qk_scale, dtype, p_layout)


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, full, empty,
                    i_b, i_h, i_hk, start_m, n_tiles, STAGES: gl.constexpr,
                    BLOCK_N: gl.constexpr):
    """The load warp: Q once, then K and V of each key tile into buffer j % STAGES, once
    both consumer groups released that buffer's previous tile. A [rows, D] buffer takes a
    [1, rows, 1, D] tile of the (B, S, H, D) input."""
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [i_b, start_m, i_h, 0], q_bar,
                                    q_smem.reshape(q_desc.block_type.shape))
    for j in range(n_tiles):
        s = j % STAGES
        if j >= STAGES:
            mbarrier.wait(empty.index(s), ((j // STAGES) - 1) & 1)
        mbarrier.expect(full.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [i_b, j * BLOCK_N, i_hk, 0], full.index(s),
                                        k_smem.index(s).reshape(k_desc.block_type.shape))
        tma.async_copy_global_to_shared(v_desc, [i_b, j * BLOCK_N, i_hk, 0], full.index(s),
                                        v_smem.index(s).reshape(v_desc.block_type.shape))


@gluon.jit
def _consumer_partition(q_smem, k_smem, v_smem, q_bar, full, empty, o, lse, lse_log2,
                        stride_os, stride_od, start_m, S_q, S_k, n_tiles, qk_scale,
                        WG: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                        D: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr,
                        CAUSAL: gl.constexpr, MASK_LAST: gl.constexpr):
    """Consumer group WG: query rows [start_m + WG * ROWS, + ROWS) over n_tiles key tiles;
    writes their output and lse (``o``, ``lse``, ``lse_log2`` point at the (batch, head)'s
    first row)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype
    b_q = q_smem.slice(WG * ROWS, ROWS)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([ROWS], gl.float32, row_layout)
    acc = gl.zeros([ROWS, DV], gl.float32, o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    o_q = start_m + WG * ROWS + gl.arange(0, ROWS, layout=row_layout)
    o_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    # the first tile's scores, alone
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(full.index(0), 0)
    # [ROWS, BLOCK_N]
    s_tok = warpgroup_mma(b_q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
    b_s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
    if MASK_LAST and n_tiles == 1:
        b_p, m_i, l_i, alpha = _softmax_last_tile(b_s, m_i, l_i, qk_scale, o_q, o_n, S_k,
                                                  dtype, p_layout, CAUSAL)
    else:
        b_p, m_i, l_i, alpha = _softmax_tile(b_s, m_i, l_i, qk_scale, dtype, p_layout)
    # S_{j+1} and O += P_j V_j issued together; the softmax of S_{j+1} under P_j V_j
    for j in range(n_tiles - 1):
        s = j % STAGES
        s1 = (j + 1) % STAGES
        mbarrier.wait(full.index(s1), ((j + 1) // STAGES) & 1)
        # [ROWS, BLOCK_N]
        s_tok = warpgroup_mma(b_q, k_smem.index(s1).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        # [ROWS, DV]
        acc_tok = warpgroup_mma(b_p, v_smem.index(s), acc, is_async=True)
        b_s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
        if MASK_LAST and j + 2 == n_tiles:
            b_p, m_i, l_i, alpha = _softmax_last_tile(
                b_s, m_i, l_i, qk_scale, o_q, (j + 1) * BLOCK_N + o_n, S_k, dtype, p_layout,
                CAUSAL)
        else:
            b_p, m_i, l_i, alpha = _softmax_tile(b_s, m_i, l_i, qk_scale, dtype, p_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
        mbarrier.arrive(empty.index(s), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
    s = (n_tiles - 1) % STAGES
    # [ROWS, DV]
    acc_tok = warpgroup_mma(b_p, v_smem.index(s), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
    mbarrier.arrive(empty.index(s), count=1)
    # every row attends at least one key (S_k >= 1; causal: its own), so l_i > 0
    b_o = acc / gl.expand_dims(gl.convert_layout(l_i, orow_layout), 1)
    o_m = start_m + WG * ROWS + gl.arange(0, ROWS, layout=orow_layout)
    o_d = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
    p_o = o + (gl.expand_dims(o_m.to(gl.int64) * stride_os, 1) + gl.expand_dims(o_d * stride_od, 0))
    gl.store(p_o, b_o.to(dtype), mask=gl.expand_dims(o_m < S_q, 1))
    b_lse_log2 = m_i + gl.log2(l_i)
    gl.store(lse_log2 + o_q, b_lse_log2, mask=o_q < S_q)
    gl.store(lse + o_q, b_lse_log2 * LN2, mask=o_q < S_q)


@gluon.jit
def attention_fwd_gluon_kernel(
    q_desc, k_desc, v_desc, o, lse, lse_log2,
    stride_ob, stride_os, stride_oh, stride_od, stride_lb, stride_lh,
    S_q, S_k, H, G, qk_scale,
    D: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASK_LAST: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LOAD_REGS: gl.constexpr,
):
    """out[b, i, h] = softmax(scale * q_i . K^T) V over the (batch, head)'s keys (the
    module's docstring has the partitions), lse[b, h, i] in natural log and lse_log2 in
    base 2; qk_scale = scale * log2(e) > 0. Where CAUSAL, S_q == S_k. MASK_LAST: CAUSAL or
    S_k not a multiple of BLOCK_N (the last key tile masked; a masked branch in the loop
    cost 2% where there is nothing to mask). Grid: (cdiv(S_q, BLOCK_M), B * H)."""
    i_m = gl.program_id(0)
    if CAUSAL:  # heaviest first
        i_m = gl.num_programs(0) - 1 - i_m
    i_bh = gl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    i_hk = i_h // G
    start_m = i_m * BLOCK_M
    dtype: gl.constexpr = q_desc.dtype
    # 2-D buffers (the wgmmas' operands) in the descriptors' swizzle
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=q_desc.layout.swizzle_byte_width,
        element_bitwidth=q_desc.layout.element_bitwidth, rank=2)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], smem_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DV], smem_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumer groups release a buffer
    if CAUSAL:
        n_tiles = i_m + 1
    else:
        n_tiles = gl.cdiv(S_k, BLOCK_N)
    o += i_b.to(gl.int64) * stride_ob + i_h.to(gl.int64) * stride_oh
    lse += i_b.to(gl.int64) * stride_lb + i_h.to(gl.int64) * stride_lh
    lse_log2 += i_b.to(gl.int64) * stride_lb + i_h.to(gl.int64) * stride_lh
    ROWS: gl.constexpr = BLOCK_M // 2
    gl.warp_specialize([
        (_consumer_partition, (q_smem, k_smem, v_smem, q_bar, full, empty, o, lse, lse_log2,
                               stride_os, stride_od, start_m, S_q, S_k, n_tiles, qk_scale, 0,
                               ROWS,
                               BLOCK_N, D, DV, STAGES, CAUSAL, MASK_LAST)),
        (_consumer_partition, (q_smem, k_smem, v_smem, q_bar, full, empty, o, lse, lse_log2,
                               stride_os, stride_od, start_m, S_q, S_k, n_tiles, qk_scale, 1,
                               ROWS,
                               BLOCK_N, D, DV, STAGES, CAUSAL, MASK_LAST)),
        (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, full, empty,
                           i_b, i_h, i_hk, start_m, n_tiles, STAGES, BLOCK_N)),
    ], [4, 1], [CONSUMER_REGS, LOAD_REGS])
