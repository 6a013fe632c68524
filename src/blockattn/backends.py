"""The one dispatcher: every backend declares which calls it takes, and :func:`select` picks, for the forward and the
backward alike.

A backend is a set of launchers with one signature per pass and a ``why_not(call)`` that returns ``None`` when the
backend takes the call, or the reason it does not. :func:`select` tries them in order of preference (the most
specialised first) and returns the first that takes the call; the PyTorch path takes every call, so a device the
kernels do not serve (a GPU older than Ampere, say) still runs, in PyTorch.

Launchers:

- ``forward(q, k, v, offsets, table, block_size, scale, sinu_pos, rotate) -> out``
- ``backward(grad_out, q, k, v, offsets, table, block_size, scale, sinu_pos, rotate, grads) -> None``: writes
  ``(dq, dk, dv)`` into ``grads`` (new tensors, or views of one packed buffer).

Tuning overrides (warps, register caps) are arguments of the Triton launchers alone, which tuning scripts call
directly: they never change which backend runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import devices
from .checks import BLOCK_SIZES, KERNEL_DTYPES, MAX_HEAD_DIM, MIN_HEAD_DIM
from .ops import block_attention as triton_ops
from .ops import block_attention_torch as torch_ops

try:
    from .ops import block_attention_sm90 as sm90_ops
except ImportError as error:  # a triton without Gluon's Hopper API (before 3.6): the Triton kernels serve Hopper
    sm90_ops = None
    _SM90_MISSING = f"needs triton >= 3.6 (Gluon's Hopper API): {error}"

PASSES = ("fwd", "bwd")


@dataclass(frozen=True)
class AttentionCall:
    """What a backend needs to know to say whether it takes a call: metadata only, never tensor values."""

    pass_name: str
    device: torch.device
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    rotate: int = 0
    # q, k, v, dO readable by TMA as [N, H * D] rows (16-byte aligned) and gradients laid out as such rows.
    tma_rows: bool = True

    @classmethod
    def of(cls, pass_name: str, q: torch.Tensor, k: torch.Tensor, block_size: int, rotate: int,
           tensors: tuple[torch.Tensor, ...] = (), grads: tuple[torch.Tensor, ...] = ()) -> AttentionCall:
        """The call on ``q [N, Hq, D]`` and ``k [N, Hkv, D]``; ``tensors`` and ``grads`` are those whose layout a
        backend reads (the backward's inputs and gradients)."""
        return cls(pass_name, q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2], block_size, rotate,
                   all(tma_readable(t) for t in tensors) and all(rows_of_heads(g) for g in grads))


def rows_of_heads(t: torch.Tensor) -> bool:
    """``[N, H, D]`` addressable as one ``[N, H * D]`` matrix: heads side by side in a row."""
    _, h, d = t.shape
    return t.stride(2) == 1 and (h == 1 or t.stride(1) == d)


def tma_readable(t: torch.Tensor) -> bool:
    """:func:`rows_of_heads`, and rows and start 16-byte aligned, as TMA needs."""
    return rows_of_heads(t) and t.stride(0) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0


def _triton_why_not(call: AttentionCall) -> str | None:
    if reason := devices.kernels_reason(call.device):
        return reason
    if call.dtype not in KERNEL_DTYPES:
        return f"takes float16, bfloat16 and float32, not {call.dtype}"
    if not (MIN_HEAD_DIM <= call.head_dim <= MAX_HEAD_DIM and call.head_dim % 8 == 0):
        return f"takes head dims that are multiples of 8 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], not {call.head_dim}"
    if call.block_size not in BLOCK_SIZES:
        return f"takes block sizes {BLOCK_SIZES}, not {call.block_size}"
    return None


def _sm90_why_not(call: AttentionCall) -> str | None:
    if sm90_ops is None:
        return _SM90_MISSING
    if devices.kernels_reason(call.device) or devices.capability(call.device)[0] != 9:
        return "needs a Hopper GPU (compute capability 9.x)"
    return sm90_ops.why_not(call)


def _torch_why_not(call: AttentionCall) -> None:
    return None


@dataclass(frozen=True)
class Backend:
    name: str
    summary: str
    why_not: Callable[[AttentionCall], str | None]
    forward: Callable | None = None
    backward: Callable | None = None

    @property
    def passes(self) -> tuple[str, ...]:
        return tuple(p for p, fn in zip(PASSES, (self.forward, self.backward)) if fn is not None)

    def takes(self, call: AttentionCall) -> str | None:
        """``why_not``, then whether this backend has the call's pass."""
        if reason := self.why_not(call):
            return reason
        return None if call.pass_name in self.passes else f"has no {call.pass_name} kernel"


# In order of preference: the first that takes a call runs it.
BACKENDS: dict[str, Backend] = {
    backend.name: backend
    for backend in (
        Backend("sm90-gluon", "Hopper backward in Gluon: TMA loads, wgmma on whole rows (64-token blocks, D = 128, "
                "no GQA, fp16/bf16, plain or rotary)", _sm90_why_not,
                backward=None if sm90_ops is None else sm90_ops.block_attention_bwd_sm90),
        Backend("triton", "Triton kernels, every supported shape, NVIDIA GPUs from Ampere on", _triton_why_not,
                forward=triton_ops.block_attention_fwd_triton, backward=triton_ops.block_attention_bwd_triton),
        Backend("torch", "PyTorch ops on padded blocks, any device (the CPU path; the fallback elsewhere)",
                _torch_why_not, forward=torch_ops.block_attention_fwd_torch,
                backward=torch_ops.block_attention_bwd_torch),
    )
}


def select(call: AttentionCall) -> Backend:
    """The backend that runs ``call``: the first in :data:`BACKENDS` that takes it."""
    reasons = []
    for backend in BACKENDS.values():
        reason = backend.takes(call)
        if reason is None:
            return backend
        reasons.append(f"{backend.name}: {reason}")
    raise ValueError(f"no backend takes {call}: " + "; ".join(reasons))

