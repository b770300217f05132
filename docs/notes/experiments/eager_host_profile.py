"""Host time of a tiny eager call (B=1, H=1, N=128, D=64, causal): flashop's forward (under
no_grad) and forward+backward beside SDPA's, median of rounds of calls, and a cProfile of
flashop's calls (sorted by own time).

On the CPU (no GPU needed) the kernels do not run, so that the figures are the Python around
them, the same code as on a GPU: run with TRITON_INTERPRET=1 (flashop refuses CPU tensors
otherwise). ``--launch cached`` (the default) stands in for triton 3.6 on a GPU: Triton's
launch returns a compiled kernel whose launch does nothing, so that flashop's cached
launches (flashop/_launch/launches.py; fastpath.py or common.py before it) run as they do there;
``--launch triton`` stops at Triton's interpreter instead (every launch takes Triton's path,
whose binding is not counted). SDPA runs its arithmetic on the CPU (milliseconds, on every
thread), so it is left out there unless ``--sdpa``: compare flashop's CPU figures with each
other, and with SDPA's on a GPU. On a GPU (``--device cuda``) the kernels run, synchronized
at the ends of rounds, and SDPA is timed beside flashop.

    TRITON_INTERPRET=1 PYTHONPATH=. python docs/notes/experiments/eager_host_profile.py
    PYTHONPATH=. python docs/notes/experiments/eager_host_profile.py --device cuda
    ... --profile fwd_bwd   # cProfile of flashop's forward+backward (or fwd)
    ... --fp8               # the bf16 forward beside the e4m3 one (with --profile fwd: its)
"""
import argparse
import cProfile
import inspect
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

import flashop

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cpu")
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--n", type=int, default=128)
parser.add_argument("--calls", type=int, default=200)
parser.add_argument("--rounds", type=int, default=15)
parser.add_argument("--launch", choices=("cached", "triton"), default="cached")
parser.add_argument("--profile", choices=("fwd", "fwd_bwd"), default=None)
parser.add_argument("--label", default="")
parser.add_argument("--sdpa", action="store_true", help="time SDPA on the CPU too")
parser.add_argument("--fp8", action="store_true",
                    help="flashop's forward on e4m3 q, k, v with their descales (entry 106)")
args = parser.parse_args()

device, dtype = torch.device(args.device), getattr(torch, args.dtype)
if device.type == "cpu":  # the Python around the launches only
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    class _Compiled:
        """A compiled kernel whose launch does nothing."""
        function = packed_metadata = None

        def run(self, *_):
            pass

    class _Param:
        def __init__(self, p):
            self.name, self.default = p.name, p.default

    class _Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 0

    compiled = _Compiled()
    InterpretedFunction.run = lambda self, *a, grid, warmup, **kw: compiled
    if args.launch == "cached":
        InterpretedFunction.params = property(
            lambda self: [_Param(p) for p in inspect.signature(self.fn).parameters.values()])
        triton.runtime.driver.set_active(_Driver())
        from flashop._launch import common
        try:
            from flashop._launch import launches, plans
            launches.triton_allows_cached_launches = lambda: True
        except ImportError:  # before launches.py and plans.py (one module, or common.py)
            try:
                from flashop._launch import fastpath as launches
            except ImportError:  # before the fast path's module
                launches = common
            launches._triton_allows_cached_launches = lambda: True
            plans = launches
        if hasattr(plans, "Plan"):  # a plan's replay launches on a stream, as on a GPU
            def _replay(self, call_args, _device):
                pool = list(call_args)
                for step in self.steps:
                    step(pool, 0)
                return self.outputs(pool)
            plans.Plan._replay = _replay

q, k, v = (torch.randn(1, args.n, 1, 64, device=device, dtype=dtype, requires_grad=True)
           for _ in range(3))
dout = torch.randn_like(q)
qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
doutt = dout.transpose(1, 2)


def fa_fwd():
    with torch.no_grad():
        flashop.attention(q, k, v, causal=True)


q8, k8, v8 = (x.detach().to(torch.float8_e4m3fn) for x in (q, k, v))
descales = {f"{n}_descale": torch.rand(1, 1, device=device) + 0.5 for n in "qkv"}


def fa_fp8_fwd():  # e4m3 inputs, each with its (B, H_kv) descale
    flashop.attention(q8, k8, v8, causal=True, **descales)


def fa_fwd_bwd():
    flashop.attention(q, k, v, causal=True).backward(dout)


def sd_fwd():
    with torch.no_grad():
        F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)


def sd_fwd_bwd():
    F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).backward(doutt)


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize()


def per_call(fn) -> tuple:
    """(median, min) over the rounds of the time per call, in us (the min: on shared CPUs)."""
    for _ in range(50):
        fn()
    sync()
    times = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / args.calls * 1e6)
    return statistics.median(times), min(times)


if args.profile:
    fn = (fa_fp8_fwd if args.fp8 else fa_fwd) if args.profile == "fwd" else fa_fwd_bwd
    for _ in range(50):
        fn()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        fn()
    sync()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(30)
else:
    sdpa = device.type != "cpu" or args.sdpa
    runs = (("flashop fwd", fa_fwd), ("sdpa fwd", sd_fwd), ("flashop fwd+bwd", fa_fwd_bwd),
            ("sdpa fwd+bwd", sd_fwd_bwd))
    if args.fp8:
        runs = (("flashop fwd", fa_fwd), ("flashop fp8 fwd", fa_fp8_fwd))
        sdpa = False
    results = {name: per_call(fn) for name, fn in runs if sdpa or name.startswith("flashop")}
    for name, (median, least) in results.items():
        print(f"host {args.label} {device.type} {name}: {median:.1f} us (min {least:.1f})",
              flush=True)
    for what in ("fwd", "fwd+bwd") if sdpa else ():
        print(f"ratio {args.label} {what}: flashop / sdpa = "
              f"{results['flashop ' + what][0] / results['sdpa ' + what][0]:.2f}")
