"""The `tl` MLA decode kernel with its inner key tiles (not a run's edge tile) loaded through
tensor descriptors made in the kernel (TMA), where the values are the keys' leading dims and
the cache is dense or a tile lies in one page (performance notes, entry 149). The package
took it since (entry 151: flashop/kernels/mla.py's ``TMA``); the variant and the offline
compiles below substitute the package's key-tile loop as it was at commit 09c233e, so run
them there (``--time package`` runs on the current package, FLASHOP_TMA as set).

From the repository root: compiled for sm_90 on a machine without a GPU (a CPU torch,
triton 3.6.0 or newer), the package's kernel and the variant at the MLA launcher's H = 128
and H = 16 launches, each's shared memory, registers and spills:

    PYTHONPATH=. python docs/notes/experiments/tl_mla_descriptors.py
    PYTHONPATH=. python docs/notes/experiments/tl_mla_descriptors.py --ws

(``--ws``: the variant's loop as ``tl.range(..., warp_specialize=True)`` where it reads
through descriptors; each compile prints whether the TTGIR holds a warp_specialize op.)

On a Hopper GPU, one process per kernel (a kernel's compiled form is keyed once): checked
against the reference at four cases of tests/test_mla.py, then timed (CUDA-graph replays,
FLASHOP_GLUON off) at the MLA protocol's points and 32 heads x 2 queries:

    PYTHONPATH=. python docs/notes/experiments/tl_mla_descriptors.py --time package
    PYTHONPATH=. python docs/notes/experiments/tl_mla_descriptors.py --time variant
"""

import os, sys, types
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "tests")); sys.path.insert(0, ROOT)
TIME = sys.argv[sys.argv.index("--time") + 1] if "--time" in sys.argv else None
if TIME is None and not os.environ.get("TRITON_INTERPRET"):
    import compile_for_hopper as C  # noqa
    from compile_sm90 import compile_kernel, report  # noqa
import torch, triton, triton.language as tl  # noqa

WS = tl.constexpr("--ws" in sys.argv)
from flashop._launch import mla
from flashop._launch.options import PLAIN
from flashop.kernels import mla as kernels
from flashop.kernels.common import dot_operand, load_tile
from flashop.kernels.decode_steps import key_tile, pv_step


@triton.jit
def _tiles_desc(
    acc, l_i, m_i, b_q, b_qr, k_cache, v_cache, block_table, o_i, m_r, start, end, L_read, L,
    S_q, stride_kcb, stride_kcs, stride_vcb, stride_vcs, qk_scale, DV: tl.constexpr,
    D_ROPE: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    IS_PAGED: tl.constexpr, TILE_PAGE: tl.constexpr, EDGE_TILE: tl.constexpr,
    IS_CAUSAL: tl.constexpr, V_IN_K: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """kernels.mla._mla_key_tiles with inner tiles through descriptors (``DESC``): dense, a
    descriptor of the sequence's rows; paged (a tile in one page), one of [pages, page rows,
    dims] with a bound on pages no inner tile reaches."""
    o_dv = tl.arange(0, DV)
    o_dr = DV + tl.arange(0, D_ROPE)
    DESC: tl.constexpr = (not EDGE_TILE) and V_IN_K and ((not IS_PAGED) or TILE_PAGE)
    if DESC:
        if IS_PAGED:
            k_lat = tl.make_tensor_descriptor(k_cache, shape=[2**30, PAGE_SIZE, DV],
                                              strides=[stride_kcb, stride_kcs, 1],
                                              block_shape=[1, BLOCK_N, DV])
            k_rot = tl.make_tensor_descriptor(k_cache + DV, shape=[2**30, PAGE_SIZE, D_ROPE],
                                              strides=[stride_kcb, stride_kcs, 1],
                                              block_shape=[1, BLOCK_N, D_ROPE])
        else:
            n = tl.maximum(L_read, 1)
            k_lat = tl.make_tensor_descriptor(k_cache, shape=[n, DV], strides=[stride_kcs, 1],
                                              block_shape=[BLOCK_N, DV])
            k_rot = tl.make_tensor_descriptor(k_cache + DV, shape=[n, D_ROPE],
                                              strides=[stride_kcs, 1],
                                              block_shape=[BLOCK_N, D_ROPE])
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WS and DESC):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        o_n, m_n, o_kn, o_vn = key_tile(
            block_table, start_n, L_read, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
            BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, IS_PAGED=IS_PAGED, TILE_PAGE=TILE_PAGE,
            EDGE_TILE=EDGE_TILE)
        if DESC:
            if IS_PAGED:
                i_page = tl.load(block_table + start_n // PAGE_SIZE).to(tl.int32)
                row = (start_n % PAGE_SIZE).to(tl.int32)
                b_k = k_lat.load([i_page, row, 0]).reshape(BLOCK_N, DV)
                b_kr = k_rot.load([i_page, row, 0]).reshape(BLOCK_N, D_ROPE)
            else:
                b_k = k_lat.load([start_n.to(tl.int32), 0])
                b_kr = k_rot.load([start_n.to(tl.int32), 0])
        else:
            b_k = load_tile(k_cache + o_kn[:, None] + o_dv[None, :], m_n[:, None], None,
                            EDGE_TILE, False)
            b_kr = load_tile(k_cache + o_kn[:, None] + o_dr[None, :], m_n[:, None], None,
                             EDGE_TILE, False)
        b_kl = dot_operand(b_k, UPCAST)
        if b_q.shape[0] >= 64:
            if start_n < end:
                b_lat = tl.dot(b_q, tl.trans(b_kl), input_precision=DOT_PRECISION)
            else:
                b_lat = tl.zeros([b_q.shape[0], BLOCK_N], dtype=tl.float32)
            if start_n >= start:
                b_pk, alpha, l_new, m_new = kernels._tile_probs(
                    b_lat, b_qr, b_kr, m_i, l_i, o_i, m_r, o_n, m_n, S_q, L, qk_scale,
                    k_cache, EDGE_TILE=EDGE_TILE, IS_CAUSAL=IS_CAUSAL, UPCAST=UPCAST,
                    DOT_PRECISION=DOT_PRECISION)
            else:
                b_pk = tl.zeros([b_q.shape[0], BLOCK_N], dtype=b_k.dtype)
                alpha = tl.full([b_q.shape[0]], 1.0, dtype=tl.float32)
                l_new = l_i
                m_new = m_i
        else:
            b_lat = tl.dot(b_q, tl.trans(b_kl), input_precision=DOT_PRECISION)
            b_pk, alpha, l_new, m_new = kernels._tile_probs(
                b_lat, b_qr, b_kr, m_i, l_i, o_i, m_r, o_n, m_n, S_q, L, qk_scale, k_cache,
                EDGE_TILE=EDGE_TILE, IS_CAUSAL=IS_CAUSAL, UPCAST=UPCAST,
                DOT_PRECISION=DOT_PRECISION)
        l_i, m_i = l_new, m_new
        if V_IN_K:
            b_v = b_kl
        else:
            b_v = load_tile(v_cache + o_vn[:, None] + o_dv[None, :], m_n[:, None], None,
                            EDGE_TILE, False)
        acc = pv_step(acc, alpha, b_pk, b_v, UPCAST=UPCAST, DOT_PRECISION=DOT_PRECISION)
    return acc, l_i, m_i


def variant_kernel():
    """mla_decode_kernel calling _tiles_desc (the same code, other globals)."""
    fn = kernels.mla_decode_kernel.fn
    scope = dict(fn.__globals__, _mla_key_tiles=_tiles_desc)
    v = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__)
    v.__annotations__ = fn.__annotations__
    return triton.jit(v)


def launches(H=128):
    """(label, kwargs, grid) of the MLA launcher's attention launches at H heads."""
    bf16, B, L = torch.bfloat16, 4, 4096
    for paged, S_q in ((False, 1), (True, 1), (True, 2)):
        shape = (B * L // 64, 64, 1, 576) if paged else (B, L, 1, 576)
        k_cache = torch.empty(shape, dtype=bf16)
        table = torch.zeros(B, L // 64, dtype=torch.int32) if paged else None
        q = torch.empty(B, S_q, H, 576, dtype=bf16)
        lens = torch.full((B,), L, dtype=torch.int32)
        args = (q, k_cache, k_cache[..., :512], None, None, lens, None, table, None,
                PLAIN[S_q > 1], 0, None)
        for kernel, grid, kwargs in C.catch_launches(lambda a=args: mla.attention_with_latent_cache(*a)):
            if kernel is kernels.mla_decode_kernel:
                yield f"H={H} {'paged' if paged else 'dense'} S_q={S_q}", kwargs, grid


def time_on_gpu(which):
    """The package's kernel or the variant (``which``), checked, then timed."""
    import test_mla
    import flashop
    from flashop._launch.common import ensure_triton_allocator
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from decode import time_us
    ensure_triton_allocator()
    if which == "variant":
        kernels._mla_key_tiles = _tiles_desc
    flashop.config.settings.gluon = False
    for case in (test_mla.MlaCase((0, 1000, 4091, 4094), 2, 2, 128, paged=True, page=64,
                                  capacity=4096, scale=0.1352, new_values="view"),
                 test_mla.MlaCase((0, 63, 700, 2040), 1, 1, 128, capacity=2048, num_splits=3),
                 test_mla.MlaCase((5, 300, 1000), 2, 2, 16, paged=True, page=64, capacity=1024),
                 test_mla.MlaCase((5, 300, 1000), 1, 1, 16, capacity=1024)):
        test_mla.check_mla_case(case)
    print(f"{which}: cases within the rule", flush=True)
    for B, H, L, S_q in ((32, 16, 8192, 1), (128, 16, 4096, 1), (32, 128, 8192, 1),
                         (128, 128, 4096, 1), (64, 128, 8192, 2), (64, 32, 8192, 2)):
        q = torch.randn(B, S_q, H, 576, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((B,), L, device="cuda", dtype=torch.int32)
        dense = torch.randn(B, L, 1, 576, device="cuda", dtype=torch.bfloat16)
        pages = dense.view(B * L // 64, 64, 1, 576)
        table = torch.randperm(B * L // 64, device="cuda").view(B, -1).int()
        flops = 2 * S_q * H * L * 1088 * B
        gb = B * L * 576 * 2
        row = f"{which} B={B} H={H} L={L} S_q={S_q}:"
        for name, cache, extra in (("dense", dense, {}), ("p64", pages, {"block_table": table})):
            us = time_us(lambda: flashop.attention_with_kvcache(
                q, cache, cache[..., :512], cache_seqlens=lens, scale=0.1352,
                causal=S_q > 1, **extra), True)
            row += f"  {name} {us:.0f} us {flops / us / 1e6:.0f} TF {gb / us / 1e3:.0f} GB/s"
        print(row, flush=True)


if __name__ == "__main__":
    if TIME:
        sys.exit(time_on_gpu(TIME))
    variant = variant_kernel()
    for H in (128, 16):
        for label, kwargs, grid in launches(H):
            report(compile_kernel(kernels.mla_decode_kernel, grid, kwargs, label=f"package {label}"))
            res = compile_kernel(variant, grid, kwargs, label=f"desc {label}")
            report(res)
            if res.ok and WS:
                print("    warp_specialize ops in the TTGIR:",
                      res.compiled.asm["ttgir"].count("ttg.warp_specialize"))
