"""Chunked attention (``attention_chunk``, FlashAttention-3's; Llama 4's local layers): query i
at position p = i + S_k - S_q attends only the keys j with j // C == p // C, within the
window and causal bounds. Dense, packed, paged-prefill and decoding calls against the fp64
reference with every other modifier, forward and backward; the chunk's edges; the kernels
that decline chunks; errors; operators, fakes and compiled graphs. (The tile ranges that
skip the tiles outside the chunks: tests/test_tile_ranges.py.)"""

import contextlib
import dataclasses

import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from torch.library import opcheck

import flashop
from flashop._launch.problem import PLAIN_FLAGS
from flashop._launch import attention as launch
from flashop._launch import tiles
from flashop._launch.options import modifiers
from flashop._launch.tiles import Tiles
from flashop.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from flashop.reference import (
    attention_varlen_reference, attention_with_kvcache_reference, keys_in_bounds,
)
from flashop.testing import (
    accuracy, check_attention, check_attention_varlen, differentiable_inputs, dropout_mask,
)
from helpers import (
    CPU_PATH_TWIN, DEVICE, DKDV_KEYS, DKDV_QUERIES, FWD_KEYS, FWD_QUERIES, INPUTS, Case,
    TestCase, check_case, cpu_path, error_message, head_counts, input_scales, lengths,
    make_inputs, make_modifiers, poisoned_outputs, window_bound,
)

ON_GPU = DEVICE == "cuda"
MAX_SEQ = 300 if ON_GPU else 64
# where the tests' tensors are CPU ones, each call also through the CPU path (its twins)
PATHS = ["kernels"] if ON_GPU else ["kernels", "cpu-path"]


def on(path: str):
    """The block's calls through the kernels, or through the CPU path (tiles of 16 keys)."""
    return cpu_path() if path == "cpu-path" else contextlib.nullcontext()

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# the interpreter's tile sizes, one either side of them, and 1 (DECODE_KEYS is FWD_KEYS)
TILE_EDGES = sorted({1, *(n + d for n in (FWD_QUERIES, FWD_KEYS, DKDV_KEYS, DKDV_QUERIES)
                          for d in (-1, 0, 1))})


def chunks(longest: int):
    """A chunk length: at or one either side of a tile size (the chunks' edges on and off the
    tiles' edges), or any up to a little past ``longest`` (one chunk for every key)."""
    return st.one_of(st.sampled_from(TILE_EDGES), st.integers(1, longest + 8))


@st.composite
def chunked_cases(draw, most_heads=3 if not ON_GPU else 8, most_seq=MAX_SEQ):
    """A chunked call (its dtype Case.in_dtype's) with random other modifiers: causal or not
    (then the chunk is two-sided), a window, softcap, ALiBi, the gate (causal), an
    attn_mask, sinks, grouped-query heads, S_q != S_k, large scores."""
    B, H_kv, G = head_counts(draw, most_heads, groups=(1, 2))
    S_q = draw(lengths(DKDV_QUERIES + 1, most_seq))
    S_k = draw(lengths(DKDV_KEYS + 1, most_seq))
    H = H_kv * G
    D = draw(st.sampled_from([8, 16, 24] if not ON_GPU else [16, 64, 128]))
    causal = draw(st.booleans())
    mask = draw(st.sampled_from([None, None, torch.bool, torch.float32]))
    return Case(
        B=B, S_q=S_q, S_k=S_k, H_kv=H_kv, G=G, D=D, DV=draw(st.sampled_from([D, 16])),
        dtype=None, causal=causal,
        window_size=(draw(window_bound(S_k)),
                     draw(st.sampled_from([-1, 0])) if causal else draw(window_bound(S_k))),
        attention_chunk=draw(chunks(max(S_q, S_k))),
        softcap=draw(st.sampled_from([0.0, 0.0, 3.0])),
        alibi=draw(st.sampled_from([None, (H,), (B, H)])),
        gate=draw(st.sampled_from([None, torch.float32, INPUTS])) if causal else None,
        mask=mask, mask_shape=None if mask is None else (1, H, S_q, S_k),
        mask_grad=mask is torch.float32 and draw(st.booleans()),
        sinks=draw(st.sampled_from([None, torch.float32, INPUTS])),
        **input_scales(draw, D),
    )


@pytest.mark.parametrize("dtype", DTYPES)  # one test per dtype: they run in parallel
@given(case=chunked_cases(), seed=st.integers(0, 2**16))
@example(case=Case(B=1, S_q=50, S_k=50, H_kv=1, G=2, D=16, DV=16, dtype=None, causal=True,
                   attention_chunk=16), seed=0)
@example(case=Case(B=2, S_q=45, S_k=60, H_kv=2, G=1, D=8, DV=8, dtype=None,
                   attention_chunk=17, window_size=(5, 3)), seed=0)
def test_chunked_matches_reference(dtype, case, seed):
    """out, lse and every gradient (dq, dk, dv, dg, dattn_mask, dsinks) under the accuracy
    rule, outputs poisoned."""
    check_case(case.in_dtype(dtype), seed)


@CPU_PATH_TWIN
@pytest.mark.parametrize("dtype", DTYPES)
@given(case=chunked_cases(), seed=st.integers(0, 2**16))
def test_cpu_path_chunked_matches_reference(dtype, case, seed):
    """The CPU path on the same draws (its bounds: cpu/bounds.py)."""
    with cpu_path():
        check_case(case.in_dtype(dtype), seed)


def _case(S_q, S_k, C, causal=True, **changes):
    case = Case(B=1, S_q=S_q, S_k=S_k, H_kv=1, G=2, D=16, DV=16, dtype=torch.float16,
                causal=causal, attention_chunk=C)
    return dataclasses.replace(case, **changes)


EDGE_CASES = {
    "one-key-chunks": _case(40, 40, 1),
    "one-key-chunks-two-sided": _case(40, 40, 1, causal=False),
    "chunk-past-the-keys": _case(40, 50, 70),
    "chunk-past-the-keys-two-sided": _case(40, 50, 70, causal=False),
    "chunks-on-tile-edges": _case(96, 96, 32),
    "chunks-of-a-query-tile-on-key-tiles": _case(96, 96, FWD_QUERIES, causal=False),
    "chunks-off-tile-edges": _case(70, 90, 23, causal=False),
    "queries-before-key-0": _case(70, 30, 12, causal=False),  # rows 0..39 attend nothing
    "fewer-queries": _case(9, 77, 20),
    "with-a-window": _case(80, 80, 33, window_size=(10, -1)),
    "with-a-two-sided-window": _case(80, 64, 20, causal=False, window_size=(6, 4)),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", EDGE_CASES.values(), ids=EDGE_CASES.keys())
def test_chunk_edges(case, path):
    with on(path):
        check_case(case)


def test_causal_chunks_attend_their_chunk_up_to_the_query():
    """The reference's bounds: causal chunks are (p // C) * C <= j <= p; without causal the
    whole chunk; queries before key 0 (S_q > S_k) attend nothing."""
    keep = keys_in_bounds(6, 6, True, (-1, -1), attention_chunk=4)
    assert keep.int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                                   [1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1]]
    keep = keys_in_bounds(3, 6, False, (-1, -1), attention_chunk=4)
    assert keep.int().tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1]]
    keep = keys_in_bounds(4, 2, False, (-1, -1), attention_chunk=4)
    assert keep.int().tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]


def test_split_query_tiles_descriptors_and_dq_by_atomics():
    """The forward's split query tile (Tiles.split_m: two tiles whose second alone runs the
    keys past the first's), its key tiles through tensor descriptors (FLASHOP_TMA=1), and
    the backward adding dQ by atomics in the dK/dV kernel."""
    split = Tiles(128, 32, 4, 2, split_m=True) if ON_GPU else Tiles(32, 16, split_m=True)
    case = _case(90, 90, 20, alibi=(2,))
    with tiles.force("fwd", split):
        check_case(case)
        check_case(dataclasses.replace(case, causal=False, attention_chunk=9))
    with flashop.config.override(tma=True):
        check_case(dataclasses.replace(case, S_q=50, attention_chunk=33))
    check_case(case, deterministic_backward=False)


@pytest.mark.parametrize("chunk", [7, 32])
def test_dropout_with_its_mask(chunk):
    """Dropout at a fixed seed against the reference given the kernels' mask."""
    case = _case(60, 60, chunk, causal=chunk == 7, sinks=torch.float32, alibi=(2,))
    inputs, dout, dlse = make_inputs(case)
    mods = make_modifiers(case)
    seed = torch.tensor([1234], dtype=torch.int64, device=DEVICE)
    with poisoned_outputs():
        out, lse, _ = torch.ops.flashop.attention_forward(
            *inputs, alibi_slopes=mods["alibi_slopes"], sinks=mods["sinks"],
            dropout_seed=seed, dropout_p=0.3, **case.op_options())
        wrt = differentiable_inputs(*inputs, sinks=mods["sinks"])
        grads = torch.autograd.grad((out, lse), tuple(wrt.values()), (dout, dlse))
    keep = dropout_mask(seed, case.B, case.H, case.S_q, case.S_k, 0.3)
    for result in check_attention(*inputs, dout, dlse, out, lse, grads, **mods, dropout_p=0.3,
                                  dropout_mask=keep, **case.options()):
        assert result.ok, str(result)


# --- packed sequences and paged prefill -------------------------------------------------------


def _cu(lens) -> torch.Tensor:
    return torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)


def _randn(*shape, dtype, gen, grad=False):
    return torch.randn(*shape, device=DEVICE, generator=gen).to(dtype).requires_grad_(grad)


@settings(max_examples=max(settings.default.max_examples // 3, 1))
@given(lens=st.lists(st.tuples(st.integers(0, 45), st.integers(0, 45)), min_size=1,
                     max_size=4),
       chunk=chunks(45), causal=st.booleans(), dtype=st.sampled_from(DTYPES),
       gate=st.booleans(), seed=st.integers(0, 2**16))
@example(lens=[(30, 30), (1, 40), (0, 5), (44, 20)], chunk=16, causal=True, dtype=torch.float16,
         gate=True, seed=0)
def test_packed_chunks_restart_in_every_sequence(lens, chunk, causal, dtype, gate, seed):
    """A packed batch (empty sequences too): each sequence's chunks count from its own first
    key; out, lse, dq, dk, dv (and the gate's gradient) per sequence against the reference;
    through the CPU path too where the tensors are CPU ones."""
    for path in PATHS:
        with on(path):
            _check_packed(lens, chunk, causal, dtype, gate, seed)


def _check_packed(lens, chunk, causal, dtype, gate, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    lens_q, lens_k = [q for q, _ in lens], [k for _, k in lens]
    H_kv, G, D = 1, 2, 16
    q = _randn(sum(lens_q), H_kv * G, D, dtype=dtype, gen=gen, grad=True)
    k = _randn(sum(lens_k), H_kv, D, dtype=dtype, gen=gen, grad=True)
    v = _randn(sum(lens_k), H_kv, D, dtype=dtype, gen=gen, grad=True)
    g = None
    if gate and causal:
        g = torch.nn.functional.logsigmoid(2 + _randn(sum(lens_k), H_kv * G, dtype=torch.float32,
                                                      gen=gen)).requires_grad_()
    dout = _randn(*q.shape, dtype=dtype, gen=gen)
    dlse = _randn(H_kv * G, q.shape[0], dtype=torch.float32, gen=gen)
    packing = (_cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k))
    options = dict(causal=causal, attention_chunk=chunk)
    with poisoned_outputs():
        out, lse = flashop.attention_varlen_with_lse(q, k, v, *packing, g=g, **options)
        wrt = differentiable_inputs(q, k, v, g=g)
        grads = torch.autograd.grad((out, lse), tuple(wrt.values()), (dout, dlse))
    for result in check_attention_varlen(q, k, v, *packing[:2], dout, dlse, out, lse, grads,
                                         g=g, **options):
        assert result.ok, str(result)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal,chunk", [(True, 16), (False, 23), (True, 1)])
def test_paged_prefill(causal, chunk, path):
    """Packed queries over pages read in place (block_table), forward only: out and lse
    against the reference over the gathered keys."""
    gen = torch.Generator(device=DEVICE).manual_seed(chunk)
    lens_q, lens_k, page, blocks = [20, 5, 33], [40, 37, 64], 16, 4
    H_kv, G, D, dtype = 2, 2, 16, torch.float16
    k_cache = _randn(3 * blocks + 1, page, H_kv, D, dtype=dtype, gen=gen)
    v_cache = _randn(3 * blocks + 1, page, H_kv, D, dtype=dtype, gen=gen)
    table = torch.randperm(3 * blocks + 1, device=DEVICE, generator=gen)[:3 * blocks]
    table = table.view(3, blocks).to(torch.int32)
    q = _randn(sum(lens_q), H_kv * G, D, dtype=dtype, gen=gen)
    k, v = (torch.cat([c[table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(lens_k)])
            for c in (k_cache, v_cache))
    packing = (_cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k))
    sinks = torch.randn(H_kv * G, device=DEVICE, generator=gen)
    options = dict(causal=causal, attention_chunk=chunk, sinks=sinks)
    with poisoned_outputs(), on(path):
        out, lse = flashop.attention_varlen_with_lse(q, k_cache, v_cache, *packing,
                                                     block_table=table, **options)
    ref, plain = (attention_varlen_reference(q, k, v, *packing[:2], compute_dtype=d, **options)
                  for d in (torch.float64, None))
    for name, actual, r, p in (("out", out, ref[0], plain[0]), ("lse", lse, ref[1], plain[1])):
        result = accuracy(name, actual, r, p, 2, dtype)
        assert result.ok, str(result)


# --- decoding ---------------------------------------------------------------------------------


def _check_decode(q, k_cache, v_cache, k, v, dtype, path="kernels", **kwargs):
    """attention_with_kvcache's out and lse (outputs poisoned; through ``path``) against the
    reference on the caches as they were; returns the caches after the append."""
    before = k_cache.clone(), v_cache.clone()
    with poisoned_outputs(), on(path):
        out, lse = flashop.attention_with_kvcache(q, k_cache, v_cache, k, v, return_lse=True,
                                                  **kwargs)
    reference = dict(kwargs)
    reference.pop("num_splits", None)
    ref, plain = (attention_with_kvcache_reference(q, *before, k, v, compute_dtype=d,
                                                   **reference)
                  for d in (torch.float64, None))
    for name, actual, r, p in (("out", out, ref[0], plain[0]), ("lse", lse, ref[1], plain[1])):
        result = accuracy(name, actual, r, p, 2, dtype)
        assert result.ok, str(result)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("causal,chunk,S_q", [(True, 16, 1), (True, 20, 4), (False, 9, 3)])
def test_decode_with_appends_and_splits(paged, num_splits, causal, chunk, S_q, path):
    """Queries over caches of several lengths (empty, inside the first chunk, past several)
    after an append of 3 keys, chunks counted from each sequence's first key; split-KV runs
    whose key tiles cross chunk edges; GQA, ALiBi and sinks."""
    gen = torch.Generator(device=DEVICE).manual_seed(chunk + S_q)
    dtype, H_kv, G, D, page, capacity = torch.bfloat16, 2, 2, 16, 16, 64
    lengths = torch.tensor([0, 11, 45, 61], dtype=torch.int32, device=DEVICE)
    B = lengths.shape[0]
    kwargs = dict(cache_seqlens=lengths, causal=causal, attention_chunk=chunk,
                  num_splits=num_splits, alibi_slopes=torch.rand(H_kv * G, device=DEVICE,
                                                                 generator=gen),
                  sinks=torch.randn(H_kv * G, device=DEVICE, generator=gen))
    if paged:
        blocks = B * capacity // page
        shape = (blocks + 1, page, H_kv, D)
        order = torch.randperm(blocks + 1, device=DEVICE, generator=gen)[:blocks]
        kwargs["block_table"] = order.view(B, capacity // page).to(torch.int32)
    else:
        shape = (B, capacity, H_kv, D)
    k_cache, v_cache = (_randn(*shape, dtype=dtype, gen=gen) for _ in range(2))
    q = _randn(B, S_q, H_kv * G, D, dtype=dtype, gen=gen)
    k, v = (_randn(B, 3, H_kv, D, dtype=dtype, gen=gen) for _ in range(2))
    _check_decode(q, k_cache, v_cache, k, v, dtype, path, **kwargs)


@pytest.mark.parametrize("path", PATHS)
def test_decode_with_left_padding_counts_chunks_from_the_first_key(path):
    """cache_leftpad: sequence b's keys (and chunks) start at row cache_leftpad[b]; rotary
    positions per query, as under a window."""
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    dtype, B, H_kv, D = torch.float16, 3, 1, 16
    angle = 6.3 * torch.rand(67, 4, device=DEVICE, generator=gen)
    kwargs = dict(cache_seqlens=torch.tensor([30, 50, 7], dtype=torch.int32, device=DEVICE),
                  cache_leftpad=torch.tensor([3, 20, 0], dtype=torch.int32, device=DEVICE),
                  causal=True, attention_chunk=8, rotary_cos=angle.cos().to(dtype),
                  rotary_sin=angle.sin().to(dtype))
    k_cache, v_cache = (_randn(B, 64, H_kv, D, dtype=dtype, gen=gen) for _ in range(2))
    q = _randn(B, 2, H_kv * 2, D, dtype=dtype, gen=gen)
    k, v = (_randn(B, 2, H_kv, D, dtype=dtype, gen=gen) for _ in range(2))
    _check_decode(q, k_cache, v_cache, k, v, dtype, path, **kwargs)


def test_decode_loop_step_by_step():
    """A prefill of 13 keys, then one token per step past two chunk edges: each step's output
    against the reference, the query's chunk growing and restarting."""
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    dtype, B, H_kv, G, D, C = torch.float16, 2, 1, 3, 16, 8
    k_cache, v_cache = (torch.zeros(B, 48, H_kv, D, dtype=dtype, device=DEVICE)
                        for _ in range(2))
    lengths = torch.zeros(B, dtype=torch.int32, device=DEVICE)
    for S_new in (13, 1, 1, 1, 1, 1):
        q = _randn(B, S_new, H_kv * G, D, dtype=dtype, gen=gen)
        k, v = (_randn(B, S_new, H_kv, D, dtype=dtype, gen=gen) for _ in range(2))
        _check_decode(q, k_cache, v_cache, k, v, dtype, cache_seqlens=lengths, causal=True,
                      attention_chunk=C, num_splits=2)  # appends k, v
        lengths = lengths + S_new


# --- the kernels that decline chunks, the doors, what stays as it was ----------------------------


def test_gluon_and_warp_specialized_kernels_decline_chunks(monkeypatch):
    """A chunk is a modifier: the Gluon forward and backward (plain calls, dropout aside;
    here made available on this device and forced on) and the warp-specialized forward (no
    flag set) never take it; its calls keep one query tile per program, as under a window's
    left bound."""
    from flashop._launch import choice, gluon

    seed = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    for mods in (modifiers(attention_chunk=8), modifiers(causal=True, attention_chunk=8),
                 modifiers(attention_chunk=8, dropout_p=0.1, dropout_seed=seed)):
        assert not mods.is_plain and not mods.is_plain_but_dropout
    monkeypatch.setattr(gluon, "unavailable", lambda device: None)
    q = torch.empty(1, 256, 2, 128, dtype=torch.bfloat16, device=DEVICE)
    with flashop.config.override(gluon=True):
        for causal in (False, True):
            plain, chunked = modifiers(causal=causal), modifiers(causal=causal,
                                                                 attention_chunk=64)
            assert choice.forward_takes_gluon(q, q, q, 0.1, plain, None)
            assert not choice.forward_takes_gluon(q, q, q, 0.1, chunked, None)
            assert choice.gluon_backward_order(q, q, q, q, plain, False, None, True) is not None
            assert choice.gluon_backward_order(q, q, q, q, chunked, False, None, True) is None
    q = torch.empty(1, 256, 2, 128, dtype=torch.float16, device=DEVICE)
    flags = dict(PLAIN_FLAGS[True])
    with flashop.config.override(warp_specialize=True):
        assert choice.uses_ws(q, q, q, PLAIN_FLAGS[False], 128, 256, False)
        assert not choice.uses_ws(q, q, q, dict(flags, HAS_CHUNK=True), 128, 256, False)
    assert tiles.forward_tiles(128, torch.float16, torch.device(DEVICE), flags, 8192).split_m
    assert not tiles.forward_tiles(128, torch.float16, torch.device(DEVICE),
                                   dict(flags, HAS_CHUNK=True), 8192).split_m


def test_chunk_of_zero_is_plain_and_flops_count_every_pair():
    """attention_chunk=0 is the plain call (the shared PLAIN modifiers: the fast paths); a
    chunk leaves SDPA's FLOP count as it is (every pair, as for windows)."""
    assert modifiers(causal=True, attention_chunk=0).is_plain
    case = _case(33, 47, 8)
    (q, k, v), _, _ = make_inputs(case)
    counts = []
    for chunk in (0, 8):
        with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
            flashop.attention(q, k, v, causal=True, attention_chunk=chunk).sum().backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0


def test_flash_attn_functions_take_attention_chunk():
    """FlashAttention-3's keyword in flash_attn_func, flash_attn_varlen_func and
    flash_attn_with_kvcache: the same results as flashop's functions."""
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    q, k, v = (_randn(2, 40, 2, 16, dtype=torch.float16, gen=gen) for _ in range(3))
    want = flashop.attention(q, k, v, causal=True, attention_chunk=12)
    assert torch.equal(flash_attn_func(q, k, v, causal=True, attention_chunk=12), want)
    assert not torch.equal(flash_attn_func(q, k, v, causal=True), want)
    cu = _cu([40, 40])
    packed = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu,
                                    40, 40, causal=True, attention_chunk=12)
    assert torch.equal(packed.view(want.shape), want)
    lengths = torch.tensor([30, 37], dtype=torch.int32, device=DEVICE)
    out = flash_attn_with_kvcache(q[:, :3], k, v, cache_seqlens=lengths, causal=True,
                                  attention_chunk=12)
    assert torch.equal(out, flashop.attention_with_kvcache(q[:, :3], k, v, cache_seqlens=lengths,
                                                           causal=True, attention_chunk=12))


def test_meta_tensors_and_opcheck():
    """The fakes take the chunk (same outputs' shapes); opcheck of the forward and backward
    operators (dense and packed), the paged prefill and the decoding operator."""
    case = _case(20, 30, 8)
    (q, k, v), dout, dlse = make_inputs(case)
    options = case.op_options()
    meta = [t.detach().to("meta") for t in (q, k, v)]
    out, lse, _ = torch.ops.flashop.attention_forward(*meta, **options)
    assert out.shape == q.shape and lse.shape == (1, 2, 20) and out.device.type == "meta"
    opcheck(torch.ops.flashop.attention_forward.default, (q, k, v), options)
    detached = [t.detach() for t in (q, k, v)]
    out, _, lse_log2 = torch.ops.flashop.attention_forward(*detached, **options)
    opcheck(torch.ops.flashop.attention_backward.default,
            (dout, dlse, *detached, out, lse_log2), options)
    cu_q, cu_k = _cu([5, 15]), _cu([12, 18])
    packed = (detached[0][0], detached[1][0], detached[2][0], cu_q, cu_k, 15, 18)
    opcheck(torch.ops.flashop.attention_forward.default, packed, options)
    table = torch.arange(4, dtype=torch.int32, device=DEVICE).view(2, 2)
    cache = torch.randn(5, 16, 2, 16, dtype=torch.float16, device=DEVICE)
    opcheck(torch.ops.flashop.attention_varlen_paged.default,
            (packed[0], cache, cache, cu_q, cu_k, 15, 18, table), options)
    opcheck(torch.ops.flashop.attention_with_kvcache.default,
            (detached[0][:, :2], cache[:1].clone(), cache[:1].clone(),
             torch.tensor([11], dtype=torch.int32, device=DEVICE)),
            dict(causal=True, attention_chunk=8))


@pytest.mark.compile
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_compiles_with_fullgraph(packed):
    """torch.compile(fullgraph=True) of a chunked forward and backward (dense and packed)
    gives the eager call's out and gradients."""
    case = _case(40, 40, 12, G=1)
    (q, k, v), _, _ = make_inputs(case)

    def run(q, k, v):
        if packed:
            cu = _cu([15, 25])
            return flashop.attention_varlen(q[0], k[0], v[0], cu, cu, 25, 25, causal=True,
                                            attention_chunk=12)
        return flashop.attention(q, k, v, causal=True, attention_chunk=12)

    torch._dynamo.reset()
    results = []
    for fn in (run, torch.compile(run, fullgraph=True, backend="aot_eager")):
        out = fn(q, k, v)
        results.append((out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


# --- bad input ------------------------------------------------------------------------------


class TestChunkErrors(TestCase):
    def test_messages(self):
        q = torch.randn(1, 8, 2, 16, dtype=torch.float16, device=DEVICE)
        self.assertExpectedInline(error_message(
            flashop.attention, q, q, q, attention_chunk=-1), """\
flashop.attention: attention_chunk must be an int >= 0 (the chunk's length in keys: each query attends only the keys of its chunk; 0 turns chunking off), got -1""")  # noqa: B950
        self.assertExpectedInline(error_message(
            flashop.attention, q, q, q, attention_chunk=2.5), """\
flashop.attention: attention_chunk must be an int >= 0 (the chunk's length in keys: each query attends only the keys of its chunk; 0 turns chunking off), got 2.5""")  # noqa: B950
        cu = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
        self.assertExpectedInline(error_message(
            flashop.attention_varlen, q[0], q[0], q[0], cu, cu, 8, 8, attention_chunk=True), """\
flashop.attention_varlen: attention_chunk must be an int >= 0 (the chunk's length in keys: each query attends only the keys of its chunk; 0 turns chunking off), got True""")  # noqa: B950
        lengths = torch.tensor([4], dtype=torch.int32, device=DEVICE)
        self.assertExpectedInline(error_message(
            flashop.attention_with_kvcache, q, q, q, cache_seqlens=lengths,
            attention_chunk="8"), """\
flashop.attention_with_kvcache: attention_chunk must be an int >= 0 (the chunk's length in keys: each query attends only the keys of its chunk; 0 turns chunking off), got '8'""")  # noqa: B950


# --- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("N,C", [(4096, 1024), (4000, 1000), (4096, 100)])
def test_gpu_bf16_long_chunked(N, C, causal):
    """bf16 forward and backward at Llama 4's scale (D = 128, GQA 4:1) on the GPU's tiles:
    chunks on and off the tiles' edges, causal and two-sided."""
    check_case(Case(B=1, S_q=N, S_k=N, H_kv=2, G=4, D=128, DV=128, dtype=torch.bfloat16,
                    causal=causal, attention_chunk=C))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gpu_packed_and_decode_chunks():
    """A packed bf16 batch of 3 sequences and a 4k-key decoding step over a paged cache."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    lens = [3000, 1500, 4096]
    q, k, v = (_randn(sum(lens), h, 128, dtype=torch.bfloat16, gen=gen, grad=True)
               for h in (8, 2, 2))
    dout = _randn(*q.shape, dtype=torch.bfloat16, gen=gen)
    dlse = _randn(8, q.shape[0], dtype=torch.float32, gen=gen)
    packing = (_cu(lens), _cu(lens), max(lens), max(lens))
    out, lse = flashop.attention_varlen_with_lse(q, k, v, *packing, causal=True,
                                                 attention_chunk=1024)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    for result in check_attention_varlen(q, k, v, *packing[:2], dout, dlse, out, lse, grads,
                                         causal=True, attention_chunk=1024):
        assert result.ok, str(result)
    cache = _randn(4 * 64 + 1, 64, 2, 128, dtype=torch.bfloat16, gen=gen)
    table = torch.randperm(4 * 64 + 1, device=DEVICE, generator=gen)[:4 * 64]
    _check_decode(_randn(4, 1, 8, 128, dtype=torch.bfloat16, gen=gen), cache, cache.clone(),
                  None, None, torch.bfloat16,
                  cache_seqlens=torch.tensor([4096, 1025, 1024, 3000], dtype=torch.int32,
                                             device=DEVICE),
                  block_table=table.view(4, 64).to(torch.int32), causal=True,
                  attention_chunk=1024)


def test_chunk_keys_the_decoding_checks_and_plans():
    """Two decoding calls of one signature but their chunks (and one without) are checked
    and planned apart: each against the reference."""
    gen = torch.Generator(device=DEVICE).manual_seed(13)
    dtype, B, H_kv, D = torch.float16, 2, 1, 16
    k_cache, v_cache = (_randn(B, 64, H_kv, D, dtype=dtype, gen=gen) for _ in range(2))
    q = _randn(B, 1, 2, D, dtype=dtype, gen=gen)
    lengths = torch.tensor([50, 61], dtype=torch.int32, device=DEVICE)
    outs = []
    for chunk in (8, 16, 0):
        _check_decode(q, k_cache, v_cache, None, None, dtype, cache_seqlens=lengths,
                      causal=True, attention_chunk=chunk)
        outs.append(flashop.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                   causal=True, attention_chunk=chunk))
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])


def test_decoding_splits_share_the_chunks_keys(monkeypatch):
    """The split count as on an H200 (132 SMs): a decoding step over a 128k-key cache shares
    its query's chunk among the splits (chunks of 8192: 33 splits of two 128-key tiles;
    chunks of 1024: 5), where without a chunk the splits share the capacity (61)."""
    from flashop._launch import decode_tiles, kvcache as launch_decode
    from flashop._launch.common import tensor_meta

    for module in (launch_decode, decode_tiles):
        monkeypatch.setattr(module, "INTERPRETING", False)
    monkeypatch.setattr(decode_tiles, "sm_count", lambda device: 132)
    monkeypatch.setattr(launch_decode, "max_shared_memory", lambda index: 227 * 1024)
    q = torch.empty(1, 1, 8, 128, dtype=torch.bfloat16, device=DEVICE)
    cache = torch.empty(1, 131072, 2, 128, dtype=torch.bfloat16, device=DEVICE)
    metas = tuple(map(tensor_meta, (q, cache, cache) + (None,) * 12))
    splits = [launch_decode._make_plan(metas, (modifiers(causal=causal, attention_chunk=chunk),
                                               None, 0, True)).decode.grid[0]
              for causal, chunk in ((True, 0), (True, 8192), (True, 1024), (False, 8192))]
    assert splits == [61, 33, 5, 65]
