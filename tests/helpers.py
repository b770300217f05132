"""Shared test helpers: inputs, output poisoning, and the accuracy check."""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, replace
from typing import Optional

import pytest
import torch
from hypothesis import strategies as st

import flashop
from flashop.testing import accuracy, check_attention, differentiable_inputs

DEVICE = "cpu" if flashop.INTERPRETING else "cuda"

try:
    from expecttest import TestCase
except ImportError:  # not installed everywhere (the GPU machine): the messages as written
    import unittest

    class TestCase(unittest.TestCase):
        def assertExpectedInline(self, actual, expect, skip=0):
            self.assertEqual(actual, expect)


def error_message(fn, *args, **kwargs) -> str:
    """The message of the ValueError or RuntimeError that ``fn(*args, **kwargs)`` raises
    (failing where it raises none), with the test device written as DEVICE."""
    with pytest.raises((ValueError, RuntimeError)) as info:
        fn(*args, **kwargs)
    return str(info.value).replace(str(torch.empty(0, device=DEVICE).device), "DEVICE")


def slow_property_examples(interpreter_share: float = 1.0) -> int:
    """Examples for the slowest property tests (every modifier, with sinks or dropout): half
    the profile's on a GPU, ``interpreter_share`` of them under the interpreter."""
    from hypothesis import settings

    share = 0.5 if DEVICE == "cuda" else interpreter_share
    return max(round(settings.default.max_examples * share), 1)


def _interpreter_tiles(kind: str):
    from flashop._launch import decode_tiles, tiles

    if kind == "decode":
        return decode_tiles.decode_tiles(1, 16, 16, torch.float16, 0)
    return tiles.tiles_for(kind, 16, torch.float16, torch.device(DEVICE))


# The interpreter's tiles, as its launchers choose them: the forward and dQ take 16 keys at a
# time (in programs of 32 queries), dK/dV 32 keys a program and 16 queries at a time, the
# decode kernel 16 keys at a time (flashop/_launch/tiles.py, flashop/_launch/kvcache.py)
if DEVICE == "cpu":
    (FWD_QUERIES, FWD_KEYS), (DKDV_QUERIES, DKDV_KEYS) = (
        (t.BLOCK_M, t.BLOCK_N) for t in map(_interpreter_tiles, ("fwd", "dkdv")))
    DECODE_KEYS = _interpreter_tiles("decode").BLOCK_N
else:
    FWD_QUERIES, FWD_KEYS, DKDV_KEYS, DKDV_QUERIES, DECODE_KEYS = 32, 16, 32, 16, 16
# Lengths past two tiles of every attention kernel, where a property test's draws spend
# most of their time (a GPU's tiles reach 128). Shorter lengths are drawn too, and
# @examples pin the edges.
TWO_QUERY_TILES = DKDV_QUERIES + 1 if DEVICE == "cpu" else 129
TWO_KEY_TILES = DKDV_KEYS + 1 if DEVICE == "cpu" else 129


def tile_sizes() -> tuple:
    """Every tile size the launchers choose on the test device, smallest first: the attention
    kernels' BLOCK_M and BLOCK_N (and the forward's query tiles of BLOCK_M / 2) for every
    kind, head dim, dtype, bound and length class of the tile table, and the decode kernel's
    key tiles (BLOCK_N) for dense and paged caches."""
    from flashop._launch import decode_tiles, tiles
    from flashop._launch.common import max_shared_memory

    device = torch.device("cpu") if DEVICE == "cpu" else torch.device(
        "cuda", torch.cuda.current_device())
    sizes = set()
    head_dims = (16, 32, 64, 96, 128, 160, 192, 256)
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    for kind in ("fwd", "dq", "dkdv", "dkdv_atomic"):
        for D, dtype, causal, short, mask_grad in itertools.product(
                head_dims, dtypes, *[(False, True)] * 3):
            t = tiles.tiles_for(kind, D, dtype, device, mask_grad, causal, short)
            sizes |= {t.BLOCK_M, t.BLOCK_N}
            if t.split_m:  # two query tiles of BLOCK_M / 2 per program
                sizes.add(t.BLOCK_M // 2)
    for rows, D, dtype, page in itertools.product((1, 8, 64), head_dims, dtypes, (0, 16, 64)):
        t = decode_tiles.decode_tiles(rows, D, D, dtype, page)
        if DEVICE == "cuda":
            t = decode_tiles.fit_shared_memory(t, D, D, dtype.itemsize,
                                               max_shared_memory(device.index))
        sizes.add(t.BLOCK_N)
    return tuple(sorted(sizes))


TILES = tile_sizes()


def _near_multiples(most: int, sizes, spread: int, zero: bool = False) -> set:
    """n * size + d for the sizes, n >= 1 (n >= 0 where ``zero``) and |d| <= spread, up to
    ``most``."""
    return {n * t + d for t in sizes for n in range(0 if zero else 1, most // t + 2)
            for d in range(-spread, spread + 1) if n * t + d <= most}


def _sampled(values):
    values = sorted(values)
    return st.sampled_from(values) if values else st.nothing()


def tile_edges(least: int, most: int, sizes=TILES):
    """Lengths in [least, most] at a multiple of a tile size in use (``sizes``) or one either
    side: a sequence's queries or keys, a packed sequence's end, a cache's keys, a page's
    end."""
    return _sampled(n for n in _near_multiples(most, sizes, 1) if n >= least)


# The window's bounds and the causal offset S_k - S_q are drawn up to two either side of an
# edge: the kernels' ranges add one to them themselves (a tile's last row, the key past a
# bound), so that two reach one either side of every edge the kernels compute.

def edge_offset_keys(S_q: int, least: int, most: int, sizes=TILES):
    """Key counts in [least, most] whose causal offset S_k - S_q is a multiple of a tile size
    (0 included) or up to two either side, of either sign."""
    offsets = _near_multiples(most, sizes, 2, zero=True)
    return _sampled({S_q + s * o for o in offsets for s in (1, -1)} & set(range(least, most + 1)))


def left_bounds_at_edges(offset: int, most: int, least: int = 0, sizes=TILES):
    """Left window bounds in [least, most] that put the first key of a query tile (its first
    row + offset - left, the tile starting at a multiple of the tile sizes) at a tile edge or
    up to two either side: left - offset a multiple of a tile size (0 included) up to two
    off, of either sign."""
    near = _near_multiples(most + abs(offset), sizes, 2, zero=True)
    return _sampled({offset + s * n for n in near for s in (1, -1)}
                    & set(range(max(least, 0), most + 1)))


def right_bounds_at_edges(offset: int, most: int, sizes=TILES):
    """Right window bounds in [0, most] that put the last key of a query tile (its last row +
    offset + right) at a tile edge or up to two either side: right + offset a multiple of a
    tile size (0 included) up to two off."""
    near = _near_multiples(most + abs(offset), sizes, 2, zero=True)
    return _sampled({n - offset for n in near} & set(range(0, most + 1)))


# A modifier's dtype drawn as "the inputs' dtype": strategies draw a Case before the test's
# dtype is known (Case.in_dtype resolves it)
INPUTS = "the inputs' dtype"


def lengths(least: int, most: int, short=None):
    """Lengths from ``least`` (past the kernels' tiles) to ``most`` in about 31 draws of 32,
    half of them at a tile edge (tile_edges), ``short``'s (default: any from 1) in the others
    (Hypothesis repeats a draw's choices in the next ones: a short one often makes several)."""
    short = st.integers(1, most) if short is None else short
    long = st.one_of(tile_edges(least, most), st.integers(least, most))
    return st.integers(0, 31).flatmap(lambda i: short if i == 31 else long)


def window_bound(length: int):
    """One side of a window: -1 (no bound) or a bound past a key tile (up to a little past
    ``length``) in about 15 draws of 16, any from 0 in the others."""
    wide = st.one_of(st.just(-1), st.integers(FWD_KEYS, max(FWD_KEYS, length + 4)))
    return st.integers(0, 15).flatmap(lambda i: st.integers(0, length + 4) if i == 15 else wide)


def head_counts(draw, most_heads: int, groups=(1, 2, 3)) -> tuple[int, int, int]:
    """(B, H_kv, G) with B * H_kv * G <= ``most_heads`` (the interpreter's time grows with
    the programs, one per batch entry and head): group ratios, then KV heads, then batch."""
    G = draw(st.sampled_from([g for g in groups if g <= most_heads]))
    H_kv = draw(st.integers(1, max(1, min(2, most_heads // G))))
    B = draw(st.integers(1, max(1, min(2, most_heads // (G * H_kv)))))
    return B, H_kv, G


def input_scales(draw, D: int) -> dict:
    """A call's scale and input magnitudes: unit normals at the usual scales (the scores'
    standard deviation 0.1 to 2) in three draws of four; in the others, large scores as in
    real models: a scale up to 1, q and k of standard deviation up to 2 and a few keys 20-50x
    the others' norm (|score| of tens to thousands)."""
    if draw(st.integers(0, 3)):
        return dict(scale=draw(st.one_of(st.none(),
                                         st.floats(0.1, 2.0).map(lambda f: f / D ** 0.5))))
    return dict(scale=draw(st.floats(0.05, 1.0)), magnitude=draw(st.sampled_from([1.0, 2.0])),
                outlier_keys=draw(st.sampled_from([0, 2])))


@dataclass(frozen=True)
class Case:
    """One attention problem: q (B, S_q, H_kv * G, D), k (B, S_k, H_kv, D), v (.., DV)."""

    B: int
    S_q: int
    S_k: int
    H_kv: int
    G: int
    D: int
    DV: int
    dtype: torch.dtype
    causal: bool = False
    scale: Optional[float] = None
    layout: str = "contiguous"  # "contiguous" | "bhsd" (heads-major storage) | "padded"
    # score modifiers (docs/modifiers.md)
    window_size: tuple = (-1, -1)
    attention_chunk: int = 0
    softcap: float = 0.0
    alibi: Optional[tuple] = None  # shape of alibi_slopes: (H,) or (B, H)
    gate: Optional[torch.dtype] = None  # dtype of g (B, S_k, H)
    mask: Optional[torch.dtype] = None  # dtype of attn_mask: bool, or float (additive)
    mask_shape: Optional[tuple] = None  # broadcastable to (B, H, S_q, S_k)
    mask_keep: float = 0.7  # fraction of pairs a boolean mask keeps
    mask_grad: bool = False  # a float attn_mask requires grad
    sinks: Optional[torch.dtype] = None  # dtype of the attention sinks (H,), learned
    dq_atomics: bool = False  # the backward adds dQ by atomics (FLASHOP_DQ_ATOMICS=1)
    # inputs like real models' besides unit normals: q and k of a larger standard deviation
    # (scores of tens to hundreds), and keys 20-50x the others' norm
    magnitude: float = 1.0  # the standard deviation of q and k
    outlier_keys: int = 0  # such keys per batch entry and KV head

    @property
    def H(self) -> int:
        return self.H_kv * self.G

    def in_dtype(self, dtype: torch.dtype) -> "Case":
        """The case with inputs of ``dtype``, and its modifiers drawn as INPUTS in it too."""
        def resolve(d):
            return dtype if d is INPUTS else d

        return replace(self, dtype=dtype, gate=resolve(self.gate), mask=resolve(self.mask),
                       sinks=resolve(self.sinks))

    def options(self) -> dict:
        """Keyword options of flashop.attention."""
        return dict(causal=self.causal, scale=self.scale, window_size=self.window_size,
                    attention_chunk=self.attention_chunk, softcap=self.softcap)

    def op_options(self) -> dict:
        """Keyword options of the torch.ops.flashop operators (the window as two ints)."""
        return op_options(**self.options())


def op_options(window_size=(-1, -1), **options) -> dict:
    """The operators' keyword options of flashop.attention's (window_size as its two ints)."""
    left, right = window_size
    return dict(options, window_size_left=left, window_size_right=right)


def _strided_randn(shape, dtype, layout, generator):
    """A (B, S, H, D) tensor of random normals stored in the given layout."""
    B, S, H, D = shape
    if layout == "bhsd":
        return torch.randn(B, H, S, D, dtype=dtype, device=DEVICE, generator=generator
                           ).transpose(1, 2)
    if layout == "padded":
        return torch.randn(B, S, H + 1, D + 3, dtype=dtype, device=DEVICE, generator=generator
                           )[:, :, 1:, :D]
    return torch.randn(shape, dtype=dtype, device=DEVICE, generator=generator)


@st.composite
def gluon_cases(draw, dtype, head_dims=(128,)):
    """Plain calls the Gluon kernels take when forced (FLASHOP_GLUON=1): causal (S_q == S_k)
    or not, up to 700 queries and keys (tail tiles), GQA, two layouts, any positive scale;
    ``head_dims``: D (DV = D) or (D, DV) pairs."""
    causal = draw(st.booleans())
    S_k = draw(st.integers(1, 700))
    D = draw(st.sampled_from(head_dims))
    D, DV = D if isinstance(D, tuple) else (D, D)
    return Case(B=draw(st.integers(1, 2)), S_q=S_k if causal else draw(st.integers(1, 700)),
                S_k=S_k, H_kv=draw(st.integers(1, 2)), G=draw(st.sampled_from([1, 2, 3, 4])),
                D=D, DV=DV, dtype=dtype, causal=causal,
                scale=draw(st.one_of(st.none(), st.floats(0.1, 2.0).map(lambda f: f / D**0.5))),
                layout=draw(st.sampled_from(["contiguous", "bhsd"])))


def make_inputs(case: Case, seed: int = 0):
    """q, k, v (requiring grad) and the output cotangents dout, dlse."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = _strided_randn((case.B, case.S_q, case.H, case.D), case.dtype, case.layout, g)
    k = _strided_randn((case.B, case.S_k, case.H_kv, case.D), case.dtype, case.layout, g)
    v = _strided_randn((case.B, case.S_k, case.H_kv, case.DV), case.dtype, case.layout, g)
    dout = torch.randn(case.B, case.S_q, case.H, case.DV, dtype=case.dtype, device=DEVICE,
                       generator=g)
    dlse = torch.randn(case.B, case.H, case.S_q, dtype=torch.float32, device=DEVICE,
                       generator=g)
    with torch.no_grad():
        q.mul_(case.magnitude)
        k.mul_(case.magnitude)
        if case.outlier_keys and case.S_k:
            k.copy_(k.float() * key_norms(case, g))
    return [t.requires_grad_() for t in (q, k, v)], dout, dlse


def key_norms(case: Case, generator) -> torch.Tensor:
    """(B, S_k, H_kv, 1) fp32 factors of the keys: 1, and 20-50 for case.outlier_keys
    random keys of each batch entry and KV head."""
    B, S_k, H_kv, n = case.B, case.S_k, case.H_kv, min(case.outlier_keys, case.S_k)
    picked = torch.rand(B, S_k, H_kv, device=DEVICE, generator=generator).argsort(dim=1)[:, :n]
    factors = 20 + 30 * torch.rand(B, n, H_kv, device=DEVICE, generator=generator)
    return torch.ones(B, S_k, H_kv, device=DEVICE).scatter(1, picked, factors)[..., None]


def make_modifiers(case: Case, seed: int = 0) -> dict:
    """attn_mask, alibi_slopes, g and sinks of the case (None where it has none)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    mods = dict(attn_mask=None, alibi_slopes=None, g=None, sinks=None)
    if case.alibi is not None:
        # FlashAttention's slopes are 2^(-8h/H); any positive slopes will do here
        mods["alibi_slopes"] = torch.rand(case.alibi, device=DEVICE, generator=gen)
    if case.gate is not None:
        # log-decays as FLA's gates: logsigmoid of a normal, in (-inf, 0)
        g = torch.nn.functional.logsigmoid(
            2 + torch.randn(case.B, case.S_k, case.H, device=DEVICE, generator=gen))
        mods["g"] = g.to(case.gate).requires_grad_()
    if case.mask is torch.bool:
        mods["attn_mask"] = torch.rand(case.mask_shape, device=DEVICE,
                                       generator=gen) < case.mask_keep
    elif case.mask is not None:
        bias = torch.randn(case.mask_shape, device=DEVICE, generator=gen)
        # some pairs masked by -inf, as an additive SDPA mask may hold
        bias = bias.masked_fill(torch.rand(case.mask_shape, device=DEVICE, generator=gen)
                                > case.mask_keep, float("-inf"))
        mods["attn_mask"] = bias.to(case.mask).requires_grad_(case.mask_grad)
    if case.sinks is not None:
        # from far below the scores to far above (a sink that takes most of the mass)
        sinks = 4 * torch.randn(case.H, device=DEVICE, generator=gen)
        mods["sinks"] = sinks.to(case.sinks).requires_grad_()
    return mods


def make_packed(lens_q, lens_k, H_kv, G, D, dtype, seed=0, gate=None, alibi=None):
    """q, k, v (requiring grad), cu_seqlens, max lengths, g, slopes, dout, dlse."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    H = H_kv * G

    def cu(lens):
        return torch.tensor([0] + lens, device=DEVICE).cumsum(0).to(torch.int32)

    cu_q, cu_k = cu(lens_q), cu(lens_k)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, H, D, device=DEVICE, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(tk, H_kv, D, device=DEVICE, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(tk, H_kv, D, device=DEVICE, generator=gen).to(dtype).requires_grad_()
    g = None
    if gate is not None:
        g = torch.nn.functional.logsigmoid(
            2 + torch.randn(tk, H, device=DEVICE, generator=gen)).to(gate).requires_grad_()
    slopes = None if alibi is None else torch.rand(alibi, device=DEVICE, generator=gen)
    dout = torch.randn(tq, H, D, device=DEVICE, generator=gen).to(dtype)
    dlse = torch.randn(H, tq, device=DEVICE, generator=gen)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                max_seqlen_q=max(lens_q, default=0), max_seqlen_k=max(lens_k, default=0),
                alibi_slopes=slopes, g=g), dout, dlse


@contextlib.contextmanager
def replayed_launches(record):
    """Within the block, ``record(kernel, kwargs)`` sees every launch that an eager plan
    replays (flashop/_launch/plans.py): a repeated signature's launches skip
    launch_kernel, which the recording tests watch."""
    from unittest import mock

    from flashop._launch import plans

    launch = plans._PlannedLaunch.__call__

    def recorded(self, pool, stream=None):
        record(self.kernel, self.arguments(self.take(pool)))
        return launch(self, pool, stream)

    with mock.patch.object(plans._PlannedLaunch, "__call__", recorded):
        yield


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b hold the same bits (NaNs included)."""
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


def assert_outputs_within_rule(out, lse, ref, plain, dtype: torch.dtype) -> None:
    """out and lse under the accuracy rule (2x; flashop.testing) against the fp64
    reference's (out, lse) ``ref`` and plain PyTorch's ``plain`` in ``dtype``."""
    for name, actual, r, p in (("out", out, ref[0], plain[0]), ("lse", lse, ref[1], plain[1])):
        result = accuracy(name, actual, r, p, 2, dtype)
        assert result.ok, str(result)


def cuda_graph(step):
    """``step()`` captured in a CUDA graph: (the graph, the captured call's outputs). A first
    call on a side stream compiles the kernels, as capture requires (what the step writes
    in place, it writes once more there)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


# The CPU path's twins of tests that make their tensors on DEVICE: on a GPU those are CUDA
# tensors, which the CPU path never takes (there tests/test_cpu.py checks CPU tensors)
CPU_PATH_TWIN = pytest.mark.skipif(DEVICE != "cpu", reason="the test's tensors are on a GPU")


@contextlib.contextmanager
def cpu_path(tile_elements: int = 512, sdpa: bool = True):
    """Within the block CPU tensors run the CPU path (flashop/_launch/cpu; the switch
    ``cpu_path`` under the interpreter), its tiles 16 keys wide and its parts of
    ``tile_elements`` scores, so that short test sequences span several tiles and parts.
    ``sdpa`` False: the blocked path takes the calls SDPA's kernels would take too. torch
    runs one thread meanwhile: the test run takes a core per worker, and a second OpenMP
    thread waiting for a busy core made each of the path's small operations cost
    milliseconds."""
    from unittest import mock

    from flashop._launch.cpu import attention, bounds

    threads = torch.get_num_threads()
    with contextlib.ExitStack() as stack:
        torch.set_num_threads(1)
        stack.callback(torch.set_num_threads, threads)
        stack.enter_context(flashop.config.override(cpu_path=True))
        stack.enter_context(mock.patch.object(bounds, "TILE_ELEMENTS", tile_elements))
        stack.enter_context(mock.patch.object(bounds, "KEY_TILE", 16))
        if not sdpa:
            stack.enter_context(mock.patch.object(attention, "sdpa_serves",
                                                  lambda *args: False))
        yield


@contextlib.contextmanager
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) within this block (flashop's backward then
    never adds dQ by atomics)."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@contextlib.contextmanager
def poisoned_outputs(deterministic_backward: bool = True):
    """Within this block torch.empty fills floating-point memory with NaN, so an element a
    kernel fails to write shows up as NaN (torch.utils.deterministic.fill_uninitialized_memory,
    which needs deterministic algorithms on). flashop's backward takes its default dQ kernel
    unless ``deterministic_backward`` is False: then dQ by atomics wherever the kernels allow
    (FLASHOP_DQ_ATOMICS=1)."""
    fill = torch.utils.deterministic.fill_uninitialized_memory
    # the poisoning needs deterministic algorithms on, under which the launcher never takes
    # the atomics: its choice is replaced for the block
    choice = flashop._launch.choice.deterministic_backward
    flashop._launch.choice.deterministic_backward = lambda requested=False: (
        requested or deterministic_backward)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with deterministic_algorithms(), flashop.config.override(
                dq_atomics=None if deterministic_backward else True):
            yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        flashop._launch.choice.deterministic_backward = choice


def run_flashop(case: Case, inputs, dout, dlse, mods=None, deterministic_backward=True):
    """out, lse and the gradients of differentiable_inputs (dq, dk, dv[, dg][, dattn_mask])
    from flashop, with poisoned output memory."""
    mods = mods or {}
    with poisoned_outputs(deterministic_backward):
        out, lse = flashop.attention_with_lse(*inputs, **mods, **case.options())
        wrt = differentiable_inputs(*inputs, mods.get("attn_mask"), mods.get("g"),
                                    mods.get("sinks"))
        grads = torch.autograd.grad((out, lse), tuple(wrt.values()), (dout, dlse))
    return out, lse, grads


def check_case(case: Case, seed: int = 0, deterministic_backward: bool = True):
    """Run flashop (outputs poisoned) and apply the accuracy rule (flashop.testing) to out,
    lse (2x) and every gradient (3x) against the fp64 reference and plain PyTorch in
    case.dtype. The backward adds dQ by atomics where ``deterministic_backward`` is False
    or ``case.dq_atomics``."""
    inputs, dout, dlse = make_inputs(case, seed)
    mods = make_modifiers(case, seed)
    deterministic_backward = deterministic_backward and not case.dq_atomics
    out, lse, grads = run_flashop(case, inputs, dout, dlse, mods, deterministic_backward)
    assert out.dtype == case.dtype and lse.dtype == torch.float32
    wrt = differentiable_inputs(*inputs, mods["attn_mask"], mods["g"], mods["sinks"])
    assert all(g.dtype == x.dtype for g, x in zip(grads, wrt.values()))
    for result in check_attention(*inputs, dout, dlse, out, lse, grads, **mods,
                                  **case.options()):
        assert result.ok, str(result)
