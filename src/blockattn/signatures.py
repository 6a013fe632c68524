"""Call signatures: a hashable summary of a call's arguments, cheap enough to compute on every call.

Three host-side caches key on one: the call plans (``ops.plans``) replay the launches recorded for a signature, the
checks (``checks``) skip the validation that a signature has already passed, and the call cache (``call_cache``)
takes a public call straight to its plan. Each says what of a tensor its
decisions may depend on (``tensor_key``, an expression of the tensor ``{t}``) and what of the call's context
(``context``: the current device, grad mode). A signature holds the type of every argument, the ``tensor_key`` of each
tensor, every other value itself (which must then be hashable), the context, and (``aliases``) which tensor
arguments are one tensor. A tensor subclass has no signature (``TypeError``): its own code may run anything; nor has
a tensor whose key cannot be read (a sparse tensor has no strides or storage).

The function that computes a key is generated once per sequence of argument types, one expression per argument
(Triton generates its argument binders the same way): no loop or type test per argument on every call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

TENSORS = (torch.Tensor, torch.nn.Parameter)


class Signature:
    """``signature(args) -> (types, key)`` of a flat tuple of arguments (tensors, None and hashable values)."""

    def __init__(self, tensor_key: str, context: Callable[[], object], aliases: bool = True):
        self.tensor_key = tensor_key
        self.context = context
        self.aliases = aliases
        self.functions: dict[tuple[type, ...], Callable[[tuple], tuple]] = {}

    def __call__(self, args: tuple) -> tuple:
        types = tuple(map(type, args))
        key_of = self.functions.get(types)
        if key_of is None:
            key_of = self.functions[types] = self._key_function(types)
        try:
            return types, key_of(args)
        except RuntimeError as error:  # a tensor without strides or storage (a sparse one)
            raise TypeError(f"no signature: {error}") from error

    def _key_function(self, types: tuple[type, ...]) -> Callable[[tuple], tuple]:
        if any(issubclass(t, torch.Tensor) and t not in TENSORS for t in types):
            def refuse(args):
                raise TypeError("a tensor subclass: no signature")
            return refuse
        tensors = [i for i, t in enumerate(types) if t in TENSORS]
        parts = [self.tensor_key.format(t=f"a[{i}]") if t in TENSORS else f"a[{i}]" for i, t in enumerate(types)
                 if t is not type(None)]
        if self.aliases:
            parts.insert(0, "_aliases((" + "".join(f"id(a[{i}]), " for i in tensors) + "))")
        # Generated from argument positions and the tensor expression this module's callers give, no outside text.
        source = f"def key(a):\n    return (_context(), {''.join(p + ', ' for p in parts)})\n"
        scope = {"_context": self.context, "_aliases": _aliases}
        exec(compile(source, "<call signature>", "exec"), scope)  # noqa: S102
        return scope["key"]


def _aliases(ids: tuple[int, ...]) -> tuple[int, ...] | None:
    """Which tensor arguments are one tensor (each one's first position), or None when all are distinct."""
    return None if len(set(ids)) == len(ids) else tuple(ids.index(i) for i in ids)
