"""attention_with_kvcache over MLA's latent cache (576-dim rows whose first 512 dims are the
values, v_cache = k_cache[..., :512]): out and lse against the reference under the accuracy
rule, the whole cache after the append bit for bit (rows past each sequence's keys hold NaN,
which a read past them would carry into the output), dense and paged caches, splits, the
rows written once and read once, FlashMLA's functions (flashop.flash_mla) equal to the
direct call, the errors, opcheck and a compiled decode loop; GPU-only tests at real shapes
(bf16, H 16 and 128, CUDA graphs, Inductor)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional
from unittest import mock

import pytest
import torch
from torch.library import opcheck

import flashop
from flashop.flash_mla import flash_mla_with_kvcache, get_mla_metadata
from flashop.reference import attention_with_kvcache_reference, kvcache_append_reference
from flashop.testing import accuracy
from helpers import (
    CPU_PATH_TWIN, DEVICE, TestCase, assert_outputs_within_rule, bitwise_equal, cpu_path,
    cuda_graph, poisoned_outputs,
)

D, DV = 576, 512  # MLA's: 512 latent + 64 rotary dims; the values are the latent ones


@pytest.fixture(autouse=True)
def fresh_plans():
    """Each test plans its calls anew (an eager call's launches are planned once per
    signature), so that patched rules are seen."""
    from flashop._launch import mla as launch_mla
    launch_mla._plan.cache_clear()
    yield
    launch_mla._plan.cache_clear()


@dataclass(frozen=True)
class MlaCase:
    """B = len(lengths) sequences of S_q queries of H heads over a latent cache of H_kv heads
    (MLA: 1) holding ``lengths`` keys before the append of S_new; paged with pages of
    ``page`` keys (``capacity // page`` per sequence, in random physical order among
    ``spare`` extra pages), or dense with ``capacity`` positions per row (rows picked by
    ``batch_idx`` from B + spare; ``leftpad``: each sequence starts at a random row up to
    its length). ``new_values``: the v passed with the new keys, None or "view"
    (``k[..., :512]``, flash-attn-style code); ``own_values``: v_cache a tensor of its own
    (and v, where given, its own values)."""

    lengths: tuple
    S_q: int
    S_new: int
    H: int
    dtype: torch.dtype = torch.bfloat16
    H_kv: int = 1
    paged: bool = False
    page: int = 16
    capacity: int = 64
    spare: int = 1
    causal: bool = True
    scale: Optional[float] = None
    num_splits: int = 0
    batch_idx: bool = False
    leftpad: bool = False
    new_values: Optional[str] = None
    own_values: bool = False
    magnitude: float = 1.0  # q and k's standard deviation (large scores from 2)

    @property
    def B(self) -> int:
        return len(self.lengths)


def make_mla_call(case: MlaCase, seed: int = 0):
    """(q, k_cache, v_cache, k, v) and the keyword arguments of attention_with_kvcache. The
    cache's rows past each sequence's cached keys (and before its left padding, and in
    pages no sequence maps) hold NaN."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device=DEVICE, generator=gen)).to(case.dtype)

    B, nan = case.B, float("nan")
    q = randn(B, case.S_q, case.H, D, scale=case.magnitude)
    lengths = torch.tensor(case.lengths, dtype=torch.int32, device=DEVICE)
    kwargs = dict(cache_seqlens=lengths, causal=case.causal, scale=case.scale,
                  num_splits=case.num_splits)
    if case.paged:
        max_blocks = case.capacity // case.page
        blocks = B * max_blocks + case.spare
        k_cache = torch.full((blocks, case.page, case.H_kv, D), nan, device=DEVICE,
                             dtype=case.dtype)
        table = torch.randperm(blocks, device=DEVICE, generator=gen)[:B * max_blocks]
        table = kwargs["block_table"] = table.view(B, max_blocks).to(torch.int32)
        for b, n in enumerate(case.lengths):
            rows = k_cache[table[b]].flatten(0, 1)
            rows[:n] = randn(n, case.H_kv, D, scale=case.magnitude)
            k_cache[table[b]] = rows.view(max_blocks, case.page, case.H_kv, D)
    else:
        k_cache = torch.full((B + case.spare, case.capacity, case.H_kv, D), nan,
                             device=DEVICE, dtype=case.dtype)
        rows = torch.arange(B, device=DEVICE)
        if case.batch_idx:
            rows = torch.randperm(B + case.spare, device=DEVICE, generator=gen)[:B]
            kwargs["cache_batch_idx"] = rows.to(torch.int32)
        pads = [0] * B
        if case.leftpad:
            pads = [int(torch.randint(0, n + 1, (), generator=gen, device=DEVICE))
                    for n in case.lengths]
            kwargs["cache_leftpad"] = torch.tensor(pads, dtype=torch.int32, device=DEVICE)
        for b, n in enumerate(case.lengths):
            k_cache[rows[b], pads[b]:n] = randn(n - pads[b], case.H_kv, D,
                                                scale=case.magnitude)
    v_cache = k_cache[..., :DV]
    if case.own_values:
        v_cache = torch.where(k_cache[..., :DV].isnan(), nan, randn(*v_cache.shape))
    k = v = None
    if case.S_new:
        k = randn(B, case.S_new, case.H_kv, D, scale=case.magnitude)
        if case.new_values == "view":
            v = k[..., :DV]
        elif case.own_values and case.new_values == "own":
            v = randn(B, case.S_new, case.H_kv, DV)
    return (q, k_cache, v_cache, k, v), kwargs


def reference_kwargs(kwargs: dict) -> dict:
    return {n: a for n, a in kwargs.items() if n != "num_splits"}


def check_mla_case(case: MlaCase, seed: int = 0, call=None, run=None):
    """flashop's out and lse (outputs poisoned) under the accuracy rule against the fp64
    reference and plain PyTorch in the case's dtype (attention over the cache's rows and
    their first 512 dims); the whole cache after the call bit for bit against the expected
    append. ``run`` replaces flashop.attention_with_kvcache (a door)."""
    (q, k_cache, v_cache, k, v), kwargs = call or make_mla_call(case, seed)
    index = {n: kwargs[n] for n in ("cache_seqlens", "cache_batch_idx", "block_table")
             if n in kwargs}
    expected = kvcache_append_reference(k_cache, v_cache, k, v, **index)
    ref, plain = (attention_with_kvcache_reference(q, k_cache, v_cache, k, v,
                                                   **reference_kwargs(kwargs),
                                                   compute_dtype=dtype)
                  for dtype in (torch.float64, None))
    with poisoned_outputs():
        out, lse = (run or flashop.attention_with_kvcache)(q, k_cache, v_cache, k, v,
                                                           **kwargs, return_lse=True)
    assert out.dtype == case.dtype and out.shape == (case.B, case.S_q, case.H, DV)
    assert lse.dtype == torch.float32 and lse.shape == (case.B, case.H, case.S_q)
    assert_outputs_within_rule(out, lse, ref, plain, case.dtype)
    assert bitwise_equal(k_cache, expected[0]), "k_cache differs from the expected append"
    assert bitwise_equal(v_cache, expected[1]), "v_cache differs from the expected append"
    return out, lse


CASES = {
    "dense-1-query-1-head": MlaCase((5, 40), 1, 1, 1, capacity=48, num_splits=1),
    "dense-2-queries-3-heads-splits-large-scores": MlaCase(
        (17, 30), 2, 2, 3, torch.float16, capacity=48, scale=0.3, magnitude=2.0,
        num_splits=3),
    "paged-16-3-queries-v-view": MlaCase((14, 40), 3, 3, 2, paged=True, capacity=64,
                                         num_splits=2, new_values="view"),
    "paged-64-4-queries-auto-splits": MlaCase((60, 3), 4, 4, 2, paged=True, page=64,
                                              capacity=128, spare=2),
    "dense-batch-idx-leftpad-fp32": MlaCase((9, 30, 4), 2, 1, 2, torch.float32, capacity=40,
                                            num_splits=2, batch_idx=True, leftpad=True),
    "paged-not-causal-no-append": MlaCase((33, 1), 2, 0, 4, paged=True, capacity=48,
                                          causal=False, num_splits=2),
    "queries-past-the-keys": MlaCase((0, 1), 4, 2, 2, capacity=32, num_splits=2),
    "two-row-tiles": MlaCase((20, 37), 1, 1, 20, capacity=48, num_splits=2),
    "two-latent-heads": MlaCase((7, 26), 2, 1, 4, torch.float16, H_kv=2, capacity=32),
    "own-value-cache-paged": MlaCase((14, 33), 2, 2, 2, paged=True, capacity=48,
                                     num_splits=2, own_values=True, new_values="own"),
    "own-value-cache-values-from-k": MlaCase((3, 21), 1, 2, 2, torch.float16, capacity=32,
                                             own_values=True),
    "chunked-prefill": MlaCase((0, 9), 20, 20, 2, paged=True, capacity=64, num_splits=2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_latent_cache_matches_reference(name):
    check_mla_case(CASES[name])


@CPU_PATH_TWIN
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_path_latent_cache_matches_reference(name):
    """The CPU path on the same calls: the row appended once (the values are its leading
    columns), the attention over each sequence's rows."""
    with cpu_path():
        check_mla_case(CASES[name])


@pytest.mark.parametrize("page", [16, 32, 64, 128, 256])
def test_every_page_size(page):
    """Every page size the paged decode takes: lengths end mid-page (one one key short of
    a page) and the appends cross a page boundary; pages of 64 are FlashMLA's."""
    check_mla_case(MlaCase((page - 2, page - 1), 2, 3, 2, paged=True, page=page,
                           capacity=2 * page, num_splits=2))


@pytest.mark.parametrize("tiles,page,H", [((16, 32), 16, 8), ((32, 16, 4, 1, 0, True), 64, 8),
                                          ((64, 16, 8, 2), 64, 32)],
                         ids=["tiles-over-pages", "each-keys-page-id", "64-rows"])
def test_forced_tiles(tiles, page, H):
    """Tiles forced as the benchmark's sweep forces them (tiles.force("mla", ...)): keys of
    a tile in two pages (32 keys, pages of 16) and each key's page id loaded, both a GPU's
    ways at pages below its 64-key tiles; 32 rows a program; 64 rows (32 heads x 2
    queries: a GPU's tile from 64 rows, its products in regions, kernels/mla.py)."""
    from flashop._launch import tiles as tile_table
    from flashop._launch.decode_tiles import DecodeTiles
    with tile_table.force("mla", DecodeTiles(*tiles)):
        check_mla_case(MlaCase((page - 3, 2 * page + 5), 2, 2, H, paged=True, page=page,
                               capacity=4 * page, num_splits=3))


def _launched_statics(monkeypatch) -> dict:
    """Each planned launch's static arguments by its kernel's name (the append's, the
    attention's, the merge's), filled in by the calls that follow."""
    from flashop._launch import kvcache as launch_kvcache, mla as launch_mla
    statics, launch = {}, launch_kvcache.launch_planned

    def recorded(kernel, planned, **per_call):
        statics[getattr(kernel, "fn", kernel).__name__] = planned.static
        return launch(kernel, planned, **per_call)

    monkeypatch.setattr(launch_mla, "launch_planned", recorded)  # the append
    monkeypatch.setattr(launch_kvcache, "launch_planned", recorded)  # the attention's
    return statics


@pytest.mark.parametrize("case,tiles", [
    (MlaCase((5, 40), 2, 1, 4, capacity=48, num_splits=2), (16, 16, 4, 2)),
    (MlaCase((20, 45), 1, 2, 2, capacity=64, leftpad=True, batch_idx=True, spare=2),
     (16, 16, 4, 2)),
    (MlaCase((30, 50), 2, 2, 2, paged=True, page=16, capacity=64, num_splits=2),
     (16, 16, 4, 2)),
    (MlaCase((61, 133), 2, 2, 32, paged=True, page=64, capacity=256, num_splits=3),
     (64, 16, 8, 2))], ids=["dense", "dense-leftpad-batch-idx", "pages-of-16", "64-rows"])
def test_descriptors_forced(monkeypatch, case, tiles):
    """FLASHOP_TMA=1: the `tl` kernel's inner key tiles through tensor descriptors made in
    the kernel (by default only at 64 rows on Hopper): a dense cache's over each
    sequence's rows from its row of the cache and its left padding, a paged one's over
    [pages, page rows, dims] at the tile's page; the edge tiles by pointer loads. Lengths
    end mid-tile, the appends cross tiles, splits; tiles forced (16 keys, which lie in one
    page of 16; 64 rows), as a GPU's table would not pick them."""
    from flashop._launch import tiles as tile_table
    from flashop._launch.decode_tiles import DecodeTiles
    statics = _launched_statics(monkeypatch)
    with flashop.config.override(tma=True), tile_table.force("mla", DecodeTiles(*tiles)):
        check_mla_case(case)
    static = statics["mla_decode_kernel"]
    assert static["TMA"] is True and static["V_IN_K"] is True


def test_descriptor_rule(monkeypatch):
    """Where the `tl` kernel reads through descriptors: each call's setting (FLASHOP_TMA,
    by default a Hopper GPU, 16-bit caches, the values in the keys, k_cache's alignment, in
    the plan's key), then the plan's tiles (a dense cache or tiles within one page; by
    default 64 rows). A declined rule says why, and a call whose cache is not aligned plans
    pointer loads even where FLASHOP_TMA=1."""
    from flashop._launch import mla as launch_mla
    from flashop._launch.decode_tiles import DecodeTiles
    setting = launch_mla.descriptor_setting
    q, k_cache = torch.zeros(1, 1, 4, D, dtype=torch.bfloat16), torch.zeros(2, 64, 1, D,
                                                                           dtype=torch.bfloat16)
    v_cache = k_cache[..., :DV]
    shifted = torch.zeros(2 * 64 * D + 1, dtype=torch.bfloat16)[1:].view(2, 64, 1, D)
    # q on a GPU (what the rule reads of it: its device and dtype)
    gpu_q = mock.Mock(device=torch.device("cuda"), dtype=torch.bfloat16)
    monkeypatch.setattr(launch_mla, "is_hopper", lambda device: True)
    with flashop.config.override(tma=None):
        assert setting(gpu_q, k_cache, v_cache, True) is None
        for args, reason in [
                ((mock.Mock(device=torch.device("cuda"), dtype=torch.float32),
                  k_cache.float(), v_cache.float(), True), "16-bit caches only"),
                ((gpu_q, k_cache, torch.zeros_like(v_cache), False), "a value cache of its own"),
                ((gpu_q, shifted, shifted[..., :DV], True), "k_cache not 16-byte aligned")]:
            why = []
            assert setting(*args, why) is False and reason in why[0], why
    with flashop.config.override(tma=True):
        assert setting(q, k_cache, v_cache, True) is True
        assert setting(q, shifted, shifted[..., :DV], True) is False
    with flashop.config.override(tma=False):
        why = []
        assert setting(gpu_q, k_cache, v_cache, True, why) is False
        assert why == ["tensor descriptors: off (FLASHOP_TMA=0)"]
    with flashop.config.override(tma=None):  # by default off a Hopper GPU: no further checks
        for on_hopper, x in ((True, q), (False, gpu_q)):
            monkeypatch.setattr(launch_mla, "is_hopper", lambda device, h=on_hopper: h)
            why = []
            assert setting(x, k_cache, v_cache, True, why) is False
            assert why == ["tensor descriptors: by default on Hopper GPUs only"]

    uses = launch_mla.uses_descriptors
    rows64, rows16 = DecodeTiles(64, 64, 8, 2), DecodeTiles(16, 64, 4, 5)
    assert uses(None, rows64, False, False) and uses(None, rows64, True, True)
    assert uses(True, rows16, True, True) and not uses(False, rows64, False, False)
    for args, reason in [
            ((None, rows64, True, False), "not for tiles that cross pages"),
            ((True, rows16, True, False), "not for tiles that cross pages"),
            ((None, rows16, False, False), "from 64 query rows a program, not 16")]:
        why = []
        assert not uses(*args, why) and reason in why[0], (args, why)


def test_explain_tells_the_descriptors():
    """flashop.explain says whether the `tl` kernel reads through descriptors, and which
    rule declined them."""
    (q, k_cache, v_cache, k, v), kwargs = make_mla_call(MlaCase((5, 40), 1, 1, 4,
                                                                capacity=48))
    with flashop.config.override(gluon=False, tma=True):
        told = flashop.explain(flashop.attention_with_kvcache, q, k_cache, v_cache, k, v,
                               **kwargs)
        assert told.forward.options["tensor descriptors"] is True
        assert "tensor descriptors: True" in str(told)
    with flashop.config.override(gluon=False, tma=False):
        told = flashop.explain(flashop.attention_with_kvcache, q, k_cache, v_cache, k, v,
                               **kwargs)
        assert told.forward.options["tensor descriptors"] is False
        assert "tensor descriptors: off (FLASHOP_TMA=0)" in str(told)


@pytest.mark.parametrize("shared_memory", [227 * 1024, 163 * 1024, 99 * 1024])
def test_tile_rule_fits_every_shared_memory(monkeypatch, shared_memory):
    """mla_tiles as on a GPU: 64-key tiles for up to 16 rows over a dense cache (3 stages)
    or pages of a multiple of 64 (5 stages: a paged tile's keys get half the pipeliner's
    buffers), and 64 rows in 2 stages, where their query tile and key buffers fit
    (held_bytes: an H200's 227 KiB, not an A100's 163); else 32-key tiles, and 64 rows in
    one stage; every choice within the shared memory less MARGIN where it fits at all."""
    from flashop._launch import mla as launch_mla
    from flashop._launch.decode_tiles import DecodeTiles
    monkeypatch.setattr(launch_mla, "INTERPRETING", False)
    rule, held = launch_mla.mla_tiles, launch_mla.held_bytes
    bf16, hopper = torch.bfloat16, shared_memory == 227 * 1024
    for rows, page, on_hopper, elsewhere in (
            (16, 0, (16, 64, 4, 3), (16, 32, 4, 2)), (16, 64, (16, 64, 4, 5), (16, 32, 4, 2)),
            (8, 256, (16, 64, 4, 5), (16, 32, 4, 2)), (16, 16, (16, 32, 4, 2), (16, 32, 4, 2)),
            (32, 0, (32, 32, 4, 2), (32, 32, 4, 2)), (32, 64, (32, 32, 4, 2), (32, 32, 4, 2)),
            (128, 64, (64, 64, 8, 2), (64, 64, 8, 1)), (64, 0, (64, 64, 8, 2), (64, 64, 8, 1))):
        t = rule(rows, bf16, page, shared_memory)
        assert t == DecodeTiles(*(on_hopper if hopper else elsewhere)), (rows, page, t)
        if shared_memory >= 163 * 1024:  # (a consumer GPU's 99 KiB: fit_shared_memory's)
            assert held(t, 576, 2, page > 0) <= shared_memory - launch_mla.MARGIN, (rows, t)
    # key tiles held, as compiled for sm_90 (triton 3.6.0 and 3.9.0): num_stages - 1 ahead
    # dense, half that paged, at least one; one more for 64 rows (wgmma) where pipelined
    tiles = [((16, 64, 4, 3), False, 2), ((16, 64, 4, 5), True, 2), ((16, 64, 4, 3), True, 1),
             ((16, 64, 4, 2), True, 1), ((16, 32, 4, 1), False, 1), ((64, 64, 8, 2), False, 2),
             ((64, 64, 8, 2), True, 2), ((64, 64, 8, 1), True, 1), ((64, 32, 8, 5), True, 3),
             ((64, 32, 8, 4), False, 4)]
    for t, paged, buffers in tiles:
        assert held(DecodeTiles(*t), 576, 2, paged) == 2 * 576 * (t[0] + buffers * t[1]), t
    assert rule(16, torch.float32, 64, shared_memory) == DecodeTiles(16, 16, 4, 2)
    # a value cache of its own (512 dims) staged beside the keys where pipelined (a key
    # tile's buffer unpipelined): 32-key tiles for 16 rows, one stage for 64
    for t, paged, values in (((16, 64, 4, 3), False, 2 * 64), ((16, 64, 4, 5), True, 2 * 64),
                             ((16, 32, 4, 2), False, 32), ((64, 64, 8, 1), True, 0)):
        assert held(DecodeTiles(*t), 576, 2, paged, 512) == \
            held(DecodeTiles(*t), 576, 2, paged) + 2 * 512 * values, t
    if hopper:
        assert rule(16, bf16, 0, shared_memory, 512) == DecodeTiles(16, 32, 4, 2)
        assert rule(16, bf16, 64, shared_memory, 512) == DecodeTiles(16, 32, 4, 2)
        assert rule(64, bf16, 64, shared_memory, 512) == DecodeTiles(64, 64, 8, 1)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_empty_sequences_give_zero_and_minus_infinity(num_splits):
    """Sequences with no key (empty cache, nothing appended) get out 0 and lse -inf, beside
    one that has keys; splits past a sequence's keys merge cleanly."""
    case = MlaCase((0, 37, 0), 2, 0, 2, paged=True, capacity=48, num_splits=num_splits)
    out, lse = check_mla_case(case)
    assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]]))
    assert torch.isneginf(lse[[0, 2]]).all() and torch.isfinite(lse[1]).all()


def test_lengths_out_of_range_attend_no_key():
    """docs/decoding.md's unchecked values: a negative length (its appended position below
    0 is not written) and a left pad past the sequence's keys attend no key: out 0, lse
    -inf; the rest of the cache is unchanged."""
    case = MlaCase((3, 5), 2, 1, 2, capacity=16, leftpad=True)
    (q, k_cache, v_cache, k, _), kwargs = make_mla_call(case)
    kwargs.update(cache_seqlens=torch.tensor([-3, 5], dtype=torch.int32, device=DEVICE),
                  cache_leftpad=torch.tensor([0, 9], dtype=torch.int32, device=DEVICE))
    expected = kvcache_append_reference(k_cache, v_cache, k, None,
                                        cache_seqlens=kwargs["cache_seqlens"])
    with poisoned_outputs():
        out, lse = flashop.attention_with_kvcache(q, k_cache, v_cache, k, **kwargs,
                                                  return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    assert bitwise_equal(k_cache, expected[0])


@pytest.mark.parametrize("own_values", [False, True])
def test_rows_written_once_and_read_once(monkeypatch, own_values):
    """With v_cache = k_cache[..., :512] the append writes each new row once, all 576 dims
    (no value columns of its own), and the attention takes the values from the key tile
    (V_IN_K); a v_cache of its own is appended to and read."""
    static = _launched_statics(monkeypatch)
    check_mla_case(MlaCase((3, 9), 1, 1, 2, paged=True, capacity=32, own_values=own_values,
                           new_values="view" if not own_values else None))
    assert static["kvcache_append_kernel"]["DV"] == (DV if own_values else 0)
    assert static["kvcache_append_kernel"]["D"] == D
    assert static["mla_decode_kernel"]["V_IN_K"] is (not own_values)


def test_the_views_layout_is_part_of_the_checked_signature():
    """A v_cache of its own with the strides of k_cache[..., :512] (a view into another
    576-wide tensor) has the view's signature (shapes, strides, dtype): the call after one
    over the view reads its own values, not the keys' (checked and planned anew)."""
    case = MlaCase((5, 12), 1, 1, 2, capacity=16, new_values="view")
    check_mla_case(case)
    (q, k_cache, _, k, _), kwargs = make_mla_call(case, seed=1)
    other = torch.randn(k_cache.shape, device=DEVICE).to(case.dtype)
    other[k_cache.isnan()] = float("nan")
    v_cache = other[..., :DV]  # the view's strides, another tensor's memory
    check_mla_case(case, call=((q, k_cache, v_cache, k, k[..., :DV].clone()), kwargs))


def test_a_bad_view_after_a_good_call_of_its_signature_raises():
    """k_cache[..., 64:] has the shapes and strides of k_cache[..., :512]: after a call over
    the good view the checks of that signature are skipped, but not for the bad one."""
    (q, k_cache, _, _, _), kwargs = make_mla_call(MlaCase((3, 5), 1, 0, 2))
    for _ in range(2):
        flashop.attention_with_kvcache(q, k_cache, k_cache[..., :DV], **kwargs)
        with pytest.raises(ValueError, match="v_cache shares k_cache's memory but is not"):
            flashop.attention_with_kvcache(q, k_cache, k_cache[..., 64:], **kwargs)


def test_decode_loop_matches_reference_step_by_step():
    """A paged decode loop appending one latent row at a time (the caller advances the
    lengths) equals the reference at every step, with MTP's two queries."""
    case = MlaCase((3, 0), 2, 2, 2, paged=True, capacity=32)
    (q, k_cache, v_cache, k, _), kwargs = make_mla_call(case)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for _ in range(6):
        q, k = (torch.randn(x.shape, device=DEVICE, generator=gen).to(x.dtype) for x in (q, k))
        check_mla_case(case, call=((q, k_cache, v_cache, k, None), kwargs))
        kwargs["cache_seqlens"] += 2


def test_the_docs_worked_example_runs():
    """docs/decoding.md's MLA example, pasted as it is, at smaller sizes on the test device;
    a further step of its loop against the reference."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "decoding.md").read_text()
    section = text[text.index("## MLA: a latent cache"):]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    small = (code.replace('device="cuda"', f'device="{DEVICE}"')
             .replace("= 8, 16, 64, 4096", "= 2, 4, 64, 128")
             .replace("tokens(100)", "tokens(20)").replace("range(10)", "range(2)"))
    assert small.count(DEVICE) >= 4 and "tokens(20)" in small
    env = {}
    exec(compile(small, "docs/decoding.md (MLA)", "exec"), env)
    assert env["lengths"].tolist() == [24, 24] and env["out"].shape == (2, 2, 4, DV)
    q, kv = env["tokens"](2)
    cache, table, lengths = env["kv_cache"], env["block_table"], env["lengths"].clone()
    ref, plain = (attention_with_kvcache_reference(
        q, cache, cache[..., :DV], kv, cache_seqlens=lengths, block_table=table,
        scale=env["scale"], causal=True, compute_dtype=dtype) for dtype in (torch.float64, None))
    result = accuracy("out", env["step"](q, kv), ref[0], plain[0], 2, torch.bfloat16)
    assert result.ok, str(result)


def test_flop_count_and_autocast():
    """FlopCounterMode counts FlashMLA's 2 * S_q * H * L * (576 + 512) per sequence; under
    bf16 autocast fp32 queries and rows append to a bf16 latent cache, and a read-only fp32
    cache is read cast (a copy of k_cache and one of its view: values of their own), with
    the same output."""
    from torch.utils.flop_counter import FlopCounterMode

    case = MlaCase((3, 30), 2, 2, 4, capacity=48)
    (q, k_cache, _, k, _), kwargs = make_mla_call(case)
    k_cache.nan_to_num_()
    with FlopCounterMode(display=False) as counter:
        flashop.attention_with_kvcache(q, k_cache.clone(), k_cache[..., :DV], k, **kwargs)
    assert counter.get_total_flops() == sum(2 * 2 * 4 * (n + 2) * (D + DV) for n in (3, 30))
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = flashop.attention_with_kvcache(q.float(), k_cache, k_cache[..., :DV],
                                             k.float(), **kwargs)
        wide = k_cache.float()
        kwargs["cache_seqlens"] = kwargs["cache_seqlens"] + 2
        again = flashop.attention_with_kvcache(q.float(), wide, wide[..., :DV], **kwargs)
    assert out.dtype == again.dtype == torch.bfloat16 and bitwise_equal(out, again)


# --- FlashMLA's functions --------------------------------------------------------------------


def test_flash_mla_with_kvcache_equals_the_direct_call():
    """flashop.flash_mla's functions give attention_with_kvcache's out and lse bit for bit
    (pages of 64, two queries causal, an explicit scale), within the accuracy rule."""
    case = MlaCase((70, 5), 2, 0, 4, paged=True, page=64, capacity=128, scale=0.05)
    (q, k_cache, v_cache, _, _), kwargs = make_mla_call(case)
    table, seqlens = kwargs["block_table"], kwargs["cache_seqlens"]
    metadata, splits = get_mla_metadata(seqlens, case.S_q * case.H, 1)
    assert metadata.dtype == splits.dtype == torch.int32 and metadata.device == q.device
    assert metadata.dim() == 2 and metadata.shape[1] == 8 and splits.shape == (case.B + 1,)

    def door(q, k_cache, v_cache, k, v, *, cache_seqlens, block_table, scale, causal,
             **options):
        return flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, DV, metadata,
                                      splits, softmax_scale=scale, causal=causal)

    out, lse = check_mla_case(case, call=((q, k_cache, v_cache, None, None), kwargs),
                              run=door)
    direct = flashop.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                            block_table=table, scale=0.05, causal=True,
                                            return_lse=True)
    assert bitwise_equal(out, direct[0]) and bitwise_equal(lse, direct[1])
    # FlashMLA's first releases' keyword; its latest metadata object and num_splits=None
    old = get_mla_metadata(seqlens, num_heads_per_head_k=case.S_q * case.H, num_heads_k=1)
    assert all(torch.equal(a, b) for a, b in zip(old, (metadata, splits)))
    latest = flash_mla_with_kvcache(q, k_cache, table, seqlens, DV, object(), None,
                                    softmax_scale=0.05, causal=True)
    assert bitwise_equal(latest[0], out) and bitwise_equal(latest[1], lse)


class TestFlashMlaErrors(TestCase):
    def message(self, fn, *args, **kwargs):
        with self.assertRaises(ValueError) as ctx:
            fn(*args, **kwargs)
        return str(ctx.exception)

    def test_unsupported_options(self):
        (q, k_cache, _, _, _), kwargs = make_mla_call(MlaCase((5,), 1, 0, 2, paged=True))
        args = (q, k_cache, kwargs["block_table"], kwargs["cache_seqlens"], DV, None, None)
        self.assertExpectedInline(self.message(flash_mla_with_kvcache, *args,
                                               is_fp8_kvcache=True), """flashop.flash_mla: is_fp8_kvcache=True is not supported (flashop takes FlashMLA's dense decoding of 16-bit caches); decode over the paged cache with block_table and cache_seqlens""")  # noqa: B950
        self.assertExpectedInline(self.message(flash_mla_with_kvcache, *args,
                                               indices=kwargs["block_table"]), """flashop.flash_mla: indices (sparse attention) is not supported (flashop takes FlashMLA's dense decoding of 16-bit caches); decode over the paged cache with block_table and cache_seqlens""")  # noqa: B950
        self.assertExpectedInline(self.message(flash_mla_with_kvcache, q, k_cache, None,
                                               kwargs["cache_seqlens"], DV), """flashop.flash_mla.flash_mla_with_kvcache: dense decoding takes a block_table and cache_seqlens (FlashMLA's paged cache), got block_table None and cache_seqlens given""")  # noqa: B950
        self.assertExpectedInline(self.message(get_mla_metadata, kwargs["cache_seqlens"], 2,
                                               1, topk=64), """flashop.flash_mla: topk (sparse attention) is not supported (flashop takes FlashMLA's dense decoding of 16-bit caches); pass is_fp8_kvcache=False and topk=None""")  # noqa: B950


# --- the operator ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", [
    MlaCase((5, 12), 2, 1, 2, torch.float16, paged=True, capacity=32, num_splits=2),
    MlaCase((3, 9), 1, 1, 2, torch.float32, capacity=16, num_splits=1, new_values="view")],
    ids=["paged", "dense-v-view"])
def test_opcheck(case):
    """The operator over a latent cache (v_cache a view of k_cache, both declared written):
    schema, fake and autograd registration, and its tracing."""
    (q, k_cache, v_cache, k, v), kwargs = make_mla_call(case)
    k_cache.nan_to_num_()  # (opcheck compares the caches, NaN unequal to NaN)
    args = (q, k_cache, v_cache, kwargs.pop("cache_seqlens"), k, v, None,
            kwargs.pop("block_table", None))
    opcheck(torch.ops.flashop.attention_with_kvcache.default, args, kwargs)


@pytest.mark.compile
@pytest.mark.parametrize("paged", [False, True])
def test_compiled_decode_loop_compiles_once(paged):
    """A decode step (the view taken inside, v None) under torch.compile(fullgraph=True,
    dynamic=True) over growing lengths: one compilation, the eager call's outputs and
    caches."""
    from torch._dynamo.testing import CompileCounterWithBackend

    case = MlaCase((4, 9), 2, 2, 2, torch.float16, paged=paged, capacity=32)
    (q, k_cache, _, k, _), kwargs = make_mla_call(case)
    k_cache = torch.nan_to_num(k_cache)
    seqlens = kwargs.pop("cache_seqlens")
    table = kwargs.get("block_table")

    def step(q, k_cache, k, seqlens):
        out = flashop.attention_with_kvcache(q, k_cache, k_cache[..., :DV], k,
                                             cache_seqlens=seqlens, block_table=table,
                                             causal=True)
        seqlens.add_(2)
        return out * 2

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=counter)
    cache, lengths = k_cache.clone(), seqlens.clone()
    frames = []
    for i in range(3):
        q, k = q + i, k - i
        out = compiled(q, cache, k, lengths)
        frames.append(counter.frame_count)
        expected = step(q, k_cache, k, seqlens)
        torch.testing.assert_close(out, expected)
        assert torch.equal(cache, k_cache) and torch.equal(lengths, seqlens)
    assert frames == frames[:1] * 3, f"recompiled: frames compiled after each step {frames}"
    graphs = [g for g in counter.graphs if len(g.graph.nodes) > 0]
    assert len(graphs) == 1


# --- bad input ------------------------------------------------------------------------------


class TestLatentCacheErrors(TestCase):
    def message(self, **changes):
        (q, k_cache, v_cache, k, v), kwargs = make_mla_call(MlaCase((3, 5), 1, 1, 2,
                                                                    torch.float16))
        args = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, **kwargs)
        args.update({n: c(args) if callable(c) else c for n, c in changes.items()})
        with self.assertRaises(ValueError) as ctx:
            flashop.attention_with_kvcache(**args)
        return str(ctx.exception)

    def test_v_cache_not_the_leading_columns(self):
        self.assertExpectedInline(self.message(v_cache=lambda a: a["k_cache"][..., 64:]), """flashop.attention_with_kvcache: v_cache shares k_cache's memory but is not its leading columns k_cache[..., :512] (v_cache torch.float16 (3, 64, 1, 512) with strides (36864, 576, 576, 1) at storage offset 64, k_cache torch.float16 (3, 64, 1, 576) with strides (36864, 576, 576, 1) at storage offset 0); for values stored in the keys' rows (MLA's latent cache) pass v_cache = k_cache[..., :head_dim_v], else a v_cache of its own""")  # noqa: B950

    def test_v_cache_of_another_stride(self):
        self.assertExpectedInline(self.message(v_cache=lambda a: a["k_cache"][:, ::2, :, :DV]), """flashop.attention_with_kvcache: v_cache shares k_cache's memory but is not its leading columns k_cache[..., :512] (v_cache torch.float16 (3, 32, 1, 512) with strides (36864, 1152, 576, 1) at storage offset 0, k_cache torch.float16 (3, 64, 1, 576) with strides (36864, 576, 576, 1) at storage offset 0); for values stored in the keys' rows (MLA's latent cache) pass v_cache = k_cache[..., :head_dim_v], else a v_cache of its own""")  # noqa: B950

    def test_v_cache_of_another_dtype(self):
        self.assertExpectedInline(self.message(v_cache=lambda a: a["k_cache"].view(torch.bfloat16)[..., :DV]), """flashop.attention_with_kvcache: v_cache shares k_cache's memory but is not its leading columns k_cache[..., :512] (v_cache torch.bfloat16 (3, 64, 1, 512) with strides (36864, 576, 576, 1) at storage offset 0, k_cache torch.float16 (3, 64, 1, 576) with strides (36864, 576, 576, 1) at storage offset 0); for values stored in the keys' rows (MLA's latent cache) pass v_cache = k_cache[..., :head_dim_v], else a v_cache of its own""")  # noqa: B950

    def test_new_values_not_the_keys_leading_columns(self):
        self.assertExpectedInline(self.message(v=lambda a: a["k"][..., :DV].clone()), """flashop.attention_with_kvcache: v_cache is k_cache[..., :512] (the values are the keys' leading columns, written once with them), so the new values must be k[..., :512] or None, got v (2, 1, 1, 512) in its own memory; pass v=None""")  # noqa: B950
        self.assertExpectedInline(self.message(v=lambda a: a["k"][..., 64:]), """flashop.attention_with_kvcache: v_cache is k_cache[..., :512] (the values are the keys' leading columns, written once with them), so the new values must be k[..., :512] or None, got v (2, 1, 1, 512) in k's memory elsewhere; pass v=None""")  # noqa: B950

    def test_head_dims(self):
        self.assertExpectedInline(self.message(k=None, v_cache=lambda a: torch.zeros_like(a["k_cache"][..., :256])), """flashop.attention_with_kvcache: head dims from 1 to 256 are supported, and 576 with 512 for v (MLA's latent cache, v_cache = k_cache[..., :512]), got 576 for q and k and 256 for v (q (2, 1, 2, 576), k_cache (3, 64, 1, 576), v_cache (3, 64, 1, 256))""")  # noqa: B950

    def test_options_refused_by_name(self):
        t = torch.zeros(2, device=DEVICE)
        self.assertExpectedInline(self.message(window_size=(8, 0)), """flashop.attention_with_kvcache: window_size=(8, 0) is not supported over MLA's latent cache (head dim 576, v_cache = k_cache[..., :512]); attend the whole cache (window_size=(-1, -1))""")  # noqa: B950
        self.assertExpectedInline(self.message(attention_chunk=64), """flashop.attention_with_kvcache: attention_chunk=64 is not supported over MLA's latent cache (head dim 576, v_cache = k_cache[..., :512]); attend the whole cache (attention_chunk=0)""")  # noqa: B950
        self.assertExpectedInline(self.message(softcap=30.0), """flashop.attention_with_kvcache: softcap=30.0 is not supported over MLA's latent cache (head dim 576, v_cache = k_cache[..., :512]); pass softcap=0.0""")  # noqa: B950
        self.assertExpectedInline(self.message(alibi_slopes=t), """flashop.attention_with_kvcache: alibi_slopes is not supported over MLA's latent cache (head dim 576, v_cache = k_cache[..., :512]); pass alibi_slopes=None""")  # noqa: B950
        self.assertExpectedInline(self.message(sinks=t), """flashop.attention_with_kvcache: sinks is not supported over MLA's latent cache (head dim 576, v_cache = k_cache[..., :512]); pass sinks=None""")  # noqa: B950
        rotary = torch.zeros(64, 32, device=DEVICE, dtype=torch.float16)
        self.assertExpectedInline(self.message(rotary_cos=rotary, rotary_sin=rotary), """flashop.attention_with_kvcache: rotary_cos/rotary_sin is not supported over MLA's latent cache (head dim 576, v_cache = k_cache[..., :512]); MLA rotates its last 64 dims (q_pe, k_pe), not the first ones: rotate them before the call""")  # noqa: B950

    def test_fp8_cache(self):
        def fp8(a):
            a["k_cache"] = a["k_cache"].to(torch.float8_e4m3fn)
            return a["k_cache"][..., :DV]

        self.assertExpectedInline(self.message(k=None, v_cache=fp8), """flashop.attention_with_kvcache: an fp8 cache (torch.float8_e4m3fn) or descales is not supported over MLA's latent cache (head dim 576, v_cache = k_cache[..., :512]); keep the latent cache in bfloat16 or float16""")  # noqa: B950


# --- GPU only -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("S_q", [1, 2])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
@pytest.mark.parametrize("gluon", [None, False], ids=["default", "tl"])
def test_gpu_bf16_real_shapes(H, S_q, paged, num_splits, gluon):
    """bf16 on the GPU's tiles: DeepSeek-V3's heads (16 per GPU at tensor parallelism 8,
    and 128), decode and MTP's two queries, caches from empty to full (4096 keys), pages
    of 64, auto and forced splits; by default (128 heads: the Gluon kernel where it runs)
    and with the `tl` kernel forced."""
    with flashop.config.override(gluon=gluon):
        check_mla_case(MlaCase((0, 1000, 4093 - S_q, 4096 - S_q), S_q, S_q, H, paged=paged,
                               page=64, capacity=4096, num_splits=num_splits,
                               scale=0.1352, new_values="view"))


def _mla_step(case: MlaCase):
    """A decode step on fixed tensors: its inputs (written in place between calls), the
    cache, and a function returning (out, lse)."""
    (q, k_cache, v_cache, k, _), kwargs = make_mla_call(case)
    k_cache.nan_to_num_()  # the steps below jump past rows they never write
    seqlens = kwargs.pop("cache_seqlens")

    def step():
        return flashop.attention_with_kvcache(q, k_cache, v_cache, k, cache_seqlens=seqlens,
                                              **kwargs, return_lse=True)
    return (q, k, seqlens), k_cache, step


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("H,S_q", [(16, 1), (128, 2)])
def test_gpu_cuda_graph_replays_equal_eager(paged, H, S_q):
    """One CUDA graph of an MLA decode step (append and attention), replayed with new
    queries, rows and growing lengths written into its inputs, gives eager's outputs and
    cache bit for bit."""
    case = MlaCase((5, 300, 0), S_q, S_q, H, paged=paged, page=64, capacity=1024)
    inputs, cache, step = _mla_step(case)
    eager_inputs, eager_cache, eager_step = _mla_step(case)
    graph, captured = cuda_graph(step)
    eager_cache.copy_(cache)  # (after the warm-up's append)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for i in range(1, 20):
        for x, y in zip(inputs[:2], eager_inputs[:2]):
            x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
            y.copy_(x)
        inputs[2].copy_(torch.tensor([5 + 2 * i, 300 + 17 * i, 2 * i], dtype=torch.int32))
        eager_inputs[2].copy_(inputs[2])
        graph.replay()
        expected = eager_step()
        torch.cuda.synchronize()
        assert all(bitwise_equal(a, b) for a, b in zip(captured, expected))
        assert bitwise_equal(cache, eager_cache)


def _compiled_call_equals_eager(paged: bool):
    """A 128-head MTP step (two queries appended and attended, four splits) compiled with
    fullgraph=True: its out, lse and cache bit for bit against eager's. Returns Inductor's
    code and (q, the eager call's cache, its keyword arguments)."""
    from torch._inductor.utils import run_and_get_code

    case = MlaCase((100, 2000), 2, 2, 128, paged=paged, page=64, capacity=4096,
                   num_splits=4, scale=0.1352)
    (q, k_cache, _, k, _), kwargs = make_mla_call(case)
    cache = k_cache.clone()
    expected = flashop.attention_with_kvcache(q, k_cache, k_cache[..., :DV], k, **kwargs,
                                              return_lse=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, c, k: flashop.attention_with_kvcache(
        q, c, c[..., :DV], k, **kwargs, return_lse=True), fullgraph=True)
    result, code = run_and_get_code(lambda: compiled(q, cache, k))
    assert all(bitwise_equal(a, b) for a, b in zip(result, expected))
    assert bitwise_equal(cache, k_cache)
    return "\n".join(code), (q, k_cache, kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_inductor_launches_the_latent_kernels(paged):
    """Under torch.compile(fullgraph=True) Inductor's code launches the append, `tl` latent
    and merge kernels itself, with eager's out, lse and cache bit for bit; FlashMLA's door
    compiles alike. (The Gluon kernel, which takes these 128 heads on triton 3.6, is off
    here: a graph reaches it through an opaque operator,
    test_gpu_gluon_kernel_in_compiled_graphs_and_cuda_graphs.)"""
    with flashop.config.override(gluon=False):
        code, (q, k_cache, kwargs) = _compiled_call_equals_eager(paged)
        for kernel in ("kvcache_append_kernel", "mla_decode_kernel",
                       "attention_decode_merge_kernel"):
            assert kernel in code, f"{kernel} not in Inductor's code"
        if paged:
            door = torch.compile(flash_mla_with_kvcache, fullgraph=True)
            args = (q, k_cache, kwargs["block_table"], kwargs["cache_seqlens"] + 2, DV, None,
                    None)
            out = door(*args, softmax_scale=0.1352, causal=True)
            direct = flash_mla_with_kvcache(*args, softmax_scale=0.1352, causal=True)
            assert all(bitwise_equal(a, b) for a, b in zip(out, direct))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("options", [dict(backend="aot_eager"), dict(mode="reduce-overhead")],
                         ids=["aot-eager", "reduce-overhead"])
def test_gpu_compiled_decode_steps_equal_eager(options):
    """Decode steps compiled without Inductor's reinplacing (aot_eager: the append's
    functional form, whose one written tensor is k_cache) and into CUDA graphs
    (mode="reduce-overhead"), over growing lengths: eager's out, lse and cache bit for
    bit at every step."""
    case = MlaCase((100, 2000, 7), 2, 2, 16, paged=True, page=64, capacity=4096,
                   scale=0.1352)
    (q, k_cache, _, k, _), kwargs = make_mla_call(case)
    k_cache.nan_to_num_()
    seqlens = kwargs.pop("cache_seqlens")

    def step(q, cache, k, lengths):
        out = flashop.attention_with_kvcache(q, cache, cache[..., :DV], k,
                                             cache_seqlens=lengths, **kwargs, return_lse=True)
        lengths.add_(2)
        return out

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, **options)
    cache, lengths = k_cache.clone(), seqlens.clone()
    for i in range(4):
        q, k = q.roll(1, 2), k * -1
        result = compiled(q, cache, k, lengths)
        expected = step(q, k_cache, k, seqlens)
        assert all(bitwise_equal(a, b) for a, b in zip(result, expected)), i
        assert bitwise_equal(cache, k_cache) and torch.equal(lengths, seqlens), i


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
def test_gpu_a_compile_under_other_tiles_plans_its_own_launches():
    """A call compiled with the table's tiles, then (torch._dynamo.reset()) compiled again
    under a forced tile whose decode splits differ: the second compile launches its own plan
    (torch's AOTAutograd cache, keyed by the Dynamo graph, must not serve the first's), so
    it equals the eager call under that tile bit for bit. Both compiles use one fresh cache
    directory, so that what earlier runs stored cannot answer either."""
    from torch._inductor import utils as inductor_utils

    from flashop._launch import tiles as tile_table
    from flashop._launch.decode_tiles import DecodeTiles
    from flashop._launch.mla import attention_with_latent_cache
    from flashop._launch.options import modifiers

    fresh_cache = getattr(inductor_utils, "fresh_cache", None) or \
        inductor_utils.fresh_inductor_cache  # torch<=2.8's name
    case = MlaCase((100, 2000), 2, 0, 128, capacity=4096, scale=0.1352)
    (q, k_cache, _, _, _), kwargs = make_mla_call(case)

    def call(q, c):
        return flashop.attention_with_kvcache(q, c, c[..., :DV], **kwargs, return_lse=True)

    def splits():
        plan = attention_with_latent_cache(
            q, k_cache, k_cache[..., :DV], None, None, kwargs["cache_seqlens"], None, None,
            0.1352, modifiers(causal=True), 0, plan_only=True)
        return plan.decode.grid[0]

    with fresh_cache():
        torch._dynamo.reset()
        torch.compile(call, fullgraph=True)(q, k_cache)
        table_splits = splits()
        with tile_table.force("mla", DecodeTiles(64, 64, 8, 1)):
            assert splits() != table_splits  # (else the test could not tell the plans apart)
            torch._dynamo.reset()
            out = torch.compile(call, fullgraph=True)(q, k_cache)
            expected = call(q, k_cache)
    assert all(bitwise_equal(a, b) for a, b in zip(out, expected))


# --- the Gluon kernel (triton 3.6, Hopper) --------------------------------------------------


def test_gluon_kernel_rule_and_plan(monkeypatch):
    """The Gluon kernel's rule and plan on any machine (its kernel runs on Hopper only), the
    kernels taken as available: a call it takes plans its grid (splits, S_q * H / 64, B)
    and the merge, and explain names it; each call it declines names its reason and plans
    the `tl` kernel."""
    from flashop._launch import gluon, mla as launch_mla
    from flashop._launch.options import modifiers

    monkeypatch.setattr(gluon, "unavailable", lambda device: None)
    monkeypatch.setattr(flashop.config.settings, "gluon", None)  # (whatever FLASHOP_GLUON says)

    def planned(case):
        (q, k_cache, v_cache, k, v), kwargs = make_mla_call(case)
        explanation = flashop.explain(flashop.attention_with_kvcache, q, k_cache, v_cache,
                                      k, v, **kwargs)
        plan = launch_mla.attention_with_latent_cache(
            q, k_cache, v_cache, k, v, kwargs["cache_seqlens"],
            kwargs.get("cache_batch_idx"), kwargs.get("block_table"), None,
            modifiers(causal=case.causal), case.num_splits, kwargs.get("cache_leftpad"),
            values_in_keys=not case.own_values, plan_only=True)
        return str(explanation), plan

    text, plan = planned(MlaCase((10, 100), 2, 2, 128, paged=True, page=128, capacity=256,
                                 num_splits=3, new_values="view"))
    assert plan.kernel == "mla_decode_gluon_kernel" and "mla_decode_gluon_kernel" in text
    assert plan.decode.grid == (3, 2 * 128 // 64, 2) and plan.merge is not None
    assert plan.append is not None and plan.decode.static["PAGE_SIZE"] == 128
    text, plan = planned(MlaCase((10, 100), 2, 2, 32, capacity=128, num_splits=2))
    assert plan.kernel == "mla_decode_gluon_kernel" and plan.decode.grid == (2, 1, 2)
    for case, reason in [
            (MlaCase((10, 100), 1, 1, 96, capacity=128), "a multiple of 64 query heads"),
            (MlaCase((10, 100), 1, 1, 32, capacity=128), "not 1 and 32 x 1"),
            (MlaCase((10, 100), 1, 1, 64, paged=True, page=32, capacity=128),
             "pages of a multiple of 64 keys, not 32"),
            (MlaCase((10, 100), 1, 1, 64, capacity=128, leftpad=True), "no cache_leftpad"),
            (MlaCase((10, 100), 1, 1, 64, torch.float32, capacity=128),
             "float16 or bfloat16 inputs only"),
            (MlaCase((10, 100), 1, 1, 64, capacity=128, own_values=True), "first 512 dims")]:
        text, plan = planned(case)
        assert plan.kernel == "mla_decode_kernel", case
        assert reason in text, (reason, text)
    with flashop.config.override(gluon=False):
        text, plan = planned(MlaCase((10, 100), 1, 1, 64, capacity=128))
        assert plan.kernel == "mla_decode_kernel" and "FLASHOP_GLUON=0" in text


def _gluon_available() -> bool:
    from flashop._launch import gluon
    return DEVICE == "cuda" and gluon.available(torch.device("cuda"))


def _explained(case: MlaCase):
    """flashop.explain's account of a case's call."""
    (q, k_cache, v_cache, k, v), kwargs = make_mla_call(case)
    return flashop.explain(flashop.attention_with_kvcache, q, k_cache, v_cache, k, v,
                           **kwargs)


def _kernel_of(case: MlaCase, explanation=None) -> str:
    """The attention kernel a case's call plans (flashop.explain's, or ``explanation``'s)."""
    explanation = explanation or _explained(case)
    return [name for name, _ in explanation.forward.kernels if "decode" in name][0]


GLUON_CASES = {
    "dense-decode": MlaCase((0, 1, 63, 64, 65, 1000), 1, 1, 128, capacity=1024, scale=0.1352,
                            num_splits=1),
    "dense-decode-auto-splits": MlaCase((5, 700, 4000), 1, 1, 64, capacity=4096),
    "dense-mtp-causal-splits": MlaCase((0, 130, 2043), 3, 3, 128, capacity=2048,
                                       num_splits=3, new_values="view"),
    "dense-not-causal-fp16": MlaCase((77, 129), 2, 0, 64, torch.float16, capacity=256,
                                     causal=False, num_splits=2, magnitude=2.0),
    "dense-batch-idx-full-cache": MlaCase((200, 252), 4, 4, 64, capacity=256,
                                          batch_idx=True, spare=2, num_splits=5),
    "paged-64": MlaCase((1, 300, 510), 2, 2, 128, paged=True, page=64, capacity=512,
                        spare=3, num_splits=2),
    "paged-128-auto": MlaCase((129, 0, 1000), 1, 1, 64, paged=True, page=128, capacity=1024),
    "paged-256-many-splits": MlaCase((255, 257), 4, 1, 64, paged=True, page=256,
                                     capacity=1024, num_splits=7),
    # 64 rows over several queries: each row's causal bound its own, rows with no key beside
    # rows with keys (in a tile and in a split)
    "32-heads-2-queries": MlaCase((0, 64, 1000), 2, 2, 32, capacity=1024, num_splits=3,
                                  new_values="view"),
    "16-heads-4-queries-rows-with-no-key": MlaCase((1, 3, 70, 200), 4, 0, 16, paged=True,
                                                   page=64, capacity=256, num_splits=2),
    "16-heads-4-queries-not-causal": MlaCase((5, 190), 4, 4, 16, torch.float16,
                                             capacity=256, causal=False),
}


@pytest.mark.gpu
@pytest.mark.skipif(not _gluon_available(), reason="needs triton 3.6 on a Hopper GPU")
@pytest.mark.parametrize("name", list(GLUON_CASES))
def test_gpu_gluon_kernel_matches_reference(name):
    """The Gluon kernel takes these calls (flashop.explain says so) and matches the reference
    under the rule, the append bit for bit: lengths 0, inside one key tile, on and across
    tile edges, up to the capacity; 1-4 queries causal and not; 64 and 128 heads, and 16
    and 32 whose programs' rows span queries; dense, cache_batch_idx, pages of 64, 128 and
    256; one split, several, more than a run has tiles, auto. Rows past each sequence's
    keys hold NaN, so a read of them shows."""
    case = GLUON_CASES[name]
    assert _kernel_of(case) == "mla_decode_gluon_kernel"
    check_mla_case(case)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("tma", [None, False], ids=["default", "pointer-loads"])
@pytest.mark.parametrize("name", list(GLUON_CASES))
def test_gpu_tl_kernel_matches_reference_in_the_gluon_cases(name, tma):
    """The `tl` kernel (what every stack but triton 3.6 on Hopper runs) over the same calls,
    at the GPU's tiles: at 64 rows its two warp groups split S by keys and P V by value
    dims (kernels/mla.py's regions); its inner key tiles through tensor descriptors (by
    default on Hopper at 64 rows, dense or pages of 64 and more) and by pointer loads."""
    case = GLUON_CASES[name]
    with flashop.config.override(gluon=False, tma=tma):
        told = _explained(case)
        assert _kernel_of(case, told) == "mla_decode_kernel"
        hopper = torch.cuda.get_device_capability()[0] >= 9
        assert told.forward.options["tensor descriptors"] is (tma is None and hopper), told
        check_mla_case(case)


@pytest.mark.gpu
@pytest.mark.skipif(not _gluon_available(), reason="needs triton 3.6 on a Hopper GPU")
def test_gpu_gluon_kernel_negative_length_attends_no_key():
    """A negative length (docs/decoding.md's unchecked values) attends no key in the Gluon
    kernel too: out 0, lse -inf, beside a sequence that attends its keys."""
    case = MlaCase((3, 5), 2, 1, 64, capacity=16)
    (q, k_cache, v_cache, k, _), kwargs = make_mla_call(case)
    kwargs["cache_seqlens"] = torch.tensor([-3, 5], dtype=torch.int32, device=DEVICE)
    assert _kernel_of(case) == "mla_decode_gluon_kernel"
    with poisoned_outputs():
        out, lse = flashop.attention_with_kvcache(q, k_cache, v_cache, k, **kwargs,
                                                  return_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not _gluon_available(), reason="needs triton 3.6 on a Hopper GPU")
def test_gpu_gluon_kernel_declines_what_it_does_not_take():
    """Calls the Gluon kernel does not take run the `tl` kernel, and the explanation says
    why: 16 heads, pages of 32, left padding, a value cache of its own, the switch off."""
    base = MlaCase((10, 100), 1, 1, 64, capacity=128)
    for case, reason in [
            (MlaCase((10, 100), 1, 1, 16, capacity=128), "a multiple of 64 query heads"),
            (MlaCase((10, 100), 2, 2, 16, capacity=128), "not 1 and 16 x 2"),
            (MlaCase((10, 100), 1, 1, 64, paged=True, page=32, capacity=128),
             "pages of a multiple of 64"),
            (MlaCase((10, 100), 1, 1, 64, capacity=128, leftpad=True), "cache_leftpad"),
            (MlaCase((10, 100), 1, 1, 64, capacity=128, own_values=True), "first 512 dims")]:
        (q, k_cache, v_cache, k, v), kwargs = make_mla_call(case)
        explanation = flashop.explain(flashop.attention_with_kvcache, q, k_cache, v_cache,
                                      k, v, **kwargs)
        assert "mla_decode_kernel" in str(explanation), case
        assert reason in str(explanation), (reason, str(explanation))
        check_mla_case(case)
    with flashop.config.override(gluon=False):
        assert _kernel_of(base) == "mla_decode_kernel"
        check_mla_case(base)


@pytest.mark.gpu
@pytest.mark.skipif(not _gluon_available(), reason="needs triton 3.6 on a Hopper GPU")
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_gluon_kernel_in_compiled_graphs_and_cuda_graphs(paged):
    """Under torch.compile(fullgraph=True) a call the Gluon kernel takes runs through the
    opaque operator (Inductor cannot trace Gluon) with eager's out, lse and cache bit for
    bit; a CUDA graph of the step replays eager's outputs."""
    code, _ = _compiled_call_equals_eager(paged)
    assert "attention_with_kvcache_opaque" in code
    case = MlaCase((100, 2000), 2, 2, 128, paged=paged, page=64, capacity=4096,
                   num_splits=4, scale=0.1352)
    inputs, graph_cache, step = _mla_step(case)
    eager_inputs, eager_cache, eager_step = _mla_step(case)
    graph, captured = cuda_graph(step)
    eager_cache.copy_(graph_cache)
    for i in range(1, 6):
        inputs[2].copy_(torch.tensor([100 + 3 * i, 2000 - 5 * i], dtype=torch.int32))
        eager_inputs[2].copy_(inputs[2])
        graph.replay()
        out = eager_step()
        torch.cuda.synchronize()
        assert all(bitwise_equal(a, b) for a, b in zip(captured, out)), i
        assert bitwise_equal(graph_cache, eager_cache), i
