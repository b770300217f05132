"""The CPU path (flashop/_launch/cpu): CPU tensors without Triton's interpreter.

Its accuracy is tested beside the kernels', by the ``test_cpu_path_*`` tests of each module
(the same draws, through tests/helpers.py's cpu_path). Here: the default routing in a fresh
process without the interpreter (eager calls, compiled graphs through the opaque operators,
opcheck, no Triton launch), the switch that sends CPU tensors there under the interpreter,
the bounds and tiles against the reference's, which calls SDPA's kernels take, that no
operation holds more than a tile of scores, and autocast.
"""

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flashop
from flashop._launch.cpu import attention as cpu_attention, bounds
from flashop._launch.cpu.bounds import Bounds, key_tiles
from flashop.reference import keys_in_bounds
from helpers import cpu_path

ROOT = Path(__file__).resolve().parents[1]

# A fresh process without TRITON_INTERPRET: the operators are triton_ops, CPU tensors take
# the CPU path, traced calls its opaque operators; a Triton launch would raise.
_DEFAULT_ROUTING = r"""
import torch, flashop
from torch._inductor.utils import run_and_get_code
from torch.library import opcheck
from flashop._launch import launches
from flashop.reference import kvcache_append_reference
from flashop.testing import check_attention

def no_launch(*args, **kwargs):
    raise AssertionError("a Triton kernel was launched")

launches.launch_kernel = launches.launch_now = launches.launch_planned = no_launch
assert not flashop.INTERPRETING
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, S, H, 16, generator=gen).requires_grad_()
           for S, H in ((37, 4), (45, 2), (45, 2)))
g = torch.nn.functional.logsigmoid(torch.randn(2, 45, 4, generator=gen) + 2).requires_grad_()
bias = torch.randn(1, 4, 37, 1, generator=gen).requires_grad_()
options = dict(causal=True, window_size=(20, 0), softcap=5.0)

def f(q, k, v, g, bias):
    return flashop.attention_with_lse(q, k, v, bias, torch.full((4,), 0.3), g, **options)

class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return flashop.attention(q, k, v, causal=True, softcap=5.0)

dout, dlse = torch.randn(2, 37, 4, 16, generator=gen), torch.randn(2, 4, 37, generator=gen)
out, lse = f(q, k, v, g, bias)
grads = torch.autograd.grad((out, lse), (q, k, v, g, bias), (dout, dlse))
for r in check_attention(q, k, v, dout, dlse, out, lse, (*grads[:3], grads[3], grads[4]),
                         bias, torch.full((4,), 0.3), g, **options):
    assert r.ok, str(r)
print("eager: the accuracy rule")

compiled = torch.compile(f, fullgraph=True)
(c_out, c_lse), code = run_and_get_code(compiled, q, k, v, g, bias)
c_grads = torch.autograd.grad((c_out, c_lse), (q, k, v, g, bias), (dout, dlse))
assert "flashop.attention_forward_opaque" in "".join(code)
assert torch.equal(c_out, out) and torch.equal(c_lse, lse)
assert all(torch.equal(a, b) for a, b in zip(c_grads, grads))
print("compiled: the opaque operators, eager's bits")

program = torch.export.export(Attention(), (q.detach(), k.detach(), v.detach()))
assert torch.ops.flashop.attention_forward.default in [n.target for n in program.graph.nodes]
assert torch.equal(program.module()(q, k, v), Attention()(q, k, v))
print("exported: the operators, eager's bits")

B, page, H_kv = 2, 16, 2
k_cache, v_cache = (torch.randn(6, page, H_kv, 16, generator=gen) for _ in range(2))
table = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32)
step = torch.compile(lambda *a, **o: flashop.attention_with_kvcache(*a, **o), fullgraph=True)
lengths = torch.tensor([3, 20], dtype=torch.int32)
for _ in range(2):
    qs, ks, vs = (torch.randn(B, 1, h, 16, generator=gen) for h in (4, H_kv, H_kv))
    expected = kvcache_append_reference(k_cache, v_cache, ks, vs, lengths, None, table)
    eager = flashop.attention_with_kvcache(qs, k_cache.clone(), v_cache.clone(), ks, vs,
                                           cache_seqlens=lengths, block_table=table,
                                           causal=True)
    got = step(qs, k_cache, v_cache, ks, vs, cache_seqlens=lengths, block_table=table,
               causal=True)
    assert torch.equal(got, eager)
    assert torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])
    lengths += 1
print("compiled decode: eager's bits, the caches appended")

x = torch.randn(1, 20, 2, 16, generator=gen)
e4m3 = torch.randn(1, 20, 2, 16, generator=gen).to(torch.float8_e4m3fn)
cu = torch.tensor([0, 5, 20], dtype=torch.int32)
for op, args, kwargs in [
        (torch.ops.flashop.attention_forward, (q, k, v), dict(causal=True, softcap=5.0)),
        (torch.ops.flashop.attention_backward,
         (dout, dlse, *(x.detach() for x in (q, k, v, out)),
          torch.ops.flashop.attention_forward(q, k, v)[2]), {}),
        (torch.ops.flashop.attention_with_kvcache,
         (qs, k_cache, v_cache, lengths, ks, vs, None, table), dict(causal=True)),
        (torch.ops.flashop.attention_varlen_paged,
         (x[0], k_cache, v_cache, cu, cu, 15, 15, table), dict(causal=True)),
        (torch.ops.flashop.attention_fp8, (e4m3, e4m3, e4m3), {})]:
    # (torch's CPU kernels cannot compare e4m3 tensors, which the schema test needs)
    opcheck(op, args, kwargs, test_utils=(
        "test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic",
        *(() if op is torch.ops.flashop.attention_fp8 else ("test_schema",))))
print("opcheck: every operator")
"""


def test_default_routing_without_the_interpreter():
    """In a process without TRITON_INTERPRET (as on a CPU-only machine, or a GPU machine's
    CPU tensors): eager calls with modifiers meet the accuracy rule, a compiled forward and
    backward runs the opaque operators with eager's bits, an exported program holds the
    operator and gives eager's bits, a compiled paged decoding loop appends as the reference
    does, every operator passes opcheck; no Triton kernel is launched. Inductor's caches
    are off: their keys do not hold flashop's Python code, so a graph traced by another
    checkout could stand in for this one's."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env.update(TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    done = subprocess.run([sys.executable, "-c", _DEFAULT_ROUTING], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "eager: the accuracy rule", "compiled: the opaque operators, eager's bits",
        "exported: the operators, eager's bits",
        "compiled decode: eager's bits, the caches appended", "opcheck: every operator"]


@pytest.mark.skipif(not flashop.INTERPRETING, reason="the switch acts under the interpreter")
def test_the_switch_sends_cpu_tensors_to_the_cpu_path():
    """Under the interpreter CPU tensors run the Triton kernels; with
    flashop.config's cpu_path, the CPU path (no launch)."""
    from flashop._launch import launches

    q = torch.randn(1, 20, 2, 16)
    with mock.patch.object(launches, "launch_now", wraps=launches.launch_now) as launched:
        flashop.attention(q, q, q, causal=True)
        assert launched.call_count > 0
        launched.reset_mock()
        with flashop.config.override(cpu_path=True):
            flashop.attention(q, q, q, causal=True)
        assert launched.call_count == 0


# (causal, window) pairs: none, causal, two-sided, one-sided, zero-width, past the lengths
_BOUNDS = [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 17)), (True, (16, -1)),
           (False, (-1, 3)), (False, (0, 0)), (True, (0, -1)), (False, (40, 0))]


@pytest.mark.parametrize("M,N", [(16, 16), (48, 32)])
def test_tiles_cover_exactly_the_attended_pairs(M, N):
    """The tiles the CPU path visits for each block of M queries, with their keep-masks,
    cover exactly the reference's attended pairs (flashop.reference.keys_in_bounds); a tile
    left unmasked is wholly attended, and none is wholly outside the bounds. Lengths at and
    either side of multiples of the tiles, S_q above and below S_k, no query, no key."""
    for S_q in (0, 1, 15, 16, 17, 47, 49):
        for S_k in (0, 1, 16, 31, 33, 64):
            for causal, (left, right) in _BOUNDS:
                expected = keys_in_bounds(S_q, S_k, causal, (left, right))
                where = Bounds(S_k - S_q, left, 0 if causal else right)
                seen = torch.zeros(S_q, S_k, dtype=torch.bool)
                for i0 in range(0, S_q, M):
                    i1 = min(i0 + M, S_q)
                    for j0, j1 in key_tiles(where, i0, i1, S_k, N):
                        assert j0 % N == 0
                        keep = where.keep(i0, i1, j0, j1)
                        if keep is None:
                            assert expected[i0:i1, j0:j1].all()
                            keep = torch.ones(i1 - i0, j1 - j0, dtype=torch.bool)
                        assert keep.any(), (S_q, S_k, causal, left, right, i0, j0)
                        seen[i0:i1, j0:j1] |= keep
                assert torch.equal(seen, expected), (S_q, S_k, causal, left, right)


def _sdpa_calls(*args, **kwargs) -> tuple:
    """(SDPA forwards, SDPA backwards) of a forward + backward of flashop.attention on the CPU
    path."""
    fwd = mock.patch.object(cpu_attention, "_sdpa_forward", wraps=cpu_attention._sdpa_forward)
    bwd = mock.patch.object(cpu_attention, "_sdpa_backward",
                            wraps=cpu_attention._sdpa_backward)
    with cpu_path(), fwd as forwards, bwd as backwards:
        flashop.attention(*args, **kwargs).sum().backward()
    return forwards.call_count, backwards.call_count


def test_sdpa_takes_the_calls_it_computes_as_flashop_does():
    """SDPA's CPU kernels take plain 16-bit calls with one head dim (grouped heads too),
    causal where S_q == S_k (their causal mask is top-left aligned); fp32 training calls,
    causal with S_q != S_k, any modifier, D != DV and no key run the blocked path. (Where
    they take a call, the property tests check it: test_cpu_path_matches_reference.)"""
    def t(S, H=2, D=16, dtype=torch.bfloat16):
        return torch.randn(1, S, H, D, dtype=dtype, requires_grad=True)

    assert _sdpa_calls(t(20, 4), t(30), t(30)) == (1, 1)
    assert _sdpa_calls(t(30), t(30), t(30), causal=True) == (1, 1)
    assert _sdpa_calls(t(20), t(30), t(30), causal=True) == (0, 0)
    assert _sdpa_calls(t(30, dtype=torch.float32), t(30, dtype=torch.float32),
                       t(30, dtype=torch.float32)) == (0, 0)
    assert _sdpa_calls(t(30), t(30), t(30), softcap=5.0) == (0, 0)
    assert _sdpa_calls(t(30), t(30), t(30, D=8)) == (0, 0)
    assert _sdpa_calls(t(30), t(0), t(0)) == (0, 0)


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operation makes."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


@pytest.mark.parametrize("options", [dict(window_size_left=4096, window_size_right=0),
                                     dict(softcap=5.0)], ids=["causal-window", "softcap"])
def test_the_blocked_path_holds_a_tile_of_scores_at_a_time(options):
    """The CPU path's forward and backward over 2048 queries and keys of 2 heads (8M scores)
    at the default tiles, every operation they run watched: none makes a tensor of more
    than bounds.TILE_ELEMENTS elements (512K; all 2048 keys of the 2048 queries would be 4M),
    so no (S_q, S_k) matrix."""
    from flashop._launch import attention as launch
    from flashop._launch.options import modifiers

    q, k, v, dout = (torch.randn(1, 2048, 2, 16) for _ in range(4))
    mods = modifiers(**options)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with flashop.config.override(cpu_path=True), _LargestTensor() as seen:
            out, lse, lse_log2 = launch.attention_forward(q, k, v, None, mods)
            launch.attention_backward(dout, torch.zeros_like(lse), q, k, v, out, lse_log2,
                                      None, mods, False)
    finally:
        torch.set_num_threads(threads)
    assert 2048 * 2 * 16 <= seen.largest <= bounds.TILE_ELEMENTS


def test_autocast_casts_the_inputs_not_the_cpu_paths_arithmetic():
    """Under torch.autocast("cpu", bfloat16), fp32 inputs run as the call on their bf16
    casts, bit for bit, through the direct eager path and the operator; the CPU path's own
    products stay fp32 inside the region."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 40, 2, 16, generator=gen) for _ in range(3))
    bias = torch.randn(1, 2, 40, 40, generator=gen)
    with cpu_path():
        expected = flashop.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), bias,
                                     causal=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            direct = flashop.attention(q, k, v, bias, causal=True)
            operator = torch.ops.flashop.attention(q, k, v, bias, causal=True)
    assert direct.dtype == torch.bfloat16
    assert torch.equal(direct, expected) and torch.equal(operator, expected)
