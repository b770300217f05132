"""``python -m flashop``: check flashop against the reference on this machine, then time it
(next to ``F.scaled_dot_product_attention``), and print what ran where and a summary.

Two paths are checked: the CPU path (CPU tensors, PyTorch's CPU kernels), and the Triton
kernels, on a GPU, or without one in Triton's CPU interpreter (as CI tests them): in a child
process with TRITON_INTERPRET=1 (which Triton reads when the kernels are decorated), unless
this process already has it. ``--only cpu-path`` / ``--only kernels`` checks one.

The default run is short: a few checks (one with a window and a softcap, gradients included)
and one benchmark shape, so that a first run, which compiles each kernel it uses (Triton
caches them for later runs), ends within a minute.
``--full`` checks every dtype on more shapes, every modifier, sinks with a boolean mask and
dropout, and decoding over a paged cache, and times more shapes.
"""

from __future__ import annotations

import os
import time


def _process_start() -> float:
    """perf_counter's reading when this process started (Linux: from /proc, so the imports
    that ran before this module count; elsewhere this module's import)."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.perf_counter() - (uptime - started / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter()


_START = _process_start()

import argparse  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402


def _kernels_in_interpreter(full: bool) -> int:
    """Check the Triton kernels in Triton's interpreter, in a child process (its output
    inline); its exit status."""
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1")
    argv = [sys.executable, "-m", "flashop", "--only", "kernels", *(["--full"] if full else [])]
    return subprocess.run(argv, env=env).returncode


def _say(message: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f} s] {message}", flush=True)


# (dtype, B, S_q, S_k, H, H_kv, D, DV, causal): odd lengths, S_q != S_k, grouped heads, odd
# head dims. The quick GPU run's bf16 checks compile the very kernel variants its benchmark
# times (D=128, S_q = S_k of 2048 or more, which the Hopper kernels take; one K/V head per
# query head; lengths and strides multiples of 16, which Triton specializes on), so a first
# run compiles few kernels.
_BF16, _FP16, _FP32 = torch.bfloat16, torch.float16, torch.float32
CHECKS = {
    ("cpu", False): [(_BF16, 1, 37, 53, 4, 2, 40, 40, True), (_FP16, 2, 50, 21, 3, 1, 59, 32, True),
                     (_FP32, 1, 64, 64, 2, 2, 128, 128, False)],
    ("cuda", False): [(_BF16, 1, 2048, 2048, 16, 16, 128, 128, True),
                      (_BF16, 1, 2048, 2048, 16, 16, 128, 128, False),
                      (_FP16, 2, 50, 21, 3, 1, 59, 32, True),
                      (_FP32, 1, 64, 64, 2, 2, 128, 128, False)],
}
_MORE_SHAPES = [(1, 37, 53, 4, 2, 40, 40, True), (2, 50, 21, 3, 1, 59, 32, True),
                (1, 64, 64, 2, 2, 128, 128, False), (2, 1000, 777, 8, 2, 128, 128, True),
                (1, 513, 2049, 4, 4, 256, 256, False), (4, 1, 300, 8, 1, 64, 64, True)]
CHECKS[("cpu", True)] = [(dt, *s) for dt in (_FP16, _BF16, _FP32) for s in _MORE_SHAPES[:3]]
CHECKS[("cuda", True)] = [(dt, *s) for dt in (_FP16, _BF16, _FP32) for s in _MORE_SHAPES]

# (D, N, causal) of the GPU benchmark: bf16, 16k tokens per batch, 2048 hidden
BENCHMARK = {False: [(128, 4096, False), (128, 4096, True)],
             True: [(D, N, c) for D in (64, 128) for N in (1024, 4096) for c in (False, True)]}


class Summary:
    """What the run found: checks passed/failed and the worst error against its bound."""

    def __init__(self):
        self.passed = self.failed = 0
        self.worst = 0.0

    def add(self, results) -> bool:
        ok = all(r.ok for r in results)
        self.passed += ok
        self.failed += not ok
        self.worst = max(self.worst, *(r.error / r.bound if r.bound else 0.0 for r in results))
        for r in results:
            if not r.ok:
                print("    " + str(r))
        return ok


def _cpu_path():
    """A block in which CPU tensors take the CPU path (under the interpreter, the switch
    flashop.config's cpu_path; without it they always do)."""
    import flashop

    return flashop.config.override(cpu_path=True)


def _one_check(device: str, check: tuple, seed: int) -> tuple:
    """One configuration of CHECKS: flashop's out, lse and gradients under the accuracy
    rule; (its row of the table, the rule's results, flashop.explain's account of it)."""
    import flashop
    from flashop.testing import check_attention

    dtype, B, S_q, S_k, H, H_kv, D, DV, causal = check
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(B, S, h, d, device=device, dtype=dtype, generator=gen
                           ).requires_grad_()
               for S, h, d in ((S_q, H, D), (S_k, H_kv, D), (S_k, H_kv, DV)))
    dout = torch.randn(B, S_q, H, DV, device=device, dtype=dtype, generator=gen)
    dlse = torch.randn(B, H, S_q, device=device, generator=gen)
    told = flashop.explain(flashop.attention_with_lse, q, k, v, causal=causal)
    out, lse = flashop.attention_with_lse(q, k, v, causal=causal)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    results = check_attention(q, k, v, dout, dlse, out, lse, grads, causal=causal)
    row = (f"{str(dtype)[6:]:>9} {B:>2} {S_q:>5} {S_k:>5} {H:>3} {H_kv:>4} {D:>4} "
           f"{DV:>4} {str(causal):>6}")
    return row, results, told


def _ran(told) -> str:
    """One line of what an explained call ran: each pass's path and kernels with tiles."""
    def part(choice):
        kernels = "; ".join(f"{name}: {tiles}" if tiles else name
                            for name, tiles in choice.kernels)
        return f"{choice.path}" + (f" ({kernels})" if kernels else "")
    return part(told.forward) + (f" | backward: {part(told.backward)}"
                                 if told.backward is not None else "")


def self_check(device: str, full: bool, summary: Summary) -> None:
    """CHECKS' configurations, printed in order. On a GPU they run in threads, one each, so
    that a first run compiles their kernels side by side (Triton's compiler leaves Python's
    lock to other threads while it works); the interpreter runs them one after another."""
    from concurrent.futures import ThreadPoolExecutor

    checks = CHECKS[(device, full)]
    print(f"{'dtype':>9} {'B':>2} {'S_q':>5} {'S_k':>5} {'H':>3} {'H_kv':>4} {'D':>4} "
          f"{'DV':>4} {'causal':>6}  worst error/bound  result")
    seeds = range(len(checks))
    ran = []
    with ThreadPoolExecutor(len(checks) if device == "cuda" else 1) as pool:
        for row, results, told in pool.map(_one_check, [device] * len(checks), checks, seeds):
            worst = max(r.error / r.bound if r.bound else 0.0 for r in results)
            ok = summary.add(results)
            print(f"{row}  {worst:17.2f}  {'ok' if ok else 'FAIL'}", flush=True)
            ran.append((row, told))
    print("\nwhat each ran (flashop.explain; the first in full, with the rules that ruled "
          "something out):")
    print("  " + str(ran[0][1]).replace("\n", "\n  "))
    for row, told in ran[1:]:
        print(f"  {' '.join(row.split())}: {_ran(told)}")


def _modified_dense_check(randn, gen, device: str, every: bool) -> list:
    """A dense call with a two-sided window and a softcap, whose gradients the plain checks do
    not reach (a dropped term of the softcap's derivative fails it); where ``every``, causal
    with every score modifier instead (ALiBi, a gate, a float mask with its gradient)."""
    import flashop
    from flashop.testing import check_attention, differentiable_inputs

    B, S_q, S_k, H, H_kv, D = 2, 45, 70, 4, 2, 32
    q, k, v = randn(B, S_q, H, D), randn(B, S_k, H_kv, D), randn(B, S_k, H_kv, D)
    mods = dict(attn_mask=None, alibi_slopes=None, g=None)
    options = dict(window_size=(19, 7), softcap=2.0)
    if every:
        mods = dict(attn_mask=randn(1, H, S_q, 1, dt=torch.float32),
                    alibi_slopes=torch.rand(H, device=device, generator=gen),
                    g=torch.nn.functional.logsigmoid(randn(B, S_k, H, dt=torch.float32) + 2))
        options = dict(causal=True, window_size=(24, 0), softcap=5.0)
        mods["attn_mask"].requires_grad_()
        mods["g"].requires_grad_()
    for t in (q, k, v):
        t.requires_grad_()
    out, lse = flashop.attention_with_lse(q, k, v, **mods, **options)
    wrt = differentiable_inputs(q, k, v, mods["attn_mask"], mods["g"])
    dout, dlse = randn(B, S_q, H, D), randn(B, H, S_q, dt=torch.float32)
    grads = torch.autograd.grad((out, lse), tuple(wrt.values()), (dout, dlse))
    return check_attention(q, k, v, dout, dlse, out, lse, grads, **mods, **options)


def _report(summary: Summary, dtype: torch.dtype, name: str, results) -> None:
    worst = max(r.error / r.bound if r.bound else 0.0 for r in results)
    ok = summary.add(results)
    print(f"{str(dtype)[6:]:>9}  {name:<58} {worst:17.2f}  {'ok' if ok else 'FAIL'}",
          flush=True)


def _randn(gen, device: str, dtype: torch.dtype):
    def randn(*shape, dt=dtype):
        return torch.randn(*shape, device=device, dtype=dt, generator=gen)
    return randn


def quick_modifier_check(device: str, summary: Summary) -> None:
    """The default run's one call with modifiers (fp16): a two-sided window and a softcap,
    out, lse and gradients under the rule."""
    gen = torch.Generator(device=device).manual_seed(1)
    print(f"\n{'dtype':>9}  {'case':<58} worst error/bound  result")
    _report(summary, torch.float16, "window (19, 7), softcap 2",
            _modified_dense_check(_randn(gen, device, torch.float16), gen, device, False))


def modifier_check(device: str, summary: Summary) -> None:
    """Per dtype, under the same accuracy rule: every score modifier at once (dense, float
    mask with its gradient); a packed batch with a gate, a window and chunks; learned sinks
    with a boolean mask and dropout (against the reference given the kernels' own keep-mask);
    and decoding over a paged key/value cache with an append, chunked (out and lse; the cache
    after the append bit for bit)."""
    import flashop
    from flashop.testing import check_attention_varlen

    gen = torch.Generator(device=device).manual_seed(1)
    print(f"\n{'dtype':>9}  {'case':<58} worst error/bound  result")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        randn = _randn(gen, device, dtype)
        H, H_kv, D = 4, 2, 32
        results = [("causal, window 24, softcap 5, ALiBi, gate, float mask (grad)",
                    _modified_dense_check(randn, gen, device, True))]

        lens_q, lens_k = [0, 37, 1, 60], [5, 50, 1, 60]
        cu_q, cu_k = (torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
                      for lens in (lens_q, lens_k))
        q, k, v = randn(sum(lens_q), H, D), randn(sum(lens_k), H_kv, D), randn(
            sum(lens_k), H_kv, D)
        g = torch.nn.functional.logsigmoid(randn(sum(lens_k), H, dt=torch.float32) + 2)
        for t in (q, k, v, g):
            t.requires_grad_()
        options = dict(causal=True, window_size=(20, 0), attention_chunk=24)
        out, lse = flashop.attention_varlen_with_lse(q, k, v, cu_q, cu_k, 60, 60, None, g,
                                                     **options)
        dout, dlse = randn(*out.shape), randn(*lse.shape, dt=torch.float32)
        grads = torch.autograd.grad((out, lse), (q, k, v, g), (dout, dlse))
        results.append(("packed q 0/37/1/60, k 5/50/1/60, gate, window 20, chunk 24",
                        check_attention_varlen(q, k, v, cu_q, cu_k, dout, dlse, out, lse,
                                               grads, None, g, **options)))
        results.append(("sinks (grad), boolean mask, dropout 0.2, causal",
                        _training_check(randn, gen, device, dtype)))
        results.append(("paged cache (pages of 16), append 3, GQA, causal, chunk 24",
                        _cache_check(randn, gen, device, dtype)))
        for name, rs in results:
            _report(summary, dtype, name, rs)


def _training_check(randn, gen, device: str, dtype: torch.dtype) -> list:
    """Learned sinks with a boolean keep-mask, dropout drawn from a fixed seed: out, lse and
    the gradients of q, k, v and the sinks against the reference given the kernels' mask."""
    from flashop.testing import check_attention, differentiable_inputs, dropout_mask

    B, S_q, S_k, H, H_kv, D, p = 2, 40, 57, 4, 2, 32, 0.2
    q, k, v = randn(B, S_q, H, D), randn(B, S_k, H_kv, D), randn(B, S_k, H_kv, D)
    sinks = randn(H, dt=torch.float32)
    keep = torch.rand(B, 1, S_q, S_k, device=device, generator=gen) < 0.8
    for t in (q, k, v, sinks):
        t.requires_grad_()
    seed = torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64, generator=gen)
    out, lse, _ = torch.ops.flashop.attention_forward(
        q, k, v, attn_mask=keep, sinks=sinks, dropout_seed=seed, causal=True, dropout_p=p)
    wrt = differentiable_inputs(q, k, v, keep, None, sinks)
    dout, dlse = randn(*out.shape), randn(*lse.shape, dt=torch.float32)
    grads = torch.autograd.grad((out, lse), tuple(wrt.values()), (dout, dlse))
    return check_attention(q, k, v, dout, dlse, out, lse, grads, keep, sinks=sinks,
                           causal=True, dropout_p=p,
                           dropout_mask=dropout_mask(seed, B, H, S_q, S_k, p))


def _cache_check(randn, gen, device: str, dtype: torch.dtype) -> list:
    """attention_with_kvcache over a paged cache, appending 3 new keys, causal chunks of 24
    keys: out and lse under the rule against the fp64 reference and plain PyTorch; both
    caches after the append equal the reference's append bit for bit."""
    import flashop
    from flashop.reference import attention_with_kvcache_reference, kvcache_append_reference
    from flashop.testing import accuracy

    B, S_q, S_new, H, H_kv, D, page, pages = 3, 3, 3, 4, 2, 32, 16, 4
    q, k, v = randn(B, S_q, H, D), randn(B, S_new, H_kv, D), randn(B, S_new, H_kv, D)
    k_cache, v_cache = randn(B * pages + 2, page, H_kv, D), randn(B * pages + 2, page, H_kv, D)
    table = torch.randperm(B * pages + 2, device=device, generator=gen)[:B * pages]
    options = dict(cache_seqlens=torch.tensor([0, 20, 60], device=device, dtype=torch.int32),
                   block_table=table.view(B, pages).to(torch.int32), causal=True,
                   attention_chunk=24)
    expected = kvcache_append_reference(k_cache, v_cache, k, v, options["cache_seqlens"],
                                        None, options["block_table"])
    ref, plain = (attention_with_kvcache_reference(q, k_cache, v_cache, k, v, **options,
                                                   compute_dtype=dt)
                  for dt in (torch.float64, None))
    out, lse = flashop.attention_with_kvcache(q, k_cache, v_cache, k, v, **options,
                                              return_lse=True)
    appended = torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])
    return [accuracy("out", out, ref[0], plain[0], 2, dtype),
            accuracy("lse", lse, ref[1], plain[1], 2, dtype),
            _Exact("the caches after the append, bit for bit", appended)]


class _Exact:
    """A check that holds or not (no error to bound), as Summary reads the rule's results."""

    error = bound = 0.0

    def __init__(self, name: str, ok: bool):
        self.name, self.ok = name, ok

    def __str__(self) -> str:
        return f"{self.name}: {'as expected' if self.ok else 'differ from the reference'}"


def benchmark_gpu(full: bool) -> list:
    """TFLOP/s of flashop and SDPA (its default backend) per shape and pass; the rows."""
    import torch.nn.functional as F
    from triton.testing import do_bench

    import flashop

    rows = []
    for D, N, causal in BENCHMARK[full]:
        _say(f"timing D={D} N={N} causal={causal}")
        B, H = 16384 // N, 2048 // D
        q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_()
                      for x in (q, k, v))
        flops = 4 * B * H * N * N * D / (2 if causal else 1)
        runs = {
            "flashop": (lambda: flashop.attention(q, k, v, causal=causal), (q, k, v)),
            "sdpa": (lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
                     (qt, kt, vt)),
        }
        for name_pass, mult in (("fwd", 1.0), ("bwd", 2.5)):
            row = [D, N, causal, name_pass]
            for fn, inputs in runs.values():
                if name_pass == "fwd":
                    ms = do_bench(fn, warmup=5, rep=20, return_mode="median")
                else:
                    out = fn()
                    dout = torch.randn_like(out)
                    ms = do_bench(lambda: out.backward(dout, retain_graph=True), warmup=5,
                                  rep=20, grad_to_none=list(inputs), return_mode="median")
                row.append(mult * flops / ms * 1e-9)
            rows.append(row)
    return rows


def benchmark_cpu_path() -> list:
    """ms of a forward + backward at (B, S, H, D) = (4, 512, 8, 64) on the CPU path and by
    SDPA's CPU kernels, fastest of 2 after a warm-up: (dtype, flashop's, SDPA's) for bf16 (a
    plain call: SDPA's kernels inside flashop) and fp32 (the blocked path)."""
    import torch.nn.functional as F

    import flashop

    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(4, 512, 8, 64, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_()
                      for x in (q, k, v))
        best = [float("inf")] * 2
        for _ in range(3):
            for i, fn in enumerate((lambda: flashop.attention(q, k, v),
                                    lambda: F.scaled_dot_product_attention(qt, kt, vt))):
                start = time.perf_counter()
                fn().sum().backward()
                best[i] = min(best[i], time.perf_counter() - start)
        rows.append((str(dtype)[6:], 1000 * best[0], 1000 * best[1]))
    return rows


def check_cpu_path(full: bool) -> "Summary":
    """The CPU path: CHECKS' CPU configurations (and with ``full`` every modifier, sinks and
    dropout, decoding over a paged cache), then the timing of benchmark_cpu_path."""
    summary = Summary()
    print("\nCPU path (CPU tensors: PyTorch's CPU kernels, flashop/_launch/cpu)")
    with _cpu_path():
        self_check("cpu", full, summary)
        if full:
            modifier_check("cpu", summary)
        else:
            quick_modifier_check("cpu", summary)
        _say("CPU path checks " + ("passed" if not summary.failed else "FAILED"))
        rows = benchmark_cpu_path()
    print(f"\nCPU path: (4, 512, 8, 64) forward + backward, ms, {torch.get_num_threads()} "
          f"threads (benchmarks/cpu.py times more)")
    print(f"{'dtype':>9} {'flashop':>8} {'sdpa':>8}")
    for dtype, ours, sdpa in rows:
        print(f"{dtype:>9} {ours:8.1f} {sdpa:8.1f}")
    return summary


def benchmark_interpreter() -> float:
    import flashop

    q = torch.randn(1, 256, 2, 64, requires_grad=True)
    start = time.perf_counter()
    out = flashop.attention(q, q, q, causal=True)
    out.sum().backward()
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flashop",
        description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", ""))
    parser.add_argument("--full", action="store_true",
                        help="check every dtype on more shapes, every modifier, sinks with "
                             "dropout and the KV cache; time more shapes (minutes on a first "
                             "run, which compiles more kernels)")
    parser.add_argument("--only", choices=("cpu-path", "kernels"),
                        help="check only the CPU path, or only the Triton kernels (without a "
                             "GPU: in Triton's interpreter)")
    args = parser.parse_args(argv)
    import triton

    import flashop

    gpu = torch.cuda.is_available()
    kernels_on = (torch.cuda.get_device_name() if gpu else "Triton's CPU interpreter"
                  if flashop.INTERPRETING else "Triton's CPU interpreter (a child process)")
    print(f"flashop {flashop.__version__}, torch {torch.__version__}, triton "
          f"{triton.__version__}; Triton kernels on: {kernels_on}; CPU tensors: the CPU path")
    _say("imported")
    results = []  # (what ran, Summary or the child's exit status)
    if args.only != "kernels":
        results.append(("CPU path", check_cpu_path(args.full)))
    if args.only != "cpu-path":
        if gpu or flashop.INTERPRETING:
            results.append((f"Triton kernels on {kernels_on}", check_kernels(args.full)))
        else:
            _say("Triton kernels in Triton's interpreter, in a child process:")
            status = _kernels_in_interpreter(args.full)
            results.append(("Triton kernels in Triton's interpreter", status))
    total = time.perf_counter() - _START
    parts = []
    for what, result in results:
        if isinstance(result, Summary):
            parts.append(f"{what}: {result.passed} checks passed, {result.failed} failed "
                         f"(worst error {result.worst:.2f} of its bound)")
        else:
            parts.append(f"{what}: {'passed' if result == 0 else 'FAILED'} (above)")
    print(f"\nsummary: {'; '.join(parts)}; total {total:.1f} s"
          f"{'' if args.full else '; --full checks more'}")
    failed = any(r.failed if isinstance(r, Summary) else r != 0 for _, r in results)
    return 1 if failed else 0


def check_kernels(full: bool) -> "Summary":
    """The Triton kernels on this device (a GPU, or the interpreter on the CPU): CHECKS'
    configurations (and with ``full`` the modifiers'), then a timing."""
    import flashop

    device = "cpu" if flashop.INTERPRETING else "cuda"
    where = "Triton's CPU interpreter" if device == "cpu" else torch.cuda.get_device_name()
    print(f"\nTriton kernels on {where}")
    _say("checking outputs and gradients against the reference (the first run compiles "
         "each kernel it uses; later runs take them from Triton's cache)")
    summary = Summary()
    self_check(device, full, summary)
    if full:
        modifier_check(device, summary)
    else:
        quick_modifier_check(device, summary)
    _say("kernel checks " + ("passed" if not summary.failed else "FAILED"))
    if device == "cuda":
        rows = benchmark_gpu(full)
        print(f"\nTFLOP/s, bf16, 16k tokens per batch, 2048 hidden ({where}; "
              f"benchmarks/attention.py times the full grid with the peers)")
        print(f"{'D':>4} {'N':>6} {'causal':>6} {'pass':>4} {'flashop':>8} {'sdpa':>8}")
        for D, N, causal, name_pass, ours, sdpa in rows:
            print(f"{D:>4} {N:>6} {str(causal):>6} {name_pass:>4} {ours:8.1f} {sdpa:8.1f}")
    else:
        seconds = benchmark_interpreter()
        print(f"\nTriton interpreter: (1, 256, 2, 64) causal forward + backward in "
              f"{seconds:.2f} s (the interpreter is for checking, not speed)")
    return summary


if __name__ == "__main__":
    sys.exit(main())
