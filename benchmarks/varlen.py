"""Packed documents: flashop.attention_varlen against a dense batch of the mean document
length (the same tokens, the same attended pairs per token on average) and FlexAttention
with a document mask over the packed sequence.

bf16, D = 128, H = 16, 16384 tokens, causal within each document; document lengths drawn
from a fixed seed. TFLOP/s count the attended pairs (4 * pairs * D * H forward, 2.5x that
backward).

Usage: python benchmarks/varlen.py [--out PATH.csv]
"""

import argparse
import datetime
import sys
from pathlib import Path

import torch
import torch._functorch.config
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import bench_one, gpu_slug, import_flashop, write_csv  # noqa: E402
from progress import progress  # noqa: E402

CSV_HEADER = ["gpu", "torch", "triton", "provider", "layout", "dtype", "D", "H", "tokens",
              "documents", "mean_len", "pass", "ms", "tflops"]
TOKENS, H, D = 16384, 16, 128
MIXES = ((256, 1024), (512, 4096), (1024, 8192))  # document lengths drawn from [lo, hi]


def document_lengths(seed, lo, hi):
    """Lengths in [lo, hi] summing to TOKENS (the last one takes the rest)."""
    gen = torch.Generator().manual_seed(seed)
    lens, left = [], TOKENS
    while left > hi:
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        lens.append(n)
        left -= n
    return lens + [left]


def causal_pairs(lens):
    return sum(n * (n + 1) / 2 for n in lens)


def bench(fn, inputs, warmup, rep, cuda_graph=False):
    """{pass: median ms} of ``fn()``; with ``cuda_graph`` also "fwd-graph": the forward
    replayed from a CUDA graph (no host time)."""
    def call(q, k, v):
        return fn()

    times = {}
    if cuda_graph:
        times["fwd-graph"] = bench_one(call, inputs, ("fwd",), warmup, rep, cuda_graph=True)["fwd"]
    return {**times, **bench_one(call, inputs, ("fwd", "bwd"), warmup, rep)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rep", type=int, default=50)
    p.add_argument("--cuda-graph", action="store_true",
                   help="also time the forward replayed from a CUDA graph (no host time)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("This benchmark needs a CUDA GPU; none is available.")
    flashop = import_flashop()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    torch._functorch.config.donated_buffer = False  # compiled backward re-run with retain_graph
    flex = torch.compile(flex_attention)
    gpu = torch.cuda.get_device_name()
    out = Path(args.out) if args.out else (
        Path(__file__).resolve().parent / "results"
        / f"{datetime.date.today().isoformat()}-{gpu_slug(gpu)}-varlen.csv")
    print(f"GPU: {gpu} | torch {torch.__version__} | triton {triton.__version__}", flush=True)
    rows = []
    bar = progress(MIXES, desc="documents", label=lambda m: f"{m[0]}-{m[1]} tokens")
    for lo, hi in bar:
        lens = document_lengths(0, lo, hi)
        mean = TOKENS / len(lens)
        pairs = causal_pairs(lens)
        cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
        torch.manual_seed(0)
        q, k, v = (torch.randn(TOKENS, H, D, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        doc = torch.repeat_interleave(torch.arange(len(lens), device="cuda"),
                                      torch.tensor(lens, device="cuda"))

        def doc_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        block_mask = create_block_mask(doc_causal, None, None, TOKENS, TOKENS, device="cuda")
        # a dense batch of the mean length, the same number of tokens
        N = max(16, int(round(mean / 16)) * 16)
        B = TOKENS // N
        qd, kd, vd = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16,
                                  requires_grad=True) for _ in range(3))
        cases = [
            ("flashop", "packed", lens, pairs, (q, k, v), lambda: flashop.attention_varlen(
                q, k, v, cu, cu, max(lens), max(lens), causal=True)),
            ("flex", "packed", lens, pairs, (q, k, v), lambda: flex(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                block_mask=block_mask)[0].transpose(0, 1)),
            ("flashop", f"dense {B}x{N}", [N] * B, causal_pairs([N] * B), (qd, kd, vd),
             lambda: flashop.attention(qd, kd, vd, causal=True)),
        ]
        for provider, layout, doc_lens, n_pairs, inputs, fn in cases:
            times = bench(fn, list(inputs), args.warmup, args.rep, args.cuda_graph)
            for pass_, ms in times.items():
                f = 4 * n_pairs * D * H * (2.5 if pass_ == "bwd" else 1.0)  # fwd, fwd-graph
                tflops = f / (ms * 1e-3) / 1e12
                rows.append(dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                                 provider=provider, layout=layout, dtype="bf16", D=D, H=H,
                                 tokens=TOKENS, documents=len(doc_lens),
                                 mean_len=round(TOKENS / len(doc_lens)), **{"pass": pass_},
                                 ms=round(ms, 4), tflops=round(tflops, 1)))
                bar.write(f"docs {lo}-{hi} ({len(lens)} docs, mean {mean:.0f}) {provider:<8} "
                          f"{layout:<14} {pass_} {ms:7.3f} ms {tflops:6.1f} TFLOP/s")
    write_csv(out, rows, CSV_HEADER)
    print(f"results written to {out}", flush=True)


if __name__ == "__main__":
    main()
