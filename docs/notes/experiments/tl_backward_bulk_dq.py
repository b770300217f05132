"""The `tl` backward with dQ added by the copy engine's bulk reduce-add (performance notes,
entry 109).

The `tl` backward's default form runs seven products per tile pair (the dQ kernel's three,
the dK/dV kernel's four); its form with dQ by atomics five, but its dK/dV kernel adds each
[BLOCK_M, D] fp32 dQ tile by one atomic per element, and measured slower. Here the same
kernel adds the tile by one bulk reduce-add through a tensor descriptor made in the kernel
(``DQ_TMA``: triton's ``tensor_descriptor.atomic_add``, PTX ``cp.reduce.async.bulk.tensor``),
as the Gluon backward does.

Not kept: the kernel's DQ_TMA flag and the launcher's rule are in
``tl_backward_bulk_dq.patch`` (apply to 46cbbd7 with ``git apply``) for this script.

Times the whole backward launcher per variant (bf16, 16k tokens per batch, hidden 2048),
checks each variant's gradients against the `tl` default's (relative Frobenius error) and
times cuDNN's backward in the same process.

    python docs/notes/experiments/tl_backward_bulk_dq.py [--head-dims 64,128] [--lengths ...]
    python docs/notes/experiments/tl_backward_bulk_dq.py --compile   # sm_90 offline
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

ap = argparse.ArgumentParser()
ap.add_argument("--compile", action="store_true", help="compile for sm_90 without a GPU")
ap.add_argument("--lengths", default="4096,16384")
ap.add_argument("--head-dims", default="64,128")
ap.add_argument("--variants", default="tl,tl-atomic,tl-bulk,tl-bulk-64x128x8x2,"
                                      "tl-bulk-64x64x4x3,gluon")
ap.add_argument("--profile", action="store_true", help="each kernel's time (torch.profiler)")
args = ap.parse_args()

if args.compile:
    import compile_sm90  # noqa: F401  (installs a driver that reports sm_90)

import torch  # noqa: E402
from torch._library.triton import set_wrap_triton_enabled  # noqa: E402

from flashop import config  # noqa: E402
from flashop._launch import attention as A, fastpath, tiles  # noqa: E402
from flashop._launch.options import PLAIN  # noqa: E402
from flashop._launch.tiles import Tiles  # noqa: E402

DEVICE = "cpu" if args.compile else "cuda"
_bulk = A.dq_by_bulk_adds
if args.compile:
    tiles.is_hopper = A.is_hopper = lambda device: True
    _bulk = lambda q: True  # noqa: E731
    fastpath._launch_now = lambda kernel, grid, kwargs: kernel.warmup(grid=grid, **kwargs)


def variant_settings(name: str):
    """(switches, bulk adds or not, forced tiles) of a variant's name."""
    if name == "tl":
        return {"gluon": False}, False, {}
    if name == "gluon":
        return {}, False, {}
    if name == "tl-atomic":
        return {"gluon": False, "dq_atomics": True}, False, {}
    if name.startswith("tl-bulk"):
        forced = {}
        if name != "tl-bulk":
            forced["dkdv_atomic"] = Tiles(*map(int, name.split("-")[-1].split("x")))
        return {"gluon": False, "dq_atomics": True}, True, forced
    raise ValueError(name)


@contextlib.contextmanager
def variant(name):
    switches, bulk, forced = variant_settings(name)
    with contextlib.ExitStack() as stack:
        stack.enter_context(config.override(**switches))
        for kind, t in forced.items():
            stack.enter_context(tiles.force(kind, t))
        A.dq_by_bulk_adds = _bulk if bulk else (lambda q: False)
        stack.callback(setattr, A, "dq_by_bulk_adds", _bulk)
        yield


def inputs(N, causal, D):
    B, H = 16384 // N, 2048 // D
    g = torch.Generator(device=DEVICE).manual_seed(N + causal + D)
    mk = lambda: torch.randn(B, N, H, D, device=DEVICE, dtype=torch.bfloat16, generator=g)  # noqa
    q, k, v, dout = mk(), mk(), mk(), mk()
    mods = PLAIN[causal]
    with config.override(gluon=False):
        out, _, lse_log2 = A.attention_forward(q, k, v, None, mods)
    dlse = torch.zeros(B, H, N, device=DEVICE)
    return (dout, dlse, q, k, v, out, lse_log2, None, mods, False, None, False), (B, H)


def kernel_times(call):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            A.attention_backward(*call)
        torch.cuda.synchronize()
    for e in prof.key_averages():
        if e.device_time_total > 0:
            print(f"    {e.key[:60]:60s} {e.device_time_total / e.count / 1e3:8.3f} ms x "
                  f"{e.count // 10}", flush=True)


def cudnn(N, causal, B, H, D, flops):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    do = torch.randn_like(o)
    ms = do_bench(lambda: o.backward(do, retain_graph=True), warmup=50, rep=300,
                  grad_to_none=[q, k, v], return_mode="median")
    return ms, flops / ms * 1e-9


def run():
    rows = []
    for D in map(int, args.head_dims.split(",")):
        for N in map(int, args.lengths.split(",")):
            for causal in (False, True):
                call, (B, H) = inputs(N, causal, D)
                flops = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
                ref = None
                for name in args.variants.split(","):
                    with variant(name):
                        t0 = time.perf_counter()
                        grads = A.attention_backward(*call)
                        first = time.perf_counter() - t0
                        if args.compile:
                            print(f"compiled {name} D={D} N={N} causal={causal} in "
                                  f"{first:.1f} s", flush=True)
                            continue
                        torch.cuda.synchronize()
                        if ref is None:
                            ref = [g.float() for g in grads[:3]]
                        err = max(((g.float() - r).norm() / r.norm()).item()
                                  for g, r in zip(grads[:3], ref))
                        from triton.testing import do_bench
                        ms = do_bench(lambda: A.attention_backward(*call), warmup=50, rep=300,
                                      return_mode="median")
                        if args.profile:
                            kernel_times(call)
                    rows.append((D, N, causal, name, ms, flops / ms * 1e-9))
                    print(f"D={D} N={N:6d} causal={causal!s:5} {name:24s} {ms:8.3f} ms "
                          f"{flops / ms * 1e-9:6.1f} TFLOP/s  err {err:.1e}  first {first:.1f} s",
                          flush=True)
                if not args.compile:
                    ms, tf = cudnn(N, causal, B, H, D, flops)
                    rows.append((D, N, causal, "cudnn", ms, tf))
                    print(f"D={D} N={N:6d} causal={causal!s:5} {'cudnn':24s} {ms:8.3f} ms "
                          f"{tf:6.1f} TFLOP/s", flush=True)
                del call
    if rows:
        print("\nD, N, causal, variant, ms, TFLOP/s, vs cuDNN")
        for D, N, causal, name, ms, tf in rows:
            base = next(r for r in rows if r[:3] == (D, N, causal) and r[3] == "cudnn")
            print(f"{D},{N},{causal},{name},{ms:.3f},{tf:.1f},{tf / base[5]:.3f}")


if __name__ == "__main__":
    with set_wrap_triton_enabled(False):  # launched as eager calls launch them
        run()
