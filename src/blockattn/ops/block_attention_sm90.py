"""The backward of block attention on Hopper (sm_90), plain or with a fused rotary, with or without GQA: Gluon
kernels, their launcher, and what they take (:func:`why_not`, which the dispatcher asks).

Without GQA, one program per (block, head), as the Triton kernels, but its four tiles come in by TMA: one thread
issues four bulk copies into shared memory and nothing is staged in registers, so every byte of the program is in
flight at once, while the angles load beside them. The rotated operands are then turned in place (rows past the
block's end zeroed: TMA fetched the next block's rows there), and the five products read whole rows straight from
those tiles (``wgmma``): pairs stay interleaved, since a product over the head dim does not care about the order of
its terms. The gradients are staged in the tiles that are no longer read and stored 16 bytes per thread; a rotated
operand's gradient is staged in fp32 and turned back on the way out.

The rotary turns tiles in a layout of rows where each thread holds 4 whole pairs (``gluon_sm90.rows_layout``), so
that a thread loads its pairs' angles 16 bytes at a time. In the products' layout each pair's angle was a load of its
own, 8 cache lines a warp: those loads set the rotary backward's time (H100, `ads` lengths, fp32 angles: with
constant angles in their place it ran as fast as the plain kernel).

Under GQA, one program per (block, kv head): k and v land and turn once, the group's query heads run in turn with
the next head's q and dO landing in a second buffer, and dk and dv accumulate in registers across the group. Up to
D = 64 the rotary's angles load once a program and stay in registers for every head (H100, 8:2, fp32 angles,
backward over its floor: 1.40-1.42x -> 1.24-1.26x at D = 64, 1.57-1.59x -> 1.42x at D = 32; 2026-11-28).

One warpgroup runs 64-token blocks up to D = 128. Past that one warpgroup's accumulators would spill, so two run
(:func:`_num_warps`): at 128-token blocks down the rows of [128, 128] score tiles, at D = 256 side by side along the
columns of [64, 256] gradient tiles. Under GQA at 128-token blocks and D = 128 each query head runs in two steps of
half the block's query rows against all its keys (:func:`_query_rows`), as FlashAttention-3's backward does: [64,
128] score tiles, the warpgroups side by side, where [128, 128] ones spilled registers beside the group's dk and dv
(H200, 8 query heads, 2.63-3.24x -> 2.38-2.99x the floor); at D = 64 on [128, 128] tiles S comes before dP, never
held with it (:func:`_split_products`; 2.35-2.67x -> 2.29-2.56x). Where the score tiles' registers hold an SM to one
program (128-token blocks, D <= 64), one program without GQA runs every head of its block in turn, the next head's
four tiles landing in a second buffer (:func:`_heads_per_program`): otherwise its loads, products and stores take
turns. At D = 32 on 64-row tiles up to 8 heads run in turn likewise: there a program's own fixed costs weigh more
than its tiles.

16- and 32-token blocks run four or two to a program in one 64-row tile (``tiles.blocks_per_tile``): consecutive
grid slots' blocks are consecutive rows, so the tile lands by TMA as a 64-token block would, and each row's keys
are masked to its own block (``tiles.same_block``). The products do four (two) times the work, which the tensor
cores have to spare there, and wgmma gets the 64 rows a warpgroup it needs (H100, 8 query heads, against the Triton
kernels' one block a program: under GQA 1.28-2.91x -> 1.06-1.98x the floor).

Both take the in-block options (causal mask, position and time biases, dropout): the Triton kernels' own tile
code (``in_block.tile_probs_and_grads``) runs on the score tile in the products' layout, the dropout's Philox words
computed while the products run and brought to that layout, and the position bias's gradient gathering dS along
rows that each sit in one warp. Without GQA both biases' gradients are summed at the program's end, once the
products no longer hold registers and shared memory: the time bias's per bucket in per-thread bins where the tiles
were (``_sums_in_bins``). At ``ads`` (H100, bf16) their backward costs 1.00x (causal, dropout), 1.05x (position
bias), 1.13x (time bias; 1.62x with a compare-and-add per pair and bucket in the tile code) and 1.17x (both biases
with the causal mask; 1.83x) the plain one, against 1.11-1.23x and 2.16x in the Triton one-block kernel; with GQA
4:1 (8 query heads) at D = 128, 4.8-16.2 ms against 11.2-29.6 ms there without the time bias and 20.3 against
23.6 ms with it, at D = 64 2.4-7.3 ms against 2.8-10.4 ms.

Measured against the Triton kernels they replace (docs/benchmarks.md, times over the memory floor): without GQA,
the rotary backward at the ``ads-rotary`` shape 1.18x -> 1.05x on an H100 and 1.45x -> 1.30x on an H200, the plain
backward on an H200 1.12x -> 1.01x (``ads``); under GQA at ``ads`` lengths, D = 128, 2 to 8 query heads per kv
head, 1.25-1.68x -> 1.01-1.04x on an H100 and 1.74-2.37x -> 1.05-1.17x on an H200 (with a rotary and fp32 angles
2.12-2.52x -> 1.79-1.90x, and 1.27-1.28x since the angles load 16 bytes a thread; H200 2.89-3.47x -> 2.51-2.70x ->
1.68-1.74x). Past one warpgroup (H100, 2026-11-28, 8 query heads, backward over its floor, against the Triton
kernels in the same process): 128-token blocks without GQA 1.17-1.66x (1.55-2.85x), under GQA at D = 64 1.88x
(2.23x at 8:2); D = 256 at 64-token blocks 1.04-1.12x (1.38-3.17x), with a rotary and fp32 angles 1.64x (5.75x
at 8:2).
"""

from __future__ import annotations

import functools

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

from ..block_table import BlockTable, OffsetsOnly
from . import in_block, tiles
from .gluon_sm90 import barrier, mma_layout, offsets_chunk, reinterpret, rows_layout, tma_load
from .in_block import (
    DROPOUT,
    POS_BIAS,
    TIME_BIAS,
    InBlock,
    bucket_tile,
    dropout_factors,
    tile_probs_and_grads,
    write_pos_bias_grad,
)
from .launch import launch
from .tiles import (
    LOG2E,
    ROTATE_K,
    ROTATE_Q,
    ROTATE_V,
    grad_scores,
    rotary_operand,
    same_block,
    softmax_probs,
    tile_bounds,
)

# The head dims each block size takes (see why_not).
_HEAD_DIMS = {64: (32, 64, 128, 256), 128: (32, 64, 128)}
_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
# What tiles TMA lands: the forward's fp8 inputs too.
_TILE_GL_DTYPES = {**_GL_DTYPES, torch.float8_e4m3fn: gl.float8e4nv}
# The dropout's Philox calls, [BS, BS / 4] (four words each, interleaved along the keys): rows over 8 lanes and
# the 4 warps, 4 calls a thread along the row (in_block.dropout_factors).
_CALLS_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0]))
# The position bias's gradient gathers dS along its rows: with each row in one warp, on shuffles.
_ROWS_IN_WARPS = gl.constexpr(gl.BlockedLayout([1, 2], [1, 32], [4, 1], [1, 0]))


@gluon.jit
def _pairs(x):
    """``(even, odd)`` columns of ``x``: in a layout that holds both elements of a pair in one thread (the products'
    accumulators and operands do), no data moves."""
    return gl.split(gl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))


@gluon.jit
def _unpairs(even, odd):
    joined = gl.join(even, odd)
    return gl.reshape(joined, [joined.shape[0], joined.shape[1] * 2])


@gluon.constexpr_function
def _pair_layout(width, warps):
    """The pair halves (:func:`_pairs`) of a :func:`gluon_sm90.rows_layout` tile: 4 consecutive pairs a thread,
    whose angles load 16 bytes at a time (in the products' layout each pair's angle was a load of its own, 8 cache
    lines a warp: those loads set the rotary kernels' time)."""
    return gl.SliceLayout(2, gl.BlockedLayout([1, 4, 2], [32 * 8 // width, width // 8, 1], [warps, 1, 1],
                                              [2, 1, 0]))


@gluon.jit
def _angles(sinu_ptr, start, length, stride_sn, stride_sd, BLOCK: gl.constexpr, WIDTH: gl.constexpr,
            COL0: gl.constexpr, HALF_D: gl.constexpr, ROTATE: gl.constexpr):
    """``(sin, cos, row_ok)``: the angles in fp32 of the block's rows and the pairs of head-dim columns ``[COL0,
    COL0 + WIDTH)`` in :func:`_pair_layout` (zeros past the block's end), and which rows are the block's. Without
    ``ROTATE`` no angle is loaded: ``sin`` and ``cos`` are stand-ins, never read (a function cannot return
    None)."""
    layout: gl.constexpr = _pair_layout(WIDTH, gl.num_warps())
    rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
    row_ok = (rows < length)[:, None]
    if ROTATE != 0:
        cols = COL0 // 2 + gl.arange(0, WIDTH // 2, layout=gl.SliceLayout(0, layout))
        ptrs = sinu_ptr + (start + rows)[:, None] * stride_sn + cols[None, :] * stride_sd
        sin = gl.load(ptrs, mask=row_ok, other=0.0).to(gl.float32)
        cos = gl.load(ptrs + HALF_D * stride_sd, mask=row_ok, other=0.0).to(gl.float32)
    else:
        sin = gl.zeros([BLOCK, WIDTH // 2], gl.float32, layout)
        cos = sin
    return sin, cos, row_ok


@gluon.jit
def _prepare_tile(tile, sin, cos, row_ok, ROTATE: gl.constexpr, partial):
    """Rotate a landed tile in place by the angles of its columns (:func:`_angles`) when ``ROTATE`` (in fp32,
    rounded back as an unfused rotary would have stored it); either way rows past the block's end become zeros,
    so that the next block's rows add nothing, not even a NaN."""
    layout: gl.constexpr = rows_layout(tile.shape[1], gl.num_warps())
    if ROTATE:
        x = tile.load(layout)
        even, odd = _pairs(x)
        even = even.to(gl.float32)
        odd = odd.to(gl.float32)
        turned_even = gl.where(row_ok, even * cos - odd * sin, 0.0).to(x.dtype)
        turned_odd = gl.where(row_ok, odd * cos + even * sin, 0.0).to(x.dtype)
        tile.store(_unpairs(turned_even, turned_odd))
    elif partial:
        x = tile.load(layout)
        even, odd = _pairs(x)
        tile.store(_unpairs(gl.where(row_ok, even, 0.0).to(x.dtype), gl.where(row_ok, odd, 0.0).to(x.dtype)))


@gluon.jit
def _store_gradient(acc, stage, stage32, base, stride_n, length, sin, cos, ROTATE: gl.constexpr):
    """Store a gradient tile so that each thread writes 16 contiguous bytes, rows past the block's end not
    written: through ``stage`` (a tile of the inputs' dtype no longer read), or, for a rotated operand
    (``ROTATE``), turned back in fp32 by its columns' angles (``sin -> -sin``) after staging it as it is in
    ``stage32`` (fp32 shared memory no longer read)."""
    layout: gl.constexpr = rows_layout(acc.shape[1], gl.num_warps())
    if ROTATE:
        stage32.store(acc)
        even, odd = _pairs(stage32.load(layout))
        tile = _unpairs(even * cos + odd * sin, odd * cos - even * sin).to(base.dtype.element_ty)
    else:
        stage.store(acc.to(base.dtype.element_ty))
        tile = stage.load(layout)
    rows = gl.arange(0, tile.shape[0], layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, tile.shape[1], layout=gl.SliceLayout(0, layout))
    gl.store(base + rows.to(gl.int64)[:, None] * stride_n + cols[None, :], tile, mask=(rows < length)[:, None])


@gluon.jit
def _rows_in_warps(ds, offs_i, offs_j):
    """``ds`` and its row and column offsets in ``_ROWS_IN_WARPS`` (``write_pos_bias_grad``'s diagonals)."""
    BLOCK: gl.constexpr = ds.shape[0]
    return (gl.convert_layout(ds, _ROWS_IN_WARPS), gl.arange(0, BLOCK, layout=gl.SliceLayout(1, _ROWS_IN_WARPS)),
            gl.arange(0, BLOCK, layout=gl.SliceLayout(0, _ROWS_IN_WARPS)))


# The time bias's gradient, summed per bucket in shared memory once the program's products are done (the non-GQA
# kernel's end, where every buffer is dead; Gluon has no indexed stores to shared memory, hence PTX). Per-thread
# bins of W buckets a pass: [W, 128] fp32 from the start of the dynamic shared memory (Triton's `global_smem`;
# W * 512 bytes, within the 512 * D bytes of the tiles, as W <= D), bucket b of thread t at (b * 128 + t) * 4, so
# that a warp's 32 lanes hit 32 banks whatever their buckets. Each thread adds its own pairs in a fixed order (a
# load, an add and a store each: no atomics); then each bucket's 128 bins are summed in a fixed order by 128 / W
# threads, lane l reading thread (l + k) % 32 of each 32 at step k (again 32 banks). Bitwise reproducible. At
# `ads` (about 36 buckets a block) this took the time bias's backward from 6.37 to 4.45 ms (the plain one: 3.94):
# a few instructions a pair, where a compare, a select and an add per pair and bucket took 2 ms.
def _zero_bins_asm(width: int) -> str:
    stores = "\n".join(f"st.shared.v4.f32 [a+{k * 2048}], {{z, z, z, z}};" for k in range(width // 4))
    return f"""{{
    .reg .b32 a;
    .reg .f32 z;
    mov.f32 z, 0f00000000;
    mov.u32 a, global_smem;
    mad.lo.u32 a, $1, 16, a;
    {stores}
    mov.u32 $0, 0;
    }}"""


def _sum_bins_asm(width: int) -> str:
    chunks = 4 * width // 128  # of 32 threads' bins, per thread: 128 // width threads share a value
    steps = []
    for k in range(32):
        steps.append(f"add.u32 r, l, {k}; and.b32 r, r, 31; mad.lo.u32 a, r, 4, row;")
        steps += [f"ld.shared.f32 x, [a+{c * 128}]; add.f32 s, s, x;" for c in range(chunks)]
    body = "\n".join(steps)
    return f"""{{
    .reg .b32 row, l, r, a;
    .reg .f32 s, x;
    and.b32 row, $1, {width - 1};
    mov.u32 a, global_smem;
    mad.lo.u32 row, row, 512, a;
    shr.u32 r, $1, {width.bit_length() - 1};
    mad.lo.u32 row, r, {chunks * 128}, row;
    and.b32 l, $1, 31;
    mov.f32 s, 0f00000000;
    {body}
    mov.b32 $0, s;
    }}"""


def _add_to_bins_asm(width: int) -> str:
    return f"""{{
    .reg .pred p;
    .reg .b32 a, t;
    .reg .f32 x;
    setp.lt.u32 p, $2, {width};
    @p mov.u32 t, %tid.x;
    @p mov.u32 a, global_smem;
    @p mad.lo.u32 a, t, 4, a;
    @p mad.lo.u32 a, $2, 512, a;
    @p ld.shared.f32 x, [a];
    @p add.f32 x, x, $1;
    @p st.shared.f32 [a], x;
    mov.u32 $0, 0;
    }}"""


_ZERO_32, _ADD_32, _SUM_32 = (gl.constexpr(f(32)) for f in (_zero_bins_asm, _add_to_bins_asm, _sum_bins_asm))
_ZERO_64, _ADD_64, _SUM_64 = (gl.constexpr(f(64)) for f in (_zero_bins_asm, _add_to_bins_asm, _sum_bins_asm))
_ZERO_128, _ADD_128, _SUM_128 = (gl.constexpr(f(128)) for f in (_zero_bins_asm, _add_to_bins_asm, _sum_bins_asm))
# One element per thread: thread t holds element t.
_THREADS_LAYOUT = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))


@gluon.jit
def _bins_pass(ds, rel, threads, zero_asm: gl.constexpr, add_asm: gl.constexpr, sum_asm: gl.constexpr):
    """One pass of the bins (see above) on buckets ``rel`` (relative to the pass's first): each thread's share of
    each bucket's sum, in ``threads``' layout."""
    barrier()  # every thread is done with the shared memory (the products, the last pass)
    gl.inline_asm_elementwise(zero_asm, "=r,r", [threads], dtype=gl.int32, is_pure=False, pack=1)
    barrier()
    gl.inline_asm_elementwise(add_asm, "=r,f,r", [ds, rel], dtype=gl.int32, is_pure=False, pack=1)
    barrier()
    shares = gl.inline_asm_elementwise(sum_asm, "=f,r", [threads], dtype=gl.float32, is_pure=False, pack=1)
    barrier()  # Triton's own scratch (the caller's sum across warps) knows nothing of the bins' reads
    return shares


@gluon.jit
def _sums_in_bins(ds, index, row_ptr, count, WIDTH: gl.constexpr):
    """Sum the fp32 ``ds`` tile over each value of ``index`` (its layout, ``0 <= index < count``) into the partial
    row at ``row_ptr`` (``count`` wide), ``WIDTH`` values a pass through shared memory (see above: every thread of
    the program calls this once its shared memory is dead)."""
    threads = gl.arange(0, 128, layout=_THREADS_LAYOUT)
    for base in range(0, count, WIDTH):
        if WIDTH == 32:
            shares = _bins_pass(ds, index - base, threads, _ZERO_32, _ADD_32, _SUM_32)
        elif WIDTH == 64:
            shares = _bins_pass(ds, index - base, threads, _ZERO_64, _ADD_64, _SUM_64)
        else:
            shares = _bins_pass(ds, index - base, threads, _ZERO_128, _ADD_128, _SUM_128)
        # 128 // WIDTH threads per value, thread t's share of value t % WIDTH: summed in a fixed order.
        sums = gl.sum(gl.reshape(shares, [128 // WIDTH, WIDTH]), axis=0)
        values = base + gl.arange(0, WIDTH, layout=sums.type.layout)
        gl.store(row_ptr + values, sums, mask=values < count)


@gluon.jit
def _probs_and_grads(q, k, v, do, start, length, later, head, slot_head, scale, qk_scale_log2, mods, dpos_ptr,
                     dtime_ptr, scores_layout: gl.constexpr, BLOCKS: gl.constexpr, IN_BLOCK: gl.constexpr,
                     SUMMED: gl.constexpr):
    """``(P, dS, dS in fp32)`` of one (tile, query head), the first two in the inputs' dtype, from the landed
    tiles, ``dS`` times ``scale``. A tile of ``BLOCKS`` blocks masks each row's keys to its block (``later``: where
    the later blocks begin, ``tiles.tile_bounds``). With in-block options (``IN_BLOCK``, arguments ``mods``:
    ``in_block.kernel_args``) the Triton kernels' own tile code runs on this kernel's layouts, and the block's share
    of the gradients of the biases in ``SUMMED`` goes to row ``slot_head`` of the partial buffers."""
    BLOCK: gl.constexpr = q.shape[0]
    zeros = gl.zeros([BLOCK, BLOCK], gl.float32, scores_layout)
    scores = warpgroup_mma(q, k.permute((1, 0)), zeros, use_acc=False, is_async=True)
    dp = warpgroup_mma(do, v.permute((1, 0)), zeros, use_acc=False, is_async=True)
    if DROPOUT & IN_BLOCK:  # the Philox words while the products run
        call_rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, _CALLS_LAYOUT))
        call_cols = gl.arange(0, BLOCK // 4, layout=gl.SliceLayout(0, _CALLS_LAYOUT))
        keep = gl.convert_layout(dropout_factors(start, head, mods, call_rows, call_cols, BLOCK), scores_layout)
    else:
        keep = 1.0  # not read
    scores, dp = warpgroup_mma_wait(num_outstanding=0, deps=(scores, dp))
    offs_j = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, scores_layout))
    if IN_BLOCK:
        offs_i = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, scores_layout))
        offs_16 = gl.arange(0, 16, layout=gl.SliceLayout(0, scores_layout))
        p, ds, ds32 = tile_probs_and_grads(scores, dp, keep, start, length, head, slot_head, length > 0, offs_i,
                                           offs_j, offs_16, qk_scale_log2, scale, q.dtype, mods, dpos_ptr, dtime_ptr,
                                           BLOCK, IN_BLOCK, _rows_in_warps, SUMMED)
    else:
        if BLOCKS > 1:
            offs_i = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, scores_layout))
            keys = same_block(offs_i, offs_j, later[0], later[1], later[2])
        else:
            keys = None
        p = softmax_probs(scores, offs_j < length, qk_scale_log2, keys=keys)
        ds = grad_scores(p, dp, q.dtype, scale)  # before P is rounded: p and dp die sooner
        p = p.to(q.dtype)
        ds32 = dp  # not read
    return p, ds, ds32


@gluon.jit
def _load_tiles(q_desc, k_desc, v_desc, do_desc, row, col, tiles, buf, landed):
    """One head's q, k, v and dO tiles by TMA into buffer ``buf`` of ``tiles``, counted on its barrier."""
    bar = landed.index(buf)
    mbarrier.expect(bar, 4 * q_desc.block_type.nbytes)
    tma_load(q_desc, [row, col], bar, tiles.index(4 * buf))
    tma_load(k_desc, [row, col], bar, tiles.index(4 * buf + 1))
    tma_load(v_desc, [row, col], bar, tiles.index(4 * buf + 2))
    tma_load(do_desc, [row, col], bar, tiles.index(4 * buf + 3))


@gluon.jit
def _block_attention_bwd_sm90_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_ptr, dk_ptr, dv_ptr, sinu_ptr,
    block_seq_ptr, block_cum_ptr, offsets_ptr,
    num_seqs, num_tokens, scale, qk_scale_log2,
    stride_dqn, stride_dkn, stride_dvn, stride_sn, stride_sd,
    dpos_ptr, dtime_ptr, pos_bias_ptr, stride_pbh, stride_pbw, buckets_ptr, stride_bucket_row, time_bias_ptr,
    stride_tbh, stride_tbb, num_buckets, seed_ptr, keep_threshold, keep_scale,
    NUM_HEADS: gl.constexpr, HEADS: gl.constexpr, BLOCKS: gl.constexpr, ROTATE: gl.constexpr,
    IN_BLOCK: gl.constexpr, TIME_BINS: gl.constexpr,
):
    # One program per block and HEADS of its heads, heads fastest. With HEADS > 1 the next head's four tiles land in
    # a second buffer while this one computes, and the angles load once for them all. ROTATE is a bit mask
    # (tiles.ROTATE_Q/K/V) of the rotated operands. IN_BLOCK: the in-block options, as in the Triton kernels (their
    # arguments ``mods``), with one head a program: the biases' gradients are summed at the end, where the
    # registers of the products are free and shared memory is dead (the time bias's TIME_BINS buckets a pass,
    # _sums_in_bins, use the tiles' memory). A "block" here is a tile of BLOCKS blocks (tiles.tile_bounds; no
    # in-block option with more than one).
    gl.static_assert(HEADS == 1 or IN_BLOCK == 0)
    gl.static_assert(BLOCKS == 1 or IN_BLOCK == 0)
    BLOCK: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    BUFFERS: gl.constexpr = 2 if HEADS > 1 else 1
    PROGRAMS_PER_BLOCK: gl.constexpr = (NUM_HEADS + HEADS - 1) // HEADS
    # Score tiles and gradient tiles in the wgmma accumulator layouts (one warpgroup, or two: _num_warps).
    scores_layout: gl.constexpr = mma_layout(BLOCK, BLOCK, gl.num_warps(), dtype)
    grad_layout: gl.constexpr = mma_layout(BLOCK, D, gl.num_warps(), dtype)

    pid = gl.program_id(0)
    slot = pid // PROGRAMS_PER_BLOCK
    head0 = (pid % PROGRAMS_PER_BLOCK) * HEADS
    start, length, second, third, fourth = tile_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, slot, num_seqs,
                                                       num_tokens, BLOCK, BLOCKS, offsets_chunk())
    mods = (pos_bias_ptr, stride_pbh, stride_pbw, buckets_ptr, stride_bucket_row, time_bias_ptr, stride_tbh,
            stride_tbb, num_buckets, seed_ptr, keep_threshold, keep_scale)
    if length > 0:
        tiles = gl.allocate_shared_memory(dtype, [4 * BUFFERS, BLOCK, D], q_desc.layout)
        probs = gl.allocate_shared_memory(dtype, [BLOCK, BLOCK], gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK],
                                                                                                       dtype))
        landed = gl.allocate_shared_memory(gl.int64, [BUFFERS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(BUFFERS):
            mbarrier.init(landed.index(i), count=1)
        row = start.to(gl.int32)
        _load_tiles(q_desc, k_desc, v_desc, do_desc, row, head0 * D, tiles, 0, landed)
        # A rotated operand's gradient is staged in fp32 where a buffer's v and dO were (both read by then).
        stage32 = reinterpret(tiles, gl.float32, [2 * BUFFERS, BLOCK, D],
                              gl.NVMMASharedLayout.get_default_for([BLOCK, D], gl.float32))
        # The angles turn the operands and the gradients of every head; loaded while the first tiles land.
        sin, cos, row_ok = _angles(sinu_ptr, start, length, stride_sn, stride_sd, BLOCK, D, 0, D // 2, ROTATE)
        partial = length < BLOCK
        # One head a program: a loop of one trip, which the compiler removes. A loop over a count read at run time
        # would hold its registers across the trip: 125 -> 184 registers at D = 64 with a rotary (four programs an
        # SM -> two), 202 -> 255 and spills at D = 128.
        if HEADS == 1:
            count = 1
        else:
            count = gl.minimum(HEADS, NUM_HEADS - head0)
        for i in range(count):
            buf = i % BUFFERS
            head = head0 + i
            col = head * D
            if i + 1 < count:
                # Every thread is done with the other buffer (the previous head's products and staging) before
                # TMA overwrites it.
                fence_async_shared()
                barrier()
                _load_tiles(q_desc, k_desc, v_desc, do_desc, row, col + D, tiles, 1 - buf, landed)
            q = tiles.index(4 * buf)
            k = tiles.index(4 * buf + 1)
            v = tiles.index(4 * buf + 2)
            do = tiles.index(4 * buf + 3)
            stage = stage32.index(2 * buf + 1)
            mbarrier.wait(landed.index(buf), (i // BUFFERS) & 1)
            _prepare_tile(q, sin, cos, row_ok, ROTATE_Q & ROTATE, partial)
            _prepare_tile(k, sin, cos, row_ok, ROTATE_K & ROTATE, partial)
            _prepare_tile(v, sin, cos, row_ok, ROTATE_V & ROTATE, partial)
            _prepare_tile(do, sin, cos, row_ok, 0, partial)
            fence_async_shared()

            slot_head = slot * NUM_HEADS + head
            p, ds, ds32 = _probs_and_grads(q, k, v, do, start, length, (second, third, fourth), head, slot_head,
                                           scale, qk_scale_log2, mods, dpos_ptr, dtime_ptr, scores_layout, BLOCKS,
                                           IN_BLOCK, 0)
            probs.store(p)
            fence_async_shared()
            zeros = gl.zeros([BLOCK, D], gl.float32, grad_layout)
            dv = warpgroup_mma(probs.permute((1, 0)), do, zeros, use_acc=False, is_async=True)
            dv = warpgroup_mma_wait(num_outstanding=0, deps=(dv,))
            probs.store(ds)
            fence_async_shared()
            _store_gradient(dv, do, stage, dv_ptr + start * stride_dvn + col, stride_dvn, length, sin, cos,
                            ROTATE_V & ROTATE)
            dk = warpgroup_mma(probs.permute((1, 0)), q, zeros, use_acc=False, is_async=True)
            dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk,))
            _store_gradient(dk, v, stage, dk_ptr + start * stride_dkn + col, stride_dkn, length, sin, cos,
                            ROTATE_K & ROTATE)
            dq = warpgroup_mma(probs, k, zeros, use_acc=False, is_async=True)
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
            _store_gradient(dq, q, stage, dq_ptr + start * stride_dqn + col, stride_dqn, length, sin, cos,
                            ROTATE_Q & ROTATE)
            if (POS_BIAS | TIME_BIAS) & IN_BLOCK:
                offs_i = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, scores_layout))
                offs_j = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, scores_layout))
                if POS_BIAS & IN_BLOCK:
                    write_pos_bias_grad(ds32, slot_head, length > 0, dpos_ptr, offs_i, offs_j, BLOCK,
                                        _rows_in_warps)
                if TIME_BIAS & IN_BLOCK:
                    bucket = bucket_tile(start, start + offs_i, offs_i < length, offs_j, mods)
                    _sums_in_bins(ds32, bucket, dtime_ptr + slot_head.to(gl.int64) * num_buckets, num_buckets,
                                  TIME_BINS)
        for i in gl.static_range(BUFFERS):
            mbarrier.invalidate(landed.index(i))


@gluon.jit
def _load_head(q_desc, do_desc, row, col, heads, buf, landed):
    """One query head's q and dO tiles by TMA into buffer ``buf`` of ``heads``, counted on its barrier."""
    bar = landed.index(buf)
    mbarrier.expect(bar, 2 * q_desc.block_type.nbytes)
    tma_load(q_desc, [row, col], bar, heads.index(2 * buf))
    tma_load(do_desc, [row, col], bar, heads.index(2 * buf + 1))


@gluon.jit
def _product_parts(a, b, acc0, acc1, PARTS: gl.constexpr):
    """``acc0 += a @ b[:, :W]`` and, where ``PARTS == 2``, ``acc1 += a @ b[:, W:]`` (``W``: ``b``'s width over
    ``PARTS``; ``acc1`` is returned untouched otherwise)."""
    W: gl.constexpr = b.shape[1] // PARTS
    acc0 = warpgroup_mma(a, b.slice(0, W, dim=1), acc0, is_async=True)
    if PARTS == 2:
        acc1 = warpgroup_mma(a, b.slice(W, W, dim=1), acc1, is_async=True)
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
    else:
        acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0,))
    return acc0, acc1


@gluon.jit
def _block_attention_bwd_sm90_gqa_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_ptr, dk_ptr, dv_ptr, sinu_ptr,
    block_seq_ptr, block_cum_ptr, offsets_ptr,
    num_seqs, num_tokens, scale, qk_scale_log2,
    stride_dqn, stride_dkn, stride_dvn, stride_sn, stride_sd,
    dpos_ptr, dtime_ptr, pos_bias_ptr, stride_pbh, stride_pbw, buckets_ptr, stride_bucket_row, time_bias_ptr,
    stride_tbh, stride_tbb, num_buckets, seed_ptr, keep_threshold, keep_scale,
    NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCKS: gl.constexpr, ROTATE: gl.constexpr,
    PARTS: gl.constexpr, IN_BLOCK: gl.constexpr, SPLIT: gl.constexpr,
):
    # One program per (block, kv head), kv heads fastest: k and v land (and turn) once, then the GROUP query heads
    # that share them run in turn, the next head's q and dO landing in a second buffer while this one computes.
    # dk and dv accumulate over the group in the products' registers and are stored once: no atomics, bitwise
    # reproducible. From D = 128 the two accumulators take 128 registers a thread of one warpgroup, so every
    # column-wise step (dk, dv and dq products, turning q, storing gradients) runs in PARTS = 2 column halves, and
    # the angles are loaded again where needed (an L1/L2 hit) rather than held across the loop, but for q's second
    # half from one head's dq to the next head's q: otherwise registers spill. Those loads cost (H100, 8:2 at D =
    # 128, fp32 angles, backward over its floor): 1.37-1.38x with four a head, 1.33x with three, 1.20-1.21x with
    # stand-ins computed in registers in their place (2026-11-28). A "block" is a tile of BLOCKS blocks, as in the
    # kernel above.
    #
    # Where q's descriptor lands half a block's rows (HALVES == 2: 128-token blocks), each query head runs as two
    # steps of 64 query rows against the block's 128 keys, as FlashAttention-3's backward does: a step's dq is
    # whole (every key is in the tile), dk and dv sum both halves. Its [64, 128] score tiles take 32 registers a
    # thread over two warpgroups (side by side along the keys) where [128, 128] ones took 64, and q's angles load
    # for each step where they are needed.
    #
    # SPLIT (_split_products): a step computes S, then P, whose dV product runs while dP's does, then dS, where S and
    # dP issued together and held beside the group's dk and dv spilled registers; P and dS then take a tile each.
    BLOCK: gl.constexpr = k_desc.block_type.shape[0]
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    HALVES: gl.constexpr = BLOCK // ROWS
    STEPS: gl.constexpr = GROUP * HALVES
    gl.static_assert(BLOCKS == 1 or IN_BLOCK == 0)
    gl.static_assert(HALVES == 1 or SPLIT)
    gl.static_assert(not SPLIT or (PARTS == 1 and IN_BLOCK == 0 and BLOCKS == 1))
    D: gl.constexpr = q_desc.block_type.shape[1]
    W: gl.constexpr = D // PARTS
    dtype: gl.constexpr = q_desc.dtype
    scores_layout: gl.constexpr = mma_layout(ROWS, BLOCK, gl.num_warps(), dtype)
    part_layout: gl.constexpr = mma_layout(BLOCK, W, gl.num_warps(), dtype)
    dq_layout: gl.constexpr = mma_layout(ROWS, W, gl.num_warps(), dtype)
    # In whole rows of whole blocks the angles load once, for k and v, every head's q and dq, then dk and dv: held
    # in registers across the group loop. Otherwise they load again where needed (held, they spill).
    HOLD: gl.constexpr = PARTS == 1 and HALVES == 1

    pid = gl.program_id(0)
    kv_head = pid % NUM_KV_HEADS
    start, length, second, third, fourth = tile_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, pid // NUM_KV_HEADS,
                                                       num_seqs, num_tokens, BLOCK, BLOCKS, offsets_chunk())
    mods = (pos_bias_ptr, stride_pbh, stride_pbw, buckets_ptr, stride_bucket_row, time_bias_ptr, stride_tbh,
            stride_tbb, num_buckets, seed_ptr, keep_threshold, keep_scale)
    if length > 0:
        kv = gl.allocate_shared_memory(dtype, [2, BLOCK, D], k_desc.layout)
        heads = gl.allocate_shared_memory(dtype, [4, ROWS, D], q_desc.layout)  # q, dO of buffer 0, then 1
        scores_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK], dtype)
        probs = gl.allocate_shared_memory(dtype, [ROWS, BLOCK], scores_tile)
        if SPLIT:  # dS in a tile of its own: its store need not wait for both warpgroups' dV products to read P
            grads = gl.allocate_shared_memory(dtype, [ROWS, BLOCK], scores_tile)
        else:
            grads = probs
        landed = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())  # each buffer; k and v
        for i in gl.static_range(3):
            mbarrier.init(landed.index(i), count=1)
        k = kv.index(0)
        v = kv.index(1)
        row = start.to(gl.int32)
        mbarrier.expect(landed.index(2), 2 * k_desc.block_type.nbytes)
        tma_load(k_desc, [row, kv_head * D], landed.index(2), k)
        tma_load(v_desc, [row, kv_head * D], landed.index(2), v)
        _load_head(q_desc, do_desc, row, kv_head * GROUP * D, heads, 0, landed)

        kv_rotate: gl.constexpr = ROTATE & (ROTATE_K | ROTATE_V)
        for c in gl.static_range(PARTS):
            sin, cos, row_ok = _angles(sinu_ptr, start, length, stride_sn, stride_sd, BLOCK, W, c * W, D // 2,
                                       ROTATE if HOLD else kv_rotate)
            if c == 0:  # the first angles load while k and v land
                mbarrier.wait(landed.index(2), 0)
            _prepare_tile(k.slice(c * W, W, dim=1), sin, cos, row_ok, ROTATE_K & ROTATE, length < BLOCK)
            _prepare_tile(v.slice(c * W, W, dim=1), sin, cos, row_ok, ROTATE_V & ROTATE, length < BLOCK)
        # A rotated operand's gradient is staged in fp32 where a buffer's q and dO were (both read by then): part c
        # of buffer b at index b * PARTS + c.
        stage32 = reinterpret(heads, gl.float32, [2 * PARTS, ROWS, W],
                              gl.NVMMASharedLayout.get_default_for([ROWS, W], gl.float32))

        if PARTS == 2:
            # q's angles of the second half: loaded for a head's dq, then held for the next head's q (three loads a
            # head instead of four; holding the first half's too spills)
            held_sin, held_cos, _ = _angles(sinu_ptr, start, length, stride_sn, stride_sd, BLOCK, W, W, D // 2,
                                            ROTATE & ROTATE_Q)
        dk0 = gl.zeros([BLOCK, W], gl.float32, part_layout)
        dk1 = gl.zeros([BLOCK, W], gl.float32, part_layout)
        dv0 = gl.zeros([BLOCK, W], gl.float32, part_layout)
        dv1 = gl.zeros([BLOCK, W], gl.float32, part_layout)
        for step in range(STEPS):
            buf = step % 2
            g = step // HALVES
            first = (step % HALVES) * ROWS  # the step's first query row in the block
            rows = length - first  # of them in the block (<= 0: none, their gradients not stored)
            head_col = (kv_head * GROUP + g) * D
            if step + 1 < STEPS:
                # Every thread is done with the other buffer (the previous step's products and staging) before
                # TMA overwrites it.
                fence_async_shared()
                barrier()
                _load_head(q_desc, do_desc, row + ((step + 1) % HALVES) * ROWS,
                           (kv_head * GROUP + (step + 1) // HALVES) * D, heads, 1 - buf, landed)
            q = heads.index(2 * buf)
            do = heads.index(2 * buf + 1)
            for c in gl.static_range(PARTS):
                if PARTS == 2:
                    q_ok = row_ok
                    if c == 0:
                        q_sin, q_cos, _ = _angles(sinu_ptr, start, length, stride_sn, stride_sd, BLOCK, W, 0, D // 2,
                                                  ROTATE & ROTATE_Q)
                    else:
                        q_sin = held_sin
                        q_cos = held_cos
                elif HALVES == 2:
                    q_sin, q_cos, q_ok = _angles(sinu_ptr, start + first, rows, stride_sn, stride_sd, ROWS, W, 0,
                                                 D // 2, ROTATE & ROTATE_Q)
                else:
                    q_sin, q_cos, q_ok = sin, cos, row_ok
                if c == 0:  # the first angles load while q and dO land
                    mbarrier.wait(landed.index(buf), (step // 2) & 1)
                _prepare_tile(q.slice(c * W, W, dim=1), q_sin, q_cos, q_ok, ROTATE_Q & ROTATE, rows < ROWS)
                _prepare_tile(do.slice(c * W, W, dim=1), q_sin, q_cos, q_ok, 0, rows < ROWS)
            fence_async_shared()

            head = kv_head * GROUP + g
            slot_head = (pid // NUM_KV_HEADS) * (NUM_KV_HEADS * GROUP) + head
            if SPLIT:
                scores = warpgroup_mma(q, k.permute((1, 0)), gl.zeros([ROWS, BLOCK], gl.float32, scores_layout),
                                       use_acc=False, is_async=True)
                scores = warpgroup_mma_wait(num_outstanding=0, deps=(scores,))
                p = softmax_probs(scores, gl.arange(0, BLOCK, layout=gl.SliceLayout(0, scores_layout)) < length,
                                  qk_scale_log2)
                probs.store(p.to(dtype))
                fence_async_shared()
                dv0 = warpgroup_mma(probs.permute((1, 0)), do, dv0, is_async=True)
                dp = warpgroup_mma(do, v.permute((1, 0)), gl.zeros([ROWS, BLOCK], gl.float32, scores_layout),
                                   use_acc=False, is_async=True)
                dv0, dp = warpgroup_mma_wait(num_outstanding=0, deps=(dv0, dp))
                grads.store(grad_scores(p, dp, dtype, scale))
                fence_async_shared()
                dk0 = warpgroup_mma(grads.permute((1, 0)), q, dk0, is_async=True)
            else:
                p, ds, _ = _probs_and_grads(q, k, v, do, start, length, (second, third, fourth), head, slot_head,
                                            scale, qk_scale_log2, mods, dpos_ptr, dtime_ptr, scores_layout, BLOCKS,
                                            IN_BLOCK, POS_BIAS | TIME_BIAS)
                probs.store(p)
                fence_async_shared()
                dv0, dv1 = _product_parts(probs.permute((1, 0)), do, dv0, dv1, PARTS)
                grads.store(ds)
                fence_async_shared()
                dk0, dk1 = _product_parts(grads.permute((1, 0)), q, dk0, dk1, PARTS)
            for c in gl.static_range(PARTS):
                dq = warpgroup_mma(grads, k.slice(c * W, W, dim=1), gl.zeros([ROWS, W], gl.float32, dq_layout),
                                   use_acc=False, is_async=True)
                if PARTS == 2:  # while the product runs
                    q_sin, q_cos, _ = _angles(sinu_ptr, start, length, stride_sn, stride_sd, BLOCK, W, c * W, D // 2,
                                              ROTATE & ROTATE_Q)
                    if c == 1:
                        held_sin = q_sin
                        held_cos = q_cos
                elif HALVES == 2:
                    q_sin, q_cos, _ = _angles(sinu_ptr, start + first, rows, stride_sn, stride_sd, ROWS, W, 0, D // 2,
                                              ROTATE & ROTATE_Q)
                else:
                    q_sin, q_cos = sin, cos
                if SPLIT:
                    dq, dk0 = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dk0))
                else:
                    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
                _store_gradient(dq, q.slice(c * W, W, dim=1), stage32.index(buf * PARTS + c),
                                dq_ptr + (start + first) * stride_dqn + head_col + c * W, stride_dqn, rows, q_sin,
                                q_cos, ROTATE_Q & ROTATE)
        for i in gl.static_range(3):
            mbarrier.invalidate(landed.index(i))
        # dk and dv staged in fp32 where both buffers' q and dO were: one stage for each, or one for both in turn
        # where half a block's query rows make the buffers half as long.
        STAGES: gl.constexpr = 2 * PARTS // HALVES
        kv_stage32 = reinterpret(heads, gl.float32, [STAGES, BLOCK, W],
                                 gl.NVMMASharedLayout.get_default_for([BLOCK, W], gl.float32))
        for c in gl.static_range(PARTS):
            if c == 0:
                dv_part, dk_part = dv0, dk0
            else:
                dv_part, dk_part = dv1, dk1
            if not HOLD:
                sin, cos, _ = _angles(sinu_ptr, start, length, stride_sn, stride_sd, BLOCK, W, c * W, D // 2,
                                      kv_rotate)
            _store_gradient(dv_part, v.slice(c * W, W, dim=1), kv_stage32.index(c),
                            dv_ptr + start * stride_dvn + kv_head * D + c * W, stride_dvn, length, sin, cos,
                            ROTATE_V & ROTATE)
            _store_gradient(dk_part, k.slice(c * W, W, dim=1), kv_stage32.index((PARTS + c) % STAGES),
                            dk_ptr + start * stride_dkn + kv_head * D + c * W, stride_dkn, length, sin, cos,
                            ROTATE_K & ROTATE)


def _num_warps(block_size: int, head_dim: int) -> int:
    """One warpgroup at 64-token blocks up to D = 128; two past that, where one warpgroup's accumulators would
    spill: at 128-token blocks the score tiles are [128, 128] (64 registers a thread each for S and dP over two
    warpgroups), at D = 256 the gradient tiles [64, 256] (64 registers a thread over two warpgroups side by side,
    where one would need 128 for each). Under GQA at 128-token blocks and D = 128 the group's [128, 128] dk and dv
    join the score tiles: two warpgroups there measured 2.14-2.46x the floor at 8:4 to 8:1 against 3.43-3.91x for
    four (H100, 8 query heads; H200 2.62-3.26x; docs/benchmarks.md, 2026-11-28), on [128, 128] score tiles and dk
    and dv in column halves, since 2026-11-29 on half the block's query rows a step (:func:`_query_rows`).
    At 64-token blocks up to D = 128 two warpgroups (without a register cap) tied or lost, though ptxas gives them
    no spills where one spills: H200, the sweep's lengths, bf16, one against two, 8:8 plain 1.02x the floor both,
    with fp32 angles 1.29x against 1.47x (D = 64: 1.29x against 1.79x), 8:2 plain 1.10x against 1.74x (1.66x with
    dk and dv in whole rows, ``PARTS`` 1), 8:2 and 8:1 with fp32 angles 1.78-1.81x against 2.21-2.61x
    (2026-11-28)."""
    return 4 if block_size == 64 and head_dim <= 128 else 8


def _heads_per_program(block_size: int, head_dim: int, num_heads: int, options: InBlock) -> int:
    """Heads of a block one program of the non-GQA kernel runs in turn, the next head's tiles landing while one
    computes: all of them at 128-token blocks with D <= 64, where the score tiles' registers hold an SM to one
    program and its loads, products and stores would otherwise take turns (H100, 8 heads, `ads`-like lengths,
    backward over its floor, 1 / 2 / 4 / 8 heads a program: D = 64 1.50 / 1.25 / 1.17 / 1.17x, D = 32 2.40 / 1.89 /
    1.72 / 1.66x; with fp32 angles, read once for all heads, 1.96 -> 1.54x and 2.75 -> 2.08x). Up to 8 of at least
    4 heads at D = 32 on 64-row tiles (64-token blocks, and 16- and 32-token blocks packed in them), where a
    program's tiles are small and its fixed costs (the block's bounds, the barriers, the first load's latency) weigh
    (H200, 2026-11-29, 8 heads, the sweep's lengths, 1 / 2 / 4 / 8 heads a program: 64-token blocks 1.22 / 1.26 /
    1.16 / 1.15x, with fp32 angles 1.56 / 1.64 / 1.53 / 1.50x; 32-token blocks 1.41 / 1.37 / 1.20 / 1.17x and 1.90
    / 1.74 / 1.53 / 1.47x; 16-token blocks 1.47 / 1.35 / 1.20 / 1.16x and 1.73 / 1.71 / 1.52 / 1.47x). One head a
    program elsewhere (D = 64 at 64-token blocks 1.04 / 1.12 / 1.10 / 1.15x, with fp32 angles 1.27 / 1.54 / 1.24 /
    1.25x; D = 128 1.02 / 1.16x, with fp32 angles 1.29 / 2.47x), and with in-block options. The rule does not look
    at the batch: on a batch of fewer blocks than the GPU has SMs, a block's heads run in turn where they could have
    run side by side (not measured)."""
    if options.bits:
        return 1
    if block_size == 128 and head_dim <= 64:
        return num_heads
    if block_size == 64 and head_dim == 32 and num_heads >= 4:
        return min(num_heads, 8)
    return 1


def _query_rows(tile: int, head_dim: int, gqa: bool) -> int:
    """Query rows a step of the GQA kernel takes: half of a 128-token block (two steps a query head) under GQA at
    D = 128, else the tile's. H200, 2026-11-29, the sweep's lengths, bf16, backward over its floor, [128, 128] tiles
    against halves: D = 128 8:4 / 8:2 / 8:1 2.63 / 3.01 / 3.24x -> 2.29 / 2.64 / 3.00x, with fp32 angles 3.54 /
    3.84 / 4.13x -> 3.25 / 3.54 / 3.64x. Where halves lost: D = 64 under GQA (2.35-2.70x -> 2.79-3.35x), D = 32
    under GQA (3.58-4.11x -> 4.81-5.87x; with a register cap of 128, two programs an SM, 3.34-4.15x: a gain at 8:4
    only, a loss with fp32 angles) and without GQA, against the non-GQA kernel (D = 128 1.47x -> 2.01x, D = 64 1.50x
    -> 2.39x, D = 32 2.26x -> 2.62x capped). There one program holds an SM, and a block's chain of products and
    softmax is longer in halves than on [128, 128] tiles: twice the steps, on [64, 64] pieces of the score tiles a
    warpgroup, whose row sums cross between the two warpgroups."""
    return tile // 2 if tile == 128 and gqa and head_dim == 128 else tile


def _split_products(tile: int, head_dim: int, parts: int) -> bool:
    """Whether the GQA kernel computes S, then P on to dV's product, which runs while dP's does, then dS (``SPLIT``),
    rather than S and dP together: at 128-token blocks in whole rows from D = 64, where S and dP held together beside
    the group's dk and dv spilled registers. H200, 2026-11-29, the sweep's lengths, bf16, backward over its floor, 8:4
    / 8:2 / 8:1 on [128, 128] tiles at D = 64: 2.36 / 2.58 / 2.68x -> 2.30 / 2.42 / 2.55x, with fp32 angles 2.99 /
    3.18 / 3.25x -> 2.84 / 2.97 / 3.04x (ptxas: 12 -> 0 bytes of spills a thread, 72 -> 12 with a rotary); at D = 32
    (no spills either way) 3.58-4.33x -> 3.61-4.40x, a loss. Half a block's query rows a step (D = 128) were measured
    split only."""
    return tile == 128 and head_dim >= 64 and parts == 1


def why_not(call) -> str | None:
    """Why these kernels do not take a Hopper backward ``call`` (``backends.AttentionCall``), or ``None``: they take
    16-bit inputs that TMA can read and gradients laid out as ``[N, H * D]`` rows, with or without GQA, with or
    without a rotary, at 64-token blocks with D = 32, 64, 128 or 256 and at 128-token blocks with D = 32, 64 or 128
    (at D = 256 the four [128, 256] tiles do not fit in shared memory); 16- and 32-token blocks as 64-row tiles of
    4 or 2 blocks where ``tiles.blocks_per_tile`` packs them, at D = 32-256. The in-block options at 64-token
    blocks and D <= 128 only, where one warpgroup runs (their tile code's layouts assume it); both biases together
    under GQA stay with the Triton kernels: there the group's accumulators and the biases' gradients spill
    registers, 40.6 ms against 34.6 with a causal mask (8 query heads on 2 kv heads, D = 128, `ads` lengths,
    H100)."""
    both_biases = POS_BIAS.value | TIME_BIAS.value
    gqa = call.num_heads != call.num_kv_heads
    if gqa and call.in_block & both_biases == both_biases:
        return "takes the position and time biases together without GQA only (the Triton kernels are faster)"
    tile = call.block_size * tiles.blocks_per_tile(call.block_size, call.head_dim, call.num_heads // call.num_kv_heads,
                                                   call.rotate != 0, call.in_block, backward=True)
    if tile not in _HEAD_DIMS:
        return f"takes block sizes {tuple(_HEAD_DIMS)}, and 16 or 32 where they run 64-row tiles, only"
    if call.head_dim not in _HEAD_DIMS[tile]:
        return f"takes D in {_HEAD_DIMS[tile]} at {call.block_size}-token blocks"
    if call.in_block and _num_warps(call.block_size, call.head_dim) != 4:
        return "takes the in-block options at 64-token blocks with D <= 128 only"
    if call.dtype not in _GL_DTYPES:
        return "takes float16 and bfloat16 only"
    if not call.tma_rows:
        return "needs q, k, v, dO as 16-byte aligned [N, H * D] rows and gradients as [N, H * D] rows"
    return None


@functools.cache
def _tile_layout(block_size: int, head_dim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for([block_size, head_dim], _TILE_GL_DTYPES[dtype])


def _descriptor(t: torch.Tensor, block_size: int) -> TensorDescriptor:
    n, h, d = t.shape
    return TensorDescriptor(t, [n, h * d], [t.stride(0), 1], [block_size, d], _tile_layout(block_size, d, t.dtype))


def _time_bins(options: InBlock, head_dim: int) -> int:
    """Buckets a pass of the time bias's sums in the non-GQA kernel: the bias's width up to a power of two, at least
    32 and at most what the tiles' shared memory holds (``head_dim``: 128 buckets need 64 KiB)."""
    width = 1 if options.time_bias is None else options.time_bias.shape[1]
    return min(head_dim, max(32, 1 << (width - 1).bit_length()))


def _backward_register_cap(options: InBlock, rotate: int, gqa: bool, tile: int, head_dim: int, blocks: int) -> dict:
    """A register cap where it measured faster (`ads`-like lengths; ``tile``: rows of a program's tile, ``blocks``:
    blocks in it):

    - 168 registers a thread (three programs an SM where the tiles' shared memory allows it) for both biases
      together, without GQA, a rotary or dropout: causal + both biases 5.16-5.17 ms uncapped (216 registers), 4.64
      capped (28 bytes spill) on an H100. The time bias alone loses capped (4.67 against 4.48 ms); the position bias
      alone takes 168 anyway; with dropout or a rotary shared memory or spills hold the kernel to two;
    - 168 for GQA at D = 64 without in-block options or a rotary (216-220 registers uncapped, 20-60 bytes spill
      capped): on an H200 1.35-1.40x the floor -> 1.19-1.31x; on an H100 a tie or better (1.07-1.11x ->
      1.06-1.08x). With a rotary, whose angles the kernel holds across its group loop at D <= 64 (246 registers),
      capped it spills 212 bytes: uncapped against capped, 8:2 and 8:1, H100 1.25-1.32x against 1.49-1.54x, H200
      1.74-1.84x against 1.90-2.03x (2026-11-28);
    - 168 for the rotary without GQA at 64-token blocks and D = 128, without in-block options: its angles, held in
      registers from the operands' turns to the gradients', take 64 a thread (on the H200, 202 registers: two
      programs an SM; capped, three, and 88 bytes spilled, ptxas of triton 3.6 and 3.9). H200, 8 heads,
      the sweep's lengths: fp32 angles 1.44x the floor -> 1.29x, bf16 angles 1.40x -> 1.36x (2026-11-28; not
      measured on an H100, where uncapped it ran 1.06-1.09x). The plain kernel (158 registers, three programs
      already) lost capped, 1.02x -> 1.13x. Turning operands and gradients in column halves instead, each half's
      angles loaded where it turns (129 registers uncapped, no spill: three programs an SM), lost too: fp32 angles
      1.29x -> 1.46-1.47x, the angles loaded four times a head instead of once (H200, 2026-11-29);
    - 128 for GQA at D = 32 on tiles of 16- or 32-token blocks (194 registers uncapped with a rotary; 64 bytes spill
      capped, four programs an SM), 8:2: with a rotary H100 1.81-1.83x -> 1.46-1.49x, H200 2.55-2.58x ->
      2.01-2.07x; plain H100 1.34-1.37x -> 1.23-1.24x, H200 1.87-1.88x -> 1.68-1.69x at 16-token blocks
      (2026-11-28). With 64-token blocks (167 registers: three programs an SM already) a tie.
    At D = 128 the kernel's shared memory holds it to two programs an SM."""
    both = options.pos_bias is not None and options.time_bias is not None
    if both and options.dropout_p == 0 and not rotate and not gqa:
        return {"maxnreg": 168}
    if rotate and not gqa and tile == 64 and blocks == 1 and head_dim == 128 and options.bits == 0:
        return {"maxnreg": 168}
    if gqa and tile == 64 and options.bits == 0:
        if head_dim == 64 and not rotate:
            return {"maxnreg": 168}
        if head_dim == 32 and blocks > 1:
            return {"maxnreg": 128}
    return {}


def block_attention_bwd_sm90(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             offsets: torch.Tensor, table: BlockTable | OffsetsOnly, block_size: int, scale: float,
                             sinu_pos: torch.Tensor | None, rotate: int, options: InBlock,
                             grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple:
    """Write ``(dq, dk, dv)`` into ``grads`` and return the gradients of ``options``' biases (None where absent),
    where :func:`why_not` says nothing against the call (the dispatcher's backward signature, ``backends``)."""
    n, h, d = q.shape
    kv_heads = k.shape[1]
    dq, dk, dv = grads
    partials = in_block.bias_grad_partials(options, table.num_slots, block_size, q)
    if table.num_slots == 0:
        return in_block.summed_bias_grads(options, partials)
    sinu_ptr, stride_sn, stride_sd = rotary_operand(sinu_pos, q)
    blocks = tiles.blocks_per_tile(block_size, d, h // kv_heads, rotate != 0, options.bits, backward=True)
    tile = block_size * blocks
    num_tiles = triton.cdiv(table.num_slots, blocks)
    rows = _query_rows(tile, d, h != kv_heads)
    if h == kv_heads and rows == tile:  # the non-GQA kernel lands whole blocks of q; halves go to the GQA one
        per_program = _heads_per_program(tile, d, h, options)
        programs = num_tiles * triton.cdiv(h, per_program)
        kernel = _block_attention_bwd_sm90_kernel
        heads = {"NUM_HEADS": h, "HEADS": per_program, "TIME_BINS": _time_bins(options, d)}
    else:
        # Column halves from D = 128, whole rows below (H100, `ads` lengths, times over the floor: at D = 128 plain
        # 1.02x either way, with a rotary and fp32 angles 1.80-1.92x against 1.86-2.47x for whole rows; at D = 64
        # plain 1.06-1.10x against 1.13-1.15x in halves, with a rotary 1.75-1.92x against 2.02-2.14x). Half a
        # block's query rows a step take whole rows: there the group's dk and dv lie over two warpgroups.
        kernel = _block_attention_bwd_sm90_gqa_kernel
        parts = 2 if d >= 128 and rows == tile else 1
        heads = {"NUM_KV_HEADS": kv_heads, "GROUP": h // kv_heads, "PARTS": parts,
                 "SPLIT": _split_products(tile, d, parts)}
        programs = num_tiles * kv_heads
    launch(
        kernel, (programs,),
        q_desc=_descriptor(q, rows), k_desc=_descriptor(k, tile), v_desc=_descriptor(v, tile),
        do_desc=_descriptor(grad_out, rows),
        dq_ptr=dq, dk_ptr=dk, dv_ptr=dv, sinu_ptr=sinu_ptr,
        **table.kernel_args(offsets), num_tokens=n, scale=scale, qk_scale_log2=scale * LOG2E,
        stride_dqn=dq.stride(0), stride_dkn=dk.stride(0), stride_dvn=dv.stride(0),
        stride_sn=stride_sn, stride_sd=stride_sd, dpos_ptr=partials[0], dtime_ptr=partials[1],
        **in_block.call_args(options, q, offsets, table, block_size), **heads, BLOCKS=blocks, ROTATE=rotate,
        num_warps=_num_warps(tile, d),
        **_backward_register_cap(options, rotate, h != kv_heads, tile, d, blocks),
    )
    return in_block.summed_bias_grads(options, partials)
