"""Bad input gets a clear error naming the shapes, dtypes or devices and the fix."""

import pytest
import torch

import flashop
from helpers import DEVICE, TestCase, error_message


def _t(*shape, dtype=torch.float16, device=DEVICE):
    return torch.randn(*shape, device=device).to(dtype)


class TestErrors(TestCase):
    def message(self, q, k, v, **kwargs):
        with self.assertRaises((ValueError, RuntimeError)) as ctx:
            flashop.attention(q, k, v, **kwargs)
        return str(ctx.exception)

    def test_rank(self):
        self.assertExpectedInline(
            self.message(_t(2, 8, 16), _t(2, 8, 2, 16), _t(2, 8, 2, 16)),
            """flashop.attention: q must be a 4-D tensor (batch, seqlen, heads, head_dim), got shape (2, 8, 16)""")  # noqa: B950

    def test_batch(self):
        self.assertExpectedInline(
            self.message(_t(2, 8, 2, 16), _t(3, 8, 2, 16), _t(3, 8, 2, 16)),
            """flashop.attention: q, k and v must have the same batch size (dim 0), got q (2, 8, 2, 16), k (3, 8, 2, 16), v (3, 8, 2, 16)""")  # noqa: B950

    def test_key_value_lengths(self):
        self.assertExpectedInline(
            self.message(_t(1, 8, 2, 16), _t(1, 9, 2, 16), _t(1, 8, 2, 16)),
            """flashop.attention: k and v must have the same sequence length (dim 1), got q (1, 8, 2, 16), k (1, 9, 2, 16), v (1, 8, 2, 16)""")  # noqa: B950

    def test_key_value_heads(self):
        self.assertExpectedInline(
            self.message(_t(1, 8, 4, 16), _t(1, 8, 2, 16), _t(1, 8, 1, 16)),
            """flashop.attention: k and v must have the same number of heads (dim 2), got q (1, 8, 4, 16), k (1, 8, 2, 16), v (1, 8, 1, 16)""")  # noqa: B950

    def test_head_dims(self):
        self.assertExpectedInline(
            self.message(_t(1, 8, 2, 16), _t(1, 8, 2, 32), _t(1, 8, 2, 16)),
            """flashop.attention: q and k must have the same head dim (dim 3), got q (1, 8, 2, 16), k (1, 8, 2, 32), v (1, 8, 2, 16)""")  # noqa: B950

    def test_head_groups(self):
        self.assertExpectedInline(
            self.message(_t(1, 8, 5, 16), _t(1, 7, 2, 16), _t(1, 7, 2, 16)),
            """flashop.attention: the number of query heads (5) must be a multiple of the number of key/value heads (2) for grouped-query attention, got q (1, 8, 5, 16), k (1, 7, 2, 16), v (1, 7, 2, 16)""")  # noqa: B950

    def test_sdpas_layout_is_named(self):
        """(batch, heads, seqlen, head_dim) tensors, SDPA's layout, whose lengths fail the
        head counts: the message suggests the transpose."""
        q, k = _t(2, 4, 300, 16), _t(2, 2, 128, 16)
        self.assertExpectedInline(self.message(q, k, k), """flashop.attention: the number of query heads (300) must be a multiple of the number of key/value heads (128) for grouped-query attention, got q (2, 4, 300, 16), k (2, 2, 128, 16), v (2, 2, 128, 16); if they are (batch, heads, seqlen, head_dim), SDPA's layout, pass q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2) (flashop takes (batch, seqlen, heads, head_dim)) and transpose the output back""")  # noqa: B950

    def test_head_dim_too_large(self):
        self.assertExpectedInline(
            self.message(_t(1, 4, 1, 320), _t(1, 4, 1, 320), _t(1, 4, 1, 64)),
            """flashop.attention: head dims from 1 to 256 are supported, got 320 for q and k and 64 for v (q (1, 4, 1, 320), k (1, 4, 1, 320), v (1, 4, 1, 64))""")  # noqa: B950

    def test_mixed_dtypes(self):
        self.assertExpectedInline(
            self.message(_t(1, 8, 2, 16), _t(1, 8, 2, 16, dtype=torch.bfloat16),
                         _t(1, 8, 2, 16)),
            """flashop.attention: q, k and v must have the same dtype, got q torch.float16, k torch.bfloat16, v torch.float16; cast them to one of float16, bfloat16, float32""")  # noqa: B950

    def test_integer_dtype(self):
        q = torch.ones(1, 8, 2, 16, dtype=torch.int32, device=DEVICE)
        self.assertExpectedInline(
            self.message(q, q, q),
            """flashop.attention: dtype torch.int32 is not supported; use float16, bfloat16 or float32""")  # noqa: B950

    def test_devices(self):
        k = torch.empty(1, 8, 2, 16, dtype=torch.float16, device="meta")
        self.assertExpectedInline(
            self.message(_t(1, 8, 2, 16), k, _t(1, 8, 2, 16)).replace(
                str(_t(1).device), "DEVICE"),
            """flashop.attention: q, k and v must be on the same device, got q on DEVICE, k on meta, v on DEVICE""")  # noqa: B950

    def test_scale(self):
        q = _t(1, 8, 2, 16)
        self.assertExpectedInline(
            self.message(q, q, q, scale=float("nan")),
            """flashop.attention: scale must be a finite float or None (1/sqrt(head_dim)), got nan""")  # noqa: B950

    def test_backward_shapes(self):
        q = _t(1, 8, 2, 16)
        lse = torch.zeros(1, 2, 8, device=DEVICE)
        with self.assertRaises(ValueError) as ctx:
            torch.ops.flashop.attention_backward(q[:, :4], lse, q, q, q, q, lse)
        self.assertExpectedInline(str(ctx.exception), """flashop.attention_backward: dout must have shape (1, 8, 2, 16), got (1, 4, 2, 16)""")  # noqa: B950

    def test_window_size(self):
        q = _t(1, 8, 2, 16)
        self.assertExpectedInline(self.message(q, q, q, window_size=(-2, 3)), """flashop.attention: window_size must be (left, right) with each >= 0, or -1 for no bound, got (-2, 3)""")  # noqa: B950
        self.assertExpectedInline(self.message(q, q, q, window_size=(4,)), """flashop.attention: window_size must be (left, right) with each >= 0, or -1 for no bound, got (4,)""")  # noqa: B950

    def test_window_size_of_the_operators(self):
        """The operators take the window as two ints; the same bounds are checked there."""
        q = _t(1, 8, 2, 16)
        self.assertExpectedInline(error_message(torch.ops.flashop.attention, q, q, q, window_size_left=-3), """flashop.attention: window_size must be (left, right) with each >= 0, or -1 for no bound, got (-3, -1)""")  # noqa: B950
        self.assertExpectedInline(self.message(q, q, q, window_size=(4.0, 0)), """flashop.attention: window_size must be (left, right) with each >= 0, or -1 for no bound, got (4.0, 0)""")  # noqa: B950

    def test_packing_arguments_come_together(self):
        q = _t(8, 2, 16)
        cu = torch.tensor([0, 8], device=DEVICE, dtype=torch.int32)
        self.assertExpectedInline(error_message(torch.ops.flashop.attention_forward, q, q, q, cu, max_seqlen_q=8), """flashop.attention_forward: a packed batch is described by cu_seqlens_q, cu_seqlens_k, max_seqlen_q and max_seqlen_k together, but cu_seqlens_k, max_seqlen_k are None; pass all four (flashop.attention_varlen), or none for a dense batch""")  # noqa: B950
        self.assertExpectedInline(error_message(torch.ops.flashop.attention_forward, q, q, q, max_seqlen_k=8), """flashop.attention_forward: a packed batch is described by cu_seqlens_q, cu_seqlens_k, max_seqlen_q and max_seqlen_k together, but cu_seqlens_q, cu_seqlens_k, max_seqlen_q are None; pass all four (flashop.attention_varlen), or none for a dense batch""")  # noqa: B950

    def test_causal_window_reaching_ahead(self):
        q = _t(1, 8, 2, 16)
        self.assertExpectedInline(
            self.message(q, q, q, causal=True, window_size=(16, 4)), """flashop.attention: causal=True attends no key after the query, but window_size=(16, 4) asks for 4 after it; pass window_size=(16, 0) (or -1) with causal=True, or causal=False for a two-sided window""")  # noqa: B950

    def test_softcap(self):
        q = _t(1, 8, 2, 16)
        self.assertExpectedInline(self.message(q, q, q, softcap=-1.0), """flashop.attention: softcap must be a finite float >= 0 (0 turns it off), got -1.0""")  # noqa: B950

    def test_alibi_slopes(self):
        q = _t(2, 8, 4, 16)
        self.assertExpectedInline(
            self.message(q, q, q, alibi_slopes=torch.ones(4, 2, device=DEVICE)), """flashop.attention: alibi_slopes must have shape (H,) = (4,) or (B, H) = (2, 4), got (4, 2)""")  # noqa: B950
        self.assertExpectedInline(
            self.message(q, q, q, alibi_slopes=torch.ones(4, device=DEVICE).half()), """flashop.attention: alibi_slopes must be torch.float32, got torch.float16""")  # noqa: B950

    def test_gate_needs_causal(self):
        q = _t(2, 8, 4, 16)
        self.assertExpectedInline(
            self.message(q, q, q, g=torch.zeros(2, 8, 4, device=DEVICE)), """flashop.attention: the log-decay gate g requires causal=True (as in flash-linear-attention: the decay G_i - G_j is a decay only for keys j before query i)""")  # noqa: B950

    def test_gate_shape(self):
        q, k = _t(2, 8, 4, 16), _t(2, 12, 2, 16)
        self.assertExpectedInline(
            self.message(q, k, k, g=torch.zeros(2, 8, 4, device=DEVICE), causal=True), """flashop.attention: g must have shape (B, S_k, H) = (2, 12, 4) (one log-decay per key position and query head; query i sits at position i + S_k - S_q), got (2, 8, 4)""")  # noqa: B950

    def test_attn_mask_shape(self):
        q, k = _t(2, 8, 4, 16), _t(2, 12, 2, 16)
        mask = torch.ones(8, 8, dtype=torch.bool, device=DEVICE)
        self.assertExpectedInline(self.message(q, k, k, attn_mask=mask), """flashop.attention: attn_mask of shape (8, 8) does not broadcast to (B, H, S_q, S_k) = (2, 4, 8, 12); give it that shape, or 1 in the dims it shares""")  # noqa: B950

    def test_attn_mask_dtype(self):
        q = _t(2, 8, 4, 16)
        mask = torch.ones(8, 8, dtype=torch.int64, device=DEVICE)
        self.assertExpectedInline(self.message(q, q, q, attn_mask=mask), """flashop.attention: attn_mask must be torch.bool or torch.float32 or torch.float16, got torch.int64""")  # noqa: B950

    def test_errors_surface_under_torch_compile(self):
        fn = torch.compile(flashop.attention, fullgraph=True, backend="eager")
        with self.assertRaisesRegex(Exception, "must be a multiple of the number of key/value"):
            fn(_t(1, 8, 3, 16), _t(1, 8, 2, 16), _t(1, 8, 2, 16))


class TestDevices(TestCase):
    def test_devices_other_than_cuda_and_cpu_are_refused(self):
        """CUDA GPUs run the kernels, the CPU its CPU path (tests/test_cpu.py); other devices
        are refused (checked directly: no such device here)."""
        from flashop._ops.checks import check_device

        self.assertExpectedInline(error_message(check_device, "flashop.attention", torch.device("mps")), """flashop.attention: the inputs are on mps, but flashop runs on CUDA GPUs and on the CPU; move the tensors to one of them""")  # noqa: B950


def test_sequences_past_32_bit_offsets_are_refused():
    """A (batch, head) slice spanning 2**31 elements would overflow the kernels' row offsets
    (checked on meta tensors, so nothing large is allocated)."""
    from flashop._launch.problem import check_row_offsets

    def check(x):
        check_row_offsets("flashop.attention", (x,), (x.stride(1),), (x.shape[1],))

    big = torch.empty(1, 2**27, 1, 16, device="meta")
    with pytest.raises(ValueError, match="32-bit row offsets"):
        check(big)
    check(big[:, : 2**27 - 1])
