"""A prefill over a paged key/value cache against the same prefill over packed keys and
values: ``flashop.attention_varlen(..., block_table=...)`` reading the pages in place,
against ``flashop.attention_varlen`` over the keys and values gathered into one packed
tensor (what the pages hold, in order). Each batch: ``--batch`` sequences whose queries are
the last ``--new`` of their ``--keys`` keys (a cached prefix, then the new tokens), causal,
bf16, GQA; pages of each ``--pages`` size, in a shuffled order of one pool. Forward only,
``triton.testing.do_bench``'s median, TFLOP/s (4 * queries * keys * D per head, the causal
part counted: keys at or before each query), and paged / packed.

    python benchmarks/paged_prefill.py                       # H=32 over 8, D=128
    python benchmarks/paged_prefill.py --keys 4096 --new 4096 512 64 --csv paged.csv
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import import_flashop, write_csv  # noqa: E402

CSV_HEADER = ["gpu", "torch", "triton", "dtype", "batch", "heads", "kv_heads", "dim", "keys",
              "new", "page", "layout", "ms", "tflops", "paged_vs_packed"]


def causal_pairs(keys: int, new: int) -> int:
    """Query-key pairs attended per head: query i of the last ``new`` sees keys up to its own
    position."""
    first = keys - new
    return sum(first + i + 1 for i in range(new))


def main() -> None:
    import triton

    flashop = import_flashop()
    H, H_kv, D, B, keys = args.heads, args.kv_heads, args.dim, args.batch, args.keys
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}, torch {torch.__version__}, triton {triton.__version__}; B={B} H={H}/{H_kv} "
          f"D={D} keys={keys} causal bf16")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for new in args.new:
        q = torch.randn(B * new, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        cu_q = torch.arange(B + 1, device="cuda", dtype=torch.int32) * new
        cu_k = torch.arange(B + 1, device="cuda", dtype=torch.int32) * keys
        flops = 4 * B * H * D * causal_pairs(keys, new)
        times = {}
        for page in [None, *args.pages]:
            if page is None:  # packed: the keys and values in one tensor
                k, v = (torch.randn(B * keys, H_kv, D, device="cuda", dtype=torch.bfloat16,
                                    generator=gen) for _ in range(2))
                extra = {}
            else:
                per_seq = -(-keys // page)
                blocks = B * per_seq
                k, v = (torch.randn(blocks, page, H_kv, D, device="cuda", dtype=torch.bfloat16,
                                    generator=gen) for _ in range(2))
                order = torch.randperm(blocks, device="cuda", generator=gen)
                extra = dict(block_table=order.view(B, per_seq).to(torch.int32))

            def call(k=k, v=v, extra=extra):
                return flashop.attention_varlen(q, k, v, cu_q, cu_k, new, keys, causal=True,
                                                **extra)

            call()
            ms = triton.testing.do_bench(call, warmup=25, rep=200)
            layout = "packed" if page is None else "paged"
            times[page] = ms
            ratio = times[None] / ms
            print(f"new={new:6d} {layout:7s} page={page or '-':>4} {ms:8.3f} ms "
                  f"{flops / ms / 1e9:6.0f} TFLOP/s  {ratio:5.2f}x packed", flush=True)
            rows.append(dict(zip(CSV_HEADER, [
                gpu, torch.__version__, triton.__version__, "bf16", B, H, H_kv, D, keys, new,
                page or "", layout, f"{ms:.4f}", f"{flops / ms / 1e9:.1f}", f"{ratio:.3f}"])))
    if args.csv:
        write_csv(Path(args.csv), rows, CSV_HEADER)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--new", type=int, nargs="+", default=[4096, 512, 64])
    parser.add_argument("--pages", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--csv", default=None, metavar="PATH")
    args = parser.parse_args()
    main()
