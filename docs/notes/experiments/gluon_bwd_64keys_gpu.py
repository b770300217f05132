"""Entry 140's Gluon backward of 64 keys per program (gluon_bwd_64keys.py: non-causal, one
query head per KV head) on a Hopper GPU with triton 3.6 (performance notes, entry 143): its
gradients against the fp64 reference, then its TFLOP/s (the kernel and the zeroing of dQ's
fp32 buffer) beside flashop's default and `tl` backward and cuDNN's, non-causal, H = 16.
From the repository root:

    PYTHONPATH=. python docs/notes/experiments/gluon_bwd_64keys_gpu.py
"""
import time

import gpu_stand_in  # noqa: F401  (before the kernel module)
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashop
import gluon_bwd_64keys as K
from flashop.testing import check_attention

descriptor = gpu_stand_in.descriptor


def median_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")

LOG2E = 1.4426950408889634

def fwd(q, k, v, sm):
    return torch.ops.flashop.attention_forward(q, k, v, None, None, None, None, None, None, None,
                                               None, None, causal=False, scale=sm)

def prepare(q, k, v, do, sm):
    out, lse, lse_log2 = fwd(q, k, v, sm)
    delta = (do.float() * out.float()).sum(-1).permute(0, 2, 1).contiguous()
    return out, lse, lse_log2.contiguous(), delta

def gluon_bwd(q, k, v, do, lse_log2, delta, sm, STAGES=2, dq_acc=None, dk=None, dv=None):
    B, S, H, D = q.shape
    DV = v.shape[-1]
    if dq_acc is None:
        dq_acc = torch.zeros(B, S, H, D, device=q.device, dtype=torch.float32)
    else:
        dq_acc.zero_()
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    d1 = 128 if D & (D - 1) else D
    d2 = D - d1
    BM = BN = 64
    qd, kd = descriptor(q, (1, BM, 1, d1)), descriptor(k, (1, BN, 1, d1))
    kw = dict(q_desc=qd, q_desc2=descriptor(q, (1, BM, 1, d2)) if d2 else qd,
              k_desc=kd, k_desc2=descriptor(k, (1, BN, 1, d2)) if d2 else kd,
              v_desc=descriptor(v, (1, BN, 1, DV)), do_desc=descriptor(do, (1, BM, 1, DV)),
              dq_desc=descriptor(dq_acc, (1, BM, 1, d1 if d2 else D // 2)),
              dq_desc2=descriptor(dq_acc, (1, BM, 1, d2 if d2 else D // 2)),
              lse_log2=lse_log2, delta=delta, dk=dk, dv=dv, stride_lb=lse_log2.stride(0),
              stride_lh=lse_log2.stride(1), stride_dkb=dk.stride(0), stride_dks=dk.stride(1),
              stride_dkh=dk.stride(2), stride_dvb=dv.stride(0), stride_dvs=dv.stride(1),
              stride_dvh=dv.stride(2), S_q=S, H=H, sm_scale=sm, qk_scale=sm * LOG2E, D=D, DV=DV,
              BLOCK_M=BM, BLOCK_N=BN, STAGES=STAGES, CONSUMER_REGS=240, LOAD_REGS=24,
              num_warps=4)
    K.bwd_64keys_kernel[(S // BN, B * H)](**kw)
    return dq_acc, dk, dv

def check(B, S, H, D, DV, STAGES):
    torch.manual_seed(1)
    mk = lambda d: torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16)
    q, k, v, do = mk(D), mk(D), mk(DV), mk(DV)
    q, k, v = (x.requires_grad_() for x in (q, k, v))  # (the reference's gradients)
    sm = D ** -0.5
    with torch.no_grad():
        out, lse, lse_log2, delta = prepare(q, k, v, do, sm)
        dq, dk, dv = gluon_bwd(q.detach(), k.detach(), v.detach(), do, lse_log2, delta, sm,
                               STAGES)
    torch.cuda.synchronize()
    res = check_attention(q, k, v, do, torch.zeros_like(lse), out, lse,
                          (dq.to(q.dtype), dk, dv), causal=False, scale=sm)
    ok = all(r.ok for r in res)
    print(f"check B={B} S={S} H={H} D={D}/{DV} stages {STAGES}: {'PASS' if ok else 'FAIL'}; "
          + "; ".join(str(r) for r in res if r.name in ("dq", "dk", "dv")), flush=True)
    return ok

def bench():
    print("\nbackward TFLOP/s, non-causal, H=16 (2.5 x 2BHN^2(D+DV))")
    for D, DV, stages in ((192, 128, 2), (128, 128, 2), (256, 256, 1)):
        for B, S in ((4, 4096), (1, 16384)):
            H = 16
            mk = lambda d: torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16)
            q, k, v, do = mk(D), mk(D), mk(DV), mk(DV)
            sm = D ** -0.5
            fl = 2.5 * 2 * B * H * S * S * (D + DV)
            row = [f"D={D}/{DV} B={B} S={S}"]
            out, lse, lse_log2, delta = prepare(q, k, v, do, sm)
            dq_acc = torch.zeros(B, S, H, D, device="cuda")
            dk, dv = torch.empty_like(k), torch.empty_like(v)
            ms = median_ms(lambda: gluon_bwd(q, k, v, do, lse_log2, delta, sm, stages, dq_acc,
                                             dk, dv))
            row.append(f"gluon64(kernel+zero) {fl / ms / 1e9:.0f}")
            for name, kw in (("default", {}), ("tl", {"gluon": False})):
                qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
                with flashop.config.override(**kw):
                    o = flashop.attention(qg, kg, vg, scale=sm)
                    ms = median_ms(lambda: torch.autograd.grad(o, (qg, kg, vg), do,
                                                               retain_graph=True))
                row.append(f"{name} {fl / ms / 1e9:.0f}")
            try:
                qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
                dot = do.transpose(1, 2)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    o = F.scaled_dot_product_attention(qt, kt, vt, scale=sm)
                    ms = median_ms(lambda: torch.autograd.grad(o, (qt, kt, vt), dot,
                                                               retain_graph=True))
                row.append(f"cudnn {fl / ms / 1e9:.0f}")
            except Exception as e:
                row.append(f"cudnn ERR {str(e)[:60]}")
            print("  ".join(row), flush=True)

if __name__ == "__main__":
    t = time.time()
    for D, DV, st in ((192, 128, 2), (128, 128, 2), (256, 256, 1)):
        try:
            check(1, 512, 2, D, DV, st)
            check(2, 1024, 3, D, DV, st)
        except Exception as e:
            print(f"D={D}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
    print(f"checks done in {time.time() - t:.0f} s", flush=True)
    bench()
