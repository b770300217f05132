"""Experiment (performance notes, entry 74): dropout's cost in one checkout, D = 128, bf16, 16k tokens
per batch, H = 16: the plain call, dropout 0.1 with the tl kernels forced, and dropout by
default; forward and backward times. Run per checkout, alternating: python
dropout_layout_ab.py <checkout root>. Not run by CI."""
import os, sys
sys.path.insert(0, sys.argv[1])
import torch, triton
import flashop
from flashop import config
print(sys.argv[1], flashop.__file__, torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
D = 128
for causal in (False, True):
    for N in (4096, 16384):
        B, H = 16384 // N, 2048 // D
        q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        res = {}
        for name, p, ov in (("plain", 0.0, {}), ("drop_tl", 0.1, dict(gluon=False)), ("drop", 0.1, {})):
            with config.override(**ov):
                f = lambda: flashop.attention(q, k, v, causal=causal, dropout_p=p)
                def fb():
                    out = flashop.attention(q, k, v, causal=causal, dropout_p=p)
                    torch.autograd.grad(out, (q, k, v), dout)
                with torch.no_grad():
                    tf = triton.testing.do_bench(f, warmup=25, rep=200)
                tfb = triton.testing.do_bench(fb, warmup=10, rep=200)
            res[name] = (tf, tfb - tf, tfb)
        pl = res["plain"]
        print("RES", os.path.basename(sys.argv[1].rstrip("/")), N, causal, " | ".join(
            "%s fwd %.3f (%.2fx) bwd %.3f (%.2fx)" % (n, r[0], r[0] / pl[0], r[1], r[1] / pl[1]) for n, r in res.items()), flush=True)
