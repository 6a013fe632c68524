"""Kernel launches without Triton's per-call argument binding: what a small batch pays on the host.

``kernel[grid](**kwargs)`` costs 40–75 µs of host time per launch for our kernels of ~50 arguments (an H100's
shared host, triton 3.6, docs/benchmarks.md): Triton binds every argument, derives its specialisation (dtype and
16-byte alignment of pointers; 16-divisibility, value 1 and width of integers), builds a cache key from them and
checks the kernel's globals, before the launch itself (12–19 µs). :func:`launch` derives a key that determines that
specialisation from the arguments directly (the same properties, never fewer) and launches the compiled kernel
of a key it has seen; an unseen key goes through ``kernel[grid]`` once, which compiles or finds the kernel.

Off the GPU (Triton's interpreter) and for argument types it does not know, it is ``kernel[grid](**kwargs)``.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a triton without Gluon's Hopper API: no kernel takes descriptors then
    TensorDescriptor = ()

_INT32 = range(-(2**31), 2**31)
_LOCK = threading.Lock()
# kernel -> {key: compiled kernel}: a handful of keys per kernel (one per specialisation actually launched).
_COMPILED: dict[JITFunction, dict[tuple, object]] = {}
# kernel -> (parameter names in the kernel's order, the same as a set, which are constexprs).
_PARAMS: dict[JITFunction, tuple[tuple[str, ...], frozenset[str], tuple[bool, ...]]] = {}
_DESCRIPTOR_FIELDS: dict[type, tuple[str, ...]] = {}


class _Uncached(Exception):
    """An argument whose specialisation :func:`_key_of` cannot tell: launch through Triton."""


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
        return (TensorDescriptor, value.base.dtype, value.base.data_ptr() % 16 == 0, _settings(value),
                tuple(s % 16 == 0 for s in value.strides), tuple(s % 16 == 0 for s in value.shape))
    raise _Uncached(type(value).__name__)


def _settings(descriptor) -> tuple:
    """Every field of a descriptor but its tensor and sizes (block shape, layout, padding... as this triton has
    them), hashable."""
    names = _DESCRIPTOR_FIELDS.get(type(descriptor))
    if names is None:
        names = _DESCRIPTOR_FIELDS[type(descriptor)] = tuple(
            f.name for f in dataclasses.fields(descriptor) if f.name not in ("base", "shape", "strides"))
    settings = tuple(getattr(descriptor, name) for name in names)
    try:
        hash(settings)
    except TypeError:
        return tuple(map(repr, settings))
    return settings


def _key(values: list, constexprs: tuple[bool, ...], options: tuple):
    """:func:`_key_of` of every argument, with the two common types (tensors and ints) inline: this runs at every
    launch, and a function call per argument would cost as much as Triton's own binding."""
    key = [torch.cuda.current_device(), options]
    for value, constexpr in zip(values, constexprs):
        kind = type(value)
        if constexpr:
            key.append(value)
        elif kind is torch.Tensor:
            key.append((value.dtype, value.data_ptr() & 15 == 0))
        elif kind is int:
            key.append((value == 1, value & 15 == 0, -2147483648 <= value < 2147483648, value < 2**63))
        else:
            key.append(_key_of(value, False))
    return tuple(key)


def launch(kernel, grid: tuple[int, ...], **kwargs) -> None:
    """``kernel[grid](**kwargs)`` with every kernel parameter given by name (and the launch options, e.g.
    ``num_warps``), without Triton's per-call binding once this key was launched."""
    if not isinstance(kernel, JITFunction):  # the interpreter
        kernel[grid](**kwargs)
        return
    params = _PARAMS.get(kernel)
    if params is None:
        params = _PARAMS[kernel] = (tuple(kernel.arg_names), frozenset(kernel.arg_names),
                                    tuple(p.is_constexpr for p in kernel.params))
    names, name_set, constexprs = params
    try:
        values = [kwargs[name] for name in names]
        key = _key(values, constexprs, tuple(sorted((name, kwargs[name]) for name in kwargs.keys() - name_set)))
    except (_Uncached, KeyError):
        kernel[grid](**kwargs)
        return
    compiled = _COMPILED.get(kernel, {}).get(key)
    if compiled is None:
        compiled = kernel[grid](**kwargs)
        with _LOCK:
            _COMPILED.setdefault(kernel, {})[key] = compiled
        return
    compiled[(*grid, 1, 1)[:3]](*values)


def cached_keys(kernel) -> int:
    """How many argument keys of ``kernel`` :func:`launch` holds a compiled kernel for (for tests)."""
    return len(_COMPILED.get(kernel, {}))

