"""Whether a Triton kernel may take one tensor's strides as one tuple argument on each stack:
eager (Triton's launcher), inside a triton_op compiled by Inductor (fullgraph), and under the
interpreter (python docs/notes/experiments/tuple_args_probe.py; exits 1 on a failure)."""

import sys

import torch
import triton
import triton.language as tl


@triton.jit
def copy_rows_kernel(x, y, stride_x, stride_y, S, BLOCK: tl.constexpr, D: tl.constexpr):
    # stride_x, stride_y: (batch, seq) strides of one tensor each, as tuples
    i_b = tl.program_id(1)
    o_s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    o_d = tl.arange(0, D)
    m = o_s[:, None] < S
    b_x = tl.load(x + i_b * stride_x[0] + o_s[:, None] * stride_x[1] + o_d[None, :], mask=m)
    tl.store(y + i_b * stride_y[0] + o_s[:, None] * stride_y[1] + o_d[None, :], b_x * 2,
             mask=m)


def launch(x, y):
    B, S, D = x.shape
    torch.library.wrap_triton(copy_rows_kernel)[(triton.cdiv(S, 16), B)](
        x, y, tuple(x.stride()[:2]), tuple(y.stride()[:2]), S, BLOCK=16, D=D)


@torch.library.triton_op("probe::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    launch(x, y)
    return y


def main() -> int:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(3, 37, 32, device=dev)[:, :, :32]
    ok = True
    y = torch.empty_like(x)
    launch(x, y)
    print("eager:", torch.equal(y, 2 * x))
    ok &= torch.equal(y, 2 * x)
    if dev == "cuda":
        from torch._inductor.utils import run_and_get_code
        f = torch.compile(lambda t: double(t) + 1, fullgraph=True)
        out, code = run_and_get_code(f, x)
        seen = "copy_rows_kernel" in "\n".join(code)
        print("compiled:", torch.equal(out, 2 * x + 1), "kernel in Inductor's code:", seen)
        ok &= torch.equal(out, 2 * x + 1) and seen
        fd = torch.compile(lambda t: double(t) + 1, fullgraph=True, dynamic=True)
        x2 = torch.randn(2, 53, 32, device=dev)
        print("dynamic:", torch.equal(fd(x), 2 * x + 1), torch.equal(fd(x2), 2 * x2 + 1))
        ok &= torch.equal(fd(x2), 2 * x2 + 1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
