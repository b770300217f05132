"""The plain backward on Hopper in Gluon (``triton.experimental.gluon``), written for triton
3.6 like flashop/kernels/forward_gluon.py (imported only under that version, never by the
interpreter; the ``tl`` backward in flashop/kernels/backward.py stays the reference).

One kernel computes dK and dV of one key tile and adds its share of dQ into an fp32 buffer
by TMA's bulk reduce-add, so S and dP are computed once (five products per tile pair, where
the deterministic ``tl`` backward computes seven): FlashAttention-3's structure. Where
DETERMINISTIC is off the sum's order over key tiles is not fixed, so dQ is not bitwise
reproducible (flashop runs it so only where the caller asked for dQ by atomics); where it
is on, each query tile of dQ takes its key tiles' adds in a fixed order, by a counter per
query tile in global memory (zeroed by the caller): a program waits until the counter
reads its turn before its adds, and raises it once they are complete. Either in key-tile
order, 0, 1, 2, ...: a program waits only on the program of the key tile before it,
launched before it, so the waits end whatever the number of programs resident; the grid
runs key tiles in bands of a few per (batch, KV head), so that the programs resident at
once share Q, dO and dQ's tiles (in L2) yet hold few key tiles of one head to wait on each
other. Or, where ROTATE (not causal; the launcher's rule: no more key tiles than the GPU
holds programs), rotated: all key tiles of a (batch, KV head) side by side, key tile j
starting on query tile j * n_qt // n_tiles and walking on cyclically, each query tile's
adds in the order the key tiles reach it (_dq_turn), so that none waits but for an add in
flight (in key-tile order, key tile j starts j steps late). The waits and the adds are a
warp's of their own, so that the consumer groups never wait for an add to complete, only
for it to have read their shared tile.

One program takes BLOCK_N keys of one (batch, KV head) and runs four partitions:
- a load warp: K and V once, then Q and dO of each query tile (of every query head of the
  group, in turn; or of its share of them, where the grid splits each group's heads
  between programs that add dK and dV into fp32 sums) through tensor descriptors, and
  the tile's rows of lse_log2 and delta by loads, into STAGES shared buffers;
- two consumer warp groups, group w owning keys [w * BLOCK_N / 2, (w + 1) * BLOCK_N / 2) of
  the tile. Per query tile, group w computes S^T and dP^T of its keys by wgmma, P^T and
  dS^T, then dV += P^T dO and dK += dS^T Q; both groups' dS^T meet in shared memory, and
  group w computes dQ's columns [w * D / 2, (w + 1) * D / 2) of the query tile over all
  BLOCK_N keys (dS K), which it adds, scaled, into dQ's buffer from shared memory (where
  DETERMINISTIC, it leaves the tile in shared memory to the dQ warp);
- where DETERMINISTIC, a dQ warp: per query tile, the wait for its turn, both halves'
  adds, and the counter's raise once they are complete (otherwise it has nothing to do).
Rows past S_q read as 0 and their lse as +inf, so they add nothing; keys past S_k read as
0, their rows of dK and dV are not stored and their dS is zeroed before dQ. Where DROPOUT,
each consumer group draws the forward's keep mask of its scores in their own registers
(flashop/kernels/dropout_gluon.py).
"""

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from flashop.kernels.dropout_gluon import dropout_args, keep_keys


@builtin
def _reduce_add_shared_to_global(tensor_desc, coord, src, _semantic=None):
    """Add the shared tile ``src`` into ``tensor_desc``'s tile at ``coord`` (TMA's bulk
    reduce, ``cp.reduce.async.bulk.tensor``; triton 3.6 builds the operation but exports no
    function for it). tma.store_wait waits for it as for a store."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle,
                                              coord, src.handle)


@gluon.jit
def _dq_add_done(sem):
    """Once the warp's bulk reduce-adds are complete (written, not only read from shared
    memory), raise the counter ``sem`` (a scalar pointer; one thread, after the warp's
    barrier) with release semantics."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;",
                              "=r,r", [sem.to(gl.int64, bitcast=True).to(gl.int32)],
                              dtype=gl.int32, is_pure=False, pack=1)
    gl.thread_barrier()
    gl.atomic_add(sem, 1, sem="release", scope="gpu")


@gluon.jit
def _dq_wait_turn(sem, turn):
    """Wait until the counter ``sem`` reads ``turn`` (each thread spins on an acquire
    load), so that the add that follows comes after those of the key tiles before."""
    gl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\t.reg .b32 v;\n\tmov.u32 $0, 0;\n"
        "WAIT_TURN:\n\tld.acquire.gpu.global.b32 v, [$1];\n\tsetp.ne.b32 p, v, $2;\n\t"
        "@p bra WAIT_TURN;\n\tfence.proxy.async.global;\n\t}",
        "=r,l,r", [sem, turn], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _dq_counter(dq_sem, i_b, i_h, H, start_m, n_m, BLOCK_M: gl.constexpr):
    """The counter of dQ's query tile start_m / BLOCK_M of (i_b, i_h)."""
    return dq_sem + (i_b * H + i_h) * n_m + start_m // BLOCK_M


@gluon.jit
def _query_tile(t, h0, m_lo, n_qt, shift, BLOCK_M: gl.constexpr, DESCENDING: gl.constexpr):
    """Step t's query head and first row: the program's heads from h0 in turn, each over
    query tiles m_lo, ..., m_lo + n_qt - 1, or from the last down where DESCENDING, from
    the ``shift``-th on, cyclically (0 where not ROTATE)."""
    i_m = t % n_qt
    if DESCENDING:
        i_m = n_qt - 1 - i_m
    i_m = (i_m + shift) % n_qt
    return h0 + t // n_qt, (m_lo + i_m) * BLOCK_M


@gluon.jit
def _dq_turn(i_n, start_m, n_tiles, n_qt, BLOCK_M: gl.constexpr, ROTATE: gl.constexpr):
    """Key tile i_n's place among the adds into dQ's query tile start_m / BLOCK_M: i_n
    (key-tile order), or where ROTATE (every key tile of the (batch, KV head) resident at
    once, not causal, key tile j starting on query tile j * n_qt // n_tiles) the order in
    which they reach it: the last key tile to start on it or before it (j0), then j0 - 1,
    ..., 0, n_tiles - 1, ..., j0 + 1, so that none waits on one behind it."""
    turn = i_n
    if ROTATE:
        i_m = start_m // BLOCK_M
        j0 = gl.minimum(((i_m + 1) * n_tiles + n_qt - 1) // n_qt - 1, n_tiles - 1)
        turn = (j0 - i_n + n_tiles) % n_tiles
    return turn


@gluon.jit
def _load_row_values(lse_log2, delta, lse_smem, delta_smem, stride_lb, stride_lh, i_b, i_h,
                     start_m, S_q, BLOCK_M: gl.constexpr):
    """lse_log2 (a row that attended nothing, -inf, as +inf: its P is then 0; rows past S_q
    +inf) and delta (0 past S_q) of a query tile, into shared memory (by the load warp)."""
    layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    o_m = start_m + gl.arange(0, BLOCK_M, layout=layout)
    row = i_b.to(gl.int64) * stride_lb + i_h.to(gl.int64) * stride_lh
    m_m = o_m < S_q
    b_lse = gl.load(lse_log2 + row + o_m, mask=m_m, other=float("inf"))
    lse_smem.store(gl.where(b_lse == float("-inf"), float("inf"), b_lse))
    delta_smem.store(gl.load(delta + row + o_m, mask=m_m, other=0.0))


@gluon.jit
def _bwd_load_partition(q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem, do_smem,
                        lse_smem, delta_smem, lse_log2, delta, stride_lb, stride_lh, S_q,
                        kv_bar, full, empty, i_b, i_hk, h0, start_n, m_lo, n_qt, shift,
                        n_steps, STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
                        DESCENDING: gl.constexpr):
    """The load warp: K and V once, then Q and dO of step t (by TMA) and its rows' lse and
    delta (by loads) into buffer t % STAGES, once both consumer groups released that
    buffer's previous tile. full[s] completes on TMA's bytes and this warp's arrival."""
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [i_b, start_n, i_hk, 0], kv_bar,
                                    k_smem.reshape(k_desc.block_type.shape))
    tma.async_copy_global_to_shared(v_desc, [i_b, start_n, i_hk, 0], kv_bar,
                                    v_smem.reshape(v_desc.block_type.shape))
    for t in range(n_steps):
        s = t % STAGES
        if t >= STAGES:
            mbarrier.wait(empty.index(s), ((t // STAGES) - 1) & 1)
        i_h, start_m = _query_tile(t, h0, m_lo, n_qt, shift, BLOCK_M, DESCENDING)
        mbarrier.expect(full.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [i_b, start_m, i_h, 0], full.index(s),
                                        q_smem.index(s).reshape(q_desc.block_type.shape))
        tma.async_copy_global_to_shared(do_desc, [i_b, start_m, i_h, 0], full.index(s),
                                        do_smem.index(s).reshape(do_desc.block_type.shape))
        _load_row_values(lse_log2, delta, lse_smem.index(s), delta_smem.index(s), stride_lb,
                         stride_lh, i_b, i_h, start_m, S_q, BLOCK_M)
        mbarrier.arrive(full.index(s), count=1)


@gluon.jit
def _bwd_consumer_partition(
    q_smem, k_smem, v_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_bar, full,
    empty, ds_bar, dq_full, dq_empty, dq_desc, dk, dv, stride_dks, stride_dkd, stride_dvs,
    stride_dvd, i_b, h0, start_n, m_lo, n_qt, shift, n_steps, S_k, qk_scale, sm_scale,
    dropout_seed, dropout_p,
    WG: gl.constexpr, KEYS: gl.constexpr, BLOCK_M: gl.constexpr, D: gl.constexpr,
    DV: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASK_KEYS: gl.constexpr,
    DETERMINISTIC: gl.constexpr, DESCENDING: gl.constexpr, DROPOUT: gl.constexpr,
    SPLIT: gl.constexpr,
):
    """Consumer group WG: dK and dV of keys [start_n + WG * KEYS, + KEYS) (``dk``, ``dv``
    point at the (batch, KV head)'s first key), and dQ's columns [WG * D / 2, + D / 2) of
    every query tile over the program's 2 * KEYS keys (where DETERMINISTIC, left in dq_smem
    to the dQ warp: dq_full once stored, dq_empty once read). Where DROPOUT, each step's keep
    mask is drawn (dropout_gluon.keep_keys) while its S^T and dP^T run, and P^T and dP^T
    take only the kept pairs, scaled by 1 / (1 - dropout_p). Where SPLIT > 1, dK and dV
    are fp32 sums that the programs of one key tile's query heads add into by atomics."""
    # S^T, dP^T [KEYS, BLOCK_M]; dK, dV [KEYS, D]; dQ's half [BLOCK_M, D / 2]
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    dk_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    dv_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D // 2, 16])
    pt_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout, k_width=2)
    dst_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk_layout, k_width=2)
    key_layout: gl.constexpr = gl.SliceLayout(1, st_layout)
    query_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    dtype: gl.constexpr = q_smem.dtype
    DIAGONAL_STEPS: gl.constexpr = 2 * KEYS // BLOCK_M  # query tiles that cross the diagonal
    b_k = k_smem.slice(WG * KEYS, KEYS)
    b_v = v_smem.slice(WG * KEYS, KEYS)
    # [2 * KEYS, D / 2]: K's columns of this group's half of dQ
    b_k_cols = k_smem.slice(WG * (D // 2), D // 2, dim=1)
    b_dk = gl.zeros([KEYS, D], gl.float32, dk_layout)
    b_dv = gl.zeros([KEYS, DV], gl.float32, dv_layout)
    o_n = start_n + WG * KEYS + gl.arange(0, KEYS, layout=key_layout)
    o_m = gl.arange(0, BLOCK_M, layout=query_layout)
    k0, k1, threshold = dropout_args(dropout_seed, dropout_p, DROPOUT)
    keep_scale = 1.0
    if DROPOUT:
        keep_scale = 1.0 / (1.0 - dropout_p)
    mbarrier.wait(kv_bar, 0)
    for t in range(n_steps):
        s = t % STAGES
        i_h, start_m = _query_tile(t, h0, m_lo, n_qt, shift, BLOCK_M, DESCENDING)
        mbarrier.wait(full.index(s), (t // STAGES) & 1)
        b_lse = lse_smem.index(s).load(query_layout)
        b_delta = delta_smem.index(s).load(query_layout)
        b_q = q_smem.index(s)
        b_do = do_smem.index(s)
        # S^T = K Q^T, dP^T = V dO^T [KEYS, BLOCK_M]
        st_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, st_layout)
        st_tok = warpgroup_mma(b_k, b_q.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        dpt_tok = warpgroup_mma(b_v, b_do.permute((1, 0)), st_zero, use_acc=False,
                                is_async=True)
        # the keep mask drawn under the two products where not causal, after them where
        # causal, its products by one instruction each where not causal (more registers
        # spill where causal): each measured the faster there
        if DROPOUT and not CAUSAL:
            b_keep = keep_keys(k0, k1, i_b, i_h, start_n + WG * KEYS, start_m, threshold,
                               KEYS, BLOCK_M, st_layout, True)
        b_st = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok,))
        if CAUSAL and start_m // BLOCK_M - m_lo < DIAGONAL_STEPS:
            b_pt = gl.exp2(gl.fma(
                gl.where(gl.expand_dims(o_n, 1) <= gl.expand_dims(start_m + o_m, 0), b_st,
                         float("-inf")), qk_scale, -gl.expand_dims(b_lse, 0)))
        else:
            b_pt = gl.exp2(gl.fma(b_st, qk_scale, -gl.expand_dims(b_lse, 0)))
        b_dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt_tok,))
        if DROPOUT:
            if CAUSAL:
                b_keep = keep_keys(k0, k1, i_b, i_h, start_n + WG * KEYS, start_m, threshold,
                                   KEYS, BLOCK_M, st_layout, False)
            b_dpt = gl.where(b_keep, b_dpt * keep_scale, 0.0)
        b_dst = b_pt * (b_dpt - gl.expand_dims(b_delta, 0))
        if DROPOUT:
            b_pt = gl.where(b_keep, b_pt * keep_scale, 0.0)  # for dV
        if MASK_KEYS:
            # keys past S_k: P = exp2(0 - lse) may overflow, and dQ must not take inf * 0
            b_dst = gl.where(gl.expand_dims(o_n < S_k, 1), b_dst, 0.0)
        b_dst = b_dst.to(dtype)
        # dV += P^T dO [KEYS, DV]; dK += dS^T Q [KEYS, D]
        dv_tok = warpgroup_mma(gl.convert_layout(b_pt.to(dtype), pt_layout), b_do, b_dv,
                               is_async=True)
        dk_tok = warpgroup_mma(gl.convert_layout(b_dst, dst_layout), b_q, b_dk, is_async=True)
        # both groups' dS^T into the shared [2 * KEYS, BLOCK_M] tile of this step
        b_ds = ds_smem.index(t % 2)
        b_ds.slice(WG * KEYS, KEYS).store(b_dst)
        fence_async_shared()
        mbarrier.arrive(ds_bar.index(t % 2), count=1)
        mbarrier.wait(ds_bar.index(t % 2), (t // 2) & 1)
        # dQ's half: dS K [BLOCK_M, D / 2] over the program's keys
        dq_zero = gl.zeros([BLOCK_M, D // 2], gl.float32, dq_layout)
        dq_tok = warpgroup_mma(b_ds.permute((1, 0)), b_k_cols, dq_zero, use_acc=False,
                               is_async=True)
        b_dv, b_dk, b_dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, dq_tok))
        mbarrier.arrive(empty.index(s), count=1)
        if DETERMINISTIC:
            if t > 0:  # the dQ warp's add of the previous step has read dq_smem
                mbarrier.wait(dq_empty, (t - 1) & 1)
        else:
            tma.store_wait(0)  # the previous step's add has read dq_smem
        dq_smem.store(b_dq * sm_scale)
        fence_async_shared()
        if DETERMINISTIC:
            mbarrier.arrive(dq_full, count=1)
        else:
            _reduce_add_shared_to_global(dq_desc, [i_b, start_m, i_h, WG * (D // 2)],
                                         dq_smem.reshape(dq_desc.block_type.shape))
    if not DETERMINISTIC:
        tma.store_wait(0)
    # dK = scale * dS^T Q; rows of keys past S_k are not stored
    o_nk = start_n + WG * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, dk_layout))
    o_d = gl.arange(0, D, layout=gl.SliceLayout(0, dk_layout))
    p_dk = dk + (gl.expand_dims(o_nk.to(gl.int64) * stride_dks, 1)
                 + gl.expand_dims(o_d * stride_dkd, 0))
    m_dk = gl.expand_dims(o_nk < S_k, 1)
    if SPLIT > 1:  # fp32 sums of the programs that share the key tile
        gl.atomic_add(p_dk, b_dk * sm_scale, mask=m_dk, sem="relaxed")
    else:
        gl.store(p_dk, (b_dk * sm_scale).to(dtype), mask=m_dk)
    o_nv = start_n + WG * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, dv_layout))
    o_dv = gl.arange(0, DV, layout=gl.SliceLayout(0, dv_layout))
    p_dv = dv + (gl.expand_dims(o_nv.to(gl.int64) * stride_dvs, 1)
                 + gl.expand_dims(o_dv * stride_dvd, 0))
    m_dv = gl.expand_dims(o_nv < S_k, 1)
    if SPLIT > 1:
        gl.atomic_add(p_dv, b_dv, mask=m_dv, sem="relaxed")
    else:
        gl.store(p_dv, b_dv.to(dtype), mask=m_dv)


@gluon.jit
def _bwd_dq_partition(dq_desc, dq_sem, dq0_smem, dq1_smem, dq_full, dq_empty, i_b, h0, i_n,
                      n_tiles, H, m_lo, n_qt, shift, n_m, n_steps, D: gl.constexpr,
                      BLOCK_M: gl.constexpr, DETERMINISTIC: gl.constexpr,
                      DESCENDING: gl.constexpr, ROTATE: gl.constexpr):
    """The dQ warp (where DETERMINISTIC; otherwise idle): per step, once the key tile
    before this one in the query tile's order (_dq_turn) added its share into it (its
    counter reads this one's turn), the adds of both groups' halves as each is stored; once
    they have read shared memory, the groups may store the next; once they are complete,
    the counter is raised."""
    if DETERMINISTIC:
        for t in range(n_steps):
            i_h, start_m = _query_tile(t, h0, m_lo, n_qt, shift, BLOCK_M, DESCENDING)
            sem = _dq_counter(dq_sem, i_b, i_h, H, start_m, n_m, BLOCK_M)
            _dq_wait_turn(sem, _dq_turn(i_n, start_m, n_tiles, n_qt, BLOCK_M, ROTATE))
            mbarrier.wait(dq_full.index(0), t & 1)
            _reduce_add_shared_to_global(dq_desc, [i_b, start_m, i_h, 0],
                                         dq0_smem.reshape(dq_desc.block_type.shape))
            mbarrier.wait(dq_full.index(1), t & 1)
            _reduce_add_shared_to_global(dq_desc, [i_b, start_m, i_h, D // 2],
                                         dq1_smem.reshape(dq_desc.block_type.shape))
            tma.store_wait(0)  # both adds have read shared memory
            mbarrier.arrive(dq_empty.index(0), count=1)
            mbarrier.arrive(dq_empty.index(1), count=1)
            _dq_add_done(sem)


@gluon.jit
def attention_bwd_gluon_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, dq_sem, lse_log2, delta, dk, dv,
    stride_lb, stride_lh, stride_dkb, stride_dks, stride_dkh, stride_dkd,
    stride_dvb, stride_dvs, stride_dvh, stride_dvd,
    S_q, S_k, H_kv, G, sm_scale, qk_scale, dropout_seed, dropout_p,
    D: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASK_KEYS: gl.constexpr,
    DETERMINISTIC: gl.constexpr, KEY_GROUP: gl.constexpr, ROTATE: gl.constexpr,
    SPLIT: gl.constexpr, DROPOUT: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    LOAD_REGS: gl.constexpr,
):
    """dK, dV (B, S_k, H_kv, D / DV) of one key tile, and its share of dQ added into the
    fp32 (B, S_q, H, D) buffer behind ``dq_desc`` (zeroed by the caller); the
    module's docstring has the partitions. lse_log2 and delta are the forward's base-2 lse
    and rowsum(dO * O) - dlse, (B, H, S_q) with a unit stride over rows; qk_scale = scale *
    log2(e). Where CAUSAL, S_q == S_k. MASK_KEYS: S_k not a multiple of BLOCK_N. Grid:
    (cdiv(S_k, BLOCK_N), B * H_kv * SPLIT), key tiles in order (where causal, the heaviest
    first), each program taking G / SPLIT of the (batch, KV head)'s G query heads: where
    SPLIT > 1 (never where DETERMINISTIC), ``dk`` and ``dv`` are zeroed fp32 buffers that
    the SPLIT programs of a key tile add their shares into (a grid of a few programs per SM
    at most, as a short sequence of few heads gives, then still fills the SMs);
    where DETERMINISTIC, (B * H_kv * cdiv(S_k, BLOCK_N),): bands of KEY_GROUP key tiles in
    order, within a band each (batch, KV head)'s tiles in turn, so that a program waits only
    on programs before it, and the programs resident at once share Q, dO and dQ's tiles in
    groups (L2); where ROTATE (DETERMINISTIC, not CAUSAL), each (batch, KV head)'s key tiles
    in turn, all of which the GPU must hold at once (the module's docstring); ``dq_sem``
    holds the zeroed int32 counters, (B, H, cdiv(S_q, BLOCK_M)) (otherwise unused). Where
    DROPOUT, the forward's mask of the int64 ``dropout_seed[0]`` and ``dropout_p`` (P and dP
    of the dropped pairs 0, the rest scaled by 1 / (1 - dropout_p))."""
    n_tiles = gl.cdiv(S_k, BLOCK_N)
    if ROTATE:  # each (batch, KV head)'s key tiles side by side
        i_bh = gl.program_id(0) // n_tiles
        i_n = gl.program_id(0) % n_tiles
    elif DETERMINISTIC:
        band_size = gl.minimum(n_tiles, KEY_GROUP) * (gl.num_programs(0) // n_tiles)
        band = gl.program_id(0) // band_size
        in_band = gl.program_id(0) - band * band_size
        band_tiles = gl.minimum(n_tiles - band * KEY_GROUP, KEY_GROUP)
        i_bh = in_band // band_tiles
        i_n = band * KEY_GROUP + in_band % band_tiles
    else:
        i_n = gl.program_id(0)
        i_bh = gl.program_id(1)
    # where SPLIT > 1, each (batch, KV head)'s G query heads are split between SPLIT programs
    i_b = i_bh // (H_kv * SPLIT)
    i_hk = i_bh % (H_kv * SPLIT) // SPLIT
    heads = G // SPLIT
    h0 = i_hk * G + i_bh % SPLIT * heads
    start_n = i_n * BLOCK_N
    dtype: gl.constexpr = q_desc.dtype
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=q_desc.layout.swizzle_byte_width,
        element_bitwidth=q_desc.layout.element_bitwidth, rank=2)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=q_desc.layout.element_bitwidth, rank=2)
    dq_smem_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=dq_desc.layout.swizzle_byte_width,
        element_bitwidth=dq_desc.layout.element_bitwidth, rank=2)
    KEYS: gl.constexpr = BLOCK_N // 2
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, DV], smem_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], smem_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, DV], smem_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    dq0_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, D // 2], dq_smem_layout)
    dq1_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, D // 2], dq_smem_layout)
    row_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=2)  # TMA's bytes and the load warp's rows
        mbarrier.init(empty.index(i), count=2)  # both consumer groups release a buffer
    for i in gl.static_range(2):
        mbarrier.init(ds_bar.index(i), count=2)  # both groups wrote their dS^T
        mbarrier.init(dq_full.index(i), count=1)  # group i stored its half of dQ
        mbarrier.init(dq_empty.index(i), count=1)  # the dQ warp's add read it
    # Where causal and in order, a key tile takes its query tiles from the last down: the
    # programs resident at once then all start on the last query tile, each a step behind the
    # key tile before it, where from the diagonal up each would start two steps behind it.
    DESCENDING: gl.constexpr = CAUSAL and DETERMINISTIC
    if CAUSAL:
        m_lo = start_n // BLOCK_M
    else:
        m_lo = 0
    n_m = gl.cdiv(S_q, BLOCK_M)
    n_qt = n_m - m_lo
    n_steps = heads * n_qt
    shift = 0
    if ROTATE:  # each key tile starts on its own query tile (_dq_turn)
        shift = i_n * n_qt // n_tiles
    dk += i_b.to(gl.int64) * stride_dkb + i_hk.to(gl.int64) * stride_dkh
    dv += i_b.to(gl.int64) * stride_dvb + i_hk.to(gl.int64) * stride_dvh
    gl.warp_specialize([
        (_bwd_consumer_partition, (
            q_smem, k_smem, v_smem, do_smem, lse_smem, delta_smem, ds_smem, dq0_smem, kv_bar,
            full, empty, ds_bar, dq_full.index(0), dq_empty.index(0), dq_desc, dk, dv,
            stride_dks, stride_dkd, stride_dvs, stride_dvd, i_b, h0, start_n, m_lo, n_qt,
            shift, n_steps, S_k, qk_scale, sm_scale, dropout_seed, dropout_p, 0, KEYS,
            BLOCK_M, D, DV, STAGES, CAUSAL, MASK_KEYS, DETERMINISTIC, DESCENDING, DROPOUT,
            SPLIT)),
        (_bwd_consumer_partition, (
            q_smem, k_smem, v_smem, do_smem, lse_smem, delta_smem, ds_smem, dq1_smem, kv_bar,
            full, empty, ds_bar, dq_full.index(1), dq_empty.index(1), dq_desc, dk, dv,
            stride_dks, stride_dkd, stride_dvs, stride_dvd, i_b, h0, start_n, m_lo, n_qt,
            shift, n_steps, S_k, qk_scale, sm_scale, dropout_seed, dropout_p, 1, KEYS,
            BLOCK_M, D, DV, STAGES, CAUSAL, MASK_KEYS, DETERMINISTIC, DESCENDING, DROPOUT,
            SPLIT)),
        (_bwd_load_partition, (
            q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem, do_smem, lse_smem,
            delta_smem, lse_log2, delta, stride_lb, stride_lh, S_q, kv_bar, full, empty, i_b,
            i_hk, h0, start_n, m_lo, n_qt, shift, n_steps, STAGES, BLOCK_M, DESCENDING)),
        (_bwd_dq_partition, (
            dq_desc, dq_sem, dq0_smem, dq1_smem, dq_full, dq_empty, i_b, h0, i_n, n_tiles,
            H_kv * G, m_lo, n_qt, shift, n_m, n_steps, D, BLOCK_M, DETERMINISTIC, DESCENDING,
            ROTATE)),
    ], [4, 1, 1], [CONSUMER_REGS, LOAD_REGS, LOAD_REGS])
