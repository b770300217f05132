"""The eager fast path, in one place: which calls are eager (``is_direct``, ``is_traced``,
``eager_meta``), the kernels' launches (``launch_kernel``; ``launch_now`` and
``launch_planned`` launch Triton's compiled kernels directly under CACHED_LAUNCH_TRITON),
and plans: an operator body's tensor operations (allocations, fills, copies, views) and
launches for one signature of eager calls,
recorded on the signature's first call, which runs the body and its checks, and replayed on
later calls without them (``PlannedBody``).

A short eager call's host time is mostly Python: checks, the kernel's choice and its
arguments, and Triton's binding of them. A plan keeps what depends on the signature alone
(everything but the tensors' data), so a repeated call allocates its outputs and launches
(a Gluon kernel's host-made descriptors remade for its tensors).
"""

from __future__ import annotations

import functools
import operator
import threading
from typing import Callable, NamedTuple, Optional

import torch
import triton
from torch._library.triton import set_wrap_triton_enabled
from torch.library import wrap_triton
from torch.utils._python_dispatch import TorchDispatchMode

from flashop import config
from flashop.kernels import INTERPRETING

# --- which calls are eager --------------------------------------------------------------------

# the types of an eager call's tensors: plain tensors (a parameter is one to the dispatcher),
# not a tracer's stand-ins (fake, functional) or another subclass, whose shapes may be symbolic
EAGER_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def is_traced(x: torch.Tensor) -> bool:
    """Whether ``x`` is a tracer's stand-in (fake or functional tensor) rather than data, or
    torch.compile is tracing the call."""
    return type(x) not in EAGER_TENSOR_TYPES or torch.compiler.is_compiling()


def is_direct(q: torch.Tensor, *tensors: Optional[torch.Tensor]) -> bool:
    """Whether a call with ``q`` and these tensors takes the direct eager path (the
    operators' bodies run without the dispatcher): eager tensors (no subclass: fake,
    functional, DTensor, ...) with data (not on the meta device, whose calls the operators'
    fakes answer), nothing that must see the operator (a compiler or tracer, a dispatch
    mode, a functorch transform), and config.settings.direct_eager."""
    return (config.settings.direct_eager and not q.is_meta and type(q) in EAGER_TENSOR_TYPES
            and not torch.compiler.is_compiling()
            and all(t is None or type(t) in EAGER_TENSOR_TYPES for t in tensors)
            and not torch._C._len_torch_dispatch_stack()
            and not torch._C._are_functorch_transforms_active()
            and not torch._C._get_tracing_state())


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


def environment() -> tuple:
    """What the kernels' choice reads besides the call: flashop's switches
    (config.settings), the tiles forced for tuning (tiles.force), and
    torch.use_deterministic_algorithms' mode."""
    from flashop._launch import tiles  # (tiles imports common, which imports this module)

    return (tuple(vars(config.settings).values()), tiles.forced(),
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled())


# --- launches ---------------------------------------------------------------------------------

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
def _triton_allows_cached_launches() -> bool:
    return not INTERPRETING and triton_version() == CACHED_LAUNCH_TRITON


class _Launches:
    """One @triton.jit function's compiled kernels, by the specialisation of their calls."""

    def __init__(self, kernel):
        params = kernel.params
        self.names = tuple(p.name for p in params)
        self.defaults = tuple(p.default for p in params)
        self.compiled: dict = {}


class _Compiled(NamedTuple):
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


def _launches_kept() -> bool:
    """Whether launch_now may launch compiled kernels itself (see there), as far as the
    switch, the Triton release and its launch hooks go."""
    runtime = triton.knobs.runtime
    return (config.settings.cached_launch and _triton_allows_cached_launches()
            and not _hooked(runtime.launch_enter_hook)
            and not _hooked(runtime.launch_exit_hook))


def _cached_launches_allowed(kernel) -> bool:
    """Whether launch_now may launch ``kernel``'s compiled kernels itself (see there)."""
    return _launches_kept() and not kernel.pre_run_hooks


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
    recording = _active.recording
    if recording is not None:
        recording.launch(kernel, grid, kwargs)
    else:
        _launch_now(kernel, grid, kwargs)


def _launch_now(kernel, grid: tuple, kwargs: dict) -> Optional[_Compiled]:
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
            or _active.recording is not None):
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


def _launches(kernel) -> _Launches:
    launches = _LAUNCHES.get(id(kernel))  # (JITFunction's hash hashes its source)
    if launches is None:
        launches = _LAUNCHES[id(kernel)] = _Launches(kernel)
    return launches


def _launch_keyed(kernel, grid: tuple, kwargs: dict, values: tuple, key: Callable,
                  device) -> Optional[_Compiled]:
    """launch_now's cache: the compiled kernel kept under ``key()`` (a call's
    specialisation, equal keys for equal specialisations), launched directly; Triton's
    path (which compiles or finds it) for a key's first call. Returns the compiled kernel
    (None where Triton's path kept none)."""
    launches = _launches(kernel)
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
        entry = launches.compiled[_kept(key)] = _Compiled(compiled, order, arguments)
        return entry
    entry.run(tuple(grid) + (1,) * (3 - len(grid)),
              triton.runtime.driver.active.get_current_stream(device),
              entry.arguments(values + launches.defaults))
    return entry


# --- plans ------------------------------------------------------------------------------------

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


class _Active(threading.local):
    recording: Optional["_Recording"] = None


_active = _Active()


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
            compiled = _launch_now(kernel, grid, kwargs)
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
    arguments' dtypes and alignment (signature()), the allocations are the caching
    allocator's (aligned) and each view sits at its recorded offset from its base."""

    __slots__ = ("kernel", "grid", "names", "tensor_names", "take", "static", "compiled",
                 "template", "positions", "descriptors")

    @classmethod
    def make(cls, kernel, grid: tuple, kwargs: dict, compiled: Optional[_Compiled],
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
              static: dict, descriptors: tuple, compiled: Optional[_Compiled]) -> None:
        self.kernel, self.grid = kernel, grid + (1,) * (3 - len(grid))
        self.names, self.tensor_names, self.static = names, tensor_names, static
        self.take, self.descriptors = _getter(slots), descriptors
        self.compiled = self.template = self.positions = None
        if compiled is not None:
            self._keep(compiled)

    def _keep(self, compiled: _Compiled) -> None:
        """Keep ``compiled``, and the arguments' template (every argument in the signature's
        order, the tensors' places left for each call)."""
        n = len(self.names)
        values = [self.static.get(name) for name in self.names]
        values += _launches(self.kernel).defaults
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
        compiled = _launch_now(self.kernel, self.grid, self.arguments(values))
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
                  if device is not None and _launches_kept() else None)
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
    direct eager path, by plans: the first call of a signature (``key``: the arguments'
    signature(), the options by name, type and value, and the environment()) runs the body,
    its checks included, and records its plan; later calls of that signature replay the plan
    (no checks: they read the signature alone, which passed them). A body that computes
    anything besides allocations, fills, copies, views and launches (a gate's cumulative
    sum, a value read on the host), and every call while autotuning (its launches bypass
    launch_now), run the body each time. The body runs with wrap_triton off (the kernels
    launched as they are, as a triton_op's eager call does)."""

    def __init__(self, body: Callable):
        self.body = body
        self.plans: dict = {}
        functools.update_wrapper(self, body)
        _BODIES.append(self)

    def __call__(self, *args, **options):
        return self.run(self.key(args, options), args, options)

    @staticmethod
    def key(args: tuple, options: dict) -> Optional[Key]:
        return make_key((signature(args), tuple(options.items()),
                         tuple([v.__class__ for v in options.values()]), environment()))

    def run(self, key: Optional[Key], args: tuple, options: dict):
        """The body's call of ``args`` and ``options``, whose key (or one that tells apart
        at least as much) is ``key``; None (no key): the body."""
        plan = self.plans.get(key, _MISSING) if key is not None else None
        if plan is None or config.settings.autotune:
            return self._run(args, options)
        if plan is not _MISSING:
            return plan.replay(args)
        recording, outer = _Recording(), _active.recording
        _active.recording = recording
        try:
            with recording:
                result = self._run(args, options)
        finally:
            _active.recording = outer
        if len(self.plans) >= MAX_PLANS:
            self.plans.clear()
        self.plans[key] = recording.plan(args, result)
        return result

    def _run(self, args: tuple, options: dict):
        with set_wrap_triton_enabled(False):
            return self.body(*args, **options)
