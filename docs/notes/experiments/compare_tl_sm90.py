"""Compile the tl kernels (forward, dQ, dK/dV) for sm_90 over representative calls, and
compare two source trees' compiled code, on a machine without a GPU.

Usage, from the repository root, with a Python environment holding triton 3.6.0 and a CPU
torch (compile_sm90.py's; it supplies the stand-in driver), a fresh TRITON_CACHE_DIR per
tree (or TRITON_ALWAYS_COMPILE=1), and the tree before a change somewhere else (e.g.
``mkdir /tmp/before && git archive main | tar -x -C /tmp/before``):

    X=docs/notes/experiments/compare_tl_sm90.py
    PYTHONPATH=/tmp/before python $X dump /tmp/dump-before
    PYTHONPATH=. python $X dump /tmp/dump-after
    PYTHONPATH=. python $X diff /tmp/dump-before /tmp/dump-after

``dump`` runs each case's launcher (flashop/_launch/attention.py's attention_forward or
attention_backward, over CPU tensors, Hopper's rules forced, the Gluon kernels off) with
its launches caught, compiles each caught launch through the kernel's own ``warmup``
(compile_sm90.compile_kernel) and writes, per launch: its scalar arguments and constexprs,
its resources (registers, spill bytes, stack, shared memory), its PTX without debug
information (``.loc`` and ``.file`` lines, ``.debug_*`` sections and comments dropped) and
its SASS (``cuobjdump -sass``). ``--only`` keeps the cases whose names hold a string.
``diff`` compares two dumps launch by launch (arguments, resources, PTX, SASS), prints the
first differing lines, and exits with status 1 on any difference.

The cases: forward D = 64 and 128, causal and not (two query tiles per program at D = 128
causal), tensor-descriptor loads, D = 192 / 128 with the head dim in two tiles, a window
with a softcap, ALiBi and a gate, a chunk with sinks, a boolean and a float mask, dropout,
a packed batch, a paged prefill, fp8 (D = 128, and 192 / 128 in two tiles); backward
D = 64, 128 and 192 / 128 (the dK/dV kernel in parts, the head dim in two tiles), dQ by
atomics, the modifiers, a chunk, a float mask's gradient, a boolean mask, dropout, a packed
batch; both also with one query, and with one head and a window of one key either side
(values of 1, which triton's specialization makes constexprs).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compile_sm90 as C  # noqa: E402  (installs the stand-in driver before flashop loads)
import torch  # noqa: E402

from flashop import config  # noqa: E402
from flashop._launch import attention as A, choice, tiles  # noqa: E402
from flashop._launch.options import PLAIN, Packing, modifiers  # noqa: E402

BF16 = torch.bfloat16


def _hopper_rules(parts: bool) -> None:
    """Hopper's rules for CPU tensors: its tiles, the CPU path off, the head dim in two
    tiles and the dK/dV kernel in two parts where ``parts`` (and the head dim allows)."""
    tiles.is_hopper = choice.is_hopper = lambda device: True
    A.cpu.serves = choice.cpu.serves = lambda x: False
    choice.INTERPRETING = False
    blocks = choice.head_blocks
    choice.head_in_parts = lambda d, dev, why=None: parts and bool(blocks(d)[1])
    tiles.splits_dkdv = lambda d, dtype, dev, why=None: parts and d > 128


def _caught(run, parts=False, **overrides) -> list:
    """The (kernel, grid, kwargs) of the launches ``run()`` makes through attention.py."""
    _hopper_rules(parts)
    caught = []
    saved = A.launch_kernel
    A.launch_kernel = lambda kernel, grid, **kw: caught.append((kernel, grid, kw))
    try:
        with config.override(gluon=False, **overrides):
            run()
    finally:
        A.launch_kernel = saved
    return caught


def _qkv(D, DV=None, S=2048, B=2, H=8, H_kv=None, dtype=BF16):
    DV, H_kv = DV or D, H_kv or H
    return (torch.empty(B, S, H, D, dtype=dtype), torch.empty(B, S, H_kv, D, dtype=dtype),
            torch.empty(B, S, H_kv, DV, dtype=dtype))


def forward(D, DV=None, S=2048, mods=PLAIN[False], packing=None, dtype=BF16, parts=False,
            qkv=None, **overrides):
    """A case: a function that returns the launches of a forward of these inputs (``qkv``,
    else (B=2, S, H=8, D / DV) tensors); ``overrides``: flashop.config's."""
    q, k, v = qkv or _qkv(D, DV, S, dtype=dtype)
    return lambda: _caught(lambda: A.attention_forward(q, k, v, None, mods, packing), parts,
                           **overrides)


def backward(D, DV=None, S=2048, mods=PLAIN[False], packing=None, parts=False,
             mask_grad=False, deterministic=True, qkv=None, **overrides):
    """A case: the launches of a backward, as ``forward``'s."""
    q, k, v = qkv or _qkv(D, DV, S)
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    lse = torch.empty(q.shape[-2], q.shape[0]) if packing else torch.empty(
        q.shape[0], q.shape[2], q.shape[1])
    run = lambda: A.attention_backward(  # noqa: E731
        torch.empty_like(out), torch.zeros_like(lse), q, k, v, out, lse, None, mods, mask_grad,
        packing, deterministic)
    return lambda: _caught(run, parts, **overrides)


def _packed(D, lengths=(300, 1000, 77)):
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    qkv = tuple(torch.empty(total, 8, D, dtype=BF16) for _ in range(3))
    return qkv, Packing(cu, cu, max(lengths), max(lengths))


def _paged(D, page=64, batch=3, blocks=16):
    q = torch.empty(batch * 500, 8, D, dtype=BF16)
    k = torch.empty(batch * blocks, page, 8, D, dtype=BF16)
    cu_q = torch.tensor([0, 500, 1000, 1500], dtype=torch.int32)
    cu_k = torch.tensor([0, 700, 1400, 2100], dtype=torch.int32)
    table = torch.arange(batch * blocks, dtype=torch.int32).reshape(batch, blocks)
    return (q, k, torch.empty_like(k)), Packing(cu_q, cu_k, 500, 700, table)


def _fp8(D, S=2048, B=2, H=8, DV=None):
    f8 = torch.float8_e4m3fn
    v = torch.empty(B, H, DV or D, S, dtype=f8).permute(0, 3, 1, 2)  # keys-last, as read
    return (torch.empty(B, S, H, D, dtype=f8), torch.empty(B, S, H, D, dtype=f8), v)


def cases() -> dict:
    S, B, H = 2048, 2, 8
    seed = torch.zeros(1, dtype=torch.int64)
    mods = modifiers(causal=True, window_size_left=100, softcap=30.0,
                     alibi_slopes=torch.empty(H), g=torch.empty(B, S, H))
    chunk_sinks = modifiers(attention_chunk=256, sinks=torch.empty(H))
    bool_mask = modifiers(attn_mask=torch.empty(B, H, S, S, dtype=torch.bool))
    float_mask = modifiers(attn_mask=torch.empty(B, 1, S, S))
    dropout = modifiers(causal=True, dropout_p=0.1, dropout_seed=seed)
    # lengths, strides and bounds of 1 are constexprs in the compiled kernels (triton's
    # specialization): one query, one head (the gate's stride 1), a window of 1 either side
    one_query = (torch.empty(B, 1, H, 128, dtype=BF16), *_qkv(128, S=S)[1:])
    ones = modifiers(window_size_left=1, window_size_right=1, g=torch.empty(B, S, 1))
    packed_qkv, packing = _packed(128)
    paged_qkv, paged = _paged(128)
    return {
        "fwd D=64": forward(64),
        "fwd D=64 causal": forward(64, mods=PLAIN[True]),
        "fwd D=128": forward(128),
        "fwd D=128 causal S=4096": forward(128, S=4096, mods=PLAIN[True]),
        "fwd D=128 tma": forward(128, tma=True),
        "fwd D=192/128 parts causal": forward(192, 128, mods=PLAIN[True], parts=True),
        "fwd D=192/128 parts tma": forward(192, 128, parts=True, tma=True),
        "fwd D=128 window softcap alibi gate": forward(128, mods=mods),
        "fwd D=64 chunk sinks": forward(64, mods=chunk_sinks),
        "fwd D=128 bool mask": forward(128, mods=bool_mask),
        "fwd D=64 float mask": forward(64, mods=float_mask),
        "fwd D=128 dropout causal": forward(128, mods=dropout),
        "fwd D=128 packed causal": forward(128, mods=PLAIN[True], packing=packing,
                                           qkv=packed_qkv),
        "fwd D=128 paged": forward(128, mods=PLAIN[True], packing=paged, qkv=paged_qkv),
        "fwd D=128 fp8": forward(128, qkv=_fp8(128)),
        "fwd D=192/128 parts fp8 causal": forward(192, 128, mods=PLAIN[True], parts=True,
                                                  qkv=_fp8(192, DV=128)),
        "fwd D=128 one query causal": forward(128, mods=PLAIN[True], qkv=one_query),
        "fwd D=64 window 1 1 gate H=1": forward(64, mods=ones, qkv=_qkv(64, S=S, H=1)),
        "bwd D=64": backward(64),
        "bwd D=64 causal": backward(64, mods=PLAIN[True]),
        "bwd D=128 causal": backward(128, mods=PLAIN[True]),
        "bwd D=192/128 parts causal": backward(192, 128, mods=PLAIN[True], parts=True),
        "bwd D=192/128 parts": backward(192, 128, parts=True),
        "bwd D=128 dq atomics causal": backward(128, mods=PLAIN[True], deterministic=False,
                                                dq_atomics=True),
        "bwd D=192/128 parts dq atomics": backward(192, 128, parts=True, deterministic=False,
                                                   dq_atomics=True),
        "bwd D=128 window softcap alibi gate": backward(128, mods=mods),
        "bwd D=64 chunk": backward(64, mods=modifiers(attention_chunk=256)),
        "bwd D=64 float mask grad": backward(64, mods=float_mask, mask_grad=True),
        "bwd D=128 bool mask": backward(128, mods=bool_mask),
        "bwd D=128 dropout causal": backward(128, mods=dropout),
        "bwd D=128 packed causal": backward(128, mods=PLAIN[True], packing=packing,
                                           qkv=packed_qkv),
        "bwd D=128 one query causal": backward(128, mods=PLAIN[True], qkv=one_query),
        "bwd D=64 window 1 1 gate H=1": backward(64, mods=ones, qkv=_qkv(64, S=S, H=1)),
    }


# --- dump --------------------------------------------------------------------------------

_DEBUG_SECTION = re.compile(r"^\s*\.section\s+\.debug_\w+\s*\{.*?^\s*\}", re.M | re.S)


def clean_ptx(ptx: str) -> str:
    """PTX without its debug information: ``.loc`` and ``.file`` lines, ``.debug_*``
    sections, comments and blank lines."""
    ptx = _DEBUG_SECTION.sub("", ptx)
    lines = []
    for line in ptx.splitlines():
        line = re.sub(r"//.*", "", line).rstrip()
        if line.strip() and not re.match(r"\s*\.(loc|file)\b", line):
            lines.append(line)
    return "\n".join(lines) + "\n"


def sass(cubin: bytes) -> str:
    """The cubin's SASS as ``cuobjdump -sass`` prints it (less the lines naming its file)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        r = subprocess.run([C._CUOBJDUMP, "-sass", f.name], capture_output=True, text=True)
    return "\n".join(line for line in r.stdout.splitlines()
                     if f.name not in line) + "\n"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text).strip("_")


def dump(folder: str, only: str = "") -> bool:
    """Compile every launch of the cases whose names hold ``only`` and write each one's
    launch.json, resources.json, kernel.ptx and kernel.sass to a subfolder of ``folder``
    named after it; True if all compiled (compile_sm90.report prints a line each)."""
    os.makedirs(folder, exist_ok=True)
    ok = True
    for name, make in cases().items():
        if only not in name:
            continue
        for i, (kernel, grid, kw) in enumerate(make()):
            kname = getattr(kernel, "fn", kernel).__name__
            label = f"{name} #{i} {kname}"
            res = C.compile_kernel(kernel, grid, kw, label=label)
            ok &= C.report(res)
            if not res.ok and res.compiled is None:
                continue
            sub = os.path.join(folder, _slug(label))
            os.makedirs(sub, exist_ok=True)
            keys = ("n_regs", "spill_stores", "spill_loads", "stack", "shared", "threads")
            with open(os.path.join(sub, "resources.json"), "w") as f:
                json.dump({k: res.info.get(k) for k in keys}, f, indent=1)
            with open(os.path.join(sub, "launch.json"), "w") as f:  # its scalars, constexprs
                json.dump({k: v for k, v in kw.items()
                           if isinstance(v, (bool, int, float, str))}, f, indent=1)
            with open(os.path.join(sub, "kernel.ptx"), "w") as f:
                f.write(clean_ptx(res.compiled.asm["ptx"]))
            with open(os.path.join(sub, "kernel.sass"), "w") as f:
                f.write(sass(res.compiled.asm["cubin"]))
    return ok


# --- diff --------------------------------------------------------------------------------

def diff(before: str, after: str, context: int = 12) -> bool:
    """Compare two dumps' launches file by file, printing a line per launch and the first
    ``context`` lines of each difference; True if they are identical."""
    a, b = set(os.listdir(before)), set(os.listdir(after))
    same = True
    for gone in sorted(a ^ b):
        print(f"only in {'the first' if gone in a else 'the second'} dump: {gone}")
        same = False
    for launch in sorted(a & b):
        differs = False
        for fname in ("launch.json", "resources.json", "kernel.ptx", "kernel.sass"):
            with open(os.path.join(before, launch, fname)) as f:
                x = f.read()
            with open(os.path.join(after, launch, fname)) as f:
                y = f.read()
            if x != y:
                differs = True
                lines = list(difflib.unified_diff(x.splitlines(), y.splitlines(), "before",
                                                  "after", lineterm="", n=1))
                print(f"DIFF {launch} {fname}: {len(lines)} diff lines")
                print("\n".join("     " + line for line in lines[:context]))
        if differs:
            same = False
        else:
            with open(os.path.join(after, launch, "resources.json")) as f:
                r = json.load(f)
            print(f"same {launch}: regs {r['n_regs']}, spills {r['spill_stores']}/"
                  f"{r['spill_loads']} B, shared {r['shared']} B; PTX and SASS identical")
    print(f"{len(a & b)} launches compared: {'identical' if same else 'DIFFERENT'}")
    return same


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="compile the cases; write resources, PTX and SASS")
    d.add_argument("folder")
    d.add_argument("--only", default="", help="only the cases whose names hold this")
    c = sub.add_parser("diff", help="compare two dumps")
    c.add_argument("before")
    c.add_argument("after")
    args = ap.parse_args(argv)
    if args.cmd == "dump":
        return 0 if dump(args.folder, args.only) else 1
    return 0 if diff(args.before, args.after) else 1


if __name__ == "__main__":
    sys.exit(main())
