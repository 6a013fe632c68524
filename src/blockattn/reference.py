"""Plain PyTorch references: the semantics of docs/semantics.md written as directly as possible, and the accuracy
measure of its "Accuracy" section.

These loop over sequences and blocks in Python; they are for tests and accuracy reports, not for speed. With the
default ``compute_dtype=torch.float64`` they are the ground truth; with the inputs' own low-precision dtype they are
"PyTorch's error in the same precision" that the kernels' error is compared with.
"""

from __future__ import annotations

import math

import torch


def block_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    block_size: int = 64,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Block-diagonal attention on jagged ``[N, H, D]`` tensors; differentiable; returns ``compute_dtype``."""
    n, hq, d = q.shape
    group = hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    pieces = []
    bounds = offsets.tolist()
    for seq_start, seq_end in zip(bounds[:-1], bounds[1:]):
        for start in range(seq_start, seq_end, block_size):
            end = min(start + block_size, seq_end)
            qb, kb, vb = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [H, L, D]
            scores = (qb @ kb.transpose(1, 2)) * scale
            pieces.append((torch.softmax(scores, dim=-1) @ vb).transpose(0, 1))
    if not pieces:
        return q.new_zeros(0, hq, d)
    return torch.cat(pieces, dim=0)


def rotary_reference(
    x: torch.Tensor,
    sinu_pos: torch.Tensor,
    *,
    inverse: bool = False,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Rotary embedding with interleaved pairs (docs/semantics.md, "Rotary") of ``[N, H, D]`` by
    ``sinu_pos = [sin | cos]``, ``[N, D]``:
    ``y[2i] = x[2i] cos_i - x[2i+1] sin_i``, ``y[2i+1] = x[2i+1] cos_i + x[2i] sin_i``; ``inverse`` turns the other
    way (``sin -> -sin``). Differentiable in ``x``; returns ``compute_dtype``."""
    half = x.shape[-1] // 2
    sin = sinu_pos[:, None, :half].to(compute_dtype)
    cos = sinu_pos[:, None, half:].to(compute_dtype)
    if inverse:
        sin = -sin
    x = x.to(compute_dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)


def snr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-noise ratio of ``out`` against ``ref`` in dB: ``10 log10(|ref|^2 / |out - ref|^2)``."""
    noise = (out.double() - ref.double()).pow(2).sum().item()
    return 10 * math.log10(ref.double().pow(2).sum().item() / max(noise, 1e-300))
