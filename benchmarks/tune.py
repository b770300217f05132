"""Sweep the tile sizes of each attention kernel on this GPU and print the fastest.

The candidates are the autotuner's (``flashop.launch.TILE_CANDIDATES``, pruned to the GPU's
shared memory).

Times bf16 N=4096 (or --seqlen), B=16384/N, H=2048/D (non-causal, or --causal): the forward
alone for forward tiles; the whole backward for dK/dV and dQ tiles, varying one kernel's
tiles at a time (the deterministic backward for "dkdv" and "dq", the one with atomic dQ for
"dkdv_atomic"). The chosen tiles go into flashop/launch.py by hand; the full sweep is
written to --out as CSV.

    python benchmarks/tune.py --heads-dims 64,128,256 --out tune.csv
    python benchmarks/tune.py --heads-dims 128 --seqlen 1024 --causal --kinds fwd \
        --tiles 128x64x8x3,64x64x4x2
"""

import argparse
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

try:
    import flashop  # noqa: F401 - registers torch.ops.flashop
except ImportError:
    sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
    import flashop  # noqa: F401
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import write_csv  # noqa: E402
from flashop import launch


def parse_tiles(spec):
    """``BLOCK_MxBLOCK_NxWARPSxSTAGES[xsplit],...`` -> [Tiles]."""
    tiles = []
    for item in spec.split(","):
        parts = item.split("x")
        split = parts[4:] == ["split"]
        tiles.append(launch.Tiles(*map(int, parts[:4]), split_m=split))
    return tiles


def candidates(kind, D):
    """The autotuner's candidates (flashop.launch.TILE_CANDIDATES) that fit this GPU."""
    block = launch._block_dim(D)
    props = triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())
    return launch.prune_tiles(kind, block, block, 2, props["max_shared_mem"])


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads-dims", default="64,128,256")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--kinds", default="fwd,dkdv,dq,dkdv_atomic")
    parser.add_argument("--causal", action="store_true",
                        help="under a causal bound (the tables' causal choices)")
    parser.add_argument("--tiles", default=None,
                        help="candidates to time instead of the autotuner's, e.g. "
                             "128x64x8x3,256x64x8x3xsplit")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="replay each candidate from a CUDA graph (kernel time without "
                             "the host's launch overhead, which short sequences otherwise show)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("tune.py needs a CUDA GPU")
        return 2
    default_tiles = launch.tiles_for
    rows, best = [], {}
    for D in (int(d) for d in args.heads_dims.split(",")):
        N = args.seqlen
        B, H = 16384 // N, 2048 // D
        q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        out, lse, lse_log2 = torch.ops.flashop.attention_forward(q, k, v, causal=args.causal)
        dout, dlse = torch.randn_like(out), torch.zeros_like(lse)
        fwd = lambda: torch.ops.flashop.attention_forward(  # noqa: E731
            q, k, v, causal=args.causal)

        def bwd(deterministic):
            return lambda: launch.attention_backward(
                dout, dlse, q, k, v, out, lse_log2, None, launch.PLAIN[args.causal], False,
                deterministic=deterministic)
        flops = 4 * B * H * N * N * D // (2 if args.causal else 1)
        kinds = (("fwd", fwd, 1.0), ("dkdv", bwd(True), 2.5), ("dq", bwd(True), 2.5),
                 ("dkdv_atomic", bwd(False), 2.5))
        for kind, fn, mult in (x for x in kinds if x[0] in args.kinds.split(",")):
            results = []
            for t in parse_tiles(args.tiles) if args.tiles else candidates(kind, D):
                launch.tiles_for = (lambda kd, hd, dt, dev, t=t, kind=kind, **kw:
                                    t if kd == kind else default_tiles(kd, hd, dt, dev, **kw))
                try:
                    fn()
                    run = graphed(fn) if args.cuda_graph else fn
                    ms = do_bench(run, warmup=10, rep=40, return_mode="median")
                except (triton.runtime.errors.OutOfResources, RuntimeError) as e:
                    print(f"  D={D} {kind} {t}: {type(e).__name__}", flush=True)
                    continue
                finally:
                    launch.tiles_for = default_tiles
                tflops = mult * flops / ms * 1e-9
                results.append((ms, t))
                rows.append(dict(D=D, N=N, causal=args.causal, kind=kind, BLOCK_M=t.BLOCK_M,
                                 BLOCK_N=t.BLOCK_N, split_m=t.split_m,
                                 num_warps=t.num_warps, num_stages=t.num_stages,
                                 ms=round(ms, 4), tflops=round(tflops, 1)))
                print(f"  D={D} {kind} {t}: {ms:.3f} ms {tflops:.0f} TFLOP/s", flush=True)
            if results:
                best[(D, kind)] = min(results, key=lambda r: r[0])
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; best tiles (B={16384 // args.seqlen}, N={args.seqlen}, "
          f"bf16, {'causal' if args.causal else 'non-causal'}):")
    for (D, kind), (ms, t) in sorted(best.items()):
        cur = default_tiles(kind, D, torch.bfloat16, torch.device("cuda"), causal=args.causal)
        print(f"  D={D:>3} {kind:>4}: {t}  {ms:.3f} ms   (current {cur})")
    if args.out:
        write_csv(Path(args.out), rows, fieldnames=list(rows[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
