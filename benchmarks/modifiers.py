"""Cost of each score modifier: flashop with a modifier against flashop without, and
FlexAttention with the same mask or score modification where it has one.

bf16, D = 128, 16384 tokens per batch, hidden size 2048 (as benchmarks/attention.py).
TFLOP/s count only the (query, key) pairs a variant attends (so a window or a chunk is not
credited with the pairs it skips); ``ms`` is the time itself. Chunked attention (causal,
chunks of ``--chunk`` tokens, Llama 4's local layers) is timed against FlexAttention with a
chunked block mask, and its time reported as a share of plain causal attention's (about
chunk / N plus the tiles that cross a chunk's edge is the aim).

Usage: python benchmarks/modifiers.py [--seqlens 4096,16384] [--chunk 1024] [--out PATH.csv]
"""

import argparse
import datetime
import sys
from pathlib import Path

import torch
import torch._functorch.config
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import (  # noqa: E402
    HIDDEN, TOKENS, bench_one, gpu_slug, import_flashop, int_list, write_csv,
)
from progress import progress  # noqa: E402

CSV_HEADER = ["gpu", "torch", "triton", "provider", "variant", "dtype", "D", "N", "B", "H",
              "causal", "pass", "ms", "tflops"]
WINDOW = 1024
CHUNK = 1024


def chunk_variant(chunk: int) -> str:
    return f"causal chunk {chunk}"


def variants(N, H, B, device, chunk=CHUNK):
    """name -> (causal, window_size, extra keyword arguments of flashop.attention)."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1, device=device) / H)
    g = torch.nn.functional.logsigmoid(torch.randn(B, N, H, device=device) + 4)
    keep = torch.rand(1, 1, N, N, device=device) < 0.9
    bias = torch.randn(1, 1, N, N, device=device, dtype=torch.bfloat16)
    return {
        "plain": (False, (-1, -1), {}),
        "window 512/512": (False, (512, 512), {}),
        "causal": (True, (-1, -1), {}),
        f"causal window {WINDOW}": (True, (WINDOW, 0), {}),
        chunk_variant(chunk): (True, (-1, -1), dict(attention_chunk=chunk)),
        "causal softcap 30": (True, (-1, -1), dict(softcap=30.0)),
        "causal alibi": (True, (-1, -1), dict(alibi_slopes=slopes)),
        "causal gate": (True, (-1, -1), dict(g=g)),
        "causal bool mask": (True, (-1, -1), dict(attn_mask=keep)),
        "causal bf16 bias": (True, (-1, -1), dict(attn_mask=bias)),
        # training features: learned sinks (with their gradient) and dropout
        "causal sinks": (True, (-1, -1), dict(sinks=torch.zeros(H, device=device,
                                                                requires_grad=True))),
        "causal dropout 0.1": (True, (-1, -1), dict(dropout_p=0.1)),
        "dropout 0.1": (False, (-1, -1), dict(dropout_p=0.1)),
    }


def attended_pairs(N, causal, window, chunk=0):
    left, right = window
    if causal:
        right = 0
    i = torch.arange(N, dtype=torch.float64)
    hi = torch.clamp(i + right, max=N - 1) if right >= 0 else torch.full_like(i, N - 1)
    lo = torch.clamp(i - left, min=0) if left >= 0 else torch.zeros_like(i)
    if chunk:
        start = torch.div(i, chunk, rounding_mode="floor") * chunk
        lo, hi = torch.maximum(lo, start), torch.minimum(hi, start + chunk - 1)
    return float((hi - lo + 1).sum())


def flex_fn(N, causal, window, chunk=0):
    """FlexAttention with a block mask for causal / sliding-window causal / chunked causal,
    or None."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if not causal or window[1] not in (0, -1):
        return None
    left = window[0]

    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        if chunk:
            keep = keep & (q_idx // chunk == kv_idx // chunk)
        return keep & (q_idx - kv_idx <= left) if left >= 0 else keep

    block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=N, KV_LEN=N, device="cuda")
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                    block_mask=block_mask).transpose(1, 2)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", type=int_list, default=[4096, 16384])
    p.add_argument("--chunk", type=int, default=CHUNK, help="the chunked variant's chunk")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rep", type=int, default=50)
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("This benchmark needs a CUDA GPU; none is available.")
    flashop = import_flashop()
    gpu = torch.cuda.get_device_name()
    out = Path(args.out) if args.out else (
        Path(__file__).resolve().parent / "results"
        / f"{datetime.date.today().isoformat()}-{gpu_slug(gpu)}-modifiers.csv")
    print(f"GPU: {gpu} | torch {torch.__version__} | triton {triton.__version__}", flush=True)
    D, rows = 128, []
    torch._functorch.config.donated_buffer = False  # compiled backward re-run with retain_graph
    steps = [(N, name) for N in args.seqlens
             for name in variants(1, 1, 1, "cpu", args.chunk)]
    bar = progress(steps, desc="modifiers", label=lambda s: f"N={s[0]} {s[1]}")
    current_N = None
    for N, name in bar:
        B, H = TOKENS // N, HIDDEN // D
        if N != current_N:
            if current_N is not None:
                write_csv(out, rows, CSV_HEADER)  # after every length: a partial run keeps its rows
            current_N, q, k, v, cases = N, None, None, None, None
            torch.cuda.empty_cache()
            torch.manual_seed(0)
            q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            cases = variants(N, H, B, "cuda", args.chunk)
        causal, window, extra = cases[name]
        chunk = extra.get("attention_chunk", 0)
        pairs = attended_pairs(N, causal, window, chunk)
        providers = [("flashop", lambda q, k, v, c=causal, w=window, e=extra:
                      flashop.attention(q, k, v, causal=c, window_size=w, **e))]
        if not args.no_flex and set(extra) <= {"attention_chunk"}:
            fn = flex_fn(N, causal, window, chunk)
            if fn is not None:
                providers.append(("flex", fn))
        for provider, fn in providers:
            try:
                times = bench_one(fn, (q, k, v), ("fwd", "bwd"), args.warmup, args.rep)
            except Exception as e:  # noqa: BLE001 (report and go on)
                bar.write(f"N={N} {name} {provider}: skipped: {type(e).__name__}: "
                          f"{str(e).strip().splitlines()[-1][:160]}")
                continue
            for pass_, ms in times.items():
                f = 4 * B * H * pairs * D * (2.5 if pass_ == "bwd" else 1.0)
                tflops = f / (ms * 1e-3) / 1e12
                rows.append(dict(gpu=gpu, torch=torch.__version__,
                                 triton=triton.__version__, provider=provider,
                                 variant=name, dtype="bf16", D=D, N=N, B=B, H=H,
                                 causal=causal, **{"pass": pass_}, ms=round(ms, 4),
                                 tflops=round(tflops, 1)))
                bar.write(f"N={N:6d} {name:<22} {provider:<8} {pass_} {ms:8.3f} ms "
                          f"{tflops:7.1f} TFLOP/s")
    write_csv(out, rows, CSV_HEADER)
    for line in chunk_shares(rows, chunk_variant(args.chunk)):
        print(line, flush=True)
    print(f"results written to {out}", flush=True)


def chunk_shares(rows, variant):
    """Lines of the chunked variant's time as a share of plain causal attention's (flashop's
    causal time for both providers), per length, provider and pass."""
    ms = {(r["N"], r["provider"], r["variant"], r["pass"]): r["ms"] for r in rows}
    lines = []
    for (N, provider, name, pass_), t in ms.items():
        causal = ms.get((N, "flashop", "causal", pass_))
        if name == variant and causal:
            lines.append(f"N={N:6d} {variant} {provider:<8} {pass_} {t:8.3f} ms = "
                         f"{t / causal:.3f} x flashop's causal ({causal:.3f} ms)")
    return lines


if __name__ == "__main__":
    main()
