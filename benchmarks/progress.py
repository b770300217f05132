"""A progress bar for the benchmarks' long loops: tqdm's where it is installed and stderr is
a terminal, otherwise a line per step on stderr with the time spent and an estimate of the
time left (readable in a log file, e.g. benchmarks/gpu_check.sh's).

    bar = progress(shapes, desc="grid", label=lambda s: f"D={s[0]} N={s[1]}")
    for shape in bar:              # the bar shows the label of the step that runs now
        bar.write("a result line")  # printed without breaking the bar
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Iterable, Optional

try:
    from tqdm.auto import tqdm
except ImportError:  # LineProgress below
    tqdm = None


class LineProgress:
    """The part of tqdm's interface the benchmarks use, as one stderr line per step."""

    def __init__(self, iterable: Iterable, total: Optional[int] = None, desc: str = "",
                 label: Optional[Callable] = None, file=None):
        self.iterable = iterable
        self.total = total if total is not None else _length(iterable)
        self.desc = desc
        self.label = label
        self.file = file
        self.n = 0

    def __iter__(self):
        start = time.perf_counter()
        for item in self.iterable:
            self.n += 1
            print(self.line(item, time.perf_counter() - start), file=self.file or sys.stderr,
                  flush=True)
            yield item

    def line(self, item, elapsed: float) -> str:
        """``desc: [n/total] label (elapsed s, ~left s left)`` for the step ``item``."""
        count = f"{self.n}/{self.total}" if self.total else str(self.n)
        left = ""
        if self.total and self.n > 1:
            left = f", ~{elapsed / (self.n - 1) * (self.total - self.n + 1):.0f} s left"
        label = f" {self.label(item)}" if self.label else ""
        return f"{self.desc}{': ' if self.desc else ''}[{count}]{label} ({elapsed:.0f} s{left})"

    def write(self, text: str) -> None:
        print(text, flush=True)


class _TqdmProgress:
    """tqdm's bar with the step's label as its postfix."""

    def __init__(self, iterable, total, desc, label):
        self.bar = tqdm(iterable, total=total, desc=desc, dynamic_ncols=True)
        self.label = label

    def __iter__(self):
        for item in self.bar:
            if self.label:
                self.bar.set_postfix_str(self.label(item))
            yield item

    def write(self, text: str) -> None:
        self.bar.write(text)


def _length(iterable) -> Optional[int]:
    try:
        return len(iterable)
    except TypeError:
        return None


def progress(iterable: Iterable, total: Optional[int] = None, desc: str = "",
             label: Optional[Callable] = None):
    """``iterable`` with a progress bar (tqdm's on a terminal, else LineProgress);
    ``label(item)`` names the step that runs. Print through the bar's ``write``."""
    if tqdm is not None and sys.stderr.isatty():
        return _TqdmProgress(iterable, total, desc, label)
    return LineProgress(iterable, total=total, desc=desc, label=label)
