"""The kernels' launches: ``launch_kernel`` (through ``torch.library.wrap_triton``, so that
a traced call records the launch in its graph), and for eager calls ``launch_now`` and
``launch_planned``, which launch the kernel Triton compiled for a call's specialisation
directly on later calls (under CACHED_LAUNCH_TRITON), skipping Triton's binding of the
arguments."""

from __future__ import annotations

import functools
import operator
import threading
from typing import Callable, NamedTuple, Optional

import torch
import triton
from torch.library import wrap_triton

from flashop import config
from flashop.kernels import INTERPRETING

# triton==3.6: JITFunction.run returns the CompiledKernel it launched, and CompiledKernel.run
# takes (grid x, y, z, stream, function, packed metadata, launch metadata, enter hook, exit
# hook, every argument in the signature's order), as the cached launches call it
CACHED_LAUNCH_TRITON = (3, 6)
# compiled kernels kept per @triton.jit function (a key holds the call's integer values: a
# workload of ever-new shapes starts the table again rather than growing it)
CACHED_LAUNCHES_PER_KERNEL = 1024


def triton_version() -> tuple:
    """The installed Triton's (major, minor) release."""
    return tuple(int(part) for part in triton.__version__.split(".")[:2])


@functools.lru_cache(maxsize=None)
def triton_allows_cached_launches() -> bool:
    return not INTERPRETING and triton_version() == CACHED_LAUNCH_TRITON


class _Launches:
    """One @triton.jit function's compiled kernels, by the specialisation of their calls."""

    def __init__(self, kernel):
        params = kernel.params
        self.names = tuple(p.name for p in params)
        self.defaults = tuple(p.default for p in params)
        self.compiled: dict = {}


class CompiledLaunch(NamedTuple):
    """A compiled kernel and where its signature's arguments come from: ``order[i]`` indexes
    (the call's values by keyword, then the kernel's defaults)."""

    kernel: object
    order: tuple
    arguments: Callable

    def run(self, grid: tuple, stream, args) -> None:
        self.kernel.run(grid[0], grid[1], grid[2], stream, self.kernel.function,
                        self.kernel.packed_metadata, None, None, None, *args)


_LAUNCHES: dict = {}  # id(kernel) -> _Launches; the kernels are module-level functions
_Tensor = torch.Tensor


class _Recorder(threading.local):
    """The plan being recorded in this thread (plans.PlannedBody), whose launches
    launch_now and launch_planned hand to it."""

    recording = None


recorder = _Recorder()


def _hooked(hook) -> bool:
    """Whether a launch hook is set (triton 3.6 keeps an empty chain of them when none is)."""
    return hook is not None and getattr(hook, "calls", True) != []


# the types of a call's values -> (the positions of its tensors, a getter of the others)
_SPLITS: dict = {}


def _split(types: tuple) -> tuple:
    split = _SPLITS.get(types)
    if split is None:
        tensors = tuple(i for i, t in enumerate(types) if issubclass(t, _Tensor))
        others = tuple(i for i in range(len(types)) if i not in tensors)
        getter = (operator.itemgetter(*others) if len(others) > 1
                  else (lambda values: (values[others[0]],)) if others
                  else (lambda values: ()))
        if len(_SPLITS) >= 4096:  # as many as the kernels' distinct argument lists
            _SPLITS.clear()
        split = _SPLITS[types] = (tensors, getter)
    return split


def _call_key(values: tuple) -> tuple:
    """What Triton specialises a call on, or finer: each tensor's dtype and whether its
    address is 16-byte aligned; every other argument (integers, floats, flags, strings,
    descriptors that define equality by dtype and block; Triton's options) by type and
    value. (The positions of the tensors are found once per list of types: a launch looks
    at its tensors alone.)"""
    types = tuple(map(type, values))
    tensors, others = _split(types)
    return (types, others(values),
            tuple([(values[i].dtype, not values[i].data_ptr() & 15) for i in tensors]))


def launch_kernel(kernel, grid: tuple, **kwargs) -> None:
    """Launch the @triton.jit ``kernel`` on ``grid`` with its arguments (and Triton's options,
    num_warps, num_stages) by keyword, through ``torch.library.wrap_triton``: where a graph
    is traced, the launch is recorded in it; otherwise launch_now launches it."""
    launcher = wrap_triton(kernel)
    if launcher is kernel:
        launch_now(kernel, grid, **kwargs)
    else:
        launcher[grid](**kwargs)


def launches_kept() -> bool:
    """Whether launch_now may launch compiled kernels itself (see there), as far as the
    switch, the Triton release and its launch hooks go."""
    runtime = triton.knobs.runtime
    return (config.settings.cached_launch and triton_allows_cached_launches()
            and not _hooked(runtime.launch_enter_hook)
            and not _hooked(runtime.launch_exit_hook))


def _cached_launches_allowed(kernel) -> bool:
    """Whether launch_now may launch ``kernel``'s compiled kernels itself (see there)."""
    return launches_kept() and not kernel.pre_run_hooks


def launch_now(kernel, grid: tuple, **kwargs) -> None:
    """Launch ``kernel`` eagerly, as ``kernel[grid](**kwargs)`` does, skipping Triton's
    binding of the arguments (tens of microseconds of host time per launch) where it can:
    the kernel that Triton compiled for a call is kept under the call's key (_call_key), and
    a later call of the same key launches it directly with the same arguments. Triton's own
    path serves the first call of each key, the interpreter, calls while a launch hook is
    set, Triton releases other than CACHED_LAUNCH_TRITON, and every call with
    ``FLASHOP_CACHED_LAUNCH=0``. (Triton's compile-time knobs, such as TRITON_DEBUG, are
    those in force at a key's first call.) A launch while a plan is recorded is also
    recorded (_Recording)."""
    recording = recorder.recording
    if recording is not None:
        recording.launch(kernel, grid, kwargs)
    else:
        launch_and_keep(kernel, grid, kwargs)


def launch_and_keep(kernel, grid: tuple, kwargs: dict) -> Optional[CompiledLaunch]:
    """launch_now's launch; the compiled kernel it launched, where it keeps one."""
    if not _cached_launches_allowed(kernel):
        kernel[grid](**kwargs)
        return None
    values = tuple(kwargs.values())
    device = triton.runtime.driver.active.get_current_device()
    return _launch_keyed(kernel, grid, kwargs, values,
                         lambda: (device, tuple(kwargs), _call_key(values)), device)


class Planned:
    """A launch whose grid and arguments but a few are fixed (a launch plan's): ``static``
    holds those arguments by name. Its key of Triton's specialisation on them is computed
    once, so that launch_planned keys a call by this object and the other arguments alone."""

    __slots__ = ("grid", "static", "_key", "_hash")

    def __init__(self, grid: tuple, static: dict):
        self.grid = grid
        self.static = static
        self._key = self._hash = None  # on first use (a traced plan's values may be symbolic)

    def key(self) -> tuple:
        if self._key is None:
            values = tuple(self.static.values())
            if any(isinstance(v, _Tensor) for v in values):
                raise TypeError("Planned: tensors are per-call arguments, not planned ones")
            self._key = (self.grid, tuple(self.static), _call_key(values))
            self._hash = hash(self._key)
        return self._key

    def __hash__(self) -> int:
        return self._hash if self._hash is not None else hash(self.key())

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Planned) and self.key() == other.key())

    def __repr__(self) -> str:
        return f"Planned(grid={self.grid}, static={self.static})"


def launch_planned(kernel, planned: Planned, **per_call) -> None:
    """launch_kernel(kernel, planned.grid, **per_call, **planned.static), where an eager
    call's key (launch_now's) is ``planned`` with the per-call arguments' alone: a plan's
    fixed arguments are not looked at again on each call."""
    kwargs = {**per_call, **planned.static}
    if (wrap_triton(kernel) is not kernel or not _cached_launches_allowed(kernel)
            or recorder.recording is not None):
        launch_kernel(kernel, planned.grid, **kwargs)
        return
    values = tuple(kwargs.values())
    device = triton.runtime.driver.active.get_current_device()
    _launch_keyed(kernel, planned.grid, kwargs, values,
                  lambda: (device, planned, tuple(per_call),
                           _call_key(values[:len(per_call)])), device)


def _kept(key):
    """``key`` as the launch cache keeps it: each part that holds a tensor (a host-made
    tensor descriptor holds its tensor) replaced by its equal that holds none
    (``launch_key()``), so that the cache keeps no call's tensors alive."""
    if isinstance(key, tuple):
        return tuple(_kept(part) for part in key)
    if isinstance(key, type):  # (a key holds its values' types too)
        return key
    launch_key = getattr(key, "launch_key", None)
    return key if launch_key is None else launch_key()


def kernel_launches(kernel) -> _Launches:
    launches = _LAUNCHES.get(id(kernel))  # (JITFunction's hash hashes its source)
    if launches is None:
        launches = _LAUNCHES[id(kernel)] = _Launches(kernel)
    return launches


def _launch_keyed(kernel, grid: tuple, kwargs: dict, values: tuple, key: Callable,
                  device) -> Optional[CompiledLaunch]:
    """launch_now's cache: the compiled kernel kept under ``key()`` (a call's
    specialisation, equal keys for equal specialisations), launched directly; Triton's
    path (which compiles or finds it) for a key's first call. Returns the compiled kernel
    (None where Triton's path kept none)."""
    launches = kernel_launches(kernel)
    try:
        key = key()
        entry = launches.compiled.get(key)
    except TypeError:  # an argument that cannot be hashed: Triton's path
        kernel[grid](**kwargs)
        return None
    if entry is None:
        compiled = kernel[grid](**kwargs)
        if not hasattr(compiled, "packed_metadata"):  # a pending compilation
            return None
        if len(launches.compiled) >= CACHED_LAUNCHES_PER_KERNEL:
            launches.compiled.clear()
        # the signature's arguments from (the call's values + the defaults)
        given = {name: i for i, name in enumerate(kwargs)}
        order = tuple(given.get(name, len(values) + i) for i, name in enumerate(launches.names))
        arguments = (operator.itemgetter(*order) if len(order) > 1
                     else lambda all_values: (all_values[order[0]],))
        entry = launches.compiled[_kept(key)] = CompiledLaunch(compiled, order, arguments)
        return entry
    entry.run(tuple(grid) + (1,) * (3 - len(grid)),
              triton.runtime.driver.active.get_current_stream(device),
              entry.arguments(values + launches.defaults))
    return entry
