"""The tile ranges the kernels visit (kernels/common.py): every attended (query, key) pair is
visited, tiles run without a mask only where every pair is attended, and no visited tile is
wholly outside the window and the chunks (so their cost grows with their size, not with
S_q * S_k)."""

import torch
import triton
import triton.language as tl
from hypothesis import example, given, settings, strategies as st

from flashop.kernels.common import key_tile_range, query_tile_range
from helpers import DEVICE


@triton.jit
def _store4(p, a, b, c, d):
    o = tl.arange(0, 4)
    tl.store(p + o, tl.where(o == 0, a, tl.where(o == 1, b, tl.where(o == 2, c, d))))


@triton.jit
def _ranges_kernel(out_k, out_q, S_q, S_k, left, right, chunk, HAS_LEFT: tl.constexpr,
                   HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    i = tl.program_id(0)
    if i * BLOCK_M < S_q:
        lo, u_lo, u_hi, hi = key_tile_range(i * BLOCK_M, S_q, S_k, left, right, chunk,
                                            HAS_LEFT, HAS_RIGHT, HAS_CHUNK, BLOCK_M, BLOCK_N)
        _store4(out_k + 4 * i, lo, u_lo, u_hi, hi)
    if i * BLOCK_N < S_k:
        lo, u_lo, u_hi, hi = query_tile_range(i * BLOCK_N, S_q, S_k, left, right, chunk,
                                              HAS_LEFT, HAS_RIGHT, HAS_CHUNK, BLOCK_M, BLOCK_N)
        _store4(out_q + 4 * i, lo, u_lo, u_hi, hi)


def _attended(S_q, S_k, left, right, chunk, rows=None):
    """keep[i, j] for queries i < rows (default S_q; more rows continue the diagonal and the
    chunks)."""
    i = torch.arange(S_q if rows is None else rows)[:, None] + (S_k - S_q)
    j = torch.arange(S_k)[None, :]
    keep = torch.ones(i.shape[0], S_k, dtype=torch.bool)
    if right >= 0:
        keep &= j <= i + right
    if left >= 0:
        keep &= j >= i - left
    if chunk > 0:
        keep &= torch.div(j, chunk, rounding_mode="floor") == torch.div(
            i, chunk, rounding_mode="floor")
    return keep


def _check_loops(lo, u_lo, u_hi, hi, step, end):
    assert 0 <= lo <= u_lo <= u_hi <= hi <= end, (lo, u_lo, u_hi, hi)
    for start in (lo, u_lo, u_hi):  # each loop starts on a tile boundary (or is empty)
        assert start % step == 0 or start == hi, (lo, u_lo, u_hi, hi)


# chunk lengths: off; 1; below, at and one either side of the tile sizes and their
# multiples; and any up to past the lengths
CHUNKS = st.one_of(st.just(0), st.sampled_from([1, 2, 3, 5, 8, 15, 16, 17, 31, 32, 33, 48, 63,
                                                64, 65, 96, 127, 128, 129, 256]),
                   st.integers(1, 320))


@settings(max_examples=max(settings.default.max_examples, 150))
@given(S_q=st.integers(1, 300), S_k=st.integers(1, 300),
       left=st.one_of(st.just(-1), st.integers(0, 320)),
       right=st.one_of(st.just(-1), st.integers(0, 320)), chunk=CHUNKS,
       BLOCK_M=st.sampled_from([16, 32, 64, 128]), BLOCK_N=st.sampled_from([16, 32, 64]))
@example(S_q=256, S_k=256, left=-1, right=0, chunk=64, BLOCK_M=64, BLOCK_N=32)  # on tile edges
@example(S_q=100, S_k=300, left=-1, right=0, chunk=1, BLOCK_M=32, BLOCK_N=16)
@example(S_q=300, S_k=100, left=-1, right=-1, chunk=48, BLOCK_M=128, BLOCK_N=64)
@example(S_q=200, S_k=200, left=20, right=-1, chunk=17, BLOCK_M=16, BLOCK_N=64)
def test_tile_ranges(S_q, S_k, left, right, chunk, BLOCK_M, BLOCK_N):
    n = max(triton.cdiv(S_q, BLOCK_M), triton.cdiv(S_k, BLOCK_N))
    out_k = torch.zeros(n, 4, dtype=torch.int32, device=DEVICE)
    out_q = torch.zeros(n, 4, dtype=torch.int32, device=DEVICE)
    _ranges_kernel[(n,)](out_k, out_q, S_q, S_k, max(left, 0), max(right, 0), chunk,
                         left >= 0, right >= 0, chunk > 0, BLOCK_M, BLOCK_N)
    keep = _attended(S_q, S_k, left, right, chunk)
    # the same bounds for rows up to BLOCK_M past S_q (a last query tile's padding rows)
    keep_padded = _attended(S_q, S_k, left, right, chunk, rows=S_q + BLOCK_M)
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
