"""Compiled and eager MLA decode calls that differ by an ulp (performance notes, entry 123).

On an H200 (torch 2.11, triton 3.6) `test_mla.py::test_gpu_inductor_launches_the_latent_kernels[True]`
failed after the MLA tile table took 64-row tiles in 2 stages: FlashMLA's door compiled with
``fullgraph=True`` and called first gave out and lse one ulp away from the same call made
eagerly after it (out 0.0078 in bf16, lse 1.9e-6), at H = 128, S_q = 2, pages of 64, lengths
102 and 2002, the splits the rule plans (16). Each of the three parts below printed what
entry 123 says:

1. the test's sequence (an eager append, then the door compiled and called, then eagerly);
2. the other order (the door eagerly, then compiled, then eagerly again), and whether any
   input changed;
3. ``attention_with_kvcache`` compiled, then eager, per split count (0: the rule's), S_q and
   tile (the table's, and the former one-stage 64-row tile), no append.

The cause (entry 125): torch's AOTAutograd cache keyed a graph by its Dynamo graph alone, so
part 3's forced-tile compiles were served the graph compiled for the table's tile earlier
in the loop (16 splits where the forced tile plans 32). With flashop's compile key
(flashop/_ops/compile_key.py) every part prints equal.

Usage (a GPU; tests/ on the path for the tests' cases):

    PYTHONPATH=.:tests python docs/notes/experiments/mla_compiled_vs_eager.py
"""

from __future__ import annotations

import contextlib

import torch

import flashop
import test_mla as T  # the tests' MLA cases (tests/test_mla.py)
from flashop._launch import tiles as tile_table
from flashop._launch.decode_tiles import DecodeTiles
from flashop.flash_mla import flash_mla_with_kvcache


def same(a, b) -> list:
    return [T.bitwise_equal(x, y) for x, y in zip(a, b)]


def door_case():
    """The test's case after its eager append: (q, k_cache, block table, lengths)."""
    case = T.MlaCase((100, 2000), 2, 2, 128, paged=True, page=64, capacity=4096,
                     num_splits=4, scale=0.1352)
    (q, k_cache, _, k, _), kwargs = T.make_mla_call(case)
    flashop.attention_with_kvcache(q, k_cache, k_cache[..., :T.DV], k, **kwargs,
                                   return_lse=True)
    return q, k_cache, kwargs["block_table"], kwargs["cache_seqlens"] + 2


def door(args, compiled: bool):
    fn = torch.compile(flash_mla_with_kvcache, fullgraph=True) if compiled \
        else flash_mla_with_kvcache
    return fn(*args, T.DV, None, None, softmax_scale=0.1352, causal=True)


def main() -> None:
    args = door_case()
    torch._dynamo.reset()
    first = door(args, compiled=True)
    print("1. compiled first, then eager: equal", same(first, door(args, compiled=False)))

    args = door_case()
    before = [x.clone() for x in args]
    eager = door(args, compiled=False)
    torch._dynamo.reset()
    compiled = door(args, compiled=True)
    again = door(args, compiled=False)
    print("2. eager first, then compiled: equal", same(eager, compiled), "eager again",
          same(eager, again), "inputs unchanged", same(before, args))

    for forced in (None, DecodeTiles(64, 64, 8, 1)):
        for paged in (False, True):
            for splits in (0, 4, 32):
                for S_q in (1, 2):
                    within = (tile_table.force("mla", forced) if forced
                              else contextlib.nullcontext())
                    with within:
                        case = T.MlaCase((100, 2000), S_q, 0, 128, paged=paged, page=64,
                                         capacity=4096, num_splits=splits, scale=0.1352)
                        (q, k_cache, _, _, _), kwargs = T.make_mla_call(case)
                        torch._dynamo.reset()

                        def call(q, c):
                            return flashop.attention_with_kvcache(
                                q, c, c[..., :T.DV], **kwargs, return_lse=True)
                        out = torch.compile(call, fullgraph=True)(q, k_cache)
                        tiles = "the table's" if forced is None else "64x64x8x1"
                        print(f"3. tiles {tiles}, paged {paged}, splits {splits}, S_q {S_q}:"
                              f" equal", same(out, call(q, k_cache)))


if __name__ == "__main__":
    main()
