"""The operators' registration: pinned schemas and torch.library.opcheck."""

import pytest
import torch
from torch.library import opcheck

import flashop
from helpers import Case, TestCase, make_inputs, make_modifiers, make_packed

OPCHECK_CASES = [
    Case(B=2, S_q=37, S_k=53, H_kv=2, G=2, D=40, DV=24, dtype=torch.float32, causal=True),
    Case(B=1, S_q=40, S_k=17, H_kv=1, G=3, D=16, DV=16, dtype=torch.float16, causal=True,
         scale=0.5, layout="bhsd"),
    Case(B=1, S_q=19, S_k=33, H_kv=2, G=1, D=24, DV=32, dtype=torch.bfloat16, causal=False),
    # every modifier at once, the float attn_mask with its gradient
    Case(B=2, S_q=30, S_k=41, H_kv=1, G=2, D=16, DV=16, dtype=torch.float32, causal=True,
         window_size=(12, 0), softcap=4.0, alibi=(2, 2), gate=torch.float32,
         mask=torch.float32, mask_shape=(2, 1, 30, 41), mask_grad=True),
    Case(B=1, S_q=25, S_k=20, H_kv=2, G=1, D=16, DV=16, dtype=torch.float16,
         window_size=(5, 3), mask=torch.bool, mask_shape=(25, 20)),
]


def _args(case, packing=()):
    """(q, k, v, attn_mask, alibi_slopes, g) and the operators' keyword options of the case;
    with ``packing``, the forward's (q, k, v, *packing, attn_mask, alibi_slopes, g)."""
    (q, k, v), _, _ = make_inputs(case)
    mods = make_modifiers(case)
    tensors = (mods["attn_mask"], mods["alibi_slopes"], mods["g"])
    return (q, k, v, *packing, *tensors), case.op_options()


class TestSchemas(TestCase):
    def test_schemas(self):
        """One forward and one backward operator for dense and packed batches (the packing
        arguments None where dense), and the composites over them; the window as two ints;
        ``deterministic`` (the backward's) in every one."""
        schemas = "\n".join(str(getattr(torch.ops.flashop, op).default._schema) for op in (
            "attention", "attention_with_lse", "attention_forward", "attention_backward",
            "attention_varlen", "attention_varlen_with_lse"))
        self.assertExpectedInline(schemas, """\
flashop::attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, Tensor? alibi_slopes=None, Tensor? g=None, Tensor? sinks=None, *, bool causal=False, float? scale=None, SymInt window_size_left=-1, SymInt window_size_right=-1, SymInt attention_chunk=0, float softcap=0., float dropout_p=0., bool deterministic=False) -> Tensor
flashop::attention_with_lse(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, Tensor? alibi_slopes=None, Tensor? g=None, Tensor? sinks=None, *, bool causal=False, float? scale=None, SymInt window_size_left=-1, SymInt window_size_right=-1, SymInt attention_chunk=0, float softcap=0., float dropout_p=0., bool deterministic=False) -> (Tensor, Tensor)
flashop::attention_forward(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, SymInt? max_seqlen_q=None, SymInt? max_seqlen_k=None, Tensor? attn_mask=None, Tensor? alibi_slopes=None, Tensor? g=None, Tensor? sinks=None, Tensor? dropout_seed=None, *, bool causal=False, float? scale=None, SymInt window_size_left=-1, SymInt window_size_right=-1, SymInt attention_chunk=0, float softcap=0., float dropout_p=0., bool deterministic=False) -> (Tensor, Tensor, Tensor)
flashop::attention_backward(Tensor dout, Tensor dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse_log2, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, SymInt? max_seqlen_q=None, SymInt? max_seqlen_k=None, Tensor? attn_mask=None, Tensor? alibi_slopes=None, Tensor? g=None, Tensor? dropout_seed=None, *, bool causal=False, float? scale=None, SymInt window_size_left=-1, SymInt window_size_right=-1, SymInt attention_chunk=0, float softcap=0., float dropout_p=0., bool attn_mask_grad=False, bool deterministic=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor)
flashop::attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? alibi_slopes=None, Tensor? g=None, Tensor? sinks=None, *, bool causal=False, float? scale=None, SymInt window_size_left=-1, SymInt window_size_right=-1, SymInt attention_chunk=0, float softcap=0., float dropout_p=0., bool deterministic=False) -> Tensor
flashop::attention_varlen_with_lse(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? alibi_slopes=None, Tensor? g=None, Tensor? sinks=None, *, bool causal=False, float? scale=None, SymInt window_size_left=-1, SymInt window_size_right=-1, SymInt attention_chunk=0, float softcap=0., float dropout_p=0., bool deterministic=False) -> (Tensor, Tensor)""")  # noqa: B950
        for gone in ("attention_varlen_forward", "attention_varlen_backward"):
            self.assertFalse(hasattr(torch.ops.flashop, gone))

    def test_python_functions_have_the_ops_names(self):
        for fn in (flashop.attention, flashop.attention_with_lse, flashop.attention_varlen,
                   flashop.attention_varlen_with_lse):
            self.assertTrue(hasattr(torch.ops.flashop, fn.__name__))


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
@pytest.mark.parametrize("op", ["attention_forward", "attention_with_lse", "attention"])
def test_opcheck_forward(case, op):
    args, options = _args(case, (None,) * 4 if op == "attention_forward" else ())
    opcheck(getattr(torch.ops.flashop, op).default, args, options)


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
def test_opcheck_backward(case):
    args, options = _args(case, (None,) * 4)
    _, dout, dlse = make_inputs(case)
    args = [None if t is None else t.detach() for t in args]
    out, _, lse_log2 = torch.ops.flashop.attention_forward(*args, **options)
    opcheck(torch.ops.flashop.attention_backward.default,
            (dout, dlse, *args[:3], out, lse_log2, *args[3:]),
            dict(options, attn_mask_grad=case.mask_grad))


def _grad_fn_name(out) -> str:
    return type(out.grad_fn).__name__


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_the_direct_eager_path_matches_the_operator_bitwise(case):
    """flashop.attention_with_lse on plain tensors runs the forward operator's body in its
    own autograd function (flashop/_ops/eager.py): outputs and gradients equal the
    operator's bit for bit."""
    (q, k, v), dout, dlse = make_inputs(case)
    mods = make_modifiers(case)
    args = (q, k, v, mods["attn_mask"], mods["alibi_slopes"], mods["g"])
    wrt = [x for x in args if x is not None and x.requires_grad]
    results = []
    for fn, options, path in (
            (flashop.attention_with_lse, case.options(), "_DirectAttentionBackward"),
            (torch.ops.flashop.attention_with_lse, case.op_options(), "GeneratedBackwardFor")):
        out, lse = fn(*args, **options)
        assert _grad_fn_name(out).startswith(path), _grad_fn_name(out)
        results.append((out, lse, *torch.autograd.grad((out, lse), wrt, (dout, dlse))))
    for direct, op in zip(*results):
        assert torch.equal(direct, op)


def test_the_direct_eager_path_takes_an_unread_output_as_a_zero_gradient():
    """A loss that reads out alone (or lse alone) gives the gradients of a zero gradient of
    the other output, bit for bit: the direct path's backward gets none for it (no zeroed
    tensor is made per call; one zero element per device, never written, stands for an
    unread lse)."""
    case = OPCHECK_CASES[0]
    (q, k, v), dout, dlse = make_inputs(case)
    out, lse = flashop.attention_with_lse(q, k, v, **case.options())
    assert _grad_fn_name(out) == "_DirectAttentionBackward"

    def grads(outputs, grad_outputs):
        return torch.autograd.grad(outputs, (q, k, v), grad_outputs, retain_graph=True)

    for given, alone in (((dout, torch.zeros_like(dlse)), grads(out, dout)),
                         ((torch.zeros_like(dout), dlse), grads(lse, dlse))):
        assert all(torch.equal(a, b) for a, b in zip(grads((out, lse), given), alone))
    zeros = flashop._ops.eager._ZEROS
    assert zeros and not any(z.any() for z in zeros.values())


def test_the_direct_eager_path_leaves_modes_and_fake_tensors_to_the_operator():
    """Under a dispatch mode, on fake tensors or with FLASHOP_DIRECT_EAGER=0 the Python API
    calls the operator (which the mode, tracer or compiler must see)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    (q, k, v), _, _ = make_inputs(OPCHECK_CASES[0])

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    assert _grad_fn_name(flashop.attention(q, k, v)) == "_DirectAttentionBackward"
    with Record() as record:
        flashop.attention(q, k, v, causal=True)
    assert torch.ops.flashop.attention_forward.default in record.ops
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        assert flashop.attention(fq, fk, fv).shape == q.shape[:-1] + v.shape[-1:]
    with flashop.config.override(direct_eager=False):
        assert _grad_fn_name(flashop.attention(q, k, v)).startswith("GeneratedBackwardFor")


def test_the_direct_eager_path_runs_the_backward_without_the_dispatcher():
    """The direct path's backward runs the backward operator's body itself (the profiler,
    which records every operator the dispatcher runs, sees no flashop::attention_backward);
    with FLASHOP_DIRECT_EAGER=0, or a backward that builds a graph, the operator runs."""
    (q, k, v), dout, _ = make_inputs(OPCHECK_CASES[0])

    def operators(direct: bool = True, create_graph: bool = False) -> list:
        with flashop.config.override(direct_eager=direct):
            out = flashop.attention(q, k, v, causal=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            torch.autograd.grad(out, (q, k, v), dout, create_graph=create_graph)
        return [e.name for e in prof.events() if e.name.startswith("flashop::")]

    assert operators() == []
    assert "flashop::attention_backward" in operators(direct=False)
    assert "flashop::attention_backward" in operators(create_graph=True)


def test_launch_keys_separate_what_triton_specialises_on():
    """An eager launch reuses a compiled kernel for calls of the same key
    (launches.launch_now); a key must tell apart whatever Triton compiles differently:
    a tensor's dtype and 16-byte alignment, an argument's type (1, True and 1.0 are equal
    in Python) and value."""
    from flashop._launch.launches import _call_key

    x = torch.zeros(64)
    shifted = torch.zeros(65)[1:]
    keys = [_call_key(values) for values in (
        (x, 16), (x.clone(), 16), (shifted, 16), (x.double(), 16), (x, 17), (x, 1), (x, True),
        (x, 1.0), (x, 16.0), (x, None), (x, "ieee"), (x, "tf32"), (16, x))]
    assert keys[0] == keys[1]  # other tensors of the same dtype and alignment
    assert len(set(keys[1:])) == len(keys) - 1


def test_planned_launch_keys_separate_what_a_plan_fixes():
    """A planned launch (launches.Planned: a launch plan's grid and fixed arguments,
    launch_planned) keys its compiled kernel by the plan's content and the call's other
    arguments: plans of equal content share a key; plans that differ in the grid or in an
    argument's name, type or value do not; a plan holds no tensor."""
    from flashop._launch.launches import Planned

    base = Planned((2, 1, 1), dict(BLOCK=16, CAUSAL=True, scale=0.5))
    same = Planned((2, 1, 1), dict(BLOCK=16, CAUSAL=True, scale=0.5))
    assert base == same and hash(base) == hash(same) and base is not same
    others = [Planned((3, 1, 1), dict(BLOCK=16, CAUSAL=True, scale=0.5)),
              Planned((2, 1, 1), dict(BLOCK=32, CAUSAL=True, scale=0.5)),
              Planned((2, 1, 1), dict(BLOCK=16, CAUSAL=1, scale=0.5)),
              Planned((2, 1, 1), dict(BLOCK=16, CAUSAL=True, scale=1)),
              Planned((2, 1, 1), dict(BLOCK_N=16, CAUSAL=True, scale=0.5))]
    assert len({base, *others}) == len(others) + 1
    with pytest.raises(TypeError, match="per-call"):
        hash(Planned((1,), dict(x=torch.zeros(1))))


def test_the_direct_eager_path_keeps_the_operators_errors():
    case = OPCHECK_CASES[0]
    (q, k, v), dout, _ = make_inputs(case)
    messages = []
    for fn in (flashop.attention, torch.ops.flashop.attention):
        with pytest.raises(ValueError) as err:
            fn(q, k.double(), v)
        messages.append(str(err.value))
        slopes = torch.ones(q.shape[2], device=q.device, requires_grad=True)
        out = fn(q, k, v, alibi_slopes=slopes)
        with pytest.raises(RuntimeError, match="alibi_slopes get no gradient"):
            out.backward(torch.ones_like(out))
    assert messages[0] == messages[1] and "float64" in messages[0]


def test_the_direct_eager_path_of_packed_batches_matches_the_operator_bitwise():
    """flashop.attention_varlen_with_lse takes the same direct path (the one forward
    operator's body with the packing arguments): outputs and gradients equal the
    operator's bit for bit, the sinks' and the gate's gradients included."""
    args, dout, dlse = make_packed([5, 0, 30], [17, 4, 30], 1, 2, 16, torch.float32,
                                   gate=torch.float32, alibi=(3, 2))
    args["alibi_slopes"] = args["alibi_slopes"].detach()
    sinks = torch.randn(2, device=args["q"].device, requires_grad=True)
    wrt = (args["q"], args["k"], args["v"], args["g"], sinks)
    results = []
    for fn, options, path in (
            (flashop.attention_varlen_with_lse, dict(window_size=(9, 0)),
             "_DirectAttentionBackward"),
            (torch.ops.flashop.attention_varlen_with_lse,
             dict(window_size_left=9, window_size_right=0), "GeneratedBackwardFor")):
        out, lse = fn(**args, sinks=sinks, causal=True, softcap=3.0, **options)
        assert _grad_fn_name(out).startswith(path), _grad_fn_name(out)
        results.append((out, lse, *torch.autograd.grad((out, lse), wrt, (dout, dlse))))
    for direct, op in zip(*results):
        assert torch.equal(direct, op)
