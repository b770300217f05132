"""flashop's forward with and without its warp-specialized kernel, side by side on one GPU.

For each point (head dim, length, layout), the same inputs run through the forward with
``launch.WARP_SPECIALIZE`` unset (the default rule: attention_fwd_ws_kernel where it applies)
and set to False (the split kernel), alternating for ``--rounds`` rounds; each reading is
the median of do_bench over replays of a CUDA graph of one call (kernel time, without the
host's launch overhead). Prints both series and the largest difference between the two
kernels' outputs and log-sum-exps. bf16, non-causal, 16384 tokens per batch, hidden size
2048 (the grid of benchmarks/attention.py).

    python benchmarks/fwd_ws.py --points 128:16384,128:4096,96:4096:bhsd [--out ab.csv]
"""

import argparse
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import HIDDEN, TOKENS, import_flashop, write_csv  # noqa: E402


def graphed(fn):
    """fn captured in a CUDA graph (after one eager call): its replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def inputs(D, N, layout):
    """q, k, v of the grid's shape at (D, N), stored (B, N, H, D) or head-major."""
    B, H = TOKENS // N, HIDDEN // D
    if layout == "bhsd":
        return [torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                for _ in range(3)]
    return [torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", default="128:16384,128:4096,128:1024",
                   help="D:N[:bhsd], comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("fwd_ws.py needs a CUDA GPU")
        return 2
    flashop = import_flashop()
    launch = flashop.launch
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}")
    rows = []
    for point in args.points.split(","):
        D, N, *rest = point.split(":")
        D, N, layout = int(D), int(N), (rest[0] if rest else "bshd")
        q, k, v = inputs(D, N, layout)
        flops = 4 * q.shape[0] * q.shape[2] * N * N * D
        uses = launch._uses_ws(q, k, v, launch._PLAIN_FLAGS[False], D, N, False)
        series, outputs = {"split": [], "ws": []}, {}
        for r in range(args.rounds):
            for kernel, setting in (("split", False), ("ws", None)):
                launch.WARP_SPECIALIZE = setting
                with torch.no_grad():
                    outputs[kernel] = flashop.attention_with_lse(q, k, v)
                    ms = do_bench(graphed(lambda: flashop.attention_with_lse(q, k, v)),
                                  warmup=10, rep=50, return_mode="median")
                series[kernel].append(flops / ms * 1e-9)
                rows.append(dict(D=D, N=N, layout=layout, kernel=kernel, round=r,
                                 ms=round(ms, 4), tflops=round(flops / ms * 1e-9, 1)))
        launch.WARP_SPECIALIZE = None
        d_out = (outputs["ws"][0].float() - outputs["split"][0].float()).abs().max().item()
        d_lse = (outputs["ws"][1] - outputs["split"][1]).abs().max().item()
        print(f"D={D} N={N} {layout} (warp-specialized kernel applies: {uses}): split "
              + " ".join(f"{x:.0f}" for x in series["split"]) + " | ws "
              + " ".join(f"{x:.0f}" for x in series["ws"])
              + f" TFLOP/s | max |out diff| {d_out:.2e}, |lse diff| {d_lse:.2e}", flush=True)
    if args.out:
        write_csv(Path(args.out), rows, fieldnames=list(rows[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
