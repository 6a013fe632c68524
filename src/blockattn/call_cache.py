"""A public call repeated on the same argument signature runs its op's plan at once: no checks, argument handling or
second signature.

A model's layers, and a serving loop's calls on one batch, call an attention function on the same metadata again and
again. Everything the public function does before its op runs is then a function of that metadata: its checks
pass (``checks`` reads nothing else), the op's inputs are the call's arguments in another order plus values computed
from the metadata (the block size, the scale, the rotate mask), the eager route (``custom_ops.eager_route``) takes
the same branch, and the op's implementation replays the same plan (``ops.plans``), found by a second signature of
the op's inputs. A small eager forward spent more host time on those steps than on its plan's replay.

:class:`CallCache` keeps, per signature of a public call's arguments, a function that builds the op's inputs out of
the arguments, and the op's replay on them (``custom_ops.block_attention_replay`` and its siblings). A call whose
signature is there computes one signature and runs the replay. Its signature holds everything both earlier ones
held (each tensor's shape, strides, dtype, device, 16-byte alignment and ``requires_grad``, which arguments are one
tensor, the other values, grad mode and the current device), so a hit is a call the checks passed and the plan was
recorded for. A public function that computes a tensor before its op (``qkv_block_attention``'s projection, whose
dtype CUDA autocast decides) passes it after its arguments, and its cache's signature holds the autocast state too.

The cache learns a signature after a call that ran the slow way and whose op's inputs are all arguments of the call
(or such computed tensors) or values, once the op's implementation has a plan for them (after the second call of a
signature, which records it). A dropout seed, drawn per call, is neither: such calls always run the slow way.
Nothing is cached while ``torch.compile`` traces, under a dispatch mode or functorch transform, for a tensor
subclass (a nested tensor among them), off CUDA, or for an argument without a signature (an unhashable value);
:func:`checks.forget` and :func:`ops.plans.forget` forget it. A learned call holds its plan: replays through the
cache do not renew it in ``planned``'s own order of use, so a plan can leave that bound (:data:`ops.plans.MAX_PLANS`)
while this one keeps it, still valid for its signature.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from . import checks, custom_ops
from .ops import plans
from .signatures import TENSORS, Signature

MAX_CALLS = 256
# The checks' signature (shape, dtype, device, requires_grad, grad mode) and the plans' (strides, 16-byte
# alignment, aliases, the current device) in one; for a cache with ``autocast``, also the dtype CUDA autocast
# computes in (False where it is off).
_TENSOR_KEY = "({t}.shape, {t}.stride(), {t}.dtype, {t}.device, {t}.data_ptr() & 15, {t}.requires_grad)"
_SIGNATURES = {
    False: Signature(_TENSOR_KEY, lambda: (torch.is_grad_enabled(), plans.current_device())),
    True: Signature(_TENSOR_KEY, lambda: (torch.is_grad_enabled(), plans.current_device(),
                                          torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda"))),
}
# A signature whose calls always run the slow way.
_SLOW = object()


class CallCache:
    """One public function's repeated calls (the module's docstring). ``replay_of(inputs)`` is what its op runs for
    calls on the signature of ``inputs``: a function of the op's inputs, False where such calls never replay a plan,
    or None while they cannot yet (``custom_ops.block_attention_replay`` and its siblings). ``autocast``: the
    function computes a tensor before its op whose dtype follows CUDA autocast."""

    def __init__(self, replay_of: Callable[[tuple], Callable[[tuple], object] | bool | None], autocast: bool = False):
        self.replay_of = replay_of
        self.signature = _SIGNATURES[autocast]
        self.calls: OrderedDict = OrderedDict()  # oldest learned first
        checks.forget_with_checks(self.calls)
        plans.forget_with_plans(self.calls)

    def lookup(self, args: tuple) -> tuple[object, Callable[[tuple], object] | None]:
        """``(key, replay)``: the signature of ``args`` (the public call's arguments, flat: tensors, None and
        hashable values) and, where it was learned, ``replay(args)``, the call's result; key None where nothing
        may be cached."""
        if type(args[0]) not in TENSORS or not args[0].is_cuda or not custom_ops.eager_context():
            return None, None
        try:
            key = self.signature(args)
            replay = self.calls.get(key)
        except TypeError:  # a tensor subclass, an unhashable value
            return None, None
        return key, None if replay is _SLOW else replay

    def learn(self, key, args: tuple, inputs: tuple) -> None:
        """After a call with signature ``key`` (:meth:`lookup`) ran the slow way and passed ``inputs`` to its op."""
        if key is None or key in self.calls:
            return
        sources = _sources(args, inputs)
        replay = self.replay_of(inputs) if sources is not None else False
        if replay is None:  # no plan yet
            return
        if len(self.calls) >= MAX_CALLS:  # the oldest goes (one C call each: safe between threads under the GIL)
            self.calls.popitem(last=False)
        self.calls[key] = _SLOW if replay is False else _bound(_binder(sources), replay)


def _bound(bind: Callable[[tuple], tuple], replay: Callable[[tuple], object]) -> Callable[[tuple], object]:
    return lambda args: replay(bind(args))


def _sources(args: tuple, inputs: tuple) -> list | None:
    """Where each of ``inputs`` comes from in calls of this signature: for a tensor, the position in ``args`` where
    this call has it (an int), for every other value, the value itself (in a 1-tuple); None where a tensor of
    ``inputs`` is not an argument."""
    position = {}
    for i, value in reversed(list(enumerate(args))):
        if type(value) in TENSORS:
            position[id(value)] = i
    sources = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            if id(value) not in position:
                return None
            sources.append(position[id(value)])
        else:
            sources.append((value,))
    return sources


def _binder(sources: list) -> Callable[[tuple], tuple]:
    """``bind(args) -> inputs`` (:func:`_sources`), generated once per learned signature."""
    parts = [f"a[{source}]" if type(source) is int else f"c{j}" for j, source in enumerate(sources)]
    constants = {f"c{j}": source[0] for j, source in enumerate(sources) if type(source) is not int}
    # Generated from positions alone (the values are the scope's), like ``signatures.Signature``'s key functions.
    source = f"def bind(a):\n    return ({''.join(p + ', ' for p in parts)})\n"
    exec(compile(source, "<call binder>", "exec"), constants)  # noqa: S102
    return constants["bind"]
