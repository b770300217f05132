"""The fp8 forward: e4m3 q, k, v with FlashAttention-3's descales (flashop::attention_fp8).

Accuracy follows the rule of docs/testing.md with plain PyTorch in fp8 as the baseline
(flashop.reference.fp8_attention_reference with compute_dtype=None: the dequantized inputs
in fp32, the probabilities rounded to e4m3 for the product with v, out in bf16), against the
float64 attention of the dequantized inputs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.library import opcheck
from torch.utils.flop_counter import FlopCounterMode

import flashop
from flashop import config
from flashop.reference import attention_varlen_reference, dequantize, fp8_attention_reference
from flashop.testing import accuracy, rounding_noise
from helpers import CPU_PATH_TWIN, DEVICE, TestCase, cpu_path, error_message

FP8 = torch.float8_e4m3fn


def quantized(shape, H_kv: int, gen: torch.Generator, spread: float = 1.0):
    """Unit normals (times ``spread``) quantized per (batch, kv head) by their amax, as
    FlashAttention-3's fp8 tests do: (e4m3 tensor, descale (B, H_kv))."""
    x = torch.randn(shape, device=DEVICE, generator=gen) * spread
    B, S, H, D = x.shape
    amax = x.abs().amax(dim=(1, 3)).view(B, H_kv, H // H_kv).amax(-1)
    descale = (amax / 448).clamp(min=1e-12)
    return (x / descale.repeat_interleave(H // H_kv, 1)[:, None, :, None]).to(FP8), descale


def fp8_inputs(B, S_q, S_k, H_kv, G, D, DV, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q, qd = quantized((B, S_q, H_kv * G, D), H_kv, gen)
    k, kd = quantized((B, S_k, H_kv, D), H_kv, gen, spread=2.0)
    v, vd = quantized((B, S_k, H_kv, DV), H_kv, gen)
    return q, k, v, qd, kd, vd


def check(out, lse, ref, plain, out_dtype=torch.bfloat16):
    for result in (accuracy("out", out, ref[0], plain[0], 2, out_dtype),
                   accuracy("lse", lse, ref[1], plain[1], 2, out_dtype)):
        assert result.ok, result


CASES = {
    "plain": dict(),
    "causal_gqa": dict(G=2, causal=True),
    "window_softcap": dict(S_q=150, window_size=(40, 7), softcap=5.0),
    "alibi_sinks_dv": dict(G=2, DV=32, causal=True, alibi=True, sinks=True),
    "chunks": dict(G=2, S_q=150, attention_chunk=48, window_size=(40, -1)),
    # DeepSeek's prefill dims: q's and k's head dim in two tiles (choice.head_in_parts)
    "head_192_128": dict(S_q=130, S_k=150, D=192, DV=128, causal=True),
}


@pytest.mark.parametrize("path", ["kernels", pytest.param("cpu", marks=CPU_PATH_TWIN)])
@pytest.mark.parametrize("name", CASES)
def test_fp8_attention_against_dequantized_reference(name, path):
    opts = dict(B=2, S_q=200, S_k=200, H_kv=1, G=1, D=64, DV=64, causal=False,
                window_size=(-1, -1), attention_chunk=0, softcap=0.0, alibi=False, sinks=False)
    opts.update(CASES[name])
    B, S_q, S_k, H_kv, G, D, DV = (opts[n] for n in ("B", "S_q", "S_k", "H_kv", "G", "D", "DV"))
    q, k, v, qd, kd, vd = fp8_inputs(B, S_q, S_k, H_kv, G, D, DV)
    H = H_kv * G
    extra = dict(causal=opts["causal"], window_size=opts["window_size"],
                 attention_chunk=opts["attention_chunk"], softcap=opts["softcap"])
    if opts["alibi"]:
        extra["alibi_slopes"] = torch.rand(H, device=DEVICE) * 0.3
    if opts["sinks"]:
        extra["sinks"] = torch.randn(H, device=DEVICE) + 2.0
    with cpu_path() if path == "cpu" else contextlib.nullcontext():
        out, lse = flashop.attention_with_lse(q, k, v, q_descale=qd, k_descale=kd,
                                              v_descale=vd, **extra)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref = fp8_attention_reference(q, k, v, qd, kd, vd, **extra)
    plain = fp8_attention_reference(q, k, v, qd, kd, vd, compute_dtype=None, **extra)
    check(out, lse, ref, plain)


@pytest.mark.parametrize("path", ["kernels", pytest.param("cpu", marks=CPU_PATH_TWIN)])
def test_fp8_packed_batch_and_out_dtype(path):
    """Packed sequences (one descale row each, an empty one among them), fp16 output."""
    lengths = [70, 0, 131]
    H_kv, G, D = 2, 2, 64
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    q, qd = quantized((1, sum(lengths), H_kv * G, D), H_kv, gen)
    k, kd = quantized((1, sum(lengths), H_kv, D), H_kv, gen)
    v, vd = quantized((1, sum(lengths), H_kv, D), H_kv, gen)
    # one descale per sequence: each sequence's own factors (rows of random size)
    n = len(lengths)
    qd, kd, vd = (d.expand(n, H_kv) * torch.rand(n, H_kv, device=DEVICE, generator=gen).add(0.5)
                  for d in (qd, kd, vd))
    cu = torch.tensor([0, 70, 70, 201], device=DEVICE, dtype=torch.int32)
    with cpu_path() if path == "cpu" else contextlib.nullcontext():
        out, lse = flashop.attention_varlen_with_lse(
            q[0], k[0], v[0], cu, cu, 131, 131, causal=True, q_descale=qd, k_descale=kd,
            v_descale=vd, out_dtype=torch.float16)
    assert out.dtype == torch.float16

    def per_token(x, d):  # each token's dequantized value: its sequence's row of d
        rows = torch.repeat_interleave(torch.arange(n, device=DEVICE),
                                       torch.tensor(lengths, device=DEVICE))
        group = x.shape[-2] // d.shape[1]
        return x[0].double() * d.double()[rows].repeat_interleave(group, 1)[:, :, None]

    qr, kr, vr = per_token(q, qd), per_token(k, kd), per_token(v, vd)
    ref = attention_varlen_reference(qr, kr, vr, cu, cu, causal=True, compute_dtype=torch.float64)
    # plain fp8 per sequence
    plain_out, plain_lse = [], []
    for b in range(n):
        s, e = cu[b].item(), cu[b + 1].item()
        o, lz = fp8_attention_reference(
            q[:, s:e], k[:, s:e], v[:, s:e], qd[b:b + 1], kd[b:b + 1], vd[b:b + 1],
            compute_dtype=None, out_dtype=torch.float16, causal=True)
        plain_out.append(o[0])
        plain_lse.append(lz[0])
    plain = torch.cat(plain_out), torch.cat(plain_lse, dim=1)
    check(out, lse, ref, plain, torch.float16)


@pytest.mark.parametrize("warp_specialize", [False, True])
def test_fp8_values_in_either_layout_give_the_same_bits(warp_specialize):
    """Values stored keys-last (read as they are) or with a unit-stride head dim (copied
    keys-last first) give one result, through the general and the warp-specialized kernel;
    each kernel passes the rule (their tiles differ: P's rounding to e4m3 follows each
    tile's running max, so the kernels differ from each other in the last bits)."""
    q, k, v, qd, kd, vd = fp8_inputs(1, 64, 128, 1, 2, 64, 64, seed=3)
    v_keys_last = v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    with config.override(warp_specialize=warp_specialize):
        out, lse = flashop.attention_with_lse(q, k, v, q_descale=qd, k_descale=kd,
                                              v_descale=vd)
        assert torch.equal(out, flashop.attention(q, k, v_keys_last, q_descale=qd,
                                                  k_descale=kd, v_descale=vd))
    check(out, lse, fp8_attention_reference(q, k, v, qd, kd, vd),
          fp8_attention_reference(q, k, v, qd, kd, vd, compute_dtype=None))


def test_fp8_through_the_flash_attn_doors():
    """flash_attn_func and flash_attn_varlen_func take FlashAttention-3's descales and give
    the functions' results."""
    from flashop.flash_attn import flash_attn_func, flash_attn_varlen_func

    q, k, v, qd, kd, vd = fp8_inputs(1, 48, 48, 1, 2, 32, 32, seed=7)
    descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    expected = flashop.attention(q, k, v, causal=True, **descales)
    assert torch.equal(flash_attn_func(q, k, v, causal=True, **descales), expected)
    cu = torch.tensor([0, 48], device=DEVICE, dtype=torch.int32)
    assert torch.equal(flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 48, 48, causal=True,
                                              **descales), expected[0])


def test_fp8_descales_default_to_one():
    q, k, v, _, _, _ = fp8_inputs(1, 40, 40, 1, 1, 32, 32, seed=4)
    ones = torch.ones(1, 1, device=DEVICE)
    assert torch.equal(flashop.attention(q, k, v),
                       flashop.attention(q, k, v, q_descale=ones, k_descale=ones,
                                         v_descale=ones))


def test_fp8_operator_opcheck_and_flops():
    q, k, v, qd, kd, vd = fp8_inputs(1, 64, 64, 1, 2, 32, 32, seed=5)
    args = (q, k, v, None, None, None, None, qd, kd, vd)
    # torch's CPU kernels cannot multiply e4m3 tensors, which the schema test's comparison
    # needs; the other checks (fake, autograd registration, dispatch) run
    opcheck(torch.ops.flashop.attention_fp8.default, args, dict(causal=True),
            test_utils=("test_faketensor", "test_autograd_registration",
                        "test_aot_dispatch_dynamic"))
    with FlopCounterMode(display=False) as counter:
        flashop.attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    assert counter.get_total_flops() == 4 * 2 * 64 * 64 * 32


def test_fp8_under_compile_is_the_eager_call_without_recompiles():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    def fn(q, k, v, qd, kd, vd):
        return flashop.attention(q, k, v, causal=True, q_descale=qd, k_descale=kd,
                                 v_descale=vd)

    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=counter)
    frames = []
    for S in (48, 80, 112):
        inputs = fp8_inputs(1, S, S, 1, 1, 32, 32, seed=S)
        assert torch.equal(compiled(*inputs), fn(*inputs))
        frames.append(counter.frame_count)
    assert frames == frames[:1] * 3, f"recompiled: frames compiled after each length {frames}"


def test_fp8_eager_calls_replay_their_plan(monkeypatch):
    """Eager fp8 calls of one signature (descales given, or None: ones) replay the first
    call's plan: the body (its checks and launcher) runs once, and every call's output,
    made from its own inputs and descales, equals the operator's bit for bit."""
    import flashop._launch.attention as launch
    from flashop._ops import attention_fp8 as fp8_ops

    original, launches = launch.attention_forward, []

    def counted(*args, **kwargs):
        launches.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(launch, "attention_forward", counted)
    for given in (True, False):
        calls = []
        for seed in (1, 2, 3):
            q, k, v, qd, kd, vd = fp8_inputs(1, 40, 70, 1, 2, 32, 32, seed=seed)
            descales = dict(q_descale=qd, k_descale=kd, v_descale=vd) if given else {}
            with config.override(direct_eager=False):
                calls.append((q, k, v, descales, flashop.attention(q, k, v, **descales)))
        fp8_ops.planned_attention_fp8.plans.clear()
        launches.clear()
        for q, k, v, descales, expected in calls:
            assert torch.equal(flashop.attention(q, k, v, **descales), expected)
        assert len(launches) == 1, "the launcher ran again: the plan was not replayed"


class TestFp8Errors(TestCase):
    def setUp(self):
        self.q, self.k, self.v, self.qd, self.kd, self.vd = fp8_inputs(1, 16, 16, 2, 1, 32, 32)

    def test_descale_shape(self):
        self.assertExpectedInline(
            error_message(flashop.attention, self.q, self.k, self.v, q_descale=self.qd[:, :1]),
            """flashop.attention: q_descale must have shape (batch, kv_heads) = (1, 2) (one factor per sequence and key/value head, FlashAttention-3's), got (1, 1)""")

    def test_descale_dtype(self):
        self.assertExpectedInline(
            error_message(flashop.attention, self.q, self.k, self.v, v_descale=self.vd.half()),
            """flashop.attention: v_descale must be torch.float32, got torch.float16""")

    def test_mixed_dtypes(self):
        self.assertExpectedInline(
            error_message(flashop.attention, self.q, self.k, self.v.bfloat16()),
            """flashop.attention: q, k and v must have the same dtype, got q torch.float8_e4m3fn, k torch.float8_e4m3fn, v torch.bfloat16; cast them to one of float16, bfloat16, float32, or all three to float8_e4m3fn""")

    def test_e5m2(self):
        x = self.q.to(torch.float8_e5m2)
        self.assertExpectedInline(
            error_message(flashop.attention, x, x, x),
            """flashop.attention: dtype torch.float8_e5m2 is not supported; use float16, bfloat16 or float32 (of the fp8 types, float8_e4m3fn, FlashAttention-3's)""")

    def test_what_fp8_does_not_take(self):
        self.assertExpectedInline(
            error_message(flashop.attention, self.q, self.k, self.v, dropout_p=0.1,
                          attn_mask=torch.ones(16, 16, dtype=torch.bool, device=DEVICE)),
            """flashop.attention: attn_mask, dropout_p=0.1 is not supported with float8_e4m3fn inputs (the fp8 forward takes causal, window_size, attention_chunk, softcap, alibi_slopes, sinks, grouped-query heads and packed batches); run this call on 16-bit inputs""")

    def test_descales_with_16_bit_inputs(self):
        x = torch.randn(1, 16, 2, 32, device=DEVICE, dtype=torch.bfloat16)
        self.assertExpectedInline(
            error_message(flashop.attention, x, x, x, k_descale=self.kd,
                          out_dtype=torch.float16),
            """flashop.attention: k_descale, out_dtype apply to float8_e4m3fn q, k, v only, got q of dtype torch.bfloat16; drop them, or pass float8_e4m3fn q, k, v""")

    def test_out_dtype(self):
        self.assertExpectedInline(
            error_message(flashop.attention, self.q, self.k, self.v, out_dtype=torch.float32),
            """flashop.attention: out_dtype must be torch.bfloat16 or torch.float16 (or None: bfloat16), got torch.float32""")

    def test_training_operator_points_to_the_fp8_one(self):
        self.assertExpectedInline(
            error_message(torch.ops.flashop.attention, self.q, self.k, self.v),
            """flashop.attention: float8_e4m3fn inputs are forward-only and run on flashop::attention_fp8: call flashop.attention / attention_with_lse / attention_varlen(_with_lse), which route them there (with q_descale, k_descale, v_descale), or torch.ops.flashop.attention_fp8""")

    def test_backward_raises(self):
        q = self.q.float().requires_grad_()
        out = flashop.attention(q.to(FP8), self.k, self.v)
        assert out.requires_grad
        self.assertExpectedInline(
            error_message(out.float().sum().backward),
            """flashop.attention: fp8 (float8_e4m3fn) attention is forward-only, as FlashAttention-3's: no gradient flows to fp8 q, k, v; for training run the 16-bit inputs (bfloat16 or float16), or run the fp8 call under torch.no_grad() / torch.inference_mode()""")


def test_fp8_broken_kernel_fails(monkeypatch):
    """The accuracy check fails where the kernel drops the values' descale."""
    import flashop._launch.attention as launch

    original = launch.fp8_args

    def without_v_descale(q, descales, B, H_kv):
        args = original(q, descales, B, H_kv)
        if args["FP8"]:
            args = dict(args, v_descale=torch.ones_like(args["v_descale"]))
        return args

    monkeypatch.setattr(launch, "fp8_args", without_v_descale)
    q, k, v, qd, kd, vd = fp8_inputs(1, 64, 64, 1, 1, 32, 32, seed=6)
    vd = vd * 3  # a descale far from 1
    out, lse = flashop.attention_with_lse(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    ref = fp8_attention_reference(q, k, v, qd, kd, vd)
    plain = fp8_attention_reference(q, k, v, qd, kd, vd, compute_dtype=None)
    with pytest.raises(AssertionError):
        check(out, lse, ref, plain)


def test_dequantize_takes_each_heads_group_descale():
    x = torch.ones(1, 2, 4, 3, device=DEVICE).to(FP8)
    d = torch.tensor([[2.0, 5.0]], device=DEVICE)
    assert dequantize(x, d, torch.float32)[0, 0, :, 0].tolist() == [2.0, 2.0, 5.0, 5.0]
    assert rounding_noise(torch.ones(1), torch.bfloat16) > 0
