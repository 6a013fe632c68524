"""Tile addressing shared by the kernels: pointers, masks and stores of ``[rows, CHUNK]`` tiles of ``[N, ..., D]``
tensors; and the allocation of every kernel output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
        values = tl.load(ptrs, mask=mask, other=0)
    return values


def new_output(like: torch.Tensor) -> torch.Tensor:
    """Allocation of every kernel output (one place, so tests can poison it: callers go through the module)."""
    return torch.empty_like(like)
