"""Time the first calls of one configuration in this (fresh) process: import, the first call
(which compiles, or loads from Triton's cache), and the calls after it, each forward +
backward synchronized. ``--profile N`` prints where call N's host time goes (cProfile) and
what runs on the device then (torch.profiler).

    python benchmarks/first_calls.py                      # B=2, S=2048, H=16, D=128, causal
    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/first_calls.py --profile 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

START = time.perf_counter()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flashop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="2,2048,16,128", help="B,S,H,D")
    parser.add_argument("--non-causal", action="store_true")
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--profile", type=int, default=0, help="profile this call (1-based)")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    import flashop

    imported = time.perf_counter()
    print(f"import torch + flashop: {imported - START:.2f} s")
    B, S, H, D = map(int, args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(B, S, H, D, device="cuda", dtype=dtype)
    torch.cuda.synchronize()

    def call():
        out = flashop.attention(q, k, v, causal=not args.non_causal)
        out.backward(dout)
        q.grad = k.grad = v.grad = None

    for i in range(1, args.calls + 1):
        if i == args.profile:
            import cProfile
            import pstats

            from torch.profiler import ProfilerActivity, profile

            prof = cProfile.Profile()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
                start = time.perf_counter()
                prof.enable()
                call()
                torch.cuda.synchronize()
                prof.disable()
                ms = (time.perf_counter() - start) * 1e3
            print(f"call {i}: {ms:.2f} ms (profiled)")
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
            print(tp.key_averages().table(sort_by="cpu_time_total", row_limit=20))
            continue
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        print(f"call {i}: {(time.perf_counter() - start) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
