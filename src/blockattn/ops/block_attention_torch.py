"""The PyTorch path: block attention and the rotary in plain PyTorch ops, on any device (the CPU, and GPUs the
kernels do not serve). Written apart from ``reference.py``, the tests' oracle, so the two check each other.

Blocks are gathered into padded ``[slots, H, BS, D]`` tensors (``block_table.block_rows``), computed in fp32 (float64
for float64 inputs) and scattered back. The semantics are the kernels' (docs/semantics.md): each row's softmax over
the valid keys of its block, and a NaN or inf in an input stays in its own block and head, and shows.
"""

from __future__ import annotations

import torch

from ..block_table import BlockTable, block_rows
from .tiles import ROTATE_BITS


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def rotate_pairs(x: torch.Tensor, sinu_pos: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``[N, H, D]`` with each pair ``(2i, 2i+1)`` turned by angle ``i`` of ``sinu_pos = [sin | cos]`` (by the
    opposite angle if ``inverse``), in the compute dtype."""
    dtype = _compute_dtype(x.dtype)
    half = x.shape[-1] // 2
    sin, cos = sinu_pos[:, None, :half].to(dtype), sinu_pos[:, None, half:].to(dtype)
    if inverse:
        sin = -sin
    x = x.to(dtype)
    pairs = x.unflatten(-1, (half, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)


def rotary_torch(x: torch.Tensor, sinu_pos: torch.Tensor, inverse: bool) -> torch.Tensor:
    """``apply_rotary``'s PyTorch path, in ``x``'s dtype (one rounding of the compute-dtype result)."""
    return rotate_pairs(x, sinu_pos, inverse).to(x.dtype)


def _gather_blocks(x: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[N, H, D]`` -> ``[slots, H, BS, D]``, zeros where ``valid`` is False (they read a zero row ``N``)."""
    padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
    return padded[torch.where(valid, rows, x.shape[0])].transpose(1, 2)


def _scatter_blocks(blocks: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Inverse of :func:`_gather_blocks`: padded rows go to a spare row ``N`` that is dropped."""
    out = blocks.new_empty((num_tokens + 1, blocks.shape[1], blocks.shape[-1]))
    out[torch.where(valid, rows, num_tokens).flatten()] = blocks.transpose(1, 2).flatten(0, 1)
    return out[:num_tokens]


def _turned_inputs(q, k, v, sinu_pos, rotate: int) -> tuple[torch.Tensor, ...]:
    """q, k, v in the compute dtype, the ones named by the ``rotate`` mask turned by ``sinu_pos``."""
    dtype = _compute_dtype(q.dtype)
    return tuple(rotate_pairs(t, sinu_pos) if sinu_pos is not None and rotate & ROTATE_BITS[name] else t.to(dtype)
                 for name, t in zip("qkv", (q, k, v)))


class _Blocks:
    """The gathered blocks of one call and the probabilities of their scores."""

    def __init__(self, q, k, v, offsets, table: BlockTable, block_size: int, scale: float):
        group = q.shape[1] // k.shape[1]
        self.rows, self.valid = block_rows(offsets, table, block_size)
        self.q = _gather_blocks(q, self.rows, self.valid)
        self.k, self.v = (_gather_blocks(t, self.rows, self.valid).repeat_interleave(group, dim=1) for t in (k, v))
        # Padding slots have no valid key at all: let them see every (zero) key rather than none, so that their
        # softmax (dropped with the padding) is finite, while a NaN of a real block stays in its block.
        key_ok = self.valid | ~self.valid.any(-1, keepdim=True)
        scores = (self.q @ self.k.transpose(-1, -2)) * scale
        self.p = torch.softmax(scores.masked_fill(~key_ok[:, None, None, :], float("-inf")), dim=-1)

    def scatter(self, blocks: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return _scatter_blocks(blocks, self.rows, self.valid, num_tokens)


def block_attention_fwd_torch(q, k, v, offsets, table: BlockTable, block_size: int, scale: float,
                              sinu_pos: torch.Tensor | None, rotate: int) -> torch.Tensor:
    """``out [N, Hq, D]`` in ``q``'s dtype."""
    n, dtype = q.shape[0], q.dtype
    blocks = _Blocks(*_turned_inputs(q, k, v, sinu_pos, rotate), offsets, table, block_size, scale)
    return blocks.scatter(blocks.p @ blocks.v, n).to(dtype)


def block_attention_bwd_torch(grad_out, q, k, v, offsets, table: BlockTable, block_size: int, scale: float,
                              sinu_pos: torch.Tensor | None, rotate: int,
                              grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """Write ``(dq, dk, dv)``, the gradients of the unrotated inputs, into ``grads``."""
    n, hkv = q.shape[0], k.shape[1]
    group = q.shape[1] // hkv
    blocks = _Blocks(*_turned_inputs(q, k, v, sinu_pos, rotate), offsets, table, block_size, scale)
    dob = _gather_blocks(grad_out.to(blocks.q.dtype), blocks.rows, blocks.valid)
    p = blocks.p
    dp = dob @ blocks.v.transpose(-1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True)) * scale
    per_kv_head = (hkv, group)
    block_grads = (ds @ blocks.k,
                   (ds.transpose(-1, -2) @ blocks.q).unflatten(1, per_kv_head).sum(2),
                   (p.transpose(-1, -2) @ dob).unflatten(1, per_kv_head).sum(2))
    for name, grad, result in zip("qkv", grads, block_grads):
        result = blocks.scatter(result, n)
        if sinu_pos is not None and rotate & ROTATE_BITS[name]:
            result = rotate_pairs(result, sinu_pos, inverse=True)
        grad.copy_(result)
