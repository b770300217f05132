"""The D = 256 backward with the dK/dV kernel split in two (performance notes, entry 107).

The `tl` dK/dV kernel at D = 256 holds dK and dV of its key tile, [BLOCK_N, 256] fp32 each,
and spills at every tile that fits (64 x 64 with 8 warps: 255 registers, 280 B of spills,
offline compile for sm_90). Launched twice with ``PARTS`` = 1 (dV alone: S^T and P^T dO)
and ``PARTS`` = 2 (dK alone: S^T, dP^T and dS^T Q; with dQ by atomics, also dS K), each
program holds one accumulator: no spills, and 128-key tiles fit. The cost is one more
product per tile pair (S^T twice): 8 products instead of 7 with the dQ kernel, 6 instead of
5 with dQ by atomics.

Times the whole backward launcher (flashop._launch.attention.attention_backward) per variant
at D = 256 (bf16, 16k tokens per batch, H = 8), checks each variant's gradients against the
default backward's (relative Frobenius error), and times cuDNN's backward in the same process.

    python docs/notes/experiments/d256_backward_split.py            # on a GPU
    python docs/notes/experiments/d256_backward_split.py --compile  # sm_90 offline, warms
                                                                    # TRITON_CACHE_DIR
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

ap = argparse.ArgumentParser()
ap.add_argument("--compile", action="store_true", help="compile for sm_90 without a GPU")
ap.add_argument("--lengths", default="4096,16384")
ap.add_argument("--variants", default="")
ap.add_argument("--head-dim", type=int, default=256)
ap.add_argument("--profile", action="store_true", help="each kernel's time (torch.profiler)")
args = ap.parse_args()

if args.compile:
    import compile_sm90  # noqa: F401  (installs a driver that reports sm_90)

import torch  # noqa: E402
from torch._library.triton import set_wrap_triton_enabled  # noqa: E402

from flashop import config  # noqa: E402
from flashop._launch import attention as A, choice, launches, tiles  # noqa: E402
from flashop._launch.options import PLAIN  # noqa: E402
from flashop._launch.tiles import Tiles  # noqa: E402

DEVICE = "cpu" if args.compile else "cuda"
if args.compile:
    tiles.is_hopper = choice.is_hopper = lambda device: True
    A.cpu.serves = choice.cpu.serves = lambda x: False  # CPU tensors stand in for the GPU's

    def _warm(kernel, grid, **kwargs):
        kernel.warmup(grid=grid, **kwargs)

    launches.launch_now = _warm

_launch = A._launch


def split(dv: Tiles, dk: Tiles):
    """A patch of the launchers' _launch: the dK/dV kernel launched as a dV and a dK kernel."""
    def patched(kernel, kind, t, grid, lengths, autotune=False, **kwargs):
        if kind in ("dkdv", "dkdv_atomic", "dv"):
            kwargs.pop("PARTS")
            _launch(kernel, kind, dv, grid, lengths, **kwargs, PARTS=1)
            _launch(kernel, kind, dk, grid, lengths, **kwargs, PARTS=2)
        elif kind == "dk":  # (launched above)
            pass
        else:
            _launch(kernel, kind, t, grid, lengths, autotune, **kwargs)
    return patched


def one_kernel(kernel, kind, t, grid, lengths, autotune=False, **kwargs):
    """A patch of _launch: the dK/dV kernel as one launch (as before tiles.splits_dkdv)."""
    if kind in ("dv", "dk"):
        if kind == "dv":
            t = tiles.tiles_for("dkdv", args.head_dim, torch.bfloat16, torch.device(DEVICE))
            _launch(kernel, "dkdv", t, grid, lengths, **{**kwargs, "PARTS": 3})
        return
    _launch(kernel, kind, t, grid, lengths, autotune, **kwargs)


def parse(spec: str) -> Tiles:
    """``64x128x8x2`` -> Tiles(64, 128, 8, 2)."""
    return Tiles(*map(int, spec.split("x")))


# name -> (switches, patch of _launch or None, forced tiles); "split-DV-DK" names the dV and
# dK kernels' tiles, "split-atomic-..." the same with dQ by atomics in the dK kernel
DEFAULT_VARIANTS = {
    256: "base,atomic,split-64x128x8x2-32x128x8x2,split-64x64x8x2-64x64x8x2,"
         "split-64x128x8x2-64x64x8x2,split-atomic-64x128x8x2-32x128x8x1",
    128: "base,split-64x128x8x3-64x128x8x3,split-128x128x8x2-128x128x8x2",
}


def variants(names: str) -> dict:
    found = {}
    for name in names.split(","):
        if name == "base":  # one dK/dV kernel (the table's tiles)
            found[name] = ({}, one_kernel, {})
        elif name == "atomic":
            found[name] = ({"dq_atomics": True}, None, {})
        elif name.startswith("split-"):
            atomic = name.startswith("split-atomic-")
            dv, dk = name.split("-")[-2:]
            found[name] = ({"dq_atomics": True} if atomic else {}, split(parse(dv), parse(dk)),
                           {})
        else:
            raise ValueError(f"unknown variant {name!r}")
    return found


VARIANTS = variants(args.variants or DEFAULT_VARIANTS[args.head_dim])


@contextlib.contextmanager
def variant(name):
    switches, patch, forced = VARIANTS[name]
    with contextlib.ExitStack() as stack:
        stack.enter_context(config.override(gluon=False, **switches))
        for kind, t in forced.items():
            stack.enter_context(tiles.force(kind, t))
        if patch is not None:
            A._launch = patch
            stack.callback(setattr, A, "_launch", _launch)
        yield


def inputs(N, causal, D=256):
    B, H = 16384 // N, 2048 // D
    g = torch.Generator(device=DEVICE).manual_seed(N + causal)
    mk = lambda: torch.randn(B, N, H, D, device=DEVICE, dtype=torch.bfloat16, generator=g)  # noqa
    q, k, v, dout = mk(), mk(), mk(), mk()
    mods = PLAIN[causal]
    with config.override(gluon=False):
        out, _, lse_log2 = A.attention_forward(q, k, v, None, mods)
    dlse = torch.zeros(B, H, N, device=DEVICE)
    return (dout, dlse, q, k, v, out, lse_log2, None, mods, False, None, False), (B, H, D)


def main():
    with set_wrap_triton_enabled(False):  # launched as eager calls launch them
        run()


def run():
    lengths = [int(n) for n in args.lengths.split(",")]
    rows = []
    for N in lengths:
        for causal in (False, True):
            call, (B, H, D) = inputs(N, causal, args.head_dim)
            flops = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
            ref = None
            for name in VARIANTS:
                with variant(name):
                    t0 = time.perf_counter()
                    grads = A.attention_backward(*call)
                    first = time.perf_counter() - t0
                    if args.compile:
                        print(f"compiled {name} N={N} causal={causal} in {first:.1f} s",
                              flush=True)
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
                rows.append((N, causal, name, ms, flops / ms * 1e-9, err, first))
                print(f"N={N:6d} causal={causal!s:5} {name:34s} {ms:8.3f} ms "
                      f"{flops / ms * 1e-9:6.1f} TFLOP/s  err {err:.1e}  first {first:.1f} s",
                      flush=True)
            if not args.compile:
                rows.append((N, causal, "cudnn", *cudnn(N, causal, B, H, D, flops), 0.0, 0.0))
                print(f"N={N:6d} causal={causal!s:5} {'cudnn':34s} {rows[-1][3]:8.3f} ms "
                      f"{rows[-1][4]:6.1f} TFLOP/s", flush=True)
            del call
    if rows:
        print("\nN, causal, variant, ms, TFLOP/s, vs cuDNN")
        for N, causal, name, ms, tf, err, first in rows:
            base = next(r for r in rows if r[:2] == (N, causal) and r[2] == "cudnn")
            print(f"{N},{causal},{name},{ms:.3f},{tf:.1f},{tf / base[4]:.3f}")


def kernel_times(call):
    """Each kernel's mean time over 10 backward calls (torch.profiler)."""
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


if __name__ == "__main__":
    main()
