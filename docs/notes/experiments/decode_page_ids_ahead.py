"""Paged decode tiles with each key's page id loaded one tile ahead (notes entry 85).

Times flashop.attention_with_kvcache over paged caches (pages of 16 and 256 in random
physical order) and the dense cache, with SDPA on the dense cache, for the package on
PYTHONPATH (0ac287c, and 0ac287c with decode_page_ids_ahead.patch applied, in alternating
processes),
under the tile rule and under the paged tiles given by --tiles (``keys/warps/stages/per_sm``,
per_sm 0: as shared memory allows). bf16, H=32, H_kv=8, D=128, one query, full caches,
CUDA-graph replays (median of triton.testing.do_bench_cudagraph), microseconds per call.

Usage: python decode_page_ids_ahead.py --label new [--tiles 128/4/3/0,64/4/2/4] >> out.csv
"""

import argparse
import dataclasses
import sys

import torch
import torch.nn.functional as F
import triton

import flashop
import flashop.launch_decode as ld

H, H_KV, D = 32, 8, 128
POINTS = [(1, 4096), (1, 16384), (1, 65536), (1, 131072), (8, 4096), (8, 16384),
          (8, 65536), (8, 131072), (64, 4096), (64, 16384), (64, 65536)]


def use_tiles(spec):
    """Paged caches at D <= 128 take the tiles ``spec`` (None: the rule)."""
    ld._plan.cache_clear()
    if spec is None:
        ld.decode_tiles = RULE
        return
    n, w, s, per_sm = map(int, spec.split("/"))

    def tiles(rows, block_d, block_dv, dtype, page):
        t = RULE(rows, block_d, block_dv, dtype, page)
        if page == 0:
            return t
        return dataclasses.replace(t, BLOCK_N=n, num_warps=w, num_stages=s, per_sm=per_sm,
                                   key_page_ids=True)
    ld.decode_tiles = tiles


RULE = ld.decode_tiles


def time_us(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--label", required=True)
    p.add_argument("--tiles", default="")
    a = p.parse_args()
    specs = [None] + [t for t in a.tiles.split(",") if t]
    gpu = torch.cuda.get_device_name()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for B, L in POINTS:
        q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, L, H_KV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lengths = torch.full((B,), L, device="cuda", dtype=torch.int32)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        rows = [("sdpa", time_us(lambda: F.scaled_dot_product_attention(
            qt, kt, vt, enable_gqa=True)))]
        use_tiles(None)
        ref = flashop.attention_with_kvcache(q, k, v, cache_seqlens=lengths)
        rows.append(("dense", time_us(lambda: flashop.attention_with_kvcache(
            q, k, v, cache_seqlens=lengths))))
        for page in (16, 256):
            pages = B * L // page
            table = torch.randperm(pages, device="cuda", generator=gen).view(B, -1).int()
            kp, vp = k.view(pages, page, H_KV, D), v.view(pages, page, H_KV, D)
            # the same keys in page order: pages placed as the table says
            kp2, vp2 = torch.empty_like(kp), torch.empty_like(vp)
            kp2[table.view(-1).long()] = kp.clone()
            vp2[table.view(-1).long()] = vp.clone()
            for spec in specs:
                use_tiles(spec)
                out = flashop.attention_with_kvcache(q, kp2, vp2, cache_seqlens=lengths,
                                                     block_table=table)
                err = (out.float() - ref.float()).abs().max().item()
                assert err < 2e-2, (B, L, page, spec, err)
                rows.append((f"p{page} {spec or 'rule'}", time_us(
                    lambda: flashop.attention_with_kvcache(q, kp2, vp2, cache_seqlens=lengths,
                                                           block_table=table))))
            del kp2, vp2
        for variant, us in rows:
            print(f"{gpu},{torch.__version__},{triton.__version__},{a.label},{B},{L},"
                  f"{variant},{us:.2f}", flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    use_tiles(None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
