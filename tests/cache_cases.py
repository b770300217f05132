"""The calls the decoding tests make (tests/test_decode.py, tests/test_decode_fp8.py):
a cache case, its tensors and keyword arguments, and the plans made anew for each test."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from helpers import DEVICE


@pytest.fixture(autouse=True)
def fresh_plans():
    """Each test plans its calls anew: an eager call's launches are planned once per
    signature (launch_decode._plan), and tests that patch the rules must see them used."""
    from flashop._launch import kvcache as launch_decode
    launch_decode._plan.cache_clear()
    yield
    launch_decode._plan.cache_clear()


@dataclass(frozen=True)
class CacheCase:
    """One call: B sequences of S_q queries over caches of ``lengths`` (before the append of
    S_new keys); paged with pages of ``page`` keys (``max_blocks`` per sequence, in random
    physical order among ``spare`` extra pages), or dense with ``S_cache`` positions per row
    and rows picked by ``batch_idx`` from ``B + spare`` rows."""

    lengths: tuple
    S_q: int
    S_new: int
    H_kv: int
    G: int
    D: int
    DV: int
    dtype: torch.dtype
    paged: bool = False
    page: int = 16
    capacity: int = 64  # S_cache, or max_blocks * page
    spare: int = 1
    batch_idx: bool = False
    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[tuple] = None  # shape of the slopes: (H,) or (B, H)
    sinks: Optional[torch.dtype] = None  # dtype of the attention sinks (H,)
    num_splits: int = 0
    rotary_dim: int = 0  # rotary_cos / rotary_sin of (capacity + 3, rotary_dim / 2)
    interleaved: bool = True
    leftpad: bool = False  # dense: each sequence starts at a random row up to its length

    @property
    def B(self) -> int:
        return len(self.lengths)

    @property
    def H(self) -> int:
        return self.H_kv * self.G


def make_call(case: CacheCase, seed: int = 0):
    """(q, k_cache, v_cache, k, v) and the keyword arguments of attention_with_kvcache."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=DEVICE, generator=gen).to(case.dtype)

    B = case.B
    q = randn(B, case.S_q, case.H, case.D)
    kwargs = dict(cache_seqlens=torch.tensor(case.lengths, dtype=torch.int32, device=DEVICE),
                  causal=case.causal, window_size=case.window_size, softcap=case.softcap,
                  num_splits=case.num_splits)
    if case.paged:
        max_blocks = case.capacity // case.page
        blocks = B * max_blocks + case.spare
        k_cache = randn(blocks, case.page, case.H_kv, case.D)
        v_cache = randn(blocks, case.page, case.H_kv, case.DV)
        order = torch.randperm(blocks, device=DEVICE, generator=gen)[:B * max_blocks]
        kwargs["block_table"] = order.view(B, max_blocks).to(torch.int32)
    else:
        k_cache = randn(B + case.spare, case.capacity, case.H_kv, case.D)
        v_cache = randn(B + case.spare, case.capacity, case.H_kv, case.DV)
        if case.batch_idx:
            rows = torch.randperm(B + case.spare, device=DEVICE, generator=gen)[:B]
            kwargs["cache_batch_idx"] = rows.to(torch.int32)
    k = v = None
    if case.S_new > 0:
        k = randn(B, case.S_new, case.H_kv, case.D)
        v = randn(B, case.S_new, case.H_kv, case.DV)
    if case.alibi is not None:
        kwargs["alibi_slopes"] = torch.rand(case.alibi, device=DEVICE, generator=gen)
    if case.sinks is not None:
        # about the log of a few tens of keys' sum: the sink takes a real share of each row
        sinks = 3 + 2 * torch.randn(case.H, device=DEVICE, generator=gen)
        kwargs["sinks"] = sinks.to(case.sinks)
    if case.rotary_dim:
        angle = 6.3 * torch.rand(case.capacity + 3, case.rotary_dim // 2, device=DEVICE,
                                 generator=gen)
        kwargs.update(rotary_cos=angle.cos().to(case.dtype),
                      rotary_sin=angle.sin().to(case.dtype), rotary_interleaved=case.interleaved)
    if case.leftpad:
        lengths = torch.tensor(case.lengths, device=DEVICE)
        kwargs["cache_leftpad"] = (torch.rand(B, device=DEVICE, generator=gen)
                                   * (lengths + 1)).floor().to(torch.int32)
    return (q, k_cache, v_cache, k, v), kwargs


APPEND_INDEX = ("cache_seqlens", "cache_batch_idx", "block_table", "rotary_cos", "rotary_sin",
                "rotary_interleaved")


def kwargs_ref(kwargs: dict) -> dict:
    return {n: a for n, a in kwargs.items() if n != "num_splits"}
