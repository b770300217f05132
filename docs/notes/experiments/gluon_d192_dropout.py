"""The Gluon forward at D = 192, DV = 128 with dropout against the `tl` forward with dropout
(performance notes, entry 137): TFLOP/s of each (and of the plain Gluon call), and the
largest difference of their outputs under one seed over the largest value.

On a Hopper GPU with triton 3.6 (from the repository root):

    PYTHONPATH=. python docs/notes/experiments/gluon_d192_dropout.py
"""
import sys
from pathlib import Path
import torch, triton
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import flashop
from flashop._launch import plans
from triton.testing import do_bench


def main():
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    D, DV, p = 192, 128, 0.1
    for N in (1024, 4096, 16384):
        for causal in (False, True):
            B, H = 16384 // N, 16
            q, k = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            v = torch.randn(B, N, H, DV, device="cuda", dtype=torch.bfloat16)
            fl = 2 * B * H * N * N * (D + DV) / (2 if causal else 1)
            outs, row = [], []
            for g in (False, True):
                with flashop.config.override(gluon=g):
                    plans.clear_plans()
                    f = lambda: flashop.attention(q, k, v, causal=causal, dropout_p=p)
                    torch.manual_seed(0)
                    outs.append(f())
                    row.append(fl / do_bench(f, warmup=25, rep=100, return_mode="median") * 1e-9)
            with flashop.config.override(gluon=True):
                plans.clear_plans()
                plain = lambda: flashop.attention(q, k, v, causal=causal)
                row.append(fl / do_bench(plain, warmup=25, rep=100, return_mode="median") * 1e-9)
            d = (outs[0].float() - outs[1].float()).abs().max().item() / outs[0].float().abs().max().item()
            print(f"N={N} causal={causal} tl_drop {row[0]:.0f} gluon_drop {row[1]:.0f} gluon_plain {row[2]:.0f} ratio {row[1]/row[0]:.2f} diff {d:.2e}", flush=True)


if __name__ == "__main__":
    main()
