"""The keys each query attends, by position, and the CPU path's tiles of scores.

A bound on the keys is written once here: ``Bounds.keep`` (a tile's keep-mask) and
``Bounds.key_range`` (the keys a block of queries may attend, so that tiles wholly outside
are never computed) read the same fields, as the kernels' masks and key_tile_range do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# scores of one tile: about this many fp32 elements (batch x heads x queries x keys)
TILE_ELEMENTS = 1 << 19
KEY_TILE = 256  # keys per tile, where the tile budget allows
ALIGN = 16  # tiles start at multiples of 16 queries and keys (dropout's draws)


@dataclass(frozen=True)
class Bounds:
    """Query i of a problem sits at key position ``p = i + offset`` (``S_k - S_q``:
    bottom-right aligned) and attends key j, ``0 <= j < S_k``, iff ``p - left <= j`` and
    ``j <= p + right`` (-1: that side unbounded; causal is ``right = 0``) and, where
    ``chunk`` C > 0, ``j // C == p // C`` (floor division: a query before key 0 is in no
    key's chunk)."""

    offset: int
    left: int = -1
    right: int = -1
    chunk: int = 0

    @property
    def bounded(self) -> bool:
        """Whether some key is out of some query's bounds (past the lengths aside)."""
        return self.left >= 0 or self.right >= 0 or self.chunk > 0

    def _first(self, p: int) -> int:
        """The first key position ``p`` may attend (before the lengths)."""
        first = p - self.left if self.left >= 0 else -(1 << 62)
        if self.chunk > 0:
            first = max(first, p // self.chunk * self.chunk)
        return first

    def _end(self, p: int) -> int:
        """One past the last key position ``p`` may attend (before the lengths)."""
        end = p + self.right + 1 if self.right >= 0 else 1 << 62
        if self.chunk > 0:
            end = min(end, (p // self.chunk + 1) * self.chunk)
        return end

    def key_range(self, i0: int, i1: int, S_k: int) -> tuple[int, int]:
        """[lo, hi): the keys that some query of [i0, i1) may attend (a query's first and
        end keys both grow with its position)."""
        lo = max(0, self._first(i0 + self.offset))
        hi = min(S_k, self._end(i1 - 1 + self.offset))
        return lo, max(lo, hi)

    def keep(self, i0: int, i1: int, j0: int, j1: int) -> Optional[torch.Tensor]:
        """The (i1 - i0, j1 - j0) keep-mask of queries [i0, i1) and keys [j0, j1); None
        where every pair is kept."""
        if (self._first(i1 - 1 + self.offset) <= j0
                and j1 <= self._end(i0 + self.offset)):
            return None
        p = torch.arange(i0 + self.offset, i1 + self.offset)[:, None]
        j = torch.arange(j0, j1)[None, :]
        keep = torch.ones(i1 - i0, j1 - j0, dtype=torch.bool)
        if self.left >= 0:
            keep &= j >= p - self.left
        if self.right >= 0:
            keep &= j <= p + self.right
        if self.chunk > 0:
            keep &= (torch.div(j, self.chunk, rounding_mode="floor")
                     == torch.div(p, self.chunk, rounding_mode="floor"))
        return keep


def _aligned(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


def tile_sizes(G: int, S_q: int, S_k: int, bounded: bool) -> tuple[int, int, int]:
    """(M, N, pairs): tiles of M queries (times the G heads of a group) and N keys, and
    the (batch entry, key/value head) pairs a part takes, so that a tile of a part holds
    about TILE_ELEMENTS scores; M and N multiples of ALIGN, M at most N where the keys are
    ``bounded`` (causal, a window: blocks of fewer queries leave more key tiles out). The
    forward and the backward take the same tiles, so that they compute each score alike
    (the backward's P against the forward's lse)."""
    N = min(KEY_TILE, _aligned(S_k))
    M = min(_aligned(S_q), max(ALIGN, TILE_ELEMENTS // (G * N) // ALIGN * ALIGN))
    if bounded:
        M = min(M, N)
    if G * M * N > TILE_ELEMENTS:  # large groups: fewer keys per tile too
        N = max(ALIGN, TILE_ELEMENTS // (G * M) // ALIGN * ALIGN)
    return M, N, max(1, TILE_ELEMENTS // (G * M * N))


def key_tiles(bounds: Bounds, i0: int, i1: int, S_k: int, N: int):
    """The key tiles [j0, j1) that queries [i0, i1) visit: starts at multiples of N,
    clipped to the keys they may attend."""
    lo, hi = bounds.key_range(i0, i1, S_k)
    for j0 in range(lo // N * N, hi, N):
        yield j0, min(j0 + N, S_k)
