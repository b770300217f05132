"""The scripts of examples/ run as a user runs them (a fresh process, the checkout's flashop),
at their smallest settings on the test device: each exits 0 and prints its check line."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import DEVICE

ROOT = Path(__file__).resolve().parent.parent


def run_example(script: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--device", DEVICE,
                           *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_train_autocast():
    pytest.importorskip("transformers")
    out = run_example("train_autocast.py", "--steps", "1", "--batch", "1", "--seq", "16")
    assert re.search(r"^check: flashop matches SDPA under bf16 autocast", out, re.MULTILINE), out
    assert len(re.findall(r"^  ok   ", out, re.MULTILINE)) == 5, out  # the loss, 4 gradients


def test_prefix_prefill():
    out = run_example("prefix_prefill.py", "--dtype", "bfloat16")
    assert re.search(r"^check: paged prefill with 3 shared pages matches the prompt run "
                     r"without a cache$", out, re.MULTILINE), out
    assert len(re.findall(r"^  ok   ", out, re.MULTILINE)) == 3, out
