"""The forward with q's and k's head dim in two tiles (common.head_blocks: D = 192 as 128 +
64) against one power-of-two tile (256), with cuDNN, in one process (performance notes,
entries 114 and 116).

Times flashop.attention's forward (bf16, 16384 tokens per batch, H = 2048 // DV, the grid's
protocol) with the parts and with one tile (choice.head_in_parts patched to take them or
not; Hopper's default is the parts since entry 116), and SDPA's cuDNN; checks the
parts' output against the one tile's (relative Frobenius error). Then a few tiles for the
parts at N = 4k, causal (tiles.force).

    python docs/notes/experiments/d192_head_parts.py [--seqlens 1024,4096,16384]
"""

import argparse
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import flashop  # noqa: E402
from flashop._launch import choice, plans, tiles  # noqa: E402
from flashop._launch.common import head_blocks  # noqa: E402
from flashop._launch.tiles import Tiles  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--seqlens", default="1024,4096,16384")
ap.add_argument("--dims", default="192/128")
ap.add_argument("--budget", type=float, default=150.0, help="seconds; stops after")
args = ap.parse_args()
start = time.time()


def in_parts(head_dim, device, why=None):
    return head_blocks(head_dim)[1] > 0


def one_tile(head_dim, device, why=None):
    return False


def tflops(B, H, N, D, DV, causal, ms):
    return 2 * B * H * N * N * (D + DV) / (2 if causal else 1) / (ms * 1e-3) / 1e12


print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
      f"{__import__('triton').__version__}")
print(f"{'D/DV':>8} {'N':>6} {'causal':>6} {'parts':>7} {'one':>7} {'cudnn':>7} "
      f"{'parts/one':>9} {'parts/cudnn':>11} {'rel.err':>8}")
for dims in args.dims.split(","):
    D, DV = map(int, dims.split("/"))
    for N in map(int, args.seqlens.split(",")):
        for causal in (False, True):
            if time.time() - start > args.budget:
                sys.exit("budget spent")
            B, H = 16384 // N, 2048 // DV
            q, k = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
            v = torch.randn(B, N, H, DV, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                run = lambda: flashop.attention(q, k, v, causal=causal)  # noqa: E731
                with mock.patch.object(choice, "head_in_parts", one_tile):
                    plans.clear_plans()  # (an eager call's plan keeps its blocks)
                    ref = run()
                    one = do_bench(run, warmup=25, rep=100, return_mode="median")
                with mock.patch.object(choice, "head_in_parts", in_parts):
                    plans.clear_plans()
                    out = run()
                    parts = do_bench(run, warmup=25, rep=100, return_mode="median")
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    cud = do_bench(lambda: F.scaled_dot_product_attention(
                        qt, kt, vt, is_causal=causal), warmup=25, rep=100,
                        return_mode="median")
                plans.clear_plans()
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            f = [tflops(B, H, N, D, DV, causal, ms) for ms in (parts, one, cud)]
            print(f"{dims:>8} {N:>6} {str(causal):>6} {f[0]:7.1f} {f[1]:7.1f} {f[2]:7.1f} "
                  f"{f[0] / f[1]:9.2f} {f[0] / f[2]:11.2f} {err:8.1e}", flush=True)

D, DV = map(int, args.dims.split(",")[0].split("/"))
N, B, H = 4096, 4, 2048 // DV
q, k = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
v = torch.randn(B, N, H, DV, device="cuda", dtype=torch.bfloat16)
for t in (Tiles(128, 64, 8, 3), Tiles(128, 64, 8, 4), Tiles(128, 128, 8, 2),
          Tiles(64, 64, 4, 3)):
    if time.time() - start > args.budget:
        sys.exit("budget spent")
    try:
        with torch.no_grad(), tiles.force("fwd", t), \
                mock.patch.object(choice, "head_in_parts", in_parts):
            ms = do_bench(lambda: flashop.attention(q, k, v, causal=True), warmup=25, rep=100,
                          return_mode="median")
        print(f"tiles {t}: {tflops(B, H, N, D, DV, True, ms):.1f} TFLOP/s (4k, causal)")
    except Exception as e:  # out of shared memory
        print(f"tiles {t}: {type(e).__name__}")
