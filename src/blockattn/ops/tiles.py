"""What the kernels share: pointers, masks and stores of ``[rows, CHUNK]`` tiles of ``[N, ..., D]`` tensors, a grid
slot's block bounds, the softmax and ``dS`` of a score tile (also called from the Gluon kernels of
``block_attention_sm90``); the bits of the rotate mask; and the allocation of every kernel output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fp8

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
def sequence_blocks(offsets_ptr, idx, num_seqs, BLOCK_SIZE: tl.constexpr):
    """Lengths and block counts of sequences ``idx`` (0 past the last; a negative length, from bad offsets, counts no
    block, so that the grid slots stay in order)."""
    in_range = idx < num_seqs
    length = (tl.load(offsets_ptr + idx + 1, mask=in_range, other=0)
              - tl.load(offsets_ptr + idx, mask=in_range, other=0)).to(tl.int32)
    return length, tl.where(in_range, (tl.maximum(length, 0) + BLOCK_SIZE - 1) // BLOCK_SIZE, 0)


# Sequences a program reads at once where it finds its block in the offsets (no block table).
OFFSETS_CHUNK = tl.constexpr(64)
# The offsets' device-side assertion (one message for every argument name: a compiled kernel's message is fixed).
BAD_OFFSETS = tl.constexpr("blockattn: bad offsets or cu_seqlens: they must start at 0, be non-decreasing and end at "
                           "N, with no sequence above max_seqlen where that is given")


@triton.jit
def assert_offsets(offsets_ptr, num_seqs, num_tokens, max_len, CHUNK: tl.constexpr):
    """Whether the offsets are valid (``offsets[0] == 0``, non-decreasing, ``offsets[-1] == N``, no length above
    ``max_len``), read ``CHUNK`` sequences at a time, and asserted on the device where the kernel is compiled with
    ``debug`` (Triton's interpreter asserts nothing: hence the verdict)."""
    ok = (tl.load(offsets_ptr) == 0) & (tl.load(offsets_ptr + num_seqs) == num_tokens)
    for chunk in range(0, num_seqs, CHUNK):
        length = sequence_blocks(offsets_ptr, chunk + tl.arange(0, CHUNK), num_seqs, 1)[0]
        ok = ok & (tl.min(length, axis=0) >= 0) & (tl.max(length, axis=0) <= max_len)
    tl.device_assert(ok, BAD_OFFSETS)
    return ok


@triton.jit
def _slot_sequence(offsets_ptr, slot, num_seqs, BLOCK_SIZE: tl.constexpr, seqs):
    """Without a block table: the sequence that grid slot ``slot`` belongs to (``num_seqs`` for a padding slot) and
    its first slot, found by counting the blocks of the sequences in order, ``OFFSETS_CHUNK`` at a time (one chunk
    for the batches where the kernels run without a table). ``seqs``: ``arange(OFFSETS_CHUNK)`` in a layout of
    the calling Gluon kernel's (whose vectors need one), or None in a Triton kernel."""
    if seqs is None:
        seqs = tl.arange(0, OFFSETS_CHUNK)
    zero = (slot * 0).to(tl.int32)  # tl.zeros would need a layout in Gluon
    seq = zero
    first_slot = zero
    blocks = zero  # of the chunks read so far
    for chunk in range(0, num_seqs, OFFSETS_CHUNK):
        nblocks = sequence_blocks(offsets_ptr, chunk + seqs, num_seqs, BLOCK_SIZE)[1]
        # The sequences whose blocks all lie before the slot: a prefix, as block counts are not negative.
        before = (tl.cumsum(nblocks, axis=0) + blocks) <= slot
        seq += tl.sum(before.to(tl.int32), axis=0)
        first_slot += tl.sum(tl.where(before, nblocks, 0), axis=0)
        blocks += tl.sum(nblocks, axis=0)
    return seq, first_slot


@triton.jit
def block_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, slot, num_seqs, num_tokens, BLOCK_SIZE: tl.constexpr,
                 seqs=None):
    """First row and length of grid slot ``slot``'s block; length 0 for padding slots. From the block table, or
    without one (``block_seq_ptr`` None: ``block_table.OffsetsOnly``) from the offsets themselves (``seqs``: see
    :func:`_slot_sequence`).

    Clamped to ``[0, N)`` so that offsets whose values were not checked on the host never cause an out-of-bounds
    access (see ``block_table.build_block_table``).
    """
    if block_seq_ptr is None:
        seq, first_slot = _slot_sequence(offsets_ptr, slot, num_seqs, BLOCK_SIZE, seqs)
    else:
        seq = tl.load(block_seq_ptr + slot)
    seq_c = tl.minimum(seq, num_seqs - 1)
    seq_start = tl.load(offsets_ptr + seq_c).to(tl.int64)
    seq_end = tl.load(offsets_ptr + seq_c + 1).to(tl.int64)
    if block_seq_ptr is not None:
        first_slot = tl.load(block_cum_ptr + seq_c) - (seq_end - seq_start + BLOCK_SIZE - 1) // BLOCK_SIZE
    start = seq_start + (slot - first_slot) * BLOCK_SIZE
    end = tl.minimum(start + BLOCK_SIZE, seq_end)
    start = tl.minimum(tl.maximum(start, 0), num_tokens)
    end = tl.minimum(tl.maximum(end, start), num_tokens)
    length = tl.where(seq < num_seqs, end - start, 0)
    return start, length


# Blocks of fewer tokens run this many rows to a program (see blocks_per_tile).
TILE_ROWS = 64


def blocks_per_tile(block_size: int, head_dim: int, group: int, rotary: bool, in_block_bits: int,
                    backward: bool) -> int:
    """Blocks a program of the forward, or of the Hopper backward, runs at once: 4 of 16 tokens or 2 of 32 in one
    ``[64, 64]`` score tile masked to its blocks (:func:`tile_bounds`, :func:`same_block`), else 1. A grid slot's
    block is in ``table`` order, so consecutive slots' blocks are consecutive rows, and a tile's rows are too.
    Packed, these shapes take the 64-token kernels' launch rule (heads a program, warps) and, in the backward, the
    Hopper kernels, which need 64 rows a warpgroup; alone, a 16-token block gives the tensor cores [16, 16] tiles
    and under GQA reads k and v once per query head. Never with in-block options, whose tile code places a block's
    tokens by their row in the tile.

    Where it pays (H100 and H200, `ads`-like lengths, 8 query heads, bf16, time over the floor, one block a program
    -> 64-row tiles, same process; docs/benchmarks.md, 2026-11-28):

    - under GQA, the backward everywhere (H100 8:2 at D = 32-128 1.28-1.92x -> 1.06-1.35x, with a rotary and fp32
      angles 1.84-2.91x -> 1.38-1.98x; H200 1.71-2.68x -> 1.13-1.88x), the forward up to D = 128 (H100 1.15-2.13x
      -> 1.11-1.31x, rotary 1.98-3.34x -> 1.16-1.43x). At D = 256 a 64-row tile takes two head-dim slices and one
      program per query head: the forward lost there (H100 16-token blocks 1.07-1.26x -> 1.24-1.54x); with a
      rotary, where one block a program takes whole rows and the group (``kernel_config``), a tile doing the same
      (8 warps, one stage) lost too (H200 8:2, fp32 angles: 16-token blocks 2.31x against 1.55x, 32-token blocks
      2.23x against 1.59x);
    - without GQA, the backward (H100 1.01-1.41x -> 1.01-1.17x) but for the rotary from D = 4 * block_size (16-token
      blocks at D = 64, both at D = 128: H100 1.07-1.18x against 1.22-1.35x, H200 1.28-1.48x against 1.63-1.82x;
      below, H100 32-token blocks at D = 64 1.31x -> 1.14x), and the rotary forward (H100 1.54-2.50x -> 1.10-1.49x);
      not the plain forward, a tie or a loss (H100 32-token blocks at D = 32 1.23x against 1.40x, H200 16-token
      blocks at D = 128 1.11x against 1.29x)."""
    if block_size >= TILE_ROWS or in_block_bits:
        return 1
    if backward:
        alone = group == 1 and rotary and head_dim >= 4 * block_size
    else:
        alone = not rotary if group == 1 else head_dim > 128
    return 1 if alone else TILE_ROWS // block_size


@triton.jit
def _next_block(block_seq_ptr, block_cum_ptr, offsets_ptr, slot, num_seqs, num_tokens, start, end,
                BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, seqs):
    """Where slot ``slot``'s block begins in the tile that starts at row ``start`` (``TILE``, past every row, for a
    padding slot), and the tile's end with it (``end`` for a padding slot)."""
    first, length = block_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, slot, num_seqs, num_tokens, BLOCK_SIZE,
                                 seqs)
    return tl.where(length > 0, first - start, TILE), tl.where(length > 0, first + length, end)


@triton.jit
def tile_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, tile, num_seqs, num_tokens, TILE: tl.constexpr,
                BLOCKS: tl.constexpr, seqs=None):
    """First row and length of grid tile ``tile``: the blocks of slots ``tile * BLOCKS ...`` (``TILE // BLOCKS``
    tokens each; contiguous rows, the last ones possibly padding), and the rows, relative to the first, where its
    second, third and fourth blocks begin (``TILE`` where there is none). Length 0 for a tile of padding slots.
    With ``BLOCKS == 1``, :func:`block_bounds` (``seqs`` as there)."""
    BLOCK_SIZE: tl.constexpr = TILE // BLOCKS
    first = tile * BLOCKS
    start, length = block_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, first, num_seqs, num_tokens, BLOCK_SIZE,
                                 seqs)
    second = TILE
    third = TILE
    fourth = TILE
    if BLOCKS > 1:
        end = start + length
        second, end = _next_block(block_seq_ptr, block_cum_ptr, offsets_ptr, first + 1, num_seqs, num_tokens, start,
                                  end, BLOCK_SIZE, TILE, seqs)
        if BLOCKS > 2:
            third, end = _next_block(block_seq_ptr, block_cum_ptr, offsets_ptr, first + 2, num_seqs, num_tokens,
                                     start, end, BLOCK_SIZE, TILE, seqs)
            fourth, end = _next_block(block_seq_ptr, block_cum_ptr, offsets_ptr, first + 3, num_seqs, num_tokens,
                                      start, end, BLOCK_SIZE, TILE, seqs)
        length = tl.where(length > 0, end - start, 0)
    return start, length, second, third, fourth


@triton.jit
def same_block(offs_i, offs_j, second, third, fourth):
    """Whether tile rows ``offs_i`` and ``offs_j`` lie in one block of the tile (:func:`tile_bounds`), ``[i, j]``."""
    block_i = (offs_i >= second).to(tl.int32) + (offs_i >= third).to(tl.int32) + (offs_i >= fourth).to(tl.int32)
    block_j = (offs_j >= second).to(tl.int32) + (offs_j >= third).to(tl.int32) + (offs_j >= fourth).to(tl.int32)
    return block_i[:, None] == block_j[None, :]


LOG2E = 1.4426950408889634  # softmax_probs takes the scale times this: exp(x) = exp2(x * log2(e))
# fp8 outputs saturate to e4m3fn's largest finite value (kernels read globals as constexprs).
FP8_MAX = tl.constexpr(fp8.FP8_MAX)


@triton.jit
def fp8_score_scale(qk_scale_log2, q_descale_ptr, k_descale_ptr, FP8: tl.constexpr):
    """The score scale of a forward on fp8 inputs: times ``q_descale * k_descale``, read on the device (``ops.fp8``);
    other forwards' as it is."""
    if FP8:
        qk_scale_log2 = qk_scale_log2 * tl.load(q_descale_ptr) * tl.load(k_descale_ptr)
    return qk_scale_log2


@triton.jit
def fp8_out_factor(v_descale_ptr, out_scale_ptr, FP8: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """What the block forward on fp8 inputs multiplies its output by (:func:`fp8_output`): ``v_descale``, over
    ``out_scale`` for an fp8 output."""
    factor = 1.0
    if FP8:
        factor = tl.load(v_descale_ptr)
        if OUT_DTYPE == tl.float8e4nv:
            factor = factor / tl.load(out_scale_ptr)
    return factor


@triton.jit
def fp8_output(o, out_factor, FP8: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """An output tile of the block forward on fp8 inputs times ``out_factor`` (:func:`fp8_out_factor`), saturated
    for an fp8 output (e4m3fn has no infinity); other forwards' as it is."""
    if FP8:
        o = o * out_factor
        if OUT_DTYPE == tl.float8e4nv:
            o = tl.minimum(tl.maximum(o, -FP8_MAX), FP8_MAX)
    return o


@triton.jit
def softmax_probs(scores, col_ok, qk_scale_log2, bias=None, keys=None):
    """Exact row softmax of a score tile whose every key lies in the tile (``col_ok`` masks the partial block;
    ``keys``, ``[i, j]``, where given, the keys of each row: :func:`same_block`); ``bias`` (log2 units,
    ``ops.in_block.score_bias``) is added to the scaled scores."""
    scores = scores * qk_scale_log2
    if bias is not None:
        scores = scores + bias
    if keys is None:
        scores = tl.where(col_ok[None, :], scores, float("-inf"))
    else:
        scores = tl.where(col_ok[None, :] & keys, scores, float("-inf"))
    p = tl.exp2(scores - tl.max(scores, axis=1)[:, None])
    # A reciprocal a row and a multiply a score: a division per score compiles to div.full.f32, a MUFU.RCP and its
    # fix-ups (on an H200, 2026-11-28: 128-token blocks at D = 32 and 64 3-6% faster, elsewhere 0-3%)
    return p * (1.0 / tl.sum(p, axis=1))[:, None]


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
