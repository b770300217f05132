"""flashop.flash_attn: flash-attn 2.x's signatures, results and lse layouts on flashop."""

import inspect

import pytest
import torch

import flashop
from flashop import flash_attn as fa
from flashop.testing import check_attention, check_attention_varlen, dropout_mask
from helpers import DEVICE, poisoned_outputs

# flash-attn 2.x's public signatures (flash_attn/flash_attn_interface.py): name, default
_TAIL = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
         ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
         ("deterministic", False), ("return_attn_probs", False)]
_REQUIRED = inspect.Parameter.empty
# FlashAttention-3's descales of fp8 inputs, after flash-attn 2.x's parameters
_FP8 = [("q_descale", None), ("k_descale", None), ("v_descale", None)]
# FlashAttention-3's chunked attention, last, in the functions that take it there
_CHUNK = [("attention_chunk", 0)]
SIGNATURES = {
    "flash_attn_func": ([("q", _REQUIRED), ("k", _REQUIRED), ("v", _REQUIRED)] + _TAIL + _FP8
                        + _CHUNK),
    "flash_attn_qkvpacked_func": [("qkv", _REQUIRED)] + _TAIL + _CHUNK,
    "flash_attn_kvpacked_func": [("q", _REQUIRED), ("kv", _REQUIRED)] + _TAIL,
    "flash_attn_varlen_func": (
        [(n, _REQUIRED) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k",
                                  "max_seqlen_q", "max_seqlen_k")]
        + _TAIL + [("block_table", None)] + _FP8 + _CHUNK),
    "flash_attn_varlen_qkvpacked_func": (
        [(n, _REQUIRED) for n in ("qkv", "cu_seqlens", "max_seqlen")] + _TAIL),
    "flash_attn_varlen_kvpacked_func": (
        [(n, _REQUIRED) for n in ("q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                  "max_seqlen_k")] + _TAIL),
    "flash_attn_with_kvcache": (
        [(n, _REQUIRED) for n in ("q", "k_cache", "v_cache")]
        + [(n, None) for n in ("k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
                               "cache_batch_idx", "cache_leftpad", "block_table",
                               "softmax_scale")]
        + [("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0),
           ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
           ("return_softmax_lse", False)]
        # FlashAttention-3's descales of an fp8 cache, after flash-attn 2.x's parameters,
        # then its queries' (which came later, so that the others keep their places)
        + [("k_descale", None), ("v_descale", None), ("q_descale", None)] + _CHUNK),
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_is_flash_attns(name):
    params = inspect.signature(getattr(fa, name)).parameters.values()
    assert [(p.name, p.default) for p in params] == SIGNATURES[name]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)


def _randn(*shape, gen, dtype=torch.float16):
    return torch.randn(*shape, device=DEVICE, generator=gen).to(dtype).requires_grad_()


@pytest.mark.parametrize("options", [
    dict(causal=True),
    dict(causal=True, window_size=(5, 0), softcap=3.0),
    dict(window_size=(3, 2), alibi=True, softmax_scale=0.2),
])
def test_flash_attn_func_matches_reference(options):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    B, S_q, S_k, H, H_kv, D = 2, 19, 23, 4, 2, 16
    q, k, v = _randn(B, S_q, H, D, gen=gen), _randn(B, S_k, H_kv, D, gen=gen), \
        _randn(B, S_k, H_kv, D, gen=gen)
    options = dict(options)
    slopes = torch.rand(H, device=DEVICE, generator=gen) if options.pop("alibi", False) else None
    dout = torch.randn(B, S_q, H, D, device=DEVICE, generator=gen).half()
    dlse = torch.randn(B, H, S_q, device=DEVICE, generator=gen)
    with poisoned_outputs():
        out, lse, probs = fa.flash_attn_func(q, k, v, 0.0, alibi_slopes=slopes,
                                             return_attn_probs=True, **options)
        grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    assert probs is None and lse.shape == (B, H, S_q) and lse.dtype == torch.float32
    scale = options.pop("softmax_scale", None)
    for result in check_attention(q, k, v, dout, dlse, out, lse, grads, alibi_slopes=slopes,
                                  scale=scale, **options):
        assert result.ok, str(result)
    # without return_attn_probs: the output alone, the same values
    assert torch.equal(fa.flash_attn_func(q, k, v, alibi_slopes=slopes, softmax_scale=scale,
                                          **options), out)


def test_packed_layouts_give_flash_attn_func_results_and_grads():
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    B, S, H, D = 2, 17, 2, 8
    qkv = _randn(B, S, 3, H, D, gen=gen)
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(2))
    expected = flashop.attention(q, k, v, causal=True)
    assert torch.equal(out, expected)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    assert torch.equal(dqkv, torch.stack(torch.autograd.grad(expected, (q, k, v), dout), 2))

    q = _randn(B, 11, 4, D, gen=gen)
    kv = _randn(B, S, 2, H, D, gen=gen)
    out = fa.flash_attn_kvpacked_func(q, kv, causal=True)
    assert torch.equal(out, flashop.attention(q, kv[:, :, 0], kv[:, :, 1], causal=True))
    (dkv,) = torch.autograd.grad(out, kv, torch.ones_like(out))
    assert dkv.shape == kv.shape and torch.isfinite(dkv).all()


def _cu(lens):
    return torch.tensor([0] + lens, device=DEVICE).cumsum(0).to(torch.int32)


def test_varlen_functions_match_reference_and_each_other():
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    lens_q, lens_k = [5, 0, 13], [9, 4, 13]
    H, H_kv, D = 4, 2, 16
    q = _randn(sum(lens_q), H, D, gen=gen)
    k, v = _randn(sum(lens_k), H_kv, D, gen=gen), _randn(sum(lens_k), H_kv, D, gen=gen)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    dout = torch.randn(sum(lens_q), H, D, device=DEVICE, generator=gen).half()
    dlse = torch.randn(H, sum(lens_q), device=DEVICE, generator=gen)
    with poisoned_outputs():
        out, lse, probs = fa.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, window_size=(4, 0),
            return_attn_probs=True)
        grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    assert probs is None and lse.shape == (H, sum(lens_q))
    for result in check_attention_varlen(q, k, v, cu_q, cu_k, dout, dlse, out, lse, grads,
                                         causal=True, window_size=(4, 0)):
        assert result.ok, str(result)

    kv = torch.stack((k, v), 1).detach()
    assert torch.equal(fa.flash_attn_varlen_kvpacked_func(
        q, kv, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, window_size=(4, 0)), out)

    qkv = torch.stack((q, q.flip(0), q.roll(1, 0)), 1).detach()
    cu = _cu([6, 12])
    expected = flashop.attention_varlen(*qkv.unbind(1), cu, cu, 12, 12, softcap=2.0)
    assert torch.equal(fa.flash_attn_varlen_qkvpacked_func(qkv, cu, 12, softcap=2.0), expected)


def test_unsupported_arguments_raise_naming_them():
    q = torch.zeros(1, 4, 2, 8, device=DEVICE, dtype=torch.float16)
    with pytest.raises(ValueError, match="dropout_p=0.1 is not supported with a block_table"):
        cu = _cu([4])
        fa.flash_attn_varlen_func(q[0], torch.zeros(1, 16, 2, 8, device=DEVICE).half(),
                                  torch.zeros(1, 16, 2, 8, device=DEVICE).half(), cu, cu, 4, 4,
                                  0.1, block_table=torch.zeros(1, 1, dtype=torch.int32,
                                                               device=DEVICE))
    with pytest.raises(ValueError, match=r"qkv \(batch, seqlen, 3, nheads, headdim\)"):
        fa.flash_attn_qkvpacked_func(q)


def test_dropout_matches_reference_with_the_drawn_mask():
    """dropout_p > 0 (positional, as flash-attn's callers pass it): out, lse and gradients
    against the reference with the mask of the seed the call draws from torch's generator
    (torch.manual_seed reproduces it); lse is the undropped softmax's."""
    gen = torch.Generator(device=DEVICE).manual_seed(6)
    B, S_q, S_k, H, H_kv, D, p = 1, 13, 17, 4, 2, 16, 0.3
    q, k, v = _randn(B, S_q, H, D, gen=gen), _randn(B, S_k, H_kv, D, gen=gen), \
        _randn(B, S_k, H_kv, D, gen=gen)
    dout = torch.randn(B, S_q, H, D, device=DEVICE, generator=gen).half()
    dlse = torch.randn(B, H, S_q, device=DEVICE, generator=gen)
    torch.manual_seed(7)
    with poisoned_outputs():
        out, lse, probs = fa.flash_attn_func(q, k, v, p, None, True, return_attn_probs=True)
        grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    assert probs is None
    torch.manual_seed(7)
    seed = flashop._ops.attention.dropout_seed(q, p)
    mask = dropout_mask(seed, B, H, S_q, S_k, p)
    for result in check_attention(q, k, v, dout, dlse, out, lse, grads, causal=True,
                                  dropout_p=p, dropout_mask=mask):
        assert result.ok, str(result)
    # the same seed, the same mask: flashop.attention's values; another seed, others
    torch.manual_seed(7)
    assert torch.equal(out, flashop.attention(q, k, v, causal=True, dropout_p=p))
    assert not torch.equal(fa.flash_attn_func(q, k, v, p, causal=True), out)


def test_varlen_dropout_equals_attention_varlen_with_the_same_seed():
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    lens = [6, 11]
    q, k, v = (_randn(sum(lens), 2, 8, gen=gen) for _ in range(3))
    cu = _cu(lens)
    torch.manual_seed(8)
    out = fa.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, dropout_p=0.25, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    torch.manual_seed(8)
    expected = flashop.attention_varlen(q, k, v, cu, cu, 11, 11, causal=True, dropout_p=0.25)
    assert torch.equal(out, expected)
    for got, want in zip(grads, torch.autograd.grad(expected, (q, k, v),
                                                    torch.ones_like(out))):
        assert torch.equal(got, want)
    assert not torch.equal(out, flashop.attention_varlen(q, k, v, cu, cu, 11, 11, causal=True))


def _cache_call(gen, B=2, S_q=2, S_new=2, H_kv=2, G=2, D=16, rows=3, S_cache=32):
    """q, dense caches of ``rows`` rows (random contents) and new keys/values, fp16."""
    def randn(*shape):
        return torch.randn(*shape, device=DEVICE, generator=gen).half()
    q = randn(B, S_q, H_kv * G, D)
    k_cache, v_cache = randn(rows, S_cache, H_kv, D), randn(rows, S_cache, H_kv, D)
    k, v = randn(B, S_new, H_kv, D), randn(B, S_new, H_kv, D)
    return q, k_cache, v_cache, k, v


def test_flash_attn_with_kvcache_appends_in_place_and_equals_attention_with_kvcache():
    """Appending k, v: the caller's caches hold them afterwards (nothing else changed), and
    out, lse (flash-attn's (batch, nheads, seqlen)) and the caches equal
    flashop.attention_with_kvcache's on copies, with flash-attn's positional arguments."""
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    q, k_cache, v_cache, k, v = _cache_call(gen)
    lengths = torch.tensor([5, 20], dtype=torch.int32, device=DEVICE)
    rows = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    slopes = torch.rand(4, device=DEVICE, generator=gen)
    k_copy, v_copy = k_cache.clone(), v_cache.clone()
    before = k_cache.clone()
    # flash-attn's positions: ..., cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
    # softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, ...
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, None, None, lengths, rows,
                                          None, None, 0.3, True, (8, 0), 2.0, True, slopes, 0,
                                          True)
    expected, expected_lse = flashop.attention_with_kvcache(
        q, k_copy, v_copy, k, v, cache_seqlens=lengths, cache_batch_idx=rows, scale=0.3,
        causal=True, window_size=(8, 0), softcap=2.0, alibi_slopes=slopes, return_lse=True)
    assert lse.shape == (2, 4, 2) and lse.dtype == torch.float32
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    assert torch.equal(k_cache, k_copy) and torch.equal(v_cache, v_copy)
    for b, (row, n) in enumerate(((2, 5), (0, 20))):
        assert torch.equal(k_cache[row, n:n + 2], k[b]) and torch.equal(v_cache[row, n:n + 2],
                                                                        v[b])
    written = torch.zeros_like(before, dtype=torch.bool)
    written[2, 5:7] = written[0, 20:22] = True
    assert torch.equal(k_cache[~written], before[~written])


def test_flash_attn_with_kvcache_without_append():
    """cache_seqlens as an int over a paged cache; None attends every position of the row
    (flash-attn's default); q requiring grad gives an output without grad, as flash-attn's."""
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    q, k_cache, v_cache, _, _ = _cache_call(gen, S_q=1, rows=4, S_cache=16)
    block_table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32, device=DEVICE)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=21,
                                     block_table=block_table, causal=True)
    assert torch.equal(out, flashop.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=21, block_table=block_table, causal=True))

    q = q.requires_grad_()
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, softcap=1.5)
    assert not out.requires_grad
    full = torch.full((2,), 16, dtype=torch.int32, device=DEVICE)
    assert torch.equal(out, flashop.attention_with_kvcache(
        q.detach(), k_cache, v_cache, cache_seqlens=full, softcap=1.5))


def test_flash_attn_with_kvcache_rotary_and_left_padding():
    """rotary_cos, rotary_sin (positional, as flash-attn's), rotary_interleaved and
    cache_leftpad reach flashop.attention_with_kvcache: the same outputs and caches."""
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    q, k_cache, v_cache, k, v = _cache_call(gen, S_cache=16)
    angle = 6.3 * torch.rand(16, 4, device=DEVICE, generator=gen)
    cos, sin = angle.cos().half(), angle.sin().half()
    lengths = torch.tensor([2, 9], dtype=torch.int32, device=DEVICE)
    pads = torch.tensor([1, 4], dtype=torch.int32, device=DEVICE)
    k_copy, v_copy = k_cache.clone(), v_cache.clone()
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, lengths,
                                     cache_leftpad=pads, causal=True, rotary_interleaved=False)
    expected = flashop.attention_with_kvcache(
        q, k_copy, v_copy, k, v, cache_seqlens=lengths, cache_leftpad=pads, rotary_cos=cos,
        rotary_sin=sin, rotary_interleaved=False, causal=True)
    assert torch.equal(out, expected)
    assert torch.equal(k_cache, k_copy) and torch.equal(v_cache, v_copy)
    assert not torch.equal(k_cache[0, 2:4], k[0])  # written rotated
    with pytest.raises(ValueError, match="k and v .* need cache_seqlens"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v)
