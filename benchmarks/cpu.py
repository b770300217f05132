"""flashop's CPU path against SDPA's CPU kernels (``F.scaled_dot_product_attention``):
forward and forward + backward, ms, on this machine's CPU.

    python benchmarks/cpu.py                      # (4, 512, 8, 64), fp32 and bf16
    python benchmarks/cpu.py --shape 2,1024,16,64 --dtypes bfloat16 --reps 9 --threads 1

Each row's flashop call and its SDPA peer (the same attention: not causal, or causal) run
alternately, repetition after repetition, and each keeps its fastest repetition, so that a
machine shared with other work slows both alike. Rows: plain calls (16-bit ones take SDPA's
kernels inside flashop, fp32 ones the blocked path), the blocked path on the same attention
(a window spanning every key, which no SDPA kernel takes: not causal, and causal as
``window_size=(S, 0)``), and two modifiers; ``path`` says which ran. Runs without a GPU;
Triton's interpreter need not be off (the CPU path is switched on).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flashop


def _variants(S: int) -> list:
    """(name, flashop's options, whether its SDPA peer is causal)."""
    return [("plain", {}, False), ("causal", dict(causal=True), True),
            ("window of every key", dict(window_size=(S, S)), False),
            ("causal as a window", dict(window_size=(S, 0)), True),
            ("softcap 30", dict(softcap=30.0), False), ("ALiBi", dict(alibi=True), False)]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(B: int, S: int, H: int, D: int, dtype: torch.dtype, reps: int) -> list:
    """Rows (name, path, flashop fwd ms, fwd+bwd ms, SDPA fwd ms, fwd+bwd ms), fastest of
    ``reps`` alternating repetitions."""
    from unittest import mock

    import flashop
    from flashop._launch.cpu import attention as cpu_attention

    q, k, v = (torch.randn(B, S, H, D, dtype=dtype, requires_grad=True) for _ in range(3))
    sq, sk, sv = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    slopes = torch.rand(H)
    rows = []
    for name, options, causal in _variants(S):
        options = dict(options)
        alibi = slopes if options.pop("alibi", False) else None

        def ours():
            return flashop.attention(q, k, v, alibi_slopes=alibi, **options)

        def peer():
            return F.scaled_dot_product_attention(sq, sk, sv, is_causal=causal)

        with mock.patch.object(cpu_attention, "_sdpa_forward",
                               wraps=cpu_attention._sdpa_forward) as sdpa:
            ours()
        path = "SDPA's" if sdpa.called else "blocked"
        best = [float("inf")] * 4
        for _ in range(reps + 1):  # the first repetition warms up
            for i, fn in enumerate((ours, peer)):
                with torch.no_grad():
                    forward = _timed(fn)
                both = _timed(lambda: fn().sum().backward())
                best[2 * i] = min(best[2 * i], forward)
                best[2 * i + 1] = min(best[2 * i + 1], both)
        rows.append((name, path, *(1000 * t for t in best)))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="4,512,8,64", help="B,S,H,D")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch's threads (0: as set)")
    args = parser.parse_args(argv)
    import flashop

    if args.threads:
        torch.set_num_threads(args.threads)
    B, S, H, D = map(int, args.shape.split(","))
    print(f"flashop {flashop.__version__}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; (B, S, H, D) = ({B}, {S}, {H}, {D}); fastest of {args.reps} repetitions")
    print(f"{'dtype':>9}  {'call':<20} {'path':<8} {'fwd ms':>7} {'fwd+bwd':>8} "
          f"{'SDPA fwd':>9} {'fwd+bwd':>8} {'ratio fwd+bwd':>13}")
    with flashop.config.override(cpu_path=True):
        for dtype in args.dtypes.split(","):
            for name, path, fwd, both, sdpa_fwd, sdpa_both in measure(
                    B, S, H, D, getattr(torch, dtype), args.reps):
                print(f"{dtype:>9}  {name:<20} {path:<8} {fwd:7.1f} {both:8.1f} "
                      f"{sdpa_fwd:9.1f} {sdpa_both:8.1f} {both / sdpa_both:13.2f}", flush=True)


if __name__ == "__main__":
    main()
