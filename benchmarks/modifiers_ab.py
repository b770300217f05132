"""One flashop checkout's causal forward and backward under ALiBi, a gate and a bf16 bias,
with the backward's kernel times: run it once per checkout, alternating, to compare two
versions of the kernels on one GPU (docs/performance-notes.md, entry 42).

bf16, D = 128, N = 4096, B = 4, H = 16 (the grid's shape at 4k). TFLOP/s as
benchmarks/attention.py counts them (causal: half the pairs; backward 2.5x the forward);
kernel times are the profiler's mean over five backward calls.

    python benchmarks/modifiers_ab.py --root /path/to/checkout --tag before
"""

import argparse
import collections
import sys
from pathlib import Path

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, help="the checkout whose flashop is imported")
    p.add_argument("--tag", default="", help="printed at the start of each line")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("modifiers_ab.py needs a CUDA GPU")
        return 2
    sys.path.insert(0, str(Path(args.root).resolve()))
    sys.path.insert(1, str(Path(__file__).resolve().parent))
    import flashop
    from attention import bench_one
    print(f"{args.tag}: flashop from {flashop.__file__}")
    N, D, B, H = 4096, 128, 4, 16
    torch.manual_seed(0)
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1, device="cuda") / H)
    g = torch.nn.functional.logsigmoid(torch.randn(B, N, H, device="cuda") + 4)
    bias = torch.randn(1, 1, N, N, device="cuda", dtype=torch.bfloat16)
    variants = {"bias": dict(attn_mask=bias), "alibi": dict(alibi_slopes=slopes),
                "gate": dict(g=g)}
    q, k, v = [torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3)]
    flops = 4 * B * H * N * N * D / 2
    for name, kwargs in variants.items():
        def fn(q, k, v):
            return flashop.attention(q, k, v, causal=True, **kwargs)
        ms = bench_one(fn, (q, k, v), ("fwd", "bwd"), 10, 50)
        out = fn(q, k, v)
        dout = torch.randn_like(out)
        out.backward(dout, retain_graph=True)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                out.backward(dout, retain_graph=True)
            torch.cuda.synchronize()
        kernels = collections.defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and "attention" in e.name:
                kernels[e.name] += e.device_time / 5
        times = " ".join(f"{n.split('_kernel')[0]}={us:.0f}us"
                         for n, us in sorted(kernels.items()))
        print(f"{args.tag} {name}: fwd {flops / ms['fwd'] * 1e-9:.0f} bwd "
              f"{2.5 * flops / ms['bwd'] * 1e-9:.0f} TFLOP/s | {times}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
