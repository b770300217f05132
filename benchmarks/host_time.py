"""Host time of one eager call, layer by layer: where the microseconds before a kernel
launch go (Triton's launch, flashop's launcher, validation, the custom-op dispatcher,
autograd), with SDPA and FlexAttention beside them.

    python benchmarks/host_time.py [--calls 500] [--profile 25]

Each layer is timed on tiny inputs (B=1, N=128, H=2, D=64, bf16) whose kernels take a few
microseconds, so the GPU keeps up and the wall time per call is the host's. do_bench, as
benchmarks/attention.py uses it, puts that host time inside every measured call: at N = 1k
it is a visible share of the figure.
"""

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import import_flashop  # noqa: E402


def host_us(fn, calls: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean wall time (µs) of ``calls`` calls of ``fn``."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs)


def captured_forward_launch(flashop, q, k, v):
    """The forward kernel's launch as flashop's launcher makes it, replayable alone."""
    from torch._library.triton import set_wrap_triton_enabled
    launch = flashop.launch
    seen = {}
    original = launch._launch

    def capture(kernel, kind, t, grid, *args, lengths, autotune=False, **meta):
        seen.update(kernel=kernel, t=t, grid=grid(t.BLOCK_M, t.BLOCK_N), args=args, meta=meta)
        return original(kernel, kind, t, grid, *args, lengths=lengths, autotune=autotune,
                        **meta)

    launch._launch = capture
    try:
        with set_wrap_triton_enabled(False):
            launch.attention_forward(q, k, v, None, launch.PLAIN[True])
    finally:
        launch._launch = original
    kernel, t, grid = seen["kernel"], seen["t"], seen["grid"]
    return lambda: kernel[grid](*seen["args"], 0, **t.constexprs("fwd"),
                                num_warps=t.num_warps, num_stages=t.num_stages, **seen["meta"])


def layers(flashop, calls, peers=True):
    """(name, µs per call) from the innermost layer out; then SDPA's and FlexAttention's
    where ``peers``."""
    from torch._library.triton import set_wrap_triton_enabled
    launch, ops = flashop.launch, flashop.ops
    B, N, H, D = 1, 128, 2, 64
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    rows = []

    def add(name, fn):
        try:
            rows.append((name, host_us(fn, calls)))
        except Exception as e:  # a layer that cannot run here is reported, not fatal
            rows.append((name, f"failed: {type(e).__name__}: {e}"[:200]))

    def eager(fn):
        """``fn`` as the registered op runs it eagerly: wrap_triton hands back the kernel."""
        def run():
            with set_wrap_triton_enabled(False):
                fn()
        return run

    add("triton launch of the forward kernel", captured_forward_launch(flashop, q, k, v))
    add("flashop launcher (launch.attention_forward)",
        eager(lambda: launch.attention_forward(q, k, v, None, launch.PLAIN[True])))
    add("op body: validation + launcher",
        eager(lambda: ops.attention_forward._init_fn(q, k, v, causal=True)))
    add("torch.ops.flashop.attention_forward", lambda: torch.ops.flashop.attention_forward(
        q, k, v, causal=True))
    add("torch.ops.flashop.attention", lambda: torch.ops.flashop.attention(q, k, v, causal=True))
    add("torch.ops.flashop.attention, inputs requiring grad",
        lambda: torch.ops.flashop.attention(qg, kg, vg, causal=True))
    add("flashop.attention, inputs requiring grad (direct eager path)",
        lambda: flashop.attention(qg, kg, vg, causal=True))
    out = torch.ops.flashop.attention(qg, kg, vg, causal=True)
    do = torch.randn_like(out)
    add("backward: out.backward(do, retain_graph=True)",
        lambda: out.backward(do, retain_graph=True))
    direct = flashop.attention(qg, kg, vg, causal=True)
    add("backward of the direct eager path's output",
        lambda: direct.backward(do, retain_graph=True))
    o, lse, lse2 = torch.ops.flashop.attention_forward(q, k, v, causal=True)
    add("backward op: torch.ops.flashop.attention_backward",
        lambda: torch.ops.flashop.attention_backward(do, torch.zeros_like(lse), q, k, v, o, lse2,
                                                     causal=True))
    add("backward launcher (launch.attention_backward)",
        eager(lambda: launch.attention_backward(do, torch.zeros_like(lse), q, k, v, o, lse2,
                                                None, launch.PLAIN[True], False)))
    if not peers:
        return rows, (qg, kg, vg)
    qt, kt, vt = (x.transpose(1, 2) for x in (qg, kg, vg))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        add("SDPA cuDNN, inputs requiring grad", lambda: torch.nn.functional
            .scaled_dot_product_attention(qt, kt, vt, is_causal=True))
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention)
    mask = create_block_mask(lambda b, h, i, j: i >= j, B=None, H=None, Q_LEN=N, KV_LEN=N,
                             device="cuda")
    add("FlexAttention (compiled), inputs requiring grad",
        lambda: flex(qt, kt, vt, block_mask=mask))
    fo = flex(qt, kt, vt, block_mask=mask)
    fdo = torch.randn_like(fo)
    add("FlexAttention backward", lambda: fo.backward(fdo, retain_graph=True))
    return rows, (qg, kg, vg)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--profile", type=int, default=25,
                   help="cProfile a grad-requiring call: how many functions to list (0: none)")
    p.add_argument("--no-peers", action="store_true", help="flashop's layers only")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_time.py needs a CUDA GPU")
        return 2
    flashop = import_flashop()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; host µs per eager call (B=1, N=128, H=2, D=64, bf16, causal)")
    rows, (qg, kg, vg) = layers(flashop, args.calls, peers=not args.no_peers)
    for name, us in rows:
        print(f"  {name:52s} {us:8.1f}" if isinstance(us, float) else f"  {name:52s} {us}")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            out = torch.ops.flashop.attention(qg, kg, vg, causal=True)
        out.sum().backward()
        prof.disable()
        torch.cuda.synchronize()
        print(f"\ncProfile of {args.calls} grad-requiring calls (tottime order):")
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
