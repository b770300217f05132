"""Experiment (performance notes, entry 86): the first timing of the Gluon backward after its
compile, against later ones in the same process. D = 128, N = 4096, B = 4, H = 16, bf16, not
causal; three rounds, each timing benchmarks/attention.py's bench_one (a warm-up call, then
calls for a while, then do_bench), then do_bench again on the same inputs, on fresh inputs,
and on the first inputs with a new dout; for the default backward (the Gluon form at these
shapes) and the tl kernels. Hopper, triton 3.6; not run by CI. Run from the repository root."""
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import torch  # noqa: E402
import triton  # noqa: E402

import attention as A  # noqa: E402

D, H, N = 128, 16, 4096
B = 16384 // N
FLOPS = 2.5 * 4 * B * H * N * N * D


def tflops(ms):
    return FLOPS / ms / 1e9


for rnd in range(3):
    for name in ("flashop", "flashop-no-gluon"):
        torch.manual_seed(0)
        fn, layout = A.make_provider(name, N, False)
        inputs = A.make_inputs(B, N, H, D, layout)
        first = A.bench_one(fn, inputs, ["bwd"], 25, 100)["bwd"]
        q, k, v = inputs
        with A.switches_of(fn):
            o = fn(q, k, v)
            do = torch.randn_like(o)
            same = triton.testing.do_bench(lambda: o.backward(do, retain_graph=True), warmup=25,
                                           rep=100, grad_to_none=[q, k, v])
            q2, k2, v2 = (torch.randn_like(x).requires_grad_() for x in inputs)
            o2 = fn(q2, k2, v2)
            do2 = torch.randn_like(o2)
            fresh = triton.testing.do_bench(lambda: o2.backward(do2, retain_graph=True),
                                            warmup=25, rep=100, grad_to_none=[q2, k2, v2])
            new_dout = triton.testing.do_bench(lambda: o.backward(do2, retain_graph=True),
                                               warmup=25, rep=100, grad_to_none=[q, k, v])
        print(rnd, name, "bench_one %.0f, same inputs %.0f, fresh inputs %.0f, old inputs new "
              "dout %.0f" % tuple(map(tflops, (first, same, fresh, new_dout))), flush=True)
        del inputs, o, o2
        torch.cuda.empty_cache()
