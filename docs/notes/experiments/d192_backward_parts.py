"""The tl backward with q's and k's head dim in two tiles (common.head_blocks: D = 192 as
128 + 64; the dQ kernel and both dK/dV parts, BLOCK_DT) against one power-of-two tile
(256), with cuDNN, in one process (performance notes, entry 116).

Times the backward alone (``o.backward(do, retain_graph=True)``, the grid's protocol: bf16,
16384 tokens per batch, H = 2048 // DV) with one tile and with the parts
(choice.head_in_parts patched to take them or not), and SDPA's cuDNN; checks the parts'
gradients against the one tile's (relative Frobenius error). Then a few tiles for the parts
(tiles.force) at N = 4k causal and 16k not causal. Prints "backward parts: faster" where
the parts' geometric mean over the points beats one tile's.

    python docs/notes/experiments/d192_backward_parts.py [--seqlens 1024,4096,16384]

Its timing helpers (backward_ms, rel) serve d192_one_pass.py too.
"""

import argparse
import math
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


def tflops(B, H, N, D, DV, causal, ms):
    return 2.5 * 2 * B * H * N * N * (D + DV) / (2 if causal else 1) / (ms * 1e-3) / 1e12


def backward_ms(fn, q, k, v, do):
    out = fn(q, k, v)
    ms = do_bench(lambda: out.backward(do, retain_graph=True), warmup=25, rep=100,
                  grad_to_none=[q, k, v], return_mode="median")
    q.grad = k.grad = v.grad = None
    out.backward(do)
    grads = [x.grad.float() for x in (q, k, v)]
    q.grad = k.grad = v.grad = None
    return ms, grads


def in_parts(head_dim, device, why=None):
    return head_blocks(head_dim)[1] > 0


def one_tile(head_dim, device, why=None):
    return False


def rel(a, b):
    return max(((x - y).norm() / y.norm()).item() for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--dims", default="192/128")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds; stops after")
    args = ap.parse_args()
    start = time.time()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
          f"{__import__('triton').__version__}")
    print(f"{'D/DV':>8} {'N':>6} {'causal':>6} {'parts':>7} {'one':>7} {'cudnn':>7} "
          f"{'parts/one':>9} {'parts/cudnn':>11} {'rel.err':>8}")
    ratios = []
    for dims in args.dims.split(","):
        D, DV = map(int, dims.split("/"))
        for N in map(int, args.seqlens.split(",")):
            for causal in (False, True):
                if time.time() - start > args.budget:
                    sys.exit("budget spent")
                B, H = 16384 // N, 2048 // DV
                q, k = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16,
                                    requires_grad=True) for _ in range(2))
                v = torch.randn(B, N, H, DV, device="cuda", dtype=torch.bfloat16,
                                requires_grad=True)
                do = torch.randn(B, N, H, DV, device="cuda", dtype=torch.bfloat16)
                attend = lambda q, k, v: flashop.attention(q, k, v, causal=causal)  # noqa: E731
                with mock.patch.object(choice, "head_in_parts", one_tile):
                    plans.clear_plans()
                    one, ref = backward_ms(attend, q, k, v, do)
                with mock.patch.object(choice, "head_in_parts", in_parts):
                    plans.clear_plans()
                    parts, got = backward_ms(attend, q, k, v, do)
                plans.clear_plans()

                def cudnn(q, k, v):
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(
                            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                            is_causal=causal).transpose(1, 2)
                cud, _ = backward_ms(cudnn, q, k, v, do)
                f = [tflops(B, H, N, D, DV, causal, ms) for ms in (parts, one, cud)]
                ratios.append(f[0] / f[1])
                print(f"{dims:>8} {N:>6} {str(causal):>6} {f[0]:7.1f} {f[1]:7.1f} {f[2]:7.1f} "
                      f"{f[0] / f[1]:9.2f} {f[0] / f[2]:11.2f} {rel(got, ref):8.1e}", flush=True)
                del q, k, v, do
                torch.cuda.empty_cache()
    mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"backward parts: {'faster' if mean > 1.0 else 'not faster'} (geometric mean "
          f"{mean:.3f}x one tile)", flush=True)

    D, DV = map(int, args.dims.split(",")[0].split("/"))
    for N, causal in ((4096, True), (16384, False)):
        B, H = 16384 // N, 2048 // DV
        q, k = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        v = torch.randn(B, N, H, DV, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn(B, N, H, DV, device="cuda", dtype=torch.bfloat16)
        for kind, t in (("dq", Tiles(64, 64, 8, 2)), ("dq", Tiles(128, 32, 8, 2)),
                        ("dq", Tiles(64, 64, 4, 2)), ("dk", Tiles(64, 128, 8, 2)),
                        ("dk", Tiles(32, 128, 8, 3)), ("dv", Tiles(64, 128, 8, 3))):
            if time.time() - start > args.budget:
                sys.exit("budget spent")
            try:
                with tiles.force(kind, t), \
                        mock.patch.object(choice, "head_in_parts", in_parts):
                    plans.clear_plans()
                    ms, _ = backward_ms(
                        lambda q, k, v: flashop.attention(q, k, v, causal=causal), q, k, v, do)
                print(f"{kind} {t}: {tflops(B, H, N, D, DV, causal, ms):.1f} TFLOP/s "
                      f"({N}, causal={causal})", flush=True)
            except Exception as e:  # out of shared memory
                print(f"{kind} {t}: {type(e).__name__}", flush=True)
        plans.clear_plans()


if __name__ == "__main__":
    main()
