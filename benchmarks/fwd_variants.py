"""Forward variants and ablations on a GPU: what limits the forward, and what moves it.

A stripped plain forward (no modifiers, non-causal, lengths that are multiples of the tiles)
with compile-time switches, timed side by side with flashop's forward in one process:

- ``FMA``: the scale folded into the row max and the exponent's subtraction (one FMA per
  score instead of a multiply and a subtract);
- ``TMA``: K and V tiles (and Q, O) through tensor descriptors (Hopper's copy engine);
- ``WS``: ``tl.range(..., warp_specialize=True)``;
- ``PIPE``: the next tile's scores ``Q K^T`` issued before the current tile's softmax, so
  that the tensor cores can run them while the softmax runs (FlashAttention-3's
  intra-warpgroup overlap, written out by hand);
- ``SPLIT``: each program takes two query tiles of BLOCK_M / 2 rows, A and B, over the same
  key tiles, in the order S_A, S_B, softmax A, P_A V, softmax B, P_B V: Triton waits for a
  scores matmul right after issuing it but lets the accumulating P V matmul run on until
  the end of the iteration, so P_A V can run while the softmax of B does;
- ``ROT``: as SPLIT, with B's P V product a key tile behind (S_A(j), P_B(j-1) V(j-1),
  softmax A(j), S_B(j), P_A(j) V(j), softmax B(j)), so that an accumulating product is in
  flight under each softmax (docs/performance-notes.md, entry 33);
- ablations, which compute wrong results on purpose and only time what remains:
  ``NO_EXP`` (p = s, no exp2), ``NO_RESCALE`` (the accumulator is not rescaled),
  ``NO_SOFTMAX`` (no max, no exp2, no row sums: the two matmuls and the loads alone).

Every correct variant is checked against flashop's output first (same rule as the tests).
    python benchmarks/fwd_variants.py [--D 128] [--N 16384] [--out variants.csv]
"""

import argparse
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


@triton.jit
def _softmax_pv(acc, l_i, m_i, b_s, b_v, qk_scale, FMA: tl.constexpr, NO_EXP: tl.constexpr,
                NO_RESCALE: tl.constexpr, NO_SOFTMAX: tl.constexpr):
    """Fold one tile of scores ``b_s`` [BLOCK_M, BLOCK_N] and its V tile into the running
    (acc, l_i, m_i)."""
    if NO_SOFTMAX:
        b_p = b_s
    else:
        if FMA:
            m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)
            b_s = b_s * qk_scale - m_new[:, None]
        else:
            b_s = b_s * qk_scale
            m_new = tl.maximum(m_i, tl.max(b_s, 1))
            b_s = b_s - m_new[:, None]
        if NO_EXP:
            b_p = b_s
        else:
            b_p = tl.math.exp2(b_s)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(b_p, 1)
        if not NO_RESCALE:
            acc = acc * alpha[:, None]
        m_i = m_new
    # [BLOCK_M, D]
    acc = tl.dot(b_p.to(b_v.dtype), b_v, acc)
    return acc, l_i, m_i


@triton.jit
def _variant_fwd_kernel(
    q, k, v, o, S, H, qk_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FMA: tl.constexpr,
    TMA: tl.constexpr, WS: tl.constexpr, PIPE: tl.constexpr, NO_EXP: tl.constexpr,
    NO_RESCALE: tl.constexpr, NO_SOFTMAX: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    row0 = i_b * S  # the tensors are read as 2-D (B * S, H * D)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, D)
    o_n0 = tl.arange(0, BLOCK_N)
    stride = H * D
    desc_k, desc_v = _variant_kv(k, v, S, stride, BLOCK_N, D, TMA)
    if TMA:
        desc_q = _variant_desc(q, S, stride, BLOCK_M, D)
        b_q = desc_q.load([row0 + i_m * BLOCK_M, i_h * D])
    else:
        b_q = tl.load(q + (row0 + o_m)[:, None] * stride + i_h * D + o_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    if PIPE:
        # S_{j+1} = Q K_{j+1}^T is issued before the softmax of S_j, so that the tensor
        # cores work on it while the softmax runs (FlashAttention-3's intra-warpgroup overlap)
        b_s = tl.dot(b_q, _variant_kt(k, desc_k, row0, 0, i_h, stride, o_d, o_n0, TMA))
        for start_n in tl.range(BLOCK_N, S, BLOCK_N, warp_specialize=WS):
            b_s_next = tl.dot(b_q, _variant_kt(k, desc_k, row0, start_n, i_h, stride, o_d,
                                               o_n0, TMA))
            b_v = _variant_v(v, desc_v, row0, start_n - BLOCK_N, i_h, stride, o_d, o_n0, TMA)
            acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, b_s, b_v, qk_scale, FMA, NO_EXP,
                                        NO_RESCALE, NO_SOFTMAX)
            b_s = b_s_next
        b_v = _variant_v(v, desc_v, row0, S - BLOCK_N, i_h, stride, o_d, o_n0, TMA)
        acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, b_s, b_v, qk_scale, FMA, NO_EXP,
                                    NO_RESCALE, NO_SOFTMAX)
    else:
        for start_n in tl.range(0, S, BLOCK_N, warp_specialize=WS):
            b_s = tl.dot(b_q, _variant_kt(k, desc_k, row0, start_n, i_h, stride, o_d, o_n0,
                                          TMA))
            b_v = _variant_v(v, desc_v, row0, start_n, i_h, stride, o_d, o_n0, TMA)
            acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, b_s, b_v, qk_scale, FMA, NO_EXP,
                                        NO_RESCALE, NO_SOFTMAX)
    if not NO_SOFTMAX:
        acc = acc / l_i[:, None]
    b_o = acc.to(o.dtype.element_ty)
    if TMA:
        desc_o = _variant_desc(o, S, stride, BLOCK_M, D)
        desc_o.store([row0 + i_m * BLOCK_M, i_h * D], b_o)
    else:
        tl.store(o + (row0 + o_m)[:, None] * stride + i_h * D + o_d[None, :], b_o)


@triton.jit
def _two_query_tiles(q, S, H, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """The program's head, row offset, first tile's rows and its two query tiles of
    BLOCK_M / 2 rows (SPLIT, ROT); the tensors are read as 2-D (B * S, H * D)."""
    HALF: tl.constexpr = BLOCK_M // 2
    i_m = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    row0 = i_b * S
    o_a = i_m * BLOCK_M + tl.arange(0, HALF)
    o_d = tl.arange(0, D)
    stride = H * D
    b_qa = tl.load(q + (row0 + o_a)[:, None] * stride + i_h * D + o_d[None, :])
    b_qb = tl.load(q + (row0 + HALF + o_a)[:, None] * stride + i_h * D + o_d[None, :])
    return i_h, row0, o_a, b_qa, b_qb


@triton.jit
def _split_fwd_kernel(
    q, k, v, o, S, H, qk_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FMA: tl.constexpr,
    TMA: tl.constexpr,
):
    """The stripped forward with two query tiles of BLOCK_M / 2 rows per program (SPLIT)."""
    HALF: tl.constexpr = BLOCK_M // 2
    i_h, row0, o_a, b_qa, b_qb = _two_query_tiles(q, S, H, D, BLOCK_M)
    o_d = tl.arange(0, D)
    o_n0 = tl.arange(0, BLOCK_N)
    stride = H * D
    desc_k, desc_v = _variant_kv(k, v, S, stride, BLOCK_N, D, TMA)
    m_a = tl.full([HALF], float("-inf"), dtype=tl.float32)
    m_b = tl.full([HALF], float("-inf"), dtype=tl.float32)
    l_a = tl.zeros([HALF], dtype=tl.float32)
    l_b = tl.zeros([HALF], dtype=tl.float32)
    acc_a = tl.zeros([HALF, D], dtype=tl.float32)
    acc_b = tl.zeros([HALF, D], dtype=tl.float32)
    for start_n in range(0, S, BLOCK_N):
        b_kt = _variant_kt(k, desc_k, row0, start_n, i_h, stride, o_d, o_n0, TMA)
        b_sa = tl.dot(b_qa, b_kt)
        b_sb = tl.dot(b_qb, b_kt)
        b_v = _variant_v(v, desc_v, row0, start_n, i_h, stride, o_d, o_n0, TMA)
        acc_a, l_a, m_a = _softmax_pv(acc_a, l_a, m_a, b_sa, b_v, qk_scale, FMA, False, False,
                                      False)
        acc_b, l_b, m_b = _softmax_pv(acc_b, l_b, m_b, b_sb, b_v, qk_scale, FMA, False, False,
                                      False)
    tl.store(o + (row0 + o_a)[:, None] * stride + i_h * D + o_d[None, :],
             (acc_a / l_a[:, None]).to(o.dtype.element_ty))
    tl.store(o + (row0 + HALF + o_a)[:, None] * stride + i_h * D + o_d[None, :],
             (acc_b / l_b[:, None]).to(o.dtype.element_ty))


@triton.jit
def _softmax_p(l_i, m_i, b_s, qk_scale, FMA: tl.constexpr):
    """The softmax of one tile of scores without its P V product: (P, alpha, l, m)."""
    if FMA:
        m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)
        b_p = tl.math.exp2(b_s * qk_scale - m_new[:, None])
    else:
        b_s = b_s * qk_scale
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        b_p = tl.math.exp2(b_s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return b_p, alpha, l_i * alpha + tl.sum(b_p, 1), m_new


@triton.jit
def _rot_fwd_kernel(
    q, k, v, o, S, H, qk_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FMA: tl.constexpr,
    TMA: tl.constexpr,
):
    """The stripped forward with two query tiles (as SPLIT), B's P V product a key tile
    behind (ROT): iteration j runs S_A(j), P_B(j-1) V(j-1), softmax A(j), S_B(j),
    P_A(j) V(j), softmax B(j), so that each softmax runs while an accumulating P V product
    is in flight. B's accumulator is kept as two halves of D/2 columns, whose layout is
    the scores' (with one [rows, D] accumulator Triton converts it at the top of the loop,
    which makes its product wait where issued)."""
    HALF: tl.constexpr = BLOCK_M // 2
    DH: tl.constexpr = D // 2
    i_h, row0, o_a, b_qa, b_qb = _two_query_tiles(q, S, H, D, BLOCK_M)
    o_d = tl.arange(0, D)
    o_dh = tl.arange(0, DH)
    o_n0 = tl.arange(0, BLOCK_N)
    stride = H * D
    desc_k, desc_v = _variant_kv(k, v, S, stride, BLOCK_N, D, TMA)
    p_v = v + i_h * D + o_dh[None, :]
    l_a = tl.zeros([HALF], dtype=tl.float32)
    acc_a = tl.zeros([HALF, D], dtype=tl.float32)
    acc_b0 = tl.zeros([HALF, DH], dtype=tl.float32)
    acc_b1 = tl.zeros([HALF, DH], dtype=tl.float32)
    # key tile 0: both softmaxes, A's product; B's waits for the loop
    b_kt = _variant_kt(k, desc_k, row0, 0, i_h, stride, o_d, o_n0, TMA)
    b_sa = tl.dot(b_qa, b_kt)
    b_sb = tl.dot(b_qb, b_kt)
    m_a = tl.full([HALF], float("-inf"), dtype=tl.float32)
    b_pa, _, l_a, m_a = _softmax_p(l_a, m_a, b_sa, qk_scale, FMA)
    b_v = _variant_v(v, desc_v, row0, 0, i_h, stride, o_d, o_n0, TMA)
    acc_a = tl.dot(b_pa.to(b_v.dtype), b_v, acc_a)
    m_b = tl.full([HALF], float("-inf"), dtype=tl.float32)
    l_b = tl.zeros([HALF], dtype=tl.float32)
    b_pb, alpha_b, l_b, m_b = _softmax_p(l_b, m_b, b_sb, qk_scale, FMA)
    for start_n in range(BLOCK_N, S, BLOCK_N):
        b_kt = _variant_kt(k, desc_k, row0, start_n, i_h, stride, o_d, o_n0, TMA)
        b_sa = tl.dot(b_qa, b_kt)
        o_vp = (row0 + start_n - BLOCK_N + o_n0)[:, None] * stride
        # (P_B is carried in fp32: converted here, from the scores' layout, the product
        # does not wait for its registers)
        b_pbl = b_pb.to(v.dtype.element_ty)
        acc_b0 = tl.dot(b_pbl, tl.load(p_v + o_vp), acc_b0 * alpha_b[:, None])
        acc_b1 = tl.dot(b_pbl, tl.load(p_v + o_vp + DH), acc_b1 * alpha_b[:, None])
        b_pa, alpha_a, l_a, m_a = _softmax_p(l_a, m_a, b_sa, qk_scale, FMA)
        b_sb = tl.dot(b_qb, b_kt)
        b_v = _variant_v(v, desc_v, row0, start_n, i_h, stride, o_d, o_n0, TMA)
        acc_a = tl.dot(b_pa.to(b_v.dtype), b_v, acc_a * alpha_a[:, None])
        b_pb, alpha_b, l_b, m_b = _softmax_p(l_b, m_b, b_sb, qk_scale, FMA)
    o_vp = (row0 + S - BLOCK_N + o_n0)[:, None] * stride
    b_pbl = b_pb.to(v.dtype.element_ty)
    acc_b0 = tl.dot(b_pbl, tl.load(p_v + o_vp), acc_b0 * alpha_b[:, None])
    acc_b1 = tl.dot(b_pbl, tl.load(p_v + o_vp + DH), acc_b1 * alpha_b[:, None])
    tl.store(o + (row0 + o_a)[:, None] * stride + i_h * D + o_d[None, :],
             (acc_a / l_a[:, None]).to(o.dtype.element_ty))
    p_ob = o + (row0 + HALF + o_a)[:, None] * stride + i_h * D + o_dh[None, :]
    tl.store(p_ob, (acc_b0 / l_b[:, None]).to(o.dtype.element_ty))
    tl.store(p_ob + DH, (acc_b1 / l_b[:, None]).to(o.dtype.element_ty))


@triton.jit
def _variant_desc(x, S, stride, ROWS: tl.constexpr, D: tl.constexpr):
    """Tensor descriptor of [ROWS, D] tiles over x read as 2-D (B * S, H * D)."""
    return tl.make_tensor_descriptor(x, [S * tl.num_programs(2), stride], [stride, 1], [ROWS, D])


@triton.jit
def _variant_kv(k, v, S, stride, BLOCK_N: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr):
    """K and V as the loops read them: descriptors of [BLOCK_N, D] tiles where TMA, else the
    pointers."""
    desc_k = k
    desc_v = v
    if TMA:
        desc_k = _variant_desc(k, S, stride, BLOCK_N, D)
        desc_v = _variant_desc(v, S, stride, BLOCK_N, D)
    return desc_k, desc_v


@triton.jit
def _variant_kt(k, desc_k, row0, start_n, i_h, stride, o_d, o_n0, TMA: tl.constexpr):
    """K^T tile [D, BLOCK_N] at key start_n."""
    if TMA:
        b_kt = tl.trans(desc_k.load([row0 + start_n, i_h * o_d.shape[0]]))
    else:
        b_kt = tl.load(k + (row0 + start_n + o_n0)[None, :] * stride + i_h * o_d.shape[0]
                       + o_d[:, None])
    return b_kt


@triton.jit
def _variant_v(v, desc_v, row0, start_n, i_h, stride, o_d, o_n0, TMA: tl.constexpr):
    """V tile [BLOCK_N, D] at key start_n."""
    if TMA:
        b_v = desc_v.load([row0 + start_n, i_h * o_d.shape[0]])
    else:
        b_v = tl.load(v + (row0 + start_n + o_n0)[:, None] * stride + i_h * o_d.shape[0]
                      + o_d[None, :])
    return b_v


VARIANTS = {
    # name: switches (defaults False)
    "base": {},
    "fma": dict(FMA=True),
    "tma": dict(TMA=True),
    "fma+tma": dict(FMA=True, TMA=True),
    "fma+ws": dict(FMA=True, WS=True),
    "fma+tma+ws": dict(FMA=True, TMA=True, WS=True),
    "pipe": dict(PIPE=True),
    "fma+pipe": dict(FMA=True, PIPE=True),
    "fma+tma+pipe": dict(FMA=True, TMA=True, PIPE=True),
    "split": dict(SPLIT=True),
    "fma+split": dict(FMA=True, SPLIT=True),
    "fma+tma+split": dict(FMA=True, TMA=True, SPLIT=True),
    "rot": dict(ROT=True),
    "fma+rot": dict(FMA=True, ROT=True),
    "no-exp": dict(FMA=True, NO_EXP=True),
    "no-rescale": dict(FMA=True, NO_RESCALE=True),
    "no-softmax": dict(NO_SOFTMAX=True),
    "no-softmax+tma": dict(NO_SOFTMAX=True, TMA=True),
}
FULL_SWEEP = {"base", "fma", "fma+tma", "pipe", "fma+pipe", "fma+tma+pipe"}
ABLATIONS = {"no-exp", "no-rescale", "no-softmax", "no-softmax+tma"}
TILES = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3)]
# head dims above 128: the tiles that fit the shared memory of a Hopper GPU (flashop's
# table has the first); each is timed for every variant
WIDE_TILES = [(128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2)]
# SPLIT: BLOCK_M counts both query tiles; 256 x 128 spills its registers
SPLIT_TILES = [(256, 64, 8, 2), (256, 64, 8, 3), (256, 32, 8, 3), (256, 32, 8, 4),
               (128, 32, 4, 3), (128, 64, 4, 2)]


def run_variant(q, k, v, name, tiles, scale):
    B, S, H, D = q.shape
    BM, BN, warps, stages = tiles
    o = torch.empty_like(q)
    flags = dict(FMA=False, TMA=False, WS=False, PIPE=False, NO_EXP=False, NO_RESCALE=False,
                 NO_SOFTMAX=False)
    flags.update(VARIANTS[name])
    kernel = _variant_fwd_kernel
    if flags.pop("SPLIT", False) or flags.get("ROT"):
        kernel = _rot_fwd_kernel if flags.pop("ROT", False) else _split_fwd_kernel
        flags = dict(FMA=flags["FMA"], TMA=flags["TMA"])

    def fn():
        kernel[(S // BM, H, B)](
            q, k, v, o, S, H, scale * 1.4426950408889634, D=D, BLOCK_M=BM, BLOCK_N=BN,
            **flags, num_warps=warps, num_stages=stages)
        return o
    return fn


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--D", default="128,64")
    parser.add_argument("--N", type=int, default=16384)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("fwd_variants.py needs a CUDA GPU")
        return 2
    use_torch_allocator()
    rows = []
    for D in (int(d) for d in args.D.split(",")):
        N = args.N
        B, H = 16384 // N, 2048 // D
        q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        flops = 4 * B * H * N * N * D
        ref = flashop.attention(q, k, v)
        ms = do_bench(lambda: flashop.attention(q, k, v), warmup=25, rep=100,
                      return_mode="median")
        rows.append(dict(D=D, N=N, variant="flashop", tiles="default", ms=round(ms, 4),
                         tflops=round(flops / ms * 1e-9, 1), error=""))
        print(f"D={D} N={N} flashop: {flops / ms * 1e-9:.0f} TFLOP/s", flush=True)
        for name in args.variants.split(","):
            tile_list = TILES if name in FULL_SWEEP else TILES[1::2]
            if D > 128:
                tile_list = WIDE_TILES
            if "split" in name or "rot" in name:
                tile_list = SPLIT_TILES if D <= 128 else [(128, 32, 4, 2), (128, 32, 8, 2)]
            for tiles in tile_list:
                row = dict(D=D, N=N, variant=name, tiles="x".join(map(str, tiles)))
                check = None if name in ABLATIONS else (lambda out: rel_err(out, ref))
                row = time_variant(run_variant(q, k, v, name, tiles, D ** -0.5), row, flops,
                                   check)
                if row:
                    rows.append(row)
    print_best(rows, ["flashop"] + args.variants.split(","))
    if args.out:
        write_csv(Path(args.out), rows, fieldnames=list(rows[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
