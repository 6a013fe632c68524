"""fp8 inputs of the block-attention forward (inference): ``float8_e4m3fn`` q, k, v with float32 descales, and the
output's dtype (bf16, fp16, fp32, or fp8 with its own scale). docs/semantics.md, "fp8 inference".

The kernels read the fp8 bytes and widen them to fp16 in registers (exact: every e4m3 value is an fp16 value), so
both products run on 16-bit tensor cores with fp32 accumulation and the probabilities stay fp16: the kernel moves
half the bytes of a 16-bit one and stays memory-bound, at 16-bit accuracy on the dequantised inputs. The descales
are read on the device (never on the host): the scores are scaled by ``q_descale * k_descale`` before the softmax,
the output by ``v_descale``, and an fp8 output by ``1 / out_scale`` then saturated to e4m3's range.

``qkv_block_attention`` of float8 ``x`` and ``w`` first quantises its packed projection (:func:`projection`): the
attention then reads fp8 q, k, v whose descale is ``qkv_scale``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import devices

FP8_DTYPE = torch.float8_e4m3fn
# The largest finite e4m3fn value: fp8 outputs saturate to it rather than overflow to NaN.
FP8_MAX = 448.0
# The output of fp8 inputs where no out_dtype is given.
DEFAULT_OUT_DTYPE = torch.bfloat16


def out_dtype_of(dtype: torch.dtype, out_dtype: torch.dtype | None) -> torch.dtype | None:
    """The output's dtype of inputs of ``dtype``: bfloat16 when left out (None) for float8 inputs; as given
    otherwise (None: the inputs' own)."""
    return DEFAULT_OUT_DTYPE if dtype == FP8_DTYPE and out_dtype is None else out_dtype


class Fp8Scales(NamedTuple):
    """The dequantisation of fp8 inputs (``q = q8 * q_descale``, ...; 1-element float32 tensors on the device) and
    the output: ``out_dtype``, with ``out_scale`` for an fp8 output (``out = out8 * out_scale``)."""

    q_descale: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor
    out_dtype: torch.dtype
    out_scale: torch.Tensor | None = None

    def kernel_args(self) -> dict:
        return {"q_descale_ptr": self.q_descale, "k_descale_ptr": self.k_descale, "v_descale_ptr": self.v_descale,
                "out_scale_ptr": self.out_scale if self.out_scale is not None else self.v_descale}


def no_scales_args(like: torch.Tensor) -> dict:
    """The kernels' fp8 arguments for 16- and 32-bit inputs: stand-ins, never read."""
    return dict.fromkeys(("q_descale_ptr", "k_descale_ptr", "v_descale_ptr", "out_scale_ptr"), like)


def dequantized(t: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``t * descale`` in ``dtype`` (the PyTorch paths' view of an fp8 input)."""
    return t.to(dtype) * descale.to(dtype)


def output(out: torch.Tensor, scales: Fp8Scales) -> torch.Tensor:
    """A float32 result in ``scales.out_dtype``: divided by ``out_scale`` and saturated for fp8."""
    if scales.out_dtype == FP8_DTYPE:
        return saturated_fp8(out, scales.out_scale)
    return out.to(scales.out_dtype)


def saturated_fp8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t / scale`` in e4m3, saturated to ``±FP8_MAX`` (e4m3fn has no infinity: an overflow would be NaN)."""
    return (t / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def projection(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, x_descale: torch.Tensor,
               w_descale: torch.Tensor, qkv_scale: torch.Tensor) -> torch.Tensor:
    """The packed fp8 projection ``e4m3(((x * x_descale) @ (w * w_descale) + bias) / qkv_scale)``, saturated to
    ``±FP8_MAX``. One ``torch._scaled_mm`` (fp8 tensor cores, fp32 accumulation) where it takes the layouts: on a
    GPU with fp8 tensor cores, ``x`` row-major and ``w`` column-major (``linear.weight.t()`` is), ``d_model`` and
    the projection's width multiples of 16. ``1 / qkv_scale`` is folded into ``x``'s scale and the bias divided by
    it, rather than passed as ``scale_result``, which CUDA ignores in torch 2.10 and 2.11 (pytorch#190449).
    Elsewhere (the CPU, other layouts) in float32 through the dequantised operands."""
    if _scaled_mm_takes(x, w):
        # A zero bias where none is given: one epilogue (a bf16 vector of the projection's width) for both cases.
        bias = x.new_zeros(w.shape[1], dtype=torch.float32) if bias is None else bias.float()
        return torch._scaled_mm(x, w, x_descale / qkv_scale, w_descale, bias=(bias / qkv_scale).to(torch.bfloat16),
                                out_dtype=FP8_DTYPE)
    out = dequantized(x, x_descale) @ dequantized(w, w_descale)
    if bias is not None:
        out = out + bias.float()
    return saturated_fp8(out, qkv_scale)


def _scaled_mm_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (x.device.type == "cuda" and devices.kernels_run_on(x.device) and devices.fp8_reason(x.device) is None
            and x.shape[0] > 0 and x.shape[1] % 16 == 0 and w.shape[1] % 16 == 0
            and x.stride() == (x.shape[1], 1) and w.stride() == (1, w.shape[0]))
