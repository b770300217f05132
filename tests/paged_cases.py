"""The paged prefill's calls (tests/test_paged_prefill.py, tests/test_gpu.py): a case of
packed sequences over paged key/value caches, its tensors, the keys gathered from the pages,
and the check of a call against the reference over them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

import flashop
from flashop.reference import attention_varlen_reference
from flashop.testing import accuracy
from helpers import DEVICE, poisoned_outputs


@dataclass(frozen=True)
class PagedCase:
    """Sequences of ``lens_q`` queries over their first ``lens_k`` keys in pages of ``page``
    keys (``max_blocks`` per sequence, in random physical order among ``spare`` more)."""

    lens_q: tuple
    lens_k: tuple
    H_kv: int
    G: int
    D: int
    DV: int
    dtype: torch.dtype
    page: int = 16
    max_blocks: int = 4
    spare: int = 1
    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[tuple] = None  # shape of the slopes: (H,) or (batch, H)
    sinks: Optional[torch.dtype] = None
    spikes: bool = False  # a few keys 30x the others' norm: scores of tens to 100+

    @property
    def H(self) -> int:
        return self.H_kv * self.G

    def options(self) -> dict:
        return dict(causal=self.causal, window_size=self.window_size, softcap=self.softcap)


def _cu(lens) -> torch.Tensor:
    return torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)


def make_paged(case: PagedCase, seed: int = 0):
    """(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    block_table) and the keyword modifiers."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=DEVICE, generator=gen)

    B = len(case.lens_k)
    blocks = B * case.max_blocks + case.spare
    k_cache = randn(blocks, case.page, case.H_kv, case.D)
    if case.spikes:
        rows = torch.randint(0, case.page, (blocks,), device=DEVICE, generator=gen)
        k_cache[torch.arange(blocks, device=DEVICE), rows] *= 30
    order = torch.randperm(blocks, device=DEVICE, generator=gen)[:B * case.max_blocks]
    mods = {}
    if case.alibi is not None:
        mods["alibi_slopes"] = torch.rand(case.alibi, device=DEVICE, generator=gen)
    if case.sinks is not None:
        mods["sinks"] = (3 + 2 * randn(case.H)).to(case.sinks)
    args = (randn(sum(case.lens_q), case.H, case.D).to(case.dtype), k_cache.to(case.dtype),
            randn(blocks, case.page, case.H_kv, case.DV).to(case.dtype), _cu(case.lens_q),
            _cu(case.lens_k), max(case.lens_q, default=0), max(case.lens_k, default=0),
            order.view(B, case.max_blocks).to(torch.int32))
    return args, mods


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor, lens_k) -> torch.Tensor:
    """The packed (total_k, H_kv, .) keys (or values) of each sequence's first lens_k[b]
    positions in its pages."""
    return torch.cat([cache[block_table[b].long()].flatten(0, 1)[:n]
                      for b, n in enumerate(lens_k)])


def check_paged(case: PagedCase, seed: int = 0):
    """flashop's out and lse (outputs poisoned) under the accuracy rule against the fp64
    reference and plain PyTorch over the gathered keys; the caches unchanged."""
    args, mods = make_paged(case, seed)
    q, k_cache, v_cache, cu_q, cu_k, _, _, table = args
    before = k_cache.clone(), v_cache.clone()
    k, v = gather_pages(k_cache, table, case.lens_k), gather_pages(v_cache, table, case.lens_k)
    ref, plain = (attention_varlen_reference(q, k, v, cu_q, cu_k, compute_dtype=dtype, **mods,
                                             **case.options())
                  for dtype in (torch.float64, None))
    with poisoned_outputs():
        out, lse = flashop.attention_varlen_with_lse(*args[:7], **mods, **case.options(),
                                                     block_table=table)
    assert out.shape == (q.shape[0], case.H, case.DV) and out.dtype == case.dtype
    assert lse.shape == (case.H, q.shape[0]) and lse.dtype == torch.float32
    for name, actual, r, p in (("out", out, ref[0], plain[0]), ("lse", lse, ref[1], plain[1])):
        result = accuracy(name, actual, r, p, 2, case.dtype)
        assert result.ok, str(result)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    return out, lse
