"""DeepSeek's prefill head dims (D = 192, DV = 128) in the Gluon forward: q's and k's head
dim in two tiles (128 + 64; Gluon's tiles are powers of two), against the `tl` forward and
cuDNN (performance notes, entry 134).

On a Hopper GPU with triton 3.6 (from the repository root):

    PYTHONPATH=. python docs/notes/experiments/gluon_d192_forward.py \\
        [--seqlens 1024,4096,16384] [--tiles 128x64x3,128x128x2]

Grid protocol (bf16, 16384 tokens per batch, H = 2048 // DV = 16): the forward alone, TFLOP/s
as benchmarks/attention.py counts them (2 * B * H * N^2 * (D + DV), halved when causal),
the `tl` forward / the Gluon forward at each (BLOCK_M, BLOCK_N, STAGES) / cuDNN, one
process; each Gluon output against the `tl` one (largest difference over the largest value).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--tiles", default="128x64x3,128x128x2")
    args = parser.parse_args(argv)
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    import flashop
    from flashop._launch import gluon, plans
    tiles = [tuple(map(int, t.split("x"))) for t in args.tiles.split(",")]
    saved = gluon.FWD_TILES[192]
    D, DV = 192, 128
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
          f"{__import__('triton').__version__} | forward TFLOP/s, D = {D}, DV = {DV}")
    for N in map(int, args.seqlens.split(",")):
        for causal in (False, True):
            B, H = 16384 // N, 2048 // DV
            q, k = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
            v = torch.randn(B, N, H, DV, device="cuda", dtype=torch.bfloat16)
            flops = 2 * B * H * N * N * (D + DV) / (2 if causal else 1)

            def rate(fn):
                return flops / do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-9

            def attend():
                return flashop.attention(q, k, v, causal=causal)
            with flashop.config.override(gluon=False):
                plans.clear_plans()
                ref = attend()
                row = [f"tl {rate(attend):.0f}"]
            for t in tiles:
                gluon.FWD_TILES[192] = t
                with flashop.config.override(gluon=True):
                    plans.clear_plans()
                    try:
                        out = attend()
                        err = ((out.float() - ref.float()).abs().max()
                               / ref.float().abs().max()).item()
                        row.append(f"gluon {'x'.join(map(str, t))} {rate(attend):.0f} "
                                   f"(diff {err:.1e})")
                    except Exception as e:  # noqa: BLE001 (an experiment: report, go on)
                        row.append(f"gluon {'x'.join(map(str, t))} {type(e).__name__}: "
                                   f"{str(e)[:80]}")
            gluon.FWD_TILES[192] = saved
            plans.clear_plans()

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        is_causal=causal)
            row.append(f"cuDNN {rate(cudnn):.0f}")
            print(f"N={N} causal={causal}: " + " | ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
