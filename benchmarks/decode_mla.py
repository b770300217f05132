"""MLA decoding rows of benchmarks/decode.py (``--mla``), the project's MLA decode
protocol: DeepSeek-V3's latent cache, one KV head of 576 dims (512 latent + 64
rotary) whose first 512 dims are the values (``v_cache = k_cache[..., :512]``, a view),
bf16, pages of 64 keys in shuffled order, every sequence's cache full (L keys), CUDA-graph
replays. Points B x H x L: 1 x 16 x 32k, 32 x 16 x 8k, 128 x 16 x 4k, 32 x 128 x 8k,
128 x 128 x 4k with one query, and 64 x 128 x 8k with S_q = 2 (multi-token prediction,
causal). Figures: the cache's bytes (B * L * 576 * 2) per second against the measured copy
bandwidth, and TFLOP/s counting 2 * S_q * H * L * (576 + 512) per sequence (FlashMLA's).

Providers: flashop over the paged cache (``flashop-p64``) and over the same cache dense
(``flashop``), with its defaults (at H = 128 on Hopper with triton 3.6 the Gluon kernel,
else the `tl` one; FLASHOP_GLUON=0 times the `tl` one there), and SDPA on the dense cache
(``sdpa``: (B, H, S_q, 576) queries, the latent head expanded with ``enable_gqa=True``,
values 512 dims: its math path) where its expanded keys and values fit in memory.

``--sweep`` times, per point, the `tl` kernel's call over the paged cache and the dense
one with each candidate tile (rows per program BLOCK_M, keys per step BLOCK_N, warps,
stages, each key's page id or a tile's) and split count, forced through
``flashop._launch.tiles.force("mla", ...)``, and prints a table per point (the fastest
first); ``--tiles`` and ``--splits`` replace the candidates.

Usage: python benchmarks/decode.py --mla [--quick] [--sweep [--tiles 64x32x8x2,...]
       [--splits 0,16,32]] [--out PATH.csv]
       python benchmarks/decode.py --mla --from-csv PATH.csv      # no GPU needed
"""

from __future__ import annotations

import csv
import itertools
import sys

import torch
import torch.nn.functional as F
import triton

import decode
from attention import write_csv

CSV_HEADER = ["gpu", "torch", "triton", "provider", "layout", "page", "B", "H", "L", "S_q",
              "splits", "tiles", "us", "gbps", "frac_copy", "tflops"]
D, DV, PAGE = 576, 512, 64
SCALE = 192 ** -0.5  # DeepSeek-V3's softmax scale (its q-k head dim, 128 + 64), before YaRN
POINTS = [(1, 16, 32768, 1), (32, 16, 8192, 1), (128, 16, 4096, 1), (32, 128, 8192, 1),
          (128, 128, 4096, 1), (64, 128, 8192, 2)]  # (B, H, L, S_q)
QUICK = [(32, 16, 8192, 1), (32, 128, 8192, 1)]
HOPPER_SHARED_MEMORY = 232448  # bytes a program may take on an H100 or H200


def candidate_tiles(rows: int) -> list:
    """The sweep's tiles (BLOCK_M, BLOCK_N, num_warps, num_stages, each key's page id) for
    ``rows = H * S_q`` query rows: the accumulator [BLOCK_M, 512] fp32 wants 8 warps at 64
    rows; 1-3 and 5 stages (a paged tile's keys get half the pipeliner's buffers: 5 is the
    first to hold two 64-key tiles at 16 rows), where the query tile and the key buffers the
    compiled kernel holds over pages (flashop._launch.mla.held_bytes) fit Hopper's shared
    memory (a dense call of the same tile may not: the sweep reports it as failed)."""
    from flashop._launch.decode_tiles import DecodeTiles
    from flashop._launch.mla import MARGIN, held_bytes

    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    ms = sorted({block_m, min(block_m, 32)} if block_m == 64 else {block_m})
    out = []
    for m, n, w, s, ids in itertools.product(ms, (32, 64), (4, 8), (1, 2, 3, 5), (False,)):
        if m == 64 and w == 4:
            continue  # a 64-row accumulator spills on 4 warps
        if held_bytes(DecodeTiles(m, n, w, s), D, 2, True) > HOPPER_SHARED_MEMORY - MARGIN:
            continue
        out.append((m, n, w, s, ids))
    return out


def parse_tiles(text: str) -> list:
    """'64x32x8x2,16x64x4x2p' -> [(64, 32, 8, 2, False), (16, 64, 4, 2, True)] (a trailing
    'p': each key's page id loaded)."""
    tiles = []
    for item in filter(None, text.split(",")):
        ids = item.endswith("p")
        m, n, w, s = (int(x) for x in item.rstrip("p").split("x"))
        tiles.append((m, n, w, s, ids))
    return tiles


def tile_name(t) -> str:
    return "x".join(map(str, t[:4])) + ("p" if t[4] else "")


def make_point(B, H, L, S_q):
    """q (B, S_q, H, 576), the dense latent cache (B, L, 1, 576), its pages of 64 in shuffled
    order (a view of the same memory) with their block table, and the lengths (full)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, S_q, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    cache = torch.randn(B, L, 1, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    pages = cache.view(B * L // PAGE, PAGE, 1, D)
    table = torch.randperm(B * L // PAGE, device="cuda", generator=gen)
    lengths = torch.full((B,), L, device="cuda", dtype=torch.int32)
    return q, cache, pages, table.view(B, -1).to(torch.int32), lengths


def providers(flashop, q, cache, pages, table, lengths, S_q, sdpa: bool) -> dict:
    """{(provider, layout, page): fn} over one point's tensors."""
    causal = S_q > 1
    fns = {("flashop", "dense", 0): lambda: flashop.attention_with_kvcache(
               q, cache, cache[..., :DV], cache_seqlens=lengths, scale=SCALE, causal=causal),
           ("flashop", "paged", PAGE): lambda: flashop.attention_with_kvcache(
               q, pages, pages[..., :DV], cache_seqlens=lengths, block_table=table,
               scale=SCALE, causal=causal)}
    if sdpa:
        qt = q.transpose(1, 2)  # (B, H, S_q, 576)
        kt = cache.transpose(1, 2)  # (B, 1, L, 576)
        L = cache.shape[1]
        # causal aligned to the last key (SDPA's is_causal aligns to the first)
        mask = torch.ones(S_q, L, device=q.device, dtype=torch.bool).tril(L - S_q)
        fns["sdpa", "dense", 0] = lambda: F.scaled_dot_product_attention(
            qt, kt, kt[..., :DV], attn_mask=mask if causal else None, scale=SCALE,
            enable_gqa=True)
    return fns


def row(gpu, copy_gbps, provider, layout, page, point, us, splits="auto", tiles="table"):
    B, H, L, S_q = point
    gbps = B * L * D * 2 / (us * 1e-6) / 1e9
    tflops = 2 * S_q * H * L * (D + DV) * B / (us * 1e-6) / 1e12
    return dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                provider=provider, layout=layout, page=page, B=B, H=H, L=L, S_q=S_q,
                splits=splits, tiles=tiles, us=round(us, 2), gbps=round(gbps, 1),
                frac_copy=round(gbps / copy_gbps, 3), tflops=round(tflops, 1))


def sweep(flashop, point, tensors, tiles, splits, gpu, copy_gbps) -> list:
    """flashop's call over the paged cache and over the same cache dense, timed with each
    tile and split count; rows, fastest first. (The two layouts pipeline differently: a
    paged tile's keys wait on its page id.)"""
    from flashop._launch import tiles as tile_table
    from flashop._launch.decode_tiles import DecodeTiles

    q, cache, pages, table, lengths = tensors
    layouts = {"paged": (pages, dict(block_table=table)), "dense": (cache, {})}
    rows = []
    for t, s, layout in itertools.product(tiles, splits, layouts):
        forced = DecodeTiles(*t[:4], key_page_ids=t[4])
        if layout == "dense" and t[4]:
            continue  # (each key's page id: pages only)
        keys, paging = layouts[layout]

        def call(forced=forced, s=s, keys=keys, paging=paging):
            with tile_table.force("mla", forced):
                return flashop.attention_with_kvcache(
                    q, keys, keys[..., :DV], cache_seqlens=lengths, scale=SCALE,
                    causal=point[3] > 1, num_splits=s, **paging)
        try:
            us = decode.time_us(call, graph=True)
        except Exception as e:  # noqa: BLE001  (a tile past the GPU's resources)
            print(f"  {tile_name(t)} splits {s} {layout}: failed ({type(e).__name__}: "
                  f"{str(e).splitlines()[0][:80]})", flush=True)
            continue
        rows.append(row(gpu, copy_gbps, "flashop-sweep", layout,
                        PAGE if layout == "paged" else 0, point, us, splits=s or "auto",
                        tiles=tile_name(t)))
    return sorted(rows, key=lambda r: r["us"])


def print_table(rows) -> None:
    """One line per point: µs, fraction of copy bandwidth and TFLOP/s per provider."""
    cols = list(dict.fromkeys(decode.column(r) for r in rows))
    table = {}
    for r in rows:
        table.setdefault((r["B"], r["H"], r["L"], r["S_q"]), {})[decode.column(r)] = r
    print(f"\n{'B':>4} {'H':>4} {'L':>6} {'S_q':>3}  " + "  ".join(f"{c:>28}" for c in cols))
    for (B, H, L, S_q), by in sorted(table.items()):
        cells = [f"{by[c]['us']:8.1f}us {by[c]['frac_copy']:5.0%} {by[c]['tflops']:6.1f}TF"
                 if c in by else "-" for c in cols]
        print(f"{B:>4} {H:>4} {L:>6} {S_q:>3}  " + "  ".join(f"{c:>28}" for c in cells))


def print_sweep(rows, point) -> None:
    print(f"\nsweep B={point[0]} H={point[1]} L={point[2]} S_q={point[3]} (pages of {PAGE}, "
          f"and dense):")
    print(f"{'tiles (MxNxWxS)':>16} {'layout':>6} {'splits':>6} {'us':>9} {'GB/s':>7} "
          f"{'copy':>5} {'TFLOP/s':>8}")
    for r in rows:
        print(f"{r['tiles']:>16} {r['layout']:>6} {str(r['splits']):>6} {r['us']:9.1f} "
              f"{r['gbps']:7.0f} {r['frac_copy']:5.0%} {r['tflops']:8.1f}")


def read_results(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r.update(page=int(r["page"]), B=int(r["B"]), H=int(r["H"]), L=int(r["L"]),
                 S_q=int(r["S_q"]), us=float(r["us"]), gbps=float(r["gbps"]),
                 frac_copy=float(r["frac_copy"]), tflops=float(r["tflops"]))
    return rows


def main(args) -> int:
    """decode.py --mla: the protocol's points (or QUICK), or the sweep, or a results file."""
    if args.from_csv:
        rows = read_results(args.from_csv)
        if not rows:
            print(f"no rows in {args.from_csv}", file=sys.stderr)
            return 1
        print_table([r for r in rows if r["provider"] != "flashop-sweep"])
        return 0
    run = decode.start_run(args.out, "decode-mla")
    if run is None:
        return 1
    flashop, gpu, out, copy_gbps = run
    total = torch.cuda.get_device_properties(0).total_memory
    splits = [int(s) for s in args.splits.split(",")] if args.splits else [0]
    rows = []
    for point in decode.progress(QUICK if args.quick else POINTS, "mla"):
        B, H, L, S_q = point
        torch.cuda.empty_cache()
        tensors = make_point(*point)
        if args.sweep:
            tiles = parse_tiles(args.tiles) if args.tiles else candidate_tiles(H * S_q)
            found = sweep(flashop, point, tensors, tiles, splits, gpu, copy_gbps)
            print_sweep(found, point)
            rows += found
            continue
        # SDPA's math path expands the latent head to H heads of keys and values
        sdpa = 3 * B * H * L * (D + DV) * 2 < 0.5 * total
        for (provider, layout, page), fn in providers(flashop, *tensors, S_q, sdpa).items():
            try:
                us = decode.time_us(fn, graph=True)
            except torch.OutOfMemoryError:
                print(f"  {provider} B={B} H={H} L={L}: out of memory", flush=True)
                torch.cuda.empty_cache()
                continue
            rows.append(row(gpu, copy_gbps, provider, layout, page, point, us))
        if not sdpa:
            print(f"  sdpa B={B} H={H} L={L}: skipped (its expanded keys and values do not "
                  f"fit)", flush=True)
        del tensors
    write_csv(out, rows, CSV_HEADER)
    print(f"wrote {out}")
    if not args.sweep:
        print_table(rows)
    return 0
