"""Autocast: inside ``torch.autocast`` every operator family takes q, k, v (and appended keys
and values) in the region's dtype, as SDPA does: outputs in that dtype, the same bits as a
call on inputs cast by hand, gradients back through the casts to fp32 leaves, eagerly,
through the operators and compiled; a transformers model with fp32 weights trains and
generates under bf16 autocast."""

import pytest
import torch

import flashop
from helpers import DEVICE

DTYPES = [torch.bfloat16, torch.float16]


def _leaves(*shapes, dtype=torch.float32):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    return [torch.randn(s, device=DEVICE, generator=gen).to(dtype).requires_grad_()
            for s in shapes]


def _grads(outputs, inputs, seed=1):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    cotangents = [torch.randn(o.shape, device=DEVICE, generator=gen).to(o.dtype)
                  for o in outputs]
    return torch.autograd.grad(outputs, inputs, cotangents)


def _calls():
    """The ways one call reaches the forward: the Python API (the eager path), the operator
    (its Autocast kernel), and the Python API sent through the operator."""
    def api(*args, **kw):
        return flashop.attention_with_lse(*args, **kw)

    def op(q, k, v, attn_mask=None, g=None, sinks=None, window_size=(-1, -1), **kw):
        return torch.ops.flashop.attention_with_lse(
            q, k, v, attn_mask, None, g, sinks, window_size_left=window_size[0],
            window_size_right=window_size[1], **kw)

    def api_through_op(*args, **kw):
        with flashop.config.override(direct_eager=False):
            return flashop.attention_with_lse(*args, **kw)

    return {"api": api, "op": op, "api-through-op": api_through_op}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("call", list(_calls()))
def test_dense_calls_run_in_the_regions_dtype(call, dtype):
    """fp32 q and k with v already in the region's dtype (transformers' rotary gives fp32 q
    and k), an fp32 mask, gate and sinks: the outputs and gradients equal those of the call
    on q, k, v cast by hand, bit for bit; the leaves' gradients are fp32."""
    fn = _calls()[call]
    q, k = _leaves((2, 30, 4, 16), (2, 41, 2, 16))
    (v,) = _leaves((2, 41, 2, 16), dtype=dtype)
    mask, g, sinks = _leaves((1, 4, 30, 41), (2, 41, 4), (4,))
    options = dict(causal=True, window_size=(20, 0), softcap=3.0)
    with torch.autocast(DEVICE, dtype=dtype):
        out, lse = fn(q, k, v, attn_mask=mask, g=g, sinks=sinks, **options)
    assert out.dtype == dtype and lse.dtype == torch.float32
    grads = _grads((out, lse), (q, k, v, mask, g, sinks))
    assert [x.dtype for x in grads] == [torch.float32] * 2 + [dtype] + [torch.float32] * 3
    cast = [x.detach().to(dtype).requires_grad_() for x in (q, k)]
    ref_out, ref_lse = flashop.attention_with_lse(*cast, v, mask, None, g, sinks, **options)
    ref_grads = _grads((ref_out, ref_lse), (*cast, v, mask, g, sinks))
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    for grad, ref in zip(grads, ref_grads):
        assert torch.equal(grad, ref.to(grad.dtype))


def test_16_bit_modifiers_of_another_dtype_are_cast_and_fp32_ones_kept():
    q, k, v = _leaves((1, 20, 2, 16), (1, 20, 2, 16), (1, 20, 2, 16))
    (bias,) = _leaves((1, 2, 20, 20), dtype=torch.float16)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = flashop.attention(q, k, v, bias)
    ref = flashop.attention(*(x.to(torch.bfloat16) for x in (q, k, v)), bias.bfloat16())
    assert torch.equal(out, ref)


def test_packed_calls():
    q, k, v = _leaves((50, 4, 16), (70, 2, 16), (70, 2, 16))
    cu_q = torch.tensor([0, 20, 50], device=DEVICE, dtype=torch.int32)
    cu_k = torch.tensor([0, 40, 70], device=DEVICE, dtype=torch.int32)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = flashop.attention_varlen(q, k, v, cu_q, cu_k, 30, 40, causal=True)
    ref = flashop.attention_varlen(*(x.to(torch.bfloat16) for x in (q, k, v)), cu_q, cu_k, 30,
                                   40, causal=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    assert _grads((out,), (q,))[0].dtype == torch.float32


@pytest.mark.parametrize("direct", [True, False])
def test_decode_calls_append_in_the_regions_dtype(direct):
    """fp32 q, new keys and values and rotary tables over a bf16 cache: cast, appended
    (rotated) and attended as the call on bf16 inputs; the cache is written in place."""
    q, new_k, new_v = (x.detach() for x in _leaves((2, 1, 4, 16), (2, 1, 2, 16),
                                                   (2, 1, 2, 16)))
    cache = torch.randn(2, 32, 2, 16, device=DEVICE).to(torch.bfloat16)
    lens = torch.tensor([3, 17], device=DEVICE, dtype=torch.int32)
    angle = torch.rand(32, 8, device=DEVICE) * 6.3
    rotary = dict(rotary_cos=angle.cos(), rotary_sin=angle.sin())
    caches = (cache.clone(), cache.clone())
    with torch.autocast(DEVICE, dtype=torch.bfloat16), \
            flashop.config.override(direct_eager=direct):
        out = flashop.attention_with_kvcache(q, *caches, new_k, new_v, cache_seqlens=lens,
                                             causal=True, **rotary)
    expected = (cache.clone(), cache.clone())
    ref = flashop.attention_with_kvcache(
        q.bfloat16(), *expected, new_k.bfloat16(), new_v.bfloat16(), cache_seqlens=lens,
        causal=True, **{name: x.bfloat16() for name, x in rotary.items()})
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(caches, expected))


@pytest.mark.parametrize("direct", [True, False])
def test_paged_prefill_reads_its_caches_cast(direct):
    """fp32 q over fp32 pages, only read: both cast, as the call on bf16 inputs."""
    q = torch.randn(12, 4, 16, device=DEVICE)
    pages = torch.randn(4, 16, 2, 16, device=DEVICE)
    cu = torch.tensor([0, 5, 12], device=DEVICE, dtype=torch.int32)
    table = torch.tensor([[2, 0], [1, 3]], device=DEVICE, dtype=torch.int32)
    with torch.autocast(DEVICE, dtype=torch.bfloat16), \
            flashop.config.override(direct_eager=direct):
        out = flashop.attention_varlen(q, pages, pages, cu, cu * 2, 7, 14, causal=True,
                                       block_table=table)
    ref = flashop.attention_varlen(q.bfloat16(), pages.bfloat16(), pages.bfloat16(), cu, cu * 2,
                                   7, 14, causal=True, block_table=table)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)


@pytest.mark.compile
def test_compiled_under_autocast_equals_eager():
    q, k, v = _leaves((1, 40, 2, 16), (1, 40, 2, 16), (1, 40, 2, 16))

    def step(q, k, v):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            return flashop.attention(q, k, v, causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)(q, k, v)
    eager = step(q, k, v)
    assert compiled.dtype == torch.bfloat16 and torch.equal(compiled, eager)
    for a, b in zip(_grads((compiled,), (q, k, v)), _grads((eager,), (q, k, v))):
        assert a.dtype == torch.float32 and torch.equal(a, b)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2", "gpt_oss"])
def test_transformers_models_with_fp32_weights_under_bf16_autocast(kind):
    """What Trainer(bf16=True) does: fp32 weights, a training step's loss and gradients under
    bf16 autocast (flashop's logits within the accuracy rule of eager attention's under the
    same autocast, against a float64 per-row reference), and greedy generation (its decoding
    steps take fp32 queries over the bf16 cache)."""
    pytest.importorskip("transformers")
    from tiny_models import left_padded_batch, per_row_reference, positions, tiny_model

    from flashop.testing import accuracy

    model = tiny_model(kind).train()
    ids, mask = left_padded_batch([7, 10], 10, seed=1)
    keep = mask.bool()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        logits = model(ids, attention_mask=mask, position_ids=positions(mask)).logits
        logits[keep].float().square().mean().backward()
        with torch.no_grad():
            tokens = model.eval().generate(ids, attention_mask=mask, max_new_tokens=3,
                                           do_sample=False)
        model.set_attn_implementation("eager")
        with torch.no_grad():
            plain = model(ids, attention_mask=mask, position_ids=positions(mask)).logits
    assert tokens.shape == (2, 13)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all()
               for g in grads)
    with torch.no_grad():
        ref = torch.cat(per_row_reference(model, ids, mask, lambda b, x: x))
    result = accuracy("logits", logits[keep].float(), ref, plain[keep].float(), 2,
                      torch.bfloat16)
    assert result.ok, str(result)
