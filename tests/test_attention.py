"""flashop.attention against the fp64 reference: Hypothesis-drawn cases and edge cases."""

import functools
import itertools
import sys
from dataclasses import replace
from unittest import mock

import pytest
import torch
from hypothesis import example, given, strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import flashop
from flashop._launch.problem import PLAIN_FLAGS
from flashop._launch import attention as launch, choice, gluon as launch_gluon, plans, tiles
from flashop.kernels import INTERPRETING
from flashop.kernels.common import LOG2E
from flashop._launch.tiles import Tiles
from flashop._launch.common import block_dim, head_blocks, is_hopper
from helpers import (
    CPU_PATH_TWIN, DEVICE, TWO_KEY_TILES, TWO_QUERY_TILES, Case, check_case, cpu_path,
    deterministic_algorithms, edge_offset_keys, gluon_cases, head_counts, input_scales, lengths,
    make_inputs, poisoned_outputs, run_flashop,
)

ON_GPU = DEVICE == "cuda"
# The interpreter runs every program in numpy, one after another: small shapes there.
MAX_SEQ = 600 if ON_GPU else 64
MAX_HEADS = 12 if ON_GPU else 3  # batch entries times heads
HEAD_DIMS = [1, 8, 16, 24, 40, 59, 64, 80, 96, 111, 128]
if ON_GPU:
    HEAD_DIMS += [160, 192, 224, 256]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@st.composite
def cases(draw):
    """A call in the test's dtype (Case.in_dtype): lengths past two tiles of every kernel in
    most draws (at tile edges, or with a causal offset S_k - S_q at one, in many), up to
    MAX_HEADS batch entries times heads, group ratios, head dims (odd ones), v head dims,
    causal, strided layouts, scales and large scores, dQ by its kernel or by atomics."""
    D = draw(st.sampled_from(HEAD_DIMS))
    B, H_kv, G = head_counts(draw, MAX_HEADS)
    S_q = draw(lengths(TWO_QUERY_TILES, MAX_SEQ))
    return Case(
        B=B, S_q=S_q, S_k=draw(st.one_of(lengths(TWO_KEY_TILES, MAX_SEQ),
                                         edge_offset_keys(S_q, TWO_KEY_TILES, MAX_SEQ))),
        H_kv=H_kv, G=G, D=D,
        DV=draw(st.one_of(st.just(D), st.sampled_from(HEAD_DIMS))),
        dtype=None,
        causal=draw(st.booleans()),
        layout=draw(st.sampled_from(["contiguous", "bhsd", "padded"])),
        dq_atomics=draw(st.booleans()),
        **input_scales(draw, D),
    )


@pytest.mark.parametrize("dtype", DTYPES)  # one test per dtype: they run in parallel
@given(case=cases(), seed=st.integers(0, 2**16))
@example(case=Case(B=1, S_q=1, S_k=70, H_kv=1, G=2, D=40, DV=40, dtype=None), seed=0)
@example(case=Case(B=2, S_q=45, S_k=1, H_kv=1, G=1, D=16, DV=24, dtype=None), seed=0)
@example(case=Case(B=1, S_q=20, S_k=0, H_kv=1, G=2, D=16, DV=16, dtype=None), seed=0)
@example(case=Case(B=1, S_q=0, S_k=20, H_kv=1, G=1, D=16, DV=16, dtype=None), seed=0)
def test_matches_reference(dtype, case, seed):
    """Drawn calls, and the edges: one query, one key, no key, no query."""
    check_case(case.in_dtype(dtype), seed)


# Where the Gluon kernels are the default (Hopper, triton 3.6), plain 16-bit calls at head
# dims 64 and 128 take them; the `tl` kernels, which every other stack runs, are drawn here
# with the same cases, forced (gluon=False), so that both stay covered on the GPU. (Elsewhere
# the `tl` kernels are the default and test_matches_reference draws them.)
@pytest.mark.skipif(not (ON_GPU and launch_gluon.available(torch.device(DEVICE))),
                    reason="the `tl` kernels are the default here: test_matches_reference")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@given(case=cases(), seed=st.integers(0, 2**16))
def test_tl_kernels_match_reference_where_gluon_is_the_default(dtype, case, seed):
    with flashop.config.override(gluon=False):
        check_case(case.in_dtype(dtype), seed)


@CPU_PATH_TWIN
@pytest.mark.parametrize("dtype", DTYPES)
@given(case=cases(), seed=st.integers(0, 2**16), sdpa=st.booleans(),
       tile=st.sampled_from([256, 4096]))
@example(case=Case(B=1, S_q=1, S_k=70, H_kv=1, G=2, D=40, DV=40, dtype=None), seed=0,
         sdpa=True, tile=256)
@example(case=Case(B=2, S_q=45, S_k=1, H_kv=1, G=1, D=16, DV=24, dtype=None), seed=0,
         sdpa=False, tile=256)
@example(case=Case(B=1, S_q=20, S_k=0, H_kv=1, G=2, D=16, DV=16, dtype=None), seed=0,
         sdpa=True, tile=4096)
@example(case=Case(B=1, S_q=0, S_k=20, H_kv=1, G=1, D=16, DV=16, dtype=None), seed=0,
         sdpa=True, tile=256)
def test_cpu_path_matches_reference(dtype, case, seed, sdpa, tile):
    """The CPU path on the same calls: SDPA's kernels where they take a call (plain, one
    head dim; ``sdpa``), the blocked path elsewhere, over tiles of 16 keys in parts of
    ``tile`` scores (one or several heads)."""
    with cpu_path(tile, sdpa):
        check_case(case.in_dtype(dtype), seed)


_LARGE_SCORES = dict(scale=1.0, magnitude=2.0, outlier_keys=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_scores_and_outlier_keys(dtype):
    """Scores in the hundreds, as real models give (scale 1, q and k of standard deviation
    2, two keys per head 20-50x the others' norm), so that most rows' probability sits on one
    key. Each kernel must compute P as the others do (choice.folds_scale): in fp32 the scale
    folded into the exponent's FMA made P of such a key 1 - 2e-5 in the backward against the
    stored lse, and dq left the rule (1.1e-2 against 2.7e-3 under the interpreter, 1.7e-2 on
    an H200); under the interpreter, casts to bf16 that truncated (common.round_to) put bf16's
    dq at 36 against 14."""
    check_case(Case(B=1, S_q=40, S_k=50, H_kv=1, G=2, D=64, DV=64, dtype=dtype, causal=True,
                    **_LARGE_SCORES), seed=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_tile_boundaries(dtype, causal):
    """Lengths one off the interpreter's and the GPU's tiles, S_q != S_k, grouped heads."""
    check_case(Case(B=1, S_q=33, S_k=129, H_kv=2, G=2, D=64, DV=64, dtype=dtype, causal=causal))
    check_case(Case(B=1, S_q=129, S_k=31, H_kv=1, G=3, D=40, DV=24, dtype=dtype, causal=causal))


TMA_CASES = [
    Case(B=2, S_q=33, S_k=70, H_kv=2, G=2, D=40, DV=24, dtype=torch.float16, causal=True),
    Case(B=1, S_q=50, S_k=37, H_kv=1, G=3, D=64, DV=64, dtype=torch.bfloat16,
         window_size=(9, 4), softcap=5.0, alibi=(3,)),
    Case(B=1, S_q=20, S_k=45, H_kv=1, G=1, D=16, DV=16, dtype=torch.float16, layout="bhsd",
         causal=True, gate=torch.float32),
]
if ON_GPU:
    TMA_CASES.append(Case(B=1, S_q=300, S_k=513, H_kv=1, G=2, D=160, DV=160,
                          dtype=torch.bfloat16, causal=True))


@pytest.mark.parametrize("case", TMA_CASES, ids=lambda c: f"D{c.D}-DV{c.DV}-{c.layout}")
def test_tl_kernels_through_tensor_descriptors(case):
    """The forward's key and value tiles and the backward's loop tiles (the dQ kernel's keys
    and values, the dK/dV kernel's queries and dO) through tensor descriptors
    (FLASHOP_TMA=1): rows past S_q or S_k and columns past D read as 0, GQA, a head-major
    layout, modifiers."""
    with flashop.config.override(tma=True):
        q, k, v = make_inputs(case)[0]
        assert choice.uses_tma(q, k, v, max(case.D, case.DV), case.S_k)  # aligned inputs
        assert choice.backward_uses_tma(q, k, v, q, max(case.D, case.DV), case.S_k, False)
        check_case(case)


def test_tensor_descriptors_need_aligned_rows():
    uses = choice.uses_tma
    q = torch.randn(1, 8, 2, 16, device=DEVICE, dtype=torch.float16)
    k = torch.randn(1, 8, 2, 20, device=DEVICE, dtype=torch.float16)[..., :12]  # 40-byte rows
    with flashop.config.override(tma=True):
        assert uses(q, q, q, 16, 8)
        assert not uses(q, k, q, 16, 8)
        assert not uses(q, q[..., 4:], q, 16, 8)  # an 8-byte offset start
        assert not uses(q.float(), q.float(), q.float(), 16, 8)
    with flashop.config.override(tma=False):
        assert not uses(q, q, q, 256, 8192)


@pytest.mark.parametrize("hopper", [False, True])
def test_tensor_descriptors_by_default_above_head_dim_128_on_hopper(hopper, monkeypatch):
    """FLASHOP_TMA unset: descriptors at head dims above 128 over at least TMA_MIN_KEYS keys
    (or a symbolic length) on Hopper GPUs only, where they measured faster; never on a CPU.
    The backward's rule (backward_uses_tma) adds q and dout's alignment, and leaves out the
    head dim in two tiles unless FLASHOP_TMA=1."""
    monkeypatch.setattr(choice, "is_hopper", lambda device: hopper)
    by_default = choice._tma_by_default
    cuda, n = torch.device("cuda", 0), choice.TMA_MIN_KEYS
    assert [by_default(d, n, cuda) for d in (64, 128, 129, 256)] == [False, False, hopper, hopper]
    assert not by_default(256, n - 1, cuda)
    symbolic = ShapeEnv().create_unbacked_symint()  # a length under torch.compile
    assert by_default(256, symbolic, cuda) == hopper
    assert not by_default(256, n, torch.device("cpu"))
    q = torch.randn(1, 8, 2, 16, device=DEVICE, dtype=torch.float16)
    with flashop.config.override(tma=None):
        assert choice.uses_tma(q, q, q, 256, n) == (hopper and q.is_cuda)
        assert not choice.uses_tma(q, q, q, 128, n)
    # the backward: the same rule, but by default not where the head dim is in two tiles
    backward = choice.backward_uses_tma
    with flashop.config.override(tma=None):
        assert backward(q, q, q, q, 256, n, False) == (hopper and q.is_cuda)
        assert not backward(q, q, q, q, 192, n, True)
        assert not backward(q, q, q, q, 128, n, False)
    with flashop.config.override(tma=True):
        assert backward(q, q, q, q, 192, n, True)
        assert not backward(q, q, q, q[..., 4:], 256, n, False)  # dout's start unaligned
        assert not backward(q[..., 4:], q, q, q, 256, n, False)


# Under the interpreter the warp-specialized kernel's tile is 32 x 16 (its loop is a plain
# loop there); on a GPU 256 x 128: S_k a multiple of 16, resp. 128
_WS_N = 128 if ON_GPU else 16
WS_CASES = [
    Case(B=2, S_q=45, S_k=4 * _WS_N, H_kv=2, G=2, D=64, DV=64, dtype=torch.float16),
    Case(B=1, S_q=33, S_k=3 * _WS_N, H_kv=1, G=3, D=40, DV=24, dtype=torch.bfloat16,
         layout="bhsd"),
    Case(B=2, S_q=1, S_k=_WS_N, H_kv=1, G=1, D=128, DV=128, dtype=torch.bfloat16,
         layout="bhsd", scale=-0.05),
    Case(B=1, S_q=70, S_k=2 * _WS_N, H_kv=1, G=2, D=128, DV=128, dtype=torch.float16),
]


def _takes_ws(case: Case) -> bool:
    q, k, v = make_inputs(case)[0]
    flags = PLAIN_FLAGS[case.causal]
    return choice.uses_ws(q, k, v, flags, max(case.D, case.DV), case.S_k, False)


@pytest.mark.parametrize("case", WS_CASES, ids=lambda c: f"D{c.D}-DV{c.DV}-{c.layout}")
def test_forward_with_its_warp_specialized_kernel(case):
    """attention_fwd_ws_kernel (FLASHOP_WS=1): GQA, both query layouts it reads, DV != D,
    rows past S_q (the next sequence's, computed and not stored), one query, a negative
    scale (not folded)."""
    with flashop.config.override(warp_specialize=True):
        assert _takes_ws(case)
        check_case(case)


def test_where_the_warp_specialized_kernel_runs():
    """Dense 16-bit inputs without modifiers and S_k a multiple of its BLOCK_N; by default
    only on Hopper GPUs (never on a CPU), and not with FLASHOP_WS=0."""
    base = Case(B=1, S_q=40, S_k=2 * _WS_N, H_kv=1, G=2, D=64, DV=64, dtype=torch.float16)
    with flashop.config.override(warp_specialize=True):
        assert _takes_ws(base)
        for other in (dict(S_k=2 * _WS_N + 1), dict(causal=True), dict(dtype=torch.float32),
                      dict(D=80, DV=80)):  # (batch, seq) rows whose D is not a block width
            assert not _takes_ws(replace(base, **other)), other
        assert _takes_ws(replace(base, D=80, DV=80, layout="bhsd"))
        q, k, v = make_inputs(base)[0]
        modifiers = PLAIN_FLAGS[False]
        for flag in ("HAS_LEFT", "HAS_SOFTCAP", "HAS_ALIBI", "HAS_GATE", "ATTN_MASK_KIND"):
            flags = {**modifiers, flag: True}
            assert not choice.uses_ws(q, k, v, flags, 64, base.S_k, False), flag
        assert not choice.uses_ws(q, k, v, modifiers, 64, base.S_k, True)  # packed
        symbolic = ShapeEnv().create_unbacked_symint()  # a length under torch.compile
        assert not choice.uses_ws(q, k, v, modifiers, 64, symbolic, False)
    with flashop.config.override(warp_specialize=False):
        assert not _takes_ws(base)
    with flashop.config.override(warp_specialize=None):
        on_hopper = ON_GPU and torch.cuda.get_device_capability()[0] >= 9
        assert _takes_ws(replace(base, D=128, DV=128)) == on_hopper
        assert not _takes_ws(base)  # D = 64: slower there


def test_the_warp_specialized_kernels_query_layouts():
    layout = choice.ws_query_layout
    x = torch.empty(2, 10, 4, 128)
    assert layout(x) is False  # (batch, seq) rows of 4 heads
    assert layout(torch.empty(2, 10, 3, 4, 128)[:, :, 1]) is False  # q of a packed qkv
    assert layout(torch.empty(2, 4, 10, 128).transpose(1, 2)) is True  # head-major
    assert layout(torch.empty(2, 10, 4, 80)) is None  # a tile would cross into the next head
    assert layout(torch.empty(2, 4, 10, 80).transpose(1, 2)) is True
    assert layout(torch.empty(2, 10, 4, 136)[..., :128]) is None  # heads not side by side
    assert layout(torch.empty(2, 12, 4, 128)[:, :10]) is None  # sequences not back to back
    assert layout(torch.empty(1, 12, 4, 128)[:, :10]) is False  # ... unless one
    assert layout(torch.empty(2, 4, 12, 80).transpose(1, 2)[:, :10]) is None


# The Gluon forward runs on Hopper GPUs under the Triton release it was written for; there
# the switch forces it wherever the inputs allow, and the same accuracy rule applies.
GLUON = ON_GPU and launch_gluon.available(torch.device(DEVICE))


def _takes_gluon(case: Case) -> bool:
    q, k, v = make_inputs(case)[0]
    qk_scale = (case.scale if case.scale is not None else case.D ** -0.5) * LOG2E.value
    return launch_gluon.serves(q, k, v, case.causal, qk_scale, plain=True)


@pytest.mark.skipif(not GLUON, reason="the Gluon forward needs a Hopper GPU and triton 3.6 "
                                      "(Triton's interpreter cannot run Gluon)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_gluon_forward_matches_reference(dtype, data, seed):
    """The Gluon forward (FLASHOP_GLUON=1) on its inputs: head dims 64, 128, 256 and 192 / 128
    (q's and k's head dim in two tiles), causal and not, any lengths (tail tiles of queries
    and keys), GQA, two layouts, any positive scale; its lse feeds the tl backward. Its
    grid, one program per SM, is drawn smaller too, so that each program takes several work
    units (its buffers carried from one to the next)."""
    case = data.draw(gluon_cases(dtype, tuple(launch_gluon.FWD_VALUE_DIMS.items())))
    programs = data.draw(st.sampled_from([None, 1, 2, 5]), label="programs")
    sm_count = launch_gluon.sm_count if programs is None else (lambda device: programs)
    with mock.patch.object(launch_gluon, "attention_forward",
                           wraps=launch_gluon.attention_forward) as launched, \
            mock.patch.object(launch_gluon, "sm_count", sm_count):
        with flashop.config.override(gluon=True):
            assert _takes_gluon(case)
            plans.clear_plans()  # (a plan made under another sm_count would not launch)
            check_case(case, seed)
    assert launched.called  # the Gluon kernel computed the forward checked


def _takes_gluon_backward(case: Case, deterministic: bool = False,
                          dropout: bool = False) -> bool:
    q, k, v = make_inputs(case)[0]
    return launch_gluon.serves_backward(q, k, v, torch.empty_like(q), case.causal, plain=True,
                                        deterministic=deterministic, dropout=dropout)


@pytest.mark.skipif(not GLUON, reason="the Gluon kernels need a Hopper GPU and triton 3.6 "
                                      "(Triton's interpreter cannot run Gluon)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_large_scores_and_outlier_keys(dtype, D):
    """The same inputs through the Gluon forward and backward (dQ by atomics)."""
    case = Case(B=1, S_q=300, S_k=300, H_kv=1, G=2, D=D, DV=D, dtype=dtype, causal=True,
                **_LARGE_SCORES)
    with mock.patch.object(launch_gluon, "attention_forward",
                           wraps=launch_gluon.attention_forward) as forward, \
            mock.patch.object(launch_gluon, "attention_backward",
                              wraps=launch_gluon.attention_backward) as backward, \
            flashop.config.override(gluon=True, dq_atomics=True):
        assert _takes_gluon(case) and _takes_gluon_backward(case)
        plans.clear_plans()  # (a replayed plan would not call the launchers watched)
        check_case(case, seed=1, deterministic_backward=False)
    assert forward.called and backward.called


@pytest.mark.skipif(not GLUON, reason="the Gluon backward needs a Hopper GPU and triton 3.6 "
                                      "(Triton's interpreter cannot run Gluon)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_gluon_backward_matches_reference(dtype, data, seed):
    """The Gluon backward (dQ by atomics, FLASHOP_DQ_ATOMICS=1) on its inputs: head dims 64
    and 128, causal and not, any lengths (tail tiles of queries and keys), GQA, two
    layouts, any positive scale, after whichever forward the default rule picks."""
    case = data.draw(gluon_cases(dtype, launch_gluon.BWD_HEAD_DIMS))
    # each group's query heads in one program, or split between several (dK and dV summed
    # by atomics), whatever the rule would pick for the grid
    split = data.draw(st.sampled_from([s for s in range(1, case.G + 1) if case.G % s == 0]))
    with mock.patch.object(launch_gluon, "attention_backward",
                           wraps=launch_gluon.attention_backward) as launched, \
            mock.patch.object(launch_gluon, "backward_split", return_value=split), \
            flashop.config.override(dq_atomics=True):
        assert _takes_gluon_backward(case)
        plans.clear_plans()  # (a replayed plan would not call the launcher watched)
        check_case(case, seed, deterministic_backward=False)
    assert launched.called  # the Gluon kernel computed the gradients checked
    assert all(call.args[7] is None and call.kwargs["split"] == split  # no counters
               for call in launched.call_args_list)


@pytest.mark.skipif(not GLUON, reason="the Gluon backward needs a Hopper GPU and triton 3.6 "
                                      "(Triton's interpreter cannot run Gluon)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_gluon_deterministic_backward_matches_reference(dtype, data, seed):
    """The Gluon backward with dQ's adds in key-tile order (the default backward's, here
    forced on with FLASHOP_GLUON=1) on the same inputs; a second run equals the first bit
    for bit."""
    case = data.draw(gluon_cases(dtype, launch_gluon.BWD_HEAD_DIMS))
    with mock.patch.object(launch_gluon, "attention_backward",
                           wraps=launch_gluon.attention_backward) as launched:
        with flashop.config.override(gluon=True):
            assert _takes_gluon_backward(case, deterministic=True)
            plans.clear_plans()  # (a replayed plan would not call the launcher watched)
            check_case(case, seed)
            inputs, dout, dlse = make_inputs(case, seed)
            first = run_flashop(case, inputs, dout, dlse)[2]
            second = run_flashop(case, inputs, dout, dlse)[2]
    assert launched.called and all(call.args[7] is not None  # the counters
                                   for call in launched.call_args_list)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.skipif(not GLUON, reason="the Gluon backward needs a Hopper GPU and triton 3.6 "
                                      "(Triton's interpreter cannot run Gluon)")
@pytest.mark.parametrize("S_q,S_k,H_kv,G", [
    (1000, 1000, 2, 2), (1100, 2100, 1, 3), (2100, 777, 2, 1), (4096, 4096, 1, 2),
    (132 * launch_gluon.BWD_BLOCK_M, 132 * launch_gluon.BWD_BLOCK_N, 1, 1)],
    ids=["tails-gqa", "as-many-query-tiles", "more-query-tiles", "4k", "a-tile-per-sm"])
def test_gluon_rotated_backward(monkeypatch, S_q, S_k, H_kv, G):
    """Not causal at D = 128, the deterministic Gluon backward rotated (each key tile of a
    (batch, KV head) starts on its own query tile; dQ's adds in the order they reach it):
    as many query tiles as key tiles (18 and 17) and more, GQA, tails, and as many key
    tiles as the H200 has SMs (all resident at once, each waiting on others). Against the
    reference; three runs bitwise equal; dQ not equal to key-tile order's (BWD_ROTATE off)
    bit for bit: its adds ran in the rotated order."""
    case = Case(B=2, S_q=S_q, S_k=S_k, H_kv=H_kv, G=G, D=128, DV=128, dtype=torch.bfloat16,
                causal=False)
    if launch_gluon.cdiv(S_k, launch_gluon.BWD_BLOCK_N) > launch_gluon.sm_count(
            torch.device(DEVICE)):
        pytest.skip("more key tiles than this GPU's SMs: the rotation does not take them")
    assert launch_gluon.backward_rotates(False, 128, S_q, S_k, torch.device(DEVICE))
    rule, answers = launch_gluon.backward_rotates, []
    monkeypatch.setattr(launch_gluon, "backward_rotates",
                        lambda *args: answers.append(rule(*args)) or answers[-1])
    with flashop.config.override(gluon=True):
        assert _takes_gluon_backward(case, deterministic=True)
        plans.clear_plans()  # (a replayed plan would not ask the rule)
        check_case(case, seed=3)
        inputs, dout, dlse = make_inputs(case, seed=3)
        runs = [run_flashop(case, inputs, dout, dlse)[2] for _ in range(3)]
        assert answers and all(answers), "the deterministic backward did not run rotated"
        monkeypatch.setattr(launch_gluon, "BWD_ROTATE", False)
        plans.clear_plans()
        ordered = run_flashop(case, inputs, dout, dlse)[2]
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))
    # (dK and dV differ too: each program's sums over query tiles start elsewhere)
    assert not torch.equal(runs[0][0], ordered[0]), "dQ summed in key-tile order"


def test_where_the_gluon_backward_rotates(monkeypatch):
    """The rotation's rule: not causal, at BWD_ROTATE_DIMS, no more key tiles than the GPU's
    SMs (every key tile of a (batch, KV head) must be resident at once: each may wait on
    any other), and at least as many query tiles as key tiles. The backward's choice asks
    it where dQ goes in a fixed order, and says which order (flashop.explain's backward;
    the Gluon kernels taken as available, nothing launched): rotated, key-tile order where
    the rule declines, by atomics where the backward need not be reproducible."""
    monkeypatch.setattr(launch_gluon, "sm_count", lambda device: 132)
    rotates, cuda = launch_gluon.backward_rotates, torch.device("cuda")
    keys = 132 * launch_gluon.BWD_BLOCK_N
    assert rotates(False, 128, keys, keys, cuda) and rotates(False, 128, 1, 1, cuda)
    assert rotates(False, 128, 64 * 33, 128 * 33, cuda)  # 33 query and key tiles
    assert not rotates(False, 128, 64 * 32, 128 * 33, cuda)  # 32 query tiles, 33 keys'
    assert not rotates(False, 128, keys + 1, keys + 1, cuda)  # 133 key tiles
    assert not rotates(True, 128, 4096, 4096, cuda)  # causal: from the last query down
    assert not rotates(False, 64, 4096, 4096, cuda)  # measured slower there

    monkeypatch.setattr(launch_gluon, "unavailable", lambda device: None)

    def told(S, causal=False, deterministic=True, D=128):
        q = torch.randn(1, S, 2, D, dtype=torch.bfloat16, device=DEVICE)
        with flashop.config.override(gluon=True):
            return flashop.explain(flashop.attention, q, q, q, causal=causal,
                                   deterministic=deterministic).backward

    rotated = told(1024)
    assert rotated.path == "Gluon backward, dQ added in a rotated order" and rotated.rotated
    for backward in (told(1024, causal=True), told(1024, D=64), told(keys + 1)):
        assert backward.path == "Gluon backward, dQ added in key-tile order", backward
        assert backward.ordered and not backward.rotated
    atomics = told(1024, deterministic=False)
    assert atomics.path == "Gluon backward, dQ added by atomics" and not atomics.rotated
    monkeypatch.setattr(launch_gluon, "BWD_ROTATE", False)
    assert not rotates(False, 128, 4096, 4096, cuda) and not told(1024).rotated


def test_the_gluon_backward_launches_the_order_its_choice_says(monkeypatch):
    """The launch takes the rotation the backward's choice made (the kernels taken as
    available, the Gluon launch recorded, not made): rotated not causal, key-tile order
    causal, the counters given either way."""
    monkeypatch.setattr(launch_gluon, "unavailable", lambda device: None)
    monkeypatch.setattr(launch_gluon, "sm_count", lambda device: 132)
    launched = mock.Mock()
    monkeypatch.setattr(launch_gluon, "attention_backward", launched)
    for causal in (False, True):
        q = torch.randn(1, 256, 2, 128, dtype=torch.bfloat16, device=DEVICE,
                        requires_grad=True)
        with flashop.config.override(gluon=False):  # (the forward: the tl kernel)
            out = flashop.attention(q, q, q, causal=causal, deterministic=True)
        plans.clear_plans()
        with flashop.config.override(gluon=True):
            out.sum().backward()
        assert launched.call_args.kwargs["rotate"] is (not causal)
        assert launched.call_args.args[7] is not None  # dQ's counters


def _rotated_schedule(n_tiles: int, n_qt: int, in_flight: float) -> float:
    """The rotated order as kernels/backward_gluon.py computes it (key tile j starts on
    query tile j * n_qt // n_tiles; its turn at query tile m is (j0 - j) mod n_tiles, j0
    the last key tile to start on m or before), run on a model of the GPU: all key tiles
    at once, a step of work each per query tile, an add complete ``in_flight`` steps after
    it is made, a key tile adding only once the one before it in the tile's order has.
    Returns the steps taken per query tile (1: no key tile ever waited)."""
    start = [j * n_qt // n_tiles for j in range(n_tiles)]

    def turn(j, m):
        j0 = min(((m + 1) * n_tiles + n_qt - 1) // n_qt - 1, n_tiles - 1)
        return (j0 - j) % n_tiles

    for m in range(n_qt):  # each query tile takes every key tile's add once
        assert sorted(turn(j, m) for j in range(n_tiles)) == list(range(n_tiles)), m
    added, clock, step = {}, [0.0] * n_tiles, [0] * n_tiles
    while any(s < n_qt for s in step):
        moved = False
        for j in range(n_tiles):
            if step[j] == n_qt:
                continue
            m = (start[j] + step[j]) % n_qt
            ready = clock[j] + 1
            if turn(j, m):
                before = added.get((m, turn(j, m) - 1))
                if before is None:
                    continue
                ready = max(ready, before)
            added[(m, turn(j, m))] = ready + in_flight
            clock[j], step[j], moved = ready, step[j] + 1, True
        assert moved, "the key tiles wait on each other: a deadlock"
    return max(clock) / n_qt


def test_the_rotated_order():
    """The rotated backward's order of dQ's adds, on a model of the GPU: each query tile
    takes every key tile's add once, no shape deadlocks, and where the query tiles are at
    least as many as the key tiles (where the rule rotates; self-attention has twice as
    many) none waits longer than an add in flight; in key-tile order from one start, key
    tile j would start j steps late. With fewer query tiles (where the rule does not
    rotate) key tiles share a start and wait on each other there. (The model mirrors
    _dq_turn and the kernel's start tiles; the GPU test test_gluon_rotated_backward runs
    the kernel.)"""
    for n_tiles, n_qt in ((1, 1), (1, 7), (8, 16), (32, 64), (132, 264), (7, 13), (5, 5)):
        assert _rotated_schedule(n_tiles, n_qt, in_flight=0.5) == 1.0, (n_tiles, n_qt)
    assert _rotated_schedule(16, 4, in_flight=0.5) > 2
    for n_tiles, n_qt, in_flight in itertools.product((2, 9, 31), (1, 4, 40), (0.0, 3.0)):
        _rotated_schedule(n_tiles, n_qt, in_flight)


def test_the_gluon_backward_splits_query_heads_on_small_grids(monkeypatch):
    """dQ by atomics, a grouped-query call splits each group's query heads between
    programs (a divisor of G): where causal, the fewest that bring the grid (key tiles x
    batch x KV heads) to BWD_SPLIT_PROGRAMS per SM, or G; where not, the most that keep it
    within one program per SM. In key-tile order, or with one query head per KV head,
    never; never past the grid's bound."""
    monkeypatch.setattr(launch_gluon, "sm_count", lambda device: 132)
    monkeypatch.setattr(launch_gluon, "BWD_SPLIT_PROGRAMS", 16)  # 2112 programs

    def split(B, S, H, H_kv, causal=True, deterministic=False):
        q = torch.empty(B, S, H, 128, device="meta")
        k = torch.empty(B, S, H_kv, 128, device="meta")
        return launch_gluon.backward_split(q, k, causal, deterministic)

    assert split(1, 4096, 16, 4) == 4  # 128 programs; 512 with each head alone
    assert split(8, 4096, 16, 4) == 4  # 1024 -> 2048, 4096
    assert split(16, 4096, 16, 4) == 2  # 2048 -> 4096
    assert split(32, 4096, 16, 4) == 1  # 4096
    assert split(1, 4096, 24, 4) == 6  # 128 -> 256, 384, 768
    assert split(5, 6400, 24, 4) == 3  # 1000 -> 2000, 3000
    assert split(1, 4000, 16, 4) == 4  # a tail tile counts: 128 programs
    assert split(1, 4096, 16, 4, causal=False) == 1  # 128 programs: 256 > 132
    assert split(1, 2048, 16, 4, causal=False) == 2  # 64 -> 128
    assert split(1, 1024, 16, 4, causal=False) == 4  # 32 -> 64, 128
    assert split(1, 4096, 16, 16) == 1  # no group to split
    assert split(1, 4096, 16, 4, deterministic=True) == 1
    assert split(1, 1024, 16, 4, causal=False, deterministic=True) == 1
    assert split(1, 128, 10, 1) == 10
    monkeypatch.setattr(launch_gluon, "MAX_GRID_Y", 6)  # the grid's bound on B * H_kv * split
    assert split(1, 128, 10, 1) == 5
    assert split(7, 128, 14, 7) == 1


def test_where_the_gluon_backward_runs(monkeypatch):
    """Plain dense 16-bit calls at D = 64 and 128 (S_q == S_k where causal) with 16-byte
    aligned strides: with dQ by atomics by default from launch_gluon.BWD_ATOMIC_MIN_KEYS
    keys and wherever the inputs allow where the atomics are forced, with dQ in key-tile
    order by default from launch_gluon.BWD_MIN_KEYS keys; never a traced call, never with
    the switch off, and nowhere the kernel is unavailable (here: this run's device)."""
    base = Case(B=1, S_q=40, S_k=256, H_kv=1, G=2, D=128, DV=128, dtype=torch.bfloat16)
    causal = replace(base, causal=True, S_q=256)
    atomics = functools.partial(flashop.config.override, dq_atomics=True)
    with atomics():
        assert _takes_gluon_backward(causal) == GLUON
    if not ON_GPU:
        assert "flashop.kernels.backward_gluon" not in sys.modules
    monkeypatch.setattr(launch_gluon, "unavailable", lambda device: None)
    for case in (base, causal, replace(base, layout="bhsd", dtype=torch.float16),
                 replace(base, S_k=1, S_q=1), replace(base, scale=-0.1),
                 replace(base, D=64, DV=64)):
        with atomics():
            assert _takes_gluon_backward(case), case
        with flashop.config.override(gluon=True):
            assert _takes_gluon_backward(case, deterministic=True), case
    for other in (dict(causal=True), dict(D=96, DV=96), dict(D=256, DV=256), dict(DV=64),
                  dict(dtype=torch.float32), dict(layout="padded")):
        with atomics():
            assert not _takes_gluon_backward(replace(base, **other)), other
        with flashop.config.override(gluon=True):
            assert not _takes_gluon_backward(replace(base, **other), deterministic=True)
    for (D, is_causal), keys in launch_gluon.BWD_ATOMIC_MIN_KEYS.items():  # the default
        case = replace(base, D=D, DV=D, causal=is_causal, S_k=keys, S_q=keys)
        assert _takes_gluon_backward(case), case
        shorter = replace(case, S_k=keys - 1, S_q=keys - 1)
        assert not _takes_gluon_backward(shorter), shorter
    for (D, is_causal), keys in launch_gluon.BWD_MIN_KEYS.items():  # in order, by default
        case = replace(base, D=D, DV=D, causal=is_causal, S_k=keys, S_q=keys)
        assert _takes_gluon_backward(case, deterministic=True), case
        shorter = replace(case, S_k=keys - 1, S_q=keys - 1)
        assert not _takes_gluon_backward(shorter, deterministic=True), shorter
    for (D, is_causal), keys in launch_gluon.BWD_DROPOUT_MIN_KEYS.items():  # with dropout
        case = replace(base, D=D, DV=D, causal=is_causal, S_k=keys, S_q=keys)
        for deterministic in (False, True):
            assert _takes_gluon_backward(case, deterministic, dropout=True), case
            shorter = replace(case, S_k=keys - 1, S_q=keys - 1)
            assert not _takes_gluon_backward(shorter, deterministic, dropout=True), shorter
            with flashop.config.override(gluon=True):
                assert _takes_gluon_backward(shorter, deterministic, dropout=True), shorter
    for D, is_causal in ((64, False), (64, True), (128, False), (128, True)):
        if (D, is_causal) not in launch_gluon.BWD_MIN_KEYS:  # never by default
            case = replace(base, D=D, DV=D, causal=is_causal, S_k=1 << 15, S_q=1 << 15)
            assert not _takes_gluon_backward(case, deterministic=True), case
    q, k, v = make_inputs(base)[0]
    for deterministic in (False, True):
        assert not launch_gluon.serves_backward(q, k, v, q, False, plain=False,  # modifiers
                                                deterministic=deterministic)
    misaligned = torch.empty(1, 40, 2, 129, device=DEVICE, dtype=q.dtype)[..., 1:]  # dO
    assert not launch_gluon.serves_backward(q, k, v, misaligned, False, plain=True,
                                            deterministic=False)
    with flashop.config.override(gluon=False), atomics():
        assert not _takes_gluon_backward(base)
        assert not _takes_gluon_backward(replace(base, S_k=4096), deterministic=True)
    # grids past their bounds: B * H_kv (dQ by atomics), every program (in order)
    many = torch.empty(launch_gluon.MAX_GRID_Y + 1, 1, 1, 128, device=DEVICE,
                       dtype=torch.bfloat16)
    with atomics():
        assert not launch_gluon.serves_backward(many, many, many, many, False, plain=True,
                                                deterministic=False)
    with flashop.config.override(gluon=True):
        assert launch_gluon.serves_backward(many, many, many, many, False, plain=True,
                                            deterministic=True)
        tiles = launch_gluon.MAX_GRID_X // (launch_gluon.MAX_GRID_Y + 1) + 1
        long = torch.empty(launch_gluon.MAX_GRID_Y + 1, tiles * launch_gluon.BWD_BLOCK_N, 1,
                           128, device="meta", dtype=torch.bfloat16)
        assert not launch_gluon.serves_backward(long, long, long, long, False, plain=True,
                                                deterministic=True)
    with FakeTensorMode() as mode:  # a traced call
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        for deterministic in (False, True):
            assert not launch_gluon.serves_backward(fq, fk, fv, fq, False, plain=True,
                                                    deterministic=deterministic)


def test_where_the_gluon_forward_runs(monkeypatch):
    """Plain dense 16-bit calls at D = DV = 64, 128 and 256 and at D = 192 with DV = 128
    (S_q == S_k where causal) with positive scales and 16-byte aligned strides; by default,
    from 1024 queries, calls over 1024+ keys at D = 128, 192 and 256, and at D = 64 over
    2048+ keys (4096+ where causal); never a traced call, and nowhere the kernel is
    unavailable (here: this run's device)."""
    base = Case(B=1, S_q=40, S_k=256, H_kv=1, G=2, D=128, DV=128, dtype=torch.bfloat16)
    causal = replace(base, causal=True, S_q=256)
    assert _takes_gluon(causal) == (GLUON and flashop.config.settings.gluon is True)
    if not ON_GPU:
        assert "flashop.kernels.forward_gluon" not in sys.modules
    monkeypatch.setattr(launch_gluon, "unavailable", lambda device: None)
    with flashop.config.override(gluon=True):
        assert _takes_gluon(base)
        assert _takes_gluon(causal)
        assert _takes_gluon(replace(base, layout="bhsd", dtype=torch.float16))
        assert _takes_gluon(replace(base, S_k=257, S_q=1))
        assert _takes_gluon(replace(causal, D=64, DV=64))
        assert _takes_gluon(replace(causal, D=256, DV=256))
        assert _takes_gluon(replace(causal, D=192, DV=128))
        for other in (dict(causal=True), dict(D=96, DV=96), dict(D=192, DV=192), dict(DV=64),
                      dict(D=176, DV=128), dict(D=192, DV=64),
                      dict(dtype=torch.float32), dict(scale=-0.1), dict(layout="padded")):
            assert not _takes_gluon(replace(base, **other)), other
        q, k, v = make_inputs(base)[0]
        assert not launch_gluon.serves(q, k, v, False, 0.1, plain=False)  # modifiers
        many = torch.empty(launch_gluon.MAX_GRID_Y + 1, 1, 1, 128, device=DEVICE,
                           dtype=torch.bfloat16)  # more (batch, head) pairs than a grid row
        assert launch_gluon.serves(many, many, many, False, 0.1, plain=True)
        with FakeTensorMode() as mode:  # a traced call
            fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
            assert not launch_gluon.serves(fq, fk, fv, False, 0.1, plain=True)
    n = launch_gluon.GLUON_MIN_QUERIES
    long_causal = replace(base, causal=True, S_q=n, S_k=n)
    with flashop.config.override(gluon=None):
        assert _takes_gluon(long_causal)
        assert not _takes_gluon(causal)  # fewer queries than were measured
        assert not _takes_gluon(replace(base, S_q=n))  # fewer keys than were measured
        min_keys = launch_gluon.GLUON_MIN_KEYS
        assert _takes_gluon(replace(base, S_k=min_keys[128, False], S_q=n))
        assert not _takes_gluon(replace(base, S_k=min_keys[128, False], S_q=n - 1))
        d64 = dict(D=64, DV=64)
        assert _takes_gluon(replace(base, S_k=min_keys[64, False], S_q=n, **d64))
        assert not _takes_gluon(replace(base, S_k=min_keys[64, False] - 1, S_q=n, **d64))
        assert not _takes_gluon(replace(long_causal, **d64))  # measured slower below 4k
        n64 = min_keys[64, True]
        assert _takes_gluon(replace(long_causal, S_q=n64, S_k=n64, **d64))
        d256 = dict(D=256, DV=256)
        for c in (False, True):
            n256 = min_keys[256, c]
            assert _takes_gluon(replace(long_causal, causal=c, S_q=n256, S_k=n256, **d256))
        assert not _takes_gluon(replace(base, S_q=n, S_k=min_keys[256, False] - 1, **d256))
        n256 = min_keys[256, True]  # causal: S_q == S_k
        assert not _takes_gluon(replace(long_causal, S_q=n256 - 1, S_k=n256 - 1, **d256))
        d192 = dict(D=192, DV=128)
        for c in (False, True):
            n192 = min_keys[192, c]
            assert _takes_gluon(replace(long_causal, causal=c, S_q=n192, S_k=n192, **d192))
        assert not _takes_gluon(replace(base, S_q=n, S_k=min_keys[192, False] - 1, **d192))
        for c in (False, True):  # with dropout too, causal and not (measured faster)
            assert launch_gluon.serves(*make_inputs(replace(long_causal, causal=c, **d192))[0],
                                       c, 0.1, plain=True, dropout=True)
        # with dropout, only where it measured faster than the tl forward: D = 128 not causal,
        # D = 192 / 128
        q, k, v = make_inputs(replace(base, S_k=min_keys[128, False], S_q=n))[0]
        assert launch_gluon.serves(q, k, v, False, 0.1, plain=True, dropout=True)
        q, k, v = make_inputs(replace(base, S_k=n64, S_q=n64, **d64))[0]
        assert launch_gluon.serves(q, k, v, True, 0.1, plain=True)
        assert not launch_gluon.serves(q, k, v, True, 0.1, plain=True, dropout=True)
    with flashop.config.override(gluon=True):  # the switch forces it with dropout too
        assert launch_gluon.serves(q, k, v, True, 0.1, plain=True, dropout=True)
    with flashop.config.override(gluon=False):
        assert not _takes_gluon(long_causal)

SPLIT_CASES = [
    # the second query tile wholly or partly past S_q, S_q > S_k with fully masked rows
    Case(B=2, S_q=45, S_k=70, H_kv=2, G=2, D=40, DV=24, dtype=torch.float16, causal=True),
    Case(B=1, S_q=50, S_k=20, H_kv=1, G=3, D=64, DV=64, dtype=torch.bfloat16, causal=True,
         layout="bhsd"),
    Case(B=1, S_q=70, S_k=37, H_kv=1, G=2, D=16, DV=32, dtype=torch.bfloat16,
         window_size=(9, 4), softcap=5.0, alibi=(1, 2)),
    Case(B=1, S_q=37, S_k=70, H_kv=1, G=2, D=16, DV=16, dtype=torch.float16, causal=True,
         window_size=(20, 0), gate=torch.float32),
    Case(B=2, S_q=40, S_k=33, H_kv=1, G=1, D=24, DV=24, dtype=torch.float32,
         mask=torch.float32, mask_shape=(2, 1, 40, 33), mask_grad=True),
    Case(B=1, S_q=33, S_k=48, H_kv=1, G=2, D=96, DV=96, dtype=torch.float16, layout="padded",
         mask=torch.bool, mask_shape=(1, 1, 33, 48)),
    # a right bound alone (the second tile's last key tiles, which the first tile's rows do
    # not reach, are run for the second tile alone), more keys than queries and fewer
    Case(B=2, S_q=37, S_k=90, H_kv=1, G=2, D=32, DV=32, dtype=torch.float16, causal=True),
    Case(B=1, S_q=70, S_k=45, H_kv=1, G=1, D=48, DV=48, dtype=torch.bfloat16,
         window_size=(-1, 5), alibi=(1,)),
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: f"D{c.D}-DV{c.DV}-{c.layout}")
def test_forward_with_two_query_tiles_per_program(case):
    """The forward's split query tile (Tiles.split_m: tiles.forward_tiles's choice at
    64 < D <= 128 on Hopper, and an autotuning candidate) at any head dim, with every
    modifier, masks, GQA, layouts, rows past S_q."""
    # 2 x 16 rows under the interpreter; on a GPU 2 x 64 (fits shared memory at every head dim)
    split = Tiles(128, 32, 4, 2, split_m=True) if ON_GPU else Tiles(32, 16, split_m=True)
    with tiles.force("fwd", split):
        check_case(case)


@pytest.mark.skipif(not ON_GPU, reason="4k keys: minutes under the interpreter")
@pytest.mark.parametrize("case", [
    Case(B=1, S_q=4100, S_k=4100, H_kv=2, G=2, D=128, DV=128, dtype=torch.bfloat16,
         causal=True),
    Case(B=2, S_q=1000, S_k=4500, H_kv=1, G=3, D=96, DV=80, dtype=torch.float16, causal=True,
         softcap=20.0, alibi=(3,), gate=torch.float32),
], ids=["D128", "D96-modifiers"])
def test_long_causal_with_the_tables_split_tiles(case):
    """Causal over >= 4096 keys at 64 < D <= 128: on Hopper the table's two query tiles per
    program, ordered heaviest first across heads (tiles.forward_tiles)."""
    if torch.cuda.get_device_capability()[0] >= 9:
        flags = dict(PLAIN_FLAGS[True])
        assert tiles.forward_tiles(case.D, case.dtype, torch.device(DEVICE), flags,
                                   case.S_k).split_m
    check_case(case)


@pytest.mark.parametrize("scale", [-0.4, 0.0])
@pytest.mark.parametrize("causal", [False, True])
def test_non_positive_scales(scale, causal):
    """A scale <= 0 (the forward folds only a positive one into its exponent: the row max of
    unscaled scores is the scaled scores' max only then), with a window's masked tiles and
    rows past the tiles; 0 gives each row a uniform average of its keys."""
    flags = PLAIN_FLAGS[causal]
    assert choice.folds_scale(0.3, flags, torch.float16)
    assert not choice.folds_scale(scale, flags, torch.float16)
    check_case(Case(B=1, S_q=45, S_k=70, H_kv=1, G=2, D=96, DV=96, dtype=torch.float16,
                    causal=causal, scale=scale, window_size=(30, -1)))


def test_where_the_kernels_fold_the_scale():
    """The forward and the backward fold alike, whatever their tiles and head dims; fp32
    never (choice.folds_scale)."""
    flags = dict(PLAIN_FLAGS[False])
    for dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn):
        folds = functools.partial(choice.folds_scale, dtype=dtype)
        assert folds(0.1, flags) and folds(0.1, {**flags, "HAS_RIGHT": True})
        assert folds(0.1, {**flags, "ATTN_MASK_KIND": 2, "HAS_LEFT": True})
        for modifier in (dict(HAS_SOFTCAP=True), dict(HAS_ALIBI=True), dict(HAS_GATE=True),
                         dict(ATTN_MASK_KIND=1)):
            assert not folds(0.1, {**flags, **modifier})
    assert not choice.folds_scale(0.1, flags, torch.float32)


@pytest.mark.parametrize("D", [192, 256])
def test_large_head_dims(D):
    check_case(Case(B=1, S_q=20, S_k=37, H_kv=1, G=2, D=D, DV=D, dtype=torch.float16,
                    causal=True))


@pytest.mark.parametrize("how", ["default", "descriptors", "dq-atomics"])
@pytest.mark.parametrize("case", [
    Case(B=2, S_q=45, S_k=70, H_kv=1, G=2, D=192, DV=128, dtype=torch.bfloat16, causal=True),
    Case(B=1, S_q=37, S_k=37, H_kv=2, G=1, D=160, DV=160, dtype=torch.float32),
    Case(B=1, S_q=30, S_k=53, H_kv=1, G=3, D=130, DV=64, dtype=torch.float16, causal=True,
         window_size=(20, 0), softcap=5.0, gate=torch.float32, sinks=torch.float32),
    Case(B=2, S_q=40, S_k=40, H_kv=1, G=1, D=176, DV=176, dtype=torch.bfloat16, causal=True,
         magnitude=8.0, outlier_keys=2, layout="bhsd"),
], ids=["deepseek-192-128", "fp32-160", "130-modifiers", "176-large-scores"])
def test_the_head_dim_in_two_tiles(case, how):
    """Head dims whose tl kernels take q's and k's head dim as a 128-wide tile and a
    narrower one (common.head_blocks; D = 192: 128 + 64; choice.head_in_parts: under the
    interpreter and on Hopper GPUs, forward and backward; elsewhere one tile): out, lse and the gradients under the rule, with tensor descriptors and with the
    dK/dV kernel adding dQ by atomics too, and every launch's blocks asserted."""
    launched = {}
    original = launch._launch

    def record(kernel, kind, *args, **kwargs):
        launched[kind] = (kwargs["BLOCK_D"], kwargs["BLOCK_DT"])
        return original(kernel, kind, *args, **kwargs)

    atomics = how == "dq-atomics"
    with mock.patch.object(launch, "_launch", record), \
            flashop.config.override(tma=True if how == "descriptors" else None):
        check_case(case, deterministic_backward=not atomics)
    parts, one = head_blocks(case.D), (block_dim(case.D), 0)
    assert parts[1] > 0
    device = torch.device(DEVICE)
    takes = INTERPRETING or is_hopper(device)
    if atomics and case.gate is None:
        kinds = {"fwd", "dkdv_atomic"}
    elif takes and case.dtype != torch.float32 and case.DV > 128:
        # (values at most 128 wide: one pass, tiles.splits_dkdv)
        kinds = {"fwd", "dq", "dv", "dk"}
    else:
        kinds = {"fwd", "dq", "dkdv"}
    assert launched == {kind: parts if takes else one for kind in kinds}
    assert choice.head_in_parts(case.D, device) == takes
    assert head_blocks(192) == (128, 64) and head_blocks(256)[1] == head_blocks(128)[1] == 0


@pytest.mark.parametrize("how", ["pointers", "descriptors"])
@pytest.mark.parametrize("case", [
    Case(B=1, S_q=77, S_k=90, H_kv=1, G=2, D=192, DV=128, dtype=torch.bfloat16,
         causal=True),
    Case(B=2, S_q=45, S_k=37, H_kv=2, G=1, D=176, DV=96, dtype=torch.float16, layout="bhsd"),
    Case(B=1, S_q=50, S_k=70, H_kv=1, G=3, D=160, DV=160, dtype=torch.bfloat16, causal=True,
         window_size=(20, 0), softcap=5.0, alibi=(3,), gate=torch.float32,
         sinks=torch.float32),
], ids=["deepseek-causal", "gqa-bhsd", "modifiers"])
def test_two_query_tiles_with_the_head_dim_in_two_tiles(case, how):
    """The forward's two query tiles per program (split_m), each with q's head dim in two
    tiles (128 + the rest): tiles forced so at D = 160-192, rows past S_q, a causal bound
    whose second tile runs past the first's last key, modifiers; explain names both. (Each
    tile reads its own second head-dim tile: read from the first, the outputs were wrong by
    up to half their scale.)"""
    forced = tiles.Tiles(32, 16, 4, 1, split_m=True)
    with tiles.force("fwd", forced), \
            flashop.config.override(tma=True if how == "descriptors" else None):
        check_case(case)
        q, k, v = make_inputs(case)[0]
        with flashop.config.override(gluon=False):
            told = flashop.explain(flashop.attention, q, k, v, causal=case.causal)
    assert told.forward.options["q's and k's head dim in tiles of"] == \
        " + ".join(map(str, head_blocks(case.D)))
    assert "two query tiles per program" in told.forward.kernels[0][1]


@pytest.mark.parametrize("case", [
    Case(B=2, S_q=45, S_k=70, H_kv=1, G=2, D=160, DV=136, dtype=torch.bfloat16, causal=True,
         window_size=(30, 0), softcap=5.0, alibi=(2,), gate=torch.float32),
    Case(B=1, S_q=33, S_k=50, H_kv=2, G=1, D=144, DV=144, dtype=torch.float16,
         mask=torch.float32, mask_shape=(1, 2, 33, 50), mask_grad=True, sinks=torch.float32),
], ids=["window-softcap-alibi-gate", "mask-grad-sinks"])
def test_the_dkdv_kernels_parts_with_modifiers(case):
    """Above head dim 128 the dK/dV kernel runs as a dV and a dK launch (tiles.splits_dkdv):
    every modifier's gradient through both parts (the gate's and the mask's come from the dK
    part's dS)."""
    check_case(case)


def test_where_the_dkdv_kernel_runs_in_parts():
    """The dK/dV kernel's launches (its PARTS): two parts, dV then dK, for 16-bit inputs above
    head dim 128 (under the interpreter, as on Hopper GPUs); one launch of both at 128 and
    below, for fp32 inputs, where q's and k's head dim is in two tiles and the values' at
    most 128 wide (D = 192 / 128), and where dQ is added by atomics (the `tl` kernels: the
    Gluon backward, where it runs, has its own)."""
    def parts(D, dtype=torch.float16, DV=None, **switches):
        launches = []
        original = launch._launch

        def record(kernel, kind, *args, **kwargs):
            if "dkdv" in getattr(kernel, "__name__", getattr(getattr(kernel, "fn", None),
                                                             "__name__", "")):
                launches.append((kind, kwargs["PARTS"]))
            return original(kernel, kind, *args, **kwargs)

        case = Case(B=1, S_q=20, S_k=24, H_kv=1, G=1, D=D, DV=DV or D, dtype=dtype)
        (q, k, v), dout, dlse = make_inputs(case)
        with mock.patch.object(launch, "_launch", record), \
                flashop.config.override(gluon=False, **switches):
            out, lse = flashop.attention_with_lse(q, k, v)
            torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
        return launches

    hopper = DEVICE == "cpu" or is_hopper(torch.device(DEVICE))
    split = [("dv", 1), ("dk", 2)] if hopper else [("dkdv", 3)]
    assert parts(160) == parts(256) == parts(160, torch.bfloat16) == split
    assert parts(192, DV=192) == parts(256, DV=128) == split
    assert parts(128) == parts(160, torch.float32) == [("dkdv", 3)]
    assert parts(192, DV=128) == parts(160, torch.bfloat16, DV=64) == [("dkdv", 3)]
    assert parts(160, dq_atomics=True) == [("dkdv_atomic", 3)]


def test_fully_masked_rows_are_zero_with_finite_gradients():
    """Causal with S_q > S_k: the first S_q - S_k queries attend nothing."""
    case = Case(B=2, S_q=50, S_k=20, H_kv=1, G=2, D=32, DV=32, dtype=torch.float16, causal=True)
    inputs, dout, dlse = make_inputs(case)
    out, lse, (dq, dk, dv) = run_flashop(case, inputs, dout, dlse)
    empty = case.S_q - case.S_k
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.isneginf(lse[:, :, :empty]).all()
    assert torch.isfinite(lse[:, :, empty:]).all()
    assert torch.equal(dq[:, :empty], torch.zeros_like(dq[:, :empty]))
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()
    check_case(case)


@pytest.mark.parametrize("shape", [(0, 5, 2, 16), (2, 0, 2, 16)])
def test_empty_batch_or_queries(shape):
    q = torch.randn(shape, device=DEVICE, requires_grad=True)
    k = torch.randn(shape[0], 7, 2, 16, device=DEVICE, requires_grad=True)
    v = torch.randn(shape[0], 7, 2, 16, device=DEVICE, requires_grad=True)
    out, lse = flashop.attention_with_lse(q, k, v)
    assert out.shape == shape and lse.shape == (shape[0], 2, shape[1])
    out.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k))


def test_no_keys_gives_zero_output_and_gradients():
    """S_k == 0: every query attends nothing, as SDPA's math backend (output 0)."""
    q = torch.randn(1, 5, 2, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 0, 2, 16, device=DEVICE, requires_grad=True)
    v = torch.randn(1, 0, 2, 16, device=DEVICE, requires_grad=True)
    with poisoned_outputs():
        out, lse = flashop.attention_with_lse(q, k, v)
        out.sum().backward()
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_strided_last_dimension_is_accepted():
    """A non-unit stride in the head dim is copied once; the result equals the dense one."""
    base = torch.randn(1, 40, 2, 64, device=DEVICE)
    q, k, v = base[..., ::2], base[..., 1::2], base[..., ::2].flip(1)
    out = flashop.attention(q, k, v, causal=True)
    dense = flashop.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(out, dense)


def test_deterministic_backward_is_bitwise_reproducible():
    case = Case(B=1, S_q=70, S_k=90, H_kv=1, G=3, D=32, DV=32, dtype=torch.float32,
                causal=True)
    inputs, dout, dlse = make_inputs(case)
    first = run_flashop(case, inputs, dout, dlse, deterministic_backward=True)
    second = run_flashop(case, inputs, dout, dlse, deterministic_backward=True)
    for a, b in zip((first[0], first[1], *first[2]), (second[0], second[1], *second[2])):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_atomic_dq_backward_matches_reference(causal):
    """The opt-in backward whose dK/dV kernel adds dQ by atomics (FLASHOP_DQ_ATOMICS=1)
    passes the same rule, with GQA, a window and lengths that are not multiples of tiles."""
    check_case(Case(B=2, S_q=70, S_k=45, H_kv=2, G=2, D=32, DV=24, dtype=torch.float16,
                    causal=causal, window_size=(20, -1)), deterministic_backward=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_cast_of_the_added_gradients(dtype):
    """attention_bwd_cast_kernel (after the Gluon backward and the atomic dQ): dQ times its
    scale, then dK and dV from their places in the fp32 buffer, each rounded as torch's
    cast rounds, past the blocks' ends too; where only dQ is given, only dQ is written."""
    q_shape, kv_shape = (2, 37, 3, 16), (2, 29, 1, 16)
    n_q, n_kv = 2 * 37 * 3 * 16, 2 * 29 * 16
    acc = torch.randn(n_q + 2 * n_kv + 5, device=DEVICE) * 100
    dq, dk, dv = (torch.full(s, 7.0, device=DEVICE, dtype=dtype)
                  for s in (q_shape, kv_shape, kv_shape))
    launch._cast_grads(acc, dq, 0.3, dk, dv)
    assert torch.equal(dq, (acc[:n_q] * 0.3).to(dtype).view(q_shape))
    assert torch.equal(dk, acc[n_q:n_q + n_kv].to(dtype).view(kv_shape))
    assert torch.equal(dv, acc[n_q + n_kv:n_q + 2 * n_kv].to(dtype).view(kv_shape))
    dq_only = torch.full(q_shape, 7.0, device=DEVICE, dtype=dtype)
    launch._cast_grads(acc, dq_only, 1.0)
    assert torch.equal(dq_only, acc[:n_q].to(dtype).view(q_shape))


def test_the_backward_is_deterministic_where_asked_and_fastest_by_default():
    """PyTorch's convention: the fastest backward by default; bitwise reproducible where the
    call asks (deterministic=True), under torch.use_deterministic_algorithms (also
    warn_only), or with the atomics switched off, whatever else the switches say."""
    assert not choice.deterministic_backward()  # the default
    assert choice.deterministic_backward(True)
    for atomics in (None, True):
        with flashop.config.override(dq_atomics=atomics):
            assert not choice.deterministic_backward()
            assert choice.deterministic_backward(True)
            with deterministic_algorithms():
                assert choice.deterministic_backward()
    with flashop.config.override(dq_atomics=False):
        assert choice.deterministic_backward()


def test_attention_equals_first_output_of_attention_with_lse():
    case = Case(B=1, S_q=17, S_k=23, H_kv=2, G=1, D=16, DV=16, dtype=torch.float32,
                causal=True, scale=0.3)
    (q, k, v), _, _ = make_inputs(case)
    out = flashop.attention(q, k, v, causal=True, scale=0.3)
    assert torch.equal(out, flashop.attention_with_lse(q, k, v, causal=True, scale=0.3)[0])
    assert torch.equal(out, torch.ops.flashop.attention(q, k, v, causal=True, scale=0.3))
