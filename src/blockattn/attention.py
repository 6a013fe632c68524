"""The public ``block_attention`` function: argument handling around the custom ops."""

from __future__ import annotations

import math

import torch

from . import custom_ops
from .layout import validate


def _same_structure(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same offsets: the same tensor, or equal values where comparing them is free (CPU); on a GPU comparing values
    would stall the host, so there only the shape is compared."""
    if a is b:
        return True
    if a.shape != b.shape or a.device != b.device:
        return False
    return a.device.type != "cpu" or torch.equal(a, b)


def _unpack_nested(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``torch.jagged`` nested tensors ``[B, j, H, D]`` -> their ``[N, H, D]`` values and shared offsets."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_nested or t.layout != torch.jagged:
            raise TypeError(f"{name} must be a nested tensor with layout=torch.jagged when q is one")
        if t.dim() != 4 or t._ragged_idx != 1:
            raise ValueError(f"{name} must be a jagged nested tensor of shape [B, j, H, D], got {t.shape}")
    offsets = q.offsets()
    for name, t in (("k", k), ("v", v)):
        if not _same_structure(t.offsets(), offsets):
            raise ValueError(f"{name} must have the same jagged structure (offsets) as q")
    return q.values(), k.values(), v.values(), offsets


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor | None = None,
    *,
    block_size: int = 64,
    scale: float | None = None,
) -> torch.Tensor:
    """Block-diagonal attention on jagged sequences.

    Every sequence ``b`` (rows ``offsets[b]:offsets[b+1]``) is cut into blocks of ``block_size`` tokens from its
    first token; each token attends, bidirectionally, to the tokens of its own block only:
    ``out[i] = softmax(scale * q[i] @ K_block.T) @ V_block``.

    Args:
        q: ``[N, Hq, D]`` queries of all sequences packed back to back, or a ``torch.jagged`` nested tensor
            ``[B, j, Hq, D]`` (then ``k`` and ``v`` are nested too, ``offsets`` is taken from ``q``, and the result
            is a nested tensor with the same structure).
        k, v: ``[N, Hkv, D]`` with ``Hq % Hkv == 0``: query head ``h`` uses key/value head ``h // (Hq // Hkv)``.
        offsets: ``[B + 1]`` int32/int64, ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == N``, on the device
            of ``q``. Length-0 sequences are allowed.
        block_size: 16, 32, 64 or 128.
        scale: score scale, ``1 / sqrt(D)`` by default.

    ``D`` is a multiple of 8 in [16, 256]. On CUDA the Triton kernels run; fp16 and bf16 multiply in their own
    precision with fp32 accumulation and an fp32 softmax; float32 inputs are computed in true fp32 (no TF32).
    On the CPU a PyTorch implementation of the same semantics runs in fp32. Gradients flow to ``q``, ``k`` and
    ``v``; the backward is deterministic.

    Validation: shapes, dtypes, devices and options raise ``TypeError``/``ValueError`` before any kernel runs.
    The values of ``offsets`` are checked with a ``ValueError`` on the CPU; on a GPU, reading them would stall the
    host, so they are checked by a device-side assertion that fails the next synchronising call, and the kernels
    never read or write outside ``[0, N)`` even for bad offsets.
    """
    nested = isinstance(q, torch.Tensor) and q.is_nested
    if nested:
        if offsets is not None:
            raise ValueError("offsets must be None when q, k, v are nested tensors (their offsets are used)")
        nested_q = q
        q, k, v, offsets = _unpack_nested(q, k, v)
    elif offsets is None:
        raise TypeError("offsets is required when q, k, v are [N, H, D] tensors")
    validate(q, k, v, offsets, block_size, scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out = custom_ops.block_attention_fwd(q, k, v, offsets, block_size, scale)[0]
    if nested:
        return torch.nested.nested_tensor_from_jagged(out, offsets, min_seqlen=nested_q._maybe_min_seqlen,
                                                      max_seqlen=nested_q._maybe_max_seqlen)
    return out
