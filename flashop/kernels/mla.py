"""Attention over multi-head latent attention's cache (MLA: DeepSeek-V2/V3, Kimi K2).

MLA caches one latent key/value head per token: a row of ``D = DV + D_ROPE`` dims (512
latent, then 64 rotary), whose first ``DV`` dims are also the token's value. Every query
head of a sequence attends the same rows: ``S = Q K^T`` over all D dims, ``O = P V`` with
``V = K[:, :DV]``.

The kernel reads each cache row once for both products: a key tile is loaded as its latent
block [BLOCK_N, DV] and its rotary block [BLOCK_N, D_ROPE] (powers of two: 576 is not
padded to 1024), the scores are ``Q_lat K_lat^T + Q_rope K_rope^T`` and the same latent
block, untransposed, is the values of ``P V`` (``V_IN_K``: v_cache is k_cache[..., :DV];
a v_cache of its own is read beside it). All query rows of one KV head (the G heads
times the S_q queries, row ``r = i * G + g``) share the keys as the M dimension of the
products, BLOCK_M rows per program; more rows take more programs over the same keys
(running together, their loads may meet in L2). The keys are cut into runs of whole
tiles, one per split (split-KV), and the splits merge in flash decoding's merge kernel
(decode.attention_decode_merge_kernel), as the decode kernel's do. Vocabulary and cache
addressing as in decode.py.
"""

import triton
import triton.language as tl

from flashop.kernels.common import LN2, attention_scores, dot_operand, load_tile, round_to
from flashop.kernels.decode_steps import (
    cache_bases, key_tile, normalized_rows, pv_step, query_rows, sequence_keys, softmax_step,
    split_run,
)


@triton.jit
def _tile_probs(
    b_lat, b_qr, b_kr, m_i, l_i, o_i, m_r, o_n, m_n, S_q, L, qk_scale, k_cache,
    EDGE_TILE: tl.constexpr, IS_CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """A key tile's P (in the keys' dtype) and the softmax's step (alpha, l, m), from the
    latent part of its scores ``b_lat`` [BLOCK_M, BLOCK_N] and the rotary blocks: scaled,
    masked past the keys and (causal: a right bound of 0) after the diagonal; no window's
    left bound, softcap, ALiBi, gate or mask."""
    b_qk = tl.dot(b_qr, tl.trans(dot_operand(b_kr, UPCAST)), b_lat,
                  input_precision=DOT_PRECISION)
    b_s, _ = attention_scores(
        b_qk, qk_scale, o_i[:, None], o_n[None, :], m_r[:, None], m_n[None, :], S_q, L,
        left=0, right=0, chunk=0, softcap_log2=0.0, alibi_log2=0.0, b_gk=0.0,
        p_attn_mask=k_cache, stride_amq=0, stride_amk=0, EDGE_TILE=EDGE_TILE,
        HAS_LEFT=False, HAS_RIGHT=IS_CAUSAL, HAS_CHUNK=False, HAS_SOFTCAP=False,
        HAS_ALIBI=False, HAS_GATE=False, ATTN_MASK_KIND=0, SCALED=True)
    b_p, alpha, l_i, m_i = softmax_step(b_s, m_i, l_i, EDGE_TILE=EDGE_TILE)
    return round_to(b_p, b_kr.dtype), alpha, l_i, m_i


@triton.jit
def _mla_key_tiles(
    acc, l_i, m_i, b_q, b_qr, k_cache, v_cache, block_table, o_i, m_r, start, end, L_read, L,
    S_q, stride_kcb, stride_kcs, stride_vcb, stride_vcs, qk_scale, DV: tl.constexpr,
    D_ROPE: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    IS_PAGED: tl.constexpr, TILE_PAGE: tl.constexpr, EDGE_TILE: tl.constexpr,
    IS_CAUSAL: tl.constexpr, V_IN_K: tl.constexpr, TMA: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold the key tiles in [start, end) (multiples of BLOCK_N) into the running (acc,
    l_i, m_i) of the query rows, whose latent part is ``b_q`` [BLOCK_M, DV] and rotary part
    ``b_qr`` [BLOCK_M, D_ROPE]. ``k_cache`` / ``v_cache`` point at this KV head (and,
    dense, this sequence's first key); ``block_table`` at this sequence's pages: a tile's one
    page id where ``TILE_PAGE`` (the tile lies in one page), else each key's. Where
    ``V_IN_K`` the values are the key tile's latent block (v_cache is not read), else a
    tile of v_cache's rows. ``EDGE_TILE`` tiles may reach past the ``L_read`` readable keys
    or cross the causal bound; the others are inside for every row and skip that
    masking. Where ``TMA`` (the values in the keys, a dense cache or tiles that lie in one
    page), the inner tiles' latent and rotary blocks are read through tensor descriptors
    made here: a dense cache's over the sequence's rows, a paged one's over [pages, page
    rows, dims] (no inner tile reaches past its page, so the bound on pages is nominal)."""
    o_dv = tl.arange(0, DV)
    o_dr = DV + tl.arange(0, D_ROPE)
    DESC: tl.constexpr = TMA and V_IN_K and (not EDGE_TILE) and ((not IS_PAGED) or TILE_PAGE)
    if DESC:
        if IS_PAGED:
            k_lat = tl.make_tensor_descriptor(k_cache, shape=[2**30, PAGE_SIZE, DV],
                                              strides=[stride_kcb, stride_kcs, 1],
                                              block_shape=[1, BLOCK_N, DV])
            k_rot = tl.make_tensor_descriptor(k_cache + DV, shape=[2**30, PAGE_SIZE, D_ROPE],
                                              strides=[stride_kcb, stride_kcs, 1],
                                              block_shape=[1, BLOCK_N, D_ROPE])
        else:
            n_rows = tl.maximum(L_read, 1)
            k_lat = tl.make_tensor_descriptor(k_cache, shape=[n_rows, DV],
                                              strides=[stride_kcs, 1],
                                              block_shape=[BLOCK_N, DV])
            k_rot = tl.make_tensor_descriptor(k_cache + DV, shape=[n_rows, D_ROPE],
                                              strides=[stride_kcs, 1],
                                              block_shape=[BLOCK_N, D_ROPE])
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        o_n, m_n, o_kn, o_vn = key_tile(
            block_table, start_n, L_read, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
            BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, IS_PAGED=IS_PAGED, TILE_PAGE=TILE_PAGE,
            EDGE_TILE=EDGE_TILE)
        if DESC:  # the tile's latent dims [BLOCK_N, DV] and rotary dims [BLOCK_N, D_ROPE]
            if IS_PAGED:
                i_page = tl.load(block_table + start_n // PAGE_SIZE).to(tl.int32)
                row = (start_n % PAGE_SIZE).to(tl.int32)
                b_k = k_lat.load([i_page, row, 0]).reshape(BLOCK_N, DV)
                b_kr = k_rot.load([i_page, row, 0]).reshape(BLOCK_N, D_ROPE)
            else:
                b_k = k_lat.load([start_n.to(tl.int32), 0])
                b_kr = k_rot.load([start_n.to(tl.int32), 0])
        else:
            # the keys' latent dims [BLOCK_N, DV]
            b_k = load_tile(k_cache + o_kn[:, None] + o_dv[None, :], m_n[:, None], None,
                            EDGE_TILE, False)
            # their rotary dims [BLOCK_N, D_ROPE]
            b_kr = load_tile(k_cache + o_kn[:, None] + o_dr[None, :], m_n[:, None], None,
                             EDGE_TILE, False)
        b_kl = dot_operand(b_k, UPCAST)
        if b_q.shape[0] >= 64:
            # Two warp groups: each product in an ``if`` that is always entered. Triton
            # lays a product out over all its warps along the rows when its result reaches
            # another product, so both groups would compute the whole of S; the search stops
            # at a region's end, so here S splits between the groups by keys and P V by
            # value dims, P passing through shared memory (performance notes, entries 147
            # and 148). The latent product's result is the rotary one's accumulator: a
            # region of its own, on another condition (two of one condition are merged).
            if start_n < end:
                b_lat = tl.dot(b_q, tl.trans(b_kl), input_precision=DOT_PRECISION)
            else:
                b_lat = tl.zeros([b_q.shape[0], BLOCK_N], dtype=tl.float32)
            if start_n >= start:
                b_pk, alpha, l_new, m_new = _tile_probs(
                    b_lat, b_qr, b_kr, m_i, l_i, o_i, m_r, o_n, m_n, S_q, L, qk_scale,
                    k_cache, EDGE_TILE=EDGE_TILE, IS_CAUSAL=IS_CAUSAL, UPCAST=UPCAST,
                    DOT_PRECISION=DOT_PRECISION)
            else:
                b_pk = tl.zeros([b_q.shape[0], BLOCK_N], dtype=b_k.dtype)
                alpha = tl.full([b_q.shape[0]], 1.0, dtype=tl.float32)
                l_new = l_i
                m_new = m_i
        else:
            b_lat = tl.dot(b_q, tl.trans(b_kl), input_precision=DOT_PRECISION)
            b_pk, alpha, l_new, m_new = _tile_probs(
                b_lat, b_qr, b_kr, m_i, l_i, o_i, m_r, o_n, m_n, S_q, L, qk_scale, k_cache,
                EDGE_TILE=EDGE_TILE, IS_CAUSAL=IS_CAUSAL, UPCAST=UPCAST,
                DOT_PRECISION=DOT_PRECISION)
        l_i, m_i = l_new, m_new
        if V_IN_K:  # the values: the same latent block, read once for both products
            b_v = b_kl
        else:  # [BLOCK_N, DV]
            b_v = load_tile(v_cache + o_vn[:, None] + o_dv[None, :], m_n[:, None], None,
                            EDGE_TILE, False)
        # [BLOCK_M, DV]
        acc = pv_step(acc, alpha, b_pk, b_v, UPCAST=UPCAST, DOT_PRECISION=DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def mla_decode_kernel(
    q, k_cache, v_cache, o, lse, o_part, lse_part, cache_seqlens, cache_batch_idx,
    block_table, cache_leftpad,
    stride_qb, stride_qs, stride_qh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    stride_tb,
    S_q, S_new, capacity, G, qk_scale,
    DV: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, IS_PAGED: tl.constexpr, TILE_PAGE: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr, IS_CAUSAL: tl.constexpr,
    V_IN_K: tl.constexpr, TMA: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Attention of q[b, i, h] (DV + D_ROPE dims) over the first ``L = cache_seqlens[b] +
    S_new`` rows of sequence b's latent cache, query i at key position ``i + L - S_q``
    (bottom-right causal where ``IS_CAUSAL``); the values are the rows' first DV dims where
    ``V_IN_K`` (v_cache is k_cache[..., :DV]), else v_cache's rows; grid (splits, H_kv *
    row tiles, B).

    As attention_decode_kernel without its modifiers: BLOCK_M rows ``r = i * G + g`` per
    program; the keys (at most ``capacity``; where ``HAS_LEFTPAD``, of a dense cache, from
    row ``cache_leftpad[b]``, L less that many) cut into runs of whole tiles, one per split;
    where ``SPLIT`` the run's normalized output (fp32) goes to ``o_part`` [split, b, i, h]
    and its base-2 lse to ``lse_part`` [split, b, h, i] (0 and -inf for an empty run), for
    the merge kernel (both the launcher's contiguous buffers: their strides follow from the
    grid); else ``o`` and the natural-log ``lse`` [b, h, i] directly. Rows that
    attend no key get 0 and -inf. The lengths are read here, so the launch depends on shapes
    only (CUDA graphs, one compilation for all lengths). Where ``TMA``, the inner key
    tiles are read through tensor descriptors (_mla_key_tiles; the caller set Triton's
    scratch allocator)."""
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor may pass a Python float as fp64
    i_b, i_hk, o_i, o_h, m_r, i_first, i_last = query_rows(G, S_q, BLOCK_M=BLOCK_M)
    _, lp, L, L_read = sequence_keys(cache_seqlens, cache_leftpad, i_b, S_new, capacity,
                                     HAS_LEFTPAD=HAS_LEFTPAD)
    off = L - S_q  # query i sits at key position i + off

    o_dv = tl.arange(0, DV)
    p_q = q + i_b * stride_qb + o_i * stride_qs + o_h * stride_qh
    # [BLOCK_M, DV], [BLOCK_M, D_ROPE]
    b_q = tl.load(p_q[:, None] + o_dv[None, :], mask=m_r[:, None], other=0.0)
    b_qr = tl.load(p_q[:, None] + DV + tl.arange(0, D_ROPE)[None, :], mask=m_r[:, None],
                   other=0.0)
    b_q, b_qr = dot_operand(b_q, UPCAST), dot_operand(b_qr, UPCAST)

    # the keys of the tile's rows: [0, hi), those before u_hi attended by every row
    hi = L_read
    u_hi = (L_read // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        hi = tl.minimum(hi, tl.maximum(i_last + off + 1, 0))
        u_hi = tl.minimum(u_hi, (tl.maximum(i_first + off + 1, 0) // BLOCK_N) * BLOCK_N)
    # this split's run of key tiles: [s_lo, s_mid) inside, [s_mid, s_hi) edge tiles
    i_split = tl.program_id(0).to(tl.int64)
    s_lo, s_hi = split_run(0, hi, i_split, BLOCK_N=BLOCK_N)
    s_mid = tl.minimum(tl.maximum(u_hi, s_lo), s_hi)

    # the caches at this sequence and KV head
    k_base, v_base = cache_bases(
        k_cache, v_cache, cache_batch_idx, i_b, i_hk, lp, stride_kcb, stride_kcs, stride_kch,
        stride_vcb, stride_vcs, stride_vch, IS_PAGED=IS_PAGED, HAS_BATCH_IDX=HAS_BATCH_IDX,
        HAS_LEFTPAD=HAS_LEFTPAD)
    if IS_PAGED:  # the block table's row of this sequence
        block_table += i_b * stride_tb

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
    for part in tl.static_range(2):
        if part == 0:
            start, end = s_lo, s_mid
        else:
            start, end = s_mid, s_hi
        acc, l_i, m_i = _mla_key_tiles(
            acc, l_i, m_i, b_q, b_qr, k_base, v_base, block_table, o_i, m_r, start, end,
            L_read, L, S_q, stride_kcb, stride_kcs, stride_vcb, stride_vcs, qk_scale, DV,
            D_ROPE, BLOCK_N, PAGE_SIZE, IS_PAGED, TILE_PAGE, part == 1, IS_CAUSAL, V_IN_K,
            TMA, UPCAST, DOT_PRECISION)

    b_o, b_lse2 = normalized_rows(acc, l_i, m_i)
    m_o = m_r[:, None]
    if SPLIT:
        # the partials [splits, B, S_q, H, DV] and [splits, B, H, S_q], contiguous
        H = G * (tl.num_programs(1) // tl.cdiv(G * S_q, BLOCK_M))
        i_run = i_split * tl.num_programs(2) + i_b
        o_pr = (i_run * S_q + o_i) * H + o_h
        tl.store(o_part + o_pr[:, None] * DV + o_dv[None, :], b_o, mask=m_o)
        tl.store(lse_part + (i_run * H + o_h) * S_q + o_i, b_lse2, mask=m_r)
    else:
        tl.store(o + i_b * stride_ob + o_i[:, None] * stride_os + o_h[:, None] * stride_oh
                 + o_dv[None, :], round_to(b_o, o.dtype.element_ty), mask=m_o)
        tl.store(lse + i_b * stride_lb + o_h * stride_lh + o_i, b_lse2 * LN2, mask=m_r)
