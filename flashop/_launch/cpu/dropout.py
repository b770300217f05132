"""Dropout's keep-mask on the CPU path: the kernels' own (flashop/kernels/common.py,
``dropout_keep``; docs/modifiers.md), a pure function of (seed, b, h, i, j), computed with
torch's integer operations.

With query i = 16 a + 8 y + r (r < 8) and key j = 16 c + 8 x + 2 u + z (u < 4), one
Philox-4x32-7 draw under the 64-bit seed of the counter (4 c + u, 8 a + r, h, b) gives four
32-bit words; the pair takes half z (the low one first) of word 2 y + x and is kept where
those 16 bits reach ``dropout_p * 2**16``. Each draw is computed once for its eight pairs.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox-4x32's multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # its key schedule's increments


def _mul_hi_lo(c: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32-bit words of ``c * m`` (c int64 holding uint32 values, m a
    uint32): the product of 16-bit halves of m, so that nothing passes 2**63."""
    a = c * (m & 0xFFFF)
    b = c * (m >> 16)
    t = a + ((b & 0xFFFF) << 16)
    return (b >> 16) + (t >> 32), t & _MASK32


def philox(seed: int, c0, c1, c2, c3) -> tuple:
    """Philox-4x32-7 of the counters (int64 tensors of uint32 values, broadcast together)
    under the 64-bit key ``seed``: its four words (int64 tensors)."""
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(7):
        hi0, lo0 = _mul_hi_lo(c0, _M0)
        hi1, lo1 = _mul_hi_lo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def keep(seed: int, batch: torch.Tensor, heads: torch.Tensor, i0: int, i1: int, j0: int,
         j1: int, dropout_p: float) -> torch.Tensor:
    """The (len(batch), len(heads), i1 - i0, j1 - j0) bool keep-mask of queries [i0, i1)
    and keys [j0, j1) of the query heads ``heads`` of the batch entries (or packed
    sequences) ``batch`` (int64 indices); ``i0`` and ``j0`` multiples of 16, ``dropout_p``
    as the kernels draw it (a multiple of 2**-16)."""
    A, C = -(-(i1 - i0) // 16), -(-(j1 - j0) // 16)
    a = torch.arange(i0 // 16, i0 // 16 + A)
    c = torch.arange(j0 // 16, j0 // 16 + C)
    # counters of shape (B, H, A, 8 [r], C, 4 [u])
    c0 = (4 * c[:, None] + torch.arange(4))[None, None, None, None]
    c1 = (8 * a[:, None] + torch.arange(8))[None, None, :, :, None, None]
    c2 = heads.long()[None, :, None, None, None, None]
    c3 = batch.long()[:, None, None, None, None, None]
    words = torch.stack(philox(seed, c0, c1, c2, c3), dim=-1)  # (..., 4 [2 y + x])
    words = words.unflatten(-1, (2, 2))  # (B, H, A, r, C, u, y, x)
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=-1)  # (..., z)
    # (B, H, [a, y, r], [c, x, u, z])
    bits = halves.permute(0, 1, 2, 6, 3, 4, 7, 5, 8).reshape(
        len(batch), len(heads), 16 * A, 16 * C)
    return bits[:, :, :i1 - i0, :j1 - j0] >= round(dropout_p * 65536)


def dropout_mask(dropout_seed: torch.Tensor, B: int, H: int, S_q: int, S_k: int,
                 dropout_p: float) -> torch.Tensor:
    """The (B, H, S_q, S_k) bool keep-mask of a call (launch.attention.dropout_mask's)."""
    return keep(int(dropout_seed.item()), torch.arange(B), torch.arange(H), 0, S_q, 0, S_k,
                dropout_p)
