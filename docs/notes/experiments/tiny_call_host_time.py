"""Host time of a tiny eager call (B=1, H=1, N=128, D=64, causal, bf16): flashop's forward
and forward+backward, beside SDPA's, median of 7 rounds of 200 calls each (CUDA-synchronized
at round ends). Usage: PYTHONPATH=<checkout> python tiny_call_host_time.py LABEL, alternating
checkouts in one run on one GPU."""
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import flashop

label = sys.argv[1]
q, k, v = (torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
dout = torch.randn_like(q)
qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))


def fa_fwd():
    with torch.no_grad():
        flashop.attention(q, k, v, causal=True)


def fa_fwd_bwd():
    flashop.attention(q, k, v, causal=True).backward(dout)


def sd_fwd():
    with torch.no_grad():
        F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)


def sd_fwd_bwd():
    F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).backward(dout.transpose(1, 2))


def per_call(fn, n=200, rounds=7):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


for name, fn in (("flashop fwd", fa_fwd), ("flashop fwd+bwd", fa_fwd_bwd),
                 ("sdpa fwd", sd_fwd), ("sdpa fwd+bwd", sd_fwd_bwd)):
    print(f"host {label} {name}: {per_call(fn):.1f} us", flush=True)
