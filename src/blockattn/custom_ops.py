"""``torch.library`` custom ops: device dispatch, fake (meta) implementations, autograd and FLOP formulas.

The ops are opaque to ``torch.compile`` (one node each, no graph break) and their fake implementations give the
output metadata without running anything. The forward also returns the block table it built, so that the
backward reuses it instead of building it again.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from .layout import block_table, max_blocks
from .ops import block_attention as impl


@torch.library.custom_op("blockattn::block_attention_fwd", mutates_args=())
def block_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, block_size: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(out, block_cum, block_seq)``; the last two are the block table (``layout.block_table``)."""
    block_cum, block_seq = block_table(offsets, q.shape[0], block_size)
    run = impl.block_attention_fwd_triton if q.device.type == "cuda" else impl.block_attention_fwd_torch
    return run(q, k, v, offsets, block_cum, block_seq, block_size, scale), block_cum, block_seq


@block_attention_fwd.register_fake
def _(q, k, v, offsets, block_size, scale):
    num_seqs = offsets.shape[0] - 1
    return (
        torch.empty_like(q),
        offsets.new_empty(num_seqs, dtype=torch.int32),
        offsets.new_empty(max_blocks(q.shape[0], num_seqs, block_size), dtype=torch.int32),
    )


@torch.library.custom_op("blockattn::block_attention_bwd", mutates_args=())
def block_attention_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    block_cum: torch.Tensor,
    block_seq: torch.Tensor,
    block_size: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    run = impl.block_attention_bwd_triton if q.device.type == "cuda" else impl.block_attention_bwd_torch
    return run(grad_out, q, k, v, offsets, block_cum, block_seq, block_size, scale)


@block_attention_bwd.register_fake
def _(grad_out, q, k, v, offsets, block_cum, block_seq, block_size, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, offsets, block_size, scale = inputs
    _, block_cum, block_seq = output
    ctx.mark_non_differentiable(block_cum, block_seq)
    ctx.save_for_backward(q, k, v, offsets, block_cum, block_seq)
    ctx.block_size, ctx.scale = block_size, scale


def _backward(ctx, grad_out, _grad_block_cum, _grad_block_seq):
    q, k, v, offsets, block_cum, block_seq = ctx.saved_tensors
    dq, dk, dv = block_attention_bwd(grad_out, q, k, v, offsets, block_cum, block_seq, ctx.block_size, ctx.scale)
    return dq, dk, dv, None, None, None


block_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def in_block_pairs(offsets: torch.Tensor, num_tokens: int, block_size: int) -> int:
    """Number of (query, key) pairs that attend, ``sum over blocks of len^2`` (an upper bound on fake tensors)."""
    if isinstance(offsets, torch._subclasses.FakeTensor) or offsets.device.type == "meta":
        return num_tokens * block_size
    lengths = (offsets[1:] - offsets[:-1]).long()
    full, rest = torch.div(lengths, block_size, rounding_mode="floor"), lengths % block_size
    return int((full * block_size * block_size + rest * rest).sum())


@register_flop_formula(torch.ops.blockattn.block_attention_fwd, get_raw=True)
def _fwd_flops(q, k, v, offsets, block_size, scale, *args, **kwargs) -> int:
    # Two matmuls (q k^T and p v) over the in-block pairs only: 4 * BS_eff * D per query row and head.
    return 4 * in_block_pairs(offsets, q.shape[0], block_size) * q.shape[1] * q.shape[2]


@register_flop_formula(torch.ops.blockattn.block_attention_bwd, get_raw=True)
def _bwd_flops(grad_out, q, k, v, offsets, block_cum, block_seq, block_size, scale, *args, **kwargs) -> int:
    # Five matmuls against the forward's two: 2.5x.
    return 10 * in_block_pairs(offsets, q.shape[0], block_size) * q.shape[1] * q.shape[2]
