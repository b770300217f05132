"""flashop inside torch.compile(fullgraph=True): a transformer block, forward and backward,
matching eager, and no recompilation across sequence lengths with dynamic shapes."""

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import flashop
from helpers import DEVICE, deterministic_algorithms

pytestmark = pytest.mark.compile


class Block(nn.Module):
    """Pre-norm transformer block with grouped-query causal attention; with ``modifiers``,
    also a sliding window, softcap, ALiBi, a learned log-decay gate and a learned distance
    bias (a float attn_mask that requires grad)."""

    def __init__(self, dim=64, heads=4, kv_heads=2, modifiers=False):
        super().__init__()
        self.modifiers = modifiers
        if modifiers:
            self.gate = nn.Linear(dim, heads)
            self.bias_scale = nn.Parameter(torch.tensor(0.05))
            self.register_buffer("slopes", 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads))
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        B, S, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(B, S, self.heads, self.head_dim)
        k, v = self.kv(h).view(B, S, 2, self.kv_heads, self.head_dim).unbind(2)
        if self.modifiers:
            pos = torch.arange(S, device=x.device, dtype=torch.float32)
            bias = -self.bias_scale * (pos[:, None] - pos[None, :]).abs()  # (S, S)
            g = nn.functional.logsigmoid(self.gate(h).float())  # (B, S, heads)
            o = flashop.attention(q, k, v, bias, self.slopes, g, causal=True,
                                  window_size=(24, 0), softcap=20.0)
        else:
            o = flashop.attention(q, k, v, causal=True)
        x = x + self.proj(o.reshape(B, S, -1))
        return x + self.mlp(self.norm2(x))


def _run(model, x):
    out = model(x)
    grads = torch.autograd.grad(out.square().mean(), [x, *model.parameters()])
    return out, grads


@pytest.mark.parametrize("modifiers", [False, True])
def test_block_compiles_fullgraph_matches_eager_and_does_not_recompile(modifiers):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = Block(modifiers=modifiers).to(DEVICE)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    frames = []
    for S in (17, 40, 33, 64):
        x = torch.randn(2, S, 64, device=DEVICE, requires_grad=True)
        out, grads = _run(compiled, x)
        frames.append(counter.frame_count)
        out_eager, grads_eager = _run(model, x)
        torch.testing.assert_close(out, out_eager)
        for g, g_eager in zip(grads, grads_eager):
            torch.testing.assert_close(g, g_eager)
    assert frames == frames[:1] * 4, f"recompiled: frames compiled after each length {frames}"
    # one graph holds the whole block (an empty one may stand for the module's wrapper)
    assert sum(len(g.graph.nodes) > 0 for g in counter.graphs) == 1


def test_op_in_the_traced_graph():
    """Dynamo puts the flashop op itself in the graph (no graph break, no fallback)."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda q, k, v: flashop.attention(q, k, v, causal=True) * 2,
                       fullgraph=True, backend=counter)
    q = torch.randn(1, 20, 2, 16, device=DEVICE, requires_grad=True)
    fn(q, q, q).sum().backward()
    assert any("flashop.attention" in str(node.target) for node in counter.graphs[0].graph.nodes)


def test_torch_export():
    torch.manual_seed(0)
    model = Block().to(DEVICE).eval()
    x = torch.randn(2, 24, 64, device=DEVICE)
    exported = torch.export.export(model, (x,))
    assert any("flashop.attention" in str(n.target) for n in exported.graph.nodes)
    torch.testing.assert_close(exported.module()(x), model(x))


def _traced_graph(fn, *args, tracing_mode="fake"):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode=tracing_mode)(*args)


def _called_ops(gm) -> list:
    """The operators a traced graph calls, in order."""
    return [n for n in gm.graph.nodes
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]


def test_compiled_graphs_reach_the_gluon_kernels_through_the_opaque_operators(monkeypatch):
    """Where an eager call takes a Gluon kernel (here made available on this device, and
    traced only: nothing runs), a call traced for a graph compiled here calls the eager
    launcher through attention_forward_opaque / attention_backward_opaque (Inductor cannot
    trace Gluon), with static and symbolic lengths and no guard on the latter; the
    backward's determinism is resolved where it is traced. A call traced for export or
    for AOTInductor keeps the tl kernels (the predicate declines), and so do calls the
    Gluon kernels decline."""
    from torch._inductor.virtualized import V

    from flashop._launch import choice, gluon
    from flashop._launch.options import modifiers
    from flashop._ops import attention as ops

    monkeypatch.setattr(gluon, "unavailable", lambda device: None)
    q, k, v = (torch.randn(1, 4096, 2, 128, dtype=torch.bfloat16, device=DEVICE)
               for _ in range(3))
    out, lse, lse_log2 = (torch.empty(1, 4096, 2, 128, dtype=torch.bfloat16, device=DEVICE),
                          *torch.empty(2, 1, 2, 4096, device=DEVICE).unbind())
    forward = lambda q, k, v: ops.run_forward(q, k, v, causal=True)  # noqa: E731
    backward = lambda *a: ops.run_backward(*a, causal=True)  # noqa: E731
    grads = (out, lse, q, k, v, out, lse_log2)
    for mode in ("fake", "symbolic"):
        gm = _traced_graph(forward, q, k, v, tracing_mode=mode)
        assert [str(n.target) for n in _called_ops(gm)] == [
            "flashop.attention_forward_opaque.default"], gm.code
        if mode == "symbolic":  # no guard on the lengths
            length = next(iter(gm.graph.nodes)).meta["val"].shape[1].node.expr
            assert not [g for g in gm.shape_env.guards if length in g.expr.free_symbols], \
                gm.shape_env.guards
        gm = _traced_graph(backward, *grads, tracing_mode=mode)
        nodes = _called_ops(gm)
        assert [str(n.target) for n in nodes] == [
            "flashop.attention_backward_opaque.default"], gm.code
        assert not nodes[0].kwargs.get("deterministic", False)
    with deterministic_algorithms():
        gm = _traced_graph(backward, *grads)
    assert [n.kwargs.get("deterministic") for n in _called_ops(gm)] == [True]

    mods = modifiers(causal=True)
    q_short = q[:, :64].contiguous()
    with torch._subclasses.FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        assert choice.forward_runs_opaque(fq, fk, fv, None, mods, None)
        assert not choice.forward_takes_gluon(fq, fk, fv, 0.1, mods, None)  # not eager
        monkeypatch.setattr(torch.compiler, "_is_exporting_flag", True)
        assert not choice.forward_runs_opaque(fq, fk, fv, None, mods, None)
        assert choice.gluon_backward_order(fq, fk, fv, fq, mods, False, None, False,
                                           traced=True) is None
        monkeypatch.setattr(torch.compiler, "_is_exporting_flag", False)
        with V.set_aot_compilation(True):
            assert not choice.forward_runs_opaque(fq, fk, fv, None, mods, None)
        for other in (dict(causal=True, window_size_left=8), dict(causal=True, softcap=5.0)):
            assert not choice.forward_runs_opaque(fq, fk, fv, None, modifiers(**other), None)
        short = mode.from_tensor(q_short)
        assert not choice.forward_runs_opaque(short, short, short, None, mods, None)
        assert choice.gluon_backward_order(short, short, short, short, mods, False, None,
                                           False, traced=True) is None
    # real tensors (an eager call) are never routed
    assert not choice.forward_runs_opaque(q, k, v, None, mods, None)
    assert not choice.forward_takes_gluon(q, k, v, 0.1, mods, None, traced=True)


def test_the_opaque_operators_equal_the_operators_bit_for_bit():
    """attention_forward_opaque and attention_backward_opaque run the operators' bodies as
    an eager call does; torch.library.opcheck passes on both."""
    from flashop._ops.attention import FORWARD_INPUTS  # noqa: F401 (the module registers them)

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (torch.randn(1, 24, 2, 16, device=DEVICE, generator=gen) for _ in range(3))
    options = dict(causal=True, softcap=3.0)
    expected = torch.ops.flashop.attention_forward(q, k, v, **options)
    result = torch.ops.flashop.attention_forward_opaque(q, k, v, **options)
    assert all(torch.equal(a, b) for a, b in zip(result, expected))
    out, lse, lse_log2 = expected
    dout = torch.randn(out.shape, device=DEVICE, generator=gen)
    args = (dout, torch.zeros_like(lse), q, k, v, out, lse_log2)
    expected = torch.ops.flashop.attention_backward(*args, **options)
    result = torch.ops.flashop.attention_backward_opaque(*args, **options)
    assert all(torch.equal(a, b) for a, b in zip(result, expected))
    torch.library.opcheck(torch.ops.flashop.attention_forward_opaque.default, (q, k, v),
                          options)
    torch.library.opcheck(torch.ops.flashop.attention_backward_opaque.default, args, options)


def test_the_compile_cache_key_names_the_launch_environment():
    """torch's AOTAutograd cache keys a graph by its Dynamo graph and the source of the
    Triton kernels torch keeps for each triton_op (get_triton_kernels_for_op): for every
    flashop op that source names flashop's code, switches and forced tiles, so that a
    graph compiled under other ones is not served. Checked in a process without the
    interpreter, where the ops are triton_ops (on the CPU too)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = """
import torch, flashop
from torch._library.triton import get_triton_kernels_for_op, triton_ops_to_kernels
from torch._inductor.codegen.wrapper import (
    user_defined_triton_kernel_transitive_closure_source_code as source)
from flashop._launch import calls, tiles
ops = sorted(n for n in triton_ops_to_kernels if n.startswith("flashop::"))
assert len(ops) >= 5, ops
def key():
    return ["".join(map(source, get_triton_kernels_for_op(n))) for n in ops]
plain = key()
with flashop.config.override(dq_atomics=True):
    atomics, with_atomics = key(), repr(calls.environment())
with tiles.force("dq", tiles.Tiles(64, 32, 4, 3)):
    forced = key()
assert key() == plain
for a, b, c in zip(plain, atomics, forced):
    assert a != b and a != c and b != c
    assert with_atomics in b and with_atomics not in a
print(len(ops), "ops")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[1] == "ops"
