"""Experiment (performance notes, entry 152): the deterministic Gluon backward not causal,
with each (batch, KV head)'s key tiles side by side, each starting on its own query tile and
dQ's adds into a query tile in the order the key tiles reach it (``BWD_ROTATE``), against
its bands of BWD_KEY_GROUP key tiles in key-tile order, the default backward (dQ by
atomics), the deterministic `tl` kernels and cuDNN's backward. bf16, hidden size 2048,
16k tokens per batch, two alternating rounds (medians of the rounds' best). First the
rotated form's gradients: bitwise equal over three calls, and against the ordered form's
(the same sums in another order: they differ where the form ran). Hopper, triton 3.6; not run by CI.

    PYTHONPATH=. python docs/notes/experiments/gluon_backward_rotated.py [D ...]
"""
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashop
from flashop import config
from flashop._launch import gluon
from flashop._launch.plans import clear_plans

print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
dims = [int(a) for a in sys.argv[1:]] or [128, 64]


def grads(q, k, v, dout, deterministic, rotate=True, use_gluon=True):
    gluon.BWD_ROTATE = rotate
    clear_plans()  # (an eager call's plan keeps its launches: the form its first call took)
    with config.override(gluon=use_gluon):
        out = flashop.attention(q, k, v, deterministic=deterministic)
        return torch.autograd.grad(out, (q, k, v), dout)


# correctness: S_q = S_k and not, GQA, a key count that is not a multiple of the tile
for B, S_q, S_k, H, H_kv, D in ((2, 1000, 1000, 4, 2, 128), (1, 333, 2100, 3, 1, 64),
                               (1, 4096, 4096, 2, 2, 128), (3, 2100, 777, 2, 1, 128)):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, S_q, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(B, S_k, H_kv, D, device="cuda", dtype=torch.bfloat16, generator=g)
            .requires_grad_() for _ in range(2))
    dout = torch.randn(B, S_q, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    rotated = [grads(q, k, v, dout, True) for _ in range(3)]
    ordered = grads(q, k, v, dout, True, rotate=False)
    same = all(torch.equal(a, b) for r in rotated[1:] for a, b in zip(rotated[0], r))
    diff = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            for a, b in zip(rotated[0], ordered)]
    print(f"B={B} S_q={S_q} S_k={S_k} H={H}/{H_kv} D={D}: three rotated calls bitwise equal "
          f"{same}; against the ordered form, largest difference / largest value "
          f"dq {diff[0]:.2e} dk {diff[1]:.2e} dv {diff[2]:.2e}", flush=True)

for D in dims:
    for N in (1024, 2048, 4096, 8192, 16384):
        B, H = max(1, 16384 // N), 2048 // D
        q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        flops = 2.5 * 4 * B * H * N * N * D
        modes = {"atomics": dict(deterministic=False, use_gluon=None),
                 "ordered": dict(deterministic=True, rotate=False),
                 "rotated": dict(deterministic=True, rotate=True),
                 "tl-det": dict(deterministic=True, use_gluon=False)}
        t = {}
        for rnd in range(2):
            for name, m in modes.items():
                gluon.BWD_ROTATE = m.get("rotate", True)
                clear_plans()
                with config.override(gluon=m.get("use_gluon", True)):
                    out = flashop.attention(q, k, v, deterministic=m["deterministic"])
                    f = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                    t.setdefault(name, []).append(
                        flops / triton.testing.do_bench(f, warmup=25, rep=150) / 1e9)
            qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)
                f = lambda: torch.autograd.grad(out, (qt, kt, vt), dout.transpose(1, 2),
                                                retain_graph=True)
                t.setdefault("cudnn", []).append(
                    flops / triton.testing.do_bench(f, warmup=25, rep=150) / 1e9)
        best = {n: max(x) for n, x in t.items()}
        print(f"D={D} N={N} not causal, TFLOP/s (best of 2): "
              + " ".join(f"{n} {x:.0f}" for n, x in best.items())
              + f" | rotated/ordered {best['rotated'] / best['ordered']:.3f}"
              f" rotated/cudnn {best['rotated'] / best['cudnn']:.3f}", flush=True)
gluon.BWD_ROTATE = True
