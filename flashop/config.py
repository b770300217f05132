"""flashop's switches: the ``FLASHOP_*`` environment variables, read once when flashop is
imported, and a context manager that changes them for a block of code.

Each switch is read by the launchers when a call is launched, and under ``torch.compile``
when the call is traced: a compiled graph keeps the choice it saw. Change a switch before
compiling (``torch._dynamo.reset()`` drops graphs compiled earlier; torch's on-disk
compile cache keys a graph by the switches too, flashop/_ops/compile_key.py).

| variable | attribute | default | what it does |
| --- | --- | --- | --- |
| ``FLASHOP_AUTOTUNE=1`` | ``autotune`` | off | time the tile candidates on each kernel's first call per key instead of the tile table |
| ``FLASHOP_TMA=0/1`` | ``tma`` | rule | the ``tl`` kernels' loop tiles through tensor descriptors (the forward's keys and values, the backward's too, MLA decode's cache rows): never / wherever aligned; unset: head dims above 128 over 4096+ keys on Hopper (the backward: not where the head dim is in two tiles), MLA decode at 64 query rows per program on Hopper |
| ``FLASHOP_WS=0/1`` | ``warp_specialize`` | rule | the warp-specialized plain forward: never / wherever the inputs allow; unset: Hopper, 64 < D <= 128 |
| ``FLASHOP_GLUON=0/1`` | ``gluon`` | rule | the Gluon forward, backward and MLA decode (Hopper, triton 3.6, eager and compiled calls, not exported ones; the forward at D=64, 128 and 256 and at D=192 with DV=128, the backward at D=64 and 128, MLA's latent cache at 64 query rows per program: multiples of 64 heads, or H * S_q a multiple of 64 where H divides 64): never / wherever the inputs allow; unset: README.md's rule (the forward from 1024 queries over 1024+ keys at D=128, 192 and 256, at D=64 over 2048+, causal 4096+; the backward with dQ by atomics over 2048+ keys; the MLA decode wherever its inputs allow); ``0`` also keeps the dQ-by-atomics backward on the ``tl`` kernels |
| ``FLASHOP_DQ_ATOMICS=0/1`` | ``dq_atomics`` | rule | the backward's dQ: never by fp32 atomics (every backward bitwise reproducible) / by atomics wherever the kernels allow (the Gluon backward at D=64 and 128 on Hopper with triton 3.6, elsewhere the ``tl`` kernels' atomic variant); unset: by atomics where that measured faster (the Gluon backward over 2048+ keys). Never under ``torch.use_deterministic_algorithms`` or ``deterministic=True`` |
| ``FLASHOP_DIRECT_EAGER=0`` | ``direct_eager`` | on | eager calls of ``attention`` / ``attention_with_lse`` go through the dispatcher like traced ones |
| ``FLASHOP_CACHED_LAUNCH=0`` | ``cached_launch`` | on | eager launches go through Triton's argument binding every time (on, with triton 3.6: a kernel compiled for a call's specialisation is launched directly on later calls of it) |
| ``FLASHOP_CPU_PATH=1`` | ``cpu_path`` | off | under Triton's interpreter (``TRITON_INTERPRET=1``) CPU tensors run the CPU path (PyTorch's CPU kernels, flashop/_launch/cpu) instead of the Triton kernels; without the interpreter they always do |
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Iterator, Optional


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value in (None, "") else value == "1"


def _tristate(name: str) -> Optional[bool]:
    """'1' -> True, '0' -> False, unset -> None (the launcher's default rule)."""
    return {"1": True, "0": False}.get(os.environ.get(name, ""))


@dataclasses.dataclass
class Settings:
    """The switches in force (see the module's table)."""

    autotune: bool = False
    tma: Optional[bool] = None
    warp_specialize: Optional[bool] = None
    gluon: Optional[bool] = None
    dq_atomics: Optional[bool] = None
    direct_eager: bool = True
    cached_launch: bool = True
    cpu_path: bool = False

    @classmethod
    def from_environment(cls) -> "Settings":
        return cls(autotune=_flag("FLASHOP_AUTOTUNE", False), tma=_tristate("FLASHOP_TMA"),
                   warp_specialize=_tristate("FLASHOP_WS"), gluon=_tristate("FLASHOP_GLUON"),
                   dq_atomics=_tristate("FLASHOP_DQ_ATOMICS"),
                   direct_eager=_flag("FLASHOP_DIRECT_EAGER", True),
                   cached_launch=_flag("FLASHOP_CACHED_LAUNCH", True),
                   cpu_path=_flag("FLASHOP_CPU_PATH", False))


settings = Settings.from_environment()


@contextlib.contextmanager
def override(**changes) -> Iterator[Settings]:
    """Change switches for the block, restoring them after it (also on error)::

        with flashop.config.override(tma=False, dq_atomics=True):
            ...
    """
    unknown = set(changes) - {f.name for f in dataclasses.fields(Settings)}
    if unknown:
        names = ", ".join(f.name for f in dataclasses.fields(Settings))
        raise TypeError(f"flashop.config.override: unknown switch(es) {sorted(unknown)}; "
                        f"the switches are {names}")
    saved = dataclasses.replace(settings)
    try:
        for name, value in changes.items():
            setattr(settings, name, value)
        yield settings
    finally:
        for field in dataclasses.fields(Settings):
            setattr(settings, field.name, getattr(saved, field.name))
