"""The forward of block attention on Hopper (sm_90), mostly under GQA: warp-specialised, persistent Gluon kernels,
their launcher, and when the dispatcher gives them a call (:func:`why_not`).

The Triton forward runs one chain a program (load, ``Q K^T``, softmax, ``P V``, store) with few programs an SM
under GQA, so too few loads are in flight for an H200's memory (Nsight Compute, 2026-11-28: half of a warp's wait on
its global loads, 3.25 TB/s at 8:2 against 4.15 without GQA). Here a producer warp keeps them in flight: a program
per multiprocessor takes work items (a 64-row tile of one block, or of four 16-token or two 32-token blocks, and one
kv head) in turn, and

- the producer warp lands each item's k and v tiles, then its query heads' q tiles, by TMA into rings in shared
  memory, each slot as soon as its consumer released it: two k/v slots a consumer, and q slots for the whole group
  where shared memory holds them (:func:`_q_slots`);
- two consumer warpgroups take the items in turn (even and odd), so that one's products and softmax run while the
  other's stores drain. For each query head of its item in turn a consumer computes ``S = Q K^T`` (wgmma from shared
  memory), the exact softmax of the whole tile (one tile holds every key: no online rescaling), ``O = P V`` with
  ``P`` in registers, and stores its rows of ``O``.

128-token blocks run in halves (:func:`_block_attention_fwd_sm90_halves_kernel`): an item is a block and a kv
head, whose k and v the producer lands once (two slots, each released by both consumers), and each consumer takes
64 of the block's query rows against its 128 keys (one consumer holding a 128-row score tile would need 128
registers a thread for it alone). The consumers zero the values past a partial block's end half each (for fp8
they widen every block's values half each), then wait for each other on a barrier.

Every program finds its items' bounds 32 at a time (one vector of loads for the batch instead of a chain of
dependent loads per item). Rows past the tile's end are the next block's (or TMA's zeros): their keys are masked,
their values zeroed in shared memory before the product (a NaN there must not reach this block), their outputs not
stored. In a tile of several blocks a NaN or inf in one block's values reaches the others, as in the Triton forward's
tiles (docs/semantics.md).

With a rotary (16 bits, 64-row tiles) the producer also lands each item's angles (``[sin | cos]`` rows, fp32 or the
inputs' dtype) into an angle tile of the item's consumer (two a consumer where shared memory holds them beside one
k/v slot and two q slots, else one: at D = 128 with fp32 angles; at D = 128 the angle tiles leave room for one k/v
slot a consumer), and a fourth partition, the turner warpgroup, turns each
item's k and v in place in shared memory (in fp32, rounded as an unfused rotary stores them) before handing them to
the consumer. The consumer turns each query head's q in registers: loaded from shared memory as the first operand
of ``Q K^T``, whose threads hold whole pairs, 32 columns at a time, so that no data crosses threads and the compiler
adds no barrier. It releases the angle tile after the item's last head.

fp8 inputs (``ops.fp8``): ``Q K^T`` runs on fp8 wgmma; each consumer widens its item's values into an fp16 tile of
its own in shared memory (``P V``'s second operand must be K-major at 8 bits, which the value rows are not), rows
past the tile's end zeroed there, and ``P`` is fp16. At 128-token blocks the two consumers widen half of a block's
values each into one of two whole-block tiles, taken in turn (each consumer widening the whole block into a tile of
its own, with no barrier, lost at D = 128: H200, 2026-11-29, 1.57-2.14x -> 1.68-2.27x the floor). The descales are
read on the device; an fp8 output is saturated to e4m3's range.

What did not pay (H200, the sweep's lengths, bf16, time over the floor; docs/benchmarks.md, 2026-11-28): three
consumer warpgroups (slower everywhere but at D = 32 without GQA; D = 128 8:2 1.60x against 1.11x with two; for
fp8, faster only without GQA at D = 64, 1.44 -> 1.30x, and at 32-token blocks, where the tiles' NaN rule keeps the
Triton forward; 2026-11-28 21:54 UTC); the rotary turned in shared memory by the consumers (1.43-4.42x over two
versions, against the Triton forward's 1.19-1.46x: the angles' registers spill), and q turned in shared memory by
the turner too (2026-11-29: 1.43-2.33x against 1.10-1.83x: one warpgroup turning every tile, ten an item at 8:1,
was slower than the consumers need); fewer q slots than the group at D = 64 (8:2 1.41x against 1.16x with four);
checking the values of tiles of several blocks for NaN or inf, to take the blocks apart where one is found (D = 128
8:4: 1.10 -> 1.55x at 32-token blocks, 1.12 -> 1.82x at 16). For fp8, whose consumers bound it (Nsight Compute: 57%
of the DRAM throughput at 8:8, where bf16 reaches 86%): more k/v slots a consumer (3 or 4: no gain, up to 1.28 ->
1.49x at 8:2), the score scale inside the exponent (8:2 1.28 -> 1.43x), and a fourth partition of two warps (40
registers a thread) widening the values for the consumers (D = 128 at 64-token blocks: 1.20-1.31x -> 1.42-1.58x).
Both kernels (2026-11-29): the output staged in shared memory and stored by TMA where a consumer's rows are whole
(the consumer moves on while it drains), which lost under GQA (128-token blocks at D = 128 8:2 1.46 -> 1.95x,
64-token blocks at D = 64 8:2 1.21 -> 1.31x, fp8 8:2 1.29 -> 1.48x); and in the halves kernel the two consumers'
products issued in turns (ping-pong, one's softmax while the other's products run): with the next head's ``Q K^T``
after the softmax, 8:1 1.64 -> 1.85x; with only ``P V`` in turns, 8:1 1.64 -> 1.61x but 8:2 1.40 -> 1.43x and 8:4
1.15 -> 1.17x.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .. import devices
from ..block_table import BlockTable
from . import fp8, tiles
from .block_attention_sm90 import _GL_DTYPES, _descriptor, _pair_layout, _pairs, _prepare_tile, _unpairs
from .flash_attention_sm90 import _zero_values_past
from .gluon_sm90 import barrier, mma_layout, rows_layout, tma_load
from .in_block import InBlock
from .launch import launch
from .tiles import (
    LOG2E,
    ROTATE_K,
    ROTATE_Q,
    ROTATE_V,
    fp8_out_factor,
    fp8_output,
    fp8_score_scale,
    same_block,
    softmax_probs,
    tile_bounds,
)

_HEAD_DIMS = (32, 64, 128)
_MAX_GROUP = 8  # query heads a kv head (as measured and tested)
_CONSUMERS = gl.constexpr(2)
_BATCH = 32  # items whose bounds a program loads at once
_KV_SLOTS = 2  # k/v slots a consumer
_RING_BYTES = 192 * 1024  # the rings' shared memory
_CONSUMER_REGS = gl.constexpr(232)
_PRODUCER_REGS = gl.constexpr(40)
# The halves kernel's consumers hold [64, 128] score tiles: 240 registers (the producer 24, as in the flash kernel)
# spill less under GQA (ptxas of triton 3.9 at D = 128, spill stores at 8:4 / 8:2 / 8:1: 60 / 92 / 45 -> 26 / 76 /
# 29). H200, 2026-11-29, 128-token blocks, time over the floor, 232/40 -> 240/24: D = 128 8:2
# 1.45 -> 1.40x, 8:1 1.69 -> 1.64x, a tie without GQA and at D = 64 within the runs' spread. In the 64-row kernel
# 240/24 lost (D = 128 8:2 1.14 -> 1.26x, fp8 1.30 -> 1.42x).
_HALVES_CONSUMER_REGS = gl.constexpr(240)
_HALVES_PRODUCER_REGS = gl.constexpr(24)
# With a rotary a fourth partition, a warpgroup, turns k and v (:func:`_turner`): its registers come out of the
# consumers' (16 warps: 200 + 200 + 24 + 88 registers a thread of each warpgroup fill the register file). It turns
# 64 columns at a time: the compiler puts two barriers in each chunk (its load and store hit one allocation), which
# at 16 columns a step set the prototypes' time (docs/benchmarks.md, 2026-11-29). The consumers turn q 32 columns at
# a time.
_TURNER_REGS = gl.constexpr(88)
_TURNING_CONSUMER_REGS = gl.constexpr(200)
_TURNING_PRODUCER_REGS = gl.constexpr(24)
_TURN_COLUMNS = gl.constexpr(64)
_Q_TURN_COLUMNS = gl.constexpr(32)
# The angles' dtypes it reads: fp32, or 16 bits (the inputs' dtype).
_ANGLE_GL_DTYPES = {torch.float32: gl.float32, **_GL_DTYPES}


@gluon.jit
def _batch_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, num_seqs, num_tokens, num_items, first,
                  NUM_KV_HEADS: gl.constexpr, TILE: gl.constexpr, BLOCKS: gl.constexpr, BATCH: gl.constexpr):
    """``(start, length, second, third, fourth)`` (``tiles.tile_bounds``) of this program's items ``first`` to
    ``first + BATCH - 1`` (its own count: item ``program_id + j * num_programs``), as vectors; length 0 past the
    last item."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    items = gl.program_id(0) + (first + gl.arange(0, BATCH, layout=layout)) * gl.num_programs(0)
    valid = items < num_items
    start, length, second, third, fourth = tile_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr,
                                                       gl.where(valid, items // NUM_KV_HEADS, 0), num_seqs,
                                                       num_tokens, TILE, BLOCKS)
    return start, gl.where(valid, length, 0), second, third, fourth


@gluon.jit
def _pick(vector, i):
    """Element ``i`` of a batch vector."""
    lanes = gl.arange(0, vector.shape[0], layout=vector.type.layout)
    return gl.sum(gl.where(lanes == i, vector, gl.zeros_like(vector)), axis=0)


@gluon.jit
def _land_kv(k_desc, v_desc, kv_smem, kv_ready, kv_empty, slot, use, row, col):
    """The producer's k and v tiles at ``[row, col]`` into k/v slot ``slot`` (its ``use``-th load), once its
    consumers released it. A fresh barrier counts as completed in the phase before its first: the first wait returns
    at once."""
    mbarrier.wait(kv_empty.index(slot), (use & 1) ^ 1)
    landed = kv_ready.index(slot)
    mbarrier.expect(landed, 2 * k_desc.block_type.nbytes)
    tma_load(k_desc, [row, col], landed, kv_smem.index(2 * slot))
    tma_load(v_desc, [row, col], landed, kv_smem.index(2 * slot + 1))


@gluon.jit
def _land_q(q_desc, q_smem, q_ready, q_empty, q_slot, use, row, col):
    """The producer's q tile at ``[row, col]`` into q slot ``q_slot`` (its ``use``-th load), once released."""
    mbarrier.wait(q_empty.index(q_slot), (use & 1) ^ 1)
    mbarrier.expect(q_ready.index(q_slot), q_desc.block_type.nbytes)
    tma_load(q_desc, [row, col], q_ready.index(q_slot), q_smem.index(q_slot))


@gluon.jit
def _producer(loads, angle_loads, NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCKS: gl.constexpr,
              BATCH: gl.constexpr, ROTATE: gl.constexpr):
    """One warp: for each item, once its consumer released the slots, k and v into the consumer's next k/v slot
    and each query head's q into its next q slot (``kv_landed``: where k and v land, the consumer's ready barriers,
    or with a rotary the turner's); with a rotary (``ROTATE``) first the item's angles into the consumer's next
    angle tile, once it released it."""
    (q_desc, k_desc, v_desc, kv_smem, q_smem, kv_landed, kv_empty, q_ready, q_empty, block_seq_ptr, block_cum_ptr,
     offsets_ptr, num_seqs, num_tokens, num_items) = loads
    sinu_desc, angles, angles_landed, angles_free = angle_loads
    TILE: gl.constexpr = q_smem.shape[1]
    D: gl.constexpr = q_smem.shape[2]
    KV_SLOTS: gl.constexpr = kv_smem.shape[0] // (2 * _CONSUMERS)
    Q_SLOTS: gl.constexpr = q_smem.shape[0] // _CONSUMERS
    ANGLE_SLOTS: gl.constexpr = angles.shape[0] // _CONSUMERS
    count = (num_items - gl.program_id(0) + gl.num_programs(0) - 1) // gl.num_programs(0)
    loaded0 = 0  # items loaded for each consumer
    loaded1 = 0
    for first in range(0, count, BATCH):
        starts, lengths, _, _, _ = _batch_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, num_seqs, num_tokens,
                                                 num_items, first, NUM_KV_HEADS, TILE, BLOCKS, BATCH)
        for i in range(gl.minimum(BATCH, count - first)):
            j = first + i
            c = j % _CONSUMERS
            if _pick(lengths, i) > 0:
                row = _pick(starts, i).to(gl.int32)
                kv_head = (gl.program_id(0) + j * gl.num_programs(0)) % NUM_KV_HEADS
                n = gl.where(c == 0, loaded0, loaded1)
                if ROTATE:
                    a = c * ANGLE_SLOTS + n % ANGLE_SLOTS
                    mbarrier.wait(angles_free.index(a), ((n // ANGLE_SLOTS) & 1) ^ 1)
                    mbarrier.expect(angles_landed.index(a), sinu_desc.block_type.nbytes)
                    tma_load(sinu_desc, [row, 0], angles_landed.index(a), angles.index(a))
                _land_kv(k_desc, v_desc, kv_smem, kv_landed, kv_empty, c * KV_SLOTS + n % KV_SLOTS, n // KV_SLOTS,
                         row, kv_head * D)
                for g in range(GROUP):
                    qn = n * GROUP + g
                    _land_q(q_desc, q_smem, q_ready, q_empty, c * Q_SLOTS + qn % Q_SLOTS, qn // Q_SLOTS, row,
                            (kv_head * GROUP + g) * D)
                loaded0 += (c == 0).to(gl.int32)
                loaded1 += (c == 1).to(gl.int32)


@gluon.jit
def _turn_landed(tile, angles, length, TURN: gl.constexpr):
    """Where ``TURN``, turn a landed ``[TILE, D]`` tile in place by its rows' angles (``angles``: the item's
    ``[TILE, D]`` ``[sin | cos]`` in shared memory), :data:`_TURN_COLUMNS` columns at a time, rows from ``length`` on
    zeroed (``block_attention_sm90._prepare_tile``: in fp32, rounded as an unfused rotary stores it)."""
    if TURN:
        TILE: gl.constexpr = tile.shape[0]
        D: gl.constexpr = tile.shape[1]
        W: gl.constexpr = min(_TURN_COLUMNS, D)
        layout: gl.constexpr = _pair_layout(W, gl.num_warps())
        rows = gl.arange(0, TILE, layout=gl.SliceLayout(1, layout))
        row_ok = (rows < length)[:, None]
        for c in gl.static_range(D // W):
            sin = angles.slice(c * (W // 2), W // 2, dim=1).load(layout).to(gl.float32)
            cos = angles.slice(D // 2 + c * (W // 2), W // 2, dim=1).load(layout).to(gl.float32)
            _prepare_tile(tile.slice(c * W, W, dim=1), sin, cos, row_ok, 1, False)


@gluon.jit
def _handed_over(ready):
    """The turner's accesses to a turned tile done by every thread and visible to the async proxy, then ``ready``
    arrived on: its consumer may read it."""
    fence_async_shared()
    barrier()
    mbarrier.arrive(ready)


@gluon.jit
def _turner(turns, NUM_KV_HEADS: gl.constexpr, BLOCKS: gl.constexpr, BATCH: gl.constexpr, ROTATE: gl.constexpr):
    """A warpgroup, with a rotary: each item's k and v, once landed, turned in place by the item's angles and handed
    to its consumer (which turns q itself, in registers: :func:`_turned_scores`)."""
    (kv_smem, kv_landed, kv_ready, angles, angles_landed, block_seq_ptr, block_cum_ptr, offsets_ptr, num_seqs,
     num_tokens, num_items) = turns
    TILE: gl.constexpr = kv_smem.shape[1]
    KV_SLOTS: gl.constexpr = kv_smem.shape[0] // (2 * _CONSUMERS)
    ANGLE_SLOTS: gl.constexpr = angles.shape[0] // _CONSUMERS
    count = (num_items - gl.program_id(0) + gl.num_programs(0) - 1) // gl.num_programs(0)
    loaded0 = 0  # items turned for each consumer
    loaded1 = 0
    for first in range(0, count, BATCH):
        _, lengths, _, _, _ = _batch_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, num_seqs, num_tokens,
                                            num_items, first, NUM_KV_HEADS, TILE, BLOCKS, BATCH)
        for i in range(gl.minimum(BATCH, count - first)):
            c = (first + i) % _CONSUMERS
            length = _pick(lengths, i)
            if length > 0:
                n = gl.where(c == 0, loaded0, loaded1)
                a = c * ANGLE_SLOTS + n % ANGLE_SLOTS
                mbarrier.wait(angles_landed.index(a), (n // ANGLE_SLOTS) & 1)
                kv_slot = c * KV_SLOTS + n % KV_SLOTS
                mbarrier.wait(kv_landed.index(kv_slot), (n // KV_SLOTS) & 1)
                _turn_landed(kv_smem.index(2 * kv_slot), angles.index(a), length, ROTATE & ROTATE_K)
                _turn_landed(kv_smem.index(2 * kv_slot + 1), angles.index(a), length, ROTATE & ROTATE_V)
                _handed_over(kv_ready.index(kv_slot))
                loaded0 += (c == 0).to(gl.int32)
                loaded1 += (c == 1).to(gl.int32)


@gluon.jit
def _turned_scores(q, k, angles, s_zero):
    """``S = turn(Q) K^T``, q turned in registers as the product's first operand, :data:`_Q_TURN_COLUMNS` columns at
    a time (by the angles of the item's ``[TILE, D]`` ``[sin | cos]`` tile; in fp32, rounded as an unfused rotary
    stores it): loaded from shared memory in the operand's layout, whose threads hold whole pairs, so that neither
    the turn nor the product moves data between threads."""
    D: gl.constexpr = q.shape[1]
    W: gl.constexpr = min(_Q_TURN_COLUMNS, D)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_zero.type.layout, k_width=2)
    scores = s_zero
    for c in gl.static_range(D // W):
        even, odd = _pairs(q.slice(c * W, W, dim=1).load(a_layout))
        sin = angles.slice(c * (W // 2), W // 2, dim=1).load(even.type.layout).to(gl.float32)
        cos = angles.slice(D // 2 + c * (W // 2), W // 2, dim=1).load(even.type.layout).to(gl.float32)
        even = even.to(gl.float32)
        odd = odd.to(gl.float32)
        turned = _unpairs((even * cos - odd * sin).to(q.dtype), (odd * cos + even * sin).to(q.dtype))
        scores = warpgroup_mma(gl.convert_layout(turned, a_layout), k.slice(c * W, W, dim=1).permute((1, 0)),
                               scores, use_acc=c > 0, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(scores,))


@gluon.jit
def _q_ready(q_smem, q_ready, qn, Q_SLOTS: gl.constexpr, C: gl.constexpr):
    """Query tile ``qn`` of consumer ``C``, landed: ``(tile, its slot)``."""
    q_slot = C * Q_SLOTS + qn % Q_SLOTS
    mbarrier.wait(q_ready.index(q_slot), (qn // Q_SLOTS) & 1)
    return q_smem.index(q_slot), q_slot


@gluon.jit
def _widen_values(values, widened, first_row, length):
    """fp8 value rows (``values``, a ``[rows, D]`` tile of shared memory: the tile's rows ``first_row`` on) widened,
    exactly, into ``widened`` (the same shape in fp16), the rows from the tile's ``length`` on zeroed (the next
    block's, or TMA's zeros: ``P`` is 0 there, but 0 * NaN is not). Full tiles take no select (a select on them
    too cost up to 8%: H200, 2026-11-28)."""
    ROWS: gl.constexpr = values.shape[0]
    D: gl.constexpr = values.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // D, D // 16], [4, 1], [1, 0])
    tile = values.load(layout).to(gl.float16)
    if length < first_row + ROWS:
        rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        tile = gl.where((rows < length)[:, None], tile, 0.0)
    widened.store(tile)


@gluon.jit
def _item_heads(q_smem, q_ready, q_empty, k, v, kv_released, first_q, length, start, kv_head, o_ptr, stride_on,
                qk_scale_log2, out_factor, keys, offs_j, rows, cols, s_zero, o_zero, angles, p_layout: gl.constexpr,
                out_layout: gl.constexpr, Q_SLOTS: gl.constexpr, C: gl.constexpr, GROUP: gl.constexpr,
                FP8: gl.constexpr, TURN_Q: gl.constexpr):
    """A consumer's work on one item, every query head of its group in turn (q tiles ``first_q ...`` of consumer
    ``C``): ``S = Q K^T`` (with ``TURN_Q``, q turned by the item's ``angles``: :func:`_turned_scores`), the exact
    softmax over the item's keys (``keys``: :func:`tiles.same_block`'s, or None), ``O = P V``, the rows ``rows`` of
    ``O`` stored up to ``length``; ``kv_released`` arrived on after the last head.

    One head at a time. The old rule's runs of 2 or 4 heads unrolled, within which the next head's ``Q K^T`` ran
    during this head's softmax (two score tiles live), lost or tied everywhere (H200, 2026-11-29, the sweep's
    lengths, 8 query heads, time over the floor, one head -> that rule's runs: bf16 at 128-token blocks, D = 128 8:4
    / 8:2 / 8:1 1.12 / 1.28 / 1.39x -> 1.17 / 1.40 / 1.65x, D = 64 1.54 / 1.69 / 1.72x -> 1.63 / 1.92 / 2.19x; at
    64-token blocks D = 128 8:2 1.14 -> 1.15x, D = 64 8:4 1.11 -> 1.15x, ties at D = 128 8:4 at 64- and 32-token
    blocks; fp8 at 128-token blocks D = 128 8:2 1.66 -> 2.13x, 8:1 1.73 -> 1.84x, D = 64 2.19-2.35x -> 2.51-2.80x).
    Runs of 4 took up to 46% longer (bf16 at 128-token blocks, D = 64 8:1, 1.72 -> 2.51x)."""
    D: gl.constexpr = q_smem.shape[2]
    pv_dtype: gl.constexpr = gl.float16 if FP8 else q_smem.dtype
    for g in range(GROUP):
        q, q_slot = _q_ready(q_smem, q_ready, first_q + g, Q_SLOTS, C)
        if TURN_Q:
            scores = _turned_scores(q, k, angles, s_zero)
        else:
            s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            scores = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(q_empty.index(q_slot))
        p = softmax_probs(scores, offs_j < length, qk_scale_log2, keys=keys)
        p = gl.convert_layout(p.to(pv_dtype), p_layout)
        o = warpgroup_mma(p, v, o_zero, use_acc=False, is_async=True)
        o, p = warpgroup_mma_wait(num_outstanding=0, deps=(o, p))
        mbarrier.arrive(kv_released, pred=g == GROUP - 1)
        o = fp8_output(o, out_factor, FP8, o_ptr.dtype.element_ty)
        out = gl.convert_layout(o.to(o_ptr.dtype.element_ty), out_layout)
        base = o_ptr + start * stride_on + (kv_head * GROUP + g) * D
        gl.store(base + rows.to(gl.int64)[:, None] * stride_on + cols[None, :], out, mask=(rows < length)[:, None])


@gluon.jit
def _consumer(work, NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCKS: gl.constexpr, BATCH: gl.constexpr,
              FP8: gl.constexpr, C: gl.constexpr, ROTATE: gl.constexpr):
    """Consumer warpgroup ``C``: the items ``j`` of this program with ``j % _CONSUMERS == C``, every query head of
    each."""
    (kv_smem, q_smem, kv_ready, kv_empty, q_ready, q_empty, o_ptr, stride_on, block_seq_ptr, block_cum_ptr, offsets_ptr,
     num_seqs, num_tokens, num_items, qk_scale_log2, v16_smem, q_descale_ptr, k_descale_ptr, v_descale_ptr,
     out_scale_ptr, angles, angles_landed, angles_free) = work
    ANGLE_SLOTS: gl.constexpr = angles.shape[0] // _CONSUMERS
    TILE: gl.constexpr = q_smem.shape[1]
    D: gl.constexpr = q_smem.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    KV_SLOTS: gl.constexpr = kv_smem.shape[0] // (2 * _CONSUMERS)
    Q_SLOTS: gl.constexpr = q_smem.shape[0] // _CONSUMERS
    # fp8 scores come from fp8 products (32 deep an instruction); the values are widened to fp16 in shared memory
    # (P V's second operand must be K-major at 8 bits, which a row-major value tile is not).
    s_layout: gl.constexpr = mma_layout(TILE, TILE, 4, dtype)
    pv_dtype: gl.constexpr = gl.float16 if FP8 else dtype
    o_layout: gl.constexpr = mma_layout(TILE, D, 4, pv_dtype)
    # 16-bit P stays in registers as the second product's first operand: the score accumulator's layout is that
    # operand's (no data moves).
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    # Whole rows, 8 elements a thread: the output's stores (the compiler stages the accumulator through shared
    # memory).
    out_layout: gl.constexpr = rows_layout(D, 4)
    offs_i = gl.arange(0, TILE, layout=gl.SliceLayout(1, s_layout))
    offs_j = gl.arange(0, TILE, layout=gl.SliceLayout(0, s_layout))
    rows = gl.arange(0, TILE, layout=gl.SliceLayout(1, out_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, out_layout))
    s_zero = gl.zeros([TILE, TILE], gl.float32, s_layout)
    o_zero = gl.zeros([TILE, D], gl.float32, o_layout)
    qk_scale_log2 = fp8_score_scale(qk_scale_log2, q_descale_ptr, k_descale_ptr, FP8)
    out_factor = fp8_out_factor(v_descale_ptr, out_scale_ptr, FP8, o_ptr.dtype.element_ty)
    count = (num_items - gl.program_id(0) + gl.num_programs(0) - 1) // gl.num_programs(0)
    done = 0
    for first in range(0, count, BATCH):
        starts, lengths, seconds, thirds, fourths = _batch_bounds(
            block_seq_ptr, block_cum_ptr, offsets_ptr, num_seqs, num_tokens, num_items, first, NUM_KV_HEADS, TILE,
            BLOCKS, BATCH)
        for i in range((C - first % _CONSUMERS + _CONSUMERS) % _CONSUMERS, gl.minimum(BATCH, count - first),
                       _CONSUMERS):
            length = _pick(lengths, i)
            if length > 0:
                start = _pick(starts, i)
                kv_head = (gl.program_id(0) + (first + i) * gl.num_programs(0)) % NUM_KV_HEADS
                slot = C * KV_SLOTS + done % KV_SLOTS
                mbarrier.wait(kv_ready.index(slot), (done // KV_SLOTS) & 1)
                k = kv_smem.index(2 * slot)
                v = kv_smem.index(2 * slot + 1)
                if FP8:  # widened into this consumer's fp16 tile
                    _widen_values(v, v16_smem.index(C), 0, length)
                    v = v16_smem.index(C)
                    fence_async_shared()
                elif length < TILE:
                    # The values past the tile's end are the next block's (or TMA's zeros): P is 0 there, but 0 * NaN
                    # is not.
                    _zero_values_past(v, 0, length, 0, False)
                    _zero_values_past(v, 0, length, 1, False)
                    fence_async_shared()
                if BLOCKS > 2:
                    keys = same_block(offs_i, offs_j, _pick(seconds, i), _pick(thirds, i), _pick(fourths, i))
                elif BLOCKS == 2:  # the third and fourth bounds are TILE
                    keys = same_block(offs_i, offs_j, _pick(seconds, i), TILE, TILE)
                else:
                    keys = None
                # With a rotary, the item's angles (landed before the turner turned k and v) turn each head's q.
                a = C * ANGLE_SLOTS + done % ANGLE_SLOTS
                if ROTATE:
                    mbarrier.wait(angles_landed.index(a), (done // ANGLE_SLOTS) & 1)
                _item_heads(q_smem, q_ready, q_empty, k, v, kv_empty.index(slot), done * GROUP, length, start, kv_head,
                            o_ptr, stride_on, qk_scale_log2, out_factor, keys, offs_j, rows, cols, s_zero, o_zero,
                            angles.index(a), p_layout, out_layout, Q_SLOTS, C, GROUP, FP8, ROTATE & ROTATE_Q)
                if ROTATE:
                    mbarrier.arrive(angles_free.index(a))
                done += 1


@gluon.jit
def _block_attention_fwd_sm90_kernel(
    q_desc, k_desc, v_desc, o_ptr, block_seq_ptr, block_cum_ptr, offsets_ptr,
    num_seqs, num_tokens, num_items, qk_scale_log2, stride_on, q_descale_ptr, k_descale_ptr, v_descale_ptr,
    out_scale_ptr, sinu_desc,
    NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCKS: gl.constexpr, KV_SLOTS: gl.constexpr,
    Q_SLOTS: gl.constexpr, BATCH: gl.constexpr, FP8: gl.constexpr, ROTATE: gl.constexpr, ANGLE_SLOTS: gl.constexpr,
):
    # ROTATE (a mask of tiles.ROTATE_Q/K/V): a turner warpgroup turns k and v in shared memory, and the consumers
    # turn q in registers, by the angles of ``sinu_desc`` ([N, D] rows of [sin | cos], TILE rows a load), ANGLE_SLOTS
    # tiles a consumer; otherwise ``sinu_desc`` is a stand-in, never read.
    TILE: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    kv_smem = gl.allocate_shared_memory(dtype, [2 * _CONSUMERS * KV_SLOTS, TILE, D], k_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [_CONSUMERS * Q_SLOTS, TILE, D], q_desc.layout)
    if FP8:  # each consumer's values widened to fp16
        v16_smem = gl.allocate_shared_memory(gl.float16, [_CONSUMERS, TILE, D],
                                             gl.NVMMASharedLayout.get_default_for([TILE, D], gl.float16))
    else:  # a stand-in, never read
        v16_smem = kv_smem
    # One barrier a slot: ready (the producer's TMA landed it; with a rotary, the turner handed k and v over),
    # released (its consumer).
    kv_ready = gl.allocate_shared_memory(gl.int64, [_CONSUMERS * KV_SLOTS, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [_CONSUMERS * KV_SLOTS, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [_CONSUMERS * Q_SLOTS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [_CONSUMERS * Q_SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(_CONSUMERS * KV_SLOTS):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=1)
    for i in gl.static_range(_CONSUMERS * Q_SLOTS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    if ROTATE:
        # k and v land on barriers of their own, where the turner waits; the consumers' are the turner's.
        kv_landed = gl.allocate_shared_memory(gl.int64, [_CONSUMERS * KV_SLOTS, 1], mbarrier.MBarrierLayout())
        angles_landed = gl.allocate_shared_memory(gl.int64, [_CONSUMERS * ANGLE_SLOTS, 1], mbarrier.MBarrierLayout())
        angles_free = gl.allocate_shared_memory(gl.int64, [_CONSUMERS * ANGLE_SLOTS, 1], mbarrier.MBarrierLayout())
        angles = gl.allocate_shared_memory(sinu_desc.dtype, [_CONSUMERS * ANGLE_SLOTS, TILE, D], sinu_desc.layout)
        for i in gl.static_range(_CONSUMERS * KV_SLOTS):
            mbarrier.init(kv_landed.index(i), count=1)
        for i in gl.static_range(_CONSUMERS * ANGLE_SLOTS):
            mbarrier.init(angles_landed.index(i), count=1)
            mbarrier.init(angles_free.index(i), count=1)
    else:  # stand-ins, never read
        kv_landed = kv_ready
        angles_landed = kv_ready
        angles_free = kv_empty
        angles = kv_smem
    # Each partition's runtime arguments as one tuple, its constexprs after it (inside a tuple a constexpr would
    # turn into a plain value).
    work = (kv_smem, q_smem, kv_ready, kv_empty, q_ready, q_empty, o_ptr, stride_on, block_seq_ptr, block_cum_ptr,
            offsets_ptr, num_seqs, num_tokens, num_items, qk_scale_log2, v16_smem, q_descale_ptr, k_descale_ptr,
            v_descale_ptr, out_scale_ptr, angles, angles_landed, angles_free)
    loads = (q_desc, k_desc, v_desc, kv_smem, q_smem, kv_landed, kv_empty, q_ready, q_empty, block_seq_ptr,
             block_cum_ptr, offsets_ptr, num_seqs, num_tokens, num_items)
    angle_loads = (sinu_desc, angles, angles_landed, angles_free)
    if ROTATE:
        turns = (kv_smem, kv_landed, kv_ready, angles, angles_landed, block_seq_ptr, block_cum_ptr, offsets_ptr,
                 num_seqs, num_tokens, num_items)
        gl.warp_specialize([(_consumer, (work, NUM_KV_HEADS, GROUP, BLOCKS, BATCH, FP8, 0, ROTATE)),
                            (_consumer, (work, NUM_KV_HEADS, GROUP, BLOCKS, BATCH, FP8, 1, ROTATE)),
                            (_producer, (loads, angle_loads, NUM_KV_HEADS, GROUP, BLOCKS, BATCH, ROTATE)),
                            (_turner, (turns, NUM_KV_HEADS, BLOCKS, BATCH, ROTATE))],
                           [4, 1, 4], [_TURNING_CONSUMER_REGS, _TURNING_PRODUCER_REGS, _TURNER_REGS])
    else:
        gl.warp_specialize([(_consumer, (work, NUM_KV_HEADS, GROUP, BLOCKS, BATCH, FP8, 0, ROTATE)),
                            (_consumer, (work, NUM_KV_HEADS, GROUP, BLOCKS, BATCH, FP8, 1, ROTATE)),
                            (_producer, (loads, angle_loads, NUM_KV_HEADS, GROUP, BLOCKS, BATCH, ROTATE))],
                           [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])


@gluon.jit
def _halves_producer(loads, NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, BATCH: gl.constexpr):
    """One warp, at 128-token blocks: for each item (a block and a kv head), once both consumers released the
    slot, k and v into the next k/v slot, then for each query head the block's two 64-row halves of q, one into
    each consumer's next q slot."""
    (q_desc, k_desc, v_desc, kv_smem, q_smem, kv_ready, kv_empty, q_ready, q_empty, block_seq_ptr, block_cum_ptr,
     offsets_ptr, num_seqs, num_tokens, num_items) = loads
    TILE: gl.constexpr = q_smem.shape[1]
    KEYS: gl.constexpr = kv_smem.shape[1]
    D: gl.constexpr = q_smem.shape[2]
    KV_SLOTS: gl.constexpr = kv_smem.shape[0] // 2
    Q_SLOTS: gl.constexpr = q_smem.shape[0] // _CONSUMERS
    count = (num_items - gl.program_id(0) + gl.num_programs(0) - 1) // gl.num_programs(0)
    loaded = 0
    for first in range(0, count, BATCH):
        starts, lengths, _, _, _ = _batch_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, num_seqs, num_tokens,
                                                 num_items, first, NUM_KV_HEADS, KEYS, 1, BATCH)
        for i in range(gl.minimum(BATCH, count - first)):
            if _pick(lengths, i) > 0:
                row = _pick(starts, i).to(gl.int32)
                kv_head = (gl.program_id(0) + (first + i) * gl.num_programs(0)) % NUM_KV_HEADS
                _land_kv(k_desc, v_desc, kv_smem, kv_ready, kv_empty, loaded % KV_SLOTS, loaded // KV_SLOTS, row,
                         kv_head * D)
                for g in range(GROUP):
                    qn = loaded * GROUP + g
                    for half in gl.static_range(_CONSUMERS):
                        _land_q(q_desc, q_smem, q_ready, q_empty, half * Q_SLOTS + qn % Q_SLOTS, qn // Q_SLOTS,
                                row + half * TILE, (kv_head * GROUP + g) * D)
                loaded += 1


@gluon.jit
def _halves_consumer(work, NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, BATCH: gl.constexpr,
                     FP8: gl.constexpr, C: gl.constexpr):
    """Consumer warpgroup ``C`` at 128-token blocks: query rows ``[64 C, 64 C + 64)`` of every item of this
    program, against the block's 128 keys."""
    (kv_smem, q_smem, kv_ready, kv_empty, q_ready, q_empty, values_fixed, o_ptr, stride_on, block_seq_ptr,
     block_cum_ptr, offsets_ptr, num_seqs, num_tokens, num_items, qk_scale_log2, v16_smem, q_descale_ptr,
     k_descale_ptr, v_descale_ptr, out_scale_ptr) = work
    TILE: gl.constexpr = q_smem.shape[1]
    KEYS: gl.constexpr = kv_smem.shape[1]
    D: gl.constexpr = q_smem.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    KV_SLOTS: gl.constexpr = kv_smem.shape[0] // 2
    Q_SLOTS: gl.constexpr = q_smem.shape[0] // _CONSUMERS
    pv_dtype: gl.constexpr = gl.float16 if FP8 else dtype
    s_layout: gl.constexpr = mma_layout(TILE, KEYS, 4, dtype)
    o_layout: gl.constexpr = mma_layout(TILE, D, 4, pv_dtype)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    out_layout: gl.constexpr = rows_layout(D, 4)
    offs_j = gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
    rows = C * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(1, out_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, out_layout))
    s_zero = gl.zeros([TILE, KEYS], gl.float32, s_layout)
    o_zero = gl.zeros([TILE, D], gl.float32, o_layout)
    qk_scale_log2 = fp8_score_scale(qk_scale_log2, q_descale_ptr, k_descale_ptr, FP8)
    out_factor = fp8_out_factor(v_descale_ptr, out_scale_ptr, FP8, o_ptr.dtype.element_ty)
    count = (num_items - gl.program_id(0) + gl.num_programs(0) - 1) // gl.num_programs(0)
    done = 0
    fixes = 0  # blocks whose values both consumers fix: partial ones, every one for fp8 (the phase of values_fixed)
    for first in range(0, count, BATCH):
        starts, lengths, _, _, _ = _batch_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, num_seqs, num_tokens,
                                                 num_items, first, NUM_KV_HEADS, KEYS, 1, BATCH)
        for i in range(gl.minimum(BATCH, count - first)):
            length = _pick(lengths, i)
            if length > 0:
                start = _pick(starts, i)
                kv_head = (gl.program_id(0) + (first + i) * gl.num_programs(0)) % NUM_KV_HEADS
                slot = done % KV_SLOTS
                mbarrier.wait(kv_ready.index(slot), (done // KV_SLOTS) & 1)
                k = kv_smem.index(2 * slot)
                v = kv_smem.index(2 * slot + 1)
                if FP8:
                    # Each consumer widens its half of the value rows into the block's fp16 tile; two such tiles in
                    # turn, so that one consumer widens the next block's while the other still reads this one's (it
                    # gets no further ahead: it waits for the other's half below).
                    widened = v16_smem.index(fixes % 2)
                    _widen_values(v.slice(C * TILE, TILE, dim=0), widened.slice(C * TILE, TILE, dim=0), C * TILE,
                                  length)
                    v = widened
                elif length < KEYS:
                    # The values past the block's end are the next block's (or TMA's zeros): P is 0 there, but
                    # 0 * NaN is not. Each consumer zeroes its half of the rows.
                    _zero_values_past(v, 0, length, C, False)
                if FP8 or length < KEYS:  # then waits for the other's half
                    fence_async_shared()
                    mbarrier.arrive(values_fixed)
                    mbarrier.wait(values_fixed, fixes & 1)
                    fixes += 1
                # Query rows past the block's end (the second half of a block of up to 64 tokens) are computed
                # and not stored.
                _item_heads(q_smem, q_ready, q_empty, k, v, kv_empty.index(slot), done * GROUP, length, start, kv_head,
                            o_ptr, stride_on, qk_scale_log2, out_factor, None, offs_j, rows, cols, s_zero, o_zero,
                            k, p_layout, out_layout, Q_SLOTS, C, GROUP, FP8, 0)
                done += 1


@gluon.jit
def _block_attention_fwd_sm90_halves_kernel(
    q_desc, k_desc, v_desc, o_ptr, block_seq_ptr, block_cum_ptr, offsets_ptr,
    num_seqs, num_tokens, num_items, qk_scale_log2, stride_on, q_descale_ptr, k_descale_ptr, v_descale_ptr,
    out_scale_ptr,
    NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, KV_SLOTS: gl.constexpr, Q_SLOTS: gl.constexpr,
    BATCH: gl.constexpr, FP8: gl.constexpr,
):
    TILE: gl.constexpr = q_desc.block_type.shape[0]
    KEYS: gl.constexpr = k_desc.block_type.shape[0]
    gl.static_assert(KEYS == _CONSUMERS * TILE)  # a block's query rows, a half a consumer
    D: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    kv_smem = gl.allocate_shared_memory(dtype, [2 * KV_SLOTS, KEYS, D], k_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [_CONSUMERS * Q_SLOTS, TILE, D], q_desc.layout)
    if FP8:  # the blocks' values widened to fp16, two tiles in turn
        v16_smem = gl.allocate_shared_memory(gl.float16, [2, KEYS, D],
                                             gl.NVMMASharedLayout.get_default_for([KEYS, D], gl.float16))
    else:  # a stand-in, never read
        v16_smem = kv_smem
    # Landed (the producer's TMA) and released (by both consumers) for each k/v slot; landed and released for each
    # q slot; the values of a partial block zeroed (for fp8, of every block widened) by both consumers.
    kv_ready = gl.allocate_shared_memory(gl.int64, [KV_SLOTS, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [KV_SLOTS, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [_CONSUMERS * Q_SLOTS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [_CONSUMERS * Q_SLOTS, 1], mbarrier.MBarrierLayout())
    values_fixed = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(KV_SLOTS):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=_CONSUMERS)
    for i in gl.static_range(_CONSUMERS * Q_SLOTS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    mbarrier.init(values_fixed.index(0), count=_CONSUMERS)
    work = (kv_smem, q_smem, kv_ready, kv_empty, q_ready, q_empty, values_fixed.index(0), o_ptr, stride_on,
            block_seq_ptr, block_cum_ptr, offsets_ptr, num_seqs, num_tokens, num_items, qk_scale_log2, v16_smem,
            q_descale_ptr, k_descale_ptr, v_descale_ptr, out_scale_ptr)
    loads = (q_desc, k_desc, v_desc, kv_smem, q_smem, kv_ready, kv_empty, q_ready, q_empty, block_seq_ptr,
             block_cum_ptr, offsets_ptr, num_seqs, num_tokens, num_items)
    gl.warp_specialize([(_halves_consumer, (work, NUM_KV_HEADS, GROUP, BATCH, FP8, 0)),
                        (_halves_consumer, (work, NUM_KV_HEADS, GROUP, BATCH, FP8, 1)),
                        (_halves_producer, (loads, NUM_KV_HEADS, GROUP, BATCH))],
                       [4, 1], [_HALVES_CONSUMER_REGS, _HALVES_PRODUCER_REGS])


def _angle_slots(head_dim: int, element_size: int, angle_size: int) -> int:
    """Angle tiles a consumer, with a rotary (of ``angle_size``-byte angles): two, so that an item's angles land
    while the consumer still reads the last item's, where they leave room for one k/v slot and two q slots a
    consumer; else one."""
    tile = tiles.TILE_ROWS * head_dim
    two = _CONSUMERS * (2 * tile * angle_size + (2 + 2) * tile * element_size)
    return 2 if two <= _RING_BYTES else 1


def _kv_slots(head_dim: int, element_size: int, angle_bytes: int) -> int:
    """k/v slots a consumer of the 64-row kernel: :data:`_KV_SLOTS`, or one where the angle tiles (``angle_bytes``
    in all) leave no room for them beside two q slots (a rotary at D = 128)."""
    tile = tiles.TILE_ROWS * head_dim * element_size
    return _KV_SLOTS if _CONSUMERS * (2 * _KV_SLOTS + 2) * tile <= _RING_BYTES - angle_bytes else 1


def _q_slots(head_dim: int, group: int, element_size: int, block_size: int, angle_bytes: int = 0,
             kv_slots: int = _KV_SLOTS) -> int:
    """q slots a consumer: the whole group's (up to 8), as many as :data:`_RING_BYTES` holds beside the k/v slots
    (and, for fp8, the values widened to 16 bits: a 64-row tile a consumer, or at 128-token blocks two whole blocks'
    in turn; with a rotary, the angle tiles, ``angle_bytes`` in all; the compiler's staging of the outputs takes
    the rest of the shared memory), at least two: the producer waits for a free q slot, and with fewer slots than
    the group it cannot load the other consumer's next item meanwhile. At 128-token blocks the two shared k/v slots
    hold as many bytes as the four 64-row ones of the other kernel."""
    tile = tiles.TILE_ROWS * head_dim * element_size
    widened_rows = 2 * max(block_size, tiles.TILE_ROWS)
    ring = _RING_BYTES - (widened_rows * head_dim * 2 if element_size == 1 else 0) - angle_bytes
    return int(max(2, min(group, ring // (_CONSUMERS * tile) - 2 * kv_slots)))


def _angles_descriptor(sinu_pos: torch.Tensor) -> TensorDescriptor:
    """The producer's angle loads: a 64-row tile of ``[N, D]`` ``[sin | cos]`` rows."""
    n, d = sinu_pos.shape
    layout = gl.NVMMASharedLayout.get_default_for([tiles.TILE_ROWS, d], _ANGLE_GL_DTYPES[sinu_pos.dtype])
    return TensorDescriptor(sinu_pos, [n, d], [sinu_pos.stride(0), 1], [tiles.TILE_ROWS, d], layout)


def why_not(call) -> str | None:
    """Why the dispatcher does not give this kernel a Hopper forward ``call`` (``backends.AttentionCall``), or
    ``None``: what it cannot run, then where the Triton forward is faster (:func:`_triton_faster`)."""
    return kernel_reason(call) or _triton_faster(call)


def _triton_faster(call) -> str | None:
    """Where the Triton forward measured faster (H200, the sweep's lengths, 8 query heads, time over the floor;
    ``Hq:Hkv``).

    In 64-row tiles this kernel runs 16 bits at D = 128 under GQA of 2 to 4 query heads a kv head and at D = 64 with
    2 (2026-11-28, Triton -> this kernel: D = 128 8:4 1.13 -> 1.08x at 64-token blocks, 1.16 -> 1.10x at 32, 1.20 ->
    1.12x at 16; 8:2 1.20 -> 1.11x, 1.22 -> 1.12x, 1.24 -> 1.18x; D = 64 8:4 1.17 -> 1.12x, 1.31 -> 1.17x, 1.33 ->
    1.30x; 2026-11-29, one head at a time: D = 64 8:4 1.20 -> 1.13x at 64, 1.37 -> 1.27x at 32). The Triton forward
    keeps the rest: without GQA (64-token blocks at D = 128 1.03x against 1.08x: its programs keep the memory busy
    there; at 16- and 32-token blocks this kernel's tiles of several blocks would let a NaN in v reach the tile's
    other blocks, where the Triton forward, one block a program without GQA, keeps it in its own), at 8 query heads a
    kv head (2026-11-29: D = 128 1.26x against 1.27x at 64-token blocks, 1.37x against 1.35x at 32; D = 64 1.18x
    against 1.23x), at 4 with D = 64 (2026-11-28: 1.12-1.24x against 1.16-1.30x) and at D = 32 (2026-11-29: 1.16-1.39x
    against 1.44-1.83x). fp8 runs here at D = 128 under GQA of 2 to 4 query heads a kv head, without GQA at 64-token
    blocks, and at D = 64 with 2 at 64-token blocks (2026-11-28, ``benchmarks/hopper_ab.py --dtype float8_e4m3fn``,
    Triton -> this kernel at 64-, 32- and 16-token blocks: 8:4 1.36 -> 1.22x, 1.73 -> 1.32x, 1.76 -> 1.45x; 8:2 1.29
    -> 1.31x (a tie), 1.63 -> 1.36x, 1.71 -> 1.52x; 8:8 1.30 -> 1.20x at 64; D = 64 8:4 1.54 -> 1.44x at 64 on
    2026-11-29). The Triton forward keeps fp8 without GQA at 32- and 16-token blocks (the NaN exception above), at 8
    query heads a kv head (2026-11-29: 1.30x against 1.33x at D = 128) and at D = 64 and 32 but the case above (D =
    64 8:8 1.24x against 1.43x, D = 32 1.46-1.89x against 2.31-2.42x).

    At 128-token blocks this kernel runs every head dim it takes, but fp8 at D = 32 without GQA (2026-11-29, one head
    at a time, Triton -> this kernel at 8:8 / 8:4 / 8:2 / 8:1; 16 bits: D = 128 1.31 -> 1.09x, 1.60 -> 1.15x, 1.87
    -> 1.29x, 2.06 -> 1.40x; D = 64 1.47 -> 1.20x, 2.02 -> 1.57x, 2.17 -> 1.73x, 2.35 -> 1.74x; D = 32 2.42 ->
    2.04x, 2.77 -> 2.58x, 2.96 -> 2.88x, 3.11 -> 3.09x; fp8: D = 128 1.97 -> 1.59x, 2.35 -> 1.62x, 2.63 -> 1.68x,
    2.63 -> 1.74x; D = 64 2.14 -> 2.16x (a tie), 2.58 -> 2.23x, 2.91 -> 2.36x, 3.04 -> 2.38x; D = 32 3.40 -> 3.80x,
    4.05 -> 4.04x, 4.42 -> 3.99x, 4.87 -> 4.14x). Measured on an H200 only (no H100 was lent).

    A rotary runs here at D = 128 with 2 query heads a kv head, but angles in the inputs' dtype at 16-token blocks
    (H200, 2026-11-29, the same-process A/B of 14:56-14:58 UTC, Triton -> this kernel, fp32 angles / angles in the
    inputs' dtype: 64-token blocks 1.46 -> 1.25x / 1.55 -> 1.45x, 32-token blocks 1.65 -> 1.44x / 1.65 -> 1.61x,
    16-token blocks 1.70 -> 1.55x / 1.64 -> 1.64x, a tie, which the sweep of 15:03 UTC measured 1.67x). Elsewhere
    the consumers, which turn every query head's q, lose or tie: 4 and 8 query heads a kv head at D = 128 (64-token
    blocks, 8:2 1.45 -> 1.51x, 8:1 1.41 -> 1.51x), without GQA (8:8 1.28 -> 1.33x), at D = 64 (fp32 angles
    1.10-1.69x -> 1.32-1.67x, a tie at 16-token blocks 8:4; angles in the inputs' dtype 1.28-1.68x -> 1.43-1.97x, a
    gain of 0.04 at 64-token blocks 8:4 alone) and at D = 32 (1.33-1.83x -> 1.88-2.00x)."""
    group = call.num_heads // call.num_kv_heads
    if call.rotate:
        if call.head_dim == 128 and group == 2 and (call.block_size > 16 or call.angles_dtype == torch.float32):
            return None
        return "the Triton forward measured faster for a rotary at this head dim, GQA group and angle dtype"
    if call.block_size > tiles.TILE_ROWS:
        if call.dtype == fp8.FP8_DTYPE and call.head_dim == 32 and group == 1:
            return "the Triton forward measured faster for fp8 at 128-token blocks with D = 32 without GQA"
        return None
    if call.dtype == fp8.FP8_DTYPE:
        if call.head_dim == 128 and (2 <= group <= 4 or (group == 1 and call.block_size == 64)):
            return None
        if call.head_dim == 64 and group == 2 and call.block_size == 64:
            return None
        return "the Triton forward measured faster for fp8 at this head dim, GQA group and block size"
    if call.head_dim == 128 and 2 <= group <= 4:
        return None
    if call.head_dim == 64 and group == 2:
        return None
    return "the Triton forward measured faster for this head dim and GQA group"


def kernel_reason(call) -> str | None:
    """Why this kernel cannot run a Hopper forward ``call`` (``backends.AttentionCall``), or ``None``."""
    if call.dtype not in _GL_DTYPES and call.dtype != fp8.FP8_DTYPE:
        return "takes float16, bfloat16 and float8_e4m3fn only"
    if call.in_block:
        return "takes no in-block option"
    if call.rotate:
        if call.dtype not in _GL_DTYPES:
            return "takes a rotary with 16-bit inputs only"
        if call.block_size > tiles.TILE_ROWS:
            return f"takes a rotary at blocks of up to {tiles.TILE_ROWS} tokens"
        if call.angles_dtype not in (torch.float32, call.dtype):
            return ("takes a rotary's angles in float32 or the inputs' dtype, as [N, D] rows that TMA reads "
                    "(16-byte aligned)")
    if call.head_dim not in _HEAD_DIMS:
        return f"takes D in {_HEAD_DIMS}"
    if call.num_heads // call.num_kv_heads > _MAX_GROUP:
        return f"takes up to {_MAX_GROUP} query heads a kv head"
    if not call.tma_rows:
        return "needs q, k, v as 16-byte aligned [N, H * D] rows"
    return None


def block_attention_fwd_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                             table: BlockTable, block_size: int, scale: float, sinu_pos: torch.Tensor | None,
                             rotate: int, options: InBlock, fp8_scales=None) -> torch.Tensor:
    """``out`` of a forward :func:`kernel_reason` takes (the dispatcher's forward signature, ``backends``: no
    options; a rotary on angles TMA reads; fp8 inputs with their ``fp8_scales``)."""
    n, h, d = q.shape
    kv_heads = k.shape[1]
    assert not rotate or (block_size <= tiles.TILE_ROWS and fp8_scales is None), "kernel_reason declines these"
    out = tiles.new_output(q, dtype=None if fp8_scales is None else fp8_scales.out_dtype)
    blocks = max(tiles.TILE_ROWS // block_size, 1)
    num_items = triton.cdiv(table.num_slots, blocks) * kv_heads
    if num_items == 0:
        return out
    tile = tiles.TILE_ROWS
    grid = (min(num_items, devices.multiprocessors(q.device)),)
    angle_size = sinu_pos.element_size() if rotate else 0
    angle_slots = _angle_slots(d, q.element_size(), angle_size)
    angle_bytes = _CONSUMERS * angle_slots * tiles.TILE_ROWS * d * angle_size
    kv_slots = _kv_slots(d, q.element_size(), angle_bytes)
    q_slots = _q_slots(d, h // kv_heads, q.element_size(), block_size, angle_bytes, kv_slots)
    fp8_args = fp8.no_scales_args(out) if fp8_scales is None else fp8_scales.kernel_args()
    if block_size > tile:  # both consumers on each block, a half of its query rows each
        launch(
            _block_attention_fwd_sm90_halves_kernel, grid, q_desc=_descriptor(q, tile),
            k_desc=_descriptor(k, block_size), v_desc=_descriptor(v, block_size), o_ptr=out,
            **table.kernel_args(offsets), num_tokens=n, num_items=num_items, qk_scale_log2=scale * LOG2E,
            stride_on=out.stride(0), **fp8_args, NUM_KV_HEADS=kv_heads, GROUP=h // kv_heads, KV_SLOTS=_KV_SLOTS,
            Q_SLOTS=q_slots, BATCH=_BATCH, FP8=fp8_scales is not None, num_warps=4,
        )
        return out
    q_desc = _descriptor(q, tile)
    launch(
        _block_attention_fwd_sm90_kernel, grid,
        q_desc=q_desc, k_desc=_descriptor(k, tile), v_desc=_descriptor(v, tile), o_ptr=out,
        **table.kernel_args(offsets), num_tokens=n, num_items=num_items, qk_scale_log2=scale * LOG2E,
        stride_on=out.stride(0), **fp8_args, sinu_desc=_angles_descriptor(sinu_pos) if rotate else q_desc,
        NUM_KV_HEADS=kv_heads, GROUP=h // kv_heads, BLOCKS=blocks, KV_SLOTS=kv_slots,
        Q_SLOTS=q_slots, BATCH=_BATCH, FP8=fp8_scales is not None, ROTATE=rotate, ANGLE_SLOTS=angle_slots,
        num_warps=4,
    )
    return out
