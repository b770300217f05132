"""End to end: a small Llama-style model generating greedily with flashop's cache attention
(paged and dense caches) gives the tokens of the same model with plain PyTorch attention."""

import sys
from pathlib import Path

import pytest
import torch

from helpers import DEVICE

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from decode_model import ModelConfig, build, generate  # noqa: E402


def _tokens(cfg, backend, batch=2, steps=10, step_fn=None, dtype=torch.float32):
    model = build(cfg, backend, batch, DEVICE, dtype)
    prompt = torch.randint(0, cfg.vocab, (batch, 5), device=DEVICE,
                           generator=torch.Generator(device=DEVICE).manual_seed(1))
    return generate(model, prompt, steps, step_fn(model) if step_fn else None)


@pytest.mark.parametrize("page", [16, 0], ids=["paged", "dense"])
def test_greedy_tokens_equal_plain_pytorch_attention(page):
    cfg = ModelConfig(vocab=128, dim=64, layers=2, heads=4, kv_heads=2, hidden=128,
                      max_len=32, page=page)
    tokens = _tokens(cfg, "flashop")
    assert tokens.shape == (2, 10)
    assert torch.equal(tokens, _tokens(cfg, "sdpa"))


# eager on purpose, which FlexAttention warns of
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
def test_flex_peer_gives_plain_pytorch_attentions_tokens():
    """The benchmark's FlexAttention peer (eager here: PyTorch's unfused reference) decodes
    the tokens of the SDPA one, so its tokens/s are those of the same model."""
    cfg = ModelConfig(vocab=128, dim=64, layers=2, heads=4, kv_heads=2, hidden=128,
                      max_len=32, page=0)
    assert torch.equal(_tokens(cfg, "flex"), _tokens(cfg, "sdpa"))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_decode_step_compiles_fullgraph_and_replays_from_cuda_graphs(mode):
    """The decode step under torch.compile(fullgraph=True) (and CUDA graphs) gives the eager
    tokens with a paged cache. In fp32: in bf16 Inductor's fusions of the rest of the model
    round differently from eager, and greedy tokens may part at a near tie."""
    cfg = ModelConfig(max_len=64, page=16)
    eager = _tokens(cfg, "flashop", batch=4, steps=40)
    torch._dynamo.reset()
    compiled = _tokens(cfg, "flashop", batch=4, steps=40,
                       step_fn=lambda m: torch.compile(m.decode_step, fullgraph=True,
                                                       mode=mode))
    assert torch.equal(compiled, eager)


def test_decode_benchmark_table_needs_no_gpu(capsys):
    """benchmarks/decode.py's table from its rows: GB/s fractions and flashop over SDPA."""
    import decode

    rows = [dict(provider=p, layout=lay, page=page, B=1, L=4096, us=us, frac_copy=f)
            for p, lay, page, us, f in (("flashop", "dense", 0, 10.0, 0.8),
                                        ("flashop", "paged", 16, 11.0, 0.7),
                                        ("sdpa", "dense", 0, 20.0, 0.4))]
    decode.print_table(rows)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].split()[2:] == ["flashop", "flashop-p16", "sdpa", "flashop/sdpa"]
    assert lines[-1].split() == ["1", "4096", "10.0us", "80%", "11.0us", "70%", "20.0us",
                                 "40%", "2.00x"]


def test_fp8_cache_backend_generates():
    """The benchmark's flashop-fp8 backend (a float8_e4m3fn cache scaled per head from the
    prefill) runs in bf16 and starts with SDPA's first token (same prefill)."""
    cfg = ModelConfig(vocab=128, dim=64, layers=1, heads=4, kv_heads=2, hidden=128,
                      max_len=32, page=16)
    tokens = _tokens(cfg, "flashop-fp8", steps=3, dtype=torch.bfloat16)
    assert tokens.shape == (2, 3)
    assert torch.equal(tokens[:, 0], _tokens(cfg, "sdpa", steps=3, dtype=torch.bfloat16)[:, 0])
