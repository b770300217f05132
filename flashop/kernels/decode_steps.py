"""Steps shared by the decoding kernels over a key/value cache (decode.py's split-KV kernel
and mla.py's latent-cache kernel): a program's query rows, its sequence's keys, the caches'
pointers at its sequence and KV head, its split's run of key tiles; in the key loop, where
a tile's keys and values live in a dense or paged cache, the online softmax over a tile of
scores and the output's P V update; after it, the normalized output and its lse.
Vocabulary as in decode.py.

Where a store's offset comes from a step's results, torch's mutation analysis (2.13's too;
see common.py for older releases) counts every tensor that the step's arguments come from
as written: the offsets of the outputs' stores come from query_rows, which takes no tensor,
and from the kernel's own split index (tl.program_id(0)), not from split_run, whose bounds
come from the lengths the kernel loads."""

import triton
import triton.language as tl

from flashop.kernels.common import dot_operand


@triton.jit
def query_rows(G, S_q, BLOCK_M: tl.constexpr):
    """The query rows of this program of the grid (splits, H_kv * row tiles, B): its
    sequence ``i_b`` and KV head ``i_hk``; its tile of BLOCK_M of the KV head's ``G * S_q``
    rows ``r = i * G + g`` (the G query heads of the KV head at each of the S_q queries),
    each row's query ``o_i`` and query head ``o_h``, ``m_r`` the rows that exist; the
    tile's first and last query."""
    i_b = tl.program_id(2).to(tl.int64)
    rows = G * S_q
    n_row_tiles = tl.cdiv(rows, BLOCK_M)
    i_hk = (tl.program_id(1) // n_row_tiles).to(tl.int64)
    start_r = (tl.program_id(1) % n_row_tiles) * BLOCK_M
    o_r = start_r + tl.arange(0, BLOCK_M)
    m_r = o_r < rows
    o_i = o_r // G  # query index
    o_h = i_hk * G + o_r % G  # query head
    i_first = start_r // G
    i_last = (tl.minimum(start_r + BLOCK_M, rows) - 1) // G
    return i_b, i_hk, o_i, o_h, m_r, i_first, i_last


@triton.jit
def sequence_keys(cache_seqlens, cache_leftpad, i_b, S_new, capacity,
                  HAS_LEFTPAD: tl.constexpr):
    """Sequence ``i_b``'s cached length before the append, the row of its first key
    (``cache_leftpad[i_b]`` where ``HAS_LEFTPAD``, else 0), its keys ``L`` (those after the
    append, less the left padding) and how many of them are read (keys past the cache's
    capacity never are)."""
    cached = tl.load(cache_seqlens + i_b)
    L = cached + S_new
    lp = 0
    if HAS_LEFTPAD:
        lp = tl.load(cache_leftpad + i_b)
        L -= lp
    return cached, lp, L, tl.minimum(L, capacity - lp)


@triton.jit
def cache_bases(k_cache, v_cache, cache_batch_idx, i_b, i_hk, lp, stride_kcb, stride_kcs,
                stride_kch, stride_vcb, stride_vcs, stride_vch, IS_PAGED: tl.constexpr,
                HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr):
    """The key and value caches' pointers at KV head ``i_hk`` and, dense, at sequence
    ``i_b``'s first key (in cache row ``cache_batch_idx[i_b]`` where ``HAS_BATCH_IDX``,
    else ``i_b``; at position ``lp``, the left padding, where ``HAS_LEFTPAD``). Paged, the
    block table's row is the caller's to take: a dense call's table is None, which a
    helper cannot return on a GPU."""
    k_base = k_cache + i_hk * stride_kch
    v_base = v_cache + i_hk * stride_vch
    if not IS_PAGED:
        i_row = i_b
        if HAS_BATCH_IDX:
            i_row = tl.load(cache_batch_idx + i_b).to(tl.int64)
        k_base += i_row * stride_kcb
        v_base += i_row * stride_vcb
        if HAS_LEFTPAD:
            k_base += lp.to(tl.int64) * stride_kcs
            v_base += lp.to(tl.int64) * stride_vcs
    return k_base, v_base


@triton.jit
def split_run(lo, hi, i_split, BLOCK_N: tl.constexpr):
    """Split ``i_split``'s run [s_lo, s_hi) of the key tiles from ``lo`` (a multiple of
    BLOCK_N) to ``hi``: the splits (the grid's first axis) take whole tiles, as many each,
    the last ones fewer or none."""
    tiles_per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), tl.num_programs(0))
    s_lo = tl.minimum(lo + i_split * tiles_per_split * BLOCK_N, hi)
    return s_lo, tl.minimum(s_lo + tiles_per_split * BLOCK_N, hi)


@triton.jit
def key_tile(block_table, start_n, L_read, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
             BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, IS_PAGED: tl.constexpr,
             TILE_PAGE: tl.constexpr, EDGE_TILE: tl.constexpr):
    """The keys ``o_n`` [BLOCK_N] of the tile starting at ``start_n`` (a multiple of
    BLOCK_N), ``m_n`` those below the ``L_read`` readable keys, and the key and value
    caches' row offsets (int64) of the keys, from the caches' pointers at this KV head
    (dense: at this sequence's first key). Paged: ``block_table`` points at this sequence's
    pages; where ``TILE_PAGE`` (the tile lies in one page) the tile's one page id is
    loaded, else each key's (a vector, which the pipeliner prefetches), masked on
    ``EDGE_TILE`` tiles."""
    o_n = start_n + tl.arange(0, BLOCK_N)
    m_n = o_n < L_read
    if IS_PAGED:
        if TILE_PAGE:
            i_page = tl.load(block_table + start_n // PAGE_SIZE).to(tl.int64)
            o_row = start_n % PAGE_SIZE + tl.arange(0, BLOCK_N)
        else:  # each key's own page (a tile of BLOCK_N > PAGE_SIZE keys spans pages)
            if EDGE_TILE:
                i_page = tl.load(block_table + o_n // PAGE_SIZE, mask=m_n,
                                 other=0).to(tl.int64)
            else:
                i_page = tl.load(block_table + o_n // PAGE_SIZE).to(tl.int64)
            o_row = o_n % PAGE_SIZE
        return (o_n, m_n, i_page * stride_kcb + o_row * stride_kcs,
                i_page * stride_vcb + o_row * stride_vcs)
    return o_n, m_n, o_n.to(tl.int64) * stride_kcs, o_n.to(tl.int64) * stride_vcs


@triton.jit
def softmax_step(b_s, m_i, l_i, EDGE_TILE: tl.constexpr):
    """The online softmax over one tile of base-2 scores ``b_s`` [ROWS, BLOCK_N] (-inf where
    masked): (P, the factor ``alpha`` of what came before, the new running sum and max).
    On ``EDGE_TILE`` tiles a row may have seen no key yet (max -inf): its P and alpha are 0,
    not NaN."""
    # [ROWS]
    m_new = tl.maximum(m_i, tl.max(b_s, 1))
    if EDGE_TILE:
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    b_p = tl.math.exp2(b_s - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    return b_p, alpha, l_i * alpha + tl.sum(b_p, 1), m_new


@triton.jit
def pv_step(acc, alpha, b_p, b_v, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The running output ``acc`` [ROWS, DV] after one more key tile: ``acc`` rescaled by
    softmax_step's ``alpha`` [ROWS], plus P V, ``b_p`` [ROWS, BLOCK_N] the tile's P already
    in the values' dtype (the caller's conversion), ``b_v`` [BLOCK_N, DV] its values."""
    # [ROWS, DV]
    return tl.dot(dot_operand(b_p, UPCAST), dot_operand(b_v, UPCAST), acc * alpha[:, None],
                  input_precision=DOT_PRECISION)


@triton.jit
def normalized_rows(acc, l_i, m_i):
    """The rows' output ``acc / l`` (fp32) and base-2 lse ``m + log2(l)``: 0 and -inf for
    a row that attended no key (l = 0)."""
    m_empty = l_i == 0.0
    l_safe = tl.where(m_empty, 1.0, l_i)
    return acc / l_safe[:, None], tl.where(m_empty, float("-inf"), m_i + tl.math.log2(l_safe))
