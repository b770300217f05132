"""Experiment (performance notes, entry 77): where the deterministic Gluon backward (dQ's
adds in key-tile order) beats the tl kernels at D = 128: both forms of the default backward
(FLASHOP_GLUON=1 and 0) side by side, three alternating rounds, bf16, hidden size 2048.
Hopper, triton 3.6; not run by CI."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch, triton
import flashop
from flashop import config

print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
D = 128
for causal, lengths in ((True, (1024, 1536, 2048, 3072, 4096)), (False, (2048, 3072, 4096, 8192))):
    for N in lengths:
        B, H = max(1, 16384 // N), 2048 // D
        q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        flops = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
        t = {}
        for rnd in range(3):
            for name, gluon in (("tl", False), ("gluon", True)):
                with config.override(gluon=gluon):
                    out = flashop.attention(q, k, v, causal=causal)
                    f = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                    t.setdefault(name, []).append(flops / triton.testing.do_bench(f, warmup=25, rep=150) / 1e9)
        med = {n: sorted(x)[1] for n, x in t.items()}
        print("causal" if causal else "not causal", N, " ".join("%s %s" % (n, "/".join("%.0f" % y for y in x)) for n, x in t.items()),
              "| medians %.0f %.0f gluon/tl %.3f" % (med["tl"], med["gluon"], med["gluon"] / med["tl"]), flush=True)
