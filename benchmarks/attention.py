"""Attention benchmark: flashop against SDPA (flash, cuDNN, memory-efficient) and FlexAttention.

Grid: bf16, 16384 tokens per batch (B = 16384 // N), hidden size 2048 (H = 2048 // D),
head dims D, sequence lengths N, causal and not. A head dim written D/DV gives the values
DV dims and H = 2048 // DV heads (192/128: DeepSeek-V3's prefill, 16 heads, its 128 at
tensor parallelism 8). Forward and backward are timed separately with
triton.testing.do_bench (median); the backward is ``o.backward(do, retain_graph=True)``
alone. TFLOP/s: forward 2*B*H*N*N*(D + DV) (halved when causal), backward 2.5x that.

Providers: flashop (its defaults, eager), flashop-compiled (the same call inside
``torch.compile(fullgraph=True)``), flashop-deterministic (``deterministic=True``: the bitwise
reproducible backward), flashop-fp8 (the forward on e4m3 q, k, v, each quantized per
(batch, head) by its amax, untimed; FLOPs counted as bf16's), flashop with switches changed
(flashop-atomic, flashop-atomic-no-gluon, flashop-autotune, flashop-tma, flashop-no-tma,
flashop-no-ws, flashop-no-gluon, flashop-no-gluon-tma, flashop-no-gluon-ws,
flashop-no-gluon-no-ws: README's Configuration, set with ``flashop.config.override`` while
timing), SDPA pinned to each backend (sdpa-flash = FlashAttention-2, sdpa-cudnn, sdpa-mem)
and compiled FlexAttention.

Usage: python benchmarks/attention.py [--quick] [--heads-dims 64,128,256,192/128]
       [--plot out.png]
"""

import argparse
import contextlib
import csv
import datetime
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from progress import progress  # noqa: E402

TOKENS = 16384
HIDDEN = 2048
# flashop with switches changed (flashop.config.override's keywords) while it is timed
FLASHOP_VARIANTS = {
    "flashop": {},
    "flashop-atomic": {"dq_atomics": True},  # the backward adds dQ by atomics
    "flashop-atomic-no-gluon": {"dq_atomics": True, "gluon": False},  # ... in the tl kernels
    "flashop-autotune": {"autotune": True},  # autotuned tiles instead of the table
    "flashop-tma": {"tma": True},  # key/value tiles through tensor descriptors everywhere
    "flashop-no-tma": {"tma": False},  # ... nowhere
    "flashop-no-ws": {"warp_specialize": False},  # never the warp-specialized forward
    "flashop-ws": {"warp_specialize": True},  # ... wherever the inputs allow it
    "flashop-no-gluon": {"gluon": False},  # never the Gluon forward
    "flashop-no-gluon-tma": {"gluon": False, "tma": True},  # the tl kernels, descriptors
    "flashop-no-gluon-no-ws": {"gluon": False, "warp_specialize": False},  # ... no WS forward
    "flashop-no-gluon-ws": {"gluon": False, "warp_specialize": True},  # ... WS where allowed
    "flashop-gluon": {"gluon": True},  # ... wherever the inputs allow it
}
# flashop called otherwise: compiled, or with the deterministic backward
FLASHOP_CALLS = {"flashop-compiled": {"compiled": True},
                 "flashop-deterministic": {"deterministic": True}}
FORWARD_ONLY = ["flashop-fp8"]
PEERS = ["sdpa-flash", "sdpa-cudnn", "sdpa-mem", "flex"]
PROVIDERS = [*FLASHOP_VARIANTS, *FLASHOP_CALLS, *FORWARD_ONLY, *PEERS]
DEFAULT_PROVIDERS = ["flashop", *PEERS]
SDPA_BACKENDS = {
    "sdpa-flash": SDPBackend.FLASH_ATTENTION,
    "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa-mem": SDPBackend.EFFICIENT_ATTENTION,
}
CSV_HEADER = ["gpu", "torch", "triton", "provider", "dtype", "D", "N", "B", "H", "causal",
              "pass", "ms", "tflops", "DV"]
RATIOS = [("flashop", "sdpa-flash"), ("flashop", "flex"), ("flashop", "sdpa-cudnn"),
          ("flashop-compiled", "flashop"), ("flashop-deterministic", "sdpa-cudnn"),
          ("flashop-fp8", "flashop")]


def import_flashop():
    """Import flashop, falling back to the checkout this script lives in."""
    try:
        import flashop
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        import flashop
    return flashop


def make_inputs(B, N, H, D, layout, DV=None):
    """Random normal bf16 q, k, v leaves requiring grad (v with DV dims, default D); layout
    'bnhd' or 'bhnd' (contiguous)."""
    return [torch.randn((B, N, H, d) if layout == "bnhd" else (B, H, N, d), device="cuda",
                        dtype=torch.bfloat16, requires_grad=True)
            for d in (D, D, DV or D)]


def provider_flashop(N, causal, switches=None, compiled=False, deterministic=False):
    """flashop.attention (``deterministic``: its bitwise reproducible backward), in
    ``torch.compile(fullgraph=True)`` where ``compiled``; ``switches``
    (flashop.config.override's keywords) are in force while bench_one times it."""
    flashop = import_flashop()

    def fn(q, k, v):
        return flashop.attention(q, k, v, causal=causal, deterministic=deterministic)
    if compiled:
        fn = _compiled(fn)
    fn.switches = dict(switches or {})
    return fn, "bnhd"


def provider_flashop_fp8(causal):
    """flashop.attention on e4m3 copies of q, k, v with their (B, H) descales, made on the
    first call of each input (not timed; v keeps the (B, N, H, D) layout, so the forward's
    copy of v keys-last is timed)."""
    flashop = import_flashop()
    made = {}

    def quantized(x):
        descale = (x.detach().abs().amax(dim=(1, 3)).float() / 448).clamp(min=1e-12)
        return (x.detach().float() / descale[:, None, :, None]).to(torch.float8_e4m3fn), descale

    def fn(q, k, v):
        key = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        if key not in made:
            made.clear()
            made[key] = [quantized(x) for x in (q, k, v)]
        (q8, qd), (k8, kd), (v8, vd) = made[key]
        return flashop.attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                                 v_descale=vd)
    return fn, "bnhd"


def _fresh_dynamo():
    """A fresh Dynamo state per shape (otherwise the recompile limit is hit and a compiled
    call falls back), whose compiled backwards may run repeatedly (retain_graph=True: no
    donated buffers)."""
    import torch._dynamo
    import torch._functorch.config
    torch._dynamo.reset()
    if hasattr(torch._functorch.config, "donated_buffer"):
        torch._functorch.config.donated_buffer = False


def _compiled(fn):
    """``torch.compile(fn, fullgraph=True)`` from a fresh Dynamo state."""
    _fresh_dynamo()
    return torch.compile(fn, fullgraph=True)


def provider_sdpa(backend, causal):
    def fn(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn, "bhnd"


_flex_compiled = None


def provider_flex(N, causal):
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    _fresh_dynamo()
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention)
    block_mask = None
    if causal:
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
                                       B=None, H=None, Q_LEN=N, KV_LEN=N, device="cuda")
    return (lambda q, k, v: _flex_compiled(q, k, v, block_mask=block_mask)), "bhnd"


def make_provider(name, N, causal):
    """Return (forward callable taking q, k, v, input layout) for a provider."""
    if name in FLASHOP_VARIANTS:
        return provider_flashop(N, causal, FLASHOP_VARIANTS[name])
    if name in FLASHOP_CALLS:
        return provider_flashop(N, causal, **FLASHOP_CALLS[name])
    if name == "flashop-fp8":
        return provider_flashop_fp8(causal)
    if name in SDPA_BACKENDS:
        return provider_sdpa(SDPA_BACKENDS[name], causal)
    if name == "flex":
        return provider_flex(N, causal)
    raise ValueError(f"unknown provider {name}")


def flops(B, H, N, D, causal, pass_, DV=None):
    f = 2 * B * H * N * N * (D + (DV or D))
    if causal:
        f /= 2
    return f * 2.5 if pass_ == "bwd" else f


def _graphed(fn, q, k, v):
    """fn(q, k, v) without autograd, captured in a CUDA graph: replaying it times the
    kernels without the host's launch overhead."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad():
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn(q, k, v)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(q, k, v)
    return graph.replay


def _busy(run, seconds=1.0):
    """Run for a while before timing: after a compile the GPU has idled and its clocks
    take longer to come back than do_bench's warm-up (0.3 s was not enough after the Gluon
    backward's compile: entry 86 of docs/notes/performance-notes.md)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        run()
    torch.cuda.synchronize()


def switches_of(fn):
    """The context in which ``fn`` is timed: ``flashop.config.override(**fn.switches)``
    for a flashop provider with switches, else nothing."""
    switches = getattr(fn, "switches", None)
    if not switches:
        return contextlib.nullcontext()
    import_flashop()
    from flashop import config
    return config.override(**switches)


def bench_one(fn, inputs, passes, warmup, rep, cuda_graph=False):
    """Time fn(*inputs) forward and/or backward; returns {pass: median ms}. With
    ``cuda_graph`` the forward is replayed from a CUDA graph (no host overhead)."""
    q, k, v = inputs
    out = {}
    with switches_of(fn):
        if "fwd" in passes:
            fn(q, k, v)  # warm-up (compiles / autotunes)
            torch.cuda.synchronize()
            _busy(lambda: fn(q, k, v))
            run = _graphed(fn, q, k, v) if cuda_graph else (lambda: fn(q, k, v))
            out["fwd"] = triton.testing.do_bench(run, warmup=warmup, rep=rep,
                                                 return_mode="median")
        if "bwd" in passes:
            o = fn(q, k, v)
            do = torch.randn_like(o)
            o.backward(do, retain_graph=True)  # warm-up (compiles)
            torch.cuda.synchronize()
            _busy(lambda: o.backward(do, retain_graph=True))
            for x in (q, k, v):
                x.grad = None
            out["bwd"] = triton.testing.do_bench(lambda: o.backward(do, retain_graph=True),
                                                 warmup=warmup, rep=rep,
                                                 grad_to_none=[q, k, v], return_mode="median")
            del o, do
    return out


def error_line(error):
    """The line of an exception's message that says what failed (at most 200 characters)."""
    # torch.compile's errors name the exception the traced code raised inside their text
    cause = re.search(r"(?:got|raised exception) (\w+)\('(.+?)'\)", str(error))
    if cause:
        return f"{cause[1]}: {cause[2]}"[:200]
    lines = [x for x in str(error).splitlines() if x.strip()] or [""]
    # Triton compile errors start with "at L:C:" and end with the cause.
    return (lines[-1] if lines[0].rstrip().endswith(":") else lines[0]).strip()[:200]


def gpu_slug(name):
    return re.sub(r"[^a-z0-9-]", "", name.lower().replace(" ", "-"))


def write_csv(path, rows, fieldnames=CSV_HEADER):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fieldnames, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def dims_label(D, DV=None):
    """A head dim as --heads-dims writes it: D, or D/DV where the values' differs."""
    return str(D) if DV in (None, D) else f"{D}/{DV}"


def print_table(rows, providers):
    """One row per (D, N, causal, pass); TFLOP/s per provider, then flashop ratios."""
    table = {}
    for r in rows:
        key = (dims_label(r["D"], r["DV"]), r["N"], r["causal"], r["pass"])
        table.setdefault(key, {})[r["provider"]] = r["tflops"]
    ratios = [(a, b) for a, b in RATIOS if a in providers and b in providers]
    head = ["D", "N", "causal", "pass"] + providers + [f"{a}/{b}" for a, b in ratios]
    widths = [7, 6, 6, 4] + [max(len(h), 8) for h in head[4:]]
    print("\nTFLOP/s (median)", flush=True)
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)), flush=True)
    for key in sorted(table, key=lambda k: (tuple(map(int, k[0].split("/"))), k[2],
                                            k[3] == "bwd", k[1])):
        vals = table[key]
        cells = [str(x) for x in key]
        cells += [f"{vals[p]:.1f}" if p in vals else "-" for p in providers]
        cells += [f"{vals[a] / vals[b]:.2f}" if a in vals and b in vals and vals[b] else "-"
                  for a, b in ratios]
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths)), flush=True)


def plot(rows, providers, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot", flush=True)
        return
    passes = sorted({r["pass"] for r in rows}, key=lambda p: p == "bwd")
    cols = sorted({(r["D"], r["DV"], r["causal"]) for r in rows})
    if not passes or not cols:
        print("no results: skipping the plot", flush=True)
        return
    fig, axes = plt.subplots(len(passes), len(cols), squeeze=False,
                             figsize=(4 * len(cols), 3.5 * len(passes)))
    for i, pass_ in enumerate(passes):
        for j, (D, DV, causal) in enumerate(cols):
            ax = axes[i][j]
            for p in providers:
                pts = sorted((r["N"], r["tflops"]) for r in rows if r["provider"] == p and
                             r["pass"] == pass_ and r["D"] == D and r["DV"] == DV
                             and r["causal"] == causal)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=p)
            ax.set_xscale("log", base=2)
            ns = sorted({r["N"] for r in rows})
            ax.set_xticks(ns, [str(n) for n in ns])
            ax.minorticks_off()
            ax.set_title(f"{pass_} D={dims_label(D, DV)} causal={causal}")
            ax.set_xlabel("N")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}", flush=True)


def int_list(text):
    return [int(x) for x in text.split(",") if x.strip()]


def dims_list(text):
    """``64,128,192/128`` -> [(64, 64), (128, 128), (192, 128)]: (D, DV) pairs."""
    dims = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        D, _, DV = item.partition("/")
        try:
            dims.append((int(D), int(DV or D)))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"head dim {item!r}: expected D or D/DV, e.g. 128 or 192/128") from None
    return dims


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads-dims", type=dims_list, default=None,
                   help="head dims D (or D/DV: values of DV dims), comma-separated (default "
                        "64,128; add 256 or 192/128 if wanted)")
    p.add_argument("--seqlens", type=int_list, default=None,
                   help="sequence lengths N, comma-separated (default 1024,4096,16384)")
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--providers", default=None,
                   help=f"comma-separated subset of {','.join(PROVIDERS)} (default "
                        f"{','.join(DEFAULT_PROVIDERS)})")
    p.add_argument("--passes", default="fwd,bwd", help="comma-separated subset of fwd,bwd")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up time (ms)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    p.add_argument("--out", default=None,
                   help="CSV path (default benchmarks/results/<date>-<gpu>.csv)")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="also plot TFLOP/s against N (needs matplotlib)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="time the forward replayed from a CUDA graph (kernels without host "
                        "overhead; short sequences are otherwise launch-bound)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: D=64,128 and N=1024,4096 unless given explicitly")
    p.add_argument("--from-csv", nargs="+", default=None, metavar="PATH.csv",
                   help="no timing: print the table (and --plot) of results files written "
                        "before, e.g. a grid run in parts; --heads-dims, --seqlens, --causal "
                        "and --providers select rows where given")
    args = p.parse_args(argv)
    if args.from_csv:
        return args
    if args.heads_dims is None:
        args.heads_dims = [(64, 64), (128, 128)]
    if args.seqlens is None:
        args.seqlens = [1024, 4096] if args.quick else [1024, 4096, 16384]
    args.providers = [x for x in (args.providers or ",".join(DEFAULT_PROVIDERS)).split(",") if x]
    args.passes = [x for x in args.passes.split(",") if x]
    for name in args.providers:
        if name not in PROVIDERS:
            p.error(f"unknown provider {name!r}; choose from {','.join(PROVIDERS)}")
    for name in args.passes:
        if name not in ("fwd", "bwd"):
            p.error(f"unknown pass {name!r}; choose from fwd,bwd")
    for D, DV in args.heads_dims:
        if D <= 0 or DV <= 0 or HIDDEN % DV:
            p.error(f"head dim {dims_label(D, DV)}: the values' head dim {DV} does not divide "
                    f"the hidden size {HIDDEN}")
    for N in args.seqlens:
        if N <= 0 or TOKENS % N:
            p.error(f"sequence length {N} does not divide {TOKENS} tokens per batch")
    args.causal = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    return args


def read_results(paths, heads_dims=None, seqlens=None, causal="both", providers=None):
    """The rows of results CSVs (CSV_HEADER's columns) with their numbers parsed, those
    selected where a filter is given, in file order."""
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                r.update(D=int(r["D"]), DV=int(r.get("DV") or r["D"]), N=int(r["N"]),
                         B=int(r["B"]), H=int(r["H"]),
                         causal=r["causal"] == "True", ms=float(r["ms"]),
                         tflops=float(r["tflops"]))
                rows.append(r)
    providers = providers.split(",") if providers else None
    return [r for r in rows
            if (heads_dims is None or (r["D"], r["DV"]) in heads_dims)
            and (seqlens is None or r["N"] in seqlens)
            and causal in ("both", str(r["causal"]).lower())
            and (providers is None or r["provider"] in providers)]


def show_results(args):
    """--from-csv: the table and plot of results files, without a GPU."""
    rows = read_results(args.from_csv, args.heads_dims, args.seqlens, args.causal,
                        args.providers)
    if not rows:
        print("no rows selected from " + ", ".join(args.from_csv), file=sys.stderr)
        return 1
    versions = sorted({(r["gpu"], r["torch"], r["triton"]) for r in rows})
    for gpu, torch_version, triton_version in versions:
        print(f"GPU: {gpu} | torch {torch_version} | triton {triton_version}", flush=True)
    present = [p for p in PROVIDERS if any(r["provider"] == p for r in rows)]
    print_table(rows, present)
    if args.plot:
        plot(rows, present, args.plot)
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.from_csv:
        return show_results(args)
    if not torch.cuda.is_available():
        print("This benchmark needs a CUDA GPU; none is available.", file=sys.stderr, flush=True)
        sys.exit(2)

    gpu = torch.cuda.get_device_name()
    out = Path(args.out) if args.out else (
        Path(__file__).resolve().parent / "results"
        / f"{datetime.date.today().isoformat()}-{gpu_slug(gpu)}.csv")
    print(f"GPU: {gpu} | torch {torch.__version__} | triton {triton.__version__}", flush=True)

    shapes = [(D, DV, N, c) for D, DV in args.heads_dims for N in args.seqlens
              for c in args.causal]
    rows = []
    bar = progress(shapes, desc="grid",
                   label=lambda s: f"D={dims_label(s[0], s[1])} N={s[2]} causal={s[3]}")
    for D, DV, N, causal in bar:
        B, H = TOKENS // N, HIDDEN // DV
        bar.write(f"D={dims_label(D, DV)} N={N} causal={causal} (B={B}, H={H})")
        torch.manual_seed(0)
        for name in args.providers:
            inputs = None
            try:
                fn, layout = make_provider(name, N, causal)
                inputs = make_inputs(B, N, H, D, layout, DV)
                passes = [p for p in args.passes if p == "fwd" or name not in FORWARD_ONLY]
                times = bench_one(fn, inputs, passes, args.warmup, args.rep, args.cuda_graph)
            except Exception as e:  # unsupported shape, OOM, compile failure...
                bar.write(f"  {name:<16} skipped: {type(e).__name__}: {error_line(e)}")
                times = {}
            for pass_, ms in times.items():
                tflops = flops(B, H, N, D, causal, pass_, DV) / (ms * 1e-3) / 1e12
                rows.append({"gpu": gpu, "torch": torch.__version__,
                             "triton": triton.__version__, "provider": name,
                             "dtype": "fp8" if name == "flashop-fp8" else "bf16",
                             "D": D, "N": N, "B": B, "H": H, "causal": causal, "pass": pass_,
                             "ms": round(ms, 4), "tflops": round(tflops, 1), "DV": DV})
                bar.write(f"  {name:<16} {pass_}  {ms:8.3f} ms  {tflops:7.1f} TFLOP/s")
            del inputs
            torch.cuda.empty_cache()
        write_csv(out, rows)  # rewritten after every shape so a partial run keeps its results

    print(f"\nresults written to {out}", flush=True)
    print_table(rows, args.providers)
    if args.plot:
        plot(rows, args.providers, args.plot)


if __name__ == "__main__":
    sys.exit(main())
