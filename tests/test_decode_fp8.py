"""attention_with_kvcache over float8_e4m3fn caches with per-(sequence, kv head) descales,
with 16-bit or float8_e4m3fn queries: out and lse against the reference on the dequantized
cache (and queries) under the accuracy rule, the whole cache after the append bit for bit,
the kernels' fp8 conversions, opcheck, a compiled decode loop that compiles once, the decode
fast paths' keys and the errors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl
from torch.library import opcheck

import flashop
# fresh_plans: an autouse fixture, which pytest finds in this module's names
from cache_cases import APPEND_INDEX, CacheCase, fresh_plans, kwargs_ref, make_call  # noqa: F401
from flashop.reference import attention_with_kvcache_reference, kvcache_append_reference
from flashop.testing import accuracy
from helpers import DEVICE, CPU_PATH_TWIN, cpu_path, poisoned_outputs

FP8 = torch.float8_e4m3fn


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def make_fp8_call(case: CacheCase, seed: int = 0, descales: str = "kv", loud_head=False,
                  fp8_queries: bool = False):
    """make_call's call with its caches quantized to e4m3 (spread over e4m3's range, 64
    times unit normals, some saturating) and fp32 descales (B, H_kv) from 0.005 to 0.035,
    so that the real keys and values are about unit normals; ``descales`` names those given
    (the others None: 1; "q" among them with ``fp8_queries``). ``loud_head``: kv head 0's
    keys 30 times louder (scores of tens to 100+). ``fp8_queries``: q quantized likewise
    (divided by its descale, from 0.01 to 0.05, where given), out_dtype the case's dtype
    (left to its default where that is bfloat16)."""
    (q, k_cache, v_cache, k, v), kwargs = make_call(case, seed)
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    k_cache, v_cache = ((c.float() * 64).clamp(-448, 448).to(FP8) for c in (k_cache, v_cache))
    if fp8_queries:
        qd = torch.ones(case.B, case.H_kv, device=DEVICE)
        if "q" in descales:
            qd = kwargs["q_descale"] = 0.01 + 0.04 * torch.rand(
                case.B, case.H_kv, device=DEVICE, generator=gen)
        group = q.shape[2] // case.H_kv
        q = (q.float() / qd.repeat_interleave(group, 1)[:, None, :, None]).clamp(-448, 448)
        q = q.to(FP8)
        if case.dtype != BF16:
            kwargs["out_dtype"] = case.dtype
    for name in ("k", "v"):
        if name in descales:
            ds = 0.005 + 0.03 * torch.rand(case.B, case.H_kv, device=DEVICE, generator=gen)
            if name == "k" and loud_head:
                ds[:, 0] *= 30
            kwargs[f"{name}_descale"] = ds
    return (q, k_cache, v_cache, k, v), kwargs


def check_fp8_case(case: CacheCase, seed: int = 0, descales: str = "kv", loud_head=False,
                   fp8_queries: bool = False):
    """flashop's out and lse (outputs poisoned) under the accuracy rule against the fp64
    reference on the dequantized cache (and queries) and plain PyTorch on it in the case's
    dtype; both caches after the call bit for bit against the reference's append (the new
    keys quantized)."""
    (q, k_cache, v_cache, k, v), kwargs = make_fp8_call(case, seed, descales, loud_head,
                                                        fp8_queries)
    index = {n: kwargs[n] for n in (*APPEND_INDEX, "k_descale", "v_descale") if n in kwargs}
    expected = kvcache_append_reference(k_cache, v_cache, k, v, **index)
    ref, plain = (attention_with_kvcache_reference(q, k_cache, v_cache, k, v,
                                                   **kwargs_ref(kwargs), compute_dtype=dtype)
                  for dtype in (torch.float64, None))
    with poisoned_outputs():
        out, lse = flashop.attention_with_kvcache(q, k_cache, v_cache, k, v, **kwargs,
                                                  return_lse=True)
    assert out.dtype == case.dtype and out.shape == (case.B, case.S_q, case.H, case.DV)
    for name, actual, r, p in (("out", out, ref[0], plain[0]), ("lse", lse, ref[1], plain[1])):
        result = accuracy(name, actual, r, p, 2, case.dtype)
        assert result.ok, str(result)
    assert torch.equal(bits(k_cache), bits(expected[0])), "k_cache differs from the append"
    assert torch.equal(bits(v_cache), bits(expected[1])), "v_cache differs from the append"


F16, BF16 = torch.float16, torch.bfloat16
CASES = {
    "dense-gqa-causal-batch-idx": CacheCase((5, 40, 0), 1, 1, 2, 2, 32, 32, F16,
                                            capacity=48, batch_idx=True, causal=True,
                                            num_splits=1),
    "dense-window-softcap-splits": CacheCase((30, 47), 2, 0, 1, 4, 32, 24, BF16, capacity=48,
                                             window_size=(20, 3), softcap=5.0, num_splits=3),
    "paged-alibi-sinks-splits": CacheCase((17, 60, 0), 1, 3, 2, 2, 32, 32, BF16, paged=True,
                                          capacity=64, causal=True, alibi=(3, 4),
                                          sinks=torch.float32, num_splits=2),
    "paged-rotary-neox": CacheCase((14, 40), 3, 3, 1, 2, 32, 32, F16, paged=True,
                                   capacity=48, causal=True, rotary_dim=16,
                                   interleaved=False),
    "dense-rotary-leftpad": CacheCase((9, 30), 2, 2, 1, 2, 16, 16, BF16, capacity=40,
                                      rotary_dim=16, leftpad=True, num_splits=2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_cache_matches_reference(name):
    check_fp8_case(CASES[name])


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_queries_match_reference(name):
    """float8_e4m3fn queries with q_descale over the fp8 cache: out in out_dtype (the
    case's dtype; bfloat16 by default), against the reference on the dequantized queries
    and cache."""
    check_fp8_case(CASES[name], descales="qkv", fp8_queries=True)


@CPU_PATH_TWIN
@pytest.mark.parametrize("fp8_queries", [False, True], ids=["16-bit-queries", "fp8-queries"])
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_path_fp8_cache_matches_reference(name, fp8_queries):
    """The CPU path on the same calls: the new keys and values quantized into the cache as
    the kernel writes them, the cache (and fp8 queries) read times the descales in fp32."""
    with cpu_path():
        check_fp8_case(CASES[name], descales="qkv" if fp8_queries else "kv",
                       fp8_queries=fp8_queries)


@pytest.mark.parametrize("descales", ["q", "k", ""], ids=["q-only", "k-only", "none"])
def test_fp8_queries_with_absent_descales(descales):
    """With fp8 queries a descale left out reads as 1, the queries' and the keys' apart (the
    scores take their product)."""
    check_fp8_case(CASES["dense-window-softcap-splits"], descales=descales, fp8_queries=True)


@pytest.mark.parametrize("descales", ["k", ""], ids=["k-only", "none"])
def test_absent_descales_mean_one(descales):
    """A descale left out reads as 1 (the cache holds the real values), in the append and
    the attention."""
    check_fp8_case(replace(CASES["paged-alibi-sinks-splits"], dtype=F16), descales=descales)


def test_loud_keys_and_large_scores():
    """One kv head's keys 30 times the others' (scores of tens to 100+), split 3 ways."""
    check_fp8_case(CacheCase((33, 47), 1, 1, 2, 2, 32, 32, BF16, capacity=48, causal=True,
                             num_splits=3), loud_head=True)


@pytest.mark.parametrize("power", [20, -30], ids=["past-fp16s-largest", "below-fp16s-normals"])
def test_bf16_queries_outside_fp16s_range(power):
    """bf16 queries over an fp8 cache take their products in fp16, each program's queries
    scaled by a power of two: queries 2^20 times unit normals (past fp16's 65504) or 2^-30
    times (below its normals), the softmax scale taking the power back, split 2 ways, under
    the rule."""
    case = CacheCase((40, 61), 1, 1, 2, 2, 32, 32, BF16, capacity=64, num_splits=2)
    (q, k_cache, v_cache, k, v), kwargs = make_fp8_call(case)
    q, kwargs["scale"] = q * 2.0**power, 32**-0.5 * 2.0**-power
    assert torch.isfinite(q).all() and (q.float().abs().max() > 65504) == (power > 0)
    ref, plain = (attention_with_kvcache_reference(q, k_cache, v_cache, k, v,
                                                   **kwargs_ref(kwargs), compute_dtype=dtype)
                  for dtype in (torch.float64, None))
    out, lse = flashop.attention_with_kvcache(q, k_cache, v_cache, k, v, **kwargs,
                                              return_lse=True)
    for name, actual, r, p in (("out", out, ref[0], plain[0]), ("lse", lse, ref[1], plain[1])):
        result = accuracy(name, actual, r, p, 2, BF16)
        assert result.ok, str(result)


def test_appended_bits_are_torchs_conversion():
    """The written slots hold ``(new.float() / descale).clamp(-448, 448).to(float8_e4m3fn)``
    of their (b, h), computed here without the reference: exact ties between e4m3 values
    (to even, one carrying into the exponent: 124 -> 128), values past 448 (saturating),
    subnormals, ties times a descale of 7 (which the product by a rounded 1/7 misses: the
    division must be correctly rounded), and random values divided by random descales;
    every other byte of the caches (poisoned with e4m3's NaN) unchanged."""
    B, S_new, H_kv, D = 2, 20, 2, 32
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    ties = torch.tensor([124.0, -124.0, 9.0, 2.5, 0.5 * 2.0**-9, 1.5 * 2.0**-9, 464.0, -1e4,
                         240.0, -0.0, 0.0, 447.0, 3.0 * 2.0**-8, 13.0, -11.0, 1.0])
    e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    e4m3 = e4m3[torch.isfinite(e4m3) & (e4m3 > 0)].sort().values
    sevens = (e4m3[:-1] + e4m3[1:]) * 3.5
    sevens = sevens[sevens.to(BF16).float() == sevens]  # exact in bf16 (and fp16)
    sevens = torch.cat([sevens, -sevens])
    for dtype in (F16, BF16):
        k = torch.randn(B, S_new, H_kv, D, device=DEVICE, generator=gen) * 40
        k[0, 0, 0, :len(ties)] = ties.to(DEVICE)  # descale 1 below: the ties themselves
        fill = k[1, :, 1].flatten()
        fill[:len(sevens)] = sevens.to(DEVICE)  # descale 7 below
        k[1, :, 1] = fill.view(S_new, D)
        k, v = k.to(dtype), (k.flip(-1) * 3).to(dtype)
        descale = 0.05 + torch.rand(B, H_kv, device=DEVICE, generator=gen)
        descale[0, 0], descale[1, 1] = 1.0, 7.0
        k_cache = torch.full((B + 1, 32, H_kv, D), 0x7F, dtype=torch.uint8, device=DEVICE)
        v_cache = k_cache.clone()
        lengths = torch.tensor([3, 12], dtype=torch.int32, device=DEVICE)
        q = torch.randn(B, 1, H_kv, D, device=DEVICE, generator=gen).to(dtype)
        flashop.attention_with_kvcache(q, k_cache.view(FP8), v_cache.view(FP8), k, v,
                                       cache_seqlens=lengths, k_descale=descale,
                                       v_descale=descale / 2)
        expected_k = torch.full_like(k_cache, 0x7F)
        expected_v = expected_k.clone()
        for b, start in enumerate(lengths.tolist()):
            for new, ds, cache in ((k, descale, expected_k), (v, descale / 2, expected_v)):
                quantized = (new[b].float() / ds[b][None, :, None]).clamp(-448, 448).to(FP8)
                cache[b, start:start + S_new] = bits(quantized)
        assert torch.equal(k_cache, expected_k), dtype
        assert torch.equal(v_cache, expected_v), dtype


@triton.jit
def _convert_kernel(x, y16, ybf, y32, N: tl.constexpr):
    o = tl.arange(0, N)
    b_x = tl.load(x + o)
    tl.store(y16 + o, b_x.to(tl.float16))
    tl.store(ybf + o, b_x.to(tl.bfloat16))
    tl.store(y32 + o, b_x.to(tl.float32))


def test_kernel_conversions_of_fp8_are_exact():
    """Every finite e4m3 value converts exactly to fp16, bf16 and fp32 inside a kernel (the
    attention's dequantization relies on it, under the interpreter as on GPUs)."""
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8)
    x = x[torch.isfinite(x.float())]
    x = torch.cat([x, x[:256 - x.numel()]]).to(DEVICE)
    ys = [torch.empty(256, dtype=d, device=DEVICE) for d in (F16, BF16, torch.float32)]
    _convert_kernel[(1,)](x, *ys, 256)
    for y in ys:
        assert torch.equal(y.float(), x.float()), y.dtype


# --- the operator -------------------------------------------------------------------------


def _op_args(case: CacheCase, fp8_queries: bool = False):
    (q, k_cache, v_cache, k, v), kwargs = make_fp8_call(case, descales="qkv",
                                                        fp8_queries=fp8_queries)
    args = (q, k_cache, v_cache, kwargs.pop("cache_seqlens"), k, v,
            kwargs.pop("cache_batch_idx", None), kwargs.pop("block_table", None),
            kwargs.pop("alibi_slopes", None), kwargs.pop("sinks", None),
            kwargs.pop("rotary_cos", None), kwargs.pop("rotary_sin", None),
            kwargs.pop("cache_leftpad", None), kwargs.pop("k_descale"),
            kwargs.pop("v_descale"), kwargs.pop("q_descale", None))
    kwargs["window_size_left"], kwargs["window_size_right"] = kwargs.pop("window_size")
    return args, kwargs


@pytest.mark.parametrize("fp8_queries", [False, True], ids=["16-bit-queries", "fp8-queries"])
@pytest.mark.parametrize("name", ["dense-rotary-leftpad", "paged-alibi-sinks-splits"])
def test_opcheck(name, fp8_queries):
    """opcheck but its test_schema, whose comparison of the arguments before and after the
    call multiplies them, which torch's CPU kernels do not do in float8_e4m3fn (the schema is
    the 16-bit caches', checked by test_decode.py's opcheck; the fp8 caches' mutation is
    checked bit for bit above); with 16-bit and fp8 queries (an fp16 case's out_dtype)."""
    args, kwargs = _op_args(CASES[name], fp8_queries)
    opcheck(torch.ops.flashop.attention_with_kvcache.default, args, kwargs,
            test_utils=("test_autograd_registration", "test_faketensor",
                        "test_aot_dispatch_dynamic"))


def test_descales_key_the_checks_and_the_plan():
    """An eager call's signature holds the descales: a call with them and one without (same
    fp8 caches) are checked and planned apart, and give different outputs."""
    from flashop._launch import kvcache as launch_decode
    from flashop._ops import kvcache as ops_kvcache

    (q, k_cache, v_cache, k, v), kwargs = make_fp8_call(CASES["paged-rotary-neox"])
    with_ds = flashop.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v,
                                             **kwargs)
    without = {n: a for n, a in kwargs.items() if not n.endswith("descale")}
    plain = flashop.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v,
                                           **without)
    assert launch_decode._plan.cache_info().misses == 2
    assert len(ops_kvcache.planned_attention_with_kvcache.plans) == 2
    assert not torch.equal(with_ds, plain)


@pytest.mark.compile
def test_compiled_fp8_decode_loop_compiles_once():
    """A decode step over an fp8 cache under torch.compile(fullgraph=True, dynamic=True) over
    growing lengths: one compilation, the eager call's outputs and cache bytes."""
    from torch._dynamo.testing import CompileCounterWithBackend

    case = CacheCase((4, 9), 1, 1, 1, 2, 16, 16, F16, paged=True, capacity=32, causal=True)
    (q, k_cache, v_cache, k, v), kwargs = make_fp8_call(case)
    seqlens = kwargs.pop("cache_seqlens")
    table, kd, vd = kwargs["block_table"], kwargs["k_descale"], kwargs["v_descale"]

    def step(q, k_cache, v_cache, k, v, seqlens):
        out = flashop.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                             block_table=table, causal=True, k_descale=kd,
                                             v_descale=vd)
        seqlens.add_(1)
        return out * 2

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=counter)
    caches = k_cache.clone(), v_cache.clone()
    lengths = seqlens.clone()
    frames = []
    for i in range(3):
        q, k, v = (x + i for x in (q, k, v))
        out = compiled(q, *caches, k, v, lengths)
        frames.append(counter.frame_count)
        expected = step(q, k_cache, v_cache, k, v, seqlens)
        torch.testing.assert_close(out, expected)
        assert torch.equal(bits(caches[0]), bits(k_cache))
        assert torch.equal(bits(caches[1]), bits(v_cache))
    assert frames == frames[:1] * 3, f"recompiled: frames compiled after each step {frames}"


def test_autocast_leaves_fp8_queries_as_they_are():
    """Under autocast fp8 queries are read as they are, with their descale (a cast copy
    would be 16-bit, which takes no q_descale)."""
    (q, k_cache, v_cache, k, v), kwargs = make_fp8_call(CASES["paged-alibi-sinks-splits"],
                                                        descales="qkv", fp8_queries=True)
    expected = flashop.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v,
                                              **kwargs)
    with torch.autocast(DEVICE, dtype=BF16):
        out = flashop.attention_with_kvcache(q, k_cache, v_cache, k.float(), v.float(),
                                             **kwargs)
    assert out.dtype == BF16 and torch.equal(out, expected)


def test_autocast_reads_an_fp8_cache_as_it_is():
    """Under autocast a read-only call (no new keys) reads an fp8 cache as it is, with its
    descales (a cast copy would be 16-bit, which takes no descales)."""
    (q, k_cache, v_cache, _, _), kwargs = make_fp8_call(CASES["dense-window-softcap-splits"])
    expected = flashop.attention_with_kvcache(q, k_cache, v_cache, **kwargs)
    with torch.autocast(DEVICE, dtype=BF16):
        out = flashop.attention_with_kvcache(q.float(), k_cache, v_cache, **kwargs)
    assert torch.equal(out, expected)


# --- bad input ----------------------------------------------------------------------------


def _error(**changes):
    """The message raised by a small valid fp8 call with its arguments changed."""
    (q, k_cache, v_cache, k, v), kwargs = make_fp8_call(
        CacheCase((3, 5), 1, 1, 2, 2, 16, 16, F16, capacity=32))
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, **kwargs)
    args.update(changes)
    with pytest.raises(ValueError) as info:
        flashop.attention_with_kvcache(**args)
    return str(info.value)


def _t(*shape, dtype=F16):
    return torch.zeros(*shape, device=DEVICE, dtype=dtype)


OP = "flashop.attention_with_kvcache: "
ERRORS = {
    "descales with a 16-bit cache": (
        dict(k_cache=_t(3, 32, 2, 16), v_cache=_t(3, 32, 2, 16)),
        "k_descale and v_descale scale an fp8 (torch.float8_e4m3fn) cache, but the cache is "
        "torch.float16; drop the descales, or pass torch.float8_e4m3fn caches"),
    "descale shape": (
        dict(k_descale=_t(2, dtype=torch.float32)),
        "k_descale must have shape (batch, kv_heads) = (2, 2) (one factor per sequence and "
        "key/value head, FlashAttention-3's), got (2,)"),
    "descale dtype": (
        dict(v_descale=_t(2, 2)),
        "v_descale must be torch.float32, got torch.float16"),
    "new keys dtype": (
        dict(k=_t(2, 1, 2, 16, dtype=BF16), v=_t(2, 1, 2, 16, dtype=BF16)),
        "with an fp8 cache the new keys and values must have q's dtype torch.float16 (they "
        "are quantized as they are appended), got k torch.bfloat16, v torch.bfloat16; cast k "
        "and v to torch.float16"),
    "fp8 queries with new keys of another dtype": (
        dict(q=_t(2, 1, 4, 16, dtype=FP8)),
        "with fp8 queries the new keys and values must be in the output's dtype "
        "torch.bfloat16 (out_dtype; they are quantized as they are appended), got k "
        "torch.float16, v torch.float16; cast k and v to torch.bfloat16, or pass "
        "out_dtype=torch.float16"),
    "e5m2 queries": (
        dict(q=_t(2, 1, 4, 16, dtype=torch.float8_e5m2)),
        "fp8 queries must be torch.float8_e4m3fn (FlashAttention-3's format), got q "
        "torch.float8_e5m2; quantize q to torch.float8_e4m3fn"),
    "fp8 queries over a 16-bit cache": (
        dict(q=_t(2, 1, 4, 16, dtype=FP8), k_cache=_t(3, 32, 2, 16), v_cache=_t(3, 32, 2, 16),
             k_descale=None, v_descale=None),
        "fp8 queries attend an fp8 (torch.float8_e4m3fn) cache only, got k_cache "
        "torch.float16 and v_cache torch.float16; pass 16-bit queries (q.to(dtype) * "
        "q_descale) over a 16-bit cache"),
    "fp8 queries' out_dtype": (
        dict(q=_t(2, 1, 4, 16, dtype=FP8), out_dtype=torch.float32),
        "out_dtype must be torch.bfloat16 or torch.float16 (or None: bfloat16), got "
        "torch.float32"),
    "q_descale shape": (
        dict(q=_t(2, 1, 4, 16, dtype=FP8), out_dtype=F16, q_descale=_t(2, 4, dtype=torch.float32)),
        "q_descale must have shape (batch, kv_heads) = (2, 2) (one factor per sequence and "
        "key/value head, FlashAttention-3's), got (2, 4)"),
    "q_descale with 16-bit queries": (
        dict(q_descale=_t(2, 2, dtype=torch.float32)),
        "q_descale applies to float8_e4m3fn queries only, got q of dtype torch.float16; "
        "drop it, or pass float8_e4m3fn queries"),
    "out_dtype with 16-bit queries": (
        dict(out_dtype=BF16),
        "out_dtype sets the output's dtype of fp8 queries; torch.float16 queries give "
        "outputs in torch.float16, got out_dtype torch.bfloat16; drop out_dtype, or cast "
        "the output"),
    "fp32 queries": (
        dict(q=_t(2, 1, 4, 16, dtype=torch.float32)),
        "an fp8 cache takes float16 or bfloat16 queries, got q torch.float32; cast q (and k, "
        "v) to one of them"),
    "one fp8 cache": (
        dict(v_cache=_t(3, 32, 2, 16)),
        "k_cache and v_cache must both be torch.float8_e4m3fn or neither, got k_cache "
        "torch.float8_e4m3fn and v_cache torch.float16"),
    "e5m2": (
        dict(k_cache=_t(3, 32, 2, 16, dtype=torch.float8_e5m2),
             v_cache=_t(3, 32, 2, 16, dtype=torch.float8_e5m2)),
        "an fp8 cache must be torch.float8_e4m3fn (FlashAttention-3's format), got k_cache "
        "torch.float8_e5m2; quantize the cache to torch.float8_e4m3fn"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_error_messages(name):
    changes, message = ERRORS[name]
    assert _error(**changes) == OP + message


def test_descale_on_another_device():
    message = _error(k_descale=torch.ones(2, 2, device="meta"))
    assert message.startswith(OP + "all tensors must be on one device, got q on ")
    assert "k_descale on meta, v_descale on " in message, message


def test_flash_attn_door_takes_the_descales():
    """flashop.flash_attn.flash_attn_with_kvcache passes k_descale, v_descale through."""
    from flashop.flash_attn import flash_attn_with_kvcache

    (q, k_cache, v_cache, k, v), kwargs = make_fp8_call(CASES["dense-gqa-causal-batch-idx"])
    caches = k_cache.clone(), v_cache.clone()
    expected = flashop.attention_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)
    out = flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=kwargs["cache_seqlens"],
                                  cache_batch_idx=kwargs["cache_batch_idx"], causal=True,
                                  num_splits=1, k_descale=kwargs["k_descale"],
                                  v_descale=kwargs["v_descale"])
    assert torch.equal(out, expected) and torch.equal(bits(caches[0]), bits(k_cache))


def test_flash_attn_door_takes_fp8_queries():
    """flashop.flash_attn.flash_attn_with_kvcache passes q_descale through (fp8 queries,
    bfloat16 out, as FlashAttention-3's)."""
    from flashop.flash_attn import flash_attn_with_kvcache

    case = replace(CASES["dense-gqa-causal-batch-idx"], dtype=BF16)
    (q, k_cache, v_cache, k, v), kwargs = make_fp8_call(case, descales="qkv",
                                                        fp8_queries=True)
    caches = k_cache.clone(), v_cache.clone()
    expected = flashop.attention_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)
    out = flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=kwargs["cache_seqlens"],
                                  cache_batch_idx=kwargs["cache_batch_idx"], causal=True,
                                  num_splits=1, k_descale=kwargs["k_descale"],
                                  v_descale=kwargs["v_descale"], q_descale=kwargs["q_descale"])
    assert out.dtype == BF16 and torch.equal(out, expected)
    assert torch.equal(bits(caches[0]), bits(k_cache))


# --- GPU only -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("paged,page", [(False, 0), (True, 16), (True, 256)])
@pytest.mark.parametrize("S_q,num_splits", [(1, 0), (1, 1), (4, 0), (16, 3)])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_gpu_fp8_long_caches(paged, page, S_q, num_splits, dtype):
    """fp8 caches on GPU tiles: lengths up to a full 4096-key cache, auto and forced splits,
    decode and chunked queries, GQA 4, sinks, one kv head's keys loud."""
    case = CacheCase((0, 1000, 4093 - S_q, 4096 - S_q), S_q, S_q, 8, 4, 128, 128, dtype,
                     paged=paged, page=page or 16, capacity=4096, causal=True,
                     sinks=torch.float32, num_splits=num_splits)
    check_fp8_case(case, loud_head=True)
