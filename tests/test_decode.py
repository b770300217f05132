"""attention_with_kvcache: out and lse against the reference under the accuracy rule, the
whole cache after the append bit for bit, dense and paged caches, opcheck, a compiled decode
loop that compiles once, and the errors on bad input."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from hypothesis import example, given, strategies as st
from torch.library import opcheck

import flashop
# fresh_plans: an autouse fixture, which pytest finds in this module's names
from cache_cases import APPEND_INDEX, CacheCase, fresh_plans, kwargs_ref, make_call  # noqa: F401
from flashop.reference import attention_with_kvcache_reference, kvcache_append_reference
from flashop.testing import accuracy
from helpers import (
    CPU_PATH_TWIN, DECODE_KEYS, DEVICE, INPUTS, TILES, cpu_path, cuda_graph, left_bounds_at_edges,
    lengths, poisoned_outputs, right_bounds_at_edges, tile_edges,
)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b hold the same bits (NaNs included)."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


def check_cache_case(case: CacheCase, seed: int = 0, call=None):
    """flashop's out and lse (outputs poisoned) under the accuracy rule against the fp64
    reference and plain PyTorch in the case's dtype; both caches after the call bit for bit
    against the expected append. ``call``: make_call's result, where not made here."""
    (q, k_cache, v_cache, k, v), kwargs = call or make_call(case, seed)
    index = {n: kwargs[n] for n in APPEND_INDEX if n in kwargs}
    expected = kvcache_append_reference(k_cache, v_cache, k, v, **index)
    ref = attention_with_kvcache_reference(q, k_cache, v_cache, k, v, **kwargs_ref(kwargs),
                                           compute_dtype=torch.float64)
    plain = attention_with_kvcache_reference(q, k_cache, v_cache, k, v, **kwargs_ref(kwargs),
                                             compute_dtype=None)
    with poisoned_outputs():
        out, lse = flashop.attention_with_kvcache(q, k_cache, v_cache, k, v, **kwargs,
                                                  return_lse=True)
    assert out.dtype == case.dtype and out.shape == (case.B, case.S_q, case.H, case.DV)
    assert lse.dtype == torch.float32 and lse.shape == (case.B, case.H, case.S_q)
    for name, actual, r, p in (("out", out, ref[0], plain[0]), ("lse", lse, ref[1], plain[1])):
        result = accuracy(name, actual, r, p, 2, case.dtype)
        assert result.ok, str(result)
    assert bitwise_equal(k_cache, expected[0]), "k_cache differs from the expected append"
    assert bitwise_equal(v_cache, expected[1]), "v_cache differs from the expected append"


@st.composite
def cache_cases(draw):
    """A call in the test's dtype: dense and paged caches of two pages or more, most
    sequences' keys past a page and a key tile (the interpreter's tiles are 16 keys), so
    that their keys lie in several pages and splits; lengths from empty to full after the
    append, appends of 0 to 5 keys, 1 to 7 queries, GQA, head dims, the modifiers. In many
    draws a sequence's keys after the append end at a key tile's or a page's edge, and the
    window's bounds put the first or last key the first sequence's first or last query
    attends at one."""
    paged = draw(st.booleans())
    page = draw(st.sampled_from([16, 32]))
    capacity = page * draw(st.integers(2, 4)) if paged else draw(st.integers(33, 90))
    S_new = draw(st.sampled_from([0, 1, 1, 2, 5]))
    H_kv = draw(st.integers(1, 2))
    B = draw(st.integers(1, 3 // H_kv))  # programs (B * H_kv per split) cost time
    top = capacity - S_new
    least = (page if paged else DECODE_KEYS) + 1
    short = st.one_of(st.just(0), st.just(top), st.integers(0, top))
    # keys after the append (length + S_new) at a tile's or a page's edge
    at_edges = tile_edges(least + S_new, capacity, TILES + ((page,) if paged else ())).map(
        lambda keys: keys - S_new)
    lens = tuple(draw(st.one_of(lengths(least, top, short), at_edges)) for _ in range(B))
    S_q = draw(st.sampled_from([1, 1, 2, 3, 7]))
    G = draw(st.sampled_from([1, 2, 4]))
    D = draw(st.sampled_from([16, 32, 40, 64]))
    DV = draw(st.sampled_from([D, D, 24]))
    causal = draw(st.booleans())
    # a few bounds (narrower ones: an @example), or bounds at a tile edge for the first
    # sequence's first or last query (query i sits at key i + L - S_q: the kernel's ranges
    # start from the first query's and end at the last one's); left bounds past a key tile
    offset = lens[0] + S_new - draw(st.sampled_from([S_q, 1]))
    left = draw(st.one_of(st.sampled_from([-1, -1, 20, 40]),
                          left_bounds_at_edges(offset, capacity, least=DECODE_KEYS)))
    right = -1 if causal else draw(st.one_of(st.sampled_from([-1, -1, 0, 3]),
                                             right_bounds_at_edges(offset, capacity)))
    softcap = draw(st.sampled_from([0.0, 0.0, 5.0]))
    alibi = draw(st.sampled_from([None, None, (H_kv * G,), (B, H_kv * G)]))
    sinks = draw(st.sampled_from([None, None, torch.float32, INPUTS]))
    # rotary embeddings of all of D or of part of it (with new keys to rotate), left padding
    rotary_dim = draw(st.sampled_from([0, 0, D, 2 * (D // 4)])) if S_new else 0
    return CacheCase(lens, S_q, S_new, H_kv, G, D, DV, None, paged=paged, page=page,
                     capacity=capacity, spare=draw(st.integers(0, 2)),
                     batch_idx=not paged and draw(st.booleans()), causal=causal,
                     window_size=(left, right), softcap=softcap, alibi=alibi, sinks=sinks,
                     num_splits=draw(st.sampled_from([0, 2, 3, 5])), rotary_dim=rotary_dim,
                     interleaved=draw(st.booleans()),
                     leftpad=not paged and draw(st.booleans()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@given(case=cache_cases(), seed=st.integers(0, 2**16))
@example(case=CacheCase((0, 0), 2, 0, 1, 2, 16, 16, None, paged=True, capacity=32), seed=0)
@example(case=CacheCase((0, 40), 1, 1, 2, 2, 16, 16, None, capacity=48, sinks=INPUTS), seed=0)
@example(case=CacheCase((62, 30), 1, 2, 1, 4, 32, 24, None, paged=True, capacity=64,
                        causal=True, num_splits=3), seed=0)
@example(case=CacheCase((37, 50), 3, 1, 2, 2, 40, 40, None, capacity=64, causal=True,
                        window_size=(0, -1), alibi=(2, 4), softcap=5.0, num_splits=1), seed=0)
@example(case=CacheCase((50, 33), 2, 0, 1, 2, 16, 24, None, paged=True, capacity=64,
                        sinks=torch.float32, num_splits=1), seed=0)
def test_kvcache_matches_reference(dtype, case, seed):
    """Drawn calls, and the edges: no key, one key (appended), a cache full after the
    append, one key per query, one split."""
    case = replace(case, dtype=dtype, sinks=dtype if case.sinks is INPUTS else case.sinks)
    check_cache_case(case, seed)


@CPU_PATH_TWIN
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@given(case=cache_cases(), seed=st.integers(0, 2**16))
@example(case=CacheCase((0, 0), 2, 0, 1, 2, 16, 16, None, paged=True, capacity=32), seed=0)
@example(case=CacheCase((37, 50), 3, 1, 2, 2, 40, 40, None, capacity=64, causal=True,
                        window_size=(0, -1), alibi=(2, 4), softcap=5.0, num_splits=1), seed=0)
def test_cpu_path_kvcache_matches_reference(dtype, case, seed):
    """The CPU path on the same calls: its append (rotated keys included) against the
    reference's bit for bit, then each sequence's attention."""
    case = replace(case, dtype=dtype, sinks=dtype if case.sinks is INPUTS else case.sinks)
    with cpu_path():
        check_cache_case(case, seed)


_T = max(TILES)  # a multiple of every tile in use


@pytest.mark.parametrize("window_size", [(-1, -1), (_T + 3, 0)], ids=["unbounded", "window"])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_keys_and_bounds_at_every_residue_of_the_tiles(paged, window_size):
    """_T sequences whose keys after the append end at every residue of the tiles in use
    (L = 2 * _T + b for b < _T), so that the keys' end, the pages' ends and each query's
    first and last key under the window fall at every residue too, with 3 queries, an append
    of 2 keys and two splits: plain fp32 inputs, so that one key too many or too few fails
    the rule."""
    lengths = tuple(2 * _T + b - 2 for b in range(_T))
    check_cache_case(CacheCase(lengths, 3, 2, 1, 2, 16, 16, torch.float32, paged=paged,
                               page=min(TILES), capacity=3 * _T, window_size=window_size,
                               num_splits=2))


@pytest.mark.parametrize("page", [16, 32, 64, 128, 256])
def test_every_page_size(page):
    """Every power-of-two page size from 16 to 256 is accepted and gives the reference's
    results; lengths end mid-page and the append crosses a page boundary."""
    check_cache_case(CacheCase((page - 2, 2 * page - 9), 2, 3, 2, 2, 32, 32, torch.float16,
                               paged=True, page=page, capacity=2 * page, causal=True,
                               num_splits=2))


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_empty_caches_give_zero_and_minus_infinity(num_splits):
    """Sequences with no key (empty cache, nothing appended) get out 0 and lse -inf, beside
    a sequence that has keys; splits past a sequence's keys merge cleanly."""
    case = CacheCase((0, 37, 0), 2, 0, 2, 2, 16, 16, torch.float32, capacity=48,
                     num_splits=num_splits)
    (q, k_cache, v_cache, _, _), kwargs = make_call(case)
    with poisoned_outputs():
        out, lse = flashop.attention_with_kvcache(q, k_cache, v_cache, **kwargs,
                                                  return_lse=True)
    assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]]))
    assert torch.isneginf(lse[[0, 2]]).all() and torch.isfinite(lse[1]).all()
    check_cache_case(case)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_empty_caches_with_sinks_give_zero_and_the_sink(num_splits):
    """With sinks, a sequence with no key gets out 0 and lse = sinks[h] (as the dense op's
    rows with no key), beside a sequence that has keys."""
    case = CacheCase((0, 37), 2, 0, 1, 2, 16, 16, torch.float32, capacity=48,
                     sinks=torch.float32, num_splits=num_splits)
    (q, k_cache, v_cache, _, _), kwargs = make_call(case)
    with poisoned_outputs():
        out, lse = flashop.attention_with_kvcache(q, k_cache, v_cache, **kwargs,
                                                  return_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    # the kernels keep the sink in base 2 (sink * log2 e) and return lse * ln 2: two fp32
    # roundings, so lse is the sink to within 2 ulps (bit for bit under the interpreter)
    torch.testing.assert_close(lse[0], kwargs["sinks"][:, None].expand(2, 2),
                               rtol=2 * torch.finfo(torch.float32).eps, atol=0)
    check_cache_case(case)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 0])
def test_sink_counts_once_in_every_split_count(num_splits):
    """The sink joins each row's softmax once whatever the number of splits (sinks about
    the keys' log-sum so that counting one twice or not at all fails), windowed so that
    some splits hold no key of a row; the sinks in q's dtype."""
    case = CacheCase((40, 9), 3, 2, 1, 2, 32, 32, torch.float16, paged=True, page=16,
                     capacity=64, causal=True, window_size=(20, 0), sinks=torch.float16,
                     num_splits=num_splits)
    check_cache_case(case)


@pytest.mark.parametrize("options,interleaved", [
    (dict(causal=True), True), (dict(), False), (dict(window_size=(-1, 2)), False),
    (dict(window_size=(48, -1)), True)],
    ids=["causal", "no-bound", "right-bound", "bound-past-capacity"])
def test_rotary_positions(options, interleaved):
    """The new keys rotated at cache_seqlens[b] + s (caches bit for bit) and the queries at
    cache_seqlens[b] + i where causal or a window bound below the capacity is set, else all
    at cache_seqlens[b] (a bound at or past the capacity, 48, counts as none): 4 queries
    after 3 and 20 cached keys, rotary on 24 of 32 dims, GPT-J's pairs and GPT-NeoX's, bf16
    (rounded as a GPU rounds)."""
    case = CacheCase((3, 20), 4, 4, 1, 2, 32, 32, torch.bfloat16, capacity=48,
                     rotary_dim=24, interleaved=interleaved, **options)
    check_cache_case(case)


def test_rotary_on_paged_caches_and_every_dim():
    """Rotary on a paged cache whose appends cross a page, on all of the head dim, 2 splits,
    fp32 (rotated in fp64)."""
    check_cache_case(CacheCase((14, 0, 30), 3, 3, 2, 2, 16, 16, torch.float32, paged=True,
                               page=16, capacity=48, causal=True, rotary_dim=16, num_splits=2))


def test_left_padding_is_never_read():
    """cache_leftpad: each sequence attends rows cache_leftpad[b] .. cache_seqlens[b] +
    S_new - 1 (ALiBi distances and windows counted from its own first key); the padding
    rows, filled with NaN, are never read (a NaN there would reach the output)."""
    case = CacheCase((9, 30, 4), 3, 2, 1, 2, 16, 16, torch.float32, capacity=40,
                     batch_idx=True, causal=True, window_size=(6, 0), alibi=(3, 2),
                     leftpad=True, num_splits=2)
    (q, k_cache, v_cache, k, v), kwargs = make_call(case)
    pads = kwargs["cache_leftpad"] = torch.tensor([5, 28, 4], dtype=torch.int32,
                                                   device=DEVICE)
    for b, row in enumerate(kwargs["cache_batch_idx"].tolist()):
        k_cache[row, :pads[b]] = v_cache[row, :pads[b]] = float("nan")
    check_cache_case(case, call=((q, k_cache, v_cache, k, v), kwargs))


def test_python_int_lengths_and_appends_past_capacity_are_dropped():
    """cache_seqlens as a Python int applies to every sequence; new keys past the cache's
    capacity are not written anywhere (the rest of the cache is unchanged)."""
    case = CacheCase((5, 5), 1, 4, 1, 2, 16, 16, torch.float32, capacity=8)
    (q, k_cache, v_cache, k, v), kwargs = make_call(case)
    kwargs["cache_seqlens"] = 5
    before = k_cache.clone(), v_cache.clone()
    flashop.attention_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)
    assert torch.equal(k_cache[:2, 5:], k[:, :3]) and torch.equal(v_cache[:2, 5:], v[:, :3])
    assert torch.equal(k_cache[:2, :5], before[0][:2, :5])
    assert torch.equal(k_cache[2:], before[0][2:]) and torch.equal(v_cache[2:], before[1][2:])


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("alibi,sinks", [((3, 4), None), (None, torch.float32),
                                          ((4,), torch.float32)],
                         ids=["alibi", "sinks", "alibi-and-sinks"])
def test_alibi_or_sinks_as_the_only_modifiers(paged, alibi, sinks):
    """A decode plan holds its modifiers without their tensors (its key): ALiBi's slopes and
    the sinks, the only modifiers of a causal call, still reach the kernel."""
    check_cache_case(CacheCase((17, 60, 0), 1, 3, 2, 2, 32, 32, torch.float16, paged=paged,
                               capacity=64, causal=True, alibi=alibi, sinks=sinks,
                               num_splits=2))


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_keys_and_values_stacked_in_one_buffer(paged):
    """Caches that are two halves of one allocation (kv[0], kv[1], as serving engines
    allocate them), and new keys and values unbound from one tensor: separate tensors to
    the checks and the kernels, written and read apart."""
    case = CacheCase((17, 40, 0), 1, 2, 2, 2, 32, 32, torch.float16, paged=paged,
                     capacity=64, causal=True, num_splits=2)
    (q, k_cache, v_cache, k, v), kwargs = make_call(case)
    kv_cache = torch.stack([k_cache, v_cache])
    kv_new = torch.stack([k, v])
    check_cache_case(case, call=((q, kv_cache[0], kv_cache[1], kv_new[0], kv_new[1]), kwargs))


def test_decode_loop_matches_reference_step_by_step():
    """A paged decode loop appending one token at a time (the caller advances the
    lengths) equals the reference at every step."""
    case = CacheCase((3, 0), 1, 1, 2, 2, 16, 16, torch.float32, paged=True, page=16,
                     capacity=32, causal=True)
    (q, k_cache, v_cache, k, v), kwargs = make_call(case)
    seqlens = kwargs.pop("cache_seqlens")
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for _ in range(20):
        q, k, v = (torch.randn(x.shape, device=DEVICE, generator=gen) for x in (q, k, v))
        ref_out, plain_out = (
            attention_with_kvcache_reference(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                             **kwargs_ref(kwargs), compute_dtype=dtype)[0]
            for dtype in (torch.float64, None))
        out = flashop.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                             **kwargs)
        result = accuracy("out", out, ref_out, plain_out, 2, case.dtype)
        assert result.ok, str(result)
        seqlens += 1


# --- the operator ---------------------------------------------------------------------------

OPCHECK_CASES = [
    CacheCase((5, 30), 2, 3, 2, 2, 40, 24, torch.float32, capacity=40, batch_idx=True,
              causal=True, num_splits=2, rotary_dim=24, interleaved=False, leftpad=True),
    CacheCase((17, 0), 1, 2, 1, 4, 16, 16, torch.float16, paged=True, page=16, capacity=48,
              window_size=(8, 0), softcap=3.0, alibi=(4,), sinks=torch.float32, num_splits=2),
]


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=["dense", "paged"])
def test_opcheck(case):
    (q, k_cache, v_cache, k, v), kwargs = make_call(case)
    args = (q, k_cache, v_cache, kwargs.pop("cache_seqlens"), k, v,
            kwargs.pop("cache_batch_idx", None), kwargs.pop("block_table", None),
            kwargs.pop("alibi_slopes", None), kwargs.pop("sinks", None),
            kwargs.pop("rotary_cos", None), kwargs.pop("rotary_sin", None),
            kwargs.pop("cache_leftpad", None))
    kwargs["window_size_left"], kwargs["window_size_right"] = kwargs.pop("window_size")
    opcheck(torch.ops.flashop.attention_with_kvcache.default, args, kwargs)


def test_schema_declares_the_cache_mutation():
    schema = str(torch.ops.flashop.attention_with_kvcache.default._schema)
    assert schema == (
        "flashop::attention_with_kvcache(Tensor q, Tensor(a1!) k_cache, Tensor(a2!) v_cache, "
        "Tensor cache_seqlens, Tensor? k=None, Tensor? v=None, Tensor? cache_batch_idx=None, "
        "Tensor? block_table=None, Tensor? alibi_slopes=None, Tensor? sinks=None, "
        "Tensor? rotary_cos=None, Tensor? rotary_sin=None, Tensor? cache_leftpad=None, "
        "Tensor? k_descale=None, Tensor? v_descale=None, Tensor? q_descale=None, *, "
        "bool causal=False, float? scale=None, SymInt window_size_left=-1, "
        "SymInt window_size_right=-1, SymInt attention_chunk=0, float softcap=0., "
        "bool rotary_interleaved=True, "
        "SymInt num_splits=0, ScalarType? out_dtype=None) -> (Tensor, Tensor)")


@pytest.mark.compile
@pytest.mark.parametrize("paged", [False, True])
def test_compiled_decode_loop_compiles_once(paged):
    """A decode step under torch.compile(fullgraph=True, dynamic=True) over growing lengths:
    one compilation, the eager call's outputs and caches."""
    from torch._dynamo.testing import CompileCounterWithBackend

    case = CacheCase((4, 9), 1, 1, 1, 2, 16, 16, torch.float32, paged=paged, capacity=32,
                     causal=True)
    (q, k_cache, v_cache, k, v), kwargs = make_call(case)
    seqlens = kwargs.pop("cache_seqlens")
    table = kwargs.get("block_table")

    def step(q, k_cache, v_cache, k, v, seqlens):
        out = flashop.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                             block_table=table, causal=True)
        seqlens.add_(1)  # the caller advances the lengths, in place on the device
        return out * 2

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=counter)
    caches = k_cache.clone(), v_cache.clone()
    lengths = seqlens.clone()
    frames = []
    for i in range(4):
        q, k, v = (x + i for x in (q, k, v))
        out = compiled(q, *caches, k, v, lengths)
        frames.append(counter.frame_count)
        expected = step(q, k_cache, v_cache, k, v, seqlens)
        torch.testing.assert_close(out, expected)
        assert torch.equal(caches[0], k_cache) and torch.equal(caches[1], v_cache)
        assert torch.equal(lengths, seqlens)
    assert frames == frames[:1] * 4, f"recompiled: frames compiled after each step {frames}"
    # one graph holds the whole step (as in test_compile.py, an empty one may come first)
    graphs = [g for g in counter.graphs if len(g.graph.nodes) > 0]
    assert len(graphs) == 1
    assert any("flashop.attention_with_kvcache" in str(n.target) for n in graphs[0].graph.nodes)


# --- bad input ------------------------------------------------------------------------------


def _error(**changes):
    """The message raised by a call with the arguments of a small valid call changed."""
    case = CacheCase((3, 5), 1, 1, 2, 2, 16, 16, torch.float16, capacity=32)
    (q, k_cache, v_cache, k, v), kwargs = make_call(case)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, **kwargs)
    args.update(changes)
    with pytest.raises((ValueError, RuntimeError)) as info:
        flashop.attention_with_kvcache(**args)
    return str(info.value)


def _t(*shape, dtype=torch.float16):
    return torch.zeros(*shape, device=DEVICE, dtype=dtype)


OP = "flashop.attention_with_kvcache: "
ERRORS = {
    "rank": (dict(q=_t(2, 4, 16)),
             "q must be a 4-D tensor (batch, seqlen_q, heads, head_dim), got shape (2, 4, 16)"),
    "dtype": (dict(v_cache=_t(3, 32, 2, 16, dtype=torch.bfloat16)),
              "q, the caches and k, v must have the same dtype, got q torch.float16, k_cache "
              "torch.float16, v_cache torch.bfloat16, k torch.float16, v torch.float16; cast "
              "them to one of float16, bfloat16, float32"),
    "only k": (dict(v=None),
               "pass both k and v (the new keys and values to append) or neither, got k "
               "(2, 1, 2, 16) and v None"),
    "heads": (dict(q=_t(2, 1, 3, 16)),
              "the number of query heads (3) must be a multiple of the cache's number of "
              "key/value heads (2) for grouped-query attention, got q (2, 1, 3, 16), k_cache "
              "(3, 32, 2, 16), v_cache (3, 32, 2, 16)"),
    "head dim": (dict(q=_t(2, 1, 4, 32)),
                 "q and k_cache must have the same head dim (dim 3), got q (2, 1, 4, 32), "
                 "k_cache (3, 32, 2, 16), v_cache (3, 32, 2, 16)"),
    "new keys": (dict(k=_t(2, 1, 1, 16), v=_t(2, 1, 1, 16)),
                 "k and v must be (batch, seqlen_new, kv_heads, head_dim) = (2, S_new, 2, 16) "
                 "and (2, S_new, 2, 16) to match q and the caches, got k (2, 1, 1, 16), v "
                 "(2, 1, 1, 16) (q (2, 1, 4, 16), k_cache (3, 32, 2, 16), v_cache (3, 32, 2, "
                 "16))"),
    "too many new keys": (dict(k=_t(2, 33, 2, 16), v=_t(2, 33, 2, 16)),
                          "33 new keys do not fit a cache of 32 positions per sequence (k (2, "
                          "33, 2, 16), v (2, 33, 2, 16), q (2, 1, 4, 16), k_cache (3, 32, 2, "
                          "16), v_cache (3, 32, 2, 16)); allocate a larger cache"),
    "seqlens dtype": (dict(cache_seqlens=torch.zeros(2, dtype=torch.int64, device=DEVICE)),
                      "cache_seqlens must be a 1-D int32 tensor of 2 lengths (one per "
                      "sequence; or a Python int for all), got torch.int64 of shape (2,)"),
    "seqlens shape": (dict(cache_seqlens=torch.zeros(3, dtype=torch.int32, device=DEVICE)),
                      "cache_seqlens must be a 1-D int32 tensor of 2 lengths (one per "
                      "sequence; or a Python int for all), got torch.int32 of shape (3,)"),
    "batch idx": (dict(cache_batch_idx=torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)),
                  "cache_batch_idx must be a 1-D int32 tensor of 2 cache rows (one per "
                  "sequence of q), got torch.int32 of shape (2, 1)"),
    "small dense cache": (dict(k_cache=_t(1, 32, 2, 16), v_cache=_t(1, 32, 2, 16)),
                          "the dense cache has 1 rows (dim 0) for a batch of 2 sequences: "
                          "sequence b uses row b; pass cache_batch_idx to pick rows, or a "
                          "larger cache (q (2, 1, 4, 16), k_cache (1, 32, 2, 16), v_cache (1, "
                          "32, 2, 16))"),
    "page size": (dict(k_cache=_t(6, 24, 2, 16), v_cache=_t(6, 24, 2, 16),
                       block_table=torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)),
                  "the paged cache's page size (k_cache dim 1) must be a power of two from 16 "
                  "to 256, got 24 (q (2, 1, 4, 16), k_cache (6, 24, 2, 16), v_cache (6, 24, 2, "
                  "16))"),
    "block table": (dict(k_cache=_t(6, 16, 2, 16), v_cache=_t(6, 16, 2, 16),
                         block_table=torch.zeros(2, 3, dtype=torch.int64, device=DEVICE)),
                    "block_table must be a 2-D int32 tensor (batch, max_blocks) = (2, ...) of "
                    "page indices into the caches' first dim, got torch.int64 of shape (2, 3)"),
    "batch idx with pages": (
        dict(k_cache=_t(6, 16, 2, 16), v_cache=_t(6, 16, 2, 16),
             block_table=torch.zeros(2, 3, dtype=torch.int32, device=DEVICE),
             cache_batch_idx=torch.zeros(2, dtype=torch.int32, device=DEVICE)),
        "cache_batch_idx selects rows of a dense cache; with a block_table (paged cache) map "
        "the sequences' pages instead"),
    "strided cache": (dict(k_cache=_t(3, 32, 2, 32)[..., ::2]),
                      "k_cache must have unit stride in its last dim (it is written in place, "
                      "so it cannot be copied), got strides (2048, 64, 32, 2)"),
    "splits": (dict(num_splits=-1),
               "num_splits must be 0 (chosen from the GPU and the shapes) or from 1 to 128, "
               "got -1"),
    "scale": (dict(scale=float("inf")),
              "scale must be a finite float or None (1/sqrt(head_dim)), got inf"),
    "window pair": (dict(window_size=(4,)),
                    "window_size must be (left, right) with each >= 0, or -1 for no bound, "
                    "got (4,)"),
    "window": (dict(causal=True, window_size=(4, 2)),
               "causal=True attends no key after the query, but window_size=(4, 2) asks for 2 "
               "after it; pass window_size=(4, 0) (or -1) with causal=True, or causal=False "
               "for a two-sided window"),
    "alibi": (dict(alibi_slopes=torch.ones(3, device=DEVICE)),
              "alibi_slopes must have shape (H,) = (4,) or (B, H) = (2, 4), got (3,)"),
    "sinks shape": (dict(sinks=torch.zeros(2, device=DEVICE)),
                    "sinks must have shape (H,) = (4,): one logit per query head, got (2,)"),
    "sinks dtype": (dict(sinks=torch.zeros(4, device=DEVICE, dtype=torch.bfloat16)),
                    "sinks must be torch.float32 or torch.float16, got torch.bfloat16"),
    "leftpad with pages": (
        dict(k_cache=_t(6, 16, 2, 16), v_cache=_t(6, 16, 2, 16),
             block_table=torch.zeros(2, 3, dtype=torch.int32, device=DEVICE),
             cache_leftpad=torch.zeros(2, dtype=torch.int32, device=DEVICE)),
        "cache_leftpad is not supported with a block_table (paged cache), as in flash-attn; "
        "start each sequence at the first row of its first page"),
    "leftpad": (dict(cache_leftpad=torch.zeros(2, dtype=torch.int64, device=DEVICE)),
                "cache_leftpad must be a 1-D int32 tensor of 2 start rows (one per sequence: "
                "its keys are rows cache_leftpad[b] .. cache_seqlens[b] + S_new - 1), got "
                "torch.int64 of shape (2,)"),
    "rotary sin": (dict(rotary_cos=_t(32, 8)),
                   "pass both rotary_cos and rotary_sin or neither, got only rotary_cos"),
    "rotary without keys": (dict(rotary_cos=_t(32, 8), rotary_sin=_t(32, 8), k=None, v=None),
                            "rotary_cos/rotary_sin rotate q and the new keys as they are "
                            "appended, but no k, v were given (as in flash-attn); pass the new "
                            "keys and values, or rotate q before the call"),
    "rotary dim": (dict(rotary_cos=_t(32, 9), rotary_sin=_t(32, 9)),
                   "rotary_cos and rotary_sin must be 2-D of one shape (seqlen_ro, rotary_dim "
                   "/ 2) with 2 <= rotary_dim <= head_dim = 16, got rotary_cos (32, 9), "
                   "rotary_sin (32, 9)"),
    "rotary rows": (dict(rotary_cos=_t(31, 8), rotary_sin=_t(31, 8)),
                    "rotary_cos and rotary_sin need a row for each of the cache's 32 positions "
                    "(dim 0 at least 32), got rotary_cos (31, 8), rotary_sin (31, 8)"),
    "rotary dtype": (dict(rotary_cos=_t(32, 8, dtype=torch.float32),
                          rotary_sin=_t(32, 8, dtype=torch.float32)),
                     "rotary_cos and rotary_sin must have q's dtype torch.float16 (as in "
                     "flash-attn), got torch.float32 and torch.float32"),
    "sinks grad": (dict(sinks=torch.zeros(4, device=DEVICE, requires_grad=True)),
                   "is for inference and has no backward, but sinks require(s) grad; call it "
                   "under torch.no_grad() / torch.inference_mode(), or detach the inputs (for "
                   "training use flashop.attention)"),
    "grad": (dict(q=_t(2, 1, 4, 16).requires_grad_()),
             "is for inference and has no backward, but q require(s) grad; call it under "
             "torch.no_grad() / torch.inference_mode(), or detach the inputs (for training "
             "use flashop.attention)"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_error_messages(name):
    changes, message = ERRORS[name]
    assert _error(**changes) == OP + message


def test_mixed_devices():
    message = _error(cache_seqlens=torch.zeros(2, dtype=torch.int32, device="meta"))
    assert re.fullmatch(re.escape(OP + "all tensors must be on one device, got q on ") + ".*"
                        + re.escape("cache_seqlens on meta"), message), message


def test_sinks_on_another_device():
    message = _error(sinks=torch.zeros(4, device="meta"))
    assert re.fullmatch(re.escape(OP + "all tensors must be on one device, got q on ") + ".*"
                        + re.escape("sinks on meta"), message), message


def test_a_repeated_signature_reuses_its_checks_and_plan(monkeypatch):
    """A decode loop's calls share one signature: the second call replays the first's plan
    (no checks, no launcher) and gives the same results; a call of another signature
    (strides, a dtype, an option) is checked and planned anew, and a bad one raises however
    often it comes."""
    from flashop._launch import plans
    from flashop._ops import kvcache as ops_kvcache

    checked = []
    check = ops_kvcache.check_kvcache_inputs
    monkeypatch.setattr(ops_kvcache, "check_kvcache_inputs",
                        lambda *a, **kw: checked.append(1) or check(*a, **kw))
    body = ops_kvcache.planned_attention_with_kvcache
    case = CacheCase((3, 9), 1, 1, 2, 2, 16, 16, torch.float16, paged=True, capacity=32,
                     causal=True)
    (q, k_cache, v_cache, k, v), kwargs = make_call(case)
    first = flashop.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v,
                                           **kwargs, return_lse=True)
    assert len(checked) == 1 and [type(p) for p in body.plans.values()] == [plans.Plan]
    again = flashop.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v,
                                           **kwargs, return_lse=True)
    assert len(checked) == 1 and len(body.plans) == 1
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    # strides (q as a view of a wider tensor), an option: new signatures
    wide = torch.zeros(q.shape[:-1] + (2 * q.shape[-1],), dtype=q.dtype, device=DEVICE)
    q_view = wide[..., :q.shape[-1]].copy_(q)
    flashop.attention_with_kvcache(q_view, k_cache.clone(), v_cache.clone(), k, v, **kwargs)
    flashop.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v,
                                   **{**kwargs, "causal": False})
    assert len(checked) == 3 and len(body.plans) == 3
    bad = {**kwargs, "cache_seqlens": kwargs["cache_seqlens"].long()}
    for _ in range(2):
        with pytest.raises(ValueError, match="cache_seqlens must be a 1-D int32 tensor"):
            flashop.attention_with_kvcache(q, k_cache, v_cache, k, v, **bad)


@pytest.fixture
def decode_rules_on_gpus(monkeypatch):
    """The decode kernels' tile and split rules (flashop/_launch/decode_tiles.py) as on a GPU
    (not the interpreter's small tiles), and their launcher's."""
    from flashop._launch import decode_tiles, kvcache
    monkeypatch.setattr(decode_tiles, "INTERPRETING", False)
    monkeypatch.setattr(kvcache, "INTERPRETING", False)
    return decode_tiles


def test_split_rule_on_gpus(decode_rules_on_gpus):
    """auto_splits as on a GPU: splits of at least two key tiles, none left empty (the
    count is one its tiles per split fill), the fewest within 5% of the best occupancy of
    the resident programs; one split where the programs fill several waves. The points of
    docs/notes/performance-notes.md entry 54 (H200: 132 SMs)."""
    launch_decode = decode_rules_on_gpus
    rule = launch_decode.auto_splits
    # B=1 4k keys: pages of 16 (4 programs per SM), dense (1); the small model's 16 programs
    # over 768 keys; B=8 4k with pages of 16; B=64 (many waves)
    assert [rule(8, 4096, 64, 528), rule(8, 4096, 64, 132), rule(16, 768, 64, 528),
            rule(64, 4096, 64, 528), rule(512, 4096, 64, 528)] == [32, 16, 6, 8, 1]
    cdiv = launch_decode.cdiv
    for programs in (1, 3, 8, 16, 40, 64, 200, 600):
        for capacity in (64, 100, 768, 4096, 65536, 131072):
            for slots in (132, 264, 528):
                s = rule(programs, capacity, 64, slots)
                tiles = cdiv(capacity, 64)
                assert 1 <= s <= launch_decode.MAX_SPLITS
                assert cdiv(tiles, cdiv(tiles, s)) == s  # no empty split
                assert s == 1 or cdiv(tiles, s) >= 2, (programs, capacity, slots, s)


def test_decode_tiles_on_gpus(decode_rules_on_gpus):
    """decode_tiles as on a GPU at D=128, 16-bit: dense caches 128 keys with 3 stages, 2
    where each split runs at most two tiles (short_run_tiles); pages 64 keys with each
    key's page id, and a tile's one id where it lies in one page and the runs are short;
    fp8 caches 128 keys with 3 stages and 2 programs per SM."""
    launch_decode = decode_rules_on_gpus
    dense = launch_decode.decode_tiles(4, 128, 128, torch.bfloat16, 0)
    assert (dense.BLOCK_N, dense.num_stages) == (128, 3)
    short = launch_decode.short_run_tiles
    assert short(dense, 4096, 16, 0).num_stages == 2  # B=1 over 4k keys: 2 tiles per split
    assert short(dense, 4096, 8, 0) == dense  # 4 tiles per split
    for page in (16, 256):
        paged = launch_decode.decode_tiles(4, 128, 128, torch.bfloat16, page)
        assert (paged.BLOCK_N, paged.num_stages, paged.per_sm, paged.key_page_ids) == (
            64, 2, 4, True)
        assert short(paged, 4096, 16, page) == paged  # 4 tiles per split
    # pages of 16: a 64-key tile spans 4 pages, each key's id however short the runs
    assert short(paged, 4096, 32, 16) == paged
    assert short(paged, 4096, 32, 256) == replace(paged, key_page_ids=False)
    # head dims above 128: dense 64 keys with 8 warps, paged 32 keys with each key's id
    dense = launch_decode.decode_tiles(4, 256, 256, torch.bfloat16, 0)
    assert (dense.BLOCK_N, dense.num_warps, dense.num_stages) == (64, 8, 3)
    paged = launch_decode.decode_tiles(4, 256, 256, torch.bfloat16, 16)
    assert (paged.BLOCK_N, paged.num_stages, paged.per_sm, paged.key_page_ids) == (
        32, 2, 4, True)
    # fp8 caches at D=128: 128 keys, 3 stages, 2 programs per SM, dense or paged
    for page in (0, 16, 256):
        fp8 = launch_decode.decode_tiles(4, 128, 128, torch.bfloat16, page, fp8_cache=True)
        assert (fp8.BLOCK_N, fp8.num_warps, fp8.num_stages, fp8.per_sm, fp8.key_page_ids) == (
            128, 4, 3, 2, page > 0)


@pytest.mark.parametrize("head", [64, 128, 256])
@pytest.mark.parametrize("rows", [4, 64])
@pytest.mark.parametrize("page", [0, 16, 256])
def test_decode_tiles_fit_every_shared_memory(decode_rules_on_gpus, head, rows, page):
    """fit_shared_memory: the tiles chosen on Hopper stay as they are there (227 KiB) and
    fit an A100's 163 KiB and a consumer GPU's 99 KiB, losing stages before keys."""
    launch_decode = decode_rules_on_gpus
    tiles = launch_decode.decode_tiles(rows, head, head, torch.bfloat16, page)
    fit = launch_decode.fit_shared_memory

    def needed(t):
        return 2 * (t.BLOCK_M * head + t.num_stages * t.BLOCK_N * 2 * head)

    hopper = 227 * 1024
    assert needed(tiles) <= hopper - 16 * 1024 or (head, rows) == (256, 64)
    if needed(tiles) <= hopper - 16 * 1024:
        assert fit(tiles, head, head, 2, hopper) == tiles
    for shared_memory in (hopper, 163 * 1024, 99 * 1024):
        limit = shared_memory - 16 * 1024
        t = fit(tiles, head, head, 2, shared_memory)
        assert needed(t) <= limit and t.BLOCK_N >= 16, (shared_memory, t)
        if t.BLOCK_N < tiles.BLOCK_N:  # stages go first, down to 2
            assert t.num_stages == 2 and needed(replace(t, BLOCK_N=2 * t.BLOCK_N)) > limit
        elif t.num_stages < tiles.num_stages:  # no more than needed
            assert needed(replace(t, num_stages=t.num_stages + 1)) > limit


@pytest.mark.parametrize("key_page_ids", [False, True])
@pytest.mark.parametrize("page", [16, 32])
def test_page_ids_per_tile_and_per_key(monkeypatch, key_page_ids, page):
    """The kernel's two ways to find a paged tile's keys, a tile's one page id and each
    key's, whichever the rules pick: causal with a window (edge tiles), lengths from empty
    to full, 1 and 3 splits."""
    from flashop._launch import kvcache as launch_decode
    tiles = launch_decode.decode_tiles
    monkeypatch.setattr(launch_decode, "decode_tiles",
                        lambda *a: replace(tiles(*a), key_page_ids=key_page_ids))
    monkeypatch.setattr(launch_decode, "short_run_tiles", lambda t, *a: t)
    for num_splits in (1, 3):
        check_cache_case(CacheCase((0, 37, 4 * page - 1), 2, 1, 2, 2, 32, 32, torch.float16,
                                   paged=True, page=page, capacity=4 * page, causal=True,
                                   window_size=(20, 0), num_splits=num_splits))


def test_grad_mode_off_accepts_inputs_that_require_grad():
    case = CacheCase((3, 5), 1, 0, 1, 2, 16, 16, torch.float32, capacity=8)
    (q, k_cache, v_cache, _, _), kwargs = make_call(case)
    with torch.no_grad():
        out = flashop.attention_with_kvcache(q.requires_grad_(), k_cache, v_cache, **kwargs)
    assert not out.requires_grad


# --- GPU only -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("paged,page", [(False, 0), (True, 16), (True, 256)])
@pytest.mark.parametrize("S_q,num_splits", [(1, 0), (1, 1), (4, 0), (33, 3)])
def test_gpu_bf16_long_caches(paged, page, S_q, num_splits):
    """bf16 on GPU tiles: lengths up to a full 4096-key cache, auto and forced splits,
    decode and chunked queries, GQA 4."""
    case = CacheCase((0, 1000, 4093 - S_q, 4096 - S_q), S_q, S_q, 8, 4, 128, 128,
                     torch.bfloat16, paged=paged, page=page or 16, capacity=4096,
                     causal=True, num_splits=num_splits)
    check_cache_case(case)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("num_splits", [0, 1, 7])
def test_gpu_bf16_long_caches_with_sinks(paged, num_splits):
    """bf16 sinks on GPU tiles over caches from empty to full: the sink counts once in
    the merge of auto and forced splits."""
    case = CacheCase((0, 1000, 4095), 1, 1, 8, 4, 128, 128, torch.bfloat16, paged=paged,
                     capacity=4096, causal=True, sinks=torch.bfloat16, num_splits=num_splits)
    check_cache_case(case)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("shared_memory", [0, 163 * 1024, 99 * 1024],
                         ids=["this-gpu", "163KiB", "99KiB"])
@pytest.mark.parametrize("paged,page", [(False, 0), (True, 16), (True, 256)])
@pytest.mark.parametrize("D,S_q", [(128, 1), (256, 1), (256, 16)])
def test_gpu_bf16_tiles_for_every_shared_memory(monkeypatch, shared_memory, paged, page, D,
                                                 S_q):
    """bf16 over 2048-key caches with the tiles as chosen for this GPU, and as fitted to an
    A100's (163 KiB) and a consumer GPU's (99 KiB) shared memory: each compiles, launches
    and agrees with the reference (D=256 with 16 queries of 4 heads: 64-row tiles)."""
    from flashop._launch import kvcache as launch_decode
    if shared_memory:
        monkeypatch.setattr(launch_decode, "max_shared_memory", lambda index: shared_memory)
    case = CacheCase((0, 700, 2048 - S_q), S_q, S_q, 2, 4, D, D, torch.bfloat16,
                     paged=paged, page=page or 16, capacity=2048, causal=True)
    check_cache_case(case)


def _step_fn(case: CacheCase):
    """A decode step on a fixed set of tensors: its inputs (updated in place between
    calls), its caches, and a function returning (out, lse)."""
    (q, k_cache, v_cache, k, v), kwargs = make_call(case)
    seqlens = kwargs.pop("cache_seqlens")

    def step():
        return flashop.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                              **kwargs, return_lse=True)
    return (q, k, v, seqlens), (k_cache, v_cache), step


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("paged", [False, True])
def test_cuda_graph_replays_over_growing_lengths_equal_eager(paged):
    """One CUDA graph of a decode step, replayed with new queries, keys and growing lengths
    written into its inputs, gives eager's outputs and caches bit for bit: the launch
    depends on no length."""
    case = CacheCase((5, 300, 0), 1, 1, 2, 4, 128, 128, torch.bfloat16, paged=paged,
                     page=16, capacity=1024, causal=True)
    inputs, caches, step = _step_fn(case)
    eager_inputs, eager_caches, eager_step = _step_fn(case)
    graph, captured = cuda_graph(step)
    for x, y in zip(caches, eager_caches):  # (after the warm-up's append)
        y.copy_(x)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for i in range(1, 40):
        for x, y in zip(inputs[:3], eager_inputs[:3]):
            x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
            y.copy_(x)
        inputs[3].copy_(torch.tensor([5 + i, 300 + 17 * i, i], dtype=torch.int32))
        eager_inputs[3].copy_(inputs[3])
        graph.replay()
        expected = eager_step()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(captured, expected))
        assert all(torch.equal(a, b) for a, b in zip(caches, eager_caches))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", [
    CacheCase((100, 2000), 1, 1, 2, 4, 128, 128, torch.bfloat16, paged=True, page=16,
              capacity=4096, causal=True, num_splits=4),
    CacheCase((100, 2000, 7), 4, 4, 2, 4, 128, 128, torch.bfloat16, capacity=4096,
              causal=True, rotary_dim=64, interleaved=False, leftpad=True, num_splits=4)],
    ids=["paged", "rotary-leftpad"])
def test_inductor_launches_the_decode_kernels(case):
    """Under torch.compile the op is a triton_op: Inductor's code launches the append,
    split-KV and merge kernels itself (no opaque call), with eager's results and caches (the
    keys rotated in the append) bit for bit."""
    from torch._inductor.utils import run_and_get_code

    (q, k_cache, v_cache, k, v), kwargs = make_call(case)
    caches = k_cache.clone(), v_cache.clone()
    expected = flashop.attention_with_kvcache(q, k_cache, v_cache, k, v, **kwargs,
                                              return_lse=True)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda *a: flashop.attention_with_kvcache(*a, **kwargs, return_lse=True),
        fullgraph=True)
    result, code = run_and_get_code(lambda: compiled(q, *caches, k, v))
    code = "\n".join(code)
    for kernel in ("kvcache_append_kernel", "attention_decode_kernel",
                   "attention_decode_merge_kernel"):
        assert kernel in code, f"{kernel} not in Inductor's code"
    assert "flashop.attention_with_kvcache" not in code
    assert all(torch.equal(a, b) for a, b in zip(result, expected))
    assert torch.equal(caches[0], k_cache) and torch.equal(caches[1], v_cache)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_bf16_outputs_round_to_nearest_as_a_gpu_does(num_splits):
    """Zero queries over 64 keys whose values are zero but in the first and last key: every
    probability is 1/64, so the output, (v_0 + v_63) / 64, is exact in fp32 (split or not),
    and its bf16 store must round it to nearest, as a GPU's cast does (under the
    interpreter a plain cast truncates)."""
    B, L, H, D = 1, 64, 2, 64
    gen = torch.Generator().manual_seed(0)
    v_cache = torch.zeros(B, L, H, D, dtype=torch.bfloat16)
    v_cache[:, [0, L - 1]] = torch.randn(B, 2, H, D, generator=gen).to(torch.bfloat16)
    k_cache = torch.randn(B, L, H, D, generator=gen).to(torch.bfloat16)
    q = torch.zeros(B, 1, H, D, dtype=torch.bfloat16)
    seqlens = torch.full((B,), L, dtype=torch.int32)
    out = flashop.attention_with_kvcache(
        q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), cache_seqlens=seqlens.to(DEVICE),
        num_splits=num_splits)
    exact = (v_cache[:, 0].float() + v_cache[:, L - 1].float()) / L
    assert torch.equal(out[:, 0].cpu(), exact.to(torch.bfloat16))
