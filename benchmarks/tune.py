"""Sweep the tile sizes of each attention kernel on this GPU and print the fastest.

The candidates are the autotuner's (``flashop._launch.tiles.TILE_CANDIDATES``, pruned to
the GPU's shared memory), or those given with --tiles. Each candidate is forced on its kernel
with ``flashop._launch.tiles.force(kind, tiles)`` while the call is timed.

Times bf16 N=4096 (or --seqlen), B=16384/N, H=2048/DV (non-causal, or --causal; a head dim
D/DV gives the values DV dims, as in benchmarks/attention.py): the forward
alone for forward tiles; the whole backward for dK/dV and dQ tiles, varying one kernel's
tiles at a time (the deterministic backward for "dkdv", "dq" and, at head dims above 128, the
dK/dV kernel's parts "dv" and "dk"; the one with atomic dQ,
``flashop.config.override(dq_atomics=True)``, for "dkdv_atomic"). Forward tiles are timed
with the warp-specialized forward off (it has its own tiles,
``flashop._launch.tiles.WS_TILES``). The chosen tiles go into flashop/_launch/tiles.py by
hand; the full sweep is written to --out as CSV.

    python benchmarks/tune.py --heads-dims 64,128,256 --out tune.csv
    python benchmarks/tune.py --heads-dims 128 --seqlen 1024 --causal --kinds fwd \\
        --tiles 128x64x8x3,64x64x4x2
"""

import argparse
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import dims_label, dims_list, flops, import_flashop, write_csv  # noqa: E402
from progress import progress  # noqa: E402

import_flashop()  # registers torch.ops.flashop
from flashop import config  # noqa: E402
from flashop._launch import tiles  # noqa: E402
from flashop._launch.common import block_dim  # noqa: E402
from flashop._launch.tiles import TILE_CANDIDATES, Tiles, prune_tiles  # noqa: E402

KINDS = tuple(TILE_CANDIDATES)  # fwd, dkdv, dkdv_atomic, dv, dk, dq
FLOPS_FACTOR = {"fwd": 1.0, "dkdv": 2.5, "dq": 2.5, "dkdv_atomic": 2.5, "dv": 2.5, "dk": 2.5}


def parse_tiles(spec):
    """``BLOCK_MxBLOCK_NxWARPSxSTAGES[xsplit],...`` -> [Tiles]."""
    result = []
    for item in spec.split(","):
        parts = item.split("x")
        if len(parts) not in (4, 5) or parts[4:] not in ([], ["split"]):
            raise ValueError(f"tile {item!r}: expected BLOCK_MxBLOCK_NxWARPSxSTAGES[xsplit], "
                             f"e.g. 128x64x8x3 or 256x64x8x3xsplit")
        result.append(Tiles(*map(int, parts[:4]), split_m=parts[4:] == ["split"]))
    return result


def candidates(kind, D, DV):
    """The autotuner's candidates for ``kind`` that fit this GPU's shared memory."""
    props = triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())
    return prune_tiles(kind, block_dim(D), block_dim(DV), 2, props["max_shared_mem"])


def graphed(fn):
    """``fn`` captured in a CUDA graph; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def kernel_calls(D, DV, N, causal):
    """{kind: (call, switches)}: the call whose time measures ``kind``'s tiles and the
    flashop.config switches it runs under."""
    B, H = 16384 // N, 2048 // DV
    q, k, v = (torch.randn(B, N, H, d, device="cuda", dtype=torch.bfloat16) for d in (D, D, DV))
    out, lse, lse_log2 = torch.ops.flashop.attention_forward(q, k, v, causal=causal)
    dout, dlse = torch.randn_like(out), torch.zeros_like(lse)

    def forward():
        return torch.ops.flashop.attention_forward(q, k, v, causal=causal)

    def backward():
        return torch.ops.flashop.attention_backward(dout, dlse, q, k, v, out, lse_log2,
                                                    causal=causal)
    # the forward's tiles are those of its non-warp-specialized kernels (the warp-specialized
    # one has its own, WS_TILES)
    return {"fwd": (forward, {"warp_specialize": False}), "dkdv": (backward, {"dq_atomics": False}),
            "dq": (backward, {"dq_atomics": False}),
            "dkdv_atomic": (backward, {"dq_atomics": True}),
            # the dK/dV kernel's two parts at head dims above 128 (tiles.splits_dkdv)
            "dv": (backward, {"dq_atomics": False}), "dk": (backward, {"dq_atomics": False})}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads-dims", type=dims_list, default="64,128,256",
                        help="head dims D (or D/DV), comma-separated")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--causal", action="store_true",
                        help="under a causal bound (the tables' causal choices)")
    parser.add_argument("--tiles", default=None,
                        help="candidates to time instead of the autotuner's, e.g. "
                             "128x64x8x3,256x64x8x3xsplit")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="replay each candidate from a CUDA graph (kernel time without "
                             "the host's launch overhead, which short sequences otherwise show)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    kinds = [x for x in args.kinds.split(",") if x]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown kinds {unknown}; choose from {','.join(KINDS)}")
    given = parse_tiles(args.tiles) if args.tiles else None
    if not torch.cuda.is_available():
        print("tune.py needs a CUDA GPU", file=sys.stderr)
        return 2
    N = args.seqlen
    steps = [(dims, kind, t) for dims in args.heads_dims for kind in kinds
             for t in (given or candidates(kind, *dims))]
    rows, best, calls = [], {}, {}
    bar = progress(steps, desc="tiles", label=lambda s: f"D={dims_label(*s[0])} {s[1]} {s[2]}")
    for (D, DV), kind, t in bar:
        name = dims_label(D, DV)
        if (D, DV) not in calls:  # one head dim's inputs at a time
            calls = {(D, DV): kernel_calls(D, DV, N, args.causal)}
        fn, switches = calls[(D, DV)][kind]
        try:
            with config.override(**switches), tiles.force(kind, t):
                fn()
                run = graphed(fn) if args.cuda_graph else fn
                ms = do_bench(run, warmup=10, rep=40, return_mode="median")
        except (triton.runtime.errors.OutOfResources, RuntimeError) as e:
            bar.write(f"  D={name} {kind} {t}: {type(e).__name__}")
            continue
        B, H = 16384 // N, 2048 // DV
        tflops = FLOPS_FACTOR[kind] * flops(B, H, N, D, args.causal, "fwd", DV) / ms * 1e-9
        rows.append(dict(D=D, DV=DV, N=N, causal=args.causal, kind=kind, BLOCK_M=t.BLOCK_M,
                         BLOCK_N=t.BLOCK_N, split_m=t.split_m, num_warps=t.num_warps,
                         num_stages=t.num_stages, ms=round(ms, 4), tflops=round(tflops, 1)))
        bar.write(f"  D={name} {kind} {t}: {ms:.3f} ms {tflops:.0f} TFLOP/s")
        if (name, D, kind) not in best or ms < best[(name, D, kind)][0]:
            best[(name, D, kind)] = (ms, t)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; best tiles (B={16384 // N}, N={N}, "
          f"bf16, {'causal' if args.causal else 'non-causal'}):")
    for (name, D, kind), (ms, t) in sorted(best.items()):
        current = tiles.tiles_for(kind, D, torch.bfloat16, torch.device("cuda"),
                                  causal=args.causal, short=tiles.is_short(N))
        print(f"  D={name:>7} {kind:>11}: {t}  {ms:.3f} ms   (table: {current})")
    if args.out and rows:
        write_csv(Path(args.out), rows, fieldnames=list(rows[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
