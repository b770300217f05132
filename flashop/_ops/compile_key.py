"""What torch.compile's caches must know of flashop's launchers.

A compiled graph holds the launches the launchers planned while it was traced (tiles, grid,
decode splits, which kernel, the kernels' code), and those plans follow more than the graph
shows: the switches (flashop.config), tiles forced by ``tiles.force`` and flashop's own code.
The AOTAutograd cache (torch's, on disk, shared by processes) keys a graph by its Dynamo
graph and by the source of the Triton kernels it finds in each ``triton_op``'s function, so
without more, a graph compiled under one switch or one release of flashop is served to a
compile under another (a decode split more or less gives a result one ulp off the eager
call's; an older kernel, the older kernel's result). ``register`` adds to every
flashop ``triton_op``'s kernels one kernel that is never launched, ``launch_environment``,
whose source, as torch reads it for the key, names that state. Where torch keeps no such
table (another torch release), registering does nothing.
"""

from __future__ import annotations

import hashlib
import pathlib
from typing import Optional

import torch
from triton.runtime.jit import JITFunction

from flashop._launch import calls
from flashop.kernels import INTERPRETING

_PACKAGE = pathlib.Path(__file__).resolve().parent.parent  # flashop/
_OP_PREFIX = "flashop::"
_digest: Optional[str] = None


def code_digest() -> str:
    """A digest of the package's Python source (kernels, launchers, ops; its version), read
    once. torch finds none of the kernels a flashop op launches (they sit below its search
    depth in the launchers), so their source is keyed here with the launchers'."""
    global _digest
    if _digest is None:
        h = hashlib.sha256()
        for path in sorted(_PACKAGE.glob("**/*.py")):
            h.update(str(path.relative_to(_PACKAGE)).encode())
            h.update(path.read_bytes())
        _digest = h.hexdigest()[:16]
    return _digest


def environment() -> str:
    """The state that a launch plan follows beyond the call's arguments, as one line: the
    code, and what the eager plans' keys hold of it (calls.environment)."""
    return (f"flashop code {code_digest()} interpreting {INTERPRETING} "
            f"launch environment {calls.environment()!r}")


def _never_launched():
    pass


class _LaunchEnvironment(JITFunction):
    """A Triton function never launched, whose ``src`` ends with a comment holding
    ``environment()`` at the moment it is read."""

    @property
    def src(self) -> str:
        return f"{self._src.rstrip()}\n    # {environment()}\n"


launch_environment = _LaunchEnvironment(_never_launched)


def register() -> list:  # torch<=2.13: its cache keys a triton_op by the kernels it finds
    """Add launch_environment to the Triton kernels torch keeps for each flashop
    ``triton_op`` (torch._library.triton.triton_ops_to_kernels, read by the AOTAutograd
    cache's key); returns the op names it was added to (none where torch keeps no such
    table, and under the interpreter, whose ops are plain custom ops)."""
    table = getattr(getattr(torch._library, "triton", None), "triton_ops_to_kernels", None)
    if not isinstance(table, dict):
        return []
    names = []
    for name, kernels in table.items():
        if name.startswith(_OP_PREFIX) and isinstance(kernels, list):
            if launch_environment not in kernels:
                kernels.append(launch_environment)
            names.append(name)
    return names

