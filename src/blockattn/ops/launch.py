"""Kernel launches without Triton's per-call argument binding: what a small batch pays on the host.

``kernel[grid](**kwargs)`` costs 40–75 µs of host time per launch for our kernels of ~50 arguments (an H100's
shared host, triton 3.6, docs/benchmarks.md): Triton binds every argument, derives its specialisation (dtype and
16-byte alignment of pointers; 16-divisibility, value 1 and width of integers), builds a cache key from them and
checks the kernel's globals, before the launch itself. :func:`launch` derives a key that determines that
specialisation from the arguments directly (the same properties, never fewer) and launches the compiled kernel of a
key it has seen; an unseen key goes through ``kernel[grid]`` once, which compiles or finds the kernel.

The key is computed by a function generated once per kernel (as Triton generates its binder), one expression per
parameter for the kind of argument the launchers pass there (a tensor, an int, a constexpr...): no loop and no
call per argument on the hot path. An argument of another kind than the one the function was made for makes it
raise, and that launch goes through Triton.

Off the GPU (Triton's interpreter) and for argument types it does not know, it is ``kernel[grid](**kwargs)``.

A call plan's replay (``plans``) goes one step further where it can (:class:`DirectLaunch`): one
``cuLaunchKernel`` on a parameter buffer built when the plan was recorded, of which only the tensor addresses (and
the host tensor descriptors' maps, encoded on them) change at each replay, instead of Triton's runner.

Every kernel of the library is launched here: a call being recorded as a plan (``plans``) learns of its launches
from this function alone.

A kernel the GPU cannot run (Triton's ``OutOfResources`` at its first launch: more shared memory than a program may
take, which depends on the GPU and on Triton's version) raises again at once at every launch of its key, and
:func:`launch_fitting` runs a launcher's leaner configuration instead.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import functools
import operator
import struct
import threading
from collections.abc import Callable, Iterable

import torch
import triton.language as tl
from triton import knobs
from triton.runtime.errors import OutOfResources
from triton.runtime.jit import JITFunction

try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a triton without Gluon's Hopper API: no kernel takes descriptors then
    TensorDescriptor = ()

_INT32 = range(-(2**31), 2**31)
_LOCK = threading.Lock()
_DESCRIPTOR_FIELDS: dict[type, tuple[str, ...]] = {}
# ``recorder``: the recorder (``plans``) of the call this thread is recording, to which every launch reports.
RECORDING = threading.local()


class _Uncached(Exception):
    """An argument whose specialisation :func:`_key_of` cannot tell: launch through Triton."""


def _uncached(value):
    raise _Uncached(type(value).__name__)


def _key_of(value, constexpr: bool):
    """What of ``value`` Triton's specialisation may depend on (at least; finer is only a smaller cache's loss)."""
    if constexpr or value is None or isinstance(value, (str, tl.constexpr)):
        return value
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return bool, value
    if isinstance(value, int):
        return int, value == 1, value % 16 == 0, value in _INT32, value < 2**63
    if isinstance(value, float):
        return float
    if isinstance(value, TensorDescriptor):
        return _descriptor_key(value)
    _uncached(value)


def _descriptor_key(descriptor) -> tuple:
    """A host tensor descriptor: its tensor's dtype and alignment, the 16-divisibility of its strides and sizes, and
    every other field (block shape, layout, padding... as this triton has them; lists as tuples, to hash)."""
    names = _DESCRIPTOR_FIELDS.get(type(descriptor))
    if names is None:
        names = _DESCRIPTOR_FIELDS[type(descriptor)] = tuple(
            f.name for f in dataclasses.fields(descriptor) if f.name not in ("base", "shape", "strides"))
    base = descriptor.base
    return (TensorDescriptor, base.dtype, base.data_ptr() & 15 == 0,
            *[tuple(v) if type(v) is list else v for v in map(descriptor.__getattribute__, names)],
            *[s & 15 == 0 for s in descriptor.strides], *[s & 15 == 0 for s in descriptor.shape])


_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _expression(i: int, value, constexpr: bool) -> str:
    """The key's part for parameter ``i`` (``a[i]``), written for arguments of ``value``'s kind; an argument of
    another kind (None for a pointer: an optional tensor left out, which Triton takes as a constexpr) gets
    :func:`_key_of`'s, which tells the kinds apart (it raises for one it does not know). Tensors: dtype and 16-byte
    alignment; ints: the properties Triton specialises on; constexprs: the value; anything else: :func:`_key_of`."""
    a = f"a[{i}]"
    if constexpr:
        return a
    if type(value) in _TENSORS:
        return f"({a}.dtype, {a}.data_ptr() & 15 == 0) if {a}.__class__ in _TENSORS else _key_of({a}, False)"
    if type(value) is int:
        return (f"({a} == 1, {a} & 15 == 0, -2147483648 <= {a} < 2147483648, {a} < 2**63) "
                f"if {a}.__class__ is int else _key_of({a}, False)")
    if isinstance(value, TensorDescriptor):
        return f"_descriptor_key({a}) if isinstance({a}, TensorDescriptor) else _key_of({a}, False)"
    return f"_key_of({a}, False)"


def _key_function(values: tuple, constexprs: tuple[bool, ...], name: str = "kernel"):
    """``key(a)`` of an argument tuple ``a`` whose arguments have the kinds of ``values``: one entry per parameter.
    ``name`` (the kernel's) labels it in profiles."""
    parts = ", ".join(_expression(i, value, c) for i, (value, c) in enumerate(zip(values, constexprs)))
    scope = {"_TENSORS": _TENSORS, "_key_of": _key_of, "_descriptor_key": _descriptor_key,
             "TensorDescriptor": TensorDescriptor}
    # Generated from parameter positions only, no outside text.
    exec(compile(f"def key(a):\n    return ({parts},)\n", f"<launch key of {name}>", "exec"), scope)  # noqa: S102
    return scope["key"]


class _Kernel:
    """What :func:`launch` keeps per kernel: how to read its arguments out of the keyword arguments, the key
    function, whether it takes host-built tensor descriptors, the compiled kernel of every key seen, and the error
    of every key the GPU could not run."""

    def __init__(self, kernel: JITFunction, kwargs: dict):
        names = tuple(kernel.arg_names)
        self.names = frozenset(names)
        self.arguments = operator.itemgetter(*names)
        values = self.arguments(kwargs)
        self.key = _key_function(values, tuple(p.is_constexpr for p in kernel.params), kernel.__name__)
        self.descriptors = any(isinstance(value, TensorDescriptor) for value in values)
        self.compiled: dict[tuple, object] = {}
        self.unfit: dict[tuple, OutOfResources] = {}


_KERNELS: dict[JITFunction, _Kernel] = {}


def launch(kernel, grid: tuple[int, ...], **kwargs) -> None:
    """``kernel[grid](**kwargs)`` with every kernel parameter given by name (and the launch options, e.g.
    ``num_warps``), without Triton's per-call binding once this key was launched."""
    if not isinstance(kernel, JITFunction):  # the interpreter
        not_replayable("launches a kernel in Triton's interpreter")
        kernel[grid](**kwargs)
        return
    device = torch.cuda.current_device()
    entry = _KERNELS.get(kernel)
    try:
        if entry is None:
            entry = _KERNELS[kernel] = _Kernel(kernel, kwargs)
        values = entry.arguments(kwargs)
        options = kwargs.keys() - entry.names
        key = (device, *sorted((name, kwargs[name]) for name in options), *entry.key(values))
        compiled = entry.compiled.get(key)  # (hashing the key: an unhashable constexpr raises TypeError)
    except (_Uncached, KeyError, AttributeError, TypeError):
        not_replayable("launches a kernel with arguments the launch key does not take")
        _through_triton(kernel, grid, kwargs, device)  # Triton binds the arguments, or says what is wrong with them
        return
    grid = (*grid, 1, 1)[:3]
    if compiled is None:
        if key in entry.unfit:  # a copy, without the traceback (whose frames would keep this call's tensors alive)
            raise copy.copy(entry.unfit[key])
        try:
            compiled = _through_triton(kernel, grid, kwargs, device)
        except OutOfResources as error:
            with _LOCK:
                entry.unfit[key] = copy.copy(error)
            raise
        with _LOCK:
            entry.compiled[key] = compiled
        runner = compiled[grid]
    else:
        if entry.descriptors:
            ensure_context(device)
        runner = compiled[grid]
        runner(*values)
    if (recorder := getattr(RECORDING, "recorder", None)) is not None:
        recorder.launched(runner, values, device if entry.descriptors else None,
                          direct=functools.partial(DirectLaunch.of, compiled, grid, device=device))


# Kernel parameters by Triton's signature type: their ctypes (pointers are ``*``-types, 8 bytes).
_PARAM_CTYPES = {
    "i1": ctypes.c_int8, "i8": ctypes.c_int8, "u1": ctypes.c_uint8, "u8": ctypes.c_uint8, "i16": ctypes.c_int16,
    "u16": ctypes.c_uint16, "i32": ctypes.c_int32, "u32": ctypes.c_uint32, "i64": ctypes.c_int64,
    "u64": ctypes.c_uint64, "fp32": ctypes.c_float, "f32": ctypes.c_float, "fp64": ctypes.c_double,
}


class DirectLaunch:
    """A compiled kernel launched by one ``cuLaunchKernel`` on a parameter buffer built when a plan was recorded
    (``plans``): at each replay only the tensors' addresses are written, and the host tensor descriptors' maps
    encoded on their tensors' new addresses (or copied where an address came before: ``_TensorMap.encode``).

    Triton's runner converts and checks every argument at each launch (a driver query per pointer, a Python
    object per tensor descriptor), looks up the device and stream and asks for its launch hooks: 7 µs of host time
    for a kernel of one argument, 13.5 for our forward's 57 on an H100's host (docs/benchmarks.md, 2026-11-25). A
    plan's launch repeats the same kernel, grid and non-tensor arguments on new tensors of the same shapes, so all
    but the addresses are fixed once.

    :meth:`of` builds one only where it launches exactly what Triton's runner would: one CTA per cluster, no
    cooperative or programmatic-dependent launch, no scratch memory, every parameter of a type it knows (a tensor
    descriptor where its map's bytes are those Triton's encoder writes: ``_TensorMap``), and the compiled
    function's parameters (asked of the driver) matching their count and sizes: Triton's non-constexpr arguments
    (a descriptor as its map, shape and strides), then its scratch pointers (passed null: the kernel has no
    scratch). Anything else keeps Triton's runner, and so does a replay while a Triton launch hook (a profiler's)
    is installed.
    """

    def __init__(self, function: int, grid: tuple[int, int, int], threads: int, shared: int, device: int,
                 params: list, tensor_slots: list[int], maps: list[_TensorMap]):
        """``params``: every parameter's value in order, a ctypes scalar, a ``_TensorMap`` (one of ``maps``), or
        None for the tensor whose slot is next in ``tensor_slots``."""
        self.maps = maps
        self.launch_args = (ctypes.c_void_p(function), *map(ctypes.c_uint, (*grid, threads, 1, 1, shared)))
        self.device = device
        # The pointers live in one array, written by one call at each launch: each tensor's address read once (the
        # kernels' stand-ins for absent options are often one tensor), then spread to its parameters. The array's
        # last entry is a spare (so that ``spread`` returns a tuple even for one pointer).
        self.pointers = (ctypes.c_uint64 * (len(tensor_slots) + 1))()
        self.slots = sorted(set(tensor_slots))
        self.spread = operator.itemgetter(*[self.slots.index(slot) for slot in tensor_slots], 0)
        self.pack = struct.Struct(f"{len(tensor_slots) + 1}Q").pack_into
        pointer = iter(range(len(tensor_slots)))
        self.values = params  # keeps the scalars alive
        self.params = (ctypes.c_void_p * len(params))(*[
            ctypes.addressof(self.pointers) + 8 * next(pointer) if value is None
            else value.address if isinstance(value, _TensorMap) else ctypes.addressof(value)
            for value in params])
        self.empty = grid[0] * grid[1] * grid[2] == 0
        self.lock = threading.Lock()

    @classmethod
    def of(cls, compiled, grid: tuple[int, int, int], values: tuple, is_slot: Callable[[object], bool],
           device: int, descriptors: dict | None = None) -> DirectLaunch | None:
        """The direct launch of ``compiled[grid](*values)`` where tensors are given as slots (``is_slot``: their
        positions in a replay's list) and every other value is the recorded one; ``descriptors``: the host tensor
        descriptors, ``{position: (slot of its tensor, the descriptor)}``. None where it cannot be one."""
        metadata = compiled.metadata
        signature = getattr(compiled.src, "signature", None)
        maps_meta = iter(getattr(metadata, "tensordesc_meta", None) or ())
        if (getattr(metadata, "num_ctas", 1) != 1 or getattr(metadata, "launch_cooperative_grid", False)
                or getattr(metadata, "launch_pdl", False) or getattr(metadata, "global_scratch_size", 0)
                or getattr(metadata, "profile_scratch_size", 0)
                or not isinstance(signature, dict) or len(signature) != len(values)):
            return None
        params, sizes, tensor_slots, maps = [], [], [], []
        for position, (value, kind) in enumerate(zip(values, signature.values())):
            if kind == "constexpr":
                continue
            if not isinstance(kind, str):
                return None
            if kind.startswith("*") and is_slot(value):
                params.append(None)
                sizes.append(8)
                tensor_slots.append(value)
            elif kind in _PARAM_CTYPES and isinstance(value, (int, float)) and not is_slot(value):
                params.append(_PARAM_CTYPES[kind](value))
                sizes.append(ctypes.sizeof(params[-1]))
            elif kind.startswith("tensordesc") and position in (descriptors or {}):
                slot, descriptor = descriptors[position]
                tensor_map = _TensorMap.of(descriptor, next(maps_meta, None), slot)
                if tensor_map is None:
                    return None
                maps.append(tensor_map)
                # Triton passes the map, then the shape (int32) and the strides (int64)
                params += [tensor_map, *map(ctypes.c_int32, descriptor.shape), *map(ctypes.c_int64, descriptor.strides)]
                sizes += [_TENSOR_MAP_BYTES, *[4] * len(descriptor.shape), *[8] * len(descriptor.strides)]
            else:
                return None
        found = _param_sizes(compiled.function)
        if found is None or found[:len(sizes)] != sizes:
            return None
        scratch = found[len(sizes):]  # Triton's scratch pointers, null: the kernel has no scratch memory
        if len(scratch) > 2 or any(size != 8 for size in scratch):
            return None
        params += [ctypes.c_uint64(0) for _ in scratch]
        return cls(compiled.function, grid, 32 * metadata.num_warps, metadata.shared, device, params, tensor_slots,
                   maps)

    def __call__(self, slots: list, fallback: Callable[[], None]) -> None:
        """Launch on the tensors of ``slots``; ``fallback()`` launches through Triton instead (a hook installed)."""
        if _launch_hooks():
            fallback()
            return
        if self.empty:
            return
        addresses = self.spread([slots[slot].data_ptr() for slot in self.slots]) if self.slots else ()
        ensure_context(self.device)
        stream = _raw_stream(self.device)
        with self.lock:  # one buffer: a replay of this plan on another thread waits until the driver has read it
            self.pack(self.pointers, 0, *addresses)
            for tensor_map in self.maps:
                tensor_map.encode(slots[tensor_map.slot].data_ptr())
            _checked(_cu_launch_kernel()(*self.launch_args, stream, self.params, None), "cuLaunchKernel")


def _raw_stream(device: int) -> int:
    """The current stream's handle (what Triton's runner asks PyTorch for)."""
    return torch._C._cuda_getCurrentRawStream(device)


_TENSOR_MAP_BYTES = 128
# Maps a ``_TensorMap`` keeps by address (all forgotten when one more comes).
_KNOWN_MAPS = 64
# CUtensorMapInterleave NONE, CUtensorMapL2promotion L2_128B, CUtensorMapFloatOOBfill NONE and
# NAN_REQUEST_ZERO_FMA: what Triton's launcher encodes with.
_INTERLEAVE_NONE, _L2_PROMOTION_128B, _OOB_FILL_NONE, _OOB_FILL_NAN = 0, 2, 0, 1


class _TensorMap:
    """A host tensor descriptor's ``CUtensorMap`` in a direct launch's parameters, made at each launch for its
    tensor's address (:meth:`encode`: ``cuTensorMapEncodeTiled`` with the recorded shape, strides, block, swizzle and
    dtype, as Triton's launcher does, unless that address was encoded before). :meth:`of` checks, once, that it
    encodes the bytes Triton's own encoder writes."""

    def __init__(self, slot: int, dtype: int, shape, strides_bytes, block, swizzle: int, fill: int):
        self.slot = slot
        rank = len(shape)
        self.storage = (ctypes.c_uint8 * (_TENSOR_MAP_BYTES + 64))()  # a CUtensorMap is 64-byte aligned
        self.address = (ctypes.addressof(self.storage) + 63) & ~63
        # The driver takes the dimensions innermost first, and no stride for the innermost one.
        self.arrays = ((ctypes.c_uint64 * rank)(*reversed(shape)), (ctypes.c_uint64 * rank)(*reversed(strides_bytes)),
                       (ctypes.c_uint32 * rank)(*reversed(block)), (ctypes.c_uint32 * rank)(*[1] * rank))
        self.settings = (dtype, rank, _INTERLEAVE_NONE, swizzle, _L2_PROMOTION_128B, fill)
        self.encoded: int | None = None  # the address whose map the storage holds
        self.known: dict[int, bytes] = {}  # maps encoded before, by address

    def encode(self, address: int) -> None:
        """The map on ``address`` into the storage. Every other setting is fixed, so a map is a function of its
        address: one encoded before is copied (a model's layers, and a training loop's steps, come back to the same
        addresses), and the storage left as it is where it holds it already. On an H200's host an encoding took
        2.1 µs, a copy 0.9, a kept map 0.1 (docs/benchmarks.md, 2026-11-28)."""
        if address == self.encoded:
            return
        known = self.known.get(address)
        if known is None:
            self._encode(address)
            if len(self.known) >= _KNOWN_MAPS:
                self.known.clear()
            self.known[address] = self.bytes()
        else:
            ctypes.memmove(self.address, known, _TENSOR_MAP_BYTES)
        self.encoded = address

    def _encode(self, address: int) -> None:
        dtype, rank, interleave, swizzle, promotion, fill = self.settings
        _checked(_cu_tensor_map_encode_tiled()(self.address, dtype, rank, address, *self.arrays, interleave,
                                               swizzle, promotion, fill), "cuTensorMapEncodeTiled")

    def bytes(self) -> bytes:
        return ctypes.string_at(self.address, _TENSOR_MAP_BYTES)

    @classmethod
    def of(cls, descriptor, meta: dict | None, slot: int) -> _TensorMap | None:
        """The map of ``descriptor`` (a Gluon host descriptor, its tensor's slot), or None where the kernel takes it
        otherwise (no metadata: not lowered to a TMA descriptor), for a layout it does not know, or where its bytes
        would not be Triton's."""
        try:
            from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
            from triton.runtime import driver

            if (meta is None or meta.get("fp4_padded") or meta.get("is_im2col") or descriptor.strides[-1] != 1
                    or getattr(descriptor, "round_f32_to_tf32", False)):
                return None
            elem_size, dtype = meta["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]]
            block, swizzle = list(meta["block_size"]), meta["swizzle"]
            fill = _OOB_FILL_NAN if descriptor.padding == "nan" else _OOB_FILL_NONE
            strides_bytes = [s * elem_size for s in descriptor.strides[:-1]]
            tensor_map = cls(slot, dtype, list(descriptor.shape), strides_bytes, block, swizzle, fill)
            # Triton's encoding of the same at one address (``fill_tma_descriptor_tiled`` in newer ones: 3.9),
            # read out of its PyCUtensorMap, whose last member is the map: equal bytes, or no direct launch.
            utils = driver.active.utils
            encode = getattr(utils, "fill_tma_descriptor_tiled", None) or utils.fill_tma_descriptor
            probe = 1 << 20
            theirs = encode(probe, swizzle, elem_size, dtype, block, list(descriptor.shape), list(descriptor.strides),
                            int(fill == _OOB_FILL_NAN))
            offset = type(theirs).__basicsize__ - _TENSOR_MAP_BYTES
            if offset < 16 or offset % 64:
                return None
            tensor_map._encode(probe)
            return tensor_map if ctypes.string_at(id(theirs) + offset, _TENSOR_MAP_BYTES) == tensor_map.bytes() else None
        except (ImportError, AttributeError, KeyError, TypeError, ValueError, RuntimeError):
            return None


@functools.cache
def _cu_tensor_map_encode_tiled():
    encode = _libcuda().cuTensorMapEncodeTiled
    encode.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, *[ctypes.c_void_p] * 4,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    encode.restype = ctypes.c_int
    return encode


def _launch_hooks() -> bool:
    """Whether a Triton launch hook is installed (None or an empty chain, by the triton version, where not)."""
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return bool(enter is not None and getattr(enter, "calls", True)) or bool(exit_ is not None
                                                                            and getattr(exit_, "calls", True))


@functools.cache
def _cu_launch_kernel():
    launch_kernel = _libcuda().cuLaunchKernel
    launch_kernel.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_void_p]
    launch_kernel.restype = ctypes.c_int
    return launch_kernel


@functools.cache
def _param_sizes(function: int) -> list[int] | None:
    """The sizes of a compiled function's parameters, by ``cuFuncGetParamInfo``; None with a driver before CUDA
    12.4, which has no such call (no direct launch then)."""
    get_info = getattr(_libcuda(), "cuFuncGetParamInfo", None)
    if get_info is None:
        return None
    sizes = []
    offset, size = ctypes.c_size_t(), ctypes.c_size_t()
    while get_info(ctypes.c_void_p(function), ctypes.c_size_t(len(sizes)), ctypes.byref(offset),
                   ctypes.byref(size)) == 0:
        sizes.append(size.value)
    return sizes


def not_replayable(why: str) -> None:
    """Tell the recorder of the call being recorded on this thread, if any (``plans``), that the call does something
    a plan cannot replay."""
    if (recorder := getattr(RECORDING, "recorder", None)) is not None:
        recorder.refuse(why)


def _through_triton(kernel: JITFunction, grid: tuple[int, ...], kwargs: dict, device: int):
    """``kernel[grid](**kwargs)`` (which compiles, or finds, the kernel and returns it)."""
    if any(isinstance(value, TensorDescriptor) for value in kwargs.values()):
        ensure_context(device)
    return kernel[grid](**kwargs)


def launch_fitting(run: Callable[[object], None], rule: object, leaner: Callable[[], Iterable] | None) -> None:
    """``run(rule)``, or where the GPU cannot run the kernel of the rule's configuration (Triton's
    ``OutOfResources``, which :func:`launch` raises before anything runs: ``run`` must launch that kernel before
    anything else), ``run`` on the first of the ``leaner()`` configurations other than the rule that it can; the
    last one's error reaches the caller. ``leaner`` None: no fallback (a launch the caller tuned by hand). Off the
    GPU (Triton's interpreter) nothing is out of resources."""
    try:
        run(rule)
        return
    except OutOfResources:
        fallbacks = [] if leaner is None else [cfg for cfg in leaner() if cfg != rule]
        if not fallbacks:
            raise
    for cfg in fallbacks[:-1]:
        try:
            run(cfg)
            return
        except OutOfResources:
            continue
    run(fallbacks[-1])


def cached_keys(kernel) -> int:
    """How many argument keys of ``kernel`` :func:`launch` holds a compiled kernel for (for tests)."""
    entry = _KERNELS.get(kernel)
    return 0 if entry is None else len(entry.compiled)


_THREAD = threading.local()


def ensure_context(device_index: int) -> None:
    """Make the device's primary CUDA context current on this thread, once per thread and device.

    Triton builds host tensor descriptors (``cuTensorMapEncodeTiled``) before its launcher makes a context current,
    and PyTorch's autograd worker thread may have none yet: the first backward there that launches a kernel already
    compiled (and loaded) on another thread then fails with "invalid device context" (pytorch#124565). Driver calls
    only, so this is safe during CUDA-graph capture.
    """
    if getattr(_THREAD, "device", None) == device_index:
        return
    driver = _libcuda()
    current = ctypes.c_void_p()
    _checked(driver.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if not current.value:
        device = ctypes.c_int()
        _checked(driver.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
        _checked(driver.cuDevicePrimaryCtxRetain(ctypes.byref(current), device), "cuDevicePrimaryCtxRetain")
        _checked(driver.cuCtxSetCurrent(current), "cuCtxSetCurrent")
    _THREAD.device = device_index


def _libcuda():
    if not hasattr(_libcuda, "driver"):
        _libcuda.driver = ctypes.CDLL("libcuda.so.1")
    return _libcuda.driver


def _checked(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {result}")
