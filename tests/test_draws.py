"""What the property tests draw under the Hypothesis profile in use: each test runs with its
check replaced by a recorder (no kernel runs), and its examples are counted by what they
exercise under the interpreter's tiles. Under the derandomized ``ci`` profile each test
draws at least its least count of examples per dtype (30; fewer for the two slowest), at
least REAL_WORK of them real work: several key tiles, pages and splits; and each bound it
draws at a tile edge (EDGES) in at least EDGE_SHARE of them. docs/testing.md holds the
counts.

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
    sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import conftest  # noqa: F401

from helpers import DECODE_KEYS, DKDV_KEYS, FWD_KEYS, FWD_QUERIES, TILES  # noqa: E402

REAL_WORK = 0.75
EDGE_SHARE = 0.1
DTYPES = [torch.float16, torch.bfloat16, torch.float32]

# The bounds the kernels compute their tile ranges from, by what their edges are counted on
# (tests/helpers.py draws them): lengths (a dense call's S_q and S_k; a packed sequence's
# ends; a cache's keys after the append and its pages' ends) within one of a multiple of a
# tile size, the causal offset S_k - S_q (under a bound) and the window's bounds relative to
# it (left - offset, right + offset) within two of one (0 included)
EDGES = {
    "dense": ("S_q", "S_k", "offset", "left", "right"),
    "packed": ("ends", "offset", "left", "right"),
    "cache": ("keys", "page ends", "left", "right"),
}


def _length_on_edge(n: int, sizes=TILES) -> bool:
    return any(n >= t - 1 and min(n % t, t - n % t) <= 1 for t in sizes)


def _near_multiple(x: int) -> bool:
    return any(min(abs(x) % t, t - abs(x) % t) <= 2 for t in TILES)


def bound_edges(offset: int, causal: bool, window_size) -> set:
    """Which of the offset and the window's bounds are at a tile edge (the causal bound is a
    right bound of 0)."""
    left, right = window_size
    if causal:
        right = max(right, 0)
    edges = set()
    if (left >= 0 or right >= 0) and _near_multiple(offset):
        edges.add("offset")
    if left >= 0 and _near_multiple(left - offset):
        edges.add("left")
    if right >= 0 and _near_multiple(right + offset):
        edges.add("right")
    return edges


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
    """One example: its dtype, whether it is real work, what it is, in a few words, and
    which of its bounds are at a tile edge (EDGES)."""

    dtype: torch.dtype
    real: bool
    summary: str
    edges: frozenset = frozenset()


def _case_example(case, *rest) -> Drawn:
    real = dense_work(case.S_q, case.S_k, case.causal, case.window_size)
    edges = bound_edges(case.S_k - case.S_q, case.causal, case.window_size)
    edges |= {name for name, n in (("S_q", case.S_q), ("S_k", case.S_k)) if _length_on_edge(n)}
    if case.dq_atomics:
        edges.add("dQ atomics")
    return Drawn(case.dtype, real, f"B{case.B} S_q{case.S_q} S_k{case.S_k} "
                                   f"H{case.H_kv}x{case.G} D{case.D} {case.window_size}"
                                   f"{' causal' if case.causal else ''}", frozenset(edges))


def _packed_example(args, dout, dlse, deterministic_backward=True, **options) -> Drawn:
    """Real work for a packing: two sequences or more, one of them real work as a dense
    call."""
    lens_q = args["cu_seqlens_q"].diff().tolist()
    lens_k = args["cu_seqlens_k"].diff().tolist()
    window = options.get("window_size", (-1, -1))
    causal = options.get("causal", False)
    real = len(lens_q) >= 2 and any(dense_work(a, b, causal, window)
                                    for a, b in zip(lens_q, lens_k) if a)
    edges = bound_edges(lens_k[0] - lens_q[0], causal, window)
    if any(map(_length_on_edge, lens_q + lens_k)):
        edges.add("ends")
    return Drawn(args["q"].dtype, real, f"q{lens_q} k{lens_k} {window}"
                                        f"{' causal' if causal else ''}", frozenset(edges))


def decode_splits(case) -> int:
    """The splits the decode call takes (num_splits, or the launcher's rule)."""
    from flashop._launch import decode_tiles
    from flashop._launch.common import block_dim

    rows = case.G * case.S_q
    d, dv = block_dim(case.D), block_dim(case.DV)
    t = decode_tiles.decode_tiles(rows, d, dv, case.dtype, case.page if case.paged else 0)
    return decode_tiles.call_splits(
        case.num_splits, case.B * case.H_kv * -(-rows // t.BLOCK_M), case.capacity, t, d, dv,
        case.dtype.itemsize, torch.device("cpu"))


def _cache_example(case, seed=0, *rest) -> Drawn:
    """Real work for a decode call: some sequence's keys in two splits (it attends keys of
    two key tiles and the call takes two splits or more), in two pages of a paged cache.
    A left-padded sequence's keys start at its cache_leftpad row (drawn from the seed)."""
    from cache_cases import make_call
    from flashop.reference import keys_in_bounds

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
    keys = [length + case.S_new for length in case.lengths]
    # the bounds of the first sequence's first query, or of its last
    edges = (bound_edges(keys[0] - case.S_q, case.causal, case.window_size)
             | bound_edges(keys[0] - 1, case.causal, case.window_size))
    if any(map(_length_on_edge, keys)):
        edges.add("keys")
    if case.paged and any(_length_on_edge(n, (case.page,)) for n in keys):
        edges.add("page ends")
    what = f"{'paged' if case.paged else 'dense'} L{list(case.lengths)}+{case.S_new}"
    return Drawn(case.dtype, real, f"{what} splits {splits} {case.window_size}",
                 frozenset(edges))


@dataclass(frozen=True)
class PropertyTest:
    module: str
    test: str  # parametrized by dtype
    check: str  # the function it checks an example with
    example: Callable  # the check's arguments -> Drawn
    bounds: tuple  # the bounds whose edges it draws (EDGES' names)
    least: int = 30  # examples per dtype under the ci profile


_NO_WINDOW = tuple(b for b in EDGES["dense"] if b != "left")  # causal: the right bound
PROPERTY_TESTS = [
    PropertyTest("test_attention", "test_matches_reference", "check_case", _case_example,
                 _NO_WINDOW + ("dQ atomics",)),
    PropertyTest("test_modifiers", "test_modifiers_match_reference", "check_case",
                 _case_example, EDGES["dense"] + ("dQ atomics",)),
    # fewer examples (test_sinks.py, test_dropout.py say why)
    PropertyTest("test_sinks", "test_sinks_with_modifiers_match_reference", "check_case",
                 _case_example, EDGES["dense"], least=20),
    PropertyTest("test_dropout", "test_dropout_with_modifiers_matches_reference_with_its_mask",
                 "check_with_mask", _case_example, EDGES["dense"], least=10),
    PropertyTest("test_varlen", "test_varlen_matches_reference_per_sequence", "check_packed",
                 _packed_example, EDGES["packed"]),
    PropertyTest("test_decode", "test_kvcache_matches_reference", "check_cache_case",
                 _cache_example, EDGES["cache"]),
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


def edge_counts(entry: PropertyTest, examples: list[Drawn]) -> dict:
    """bound -> the examples that draw it at a tile edge, for the bounds of entry."""
    return {b: sum(b in e.edges for e in examples) for b in entry.bounds}


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


def documented_edges() -> dict:
    """docs/testing.md's table of the bounds drawn at tile edges: test -> {dtype: {bound:
    examples}}, from rows ``| `test` | bound n/n/n, bound n/n/n |`` (fp16/bf16/fp32)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "testing.md")
    with open(path) as f:
        text = f.read()
    table = {}
    for name, row in re.findall(r"^\| `(test_\w+)` \| ((?:[\w ]+ \d+/\d+/\d+(?:, )?)+) \|$",
                                text, re.M):
        for bound, per_dtype in re.findall(r"([A-Za-z_][\w ]*?) (\d+/\d+/\d+)", row):
            for dtype, n in zip(DTYPES, map(int, per_dtype.split("/"))):
                table.setdefault(name, {}).setdefault(dtype, {})[bound] = n
    return table


def _edge_row(entry: PropertyTest, per_dtype: list) -> str:
    """The bounds' edge counts as docs/testing.md writes them."""
    return ", ".join(f"{b} {'/'.join(str(c[b]) for c in per_dtype)}" for b in entry.bounds)


@pytest.mark.skipif(not _ci_profile(), reason="counts the ci profile's (derandomized) draws")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("entry", PROPERTY_TESTS, ids=lambda e: e.test)
def test_ci_profile_draws_real_work_and_tile_edges(entry, dtype):
    """At least entry.least examples, REAL_WORK of them real work, and each of the test's
    bounds at a tile edge in EDGE_SHARE of them or more, as docs/testing.md counts them
    (under the Hypothesis release it names: another may draw other examples)."""
    import hypothesis

    examples = drawn(entry, dtype)
    n, real = counts(examples)
    edges = edge_counts(entry, examples)
    assert n >= entry.least and real >= REAL_WORK * n, (n, real)
    assert all(c >= EDGE_SHARE * n for c in edges.values()), (n, edges)
    release, table = documented_counts()
    if hypothesis.__version__ == release:
        documented = table.get(entry.test, {}).get(dtype)
        assert documented == (n, real), (
            f"docs/testing.md counts {documented} for {entry.test} in {dtype}, drawn "
            f"{(n, real)}")
        documented = documented_edges().get(entry.test, {}).get(dtype)
        assert documented == edges, (
            f"docs/testing.md counts the edges {documented} for {entry.test} in {dtype}, "
            f"drawn {edges}")


def main():
    print(f"{'test':60s} {'examples per dtype':>20s} {'real work':>12s}")
    edge_rows = []
    for entry in PROPERTY_TESTS:
        drawn_ = [drawn(entry, dtype) for dtype in DTYPES]
        n, real = zip(*map(counts, drawn_))
        print(f"{entry.test:60s} {', '.join(map(str, n)):>20s} {', '.join(map(str, real)):>12s}")
        if "-v" in sys.argv:
            for dtype, examples in zip(DTYPES, drawn_):
                for (r, what, edges), count in Counter(
                        (e.real, e.summary, e.edges) for e in examples).items():
                    print(f"    {str(dtype)[6:]:9s} {'real ' if r else 'light'} x{count} {what}"
                          f"{'; edges: ' + ', '.join(sorted(edges)) if edges else ''}")
        edge_rows.append(f"| `{entry.test}` | "
                         f"{_edge_row(entry, [edge_counts(entry, d) for d in drawn_])} |")
    print("\nexamples with a bound at a tile edge, per dtype (fp16/bf16/fp32):")
    print("\n".join(edge_rows))


if __name__ == "__main__":
    main()
