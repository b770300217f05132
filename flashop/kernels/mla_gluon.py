"""MLA decoding in Gluon on Hopper (triton 3.6): the latent-cache attention of mla.py with
each key tile's scores computed once for 64 query rows.

Triton's `tl` kernel (mla.py) at 64 rows and 8 warps lays the scores' product out over all
eight warps along the rows, so both warp groups compute the whole S = Q K^T (1664 head-dim
columns executed per (row, key) for the 1088 counted). Here, as in FlashMLA:

- a load warp brings the 64 rows' queries once (latent [64, 512] and rotary [64, 64]
  tiles) and each key tile (latent [64, 512] and rotary [64, 64]) into STAGES buffers, by
  TMA, from the dense cache or each tile's page;
- consumer group 0 computes S of the tile, its online softmax, and writes P and the rows'
  rescale factor to shared memory;
- both groups then run O[:, half] = O[:, half] * alpha + P V[:, half], each over 256 of
  the 512 value dims (V is the key tile's latent block, read from the same buffer), and
  release the buffer. Group 0's S of the next tile runs while group 1's P V of this one
  does.

The call's shape rules are the launcher's (flashop/_launch/mla_gluon.py): one latent head
whose first 512 dims are the values, 64 query rows per program (64 heads of one query, or
all the heads of 64 / H queries where H divides 64), 16-bit dtypes, a dense cache or pages
of a multiple of 64 keys. As
mla_decode_kernel: grid (splits, row tiles, B); the lengths read here; a split's partial
output and base-2 lse to o_part / lse_part for the merge kernel; rows that attend no key get
0 and -inf. Rows past a sequence's keys are never attended: their scores are masked, and
their values zeroed in shared memory before the P V product (a cache row past the keys may
hold anything, NaN included).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from flashop.kernels.common import LN2


@gluon.jit
def _tile_row(block_table, i_row, start_n, PAGE_SIZE: gl.constexpr, IS_PAGED: gl.constexpr):
    """The cache coordinates (first index, key) of the key tile at ``start_n``: the
    sequence's row ``i_row`` of a dense cache, or the tile's page (one page holds a tile:
    PAGE_SIZE is a multiple of the tile)."""
    if IS_PAGED:
        page = gl.load(block_table + start_n // PAGE_SIZE)
        return page, start_n % PAGE_SIZE
    return i_row, start_n


@gluon.jit
def _load(q_desc, qr_desc, k_desc, kr_desc, q_smem, qr_smem, k_smem, kr_smem, q_bar, full,
          empty, block_table, i_b, i_q, h0, i_row, s_lo, n_tiles, BLOCK_N: gl.constexpr,
          STAGES: gl.constexpr, PAGE_SIZE: gl.constexpr, IS_PAGED: gl.constexpr):
    DV: gl.constexpr = k_desc.block_type.shape[3]
    mbarrier.expect(q_bar, q_desc.block_type.nbytes + qr_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [i_b, i_q, h0, 0], q_bar,
                                    q_smem.reshape(q_desc.block_type.shape))
    tma.async_copy_global_to_shared(qr_desc, [i_b, i_q, h0, DV], q_bar,
                                    qr_smem.reshape(qr_desc.block_type.shape))
    for j in range(n_tiles):
        s = j % STAGES
        if j >= STAGES:
            mbarrier.wait(empty.index(s), ((j // STAGES) - 1) & 1)
        first, key = _tile_row(block_table, i_row, s_lo + j * BLOCK_N, PAGE_SIZE, IS_PAGED)
        mbarrier.expect(full.index(s), k_desc.block_type.nbytes + kr_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [first, key, 0, 0], full.index(s),
                                        k_smem.index(s).reshape(k_desc.block_type.shape))
        tma.async_copy_global_to_shared(kr_desc, [first, key, 0, DV], full.index(s),
                                        kr_smem.index(s).reshape(kr_desc.block_type.shape))


@gluon.jit
def _zero_rows_past(tile, valid, BLOCK_N: gl.constexpr):
    """Zero the rows from ``valid`` of a key tile [BLOCK_N, DV] in shared memory (its
    values past the sequence's keys), 64 columns at a time."""
    DV: gl.constexpr = tile.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    keep = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout)) < valid, 1)
    for c in gl.static_range(DV // 64):
        part = tile.slice(c * 64, 64, dim=1)
        part.store(gl.where(keep, part.load(layout), 0.0))


@gluon.jit
def _pv(acc, b_alpha, p_smem, v_half, acc_layout: gl.constexpr):
    """acc * alpha + P V_half: the rescale, then the product (one group's half of DV)."""
    acc = acc * gl.expand_dims(gl.convert_layout(b_alpha, gl.SliceLayout(1, acc_layout)), 1)
    tok = warpgroup_mma(p_smem, v_half, acc, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(tok,))


@gluon.jit
def _group(q_smem, qr_smem, k_smem, kr_smem, p_smem, alpha_smem, l_smem, q_bar, full, empty,
           p_full, p_empty, o, lse, o_part, lse_part, stride_ob, stride_os, stride_oh,
           stride_lb, stride_lh, i_b, i_q, h0, s_lo, s_hi, n_tiles, i_run, S_q, H, off,
           qk_scale, WG: gl.constexpr, HEADS: gl.constexpr, BLOCK_N: gl.constexpr,
           STAGES: gl.constexpr, MASK_ROWS: gl.constexpr, SPLIT: gl.constexpr):
    """One consumer group (``WG``) of a program whose 64 rows are HEADS heads (from h0) of
    64 / HEADS queries (from i_q); ``off``: query i's key position less i. MASK_ROWS:
    causal with several queries per tile, whose rows' bounds differ."""
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
            b_s = warpgroup_mma_wait(num_outstanding=0, deps=(tok,)) * qk_scale
            start_n = s_lo + j * BLOCK_N
            valid = s_hi - start_n  # the tile's keys of the run (>= 1)
            o_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            if MASK_ROWS:  # each row's keys: up to its query's position, within the run
                o_r = gl.arange(0, ROWS, layout=row_layout)
                keys = gl.minimum(i_q + o_r // HEADS + off + 1 - start_n, valid)
                b_s = gl.where(gl.expand_dims(o_n, 0) < gl.expand_dims(keys, 1), b_s,
                               float("-inf"))
            elif valid < BLOCK_N:  # the run's last tile reaches past its keys
                b_s = gl.where(gl.expand_dims(o_n < valid, 0), b_s, float("-inf"))
            if valid < BLOCK_N:  # (their values too: 0 x NaN is NaN)
                _zero_rows_past(k_smem.index(s), valid, BLOCK_N)
            m_new = gl.maximum(m_i, gl.max(b_s, 1))
            # (a row with no key yet keeps m = -inf: its P and rescale are then 0)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            b_alpha = gl.exp2(m_i - m_use)
            b_p = gl.exp2(b_s - gl.expand_dims(m_use, 1))
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
    # the rows' sums, from group 0 to group 1 (a phase of p_full of their own, once group 1
    # has read the last tile's P)
    if WG == 0:
        mbarrier.wait(p_empty, (n_tiles - 1) & 1)
        l_smem.store(l_i)
        mbarrier.arrive(p_full, count=1)
    else:
        mbarrier.wait(p_full, n_tiles & 1)
        l_i = l_smem.load(row_layout)
    # out = acc / l, lse = m + log2(l): 0 and -inf for rows that attended no key
    empty_rows = l_i == 0.0
    l_safe = gl.where(empty_rows, 1.0, l_i)
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
    # row r: head h0 + r % HEADS of query i_q + r // HEADS
    o_ro = gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    o_h, o_i = h0 + o_ro % HEADS, i_q + o_ro // HEADS
    o_c = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
    o_r = gl.arange(0, ROWS, layout=row_layout)
    o_rh, o_ri = h0 + o_r % HEADS, i_q + o_r // HEADS
    if SPLIT:  # the partials [splits, B, S_q, H, DV] and [splits, B, H, S_q], contiguous
        o_pr = (i_run * S_q + o_i) * H + o_h
        gl.store(o_part + gl.expand_dims(o_pr * DV, 1) + gl.expand_dims(o_c, 0), out)
        if WG == 0:
            gl.store(lse_part + (i_run * H + o_rh) * S_q + o_ri,
                     gl.where(empty_rows, float("-inf"), m_i + gl.log2(l_safe)))
    else:
        p_o = o + i_b.to(gl.int64) * stride_ob + o_i * stride_os + o_h * stride_oh
        gl.store(gl.expand_dims(p_o, 1) + gl.expand_dims(o_c, 0), out.to(o.dtype.element_ty))
        if WG == 0:
            gl.store(lse + i_b.to(gl.int64) * stride_lb + o_rh * stride_lh + o_ri,
                     gl.where(empty_rows, float("-inf"), (m_i + gl.log2(l_safe)) * LN2))


@gluon.jit
def mla_decode_gluon_kernel(
    q_desc, qr_desc, k_desc, kr_desc, o, lse, o_part, lse_part, cache_seqlens,
    cache_batch_idx, block_table,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_tb,
    S_q, S_new, capacity, G, qk_scale,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PAGE_SIZE: gl.constexpr,
    IS_PAGED: gl.constexpr, HAS_BATCH_IDX: gl.constexpr, IS_CAUSAL: gl.constexpr,
    SPLIT: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOAD_REGS: gl.constexpr,
):
    """Attention of q[b, i, h] (512 + 64 dims; q_desc / qr_desc its latent and rotary
    tiles [1, QUERIES, HEADS, dims] of 64 rows) over the first ``L = cache_seqlens[b] +
    S_new`` rows of sequence b's latent cache (k_desc / kr_desc: a row's latent and rotary
    tiles of BLOCK_N keys; the values its latent dims), query i at key position ``i + L -
    S_q`` (bottom-right causal where ``IS_CAUSAL``). The G query heads over one latent
    head are a multiple of 64 (HEADS = 64, QUERIES = 1) or divide 64 (HEADS = G; G * S_q a
    multiple of 64). Grid (splits, S_q * G // 64, B): program (split, t, b) takes rows
    ``r = i * G + g`` from 64 t, and its split's run of whole key tiles
    (mla_decode_kernel's split_run)."""
    QUERIES: gl.constexpr = q_desc.block_type.shape[1]  # queries per tile of rows
    HEADS: gl.constexpr = q_desc.block_type.shape[2]  # and heads of each
    ROWS: gl.constexpr = QUERIES * HEADS
    DV: gl.constexpr = q_desc.block_type.shape[3]
    D_ROPE: gl.constexpr = qr_desc.block_type.shape[3]
    qk_scale = qk_scale.to(gl.float32)
    i_split = gl.program_id(0)
    r0 = gl.program_id(1) * ROWS
    i_b = gl.program_id(2)
    i_q = r0 // G
    h0 = r0 % G
    # this program's keys [0, hi): the sequence's, up to its last query's position where
    # causal
    L = gl.load(cache_seqlens + i_b) + S_new
    off = L - S_q
    hi = gl.minimum(L, capacity)
    if IS_CAUSAL:
        hi = gl.minimum(hi, i_q + QUERIES + off)
    hi = gl.maximum(hi, 0)
    # the split's run [s_lo, s_hi) of whole key tiles
    tiles_per_split = gl.cdiv(gl.cdiv(hi, BLOCK_N), gl.num_programs(0))
    s_lo = gl.minimum(i_split * tiles_per_split * BLOCK_N, hi)
    s_hi = gl.minimum(s_lo + tiles_per_split * BLOCK_N, hi)
    n_tiles = gl.cdiv(s_hi - s_lo, BLOCK_N)
    # (64-bit: the partials of every split and sequence, and the outputs' batch offsets)
    i_run = i_split.to(gl.int64) * gl.num_programs(2) + i_b
    i_row = i_b
    if HAS_BATCH_IDX:
        i_row = gl.load(cache_batch_idx + i_b)
    if IS_PAGED:
        block_table += i_b.to(gl.int64) * stride_tb

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
                  empty, p_full, p_empty, o, lse, o_part, lse_part, stride_ob, stride_os,
                  stride_oh, stride_lb, stride_lh, i_b, i_q, h0, s_lo, s_hi, n_tiles, i_run,
                  S_q, G, off, qk_scale, 0, HEADS, BLOCK_N, STAGES,
                  IS_CAUSAL and QUERIES > 1, SPLIT)),
        (_group, (q_smem, qr_smem, k_smem, kr_smem, p_smem, alpha_smem, l_smem, q_bar, full,
                  empty, p_full, p_empty, o, lse, o_part, lse_part, stride_ob, stride_os,
                  stride_oh, stride_lb, stride_lh, i_b, i_q, h0, s_lo, s_hi, n_tiles, i_run,
                  S_q, G, off, qk_scale, 1, HEADS, BLOCK_N, STAGES,
                  IS_CAUSAL and QUERIES > 1, SPLIT)),
        (_load, (q_desc, qr_desc, k_desc, kr_desc, q_smem, qr_smem, k_smem, kr_smem, q_bar,
                 full, empty, block_table, i_b, i_q, h0, i_row, s_lo, n_tiles, BLOCK_N,
                 STAGES, PAGE_SIZE, IS_PAGED)),
    ], [4, 1], [CONSUMER_REGS, LOAD_REGS])
