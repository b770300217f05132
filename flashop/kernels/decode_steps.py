"""Steps shared by the decoding kernels over a key/value cache (decode.py's split-KV kernel
and mla.py's latent-cache kernel): in the key loop, where a tile's keys and values live in a
dense or paged cache, the online softmax over a tile of scores and the output's P V update;
after it, the normalized output and its lse. Vocabulary as in decode.py.

torch<2.13: a step that takes a tensor returns no store's offset (that torch's mutation
analysis would count the tensor as written, see common.py)."""

import triton
import triton.language as tl

from flashop.kernels.common import dot_operand


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
