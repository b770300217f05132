"""Experiment (performance notes, entry 84): where the Gluon forward's time goes at 1k keys.

Needs an NVIDIA Hopper GPU with triton 3.6, and `gluon_forward_ablation.patch` applied
(it adds the switches read below to flashop/kernels/forward_gluon.py; apply to d009bb9).
Not imported by flashop and not run by CI. One variant per process, since the switches
are module constants read at import:

    FLASHOP_ABLATE=bits FLASHOP_Q_BUFFERS=n FLASHOP_FWD_STAGES=s \\
        python docs/notes/experiments/gluon_forward_ablation.py NAME [--items]

ABLATE bits: 1 no softmax (P = S: the wgmmas, loads and stores only), 2 no causal mask
on the diagonal tiles, 4 no output stores (the values still computed). Q_BUFFERS=2 gives
each consumer group two Q buffers, so the next item's Q loads while this one runs (it
fits beside two K/V stages, not three, at D = 128). FLASHOP_FWD_STAGES sets the K/V
stages at D = 128. FLASHOP_O_TMA=1 stages each group's output in its Q buffer and stores
it by TMA, releasing Q after the store (the form kept); FLASHOP_O_LAYOUT=1 converts the
output to a row-major blocked layout before the pointer store (its conversion's scratch
does not fit beside three stages at D = 128: it did not launch).

Prints one CSV line per point: variant, D, causal, S_q, S_k, flashop's µs and TFLOP/s,
cuDNN's, and the largest difference of flashop's output to the `tl` kernels'
(FLASHOP_GLUON=0; meaningful for the variants that compute the same values). bf16,
hidden size 2048 (H = 16), B = 16384 / S_q; both forwards replayed from CUDA graphs,
medians of do_bench. ``--items`` adds the non-causal calls of 1024 queries over 256 to
16384 keys, whose times against the key tiles per item give an item's fixed cost.
"""
import os
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.getcwd())
import flashop  # noqa: E402
from flashop import config, launch_gluon  # noqa: E402

D = 128
stages = int(os.environ.get("FLASHOP_FWD_STAGES", "3"))
BM, BN, _ = launch_gluon.FWD_TILES[D]
launch_gluon.FWD_TILES[D] = (BM, BN, stages)


def graphed(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def us(run):
    for _ in range(200):
        run()
    torch.cuda.synchronize()
    return triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median") * 1e3


@torch.no_grad()
def point(name, causal, S_q, S_k):
    B, H = 16384 // S_q, 2048 // D
    q = torch.randn(B, S_q, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, S_k, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with config.override(gluon=True):
        t_fl = us(graphed(lambda: flashop.attention(q, k, v, causal=causal)))
        out = flashop.attention(q, k, v, causal=causal)
    with config.override(gluon=False):
        ref = flashop.attention(q, k, v, causal=causal)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    t_cu = us(graphed(cudnn))
    fl = 4 * B * H * S_q * S_k * D / (2 if causal else 1)
    diff = (out.float() - ref.float()).abs().max().item()
    print(f"{name},{D},{int(causal)},{S_q},{S_k},{t_fl:.2f},{fl / t_fl / 1e6:.0f},"
          f"{t_cu:.2f},{fl / t_cu / 1e6:.0f},{diff:.3g}", flush=True)


if __name__ == "__main__":
    name = sys.argv[1]
    print(f"# {name}: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}, ABLATE={os.environ.get('FLASHOP_ABLATE', '0')}, Q_BUFFERS="
          f"{os.environ.get('FLASHOP_Q_BUFFERS', '1')}, stages={stages}", flush=True)
    for causal, n in ((True, 1024), (False, 1024), (True, 2048), (True, 4096),
                      (False, 4096), (False, 16384), (True, 16384), (True, 1000),
                      (False, 1000)):
        point(name, causal, n, n)
    if "--items" in sys.argv:
        for s_k in (256, 512, 2048, 4096, 8192, 16384):
            point(name, False, 1024, s_k)
