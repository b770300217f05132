"""A Gluon MLA decode kernel that computes each tile's scores once (performance notes, entry
142): the structure entry 141 names for the compute-bound MLA decode, whose `tl` kernel
computes S in both warp groups. Stripped: a dense latent cache (values the rows' first 512
dims), one query per sequence (the query heads are the rows), no split of the keys, keys a
multiple of BLOCK_N. Compiled for sm_90 on a machine without a GPU, its shared memory,
registers and spills reported. Run on an H200 by gluon_mla_decode_gpu.py (entry 144: 449-490
TFLOP/s at H = 128 where the grid fills the GPU, against the `tl` kernel's 286-300), once
group 0's last arrival waited for group 1's read of the last P (one barrier phase apart);
the package's kernel (flashop/kernels/mla_gluon.py) grew from it.

From the repository root, with triton 3.6.0 and a CPU torch:

    PYTHONPATH=. python docs/notes/experiments/gluon_mla_decode.py

One program: 64 query rows (heads) of one sequence. A load warp brings Q once (latent and
rotary tiles) and the key tiles (latent [BLOCK_N, 512] and rotary [BLOCK_N, 64]) into
STAGES buffers. Group 0 computes S = Q K^T of each tile, its softmax, and writes P and the
rows' rescale factor to shared memory; then both groups run O[:, half] = O[:, half] * alpha
+ P V[:, half], each over 256 of the 512 value dims (V the key tile's latent block), and
release the key tile. Group 0's S of the next tile runs while group 1's P V of this one
does (FlashMLA's structure, without its second softmax group).
"""

import collections
import re
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


@gluon.jit
def _load(q_desc, qr_desc, k_desc, kr_desc, q_smem, qr_smem, k_smem, kr_smem, q_bar, full,
          empty, i_b, h0, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    mbarrier.expect(q_bar, q_desc.block_type.nbytes + qr_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [i_b, 0, h0, 0], q_bar,
                                    q_smem.reshape(q_desc.block_type.shape))
    tma.async_copy_global_to_shared(qr_desc, [i_b, 0, h0, q_desc.block_type.shape[3]], q_bar,
                                    qr_smem.reshape(qr_desc.block_type.shape))
    DV: gl.constexpr = k_desc.block_type.shape[3]
    for j in range(n_tiles):
        s = j % STAGES
        if j >= STAGES:
            mbarrier.wait(empty.index(s), ((j // STAGES) - 1) & 1)
        mbarrier.expect(full.index(s), k_desc.block_type.nbytes + kr_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [i_b, j * BLOCK_N, 0, 0], full.index(s),
                                        k_smem.index(s).reshape(k_desc.block_type.shape))
        tma.async_copy_global_to_shared(kr_desc, [i_b, j * BLOCK_N, 0, DV], full.index(s),
                                        kr_smem.index(s).reshape(kr_desc.block_type.shape))


@gluon.jit
def _pv(acc, b_alpha, p_smem, v_half, acc_layout: gl.constexpr):
    """acc * alpha + P V_half: the rescale, then the product (one warp group's half)."""
    acc = acc * gl.expand_dims(gl.convert_layout(b_alpha, gl.SliceLayout(1, acc_layout)), 1)
    tok = warpgroup_mma(p_smem, v_half, acc, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(tok,))


@gluon.jit
def _group(q_smem, qr_smem, k_smem, kr_smem, p_smem, alpha_smem, l_smem, q_bar, full, empty,
           p_full, p_empty, o, lse, stride_ob, stride_oh, stride_lb, i_b, h0, n_tiles,
           qk_scale, WG: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    ROWS: gl.constexpr = q_smem.shape[0]
    DV: gl.constexpr = k_smem.shape[2]
    HALF: gl.constexpr = DV // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype
    acc = gl.zeros([ROWS, HALF], gl.float32, o_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([ROWS], gl.float32, row_layout)
    if WG == 0:
        mbarrier.wait(q_bar, 0)
    for j in range(n_tiles):
        s = j % STAGES
        mbarrier.wait(full.index(s), (j // STAGES) & 1)
        v_half = k_smem.index(s).slice(WG * HALF, HALF, dim=1)
        if WG == 0:
            # S = Q_lat K_lat^T + Q_rope K_rope^T [ROWS, BLOCK_N], once for both groups
            s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
            tok = warpgroup_mma(q_smem, k_smem.index(s).permute((1, 0)), s_zero,
                                use_acc=False, is_async=True)
            tok = warpgroup_mma(qr_smem, kr_smem.index(s).permute((1, 0)), tok,
                                is_async=True)
            b_s = warpgroup_mma_wait(num_outstanding=0, deps=(tok,))
            m_new = gl.maximum(m_i, gl.max(b_s, 1) * qk_scale)
            b_alpha = gl.exp2(m_i - m_new)
            b_p = gl.exp2(b_s * qk_scale - gl.expand_dims(m_new, 1))
            l_i = l_i * b_alpha + gl.sum(b_p, 1)
            m_i = m_new
            if j > 0:  # group 1 has read the P of the tile before
                mbarrier.wait(p_empty, (j - 1) & 1)
            p_smem.store(b_p.to(dtype))
            alpha_smem.store(b_alpha)
            fence_async_shared()
            mbarrier.arrive(p_full, count=1)
            acc = _pv(acc, b_alpha, p_smem, v_half, o_layout)
        else:
            mbarrier.wait(p_full, j & 1)
            b_alpha = alpha_smem.load(row_layout)
            acc = _pv(acc, b_alpha, p_smem, v_half, o_layout)
            mbarrier.arrive(p_empty, count=1)
        mbarrier.arrive(empty.index(s), count=1)
    if WG == 0:
        # (group 1 has waited for the last tile's P: the sums' arrival is a phase of its own)
        mbarrier.wait(p_empty, (n_tiles - 1) & 1)
        l_smem.store(l_i)
        o_r = gl.arange(0, ROWS, layout=row_layout)
        gl.store(lse + i_b * stride_lb + h0 + o_r, (m_i + gl.log2(l_i)) * 0.6931471805599453)
        fence_async_shared()
        mbarrier.arrive(p_full, count=1)  # (the sums stored)
    else:
        mbarrier.wait(p_full, n_tiles & 1)
        l_i = l_smem.load(row_layout)
    o_rows = h0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    o_cols = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
    out = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
    gl.store(o + i_b * stride_ob + gl.expand_dims(o_rows * stride_oh, 1)
             + gl.expand_dims(o_cols, 0), out.to(dtype))


@gluon.jit
def mla_decode_gluon_kernel(q_desc, qr_desc, k_desc, kr_desc, o, lse, stride_ob, stride_oh,
                            stride_lb, L, qk_scale, BLOCK_N: gl.constexpr,
                            STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                            LOAD_REGS: gl.constexpr):
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    DV: gl.constexpr = q_desc.block_type.shape[3]
    D_ROPE: gl.constexpr = qr_desc.block_type.shape[3]
    h0 = gl.program_id(0) * ROWS
    i_b = gl.program_id(1)
    n_tiles = L // BLOCK_N
    dtype: gl.constexpr = q_desc.dtype
    layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=q_desc.layout.swizzle_byte_width,
        element_bitwidth=q_desc.layout.element_bitwidth, rank=2)
    rope_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=qr_desc.layout.swizzle_byte_width,
        element_bitwidth=qr_desc.layout.element_bitwidth, rank=2)
    # (P's rows are BLOCK_N 16-bit values: a swizzle as wide as a row, at most 128 bytes)
    P_SWIZZLE: gl.constexpr = 128 if BLOCK_N >= 64 else BLOCK_N * 2
    p_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=P_SWIZZLE, element_bitwidth=q_desc.layout.element_bitwidth, rank=2)
    q_smem = gl.allocate_shared_memory(dtype, [ROWS, DV], layout)
    qr_smem = gl.allocate_shared_memory(dtype, [ROWS, D_ROPE], rope_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DV], layout)
    kr_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_ROPE], rope_layout)
    p_smem = gl.allocate_shared_memory(dtype, [ROWS, BLOCK_N], p_layout)
    rows: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    alpha_smem = gl.allocate_shared_memory(gl.float32, [ROWS], rows)
    l_smem = gl.allocate_shared_memory(gl.float32, [ROWS], rows)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    mbarrier.init(p_full, count=1)
    mbarrier.init(p_empty, count=1)
    gl.warp_specialize([
        (_group, (q_smem, qr_smem, k_smem, kr_smem, p_smem, alpha_smem, l_smem, q_bar, full,
                  empty, p_full, p_empty, o, lse, stride_ob, stride_oh, stride_lb, i_b, h0,
                  n_tiles, qk_scale, 0, BLOCK_N, STAGES)),
        (_group, (q_smem, qr_smem, k_smem, kr_smem, p_smem, alpha_smem, l_smem, q_bar, full,
                  empty, p_full, p_empty, o, lse, stride_ob, stride_oh, stride_lb, i_b, h0,
                  n_tiles, qk_scale, 1, BLOCK_N, STAGES)),
        (_load, (q_desc, qr_desc, k_desc, kr_desc, q_smem, qr_smem, k_smem, kr_smem, q_bar,
                 full, empty, i_b, h0, n_tiles, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, LOAD_REGS])


def launch_args(B: int = 32, L: int = 8192, H: int = 128, BLOCK_N: int = 64, STAGES: int = 2,
                CONSUMER_REGS: int = 240):
    """The kernel's grid and arguments over CPU tensors: q (B, 1, H, 576), a dense latent
    cache (B, L, 1, 576), out (B, 1, H, 512), lse (B, H)."""
    bf16 = torch.bfloat16
    q = torch.empty(B, 1, H, 576, dtype=bf16)
    cache = torch.empty(B, L, 1, 576, dtype=bf16)
    out = torch.empty(B, 1, H, 512, dtype=bf16)
    lse = torch.empty(B, H)
    kwargs = dict(
        q_desc=descriptor(q, (1, 1, 64, 512)), qr_desc=descriptor(q, (1, 1, 64, 64)),
        k_desc=descriptor(cache, (1, BLOCK_N, 1, 512)),
        kr_desc=descriptor(cache, (1, BLOCK_N, 1, 64)),
        o=out, lse=lse, stride_ob=out.stride(0), stride_oh=out.stride(2),
        stride_lb=lse.stride(0), L=L, qk_scale=0.06, BLOCK_N=BLOCK_N, STAGES=STAGES,
        CONSUMER_REGS=CONSUMER_REGS, LOAD_REGS=24, num_warps=4)
    return (H // 64, B), kwargs


def main() -> int:
    failed = 0
    for block_n, stages in ((64, 2), (64, 1), (32, 3), (32, 2)):
        grid, kwargs = launch_args(BLOCK_N=block_n, STAGES=stages)
        res = compile_kernel(mla_decode_gluon_kernel, grid, kwargs,
                             label=f"{block_n} keys, {stages} stages")
        failed += not report(res)
        if res.ok:  # each thread's wgmmas: S's (group 0's only) and P V's, per shape
            wgmmas = re.findall(r"wgmma.mma_async.sync.aligned.(m64n\d+k16)",
                                res.compiled.asm["ptx"])
            print("    wgmmas:", dict(collections.Counter(wgmmas)))
    return failed


if __name__ == "__main__":
    sys.exit(main())
