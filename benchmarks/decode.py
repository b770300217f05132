"""Decoding one token over a key/value cache: flashop.attention_with_kvcache (dense cache,
and paged with pages of 16 and 256 keys in random physical order) against SDPA on the dense
cache, compiled FlexAttention with a BlockMask of the lengths, and flashop.attention over
the dense cache, in the same run; and flashop over a float8_e4m3fn cache of the same
shape (``flashop-fp8``: FlashAttention-3's fp8 cache with per-(sequence, kv head) descales,
bf16 queries), dense and in pages of 16 and 256 keys.

bf16, H = 32 query heads, H_kv = 8, D = 128, one query per sequence, every sequence's cache
full (L keys). The figure of merit is the K + V bytes read per second (GB/s) and that as a
fraction of the GPU's measured copy bandwidth (a 2 GiB ``copy_``, read + write), counting
the bytes actually read (an fp8 cache's are half a bf16 one's); times are
medians of triton.testing.do_bench over CUDA-graph replays (as a serving loop runs a decode
step: host time left out), in microseconds per call; ``--eager`` times plain calls instead. Points whose
cache does not fit the GPU's memory are skipped.

``--mla`` runs MLA's latent cache instead (DeepSeek-V3's 576-dim rows whose first 512 dims
are the values, at its decode shapes, pages of 64, with SDPA as a peer where it fits), and
``--mla --sweep`` times candidate tiles and split counts per point (benchmarks/decode_mla.py).

Usage: python benchmarks/decode.py [--quick] [--out PATH.csv] [--plot PATH.png]
       python benchmarks/decode.py --from-csv PATH.csv [--plot PATH.png]   # no GPU needed
       python benchmarks/decode.py --mla [--quick] [--sweep [--tiles 64x32x8x2,...]
                                   [--splits 0,16,32]] [--from-csv PATH.csv]
Tokens/s of a small model: python benchmarks/decode_model.py
"""

from __future__ import annotations

import argparse
import csv
import datetime
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import gpu_slug, import_flashop, write_csv  # noqa: E402

CSV_HEADER = ["gpu", "torch", "triton", "provider", "layout", "page", "B", "L", "H", "H_kv",
              "D", "us", "gbps", "frac_copy"]
H, H_KV, D = 32, 8, 128
BATCHES = (1, 8, 64)
LENGTHS = (4096, 16384, 32768, 65536, 131072)
QUICK = [(1, 16384), (8, 32768), (8, 65536)]
PAGES = (16, 256)


def progress(items, desc):
    try:
        from tqdm import tqdm
        return tqdm(items, desc=desc)
    except ImportError:
        def plain():
            for i, item in enumerate(items):
                print(f"{desc}: {i + 1}/{len(items)} {item}", flush=True)
                yield item
        return plain()


def time_us(fn, graph: bool) -> float:
    """Median microseconds per call of ``fn``: CUDA-graph replays where ``graph`` (falling
    back to plain launches where capture fails)."""
    fn()  # compile, warm up
    torch.cuda.synchronize()
    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
        except Exception as e:  # noqa: BLE001  (a provider that cannot be captured)
            print(f"  (no CUDA graph: {type(e).__name__}: {str(e)[:80]}; timing launches)",
                  file=sys.stderr)
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy_, counting its read and its write."""
    n = 2**30  # bf16 elements: 2 GiB
    src = torch.empty(n, device="cuda", dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=50,
                                 return_mode="median")
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 2 * n / (ms * 1e-3) / 1e9


def flashop_layouts(flashop, provider, q, k_cache, v_cache, lengths, **descales):
    """{(provider, layout, page): fn}: flashop over one dense cache (B, L, H_kv, D) and over
    the paged layouts that view it as B * L / page pages in random physical order (no extra
    memory)."""
    B, L = k_cache.shape[:2]
    fns = {(provider, "dense", 0): lambda: flashop.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lengths, **descales)}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for page in PAGES:
        pages = B * L // page
        table = torch.randperm(pages, device="cuda", generator=gen).view(B, -1).to(torch.int32)
        kp = k_cache.view(pages, page, H_KV, D)
        vp = v_cache.view(pages, page, H_KV, D)
        fns[provider, "paged", page] = (
            lambda kp=kp, vp=vp, table=table: flashop.attention_with_kvcache(
                q, kp, vp, cache_seqlens=lengths, block_table=table, **descales))
    return fns


def providers(flashop, q, k_cache, v_cache, lengths, flex_fn):
    """{(provider, layout, page): fn} over one dense bf16 cache (B, L, H_kv, D)."""
    fns = flashop_layouts(flashop, "flashop", q, k_cache, v_cache, lengths)
    qt = q.transpose(1, 2)  # (B, H, 1, D)
    kt, vt = k_cache.transpose(1, 2), v_cache.transpose(1, 2)  # (B, H_kv, L, D)
    fns["sdpa", "dense", 0] = lambda: F.scaled_dot_product_attention(qt, kt, vt,
                                                                     enable_gqa=True)
    if flex_fn is not None:
        fns["flex", "dense", 0] = lambda: flex_fn(qt, kt, vt)
    fns["flashop.attention", "dense", 0] = lambda: flashop.attention(q, k_cache, v_cache)
    return fns


def make_flex(B, L, lengths):
    """Compiled FlexAttention with a BlockMask keeping each sequence's first lengths[b] keys
    (Dynamo reset first: a new shape compiles afresh)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)

    def keep(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    mask = create_block_mask(keep, B, None, 1, L, device="cuda")
    return lambda q, k, v: compiled(q, k, v, block_mask=mask, enable_gqa=True)


def print_table(rows):
    """One line per (B, L): GB/s and the fraction of copy bandwidth per provider/layout,
    then flashop (dense) over SDPA."""
    cols = list(dict.fromkeys(column(r) for r in rows))
    table = {}
    for r in rows:
        table.setdefault((r["B"], r["L"]), {})[column(r)] = r
    print(f"\n{'B':>3} {'L':>7}  " + "  ".join(f"{c:>20}" for c in cols) + "  flashop/sdpa")
    for (B, L), by in sorted(table.items()):
        cells = [f"{by[c]['us']:7.1f}us {by[c]['frac_copy']:5.0%}" if c in by else "-"
                 for c in cols]
        ratio = (f"{by['sdpa']['us'] / by['flashop']['us']:.2f}x"
                 if "sdpa" in by and "flashop" in by else "-")
        print(f"{B:>3} {L:>7}  " + "  ".join(f"{c:>20}" for c in cells) + f"  {ratio:>12}")


def column(r) -> str:
    """A row's provider, with its page size where paged: 'flashop-p16'."""
    return r["provider"] + ("" if r["layout"] == "dense" else f"-p{r['page']}")


def read_results(path):
    """The rows of a results CSV (CSV_HEADER's columns) with their numbers parsed."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r.update(page=int(r["page"]), B=int(r["B"]), L=int(r["L"]), us=float(r["us"]),
                 gbps=float(r["gbps"]), frac_copy=float(r["frac_copy"]))
    return rows


def plot(rows, path) -> None:
    """The fraction of copy bandwidth against the cache length, one panel per batch size,
    one line per provider and layout (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot", flush=True)
        return
    batches = sorted({r["B"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), squeeze=False, sharey=True,
                             figsize=(4.5 * len(batches), 3.8))
    for ax, B in zip(axes[0], batches):
        for col in dict.fromkeys(column(r) for r in rows):
            pts = sorted((r["L"], r["frac_copy"]) for r in rows
                         if r["B"] == B and column(r) == col)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=col)
        ax.set_xscale("log", base=2)
        ax.set_title(f"B = {B}")
        ax.set_xlabel("cache length (keys)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("K + V read / copy bandwidth")
    axes[0][-1].legend(fontsize=8)
    gpu = rows[0]["gpu"]
    fig.suptitle(f"Decoding one token, bf16, H={H}, H_kv={H_KV}, D={D} ({gpu}, torch "
                 f"{rows[0]['torch']}, triton {rows[0]['triton']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}", flush=True)


def start_run(out, suffix: str):
    """(flashop, the GPU's name, the CSV path (``out``, or benchmarks/results/<date>-<gpu>-
    <suffix>.csv), the copy bandwidth in GB/s), the run's header printed; None without a
    GPU."""
    if not torch.cuda.is_available():
        print("This benchmark needs a CUDA GPU; none is available.", file=sys.stderr)
        return None
    flashop = import_flashop()
    gpu = torch.cuda.get_device_name()
    out = Path(out) if out else (
        Path(__file__).resolve().parent / "results"
        / f"{datetime.date.today().isoformat()}-{gpu_slug(gpu)}-{suffix}.csv")
    copy_gbps = copy_bandwidth()
    print(f"GPU: {gpu} | torch {torch.__version__} | triton {triton.__version__} | copy "
          f"bandwidth {copy_gbps:.0f} GB/s (read + write)", flush=True)
    return flashop, gpu, out, copy_gbps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"only {QUICK} (about a minute)")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (compiles)")
    p.add_argument("--no-fp8", action="store_true", help="skip the fp8 cache's rows")
    p.add_argument("--eager", action="store_true",
                   help="time plain calls (host time included) instead of CUDA-graph replays")
    p.add_argument("--out", default=None,
                   help="CSV path (default benchmarks/results/<date>-<gpu>-decode.csv)")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="also plot the fraction of copy bandwidth (needs matplotlib)")
    p.add_argument("--from-csv", default=None, metavar="PATH.csv",
                   help="no timing: print the table (and --plot) of a results file")
    p.add_argument("--mla", action="store_true",
                   help="MLA's latent cache (576 dims, values its first 512), pages of 64")
    p.add_argument("--sweep", action="store_true",
                   help="with --mla: time candidate tiles and splits per point")
    p.add_argument("--tiles", default=None, metavar="MxNxWxS[p],...",
                   help="with --sweep: these tiles (rows, keys, warps, stages; p: each "
                        "key's page id) instead of the candidates")
    p.add_argument("--splits", default=None, metavar="S,...",
                   help="with --sweep: these split counts (0: the rule's), default 0")
    args = p.parse_args(argv)
    if args.mla:
        import decode_mla  # (imports this module)
        return decode_mla.main(args)
    if args.from_csv:
        rows = read_results(args.from_csv)
        if not rows:
            print(f"no rows in {args.from_csv}", file=sys.stderr)
            return 1
        print_table(rows)
        if args.plot:
            plot(rows, args.plot)
        return 0
    run = start_run(args.out, "decode")
    if run is None:
        return 1
    flashop, gpu, out, copy_gbps = run
    points = QUICK if args.quick else [(B, L) for B in BATCHES for L in LENGTHS]
    total = torch.cuda.get_device_properties(0).total_memory
    rows = []
    for B, L in progress(points, "decode"):
        kv_bytes = 2 * B * L * H_KV * D * 2
        if kv_bytes > 0.35 * total:  # the caches, and room for the peers' workspace
            print(f"  skip B={B} L={L}: K + V take {kv_bytes / 2**30:.1f} GiB", flush=True)
            continue
        torch.cuda.empty_cache()
        q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
        k_cache = torch.randn(B, L, H_KV, D, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn(B, L, H_KV, D, device="cuda", dtype=torch.bfloat16)
        lengths = torch.full((B,), L, device="cuda", dtype=torch.int32)
        flex_fn = None if args.no_flex else make_flex(B, L, lengths)
        fns = providers(flashop, q, k_cache, v_cache, lengths, flex_fn)
        if not args.no_fp8 and 1.5 * kv_bytes <= 0.35 * total:
            # an fp8 cache of the same keys (unit normals fit e4m3 unscaled); descales 1/64
            # and 1/48 as a model's amax / 448 gives them
            k8, v8 = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
            descales = dict(k_descale=torch.full((B, H_KV), 1 / 64, device="cuda"),
                            v_descale=torch.full((B, H_KV), 1 / 48, device="cuda"))
            fns.update(flashop_layouts(flashop, "flashop-fp8", q, k8, v8, lengths,
                                       **descales))
        elif not args.no_fp8:
            print(f"  skip flashop-fp8 B={B} L={L}: no room for a second cache", flush=True)
        for (provider, layout, page), fn in fns.items():
            try:
                us = time_us(fn, graph=not args.eager)
            except torch.OutOfMemoryError:
                print(f"  {provider} {layout} B={B} L={L}: out of memory", flush=True)
                torch.cuda.empty_cache()
                continue
            except Exception as e:  # noqa: BLE001  (a peer that fails at this shape)
                if provider.startswith("flashop"):
                    raise
                print(f"  {provider} B={B} L={L} failed: {type(e).__name__}: "
                      f"{str(e).splitlines()[-1][:120]}", flush=True)
                continue
            read = kv_bytes // 2 if provider.endswith("fp8") else kv_bytes  # bytes read
            gbps = read / (us * 1e-6) / 1e9
            rows.append(dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                             provider=provider, layout=layout, page=page, B=B, L=L, H=H,
                             H_kv=H_KV, D=D, us=round(us, 2), gbps=round(gbps, 1),
                             frac_copy=round(gbps / copy_gbps, 3)))
        del q, k_cache, v_cache, flex_fn, fns
    write_csv(out, rows, CSV_HEADER)
    print(f"wrote {out}")
    print_table(rows)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
