"""The eager path's plans (flashop/_launch/plans.py): a signature's first call runs the
operators' bodies, checks included, and later calls replay their allocations and launches;
each keyed item (shapes, strides, dtypes, alignment, aliasing, options, switches,
deterministic mode, forced tiles) takes its own plan; results equal the operator's bit for
bit; errors fire on every call that does not pass the checks."""

import contextlib

import pytest
import torch

import flashop
from flashop._launch import attention as launch, launches, plans, tiles
from flashop._ops import attention as ops, eager
from helpers import DEVICE, deterministic_algorithms, error_message

B, S, H, D = 1, 20, 1, 16


def _inputs(dtype=torch.float32, seed=0, shape=(B, S, H, D)):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g, device=DEVICE, dtype=dtype) for _ in range(3))
    return q, k, v, torch.randn(shape, generator=g, device=DEVICE, dtype=dtype)


def _run(q, k, v, dout, **options):
    """out, lse and the three gradients of one call (dout: out's cotangent); a tensor passed
    as two of q, k, v stays one leaf."""
    leaves = {}
    q, k, v = (leaves.setdefault(id(x), x.detach().requires_grad_()) for x in (q, k, v))
    out, lse = flashop.attention_with_lse(q, k, v, **options)
    return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))


def _operator(q, k, v, dout, **options):
    with flashop.config.override(direct_eager=False):
        return _run(q, k, v, dout, **options)


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture
def checked(monkeypatch):
    """How many times each body ran its checks and its launcher (forward, backward)."""
    counts = dict(forward=0, backward=0, forward_launcher=0, backward_launcher=0)

    def counting(name, fn):
        def counted(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return counted

    monkeypatch.setattr(ops, "_call", counting("forward", ops._call))
    monkeypatch.setattr(ops, "_backward_call", counting("backward", ops._backward_call))
    monkeypatch.setattr(launch, "attention_forward",
                        counting("forward_launcher", launch.attention_forward))
    monkeypatch.setattr(launch, "attention_backward",
                        counting("backward_launcher", launch.attention_backward))
    return counts


def test_a_repeated_signature_is_checked_once(checked):
    """The second and later calls of a signature (new tensors of the same shapes, strides
    and dtypes) replay the plan: no checks, no launcher; the results equal the operator's
    bit for bit, with and without autograd."""
    expected = [_operator(*_inputs(seed=seed), causal=True) for seed in range(2)]
    assert checked == dict(forward=2, backward=2, forward_launcher=2, backward_launcher=2)
    for seed in range(2):
        assert _equal(_run(*_inputs(seed=seed), causal=True), expected[seed])
    assert checked == dict(forward=3, backward=3, forward_launcher=3, backward_launcher=3)
    with torch.no_grad():
        for seed in range(2):
            assert torch.equal(flashop.attention(*_inputs(seed=seed)[:3], causal=True),
                               expected[seed][0])
    assert checked["forward"] == 3


def _padded(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values with wider rows (other strides)."""
    return torch.zeros(*x.shape[:-1], x.shape[-1] + 16, device=x.device,
                       dtype=x.dtype)[..., :x.shape[-1]].copy_(x)


def _aligned_copy_at(x: torch.Tensor, offset: int) -> torch.Tensor:
    """``x``'s values in memory that starts ``offset`` elements past an allocation's start."""
    y = torch.empty(x.numel() + offset, device=x.device, dtype=x.dtype)[offset:]
    return y.view(x.shape).copy_(x)


@pytest.mark.parametrize("change", [
    "shape", "stride", "dtype", "alignment", "aliasing", "causal", "scale", "window",
    "chunk", "softcap", "switch", "deterministic", "forced tiles", "dout's strides"])
def test_each_keyed_item_takes_its_own_plan(change, checked):
    """After a signature's plan is made, a call that differs from it in one keyed item runs
    the checks again (a new plan), and its results equal the operator's bit for bit."""
    q, k, v, dout = _inputs()
    options = dict(causal=True)
    _run(q, k, v, dout, **options)
    assert checked["forward"] == checked["backward"] == 1
    context = contextlib.nullcontext()  # a switch or mode, for the call and the operator's
    if change == "shape":
        q, k, v, dout = _inputs(shape=(B, S + 1, H, D))
    elif change == "stride":
        q, k, v, dout = (_padded(x) for x in (q, k, v, dout))
    elif change == "dtype":
        q, k, v, dout = _inputs(dtype=torch.float16)
    elif change == "alignment":
        q = _aligned_copy_at(q, 1)
    elif change == "aliasing":
        k = v = q
    elif change == "causal":
        options = dict(causal=False)
    elif change == "scale":
        options = dict(causal=True, scale=0.5)
    elif change == "window":
        options = dict(causal=True, window_size=(7, 0))
    elif change == "chunk":
        options = dict(causal=True, attention_chunk=8)
    elif change == "softcap":
        options = dict(causal=True, softcap=3.0)
    elif change == "switch":
        context = flashop.config.override(warp_specialize=False)
    elif change == "deterministic":
        context = deterministic_algorithms()
    elif change == "forced tiles":
        context = tiles.force("fwd", tiles.Tiles(16, 16))
    elif change == "dout's strides":
        dout = _padded(dout)
    with context:
        got = _run(q, k, v, dout, **options)
        expected = _operator(q, k, v, dout, **options)
    assert _equal(got, expected)
    assert checked["backward"] == 3, checked  # the new signature's call, and the operator's
    assert checked["forward"] == (2 if change == "dout's strides" else 3), checked


def test_errors_fire_on_every_call_that_fails_the_checks():
    """A bad call takes no plan: after a good call of the same shapes, a call of another
    dtype, window or scale raises the operator's message, and does again."""
    q, k, v, dout = _inputs()
    _run(q, k, v, dout, causal=True)
    for _ in range(2):
        for bad in (dict(k=k.double()), dict(window_size=(-2, 0)), dict(scale=float("nan"))):
            call = {**dict(q=q, k=k, v=v, causal=True), **bad}
            direct = error_message(flashop.attention, **call)
            with flashop.config.override(direct_eager=False):
                assert error_message(flashop.attention, **call) == direct


def test_calls_that_compute_on_the_host_run_the_body_each_time(checked):
    """A gate (its cumulative sum) is computed besides the launches: such calls are not
    replayed (their checks and launcher run every time); ALiBi slopes, sinks, dropout, an
    attn_mask (a broadcast view of it) and packed batches are. Results equal the
    operator's."""
    q, k, v, dout = _inputs()
    torch.manual_seed(0)
    slopes = torch.rand(H, device=DEVICE)
    sinks = torch.randn(H, device=DEVICE)
    gate = torch.nn.functional.logsigmoid(torch.randn(B, S, H, device=DEVICE))
    mask = torch.rand(S, S, device=DEVICE) > 0.3
    for modifiers, replayed in ((dict(alibi_slopes=slopes, sinks=sinks), True),
                                (dict(dropout_p=0.25), True), (dict(attn_mask=mask), True),
                                (dict(g=gate), False)):
        plans.clear_plans()
        torch.manual_seed(1)
        expected = _operator(q, k, v, dout, causal=True, **modifiers)
        before = dict(checked)
        for _ in range(2):
            torch.manual_seed(1)
            assert _equal(_run(q, k, v, dout, causal=True, **modifiers), expected)
        for body in ("forward", "backward"):
            assert checked[body] - before[body] == (1 if replayed else 2), (modifiers, body)
        assert [type(plan) for plan in eager._forward.plans.values()] == (
            [plans.Plan] if replayed else [type(None)])


def test_packed_calls_replay():
    cu = torch.tensor([0, 7, 30], device=DEVICE, dtype=torch.int32)
    q, k, v, dout = (torch.randn(30, H, D, device=DEVICE) for _ in range(4))

    def run():
        x = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = flashop.attention_varlen_with_lse(*x, cu, cu, 23, 23, causal=True)
        return (out, lse, *torch.autograd.grad(out, x, dout))

    with flashop.config.override(direct_eager=False):
        expected = run()
    assert _equal(run(), expected) and _equal(run(), expected)
    assert [type(plan) for plan in eager._forward.plans.values()] == [plans.Plan]


def test_a_plan_replays_tensor_operations_and_launches():
    """What a body may do to be replayed: allocate (torch.empty, zeros and their kin), fill,
    copy, take views (a detached alias, a view of a zeroed buffer) and launch, each replayed
    on the call's own tensors; any other tensor operation (a cumulative sum, a value read on
    the host) leaves it to the body on every call."""
    from flashop.kernels.dropout import dropout_mask_kernel

    def body(seed, zeroed=False, view=False, other=None):
        keep = torch.empty((1, 1, 16, 16), dtype=torch.uint8, device=seed.device)
        if zeroed:
            keep = torch.zeros_like(keep)
        target = keep.view(16, 16) if view else keep.detach()
        if other == "cumsum":
            seed = seed.cumsum(0)
        elif other == "item":
            assert seed.item() > 0
        launches.launch_now(dropout_mask_kernel, (1, 1, 1), dropout_seed=seed, keep=target,
                            S_q=16, S_k=16, dropout_p=0.5, BLOCK_M=16, BLOCK_N=16)
        copied = torch.empty_like(keep).copy_(keep)
        return keep, copied

    planned = plans.PlannedBody(body)
    for replayed in (dict(), dict(zeroed=True), dict(view=True)):
        planned.plans.clear()
        first = planned(torch.tensor([7], device=DEVICE), **replayed)
        assert isinstance(next(iter(planned.plans.values())), plans.Plan), replayed
        again = planned(torch.tensor([7], device=DEVICE), **replayed)
        other = planned(torch.tensor([8], device=DEVICE), **replayed)
        assert torch.equal(first[0], again[0]) and torch.equal(again[0], again[1])
        assert first[0].data_ptr() != again[0].data_ptr() != again[1].data_ptr()
        assert not torch.equal(other[0], again[0])  # the call's own seed
    for other in ("cumsum", "item"):
        planned.plans.clear()
        planned(torch.tensor([7], device=DEVICE), other=other)
        assert list(planned.plans.values()) == [None], other


def test_a_plan_remakes_descriptors_for_the_calls_tensors(monkeypatch):
    """A launch's host-made descriptor (the Gluon kernels') is remade on each replay for the
    call's own tensor (``rebased``), its block kept; the plan keeps no call's tensor alive."""
    import gc
    import weakref

    launched = []
    monkeypatch.setattr(plans, "launch_and_keep",
                        lambda kernel, grid, kwargs: launched.append(kwargs))

    class Descriptor:
        def __init__(self, base, block):
            self.base, self.block = base, block

        def rebased(self, x):
            return Descriptor(x, self.block)

    def body(x):
        out = torch.empty_like(x)
        launches.launch_now(object(), (1,), x_desc=Descriptor(x, 16), o_desc=Descriptor(out, 8),
                            n=3)
        return (out,)

    planned = plans.PlannedBody(body)
    first = torch.ones(4)
    planned(first)
    watched = weakref.ref(first)
    for _ in range(2):
        x = torch.ones(4)
        (out,) = planned(x)
        call = launched[-1]
        assert call["x_desc"].base is x and call["o_desc"].base is out
        assert (call["x_desc"].block, call["o_desc"].block, call["n"]) == (16, 8, 3)
    assert [type(p) for p in planned.plans.values()] == [plans.Plan] and len(launched) == 3
    del first, x, out, call
    launched.clear()
    gc.collect()
    assert watched() is None


def test_replayed_views_follow_the_calls_own_tensors():
    """A view replayed on a call's own tensor starts where that tensor starts: two calls of
    one signature whose inputs sit at other offsets of their storage (a slice of a larger
    buffer, then a tensor of its own) each read their own values."""

    def body(x):
        return (torch.empty(4, device=x.device).copy_(x.view(-1)[2:6]),)

    planned = plans.PlannedBody(body)
    base = torch.arange(40.0, device=DEVICE)
    first = base[8:16].view(2, 4)  # storage offset 8
    assert torch.equal(planned(first)[0], base[10:14])
    assert isinstance(next(iter(planned.plans.values())), plans.Plan)
    for x in (base[24:32].view(2, 4), torch.arange(100.0, 108.0, device=DEVICE).view(2, 4)):
        assert torch.equal(planned(x)[0], x.reshape(-1)[2:6])


def test_a_chain_of_views_replays_as_one():
    """A view of a view replays as one view of the chain's first tensor, and a view that no
    later step and no output reads is not replayed: a buffer's slices (as the Gluon
    backward's buffers are cut from one allocation) still land where the body put them."""

    def body(x):
        buf = torch.zeros(24, device=x.device)
        head = buf[:8].view(2, 4)  # slice, then view
        tail = buf[8:].view(4, 4)[1:3].view(8)  # three views, each read by the next alone
        head.copy_(x)
        tail.fill_(5.0)
        return buf, head, tail

    planned = plans.PlannedBody(body)
    planned(torch.ones(2, 4, device=DEVICE))
    plan = next(iter(planned.plans.values()))
    assert isinstance(plan, plans.Plan)
    # zeros (and the alias of them that the body holds), the two views read (each taken
    # from the zeros), the copy and the fill; each chain's slices are not replayed
    assert len(plan.steps) == 6
    for _ in range(2):
        x = torch.arange(8.0, device=DEVICE).view(2, 4)
        buf, head, tail = planned(x)
        expected = torch.zeros(24, device=DEVICE)
        expected[:8] = x.view(-1)
        expected[12:20] = 5.0
        assert torch.equal(buf, expected)
        assert head.data_ptr() == buf.data_ptr() and torch.equal(head, x)
        assert tail.data_ptr() == buf[12:].data_ptr() and tail.shape == (8,)
