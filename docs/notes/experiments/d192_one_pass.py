"""DeepSeek's prefill head dims (D = 192, DV = 128): the dK/dV kernel in one pass against its
two parts (performance notes, entry 130).

Above head dim 128 on Hopper the backward's dK/dV kernel runs as two launches, a dV part and
a dK part, each computing S^T (tiles.splits_dkdv): eight products' work per tile pair where
one pass needs seven. At D = 192 with the head dim in two tiles (128 + 64) and DV = 128, one
program holding both accumulators compiles without spills at 32 x 128 with 8 warps (2 or 3
stages) and 16 x 128, where 64 x 64 and 64 x 128 spill (`--compile`, triton 3.6, sm_90).

Modes (from the repository root):

    # compiled for sm_90 on a machine without a GPU (triton 3.6.0): registers, spills
    PYTHONPATH=. python docs/notes/experiments/d192_one_pass.py --compile
    # on a Hopper GPU: the backward alone (grid protocol: bf16, 16384 tokens per batch,
    # H = 2048 // DV), parts / the default rule / one pass at each tile / cuDNN, one
    # process; gradients of each against the parts' (relative Frobenius error); --groups G:
    # G query heads per KV head (cuDNN given the keys repeated)
    PYTHONPATH=. python docs/notes/experiments/d192_one_pass.py --time \
        [--seqlens 1024,4096,16384] [--groups 4] [--tiles 32x128x8x3,32x64x8x3] \
        [--dims 256/256] [--budget 400]

The one-pass form is the kernel that fp32 inputs and GPUs before Hopper already run above
head dim 128 (CI tests it in fp32 under the interpreter); here only the rule is patched
(tiles.splits_dkdv) and the tile forced (tiles.force("dkdv", ...)).
"""

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
ONE_PASS_TILES = [(32, 128, 8, 2), (32, 128, 8, 3), (16, 128, 8, 2), (64, 64, 8, 2)]


@contextlib.contextmanager
def in_parts():
    """The backward's dK/dV kernel in its two parts (the rule before entry 131)."""
    from flashop._launch import tiles
    with mock.patch.object(tiles, "splits_dkdv", lambda *a, **kw: True):
        yield


@contextlib.contextmanager
def one_pass(t):
    """The backward's dK/dV kernel in one launch at tiles ``t``."""
    from flashop._launch import tiles
    with mock.patch.object(tiles, "splits_dkdv", lambda *a, **kw: False), \
            tiles.force("dkdv", tiles.Tiles(*t)):
        yield


def compile_all() -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    import compile_for_hopper as ch  # installs the stand-in driver
    import compile_sm90

    import flashop
    failed = 0
    for D, DV in ((192, 128), (192, 192), (160, 160)):
        q, k = (torch.randn(1, 4096, 4, D, dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        v = torch.randn(1, 4096, 4, DV, dtype=torch.bfloat16, requires_grad=True)
        for t in ONE_PASS_TILES:
            def call():
                out = flashop.attention(q, k, v, causal=True)
                out.sum().backward()
            with one_pass(t):
                launches = ch.catch_launches(call)
            for kernel, grid, kwargs in launches:
                if kernel.__name__ == "attention_bwd_dkdv_kernel":
                    res = compile_sm90.compile_kernel(kernel, grid, kwargs,
                                                      f"D={D}/{DV} one pass {t}")
                    failed += not compile_sm90.report(res)
    return failed


def time_all(seqlens, groups: int = 1, tiles=ONE_PASS_TILES, dims=(192, 128),
             budget: float = 400) -> int:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashop
    from d192_backward_parts import backward_ms as backward, rel
    from flashop._launch import plans

    start = time.time()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
          f"{__import__('triton').__version__} | TFLOP/s of the backward")
    D, DV = dims
    print(f"D = {D}, DV = {DV}, H_kv = H / {groups}")
    for N in seqlens:
        for causal in (False, True):
            B, H = 16384 // N, 2048 // DV
            q = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True)
            k = torch.randn(B, N, H // groups, D, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True)
            v = torch.randn(B, N, H // groups, DV, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True)
            do = torch.randn(B, N, H, DV, device="cuda", dtype=torch.bfloat16)
            flops = 2.5 * 2 * B * H * N * N * (D + DV) / (2 if causal else 1)
            attend = lambda q, k, v: flashop.attention(q, k, v, causal=causal)  # noqa: E731
            with in_parts():
                plans.clear_plans()
                ms, ref = backward(attend, q, k, v, do)
            row = [f"parts {flops / ms * 1e-9:.0f}"]
            plans.clear_plans()
            ms, got = backward(attend, q, k, v, do)
            row.append(f"default {flops / ms * 1e-9:.0f} (err {rel(got, ref):.0e})")
            for t in tiles:
                try:
                    with one_pass(t):
                        plans.clear_plans()
                        ms, got = backward(attend, q, k, v, do)
                    row.append(f"{'x'.join(map(str, t))} {flops / ms * 1e-9:.0f} "
                               f"(err {rel(got, ref):.0e})")
                except Exception as e:  # noqa: BLE001 (an experiment: report and go on)
                    row.append(f"{'x'.join(map(str, t))} {type(e).__name__}")
            plans.clear_plans()

            def cudnn(q, k, v):
                if groups > 1:  # (cuDNN's SDPA takes no groups: the keys repeated)
                    k, v = (x.repeat_interleave(groups, dim=2) for x in (k, v))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        is_causal=causal).transpose(1, 2)
            ms, _ = backward(cudnn, q, k, v, do)
            row.append(f"cuDNN {flops / ms * 1e-9:.0f}")
            print(f"N={N} causal={causal}: " + " | ".join(row), flush=True)
            del q, k, v, do
            torch.cuda.empty_cache()
            if time.time() - start > budget:
                print(f"stopped: {budget:.0f} s")
                return 0
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--compile", action="store_true")
    group.add_argument("--time", action="store_true")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--groups", type=int, default=1, help="query heads per KV head")
    parser.add_argument("--dims", default="192/128", help="D/DV")
    parser.add_argument("--budget", type=float, default=400, help="seconds, then stop")
    parser.add_argument("--tiles", default=None,
                        help="one-pass tiles to force, e.g. 32x128x8x3,32x128x8x2")
    args = parser.parse_args(argv)
    if args.compile:
        os.environ.pop("TRITON_INTERPRET", None)
        return compile_all()
    tiles = ONE_PASS_TILES if args.tiles is None else [
        tuple(map(int, t.split("x"))) for t in args.tiles.split(",")]
    return time_all([int(n) for n in args.seqlens.split(",")], args.groups, tiles,
                    tuple(map(int, args.dims.split("/"))), args.budget)


if __name__ == "__main__":
    sys.exit(main())
