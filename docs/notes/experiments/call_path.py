"""Where a call goes: the flashop files that one eager call of ``flashop.attention`` passes
through on its way to the first kernel launch, in the order the code runs them (issue "one
plan per call": stops, and stops back in a file already left).

A stop is a run of consecutive Python calls in one file of flashop/ (the kernels' own
@triton.jit bodies and the launch machinery after the first launch are not followed).
Counted twice: every flashop call, and only the calls that take q itself among their
arguments (q's way, as the issue counts it: helpers that never see q, such as a rule's
``decline`` or ``cdiv``, are not stops of q's).

    TRITON_INTERPRET=1 python docs/notes/experiments/call_path.py [--show]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
import flashop  # noqa: E402
from flashop._launch import plans  # noqa: E402

ROOT = os.path.dirname(flashop.__file__)


def _takes(frame, x) -> bool:
    """Whether the called frame's arguments hold ``x`` (directly, or in a tuple or list)."""
    code = frame.f_code
    n = code.co_argcount + code.co_kwonlyargcount
    args = [frame.f_locals.get(name) for name in code.co_varnames[:n]]
    if code.co_flags & 0x04:  # *args
        args += list(frame.f_locals.get(code.co_varnames[n], ()))
    return any(a is x or (isinstance(a, (tuple, list)) and any(b is x for b in a))
               for a in args)


def path_of(call, follow=None) -> list:
    """[(file, function)] of the flashop calls ``call()`` makes before its first launch
    (with ``follow``, those that take it as an argument)."""
    events, launched = [], []

    def profile(frame, event, arg):
        if launched or event != "call":
            return
        name = frame.f_code.co_filename
        if name.startswith(ROOT) and "/kernels/" not in name:
            if follow is None or _takes(frame, follow):
                events.append((os.path.relpath(name, ROOT), frame.f_code.co_name))
            if frame.f_code.co_name in ("launch_now", "launch_planned", "replay"):
                launched.append(True)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return events


def stops(events: list) -> tuple:
    """(stops, stops back in a file already left, files)."""
    runs = []
    for file, _ in events:
        if not runs or runs[-1] != file:
            runs.append(file)
    back = sum(1 for i, f in enumerate(runs) if f in runs[:i])
    return len(runs), back, len(set(runs))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--show", action="store_true", help="print each stop")
    args = ap.parse_args()
    device = "cpu" if flashop.INTERPRETING else "cuda"
    q, k, v = (torch.randn(1, 64, 2, 64, device=device, dtype=torch.float16)
               for _ in range(3))
    for follow in (None, q):
        plans.clear_plans()
        events = path_of(lambda: flashop.attention(q, k, v, causal=True), follow)
        n, back, files = stops(events)
        if args.show:
            last = None
            for file, fn in events:
                print(("  " if file == last else f"{file}\n  ") + fn)
                last = file
        what = "every call" if follow is None else "q's way"
        print(f"{what}: flashop.attention -> first launch: {n} stops in {files} files, "
              f"{back} of them back in a file already left ({len(events)} calls)")
        events = path_of(lambda: flashop.attention(q, k, v, causal=True), follow)
        n, back, files = stops(events)
        print(f"{what}: the same call again (its plan replayed): {n} stops in {files} files, "
              f"{back} of them back in a file already left ({len(events)} calls)")


if __name__ == "__main__":
    main()
