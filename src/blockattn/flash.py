"""The public flash-attention functions (whole sequences, dense and varlen): argument handling around the custom op."""

from __future__ import annotations

import math

import torch

from . import checks, custom_ops
from .call_cache import CallCache
from .ops import fp8

_CALLS = CallCache(custom_ops.flash_attention_replay)

_DOC_COMMON = """
    Under ``causal``, query ``i`` sees keys ``j <= i`` (``causal_alignment="top_left"``, as
    ``scaled_dot_product_attention(is_causal=True)``) or ``j <= i + Sk - Sq`` (``"bottom_right"``, as
    FlashAttention when ``Sq != Sk``). A query row that sees no key (an empty key sequence, or a bottom-right row
    above the diagonal) outputs 0 and a log-sum-exp of ``-inf``. GQA/MQA: query head ``h`` uses key/value head
    ``h // (Hq // Hkv)``.

    Args:
        scale: score scale, ``1 / sqrt(D)`` by default.
        return_lse: also return the natural log-sum-exp of each row's scaled scores (float32).
        out_dtype: the output's dtype: ``q``'s by default (bfloat16 for fp8 inputs); bfloat16, float16 or float32
            (float64 too on the CPU).
        q_descale, k_descale, v_descale: for ``float8_e4m3fn`` inputs only, and then required: 1-element float32
            tensors on the inputs' device (read on the device, never on the host); the result is that of the
            dequantised inputs ``q * q_descale`` etc.
        variant: ``"pipelined"`` (pointer loads, software-pipelined; NVIDIA GPUs from Ampere on),
            ``"warp_specialized"`` (TMA loads by producer warps, consumer warps computing; Hopper on: a Gluon
            kernel on Hopper, fp8 included, Triton's elsewhere, 16-bit) or ``"auto"`` (the dispatcher's choice,
            ``python -m blockattn info``). Where the kernels do not run (the CPU, other
            devices) a PyTorch path of the same semantics runs, whatever the variant is.

    ``D`` is a multiple of 8 in [16, 256]. The kernels take float16, bfloat16 and float8_e4m3fn (fp8 needs fp8
    tensor cores: compute capability 8.9+; an Ampere GPU refuses it); they multiply in the inputs' precision with
    fp32 accumulation and an fp32 softmax. fp8 quantises the probabilities to fp8 (scaled by 256 first) for the ``P V`` product, as FA3 does
    (docs/semantics.md, "Flash attention"). The PyTorch path also takes float32 (and float64 on the CPU) and computes
    in fp32 (float64); on the kernels' GPUs it runs float32 inputs and inputs with a strided last dimension.
    Forward only: no gradient flows (the inputs must not require one).
    Bad arguments raise ``TypeError``/``ValueError`` before any kernel runs."""


def _attend(q, k, v, cu_seqlens, max_seqlens, *, causal, causal_alignment, scale, return_lse, out_dtype, q_descale,
            k_descale, v_descale, variant):
    """Both public functions past their own argument checks: the common checks, then the custom op."""
    args = (q, k, v, *cu_seqlens, *max_seqlens, causal, causal_alignment, scale, return_lse, out_dtype, q_descale,
            k_descale, v_descale, variant)
    key, replay = _CALLS.lookup(args)
    if replay is not None:
        out, lse = replay(args)
    else:
        checks.no_func_derivatives("flash_attention" if cu_seqlens[0] is None else "flash_attention_varlen", q, k, v)
        cu_seqlens = tuple(map(checks.contiguous_offsets, cu_seqlens))
        checks.flash_call(q, k, v, *cu_seqlens, *max_seqlens, causal, causal_alignment, scale, return_lse, out_dtype,
                          q_descale, k_descale, v_descale, variant)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        out_dtype = fp8.out_dtype_of(q.dtype, out_dtype) or q.dtype
        max_seqlens = tuple(None if m is None else checks.plain(m) for m in max_seqlens)
        inputs = (q, k, v, *cu_seqlens, *max_seqlens, scale, causal, causal_alignment == "bottom_right", out_dtype,
                  q_descale, k_descale, v_descale, variant)
        out, lse = custom_ops.flash_attention(*inputs)
        _CALLS.learn(key, args, inputs)
    return (out, lse) if return_lse else out


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    causal_alignment: str = "top_left",
    scale: float | None = None,
    return_lse: bool = False,
    out_dtype: torch.dtype | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    variant: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over whole sequences, ``out = softmax(scale * Q K^T + mask) V``, on dense tensors.

    ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]`` (``Hq % Hkv == 0``); returns ``out [B, Sq, Hq, D]``, and with
    ``return_lse`` also ``lse [B, Hq, Sq]``.
    """
    return _attend(q, k, v, (None, None), (None, None), causal=causal, causal_alignment=causal_alignment,
                   scale=scale, return_lse=return_lse, out_dtype=out_dtype, q_descale=q_descale,
                   k_descale=k_descale, v_descale=v_descale, variant=variant)


def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    causal_alignment: str = "top_left",
    scale: float | None = None,
    return_lse: bool = False,
    out_dtype: torch.dtype | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    variant: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over whole sequences packed back to back (varlen).

    ``q [Nq, Hq, D]``, ``k, v [Nk, Hkv, D]``; sequence ``b`` has queries ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and
    keys ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` (``[B + 1]`` int32/int64 on the inputs' device, starting at 0,
    non-decreasing, ending at ``Nq``/``Nk``; length-0 sequences allowed). Returns ``out [Nq, Hq, D]``, and with
    ``return_lse`` also ``lse [Hq, Nq]``.

    No host synchronisation: the grid comes from the shapes (one program per possible tile of query rows), never from
    reading ``cu_seqlens`` on the host, so the call works under ``torch.compile(fullgraph=True)`` and CUDA graphs
    (new ``cu_seqlens`` values of the same shapes replay correctly). ``max_seqlen_q`` and ``max_seqlen_k``, optional
    ints, are upper bounds on the sequences' lengths: ``max_seqlen_q`` shrinks the grid. Their values, like
    those of ``cu_seqlens``, are checked with a ``ValueError`` on the CPU and by a device-side assertion on a GPU
    (it fails the next synchronising call); the kernels never read or write out of bounds meanwhile.
    """
    if cu_seqlens_q is None:  # what would make it the dense call
        raise TypeError("cu_seqlens_q must be a tensor [B + 1]; for [B, S, H, D] inputs use flash_attention")
    return _attend(q, k, v, (cu_seqlens_q, cu_seqlens_k), (max_seqlen_q, max_seqlen_k), causal=causal,
                   causal_alignment=causal_alignment, scale=scale, return_lse=return_lse, out_dtype=out_dtype,
                   q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, variant=variant)


for _fn in (flash_attention, flash_attention_varlen):
    if _fn.__doc__:  # None under python -OO
        _fn.__doc__ += _DOC_COMMON
