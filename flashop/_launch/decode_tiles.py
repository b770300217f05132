"""The split-KV decode kernel's tiles and split counts (flashop/kernels/decode.py and
mla.py's launchers): the tiles per query rows, head dims, dtype and pages; what fits the
shared memory; how many programs an SM holds; and the splits of a sequence's keys that
fill the GPU. Every choice depends on shapes, the dtype and the device only, never on the
values of ``cache_seqlens`` (kvcache.py says why).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from flashop._launch.common import cdiv, next_power_of_2, sm_count
from flashop._launch.tiles import shared_memory_bytes
from flashop.kernels import INTERPRETING

# At most this many splits of one sequence's keys (the merge reads them in one block)
MAX_SPLITS = 128


@dataclass(frozen=True)
class DecodeTiles:
    """Tiles of the split-KV kernel: BLOCK_M query rows (the G heads of one KV head times
    S_q positions, padded to a power of two >= 16 for tl.dot), BLOCK_N keys per iteration."""

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int = 4
    num_stages: int = 1
    per_sm: int = 0  # programs the split count plans per SM (0: as shared memory allows)
    # paged: each key's page id loaded (a vector, which the pipeliner prefetches) even where
    # a tile lies in one page; else such a tile's one id (a scalar load in the loop)
    key_page_ids: bool = False


def decode_tiles(rows: int, block_d: int, block_dv: int, dtype: torch.dtype,
                 page: int, fp8_cache: bool = False) -> DecodeTiles:
    """The split-KV kernel's tiles for ``rows = G * S_q`` query rows per KV head over a cache
    of pages of ``page`` keys (0: a dense cache).

    The kernel streams K and V: at head dims up to 128 (16-bit), as measured fastest, a
    dense cache's contiguous tiles 128 keys at a time, 3 stages deep, one program per SM
    (short_run_tiles takes 2 stages for splits of one or
    two tiles); a paged cache's tiles 64 keys at a time, 2 stages deep with splits planned
    for 4 programs per SM, each key's page id a vector load that the pipeliner prefetches
    (short_run_tiles takes a tile's one id where it lies in one page and each split runs at
    most two tiles). Head dims above 128 take fewer keys: a dense cache 64 at a time with 8
    warps, a paged one 32. An fp8 cache (``fp8_cache``, head dims up to 128), whose tiles
    take half the shared memory, streams 128 keys at a time, 3 stages deep, with splits
    planned for 2 programs per SM, dense or paged (each key's page id loaded). Under the
    interpreter, small tiles (every program runs in numpy). The tiles are chosen for
    Hopper's shared memory (fit_shared_memory fits them to a GPU with less)."""
    block_m = max(16, next_power_of_2(rows))
    if INTERPRETING:
        return DecodeTiles(min(block_m, 32), 16, key_page_ids=page > 0)
    block_m = min(block_m, 64)
    head = max(block_d, block_dv)
    if dtype == torch.float32:
        return DecodeTiles(block_m, 32 if head <= 128 else 16, 4, 2)
    if head <= 128 and fp8_cache:
        return DecodeTiles(block_m, 128, 4, 3, per_sm=2, key_page_ids=page > 0)
    if head <= 128:
        if page == 0:
            return DecodeTiles(block_m, 128, 4, 3)
        return DecodeTiles(block_m, 64, 4, 2, per_sm=4, key_page_ids=True)
    if page == 0:
        return DecodeTiles(block_m, 64, 8, 3)
    return DecodeTiles(block_m, 32, 4, 2, per_sm=4, key_page_ids=True)


def fit_shared_memory(t: DecodeTiles, block_d: int, block_dv: int, itemsize: int,
                      shared_memory: int) -> DecodeTiles:
    """``t`` with fewer stages (down to 2), then fewer keys per tile (down to 16), until its
    query tile and staged key and value tiles (counted as the forward's,
    tiles.shared_memory_bytes) fit ``shared_memory`` bytes less 16 KiB (left for what the
    compiler adds): the tiles are chosen on Hopper (227 KiB), where an A100 has 163 KiB
    and consumer GPUs about 100 KiB."""
    while (shared_memory_bytes("fwd", t, block_d, block_dv, itemsize)
           > shared_memory - 16 * 1024):
        if t.num_stages > 2:
            t = replace(t, num_stages=t.num_stages - 1)
        elif t.BLOCK_N > 16:
            t = replace(t, BLOCK_N=t.BLOCK_N // 2)
        else:
            break
    return t


def short_run_tiles(t: DecodeTiles, capacity: int, num_splits: int, page: int) -> DecodeTiles:
    """``t`` for splits that each run at most two key tiles of a full cache (``page`` 0: a
    dense cache): the whole run is then in flight at once. A dense cache's 128-key tiles
    take 2 stages, the third only lengthening the prologue; a paged cache whose tiles lie in
    one page loads each tile's one page id, the keys' vector of ids only lengthening the
    chain of loads (both measured faster so)."""
    if cdiv(cdiv(capacity, t.BLOCK_N), num_splits) > 2:
        return t
    if page == 0 and t.BLOCK_N == 128 and t.num_stages > 2:
        return replace(t, num_stages=2)
    if page >= t.BLOCK_N and t.key_page_ids:
        return replace(t, key_page_ids=False)
    return t


def programs_per_sm(t: DecodeTiles, block_d: int, block_dv: int, itemsize: int) -> int:
    """Split-KV programs the split count plans on one SM: ``t.per_sm`` where the tiles set
    it, else as many as their staged K and V tiles fit (about 200 KiB of shared memory per
    SM on Hopper; 1 or 2)."""
    if t.per_sm:
        return t.per_sm
    staged = t.num_stages * t.BLOCK_N * (block_d + block_dv) * itemsize
    return 2 if 2 * staged <= 200 * 1024 else 1


def auto_splits(programs: int, capacity: int, block_n: int, slots: int) -> int:
    """Splits of each sequence's keys for ``programs`` (B * H_kv * row tiles) programs per
    split on ``slots`` resident programs (SMs times programs per SM): _splits_for_occupancy
    with splits of at least two key tiles (one under the interpreter)."""
    return _splits_for_occupancy(programs, capacity, block_n, slots, 1 if INTERPRETING else 2)


def call_splits(num_splits: int, programs: int, capacity: int, t: DecodeTiles, block_d: int,
                block_dv: int, itemsize: int, device: torch.device) -> int:
    """A call's split count: ``num_splits`` where it asks for some (0: auto_splits' rule for
    ``programs`` on the device's resident programs of tiles ``t``), at most MAX_SPLITS."""
    if num_splits == 0:
        slots = sm_count(device) * programs_per_sm(t, block_d, block_dv, itemsize)
        num_splits = auto_splits(programs, capacity, t.BLOCK_N, slots)
    return min(num_splits, MAX_SPLITS)


@functools.lru_cache(maxsize=4096)
def _splits_for_occupancy(programs: int, capacity: int, block_n: int, slots: int,
                          min_tiles: int) -> int:
    """auto_splits' rule (looked up once per shape: it tries every split count, a decode
    step's largest host cost otherwise).

    Every split of a full cache does the same work, so the last wave's occupancy counts:
    the fewest splits whose waves are within 5% of the best occupancy of any split count,
    each split keeping at least ``min_tiles`` key tiles of the cache's ``capacity``: small
    caches are bound by latency, and short splits finish sooner, down to two tiles (as
    measured). A split count is counted as the splits its tiles per split fill (31 splits
    of 64 tiles take 3 each: 22 splits). Many waves without splitting: one split."""
    if programs >= 4 * slots:
        return 1
    tiles = cdiv(capacity, block_n)
    most = max(1, min(MAX_SPLITS, cdiv(tiles, min_tiles)))
    occupancy = {}
    for s in range(1, most + 1):
        filled = cdiv(tiles, cdiv(tiles, s))
        waves = programs * filled / slots
        occupancy[filled] = waves / math.ceil(waves)
    best = max(occupancy.values())
    return min(s for s, occ in occupancy.items() if occ >= 0.95 * best)
