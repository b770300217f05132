"""Experiment (performance notes, entry 103): decode steps over an fp8 cache (float8_e4m3fn,
descales per sequence and kv head) against the bf16 cache, with the split-KV kernel's tiles
replaced by variants (decode_tiles patched, the plan cache cleared): µs per step from
CUDA-graph replays and the fraction of the copy bandwidth in the bytes read. H = 32,
H_kv = 8, D = 128, one bf16 query per sequence, full caches, dense and in pages of 16
(random physical order). "fp16-q" times fp16 queries over the same fp8 cache. The 256-key
variants for pages were not measured with entry 103's fp16 products. Hopper, triton 3.6;
not run by CI."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch, triton
import flashop
import flashop._launch.kvcache as kv
from flashop._launch.decode_tiles import DecodeTiles

F8 = torch.float8_e4m3fn
H, H_KV, D = 32, 8, 128
rule = kv.decode_tiles


def tiles(block_n, warps, stages, per_sm=0, key_page_ids=False):
    return lambda rows, *_, **__: DecodeTiles(max(16, triton.next_power_of_2(rows)), block_n,
                                               warps, stages, per_sm, key_page_ids)


DENSE = {"rule": rule, "128w4s3p2": tiles(128, 4, 3, 2), "128w4s4": tiles(128, 4, 4),
         "64w4s4p2": tiles(64, 4, 4, 2), "64w4s3p4": tiles(64, 4, 3, 4)}
PAGED = {"rule": rule, "64w4s3p4": tiles(64, 4, 3, 4, True),
         "128w4s3p2": tiles(128, 4, 3, 2, True), "32w4s4p4": tiles(32, 4, 4, 4, True),
         "256w8s2p1": tiles(256, 8, 2, 1, True), "256w4s2p1": tiles(256, 4, 2, 1, True)}


def step_us(B, L, page, cache_dtype, q_dtype, variant):
    kv.decode_tiles = variant
    kv._plan.cache_clear()
    q = torch.randn(B, 1, H, D, device="cuda", dtype=q_dtype)
    shape = (B * L // page, page, H_KV, D) if page else (B, L, H_KV, D)
    extra = {}
    if page:
        extra["block_table"] = torch.randperm(B * L // page, device="cuda",
                                              dtype=torch.int32).view(B, L // page)
    k_cache, v_cache = (torch.randn(shape, device="cuda").to(cache_dtype) for _ in range(2))
    if cache_dtype == F8:
        extra.update(k_descale=torch.full((B, H_KV), 0.01, device="cuda"),
                     v_descale=torch.full((B, H_KV), 0.01, device="cuda"))
    lengths = torch.full((B,), L, device="cuda", dtype=torch.int32)

    def fn():
        return flashop.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                              **extra)

    fn()
    torch.cuda.synchronize()
    us = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
    return us, 2 * k_cache.numel() * k_cache.element_size() / us / 1e6  # TB/s


n = 2**30
src = torch.empty(n, device="cuda", dtype=torch.bfloat16).normal_()
dst = torch.empty_like(src)
copy = 4 * n / triton.testing.do_bench(lambda: dst.copy_(src), rep=50,
                                       return_mode="median") / 1e9
src = dst = None
torch.cuda.empty_cache()
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__,
      f"copy {copy:.2f} TB/s", flush=True)
try:
    for B, L in ((8, 32768), (64, 4096), (8, 65536), (1, 131072)):
        for page in (0, 16):
            bf16, bw = step_us(B, L, page, torch.bfloat16, torch.bfloat16, rule)
            print(f"B={B} L={L} page={page}: bf16 {bf16:.1f}us {bw:.2f}TB/s ({bw / copy:.2f})")
            runs = [("fp16-q rule", torch.float16, rule)]
            runs += [(name, torch.bfloat16, v) for name, v in (PAGED if page else DENSE).items()]
            for name, q_dtype, variant in runs:
                try:
                    us, bw = step_us(B, L, page, F8, q_dtype, variant)
                    print(f"   fp8 {name} {us:.1f}us {bw:.2f}TB/s ({bw / copy:.2f}) "
                          f"{bf16 / us:.2f}x", flush=True)
                except Exception as e:  # noqa: BLE001  (a variant that does not compile)
                    print(f"   fp8 {name} failed: {type(e).__name__}: {str(e)[:100]}")
finally:
    kv.decode_tiles = rule
