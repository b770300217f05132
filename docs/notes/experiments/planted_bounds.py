"""Planted off-by-one bugs in the kernels' bounds (docs/notes/testing-notes.md): each is
applied to the kernel source alone, the test files that exercise that bound run under the
CPU suite's settings (Triton's interpreter, the ci profile) and stop at the first failure,
and the source is restored. Prints a table of which test caught each one, or that none did.
Not run by CI (about 30 minutes on two cores).

    python docs/notes/experiments/planted_bounds.py            # every planted bug
    python docs/notes/experiments/planted_bounds.py K1 D5      # some of them
    python docs/notes/experiments/planted_bounds.py --list     # what each changes
    python docs/notes/experiments/planted_bounds.py --without=tests/test_tile_ranges.py
                                                  # what the kernels' tests catch
    python docs/notes/experiments/planted_bounds.py K1 K2 --only=tests/test_tile_ranges.py

Run from a checkout whose kernels are unchanged: the script refuses to start otherwise, and
restores each file it changed even when interrupted.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
DENSE = ["tests/test_tile_ranges.py", "tests/test_modifiers.py", "tests/test_attention.py",
         "tests/test_varlen.py", "tests/test_paged_prefill.py"]
PACKED = ["tests/test_varlen.py", "tests/test_paged_prefill.py"]
DECODE = ["tests/test_decode.py"]


@dataclass(frozen=True)
class Planted:
    name: str
    what: str  # the bug, in a line
    path: str  # the kernel file, from the repository's root
    old: str  # the source it replaces (exactly once)
    new: str
    tests: tuple  # the test files that exercise the bound


COMMON, FORWARD, BACKWARD, DECODE_K = (f"flashop/kernels/{n}.py"
                                       for n in ("common", "forward", "backward", "decode"))

CHUNKED = ["tests/test_tile_ranges.py", "tests/test_chunked.py"]

_K = [
    # key_range: the key tiles a query tile visits (forward, dQ kernel, decoding)
    Planted("K1", "lo one tile too high where a query tile's first key ends a key tile (drops "
            "one key of a sliding window whose left bound falls on a tile edge)", COMMON,
            "lo = tl.minimum((tl.maximum(start_first, 0) // BLOCK_N) * BLOCK_N, hi)",
            "lo = tl.minimum((tl.maximum(start_first + 1, 0) // BLOCK_N) * BLOCK_N, hi)",
            DENSE),
    Planted("K2", "u_lo one tile too low where the last row's first key follows a tile edge "
            "(one key left of the window unmasked)", COMMON,
            "u_lo = tl.cdiv(tl.maximum(start_last, 0), BLOCK_N) * BLOCK_N",
            "u_lo = tl.cdiv(tl.maximum(start_last - 1, 0), BLOCK_N) * BLOCK_N", DENSE),
    Planted("K3", "hi one key short (a tile holding only the last row's last key skipped)",
            COMMON, "tl.maximum(key_end(p_last, right, chunk, HAS_RIGHT, HAS_CHUNK), 0))",
            "tl.maximum(key_end(p_last, right, chunk, HAS_RIGHT, HAS_CHUNK) - 1, 0))", DENSE),
    Planted("K4", "u_hi one tile too high where the first row's last key ends a tile but one "
            "(one key right of the window unmasked)", COMMON,
            "u_hi = tl.minimum((tl.maximum(end_first, 0) // BLOCK_N) * BLOCK_N, n_full)",
            "u_hi = tl.minimum((tl.maximum(end_first + 1, 0) // BLOCK_N) * BLOCK_N, n_full)",
            DENSE),
    Planted("K5", "the keys' last partial tile unmasked where S_k is one short of a tile",
            COMMON, "n_full = (S_k // BLOCK_N) * BLOCK_N",
            "n_full = ((S_k + 1) // BLOCK_N) * BLOCK_N", DENSE),
]

PLANTED = [
    *_K,
    # query_tile_range: the query tiles a key tile visits (dK/dV kernel, dQ by atomics)
    Planted("Q1", "lo one tile too high where the first query of a key tile ends a query tile",
            COMMON, "lo = tl.minimum((tl.maximum(first, 0) // BLOCK_M) * BLOCK_M, S_q)",
            "lo = tl.minimum((tl.maximum(first + 1, 0) // BLOCK_M) * BLOCK_M, S_q)", DENSE),
    Planted("Q2", "u_lo one tile too low (one pair above the right bound unmasked)", COMMON,
            "u_lo = tl.cdiv(tl.maximum(first_all, 0), BLOCK_M) * BLOCK_M",
            "u_lo = tl.cdiv(tl.maximum(first_all - 1, 0), BLOCK_M) * BLOCK_M", DENSE),
    Planted("Q3", "hi one query short (a query tile holding only the last query skipped)",
            COMMON, "key_end(n_last, left, chunk, HAS_LEFT, HAS_CHUNK) - off,",
            "key_end(n_last, left, chunk, HAS_LEFT, HAS_CHUNK) - off - 1,", DENSE),
    Planted("Q4", "u_hi one tile too high (one pair left of the window unmasked)", COMMON,
            "u_hi = (tl.maximum(end_all, 0) // BLOCK_M) * BLOCK_M",
            "u_hi = (tl.maximum(end_all + 1, 0) // BLOCK_M) * BLOCK_M", DENSE),
    # the chunks' bounds (key_start, key_end; the edge tiles' mask)
    Planted("C1", "a chunk starts one position early", COMMON,
            "return (tl.maximum(pos + chunk, 0) // chunk) * chunk - chunk",
            "return (tl.maximum(pos + chunk + 1, 0) // chunk) * chunk - chunk", CHUNKED),
    # attention_scores: the masks of edge tiles
    Planted("E1", "the right bound's mask drops its last key", COMMON,
            "(o_k <= o_pos + right)", "(o_k < o_pos + right)", DENSE),
    Planted("E2", "the left bound's mask drops its first key", COMMON,
            "(o_k >= o_pos - left)", "(o_k > o_pos - left)", DENSE),
    # the kernels' own range arithmetic
    Planted("B1", "dK/dV: the last partial query tile read without row masks where S_q is one "
            "short of a tile", BACKWARD, "(S_q // BLOCK_M) * BLOCK_M))",
            "((S_q + 1) // BLOCK_M) * BLOCK_M))", DENSE),
    Planted("F1", "forward with two query tiles: the first tile's keys end a tile early where "
            "they end one past a tile edge", FORWARD, "tl.cdiv(hi_a, BLOCK_N)",
            "tl.cdiv(hi_a - 1, BLOCK_N)", DENSE),
    # packed sequences' ends
    Planted("V1", "forward: a packed sequence's last query tile skipped where it holds one "
            "query", FORWARD, "if start_m >= S_q:", "if start_m >= S_q - 1:", PACKED),
    Planted("V2", "dQ kernel: a packed sequence's last query tile skipped where it holds one "
            "query", BACKWARD, "if start_m >= S_q:", "if start_m >= S_q - 1:", PACKED),
    Planted("V3", "dK/dV kernel: a packed sequence's last key tile skipped where it holds one "
            "key", BACKWARD, "if start_n >= S_k:", "if start_n >= S_k - 1:", PACKED),
    Planted("P1", "paged prefill: the last key dropped where a sequence fills its pages",
            FORWARD, "S_k = tl.minimum(S_k, capacity)", "S_k = tl.minimum(S_k, capacity - 1)",
            PACKED),
    # decoding (attention_decode_kernel, the append)
    # decoding reads its keys' tiles through the same key_range: K1-K5's faults against the
    # decode tests alone
    *[Planted(f"D{i}", f"{k.name}'s fault, in decoding", k.path, k.old, k.new, DECODE)
      for i, k in enumerate(_K, 1)],
    Planted("D6", "the splits' runs one tile short where the keys end one past a tile edge",
            DECODE_K, "tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), n_splits)",
            "tl.cdiv(tl.cdiv(hi - lo - 1, BLOCK_N), n_splits)", DECODE),
    Planted("D7", "the append writes a page's last row into the next page", DECODE_K,
            "i_page = tl.load(block_table + i_b * stride_tb + o_pos // PAGE_SIZE, mask=m_s,",
            "i_page = tl.load(block_table + i_b * stride_tb + (o_pos + 1) // PAGE_SIZE, "
            "mask=m_s,", DECODE),
]


def _pytest(files, extra=()) -> tuple[str, float]:
    """(the first failing test, or "" where every test passed; seconds)."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *files, "-x", "-q", "-n", "0", "-p", "no:cacheprovider",
         *extra], cwd=ROOT, capture_output=True, text=True)
    failed = re.findall(r"^FAILED (\S+)", done.stdout, re.M)
    if done.returncode not in (0, 1) and not failed:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    return (failed[0] if failed else ""), time.perf_counter() - start


def _files(planted: Planted, only=(), without=()) -> list:
    return [t for t in planted.tests if t not in without and (not only or t in only)]


def run(planted: Planted, only=(), without=()) -> tuple[str, float]:
    path = os.path.join(ROOT, planted.path)
    with open(path) as f:
        source = f.read()
    if source.count(planted.old) != 1:
        raise RuntimeError(f"{planted.name}: {planted.old!r} is not in {planted.path} once")
    try:
        with open(path, "w") as f:
            f.write(source.replace(planted.old, planted.new))
        return _pytest(_files(planted, only, without))
    finally:
        with open(path, "w") as f:
            f.write(source)


def main(argv) -> int:
    without = [a.split("=", 1)[1] for a in argv if a.startswith("--without=")]
    only = [a.split("=", 1)[1] for a in argv if a.startswith("--only=")]
    names = [a for a in argv if not a.startswith("--")]
    chosen = [p for p in PLANTED if (not names or p.name in names) and _files(p, only, without)]
    if "--list" in argv:
        for p in PLANTED:
            print(f"{p.name}  {p.path}: {p.what}\n      - {p.old}\n      + {p.new}")
        return 0
    changed = subprocess.run(["git", "status", "--porcelain", "flashop/kernels"], cwd=ROOT,
                             capture_output=True, text=True).stdout
    if changed:
        print(f"the kernels differ from the commit:\n{changed}", file=sys.stderr)
        return 2
    print("| bug | what | caught by | seconds |\n|---|---|---|---|", flush=True)
    survived = 0
    caught_by = []
    for p in chosen:
        caught, seconds = run(p, only, without)
        caught_by.append(caught)
        survived += not caught
        print(f"| {p.name} | {p.what} | {f'`{caught}`' if caught else '**none**'} | "
              f"{seconds:.0f} |", flush=True)
    print(f"\n{len(chosen) - survived} of {len(chosen)} caught", flush=True)
    # a test that fails without a planted bug catches nothing
    catchers = sorted({c for c in caught_by if c})
    failing, _ = _pytest(catchers) if catchers else ("", 0)
    print(f"the catching tests without a planted bug: {'FAILED ' + failing if failing else 'pass'}")
    return 1 if survived or failing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
