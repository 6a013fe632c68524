"""Plain PyTorch references: the semantics of docs/semantics.md written as directly as possible, and the accuracy
measure of its "Accuracy" section.

These loop over sequences and blocks in Python; they are for tests and accuracy reports, not for speed. With the
default ``compute_dtype=torch.float64`` they are the ground truth; with the inputs' own low-precision dtype they are
"PyTorch's error in the same precision" that the kernels' error is compared with.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch


def block_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    block_size: int = 64,
    scale: float | None = None,
    causal: bool = False,
    pos_bias: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None,
    time_bias: torch.Tensor | None = None,
    time_bucket_width: float = 0.301,
    dropout_p: float = 0.0,
    dropout_mask: Callable[[int, int], torch.Tensor] | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Block-diagonal attention on jagged ``[N, H, D]`` tensors with the in-block options of docs/semantics.md;
    differentiable (in ``q``, ``k``, ``v`` and the biases); returns ``compute_dtype``. ``dropout_mask(start,
    length)`` gives the kept probabilities ``[Hq, length, length]`` (bool) of the block starting at token
    ``start``."""
    _, hq, d = q.shape
    group = hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    pieces = []
    bounds = offsets.tolist()
    for seq_start, seq_end in itertools.pairwise(bounds):
        for start in range(seq_start, seq_end, block_size):
            end = min(start + block_size, seq_end)
            qb, kb, vb = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [H, L, D]
            scores = (qb @ kb.transpose(1, 2)) * scale
            i = torch.arange(end - start, device=q.device)[:, None]
            j = torch.arange(end - start, device=q.device)[None, :]
            if pos_bias is not None:
                scores = scores + pos_bias.to(compute_dtype)[:, j - i + block_size - 1]
            if time_bias is not None:
                buckets = _time_bucket(timestamps[start:end], time_bias.shape[1], time_bucket_width)
                scores = scores + time_bias.to(compute_dtype)[:, buckets]
            if causal:
                scores = scores.masked_fill(j > i, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            if dropout_p > 0:
                probs = probs * dropout_mask(start, end - start) / (1 - dropout_p)
            pieces.append((probs @ vb).transpose(0, 1))
    if not pieces:
        return q.new_zeros(0, hq, d)
    return torch.cat(pieces, dim=0)


def _time_bucket(times: torch.Tensor, num_buckets: int, width: float) -> torch.Tensor:
    """``[L, L]`` buckets ``min(B - 1, floor(ln(max(|t_j - t_i|, 1)) / width))``, ``|t_j - t_i|`` taken exactly
    (integers) or in fp32 (floats) and rounded to fp32, as docs/semantics.md defines it."""
    if times.dtype.is_floating_point:
        dt = (times.float()[None, :] - times.float()[:, None]).abs()
    else:
        dt = (times.long()[None, :] - times.long()[:, None]).abs().float()
    dt = dt.double().masked_fill(dt.isnan(), 0.0)  # a NaN difference counts as 0; an infinite one: the last bucket
    return torch.floor(torch.log(dt.clamp(min=1.0)) / width).clamp(max=num_buckets - 1).long()


def flash_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    causal: bool = False,
    bottom_right: bool = False,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over whole sequences of packed ``q [Nq, Hq, D]``, ``k, v [Nk, Hkv, D]`` (docs/semantics.md, "Flash
    attention"): ``(out [Nq, Hq, D], lse [Hq, Nq])`` in ``compute_dtype``. Under ``causal`` query ``i`` sees keys
    ``j <= i`` (top-left) or ``j <= i + Sk - Sq`` (``bottom_right``); a row that sees no key gives 0 and ``-inf``."""
    hq, d = q.shape[1:]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    group = hq // k.shape[1]
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    out = q.new_zeros(q.shape)
    lse = q.new_full((hq, q.shape[0]), float("-inf"))
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]):
        qs = q[q0:q1].transpose(0, 1)
        ks, vs = (t[k0:k1].transpose(0, 1).repeat_interleave(group, dim=0) for t in (k, v))
        scores = (qs @ ks.transpose(1, 2)) * scale
        if causal:
            shift = (k1 - k0) - (q1 - q0) if bottom_right else 0
            i = torch.arange(q1 - q0, device=q.device)[:, None]
            j = torch.arange(k1 - k0, device=q.device)[None, :]
            scores = scores.masked_fill(j > i + shift, float("-inf"))
        seen = (scores > float("-inf")).any(-1, keepdim=True)
        probs = torch.where(seen, torch.softmax(scores.masked_fill(~seen, 0.0), dim=-1), 0.0)
        out[q0:q1] = (probs @ vs).transpose(0, 1)
        lse[:, q0:q1] = torch.logsumexp(scores, dim=-1)
    return out, lse


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


def random_angles(num_tokens: int, head_dim: int, device="cpu", generator: torch.Generator | None = None
                  ) -> torch.Tensor:
    """``sinu_pos = [sin | cos]`` of angles drawn uniformly in ``[0, 2 pi)``, ``[N, D]`` float32 (callers cast)."""
    theta = torch.rand(num_tokens, head_dim // 2, device=device, generator=generator) * 2 * math.pi
    return torch.cat([theta.sin(), theta.cos()], dim=1)


def quantised_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t8, descale)``: ``t`` quantised per tensor to float8_e4m3fn (its largest magnitude at e4m3's largest
    finite value, 448), with ``t ~ t8 * descale``."""
    descale = (t.abs().amax().float() / 448.0).clamp(min=1e-12).reshape(1)
    return (t / descale).to(torch.float8_e4m3fn), descale


def snr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-noise ratio of ``out`` against ``ref`` in dB: ``10 log10(|ref|^2 / |out - ref|^2)``."""
    noise = (out.double() - ref.double()).pow(2).sum().item()
    return 10 * math.log10(ref.double().pow(2).sum().item() / max(noise, 1e-300))
