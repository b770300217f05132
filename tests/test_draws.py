"""What the property tests draw under the Hypothesis profile in use: each test runs with its
check replaced by a recorder (no kernel runs), and its examples are counted by what they
exercise under the interpreter's tiles. Under the derandomized ``ci`` profile each test
draws at least its least count of examples per dtype (30; fewer for the two slowest), at
least REAL_WORK of them real work: several key tiles, pages and splits. docs/testing.md
holds the counts.

    python tests/test_draws.py        # what each test draws per dtype (-v: every example)
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Callable
from unittest import mock

import pytest
import torch

if __name__ == "__main__":  # as a script: flashop and the profiles as the test run sets them
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import conftest  # noqa: F401

from helpers import DECODE_KEYS, DKDV_KEYS, FWD_KEYS, FWD_QUERIES  # noqa: E402

REAL_WORK = 0.75
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _spans_two_key_tiles(S_q: int, S_k: int, causal: bool, window_size) -> bool:
    """Whether a forward program (FWD_QUERIES queries) visits keys of two key tiles under
    the causal and window bounds."""
    from flashop.reference import keys_in_bounds

    keep = keys_in_bounds(S_q, S_k, causal, window_size)
    for rows in keep.split(FWD_QUERIES):
        keys = torch.nonzero(rows.any(0))
        if len(keys) and keys.max() // FWD_KEYS > keys.min() // FWD_KEYS:
            return True
    return False


def dense_work(S_q: int, S_k: int, causal: bool = False, window_size=(-1, -1)) -> bool:
    """Real work for one dense sequence: several key tiles, in every kernel (two dK/dV
    programs; a forward program whose bounds leave it keys of two key tiles)."""
    return S_k > DKDV_KEYS and _spans_two_key_tiles(S_q, S_k, causal, window_size)


@dataclass
class Drawn:
    """One example: its dtype, whether it is real work, and what it is, in a few words."""

    dtype: torch.dtype
    real: bool
    summary: str


def _case_example(case, *rest) -> Drawn:
    real = dense_work(case.S_q, case.S_k, case.causal, case.window_size)
    return Drawn(case.dtype, real, f"B{case.B} S_q{case.S_q} S_k{case.S_k} "
                                   f"H{case.H_kv}x{case.G} D{case.D}")


def _packed_example(args, dout, dlse, deterministic_backward=True, **options) -> Drawn:
    """Real work for a packing: two sequences or more, one of them real work as a dense
    call."""
    lens_q = args["cu_seqlens_q"].diff().tolist()
    lens_k = args["cu_seqlens_k"].diff().tolist()
    window = options.get("window_size", (-1, -1))
    real = len(lens_q) >= 2 and any(dense_work(a, b, options.get("causal", False), window)
                                    for a, b in zip(lens_q, lens_k) if a)
    return Drawn(args["q"].dtype, real, f"q{lens_q} k{lens_k}")


def decode_splits(case) -> int:
    """The splits the decode call takes (num_splits, or the launcher's rule)."""
    from flashop._launch import kvcache
    from flashop._launch.common import block_dim

    rows = case.G * case.S_q
    d, dv = block_dim(case.D), block_dim(case.DV)
    t = kvcache.decode_tiles(rows, d, dv, case.dtype, case.page if case.paged else 0)
    return kvcache.call_splits(case.num_splits, case.B * case.H_kv * -(-rows // t.BLOCK_M),
                               case.capacity, t, d, dv, case.dtype.itemsize,
                               torch.device("cpu"))


def _cache_example(case, seed=0, *rest) -> Drawn:
    """Real work for a decode call: some sequence's keys in two splits (it attends keys of
    two key tiles and the call takes two splits or more), in two pages of a paged cache.
    A left-padded sequence's keys start at its cache_leftpad row (drawn from the seed)."""
    from flashop.reference import keys_in_bounds
    from test_decode import make_call

    splits = decode_splits(case)
    pads = [0] * case.B
    if case.leftpad:
        pads = make_call(case, seed)[1]["cache_leftpad"].tolist()
    real = False
    for length, pad in zip(case.lengths, pads):
        L = length + case.S_new - pad
        keep = keys_in_bounds(case.S_q, L, case.causal, case.window_size).any(0)
        if not keep.any():
            continue
        keys = torch.nonzero(keep)
        first, last = keys.min().item(), keys.max().item()
        tiles = last // DECODE_KEYS - first // DECODE_KEYS + 1
        pages = last // case.page - first // case.page + 1 if case.paged else 2
        real |= splits >= 2 and tiles >= 2 and pages >= 2
    what = f"{'paged' if case.paged else 'dense'} L{list(case.lengths)}+{case.S_new}"
    return Drawn(case.dtype, real, f"{what} splits {splits}")


@dataclass(frozen=True)
class PropertyTest:
    module: str
    test: str  # parametrized by dtype
    check: str  # the function it checks an example with
    example: Callable  # the check's arguments -> Drawn
    least: int = 30  # examples per dtype under the ci profile


PROPERTY_TESTS = [
    PropertyTest("test_attention", "test_matches_reference", "check_case", _case_example),
    PropertyTest("test_modifiers", "test_modifiers_match_reference", "check_case",
                 _case_example),
    # fewer examples (test_sinks.py, test_dropout.py say why)
    PropertyTest("test_sinks", "test_sinks_with_modifiers_match_reference", "check_case",
                 _case_example, least=20),
    PropertyTest("test_dropout", "test_dropout_with_modifiers_matches_reference_with_its_mask",
                 "check_with_mask", _case_example, least=10),
    PropertyTest("test_varlen", "test_varlen_matches_reference_per_sequence", "check_packed",
                 _packed_example),
    PropertyTest("test_decode", "test_kvcache_matches_reference", "check_cache_case",
                 _cache_example),
]


def drawn(entry: PropertyTest, dtype) -> list[Drawn]:
    """The examples the test draws for ``dtype`` in a pytest run, its check replaced by a
    recorder (Hypothesis draws the same examples while no check fails)."""
    mod = importlib.import_module(entry.module)
    wrapped = getattr(mod, entry.test)
    # Hypothesis' pytest plugin adds a parametrized test's node id to the digest that seeds
    # its derandomized draws (_hypothesis_pytestplugin.py): the same here
    node = f"tests/{entry.module}.py::{entry.test}[dtype{DTYPES.index(dtype)}]"
    seen = []

    def record(*args, **kwargs):
        seen.append(entry.example(*args, **kwargs))

    with mock.patch.object(mod, entry.check, record), \
            mock.patch.object(wrapped.hypothesis.inner_test, "_hypothesis_internal_add_digest",
                              node.encode(), create=True):
        wrapped(dtype=dtype)
    return seen


def counts(examples: list[Drawn]) -> tuple[int, int]:
    """(examples, real work)"""
    return len(examples), sum(e.real for e in examples)


def _ci_profile() -> bool:
    from hypothesis import settings

    return settings._current_profile == "ci"


def documented_counts() -> tuple[str, dict]:
    """docs/testing.md's table of the ci profile's draws: the Hypothesis release it was drawn
    with, and test -> {dtype: (examples, real work)}, from rows ``| `test` | n, n, n | r, r,
    r |`` (fp16, bf16, fp32)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "testing.md")
    with open(path) as f:
        text = f.read()
    release = re.search(r"\(Hypothesis ([\d.]+);", text).group(1)
    rows = re.findall(r"^\| `(test_\w+)` \| ([\d, ]+) \| ([\d, ]+) \|$", text, re.M)
    return release, {name: dict(zip(DTYPES, zip(map(int, n.split(",")), map(int, r.split(",")))))
                     for name, n, r in rows}


@pytest.mark.skipif(not _ci_profile(), reason="counts the ci profile's (derandomized) draws")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("entry", PROPERTY_TESTS, ids=lambda e: e.test)
def test_ci_profile_draws_real_work(entry, dtype):
    """At least entry.least examples, REAL_WORK of them real work, as docs/testing.md
    counts them (under the Hypothesis release it names: another may draw other examples)."""
    import hypothesis

    n, real = counts(drawn(entry, dtype))
    assert n >= entry.least and real >= REAL_WORK * n, (n, real)
    release, table = documented_counts()
    if hypothesis.__version__ == release:
        documented = table.get(entry.test, {}).get(dtype)
        assert documented == (n, real), (
            f"docs/testing.md counts {documented} for {entry.test} in {dtype}, drawn "
            f"{(n, real)}")


def main():
    print(f"{'test':60s} {'examples per dtype':>20s} {'real work':>12s}")
    for entry in PROPERTY_TESTS:
        drawn_ = [drawn(entry, dtype) for dtype in DTYPES]
        n, real = zip(*map(counts, drawn_))
        print(f"{entry.test:60s} {', '.join(map(str, n)):>20s} {', '.join(map(str, real)):>12s}")
        if "-v" in sys.argv:
            for dtype, examples in zip(DTYPES, drawn_):
                for (r, what), count in Counter((e.real, e.summary) for e in examples).items():
                    print(f"    {str(dtype)[6:]:9s} {'real ' if r else 'light'} x{count} {what}")


if __name__ == "__main__":
    main()
