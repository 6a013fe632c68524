"""What the kernels share: pointers, masks and stores of ``[rows, CHUNK]`` tiles of ``[N, ..., D]`` tensors, a grid
slot's block bounds, the softmax and ``dS`` of a score tile (also called from the Gluon kernels of
``block_attention_sm90``); the bits of the rotate mask; and the allocation of every kernel output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The operands a fused rotary turns, as bits of the ``rotate`` mask that the ops and kernels (``ROTATE``) take. The
# kernels read these constexprs (constant first, ``ROTATE_Q & ROTATE``: Triton's interpreter passes ``ROTATE`` as a
# plain int, which cannot take a constexpr on its right); Python code reads the ints below.
ROTATE_Q = tl.constexpr(1)
ROTATE_K = tl.constexpr(2)
ROTATE_V = tl.constexpr(4)
ROTATE_BITS = {"q": ROTATE_Q.value, "k": ROTATE_K.value, "v": ROTATE_V.value}
ROTATE_NONE = 0
ROTATE_ALL = ROTATE_Q.value | ROTATE_K.value | ROTATE_V.value


@triton.jit
def tile_ptrs(base, rows, col0, stride_n, stride_d, CHUNK: tl.constexpr):
    cols = col0 + tl.arange(0, CHUNK)
    return base + rows[:, None] * stride_n + cols[None, :] * stride_d


@triton.jit
def store_tile(base, rows, col0, stride_n, stride_d, value, mask, CHUNK: tl.constexpr):
    tl.store(tile_ptrs(base, rows, col0, stride_n, stride_d, CHUNK), value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def tile_mask(row_ok, col0, width, CHUNK: tl.constexpr, EVEN: tl.constexpr):
    """Rows in ``row_ok`` and columns ``col0 + j < width``; ``EVEN`` promises every column is in range."""
    if EVEN:
        # Constant along the row, so loads under this mask stay 16-byte vectorised.
        mask = tl.broadcast_to(row_ok[:, None], (row_ok.shape[0], CHUNK))
    else:
        cols = col0 + tl.arange(0, CHUNK)
        mask = row_ok[:, None] & (cols < width)[None, :]
    return mask


@triton.jit
def in_block_rows(rows, row_ok):
    """``rows`` (``start + arange``, a non-empty block) with those past the block's end replaced by its first row:
    every row is then in bounds, so loads need no predicate and no zero fill (the caller zeroes what must not
    count)."""
    return tl.where(row_ok, rows, rows - tl.arange(0, rows.shape[0]))


@triton.jit
def column_mask(col0, width, CHUNK: tl.constexpr, EVEN: tl.constexpr):
    """``None`` when ``EVEN`` promises every column ``col0 + j`` is below ``width``, else a ``[1, CHUNK]`` mask."""
    if EVEN:
        mask = None
    else:
        mask = (col0 + tl.arange(0, CHUNK) < width)[None, :]
    return mask


@triton.jit
def load_or_zero(ptrs, mask):
    """``tl.load`` with masked-off elements zero; ``mask`` ``None`` loads every element (no predicate)."""
    if mask is None:
        values = tl.load(ptrs)
    else:
        values = tl.load(ptrs, mask=mask, other=0.0)  # a float: an int 0 cannot become fp8
    return values


@triton.jit
def block_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, slot, num_seqs, num_tokens, BLOCK_SIZE: tl.constexpr):
    """First row and length of grid slot ``slot``'s block; length 0 for padding slots.

    Clamped to ``[0, N)`` so that offsets whose values were not checked on the host never cause an out-of-bounds
    access (see ``block_table.build_block_table``).
    """
    seq = tl.load(block_seq_ptr + slot)
    seq_c = tl.minimum(seq, num_seqs - 1)
    seq_start = tl.load(offsets_ptr + seq_c).to(tl.int64)
    seq_end = tl.load(offsets_ptr + seq_c + 1).to(tl.int64)
    nblocks = (seq_end - seq_start + BLOCK_SIZE - 1) // BLOCK_SIZE
    first_slot = tl.load(block_cum_ptr + seq_c).to(tl.int64) - nblocks
    start = seq_start + (slot - first_slot) * BLOCK_SIZE
    end = tl.minimum(start + BLOCK_SIZE, seq_end)
    start = tl.minimum(tl.maximum(start, 0), num_tokens)
    end = tl.minimum(tl.maximum(end, start), num_tokens)
    length = tl.where(seq < num_seqs, end - start, 0)
    return start, length


LOG2E = 1.4426950408889634  # softmax_probs takes the scale times this: exp(x) = exp2(x * log2(e))


@triton.jit
def softmax_probs(scores, col_ok, qk_scale_log2, bias=None):
    """Exact row softmax of a score tile whose every key lies in the tile (``col_ok`` masks the partial block);
    ``bias`` (log2 units, ``ops.in_block.score_bias``) is added to the scaled scores."""
    scores = scores * qk_scale_log2
    if bias is not None:
        scores = scores + bias
    scores = tl.where(col_ok[None, :], scores, float("-inf"))
    p = tl.exp2(scores - tl.max(scores, axis=1)[:, None])
    return p / tl.sum(p, axis=1)[:, None]


@triton.jit
def grad_scores(p, dp, dtype, scale):
    """``dS = P * (dP - rowsum(P * dP))``, times ``scale``: ``Di`` from the tile itself, no preprocessing pass and no
    ``o`` read."""
    return (p * (dp - tl.sum(p * dp, axis=1)[:, None]) * scale).to(dtype)


def rotary_operand(sinu_pos: torch.Tensor | None, like: torch.Tensor) -> tuple:
    """The kernels' rotary arguments ``(sinu_ptr, stride_sn, stride_sd)``; without angles (the rotate mask is then
    0) ``like`` stands in for the pointer and is never read."""
    if sinu_pos is None:
        return like, 0, 0
    return sinu_pos, *sinu_pos.stride()


def new_output(like: torch.Tensor, shape: tuple[int, ...] | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Allocation of every kernel output, like ``like`` or with another ``shape``/``dtype`` (one place, so tests can
    poison it: callers go through the module)."""
    return torch.empty(like.shape if shape is None else shape, dtype=dtype or like.dtype, device=like.device)
