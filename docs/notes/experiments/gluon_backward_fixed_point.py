"""Experiment (performance notes, entry 76): the deterministic Gluon backward with dQ summed
in fixed point (int32 limbs, launch_gluon.DQ_FIXED_POINT) against its fp32 adds in key-tile
order (DQ_FIXED_POINT off), the atomics form, the tl kernels and cuDNN; runs on a checkout
of 2b9ac9f with gluon_backward_fixed_point.patch applied (the change was not kept). First
checks (three runs bitwise equal; the largest error of dQ, dK, dV to an fp64 reference
beside the tl kernels'), then backward TFLOP/s, modes alternating in rounds. Hopper,
triton 3.6; not run by CI. Usage: python gluon_backward_fixed_point.py [D,...] (default
128,64)."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import flashop
from flashop import launch_gluon, config

MODES = ["tl", "atomic", "ordered", "fixed", "cudnn"]


def grads(mode, q, k, v, dout, causal, dropout_p=0.0):
    if mode == "cudnn":
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                                 is_causal=causal, enable_gqa=True)
        return out.transpose(1, 2), lambda: torch.autograd.grad(out, (q, k, v), dout.transpose(1, 2), retain_graph=True)
    launch_gluon.DQ_FIXED_POINT = mode != "ordered"
    ov = dict(gluon=False) if mode == "tl" else dict(gluon=True, dq_atomics=mode == "atomic")
    with config.override(**ov):
        out = flashop.attention(q, k, v, causal=causal, dropout_p=dropout_p)
        return out, lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def run(mode, *a, **kw):
    ov = dict(gluon=False) if mode == "tl" else dict(gluon=True, dq_atomics=mode == "atomic")
    out, f = grads(mode, *a, **kw)
    with config.override(**ov):
        return f()


def reference(q, k, v, dout, causal):
    G = q.shape[2] // k.shape[2]
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    s = torch.einsum("bihd,bjhd->bhij", q64, k64.repeat_interleave(G, 2)) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    o = torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v64.repeat_interleave(G, 2))
    return torch.autograd.grad(o, (q64, k64, v64), dout.double())


print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
torch.manual_seed(0)
for (B, S, H, Hk, causal, D, p) in ((2, 1000, 4, 2, True, 128, 0.0), (3, 1777, 4, 1, False, 128, 0.0),
                                     (1, 4096, 8, 8, True, 128, 0.0), (2, 1500, 4, 2, True, 64, 0.0),
                                     (1, 3000, 4, 4, False, 64, 0.0), (2, 2048, 4, 2, False, 128, 0.1),
                                     (1, 1, 2, 1, False, 128, 0.0), (1, 200, 2, 2, True, 64, 0.0)):
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    ref = reference(q, k, v, dout, causal) if p == 0 else None
    res = {}
    for mode in ("tl", "ordered", "fixed"):
        torch.manual_seed(1)
        gs = []
        for _ in range(3):
            torch.manual_seed(1)
            gs.append(run(mode, q, k, v, dout, causal, dropout_p=p))
        same = all(torch.equal(a, b) for g in gs[1:] for a, b in zip(gs[0], g))
        base = ref if ref is not None else res.get("tl")
        err = " ".join("%.2e" % (a.double() - b.double()).abs().max().item() for a, b in zip(gs[0], base)) if base is not None else "-"
        res[mode] = gs[0]
        print("check", mode, (B, S, H, Hk, causal, D, p), "bitwise", same, "err dq dk dv", err, flush=True)
rows = []
for D in (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "128,64").split(",")):
    for causal in (False, True):
        for N in (1024, 2048, 4096, 8192, 16384):
            B, H = 16384 // N, 2048 // D
            q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            dout = torch.randn_like(q)
            flops = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
            t = {}
            for rnd in range(2):
                for mode in MODES:
                    ov = dict(gluon=False) if mode == "tl" else dict(gluon=True, dq_atomics=mode == "atomic")
                    out, f = grads(mode, q, k, v, dout, causal)
                    with config.override(**ov):
                        t.setdefault(mode, []).append(flops / triton.testing.do_bench(f, warmup=25, rep=150) / 1e9)
            r = {m: max(x) for m, x in t.items()}
            rows.append((D, N, causal, r))
            print(D, N, causal, " ".join("%s %.0f" % (m, r[m]) for m in MODES), "fixed/cudnn %.2f" % (r["fixed"] / r["cudnn"]), flush=True)
print("\nD N causal | " + " ".join(MODES) + " | fixed/ordered fixed/cudnn")
for D, N, c, r in rows:
    print(D, N, c, "|", " ".join("%.0f" % r[m] for m in MODES), "| %.2f %.2f" % (r["fixed"] / r["ordered"], r["fixed"] / r["cudnn"]))
