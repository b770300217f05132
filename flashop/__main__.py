"""``python -m flashop``: check the kernels against the reference on this machine's device,
then time them (on a GPU, next to ``F.scaled_dot_product_attention``).

Without a CUDA GPU the kernels run in Triton's CPU interpreter: the command restarts itself
with TRITON_INTERPRET=1, which Triton reads when the kernels are decorated.
"""

from __future__ import annotations

import os
import sys
import time

import torch


def _restart_in_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    os.execve(sys.executable, [sys.executable, "-m", "flashop", *sys.argv[1:]], env)


# (B, S_q, S_k, H, H_kv, D, DV, causal): odd lengths, S_q != S_k, grouped heads, odd head dims
CHECKS_CPU = [(1, 37, 53, 4, 2, 40, 40, True), (2, 50, 21, 3, 1, 59, 32, True),
              (1, 64, 64, 2, 2, 128, 128, False)]
CHECKS_GPU = CHECKS_CPU + [(2, 1000, 777, 8, 2, 128, 128, True),
                           (1, 513, 2049, 4, 4, 256, 256, False),
                           (4, 1, 300, 8, 1, 64, 64, True)]


def self_check(device: str) -> bool:
    import flashop
    from flashop.testing import check_attention

    dtypes = [torch.float16, torch.bfloat16, torch.float32]
    checks = CHECKS_GPU if device == "cuda" else CHECKS_CPU
    print(f"{'dtype':>9} {'B':>2} {'S_q':>5} {'S_k':>5} {'H':>3} {'H_kv':>4} {'D':>4} "
          f"{'DV':>4} {'causal':>6}  worst error/bound  result")
    all_ok = True
    gen = torch.Generator(device=device).manual_seed(0)
    for dtype in dtypes:
        for B, S_q, S_k, H, H_kv, D, DV, causal in checks:
            q, k, v = (torch.randn(B, S, h, d, device=device, dtype=dtype, generator=gen
                                   ).requires_grad_()
                       for S, h, d in ((S_q, H, D), (S_k, H_kv, D), (S_k, H_kv, DV)))
            dout = torch.randn(B, S_q, H, DV, device=device, dtype=dtype, generator=gen)
            dlse = torch.randn(B, H, S_q, device=device, generator=gen)
            out, lse = flashop.attention_with_lse(q, k, v, causal=causal)
            grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
            results = check_attention(q, k, v, dout, dlse, out, lse, grads, causal=causal)
            ok = all(r.ok for r in results)
            all_ok &= ok
            worst = max(r.error / r.bound if r.bound else 0.0 for r in results)
            print(f"{str(dtype)[6:]:>9} {B:>2} {S_q:>5} {S_k:>5} {H:>3} {H_kv:>4} {D:>4} "
                  f"{DV:>4} {str(causal):>6}  {worst:17.2f}  {'ok' if ok else 'FAIL'}")
            for r in results:
                if not r.ok:
                    print("    " + str(r))
    return all_ok


def modifier_check(device: str) -> bool:
    """Every modifier at once (dense, float mask with its gradient) and a packed batch with a
    gate and a window, per dtype, under the same accuracy rule."""
    import flashop
    from flashop.testing import check_attention, check_attention_varlen, differentiable_inputs

    gen = torch.Generator(device=device).manual_seed(1)
    all_ok = True
    print(f"\n{'dtype':>9}  {'case':<58} worst error/bound  result")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        def randn(*shape, dt=dtype):
            return torch.randn(*shape, device=device, dtype=dt, generator=gen)

        B, S_q, S_k, H, H_kv, D = 2, 45, 70, 4, 2, 32
        q, k, v = randn(B, S_q, H, D), randn(B, S_k, H_kv, D), randn(B, S_k, H_kv, D)
        g = torch.nn.functional.logsigmoid(randn(B, S_k, H, dt=torch.float32) + 2)
        bias = randn(1, H, S_q, 1, dt=torch.float32)
        slopes = torch.rand(H, device=device, generator=gen)
        options = dict(causal=True, window_size=(24, 0), softcap=5.0)
        dense = (q, k, v, bias, g)
        for t in dense:
            t.requires_grad_()
        out, lse = flashop.attention_with_lse(q, k, v, bias, slopes, g, **options)
        wrt = differentiable_inputs(q, k, v, bias, g)
        dout, dlse = randn(B, S_q, H, D), randn(B, H, S_q, dt=torch.float32)
        grads = torch.autograd.grad((out, lse), tuple(wrt.values()), (dout, dlse))
        results = [("causal, window 24, softcap 5, ALiBi, gate, float mask (grad)",
                    check_attention(q, k, v, dout, dlse, out, lse, grads, bias, slopes, g,
                                    **options))]

        lens_q, lens_k = [0, 37, 1, 60], [5, 50, 1, 60]
        cu_q, cu_k = (torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
                      for lens in (lens_q, lens_k))
        q, k, v = randn(sum(lens_q), H, D), randn(sum(lens_k), H_kv, D), randn(
            sum(lens_k), H_kv, D)
        g = torch.nn.functional.logsigmoid(randn(sum(lens_k), H, dt=torch.float32) + 2)
        for t in (q, k, v, g):
            t.requires_grad_()
        options = dict(causal=True, window_size=(20, 0))
        out, lse = flashop.attention_varlen_with_lse(q, k, v, cu_q, cu_k, 60, 60, None, g,
                                                     **options)
        dout, dlse = randn(*out.shape), randn(*lse.shape, dt=torch.float32)
        grads = torch.autograd.grad((out, lse), (q, k, v, g), (dout, dlse))
        results.append(("packed lengths q 0/37/1/60, k 5/50/1/60, gate, window 20",
                        check_attention_varlen(q, k, v, cu_q, cu_k, dout, dlse, out, lse,
                                               grads, None, g, **options)))
        for name, rs in results:
            ok = all(r.ok for r in rs)
            all_ok &= ok
            worst = max(r.error / r.bound if r.bound else 0.0 for r in rs)
            print(f"{str(dtype)[6:]:>9}  {name:<58} {worst:17.2f}  {'ok' if ok else 'FAIL'}")
            for r in rs:
                if not r.ok:
                    print("    " + str(r))
    return all_ok


def benchmark_gpu() -> None:
    import torch.nn.functional as F
    from triton.testing import do_bench

    import flashop

    print("\nTFLOP/s, bf16, 16k tokens per batch, 2048 hidden (see benchmarks/ for the "
          "full grid and the peers)")
    print(f"{'D':>4} {'N':>6} {'causal':>6} {'pass':>4} {'flashop':>8} {'sdpa':>8}")
    for D in (64, 128):
        for N in (1024, 4096):
            for causal in (False, True):
                B, H = 16384 // N, 2048 // D
                q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=True) for _ in range(3))
                qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_()
                              for x in (q, k, v))
                flops = 4 * B * H * N * N * D / (2 if causal else 1)
                runs = {
                    "flashop": (lambda: flashop.attention(q, k, v, causal=causal), (q, k, v)),
                    "sdpa": (lambda: F.scaled_dot_product_attention(qt, kt, vt,
                                                                     is_causal=causal),
                             (qt, kt, vt)),
                }
                for name_pass, mult in (("fwd", 1.0), ("bwd", 2.5)):
                    row = []
                    for fn, inputs in runs.values():
                        if name_pass == "fwd":
                            ms = do_bench(fn, return_mode="median")
                        else:
                            out = fn()
                            dout = torch.randn_like(out)
                            ms = do_bench(lambda: out.backward(dout, retain_graph=True),
                                          grad_to_none=list(inputs), return_mode="median")
                        row.append(mult * flops / ms * 1e-9)
                    print(f"{D:>4} {N:>6} {str(causal):>6} {name_pass:>4} "
                          f"{row[0]:8.1f} {row[1]:8.1f}")


def benchmark_interpreter() -> None:
    import flashop

    q = torch.randn(1, 256, 2, 64, requires_grad=True)
    start = time.perf_counter()
    out = flashop.attention(q, q, q, causal=True)
    out.sum().backward()
    print(f"\nTriton interpreter: (1, 256, 2, 64) causal forward + backward in "
          f"{time.perf_counter() - start:.2f} s (the interpreter is for checking, not speed)")


def main() -> int:
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        _restart_in_interpreter()
    import triton

    import flashop

    device = "cpu" if flashop.INTERPRETING else "cuda"
    where = ("Triton CPU interpreter" if device == "cpu"
             else torch.cuda.get_device_name())
    print(f"flashop {flashop.__version__}, torch {torch.__version__}, triton "
          f"{triton.__version__}, kernels on: {where}\n")
    ok = self_check(device)
    ok &= modifier_check(device)
    print("\nself-check:", "passed" if ok else "FAILED")
    if device == "cuda":
        benchmark_gpu()
    else:
        benchmark_interpreter()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
