"""The PyTorch path of flash attention: any device (the CPU, GPUs the kernels do not serve), the kernels' semantics.

Sequence by sequence, queries in chunks of ``QUERY_CHUNK`` rows so that memory stays ``O(chunk x Sk)``; computed in
fp32 (float64 for float64 inputs). fp8 inputs are dequantised (``q * q_descale`` ...) first. A row that sees no key
gives 0 and a log-sum-exp of ``-inf``.
"""

from __future__ import annotations

import torch

from . import fp8

QUERY_CHUNK = 1024


def _attend(q, k, v, scale, causal, shift, first_row):
    """``(out, lse)`` of queries ``[Hq, M, D]`` (rows ``first_row ...`` of their sequence) on ``[Hq, Sk, D]``."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(first_row, first_row + q.shape[1], device=q.device)[:, None]
        hidden = torch.arange(k.shape[1], device=q.device)[None, :] > rows + shift
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    seen = lse > float("-inf")
    probs = torch.exp(scores - torch.where(seen, lse, 0.0)[..., None])
    return probs @ v, lse


def flash_attention_fwd_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, scale: float, causal: bool, bottom_right: bool,
                              out_dtype: torch.dtype, descales) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` as ``ops.flash_attention.flash_attention_fwd_triton`` returns them, for dense ``[B, S, H, D]``
    (``cu_seqlens_q`` None) or packed ``[N, H, D]`` inputs."""
    dense = cu_seqlens_q is None
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    if descales is not None:
        q, k, v = (fp8.dequantized(t, s, compute) for t, s in zip((q, k, v), descales))
    q, k, v = (t.to(compute) for t in (q, k, v))
    if dense:
        batch, seqlen_q = q.shape[:2]
        seqlen_k = k.shape[1]
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))
        bounds_q = [b * seqlen_q for b in range(batch + 1)]
        bounds_k = [b * seqlen_k for b in range(batch + 1)]
    else:
        bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    hq = q.shape[1]
    group = hq // k.shape[1]
    out = q.new_zeros(q.shape)
    lse = q.new_full((hq, q.shape[0]), float("-inf"))
    for q0, q1, k0, k1 in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:]):
        ks, vs = (t[k0:k1].transpose(0, 1).repeat_interleave(group, dim=0) for t in (k, v))
        shift = (k1 - k0) - (q1 - q0) if bottom_right else 0
        for first in range(0, q1 - q0, QUERY_CHUNK):
            rows = slice(q0 + first, min(q0 + first + QUERY_CHUNK, q1))
            o, l = _attend(q[rows].transpose(0, 1), ks, vs, scale, causal, shift, first)
            out[rows], lse[:, rows] = o.transpose(0, 1), l
    if dense:
        out = out.unflatten(0, (batch, seqlen_q))
        lse = lse.unflatten(1, (batch, seqlen_q)).transpose(0, 1).contiguous()  # [B, H, Sq], as the kernels
    return out.to(out_dtype), lse.float()
