"""The kernels compile for Hopper (sm_90) at the launches their launchers plan, on any
machine: tests/compile_for_hopper.py compiles them through PTX to a cubin with the installed
Triton (no GPU needed), so that code the interpreter runs but Triton's compiler refuses,
tiles past the shared memory, MLA tiles whose shared memory the tile rule miscounts, or a
kernel Inductor would count as writing an input, fail here too. The stack a GPU-less CI
holds (the newest Triton) is one no GPU test of ours runs."""

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_for_hopper.py")


def _compile(*args: str) -> subprocess.CompletedProcess:
    # a process of its own: the kernels compile only where the interpreter is off, and the
    # script replaces Triton's driver with one reporting sm_90
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True,
                          text=True, timeout=900)


def test_the_tl_and_decoding_kernels_compile_for_hopper():
    done = _compile()
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert done.returncode == 0 and not failed, done.stdout[-6000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    compiled = int(last.split()[1])
    # (124 launches: the forward, dQ and dK/dV kernels over the modifiers, packed batches and
    # pages; decode, fp8 decode and MLA attention, their appends and merges)
    assert compiled >= 120, last
    for kernel in ("attention_fwd_kernel", "attention_bwd_dq_kernel",
                   "attention_bwd_dkdv_kernel", "attention_decode_kernel", "mla_decode_kernel",
                   "kvcache_append_kernel", "attention_decode_merge_kernel"):
        assert f"OK   {kernel}:" in done.stdout, kernel


def test_a_launch_past_the_shared_memory_fails_there():
    done = _compile("--planted")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "FAIL mla_decode_kernel: planted" in done.stdout
    assert "shared memory 386048 B > sm_90's 232448 B" in done.stdout  # (P's 16 KiB too)
