"""Experiment (performance notes, entry 74): the Gluon backward with dropout, variants of
flashop/kernels/backward_gluon.py (backward_gluon_<name>.py in $VARIANTS, "cur" the
package's): checked against the reference with the kernels' mask (bitwise repeated), then
timed against the plain backward and the tl backward with dropout. Hopper, triton 3.6; not
run by CI."""
import os, sys, importlib.util
sys.path.insert(0, os.getcwd())
from unittest import mock
import torch, triton
import flashop
from flashop import launch_gluon, config
from flashop.testing import check_attention, dropout_mask
def load(name):
    spec = importlib.util.spec_from_file_location("bg_" + name, os.path.join(os.environ.get("VARIANTS", "."), f"backward_gluon_{name}.py"))
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m.attention_bwd_gluon_kernel
kern = {"cur": launch_gluon._bwd_kernel()}
names = sys.argv[1].split(",")
for n in names:
    if n not in kern: kern[n] = load(n)
def use(n): launch_gluon._bwd_kernel = lambda: kern[n]
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
torch.manual_seed(0)
p = 0.17
for (B, S, H, Hk, causal, D, dt) in ((2, 1000, 4, 2, True, 128, torch.bfloat16), (1, 777, 4, 1, False, 128, torch.float16), (2, 300, 6, 2, True, 64, torch.float16), (1, 2048, 8, 8, False, 64, torch.bfloat16), (1, 4096, 16, 16, True, 128, torch.bfloat16)):
    q = torch.randn(B, S, H, D, device="cuda", dtype=dt, requires_grad=True)
    k, v = (torch.randn(B, S, Hk, D, device="cuda", dtype=dt, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q); dlse = torch.randn(B, H, S, device="cuda")
    seed = torch.tensor([4242], dtype=torch.int64, device="cuda")
    keep = dropout_mask(seed, B, H, S, S, p)
    for n in names:
        use(n)
        with mock.patch.object(launch_gluon, "attention_backward", wraps=launch_gluon.attention_backward) as spy, config.override(gluon=True):
            out, lse, _ = torch.ops.flashop.attention_forward(q, k, v, None, None, None, None, seed, dropout_p=p, causal=causal)
            runs = [torch.autograd.grad((out, lse), (q, k, v), (dout, dlse), retain_graph=True) for _ in range(2)]
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(*runs))
        used = spy.called and spy.call_args.kwargs.get("DROPOUT") is True
        res = check_attention(q, k, v, dout, dlse, out, lse, runs[0], causal=causal, dropout_p=p, dropout_mask=keep)
        print("check", n, B, S, H, Hk, causal, D, dt, "gluon", used, "bitwise", same, "ok", all(r.ok for r in res), "; ".join(str(r) for r in res if not r.ok), flush=True)
for D in (128, 64):
    for causal in (False, True):
        for N in ((4096, 16384) if D == 128 else (16384,)):
            B, H = 16384 // N, 2048 // D
            q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            dout = torch.randn_like(q)
            res = {}
            for rnd in range(2):
                for n in ["plain", "tl"] + names:
                    if n not in ("plain", "tl"): use(n)
                    ov = dict(gluon=False) if n == "tl" else dict(gluon=True) if n != "plain" else {}
                    pp = 0.0 if n == "plain" else 0.1
                    with config.override(**ov):
                        out = flashop.attention(q, k, v, causal=causal, dropout_p=pp)
                        f = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                        res.setdefault(n, []).append(triton.testing.do_bench(f, warmup=10, rep=100))
            r = {n: min(x) for n, x in res.items()}
            print(D, N, causal, " ".join("%s %.3f ms (%.2fx)" % (n, t, t / r["plain"]) for n, t in r.items()), flush=True)
