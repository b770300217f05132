"""The tile ranges the kernels visit (kernels/common.py): every attended (query, key) pair is
visited, tiles run without a mask only where every pair is attended, and no visited tile is
wholly outside the window and the chunks (so their cost grows with their size, not with
S_q * S_k)."""

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings, strategies as st

from flashop.kernels.common import key_tile_range, query_tile_range
from helpers import (
    DEVICE, edge_offset_keys, left_bounds_at_edges, right_bounds_at_edges, tile_edges,
)


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


@st.composite
def bounds(draw, BLOCK_M: int, BLOCK_N: int):
    """(S_q, S_k, left, right) anywhere, or at the edges of these tiles (tests/helpers.py):
    lengths, the offset S_k - S_q, and the window's bounds relative to it."""
    tiles = (BLOCK_M, BLOCK_N)
    S_q = draw(st.one_of(st.integers(1, 300), tile_edges(1, 300, tiles)))
    S_k = draw(st.one_of(st.integers(1, 300), tile_edges(1, 300, tiles),
                         edge_offset_keys(S_q, 1, 300, tiles)))
    anywhere = st.one_of(st.just(-1), st.integers(0, 320))
    left = draw(st.one_of(anywhere, left_bounds_at_edges(S_k - S_q, 320, sizes=tiles)))
    right = draw(st.one_of(anywhere, right_bounds_at_edges(S_k - S_q, 320, sizes=tiles)))
    return S_q, S_k, left, right


@settings(max_examples=max(settings.default.max_examples, 150))
@given(data=st.data(), chunk=CHUNKS, BLOCK_M=st.sampled_from([16, 32, 64, 128]),
       BLOCK_N=st.sampled_from([16, 32, 64]))
def test_tile_ranges(data, chunk, BLOCK_M, BLOCK_N):
    check_tile_ranges(*data.draw(bounds(BLOCK_M, BLOCK_N)), chunk, BLOCK_M, BLOCK_N)


@pytest.mark.parametrize("S_q,S_k,left,right,chunk,BLOCK_M,BLOCK_N", [
    (256, 256, -1, 0, 64, 64, 32),  # chunks on tile edges
    (100, 300, -1, 0, 1, 32, 16),
    (300, 100, -1, -1, 48, 128, 64),
    (200, 200, 20, -1, 17, 16, 64),
])
def test_tile_ranges_with_chunks(S_q, S_k, left, right, chunk, BLOCK_M, BLOCK_N):
    check_tile_ranges(S_q, S_k, left, right, chunk, BLOCK_M, BLOCK_N)


def check_tile_ranges(S_q, S_k, left, right, chunk, BLOCK_M, BLOCK_N):
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



# --- every residue: the ranges of many tiles and bounds at once ------------------------------

@triton.jit
def _many_ranges_kernel(out, starts, S_qs, S_ks, lefts, rights, n, HAS_LEFT: tl.constexpr,
                        HAS_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        KEY_RANGES: tl.constexpr, BLOCK: tl.constexpr):
    """(lo, u_lo, u_hi, hi) of n tiles, each with its own lengths and bounds (the ranges are
    elementwise in their arguments): of the query tile at starts[i] (key_tile_range) where
    KEY_RANGES, else of the key tile at starts[i] (query_tile_range)."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    start = tl.load(starts + o, mask=m, other=0)
    S_q = tl.load(S_qs + o, mask=m, other=1)
    S_k = tl.load(S_ks + o, mask=m, other=1)
    left = tl.load(lefts + o, mask=m, other=0)
    right = tl.load(rights + o, mask=m, other=0)
    if KEY_RANGES:
        lo, u_lo, u_hi, hi = key_tile_range(start, S_q, S_k, left, right, 0, HAS_LEFT,
                                            HAS_RIGHT, False, BLOCK_M, BLOCK_N)
    else:
        lo, u_lo, u_hi, hi = query_tile_range(start, S_q, S_k, left, right, 0, HAS_LEFT,
                                              HAS_RIGHT, False, BLOCK_M, BLOCK_N)
    zero = 0 * start  # (a range may be the scalar 0)
    tl.store(out + 4 * o, lo + zero, mask=m)
    tl.store(out + 4 * o + 1, u_lo + zero, mask=m)
    tl.store(out + 4 * o + 2, u_hi + zero, mask=m)
    tl.store(out + 4 * o + 3, hi + zero, mask=m)


def _bounds_around_edges(BLOCK_M: int, BLOCK_N: int) -> torch.Tensor:
    """(S_q, S_k, left, right) rows: query counts one either side of a query tile and two
    tiles, causal offsets S_k - S_q near multiples of the key tile, and every left bound
    (with a few right ones) and every right bound (with a few left ones) from none to past a
    tile and a half, so that first and last keys take every residue of both tiles."""
    span = range(max(BLOCK_M, BLOCK_N) + BLOCK_N + 3)
    rows = []
    for S_q in (BLOCK_M - 1, BLOCK_M + 1, 2 * BLOCK_M):
        for S_k in (S_q + d for d in (-BLOCK_N - 1, -1, 0, 1, BLOCK_N - 1, BLOCK_N + 1)):
            if S_k > 0:
                rows += [(S_q, S_k, left, right) for left in (-1, *span)
                         for right in (-1, 0, 1, BLOCK_N - 1)]
                rows += [(S_q, S_k, left, right) for left in (-1, 0, BLOCK_N) for right in span]
    return torch.tensor(rows, dtype=torch.int64)


def _ranges(bounds: torch.Tensor, tile: int, other_tile: int, key_ranges: bool):
    """Each row's tiles (of ``tile`` queries where key_ranges, else keys) with the kernels'
    ranges over the other side: (bounds per tile, tile starts, ranges), int64 on the CPU."""
    S = bounds[:, 0 if key_ranges else 1]
    t = torch.arange(int(S.max()) // tile + 1)
    keep = t[None, :] * tile < S[:, None]
    bounds = bounds[:, None, :].expand(-1, len(t), -1)[keep]
    starts = (t[None, :] * tile).expand(keep.shape)[keep]
    out = torch.empty(len(starts), 4, dtype=torch.int32, device=DEVICE)
    BLOCK_M, BLOCK_N = (tile, other_tile) if key_ranges else (other_tile, tile)
    for has_left, has_right in ((False, False), (False, True), (True, False), (True, True)):
        rows = ((bounds[:, 2] >= 0) == has_left) & ((bounds[:, 3] >= 0) == has_right)
        if rows.any():
            S_q, S_k, left, right = (x.to(torch.int32, copy=True).to(DEVICE)
                                     for x in bounds[rows].clamp(min=0).unbind(1))
            part = torch.empty(len(S_q), 4, dtype=torch.int32, device=DEVICE)
            _many_ranges_kernel[(triton.cdiv(len(S_q), 1024),)](
                part, starts[rows].to(torch.int32).to(DEVICE), S_q, S_k, left, right,
                len(S_q), has_left, has_right, BLOCK_M, BLOCK_N, key_ranges, 1024)
            out[rows.to(DEVICE)] = part
    return bounds, starts, out.long().cpu()


def _attended_span(first, last, real):
    """The union [lowest, highest] of the intervals [first, last] of the real rows that
    attend something (an interval: first and last grow by one per row), and whether any."""
    some = real & (first <= last)
    big = torch.iinfo(torch.int64).max
    return (torch.where(some, first, big).min(1).values,
            torch.where(some, last, -big).max(1).values, some.any(1))


def _check_ranges(ranges, starts, step, end, first, last, real, first_all, last_all,
                  real_all, full_end):
    """The rules of test_tile_ranges for many tiles at once: ``first``/``last`` the other
    side's first and last index each row (query or key) of the tile attends (``real`` rows
    inside the lengths; ``*_all`` with the rows past them, as the kernels compute them),
    ``step`` the other side's tile, ``end`` its length, ``full_end`` the end of its whole
    tiles (an unmasked run may not pass it)."""
    lo, u_lo, u_hi, hi = ranges.unbind(1)
    bad = ~((0 <= lo) & (lo <= u_lo) & (u_lo <= u_hi) & (u_hi <= hi) & (hi <= end))
    for start in (lo, u_lo, u_hi):  # each loop starts on a tile boundary (or is empty)
        bad |= (start % step != 0) & (start != hi)
    lowest, highest, some = _attended_span(first, last, real)
    bad |= some & ((lowest < lo) | (highest >= hi))  # every attended pair visited
    # unmasked tiles: whole, and every pair in them attended
    unmasked = u_hi > u_lo
    bad |= unmasked & (u_hi > full_end)
    bad |= (unmasked[:, None] & real
            & ((first > u_lo[:, None]) | (last < u_hi[:, None] - 1))).any(1)
    # no visited tile wholly outside what the tile's rows attend
    lowest, highest, some = _attended_span(first_all, last_all, real_all)
    last_tile = lo + (hi - 1 - lo) // step * step
    bad |= (hi > lo) & (~some | (lo + step - 1 < lowest) | (last_tile > highest))
    return bad


# the interpreter's (forward and dQ, dK/dV, the forward's two query tiles), and a GPU's of
# either ratio
@pytest.mark.parametrize("BLOCK_M,BLOCK_N", [(32, 16), (16, 32), (16, 16), (64, 64),
                                             (128, 64), (32, 64)])
def test_tile_ranges_at_every_residue(BLOCK_M, BLOCK_N):
    """test_tile_ranges' rules over every left and right bound up to past a tile and a half,
    around the tiles' edges (_bounds_around_edges): the ranges of every query tile and every
    key tile of each, computed in one launch per kind of bound."""
    bounds = _bounds_around_edges(BLOCK_M, BLOCK_N)
    # key tiles of query tiles: rows r of the tile attend keys [r + off - left, r + off + right]
    b, start, ranges = _ranges(bounds, BLOCK_M, BLOCK_N, key_ranges=True)
    S_q, S_k, left, right = (x[:, None] for x in b.unbind(1))
    r = start[:, None] + torch.arange(BLOCK_M)
    first = torch.where(left >= 0, (r + S_k - S_q - left).clamp(min=0), 0)
    last = torch.where(right >= 0, torch.minimum(r + S_k - S_q + right, S_k - 1), S_k - 1)
    bad = _check_ranges(ranges, start, BLOCK_N, S_k[:, 0], first, last, r < S_q, first, last,
                        torch.ones_like(first, dtype=torch.bool), S_k[:, 0] // BLOCK_N * BLOCK_N)
    assert not bad.any(), ("(S_q, S_k, left, right), query tile start, key ranges",
                           b[bad][:4].tolist(), start[bad][:4].tolist(), ranges[bad][:4].tolist())
    # query tiles of key tiles: keys c of the tile are attended by queries
    # [c - off - right, c - off + left]; query rows past S_q load zeros and need no mask
    b, start, ranges = _ranges(bounds, BLOCK_N, BLOCK_M, key_ranges=False)
    S_q, S_k, left, right = (x[:, None] for x in b.unbind(1))
    c = start[:, None] + torch.arange(BLOCK_N)
    first = torch.where(right >= 0, (c - S_k + S_q - right).clamp(min=0), 0)
    last = torch.where(left >= 0, torch.minimum(c - S_k + S_q + left, S_q - 1), S_q - 1)
    bad = _check_ranges(ranges, start, BLOCK_M, S_q[:, 0], first, last, c < S_k, first, last,
                        c < S_k, S_q[:, 0])
    assert not bad.any(), ("(S_q, S_k, left, right), key tile start, query ranges",
                           b[bad][:4].tolist(), start[bad][:4].tolist(), ranges[bad][:4].tolist())
