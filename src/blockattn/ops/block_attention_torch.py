"""The PyTorch path: block attention and the rotary in plain PyTorch ops, on any device (the CPU, and GPUs the
kernels do not serve). Written apart from ``reference.py``, the tests' oracle, so the two check each other.

Blocks are gathered into padded ``[slots, H, BS, D]`` tensors (``block_table.block_rows``), computed in fp32 (float64
for float64 inputs) and scattered back. The semantics are the kernels' (docs/semantics.md): each row's softmax over
the valid keys of its block, and a NaN or inf in an input stays in its own block and head, and shows.
"""

from __future__ import annotations

import torch

from ..block_table import BlockTable, block_rows
from . import fp8
from .in_block import InBlock, abs_time_deltas, bucket_edges, dropout_keep, time_buckets
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
    """The gathered blocks of one call, the probabilities of their scores (biased and masked by the in-block
    options) and the dropout factors (``keep``, None without dropout)."""

    def __init__(self, q, k, v, offsets, table: BlockTable, block_size: int, scale: float, options: InBlock):
        group = q.shape[1] // k.shape[1]
        self.options = options
        self.rows, self.valid = block_rows(offsets, table, block_size)
        self.q = _gather_blocks(q, self.rows, self.valid)
        self.k, self.v = (_gather_blocks(t, self.rows, self.valid).repeat_interleave(group, dim=1) for t in (k, v))
        # Padding slots have no valid key at all: let them see every (zero) key rather than none, so that their
        # softmax (dropped with the padding) is finite, while a NaN of a real block stays in its block.
        key_ok = self.valid | ~self.valid.any(-1, keepdim=True)
        scores = (self.q @ self.k.transpose(-1, -2)) * scale
        self.buckets = None
        if options.pos_bias is not None:
            scores = scores + options.pos_bias.to(scores.dtype)[:, _relative_positions(block_size, q.device)]
        if options.time_bias is not None:
            times = options.timestamps[self.rows.clamp(0, q.shape[0] - 1)] if q.shape[0] else self.rows
            edges = bucket_edges(options.time_bias.shape[1], options.bucket_width, q.device)
            self.buckets = time_buckets(abs_time_deltas(times[:, :, None], times[:, None, :]), edges)
            scores = scores + options.time_bias.to(scores.dtype)[:, self.buckets].transpose(0, 1)
        if options.causal:
            above = torch.ones(block_size, block_size, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(above, float("-inf"))
        self.p = torch.softmax(scores.masked_fill(~key_ok[:, None, None, :], float("-inf")), dim=-1)
        self.keep = None
        if options.dropout_p > 0:
            keep = dropout_keep(options.seed, self.rows[:, 0], q.shape[1], block_size, options.dropout_p)
            self.keep = keep.to(self.p.dtype) / (1 - options.dropout_p)

    def dropped(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.keep is None else x * self.keep

    def scatter(self, blocks: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return _scatter_blocks(blocks, self.rows, self.valid, num_tokens)

    def bias_grads(self, ds: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The biases' gradients from ``ds = dL/ds(i, j)`` ``[slots, H, BS, BS]``, summed in a fixed order."""
        pos_bias, time_bias = self.options.pos_bias, self.options.time_bias
        dpos = dtime = None
        if pos_bias is not None:
            block_size = ds.shape[-1]
            one_hot = torch.nn.functional.one_hot(_relative_positions(block_size, ds.device).flatten(),
                                                  2 * block_size - 1).to(ds.dtype)
            dpos = (ds.sum(0).flatten(1) @ one_hot).to(pos_bias.dtype)
        if time_bias is not None:
            per_bucket = [torch.where(self.buckets[:, None] == b, ds, 0).sum((0, 2, 3))
                          for b in range(time_bias.shape[1])]
            dtime = torch.stack(per_bucket, dim=1).to(time_bias.dtype)
        return dpos, dtime


def _relative_positions(block_size: int, device: torch.device) -> torch.Tensor:
    """``[BS, BS]``: the position bias column of query ``i`` and key ``j``, ``j - i + BS - 1``."""
    offs = torch.arange(block_size, device=device)
    return offs[None, :] - offs[:, None] + block_size - 1


def block_attention_fwd_torch(q, k, v, offsets, table: BlockTable, block_size: int, scale: float,
                              sinu_pos: torch.Tensor | None, rotate: int, options: InBlock,
                              fp8_scales: fp8.Fp8Scales | None = None) -> torch.Tensor:
    """``out [N, Hq, D]`` in ``q``'s dtype; fp8 inputs (``fp8_scales``) dequantised, the output in its dtype."""
    n, dtype = q.shape[0], q.dtype
    if fp8_scales is not None:
        q, k, v = (fp8.dequantized(t, s) for t, s in zip((q, k, v), fp8_scales[:3]))
    blocks = _Blocks(*_turned_inputs(q, k, v, sinu_pos, rotate), offsets, table, block_size, scale, options)
    out = blocks.scatter(blocks.dropped(blocks.p) @ blocks.v, n)
    return out.to(dtype) if fp8_scales is None else fp8.output(out, fp8_scales)


def block_attention_bwd_torch(grad_out, q, k, v, offsets, table: BlockTable, block_size: int, scale: float,
                              sinu_pos: torch.Tensor | None, rotate: int, options: InBlock,
                              grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple:
    """Write ``(dq, dk, dv)``, the gradients of the unrotated inputs, into ``grads``; return the biases'."""
    n, hkv = q.shape[0], k.shape[1]
    group = q.shape[1] // hkv
    blocks = _Blocks(*_turned_inputs(q, k, v, sinu_pos, rotate), offsets, table, block_size, scale, options)
    dob = _gather_blocks(grad_out.to(blocks.q.dtype), blocks.rows, blocks.valid)
    p = blocks.p
    dp = blocks.dropped(dob @ blocks.v.transpose(-1, -2))
    ds_unscaled = p * (dp - (p * dp).sum(-1, keepdim=True))
    ds = ds_unscaled * scale
    per_kv_head = (hkv, group)
    block_grads = (ds @ blocks.k,
                   (ds.transpose(-1, -2) @ blocks.q).unflatten(1, per_kv_head).sum(2),
                   (blocks.dropped(p).transpose(-1, -2) @ dob).unflatten(1, per_kv_head).sum(2))
    for name, grad, result in zip("qkv", grads, block_grads):
        result = blocks.scatter(result, n)
        if sinu_pos is not None and rotate & ROTATE_BITS[name]:
            result = rotate_pairs(result, sinu_pos, inverse=True)
        grad.copy_(result)
    return blocks.bias_grads(ds_unscaled)
