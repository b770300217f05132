"""flashop.explain: what a call runs and why, pinned for representative calls, and equal to
the kernels the call then launches."""

from unittest import mock

import pytest
import torch

import flashop
from flashop._launch import attention as launch_attention, gluon, kvcache, launches, mla
from helpers import DEVICE, TestCase, error_message

ON_GPU = DEVICE == "cuda"


def _t(*shape, dtype=torch.bfloat16, grad=False):
    return torch.randn(*shape, device=DEVICE).to(dtype).requires_grad_(grad)


def _launched(run) -> list:
    """The kernels ``run()`` launches, by name, in order (the Gluon kernels by their
    launchers, the tl kernels by launch_kernel)."""
    names = []
    kernel_launch = launch_attention.launch_kernel
    fwd, bwd = gluon.attention_forward, gluon.attention_backward

    def record(kernel, grid, **kwargs):
        names.append(getattr(kernel, "fn", kernel).__name__)
        return kernel_launch(kernel, grid, **kwargs)

    def record_gluon(name, original):
        def launch(*args, **kwargs):
            names.append(name)
            return original(*args, **kwargs)
        return launch

    with mock.patch.object(launch_attention, "launch_kernel", record), \
            mock.patch.object(gluon, "attention_forward",
                              record_gluon("attention_fwd_gluon_kernel", fwd)), \
            mock.patch.object(gluon, "attention_backward",
                              record_gluon("attention_bwd_gluon_kernel", bwd)):
        run()
    return names


def _kernel_names(choice) -> list:
    """A choice's kernels by their kernels' names (the parts of one kernel named once per
    launch)."""
    return [name.split(",")[0] for name, _ in choice.kernels]


CALLS = {
    "plain": (lambda: (_t(2, 40, 4, 64, grad=True), _t(2, 40, 2, 64, grad=True),
                       _t(2, 40, 2, 64, grad=True)), dict(causal=True)),
    "modifiers": (lambda: (_t(1, 33, 2, 32, dtype=torch.float16, grad=True),
                           _t(1, 50, 2, 32, dtype=torch.float16, grad=True),
                           _t(1, 50, 2, 32, dtype=torch.float16, grad=True)),
                  dict(window_size=(16, 0), softcap=5.0)),
    "head-dim-160": (lambda: (_t(1, 24, 2, 160, dtype=torch.float16, grad=True),
                              _t(1, 24, 2, 160, dtype=torch.float16, grad=True),
                              _t(1, 24, 2, 160, dtype=torch.float16, grad=True)), {}),
    "fp32": (lambda: tuple(_t(1, 24, 2, 32, dtype=torch.float32, grad=True) for _ in range(3)),
             dict(causal=True)),
}
if ON_GPU:
    CALLS["long"] = (lambda: tuple(_t(1, 4096, 8, 128, grad=True) for _ in range(3)),
                     dict(causal=True))
    CALLS["long-256"] = (lambda: tuple(_t(1, 4096, 4, 256, grad=True) for _ in range(3)), {})


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("switches", [{}, dict(dq_atomics=True), dict(gluon=False),
                                      dict(cpu_path=True)],
                         ids=["default", "dq-atomics", "no-gluon", "cpu-path"])
def test_the_explanation_is_what_the_call_launches(name, deterministic, switches):
    """explain's forward and backward kernels, in order, are those the call launches."""
    make, options = CALLS[name]
    q, k, v = make()
    options = dict(options, deterministic=deterministic)
    with flashop.config.override(**switches):
        told = flashop.explain(flashop.attention, q, k, v, **options)
        out = None

        def forward():
            nonlocal out
            out = flashop.attention(q, k, v, **options)

        assert _launched(forward) == _kernel_names(told.forward), str(told)
        ran = _launched(lambda: out.backward(torch.randn_like(out)))
        assert ran == _kernel_names(told.backward), str(told)


def _decode_launched(run) -> list:
    """The kernels a decode call launches (its planned launches), by name."""
    names = []
    originals = {module: module.launch_planned for module in (kvcache, mla)}

    def recorder(module):
        def launch(kernel, planned, **per_call):
            names.append(getattr(kernel, "fn", kernel).__name__)
            return originals[module](kernel, planned, **per_call)
        return launch

    with mock.patch.object(kvcache, "launch_planned", recorder(kvcache)), \
            mock.patch.object(mla, "launch_planned", recorder(mla)):
        run()
    return names


@pytest.mark.parametrize("mla_cache", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize("splits", [0, 1, 3])
def test_a_decode_explanation_is_what_the_call_launches(mla_cache, splits):
    """A decode call's explained kernels are those it launches, and explain writes nothing
    into the cache."""
    D, DV, H, H_kv = (576, 512, 16, 1) if mla_cache else (64, 64, 8, 2)
    q = _t(2, 1, H, D)
    pages = _t(8, 16, H_kv, D)
    table = torch.arange(8, device=DEVICE, dtype=torch.int32).view(2, 4)
    new = _t(2, 1, H_kv, D)
    lens = torch.tensor([20, 41], device=DEVICE, dtype=torch.int32)
    v_cache = pages[..., :DV] if mla_cache else _t(8, 16, H_kv, DV)
    args = (q, pages, v_cache, new, None if mla_cache else new[..., :DV])
    options = dict(cache_seqlens=lens, block_table=table, causal=True, num_splits=splits)
    before = pages.clone()
    told = flashop.explain(flashop.attention_with_kvcache, *args, **options)
    assert torch.equal(pages, before)
    ran = _decode_launched(lambda: flashop.attention_with_kvcache(*args, **options))
    assert ran == _kernel_names(told.forward), str(told)


def test_explain_launches_nothing_and_checks_as_the_call_does():
    q, k, v = CALLS["plain"][0]()
    with mock.patch.object(launches, "launch_now", side_effect=AssertionError("launched")):
        told = flashop.explain(flashop.attention_with_lse, q, k, v, causal=True)
    assert told.forward.kernels and told.backward.kernels
    bad = _t(2, 40, 3, 64)
    assert error_message(flashop.explain, flashop.attention, q, bad, bad) == \
        error_message(flashop.attention, q, bad, bad)
    assert error_message(flashop.explain, flashop.attention, q, k, v, window_size=3) == \
        error_message(flashop.attention, q, k, v, window_size=3)


@pytest.mark.parametrize("fn", [flashop.attention, flashop.attention_with_lse,
                                flashop.attention_varlen, flashop.attention_varlen_with_lse,
                                flashop.attention_with_kvcache])
def test_explain_takes_every_argument_of_the_call(fn):
    """Each explained function's parameters, with their kinds and defaults, are its
    explainer's (after the function itself): no argument a call takes is refused."""
    import inspect

    import importlib
    explain_module = importlib.import_module("flashop.explain")
    explainer = inspect.signature(explain_module._EXPLAINERS[fn])
    params = list(explainer.parameters.values())[1:]
    if any(p.kind is p.VAR_KEYWORD for p in params):  # the rest passed on to the call
        named = {p.name for p in params}
        params += [p for p in inspect.signature(fn).parameters.values() if p.name not in named
                   and p.kind is p.KEYWORD_ONLY]
        params = [p for p in params if p.kind is not p.VAR_KEYWORD]
    assert sorted((p.name, p.kind, p.default) for p in params) == sorted(
        (p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values())


def test_explain_of_a_chunked_call_is_what_it_launches():
    """attention_chunk through explain: the chunk's rules (the Gluon and warp-specialized
    kernels decline chunks) and the kernels the call then launches."""
    q, k, v = CALLS["plain"][0]()
    told = flashop.explain(flashop.attention, q, k, v, causal=True, attention_chunk=16)
    names = _launched(lambda: flashop.attention(q, k, v, causal=True, attention_chunk=16)
                      .sum().backward())
    assert names == _kernel_names(told.forward) + _kernel_names(told.backward)
    if ON_GPU and gluon.available(torch.device(DEVICE)):
        assert told.forward.path.startswith("tl forward")
    assert error_message(flashop.explain, flashop.attention, q, k, v, attention_chunk=-2) == \
        error_message(flashop.attention, q, k, v, attention_chunk=-2)


class TestExplain(TestCase):
    def test_what_it_explains(self):
        q, k, v = CALLS["plain"][0]()
        self.assertExpectedInline(
            error_message(flashop.explain, torch.nn.functional.scaled_dot_product_attention,
                          q, k, v).split(";")[0],
            """flashop.explain: explains calls of flashop.attention, flashop.attention_with_lse, flashop.attention_varlen, flashop.attention_varlen_with_lse, flashop.attention_with_kvcache""")  # noqa: B950

    @pytest.mark.skipif(ON_GPU, reason="the interpreter's tiles and reasons")
    def test_explanations_under_the_interpreter(self):
        q, k, v = CALLS["plain"][0]()
        self.assertExpectedInline(str(flashop.explain(flashop.attention, q, k, v,
                                                      causal=True)), """\
flashop.attention on cpu: q (2, 40, 4, 64) bfloat16, k (2, 40, 2, 64) bfloat16, v (2, 40, 2, 64) bfloat16
forward: tl forward
  attention_fwd_kernel: 32x16 tiles, 4 warps, 1 stage
  tensor descriptors: False
  scale folded into the exponent: True
  - Gluon forward: not under Triton's interpreter
  - warp-specialized forward: no modifier, causal or window bound
  - tensor descriptors: by default above head dim 128, not at 64
backward: tl backward
  attention_bwd_dq_kernel: 32x16 tiles, 4 warps, 1 stage
  attention_bwd_dkdv_kernel: 16x32 tiles, 4 warps, 1 stage
  bitwise reproducible: True
  tensor descriptors: False
  - Gluon backward: not under Triton's interpreter
  - tl dQ by atomics: only where FLASHOP_DQ_ATOMICS=1 (slower at most shapes)
  - the dK/dV kernel in two parts: above head dim 128 only (one program holds dK and dV)
  - tensor descriptors: by default above head dim 128, not at 64""")
        q, k, v = CALLS["head-dim-160"][0]()
        with flashop.config.override(dq_atomics=True):
            told = flashop.explain(flashop.attention, q, k, v, window_size=(8, 8))
        self.assertExpectedInline(str(told.backward), """\
tl backward
  attention_bwd_preprocess_kernel
  attention_bwd_dkdv_kernel, dQ by atomics: 16x32 tiles, 4 warps, 1 stage
  attention_bwd_cast_kernel
  bitwise reproducible: False
  tensor descriptors: False
  q's and k's head dim in tiles of: 128 + 32
  - Gluon backward: not under Triton's interpreter
  - tensor descriptors: by default from 4096 keys, not at 24""")
        cu = torch.tensor([0, 10, 24], device=DEVICE, dtype=torch.int32)
        pages = _t(4, 16, 2, 64)
        table = torch.tensor([[0, 1], [3, 2]], device=DEVICE, dtype=torch.int32)
        told = flashop.explain(flashop.attention_varlen, _t(24, 4, 64), pages, pages, cu, cu,
                               14, 14, causal=True, block_table=table)
        self.assertExpectedInline(str(told), """\
flashop.attention_varlen on cpu: q (24, 4, 64) bfloat16, k (4, 16, 2, 64) bfloat16, v (4, 16, 2, 64) bfloat16, block_table (2, 2) int32
forward: tl forward
  attention_fwd_kernel: 32x16 tiles, 4 warps, 1 stage
  tensor descriptors: False
  scale folded into the exponent: True
  - Gluon forward: not under Triton's interpreter
  - warp-specialized forward: dense 16-bit or fp8 inputs only
  - tensor descriptors: not over pages""")

    @pytest.mark.skipif(ON_GPU, reason="the CPU path takes CPU tensors")
    def test_explanations_of_the_cpu_path(self):
        q, k, v = CALLS["plain"][0]()
        with flashop.config.override(cpu_path=True):
            plain = flashop.explain(flashop.attention, q, k, v, causal=True)
            modified = flashop.explain(flashop.attention, q, k, v, softcap=3.0)
        self.assertExpectedInline(str(plain), """\
flashop.attention on cpu: q (2, 40, 4, 64) bfloat16, k (2, 40, 2, 64) bfloat16, v (2, 40, 2, 64) bfloat16
forward: CPU path
  computed by: SDPA's CPU flash-attention kernels
  - Triton kernels: CPU tensors without Triton's interpreter (the CPU path)
backward: CPU path
  computed by: SDPA's CPU flash-attention kernels
  - Triton kernels: CPU tensors without Triton's interpreter (the CPU path)""")
        self.assertEqual(modified.forward.options["computed by"],
                         "PyTorch's CPU operations, blocked over key tiles")

    @pytest.mark.gpu
    @pytest.mark.skipif(not (ON_GPU and gluon.available(torch.device(DEVICE))),
                        reason="the Gluon kernels' rules (triton 3.6, Hopper)")
    def test_explanations_on_hopper(self):
        q, k, v = CALLS["long"][0]()
        told = flashop.explain(flashop.attention, q, k, v, causal=True)
        self.assertEqual(told.forward.path, "Gluon forward")
        self.assertEqual(told.backward.path, "Gluon backward, dQ added by atomics")
        told = flashop.explain(flashop.attention, q, k, v, causal=True, deterministic=True)
        self.assertEqual(told.backward.path, "Gluon backward, dQ added in key-tile order")
        short = q[:, :1024]
        told = flashop.explain(flashop.attention, short, short, short)
        self.assertEqual(told.forward.path, "Gluon forward")
        self.assertIn("Gluon backward, dQ by atomics: by default from 2048 keys at D = 128, "
                      "not at 1024", told.backward.why)
        with flashop.config.override(gluon=False):
            told = flashop.explain(flashop.attention, q, k, v)
        self.assertEqual(told.forward.path, "tl forward, warp-specialized")
        self.assertIn("Gluon forward: off (FLASHOP_GLUON=0)", told.forward.why)
        q, k, v = CALLS["long-256"][0]()
        told = flashop.explain(flashop.attention, q, k, v)
        self.assertEqual(told.forward.path, "Gluon forward")
        self.assertEqual(told.backward.path, "tl backward")
        self.assertEqual([n for n, _ in told.backward.kernels], [
            "attention_bwd_dq_kernel", "attention_bwd_dkdv_kernel, dV part",
            "attention_bwd_dkdv_kernel, dK part"])


def test_the_gluon_forward_explains_its_head_dim_tiles(monkeypatch):
    """At D = 192 (DV = 128) the Gluon forward takes q's and k's head dim in tiles of 128 and
    64 (its tiles are powers of two), and says so; at D = 128 it has one."""
    monkeypatch.setattr(gluon, "unavailable", lambda device: None)
    q, k = (torch.randn(1, 1024, 2, 192, device=DEVICE, dtype=torch.bfloat16)
            for _ in range(2))
    v = torch.randn(1, 1024, 2, 128, device=DEVICE, dtype=torch.bfloat16)
    with flashop.config.override(gluon=True):
        told = flashop.explain(flashop.attention, q, k, v, causal=True)
        plain = flashop.explain(flashop.attention, q[..., :128], k[..., :128], v)
    assert told.forward.path == plain.forward.path == "Gluon forward"
    assert told.forward.options == {"q's and k's head dim in tiles of": "128 + 64"}
    assert plain.forward.options == {}


def test_the_main_job_prints_what_its_checks_ran(capsys):
    """python -m flashop's checks print flashop.explain's account of each call they check:
    the first in full, one line per other."""
    import importlib

    main = importlib.import_module("flashop.__main__")
    summary = main.Summary()
    main.self_check(DEVICE, False, summary)
    out = capsys.readouterr().out
    assert not summary.failed
    dtype, B, S_q, S_k, H, H_kv, D, DV, causal = main.CHECKS[(DEVICE, False)][0]
    q, k, v = (torch.empty(B, S, h, d, device=DEVICE, dtype=dtype)
               for S, h, d in ((S_q, H, D), (S_k, H_kv, D), (S_k, H_kv, DV)))
    told = flashop.explain(flashop.attention_with_lse, q, k, v, causal=causal)
    assert "  " + str(told).replace("\n", "\n  ") in out
    assert out.count(" | backward: ") == len(main.CHECKS[(DEVICE, False)]) - 1
