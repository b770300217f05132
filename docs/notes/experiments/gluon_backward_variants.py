"""Experiment (performance notes, entries 72 and 75): variants of the deterministic Gluon
backward (backward_gluon_<name>.py in $VARIANTS; "cur" the package's; "gN" the package's
with KEY_GROUP N): bitwise repeat and error against the tl kernels, then TFLOP/s beside
the tl kernels and the atomics form. Hopper, triton 3.6; not run by CI."""
import os, sys, importlib.util
sys.path.insert(0, os.getcwd())
import torch, triton
import flashop
from flashop import launch_gluon, config
def load(name):
    spec = importlib.util.spec_from_file_location("bg_" + name, os.path.join(os.environ.get("VARIANTS", "."), f"backward_gluon_{name}.py"))
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m.attention_bwd_gluon_kernel
kern = {"cur": launch_gluon._bwd_kernel()}
names = sys.argv[1].split(",")
for n in names:
    if n not in kern and not n.startswith("g"): kern[n] = load(n)
def use(n):
    launch_gluon._bwd_kernel = lambda: kern["cur" if n.startswith("g") else n]
    launch_gluon.BWD_KEY_GROUP = int(n[1:]) if n.startswith("g") else 4
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
for (B, S, H, Hk, causal, D) in ((2, 1000, 4, 2, True, 128), (3, 1777, 4, 1, False, 128), (1, 4096, 16, 16, True, 128), (2, 1500, 4, 2, True, 64)):
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    with config.override(gluon=False):
        ref = torch.autograd.grad(flashop.attention(q, k, v, causal=causal), (q, k, v), dout)
    for n in names:
        use(n)
        with config.override(gluon=True):
            gr = [torch.autograd.grad(flashop.attention(q, k, v, causal=causal), (q, k, v), dout) for _ in range(3)]
        same = all(torch.equal(a, b) for r in gr[1:] for a, b in zip(gr[0], r))
        print("check", n, causal, S, D, "bitwise", same, " ".join("%.1e" % (a.float() - b.float()).abs().max().item() for a, b in zip(gr[0], ref)), flush=True)
rows = []
for D in (int(x) for x in os.environ.get("DS", "128,64").split(",")):
    for causal in (False, True):
        for N in ((1024, 4096, 16384) if D == 128 else (2048, 16384)):
            B, H = 16384 // N, 2048 // D
            q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            dout = torch.randn_like(q)
            flops = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
            res = {}
            for rnd in range(2):
                for n in ["tl", "atomic"] + names:
                    ov = dict(gluon=False) if n == "tl" else dict(gluon=True, dq_atomics=True) if n == "atomic" else dict(gluon=True)
                    if n not in ("tl", "atomic"): use(n)
                    with config.override(**ov):
                        out = flashop.attention(q, k, v, causal=causal)
                        f = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                        res.setdefault(n, []).append(flops / triton.testing.do_bench(f, warmup=25, rep=150) / 1e9)
            rows.append((D, N, causal, {n: max(x) for n, x in res.items()}))
            print(D, N, causal, " ".join("%s %.0f" % (n, max(x)) for n, x in res.items()), flush=True)
print("\nD N causal | " + " ".join(["tl", "atomic"] + names))
for D, N, c, r in rows: print(D, N, c, "|", " ".join("%.0f" % r[n] for n in ["tl", "atomic"] + names))
