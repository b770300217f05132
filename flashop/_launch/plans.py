"""Plans of eager calls: an operator body's tensor operations (allocations, fills, copies,
views) and launches for one signature of eager calls, recorded on the signature's first call,
which runs the body and its checks, and replayed on later calls without them
(``PlannedBody``).

A short eager call's host time is mostly Python: checks, the kernel's choice and its
arguments, and Triton's binding of them. A plan keeps what depends on the signature alone
(everything but the tensors' data), so a repeated call allocates its outputs and launches
(a Gluon kernel's host-made descriptors remade for its tensors).
"""

from __future__ import annotations

import functools
import operator
from typing import Callable, Optional

import torch
import triton
from torch._library.triton import set_wrap_triton_enabled
from torch.utils._python_dispatch import TorchDispatchMode

from flashop import config
from flashop._launch.calls import Key, plan_key
from flashop._launch.launches import (
    CompiledLaunch, kernel_launches, launch_and_keep, launches_kept, recorder,
)

_Tensor = torch.Tensor

_aten = torch.ops.aten
# the tensor operations a plan replays (each a function of its tensors' signatures and its
# other arguments alone, never of the tensors' values on the host's side): allocations,
# zeroed ones, fills and copies, and views, the first and the last replayed by their
# outputs' shape, strides, dtype and device (views: offset from their base's) by the
# fastest call that gives them (an OpOverload's Python call costs several times a tensor
# method's: _fast). Any other operation (a cumulative sum, a value read on the host, an
# output whose shape follows the data) leaves the body to run on every call.
_ALLOCATIONS = {_aten.empty.memory_format, _aten.empty_like.default, _aten.new_empty.default,
                _aten.empty_strided.default, _aten.new_empty_strided.default}
_ZEROED = {_aten.zeros.default, _aten.zeros_like.default, _aten.new_zeros.default}
_VIEWS = {_aten.detach.default, _aten.alias.default, _aten.view.default,
          _aten._unsafe_view.default, _aten.slice.Tensor, _aten.select.int,
          _aten.expand.default, _aten.as_strided.default, _aten.transpose.int,
          _aten.permute.default, _aten.t.default, _aten.unsqueeze.default, _aten.squeeze.dim}
_REPLAYABLE = _ALLOCATIONS | _ZEROED | _VIEWS | {
    _aten.full.default, _aten.new_full.default, _aten.zero_.default, _aten.fill_.Scalar,
    _aten.copy_.default, _aten.view.dtype}
# the types of the arguments a plan fixes (a Gluon descriptor is remade for each call's
# tensor: _PlannedLaunch)
_STATIC_TYPES = (int, float, str, type(None))
# the types of a replayed tensor operation's other arguments (lists of them too)
_OPERATION_STATIC_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device,
                           torch.layout, torch.memory_format)
MAX_PLANS = 1024


def _static(value) -> bool:
    """Whether a replayed operation may keep ``value`` as it is (no tensor in it)."""
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, _OPERATION_STATIC_TYPES) for v in value)
    return isinstance(value, _OPERATION_STATIC_TYPES)


class _Recording(TorchDispatchMode):
    """What an operator body does on its first call of a signature: its tensor operations
    (each with its arguments; whether any is outside _REPLAYABLE, which leaves the body
    unreplayable) and its launches (through launch_now / launch_planned), each with the
    compiled kernel it ran where one was kept, in order. The operations and launches run
    as usual, unwatched."""

    def __init__(self):
        super().__init__()
        # ("op", func, args, kwargs, out) or ("launch", ...), in order (holding every tensor
        # seen, whose ids then stay theirs while recording)
        self.steps: list = []
        self.other_operations = False
        self.launching = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.launching:
            if func in _REPLAYABLE and isinstance(out, _Tensor):
                self.steps.append(("op", func, args, kwargs, out))
            else:
                self.other_operations = True
        return out

    def launch(self, kernel, grid: tuple, kwargs: dict) -> None:
        self.launching = True
        try:
            compiled = launch_and_keep(kernel, grid, kwargs)
        finally:
            self.launching = False
        self.steps.append(("launch", kernel, tuple(grid), kwargs, compiled))

    def _folded(self, result) -> list:
        """The recorded steps, each view taken from the first tensor of its chain of views
        (a replayed view is that tensor's as_strided, whatever the views between), and the
        views that no later step and no output reads left out."""
        first = {}  # id(a view's output) -> the first tensor of its chain
        steps = []
        for step in self.steps:
            if step[0] == "op" and step[1] in _VIEWS:
                _, func, op_args, op_kwargs, out = step
                source = op_args[0]
                if isinstance(source, _Tensor) and out.dtype == source.dtype:
                    base = first.get(id(source), source)
                    if out is not base:
                        first[id(out)] = base
                    if base is not source:
                        step = ("op", func, (base, *op_args[1:]), op_kwargs, out)
            steps.append(step)
        read = {id(t) for t in result if isinstance(t, _Tensor)}
        for step in steps:
            values = step[2] if step[0] == "op" else step[3].values()
            for value in values:
                tensor = value.base if _rebases(value) else value
                if isinstance(tensor, _Tensor):
                    read.add(id(tensor))
        return [step for step in steps
                if not (step[0] == "op" and id(step[4]) in first and id(step[4]) not in read)]

    def plan(self, args: tuple, result) -> Optional["Plan"]:
        """The plan that replays the body's call of ``args`` that returned ``result``, or
        None where it cannot be replayed."""
        if self.other_operations or not isinstance(result, tuple):
            return None
        slots = {}  # id -> the slot of a replay's tensors: args, then the operations' outputs
        for i, a in enumerate(args):
            if isinstance(a, _Tensor):
                slots.setdefault(id(a), i)
        n_slots = len(args)
        steps = []
        for step in self._folded(result):
            if step[0] == "op":
                _, func, op_args, op_kwargs, out = step
                planned = _PlannedOperation.make(func, op_args, op_kwargs, out, slots)
                if planned is None:
                    return None
                if id(out) not in slots:  # (an in-place operation returns its input)
                    slots[id(out)] = n_slots
                    n_slots += 1
                    planned.keeps = True
                steps.append(planned)
            else:
                _, kernel, grid, kwargs, compiled = step
                launch = _PlannedLaunch.make(kernel, grid, kwargs, compiled, slots)
                if launch is None:
                    return None
                steps.append(launch)
        if any(not isinstance(t, _Tensor) or id(t) not in slots for t in result):
            return None
        first = next((a for a in args if isinstance(a, _Tensor)), None)
        device = first.device.index if first is not None and first.is_cuda else None
        return Plan(tuple(steps), tuple(slots[id(t)] for t in result), device)


def _getter(slots: tuple) -> Callable:
    """A function of a list that returns a tuple of its items at ``slots``."""
    if len(slots) == 1:
        return lambda items, i=slots[0]: (items[i],)
    return operator.itemgetter(*slots) if slots else (lambda items: ())


class _PlannedOperation:
    """One tensor operation of a plan: ``func`` with its recorded arguments, those that are
    tensors taken from the replay's slots (or, for allocations, fills, copies and views,
    the call that gives the same result fastest: ``fast``); its output appended to them
    (``keeps``) unless the operation works in place."""

    __slots__ = ("func", "template", "positions", "kwargs", "keeps", "fast")

    @classmethod
    def make(cls, func, args: tuple, kwargs: dict, out: _Tensor, slots: dict):
        template, positions = list(args), []
        for i, a in enumerate(args):
            if isinstance(a, _Tensor):
                if id(a) not in slots:
                    return None
                positions.append((i, slots[id(a)]))
                template[i] = None  # (a plan keeps no call's tensor alive)
            elif not _static(a):
                return None
        if not all(_static(v) for v in kwargs.values()):
            return None
        planned = object.__new__(cls)
        planned.func, planned.template, planned.kwargs = func, template, dict(kwargs)
        planned.positions, planned.keeps = tuple(positions), False
        planned.fast = _fast(func, args, kwargs, out, dict(positions))
        return planned

    def __call__(self, pool: list, stream=None) -> None:
        if self.fast is not None:
            out = self.fast(pool)
        else:
            args = self.template.copy()
            for i, slot in self.positions:
                args[i] = pool[slot]
            out = self.func(*args, **self.kwargs)
        if self.keeps:
            pool.append(out)


def _fast(func, args: tuple, kwargs: dict, out: _Tensor, slot_of: dict) -> Optional[Callable]:
    """A function of the replay's slots that gives what ``func(*args, **kwargs)`` gave
    (``out``) for tensors of the recorded signatures, by a faster call; None where there is
    none (the operation itself then)."""
    shape, stride, dtype, device = tuple(out.shape), out.stride(), out.dtype, out.device
    if func in _ALLOCATIONS:
        return lambda pool: torch.empty_strided(shape, stride, dtype=dtype, device=device)
    if func in _ZEROED:
        if out.is_contiguous():
            return lambda pool: torch.zeros(shape, dtype=dtype, device=device)
        return lambda pool: torch.empty_strided(shape, stride, dtype=dtype,
                                                device=device).zero_()
    first = slot_of.get(0)
    if first is None:
        return None
    if func is _aten.zero_.default and len(args) == 1 and not kwargs:
        return lambda pool: pool[first].zero_()
    if func is _aten.fill_.Scalar and len(args) == 2 and not kwargs:
        value = args[1]
        return lambda pool: pool[first].fill_(value)
    if func is _aten.copy_.default and len(args) == 2 and not kwargs and 1 in slot_of:
        source = slot_of[1]
        return lambda pool: pool[first].copy_(pool[source])
    if func in _VIEWS and out.dtype == args[0].dtype:
        offset = out.storage_offset() - args[0].storage_offset()
        return lambda pool: pool[first].as_strided(shape, stride,
                                                   pool[first].storage_offset() + offset)
    return None


def _rebases(value) -> bool:
    """Whether ``value`` is a host-made tensor descriptor that a plan can remake for another
    tensor of the same signature (``rebased``)."""
    return hasattr(value, "rebased") and isinstance(getattr(value, "base", None), _Tensor)


class _PlannedLaunch:
    """One launch of a plan: the kernel, its grid and fixed arguments, and the slots of its
    tensors (and of the tensors its descriptors describe, remade for each call); the kernel
    Triton compiled for it. What Triton specialises a tensor on (its dtype and whether its
    address is 16-byte aligned) is the same on every call of the plan: its key holds the
    arguments' dtypes and alignment (calls.signature), the allocations are the caching
    allocator's (aligned) and each view sits at its recorded offset from its base."""

    __slots__ = ("kernel", "grid", "names", "tensor_names", "take", "static", "compiled",
                 "template", "positions", "descriptors")

    @classmethod
    def make(cls, kernel, grid: tuple, kwargs: dict, compiled: Optional[CompiledLaunch],
             slots: dict):
        names, tensor_slots, static, descriptors = [], [], {}, []
        for name, value in kwargs.items():
            tensor = value.base if _rebases(value) else value
            if isinstance(tensor, _Tensor):
                if id(tensor) not in slots:
                    return None
                if tensor is not value:  # (its template holds no tensor)
                    descriptors.append((len(names), value.rebased(None)))
                names.append(name)
                tensor_slots.append(slots[id(tensor)])
            elif isinstance(value, _STATIC_TYPES):
                static[name] = value
            else:
                return None
        planned = object.__new__(cls)
        planned._init(kernel, tuple(grid), tuple(kwargs), tuple(names), tuple(tensor_slots),
                      static, tuple(descriptors), compiled)
        return planned

    def _init(self, kernel, grid: tuple, names: tuple, tensor_names: tuple, slots: tuple,
              static: dict, descriptors: tuple, compiled: Optional[CompiledLaunch]) -> None:
        self.kernel, self.grid = kernel, grid + (1,) * (3 - len(grid))
        self.names, self.tensor_names, self.static = names, tensor_names, static
        self.take, self.descriptors = _getter(slots), descriptors
        self.compiled = self.template = self.positions = None
        if compiled is not None:
            self._keep(compiled)

    def _keep(self, compiled: CompiledLaunch) -> None:
        """Keep ``compiled``, and the arguments' template (every argument in the signature's
        order, the tensors' places left for each call)."""
        n = len(self.names)
        values = [self.static.get(name) for name in self.names]
        values += kernel_launches(self.kernel).defaults
        self.template = [values[i] for i in compiled.order]
        where = {name: i for i, name in enumerate(self.names)}
        place = {i: p for p, i in enumerate(compiled.order) if i < n}
        self.positions = tuple(place[where[name]] for name in self.tensor_names)
        self.compiled = compiled

    def _values(self, pool: list):
        """This call's tensors and descriptors, in tensor_names' order."""
        values = self.take(pool)
        if self.descriptors:
            values = list(values)
            for i, descriptor in self.descriptors:
                values[i] = descriptor.rebased(values[i])
        return values

    def arguments(self, values) -> dict:
        """The launch's arguments by keyword, in the recorded order, with these values."""
        given = dict(zip(self.tensor_names, values), **self.static)
        return {name: given[name] for name in self.names}

    def __call__(self, pool: list, stream=None) -> None:
        """Launch with the tensors of ``pool``: where ``stream`` is given (launch_now's
        cached launches allowed), the kept compiled kernel directly on it; else (or where
        none is kept yet) launch_now's way."""
        values = self._values(pool)
        compiled = self.compiled
        if stream is not None and compiled is not None and not self.kernel.pre_run_hooks:
            args = self.template.copy()
            for p, t in zip(self.positions, values):
                args[p] = t
            compiled.run(self.grid, stream, args)
            return
        compiled = launch_and_keep(self.kernel, self.grid, self.arguments(values))
        if compiled is not None and self.compiled is None:
            self._keep(compiled)


class Plan:
    """An operator body's call of one signature as a replay: its tensor operations and
    launches (``steps``) run in order on this call's tensors (the arguments, then the
    operations' outputs, by slot); returns the tensors at the slots of its outputs; on
    ``device`` (a CUDA index; None off CUDA), as the launchers' common.on_inputs_device."""

    __slots__ = ("steps", "outputs", "device")

    def __init__(self, steps: tuple, outputs: tuple, device: Optional[int]):
        self.steps, self.outputs, self.device = steps, _getter(outputs), device

    def replay(self, args: tuple) -> tuple:
        device = self.device
        if device is not None and torch.cuda.current_device() != device:
            with torch.cuda.device(device):
                return self._replay(args, device)
        return self._replay(args, device)

    def _replay(self, args: tuple, device) -> tuple:
        pool = list(args)
        stream = (triton.runtime.driver.active.get_current_stream(device)
                  if device is not None and launches_kept() else None)
        for step in self.steps:
            step(pool, stream)
        return self.outputs(pool)


_MISSING = object()
_BODIES: list = []  # every PlannedBody


def clear_plans() -> None:
    """Forget every plan (the next call of each signature records its plan again)."""
    for body in _BODIES:
        body.plans.clear()


class PlannedBody:
    """An operator's body (``body(*args, **options)``: its checks, then a launcher) for the
    direct eager path, by plans: the first call of a signature (its key: calls.plan_key,
    the arguments' signatures, the options and the switches) runs the body, its checks
    included, and records its plan; later calls of that signature replay the plan (no
    checks: they read the signature alone, which passed them). A body that computes
    anything besides allocations, fills, copies, views and launches (a gate's cumulative
    sum, a value read on the host), and every call while autotuning (its launches bypass
    launch_now), run the body each time. The body runs with wrap_triton off (the kernels
    launched as they are, as a triton_op's eager call does). ``more_key``: a function of
    the arguments whose value the key holds too, where the body's checks or choices read
    more of its tensors than their signatures (whether one is a view of another's memory)."""

    def __init__(self, body: Callable, more_key: Optional[Callable] = None):
        self.body = body
        self.more_key = more_key
        self.plans: dict = {}
        functools.update_wrapper(self, body)
        _BODIES.append(self)

    def __call__(self, *args, **options):
        more = self.more_key(args) if self.more_key is not None else None
        return self.run(plan_key(args, options, more), args, options)

    def run(self, key: Optional[Key], args: tuple, options: dict):
        """The body's call of ``args`` and ``options``, whose key (calls.plan_key, or one
        that tells apart at least as much) is ``key``; None (no key): the body."""
        plan = self.plans.get(key, _MISSING) if key is not None else None
        if plan is None or config.settings.autotune:
            return self._run(args, options)
        if plan is not _MISSING:
            return plan.replay(args)
        recording, outer = _Recording(), recorder.recording
        recorder.recording = recording
        try:
            with recording:
                result = self._run(args, options)
        finally:
            recorder.recording = outer
        if len(self.plans) >= MAX_PLANS:
            self.plans.clear()
        self.plans[key] = recording.plan(args, result)
        return result

    def _run(self, args: tuple, options: dict):
        with set_wrap_triton_enabled(False):
            return self.body(*args, **options)
