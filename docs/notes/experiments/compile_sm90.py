"""Compile (never run) flashop's Gluon forward for Hopper (sm_90) on a machine without a GPU.

Usage (from the repository root, with a Python environment holding triton 3.6.0 and a CPU
torch; performance notes, entry 104):

    PYTHONPATH=. python docs/notes/experiments/compile_sm90.py           # the 5 configs
    PYTHONPATH=. python docs/notes/experiments/compile_sm90.py --dump /tmp/ir  # + IR files
    PYTHONPATH=. python docs/notes/experiments/compile_sm90.py --break    # + 3 broken ones

Its stand-in driver and ``compile_kernel`` also serve tests/compile_for_hopper.py (the `tl`
and decoding kernels compiled for sm_90 in CI, with whichever Triton is installed): a change
here is a change to that test.

How: triton's active driver is replaced by a stand-in that reports GPUTarget("cuda", 90, 32),
flashop/_launch/gluon.py::attention_forward is called over CPU tensors with its launch_now
swapped for a catcher, and the caught (kernel, kwargs) go through the kernel's own
``warmup`` (JIT binder: specialization and signature from the real arguments), which runs
every stage: Gluon AST -> TTGIR -> LLIR -> PTX -> cubin (the wheel's ptxas). Gluon has no
TTIR stage. Registers come from ``cuobjdump --dump-resource-usage`` of the cubin (triton's
``n_regs`` only exists once a driver loads it), spills from ``ptxas -v`` rerun where the cubin
has a stack frame; shared memory from metadata.shared, checked against sm_90's 232448-byte
opt-in limit (the check triton makes at load time), and registers x threads against 65536.
Compiled kernels are cached as usual (~/.triton/cache; TRITON_ALWAYS_COMPILE=1 or a fresh
TRITON_CACHE_DIR recompiles). Exit status 1 if one of the 5 default configurations fails
(D = 192 with DV = 128: q's and k's head dim in two tiles).

From Python (an interactive interpreter or another script):

    import sys; sys.path.insert(0, "docs/notes/experiments")
    from compile_sm90 import compile_forward, descriptor, report
    report(compile_forward(128, False))                          # as attention_forward launches
    report(compile_forward(256, False, STAGES=3))                 # a constexpr overridden
    report(compile_forward(128, True, BLOCK_N=64, CONSUMER_REGS=168))
    # a variant kernel with extra arguments, fp8 inputs, V's descriptor over a (B, H, D, S)
    # view of V stored (B, H, D, S)-contiguous (tile [1, 1, D, BLOCK_N]):
    #   kern = ...  # the variant kernel (a gluon.jit function of one's own)
    #   FP8 = torch.float8_e4m3fn
    #   v_t = torch.empty(1, 16, 128, 4096, dtype=FP8)           # (B, H, D, S)
    #   ds = torch.ones(1, 16)                                   # descales
    #   report(compile_forward(128, False, FP8, kernel=kern,
    #                          tensors=dict(v=v_t.permute(0, 3, 1, 2), out_dtype=torch.bfloat16),
    #                          v_desc=descriptor(v_t, [1, 1, 128, 128]),
    #                          q_descale=ds, k_descale=ds, v_descale=ds, PINGPONG=True))
    # or give launcher= a function of attention_forward's arguments that calls launch_now
    # (e.g. a future gluon.attention_forward_fp8), whose launch is then caught the same way.

compile_forward returns a Result (ok, error, compiled, info); it never raises on a compile
error. Overrides replace (or add) launch keyword arguments after the launcher built them;
an override of None removes one.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import re
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver as _driver_config

TARGET = GPUTarget("cuda", 90, 32)  # triton 3.6: (backend, arch, warp_size)
SM90_MAX_SHARED = 232448  # bytes per block (opt-in) on H100 / H200: triton's load-time check
SM90_REGS = 65536  # 32-bit registers per SM
SM90_SMS = 132  # the grid's size only; it plays no part in the compilation
WANT_TRITON = (3, 6)


# --- a driver that reports sm_90 and can launch nothing ------------------------------------

class _Utils:
    def get_device_properties(self, device):
        return {"max_shared_mem": SM90_MAX_SHARED, "multiprocessor_count": SM90_SMS,
                "max_num_regs": SM90_REGS, "warpSize": 32, "sm_clock_rate": 1980000,
                "mem_clock_rate": 2619000, "mem_bus_width": 5120}

    def load_binary(self, *args, **kwargs):
        raise RuntimeError("compile_sm90: no GPU here; kernels are compiled, never loaded")


class Sm90StandInDriver:
    """What triton's JIT asks of the active driver on a warmup: the target, a device and
    stream id. Anything that would load or launch raises."""

    def __init__(self, target: GPUTarget = TARGET):
        self.target = target
        self.utils = _Utils()

    @staticmethod
    def is_active():
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_device_capability(self, device=None):
        return (self.target.arch // 10, self.target.arch % 10)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise RuntimeError("compile_sm90: no GPU here")

    @property
    def launcher_cls(self):
        raise RuntimeError("compile_sm90: no GPU here; kernels are compiled, never launched")


def install_driver(target: GPUTarget = TARGET) -> None:
    _driver_config.set_active(Sm90StandInDriver(target))


install_driver()

# flashop imports only after the stand-in driver is active
from flashop._launch import gluon as G  # noqa: E402

# --- descriptors ---------------------------------------------------------------------------

_GL_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
             torch.float8_e4m3fn: "float8e4nv", torch.float8_e5m2: "float8e5",
             torch.int8: "int8", torch.uint8: "uint8"}


def tile_layout(block, dtype: torch.dtype):
    """The NVMMASharedLayout that _launch.gluon._tile_layout gives a tile (any dtype above)."""
    from triton.experimental.gluon import language as gl
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, _GL_NAMES[dtype]))


def descriptor(x: torch.Tensor, block, layout=None, padding: str = "zero"):
    """A descriptor of ``x`` as it is strided (any rank, e.g. a (B, H, D, S) view), tiles
    ``block``, made as _launch.gluon._descriptor makes its own (its Descriptor type, no
    TensorDescriptor checks; the layout per tile_layout unless given)."""
    block = tuple(block)
    d = object.__new__(G._descriptor_type())
    d.base, d.shape, d.strides, d.block_shape = x, list(x.shape), list(x.stride()), list(block)
    d.layout = layout if layout is not None else tile_layout(block, x.dtype)
    d.padding, d.spec = padding, (x.dtype, block)
    return d


_orig_tile_layout = G._tile_layout


def _any_dtype_tile_layout(block, dtype):
    if dtype in G._GL_DTYPES:
        return _orig_tile_layout(block, dtype)
    return tile_layout(block, dtype)


# so that the launcher's own _descriptor also takes fp8 tensors (this process only)
G._tile_layout = _any_dtype_tile_layout


# --- the launch, as attention_forward makes it ---------------------------------------------

class _Caught(Exception):
    pass


def catch_launch(launcher: Callable, *args, **kwargs):
    """(kernel, grid, launch kwargs) of the first launch_now that ``launcher(*args,
    **kwargs)`` makes (the launch itself is not made)."""
    caught = {}

    def fake_launch_now(kernel, grid, **kw):
        caught.update(kernel=kernel, grid=grid, kwargs=kw)
        raise _Caught

    saved = G.launch_now, G.sm_count
    G.launch_now, G.sm_count = fake_launch_now, (lambda device: SM90_SMS)
    try:
        launcher(*args, **kwargs)
    except _Caught:
        pass
    finally:
        G.launch_now, G.sm_count = saved
    if not caught:
        raise RuntimeError(f"{launcher.__name__} made no launch_now call")
    return caught["kernel"], caught["grid"], caught["kwargs"]


def forward_inputs(D: int, dtype=torch.bfloat16, B=1, S=4096, H=16, H_kv=None, S_k=None,
                   DV=None, out_dtype=None, **tensors) -> dict:
    """CPU tensors of attention_forward's arguments: q (B, S, H, D), k and v (B, S_k, H_kv,
    D / DV), out, lse, lse_log2 as attention_forward_outputs allocates them (out in
    ``out_dtype``: default bf16 for 8-bit inputs, else q's). ``tensors`` replace any."""
    H_kv = H_kv or H
    S_k = S_k or S
    DV = DV or D
    t = dict(q=torch.empty(B, S, H, D, dtype=dtype),
             k=torch.empty(B, S_k, H_kv, D, dtype=dtype),
             v=torch.empty(B, S_k, H_kv, DV, dtype=dtype))
    t.update({n: x for n, x in tensors.items() if n in ("q", "k", "v")})
    if out_dtype is None:
        out_dtype = torch.bfloat16 if dtype.itemsize == 1 else dtype
    t["out"] = torch.empty(B, S, H, t["v"].shape[-1], dtype=out_dtype)
    t["lse"] = torch.empty(B, H, S, dtype=torch.float32)
    t["lse_log2"] = torch.empty(B, H, S, dtype=torch.float32)
    t.update({n: x for n, x in tensors.items() if n not in ("q", "k", "v")})
    return t


@dataclass
class Result:
    label: str
    ok: bool
    error: Optional[str] = None
    compiled: Any = None
    info: dict = field(default_factory=dict)
    log: str = ""  # what the compiler printed (ptxas failures print the whole PTX)


def compile_forward(D: int, causal: bool, dtype: torch.dtype = torch.bfloat16, *,
                    kernel=None, launcher: Optional[Callable] = None,
                    tensors: Optional[dict] = None, dropout: bool = False,
                    num_warps: Optional[int] = None, label: Optional[str] = None,
                    dump: Optional[str] = None, **overrides) -> Result:
    """Compile the Gluon forward for sm_90 with the arguments that ``launcher`` (default
    _launch.gluon.attention_forward) passes for a (B=1, S=4096, H=16, D) call over CPU
    tensors of ``dtype`` (forward_inputs; ``tensors``: its keyword arguments, e.g. B, S, H,
    H_kv, out_dtype, or tensors to use). ``kernel``: another kernel to compile with those
    arguments. ``overrides``: launch keyword arguments replaced or added (constexprs,
    descriptors, tensors; None removes one). ``dump``: a folder to write each stage's IR to."""
    label = label or (f"D={D} {'causal' if causal else 'non-causal'} {_dtype_name(dtype)}"
                      + "".join(f" {k}={_short(v)}" for k, v in overrides.items()))
    try:
        t = forward_inputs(D, dtype, **(tensors or {}))
        seed = torch.zeros(1, dtype=torch.int64) if dropout else None
        launch = launcher or G.attention_forward
        kern, grid, kwargs = catch_launch(
            launch, t["q"], t["k"], t["v"], t["out"], t["lse"], t["lse_log2"], causal,
            D ** -0.5 * math.log2(math.e), seed, 0.1 if dropout else 0.0, dropout)
        kern = kernel or kern
        for name, value in overrides.items():
            if value is None:
                kwargs.pop(name, None)
            else:
                kwargs[name] = value
        if num_warps is not None:
            kwargs["num_warps"] = num_warps
    except Exception:
        return Result(label, False, "building the launch arguments failed:\n"
                      + traceback.format_exc())
    return compile_kernel(kern, grid, kwargs, label=label, dump=dump)


def compile_kernel(kernel, grid, kwargs: dict, label: str = "", dump: Optional[str] = None
                   ) -> Result:
    """``kernel.warmup(grid=grid, **kwargs)`` under the stand-in driver: the JIT's own
    binding, specialization and compilation to a cubin; then its resources."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), _captured_fd2() as diag:
            compiled = kernel.warmup(grid=grid, **kwargs)
            if hasattr(compiled, "result"):  # (async compile mode)
                compiled = compiled.result()
    except Exception as e:
        err = _error_text(e)
        if diag.text.strip():  # MLIR's diagnostics (C++, to fd 2): the error's location
            err = diag.text.rstrip() + "\n" + err
        return Result(label, False, err, log=out.getvalue())
    if diag.text.strip():
        sys.stderr.write(diag.text)
    res = Result(label, True, compiled=compiled, log=out.getvalue())
    res.info = _resources(compiled)
    problems = []
    if res.info["shared"] > SM90_MAX_SHARED:
        problems.append(f"shared memory {res.info['shared']} B > sm_90's {SM90_MAX_SHARED} B "
                        "(triton raises OutOfResources when it loads this kernel)")
    threads, regs = res.info.get("threads"), res.info.get("n_regs")
    if threads and regs and threads * regs > SM90_REGS:
        problems.append(f"{regs} registers x {threads} threads > {SM90_REGS} (launch fails)")
    if problems:
        res.ok, res.error = False, "; ".join(problems)
    if dump:
        _dump(compiled, dump, label)
    return res


class _Text:
    text = ""


@contextlib.contextmanager
def _captured_fd2():
    """What is written to file descriptor 2 within (MLIR prints its diagnostics there, from
    C++, past sys.stderr), in .text once it ends."""
    box = _Text()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield box
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            box.text = f.read().decode(errors="replace")


def _error_text(e: BaseException) -> str:
    # triton's CompilationError carries the source location and the Gluon error; a pass
    # failure's says little ("PassManager::run failed"): its MLIR diagnostics, caught from
    # fd 2 (_captured_fd2), are put before it; ptxas's stderr is in PTXASError's message
    text = "".join(traceback.format_exception_only(type(e), e)).rstrip()
    cause = e.__cause__ or e.__context__
    while cause is not None:
        text += "\n  caused by: " + "".join(
            traceback.format_exception_only(type(cause), cause)).rstrip()
        cause = cause.__cause__ or cause.__context__
    return text


_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                          "cuobjdump")


def _resources(compiled) -> dict:
    md = compiled.metadata
    info = {"stages": [s for s in ("ttir", "ttgir", "llir", "ptx", "cubin") if s in compiled.asm],
            "shared": md.shared, "num_warps": md.num_warps, "name": md.name}
    ptx = compiled.asm.get("ptx", "")
    m = re.search(r"\.(?:reqntid|maxntid)\s+(\d+)", ptx)
    if m:
        info["threads"] = int(m.group(1))
    # the warp_specialize partitions' register budgets, in PTX order (+N: inc to N, -N: dec)
    info["setmaxnreg"] = [("+" if op == "inc" else "-") + n for op, n in re.findall(
        r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)]
    cubin = compiled.asm.get("cubin")
    if cubin:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            r = subprocess.run([_CUOBJDUMP, "--dump-resource-usage", f.name],
                               capture_output=True, text=True)
        usage = r.stdout
        for key, name in (("REG", "n_regs"), ("STACK", "stack"), ("SHARED", "static_shared"),
                          ("LOCAL", "local")):
            m = re.search(rf"\b{key}:(\d+)", usage)
            if m:
                info[name] = int(m.group(1))
        info["spill_stores"] = info["spill_loads"] = 0
        if info.get("stack") and ptx:  # a stack frame: ptxas -v tells how much is spills
            info.update(_ptxas_spills(ptx, compiled.metadata.target.arch))
    return info


def _ptxas_spills(ptx: str, arch: int) -> dict:
    """Spill stores and loads (bytes) as ``ptxas -v`` reports them for ``ptx`` (ptxas run
    again, with the options triton passes it by default)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([get_ptxas(arch).path, "-lineinfo", "-v",
                            f"--gpu-name={sm_arch_from_capability(arch)}", src,
                            "-o", os.path.join(tmp, "k.o")], capture_output=True, text=True)
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    return {"spill_stores": int(m.group(1)), "spill_loads": int(m.group(2))} if m else {}


def _dump(compiled, folder: str, label: str) -> None:
    sub = os.path.join(folder, re.sub(r"[^A-Za-z0-9_.=-]+", "_", label).strip("_"))
    os.makedirs(sub, exist_ok=True)
    for ext, text in compiled.asm.items():
        mode = "wb" if isinstance(text, bytes) else "w"
        with open(os.path.join(sub, f"kernel.{ext}"), mode) as f:
            f.write(text)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _short(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor{tuple(v.shape)}:{_dtype_name(v.dtype)}"
    if hasattr(v, "block_shape"):
        return f"desc{tuple(v.block_shape)}"
    return repr(v)


def report(res: Result, verbose_log: bool = False) -> bool:
    """Print one line (OK and its resources) or FAIL and the whole error; True if OK."""
    if res.ok:
        i = res.info
        extra = ""
        if i.get("setmaxnreg"):
            extra = f" setmaxnreg={','.join(i['setmaxnreg'])}"
        print(f"OK   {res.label}: shared={i['shared']} B, n_regs={i.get('n_regs', '?')}, "
              f"spills={i.get('spill_stores', '?')}/{i.get('spill_loads', '?')} B (stores/loads; "
              f"stack {i.get('stack', '?')} B{'; SPILLS' if i.get('spill_stores') else ''}), "
              f"threads={i.get('threads', '?')} (num_warps={i['num_warps']}){extra}, "
              f"stages={'/'.join(i['stages'])}", flush=True)
    else:
        print(f"FAIL {res.label}:\n{_indent(res.error)}", flush=True)
        if res.info:
            print(f"     (compiled: shared={res.info['shared']} B, "
                  f"n_regs={res.info.get('n_regs', '?')})", flush=True)
        if res.log and (verbose_log or "ptxas" in (res.error or "")):
            path = os.path.join(tempfile.gettempdir(), "compile_sm90_last.log")
            with open(path, "w") as f:
                f.write(res.log)
            print(f"     (compiler stdout, {len(res.log)} chars, e.g. the PTX: {path})",
                  flush=True)
    return res.ok


def _indent(text: Optional[str]) -> str:
    return "\n".join("     " + line for line in (text or "").splitlines())


DEFAULT_CONFIGS = [(128, False), (128, True), (64, False), (256, False), (192, True)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", help="write each configuration's IR (ttgir, llir, ptx, cubin)")
    ap.add_argument("--break", dest="broken", action="store_true",
                    help="also compile deliberately broken configurations")
    args = ap.parse_args(argv)
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) != WANT_TRITON:
        print(f"warning: triton {triton.__version__}; the Gluon kernels are written for "
              f"{'.'.join(map(str, WANT_TRITON))}", file=sys.stderr)
    print(f"triton {triton.__version__} torch {torch.__version__} target {TARGET}", flush=True)
    ok = True
    for D, causal in DEFAULT_CONFIGS:
        ok &= report(compile_forward(D, causal, tensors=dict(DV=G.FWD_VALUE_DIMS[D]),
                                     dump=args.dump))
    if args.broken:
        report(compile_forward(256, False, STAGES=8, label="[broken] D=256 STAGES=8"))
        report(compile_forward(128, False, BLOCK_N=96, label="[broken] D=128 BLOCK_N=96"))
        report(compile_forward(128, False, BLOCK_M=256, label="[broken] D=128 BLOCK_M=256"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
