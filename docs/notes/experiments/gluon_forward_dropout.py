"""Experiment (performance notes, entry 74): the Gluon forward with dropout, variants of
flashop/kernels/forward_gluon.py (files forward_gluon_<name>.py in $VARIANTS, "cur" the
package's) against the fp64 reference with the tl kernels' mask, then timed against the
plain call and the tl forward with dropout. python gluon_forward_dropout.py cur,<name>,...
Needs a Hopper GPU and triton 3.6; not run by CI."""
import os, sys, importlib.util
sys.path.insert(0, os.getcwd())
import torch, triton
import flashop
from flashop import launch_gluon, config
from flashop.testing import dropout_mask
from flashop.reference import attention_reference
def load(name):
    spec = importlib.util.spec_from_file_location("fg_" + name, os.path.join(os.environ.get("VARIANTS", "."), f"forward_gluon_{name}.py"))
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m.attention_fwd_gluon_kernel
kern = {"cur": launch_gluon._kernel()}
names = sys.argv[1].split(",")
for n in names:
    if n not in kern: kern[n] = load(n)
def use(n): launch_gluon._kernel = lambda: kern[n]
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
seed = torch.tensor([1234567], dtype=torch.int64, device="cuda")
for (B, S, H, Hk, causal, D) in ((2, 1000, 4, 2, True, 128), (3, 1777, 4, 1, False, 128), (2, 1500, 6, 2, True, 64), (1, 4096, 16, 16, False, 128), (1, 2048, 4, 4, True, 64)):
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    p = 0.17
    keep = dropout_mask(seed, B, H, S, S, p)
    ref = attention_reference(q.double(), k.double(), v.double(), causal=causal, dropout_p=flashop.options.round_dropout_p(p), dropout_mask=keep)
    ref = ref[0] if isinstance(ref, tuple) else ref
    errs = []
    for n in ["tl"] + names:
        if n != "tl": use(n)
        with config.override(gluon=(n != "tl")):
            out = torch.ops.flashop.attention_forward(q, k, v, None, None, None, None, seed, dropout_p=p, causal=causal)[0]
        errs.append("%s %.2e" % (n, (out.double() - ref).abs().max().item()))
    print("check", B, S, H, Hk, causal, D, " ".join(errs), flush=True)
rows = []
for D in (128, 64):
    for causal in (False, True):
        for N in ((4096, 16384) if D == 128 else (16384,)):
            B, H = 16384 // N, 2048 // D
            q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            res = {}
            for rnd in range(3):
                for n in ["plain", "tl"] + names:
                    if n not in ("plain", "tl"): use(n)
                    ov = dict(gluon=False) if n == "tl" else {}
                    p = 0.0 if n == "plain" else 0.1
                    with config.override(**ov):
                        f = lambda: flashop.attention(q, k, v, causal=causal, dropout_p=p)
                        res.setdefault(n, []).append(triton.testing.do_bench(f, warmup=25, rep=200))
            r = {n: min(x) for n, x in res.items()}
            rows.append((D, N, causal, r))
            print(D, N, causal, " ".join("%s %.3f ms (%.2fx)" % (n, t, t / r["plain"]) for n, t in r.items()), flush=True)
