"""A Gluon backward of 64 keys per program with dK and dV split between the two consumer
groups by head-dim columns (performance notes, entry 140): the layout entry 139 names for
head dims whose dK and dV do not fit the registers at 128 keys per program (D = 192 with
DV = 128; D = 256). Stripped: non-causal, no dropout, one query head per KV head, dQ by
bulk reduce-adds, keys a multiple of 64. Compiled for sm_90 on a machine without a GPU, its
shared memory, registers and spills reported; timed on an H200 by gluon_bwd_64keys_gpu.py
(entry 143: no faster than the `tl` backward at D = 192 / 128, slower at 128 and 256).

From the repository root, with triton 3.6.0 and a CPU torch:

    PYTHONPATH=. python docs/notes/experiments/gluon_bwd_64keys.py

Per step (64 queries of one head), group w:
- S[:, w-th 32 keys] = Q K_w^T and dP[:, w-th 32 keys] = dO V_w^T ([64 queries, 32 keys]),
  P and dS of those keys into shared memory, both groups' halves met by a barrier;
- dV[:, cols_w] += P^T dO[:, cols_w] and dK[:, cols_w] += dS^T Q[:, cols_w] over all 64
  keys (P^T and dS^T read transposed from shared memory);
- dQ[:, cols_w] = dS K[:, cols_w], added into dQ's fp32 buffer by a bulk reduce-add.
cols_w: dV's halves (64 + 64); dK's and dQ's the head dim's tiles (group 0 the first 128,
group 1 the rest: Gluon's tiles are powers of two), or halves where D is one tile.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from compile_sm90 import compile_kernel, descriptor, report  # noqa: E402  (stand-in driver)
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from flashop.kernels.backward_gluon import (  # noqa: E402
    _load_row_values, _reduce_add_shared_to_global,
)


@gluon.jit
def _load(q_desc, q_desc2, k_desc, k_desc2, v_desc, do_desc, q_smem, q_smem2, k_smem, k_smem2,
          v_smem, do_smem, lse_smem, delta_smem, lse_log2, delta, stride_lb, stride_lh, S_q,
          kv_bar, full, empty, i_b, i_h, start_n, n_steps, STAGES: gl.constexpr,
          BLOCK_M: gl.constexpr, HEAD_PARTS: gl.constexpr):
    D1: gl.constexpr = k_desc.block_type.shape[3]
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + HEAD_PARTS * k_desc2.block_type.nbytes
                    + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [i_b, start_n, i_h, 0], kv_bar,
                                    k_smem.reshape(k_desc.block_type.shape))
    if HEAD_PARTS:
        tma.async_copy_global_to_shared(k_desc2, [i_b, start_n, i_h, D1], kv_bar,
                                        k_smem2.reshape(k_desc2.block_type.shape))
    tma.async_copy_global_to_shared(v_desc, [i_b, start_n, i_h, 0], kv_bar,
                                    v_smem.reshape(v_desc.block_type.shape))
    for t in range(n_steps):
        s = t % STAGES
        if t >= STAGES:
            mbarrier.wait(empty.index(s), ((t // STAGES) - 1) & 1)
        start_m = t * BLOCK_M
        mbarrier.expect(full.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                        + HEAD_PARTS * q_desc2.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [i_b, start_m, i_h, 0], full.index(s),
                                        q_smem.index(s).reshape(q_desc.block_type.shape))
        if HEAD_PARTS:
            tma.async_copy_global_to_shared(q_desc2, [i_b, start_m, i_h, D1], full.index(s),
                                            q_smem2.index(s).reshape(q_desc2.block_type.shape))
        tma.async_copy_global_to_shared(do_desc, [i_b, start_m, i_h, 0], full.index(s),
                                        do_smem.index(s).reshape(do_desc.block_type.shape))
        _load_row_values(lse_log2, delta, lse_smem.index(s), delta_smem.index(s), stride_lb,
                         stride_lh, i_b, i_h, start_m, S_q, BLOCK_M)
        mbarrier.arrive(full.index(s), count=1)


@gluon.jit
def _consume(q_smem, q_smem2, k_smem, k_smem2, v_smem, do_smem, lse_smem, delta_smem, p_smem,
             ds_smem, dq_smem, kv_bar, full, empty, pd_bar, dq_desc, dk, dv, stride_dks,
             stride_dvs, i_b, i_h, start_n, n_steps, qk_scale, sm_scale, WG: gl.constexpr,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
             DV: gl.constexpr, STAGES: gl.constexpr, HEAD_PARTS: gl.constexpr):
    HALF_N: gl.constexpr = BLOCK_N // 2  # this group's keys of S and dP
    D1: gl.constexpr = k_smem.shape[1]
    # this group's columns of dK and dQ, and of dV
    if HEAD_PARTS:
        if WG == 0:
            DK_COLS: gl.constexpr = D1
        else:
            DK_COLS: gl.constexpr = D - D1
    else:
        DK_COLS: gl.constexpr = D // 2
    DV_COLS: gl.constexpr = DV // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_N, 16])
    dk_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DK_COLS, 16])
    dv_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV_COLS, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype
    b_k = k_smem.slice(WG * HALF_N, HALF_N)
    b_k2 = k_smem2.slice(WG * HALF_N, HALF_N)
    b_v = v_smem.slice(WG * HALF_N, HALF_N)
    if HEAD_PARTS:
        if WG == 0:
            b_k_cols = k_smem
        else:
            b_k_cols = k_smem2
        dk_col: gl.constexpr = WG * D1
    else:
        b_k_cols = k_smem.slice(WG * DK_COLS, DK_COLS, dim=1)
        dk_col: gl.constexpr = WG * DK_COLS
    b_dk = gl.zeros([BLOCK_N, DK_COLS], gl.float32, dk_layout)
    b_dv = gl.zeros([BLOCK_N, DV_COLS], gl.float32, dv_layout)
    mbarrier.wait(kv_bar, 0)
    for t in range(n_steps):
        s = t % STAGES
        start_m = t * BLOCK_M
        mbarrier.wait(full.index(s), (t // STAGES) & 1)
        b_lse = lse_smem.index(s).load(row_layout)
        b_delta = delta_smem.index(s).load(row_layout)
        b_q = q_smem.index(s)
        b_q2 = q_smem2.index(s)
        b_do = do_smem.index(s)
        # S, dP of this group's keys [BLOCK_M, HALF_N]
        s_zero = gl.zeros([BLOCK_M, HALF_N], gl.float32, s_layout)
        s_tok = warpgroup_mma(b_q, b_k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if HEAD_PARTS:
            s_tok = warpgroup_mma(b_q2, b_k2.permute((1, 0)), s_tok, is_async=True)
        dp_tok = warpgroup_mma(b_do, b_v.permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)
        b_s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
        b_p = gl.exp2(gl.fma(b_s, qk_scale, -gl.expand_dims(b_lse, 1)))
        b_dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok,))
        b_ds = b_p * (b_dp - gl.expand_dims(b_delta, 1))
        # both groups' P and dS [BLOCK_M, BLOCK_N] of this step
        b_pt = p_smem.index(t % 2)
        b_dst = ds_smem.index(t % 2)
        b_pt.slice(WG * HALF_N, HALF_N, dim=1).store(b_p.to(dtype))
        b_dst.slice(WG * HALF_N, HALF_N, dim=1).store(b_ds.to(dtype))
        fence_async_shared()
        mbarrier.arrive(pd_bar.index(t % 2), count=1)
        mbarrier.wait(pd_bar.index(t % 2), (t // 2) & 1)
        # dV[:, cols] += P^T dO[:, cols]; dK[:, cols] += dS^T Q[:, cols] over all BLOCK_N keys
        dv_tok = warpgroup_mma(b_pt.permute((1, 0)), b_do.slice(WG * DV_COLS, DV_COLS, dim=1),
                               b_dv, is_async=True)
        if HEAD_PARTS:
            if WG == 0:
                b_q_cols = b_q
            else:
                b_q_cols = b_q2
        else:
            b_q_cols = b_q.slice(WG * DK_COLS, DK_COLS, dim=1)
        dk_tok = warpgroup_mma(b_dst.permute((1, 0)), b_q_cols, b_dk, is_async=True)
        # dQ[:, cols] = dS K[:, cols]
        dq_zero = gl.zeros([BLOCK_M, DK_COLS], gl.float32, dk_layout)
        dq_tok = warpgroup_mma(b_dst, b_k_cols, dq_zero, use_acc=False, is_async=True)
        b_dv, b_dk, b_dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, dq_tok))
        mbarrier.arrive(empty.index(s), count=1)
        tma.store_wait(0)
        dq_smem.store(b_dq * sm_scale)
        fence_async_shared()
        _reduce_add_shared_to_global(dq_desc, [i_b, start_m, i_h, dk_col],
                                     dq_smem.reshape(dq_desc.block_type.shape))
    tma.store_wait(0)
    o_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dk_layout))
    o_d = dk_col + gl.arange(0, DK_COLS, layout=gl.SliceLayout(0, dk_layout))
    gl.store(dk + gl.expand_dims(o_n.to(gl.int64) * stride_dks, 1) + gl.expand_dims(o_d, 0),
             (b_dk * sm_scale).to(dtype))
    o_nv = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dv_layout))
    o_dv = WG * DV_COLS + gl.arange(0, DV_COLS, layout=gl.SliceLayout(0, dv_layout))
    gl.store(dv + gl.expand_dims(o_nv.to(gl.int64) * stride_dvs, 1) + gl.expand_dims(o_dv, 0),
             b_dv.to(dtype))


@gluon.jit
def bwd_64keys_kernel(q_desc, q_desc2, k_desc, k_desc2, v_desc, do_desc, dq_desc, dq_desc2,
                      lse_log2,
                      delta, dk, dv, stride_lb, stride_lh, stride_dkb, stride_dks, stride_dkh,
                      stride_dvb, stride_dvs, stride_dvh, S_q, H, sm_scale, qk_scale,
                      D: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, LOAD_REGS: gl.constexpr):
    D1: gl.constexpr = q_desc.block_type.shape[3]
    HEAD_PARTS: gl.constexpr = D1 < D
    i_n = gl.program_id(0)
    i_b = gl.program_id(1) // H
    i_h = gl.program_id(1) % H
    start_n = i_n * BLOCK_N
    dtype: gl.constexpr = q_desc.dtype
    layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=q_desc.layout.swizzle_byte_width,
        element_bitwidth=q_desc.layout.element_bitwidth, rank=2)
    pd_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=q_desc.layout.element_bitwidth, rank=2)
    dq_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=dq_desc.layout.swizzle_byte_width,
        element_bitwidth=dq_desc.layout.element_bitwidth, rank=2)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D1], layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, DV], layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D1], layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, DV], layout)
    if HEAD_PARTS:
        layout2: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=q_desc2.layout.swizzle_byte_width,
            element_bitwidth=q_desc2.layout.element_bitwidth, rank=2)
        k_smem2 = gl.allocate_shared_memory(dtype, [BLOCK_N, D - D1], layout2)
        q_smem2 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D - D1], layout2)
        dq_layout2: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=dq_desc2.layout.swizzle_byte_width,
            element_bitwidth=dq_desc2.layout.element_bitwidth, rank=2)
        dq0_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, D1], dq_layout)
        dq1_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, D - D1], dq_layout2)
    else:
        k_smem2 = k_smem
        q_smem2 = q_smem
        dq0_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, D // 2], dq_layout)
        dq1_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, D // 2], dq_layout)
    p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], pd_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], pd_layout)
    rows: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], rows)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], rows)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    pd_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=2)
        mbarrier.init(empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(pd_bar.index(i), count=2)
    n_steps = gl.cdiv(S_q, BLOCK_M)
    dk += i_b.to(gl.int64) * stride_dkb + i_h.to(gl.int64) * stride_dkh
    dv += i_b.to(gl.int64) * stride_dvb + i_h.to(gl.int64) * stride_dvh
    gl.warp_specialize([
        (_consume, (q_smem, q_smem2, k_smem, k_smem2, v_smem, do_smem, lse_smem, delta_smem,
                    p_smem, ds_smem, dq0_smem, kv_bar, full, empty, pd_bar, dq_desc, dk, dv,
                    stride_dks, stride_dvs, i_b, i_h, start_n, n_steps, qk_scale, sm_scale, 0,
                    BLOCK_M, BLOCK_N, D, DV, STAGES, HEAD_PARTS)),
        (_consume, (q_smem, q_smem2, k_smem, k_smem2, v_smem, do_smem, lse_smem, delta_smem,
                    p_smem, ds_smem, dq1_smem, kv_bar, full, empty, pd_bar, dq_desc2, dk, dv,
                    stride_dks, stride_dvs, i_b, i_h, start_n, n_steps, qk_scale, sm_scale, 1,
                    BLOCK_M, BLOCK_N, D, DV, STAGES, HEAD_PARTS)),
        (_load, (q_desc, q_desc2, k_desc, k_desc2, v_desc, do_desc, q_smem, q_smem2, k_smem,
                 k_smem2, v_smem, do_smem, lse_smem, delta_smem, lse_log2, delta, stride_lb,
                 stride_lh, S_q, kv_bar, full, empty, i_b, i_h, start_n, n_steps, STAGES,
                 BLOCK_M, HEAD_PARTS)),
    ], [4, 1], [CONSUMER_REGS, LOAD_REGS])


def launch_args(D: int, DV: int, S: int = 4096, H: int = 16, BLOCK_M: int = 64,
                BLOCK_N: int = 64, STAGES: int = 2, CONSUMER_REGS: int = 240):
    """The kernel's grid and arguments over CPU tensors (B = 1)."""
    bf16 = torch.bfloat16
    q, k = (torch.empty(1, S, H, D, dtype=bf16) for _ in range(2))
    v, do = (torch.empty(1, S, H, DV, dtype=bf16) for _ in range(2))
    dq = torch.empty(1, S, H, D, dtype=torch.float32)
    lse, delta = torch.empty(1, H, S), torch.empty(1, H, S)
    d1 = 128 if D & (D - 1) else D
    d2 = D - d1
    q_desc, k_desc = descriptor(q, (1, BLOCK_M, 1, d1)), descriptor(k, (1, BLOCK_N, 1, d1))
    kwargs = dict(
        q_desc=q_desc, q_desc2=descriptor(q, (1, BLOCK_M, 1, d2)) if d2 else q_desc,
        k_desc=k_desc, k_desc2=descriptor(k, (1, BLOCK_N, 1, d2)) if d2 else k_desc,
        v_desc=descriptor(v, (1, BLOCK_N, 1, DV)), do_desc=descriptor(do, (1, BLOCK_M, 1, DV)),
        dq_desc=descriptor(dq, (1, BLOCK_M, 1, d1 if d2 else D // 2)),
        dq_desc2=descriptor(dq, (1, BLOCK_M, 1, d2 if d2 else D // 2)),
        lse_log2=lse, delta=delta, dk=k, dv=v, stride_lb=lse.stride(0),
        stride_lh=lse.stride(1), stride_dkb=k.stride(0), stride_dks=k.stride(1),
        stride_dkh=k.stride(2), stride_dvb=v.stride(0), stride_dvs=v.stride(1),
        stride_dvh=v.stride(2), S_q=S, H=H, sm_scale=0.1, qk_scale=0.14, D=D, DV=DV,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES, CONSUMER_REGS=CONSUMER_REGS,
        LOAD_REGS=24, num_warps=4)
    return (S // BLOCK_N, H), kwargs


def main() -> int:
    failed = 0
    for D, DV, stages in ((192, 128, 2), (128, 128, 2), (256, 256, 1), (256, 256, 2)):
        grid, kwargs = launch_args(D, DV, STAGES=stages)
        failed += not report(compile_kernel(bwd_64keys_kernel, grid, kwargs,
                                            label=f"D={D}/{DV} 64 keys, {stages} stages"))
    return failed


if __name__ == "__main__":
    sys.exit(main())
