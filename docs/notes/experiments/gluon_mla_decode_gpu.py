"""Entry 142's Gluon MLA decode kernel (gluon_mla_decode.py) on a Hopper GPU with triton 3.6
(performance notes, entry 144): its outputs against the fp64 reference at four tiles, then
its TFLOP/s against the package's `tl` kernel (dense cache, one query, CUDA-graph replays)
at H = 128. From the repository root:

    PYTHONPATH=. python docs/notes/experiments/gluon_mla_decode_gpu.py
"""
import sys
import time

import gpu_stand_in  # noqa: F401  (before the kernel module)
import torch

import flashop
import gluon_mla_decode as M
from flashop.testing import accuracy

sys.path.insert(0, str(gpu_stand_in.ROOT / "benchmarks"))
from decode import time_us  # noqa: E402
descriptor = gpu_stand_in.descriptor

SCALE = 192 ** -0.5
LOG2E = 1.4426950408889634

def launch(q, cache, out, lse, BLOCK_N, STAGES, REGS=240):
    B, L = cache.shape[0], cache.shape[1]
    H = q.shape[2]
    kw = dict(q_desc=descriptor(q, (1, 1, 64, 512)), qr_desc=descriptor(q, (1, 1, 64, 64)),
              k_desc=descriptor(cache, (1, BLOCK_N, 1, 512)),
              kr_desc=descriptor(cache, (1, BLOCK_N, 1, 64)),
              o=out, lse=lse, stride_ob=out.stride(0), stride_oh=out.stride(2),
              stride_lb=lse.stride(0), L=L, qk_scale=SCALE * LOG2E, BLOCK_N=BLOCK_N,
              STAGES=STAGES, CONSUMER_REGS=REGS, LOAD_REGS=24, num_warps=4)
    M.mla_decode_gluon_kernel[(H // 64, B)](**kw)

def reference(q, cache, dtype):
    qq = q[:, 0].to(dtype)            # B, H, 576
    kk = cache[:, :, 0].to(dtype)     # B, L, 576
    s = torch.einsum("bhd,bld->bhl", qq, kk) * SCALE
    lse = torch.logsumexp(s.double() if dtype == torch.float64 else s.float(), -1)
    p = torch.softmax(s, -1)
    o = torch.einsum("bhl,bld->bhd", p, kk[..., :512])
    return o, lse

def check(B, H, L, BLOCK_N, STAGES):
    torch.manual_seed(0)
    q = torch.randn(B, 1, H, 576, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(B, L, 1, 576, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(B, 1, H, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(B, H, device="cuda")
    launch(q, cache, out, lse, BLOCK_N, STAGES)
    torch.cuda.synchronize()
    ro, rl = reference(q, cache, torch.float64)
    po, pl = reference(q, cache, torch.bfloat16)
    a = accuracy("out", out[:, 0], ro, po, 2, torch.bfloat16)
    b = accuracy("lse", lse, rl, pl, 2, torch.bfloat16)
    ok = a.ok and b.ok
    print(f"check B={B} H={H} L={L} tile {BLOCK_N}x{STAGES}: {'PASS' if ok else 'FAIL'}  "
          f"{a}; {b}", flush=True)
    return ok

def bench():
    print("\nMLA decode, dense cache, S_q=1, CUDA graphs, TFLOP/s (counting 2*H*L*1088 per seq)")
    for B, H, L in ((66, 128, 8192), (128, 128, 4096), (32, 128, 8192), (132, 128, 4096)):
        q = torch.randn(B, 1, H, 576, device="cuda", dtype=torch.bfloat16)
        cache = torch.randn(B, L, 1, 576, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(B, 1, H, 512, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(B, H, device="cuda")
        seqlens = torch.full((B,), L, device="cuda", dtype=torch.int32)
        fl = 2 * H * L * 1088 * B
        row = [f"B={B} H={H} L={L}"]
        us = time_us(lambda: flashop.attention_with_kvcache(
            q, cache, cache[..., :512], cache_seqlens=seqlens, scale=SCALE), True)
        row.append(f"tl {fl / us / 1e6:.0f}")
        for bn, st in ((64, 2), (32, 3), (32, 2), (64, 1)):
            try:
                us = time_us(lambda: launch(q, cache, out, lse, bn, st), True)
                row.append(f"gluon {bn}x{st} {fl / us / 1e6:.0f}")
            except Exception as e:
                row.append(f"gluon {bn}x{st} ERR {type(e).__name__}: {str(e)[:100]}")
        print("  ".join(row), flush=True)

if __name__ == "__main__":
    t = time.time()
    ok = True
    for bn, st in ((64, 2), (32, 3), (32, 2), (64, 1)):
        try:
            ok &= check(2, 128, 1024, bn, st)
            ok &= check(3, 64, 640, bn, st)
        except Exception as e:
            print(f"tile {bn}x{st}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
            ok = False
    print(f"checks done in {time.time() - t:.0f} s", flush=True)
    bench()
