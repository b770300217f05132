"""The tile ranges the kernels visit (kernels/common.py): every attended (query, key) pair is
visited, tiles run without a mask only where every pair is attended, and no visited tile is
wholly outside the window (so a window's cost grows with its size, not with S_q * S_k)."""

import torch
import triton
import triton.language as tl
from hypothesis import given, strategies as st

from flashop.kernels.common import key_tile_range, query_tile_range
from helpers import DEVICE


@triton.jit
def _store4(p, a, b, c, d):
    o = tl.arange(0, 4)
    tl.store(p + o, tl.where(o == 0, a, tl.where(o == 1, b, tl.where(o == 2, c, d))))


@triton.jit
def _ranges_kernel(out_k, out_q, S_q, S_k, left, right, HAS_LEFT: tl.constexpr,
                   HAS_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    i = tl.program_id(0)
    if i * BLOCK_M < S_q:
        lo, u_lo, u_hi, hi = key_tile_range(i * BLOCK_M, S_q, S_k, left, right, HAS_LEFT,
                                            HAS_RIGHT, BLOCK_M, BLOCK_N)
        _store4(out_k + 4 * i, lo, u_lo, u_hi, hi)
    if i * BLOCK_N < S_k:
        lo, u_lo, u_hi, hi = query_tile_range(i * BLOCK_N, S_q, S_k, left, right, HAS_LEFT,
                                              HAS_RIGHT, BLOCK_M, BLOCK_N)
        _store4(out_q + 4 * i, lo, u_lo, u_hi, hi)


def _attended(S_q, S_k, left, right, rows=None):
    """keep[i, j] for queries i < rows (default S_q; more rows continue the diagonal)."""
    i = torch.arange(S_q if rows is None else rows)[:, None] + (S_k - S_q)
    j = torch.arange(S_k)[None, :]
    keep = torch.ones(i.shape[0], S_k, dtype=torch.bool)
    if right >= 0:
        keep &= j <= i + right
    if left >= 0:
        keep &= j >= i - left
    return keep


def _check_loops(lo, u_lo, u_hi, hi, step, end):
    assert 0 <= lo <= u_lo <= u_hi <= hi <= end, (lo, u_lo, u_hi, hi)
    for start in (lo, u_lo, u_hi):  # each loop starts on a tile boundary (or is empty)
        assert start % step == 0 or start == hi, (lo, u_lo, u_hi, hi)


@given(S_q=st.integers(1, 300), S_k=st.integers(1, 300),
       left=st.one_of(st.just(-1), st.integers(0, 320)),
       right=st.one_of(st.just(-1), st.integers(0, 320)),
       BLOCK_M=st.sampled_from([16, 32, 64, 128]), BLOCK_N=st.sampled_from([16, 32, 64]))
def test_tile_ranges(S_q, S_k, left, right, BLOCK_M, BLOCK_N):
    n = max(triton.cdiv(S_q, BLOCK_M), triton.cdiv(S_k, BLOCK_N))
    out_k = torch.zeros(n, 4, dtype=torch.int32, device=DEVICE)
    out_q = torch.zeros(n, 4, dtype=torch.int32, device=DEVICE)
    _ranges_kernel[(n,)](out_k, out_q, S_q, S_k, max(left, 0), max(right, 0), left >= 0,
                         right >= 0, BLOCK_M, BLOCK_N)
    keep = _attended(S_q, S_k, left, right)
    # the same window for rows up to BLOCK_M past S_q (a last query tile's padding rows)
    keep_padded = _attended(S_q, S_k, left, right, rows=S_q + BLOCK_M)
    out_k, out_q = out_k.tolist(), out_q.tolist()
    for t in range(triton.cdiv(S_q, BLOCK_M)):  # a forward / dQ program per query tile
        lo, u_lo, u_hi, hi = out_k[t]
        _check_loops(lo, u_lo, u_hi, hi, BLOCK_N, S_k)
        rows = keep[t * BLOCK_M:(t + 1) * BLOCK_M]
        cols = rows.any(0).nonzero()
        if len(cols):
            assert lo <= cols.min() and cols.max() < hi
        if u_hi > u_lo:  # unmasked tiles: whole, and attended by every row
            assert rows[:, u_lo:u_hi].all()
        visited = keep_padded[t * BLOCK_M:(t + 1) * BLOCK_M]
        for start in range(lo, hi, BLOCK_N):
            assert visited[:, start:start + BLOCK_N].any(), (t, start)
    for t in range(triton.cdiv(S_k, BLOCK_N)):  # a dK/dV program per key tile
        lo, u_lo, u_hi, hi = out_q[t]
        _check_loops(lo, u_lo, u_hi, hi, BLOCK_M, S_q)
        cols = keep[:, t * BLOCK_N:(t + 1) * BLOCK_N]
        rows = cols.any(1).nonzero()
        if len(rows):
            assert lo <= rows.min() and rows.max() < hi
        if u_hi > u_lo:  # rows past S_q need no mask here (they load zeros)
            assert cols[u_lo:u_hi].all()
        for start in range(lo, hi, BLOCK_M):
            assert cols[start:start + BLOCK_M].any(), (t, start)
