"""The keys of eager calls' signatures: what the plans of the direct eager path
(flashop/_ops/eager.py, plans.py) and the decoding launchers' plans (kvcache.py, mla.py,
call_plan) hold of a call."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from flashop import config
from flashop._launch import tiles
from flashop._launch.common import EAGER_TENSOR_TYPES, tensor_meta

_Tensor = torch.Tensor


def eager_meta(*tensors: Optional[torch.Tensor]) -> Optional[tuple]:
    """Each tensor's (shape, strides, dtype, device) (common.TensorMeta's fields; None for
    None), where every tensor is a plain eager tensor (no fake, functional or other
    subclass, whose shapes may be symbolic); else None. The key of what is computed once per
    signature of eager calls."""
    metas = []
    for t in tensors:
        if t is None:
            metas.append(None)
        elif type(t) in EAGER_TENSOR_TYPES:
            metas.append((t.shape, t.stride(), t.dtype, t.device))
        else:
            return None
    return tuple(metas)


def call_plan(plans: Callable, tensors: tuple, options: tuple):
    """A decoding launcher's plan of a call of ``tensors`` and ``options``. ``plans``: the
    launcher's plan maker ``(metas, options) -> plan`` under functools.lru_cache. An eager
    call's plan is cached under its signature (eager_meta); a traced call's (its shapes may
    be symbolic) is made anew, uncached (``plans.__wrapped__``)."""
    metas = eager_meta(*tensors)
    if metas is None:
        return plans.__wrapped__(tuple(map(tensor_meta, tensors)), options)
    return plans(metas, options)


def signature(args: tuple) -> tuple:
    """What a plan's key holds of a call's positional arguments: each tensor's shape,
    strides, dtype, device and whether its address is 16-byte aligned (what the kernels'
    choice reads of it; Triton specialises on it too); None; every other argument by type
    and value; and, where one tensor is passed as two arguments, which (a plan binds the
    kernels' tensors to argument positions)."""
    key = []
    for a in args:
        if a is None:
            key.append(None)
        elif isinstance(a, _Tensor):
            key.append((a.shape, a.stride(), a.dtype, a.device, not a.data_ptr() & 15))
        else:
            key.append((a.__class__, a))
    shared = aliasing(args)
    if shared is not None:
        key.append(shared)
    return tuple(key)


def aliasing(args: tuple) -> Optional[tuple]:
    """Where one tensor is passed as several of ``args``, as signature() tells it: for each
    tensor argument, the index of its first occurrence among them; else None."""
    ids = [id(a) for a in args if isinstance(a, _Tensor)]
    if len(set(ids)) == len(ids):
        return None
    return tuple([ids.index(i) for i in ids])


class Key:
    """A plan's key (a tuple) whose hash is computed once: a key that holds another (a
    backward's holds its forward's) hashes it again for free."""

    __slots__ = ("parts", "_hash")

    def __init__(self, parts: tuple):
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (other.__class__ is Key and self._hash == other._hash
                                 and self.parts == other.parts)


def make_key(parts: tuple) -> Optional[Key]:
    """The Key of ``parts``; None where a part cannot be hashed (no plan then)."""
    try:
        return Key(parts)
    except TypeError:
        return None


def plan_key(args: tuple, options: dict, more=None) -> Optional[Key]:
    """The key of an operator body's plan for its call of ``args`` and ``options``
    (plans.PlannedBody): the arguments' signature(), the options by name, type and value,
    the environment(), and ``more``, what else of the tensors the body's checks or choices
    read (whether one is a view of another's memory); None where a part cannot be hashed."""
    return make_key((signature(args), tuple(options.items()),
                     tuple([v.__class__ for v in options.values()]), environment(), more))


def environment() -> tuple:
    """What the kernels' choice reads besides the call: flashop's switches
    (config.settings), the tiles forced for tuning (tiles.force), and
    torch.use_deterministic_algorithms' mode."""
    return (tuple(vars(config.settings).values()), tuple(tiles.FORCED.items()),
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled())
