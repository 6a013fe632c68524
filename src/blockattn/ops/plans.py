"""Call plans: the GPU work of one eager call, recorded once per argument signature and replayed.

A small batch's call costs more host time than its kernels take on the GPU (docs/benchmarks.md, "Host latency"):
the dispatcher, the launchers' ~50 keyword arguments, host tensor descriptors and Triton's launch key, on every
call. Yet what the launchers decide depends on the arguments' metadata alone (shapes, strides, dtypes, devices,
16-byte alignment, the Python values of the other arguments): the library never reads a tensor's values on the
host. A second call with the same metadata does the same work on other pointers. A model's layers run on the same
shapes one after another, and so do a serving loop's calls on one batch.

:func:`planned` wraps an op's implementation. The first call of a signature runs it as it is; the second runs it
under a recorder that sees every ATen op (a ``TorchDispatchMode``) and every kernel launch (``launch.launch``) and
keeps them as a plan: allocations, in-place fills, views and device-side assertions with their tensor arguments
named by where they came from (an argument of the call, or an earlier step's result), and launches of the compiled
kernels with their argument lists. Later calls of the signature replay the plan: the same allocations, the same
launches on the new tensors (by ``cuLaunchKernel`` on a parameter buffer kept with the plan, where
``launch.DirectLaunch`` can build one). A call that runs anything else (an ATen op that computes, a kernel launched
through Triton's interpreter, a tensor whose origin the recorder cannot name) gets no plan and always runs as it is.

Planning stays off where the implementation's ATen ops are what someone watches (a dispatch mode is active), and
for tensor subclasses. Plans are kept per function, for the :data:`MAX_PLANS` signatures used last.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..signatures import TENSORS as _TENSORS
from ..signatures import Signature
from . import launch as launches

MAX_PLANS = 256
_aten = torch.ops.aten
# What a plan may replay besides launches: allocations, fills, views, device-side assertions. Nothing that reads
# a tensor's values on the host, draws random numbers or computes (a computing op would be a kernel this library
# does not own, and its time is not what plans save).
_REPLAYABLE = {
    _aten.empty, _aten.empty_strided, _aten.empty_like, _aten.new_empty, _aten.new_empty_strided, _aten.zeros,
    _aten.zeros_like, _aten.new_zeros, _aten.full, _aten.fill_, _aten.zero_, _aten.view, _aten._unsafe_view,
    _aten.slice, _aten.select, _aten.permute, _aten.transpose, _aten.t, _aten.unsqueeze, _aten.squeeze,
    _aten.expand, _aten.alias, _aten.detach, _aten._assert_async,
}
# Overloads replayed by the public function that binds to them (same schema, so the recorded arguments fit): an
# allocation through ``torch.empty`` takes ~1 µs where its OpOverload takes ~4 (a 2-core CPU; ~3x that on an
# H100's host).
_BY_PUBLIC_FUNCTION = {
    _aten.empty.memory_format: torch.empty, _aten.empty_strided.default: torch.empty_strided,
    _aten.empty_like.default: torch.empty_like, _aten.zeros.default: torch.zeros,
    _aten.zeros_like.default: torch.zeros_like, _aten.full.default: torch.full,
    _aten.new_empty.default: torch.Tensor.new_empty, _aten.new_zeros.default: torch.Tensor.new_zeros,
    _aten.view.default: torch.Tensor.view, _aten._assert_async.msg: torch._assert_async,
}


class _Unplannable(Exception):
    """The recorded call did something a plan cannot replay."""


class _Slot(int):
    """In a recorded argument list, ``slots[i]``: the call's arguments first, then every tensor result of the
    recorded ATen ops in order."""


class NoPlan(str):
    """A signature whose call cannot be replayed, and why (for tests and debugging)."""


def _filler(values) -> Callable[[list], list]:
    """``fill(slots)``: ``values`` with every ``_Slot`` replaced by ``slots[slot]``, the slots' positions found once
    (a launch passes ~50 values, a few of them tensors)."""
    template = list(values)
    positions = tuple((i, v) for i, v in enumerate(values) if type(v) is _Slot)

    def fill(slots: list) -> list:
        filled = template.copy()
        for i, slot in positions:
            filled[i] = slots[slot]
        return filled
    return fill


class _Recorder(TorchDispatchMode):
    """Records one call's ATen ops and kernel launches as replayable steps."""

    def __init__(self, args: tuple):
        super().__init__()
        self.steps: list[Callable[[list], None]] = []
        self.slots = len(args)
        self.slot_of = {id(a): _Slot(i) for i, a in reversed(list(enumerate(args))) if type(a) in _TENSORS}
        # A result's id is named while the tensor lives (a weak reference drops it; holding the tensor itself would
        # make PyTorch return a detached alias and add a step).
        self.results: list[weakref.ref] = []
        self.failure: str | None = None

    def _named(self, values) -> tuple:
        """``values`` with tensors replaced by their slots; nested tensors and tensors of unknown origin (a cached
        constant, say) raise."""
        named = []
        for value in values:
            if isinstance(value, torch.Tensor):
                slot = self.slot_of.get(id(value))
                if slot is None:
                    raise _Unplannable("reads a tensor that is neither an argument nor made by the call")
                value = slot
            elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
                raise _Unplannable("passes a list of tensors")
            named.append(value)
        return tuple(named)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.failure is None:
            try:
                if func.overloadpacket not in _REPLAYABLE:
                    raise _Unplannable(f"runs {func}")
                if any(t not in _TENSORS for t in types):
                    raise _Unplannable("takes a tensor subclass")
                if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
                    raise _Unplannable(f"passes a tensor by keyword to {func}")
                self.steps.append(_op_step(func, self._named(args), kwargs))
                for leaf in tree_flatten(result)[0]:
                    if isinstance(leaf, torch.Tensor):  # in place ops return their input: its first slot stays
                        if id(leaf) not in self.slot_of:
                            self.slot_of[id(leaf)] = slot = _Slot(self.slots)
                            self.results.append(weakref.ref(leaf, functools.partial(self._died, id(leaf), slot)))
                        self.slots += 1
            except _Unplannable as error:
                self.failure = str(error)
        return result

    def _died(self, key: int, slot: _Slot, _ref) -> None:
        if self.slot_of.get(key) == slot:
            del self.slot_of[key]

    def launched(self, runner: Callable, values: tuple, device: int | None, direct: Callable | None = None) -> None:
        """``launch.launch`` launched ``runner(*values)`` on the current stream; ``device`` where host tensor
        descriptors need its context current (``launch.ensure_context``); ``direct(named_values, is_slot,
        descriptors)`` builds the launch's ``launch.DirectLaunch`` (or None), which replays it where one can be
        built."""
        if self.failure is not None:
            return
        try:
            descriptors = tuple((i, self._named((v.base,))[0], _without_base(v)) for i, v in enumerate(values)
                                if isinstance(v, launches.TensorDescriptor))
            named = self._named(None if isinstance(v, launches.TensorDescriptor) else v for v in values)
            through_triton = _launch_step(runner, named, descriptors, device)
            fast = None if direct is None else direct(named, is_slot=lambda v: type(v) is _Slot,
                                                      descriptors={i: (base, d) for i, base, d in descriptors})
            self.steps.append(through_triton if fast is None else _direct_step(fast, through_triton))
        except _Unplannable as error:
            self.failure = str(error)

    def refuse(self, why: str) -> None:
        """Something in the call a plan cannot replay (``launch.not_replayable``: a launch in Triton's interpreter, an
        argument ``launch`` cannot key, Triton's per-thread allocator)."""
        if self.failure is None:
            self.failure = why


def _without_base(descriptor):
    """A copy of ``descriptor`` that holds no tensor (a plan must not keep the recorded call's memory alive)."""
    return _on_base(descriptor, None)


def _on_base(descriptor, base):
    """A copy of the host descriptor (a dataclass) on another base, without its construction's checks (the base's
    shape, strides, dtype and alignment are the recorded one's: the signature's). ``copy.copy`` took ~4 µs; it
    stays for a descriptor class without a ``__dict__``."""
    if hasattr(descriptor, "__dict__"):
        clone = object.__new__(descriptor.__class__)
        clone.__dict__.update(descriptor.__dict__)
    else:
        clone = copy.copy(descriptor)
    clone.base = base
    return clone


def _op_step(func, args: tuple, kwargs: dict) -> Callable[[list], None]:
    """Runs ``func`` on ``args`` with their slots filled in; its tensor results go to the next slots."""
    fill = _filler(args)
    func = _BY_PUBLIC_FUNCTION.get(func, func)

    def step(slots: list) -> None:
        result = func(*fill(slots), **kwargs)
        if isinstance(result, torch.Tensor):
            slots.append(result)
        else:
            slots.extend(leaf for leaf in tree_flatten(result)[0] if isinstance(leaf, torch.Tensor))
    return step


def _launch_step(runner: Callable, values: tuple, descriptors: tuple, device: int | None) -> Callable[[list], None]:
    """Launches ``runner`` on ``values`` with their slots filled in. A host tensor descriptor is the recorded one
    on the new base (its shape, strides and block are the signature's)."""
    fill = _filler(values)

    def step(slots: list) -> None:
        filled = fill(slots)
        for i, base, recorded in descriptors:
            filled[i] = _on_base(recorded, slots[base])
        if device is not None:
            launches.ensure_context(device)
        runner(*filled)
    return step


def _direct_step(direct: launches.DirectLaunch, through_triton: Callable[[list], None]) -> Callable[[list], None]:
    """Launches by ``direct`` on the tensors of the slots (by ``through_triton``, the same launch as a
    :func:`_launch_step`, while a Triton launch hook is installed)."""
    def step(slots: list) -> None:
        direct(slots, lambda: through_triton(slots))
    step.direct = direct  # for tests
    return step


class Plan:
    """One signature's recorded steps, and the call's result with slots for its tensors: its leaves and their
    pytree ``spec``, or, for a flat tuple (the ops' results; ``tree_unflatten`` took 3-5 µs of a replay on an
    H200's host), the tuple itself (``spec`` None). ``backward_plans``: the plans of the backward of calls that
    replayed this (a forward's) plan, kept by ``custom_ops``."""

    def __init__(self, steps: list, result: list, spec):
        self.steps = steps
        self.result = _filler(result)
        self.spec = spec
        self.backward_plans: dict = {}

    def __call__(self, args: tuple):
        slots = list(args)
        for step in self.steps:
            step(slots)
        if self.spec is None:
            return tuple(self.result(slots))
        return tree_unflatten(self.result(slots), self.spec)


# The current CUDA device (the index alone: ``torch.cuda.current_device`` costs ~1 µs more); planned calls are on a
# GPU, so CUDA is initialised.
current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
# What the implementation's host-side decisions may depend on: every argument's type, the tensors' shapes, strides,
# dtypes, devices and 16-byte alignment, which arguments are one tensor, the other values, and the current device
# (whose stream the kernels go to). A tensor subclass raises ``TypeError``.
_signature = Signature("({t}.shape, {t}.stride(), {t}.dtype, {t}.get_device(), {t}.data_ptr() & 15)",
                       current_device)


_UNSEEN, _SEEN_ONCE = object(), object()
_EVERY_CACHE: list[dict] = []


def forget() -> None:
    """Drop every plan: the next calls run the implementations again (tests that patch what the implementations
    do, a dispatcher table or an allocation, call it first)."""
    for plans in _EVERY_CACHE:
        plans.clear()


def forget_with_plans(cache: dict) -> None:
    """Have :func:`forget` clear ``cache`` too (a cache of what replays plans: ``call_cache``)."""
    _EVERY_CACHE.append(cache)


def planned(fn: Callable) -> Callable:
    """``fn`` (an op implementation on flat arguments: tensors and Python values) with its work replayed from a plan
    on the GPU once a signature repeats (the module's docstring)."""
    plans: OrderedDict = OrderedDict()  # least recently used first
    _EVERY_CACHE.append(plans)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if kwargs or not _plannable(args):
            return fn(*args, **kwargs)
        try:
            key = _signature(args)
            plan = plans.get(key, _UNSEEN)
        except TypeError:  # an unhashable argument, or a tensor subclass
            return fn(*args)
        if isinstance(plan, Plan):
            plans.move_to_end(key)
            return plan(args)
        if plan is not _SEEN_ONCE:  # unseen, or no plan
            if plan is _UNSEEN:
                if len(plans) >= MAX_PLANS:
                    plans.popitem(last=False)
                plans[key] = _SEEN_ONCE
            return fn(*args)
        result, plans[key] = _record(fn, args)
        return result

    def plan_of(args: tuple) -> Plan | NoPlan | None:
        """What ``call(*args)`` replays: its signature's plan, a ``NoPlan`` where it never replays one, or None while
        none is recorded yet (for a caller that looks the plan up once and replays it itself: ``call_cache``)."""
        if not _plannable(args):
            return NoPlan("not planned")
        try:
            plan = plans.get(_signature(args))
        except TypeError:
            return NoPlan("no signature")
        return plan if isinstance(plan, (Plan, NoPlan)) else None

    call.plans = plans  # for tests
    call.plan_of = plan_of
    return call


def _plannable(args: tuple) -> bool:
    """Whether a call on ``args`` may replay a plan: on a GPU, while no dispatch mode watches its ATen ops."""
    return bool(args) and type(args[0]) in _TENSORS and args[0].is_cuda and not torch._C._len_torch_dispatch_stack()


def _record(fn: Callable, args: tuple):
    """``(fn(*args), its plan or a NoPlan)``."""
    recorder = _Recorder(args)
    launches.RECORDING.recorder = recorder
    try:
        with recorder:
            result = fn(*args)
    finally:
        launches.RECORDING.recorder = None
    if recorder.failure is not None:
        return result, NoPlan(recorder.failure)
    flat = type(result) is tuple and not any(isinstance(value, (list, tuple, dict)) for value in result)
    leaves, spec = (result, None) if flat else tree_flatten(result)
    try:
        named = recorder._named(leaves)
    except _Unplannable as error:
        return result, NoPlan(f"returns what it {error}")
    return result, Plan(recorder.steps, list(named), spec)
