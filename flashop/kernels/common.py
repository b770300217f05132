"""Helpers shared by the forward and backward attention kernels.

Vocabulary (docs/design.md): ``B`` batch, ``S_q``/``S_k`` query/key lengths, ``H`` query
heads, ``G`` query heads per key/value head, ``D``/``DV`` head dims of q,k and of v,o;
prefixes ``i_`` program ids, ``o_`` offsets, ``m_`` masks, ``p_`` pointers, ``b_`` blocks.
"""

import triton
import triton.language as tl

# Triton reads module-level globals in kernels only when they are tl.constexpr
LOG2E = tl.constexpr(1.4426950408889634)  # 1 / ln(2): natural-log units -> base-2 units
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): base-2 units -> natural-log units


@triton.jit
def dot_operand(x, UPCAST: tl.constexpr):
    """Operand of ``tl.dot``: as loaded, or in fp32 where ``UPCAST``.

    ``UPCAST`` is set only under Triton's CPU interpreter for bf16 inputs, whose bf16
    ``tl.dot`` is wrong there; the launcher never sets it on a GPU, so GPU code is unchanged.
    The values are bf16 either way (an exact cast), so the products are the same.
    """
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def load_tile(p, m_rows, m_cols, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a 2-D tile, masking rows and/or columns only where the flags say it can overflow.

    ``m_rows`` and ``m_cols`` broadcast against ``p`` ([R, 1] and [1, C] or the transposes).
    Masked-out elements read as 0.
    """
    if CHECK_ROWS and CHECK_COLS:
        x = tl.load(p, mask=m_rows & m_cols, other=0.0)
    elif CHECK_ROWS:
        x = tl.load(p, mask=m_rows, other=0.0)
    elif CHECK_COLS:
        x = tl.load(p, mask=m_cols, other=0.0)
    else:
        x = tl.load(p)
    return x


@triton.jit
def key_tile_range(start_m, S_q, S_k, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Keys that the query tile [start_m, start_m + BLOCK_M) attends: ``[0, hi)``.

    Tiles in ``[0, lo_mask)`` need no mask at all; tiles in ``[lo_mask, hi)`` need the causal
    and/or key-length mask. Causal is aligned to the bottom-right corner: query ``i`` attends
    key ``j`` iff ``j <= i + S_k - S_q``. Tiles past ``hi`` are never visited.
    """
    n_full = (S_k // BLOCK_N) * BLOCK_N  # keys in whole tiles
    if IS_CAUSAL:
        diag = start_m + S_k - S_q  # the last key the first row of the tile attends
        hi = tl.minimum(S_k, tl.maximum(diag + BLOCK_M, 0))
        # tiles ending at or before diag + 1 are below the diagonal for every row;
        # lo_mask <= hi since diag + 1 <= diag + BLOCK_M and n_full <= S_k
        lo_mask = tl.minimum((tl.maximum(diag + 1, 0) // BLOCK_N) * BLOCK_N, n_full)
    else:
        hi = S_k
        lo_mask = n_full
    return lo_mask, hi


@triton.jit
def query_tile_range(start_n, S_q, S_k, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """Queries that attend some key of the tile [start_n, start_n + BLOCK_N): ``[lo, S_q)``.

    ``lo`` is aligned to BLOCK_M. Tiles in ``[lo, hi_mask)`` need the causal mask, tiles in
    ``[hi_mask, S_q)`` attend every key of the tile.
    """
    if IS_CAUSAL:
        first = tl.maximum(start_n + S_q - S_k, 0)  # the first query that attends key start_n
        lo = tl.minimum((first // BLOCK_M) * BLOCK_M, S_q)
        # the first query that attends every key of the tile, rounded up to a tile start
        full = tl.maximum(start_n + BLOCK_N - 1 + S_q - S_k, 0)
        hi_mask = tl.maximum(tl.minimum(tl.cdiv(full, BLOCK_M) * BLOCK_M, S_q), lo)
    else:
        lo = 0
        hi_mask = 0
    return lo, hi_mask
