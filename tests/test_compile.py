"""flashop inside torch.compile(fullgraph=True): a transformer block, forward and backward,
matching eager, and no recompilation across sequence lengths with dynamic shapes."""

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import flashop
from helpers import DEVICE

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
