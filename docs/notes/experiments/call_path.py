"""Where a call goes: the flashop files that one eager call of ``flashop.attention`` passes
through on its way to the first kernel launch, in the order the code runs them (issue "one
plan per call": stops, and stops back in a file already left).

A stop is a run of consecutive Python calls in one file of flashop/ (the kernels' own
@triton.jit bodies and the launch machinery after the first launch are not followed).

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


def path_of(call) -> list:
    """[(file, function)] of the flashop calls ``call()`` makes before its first launch."""
    events, launched = [], []

    def profile(frame, event, arg):
        if launched or event != "call":
            return
        name = frame.f_code.co_filename
        if name.startswith(ROOT) and "/kernels/" not in name:
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
    q = torch.randn(1, 64, 2, 64, device=device, dtype=torch.float16)
    plans.clear_plans()
    events = path_of(lambda: flashop.attention(q, q, q, causal=True))
    n, back, files = stops(events)
    if args.show:
        last = None
        for file, fn in events:
            print(("  " if file == last else f"{file}\n  ") + fn)
            last = file
    print(f"flashop.attention -> first launch: {n} stops in {files} files, {back} of them "
          f"back in a file already left ({len(events)} calls)")
    events = path_of(lambda: flashop.attention(q, q, q, causal=True))
    n, back, files = stops(events)
    print(f"the same call again (its plan replayed): {n} stops in {files} files, {back} of "
          f"them back in a file already left ({len(events)} calls)")


if __name__ == "__main__":
    main()
