"""The `tl` MLA decode kernel with each tile's scores computed in a region of their own
(performance notes, entry 147), compiled for sm_90 on a machine without a GPU; timed in
entry 148, after which kernels/mla.py took the regions (at 64 rows): since then "package"
and "region" below compile and time the same code.

Entry 141: at 64 rows and 8 warps, Triton lays S = Q K^T out over all eight warps along the
rows (warpsPerCTA [8, 1]) because S feeds another product (P V): Triton's choice of warps
for a wgmma (AccelerateMatmul's warpsPerTileV3) looks for a product in the forward slice of
the product's result. So both warp groups compute the whole S. Here the scores and the
softmax of a tile sit inside ``if start_n < end:`` (always true in the loop), whose results
leave the region through its yield, where the forward slice stops: S's product then sees
no product after it and takes warpsPerCTA [4, 2] (each group 32 of the 64 keys), and P V's
takes [4, 2] too (each group 256 of the 512 value dims), P passing through shared memory:
FlashMLA's structure, asked of `tl` by the program's shape alone.

From the repository root, with a CPU torch and triton 3.6.0 (or the newest):

    PYTHONPATH=. python docs/notes/experiments/tl_mla_scores_region.py
    TRITON_INTERPRET=1 PYTHONPATH=. python docs/notes/experiments/tl_mla_scores_region.py --check

(``--check``: the variant in the package's place under Triton's interpreter, test_mla's
CPU cases against the reference: the regions change no result.)

On a Hopper GPU, one process per kernel (a kernel's compiled form is keyed once):

    PYTHONPATH=. python docs/notes/experiments/tl_mla_scores_region.py --time package
    PYTHONPATH=. python docs/notes/experiments/tl_mla_scores_region.py --time region

(``--time``: the `tl` kernel (FLASHOP_GLUON off) at benchmarks/decode.py's H = 128 points,
dense and pages of 64, CUDA-graph replays, after test_mla's 128-head real-shape case
against the reference.)

It compiles the package's kernel and the variant at the launches the MLA launcher plans for
H = 128 (dense and pages of 64, S_q = 1 and 2, the table's 64 x 64 tile, 8 warps, 2
stages), and prints per kernel the shared memory, registers, spills, the MMA layouts of
the TTGIR and each thread's wgmma instructions by shape.
"""

import collections
import os
import re
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

CHECK = "--check" in sys.argv
TIME = sys.argv[sys.argv.index("--time") + 1] if "--time" in sys.argv else None
if not CHECK and TIME is None:
    import compile_for_hopper as C  # noqa: E402  (the stand-in driver first)
    from compile_sm90 import compile_kernel, report  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flashop._launch import mla  # noqa: E402
from flashop._launch.options import PLAIN  # noqa: E402
from flashop.kernels import mla as kernels  # noqa: E402
from flashop.kernels.common import (  # noqa: E402
    attention_scores, dot_operand, load_tile, round_to,
)
from flashop.kernels.decode_steps import key_tile, pv_step, softmax_step  # noqa: E402


@triton.jit
def _mla_key_tiles_region(
    acc, l_i, m_i, b_q, b_qr, k_cache, v_cache, block_table, o_i, m_r, start, end, L_read, L,
    S_q, stride_kcb, stride_kcs, stride_vcb, stride_vcs, qk_scale, DV: tl.constexpr,
    D_ROPE: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    IS_PAGED: tl.constexpr, TILE_PAGE: tl.constexpr, EDGE_TILE: tl.constexpr,
    IS_CAUSAL: tl.constexpr, V_IN_K: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """kernels.mla._mla_key_tiles with the scores and softmax in an ``if`` region."""
    o_dv = tl.arange(0, DV)
    o_dr = DV + tl.arange(0, D_ROPE)
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        o_n, m_n, o_kn, o_vn = key_tile(
            block_table, start_n, L_read, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
            BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, IS_PAGED=IS_PAGED, TILE_PAGE=TILE_PAGE,
            EDGE_TILE=EDGE_TILE)
        b_k = load_tile(k_cache + o_kn[:, None] + o_dv[None, :], m_n[:, None], None,
                        EDGE_TILE, False)
        b_kr = load_tile(k_cache + o_kn[:, None] + o_dr[None, :], m_n[:, None], None,
                         EDGE_TILE, False)
        b_kl = dot_operand(b_k, UPCAST)
        # (regions that are always entered: each hides a product from the next one, whose
        # input it is, when Triton picks its warps; the latent product's result is the
        # rotary one's accumulator, so it takes a region of its own)
        if start_n < end:
            b_lat = tl.dot(b_q, tl.trans(b_kl), input_precision=DOT_PRECISION)
        else:
            b_lat = tl.zeros([b_q.shape[0], BLOCK_N], dtype=tl.float32)
        if start_n >= start:  # (another condition: two ifs of one condition are merged)
            b_qk = tl.dot(b_qr, tl.trans(dot_operand(b_kr, UPCAST)), b_lat,
                          input_precision=DOT_PRECISION)
            b_s, _ = attention_scores(
                b_qk, qk_scale, o_i[:, None], o_n[None, :], m_r[:, None], m_n[None, :], S_q,
                L, left=0, right=0, chunk=0, softcap_log2=0.0, alibi_log2=0.0, b_gk=0.0,
                p_attn_mask=k_cache, stride_amq=0, stride_amk=0, EDGE_TILE=EDGE_TILE,
                HAS_LEFT=False, HAS_RIGHT=IS_CAUSAL, HAS_CHUNK=False, HAS_SOFTCAP=False,
                HAS_ALIBI=False, HAS_GATE=False, ATTN_MASK_KIND=0, SCALED=True)
            b_p, alpha, l_new, m_new = softmax_step(b_s, m_i, l_i, EDGE_TILE=EDGE_TILE)
            b_pk = round_to(b_p, b_k.dtype)
        else:
            b_pk = tl.zeros([b_q.shape[0], BLOCK_N], dtype=b_k.dtype)
            alpha = tl.full([b_q.shape[0]], 1.0, dtype=tl.float32)
            l_new = l_i
            m_new = m_i
        l_i, m_i = l_new, m_new
        if V_IN_K:  # the values: the same latent block
            b_v = b_kl
        else:  # [BLOCK_N, DV]
            b_v = load_tile(v_cache + o_vn[:, None] + o_dv[None, :], m_n[:, None], None,
                            EDGE_TILE, False)
        acc = pv_step(acc, alpha, b_pk, b_v, UPCAST=UPCAST, DOT_PRECISION=DOT_PRECISION)
    return acc, l_i, m_i


def _variant_kernel():
    """mla_decode_kernel calling _mla_key_tiles_region (the same code, other globals)."""
    fn = kernels.mla_decode_kernel.fn
    scope = dict(fn.__globals__, _mla_key_tiles=_mla_key_tiles_region)
    variant = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__)
    variant.__annotations__ = fn.__annotations__  # (its constexpr parameters)
    return triton.jit(variant)


def launches():
    """(label, kwargs, grid) of the MLA launcher's attention launches at H = 128."""
    bf16, B, L = torch.bfloat16, 4, 4096
    for paged, S_q in ((False, 1), (True, 1), (True, 2)):
        shape = (B * L // 64, 64, 1, 576) if paged else (B, L, 1, 576)
        k_cache = torch.empty(shape, dtype=bf16)
        table = torch.zeros(B, L // 64, dtype=torch.int32) if paged else None
        q = torch.empty(B, S_q, 128, 576, dtype=bf16)
        lens = torch.full((B,), L, dtype=torch.int32)
        args = (q, k_cache, k_cache[..., :512], None, None, lens, None, table, None,
                PLAIN[S_q > 1], 0, None)
        caught = C.catch_launches(lambda a=args: mla.attention_with_latent_cache(*a))
        for kernel, grid, kwargs in caught:
            if kernel is kernels.mla_decode_kernel:
                yield f"{'paged' if paged else 'dense'} S_q={S_q}", kwargs, grid


def check() -> int:
    """test_mla's cases (CPU, interpreter) with the variant in the package's place."""
    import test_mla
    kernels._mla_key_tiles = _mla_key_tiles_region  # (the interpreter looks it up per call)
    failed = 0
    for name, case in test_mla.CASES.items():
        try:
            test_mla.check_mla_case(case)
            print(f"PASS {name}")
        except AssertionError as e:
            failed += 1
            print(f"FAIL {name}: {str(e)[:200]}")
    return failed


def time_on_gpu(which: str) -> int:
    """The `tl` kernel (``which``: "package" or "region") checked, then timed."""
    import test_mla

    import flashop
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from decode import time_us
    if which == "region":
        kernels._mla_key_tiles = _mla_key_tiles_region  # (before its first compile)
    flashop.config.settings.gluon = False
    test_mla.check_mla_case(test_mla.MlaCase(
        (0, 1000, 4091, 4094), 2, 2, 128, paged=True, page=64, capacity=4096,
        scale=0.1352, new_values="view"))
    print(f"{which}: the 128-head case within the rule")
    for B, H, L, S_q in ((32, 128, 8192, 1), (128, 128, 4096, 1), (64, 128, 8192, 2)):
        q = torch.randn(B, S_q, H, 576, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((B,), L, device="cuda", dtype=torch.int32)
        dense = torch.randn(B, L, 1, 576, device="cuda", dtype=torch.bfloat16)
        pages = dense.view(B * L // 64, 64, 1, 576)
        table = torch.randperm(B * L // 64, device="cuda").view(B, -1).int()
        flops = 2 * S_q * H * L * 1088 * B
        row = f"{which} B={B} H={H} L={L} S_q={S_q}:"
        for name, cache, extra in (("dense", dense, {}), ("paged", pages,
                                                          {"block_table": table})):
            us = time_us(lambda: flashop.attention_with_kvcache(
                q, cache, cache[..., :512], cache_seqlens=lens, scale=0.1352,
                causal=S_q > 1, **extra), True)
            row += f"  {name} {us:.0f} us {flops / us / 1e6:.0f} TFLOP/s"
        print(row, flush=True)
    return 0


def main() -> int:
    if CHECK:
        return check()
    if TIME is not None:
        return time_on_gpu(TIME)
    failed = 0
    variant = _variant_kernel()
    for label, kwargs, grid in launches():
        for name, kernel in (("package", kernels.mla_decode_kernel), ("region", variant)):
            res = compile_kernel(kernel, grid, kwargs, label=f"{label} {name}")
            failed += not report(res)
            if res.ok:
                ttgir = res.compiled.asm["ttgir"]
                layouts = sorted(set(re.findall(r"warpsPerCTA = \[(\d+, \d+)\], instrShape = "
                                                r"\[(\d+, \d+, \d+)\]", ttgir)))
                wgmmas = collections.Counter(re.findall(
                    r"wgmma.mma_async.sync.aligned.(m64n\d+k16)", res.compiled.asm["ptx"]))
                print(f"    mma layouts {layouts}; wgmmas {dict(wgmmas)}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
