"""flashop.sdpa: the "flashop" entry of PyTorch's flash-attention registry, and the aten
overrides it installs, called directly (their CUDA dispatch needs a GPU: tests/test_gpu.py
style tests below run SDPA itself with flashop active)."""

import pytest
import torch
import torch.nn.functional as F

import flashop
from flashop import sdpa
from flashop.testing import check_attention, check_attention_varlen, dropout_mask
from helpers import DEVICE

attention = torch.nn.attention
needs_registry = pytest.mark.skipif(not hasattr(attention, "register_flash_attention_impl"),
                                    reason="torch without the flash-attention registry")


@pytest.fixture
def flashop_active():
    attention.activate_flash_attention_impl("flashop")
    try:
        yield
    finally:
        if attention.current_flash_attention_impl() == "flashop":
            attention.restore_flash_attention_impl()


@needs_registry
def test_registered_not_activated():
    assert sdpa.REGISTERED
    assert "flashop" in attention.list_flash_attention_impls()
    assert attention.current_flash_attention_impl() != "flashop"


@needs_registry
def test_activate_and_restore(flashop_active):
    assert attention.current_flash_attention_impl() == "flashop"
    attention.restore_flash_attention_impl()
    assert attention.current_flash_attention_impl() is None


def _bhsd(B, H, S, D, gen, dtype=torch.float16):
    return torch.randn(B, S, H, D, device=DEVICE, generator=gen).to(dtype).transpose(1, 2)


def test_sdpa_overrides_convert_layouts_and_match_flashop():
    """aten::_scaled_dot_product_flash_attention and its backward: (B, H, S, D) in and out,
    the aten tuple, natural-log lse (B, H, S_q), and flashop.attention's values and grads."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = _bhsd(2, 4, 13, 16, gen), _bhsd(2, 2, 13, 16, gen), _bhsd(2, 2, 13, 16, gen)
    result = sdpa.scaled_dot_product_flash_attention(q, k, v, 0.0, True, scale=0.3)
    out, lse, cu_q, cu_k, max_q, max_k, rng, unused, debug = result
    assert out.shape == (2, 4, 13, 16) and lse.shape == (2, 4, 13) and lse.dtype == torch.float32
    assert (max_q, max_k) == (13, 13) and cu_q is None and debug.numel() == 0
    q2, k2, v2 = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    expected, expected_lse = flashop.attention_with_lse(q2, k2, v2, causal=True, scale=0.3)
    assert torch.equal(out, expected.transpose(1, 2)) and torch.equal(lse, expected_lse)
    dout = torch.randn(2, 4, 13, 16, device=DEVICE, generator=gen).half()
    dq, dk, dv = sdpa.scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, 13, 13, 0.0, True, rng, unused, scale=0.3)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    # under the accuracy rule against the reference (the backward's lse comes from aten's
    # natural-log one, so its gradients are not flashop.attention's bit for bit)
    grads = tuple(g.transpose(1, 2) for g in (dq, dk, dv))
    results = check_attention(q2, k2, v2, dout.transpose(1, 2), torch.zeros_like(lse),
                              expected, expected_lse, grads, causal=True, scale=0.3)
    assert all(r.ok for r in results), [str(r) for r in results if not r.ok]


def test_flash_attention_overrides_dense_and_packed():
    """aten::_flash_attention_forward / _backward in flash-attn's layouts: dense (B, S, H, D)
    with a window, and packed (total, H, D) with lse (H, total); the in-place variant."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    q, k, v = (torch.randn(1, 11, 2, 8, device=DEVICE, generator=gen) for _ in range(3))
    out, lse, *_ = sdpa.flash_attention_forward(q, k, v, None, None, 11, 11, 0.0, True, False,
                                                window_size_left=3, window_size_right=-1)
    expected, expected_lse = flashop.attention_with_lse(q, k, v, causal=True, window_size=(3, -1))
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)

    cu = torch.tensor([0, 4, 11], dtype=torch.int32, device=DEVICE)
    qp, kp, vp = (t[0].detach().requires_grad_() for t in (q, k, v))
    out, lse, *_ = sdpa.flash_attention_forward(qp, kp, vp, cu, cu, 7, 7, 0.0, True, False)
    expected, expected_lse = flashop.attention_varlen_with_lse(qp, kp, vp, cu, cu, 7, 7,
                                                               causal=True)
    assert torch.equal(out, expected) and lse.shape == (2, 11) and torch.equal(lse, expected_lse)
    written = torch.full_like(qp, float("nan"))
    lse2 = sdpa.flash_attention_forward_no_dropout_inplace(
        written, qp, kp, vp, cu, cu, 7, 7, 0.0, True, False)
    assert torch.equal(written, out) and torch.equal(lse2, lse)
    dout = torch.randn_like(out)
    grads = sdpa.flash_attention_backward(dout, qp, kp, vp, out, lse, cu, cu, 7, 7, 0.0, True,
                                          None, None)
    # under the accuracy rule against the reference (the backward's lse comes from aten's
    # natural-log one)
    results = check_attention_varlen(qp, kp, vp, cu, cu, dout, torch.zeros_like(lse), expected,
                                     expected_lse, grads, causal=True)
    assert all(r.ok for r in results), [str(r) for r in results if not r.ok]


def test_sdpa_dropout_round_trips_flashops_seed():
    """dropout_p > 0: the forward returns the seed it drew in aten's (2,) uint64 rng_state;
    the backward, given that state back (as autograd passes it), regenerates the mask:
    values equal flashop.attention's with the same torch.manual_seed, gradients its grads."""
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    q, k, v = _bhsd(1, 4, 11, 16, gen), _bhsd(1, 2, 11, 16, gen), _bhsd(1, 2, 11, 16, gen)
    torch.manual_seed(4)
    out, lse, _, _, _, _, rng, unused, _ = sdpa.scaled_dot_product_flash_attention(
        q, k, v, 0.3, True, scale=0.3)
    assert rng.dtype == unused.dtype == torch.uint64 and rng.shape == (2,) and unused.dim() == 0
    torch.manual_seed(4)
    q2, k2, v2 = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    expected, expected_lse = flashop.attention_with_lse(q2, k2, v2, causal=True, scale=0.3,
                                                        dropout_p=0.3)
    assert torch.equal(out, expected.transpose(1, 2)) and torch.equal(lse, expected_lse)
    assert not torch.equal(expected, flashop.attention(q2, k2, v2, causal=True, scale=0.3))
    dout = torch.randn(1, 4, 11, 16, device=DEVICE, generator=gen).half()
    grads = sdpa.scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, 11, 11, 0.3, True, rng, unused, scale=0.3)
    for got, want in zip(grads, torch.autograd.grad(expected, (q2, k2, v2),
                                                    dout.transpose(1, 2))):
        # the backward's lse went through natural log and back: equal to rounding
        torch.testing.assert_close(got, want.transpose(1, 2), rtol=2e-3, atol=2e-3)
    with pytest.raises(RuntimeError, match=r"needs the rng_state its forward returned"):
        sdpa.scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, 11, 11, 0.3, True, rng.view(torch.int64),
            unused, scale=0.3)


def test_flash_attention_overrides_packed_dropout():
    """aten::_flash_attention_forward / _backward with dropout on a packed batch: the
    rng_state carries the seed to the backward; attention_varlen's values and gradients."""
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    q, k, v = (torch.randn(12, 2, 8, device=DEVICE, generator=gen).requires_grad_()
               for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE)
    torch.manual_seed(6)
    out, lse, rng, unused, _ = sdpa.flash_attention_forward(q, k, v, cu, cu, 7, 7, 0.25, True,
                                                            False)
    torch.manual_seed(6)
    expected = flashop.attention_varlen(q, k, v, cu, cu, 7, 7, causal=True, dropout_p=0.25)
    assert torch.equal(out, expected)
    dout = torch.randn_like(out)
    grads = sdpa.flash_attention_backward(dout, q, k, v, out, lse, cu, cu, 7, 7, 0.25, True,
                                          rng, unused)
    for got, want in zip(grads, torch.autograd.grad(expected, (q, k, v), dout)):
        # fp32 inputs; the backward's lse went through natural log and back: equal to rounding
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_overrides_refuse_what_flashop_cannot_do():
    q = torch.zeros(1, 2, 4, 8, device=DEVICE, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match=r"dropout_p=0\.1 \(this variant returns no"):
        sdpa.flash_attention_forward_no_dropout_inplace(torch.empty_like(q), q, q, q, None,
                                                        None, 2, 2, 0.1, False, False)
    with pytest.raises(NotImplementedError, match="top-left causal mask"):
        sdpa.scaled_dot_product_flash_attention(q, q[:, :, :3], q[:, :, :3], is_causal=True)
    with pytest.raises(NotImplementedError, match="block_table is not supported"):
        sdpa.flash_attention_forward(q, q, q, None, None, 2, 2, 0.0, False, False,
                                     block_table=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="return_debug_mask=True"):
        sdpa.flash_attention_forward(q, q, q, None, None, 2, 2, 0.0, False, True)


# --- with a GPU: SDPA itself through flashop ------------------------------------------------


@pytest.mark.gpu
@needs_registry
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_runs_flashop_when_active(flashop_active, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))
    dout = torch.randn_like(q)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events())
    assert "attention_fwd_kernel" in names and "attention_bwd" in names, names[:2000]
    q2, k2, v2 = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    expected, lse = flashop.attention_with_lse(q2, k2, v2, causal=causal)
    assert torch.equal(out, expected.transpose(1, 2))
    # the gradients (through aten's natural-log lse) under the accuracy rule
    grads = tuple(g.transpose(1, 2) for g in grads)
    for result in check_attention(q2, k2, v2, dout.transpose(1, 2), torch.zeros_like(lse),
                                  expected, lse, grads, causal=causal):
        assert result.ok, str(result)
    # restored: PyTorch's own kernels again
    attention.restore_flash_attention_impl()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), profile(activities=[ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.cuda.synchronize()
    assert "attention_fwd_kernel" not in " ".join(e.name for e in prof.events())


@pytest.mark.gpu
@needs_registry
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
def test_sdpa_dropout_runs_flashops_dropout_when_active(flashop_active):
    """SDPA with dropout_p through flashop: values equal flashop.attention's with the same
    torch.manual_seed; autograd hands the forward's rng_state to the backward, whose
    gradients are flashop's (through aten's natural-log lse: equal to rounding)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))
    dout = torch.randn_like(q)
    torch.manual_seed(4)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q2, k2, v2 = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    torch.manual_seed(4)
    expected, lse = flashop.attention_with_lse(q2, k2, v2, causal=True, dropout_p=0.2)
    assert torch.equal(out, expected.transpose(1, 2))
    torch.manual_seed(4)
    mask = dropout_mask(flashop._ops.attention.dropout_seed(q, 0.2), 2, 4, 300, 300, 0.2)
    grads = tuple(g.transpose(1, 2) for g in grads)
    for result in check_attention(q2, k2, v2, dout.transpose(1, 2), torch.zeros_like(lse),
                                  expected, lse, grads, causal=True, dropout_p=0.2,
                                  dropout_mask=mask):
        assert result.ok, str(result)
