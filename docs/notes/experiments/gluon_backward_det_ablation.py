"""Experiment (performance notes, entry 153's open question): what holds the reproducible
Gluon backward behind its atomics form, part by part. Needs
``gluon_backward_det_ablation.patch`` applied (``git apply``; made against commit 87ac53c):
it adds ``_launch.gluon.BWD_ABLATE``, a bitmask the kernel takes as ``ABLATE``:

- 1: the dQ warp does not wait for its turn (the counters' acquire spin);
- 2: nor for its adds' completion (``cp.async.bulk.wait_group 0`` and the proxy fence);
- 4: nor raises the counters (with 1 only: a turn would never come);
- 8: the consumer groups add dQ themselves, as in the atomics form, but in the
  reproducible form's grid order and query-tile walk (the dQ warp idle).

Not causal, D = 128 and 64 (both rotated here: BWD_ROTATE_DIMS widened), bf16, hidden size
2048, 16k tokens per batch; backward TFLOP/s, best of two alternating rounds, plans cleared
at each form (an eager call's plan keeps its first launch). The forms' gradients first:
each ablation's dQ against the reproducible form's (the same sums in another order: within
a few fp32 roundings). Expected reading: 0 -> 1 is the turns' cost, 1 -> 3 the completion
round trips', 3 -> 7 the counters', 7 -> 8 the hand-off to the dQ warp, 8 -> atomics the
grid order and the walk. Hopper, triton 3.6; not run by CI.

    git apply docs/notes/experiments/gluon_backward_det_ablation.patch
    PYTHONPATH=. python docs/notes/experiments/gluon_backward_det_ablation.py
    git checkout flashop
"""
import torch
import triton

import flashop
from flashop import config
from flashop._launch import gluon
from flashop._launch.plans import clear_plans

assert hasattr(gluon, "BWD_ABLATE"), "apply gluon_backward_det_ablation.patch first"
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
gluon.BWD_ROTATE_DIMS = (64, 128)
FORMS = {"atomics": None, "det": 0, "no-turns": 1, "no-waits": 3, "no-counters": 7,
         "consumers-add": 8}


def backward(q, k, v, dout, form):
    """(the gradients' function, for do_bench) of one form, its plan recorded afresh; the
    caller holds FLASHOP_GLUON=1 (the backward's kernel is chosen when it runs)."""
    ablate = FORMS[form]
    gluon.BWD_ABLATE = ablate or 0
    clear_plans()
    out = flashop.attention(q, k, v, deterministic=ablate is not None)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


config.settings.gluon = True
for D in (128, 64):
    B, N, H = 2, 4096, 2048 // D
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
               .requires_grad_() for _ in range(3))
    dout = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    ref = backward(q, k, v, dout, "det")()[0].float()
    for form in FORMS:
        dq = backward(q, k, v, dout, form)()[0].float()
        print(f"D={D} {form}: dQ's largest difference to the reproducible form's / its largest"
              f" value {((dq - ref).abs().max() / ref.abs().max()).item():.1e}", flush=True)
    for N in (2048, 4096, 16384):
        B = 16384 // N
        q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        flops = 2.5 * 4 * B * H * N * N * D
        best = {}
        for _ in range(2):
            for form in FORMS:
                f = backward(q, k, v, dout, form)
                tf = flops / triton.testing.do_bench(f, warmup=25, rep=100) / 1e9
                best[form] = max(best.get(form, 0.0), tf)
        print(f"D={D} N={N} not causal, TFLOP/s: "
              + " ".join(f"{n} {x:.0f}" for n, x in best.items()), flush=True)
gluon.BWD_ABLATE = 0
