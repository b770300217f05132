"""Host time of a call too small for its kernels to matter: flashop against SDPA, eager and in
a graph compiled with ``fullgraph=True``, forward (no gradient) and forward + backward.
Each figure is the median over ``--rounds`` rounds of ``--calls`` calls each, the GPU
synchronized at each round's end: with kernels this short the GPU waits on the host, so it
is the host's time per call. The ratio column is flashop's time over SDPA's in the same
mode and pass (the speed issue's goals: at most 1.5x eager, 1.2x compiled). In eager mode a
third row, ``sdpa-python``, calls SDPA's flash kernels through a ``torch.autograd.Function``
written in Python, as any operator with a Python autograd formula is called: what such an
operator costs with no work of its own.

    python benchmarks/host_time.py                     # B=1, S=128, H=1, D=64, causal, bf16
    python benchmarks/host_time.py --shape 1,1024,16,128 --csv host.csv
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import import_flashop, write_csv  # noqa: E402

CSV_HEADER = ["gpu", "torch", "triton", "dtype", "batch", "seq", "heads", "dim", "causal",
              "mode", "pass", "provider", "us_per_call", "vs_sdpa"]


def per_call(fn, calls: int, rounds: int) -> float:
    """The median over rounds of the time per call in µs (synchronized at round ends)."""
    for _ in range(max(calls // 4, 10)):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="1,128,1,64", help="B,S,H,D")
    parser.add_argument("--non-causal", action="store_true")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"])
    parser.add_argument("--csv", default=None, metavar="PATH")
    args = parser.parse_args()
    flashop = import_flashop()
    import triton

    B, S, H, D = map(int, args.shape.split(","))
    causal = not args.non_causal
    dtype = torch.bfloat16
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    dout_t = dout.transpose(1, 2)

    def flashop_call(q, k, v):
        return flashop.attention(q, k, v, causal=causal)

    def sdpa_call(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    class PythonSDPA(torch.autograd.Function):
        """SDPA's flash forward and backward operators behind a Python autograd formula."""

        @staticmethod
        def forward(ctx, q, k, v):
            out, lse, cq, ck, mq, mk, seed, offset, _ = (
                torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal))
            ctx.save_for_backward(q, k, v, out, lse, cq, ck, seed, offset)
            ctx.lengths = (mq, mk)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse, cq, ck, seed, offset = ctx.saved_tensors
            return torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, cq, ck, *ctx.lengths, 0.0, causal, seed, offset)

    calls = {"flashop": (flashop_call, (q, k, v), dout),
             "sdpa": (sdpa_call, (qt, kt, vt), dout_t),
             "sdpa-python": (PythonSDPA.apply, (qt, kt, vt), dout_t)}
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}, torch {torch.__version__}, triton {triton.__version__}; B={B} S={S} H={H} "
          f"D={D} causal={causal} bf16")
    rows = []
    for mode in args.modes:
        for pass_ in ("fwd", "fwd+bwd"):
            times = {}
            for provider, (fn, inputs, cotangent) in calls.items():
                if provider == "sdpa-python" and mode != "eager":
                    continue
                if mode == "compiled":
                    torch._dynamo.reset()
                    fn = torch.compile(fn, fullgraph=True)
                if pass_ == "fwd":
                    def step(fn=fn, inputs=inputs):
                        with torch.no_grad():
                            fn(*inputs)
                else:
                    def step(fn=fn, inputs=inputs, cotangent=cotangent):
                        fn(*inputs).backward(cotangent)
                times[provider] = per_call(step, args.calls, args.rounds)
            for provider, us in times.items():
                ratio = us / times["sdpa"]
                print(f"{mode:9s} {pass_:8s} {provider:11s} {us:8.1f} us  {ratio:5.2f}x SDPA",
                      flush=True)
                rows.append(dict(zip(CSV_HEADER, [
                    gpu, torch.__version__, triton.__version__, "bf16", B, S, H, D, causal,
                    mode, pass_, provider, f"{us:.1f}", f"{ratio:.2f}"])))
    if args.csv:
        write_csv(Path(args.csv), rows, CSV_HEADER)


if __name__ == "__main__":
    main()
