"""The `tl` backward's kernels at D = 128 (4096 keys, not causal), the default and with dQ
by atomics, compiled for sm_90 on a machine without a GPU (performance notes, entry 150):
per kernel its tiles, the MMA layouts of its TTGIR and each thread's wgmma instructions by
shape, to see whether any product is computed twice by the two warp groups (as the MLA
kernel's scores were, entry 141).

From the repository root, with a CPU torch and triton 3.6.0 (or the newest):

    PYTHONPATH=. python docs/notes/experiments/tl_backward_wgmma_counts.py
"""

import collections
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)
import compile_for_hopper as C  # noqa: E402  (the stand-in driver first)
from compile_sm90 import compile_kernel, report  # noqa: E402
import torch  # noqa: E402

import flashop  # noqa: E402


def run(label, atomics, D=128, causal=False):
    """Compile and describe the backward kernels of one call."""
    q, k, v = (torch.randn(1, 4096, 2, D, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    with flashop.config.override(gluon=False, dq_atomics=atomics):
        caught = C.catch_launches(C._forward_backward(
            lambda: flashop.attention(q, k, v, causal=causal)))
    for kernel, grid, kwargs in caught:
        name = getattr(kernel, "fn", kernel).__name__
        if "bwd" not in name:
            continue
        res = compile_kernel(kernel, grid, kwargs, label=f"{label} {name}")
        report(res)
        if res.ok:
            ttgir = res.compiled.asm["ttgir"]
            layouts = sorted(set(re.findall(
                r"warpsPerCTA = \[(\d+, \d+)\], instrShape = \[(\d+, \d+, \d+)\]", ttgir)))
            w = collections.Counter(re.findall(r"wgmma.mma_async.sync.aligned.(m64n\d+k16)",
                                               res.compiled.asm["ptx"]))
            print(f"    tiles {kwargs.get('BLOCK_M')}x{kwargs.get('BLOCK_N')}, "
                  f"{kwargs.get('num_warps')} warps, {kwargs.get('num_stages')} stages; "
                  f"layouts {layouts}; wgmmas {dict(w)}")

if __name__ == "__main__":
    run("default", None)
    run("atomics", True)
