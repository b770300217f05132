"""Where the memory-bound MLA decode's time goes (H = 16; performance notes, entry 118).

For the protocol's memory-bound points (pages of 64, bf16), each split count: the attention
kernel's and the merge kernel's own times from the profiler (mean of 50 calls, kernels
only), their sum against the device's copy bandwidth, and the CUDA-graph replay time of the
whole call (decode.time_us, as the benchmark). Run from the repository root on a GPU:

    PYTHONPATH=. python docs/notes/experiments/mla_memory_bound.py [--splits 0,1,2,4,8,16,32]
"""

import argparse
import sys

import torch

sys.path.insert(0, "benchmarks")
import decode  # noqa: E402
import decode_mla  # noqa: E402

import flashop  # noqa: E402
import flashop._launch.options  # noqa: E402
from flashop._launch import mla as launch_mla  # noqa: E402

POINTS = [(32, 16, 8192, 1), (128, 16, 4096, 1), (64, 16, 16384, 1)]


def kernel_times(call, reps=50) -> dict:
    """{kernel name: mean device µs per call} over ``reps`` calls."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and "kernel" in e.key:
            times[e.key] = e.device_time_total / reps
    return times


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--splits", default="0,1,2,4,8,16,32")
    args = p.parse_args()
    copy = decode.copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy {copy} GB/s")
    print(f"{'B':>4} {'H':>3} {'L':>6} {'splits':>6} {'plan':>5} {'attn us':>8} {'merge us':>8} "
          f"{'sum':>7} {'replay us':>9} {'kernels/copy':>12} {'replay/copy':>11}")
    for point in POINTS:
        B, H, L, S_q = point
        q, _, pages, table, lengths = decode_mla.make_point(*point)
        gbytes = B * L * decode_mla.D * 2 / 1e9
        for s in (int(x) for x in args.splits.split(",")):
            def call(s=s):
                return flashop.attention_with_kvcache(
                    q, pages, pages[..., :decode_mla.DV], cache_seqlens=lengths,
                    block_table=table, scale=decode_mla.SCALE, num_splits=s)
            plan = launch_mla.attention_with_latent_cache(
                q, pages, pages[..., :decode_mla.DV], None, None, lengths, None, table,
                decode_mla.SCALE, flashop._launch.options.PLAIN[False], s, plan_only=True)
            planned = plan.decode.grid[0]
            times = kernel_times(call)
            attn = sum(t for k, t in times.items() if "mla_decode" in k)
            merge = sum(t for k, t in times.items() if "merge" in k)
            replay = decode.time_us(call, graph=True)
            frac = lambda us: f"{gbytes / (us * 1e-6) / copy:.3f}" if copy else "-"
            print(f"{B:>4} {H:>3} {L:>6} {s:>6} {planned:>5} {attn:8.1f} {merge:8.1f} "
                  f"{attn + merge:7.1f} {replay:9.1f} {frac(attn + merge):>12} {frac(replay):>11}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
