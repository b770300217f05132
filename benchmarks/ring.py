"""Context parallelism: flashop.distributed.ring_attention forward + backward on W GPUs
against flashop.attention on one GPU, in tokens per second per GPU.

bf16, B = 1, H = 16 (H_kv = --kv-heads), D = 128, causal, sequences of --seqlens tokens split
over the W ranks in the zigzag layout. For each length the script reports
- ``ring``: one forward + backward of ring_attention, the slowest rank's time;
- ``exchange``: one ring step's K/V transfer alone (each rank sends its shard to the next and
  receives the previous one's), with its bandwidth per direction;
- ``single``: (rank 0 alone, the others waiting) flashop.attention on the whole sequence on
  one GPU, for the longest lengths up to --single-max that fit in its memory.
With one process (``--nproc-per-node 1``) ``ring`` runs the world-size-1 path, which is the
plain operator. docs/notes/context-parallel.md says what to expect.

Usage (one node, W GPUs):
    torchrun --nproc-per-node W benchmarks/ring.py [--seqlens 131072,262144,524288,1048576]
        [--single-max 1048576] [--out PATH.csv]
"""

import argparse
import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import gpu_slug, import_flashop, write_csv  # noqa: E402

CSV_HEADER = ["gpu", "torch", "triton", "world", "what", "N", "H", "H_kv", "D", "ms",
              "tokens_per_s_per_gpu", "tflops_per_gpu", "gb_per_s"]
H, D = 16, 128


def int_list(text):
    return [int(x) for x in text.split(",") if x]


def timed(fn, warmup, rep, together=True):
    """Median milliseconds of ``fn()`` on this GPU; where ``together``, the ranks start each
    run together (every rank must call it then)."""
    times = []
    for i in range(warmup + rep):
        if together:
            dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def slowest(ms):
    """The largest of the ranks' times."""
    t = torch.tensor([ms], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def causal_flops(N):
    """Forward + backward (2.5x the forward) flops of causal attention over N tokens."""
    return 3.5 * 4 * N * N / 2 * H * D


def causal_inputs(S, H_kv):
    """bf16 q (1, S, H, D), k and v (1, S, H_kv, D) requiring grad, and a dout like q."""
    q = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, S, H_kv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, S, H_kv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return q, k, v, torch.randn_like(q)


def bench_ring(fd, N, H_kv, W, warmup, rep):
    q, k, v, dout = causal_inputs(N // W, H_kv)

    def step():
        out = fd.ring_attention(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), dout)

    ms = slowest(timed(step, warmup, rep))
    row = dict(what="ring", ms=ms, tokens_per_s_per_gpu=N / W / (ms / 1e3),
               tflops_per_gpu=causal_flops(N) / W / (ms / 1e3) / 1e12)
    rows = [row]
    if W > 1:
        ring = fd._ring(None, "benchmark")
        recv = [torch.empty_like(k), torch.empty_like(v)]
        kv = [k.detach().contiguous(), v.detach().contiguous()]
        ms = slowest(timed(lambda: fd._wait(fd._exchange(ring, kv, recv)), warmup, rep * 4))
        nbytes = 2 * k.numel() * k.element_size()
        rows.append(dict(what="exchange", ms=ms, gb_per_s=nbytes / (ms / 1e3) / 1e9))
    return rows


def bench_single(flashop, N, H_kv, warmup, rep):
    q, k, v, dout = causal_inputs(N, H_kv)

    def step():
        out = flashop.attention(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), dout)

    ms = timed(step, warmup, rep, together=False)  # one rank alone
    return dict(what="single", ms=ms, tokens_per_s_per_gpu=N / (ms / 1e3),
                tflops_per_gpu=causal_flops(N) / (ms / 1e3) / 1e12)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", type=int_list, default=[131072, 262144, 524288, 1048576])
    p.add_argument("--kv-heads", type=int, default=H)
    p.add_argument("--single-max", type=int, default=1048576,
                   help="the longest sequence to run on one GPU (0: none)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rep", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank),
                            timeout=datetime.timedelta(minutes=20))
    flashop = import_flashop()
    import flashop.distributed as fd

    W, rank = dist.get_world_size(), dist.get_rank()
    props = torch.cuda.get_device_properties(local_rank)
    import triton
    base = dict(gpu=props.name, torch=torch.__version__, triton=triton.__version__, world=W,
                H=H, H_kv=args.kv_heads, D=D)
    rows = []

    def report(new, N):
        for row in new:
            row = {**base, "N": N, **row}
            rows.append(row)
            if rank == 0:
                extra = (f"{row['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
                         f"{row['tflops_per_gpu']:.0f} TFLOP/s/GPU"
                         if "tokens_per_s_per_gpu" in row else f"{row['gb_per_s']:.0f} GB/s")
                print(f"W={W} N={N:>8} {row['what']:>8}: {row['ms']:10.1f} ms  {extra}",
                      flush=True)

    for N in args.seqlens:
        if N % (2 * W):
            if rank == 0:
                print(f"N={N}: not a multiple of 2 * W = {2 * W}; skipped")
            continue
        report(bench_ring(fd, N, args.kv_heads, W, args.warmup, args.rep), N)
        torch.cuda.empty_cache()

    # one GPU on the whole sequence: the longest lengths that fit
    if rank == 0:
        for N in sorted((n for n in args.seqlens if n <= args.single_max), reverse=True):
            try:
                report([bench_single(flashop, N, args.kv_heads, args.warmup, args.rep)], N)
                break
            except torch.cuda.OutOfMemoryError:
                print(f"N={N}: out of memory on one GPU")
                torch.cuda.empty_cache()
    dist.barrier()
    if rank == 0 and args.out is not None:
        write_csv(args.out, rows, CSV_HEADER)
    elif rank == 0:
        stamp = datetime.date.today().isoformat()
        print(f"(--out benchmarks/results/{stamp}-{gpu_slug(props.name)}-ring-w{W}.csv "
              f"keeps the numbers)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
