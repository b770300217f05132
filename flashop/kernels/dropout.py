"""Dropout's keep mask written out, for tests and debugging: the mask the attention kernels
draw for the same seed (flashop.testing.dropout_mask)."""

import triton
import triton.language as tl

from flashop.kernels.common import dropout_keep


@triton.jit
def dropout_mask_kernel(
    dropout_seed, keep, S_q, S_k, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """keep[b, h, i, j] (uint8, contiguous (B, H, S_q, S_k)) for a grid (query tiles, H, B):
    1 where the attention kernels keep the pair's probability."""
    dropout_p = tl.cast(dropout_p, tl.float32)
    i_m = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    i_b = tl.program_id(2).to(tl.int64)
    seed = tl.load(dropout_seed)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    keep += (i_b * tl.num_programs(1) + i_h) * S_q * S_k
    for start_n in range(0, S_k, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        # [BLOCK_M, BLOCK_N]
        b_keep = dropout_keep(seed, i_b, i_h, o_m, start_n, dropout_p, BLOCK_N, False)
        tl.store(keep + o_m[:, None] * S_k + o_n[None, :], b_keep.to(tl.uint8),
                 mask=(o_m[:, None] < S_q) & (o_n[None, :] < S_k))
