"""The `tl` forward at DeepSeek's prefill head dims (D = 192, DV = 128) with two query tiles
per program, each with q's head dim in two tiles (performance notes, entry 136), against the
table's one query tile, the Gluon forward and cuDNN.

On a Hopper GPU (from the repository root):

    PYTHONPATH=. python docs/notes/experiments/d192_two_query_tiles.py

Grid protocol (bf16, 16384 tokens per batch, H = 16): forward TFLOP/s, 2 * B * H * N^2 *
(D + DV), halved when causal; each forced tile's output against the table's (largest
difference over the largest value). One process.
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench
import flashop
from flashop._launch import plans, tiles
T = tiles.Tiles
CANDS = [None, T(256, 64, 8, 3, split_m=True), T(256, 64, 8, 2, split_m=True),
         T(256, 32, 8, 3, split_m=True), T(128, 64, 8, 3, split_m=True)]


def main():
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, "fwd TFLOP/s D=192 DV=128 H=16", flush=True)
    D, DV = 192, 128
    for N in (1024, 4096, 16384):
        for causal in (False, True):
            B, H = 16384 // N, 16
            q, k = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            v = torch.randn(B, N, H, DV, device="cuda", dtype=torch.bfloat16)
            fl = 2 * B * H * N * N * (D + DV) / (2 if causal else 1)
            rate = lambda fn: fl / do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-9
            attend = lambda: flashop.attention(q, k, v, causal=causal)
            row, ref = [], None
            for t in CANDS:
                name = "table" if t is None else f"{t.BLOCK_M}x{t.BLOCK_N}x{t.num_warps}x{t.num_stages}{'s' if t.split_m else ''}"
                try:
                    with flashop.config.override(gluon=False):
                        plans.clear_plans()
                        if t is None:
                            ref = attend(); row.append(f"{name} {rate(attend):.0f}")
                        else:
                            with tiles.force("fwd", t):
                                out = attend()
                                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                                row.append(f"{name} {rate(attend):.0f} ({err:.1e})")
                except Exception as e:
                    row.append(f"{name} {type(e).__name__}")
            with flashop.config.override(gluon=True):
                plans.clear_plans()
                row.append(f"gluon {rate(attend):.0f}")
            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
            row.append(f"cuDNN {rate(cudnn):.0f}")
            print(f"N={N} causal={causal}: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
