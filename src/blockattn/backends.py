"""The one dispatcher: every backend declares which calls it takes, and :func:`select` picks, for the forward and the
backward alike.

A backend is a set of launchers with one signature per pass and a ``why_not(call)`` that returns ``None`` when the
backend takes the call, or the reason it does not. :func:`select` tries them in order of preference (the most
specialised first) and returns the first that takes the call; the PyTorch path takes every call, so a device the
kernels do not serve (a GPU older than Ampere, say) still runs, in PyTorch.

Launchers:

- ``forward(q, k, v, offsets, table, block_size, scale, sinu_pos, rotate, options, fp8_scales) -> out``
  (``fp8_scales``: ``ops.fp8.Fp8Scales`` of float8 inputs, or None; ``table`` a ``block_table.BlockTable``, or a
  ``block_table.OffsetsOnly`` where the backend's ``finds_blocks`` says its kernel needs none)
- ``backward(grad_out, q, k, v, offsets, table, block_size, scale, sinu_pos, rotate, options, grads)
  -> (dpos_bias, dtime_bias)``: writes ``(dq, dk, dv)`` into ``grads`` (new tensors, or views of one packed buffer)
  and returns the gradients of the in-block biases (``ops.in_block.InBlock``; None where absent); ``table`` as the
  forward's.

Tuning overrides (warps, register caps) are arguments of the Triton launchers alone, which tuning scripts call
directly: they never change which backend runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import devices
from .checks import BLOCK_SIZES, FP8_DTYPE, KERNEL_DTYPES, MAX_HEAD_DIM, MIN_HEAD_DIM
from .ops import block_attention as triton_ops
from .ops import block_attention_torch as torch_ops
from .ops import flash_attention as flash_ops
from .ops import flash_attention_torch as flash_torch_ops
from .ops import tiles

try:
    from .ops import block_attention_sm90 as sm90_ops
    from .ops import block_attention_sm90_fwd as sm90_fwd_ops
    from .ops import flash_attention_sm90 as flash_sm90_ops
except ImportError as error:  # a triton without Gluon's Hopper API (before 3.6): the Triton kernels serve Hopper
    sm90_ops = sm90_fwd_ops = flash_sm90_ops = None
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
    # The in-block options' bits (ops.in_block: causal, biases, dropout); 0 for the plain op.
    in_block: int = 0
    # q, k, v, dO readable by TMA as [N, H * D] rows (16-byte aligned) and gradients laid out as such rows.
    tma_rows: bool = True
    # The rotary angles' dtype where TMA can read them as [N, D] rows (16-byte aligned), else None.
    angles_dtype: torch.dtype | None = None

    @classmethod
    def of(cls, pass_name: str, q: torch.Tensor, k: torch.Tensor, block_size: int, rotate: int, in_block: int = 0,
           tensors: tuple[torch.Tensor, ...] = (), grads: tuple[torch.Tensor, ...] = (),
           angles: torch.Tensor | None = None) -> AttentionCall:
        """The call on ``q [N, Hq, D]`` and ``k [N, Hkv, D]``; ``tensors`` and ``grads`` are those whose layout a
        backend reads (the backward's inputs and gradients), ``angles`` the rotary's ``sinu_pos`` where a backend
        may read it by TMA."""
        return cls(pass_name, q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2], block_size, rotate, in_block,
                   all(tma_readable(t) for t in tensors) and all(rows_of_heads(g) for g in grads),
                   angles.dtype if angles is not None and tma_readable(angles.unsqueeze(1)) else None)


def rows_of_heads(t: torch.Tensor) -> bool:
    """``[N, H, D]`` addressable as one ``[N, H * D]`` matrix: heads side by side in a row."""
    _, h, d = t.shape
    _, stride_h, stride_d = t.stride()
    return stride_d == 1 and (h == 1 or stride_h == d)


def tma_readable(t: torch.Tensor) -> bool:
    """:func:`rows_of_heads`, and rows and start 16-byte aligned, as TMA needs."""
    return rows_of_heads(t) and t.stride(0) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0


def _triton_why_not(call: AttentionCall) -> str | None:
    if reason := devices.kernels_reason(call.device):
        return reason
    if call.dtype == FP8_DTYPE:
        if call.pass_name != "fwd":
            return "takes float8_e4m3fn in the forward only"
        if reason := devices.fp8_reason(call.device):
            return reason
    elif call.dtype not in KERNEL_DTYPES:
        return f"takes float16, bfloat16, float32 and (forward) float8_e4m3fn, not {call.dtype}"
    if not (MIN_HEAD_DIM <= call.head_dim <= MAX_HEAD_DIM and call.head_dim % 8 == 0):
        return f"takes head dims that are multiples of 8 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], not {call.head_dim}"
    if call.block_size not in BLOCK_SIZES:
        return f"takes block sizes {BLOCK_SIZES}, not {call.block_size}"
    return None


def _hopper_reason(device: torch.device) -> str | None:
    """Why the Gluon kernels for sm_90 (wgmma: Hopper only) do not run on ``device``, or None."""
    if sm90_ops is None:
        return _SM90_MISSING
    if devices.kernels_reason(device) or devices.capability(device)[0] != 9:
        return "needs a Hopper GPU (compute capability 9.x)"
    return None


def _sm90_why_not(call: AttentionCall) -> str | None:
    return _hopper_reason(call.device) or (sm90_fwd_ops if call.pass_name == "fwd" else sm90_ops).why_not(call)


def _sm90_finds_blocks(call: AttentionCall, num_seqs: int, num_tokens: int) -> bool:
    """Whether the Hopper kernels run ``call`` without a block table (``Backend.finds_blocks``): the backward
    without GQA, one block a program, where ``triton_ops.searches_offsets``. Not the GQA backward, which spills more
    registers searching (ptxas of triton 3.6 for sm_90: 8 -> 88 bytes at D = 128, 16 -> 40 at D = 64), nor the
    warp-specialised forward, persistent, whose programs would search for every item."""
    return (call.pass_name == "bwd" and call.num_heads == call.num_kv_heads
            and tiles.blocks_per_tile(call.block_size, call.head_dim, 1, call.rotate != 0, call.in_block,
                                      backward=True) == 1
            and triton_ops.searches_offsets(call, num_seqs, num_tokens))


def _torch_why_not(call: AttentionCall) -> str | None:
    if call.dtype == FP8_DTYPE and devices.kernels_run_on(call.device):
        return "fp8 on a GPU the kernels serve is theirs (refused below compute capability 8.9, not run slowly here)"
    return None


@dataclass(frozen=True)
class Backend:
    name: str
    summary: str
    why_not: Callable[[AttentionCall], str | None]
    forward: Callable | None = None
    backward: Callable | None = None
    # ``finds_blocks(call, num_seqs, num_tokens)``: whether the kernel of ``call`` (either pass) runs without a block
    # table (``block_table.OffsetsOnly``; None: never).
    finds_blocks: Callable[[AttentionCall, int, int], bool] | None = None

    @functools.cached_property  # read at every call (select): computed once
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
        Backend("sm90-gluon", "Hopper kernels in Gluon. Backward: TMA loads, wgmma on whole rows (64-token blocks at "
                "D = 32 to 256, 128-token blocks at D = 32 to 128, 16- and 32-token blocks four or two to a 64-row tile "
                "at D = 32 to 256 but for the rotary without GQA from D = 4 x block size; with or without GQA, "
                "fp16/bf16, plain or rotary; the in-block options at 64-token blocks up to D = 128, under GQA not both "
                "biases together). Forward: warp-specialised and persistent, a TMA producer warp and two consumer "
                "warpgroups (64-row tiles, D = 32 to 128, fp16/bf16/fp8, plain, or fp16/bf16 with a rotary turned "
                "by a fourth warpgroup and the consumers; 128-token blocks in two halves; where it measured faster "
                "than the Triton forward)", _sm90_why_not,
                forward=None if sm90_fwd_ops is None else sm90_fwd_ops.block_attention_fwd_sm90,
                backward=None if sm90_ops is None else sm90_ops.block_attention_bwd_sm90,
                finds_blocks=_sm90_finds_blocks),
        Backend("triton", "Triton kernels, every supported shape, NVIDIA GPUs from Ampere on (the float8 forward "
                "from Ada on)", _triton_why_not,
                forward=triton_ops.block_attention_fwd_triton, backward=triton_ops.block_attention_bwd_triton,
                finds_blocks=triton_ops.finds_blocks),
        Backend("torch", "PyTorch ops on padded blocks, any device (the CPU path; the fallback elsewhere)",
                _torch_why_not, forward=torch_ops.block_attention_fwd_torch,
                backward=torch_ops.block_attention_bwd_torch),
    )
}


def select(call, backends: dict[str, Backend] | None = None) -> Backend:
    """The backend that runs ``call``: the first in ``backends`` (:data:`BACKENDS` by default) that takes it."""
    reasons = []
    for backend in (BACKENDS if backends is None else backends).values():
        reason = backend.takes(call)
        if reason is None:
            return backend
        reasons.append(f"{backend.name}: {reason}")
    raise ValueError(f"no backend takes {call}: " + "; ".join(reasons))


# --------------------------------------------------------------------------------------------------------------------
# Flash attention (whole sequences): one forward launcher per backend,
# ``forward(q, k, v, cu_seqlens_q, cu_seqlens_k, table, scale, causal, bottom_right, out_dtype, descales, config)
# -> (out, lse)``, where ``config`` is what ``FlashCall.config`` chose (None for the PyTorch path).
# --------------------------------------------------------------------------------------------------------------------

FLASH_KERNEL_DTYPES = (torch.float16, torch.bfloat16, FP8_DTYPE)
# TMA and the warp-specialised loop: Hopper and later.
TMA_CAPABILITY = (9, 0)


def tma_rows_ready(t: torch.Tensor) -> bool:
    """Heads side by side in a row (``[.., tokens, H * D]``), the start and every stride 16-byte aligned: what the
    TMA kernel's 2-D descriptors need."""
    elem = t.element_size()
    heads, d = t.shape[-2:]
    return (t.stride(-1) == 1 and (heads == 1 or t.stride(-2) == d) and t.data_ptr() % 16 == 0
            and all(s * elem % 16 == 0 for s in t.stride()[:-2]))


@dataclass(frozen=True)
class FlashCall:
    """A flash-attention call's metadata; ``config`` is the kernel configuration the device can hold (None where
    none fits or no kernel runs), ``config_reason`` why not."""

    pass_name: str
    device: torch.device
    dtype: torch.dtype
    head_dim: int
    variant: str
    tma_ready: bool
    last_dim_contiguous: bool
    # The rows of q, k, v follow each other across the batch ([B, S, H, D] viewable as [B * S, H, D]).
    rows_follow: bool = True
    causal: bool = False
    config: flash_ops.FlashConfig | None = None
    config_reason: str | None = None

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: str, *, causal: bool) -> FlashCall:
        return cls("fwd", q.device, q.dtype, q.shape[-1], variant, all(tma_rows_ready(t) for t in (q, k, v)),
                   all(t.stride(-1) == 1 for t in (q, k, v)),
                   all(t.dim() == 3 or t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1) for t in (q, k, v)),
                   causal)

    def with_config(self, kernel_variant: str) -> FlashCall:
        """This call with the tuned configuration of ``kernel_variant`` on its device (or why none fits)."""
        cfg, reason = flash_ops.flash_config(kernel_variant, devices.capability(self.device), self.head_dim,
                                             self.dtype == FP8_DTYPE, devices.shared_memory_limit(self.device),
                                             self.causal)
        return FlashCall(**{**self.__dict__, "config": cfg, "config_reason": reason})


def _flash_kernel_why_not(call: FlashCall, kernel_variant: str) -> str | None:
    if call.variant not in ("auto", kernel_variant):
        return f"variant={call.variant!r} was asked for"
    if reason := devices.kernels_reason(call.device):
        return reason
    if call.dtype not in FLASH_KERNEL_DTYPES:
        return f"takes float16, bfloat16 and float8_e4m3fn, not {call.dtype}"
    if call.dtype == FP8_DTYPE and (reason := devices.fp8_reason(call.device)):
        return reason
    if not call.last_dim_contiguous:
        return "needs q, k, v with a contiguous last dimension"
    return None


def _flash_pipelined_why_not(call: FlashCall) -> str | None:
    return _flash_kernel_why_not(call, "pipelined") or call.with_config("pipelined").config_reason


def _flash_sm90_why_not(call: FlashCall) -> str | None:
    if reason := _flash_kernel_why_not(call, "warp_specialized") or _hopper_reason(call.device):
        return reason
    if reason := flash_sm90_ops.why_not(call.dtype, call.head_dim):
        return reason
    if not (call.tma_ready and call.rows_follow):
        return ("needs q, k, v with heads side by side in a row, 16-byte aligned starts and strides (TMA) and "
                "rows that follow each other across the batch")
    configured = call.with_config("warp_specialized-sm90")
    return configured.config_reason or flash_sm90_ops.config_reason(configured.config)


def _flash_tma_why_not(call: FlashCall) -> str | None:
    if reason := _flash_kernel_why_not(call, "warp_specialized"):
        return reason
    if devices.capability(call.device) < TMA_CAPABILITY:
        return "needs TMA (Hopper, compute capability 9.0+)"
    if reason := tma_reason(call.head_dim, call.dtype):
        return reason
    if not call.tma_ready:
        return "needs q, k, v with heads side by side in a row and 16-byte aligned starts and strides (TMA)"
    return call.with_config("warp_specialized").config_reason


# What the TMA kernel takes: whole heads of 128 columns, 16-bit. On an H100 with triton 3.6 other head dims (16,
# 64, 256) and fp8 inputs compiled but hit "illegal instruction" at run time in the varlen/GQA tests, or failed in
# Triton's Hopper warp-specialisation pass (docs/benchmarks.md).
TMA_HEAD_DIMS = (128,)
TMA_DTYPES = (torch.float16, torch.bfloat16)


def tma_reason(head_dim: int, dtype: torch.dtype) -> str | None:
    if head_dim not in TMA_HEAD_DIMS:
        return f"takes head dims {TMA_HEAD_DIMS}, not {head_dim}"
    if dtype not in TMA_DTYPES:
        return f"takes float16 and bfloat16, not {dtype}"
    return None


def _flash_torch_why_not(call: FlashCall) -> str | None:
    """Where the kernels do not run, and on their GPUs for what they do not take (float32, a strided last
    dimension); never fp8 on a GPU without fp8 tensor cores (refused, not run slowly)."""
    if not devices.kernels_run_on(call.device):
        return None
    if call.dtype == FP8_DTYPE:
        return "fp8 on a GPU is the kernels' (they refuse it here)"
    if call.dtype in FLASH_KERNEL_DTYPES and call.last_dim_contiguous:
        return "the kernels serve this GPU and these inputs"
    return None


def _flash_forward(kernel_variant: str) -> Callable:
    def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, table, scale, causal, bottom_right, out_dtype, descales,
                config):
        return flash_ops.flash_attention_fwd_triton(q, k, v, cu_seqlens_q, cu_seqlens_k, table, scale, causal,
                                                    bottom_right, out_dtype, descales, kernel_variant, config)
    return forward


def _flash_sm90_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, table, scale, causal, bottom_right, out_dtype,
                        descales, config):
    return flash_sm90_ops.flash_attention_fwd_sm90(q, k, v, cu_seqlens_q, cu_seqlens_k, table, scale, causal,
                                                   bottom_right, out_dtype, descales, config)


def _flash_torch_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, table, scale, causal, bottom_right, out_dtype,
                         descales, config):
    return flash_torch_ops.flash_attention_fwd_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal,
                                                     bottom_right, out_dtype, descales)


# In order of preference for variant="auto".
FLASH_BACKENDS: dict[str, Backend] = {
    backend.name: backend
    for backend in (
        Backend("warp_specialized-sm90", "Hopper, Gluon: a producer warp fills a two-slot ring by TMA, two or three "
                "consumer warpgroups overlap the softmax with their products (fp16, bf16, fp8; D = 64, 128 or 256; the "
                "warp-specialised variant on Hopper)",
                _flash_sm90_why_not, forward=_flash_sm90_forward),
        Backend("warp_specialized", "Triton, TMA descriptors and a warp-specialised key/value loop (Hopper on)",
                _flash_tma_why_not, forward=_flash_forward("warp_specialized")),
        Backend("pipelined", "Triton, pointer loads software-pipelined (NVIDIA GPUs from Ampere on)",
                _flash_pipelined_why_not, forward=_flash_forward("pipelined")),
        Backend("torch", "PyTorch ops sequence by sequence (the CPU path; the fallback on other devices, and for float32 "
                "or a strided last dimension on kernel GPUs)",
                _flash_torch_why_not, forward=_flash_torch_forward),
    )
}
