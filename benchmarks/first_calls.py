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
    parser.add_argument("--spin", type=float, default=0.0,
                        help="keep the GPU busy this many seconds before call 2 (after a "
                             "compile the GPU idles at low clocks, which slows the calls "
                             "right after it)")
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

    def sm_clock() -> str:
        try:
            return f"{torch.cuda.clock_rate()} MHz"
        except Exception:  # noqa: BLE001  (no NVML)
            return "?"

    for i in range(1, args.calls + 1):
        if i == 2 and args.spin:
            a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
            end = time.perf_counter() + args.spin
            while time.perf_counter() < end:
                for _ in range(10):
                    a @ a
                torch.cuda.synchronize()
            print(f"after {args.spin} s of matmuls: SM clock {sm_clock()}")
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
        clock = sm_clock()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start = time.perf_counter()
        begin.record()
        call()
        end.record()
        host = (time.perf_counter() - start) * 1e3
        torch.cuda.synchronize()
        print(f"call {i}: {(time.perf_counter() - start) * 1e3:.2f} ms (host {host:.2f} ms, "
              f"device {begin.elapsed_time(end):.2f} ms; SM clock before: {clock})")


if __name__ == "__main__":
    main()
