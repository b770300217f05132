"""The plain forward on Hopper in Gluon (``triton.experimental.gluon``), written for triton
3.6: its API changes between releases, so flashop imports this module only under that
version (flashop/_launch/gluon.py). Triton's interpreter cannot run Gluon: the ``tl`` forward
(flashop/kernels/forward.py) stays the reference, and the GPU suite checks this kernel
against the same reference.

The grid holds one program per SM. Each takes work units in turn (_work_item: a query tile
of BLOCK_M rows of one (batch, head), or where causal a pair of them) and runs its
partitions over its units:
- a load warp: each item's Q, then its K and V tile by tile through tensor descriptors
  (TMA) into STAGES shared buffers, refilling a buffer once every consumer group released
  it, and running ahead into the next item while the consumers finish one. Where
  KV_APART (two stages of 64 keys at D = 256: what fits beside Q), K and V buffers have
  barriers of their own, a K tile released once its scores are computed and a V tile once
  its P V is, so that the next K loads while P V runs; else a tile's K and V share one;
- BLOCK_M / 64 consumer warp groups (two or three) of 64 rows each: S = Q K^T and O += P V
  by wgmma, with S_{j+1} issued together with P_j V_j, so the softmax of S_{j+1} runs while
  P_j V_j does.
Where CAUSAL (S_q == S_k) a consumer group's last key tile is its diagonal, the only one
it masks; a group whose diagonal comes before the item's last tile (three groups over
128-key tiles) releases the tiles after it unread.

Gluon's tiles are powers of two: at D = 192 (DV = 128) q's and k's head dims are two tiles,
128 and 64 wide (HEAD_PARTS: second descriptors and buffers on the same barriers), and
S = Q K^T is two products into one accumulator.

The descriptors read each (B, S, H, D) input as it is strided, a tile being [1, rows, 1, D]:
rows past a sequence's end read as 0. The last key tile of each item is masked where S_k is
not a multiple of BLOCK_N (where causal, each group's diagonal); query rows past S_q are
computed and not stored. Where DROPOUT, each consumer group draws the keep mask of its
scores in their own registers (flashop/kernels/dropout_gluon.py).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from flashop.kernels.common import LN2
from flashop.kernels.dropout_gluon import dropout_args, draw_rows, keep_rows


@gluon.jit
def _softmax_tile(b_s, m_i, l_i, qk_scale, b_keep, dtype: gl.constexpr,
                  p_layout: gl.constexpr, DROPOUT: gl.constexpr):
    """One key tile's online softmax, in base 2 with m in scaled units (the scale folds into
    exp2's FMA; qk_scale > 0): (P as the PV wgmma's register operand, new m, new l, the
    rescale alpha of the rows' earlier tiles). Where DROPOUT, P V takes only the pairs
    ``b_keep`` keeps (l sums them all)."""
    # [ROWS]
    m_new = gl.maximum(m_i, gl.max(b_s, 1) * qk_scale)
    # [ROWS, BLOCK_N]
    b_p = gl.exp2(gl.fma(b_s, qk_scale, -gl.expand_dims(m_new, 1)))
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(b_p, 1)
    if DROPOUT:
        b_p = gl.where(b_keep, b_p, 0.0)
    return gl.convert_layout(b_p.to(dtype), p_layout), m_new, l_new, alpha


@gluon.jit
def _softmax_diagonal_tile(b_s, m_i, l_i, qk_scale, b_keep, o_q, o_k, dtype: gl.constexpr,
                           p_layout: gl.constexpr, DROPOUT: gl.constexpr):
    """_softmax_tile with the keys past each row's query masked (the causal diagonal)."""
    b_s = gl.where(gl.expand_dims(o_k, 0) <= gl.expand_dims(o_q, 1), b_s, float("-inf"))
    return _softmax_tile(b_s, m_i, l_i, qk_scale, b_keep, dtype, p_layout, DROPOUT)


@gluon.jit
def _softmax_last_tile(b_s, m_i, l_i, qk_scale, b_keep, o_q, o_k, S_k, dtype: gl.constexpr,
                       p_layout: gl.constexpr, CAUSAL: gl.constexpr, DROPOUT: gl.constexpr):
    """_softmax_tile of a group's last key tile: the causal diagonal (S_q == S_k, which
    also masks the keys past S_k for every stored row), else the keys past S_k."""
    if CAUSAL:
        return _softmax_diagonal_tile(b_s, m_i, l_i, qk_scale, b_keep, o_q, o_k, dtype,
                                      p_layout, DROPOUT)
    b_s = gl.where(gl.expand_dims(o_k < S_k, 0), b_s, float("-inf"))
    return _softmax_tile(b_s, m_i, l_i, qk_scale, b_keep, dtype, p_layout, DROPOUT)


@gluon.jit
def _work_item(u, side, n_m, H, S_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               CAUSAL: gl.constexpr):
    """Item ``side`` of work unit ``u``: its query tile i_m, batch i_b, head i_h and key
    tiles n_tiles (0: no item). A (batch, head)'s units come in turn, so that the programs
    running at once share its keys and values in L2. Without CAUSAL a unit is one query
    tile. Where CAUSAL, unit a of a (batch, head) pairs query tile n_m - 1 - a with tile a,
    n_m + 1 key tiles in all, so that all units weigh the same and the programs, taking
    units in turn, end together (the middle tile of an odd n_m is a unit alone)."""
    if CAUSAL:
        half = (n_m + 1) // 2
        i_bh = u // half
        a = u % half
        i_m = n_m - 1 - a
        if side == 1:
            i_m = a
        n_tiles = gl.cdiv((i_m + 1) * BLOCK_M, BLOCK_N)  # the keys up to its last row
        if side == 1 and 2 * a + 1 == n_m:
            n_tiles = 0
    else:
        i_bh = u // n_m
        i_m = u % n_m
        n_tiles = gl.cdiv(S_k, BLOCK_N)
    return i_m, i_bh // H, i_bh % H, n_tiles


@gluon.jit
def _kv_apart(full, STAGES: gl.constexpr):
    """Whether K and V buffers have barriers of their own (``full`` holds 2 * STAGES: the K
    buffers', then the V buffers'), or share one per stage."""
    return full.shape[0] > STAGES


@gluon.jit
def _wait_k(full, t, STAGES: gl.constexpr):
    """Wait for the program's t-th key tile's K (where they share a barrier, and V)."""
    mbarrier.wait(full.index(t % STAGES), (t // STAGES) & 1)


@gluon.jit
def _wait_v(full, t, STAGES: gl.constexpr):
    """Wait for the t-th key tile's V where it has a barrier of its own (else _wait_k did)."""
    if _kv_apart(full, STAGES):
        mbarrier.wait(full.index(STAGES + t % STAGES), (t // STAGES) & 1)


@gluon.jit
def _release_k(empty, t, STAGES: gl.constexpr):
    """This consumer group is done with the t-th key tile's K (where they share a barrier,
    _release_v releases both)."""
    if _kv_apart(empty, STAGES):
        mbarrier.arrive(empty.index(t % STAGES), count=1)


@gluon.jit
def _release_v(empty, t, STAGES: gl.constexpr):
    """This consumer group is done with the t-th key tile's V (and its K where they share
    a barrier)."""
    if _kv_apart(empty, STAGES):
        mbarrier.arrive(empty.index(STAGES + t % STAGES), count=1)
    else:
        mbarrier.arrive(empty.index(t % STAGES), count=1)


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_desc2, k_desc2, q_smem, k_smem, v_smem,
                    q_smem2, k_smem2, q_full, q_empty, full, empty, n_units, n_m, H, G, S_k,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                    SIDES: gl.constexpr, HEAD_PARTS: gl.constexpr):
    """The load warp, over this program's work items: Q once every consumer group is done
    with the previous item's, then K and V of each key tile into buffer c % STAGES (c
    counts the program's key tiles over all its items), once every consumer group released
    that buffer's previous tile (its K and V apart where they have barriers of their own,
    _kv_apart). A [rows, D] buffer takes a [1, rows, 1, D] tile of the (B, S, H, D) input;
    Q comes as one [ROWS, D] buffer per consumer group. Where HEAD_PARTS, q's and k's head
    dims past the first tile's (q_desc's columns) come through q_desc2 and k_desc2 into
    q_smem2 and k_smem2, on the same barriers."""
    GROUPS: gl.constexpr = q_smem.shape[0]
    D1: gl.constexpr = q_smem.shape[2]
    # the bytes a Q tile's and a K tile's loads bring (both head-dim tiles where in parts)
    Q_BYTES: gl.constexpr = q_desc.block_type.nbytes + HEAD_PARTS * q_desc2.block_type.nbytes
    K_BYTES: gl.constexpr = k_desc.block_type.nbytes + HEAD_PARTS * k_desc2.block_type.nbytes
    ROWS: gl.constexpr = q_smem.shape[1]
    STAGES: gl.constexpr = k_smem.shape[0]
    c = 0
    n_done = 0
    for u in range(gl.program_id(0), n_units, gl.num_programs(0)):
        for side in range(SIDES):
            i_m, i_b, i_h, n_tiles = _work_item(u, side, n_m, H, S_k, BLOCK_M, BLOCK_N, CAUSAL)
            if n_tiles > 0:
                if n_done > 0:
                    mbarrier.wait(q_empty, (n_done - 1) & 1)
                mbarrier.expect(q_full, GROUPS * Q_BYTES)
                for g in gl.static_range(GROUPS):
                    tma.async_copy_global_to_shared(
                        q_desc, [i_b, i_m * BLOCK_M + g * ROWS, i_h, 0], q_full,
                        q_smem.index(g).reshape(q_desc.block_type.shape))
                    if HEAD_PARTS:
                        tma.async_copy_global_to_shared(
                            q_desc2, [i_b, i_m * BLOCK_M + g * ROWS, i_h, D1], q_full,
                            q_smem2.index(g).reshape(q_desc2.block_type.shape))
                i_hk = i_h // G
                for j in range(n_tiles):
                    s = c % STAGES
                    v_bar = s  # V's barrier
                    if _kv_apart(full, STAGES):
                        v_bar = STAGES + s
                    if c >= STAGES:
                        mbarrier.wait(empty.index(s), ((c // STAGES) - 1) & 1)
                    if _kv_apart(full, STAGES):
                        mbarrier.expect(full.index(s), K_BYTES)
                    else:
                        mbarrier.expect(full.index(s), K_BYTES + v_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(
                        k_desc, [i_b, j * BLOCK_N, i_hk, 0], full.index(s),
                        k_smem.index(s).reshape(k_desc.block_type.shape))
                    if HEAD_PARTS:
                        tma.async_copy_global_to_shared(
                            k_desc2, [i_b, j * BLOCK_N, i_hk, D1], full.index(s),
                            k_smem2.index(s).reshape(k_desc2.block_type.shape))
                    if _kv_apart(full, STAGES):
                        if c >= STAGES:
                            mbarrier.wait(empty.index(v_bar), ((c // STAGES) - 1) & 1)
                        mbarrier.expect(full.index(v_bar), v_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(
                        v_desc, [i_b, j * BLOCK_N, i_hk, 0], full.index(v_bar),
                        v_smem.index(s).reshape(v_desc.block_type.shape))
                    c += 1
                n_done += 1


@gluon.jit
def _attend_item(q_smem, k_smem, v_smem, q_smem2, k_smem2, q_full, q_empty, full, empty,
                 o_desc, o, lse, lse_log2, stride_os, stride_od, start_m, S_q, S_k, n_tiles,
                 qk_scale, c, n_done, i_b, i_h, k0, k1, threshold, dropout_p,
                 WG: gl.constexpr, BLOCK_N: gl.constexpr, DV: gl.constexpr,
                 CAUSAL: gl.constexpr, MASK_LAST: gl.constexpr, DROPOUT: gl.constexpr,
                 O_TMA: gl.constexpr, HEAD_PARTS: gl.constexpr):
    """Consumer group WG on one work item of n_tiles key tiles, the first the program's
    c-th (in buffer c % STAGES); the item is the program's n_done-th. The group's query
    rows are [start_m + WG * ROWS, + ROWS); where CAUSAL its keys end with its diagonal
    tile, which may come before the item's last (three groups over 128-key tiles), and it
    releases the tiles after it unread. Writes the rows' output and lse (``o``, ``lse``,
    ``lse_log2`` point at the (batch, head)'s first row). Where O_TMA the output is staged
    in the group's Q buffer and stored by TMA through ``o_desc``, and Q released after
    that store; else Q is released once its last S = Q K^T is done, so that the load warp
    fetches the next item's Q while this one's last P V and its stores run
    (_launch.gluon.FWD_O_TMA takes the faster per head dim). Where DROPOUT, each tile's keep
    mask is drawn (dropout_gluon.keep_rows, key (k0, k1), ``threshold``) while its S = Q
    K^T runs, and the output is scaled by 1 / (1 - dropout_p). Where HEAD_PARTS, S is two
    products into one accumulator, over the head dims in q_smem / k_smem and in q_smem2 /
    k_smem2."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype
    ROWS: gl.constexpr = q_smem.shape[1]
    STAGES: gl.constexpr = k_smem.shape[0]
    b_q = q_smem.index(WG)
    b_q2 = q_smem2.index(WG)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([ROWS], gl.float32, row_layout)
    acc = gl.zeros([ROWS, DV], gl.float32, o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    o_q = start_m + WG * ROWS + gl.arange(0, ROWS, layout=row_layout)
    o_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    n_own = n_tiles
    if CAUSAL:  # the tile of the group's last row (64-row groups lie in one tile)
        n_own = gl.cdiv(start_m + (WG + 1) * ROWS, BLOCK_N)
    b_keep = 0
    c_q = 0
    if DROPOUT:
        c_q = draw_rows(start_m + WG * ROWS, ROWS, BLOCK_N)
    # the first tile's scores, alone
    mbarrier.wait(q_full, n_done & 1)
    _wait_k(full, c, STAGES)
    # [ROWS, BLOCK_N]
    s_tok = warpgroup_mma(b_q, k_smem.index(c % STAGES).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
    if HEAD_PARTS:
        s_tok = warpgroup_mma(b_q2, k_smem2.index(c % STAGES).permute((1, 0)), s_tok,
                              is_async=True)
    if DROPOUT:
        b_keep = keep_rows(k0, k1, c_q, i_b, i_h, 0, threshold, ROWS, BLOCK_N, s_layout)
    b_s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
    _release_k(empty, c, STAGES)
    if MASK_LAST and n_own == 1:
        b_p, m_i, l_i, alpha = _softmax_last_tile(b_s, m_i, l_i, qk_scale, b_keep, o_q, o_n,
                                                  S_k, dtype, p_layout, CAUSAL, DROPOUT)
    else:
        b_p, m_i, l_i, alpha = _softmax_tile(b_s, m_i, l_i, qk_scale, b_keep, dtype, p_layout,
                                             DROPOUT)
    # S_{j+1} and O += P_j V_j issued together; the softmax of S_{j+1} under P_j V_j
    for j in range(n_own - 1):
        _wait_k(full, c + j + 1, STAGES)
        # [ROWS, BLOCK_N]
        s_tok = warpgroup_mma(b_q, k_smem.index((c + j + 1) % STAGES).permute((1, 0)),
                              s_zero, use_acc=False, is_async=True)
        if HEAD_PARTS:
            s_tok = warpgroup_mma(b_q2, k_smem2.index((c + j + 1) % STAGES).permute((1, 0)),
                                  s_tok, is_async=True)
        _wait_v(full, c + j, STAGES)
        # [ROWS, DV]
        acc_tok = warpgroup_mma(b_p, v_smem.index((c + j) % STAGES), acc, is_async=True)
        b_s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
        _release_k(empty, c + j + 1, STAGES)
        if DROPOUT:
            b_keep = keep_rows(k0, k1, c_q, i_b, i_h, (j + 1) * BLOCK_N, threshold, ROWS,
                                   BLOCK_N, s_layout)
        if MASK_LAST and j + 2 == n_own:
            b_p, m_i, l_i, alpha = _softmax_last_tile(
                b_s, m_i, l_i, qk_scale, b_keep, o_q, (j + 1) * BLOCK_N + o_n, S_k, dtype,
                p_layout, CAUSAL, DROPOUT)
        else:
            b_p, m_i, l_i, alpha = _softmax_tile(b_s, m_i, l_i, qk_scale, b_keep, dtype,
                                                 p_layout, DROPOUT)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
        _release_v(empty, c + j, STAGES)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
    if not O_TMA:
        mbarrier.arrive(q_empty, count=1)
    _wait_v(full, c + n_own - 1, STAGES)
    # [ROWS, DV]
    acc_tok = warpgroup_mma(b_p, v_smem.index((c + n_own - 1) % STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
    _release_v(empty, c + n_own - 1, STAGES)
    # the item's tiles past the group's own, which the other groups read (each released
    # once loaded, so that no release counts toward a later fill of its buffer)
    for j in range(n_own, n_tiles):
        _wait_k(full, c + j, STAGES)
        _release_k(empty, c + j, STAGES)
        _wait_v(full, c + j, STAGES)
        _release_v(empty, c + j, STAGES)
    # every row attends at least one key (S_k >= 1; causal: its own), so l_i > 0
    l_o = gl.convert_layout(l_i, orow_layout)
    if DROPOUT:
        l_o = l_o * (1.0 - dropout_p)
    b_o = acc / gl.expand_dims(l_o, 1)
    if O_TMA:
        # through the group's Q buffer (read by its last S): one TMA store, which drops
        # the rows past S_q
        b_q.store(b_o.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [i_b, start_m + WG * ROWS, i_h, 0],
                                        b_q.reshape(o_desc.block_type.shape))
    else:
        o_m = start_m + WG * ROWS + gl.arange(0, ROWS, layout=orow_layout)
        o_d = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
        p_o = o + (gl.expand_dims(o_m.to(gl.int64) * stride_os, 1)
                   + gl.expand_dims(o_d * stride_od, 0))
        gl.store(p_o, b_o.to(dtype), mask=gl.expand_dims(o_m < S_q, 1))
    b_lse_log2 = m_i + gl.log2(l_i)
    gl.store(lse_log2 + o_q, b_lse_log2, mask=o_q < S_q)
    gl.store(lse + o_q, b_lse_log2 * LN2, mask=o_q < S_q)
    if O_TMA:
        tma.store_wait(0)
        gl.thread_barrier()  # every warp's part of the store has read the buffer
        mbarrier.arrive(q_empty, count=1)
    return c + n_tiles


@gluon.jit
def _consumer_partition(q_smem, k_smem, v_smem, q_smem2, k_smem2, q_full, q_empty, full,
                        empty, o_desc, o,
                        lse, lse_log2, stride_ob, stride_os, stride_oh, stride_od,
                        stride_lb, stride_lh,
                        n_units, n_m, H, S_q, S_k, qk_scale, dropout_seed, dropout_p,
                        WG: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        DV: gl.constexpr, CAUSAL: gl.constexpr,
                        MASK_LAST: gl.constexpr, SIDES: gl.constexpr, DROPOUT: gl.constexpr,
                        O_TMA: gl.constexpr, HEAD_PARTS: gl.constexpr):
    """Consumer group WG over this program's work items (_attend_item), in the load warp's
    order; where DROPOUT, Philox's key is the int64 ``dropout_seed[0]``."""
    c = 0
    n_done = 0
    k0, k1, threshold = dropout_args(dropout_seed, dropout_p, DROPOUT)
    for u in range(gl.program_id(0), n_units, gl.num_programs(0)):
        for side in range(SIDES):
            i_m, i_b, i_h, n_tiles = _work_item(u, side, n_m, H, S_k, BLOCK_M, BLOCK_N, CAUSAL)
            if n_tiles > 0:
                o_bh = i_b.to(gl.int64) * stride_ob + i_h.to(gl.int64) * stride_oh
                l_bh = i_b.to(gl.int64) * stride_lb + i_h.to(gl.int64) * stride_lh
                c = _attend_item(q_smem, k_smem, v_smem, q_smem2, k_smem2, q_full, q_empty,
                                 full, empty, o_desc, o + o_bh, lse + l_bh, lse_log2 + l_bh,
                                 stride_os, stride_od, i_m * BLOCK_M, S_q, S_k, n_tiles,
                                 qk_scale, c, n_done, i_b, i_h, k0, k1, threshold, dropout_p,
                                 WG, BLOCK_N, DV, CAUSAL, MASK_LAST, DROPOUT, O_TMA,
                                 HEAD_PARTS)
                n_done += 1


@gluon.jit
def attention_fwd_gluon_kernel(
    q_desc, k_desc, v_desc, q_desc2, k_desc2, o_desc, o, lse, lse_log2,
    stride_ob, stride_os, stride_oh, stride_od, stride_lb, stride_lh,
    S_q, S_k, H, G, n_units, qk_scale, dropout_seed, dropout_p,
    D: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, KV_APART: gl.constexpr, O_TMA: gl.constexpr, CAUSAL: gl.constexpr,
    MASK_LAST: gl.constexpr, DROPOUT: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    LOAD_REGS: gl.constexpr,
):
    """out[b, i, h] = softmax(scale * q_i . K^T) V over the (batch, head)'s keys (the
    module's docstring has the partitions), lse[b, h, i] in natural log and lse_log2 in
    base 2; qk_scale = scale * log2(e) > 0. Where CAUSAL, S_q == S_k. MASK_LAST: CAUSAL or
    S_k not a multiple of BLOCK_N (the last key tile masked; a masked branch in the loop
    costs time where there is nothing to mask). Grid: (P,); program p takes the work units p,
    p + P, ... of the n_units (_launch.gluon.work_units; _work_item). q_desc's and o_desc's
    tiles are one consumer group's rows (64). KV_APART: K and V buffers released apart (the
    module's docstring). O_TMA: the output stored by TMA (_attend_item). Where DROPOUT, P V
    takes the probabilities kept by the mask of the int64 ``dropout_seed[0]`` and
    ``dropout_p`` (flashop/kernels/dropout_gluon.py), the output scaled by 1 / (1 -
    dropout_p); lse is the undropped softmax's. Where q_desc's tiles are narrower than D
    (D = 192: Gluon's tiles are powers of two), q's and k's head dims past them are a second
    tile, read through q_desc2 and k_desc2 (q_desc and k_desc again where there is none)."""
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    D1: gl.constexpr = q_desc.block_type.shape[3]  # the head dims' first tile
    HEAD_PARTS: gl.constexpr = D1 < D
    GROUPS: gl.constexpr = BLOCK_M // ROWS
    gl.static_assert(ROWS == 64, "consumer groups of 64 rows (a warp group's wgmma)")
    gl.static_assert(GROUPS * ROWS == BLOCK_M and (GROUPS == 2 or GROUPS == 3),
                     "two or three consumer groups")
    gl.static_assert(BLOCK_N % ROWS == 0, "a consumer group's rows within one key tile")
    gl.static_assert(STAGES >= 2, "a tile loading while one is read")
    gl.static_assert(D == DV or not O_TMA, "the output staged in the Q buffers")
    gl.static_assert(not HEAD_PARTS or q_desc2.block_type.shape[3] == D - D1,
                     "the second head-dim tile covers the rest of D")
    n_m = gl.cdiv(S_q, BLOCK_M)
    SIDES: gl.constexpr = 2 if CAUSAL else 1
    dtype: gl.constexpr = q_desc.dtype
    # 2-D buffers (the wgmmas' operands) in the descriptors' swizzle
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=q_desc.layout.swizzle_byte_width,
        element_bitwidth=q_desc.layout.element_bitwidth, rank=2)
    q_smem = gl.allocate_shared_memory(dtype, [GROUPS, ROWS, D1], smem_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D1], smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DV], smem_layout)
    if HEAD_PARTS:
        smem_layout2: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=q_desc2.layout.swizzle_byte_width,
            element_bitwidth=q_desc2.layout.element_bitwidth, rank=2)
        q_smem2 = gl.allocate_shared_memory(dtype, [GROUPS, ROWS, D - D1], smem_layout2)
        k_smem2 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D - D1], smem_layout2)
    else:  # (placeholders, not read)
        q_smem2 = q_smem
        k_smem2 = k_smem
    q_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    # a barrier per stage, or where KV_APART the K buffers' then the V buffers' (_kv_apart)
    BARRIERS: gl.constexpr = 2 * STAGES if KV_APART else STAGES
    full = gl.allocate_shared_memory(gl.int64, [BARRIERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [BARRIERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_full, count=1)
    mbarrier.init(q_empty, count=GROUPS)  # every consumer group releases Q
    for i in gl.static_range(BARRIERS):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=GROUPS)  # every consumer group releases a buffer
    # (each partition's arguments written out: in a tuple, Triton 3.6 passes constexprs as
    # tensors)
    if GROUPS == 2:
        gl.warp_specialize([
            (_consumer_partition, (q_smem, k_smem, v_smem, q_smem2, k_smem2, q_full,
                                   q_empty, full, empty,
                                   o_desc, o, lse, lse_log2, stride_ob, stride_os, stride_oh,
                                   stride_od, stride_lb, stride_lh, n_units, n_m, H, S_q, S_k,
                                   qk_scale, dropout_seed, dropout_p, 0, BLOCK_M, BLOCK_N, DV,
                                   CAUSAL, MASK_LAST, SIDES, DROPOUT, O_TMA, HEAD_PARTS)),
            (_consumer_partition, (q_smem, k_smem, v_smem, q_smem2, k_smem2, q_full,
                                   q_empty, full, empty,
                                   o_desc, o, lse, lse_log2, stride_ob, stride_os, stride_oh,
                                   stride_od, stride_lb, stride_lh, n_units, n_m, H, S_q, S_k,
                                   qk_scale, dropout_seed, dropout_p, 1, BLOCK_M, BLOCK_N, DV,
                                   CAUSAL, MASK_LAST, SIDES, DROPOUT, O_TMA, HEAD_PARTS)),
            (_load_partition, (q_desc, k_desc, v_desc, q_desc2, k_desc2, q_smem, k_smem,
                               v_smem, q_smem2, k_smem2, q_full, q_empty, full, empty,
                               n_units, n_m, H, G, S_k, BLOCK_M, BLOCK_N, CAUSAL, SIDES,
                               HEAD_PARTS)),
        ], [4, 1], [CONSUMER_REGS, LOAD_REGS])
    else:
        gl.warp_specialize([
            (_consumer_partition, (q_smem, k_smem, v_smem, q_smem2, k_smem2, q_full,
                                   q_empty, full, empty,
                                   o_desc, o, lse, lse_log2, stride_ob, stride_os, stride_oh,
                                   stride_od, stride_lb, stride_lh, n_units, n_m, H, S_q, S_k,
                                   qk_scale, dropout_seed, dropout_p, 0, BLOCK_M, BLOCK_N, DV,
                                   CAUSAL, MASK_LAST, SIDES, DROPOUT, O_TMA, HEAD_PARTS)),
            (_consumer_partition, (q_smem, k_smem, v_smem, q_smem2, k_smem2, q_full,
                                   q_empty, full, empty,
                                   o_desc, o, lse, lse_log2, stride_ob, stride_os, stride_oh,
                                   stride_od, stride_lb, stride_lh, n_units, n_m, H, S_q, S_k,
                                   qk_scale, dropout_seed, dropout_p, 1, BLOCK_M, BLOCK_N, DV,
                                   CAUSAL, MASK_LAST, SIDES, DROPOUT, O_TMA, HEAD_PARTS)),
            (_consumer_partition, (q_smem, k_smem, v_smem, q_smem2, k_smem2, q_full,
                                   q_empty, full, empty,
                                   o_desc, o, lse, lse_log2, stride_ob, stride_os, stride_oh,
                                   stride_od, stride_lb, stride_lh, n_units, n_m, H, S_q, S_k,
                                   qk_scale, dropout_seed, dropout_p, 2, BLOCK_M, BLOCK_N, DV,
                                   CAUSAL, MASK_LAST, SIDES, DROPOUT, O_TMA, HEAD_PARTS)),
            (_load_partition, (q_desc, k_desc, v_desc, q_desc2, k_desc2, q_smem, k_smem,
                               v_smem, q_smem2, k_smem2, q_full, q_empty, full, empty,
                               n_units, n_m, H, G, S_k, BLOCK_M, BLOCK_N, CAUSAL, SIDES,
                               HEAD_PARTS)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOAD_REGS])
