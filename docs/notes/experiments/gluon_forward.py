"""Experiment (performance notes, entry 63): a Hopper attention forward in Gluon, for
triton 3.6 (`triton.experimental.gluon`; its API changes between releases). One head
dim D <= 128, S_q = S_k = N a multiple of the tiles, contiguous (B, N, H, D) 16-bit
inputs, no lse, no masks but causal (fa_fwd_ws with OVERLAP): enough to measure, not a
product path. Not imported by flashop and not run by CI (Triton's interpreter cannot
run Gluon). `fa_fwd_ws(q, k, v, STAGES=3, OVERLAP=True, CAUSAL=...)` is the fastest form
measured; `flashop/kernels/forward_gluon.py` (entry 64) is that form with the op's contract.

Forms:
- fa_fwd: one program of 8 warps (two warp groups of 64 rows), K and V by TMA into STAGES
  buffers with one mbarrier each, S = Q K^T and O += P V by wgmma, P from registers.
- fa_fwd_overlap: the same with S_{j+1} issued asynchronously before P_j V_j.
- fa_fwd_ws: warp-specialized, a load warp (Q once, then K and V into STAGES buffers,
  each refilled once both consumers released it) and two consumer warp groups of 64 rows;
  OVERLAP issues S_{j+1} with P_j V_j and computes the softmax of S_{j+1} under P_j V_j;
  PINGPONG makes the groups take turns to issue their wgmmas; CAUSAL masks the diagonal
  tile (the last of each program) and runs the programs heaviest first.
- fa_fwd_ws_ptr_kernel: the same on plain pointers, its descriptors made in the kernel
  (needs `triton.set_allocator`); launched through `wrap_triton` in a `triton_op` it runs
  eagerly and in CUDA graphs, but torch 2.11's Inductor cannot compile it (entry 63).
- fa_fwd_ws3: three consumer groups of 64 rows (FA3's 192-row programs), Q in three 64-row
  buffers (a 192-row allocation is refused), non-causal; slower (entry 63).
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (
    tma, mbarrier, warpgroup_mma, warpgroup_mma_wait,
)

# the online-softmax step, as the package's kernel (entry 64) took it over from here
from flashop.kernels.forward_gluon import (  # noqa: E402
    _softmax_diagonal_tile as _softmax_tile_causal, _softmax_tile,
)


@gluon.jit
def fa_fwd_kernel(q_desc, k_desc, v_desc, o_ptr, N, H, qk_scale,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                  STAGES: gl.constexpr, ASYNC: gl.constexpr, num_warps: gl.constexpr):
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    row0 = b * N
    col = h * D
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_bar.index(i), count=1)
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0 + pid_m * BLOCK_M, col], q_bar, q_smem)
    n_tiles = N // BLOCK_N
    for i in gl.static_range(STAGES):
        mbarrier.expect(kv_bar.index(i), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row0 + i * BLOCK_N, col], kv_bar.index(i),
                                        k_smem.index(i))
        tma.async_copy_global_to_shared(v_desc, [row0 + i * BLOCK_N, col], kv_bar.index(i),
                                        v_smem.index(i))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_bar, 0)
    for j in range(n_tiles):
        s = j % STAGES
        mbarrier.wait(kv_bar.index(s), (j // STAGES) & 1)
        qk = warpgroup_mma(q_smem, k_smem.index(s).permute((1, 0)), s_zero, use_acc=False,
                           is_async=ASYNC)
        if ASYNC:
            qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        qk = qk * qk_scale
        m_new = gl.maximum(m_i, gl.max(qk, 1))
        p = gl.exp2(qk - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
        p_op = gl.convert_layout(p.to(q_desc.dtype), p_layout)
        acc = warpgroup_mma(p_op, v_smem.index(s), acc, is_async=ASYNC)
        if ASYNC:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        m_i = m_new
        nxt = j + STAGES
        if nxt < n_tiles:
            mbarrier.expect(kv_bar.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row0 + nxt * BLOCK_N, col], kv_bar.index(s),
                                            k_smem.index(s))
            tma.async_copy_global_to_shared(v_desc, [row0 + nxt * BLOCK_N, col], kv_bar.index(s),
                                            v_smem.index(s))
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(kv_bar.index(i))
    o = acc / gl.expand_dims(gl.convert_layout(l_i, orow_layout), 1)
    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=orow_layout)
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    ptrs = o_ptr + (gl.expand_dims((row0 + offs_m) * (H * D) + col, 1) + gl.expand_dims(offs_d, 0))
    gl.store(ptrs, o.to(q_desc.dtype))


def fa_fwd(q, k, v, BLOCK_M=128, BLOCK_N=128, STAGES=2, ASYNC=False, num_warps=8):
    B, N, H, D = q.shape
    assert N % BLOCK_M == 0 and N % BLOCK_N == 0 and q.is_contiguous() and k.is_contiguous()
    dt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    out = torch.empty_like(q)
    q2, k2, v2 = (x.view(B * N, H * D) for x in (q, k, v))
    ql = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dt)
    kl = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dt)
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [BLOCK_M, D], ql)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [BLOCK_N, D], kl)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [BLOCK_N, D], kl)
    qk_scale = D ** -0.5 * 1.4426950408889634
    fa_fwd_kernel[(N // BLOCK_M, B * H)](q_desc, k_desc, v_desc, out, N, H, qk_scale,
                                         BLOCK_M, BLOCK_N, D, STAGES, ASYNC, num_warps=num_warps)
    return out


@gluon.jit
def fa_fwd_overlap_kernel(q_desc, k_desc, v_desc, o_ptr, N, H, qk_scale,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                          STAGES: gl.constexpr, num_warps: gl.constexpr):
    """As fa_fwd_kernel, with S_{j+1} = Q K_{j+1}^T issued before O += P_j V_j and the
    softmax of S_{j+1} computed while that PV wgmma runs (FA3's intra-warpgroup overlap)."""
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    row0 = b * N
    col = h * D
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_desc.dtype

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_bar.index(i), count=1)
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0 + pid_m * BLOCK_M, col], q_bar, q_smem)
    n_tiles = N // BLOCK_N
    for i in gl.static_range(STAGES):
        mbarrier.expect(kv_bar.index(i), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row0 + i * BLOCK_N, col], kv_bar.index(i),
                                        k_smem.index(i))
        tma.async_copy_global_to_shared(v_desc, [row0 + i * BLOCK_N, col], kv_bar.index(i),
                                        v_smem.index(i))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(kv_bar.index(0), 0)
    qk = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False)
    p_op, m_i, l_i, alpha = _softmax_tile(qk, m_i, l_i, qk_scale, dtype, p_layout)
    for j in range(n_tiles - 1):
        s = j % STAGES
        s1 = (j + 1) % STAGES
        mbarrier.wait(kv_bar.index(s1), ((j + 1) // STAGES) & 1)
        qk_tok = warpgroup_mma(q_smem, k_smem.index(s1).permute((1, 0)), s_zero,
                               use_acc=False, is_async=True)
        acc_tok = warpgroup_mma(p_op, v_smem.index(s), acc, is_async=True)
        qk_next = warpgroup_mma_wait(num_outstanding=1, deps=(qk_tok,))
        p_op, m_i, l_i, alpha = _softmax_tile(qk_next, m_i, l_i, qk_scale, dtype, p_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
        nxt = j + STAGES
        if nxt < n_tiles:
            mbarrier.expect(kv_bar.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row0 + nxt * BLOCK_N, col], kv_bar.index(s),
                                            k_smem.index(s))
            tma.async_copy_global_to_shared(v_desc, [row0 + nxt * BLOCK_N, col], kv_bar.index(s),
                                            v_smem.index(s))
    acc = warpgroup_mma(p_op, v_smem.index((n_tiles - 1) % STAGES), acc)
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(kv_bar.index(i))
    o = acc / gl.expand_dims(gl.convert_layout(l_i, orow_layout), 1)
    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=orow_layout)
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    ptrs = o_ptr + (gl.expand_dims((row0 + offs_m) * (H * D) + col, 1) + gl.expand_dims(offs_d, 0))
    gl.store(ptrs, o.to(dtype))


def fa_fwd_overlap(q, k, v, BLOCK_M=128, BLOCK_N=128, STAGES=2, num_warps=8):
    B, N, H, D = q.shape
    assert N % BLOCK_M == 0 and N % BLOCK_N == 0 and q.is_contiguous() and k.is_contiguous()
    dt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    out = torch.empty_like(q)
    q2, k2, v2 = (x.view(B * N, H * D) for x in (q, k, v))
    ql = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dt)
    kl = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dt)
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [BLOCK_M, D], ql)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [BLOCK_N, D], kl)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [BLOCK_N, D], kl)
    qk_scale = D ** -0.5 * 1.4426950408889634
    fa_fwd_overlap_kernel[(N // BLOCK_M, B * H)](q_desc, k_desc, v_desc, out, N, H, qk_scale,
                                                 BLOCK_M, BLOCK_N, D, STAGES,
                                                 num_warps=num_warps)
    return out


@gluon.jit
def _ws_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, full, empty, row0,
                 q_row, col, n_tiles, STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    """The load warp: Q once, then K and V tile by tile into STAGES buffers, each buffer
    refilled once both consumer warp groups have released it."""
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, col], q_bar, q_smem)
    for j in range(n_tiles):
        s = j % STAGES
        if j >= STAGES:
            mbarrier.wait(empty.index(s), ((j // STAGES) - 1) & 1)
        mbarrier.expect(full.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row0 + j * BLOCK_N, col], full.index(s),
                                        k_smem.index(s))
        tma.async_copy_global_to_shared(v_desc, [row0 + j * BLOCK_N, col], full.index(s),
                                        v_smem.index(s))


@gluon.jit
def _ws_consumer(q_smem, k_smem, v_smem, q_bar, full, empty, turn, o_ptr, q_row, col, HD,
                 n_tiles, qk_scale, WG: gl.constexpr, ROWS: gl.constexpr,
                 BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                 PINGPONG: gl.constexpr):
    """One warp group's ROWS query rows: S = Q K^T and O += P V by wgmma, the softmax in
    between. Where PINGPONG, the two groups take turns to issue their wgmmas (turn[WG] is
    this group's), so one group's softmax runs under the other's matmuls."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_w = q_smem.slice(WG * ROWS, ROWS)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([ROWS], gl.float32, row_layout)
    acc = gl.zeros([ROWS, D], gl.float32, o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_bar, 0)
    for j in range(n_tiles):
        s = j % STAGES
        mbarrier.wait(full.index(s), (j // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(WG), j & 1)
        qk_tok = warpgroup_mma(q_w, k_smem.index(s).permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - WG), count=1)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk_tok,))
        p_op, m_i, l_i, alpha = _softmax_tile(qk, m_i, l_i, qk_scale, q_smem.dtype, p_layout)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
        acc = warpgroup_mma(p_op, v_smem.index(s), acc)
        mbarrier.arrive(empty.index(s), count=1)
    o = acc / gl.expand_dims(gl.convert_layout(l_i, orow_layout), 1)
    offs_m = q_row + WG * ROWS + gl.arange(0, ROWS, layout=orow_layout)
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    ptrs = o_ptr + (gl.expand_dims(offs_m * HD + col, 1) + gl.expand_dims(offs_d, 0))
    gl.store(ptrs, o.to(q_smem.dtype))


@gluon.jit
def fa_fwd_ws_ptr_kernel(q, k, v, o_ptr, N, H, qk_scale, n_rows,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                         STAGES: gl.constexpr, PINGPONG: gl.constexpr, REGS: gl.constexpr,
                         CONSUMER: gl.constexpr, CAUSAL: gl.constexpr,
                         num_warps: gl.constexpr):
    """fa_fwd_ws_kernel on plain pointers: the descriptors made here (as a traced launch
    needs: no host descriptor over a fake tensor)."""
    # 16-bit rows of D = 128: 256 bytes, the 128-byte swizzle
    Q_LAYOUT: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                  rank=2)
    K_LAYOUT: gl.constexpr = Q_LAYOUT
    q_desc = tma.make_tensor_descriptor(q, [n_rows, H * D], [H * D, 1], [BLOCK_M, D], Q_LAYOUT)
    k_desc = tma.make_tensor_descriptor(k, [n_rows, H * D], [H * D, 1], [BLOCK_N, D], K_LAYOUT)
    v_desc = tma.make_tensor_descriptor(v, [n_rows, H * D], [H * D, 1], [BLOCK_N, D], K_LAYOUT)
    _fa_ws(q_desc, k_desc, v_desc, o_ptr, N, H, qk_scale, BLOCK_M, BLOCK_N, D, STAGES,
           PINGPONG, REGS, CONSUMER, CAUSAL)


@gluon.jit
def fa_fwd_ws_kernel(q_desc, k_desc, v_desc, o_ptr, N, H, qk_scale,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                     STAGES: gl.constexpr, PINGPONG: gl.constexpr, REGS: gl.constexpr,
                     CONSUMER: gl.constexpr, CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    _fa_ws(q_desc, k_desc, v_desc, o_ptr, N, H, qk_scale, BLOCK_M, BLOCK_N, D, STAGES,
           PINGPONG, REGS, CONSUMER, CAUSAL)


@gluon.jit
def _fa_ws(q_desc, k_desc, v_desc, o_ptr, N, H, qk_scale,
           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
           STAGES: gl.constexpr, PINGPONG: gl.constexpr, REGS: gl.constexpr,
           CONSUMER: gl.constexpr, CAUSAL: gl.constexpr):
    """Warp-specialized: a load warp and two consumer warp groups of BLOCK_M / 2 rows.
    Where CAUSAL (BLOCK_M == BLOCK_N, S_q == S_k), the programs run heaviest first."""
    pid_m = gl.program_id(0)
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    row0 = b * N
    col = h * D
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    if PINGPONG:  # group 0 goes first
        mbarrier.arrive(turn.index(0), count=1)
    n_tiles = N // BLOCK_N
    if CAUSAL:
        n_tiles = pid_m + 1
    q_row = row0 + pid_m * BLOCK_M
    q_pos = pid_m * BLOCK_M
    HD = H * D
    ROWS: gl.constexpr = BLOCK_M // 2
    if CONSUMER:
        gl.warp_specialize([
            (_ws_consumer_overlap, (q_smem, k_smem, v_smem, q_bar, full, empty, turn, o_ptr,
                                    q_row, col, HD, n_tiles, qk_scale, 0, ROWS, BLOCK_N, D,
                                    STAGES, PINGPONG, CAUSAL, q_pos, N)),
            (_ws_consumer_overlap, (q_smem, k_smem, v_smem, q_bar, full, empty, turn, o_ptr,
                                    q_row, col, HD, n_tiles, qk_scale, 1, ROWS, BLOCK_N, D,
                                    STAGES, PINGPONG, CAUSAL, q_pos, N)),
            (_ws_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, full, empty,
                            row0, q_row, col, n_tiles, STAGES, BLOCK_N)),
        ], [4, 1], [REGS, 24])
    else:
        gl.warp_specialize([
            (_ws_consumer, (q_smem, k_smem, v_smem, q_bar, full, empty, turn, o_ptr, q_row, col,
                            HD, n_tiles, qk_scale, 0, ROWS, BLOCK_N, D, STAGES, PINGPONG)),
            (_ws_consumer, (q_smem, k_smem, v_smem, q_bar, full, empty, turn, o_ptr, q_row, col,
                            HD, n_tiles, qk_scale, 1, ROWS, BLOCK_N, D, STAGES, PINGPONG)),
            (_ws_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, full, empty,
                            row0, q_row, col, n_tiles, STAGES, BLOCK_N)),
        ], [4, 1], [REGS, 24])


def fa_fwd_ws(q, k, v, BLOCK_M=128, BLOCK_N=128, STAGES=2, PINGPONG=False, REGS=232,
              OVERLAP=False, CAUSAL=False):
    assert not CAUSAL or (OVERLAP and BLOCK_M == BLOCK_N)
    B, N, H, D = q.shape
    assert N % BLOCK_M == 0 and N % BLOCK_N == 0 and q.is_contiguous() and k.is_contiguous()
    dt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    out = torch.empty_like(q)
    q2, k2, v2 = (x.view(B * N, H * D) for x in (q, k, v))
    ql = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dt)
    kl = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dt)
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [BLOCK_M, D], ql)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [BLOCK_N, D], kl)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [BLOCK_N, D], kl)
    qk_scale = D ** -0.5 * 1.4426950408889634
    fa_fwd_ws_kernel[(N // BLOCK_M, B * H)](q_desc, k_desc, v_desc, out, N, H, qk_scale,
                                            BLOCK_M, BLOCK_N, D, STAGES, PINGPONG, REGS,
                                            OVERLAP, CAUSAL,
                                            num_warps=4)
    return out


@gluon.jit
def _ws_consumer_overlap(q_smem, k_smem, v_smem, q_bar, full, empty, turn, o_ptr, q_row, col,
                         HD, n_tiles, qk_scale, WG: gl.constexpr, ROWS: gl.constexpr,
                         BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                         PINGPONG: gl.constexpr, CAUSAL: gl.constexpr, q_pos, n_q,
                         Q_SPLIT: gl.constexpr = False):
    """As _ws_consumer, with S_{j+1} and O += P_j V_j issued together (in this group's turn
    where PINGPONG) and the softmax of S_{j+1} computed while P_j V_j runs. Where CAUSAL,
    the last key tile is the diagonal one (q_pos: the program's first query position)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    if Q_SPLIT:  # Q in one buffer of ROWS rows per group
        q_w = q_smem.index(WG)
    else:
        q_w = q_smem.slice(WG * ROWS, ROWS)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([ROWS], gl.float32, row_layout)
    acc = gl.zeros([ROWS, D], gl.float32, o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(full.index(0), 0)
    if PINGPONG:
        mbarrier.wait(turn.index(WG), 0)
    qk_tok = warpgroup_mma(q_w, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                           is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk_tok,))
    offs_q = q_pos + WG * ROWS + gl.arange(0, ROWS, layout=row_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if CAUSAL and n_tiles == 1:
        p_op, m_i, l_i, alpha = _softmax_tile_causal(qk, m_i, l_i, qk_scale, offs_q, offs_n,
                                                     q_smem.dtype, p_layout)
    else:
        p_op, m_i, l_i, alpha = _softmax_tile(qk, m_i, l_i, qk_scale, q_smem.dtype, p_layout)
    for j in range(n_tiles - 1):
        s = j % STAGES
        s1 = (j + 1) % STAGES
        mbarrier.wait(full.index(s1), ((j + 1) // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(WG), (j + 1) & 1)
        qk_tok = warpgroup_mma(q_w, k_smem.index(s1).permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)
        acc_tok = warpgroup_mma(p_op, v_smem.index(s), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - WG), count=1)
        qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk_tok,))
        if CAUSAL and j + 2 == n_tiles:
            p_op, m_i, l_i, alpha = _softmax_tile_causal(
                qk, m_i, l_i, qk_scale, offs_q, (j + 1) * BLOCK_N + offs_n, q_smem.dtype,
                p_layout)
        else:
            p_op, m_i, l_i, alpha = _softmax_tile(qk, m_i, l_i, qk_scale, q_smem.dtype,
                                                  p_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
        mbarrier.arrive(empty.index(s), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
    s = (n_tiles - 1) % STAGES
    if PINGPONG:
        mbarrier.wait(turn.index(WG), n_tiles & 1)
    acc_tok = warpgroup_mma(p_op, v_smem.index(s), acc, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
    mbarrier.arrive(empty.index(s), count=1)
    o = acc / gl.expand_dims(gl.convert_layout(l_i, orow_layout), 1)
    offs_m = q_row + WG * ROWS + gl.arange(0, ROWS, layout=orow_layout)
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    ptrs = o_ptr + (gl.expand_dims(offs_m * HD + col, 1) + gl.expand_dims(offs_d, 0))
    gl.store(ptrs, o.to(q_smem.dtype),
             mask=gl.expand_dims(offs_m - q_row + q_pos < n_q, 1) & gl.expand_dims(offs_d < D, 0))


@gluon.jit
def fa_fwd_ws3_kernel(q_desc, k_desc, v_desc, o_ptr, N, H, qk_scale,
                      BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                      REGS: gl.constexpr, num_warps: gl.constexpr):
    """Three consumer warp groups of 64 rows (192-row programs, FA3's D=64 form) and a
    load warp; non-causal; query rows past N are computed and not stored."""
    BLOCK_M: gl.constexpr = 192
    ROWS: gl.constexpr = 64
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    row0 = b * N
    col = h * D
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [3, ROWS, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=3)
    n_tiles = N // BLOCK_N
    q_row = row0 + pid_m * BLOCK_M
    q_pos = pid_m * BLOCK_M
    HD = H * D
    gl.warp_specialize([
        (_ws_consumer_overlap, (q_smem, k_smem, v_smem, q_bar, full, empty, turn, o_ptr,
                                q_row, col, HD, n_tiles, qk_scale, 0, ROWS, BLOCK_N, D,
                                STAGES, False, False, q_pos, N, True)),
        (_ws_consumer_overlap, (q_smem, k_smem, v_smem, q_bar, full, empty, turn, o_ptr,
                                q_row, col, HD, n_tiles, qk_scale, 1, ROWS, BLOCK_N, D,
                                STAGES, False, False, q_pos, N, True)),
        (_ws_consumer_overlap, (q_smem, k_smem, v_smem, q_bar, full, empty, turn, o_ptr,
                                q_row, col, HD, n_tiles, qk_scale, 2, ROWS, BLOCK_N, D,
                                STAGES, False, False, q_pos, N, True)),
        (_ws3_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, full, empty,
                         row0, q_row, col, n_tiles, STAGES, BLOCK_N)),
    ], [4, 4, 1], [REGS, REGS, 24])


@gluon.jit
def _ws3_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, full, empty, row0,
                  q_row, col, n_tiles, STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    """_ws_producer with Q in three 64-row buffers."""
    mbarrier.expect(q_bar, 3 * q_desc.block_type.nbytes)
    for i in gl.static_range(3):
        tma.async_copy_global_to_shared(q_desc, [q_row + i * 64, col], q_bar, q_smem.index(i))
    for j in range(n_tiles):
        s = j % STAGES
        if j >= STAGES:
            mbarrier.wait(empty.index(s), ((j // STAGES) - 1) & 1)
        mbarrier.expect(full.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row0 + j * BLOCK_N, col], full.index(s),
                                        k_smem.index(s))
        tma.async_copy_global_to_shared(v_desc, [row0 + j * BLOCK_N, col], full.index(s),
                                        v_smem.index(s))


def fa_fwd_ws3(q, k, v, BLOCK_N=128, STAGES=3, REGS=168):
    B, N, H, D = q.shape
    assert N % BLOCK_N == 0 and q.is_contiguous() and k.is_contiguous()
    dt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    out = torch.empty_like(q)
    q2, k2, v2 = (x.view(B * N, H * D) for x in (q, k, v))
    ql = gl.NVMMASharedLayout.get_default_for([64, D], dt)
    kl = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dt)
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [64, D], ql)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [BLOCK_N, D], kl)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [BLOCK_N, D], kl)
    qk_scale = D ** -0.5 * 1.4426950408889634
    fa_fwd_ws3_kernel[(triton.cdiv(N, 192), B * H)](q_desc, k_desc, v_desc, out, N, H, qk_scale,
                                                    BLOCK_N, D, STAGES, REGS, num_warps=4)
    return out
