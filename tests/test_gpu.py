"""What only a GPU shows: Inductor seeing into the Triton kernels, CUDA graphs, and
compute-sanitizer on odd shapes. (The property tests run there too, in bf16, fp16 and fp32.)"""

import gc
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from unittest import mock

import pytest
import torch

import flashop
from flashop.testing import check_attention, check_attention_varlen
from helpers import DEVICE, Case, cuda_graph, make_inputs, make_packed
from paged_cases import PagedCase, check_paged, make_paged

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_inductor_sees_the_triton_kernels():
    """The post-grad graphs hold the Triton kernels (triton_kernel_wrapper_functional), not
    an opaque call, and Inductor's generated code launches them, forward and backward."""
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    graphs = []
    q = torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 300, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    @torch.compile(fullgraph=True)
    def loss(q, k):
        return flashop.attention(q, k, k.sin(), causal=True).float().square().sum()

    torch._dynamo.reset()
    with config.patch(post_grad_custom_post_pass=lambda graph: graphs.append(str(graph))):
        _, code = run_and_get_code(lambda: loss(q, k).backward())
    code = "\n".join(code)
    assert len(graphs) == 2, graphs  # forward and backward
    assert all("triton_kernel_wrapper_functional" in g for g in graphs), graphs
    assert "flashop.attention" not in code and "flashop::" not in code
    for kernel in ("attention_fwd_kernel", "attention_bwd_dkdv_kernel",
                   "attention_bwd_dq_kernel"):
        assert kernel in code, f"{kernel} not in Inductor's code"
    # the dQ kernel computes delta for the dK/dV kernel: no preprocess kernel
    assert "attention_bwd_preprocess_kernel" not in code
    assert q.grad is not None and torch.isfinite(q.grad).all()
    # dQ by atomics in the tl kernels (forced, the Gluon kernels off): the dK/dV kernel adds
    # dQ, no dQ kernel runs, delta comes from the preprocess kernel, which zeroes dQ's fp32
    # buffer too, and the cast kernel writes dQ out
    dq = q.grad
    q.grad = None
    torch._dynamo.reset()
    with flashop.config.override(dq_atomics=True, gluon=False):
        _, code = run_and_get_code(lambda: loss(q, k).backward())
    code = "\n".join(code)
    assert "attention_bwd_dq_kernel" not in code
    assert "attention_bwd_preprocess_kernel" in code
    assert "attention_bwd_cast_kernel" in code
    torch.testing.assert_close(q.grad, dq)


def _assert_replay_equals_eager(step):
    """Capture ``step()`` (returning tensors) in a CUDA graph, replay it, and compare with an
    eager call bit for bit."""
    expected = step()
    graph, captured = cuda_graph(step)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, expected):
        assert torch.equal(a, b)
    return expected


def test_cuda_graph_capture_and_replay():
    """The forward and backward ops are capturable: no host synchronisation, no allocation
    outside PyTorch's allocator."""
    case = Case(B=2, S_q=200, S_k=333, H_kv=2, G=2, D=64, DV=64, dtype=torch.float16,
                causal=True)
    inputs, dout, dlse = make_inputs(case)
    q, k, v = (x.detach() for x in inputs)

    def step():
        out, lse, lse_log2 = torch.ops.flashop.attention_forward(q, k, v, causal=True)
        grads = torch.ops.flashop.attention_backward(dout, dlse, q, k, v, out, lse_log2,
                                                     causal=True)
        return (out, lse, *grads)

    out, lse, *grads = _assert_replay_equals_eager(step)
    for result in check_attention(*inputs, dout, dlse, out, lse, grads, causal=True):
        assert result.ok, str(result)


def test_cuda_graph_capture_of_the_python_apis_backward():
    """flashop.attention's eager path (its own autograd function, whose backward takes an
    unread lse's gradient as a shared zero element) is capturable too, forward and backward:
    the zero is made afresh inside a capture and is not kept, and replays equal eager."""
    case = Case(B=1, S_q=130, S_k=257, H_kv=2, G=2, D=128, DV=128, dtype=torch.bfloat16,
                causal=True)
    (q, k, v), dout, _ = make_inputs(case)
    flashop._ops.eager._ZEROS.clear()

    def step():
        # leaves of this step (their autograd nodes on the stream that captures it)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = flashop.attention(*leaves, causal=True)
        return (out, *torch.autograd.grad(out, leaves, dout))

    _assert_replay_equals_eager(step)
    assert not any(z.any() for z in flashop._ops.eager._ZEROS.values())


def test_cuda_graph_capture_of_packed_batches_with_modifiers():
    """attention_varlen (gate, window, ALiBi) needs no host synchronisation either: the
    offsets stay on the device."""
    args, dout, dlse = make_packed([0, 70, 1, 129], [5, 100, 1, 129], 2, 2, 64, torch.bfloat16,
                                   gate=torch.float32, alibi=(4,))
    leaves = args
    args = {n: a.detach() if isinstance(a, torch.Tensor) else a for n, a in args.items()}
    options = dict(causal=True, window_size_left=48, window_size_right=0, softcap=10.0)

    def step():
        out, lse, lse_log2 = torch.ops.flashop.attention_forward(**args, **options)
        values = list(args.values())
        grads = torch.ops.flashop.attention_backward(
            dout, dlse, *values[:3], out, lse_log2, *values[3:7], None, *values[7:],
            **options)
        return (out, lse, *grads[:4])  # dq, dk, dv, dg (no mask here)

    out, lse, *grads = _assert_replay_equals_eager(step)
    for result in check_attention_varlen(
            *(leaves[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")), dout, dlse,
            out, lse, grads, leaves["alibi_slopes"], leaves["g"], causal=True,
            window_size=(48, 0), softcap=10.0):
        assert result.ok, str(result)


@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability()[0] < 9,
                    reason="the warp-specialized forward is Hopper's")
def test_warp_specialized_forward_under_inductor_and_in_cuda_graphs():
    """attention_fwd_ws_kernel (non-causal, D=128, S_k a multiple of 128) in Inductor's code
    with the eager call's bits, and captured in a CUDA graph; with symbolic lengths (dynamic
    shapes), where the Gluon kernels are available, the graph calls the eager launcher
    through the opaque operator (no guard on the lengths), which launches the eager call's
    kernel; elsewhere the split kernel, with no guard on S_k, and its bits."""
    from torch._inductor.utils import run_and_get_code

    q = torch.randn(2, 200, 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 256, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    from flashop._launch import choice
    from flashop._launch.problem import PLAIN_FLAGS
    assert choice.uses_ws(q, k, v, PLAIN_FLAGS[False], 128, 256, False)
    eager = flashop.attention_with_lse(q, k, v)
    torch._dynamo.reset()
    compiled = torch.compile(flashop.attention_with_lse, fullgraph=True, dynamic=False)
    result, code = run_and_get_code(lambda: compiled(q, k, v))
    assert "attention_fwd_ws_kernel" in "\n".join(code)
    assert all(torch.equal(a, b) for a, b in zip(result, eager))
    _assert_replay_equals_eager(lambda: torch.ops.flashop.attention_forward(q, k, v))

    torch._dynamo.reset()
    dynamic = torch.compile(flashop.attention_with_lse, fullgraph=True, dynamic=True)
    with flashop.config.override(warp_specialize=False):
        split = flashop.attention_with_lse(q, k, v)
    result, code = run_and_get_code(lambda: dynamic(q, k, v))
    assert "attention_fwd_ws_kernel" not in "\n".join(code)
    if _gluon_here():
        assert "attention_forward_opaque" in "\n".join(code)
        assert all(torch.equal(a, b) for a, b in zip(result, eager))
    else:
        assert all(torch.equal(a, b) for a, b in zip(result, split))


def _attention_with_grads(q, k, v, dout, dlse, **options):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out, lse = flashop.attention_with_lse(q, k, v, **options)
    return (out, lse, *torch.autograd.grad((out, lse), (q, k, v), (dout, dlse)))


def test_cached_launches_equal_tritons_own():
    """An eager launch keeps the kernel Triton compiled for the call's key and launches it
    directly on later calls of that key (launches.launch_now): results equal Triton's
    own launches bit for bit, a tensor of other alignment gets its own kernel, and a repeated
    call binds no argument through Triton (its JITFunction.run is not entered)."""
    import triton.runtime.jit as jit
    from flashop._launch import launches

    if not launches.triton_allows_cached_launches():
        pytest.skip(f"cached launches serve triton {launches.CACHED_LAUNCH_TRITON}")
    cases = [Case(B=1, S_q=1, S_k=1, H_kv=1, G=1, D=64, DV=64, dtype=torch.bfloat16),
             Case(B=2, S_q=200, S_k=333, H_kv=2, G=2, D=128, DV=128, dtype=torch.float16,
                  causal=True, layout="bhsd"),
             Case(B=3, S_q=77, S_k=1000, H_kv=1, G=4, D=96, DV=96, dtype=torch.bfloat16,
                  layout="padded"),
             Case(B=1, S_q=1024, S_k=1024, H_kv=2, G=1, D=128, DV=128, dtype=torch.bfloat16,
                  causal=True)]  # the Gluon forward's default on Hopper
    entered = []
    run = jit.JITFunction.run

    def counted(self, *args, **kwargs):
        entered.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    for case in cases:
        (q, k, v), dout, dlse = make_inputs(case)
        options = case.options()
        with flashop.config.override(cached_launch=False):
            expected = _attention_with_grads(q, k, v, dout, dlse, **options)
        first = _attention_with_grads(q, k, v, dout, dlse, **options)
        with mock.patch.object(jit.JITFunction, "run", counted):
            again = _attention_with_grads(q, k, v, dout, dlse, **options)
        assert entered == [], (case, entered)
        for a, b, c in zip(expected, first, again):
            assert torch.equal(a, b) and torch.equal(a, c), case
        # q one element past a 16-byte boundary: Triton specialises on the alignment (and
        # the Gluon kernels take only aligned inputs)
        shifted = torch.empty(q.numel() + 1, device=q.device, dtype=q.dtype)[1:].view(q.shape)
        shifted.copy_(q)
        with flashop.config.override(cached_launch=False):
            expected = _attention_with_grads(shifted, k, v, dout, dlse, **options)
        for a, b in zip(expected, _attention_with_grads(shifted, k, v, dout, dlse, **options)):
            assert torch.equal(a, b), case


def test_cached_decode_launches_equal_tritons_own():
    """Decode steps launch their planned kernels directly (launches.launch_planned)
    from their second call: outputs, lse and the appended caches equal Triton's own
    launches bit for bit, for dense and paged caches with and without splits, a repeated
    step binds no argument through Triton, and queries of other alignment get their own
    kernel."""
    import triton.runtime.jit as jit
    from flashop._launch import launches

    if not launches.triton_allows_cached_launches():
        pytest.skip(f"cached launches serve triton {launches.CACHED_LAUNCH_TRITON}")
    torch.manual_seed(0)
    B, H, H_kv, D, L, page = 2, 8, 2, 128, 1000, 16
    dt = torch.bfloat16
    dense = torch.randn(2, B, 1024, H_kv, D, device="cuda", dtype=dt)
    paged = torch.randn(2, B * 1024 // page, page, H_kv, D, device="cuda", dtype=dt)
    table = torch.randperm(B * 1024 // page, device="cuda").view(B, -1).to(torch.int32)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=dt)
    k, v = torch.randn(2, B, 1, H_kv, D, device="cuda", dtype=dt)
    lens = torch.tensor([L, 17], device="cuda", dtype=torch.int32)
    entered = []
    run = jit.JITFunction.run

    def counted(self, *args, **kwargs):
        entered.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    for cache, extra in ((dense, {}), (paged, dict(block_table=table))):
        for splits in (0, 1):
            def step(queries, caches):
                out = flashop.attention_with_kvcache(
                    queries, caches[0], caches[1], k, v, cache_seqlens=lens, causal=True,
                    num_splits=splits, return_lse=True, **extra)
                return (*out, *caches)

            with flashop.config.override(cached_launch=False):
                expected = step(q, cache.clone())
            step(q, cache.clone())
            with mock.patch.object(jit.JITFunction, "run", counted):
                again = step(q, cache.clone())
            assert entered == [], (splits, entered)
            for a, b in zip(expected, again):
                assert torch.equal(a, b), (splits, extra.keys())
            shifted = torch.empty(q.numel() + 1, device="cuda", dtype=dt)[1:].view(q.shape)
            shifted.copy_(q)
            with flashop.config.override(cached_launch=False):
                expected = step(shifted, cache.clone())
            for a, b in zip(expected, step(shifted, cache.clone())):
                assert torch.equal(a, b), (splits, extra.keys())


@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability() < (8, 9),
                    reason="float8_e4m3fn conversions need sm_89 or newer")
@pytest.mark.parametrize("fp8_queries", [False, True], ids=["bf16-queries", "fp8-queries"])
@pytest.mark.parametrize("page", [0, 16])
def test_fp8_cache_decode_in_cuda_graphs_equals_eager(page, fp8_queries):
    """A decode step over a float8_e4m3fn cache (bf16 q, k, v, or float8_e4m3fn q with its
    descale; per-(b, h) descales), dense and in pages of 16, captured in a CUDA graph and
    replayed over growing lengths with new queries and keys, gives eager's out, lse and
    cache bytes bit for bit; the bytes each step appends are torch's conversion on the GPU,
    ``(new.float() / descale).clamp(-448, 448).to(float8_e4m3fn)``."""
    torch.manual_seed(0)
    B, H, H_kv, D, S = 3, 8, 2, 128, 2048
    dt, fp8 = torch.bfloat16, torch.float8_e4m3fn
    shape = (B * S // page, page, H_kv, D) if page else (B, S, H_kv, D)
    caches = [(torch.randn(shape, device="cuda") * 64).clamp(-448, 448).to(fp8)
              for _ in range(2)]
    extra = {}
    if page:
        extra["block_table"] = torch.randperm(B * S // page, device="cuda").view(
            B, -1).to(torch.int32)
    kd, vd = (0.005 + 0.03 * torch.rand(B, H_kv, device="cuda") for _ in range(2))
    q = torch.randn(B, 1, H, D, device="cuda", dtype=dt)
    if fp8_queries:
        q = q.to(fp8)
        extra["q_descale"] = 0.01 + 0.04 * torch.rand(B, H_kv, device="cuda")
    k, v = (torch.randn(B, 1, H_kv, D, device="cuda", dtype=dt) for _ in range(2))
    lens = torch.tensor([5, 700, 1500], device="cuda", dtype=torch.int32)

    def step(caches, lens):
        return flashop.attention_with_kvcache(q, caches[0], caches[1], k, v,
                                              cache_seqlens=lens, causal=True, k_descale=kd,
                                              v_descale=vd, return_lse=True, **extra)

    eager_caches = [c.clone() for c in caches]
    eager_lens = lens.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step([c.clone() for c in caches], lens)  # compiles the kernels, off the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(caches, lens)
    for i in range(12):
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, device="cuda", dtype=dt) * (1 + 20 * (i % 3 == 2)))
        lens.copy_(torch.tensor([5, 700, 1500], dtype=torch.int32) + 37 * i)
        eager_lens.copy_(lens)
        graph.replay()
        expected = step(eager_caches, eager_lens)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(captured, expected)), i
        for c, e in zip(caches, eager_caches):
            assert torch.equal(c.view(torch.uint8), e.view(torch.uint8)), i
        for new, ds, cache in ((k, kd, caches[0]), (v, vd, caches[1])):
            want = (new[:, 0].float() / ds[:, :, None]).clamp(-448, 448).to(fp8)
            for b, pos in enumerate(lens.tolist()):
                if page:
                    row = cache[extra["block_table"][b, pos // page], pos % page]
                else:
                    row = cache[b, pos]
                assert torch.equal(row.view(torch.uint8), want[b].view(torch.uint8)), (i, b)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("D", [64, 128])
def test_inputs_on_another_gpu_than_the_current_one(D):
    """Triton launches on the current device, so each launcher makes its inputs' GPU current:
    tensors on cuda:1 while cuda:0 is current (a model spread over GPUs) give the bits the
    same call gives on cuda:0, forward, backward and decoding (D=128 causal: the Gluon
    forward where it runs)."""
    torch.cuda.set_device(0)
    q, k, v = (torch.randn(2, 256, 4, D, device="cuda:1", dtype=torch.bfloat16) for _ in range(3))
    results = []
    for device in ("cuda:1", "cuda:0"):
        x = [t.to(device).requires_grad_() for t in (q, k, v)]
        out, lse = flashop.attention_with_lse(*x, causal=True)
        grads = torch.autograd.grad(out.float().square().sum(), x)
        cache = torch.zeros(2, 300, 4, D, device=device, dtype=torch.bfloat16)
        decoded = flashop.attention_with_kvcache(
            x[0].detach()[:, :1], cache, cache.clone(), x[1].detach()[:, :5],
            x[2].detach()[:, :5], cache_seqlens=torch.tensor([3, 7], device=device,
                                                             dtype=torch.int32))
        results.append([t.cpu() for t in (out, lse, *grads, decoded)])
    assert torch.cuda.current_device() == 0
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("page", [16, 256])
def test_paged_prefill_under_inductor_and_autotuned(page):
    """The paged prefill (attention_varlen with a block_table) under torch.compile: Inductor's
    code launches the forward kernel itself, with eager's bits; and with the autotuner's
    tiles (FLASHOP_AUTOTUNE=1: key tiles above and below the page size) bf16 against the
    reference of the gathered keys."""
    from torch._inductor.utils import run_and_get_code

    case = PagedCase((300, 1, 77), (1000, 513, 77), 2, 4, 128, 128, torch.bfloat16,
                     page=page, max_blocks=1024 // page, spare=5, causal=True, softcap=20.0)
    args, _ = make_paged(case)
    options = dict(causal=True, softcap=20.0, block_table=args[7])
    expected = flashop.attention_varlen_with_lse(*args[:7], **options)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: flashop.attention_varlen_with_lse(*a, **options),
                             fullgraph=True)
    result, code = run_and_get_code(lambda: compiled(*args[:7]))
    code = "\n".join(code)
    # (the operator's name shows in Inductor's comments; no call of it must remain)
    assert "attention_fwd_kernel" in code
    assert "torch.ops.flashop.attention_varlen_paged" not in code
    assert all(torch.equal(a, b) for a, b in zip(result, expected))
    with flashop.config.override(autotune=True):
        check_paged(case)
        check_paged(replace(case, D=64, DV=64, window_size=(100, 0), alibi=(8,)))


# odd shapes for compute-sanitizer: (B, S_q, S_k, H, H_kv, D, DV, causal)
SANITIZER_SHAPES = [(1, 1, 1, 1, 1, 59, 59, True), (2, 77, 131, 6, 2, 111, 40, True),
                    (1, 257, 65, 3, 3, 80, 80, True), (1, 129, 129, 2, 1, 256, 256, False),
                    (2, 33, 1000, 4, 1, 96, 96, False), (2, 77, 256, 4, 2, 128, 128, False),
                    (2, 77, 131, 4, 2, 176, 128, True)]  # (the head dim in 128 + 64 tiles)

SANITIZER_SCRIPT = """
import sys, torch, flashop
part = sys.argv[1]
if part == "split":  # the split causal forward at any length (the table's from 4096 keys)
    flashop._launch.tiles.SHORT_KEYS = 0
    part = "plain"
B, S_q, S_k, H, H_kv, D, DV, causal = map(int, sys.argv[2:])
for dtype in (torch.bfloat16, torch.float32):
    q = torch.randn(B, S_q, H, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(B, S_k, H_kv, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, S_k, H_kv, DV, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.nn.functional.logsigmoid(torch.randn(B, S_k, H, device="cuda")).requires_grad_()
    if part == "plain":
        out, lse = flashop.attention_with_lse(q, k, v, causal=bool(causal))
        torch.autograd.grad((out, lse), (q, k, v), (torch.randn_like(out), torch.randn_like(lse)))
    elif part == "modifiers":  # every modifier, the float mask with its gradient; chunks
        bias = torch.randn(1, H, S_q, S_k, device="cuda", requires_grad=True)
        out, lse = flashop.attention_with_lse(q, k, v, bias, torch.rand(H, device="cuda"), g,
                                              causal=True, window_size=(40, 0), softcap=5.0)
        torch.autograd.grad((out, lse), (q, k, v, g, bias),
                            (torch.randn_like(out), torch.randn_like(lse)))
        out, lse = flashop.attention_with_lse(q, k, v, causal=True, attention_chunk=48)
        torch.autograd.grad((out, lse), (q, k, v), (torch.randn_like(out), torch.randn_like(lse)))
    elif part == "training":  # sinks and dropout, dense and packed
        sinks = torch.randn(H, device="cuda", requires_grad=True)
        out, lse = flashop.attention_with_lse(q, k, v, sinks=sinks, causal=bool(causal),
                                              dropout_p=0.3)
        torch.autograd.grad((out, lse), (q, k, v, sinks),
                            (torch.randn_like(out), torch.randn_like(lse)))
        cu_q = torch.arange(B + 1, device="cuda", dtype=torch.int32) * S_q
        cu_k = torch.arange(B + 1, device="cuda", dtype=torch.int32) * S_k
        out = flashop.attention_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q,
                                       cu_k, S_q, S_k, sinks=sinks, causal=True, dropout_p=0.5)
        out.sum().backward()
    elif part == "gluon":  # the Gluon forward (FLASHOP_GLUON=1), D=64, 128, 256 and
        if dtype == torch.bfloat16:  # 192 / 128 (with dropout too), and backward, D=64, 128
            for causal, layout, Dg, p in ((False, "bshd", 128, 0.0), (True, "bhsd", 128, 0.0),
                                          (True, "bshd", 64, 0.0), (False, "bhsd", 64, 0.0),
                                          (True, "bshd", 128, 0.3), (False, "bhsd", 64, 0.3),
                                          (False, "bhsd", 256, 0.0), (True, "bshd", 256, 0.0),
                                          (True, "bhsd", 192, 0.3), (False, "bshd", 192, 0.0)):
                S_q = S_k if causal else S_q
                shape = lambda S, h, d: (B, h, S, d) if layout == "bhsd" else (B, S, h, d)
                qg, kg, vg = (torch.randn(shape(S, h, d), device="cuda", dtype=dtype)
                              for S, h, d in ((S_q, H, Dg), (S_k, H_kv, Dg),
                                              (S_k, H_kv, 128 if Dg == 192 else Dg)))
                if layout == "bhsd":
                    qg, kg, vg = (x.transpose(1, 2) for x in (qg, kg, vg))
                assert flashop._launch.gluon.serves(qg, kg, vg, causal, 0.1, True)
                qg, kg, vg = (x.requires_grad_(True) for x in (qg, kg, vg))
                out, lse = flashop.attention_with_lse(qg, kg, vg, causal=causal, dropout_p=p)
                torch.autograd.grad((out, lse), (qg, kg, vg),
                                    (torch.randn_like(out), torch.randn_like(lse)))
    elif part == "decode":  # S_q new tokens appended to a dense and a paged cache, attended
        if dtype == torch.bfloat16:
            q, k, v = q.detach(), k.detach(), v.detach()
            new_k, new_v = k[:, :S_q], v[:, :S_q]
            if new_k.shape[1] < S_q:  # fewer keys than queries: repeat them
                reps = -(-S_q // S_k)
                new_k = k.repeat(1, reps, 1, 1)[:, :S_q]
                new_v = v.repeat(1, reps, 1, 1)[:, :S_q]
            cap = S_k + S_q + 5
            lens = torch.randint(0, S_k + 1, (B,), device="cuda", dtype=torch.int32)
            k_cache = torch.randn(B, cap, H_kv, D, device="cuda", dtype=dtype)
            v_cache = torch.randn(B, cap, H_kv, DV, device="cuda", dtype=dtype)
            flashop.attention_with_kvcache(q, k_cache, v_cache, new_k, new_v, cache_seqlens=lens,
                                           causal=bool(causal), sinks=torch.randn(H, device="cuda"))
            for page in (16, 256):  # tiles over several pages; a tile's one page
                per_seq = -(-cap // page)
                table = torch.randperm(B * per_seq + 3, device="cuda")[:B * per_seq]
                table = table.view(B, per_seq).to(torch.int32)
                k_pages = torch.randn(B * per_seq + 3, page, H_kv, D, device="cuda",
                                      dtype=dtype)
                v_pages = torch.randn(B * per_seq + 3, page, H_kv, DV, device="cuda",
                                      dtype=dtype)
                for splits in (0, 1, 3):
                    flashop.attention_with_kvcache(q, k_pages, v_pages, new_k, new_v,
                                                   cache_seqlens=lens, block_table=table,
                                                   causal=bool(causal), num_splits=splits,
                                                   window_size=(20, -1))
    elif part == "mla":  # MLA's latent cache (576 dims, values its first 512): up to 4 new
        if dtype == torch.bfloat16:  # tokens appended and attended, dense and paged, chunked
            s = min(S_q, 4)
            ql = torch.randn(B, s, H, 576, device="cuda", dtype=dtype)
            new = torch.randn(B, s, 1, 576, device="cuda", dtype=dtype)
            cap = S_k + s + 5
            lens = torch.randint(0, S_k + 1, (B,), device="cuda", dtype=torch.int32)
            cache = torch.randn(B, cap, 1, 576, device="cuda", dtype=dtype)
            flashop.attention_with_kvcache(ql, cache, cache[..., :512], new, cache_seqlens=lens,
                                           causal=True, return_lse=True)
            # 64 heads: the Gluon kernel where it runs (triton 3.6, Hopper)
            q64 = torch.randn(B, s, 64, 576, device="cuda", dtype=dtype)
            flashop.attention_with_kvcache(q64, cache, cache[..., :512], new, cache_seqlens=lens,
                                           causal=True, return_lse=True)
            # and 64 rows over the s queries (64 / s heads each; its per-row causal bounds)
            qs = [ql, q64] + ([torch.randn(B, s, 64 // s, 576, device="cuda", dtype=dtype)]
                              if s in (2, 4) else [])
            flashop.attention_with_kvcache(qs[-1], cache, cache[..., :512], new,
                                           cache_seqlens=lens, causal=True, return_lse=True)
            for page in (16, 64):
                per_seq = -(-cap // page)
                table = torch.randperm(B * per_seq + 3, device="cuda")[:B * per_seq]
                table = table.view(B, per_seq).to(torch.int32)
                pages = torch.randn(B * per_seq + 3, page, 1, 576, device="cuda", dtype=dtype)
                for splits in (0, 1, 3):
                    for queries in qs:
                        flashop.attention_with_kvcache(queries, pages, pages[..., :512], new,
                                                       cache_seqlens=lens, block_table=table,
                                                       causal=True, num_splits=splits)
            q, k, v = q.detach(), k.detach(), v.detach()  # a chunked decode of the shape
            new_k = k.repeat(1, -(-S_q // S_k), 1, 1)[:, :S_q]
            new_v = v.repeat(1, -(-S_q // S_k), 1, 1)[:, :S_q]
            k_cache = torch.randn(B, S_k + S_q + 5, H_kv, D, device="cuda", dtype=dtype)
            v_cache = torch.randn(B, S_k + S_q + 5, H_kv, DV, device="cuda", dtype=dtype)
            flashop.attention_with_kvcache(q, k_cache, v_cache, new_k, new_v, cache_seqlens=lens,
                                           causal=True, attention_chunk=32, num_splits=3)
    elif part == "paged":  # paged prefill over pages of 16 and 256; rotary and left padding
        if dtype == torch.bfloat16:  # in the append and the decode kernel
            q, k, v = q.detach(), k.detach(), v.detach()
            cu_q = torch.arange(B + 1, device="cuda", dtype=torch.int32) * S_q
            cu_k = torch.arange(B + 1, device="cuda", dtype=torch.int32) * S_k
            for page in (16, 256):
                per_seq = -(-S_k // page)
                table = torch.randperm(B * per_seq + 3, device="cuda")[:B * per_seq]
                table = table.view(B, per_seq).to(torch.int32)
                pages = [torch.randn(B * per_seq + 3, page, H_kv, d, device="cuda", dtype=dtype)
                         for d in (D, DV)]
                flashop.attention_varlen(q.flatten(0, 1), *pages, cu_q, cu_k, S_q, S_k,
                                         causal=bool(causal), window_size=(30, -1),
                                         block_table=table)
            cap = S_k + S_q + 5
            new_k = k.repeat(1, -(-S_q // S_k), 1, 1)[:, :S_q]
            new_v = v.repeat(1, -(-S_q // S_k), 1, 1)[:, :S_q]
            angle = torch.rand(cap, D // 2, device="cuda") * 6.3
            lens = torch.randint(0, S_k + 1, (B,), device="cuda", dtype=torch.int32)
            pads = (torch.rand(B, device="cuda") * (lens + 1)).floor().to(torch.int32)
            k_cache = torch.randn(B, cap, H_kv, D, device="cuda", dtype=dtype)
            v_cache = torch.randn(B, cap, H_kv, DV, device="cuda", dtype=dtype)
            flashop.attention_with_kvcache(q, k_cache, v_cache, new_k, new_v, cache_seqlens=lens,
                                           cache_leftpad=pads, rotary_cos=angle.cos().to(dtype),
                                           rotary_sin=angle.sin().to(dtype),
                                           rotary_interleaved=bool(causal), causal=bool(causal))
    elif part == "fp8":  # the e4m3 forward (dense with v in either layout, packed) and an
        if dtype == torch.bfloat16:  # fp8 cache: appends and decode, dense and paged
            e4m3 = torch.float8_e4m3fn
            q8, k8, v8 = (x.detach().to(e4m3) for x in (q, k, v))
            qd, kd, vd = (torch.rand(B, H_kv, device="cuda") + 0.5 for _ in range(3))
            flashop.attention(q8, k8, v8, causal=bool(causal), q_descale=qd, k_descale=kd,
                              v_descale=vd)
            v_last = v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # keys last
            flashop.attention(q8, k8, v_last, causal=bool(causal),
                              window_size=(30, 0 if causal else 9),
                              sinks=torch.randn(H, device="cuda"))
            cu_q = torch.arange(B + 1, device="cuda", dtype=torch.int32) * S_q
            cu_k = torch.arange(B + 1, device="cuda", dtype=torch.int32) * S_k
            flashop.attention_varlen(q8.flatten(0, 1), k8.flatten(0, 1), v8.flatten(0, 1),
                                     cu_q, cu_k, S_q, S_k, causal=True, softcap=5.0)
            q, k, v = q.detach(), k.detach(), v.detach()
            new_k = k.repeat(1, -(-S_q // S_k), 1, 1)[:, :S_q]
            new_v = v.repeat(1, -(-S_q // S_k), 1, 1)[:, :S_q]
            cap = S_k + S_q + 5
            lens = torch.randint(0, S_k + 1, (B,), device="cuda", dtype=torch.int32)
            caches = [torch.randn(B, cap, H_kv, d, device="cuda").to(e4m3) for d in (D, DV)]
            flashop.attention_with_kvcache(q, *caches, new_k, new_v, cache_seqlens=lens,
                                           causal=bool(causal), k_descale=kd, v_descale=vd)
            for page in (16, 256):
                per_seq = -(-cap // page)
                table = torch.randperm(B * per_seq + 3, device="cuda")[:B * per_seq]
                table = table.view(B, per_seq).to(torch.int32)
                pages = [torch.randn(B * per_seq + 3, page, H_kv, d, device="cuda").to(e4m3)
                         for d in (D, DV)]
                for splits in (0, 1, 3):
                    flashop.attention_with_kvcache(q, *pages, new_k, new_v, cache_seqlens=lens,
                                                   block_table=table, causal=bool(causal),
                                                   num_splits=splits, k_descale=kd,
                                                   v_descale=vd)
    else:  # the same tokens packed (B sequences of S_q and S_k); a boolean mask dense
        cu_q = torch.arange(B + 1, device="cuda", dtype=torch.int32) * S_q
        cu_k = torch.arange(B + 1, device="cuda", dtype=torch.int32) * S_k
        out = flashop.attention_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q,
                                       cu_k, S_q, S_k, None, g.flatten(0, 1), causal=True,
                                       window_size=(17, 0))
        out.sum().backward()
        out = flashop.attention(q, k, v, torch.rand(S_q, S_k, device="cuda") > 0.5,
                                window_size=(9, 30))
        out.sum().backward()
torch.cuda.synchronize()
print("sanitized")
"""

# (part of the script, FLASHOP_DQ_ATOMICS): the modifiers' part has a gate and a mask
# gradient, where dQ never goes by atomics, and chunks; "training" has sinks and dropout,
# "decode" the key/value-cache op (appends into dense and paged caches, split and not),
# "paged" the paged prefill and the rotary, left-padded append and decode, "fp8" the e4m3
# forward and the fp8 cache's appends and decode, "mla" MLA's latent cache (appends and
# decode, dense and paged) and a chunked decode, "gluon" the Gluon forward at D=128, 64 and
# 256 (causal and not; with dropout at D=128 and 64) over the shape's batch, lengths and
# heads, and the Gluon backward at D=128 and 64 (its dQ adds in key-tile order; by atomics
# with FLASHOP_DQ_ATOMICS=1)
SANITIZER_PARTS = [("plain", "0"), ("plain", "1"), ("modifiers", "0"), ("packed", "0"),
                   ("packed", "1"), ("split", "0"), ("training", "0"), ("decode", "0"),
                   ("paged", "0"), ("gluon", "0"), ("gluon", "1"), ("fp8", "0"),
                   ("mla", "0")]


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="no compute-sanitizer")
@pytest.mark.parametrize("part", SANITIZER_PARTS, ids="-atomics".join)
@pytest.mark.parametrize("shape", SANITIZER_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_compute_sanitizer_memcheck_on_odd_shapes(shape, part):
    """One shape and one part of the script per run, so that each sanitized process stays
    short (under memcheck every kernel variant compiles and runs many times slower). A plain
    run first fills Triton's kernel cache, so that the sanitized run does not compile."""
    name, dq_atomics = part
    if name == "split" and not (shape[7]
                                and flashop._launch.tiles.two_query_tiles(max(shape[5:7]))):
        pytest.skip("the split causal forward takes causal shapes with 64 < D <= 128")
    if name == "gluon" and not flashop._launch.gluon.available(torch.device("cuda")):
        pytest.skip("the Gluon forward needs a Hopper GPU and triton 3.6")
    env = {**os.environ, "FLASHOP_DQ_ATOMICS": dq_atomics,
           **({"FLASHOP_GLUON": "1"} if name == "gluon" else {})}
    args = [sys.executable, "-c", SANITIZER_SCRIPT, name, *map(str, map(int, shape))]
    plain = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert plain.returncode == 0, plain.stderr[-3000:]
    done = subprocess.run(
        ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "1", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0 and "sanitized" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ERROR SUMMARY: 0 errors" in done.stdout, done.stdout[-3000:]


def _gluon_here() -> bool:
    return DEVICE == "cuda" and flashop._launch.gluon.available(torch.device("cuda"))


def _count_gluon_launches(monkeypatch) -> list:
    """The names of the Gluon launchers (attention_forward, attention_backward) as they run,
    in order, for the rest of the test (a counter, not a mock: a mock would keep the calls'
    tensors, which CUDA graphs' memory pool refuses to see outlive a capture)."""
    from flashop._launch import gluon

    launches = []
    for name in ("attention_forward", "attention_backward"):
        def counted(*args, _launch=getattr(gluon, name), _name=name, **kwargs):
            launches.append(_name)
            return _launch(*args, **kwargs)
        monkeypatch.setattr(gluon, name, counted)
    return launches


@pytest.mark.skipif(not _gluon_here(), reason="the Gluon kernels need Hopper and triton 3.6")
@pytest.mark.parametrize("compile_options", [dict(), dict(dynamic=True),
                                             dict(mode="reduce-overhead")],
                         ids=["default", "dynamic", "reduce-overhead"])
def test_compiled_graphs_run_the_eager_kernels(compile_options, monkeypatch):
    """Where an eager call takes the Gluon forward and backward (D=128, 4096 keys, causal,
    bf16), a graph compiled with fullgraph (default mode, dynamic shapes, CUDA graphs) calls
    them through the opaque operators: Inductor's code names attention_forward_opaque and
    attention_backward_opaque, the Gluon launchers run, and out, lse and the deterministic
    backward's gradients equal the eager call's bit for bit; the default backward (dQ by
    atomics) passes the accuracy rule."""
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 4096, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    dlse = torch.randn(2, 4, 4096, device="cuda", generator=gen)

    def attention(q, k, v, deterministic):
        return flashop.attention_with_lse(q, k, v, causal=True, deterministic=deterministic)

    def step(attention, deterministic):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out, lse = attention(*leaves, deterministic)
        grads = torch.autograd.grad((out, lse), leaves, (dout, dlse))
        return [t.clone() for t in (out, lse, *grads)]

    expected = step(attention, True)
    torch._dynamo.reset()
    compiled = torch.compile(attention, fullgraph=True, **compile_options)
    launches = _count_gluon_launches(monkeypatch)
    _, code = run_and_get_code(lambda: step(compiled, True))
    for _ in range(2):  # (CUDA graphs: recorded, then replayed)
        result = step(compiled, True)
    code = "\n".join(code)
    assert {"attention_forward", "attention_backward"} <= set(launches), launches
    assert "attention_forward_opaque" in code and "attention_backward_opaque" in code
    for a, b in zip(result, expected):
        assert torch.equal(a, b)
    out, lse, *grads = step(compiled, False)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    for r in check_attention(*leaves, dout, dlse, out, lse, grads, causal=True):
        assert r.ok, str(r)


@pytest.mark.skipif(not _gluon_here(), reason="the Gluon kernels need Hopper and triton 3.6")
def test_exported_graphs_keep_the_inductor_visible_kernels():
    """The same call exported (torch.export) holds flashop's operator, not the opaque one
    (which a package could not load), and runs as the eager call."""

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return flashop.attention(q, k, v, causal=True)

    q = torch.randn(1, 4096, 2, 128, device="cuda", dtype=torch.bfloat16)
    program = torch.export.export(Attention(), (q, q, q))
    graph = str(program.graph)
    assert "attention_forward" in graph and "opaque" not in graph
    eager = flashop.attention(q, q, q, causal=True)
    assert torch.equal(program.module()(q, q, q), eager)


@pytest.mark.skipif(not _gluon_here(), reason="the Gluon kernels need Hopper and triton 3.6")
def test_cached_launches_keep_no_tensor_alive():
    """The launch cache keys a Gluon launch by its descriptors' dtype and block: after a
    forward and backward whose tensors are all deleted, none of their memory stays
    allocated (the cache held the first call's tensors through its descriptors)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(2):  # the first call fills the cache, the second launches from it
        q, k, v = (torch.randn(2, 2048, 4, 128, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        flashop.attention(q, k, v, causal=True).sum().backward()
        del q, k, v
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 2**20


@pytest.mark.skipif(not _gluon_here(), reason="the Gluon kernels need Hopper and triton 3.6")
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_gluon_calls_replay_their_plans(deterministic, monkeypatch):
    """Eager calls that the Gluon forward and backward serve (D=128, 2048 keys, causal,
    bf16) are planned: the second call of a signature replays the plans (the Gluon
    launchers do not run again; their descriptors are remade for the call's tensors), its
    out and lse equal the operator's bit for bit, and its gradients too where deterministic
    (the default backward, dQ by atomics, passes the accuracy rule); the plans keep no
    call's tensor alive."""
    from flashop._launch import plans
    from flashop._ops import attention as ops

    plans.clear_plans()
    launches = _count_gluon_launches(monkeypatch)

    def step(seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v = (torch.randn(2, 2048, 4, 128, device="cuda", dtype=torch.bfloat16,
                               generator=gen).requires_grad_() for _ in range(3))
        dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        out, lse = flashop.attention_with_lse(q, k, v, causal=True,
                                              deterministic=deterministic)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        return (q, k, v, dout), [out, lse, *grads]

    def calls():  # (its tensors go with it)
        step(0)
        assert launches == ["attention_forward", "attention_backward"]
        for seed in (1, 2):
            inputs, got = step(seed)
            with flashop.config.override(direct_eager=False):
                _, expected = step(seed)
            for a, b in zip(got if deterministic else got[:2], expected):
                assert torch.equal(a, b)
            if not deterministic:
                q, k, v, dout = (x.detach().requires_grad_() for x in inputs)
                dlse = torch.zeros_like(got[1])
                for r in check_attention(q, k, v, dout, dlse, *got[:2], got[2:], causal=True):
                    assert r.ok, str(r)

    calls()  # (compiles, and allocates once what the kernels and the rule keep)
    plans.clear_plans()
    launches.clear()
    before = _cuda_tensors_alive()
    calls()
    # the first call ran the launchers, and so did the operator's calls; the replays did not
    assert launches.count("attention_forward") == 3 and launches.count("attention_backward") == 3
    assert [type(p) for p in ops.planned_forward.plans.values()] == [plans.Plan]
    assert [type(p) for p in ops.planned_backward.plans.values()] == [plans.Plan]
    after = _cuda_tensors_alive()
    kept = [meta for key, meta in after[1].items() if key not in before[1]]
    assert after[0] - before[0] < 2**20, f"tensors kept: {kept}"


def _cuda_tensors_alive() -> tuple:
    """The CUDA memory allocated, once garbage is collected (objects in reference cycles
    freed), and the CUDA tensors alive by id: (bytes, {id: (shape, dtype)})."""
    gc.collect()
    torch.cuda.synchronize()
    alive = {id(t): (tuple(t.shape), t.dtype) for t in gc.get_objects()
             if type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_cuda}
    return torch.cuda.memory_allocated(), alive


@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability() < (8, 9),
                    reason="fp8 tensor cores need sm_89 or newer")
@pytest.mark.parametrize("D, keys_last", [(128, False), (128, True), (256, False)])
def test_fp8_forward_under_inductor_cuda_graphs_and_export(D, keys_last):
    """The fp8 operator: Inductor's code launches its Triton kernels, compiled (default and
    reduce-overhead: CUDA graphs) and exported calls equal the eager call bit for bit, with
    values in either layout."""
    from torch._inductor.utils import run_and_get_code

    fp8 = torch.float8_e4m3fn
    gen = torch.Generator(device="cuda").manual_seed(D)
    q, k, v = (torch.randn(2, 4096, h, D, device="cuda", generator=gen).to(fp8)
               for h in (4, 2, 2))
    if keys_last:
        v = v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    qd, kd, vd = (torch.rand(2, 2, device="cuda", generator=gen) + 0.5 for _ in range(3))

    def fn(q, k, v, qd, kd, vd):
        return flashop.attention(q, k, v, causal=True, q_descale=qd, k_descale=kd,
                                 v_descale=vd)

    eager = fn(q, k, v, qd, kd, vd)
    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(fn, fullgraph=True), q, k, v, qd, kd, vd)
    assert "attention_fwd" in " ".join(code)
    assert torch.equal(out, eager)
    torch._dynamo.reset()
    graphed = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        assert torch.equal(graphed(q, k, v, qd, kd, vd), eager)

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, qd, kd, vd):
            return fn(q, k, v, qd, kd, vd)

    program = torch.export.export(Attention(), (q, k, v, qd, kd, vd))
    assert "attention_fp8" in str(program.graph)
    assert torch.equal(program.module()(q, k, v, qd, kd, vd), eager)
