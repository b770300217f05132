"""Attention sinks (one learned logit per head in every softmax denominator) against the fp64
reference with every modifier, packed batches, the gradient's sign by finite differences,
registration, torch.compile with a learned sink, and bad sinks' errors."""

import dataclasses

import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.library import opcheck

import flashop
from flashop.testing import check_attention_varlen
from helpers import (
    DEVICE, INPUTS, Case, TestCase, check_case, CPU_PATH_TWIN, cpu_path, error_message, make_inputs,
    make_modifiers, make_packed, poisoned_outputs, slow_property_examples,
)
from modifier_cases import DTYPES, EDGES, SMALLER, modified_cases

# two thirds of the profile's examples under the interpreter (30 would add a minute to CI)
EXAMPLES = slow_property_examples(interpreter_share=2 / 3)


@st.composite
def cases_with_sinks(draw):
    case = draw(modified_cases(**SMALLER))
    return dataclasses.replace(case, sinks=draw(st.sampled_from([torch.float32, INPUTS])))


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=EXAMPLES)
@given(case=cases_with_sinks(), seed=st.integers(0, 2**16))
@example(case=dataclasses.replace(EDGES[0], sinks=torch.float32), seed=0)
@example(case=dataclasses.replace(EDGES[1], sinks=INPUTS), seed=0)
@example(case=dataclasses.replace(EDGES[2], sinks=torch.float32), seed=0)
def test_sinks_with_modifiers_match_reference(dtype, case, seed):
    check_case(case.in_dtype(dtype), seed)


@CPU_PATH_TWIN
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=EXAMPLES)
@given(case=cases_with_sinks(), seed=st.integers(0, 2**16))
@example(case=dataclasses.replace(EDGES[0], sinks=torch.float32), seed=0)
@example(case=dataclasses.replace(EDGES[2], sinks=torch.float32), seed=0)
def test_cpu_path_sinks_with_modifiers_match_reference(dtype, case, seed):
    """The CPU path on the same calls (its forward starts each row's softmax at the sink).
    (With the profile's 30 examples, fp32 drew a (1, 1, 1, 1) float mask's gradient with a
    sink at scores near 40 that both the kernels and the CPU path take past the rule:
    docs/notes/cpu-path.md.)"""
    with cpu_path():
        check_case(case.in_dtype(dtype), seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_with_everything_and_empty_rows(dtype):
    """Every modifier, and queries that attend nothing (before the keys under causal, and
    masked out): their lse is the sink, their output 0, and dsinks gets their dlse."""
    check_case(Case(B=2, S_q=45, S_k=30, H_kv=1, G=2, D=24, DV=16, dtype=dtype, causal=True,
                    window_size=(20, 0), softcap=5.0, alibi=(2,), gate=torch.float32,
                    mask=torch.bool, mask_shape=(2, 1, 45, 30), mask_keep=0.3,
                    sinks=torch.float32))


def test_rows_without_keys_get_the_sink():
    case = Case(B=1, S_q=9, S_k=4, H_kv=2, G=1, D=16, DV=16, dtype=torch.float32, causal=True,
                sinks=torch.float32)
    (q, k, v), _, _ = make_inputs(case)
    sinks = make_modifiers(case)["sinks"]
    out, lse = flashop.attention_with_lse(q, k, v, sinks=sinks, causal=True)
    # queries 0 .. 4 sit before the first key
    assert torch.equal(out[:, :5], torch.zeros_like(out[:, :5]))
    assert torch.equal(lse[:, :, :5], sinks.detach()[None, :, None].expand(1, 2, 5))


def test_sink_gradient_by_finite_differences():
    """dsinks against central differences of the forward (fp32 kernels, fp64 sums), sign
    included: L = sum(out * dout) + sum(lse * dlse)."""
    case = Case(B=2, S_q=19, S_k=23, H_kv=1, G=3, D=16, DV=16, dtype=torch.float32,
                causal=True, sinks=torch.float32)
    (q, k, v), dout, dlse = make_inputs(case)
    sinks = make_modifiers(case)["sinks"]
    # one sink near the scores' scale, so that its gradient is large
    sinks = torch.tensor([0.5, -1.0, 2.0], device=DEVICE, requires_grad=True)

    def loss(s):
        out, lse = flashop.attention_with_lse(q.detach(), k.detach(), v.detach(), sinks=s,
                                              causal=True)
        return (out.double() * dout.double()).sum() + (lse.double() * dlse.double()).sum()

    out, lse = flashop.attention_with_lse(q, k, v, sinks=sinks, causal=True)
    (dsinks,) = torch.autograd.grad((out, lse), (sinks,), (dout, dlse))
    eps = 1e-2
    for h in range(3):
        step = torch.zeros(3, device=DEVICE)
        step[h] = eps
        with torch.no_grad():
            fd = (loss(sinks + step) - loss(sinks - step)) / (2 * eps)
        assert abs(fd.item() - dsinks[h].item()) <= 1e-3 * (1 + abs(fd.item())), (h, fd, dsinks)


def test_sink_gradient_of_rows_that_attend_only_the_sink_under_a_large_gate():
    """Rows whose keys are all masked out attend the sink alone: P_sink = 1 exactly, so
    dsinks = the sum of dlse, bit for bit, however large the queries' gates (here summed to
    about -250, whose round trip through the natural-log lse cost P_sink its last bits).
    (Packed sinks with a gate: test_packed_sinks_match_reference.)"""
    B, S_q, S_k, H = 2, 40, 250, 2
    q = torch.randn(B, S_q, H, 16, device=DEVICE)
    k, v = (torch.randn(B, S_k, H, 16, device=DEVICE) for _ in range(2))
    g = torch.full((B, S_k, H), -1.0, device=DEVICE)
    sinks = torch.tensor([-10.0, 0.7], device=DEVICE, requires_grad=True)
    dlse = torch.randn(B, H, S_q, device=DEVICE)
    mask = torch.zeros(1, 1, 1, 1, device=DEVICE, dtype=torch.bool)
    out, lse = flashop.attention_with_lse(q, k, v, mask, g=g, sinks=sinks, causal=True)
    assert torch.equal(out, torch.zeros_like(out))
    (dsinks,) = torch.autograd.grad(lse, sinks, dlse)
    assert torch.equal(dsinks, dlse.sum(0).sum(-1))


@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16])
def test_packed_sinks_match_reference(sink_dtype):
    """With a gate; a sequence without queries, and a last one without keys (dsinks reads
    the queries' gates, which once read past the keys there)."""
    args, dout, dlse = make_packed([7, 0, 20, 13], [11, 5, 20, 0], H_kv=1, G=2, D=16,
                                   dtype=torch.bfloat16, gate=torch.float32, alibi=(4, 2))
    sinks = (3 * torch.randn(2, device=DEVICE)).to(sink_dtype).requires_grad_()
    options = dict(causal=True, window_size=(6, -1), softcap=3.0)
    with poisoned_outputs():
        out, lse = flashop.attention_varlen_with_lse(**args, sinks=sinks, **options)
        grads = torch.autograd.grad((out, lse), (args["q"], args["k"], args["v"], args["g"],
                                                 sinks), (dout, dlse))
    assert grads[-1].dtype == sink_dtype
    for result in check_attention_varlen(
            args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"], dout,
            dlse, out, lse, grads, args["alibi_slopes"], args["g"], sinks, **options):
        assert result.ok, str(result)


OPCHECK_CASES = [
    Case(B=1, S_q=19, S_k=33, H_kv=2, G=1, D=24, DV=32, dtype=torch.float32,
         sinks=torch.float32),
    Case(B=2, S_q=30, S_k=21, H_kv=1, G=2, D=16, DV=16, dtype=torch.float16, causal=True,
         window_size=(12, 0), alibi=(2,), gate=torch.float32, sinks=torch.float16),
]


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
@pytest.mark.parametrize("op", ["attention_forward", "attention_with_lse"])
def test_opcheck_with_sinks(case, op):
    (q, k, v), _, _ = make_inputs(case)
    mods = make_modifiers(case)
    packing = (None,) * 4 if op == "attention_forward" else ()
    opcheck(getattr(torch.ops.flashop, op).default,
            (q, k, v, *packing, mods["attn_mask"], mods["alibi_slopes"], mods["g"],
             mods["sinks"]), case.op_options())


def test_direct_eager_path_matches_the_operator_with_sinks():
    case = OPCHECK_CASES[1]
    (q, k, v), dout, dlse = make_inputs(case)
    mods = make_modifiers(case)
    wrt = (q, k, v, mods["g"], mods["sinks"])
    results = []
    for fn, options in ((flashop.attention_with_lse, case.options()),
                        (torch.ops.flashop.attention_with_lse, case.op_options())):
        out, lse = fn(q, k, v, **mods, **options)
        results.append((out, lse, *torch.autograd.grad((out, lse), wrt, (dout, dlse))))
    for direct, op in zip(*results):
        assert torch.equal(direct, op)
    # a learned sink (an nn.Parameter) keeps the direct path
    out = flashop.attention(q, k, v, sinks=nn.Parameter(mods["sinks"].detach()),
                            **case.options())
    assert type(out.grad_fn).__name__ == "_DirectAttentionBackward"


class SinkAttention(nn.Module):
    """gpt-oss's attention core: grouped-query causal attention over a sliding window with
    a learned sink per head."""

    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.sinks = nn.Parameter(torch.randn(heads))

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, -1, self.head_dim).split(
            [self.heads, self.kv_heads, self.kv_heads], dim=2)
        return flashop.attention(q, k, v, sinks=self.sinks, causal=True, window_size=(8, 0))


@pytest.mark.compile
def test_learned_sink_compiles_fullgraph():
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = SinkAttention().to(DEVICE)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    frames = []
    for S in (13, 29):
        x = torch.randn(2, S, 32, device=DEVICE)
        results = []
        for fn in (compiled, model):
            out = fn(x)
            results.append((out, *torch.autograd.grad(out.square().sum(),
                                                      list(model.parameters()))))
        frames.append(counter.frame_count)
        for a, b in zip(*results):
            torch.testing.assert_close(a, b)
        assert results[0][-1].abs().sum() > 0  # the sinks learn
    assert frames == frames[:1] * 2, f"recompiled: {frames}"


def _t(*shape, dtype=torch.float16, device=DEVICE):
    return torch.randn(*shape, device=device).to(dtype)


class TestSinkErrors(TestCase):
    def test_shape(self):
        q = _t(2, 8, 4, 16)
        self.assertExpectedInline(error_message(flashop.attention, q, q, q, sinks=_t(2, 4)), """flashop.attention: sinks must have shape (H,) = (4,): one logit per query head, got (2, 4)""")  # noqa: B950

    def test_dtype(self):
        q = _t(2, 8, 4, 16)
        self.assertExpectedInline(error_message(flashop.attention, q, q, q, sinks=_t(4, dtype=torch.bfloat16)), """flashop.attention: sinks must be torch.float32 or torch.float16, got torch.bfloat16""")  # noqa: B950

    def test_device(self):
        q = _t(2, 8, 4, 16)
        self.assertExpectedInline(error_message(flashop.attention, q, q, q, sinks=_t(4, device="meta")), """flashop.attention: sinks must be on DEVICE like q, got meta""")  # noqa: B950

    def test_packed(self):
        q = _t(10, 4, 16)
        cu = torch.tensor([0, 3, 10], dtype=torch.int32, device=DEVICE)
        self.assertExpectedInline(error_message(flashop.attention_varlen, q, q, q, cu, cu, 7, 7, sinks=_t(2, dtype=torch.float32)), """flashop.attention_varlen: sinks must have shape (H,) = (4,): one logit per query head, got (2,)""")  # noqa: B950
