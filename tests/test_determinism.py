"""PyTorch's convention for the backward: the fastest by default (dQ by atomics where
faster), bitwise reproducible where a call asks (``deterministic=True``) or under
torch.use_deterministic_algorithms(True), whatever the switches say: every kernel launch
is recorded and its DQ_ATOMIC flag read, and the Gluon backward's launch is replaced by a
stand-in that would raise."""

import pytest
import torch

import flashop
from helpers import DEVICE, Case, make_inputs, make_modifiers, make_packed, replayed_launches


@pytest.fixture
def dq_atomic_launches(monkeypatch):
    """The DQ_ATOMIC flag of every kernel launch that passes one, in order (launches by
    launch_kernel, autotuned ones by wrap_triton, and those that eager plans replay)."""
    flags = []
    launch = flashop._launch.attention
    launch_kernel, wrap = launch.launch_kernel, launch.wrap_triton

    def record(kwargs):
        if "DQ_ATOMIC" in kwargs:
            flags.append(kwargs["DQ_ATOMIC"])

    def recording_launch(kernel, grid, **kwargs):
        record(kwargs)
        return launch_kernel(kernel, grid, **kwargs)

    def recording_wrap(kernel):
        launcher = wrap(kernel)

        class Grid:
            def __getitem__(self, grid):
                run = launcher[grid]

                def launch(*args, **kwargs):
                    record(kwargs)
                    return run(*args, **kwargs)
                return launch
        return Grid()

    monkeypatch.setattr(flashop._launch.attention, "launch_kernel", recording_launch)
    monkeypatch.setattr(flashop._launch.attention, "wrap_triton", recording_wrap)
    with replayed_launches(lambda kernel, kwargs: record(kwargs)):
        yield flags


@pytest.fixture
def strictly_deterministic():
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


CASE = Case(B=1, S_q=20, S_k=27, H_kv=1, G=2, D=16, DV=16, dtype=torch.float16, causal=True,
            sinks=torch.float32)


def _dense_grads(dropout_p=0.0):
    (q, k, v), dout, dlse = make_inputs(CASE)
    sinks = make_modifiers(CASE)["sinks"]
    torch.manual_seed(0)
    out, lse = flashop.attention_with_lse(q, k, v, sinks=sinks, causal=True,
                                          dropout_p=dropout_p)
    return torch.autograd.grad((out, lse), (q, k, v, sinks), (dout, dlse))


def _packed_grads():
    args, dout, dlse = make_packed([9, 14], [12, 3], H_kv=1, G=2, D=16, dtype=torch.float16)
    out, lse = flashop.attention_varlen_with_lse(**args, causal=True)
    return torch.autograd.grad((out, lse), (args["q"], args["k"], args["v"]), (dout, dlse))


def test_atomics_are_launched_when_opted_into(dq_atomic_launches):
    """(The recording works: outside deterministic mode the switch selects the atomics.)"""
    with flashop.config.override(dq_atomics=True):
        _dense_grads()
        _packed_grads()
    assert dq_atomic_launches == [True, True], dq_atomic_launches


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_deterministic_algorithms_never_launch_atomics(dq_atomic_launches,
                                                       strictly_deterministic, dropout_p):
    with flashop.config.override(dq_atomics=True):
        first = _dense_grads(dropout_p)
        second = _dense_grads(dropout_p)
        _packed_grads()
    assert dq_atomic_launches == [False] * 3, dq_atomic_launches
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_a_caller_asking_for_atomics_gets_none_under_deterministic_algorithms(
        dq_atomic_launches, strictly_deterministic):
    (q, k, v), dout, dlse = make_inputs(CASE)
    q, k, v = q.detach(), k.detach(), v.detach()
    out, _, lse_log2 = torch.ops.flashop.attention_forward(q, k, v, causal=True)
    mods = flashop._launch.options.modifiers(causal=True)
    flashop._launch.attention.attention_backward(dout, dlse, q, k, v, out, lse_log2, None, mods,
                                                 False, deterministic=False)
    assert dq_atomic_launches == [False]


class _GluonReached(Exception):
    def __init__(self, counters):
        super().__init__()
        self.counters = counters


def test_deterministic_algorithms_reach_the_gluon_backward_only_in_order(monkeypatch):
    """The Gluon backward adds dQ by TMA reductions, in no fixed order unless given its
    counters (launched outside the recording above): with it available (here: as if on a
    Hopper GPU, its launch replaced by a stand-in) and dQ by atomics asked for, a plain
    D=128 call reaches it without counters outside deterministic mode, and only with them
    under torch.use_deterministic_algorithms(True) (with the switch on: the call is shorter
    than the default rule's)."""
    monkeypatch.setattr(flashop._launch.gluon, "unavailable", lambda device: None)

    def stand_in(*args, **kwargs):
        raise _GluonReached(args[7])

    monkeypatch.setattr(flashop._launch.gluon, "attention_backward", stand_in)
    case = Case(B=1, S_q=17, S_k=17, H_kv=1, G=2, D=128, DV=128, dtype=torch.bfloat16,
                causal=True)
    (q, k, v), dout, _ = make_inputs(case)
    with flashop.config.override(dq_atomics=True):
        out = flashop.attention(q, k, v, causal=True)
        with pytest.raises(_GluonReached) as reached:
            torch.autograd.grad(out, (q, k, v), dout)
        assert reached.value.counters is None
        enabled = torch.are_deterministic_algorithms_enabled()
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            out = flashop.attention(q, k, v, causal=True)
            grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # tl
            with flashop.config.override(gluon=True), pytest.raises(_GluonReached) as reached:
                torch.autograd.grad(out, (q, k, v), dout)
            assert reached.value.counters is not None
        finally:
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    assert all(torch.isfinite(g).all() for g in grads)



def _door_calls():
    """Each function that takes ``deterministic``, called on small inputs with that option:
    flashop's dense and packed calls (and their _with_lse forms), the operator, and
    flash-attn's."""
    from flashop import flash_attn as fa

    q, k, v = (torch.randn(1, 6, 2, 16, dtype=torch.float16, device=DEVICE, requires_grad=True)
               for _ in range(3))
    cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE)
    packed = (q[0], k[0], v[0], cu, cu, 4, 4)
    yield lambda **o: flashop.attention(q, k, v, causal=True, **o)
    yield lambda **o: flashop.attention_with_lse(q, k, v, causal=True, **o)[0]
    yield lambda **o: flashop.attention_varlen(*packed, causal=True, **o)
    yield lambda **o: flashop.attention_varlen_with_lse(*packed, causal=True, **o)[0]
    yield lambda **o: torch.ops.flashop.attention(q, k, v, causal=True, **o)
    yield lambda **o: fa.flash_attn_func(q, k, v, causal=True, **o)
    yield lambda **o: fa.flash_attn_varlen_func(*packed, causal=True, **o)


def test_deterministic_true_reaches_the_backward_from_every_door(dq_atomic_launches):
    """With the atomics forced on (FLASHOP_DQ_ATOMICS=1), each door's default backward adds
    dQ by atomics and its ``deterministic=True`` backward does not (through the direct eager
    path, and through the operators for the operator's call)."""
    calls = list(_door_calls())
    with flashop.config.override(dq_atomics=True):
        for call in calls:
            call().sum().backward()
            call(deterministic=True).sum().backward()
        with flashop.config.override(direct_eager=False):
            calls[0](deterministic=True).sum().backward()
    assert dq_atomic_launches == [True, False] * len(calls) + [False], dq_atomic_launches
