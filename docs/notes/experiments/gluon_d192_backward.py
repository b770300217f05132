"""The Gluon backward at D = 192, DV = 128 (performance notes, entry 139): q's and k's head
dim in two tiles (128 + 64), as the Gluon forward's; dQ by atomics only. Not in the package:
`gluon_d192_backward.patch` (against the commit that adds this script) holds the kernel and
launcher changes and the tests' draws.

On a Hopper GPU with triton 3.6, the patch applied (from the repository root):

    git apply docs/notes/experiments/gluon_d192_backward.patch
    PYTHONPATH=. python docs/notes/experiments/gluon_d192_backward.py [--check]

Backward TFLOP/s (grid protocol, H = 16), the tl kernels / the Gluon backward / cuDNN, with
each gradient's largest difference (Gluon against tl) over tl's largest; --check first runs
four odd shapes (GQA, causal, tail tiles, the bhsd layout) against the fp64 reference with
each group's query heads in one program and split between two.
"""
import argparse
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import torch  # noqa: E402
import triton  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import flashop  # noqa: E402
from flashop._launch import gluon as G, plans  # noqa: E402


def check():
    from helpers import Case, check_case
    cases = [Case(B=2, S_q=77, S_k=131, H_kv=2, G=3, D=192, DV=128, dtype=torch.bfloat16),
             Case(B=1, S_q=300, S_k=300, H_kv=1, G=2, D=192, DV=128, dtype=torch.bfloat16, causal=True),
             Case(B=1, S_q=1000, S_k=1000, H_kv=2, G=4, D=192, DV=128, dtype=torch.float16, causal=True, layout="bhsd"),
             Case(B=2, S_q=513, S_k=700, H_kv=1, G=1, D=192, DV=128, dtype=torch.bfloat16, scale=0.3)]
    for split in (1, 2):
        for c in cases:
            if c.G % split:
                continue
            with mock.patch.object(G, "attention_backward", wraps=G.attention_backward) as launched, \
                    mock.patch.object(G, "backward_split", return_value=split), \
                    flashop.config.override(dq_atomics=True):
                plans.clear_plans()
                try:
                    check_case(c, deterministic_backward=False)
                    print("OK", split, c.S_q, c.S_k, c.G, c.causal, c.dtype, "launched", launched.called, flush=True)
                except AssertionError as e:
                    print("FAIL", split, c, str(e)[:400], flush=True)


def timing():
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, "bwd TFLOP/s D=192 DV=128 H=16", flush=True)
    D, DV = 192, 128
    for N in (1024, 4096, 16384):
        for causal in (False, True):
            B, H = 16384 // N, 16
            q, k = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
            v = torch.randn(B, N, H, DV, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            do = torch.randn(B, N, H, DV, device="cuda", dtype=torch.bfloat16)
            fl = 2.5 * 2 * B * H * N * N * (D + DV) / (2 if causal else 1)
            row, grads = [], {}
            for name, opts in (("tl", dict(gluon=False)), ("gluon", dict(dq_atomics=True))):
                with flashop.config.override(**opts):
                    plans.clear_plans()
                    out = flashop.attention(q, k, v, causal=causal)
                    grads[name] = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                    ms = do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), warmup=25, rep=100, return_mode="median")
                    row.append(f"{name} {fl / ms * 1e-9:.0f}")
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
                dot = do.transpose(1, 2)
                ms = do_bench(lambda: torch.autograd.grad(out, (q, k, v), dot, retain_graph=True), warmup=25, rep=100, return_mode="median")
                row.append(f"cuDNN {fl / ms * 1e-9:.0f}")
            diffs = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(grads["gluon"], grads["tl"])]
            print(f"N={N} causal={causal}: " + " | ".join(row) + " | gluon-tl dq/dk/dv " + " ".join(f"{d:.1e}" for d in diffs), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    if args.check:
        check()
    timing()


if __name__ == "__main__":
    main()
