"""Meta tensors (a model built under ``torch.device("meta")``): every public function answers
with meta outputs of the right shapes and dtypes, gradients included, from the operators'
fakes (the paged prefill's included), and no launcher runs."""

import pytest
import torch

import flashop
from flashop import flash_attn as fa
from flashop._launch import attention as launch_attention, kvcache as launch_kvcache

META = torch.device("meta")


@pytest.fixture(autouse=True)
def no_launches(monkeypatch):
    """Every launcher entry point raises: a meta call must not reach one."""
    def refuse(*args, **kwargs):
        raise AssertionError("a launcher ran on meta tensors")

    for module, names in ((launch_attention, ("attention_forward", "attention_backward")),
                          (launch_kvcache, ("attention_with_kvcache",))):
        for name in names:
            monkeypatch.setattr(module, name, refuse)


def _meta(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(shape, device=META, dtype=dtype, requires_grad=grad)


def test_dense_calls_and_their_gradients():
    q, k, v = _meta(2, 40, 4, 16, grad=True), _meta(2, 33, 2, 16, grad=True), \
        _meta(2, 33, 2, 24, grad=True)
    g = _meta(2, 33, 4, dtype=torch.float32, grad=True)
    sinks = _meta(4, dtype=torch.float32, grad=True)
    bias = _meta(1, 4, 40, 33, dtype=torch.float32, grad=True)
    out, lse = flashop.attention_with_lse(q, k, v, bias, _meta(4, dtype=torch.float32), g,
                                          sinks, causal=True, window_size=(8, 0), softcap=2.0,
                                          dropout_p=0.1)
    assert (out.shape, out.dtype, out.device) == ((2, 40, 4, 24), torch.bfloat16, META)
    assert (lse.shape, lse.dtype, lse.device) == ((2, 4, 40), torch.float32, META)
    grads = torch.autograd.grad((out, lse), (q, k, v, g, sinks, bias),
                                (torch.ones_like(out), torch.ones_like(lse)))
    for grad, x in zip(grads, (q, k, v, g, sinks, bias)):
        assert (grad.shape, grad.dtype, grad.device) == (x.shape, x.dtype, META)
    assert flashop.attention(q, k, v).shape == (2, 40, 4, 24)


def test_packed_calls_and_their_gradients():
    q, k, v = _meta(50, 4, 16, grad=True), _meta(70, 2, 16, grad=True), _meta(70, 2, 16)
    cu_q = torch.empty(4, device=META, dtype=torch.int32)
    cu_k = torch.empty(4, device=META, dtype=torch.int32)
    out, lse = flashop.attention_varlen_with_lse(q, k, v, cu_q, cu_k, 30, 40, causal=True)
    assert (out.shape, out.device, lse.shape) == ((50, 4, 16), META, (4, 50))
    dq, dk = torch.autograd.grad(out.sum(), (q, k))
    assert dq.shape == q.shape and dk.shape == k.shape and dq.device == META
    assert flashop.attention_varlen(q, k, v, cu_q, cu_k, 30, 40).shape == (50, 4, 16)


@pytest.mark.parametrize("paged", [False, True])
def test_decode_calls(paged):
    q, new = _meta(3, 2, 4, 16), _meta(3, 2, 2, 16)
    if paged:
        cache = _meta(12, 16, 2, 16)
        table = torch.empty(3, 4, device=META, dtype=torch.int32)
    else:
        cache, table = _meta(3, 64, 2, 16), None
    out, lse = flashop.attention_with_kvcache(q, cache, cache, new, new, cache_seqlens=5,
                                              block_table=table, causal=True,
                                              sinks=_meta(4, dtype=torch.float32),
                                              return_lse=True)
    assert (out.shape, out.device, lse.shape) == ((3, 2, 4, 16), META, (3, 4, 2))


def test_paged_prefill():
    q, cache = _meta(50, 4, 16), _meta(12, 16, 2, 16)
    cu = torch.empty(4, device=META, dtype=torch.int32)
    table = torch.empty(3, 4, device=META, dtype=torch.int32)
    out, lse = flashop.attention_varlen_with_lse(q, cache, cache, cu, cu, 30, 64, causal=True,
                                                 block_table=table)
    assert (out.shape, out.device, lse.shape) == ((50, 4, 16), META, (4, 50))


def test_flash_attn_functions():
    q, k = _meta(2, 40, 4, 16), _meta(2, 40, 2, 16)
    out, lse, _ = fa.flash_attn_func(q, k, k, causal=True, return_attn_probs=True)
    assert (out.shape, out.device, lse.shape) == ((2, 40, 4, 16), META, (2, 4, 40))
    cu = torch.empty(3, device=META, dtype=torch.int32)
    assert fa.flash_attn_varlen_func(q[0], k[0], k[0], cu, cu, 30, 30).shape == (40, 4, 16)
    assert fa.flash_attn_with_kvcache(q[:, :1], k, k, cache_seqlens=7).shape == (2, 1, 4, 16)


def test_a_transformers_model_built_on_meta():
    pytest.importorskip("transformers")
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    import flashop.transformers as ft

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("llama"),
                                                 attn_implementation=ft.ATTN_IMPLEMENTATION)
    ids = torch.zeros(2, 9, dtype=torch.long, device=META)
    logits = model(ids).logits
    assert (logits.shape, logits.device) == ((2, 9, 100), META)
