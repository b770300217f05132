"""Time each GPU kernel of flashop's forward and backward (and FlexAttention's) with the
PyTorch profiler: where a pass spends its time, kernel by kernel.

    python benchmarks/kernel_times.py [--D 128] [--N 4096,16384] [--causal both]

bf16, 16384 tokens per batch, hidden size 2048 (the grid of benchmarks/attention.py).
"""

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
import triton
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import (  # noqa: E402
    HIDDEN, PROVIDERS, TOKENS, flops, import_flashop, int_list, make_provider, switches_of,
)
from progress import progress  # noqa: E402


def kernel_times(fn, iters=10):
    """{kernel name: mean µs per call} of ``fn`` over ``iters`` calls after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name] += e.device_time / iters
    return dict(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--D", type=int_list, default=[128])
    p.add_argument("--N", type=int_list, default=[4096, 16384])
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--providers", default="flashop,flex",
                   help=f"comma-separated subset of {','.join(PROVIDERS)}")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("kernel_times.py needs a CUDA GPU")
        return 2
    import_flashop()
    causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}")
    points = [(D, N, causal, name) for D in args.D for N in args.N for causal in causals
              for name in args.providers.split(",")]
    bar = progress(points, desc="kernel times",
                   label=lambda p: f"D={p[0]} N={p[1]} causal={p[2]} {p[3]}")
    for D, N, causal, name in bar:
        B, H = TOKENS // N, HIDDEN // D
        fn, layout = make_provider(name, N, causal)
        shape = (B, N, H, D) if layout == "bnhd" else (B, H, N, D)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        with switches_of(fn):
            out = fn(q, k, v)
            dout = torch.randn_like(out)

            def bwd():
                q.grad = k.grad = v.grad = None
                out.backward(dout, retain_graph=True)
            for pass_, run in (("fwd", lambda: fn(q, k, v)), ("bwd", bwd)):
                times = kernel_times(run)
                total = sum(times.values())
                tf = flops(B, H, N, D, causal, pass_) / (total * 1e-6) * 1e-12
                bar.write(f"D={D} N={N} causal={causal} {name} {pass_}: {total:8.1f} us "
                          f"({tf:.0f} TFLOP/s of kernel time)")
                for kname, us in sorted(times.items(), key=lambda x: -x[1])[:6]:
                    bar.write(f"    {us:8.1f} us  {kname[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
