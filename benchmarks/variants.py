"""What fwd_variants.py and bwd_variants.py share: timing one variant at one tile size
against a reference, and the summary of the best tiles per variant."""

import torch
import triton
from triton.testing import do_bench


def use_torch_allocator(device="cuda"):
    """Device-side tensor descriptors (TMA) take their scratch memory from Triton's global
    allocator: hand it PyTorch's (these scripts own their process)."""
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device=device))


def rel_err(x, ref):
    """Relative error ||x - ref|| / ||ref||, in float64."""
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def time_variant(fn, row, flops, error=None, width=16):
    """Run ``fn`` once; where ``error`` is given (None for an ablation, whose results are
    wrong on purpose), ``error(fn's result)`` is its relative error to the reference, flagged
    WRONG from 1e-2; then time ``fn``. Returns ``row`` completed with ms, tflops and error,
    or None where the compiler refused the variant."""
    label = f"{row['variant']} {row['tiles']}"
    try:
        out = fn()
        torch.cuda.synchronize()
        err = ""
        if error is not None:
            rel = error(out)
            err = f"{rel:.1e}"
            if not rel < 1e-2:
                print(f"  {label}: WRONG rel err {rel}", flush=True)
        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
    except Exception as e:  # noqa: BLE001 - a variant the compiler refuses
        print(f"  {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None
    tflops = flops / ms * 1e-9
    print(f"  {row['variant']:>{width}} {row['tiles']}: {tflops:.0f} TFLOP/s  err {err}",
          flush=True)
    return dict(row, ms=round(ms, 4), tflops=round(tflops, 1), error=err)


def print_best(rows, names, width=16):
    """The machine and versions, then the fastest tiles of each variant per head dim."""
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}; best tiles per variant (TFLOP/s):")
    for D in sorted({r["D"] for r in rows}):
        for name in names:
            rs = [r for r in rows if r["D"] == D and r["variant"] == name]
            if rs:
                best = max(rs, key=lambda r: r["tflops"])
                print(f"  D={D:>3} {name:>{width}}: {best['tflops']:6.1f}  ({best['tiles']})")
