"""Launcher of the Gluon MLA decode kernel (flashop/kernels/mla_gluon.py): when it takes a
call of the latent-cache launcher (mla.py), its plan's launch, and its descriptors.

Where it serves, as the Gluon forward (gluon.py): triton 3.6 on a Hopper GPU, eager calls
and CUDA graphs captured from them, and graphs that torch.compile runs here, whose
operator then calls it through attention_with_kvcache's opaque twin (Inductor cannot trace
Gluon kernels); exported graphs keep the `tl` kernel. Its tiles are fixed: 64 query rows
and 64 keys per step, two key tiles in flight (230 KB of shared memory, one program per
SM), two consumer groups of 240 registers and a load warp.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from flashop._launch import gluon
from flashop._launch.common import decline, tma_aligned
from flashop._launch.decode_tiles import DecodeTiles
from flashop._launch.launches import Planned, launch_now

ROWS = 64  # query rows per program (Hopper's wgmma: 64 rows per consumer group)
BLOCK_N = 64  # keys per step; a page holds whole tiles (pages of a multiple of 64)
STAGES = 2
CONSUMER_REGS, LOAD_REGS = 240, 24
# the tiles as the decode's split rule (decode_tiles.call_splits) reads them: one program
# per SM
TILES = DecodeTiles(ROWS, BLOCK_N, num_stages=STAGES, per_sm=1)
LATENT, ROPE = 512, 64
KERNEL_NAME = "mla_decode_gluon_kernel"


@functools.lru_cache(maxsize=None)
def kernel():
    from flashop.kernels.mla_gluon import mla_decode_gluon_kernel
    return mla_decode_gluon_kernel


def serves(q: torch.Tensor, k_cache: torch.Tensor, values_in_keys: bool,
           block_table: Optional[torch.Tensor], cache_leftpad: Optional[torch.Tensor],
           traced: bool = False, why: Optional[list] = None) -> bool:
    """Whether the Gluon kernel takes this latent-cache call: where the Gluon kernels run
    (gluon.takes_call: the switch not off, triton 3.6 on a Hopper GPU, 16-bit inputs,
    ``traced`` as there), the values the rows' first 512 dims (one cache), one latent head,
    a multiple of 64 query heads (or a divisor of 64, the heads times the queries a
    multiple of 64: a program's 64 rows then span queries), no left padding, a dense
    cache or pages of a multiple of 64 keys, and q and the cache addressable by
    descriptors (a unit-stride last dim, 16-byte aligned start and strides)."""
    what = "Gluon MLA decode"
    if not gluon.takes_call(q, True, traced, why, what):
        return False
    S_q, H, D = q.shape[1], q.shape[2], q.shape[3]
    H_kv = k_cache.shape[2]
    if not values_in_keys or D != LATENT + ROPE:
        return decline(why, f"{what}: the latent cache's values as its rows' first "
                            f"{LATENT} dims only")
    if H_kv != 1 or not (H % ROWS == 0 or (ROWS % H == 0 and H * S_q % ROWS == 0)):
        return decline(why, f"{what}: one latent head and a multiple of {ROWS} query heads "
                            f"(or a divisor of {ROWS} with heads x queries a multiple of "
                            f"{ROWS}), not {H_kv} and {H} x {S_q}")
    if cache_leftpad is not None:
        return decline(why, f"{what}: no cache_leftpad")
    if block_table is not None and k_cache.shape[1] % BLOCK_N:
        return decline(why, f"{what}: pages of a multiple of {BLOCK_N} keys, not "
                            f"{k_cache.shape[1]}")
    if not all(x.stride(-1) == 1 and tma_aligned(x) for x in (q, k_cache)):
        return decline(why, f"{what}: q or k_cache not 16-byte aligned with a unit-stride "
                            f"head dim")
    return True


def decode_launch(num_splits: int, B: int, S_q: int, H: int, S_new: int, capacity: int,
                  page: int, paged: bool, batch_idx: bool, causal: bool, qk_scale: float,
                  stride_tb: int) -> Planned:
    """The kernel's planned launch: grid (splits, S_q * H / 64, B), its fixed arguments."""
    return Planned((num_splits, S_q * H // ROWS, B), dict(
        stride_tb=stride_tb, S_q=S_q, S_new=S_new, capacity=capacity, G=H,
        qk_scale=qk_scale, BLOCK_N=BLOCK_N, STAGES=STAGES, PAGE_SIZE=page if paged else 1,
        IS_PAGED=paged, HAS_BATCH_IDX=batch_idx, IS_CAUSAL=causal, SPLIT=num_splits > 1,
        CONSUMER_REGS=CONSUMER_REGS, LOAD_REGS=LOAD_REGS, num_warps=4))


def descriptors(q: torch.Tensor, k_cache: torch.Tensor) -> dict:
    """The kernel's descriptors of a call: q's latent and rotary tiles of 64 rows (64
    heads of one query, or the H heads of 64 / H queries), the cache's of BLOCK_N rows."""
    heads = min(q.shape[2], ROWS)
    tile = (1, ROWS // heads, heads)
    return dict(q_desc=gluon.descriptor_of(q, tile + (LATENT,)),
                qr_desc=gluon.descriptor_of(q, tile + (ROPE,)),
                k_desc=gluon.descriptor_of(k_cache, (1, BLOCK_N, 1, LATENT)),
                kr_desc=gluon.descriptor_of(k_cache, (1, BLOCK_N, 1, ROPE)))


def describe(static: dict) -> str:
    """The plan's tiles, as flashop.explain tells them."""
    return (f"{ROWS}x{static['BLOCK_N']} tiles (query heads x keys), {static['STAGES']} "
            f"stages; scores once per tile by one consumer group, P V split by value dims "
            f"between two")


def launch(kernel, planned: Planned, **per_call) -> None:
    """launch_split_kv's launch of the Gluon kernel: eager (launch_now), never through
    torch.library.wrap_triton, which cannot trace it."""
    launch_now(kernel, planned.grid, **per_call, **planned.static)
