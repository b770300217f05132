"""Backward dK/dV variants and ablations on a GPU: what limits the dK/dV kernel, and what moves it.

A stripped plain dK/dV kernel (no modifiers, non-causal, no GQA, lengths that are multiples of
the tiles, D = DV a power of two) with compile-time switches, timed side by side with
flashop's own dK/dV kernel in one process. One program per key tile of one head: K and V are
loaded once, then for each query tile

    S^T = K Q^T;  P^T = exp2(S^T * qk_scale - lse2);  dV += P^T dO;  dP^T = V dO^T;
    dS^T = P^T * (dP^T - delta);  dK += dS^T Q

and dK is scaled at the end. lse2 (the base-2 lse flashop's forward saves for its backward)
and delta (rowsum(dO * O), on the host) are computed once. The switches:

- ``MASKED``: Q^T, dO, lse and delta loaded with row masks, as flashop does ("base" mirrors
  flashop's kernel); without it the loads are unmasked;
- ``TMA``: Q and dO tiles through tensor descriptors (Hopper's copy engine), Q^T as the
  transpose of the loaded Q tile;
- ``DP_FIRST``: dP^T = V dO^T issued before dV += P^T dO;
- ``KT_SCALED``: K multiplied by qk_scale once before the loop (in fp32, rounded back to
  bf16: the rounding changes, see its error column), so the scores need no multiply;
- ablations, which compute wrong results on purpose and only time what remains (no accuracy
  check): ``NO_EXP`` (P^T = S^T - lse2, no exp2), ``NO_DS`` (dS^T = dP^T: no elementwise
  product, and delta is no longer loaded), ``NO_DV`` (no dV matmul), ``NO_DK`` (no dK
  matmul; dS^T is summed elementwise into a register tile instead, so that the dP^T matmul
  and the dS^T product are not removed as dead code), ``MATMULS_ONLY`` (no scale, no exp2,
  no dS^T product, no lse/delta loads: the four matmuls and the Q, dO loads alone).

Reference rows: flashop's whole backward (``torch.autograd.grad``, timed with do_bench, TFLOP/s
by the usual 2.5x-forward count 10*B*H*N*N*D), and its dK/dV and dQ kernels alone, timed by
the profiler as benchmarks/kernel_times.py does. Every other row counts the dK/dV kernel's four
matmuls, 8*B*H*N*N*D (the dQ kernel row its three, 6*B*H*N*N*D). Every correct variant's dK,
dV are checked against flashop's (relative error < 1e-2).

    python benchmarks/bwd_variants.py [--D 128] [--N 16384] [--variants base,nomask]
        [--tiles 64x64x4x2,64x128x8x3] [--out variants.csv]

Without a GPU, ``TRITON_INTERPRET=1 python benchmarks/bwd_variants.py --interpret-check``
runs each variant once on a tiny fp16 problem in Triton's interpreter and checks the correct
ones against PyTorch's float64 gradients.
"""

import argparse
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

try:
    import flashop
except ImportError:
    sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
    import flashop
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import write_csv  # noqa: E402
from variants import print_best, rel_err, time_variant, use_torch_allocator  # noqa: E402

LOG2E = 1.4426950408889634


@triton.jit
def _variant_rows(p, o_m, m_m, other, MASKED: tl.constexpr):
    """One (B, H, S) fp32 row block [BLOCK_M] (lse2 or delta) of this program's head."""
    if MASKED:
        b_x = tl.load(p + o_m, mask=m_m, other=other)
    else:
        b_x = tl.load(p + o_m)
    return b_x


@triton.jit
def _variant_dkdv_kernel(
    q, k, v, do, lse2, delta, dk, dv, stride, S, H, sm_scale, qk_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    TMA: tl.constexpr, DP_FIRST: tl.constexpr, KT_SCALED: tl.constexpr, NO_EXP: tl.constexpr,
    NO_DS: tl.constexpr, NO_DV: tl.constexpr, NO_DK: tl.constexpr,
    MATMULS_ONLY: tl.constexpr,
):
    """dK, dV of one key tile of one head. q, k, v, do, dk, dv are (B, S, H, D) with row
    stride ``stride``; lse2 and delta (B, H, S) fp32."""
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    # this (batch, head)'s [S, D] slices: rows of stride ``stride``, unit columns
    head = i_b * S * stride + i_h * D
    q += head
    k += head
    v += head
    do += head
    dk += head
    dv += head
    row = (i_b * H + i_h) * S  # lse2, delta
    lse2 += row
    delta += row
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, D)
    # [BLOCK_N, D], loaded once
    b_k = tl.load(k + o_n[:, None] * stride + o_d[None, :])
    b_v = tl.load(v + o_n[:, None] * stride + o_d[None, :])
    if KT_SCALED:
        # the scale folded into K once: S^T comes out in base-2 units, no multiply per score
        b_k = (b_k.to(tl.float32) * qk_scale).to(k.dtype.element_ty)
    b_dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    if NO_DK:
        b_dst_sum = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if TMA:
        # one descriptor per program over this head's [S, D] slice; rows past S read as 0
        desc_q = tl.make_tensor_descriptor(q, [S, D], [stride, 1], [BLOCK_M, D])
        desc_do = tl.make_tensor_descriptor(do, [S, D], [stride, 1], [BLOCK_M, D])
    for start_m in range(0, S, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        o_m = start_m + tl.arange(0, BLOCK_M)
        m_m = o_m < S
        # Q^T [D, BLOCK_M]
        if TMA:
            b_q = desc_q.load([start_m, 0])
            b_qt = tl.trans(b_q)
        elif MASKED:
            b_qt = tl.load(q + o_m[None, :] * stride + o_d[:, None], mask=m_m[None, :],
                           other=0.0)
        else:
            b_qt = tl.load(q + o_m[None, :] * stride + o_d[:, None])
        # S^T = K Q^T [BLOCK_N, BLOCK_M]
        b_st = tl.dot(b_k, b_qt)
        if MATMULS_ONLY:
            b_pt = b_st
        else:
            b_lse = _variant_rows(lse2, o_m, m_m, float("inf"), MASKED)
            if not KT_SCALED:
                b_st = b_st * qk_scale
            if NO_EXP:
                b_pt = b_st - b_lse[None, :]
            else:
                b_pt = tl.math.exp2(b_st - b_lse[None, :])
        # dO [BLOCK_M, D]
        if TMA:
            b_do = desc_do.load([start_m, 0])
        elif MASKED:
            b_do = tl.load(do + o_m[:, None] * stride + o_d[None, :], mask=m_m[:, None],
                           other=0.0)
        else:
            b_do = tl.load(do + o_m[:, None] * stride + o_d[None, :])
        if DP_FIRST:
            # dP^T = V dO^T [BLOCK_N, BLOCK_M] first, then dV += P^T dO [BLOCK_N, D]
            b_dpt = tl.dot(b_v, tl.trans(b_do))
            if not NO_DV:
                b_dv = tl.dot(b_pt.to(do.dtype.element_ty), b_do, b_dv)
        else:
            # flashop's order: dV += P^T dO, then dP^T = V dO^T
            if not NO_DV:
                b_dv = tl.dot(b_pt.to(do.dtype.element_ty), b_do, b_dv)
            b_dpt = tl.dot(b_v, tl.trans(b_do))
        if MATMULS_ONLY or NO_DS:
            b_dst = b_dpt
        else:
            b_delta = _variant_rows(delta, o_m, m_m, 0.0, MASKED)
            b_dst = b_pt * (b_dpt - b_delta[None, :])
        if NO_DK:
            b_dst_sum += b_dst
        else:
            # dK += dS^T Q [BLOCK_N, D]
            if TMA:
                b_dk = tl.dot(b_dst.to(q.dtype.element_ty), b_q, b_dk)
            else:
                b_dk = tl.dot(b_dst.to(q.dtype.element_ty), tl.trans(b_qt), b_dk)
    if NO_DK:
        b_dk += tl.sum(b_dst_sum, 1)[:, None]
    b_dk = b_dk * sm_scale
    tl.store(dk + o_n[:, None] * stride + o_d[None, :], b_dk.to(dk.dtype.element_ty))
    tl.store(dv + o_n[:, None] * stride + o_d[None, :], b_dv.to(dv.dtype.element_ty))


VARIANTS = {
    # name: switches (defaults False)
    "base": dict(MASKED=True),
    "nomask": {},
    "tma": dict(TMA=True),
    "dp-first": dict(MASKED=True, DP_FIRST=True),
    "nomask+dp-first": dict(DP_FIRST=True),
    "tma+dp-first": dict(TMA=True, DP_FIRST=True),
    "kt-scaled": dict(MASKED=True, KT_SCALED=True),
    "nomask+dp-first+kt-scaled": dict(DP_FIRST=True, KT_SCALED=True),
    "no-exp": dict(MASKED=True, NO_EXP=True),
    "no-ds": dict(MASKED=True, NO_DS=True),
    "no-dv": dict(MASKED=True, NO_DV=True),
    "no-dk": dict(MASKED=True, NO_DK=True),
    "matmuls-only": dict(MASKED=True, MATMULS_ONLY=True),
    "matmuls-only+nomask": dict(MATMULS_ONLY=True),
}
FULL_SWEEP = {"base", "nomask", "tma", "dp-first", "nomask+dp-first", "tma+dp-first",
              "kt-scaled", "nomask+dp-first+kt-scaled"}
ABLATIONS = {"no-exp", "no-ds", "no-dv", "no-dk", "matmuls-only", "matmuls-only+nomask"}
# (BLOCK_M queries, BLOCK_N keys, num_warps, num_stages); flashop's D=128 default is the first
TILES = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 4, 3),
         (128, 128, 8, 2)]
SWITCHES = ("MASKED", "TMA", "DP_FIRST", "KT_SCALED", "NO_EXP", "NO_DS", "NO_DV", "NO_DK",
            "MATMULS_ONLY")


def run_variant(q, k, v, do, lse2, delta, name, tiles, scale):
    """A callable launching variant ``name`` with ``tiles``; it returns (dk, dv)."""
    B, S, H, D = q.shape
    BM, BN, warps, stages = tiles
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    flags = dict.fromkeys(SWITCHES, False)
    flags.update(VARIANTS[name])

    def fn():
        _variant_dkdv_kernel[(S // BN, H, B)](
            q, k, v, do, lse2, delta, dk, dv, q.stride(1), S, H, scale, scale * LOG2E, D=D,
            BLOCK_M=BM, BLOCK_N=BN, **flags, num_warps=warps, num_stages=stages)
        return dk, dv
    return fn


def delta_rows(out, do):
    """rowsum(dO * O), (B, H, S) fp32 contiguous, as the kernel reads it (no lse gradient,
    so delta has no dlse term)."""
    return (do.float() * out.float()).sum(-1).transpose(1, 2).contiguous()


def parse_tiles(text):
    """'64x64x4x2,64x128x8x3' -> [(64, 64, 4, 2), (64, 128, 8, 3)]."""
    return [tuple(int(x) for x in t.split("x")) for t in text.split(",")]


def interpret_check(names):
    """Each variant once under Triton's interpreter on a tiny fp16 problem; the correct ones
    against PyTorch's float64 gradients. Returns the exit status."""
    torch.manual_seed(0)
    B, H, N, D = 1, 2, 64, 16
    scale = D ** -0.5
    # fp16: bf16 tl.dot is wrong under the interpreter (its bit patterns are multiplied)
    q, k, v, do = (torch.randn(B, N, H, D, dtype=torch.float16) for _ in range(4))
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    s = torch.einsum("bihd,bjhd->bhij", q64, k64) * scale
    out = torch.einsum("bhij,bjhd->bihd", torch.softmax(s, -1), v64)
    dk_ref, dv_ref = torch.autograd.grad(out, (k64, v64), do.double())
    lse2 = (torch.logsumexp(s.detach(), -1) * LOG2E).float().contiguous()
    delta = delta_rows(out.detach(), do)
    use_torch_allocator("cpu")
    failed = 0
    for name in names:
        for tiles in ((32, 32, 4, 1), (16, 32, 4, 1)):
            try:
                dk, dv = run_variant(q, k, v, do, lse2, delta, name, tiles, scale)()
            except Exception as e:  # noqa: BLE001 - e.g. descriptors the interpreter lacks
                if VARIANTS[name].get("TMA"):
                    print(f"  {name:>26} {tiles}: skipped, tensor descriptors do not run "
                          f"under the interpreter ({type(e).__name__}: {str(e)[:120]})")
                    continue
                print(f"  {name:>26} {tiles}: FAIL {type(e).__name__}: {str(e)[:200]}")
                failed += 1
                continue
            if name in ABLATIONS:
                print(f"  {name:>26} {tiles}: ran (ablation, not checked)")
                continue
            e_dk, e_dv = rel_err(dk, dk_ref), rel_err(dv, dv_ref)
            ok = e_dk < 1e-2 and e_dv < 1e-2
            failed += not ok
            print(f"  {name:>26} {tiles}: {'pass' if ok else 'FAIL'}  rel err dK {e_dk:.1e} "
                  f"dV {e_dv:.1e}")
    print(f"interpreter check: {'FAILED' if failed else 'passed'}")
    return 1 if failed else 0


def flashop_rows(q, k, v, do, D, N):
    """flashop's whole backward (do_bench) and its dK/dV and dQ kernels (profiler)."""
    from kernel_times import kernel_times
    B, _, H, _ = q.shape
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    out = flashop.attention(qg, kg, vg)

    def bwd():
        return torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)
    _, dk_ref, dv_ref = bwd()
    rows = []
    ms = do_bench(bwd, warmup=25, rep=100, return_mode="median")
    flops = 10 * B * H * N * N * D  # the usual count: 2.5x the forward's
    rows.append(dict(D=D, N=N, variant="flashop-bwd", tiles="default", ms=round(ms, 4),
                     tflops=round(flops / ms * 1e-9, 1), error=""))
    print(f"D={D} N={N} flashop whole backward: {ms:.3f} ms, {flops / ms * 1e-9:.0f} TFLOP/s "
          f"(10*B*H*N*N*D)", flush=True)
    times = kernel_times(bwd)
    for variant, key, matmuls in (("flashop-dkdv", "dkdv", 4), ("flashop-dq", "bwd_dq", 3)):
        us = sum(t for kname, t in times.items() if key in kname)
        if not us:
            print(f"  no kernel named *{key}* in the profile: {sorted(times)}")
            continue
        flops = 2 * matmuls * B * H * N * N * D
        ms = us * 1e-3
        rows.append(dict(D=D, N=N, variant=variant, tiles="default", ms=round(ms, 4),
                         tflops=round(flops / ms * 1e-9, 1), error=""))
        print(f"  {variant:>26} (profiler): {ms:.3f} ms, {flops / ms * 1e-9:.0f} TFLOP/s "
              f"({matmuls} matmuls)", flush=True)
    return rows, out.detach(), dk_ref, dv_ref


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--D", default="128")
    parser.add_argument("--N", type=int, default=16384)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--tiles", type=parse_tiles, default=None,
                        help="BMxBNxWARPSxSTAGES,... for every variant (default: the sweep)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--interpret-check", action="store_true",
                        help="without a GPU: run the variants under TRITON_INTERPRET=1")
    args = parser.parse_args()
    names = args.variants.split(",")
    for name in names:
        if name not in VARIANTS:
            parser.error(f"unknown variant {name!r}; known: {','.join(VARIANTS)}")
    if args.interpret_check:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--interpret-check needs TRITON_INTERPRET=1")
            return 2
        return interpret_check(names)
    if not torch.cuda.is_available():
        print("bwd_variants.py needs a CUDA GPU")
        return 2
    use_torch_allocator()
    rows = []
    for D in (int(d) for d in args.D.split(",")):
        N = args.N
        B, H = 16384 // N, 2048 // D
        q, k, v, do = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))
        scale = D ** -0.5
        flops = 8 * B * H * N * N * D  # the dK/dV kernel's four matmuls
        ref_rows, out, dk_ref, dv_ref = flashop_rows(q, k, v, do, D, N)
        rows += ref_rows
        # the base-2 lse as flashop's forward saves it for its own backward
        lse2 = torch.ops.flashop.attention_forward(q, k, v)[2]
        delta = delta_rows(out, do)
        for name in names:
            for tiles in (args.tiles or (TILES if name in FULL_SWEEP else TILES[::2])):
                row = dict(D=D, N=N, variant=name, tiles="x".join(map(str, tiles)))
                check = None if name in ABLATIONS else (
                    lambda out: max(rel_err(out[0], dk_ref), rel_err(out[1], dv_ref)))
                row = time_variant(run_variant(q, k, v, do, lse2, delta, name, tiles, scale),
                                   row, flops, check, width=26)
                if row:
                    rows.append(row)
    print_best(rows, ["flashop-bwd", "flashop-dkdv", "flashop-dq"] + names, width=26)
    if args.out:
        write_csv(Path(args.out), rows, fieldnames=list(rows[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
