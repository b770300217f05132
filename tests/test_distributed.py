"""flashop.distributed: the zigzag layout, the ring's kernel calls, and ring attention over
gloo process groups of 1, 2 and 4 CPU processes (the kernels in Triton's interpreter), held
to the accuracy rule against the whole sequence."""

import contextlib
import datetime
import itertools
import os
import tempfile
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashop
import flashop.distributed as fd
from flashop.testing import check_attention
from helpers import (
    DEVICE, Case, TestCase, deterministic_algorithms, make_inputs, make_modifiers,
)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed missing")


# --- the plan: which pairs each ring step's kernel calls keep (no kernels run) ------------


def _global(rank, W, C, x):
    """The global position of row x of ``rank``'s zigzag shard."""
    return rank * C + x if x < C else (2 * W - 1 - rank) * C + x - C


def _kept_by_calls(rank, src, W, C, causal, window, alibi):
    """{(global query, global key): ALiBi distance the call applies} for the pairs the calls
    of one ring step keep, by the kernels' rules (queries aligned to the keys' end)."""
    kept = {}
    for call in fd._plan(rank, src, W, C, causal, window, alibi):
        n_q, n_k = call.q1 - call.q0, call.k1 - call.k0
        d = n_k - n_q
        left, right = call.window
        for i, j in itertools.product(range(n_q), range(n_k)):
            if left != -1 and j < i + d - left:
                continue
            if (call.causal and j > i + d) or (right != -1 and j > i + d + right):
                continue
            gi, gj = _global(rank, W, C, call.q0 + i), _global(src, W, C, call.k0 + j)
            assert (gi, gj) not in kept, "a pair is attended twice"
            if call.alibi == "native":
                dist_ij = abs(i + d - j)
            elif call.alibi == "bias":
                assert (call.qg, call.kg) == (_global(rank, W, C, call.q0),
                                              _global(src, W, C, call.k0))
                dist_ij = abs((call.qg + i) - (call.kg + j))
            else:
                dist_ij = None
            kept[(gi, gj)] = dist_ij
    return kept


# (window, causal) of the calls ring_attention takes (causal with a right bound above 0 is
# refused by the checks: test_errors)
_WINDOWS = [(window, causal) for window in ((-1, -1), (0, 0), (3, -1), (-1, 2), (2, 5), (7, 0),
                                            (13, 1))
            for causal in (False, True) if not (causal and window[1] > 0)]


@pytest.mark.parametrize("W", [1, 2, 3, 4])
@pytest.mark.parametrize("window,causal", _WINDOWS)
@pytest.mark.parametrize("alibi", [False, True])
def test_plan_keeps_exactly_the_global_mask(W, window, causal, alibi):
    """Over all ring steps the calls keep each pair the whole sequence's mask keeps, once,
    and ALiBi distances are the global ones."""
    C = 4
    S = 2 * W * C
    left, right = window
    for rank in range(W):
        kept = {}
        for src in range(W):
            step = _kept_by_calls(rank, src, W, C, causal, window, alibi)
            assert not set(step) & set(kept)
            kept.update(step)
        want = {(i, j) for i in (_global(rank, W, C, x) for x in range(2 * C)) for j in range(S)
                if (left == -1 or j >= i - left) and (right == -1 or j <= i + right)
                and (not causal or j <= i)}
        assert set(kept) == want
        if alibi:
            assert all(d == abs(i - j) for (i, j), d in kept.items())


@pytest.mark.parametrize("W", [2, 4, 8])
def test_causal_zigzag_balances_the_steps(W):
    """Under causal attention every rank computes as many scores as every other, each step
    (2C^2; step 0: the causal 2C x 2C square)."""
    C = 3
    for step in range(W):
        work = []
        for rank in range(W):
            calls = fd._plan(rank, (rank - step) % W, W, C, True, (-1, -1), False)
            work.append(sum((c.q1 - c.q0) * (c.k1 - c.k0) // (2 if c.causal else 1)
                            for c in calls))
        assert len(set(work)) == 1, work


def test_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    x = torch.zeros(1, 8, 2, 16)
    for call in (lambda: fd.shard_sequence(x), lambda: fd.gather_sequence(x),
                 lambda: fd.ring_attention(x, x, x)):
        with pytest.raises(RuntimeError, match="init_process_group"):
            call()


class TestBackendErrors(TestCase):
    """The process group's backend checked against the inputs' device before any exchange
    (gloo sends CPU tensors only; a CUDA tensor handed to it died inside gloo)."""

    def message(self, backend_config, device):
        with pytest.raises(RuntimeError) as info:
            fd._check_backend(backend_config, torch.device(device), "ring_attention")
        return str(info.value)

    def test_gloo_with_cuda_tensors(self):
        self.assertExpectedInline(self.message("cpu:gloo,cuda:gloo", "cuda:1"), """\
ring_attention: q, k and v are on cuda:1, but the process group cannot send them: its backend for cuda tensors is gloo, which sends CPU tensors only; use a group with the NCCL backend for CUDA tensors (init_process_group("nccl") or new_group(backend="nccl"))""")

    def test_nccl_with_cpu_tensors(self):
        self.assertExpectedInline(self.message("cuda:nccl", "cpu"), """\
ring_attention: q, k and v are on cpu, but the process group cannot send them: it has no backend for cpu tensors (its backends: cuda:nccl); use a group with the gloo backend for CPU tensors (init_process_group("gloo") or new_group(backend="gloo"))""")

    def test_another_device(self):
        self.assertExpectedInline(self.message("cpu:gloo,cuda:gloo", "meta"), """\
ring_attention: q, k and v are on meta, but the process group cannot send them: it has no backend for meta tensors (its backends: cpu:gloo,cuda:gloo); use a group whose backend sends meta tensors (NCCL for CUDA tensors, gloo for CPU tensors)""")

    def test_backends_that_send(self):
        for config, device in (("cpu:gloo,cuda:gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cuda"),
                               ("cuda:nccl", "cuda"), ("gloo", "cpu")):
            fd._check_backend(config, torch.device(device), "ring_attention")

    def test_ring_attention_checks_before_any_exchange(self):
        """On a (faked) two-rank group of the other device's backend (NCCL for CPU inputs,
        gloo for CUDA ones), the inputs are refused before anything is sent."""
        x = torch.zeros(1, 8, 2, 16, device=DEVICE)
        ring = fd._Ring(0, 2, (0, 1), None)
        other = "cuda:nccl" if DEVICE == "cpu" else "cpu:gloo,cuda:gloo"
        with mock.patch.object(fd, "_ring", lambda group, op: ring), \
                mock.patch.object(fd.dist, "get_backend_config", lambda group=None: other), \
                mock.patch.object(fd, "_exchange", side_effect=AssertionError("sent")):
            with pytest.raises(RuntimeError, match="cannot send them"):
                fd.ring_attention(x, x, x)


# --- gloo process groups --------------------------------------------------------------------

CASES = {
    1: [Case(1, 32, 32, 2, 2, 16, 16, torch.float32, causal=True),
        Case(1, 32, 32, 1, 2, 16, 16, torch.float32, window_size=(5, 3), softcap=2.0,
             alibi=(2,))],
    2: [Case(1, 32, 32, 2, 2, 16, 16, torch.float32, causal=True),
        Case(2, 32, 32, 1, 2, 32, 16, torch.float16),
        Case(1, 48, 48, 2, 1, 16, 16, torch.float16, causal=True, window_size=(7, -1),
             alibi=(1, 2)),
        Case(1, 32, 32, 1, 2, 16, 16, torch.float32, window_size=(3, 10), softcap=3.0)],
    4: [Case(1, 32, 32, 1, 4, 16, 16, torch.float32, causal=True),
        Case(1, 32, 32, 2, 1, 16, 16, torch.float32, causal=True, window_size=(5, 0),
             alibi=(2,)),
        Case(1, 32, 32, 1, 2, 16, 16, torch.float16, window_size=(-1, 9), softcap=1.5)],
}
# on W GPUs (NCCL), longer sequences and bf16
GPU_CASES = [
    Case(2, 4096, 4096, 2, 4, 128, 128, torch.bfloat16, causal=True),
    Case(1, 2048, 2048, 4, 2, 64, 64, torch.bfloat16, causal=True, window_size=(300, 0),
         alibi=(8,)),
    Case(1, 2048, 2048, 2, 2, 128, 128, torch.float16, window_size=(-1, 500), softcap=10.0),
    Case(1, 1024, 1024, 2, 1, 32, 32, torch.float32),
]


def _check_errors(W):
    x = torch.zeros(1, 2 * W * 3, 2, 16)
    with pytest.raises(ValueError, match="divisible into 2 \\* world_size"):
        fd.shard_sequence(x[:, 1:])
    with pytest.raises(ValueError, match="must be even"):
        fd.gather_sequence(x[:, :5])
    with pytest.raises(ValueError, match="same length"):
        fd.ring_attention(x[:, :6], x[:, :6], x[:, :4])
    with pytest.raises(ValueError, match="attention_chunk=4 is not supported"):
        fd.ring_attention(x[:, :6], x[:, :6], x[:, :6], attention_chunk=4)
    if W > 1:
        with pytest.raises(ValueError, match="must be even"):
            fd.ring_attention(x[:, :5], x[:, :5], x[:, :5])


def _ring_results(W, case) -> list:
    """Ring attention's out, lse and gradients (gathered) of ``case``; with W = 1, checked
    bitwise against the plain operator's."""
    (q, k, v), dout, dlse = make_inputs(case)
    mods = make_modifiers(case)
    shards = [fd.shard_sequence(t.detach()).requires_grad_() for t in (q, k, v)]
    assert torch.equal(fd.gather_sequence(shards[0]), q)  # the round trip is exact
    out, lse = fd.ring_attention_with_lse(*shards, alibi_slopes=mods["alibi_slopes"],
                                          **case.options())
    grads = torch.autograd.grad(
        (out, lse), shards, (fd.shard_sequence(dout), fd.shard_sequence(dlse, dim=2)))
    result = [fd.gather_sequence(out), fd.gather_sequence(lse, dim=2)]
    result += [fd.gather_sequence(g) for g in grads]
    if W == 1:  # the plain op's results, bitwise
        out1, lse1 = flashop.attention_with_lse(q, k, v, **mods, **case.options())
        want = [out1, lse1, *torch.autograd.grad((out1, lse1), (q, k, v), (dout, dlse))]
        assert all(torch.equal(a, b) for a, b in zip(result, want))
    return result


def _worker(rank, W, outdir, cases):
    gpu = DEVICE == "cuda"
    if gpu:
        torch.cuda.set_device(rank)  # "cuda" (helpers.DEVICE) is this rank's GPU
    # the ranks meet through a file in the test's directory (no free port to find)
    dist.init_process_group("nccl" if gpu else "gloo",
                            init_method="file://" + os.path.join(outdir, "store"), rank=rank,
                            world_size=W, timeout=datetime.timedelta(seconds=120))
    try:
        _check_errors(W)
        if not gpu:  # this group's own backends read: gloo sends no CUDA tensor
            with pytest.raises(RuntimeError, match="NCCL backend for CUDA tensors"):
                fd._check_backend(dist.get_backend_config(), torch.device("cuda"), "ring")
        # W = 1 equals the plain operator bitwise, where both run the reproducible backward
        # (the default one may add dQ by atomics on a GPU)
        for n, case in enumerate(cases):
            with deterministic_algorithms() if W == 1 else contextlib.nullcontext():
                result = _ring_results(W, case)
            if rank == 0:
                torch.save([t.detach() for t in result], os.path.join(outdir, f"{n}.pt"))
        # every rank done before any tears its group down
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A rank that got here has checked and saved everything; it leaves without Python's
    # finalization, whose C++ destructors now and then aborted the process after its group
    # was torn down ("terminate called without an active exception", no Python frame; about
    # one run in twenty on 2 cores), which mp.spawn reports as the test's failure.
    os._exit(0)


def _run_and_check(W, cases):
    with tempfile.TemporaryDirectory() as outdir:
        # the children inherit TRITON_INTERPRET (tests/conftest.py) before importing flashop
        mp.spawn(_worker, args=(W, outdir, cases), nprocs=W, join=True)
        for n, case in enumerate(cases):
            out, lse, *grads = torch.load(os.path.join(outdir, f"{n}.pt"))
            inputs, dout, dlse = make_inputs(case)
            for result in check_attention(*inputs, dout, dlse, out, lse, grads,
                                          **make_modifiers(case), **case.options()):
                assert result.ok, f"{case}: {result}"


@pytest.mark.skipif(DEVICE != "cpu", reason="gloo on CPU tensors")
@pytest.mark.parametrize("W", [1, 2, 4])
def test_ring_attention_matches_whole_sequence(W):
    """Ring attention on W processes: out, lse and dq, dk, dv (gathered) pass the accuracy
    rule against the whole sequence; with W = 1 they equal flashop.attention's bitwise."""
    _run_and_check(W, CASES[W])


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA GPUs")
@pytest.mark.parametrize("W", [1, 2, 4, 8])
def test_ring_attention_on_gpus(W):
    """As above on W GPUs over NCCL, in bf16, fp16 and fp32."""
    if torch.cuda.device_count() < W:
        pytest.skip(f"needs {W} GPUs")
    _run_and_check(W, GPU_CASES)
