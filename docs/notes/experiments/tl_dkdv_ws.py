"""A warp-specialized `tl` dK/dV kernel, stripped (issue 61, goal 2; performance notes, entry 126).

The `tl` backward's dK/dV kernel runs its query loop in one warp group chain: S^T, P, dV,
dP, dS, dK one after another, nothing overlapping them (entry 109). This stripped kernel
asks Triton's Hopper pass (triton 3.6: ``tl.range(..., warp_specialize=True)``, one loop
without branches) for what the forward's warp-specialized kernel got (entry 39): a producer
warp group for the descriptor loads and consumer groups that overlap one another's products
and elementwise work. ``PARTS=1`` gives the program one tile of BLOCK_N keys, which the
pass splits between two consumer groups itself (each its 64 keys' dK and dV); ``PARTS=2``
writes the two halves out, each with accumulators of its own (the pass then gives each
consumer both halves, and they spill at D = 128). Only what the loop needs: dense
(B, S, H, D) inputs, one query head per key head, no bound or modifier, S_q a multiple of
BLOCK_M and S_k of BLOCK_N, D one tile (64 or 128). ``DQ`` adds dQ's share in the loop
(the five-product backward): every such form fails in triton 3.6's and 3.9's pass (entry
127), which is why ``--compile --dq`` exists.

Usage (from the repository root):

    # the kernel against PyTorch's autograd under Triton's interpreter (CPU)
    TRITON_INTERPRET=1 PYTHONPATH=. python docs/notes/experiments/tl_dkdv_ws.py --check
    # compiled for sm_90 on a machine without a GPU (triton 3.6.0): registers, spills,
    # shared memory, setmaxnreg per configuration (--dq: only the forms adding dQ)
    PYTHONPATH=. python docs/notes/experiments/tl_dkdv_ws.py --compile [--dq]
    # on a Hopper GPU: against flashop's dK/dV kernel (profiler) and cuDNN's backward
    PYTHONPATH=. python docs/notes/experiments/tl_dkdv_ws.py --time
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _dkdv_half(b_dk, b_dv, b_k, b_v, b_q, b_do, b_lse, b_delta, qk_scale,
               KEYS_AS_B: tl.constexpr):
    """One half's keys against one query tile: dV += P^T dO, dK += dS^T Q (unscaled). Where
    ``KEYS_AS_B`` the scores are computed as S = Q K^T and dP = dO V^T (the keys and values
    the products' B operands, which wgmma reads from shared memory) and transposed for the
    accumulations; else as S^T = K Q^T and dP^T = V dO^T (flashop's kernel: K and V the A
    operands, held in registers)."""
    if KEYS_AS_B:
        # S = Q K^T [BLOCK_M, HALF]
        b_s = tl.dot(b_q, tl.trans(b_k))
        b_p = tl.math.exp2(b_s * qk_scale - b_lse[:, None])
        # dV += P^T dO [HALF, D]
        b_dv = tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do, b_dv)
        # dP = dO V^T [BLOCK_M, HALF]
        b_dp = tl.dot(b_do, tl.trans(b_v))
        b_ds = b_p * (b_dp - b_delta[:, None])
        # dK += dS^T Q [HALF, D]
        b_dk = tl.dot(tl.trans(b_ds.to(b_q.dtype)), b_q, b_dk)
        b_dst = tl.trans(b_ds)
    else:
        # S^T = K Q^T [HALF, BLOCK_M]
        b_st = tl.dot(b_k, tl.trans(b_q))
        b_pt = tl.math.exp2(b_st * qk_scale - b_lse[None, :])
        # dV += P^T dO [HALF, D]
        b_dv = tl.dot(b_pt.to(b_do.dtype), b_do, b_dv)
        # dP^T = V dO^T [HALF, BLOCK_M]
        b_dpt = tl.dot(b_v, tl.trans(b_do))
        b_dst = b_pt * (b_dpt - b_delta[None, :])
        # dK += dS^T Q [HALF, D]
        b_dk = tl.dot(b_dst.to(b_q.dtype), b_q, b_dk)
    return b_dk, b_dv, b_dst


@triton.jit
def dkdv_ws_kernel(q, k, v, do, lse_log2, delta, dk, dv, dq, S_q, S_k, qk_scale, sm_scale,
                   H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, WS: tl.constexpr, KEYS_AS_B: tl.constexpr,
                   PARTS: tl.constexpr = 2, DQ: tl.constexpr = 0):
    """dK and dV of BLOCK_N keys of one head of one sequence; grid (S_k / BLOCK_N, H, B).
    q, k, v, do, dk, dv: (B, S, H, D) contiguous; lse_log2 (base 2) and delta (rowsum(dO *
    O)): (B, H, S_q) fp32 contiguous. ``PARTS``: the keys as two halves with accumulators of
    their own (2), or one tile (1), which the pass may split between its consumers itself.
    ``DQ``: dQ's share of these keys (dS K, scaled) added into dq, (B, S_q, H, D) fp32 zeroed,
    in the loop: none (0), one atomic per element (1), one bulk reduce-add per tile through a
    tensor descriptor (2; not in the interpreter), or dQ^T = K^T dS^T added so into dq read
    as (B, H, D, S_q) (3; compiled only). 2 and 3 leave the scale to whoever reads dq."""
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    B = tl.num_programs(2)
    HALF: tl.constexpr = BLOCK_N // PARTS
    # every tensor read as 2-D rows (B * S, H * D) (the forward's warp-specialized kernel
    # met races with descriptors over one program's slice under triton 3.6)
    q_desc = tl.make_tensor_descriptor(q, shape=[B * S_q, H * D], strides=[H * D, 1],
                                       block_shape=[BLOCK_M, D])
    do_desc = tl.make_tensor_descriptor(do, shape=[B * S_q, H * D], strides=[H * D, 1],
                                        block_shape=[BLOCK_M, D])
    k_desc = tl.make_tensor_descriptor(k, shape=[B * S_k, H * D], strides=[H * D, 1],
                                       block_shape=[HALF, D])
    v_desc = tl.make_tensor_descriptor(v, shape=[B * S_k, H * D], strides=[H * D, 1],
                                       block_shape=[HALF, D])
    lse_desc = tl.make_tensor_descriptor(lse_log2, shape=[B * H * S_q], strides=[1],
                                         block_shape=[BLOCK_M])
    delta_desc = tl.make_tensor_descriptor(delta, shape=[B * H * S_q], strides=[1],
                                           block_shape=[BLOCK_M])
    if DQ == 2:
        dq_desc = tl.make_tensor_descriptor(dq, shape=[B * S_q, H * D], strides=[H * D, 1],
                                            block_shape=[BLOCK_M, D])
    if DQ == 3:  # dq (B, H, D, S_q): dQ^T's tiles
        dq_desc = tl.make_tensor_descriptor(dq, shape=[B * H * D, S_q], strides=[S_q, 1],
                                            block_shape=[D, BLOCK_M])
    col = i_h * D
    k_row = i_b * S_k + i_n * BLOCK_N
    b_k1 = k_desc.load([k_row, col])
    b_v1 = v_desc.load([k_row, col])
    if PARTS == 2:
        b_k2 = k_desc.load([k_row + HALF, col])
        b_v2 = v_desc.load([k_row + HALF, col])
    else:  # (not read)
        b_k2, b_v2 = b_k1, b_v1
    b_dk1 = tl.zeros([HALF, D], dtype=tl.float32)
    b_dv1 = tl.zeros([HALF, D], dtype=tl.float32)
    b_dk2 = tl.zeros([HALF, D], dtype=tl.float32)
    b_dv2 = tl.zeros([HALF, D], dtype=tl.float32)
    q_row = i_b * S_q
    l_row = (i_b * H + i_h) * S_q
    for start_m in tl.range(0, S_q, BLOCK_M, warp_specialize=WS):
        b_q = q_desc.load([q_row + start_m, col])
        b_do = do_desc.load([q_row + start_m, col])
        b_lse = lse_desc.load([l_row + start_m])
        b_delta = delta_desc.load([l_row + start_m])
        b_dk1, b_dv1, b_ds1 = _dkdv_half(b_dk1, b_dv1, b_k1, b_v1, b_q, b_do, b_lse,
                                         b_delta, qk_scale, KEYS_AS_B)
        if DQ == 3:
            # dQ^T [D, BLOCK_M] = K^T dS^T
            b_dq = tl.dot(tl.trans(b_k1), b_ds1.to(b_k1.dtype))
        elif DQ:
            # dQ [BLOCK_M, D] = dS K
            b_dq = tl.dot(tl.trans(b_ds1.to(b_k1.dtype)), b_k1)
        if PARTS == 2:
            b_dk2, b_dv2, b_ds2 = _dkdv_half(b_dk2, b_dv2, b_k2, b_v2, b_q, b_do, b_lse,
                                             b_delta, qk_scale, KEYS_AS_B)
            if DQ:
                b_dq = tl.dot(tl.trans(b_ds2.to(b_k2.dtype)), b_k2, b_dq)
        if DQ == 1:
            o_m = start_m + tl.arange(0, BLOCK_M)
            o_dq = (i_b * S_q + o_m[:, None]) * (H * D) + col + tl.arange(0, D)[None, :]
            tl.atomic_add(dq + o_dq, b_dq * sm_scale, sem="relaxed")
        elif DQ == 2:
            dq_desc.atomic_add([q_row + start_m, col], b_dq)  # (scaled afterwards)
        elif DQ == 3:
            dq_desc.atomic_add([(i_b * H + i_h) * D, start_m], b_dq)  # (scaled afterwards)
    o_n = i_n * BLOCK_N + tl.arange(0, HALF)
    o_d = tl.arange(0, D)
    p = (i_b * S_k + o_n[:, None]) * (H * D) + col + o_d[None, :]
    tl.store(dk + p, (b_dk1 * sm_scale).to(dk.dtype.element_ty))
    tl.store(dv + p, b_dv1.to(dv.dtype.element_ty))
    if PARTS == 2:
        p += HALF * H * D
        tl.store(dk + p, (b_dk2 * sm_scale).to(dk.dtype.element_ty))
        tl.store(dv + p, b_dv2.to(dv.dtype.element_ty))


def inputs(B, S_q, S_k, H, D, dtype, device, seed=0):
    """q, k, v, dO and the forward's lse (base 2) and delta, as the backward reads them."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(B, S, H, D, device=device, dtype=dtype, generator=gen)
               for S in (S_q, S_k, S_k))
    do = torch.randn(B, S_q, H, D, device=device, dtype=dtype, generator=gen)
    scale = D ** -0.5
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    lse = torch.logsumexp(s, -1)  # (B, H, S_q)
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v.float())
    delta = (do.float() * o).sum(-1).transpose(1, 2).contiguous()  # (B, H, S_q)
    return q, k, v, do, (lse * LOG2E).contiguous(), delta, scale


def dkdv(q, k, v, do, lse_log2, delta, scale, BLOCK_M, BLOCK_N, num_warps, num_stages, ws,
         keys_as_b=False, parts=2, dq_mode=0):
    """dK and dV (and, where ``dq_mode``, dQ in fp32)."""
    B, S_q, H, D = q.shape
    S_k = k.shape[1]
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if dq_mode else dk
    dkdv_ws_kernel[(S_k // BLOCK_N, H, B)](
        q, k, v, do, lse_log2, delta, dk, dv, dq, S_q, S_k, scale * LOG2E, scale, H=H, D=D,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, WS=ws, KEYS_AS_B=keys_as_b, PARTS=parts,
        DQ=dq_mode, num_warps=num_warps, num_stages=num_stages)
    return (dk, dv, dq) if dq_mode else (dk, dv)


def check() -> int:
    """The kernel's dK and dV against autograd in fp32 (fp64 reference), two shapes."""
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    worst = 0.0
    for B, S_q, S_k, H, D in ((1, 64, 64, 2, 64), (2, 96, 128, 1, 32)):
        q, k, v, do, lse2, delta, scale = inputs(B, S_q, S_k, H, D, torch.float32, "cpu")
        for keys_as_b, parts, dq_mode in ((False, 2, 0), (True, 2, 0), (False, 1, 0),
                                          (True, 1, 0), (False, 1, 1), (False, 2, 1),
                                          (True, 1, 1)):
            grads = dkdv(q, k, v, do, lse2, delta, scale, 32, 32, 4, 1, True, keys_as_b,
                         parts, dq_mode)
            worst = max(worst, _error(q, k, v, do, grads, scale,
                                      f"{keys_as_b} parts={parts} dq={dq_mode}"))
    return 0 if worst < 1e-4 else 1


def _error(q, k, v, do, grads, scale, keys_as_b) -> float:
    """dK's and dV's (and dQ's, where given) largest error over the largest gradient,
    against fp64 autograd; grads: (dk, dv) or (dk, dv, dq)."""
    B, S_q, H, D = q.shape
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q64, k64) * scale
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v64)
    gq, gk, gv = torch.autograd.grad(o, (q64, k64, v64), do.double())
    err = max((g.double() - ref).abs().max().item() / ref.abs().max().item()
              for g, ref in zip(grads, (gk, gv, gq)))
    print(f"B={B} S_q={S_q} S_k={k.shape[1]} H={H} D={D} keys_as_b={keys_as_b}: largest "
          f"error / largest gradient {err:.2e}")
    return err


CONFIGS = [  # (D, BLOCK_M, BLOCK_N, num_warps, num_stages, WS, KEYS_AS_B, PARTS)
    (128, 64, 128, 8, 2, False, False, 2), (128, 64, 128, 4, 2, True, False, 2),
    (128, 32, 128, 4, 2, True, False, 2), (128, 64, 128, 4, 2, True, True, 2),
    (128, 32, 128, 4, 2, True, True, 2), (128, 64, 128, 4, 3, True, True, 2),
    (128, 64, 64, 8, 2, False, False, 2),
    (128, 64, 128, 4, 2, True, False, 1), (128, 32, 128, 4, 2, True, False, 1),
    (128, 64, 128, 8, 2, True, False, 1), (128, 64, 128, 4, 2, True, True, 1),
    (64, 64, 128, 8, 2, False, False, 2), (64, 64, 128, 4, 2, True, False, 2),
    (64, 32, 128, 4, 2, True, False, 2), (64, 64, 128, 4, 2, True, True, 2),
    (64, 64, 128, 4, 3, True, True, 2), (64, 128, 128, 4, 2, True, True, 2),
    (64, 64, 128, 4, 2, True, False, 1),
]
DQ_CONFIGS = [  # (D, BLOCK_M, BLOCK_N, num_warps, num_stages, WS, KEYS_AS_B, PARTS, DQ)
    (128, 64, 128, 4, 2, True, False, 1, 2), (128, 32, 128, 4, 2, True, False, 1, 2),
    (128, 64, 128, 4, 2, True, False, 1, 1), (128, 64, 128, 4, 2, True, True, 1, 2),
    (128, 64, 128, 4, 2, True, False, 2, 2), (128, 32, 128, 4, 2, True, False, 2, 2),
    (128, 64, 128, 8, 2, False, False, 1, 2), (64, 64, 128, 4, 2, True, False, 1, 2),
    (64, 64, 128, 4, 2, True, False, 2, 2), (64, 32, 128, 4, 2, True, False, 1, 2),
    (128, 64, 128, 4, 2, True, False, 1, 3), (128, 64, 128, 4, 2, True, True, 1, 3),
    (64, 64, 128, 4, 2, True, False, 1, 3),
]


def compile_all() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import compile_sm90  # installs the stand-in driver

    failed = 0
    only_dq = "--dq" in sys.argv
    for D, BM, BN, warps, stages, ws, keys_as_b, parts, dq in (
            [] if only_dq else [c + (0,) for c in CONFIGS]) + DQ_CONFIGS:
        B, S, H = 1, 4096, 2048 // D
        t = [torch.empty(B, S, H, D, dtype=torch.bfloat16) for _ in range(6)]
        lse2, delta = (torch.empty(B, H, S) for _ in range(2))
        kwargs = dict(q=t[0], k=t[1], v=t[2], do=t[3], lse_log2=lse2, delta=delta, dk=t[4],
                      dv=t[5], dq=torch.empty(B, S, H, D), S_q=S, S_k=S, qk_scale=0.1,
                      sm_scale=0.1, H=H, D=D, BLOCK_M=BM, BLOCK_N=BN, WS=ws,
                      KEYS_AS_B=keys_as_b, PARTS=parts, DQ=dq, num_warps=warps,
                      num_stages=stages)
        label = (f"D={D} {BM}x{BN}x{warps}x{stages} ws={ws} keys_as_b={keys_as_b} "
                 f"parts={parts} dq={dq}")
        res = compile_sm90.compile_kernel(dkdv_ws_kernel, (S // BN, H, B), kwargs, label)
        failed += not compile_sm90.report(res)
    return failed


def time_it() -> int:
    """On a Hopper GPU: this kernel against flashop's own dK/dV kernel in one process
    (profiler, bf16, B * S = 16384 tokens, H = 2048 / D, non-causal)."""
    from torch.profiler import ProfilerActivity, profile

    import flashop
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cuda"))
    for D in (64, 128):
        for S in (4096, 16384):
            B, H = 16384 // S, 2048 // D
            q, k, v, do, lse2, delta, scale = inputs(B, S, S, H, D, torch.bfloat16, "cuda")
            flops = 4 * 2 * B * H * S * S * D  # dK/dV's four products
            for BM, BN, warps, stages, ws, parts in (
                    (64, 128, 4, 2, True, 1), (32, 128, 4, 2, True, 1),
                    (64, 128, 4, 3, True, 1), (64, 128, 8, 2, False, 1)):
                label = f"D={D} S={S} {BM}x{BN}x{warps}x{stages} ws={ws} parts={parts}"
                try:
                    fn = lambda: dkdv(q, k, v, do, lse2, delta, scale, BM, BN,  # noqa: E731
                                      warps, stages, ws, False, parts)
                    ms = triton.testing.do_bench(fn, warmup=20, rep=100)
                    print(f"{label}: {ms:.3f} ms {flops / ms * 1e-9:.0f} TFLOP/s of its "
                          f"products", flush=True)
                except Exception as e:  # noqa: BLE001 (an experiment: report and go on)
                    print(f"{label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            with flashop.config.override(gluon=False, dq_atomics=False):
                out = flashop.attention(qq, kk, vv)
                _, gk, gv = torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)
                dk, dv = dkdv(q, k, v, do, lse2, delta, scale, 64, 128, 4, 2, True, False, 1)
                err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                          for a, b in ((dk, gk), (dv, gv)))
                print(f"D={D} S={S} 64x128x4x2 ws parts=1 against flashop's dK, dV: largest "
                      f"difference / largest gradient {err:.2e}", flush=True)
                for _ in range(3):
                    torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)
                    torch.cuda.synchronize()
            for e in prof.key_averages():
                if "dkdv" in e.key:
                    ms = e.device_time_total / e.count / 1e3
                    print(f"D={D} S={S} flashop {e.key}: {ms:.3f} ms "
                          f"{flops / ms * 1e-9:.0f} TFLOP/s of its products")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--check", action="store_true")
    group.add_argument("--compile", action="store_true")
    group.add_argument("--time", action="store_true")
    parser.add_argument("--dq", action="store_true",
                        help="with --compile or --time: only the forms that add dQ")
    args = parser.parse_args(argv)
    if args.check:
        return check()
    if args.compile:
        return compile_all()
    return time_it()


if __name__ == "__main__":
    sys.exit(main())
