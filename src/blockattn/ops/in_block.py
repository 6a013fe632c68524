"""What recommendation models put inside a block (docs/semantics.md, "Inside a block"): a causal mask, a relative
position bias, a relative time bias over log-scaled buckets and dropout on the probabilities.

Here are the tile helpers the Triton kernels call, the host side that turns the options into kernel arguments, and
the two pieces the PyTorch path and the tests must share with the kernels bit for bit: the time buckets' edges and
the dropout stream (Philox 4x32-10, Triton's ``tl.philox``, and its PyTorch twin :func:`dropout_keep`).

Time buckets: ``bucket(dt) = min(B - 1, floor(ln(max(|dt|, 1)) / width))``, ``dt`` rounded to fp32 first. A
kernel run once per call (``bucket_table_kernel``) estimates it with a fast ``log2`` and corrects the estimate by
one step against a table of edges (``edges[k]`` the smallest fp32 ``>= exp(k * width)``), so it agrees exactly with
the definition on every fp32 ``|dt|``: ``bucket(a) >= k`` exactly when ``a >= edges[k]``. It writes each block's
``BS x BS`` buckets to a table that every head's program, forward and backward, reads.

Dropout: the word of key ``j`` of query ``i`` of a block starting at token ``start``, head ``h``, is output
``j % 4`` of ``philox(seed, c0 = i * BS / 4 + j // 4, c1 = start, c2 = h, c3 = 0)``; the probability is kept when
the word is at least ``floor(p * 2**32)``, i.e. with probability ``1 - p`` (to 2**-32), and scaled by
``1 / (1 - p)``. The forward and the backward regenerate the same words; nothing is stored. The seed is one int64
drawn from PyTorch's generator per call (reproducible from ``torch.manual_seed``, and new at each CUDA-graph replay).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..block_table import BlockTable
from .launch import launch
from .rotary import inline_asm
from .tiles import LOG2E, block_bounds, softmax_probs

# Kernels read globals only as constexprs.
_LOG2E = tl.constexpr(LOG2E)
# The options as bits of the ``IN_BLOCK`` constexpr of the kernels (constant first, as for ``tiles.ROTATE_*``).
CAUSAL = tl.constexpr(1)
POS_BIAS = tl.constexpr(2)
TIME_BIAS = tl.constexpr(4)
DROPOUT = tl.constexpr(8)
# The log-bucketing width of generative-recommender models (the public functions' default).
DEFAULT_BUCKET_WIDTH = 0.301
# Below this bucket width the fast log2 could be off by more than the one step the edges correct.
MIN_BUCKET_WIDTH = 1e-3
_PHILOX_KEY = (0x9E3779B9, 0xBB67AE85)
_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)
_PHILOX_ROUNDS = 10


class InBlock(NamedTuple):
    """The in-block options of one call, checked (``checks.in_block``). ``seed``: an int64 ``[1]`` tensor on the
    inputs' device, drawn when ``dropout_p > 0``. ``buckets``: the time buckets' table of the call's timestamps
    (:func:`bucket_table`), where a batch's layout built it once for all its calls or the call's forward built it
    for its backward; else the kernels' launchers build one (:func:`call_buckets`)."""

    causal: bool = False
    pos_bias: torch.Tensor | None = None
    timestamps: torch.Tensor | None = None
    time_bias: torch.Tensor | None = None
    bucket_width: float = DEFAULT_BUCKET_WIDTH
    dropout_p: float = 0.0
    seed: torch.Tensor | None = None
    buckets: torch.Tensor | None = None

    @property
    def bits(self) -> int:
        """The ``IN_BLOCK`` mask of the kernels (0: the plain op)."""
        return ((CAUSAL.value if self.causal else 0) | (POS_BIAS.value if self.pos_bias is not None else 0)
                | (TIME_BIAS.value if self.time_bias is not None else 0)
                | (DROPOUT.value if self.dropout_p > 0 else 0))

    def keep_threshold(self) -> int:
        """Words below this are dropped: ``floor(p * 2**32)``."""
        return math.floor(self.dropout_p * 2**32)


PLAIN = InBlock()


@functools.lru_cache(maxsize=64)
def bucket_edges(num_buckets: int, width: float, device: torch.device) -> torch.Tensor:
    """``[num_buckets + 1]`` fp32: ``edges[k]``, the smallest fp32 ``>= exp(k * width)``, for ``k < num_buckets``;
    ``edges[num_buckets] = NaN``: the last bucket has no upper edge, and no ``|dt|`` compares at or above a NaN, an
    infinite one included (with inf there, ``|dt| = inf`` landed one bucket past the last). Computed on ``device``, no
    host copy; cached, so a CUDA graph captured after the first call reads the same buffer."""
    exact = torch.exp(torch.arange(num_buckets + 1, device=device, dtype=torch.float64) * width)
    edges = exact.float()
    edges = torch.where(edges.double() < exact, torch.nextafter(edges, edges.new_tensor(float("inf"))), edges)
    edges[-1] = float("nan")
    return edges


def time_buckets(dt_abs: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Buckets of fp32 ``|dt|`` values: the number of ``edges[1 : B]`` at or below each; a NaN counts as 0, bucket 0,
    as in the kernels (:func:`_bucket`)."""
    dt_abs = dt_abs.float()
    return torch.searchsorted(edges[1:-1].contiguous(), dt_abs.masked_fill(dt_abs.isnan(), 0.0).contiguous(),
                              right=True)


def abs_time_deltas(t_query: torch.Tensor, t_key: torch.Tensor) -> torch.Tensor:
    """``|t_key - t_query|`` exactly (int64) or in fp32 (float timestamps), then rounded to fp32, as the kernels."""
    if t_query.dtype.is_floating_point:
        return (t_key.float() - t_query.float()).abs()
    return (t_key.long() - t_query.long()).abs().float()


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of the 64-bit product of the 32-bit ``a`` and ``b`` (int64 tensors, no overflow)."""
    b_lo, b_hi = b & 0xFFFF, b >> 16
    low_part, high_part = a * b_lo, a * b_hi  # each below 2**48
    hi = (high_part + (low_part >> 16)) >> 16
    lo = (((high_part & 0xFFFF) << 16) + low_part) & 0xFFFFFFFF
    return hi, lo


def philox(seed: int | torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor) -> list[torch.Tensor]:
    """Philox 4x32-10 on int64 tensors holding uint32 values, as ``tl.philox`` (key: the seed's low and high
    words); returns the four output words."""
    mask = 0xFFFFFFFF
    k0, k1 = seed & mask, (seed >> 32) & mask
    for _ in range(_PHILOX_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(_PHILOX_ROUND[1], c2)
        hi_a, lo_a = _mul_hi_lo(_PHILOX_ROUND[0], c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY[0]) & mask, (k1 + _PHILOX_KEY[1]) & mask
    return [c0, c1, c2, c3]


def dropout_keep(seed: int | torch.Tensor, starts: torch.Tensor, num_heads: int, block_size: int,
                 dropout_p: float) -> torch.Tensor:
    """Which probabilities the kernels keep: bool ``[len(starts), num_heads, BS, BS]`` for blocks starting at token
    rows ``starts`` (query ``i``, key ``j``), ``seed`` an int or the int64 ``[1]`` seed tensor. The PyTorch path's
    dropout, and the tests' view of the kernels' mask."""
    device = starts.device
    i = torch.arange(block_size, device=device)[:, None]
    j = torch.arange(block_size, device=device)[None, :]
    shape = (starts.numel(), num_heads, block_size, block_size)
    c0 = (i * (block_size // 4) + j // 4).expand(shape)
    c1 = (starts.long() & 0xFFFFFFFF).view(-1, 1, 1, 1).expand(shape)
    c2 = torch.arange(num_heads, device=device).view(1, -1, 1, 1).expand(shape)
    words = torch.stack(philox(seed, c0, c1, c2, torch.zeros_like(c0)), dim=-1)
    word = words.gather(-1, (j % 4).expand(shape).unsqueeze(-1)).squeeze(-1)
    return word >= InBlock(dropout_p=dropout_p).keep_threshold()


_POINTERS = ("pos_bias_ptr", "buckets_ptr", "time_bias_ptr", "seed_ptr")


def kernel_args(options: InBlock, like: torch.Tensor, buckets: torch.Tensor | None = None) -> dict:
    """The attention kernels' in-block arguments; absent tensors are stood in for by ``like`` (never read).
    ``buckets``: the time buckets' table of the call (:func:`bucket_table`), with a time bias."""
    if options.bits == 0:  # the plain op: constant scalars (built once, as every call reads them)
        return {**_PLAIN_SCALARS, **dict.fromkeys(_POINTERS, like)}
    pos, bias = options.pos_bias, options.time_bias
    return {
        "pos_bias_ptr": pos if pos is not None else like,
        "stride_pbh": pos.stride(0) if pos is not None else 0,
        "stride_pbw": pos.stride(1) if pos is not None else 0,
        "buckets_ptr": buckets if bias is not None else like,
        "stride_bucket_row": buckets.stride(0) if bias is not None else 0,
        "time_bias_ptr": bias if bias is not None else like,
        "stride_tbh": bias.stride(0) if bias is not None else 0,
        "stride_tbb": bias.stride(1) if bias is not None else 0,
        "num_buckets": bias.shape[1] if bias is not None else 1,
        "seed_ptr": options.seed if options.seed is not None else like,
        "keep_threshold": options.keep_threshold(),
        "keep_scale": 1.0 / (1.0 - options.dropout_p),
        "IN_BLOCK": options.bits,
    }


# The general branch's scalars for the plain op's values (a causal mask alone passes the same ones, and takes
# that branch), with the plain op's mask.
_PLAIN_SCALARS = {name: value for name, value in kernel_args(InBlock(causal=True), torch.empty(0)).items()
                  if name not in _POINTERS} | {"IN_BLOCK": 0}


def bucket_dtype(num_buckets: int, block_size: int) -> torch.dtype:
    """The time buckets' table's dtype: uint8; int32 past 256 buckets, and for 16-token blocks, whose 16 x 16 uint8
    tile Triton 3.6 miscompiles beside the dropout words (wrong outputs on an H100)."""
    return torch.uint8 if num_buckets <= 256 and block_size > 16 else torch.int32


def bucket_table(timestamps: torch.Tensor, num_buckets: int, width: float, offsets: torch.Tensor, table: BlockTable,
                 block_size: int) -> torch.Tensor:
    """The time buckets' table of ``timestamps`` ``[N]`` (one kernel, ``bucket_table_kernel``): ``[N, BS]``
    (:func:`bucket_dtype`), row ``start + i`` holding the buckets of query ``i`` of the block that starts at token
    ``start`` against each key of the block. Built once per call, or once per batch by its layout, it saves every
    head's program, forward and backward, the logarithms and edge lookups of ``BS**2`` pairs."""
    num_tokens = timestamps.shape[0]
    buckets = timestamps.new_empty(num_tokens, block_size, dtype=bucket_dtype(num_buckets, block_size))
    launch(bucket_table_kernel, (table.num_slots,), buckets_ptr=buckets, timestamps_ptr=timestamps,
           stride_ts=timestamps.stride(0), edges_ptr=bucket_edges(num_buckets, width, timestamps.device),
           num_buckets=num_buckets, bucket_scale=math.log(2) / width, **table.kernel_args(offsets),
           num_tokens=num_tokens, BLOCK_SIZE=block_size, INLINE_ASM=inline_asm(timestamps), num_warps=4)
    return buckets


def call_buckets(options: InBlock, offsets: torch.Tensor, table: BlockTable, block_size: int) -> torch.Tensor:
    """The time buckets' table of a call with a time bias: the one ``options`` carries, else one built here."""
    if options.buckets is not None:
        return options.buckets
    return bucket_table(options.timestamps, options.time_bias.shape[1], options.bucket_width, offsets, table,
                        block_size)


def call_args(options: InBlock, like: torch.Tensor, offsets: torch.Tensor, table: BlockTable,
              block_size: int) -> dict:
    """:func:`kernel_args` of one call; with a time bias, on the table of time buckets it carries (its layout's or
    its forward's), or on one built here."""
    if options.time_bias is None:
        return kernel_args(options, like)
    return kernel_args(options, like, call_buckets(options, offsets, table, block_size))


def bias_grad_partials(options: InBlock, num_slots: int, block_size: int,
                       like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block partial sums of the bias gradients that the backward kernels write, ``[slots, Hq, width]`` fp32
    (zero where a block has no pair), summed over blocks in a fixed order afterwards: deterministic. Where a bias
    is absent ``like`` stands in (never read or written): the plain op allocates nothing."""
    def partials(bias, width):
        if bias is None:
            return like
        return torch.zeros(num_slots, bias.shape[0], width, device=like.device, dtype=torch.float32)
    return (partials(options.pos_bias, 2 * block_size - 1),
            partials(options.time_bias, options.time_bias.shape[1] if options.time_bias is not None else 0))


def summed_bias_grads(options: InBlock, partials: tuple[torch.Tensor, torch.Tensor]) -> tuple:
    """``(dpos_bias, dtime_bias)`` from the partials, in the biases' dtypes (None where a bias is absent)."""
    return tuple(None if bias is None else part.sum(0).to(bias.dtype)
                 for bias, part in zip((options.pos_bias, options.time_bias), partials))


@triton.jit
def _bucket(dt, edges_ptr, num_buckets, bucket_scale, INLINE_ASM: tl.constexpr):
    """The bucket of each fp32 ``|dt|``: ``g = floor(log2(max(dt, 1)) * bucket_scale - 0.5)`` (at most
    ``num_buckets - 1``) is the bucket or the one below, since the log2 is off by far less than half a bucket (even at
    MIN_BUCKET_WIDTH); ``dt >= edges[g + 1]`` settles which (``edges[k] > 1`` from ``k = 1``; the last is NaN, which
    nothing reaches). An infinite ``dt`` is in the last bucket, a NaN one in bucket 0."""
    if INLINE_ASM:
        # In one PTX block where PTX may be inlined: lg2.approx (one special-function instruction, absolute error
        # under 2**-22; Triton's log2 is a polynomial of 15), a conversion that saturates (dt < 1 and -inf give 0)
        # in place of the max, and the edge's load. As a tl.load the edge's gather took its own layout (Triton 3.6),
        # which computed the estimate twice and moved the comparisons through shared memory.
        bucket = tl.inline_asm_elementwise(
            """{
            .reg .f32 l, e;
            .reg .u32 g;
            .reg .u64 a;
            .reg .pred above;
            lg2.approx.ftz.f32 l, $1;
            fma.rn.ftz.f32 l, l, $2, 0fBF000000;
            cvt.rzi.u32.f32 g, l;
            min.u32 g, g, $3;
            mad.wide.u32 a, g, 4, $4;
            ld.global.nc.f32 e, [a+4];
            setp.ge.f32 above, $1, e;
            selp.u32 $0, 1, 0, above;
            add.u32 $0, $0, g;
            }""",
            "=r,f,f,r,l", [dt, bucket_scale, num_buckets - 1, edges_ptr.to(tl.int64, bitcast=True)],
            dtype=tl.int32, is_pure=True, pack=1)
    else:
        # Bounded before the conversion and NaN taken as 1 by the select: a float's conversion to int past its range
        # (or of a NaN) differs between devices and Triton's interpreter.
        estimate = tl.log2(tl.where(dt >= 1.0, dt, 1.0)) * bucket_scale - 0.5
        guess = tl.minimum(estimate, num_buckets - 1.0).to(tl.int32)
        bucket = guess + (dt >= tl.load(edges_ptr + guess + 1)).to(tl.int32)
    return bucket


@triton.jit
def _time_buckets(start, length, timestamps_ptr, stride_ts, edges_ptr, num_buckets, bucket_scale,
                  BLOCK_SIZE: tl.constexpr, INLINE_ASM: tl.constexpr):
    """``[BS, BS]`` int32 buckets of ``|t_j - t_i|`` for query rows ``i`` and key rows ``j`` of the block of
    ``length`` tokens from ``start``: a fast log2 estimate, corrected by one step against ``edges`` (exact on every
    fp32 ``|dt|``). Rows past the block's end read its first row: their buckets stay among the block's own (the
    gradient loops over that range)."""
    offs = tl.arange(0, BLOCK_SIZE)
    t = tl.load(timestamps_ptr + start * stride_ts + tl.where(offs < length, offs, 0).to(tl.int64) * stride_ts)
    if t.dtype.is_floating():
        t = t.to(tl.float32)
        dt = tl.abs(t[None, :] - t[:, None])
    else:
        # Integer differences exactly, rounded once to fp32. A block whose times span less than 2**31 (any real
        # one) takes them in int32 from its earliest time: 64-bit subtractions and conversions cost several
        # instructions each, per pair.
        t = t.to(tl.int64)
        since = t - tl.min(t, axis=0)
        if tl.max(since, axis=0) < 2**31:
            since32 = since.to(tl.int32)
            dt = tl.abs(since32[None, :] - since32[:, None]).to(tl.float32)
        else:
            dt = tl.abs(t[None, :] - t[:, None]).to(tl.float32)
    return _bucket(dt, edges_ptr, num_buckets, bucket_scale, INLINE_ASM)


@triton.jit
def bucket_table_kernel(buckets_ptr, timestamps_ptr, stride_ts, edges_ptr, num_buckets, bucket_scale,
                        block_seq_ptr, block_cum_ptr, offsets_ptr, num_seqs, num_tokens, BLOCK_SIZE: tl.constexpr,
                        INLINE_ASM: tl.constexpr):
    # One program per block: its buckets, query i's at row start + i of the table (bucket_table).
    start, length = block_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, tl.program_id(0), num_seqs, num_tokens,
                                 BLOCK_SIZE)
    if length <= 0:
        return
    length = length.to(tl.int32)  # at most BLOCK_SIZE
    bucket = _time_buckets(start, length, timestamps_ptr, stride_ts, edges_ptr, num_buckets, bucket_scale,
                           BLOCK_SIZE, INLINE_ASM)
    # The block's base in 64 bits once, the offsets within it in 32.
    offs = tl.arange(0, BLOCK_SIZE)
    tl.store(buckets_ptr + start * BLOCK_SIZE + (offs[:, None] * BLOCK_SIZE + offs[None, :]),
             bucket.to(buckets_ptr.dtype.element_ty), mask=(offs < length)[:, None])


# The tile helpers below take the block's query and key offsets (``offs_i``, ``offs_j``: ``arange(BS)``, and
# ``offs_16 = arange(16)`` for the time bias's gradient) from the caller, so that the Gluon backward
# (block_attention_sm90) runs them on its own layouts (Gluon tensors carry explicit layouts; a helper that made its
# own ``arange`` or ``zeros`` would have none).


@triton.jit
def bucket_tile(start, rows, row_ok, offs_j, mods):
    """``[BS, BS]`` int32 buckets of one block from the call's table for query ``rows`` (those not ``row_ok``, past
    the block's end: its first row's)."""
    rows = tl.where(row_ok, rows, start).to(tl.int64)
    return tl.load(mods[3] + rows[:, None] * mods[4] + offs_j[None, :]).to(tl.int32)


@triton.jit
def _score_bias(head, bucket, mods, offs_i, offs_j, BLOCK_SIZE: tl.constexpr, IN_BLOCK: tl.constexpr):
    """What head ``head`` adds to a block's scaled scores, in log2 units (``softmax_probs`` works in base 2):
    ``(pos_bias + time_bias[bucket]) * log2(e)``, ``-inf`` above the diagonal under ``CAUSAL``. (Triton 3.6 cannot
    return None from a function: callers ask only where one of these options is on.)"""
    rel = offs_j[None, :] - offs_i[:, None]
    bias = (rel * 0).to(tl.float32)  # zeros, in the tile's layout
    if POS_BIAS & IN_BLOCK:
        bias += tl.load(mods[0] + head * mods[1] + (rel + BLOCK_SIZE - 1) * mods[2]).to(tl.float32) * _LOG2E
    if TIME_BIAS & IN_BLOCK:
        bias += tl.load(mods[5] + head * mods[6] + bucket * mods[7]).to(tl.float32) * _LOG2E
    if CAUSAL & IN_BLOCK:
        bias = tl.where(rel > 0, float("-inf"), bias)
    return bias


@triton.jit
def dropout_factors(start, head, mods, offs_i, offs_quarter, BLOCK_SIZE: tl.constexpr):
    """``[BS, BS]`` dropout factors of one (block, head): ``1 / (1 - p)`` where the probability is kept, 0 where it
    is dropped. Four words per Philox call, interleaved along the keys: the calls are ``[BS, BS / 4]``, on the
    query offsets ``offs_i`` and ``offs_quarter = arange(BS / 4)``."""
    seed_ptr, keep_threshold, keep_scale = mods[9], mods[10], mods[11]
    QUARTER: tl.constexpr = BLOCK_SIZE // 4
    c0 = (offs_i[:, None] * QUARTER + offs_quarter[None, :]).to(tl.uint32)
    zero = c0 * 0
    c1 = zero + start.to(tl.uint32)
    c2 = zero + head.to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(tl.load(seed_ptr), c0, c1, c2, zero)
    # join stacks on a new last axis: [.., m, u, v] holds word 2u + v of call m, i.e. key j = 4m + 2u + v.
    words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK_SIZE, BLOCK_SIZE))
    return tl.where(words.to(tl.int64) >= keep_threshold, keep_scale, 0.0)


@triton.jit
def _bitwise_or(a, b):
    return a | b


@triton.jit
def write_pos_bias_grad(ds, slot_head, write, dpos_ptr, offs_i, offs_j, BLOCK_SIZE: tl.constexpr,
                        DIAGONALS_TILE: tl.constexpr):
    """One (block, head)'s share of the position bias's gradient, the sums of ``ds = dL/ds(i, j)`` (fp32, zero off
    the valid pairs) along each diagonal ``j - i``, into row ``slot_head`` of its partial buffer where ``write``;
    on ``DIAGONALS_TILE(ds, offs_i, offs_j)``: the tile and offsets in the layout that sums them best."""
    WIDTH: tl.constexpr = 2 * BLOCK_SIZE - 1
    diag_ds, diag_i, diag_j = DIAGONALS_TILE(ds, offs_i, offs_j)
    # skew[i, c] = ds[i, (i + c) % BS]: column c holds diagonal c (i + c < BS) and diagonal c - BS (wrapped).
    shifted = diag_i[:, None] + diag_j[None, :]
    wrapped = shifted >= BLOCK_SIZE
    skew = tl.gather(diag_ds, tl.where(wrapped, shifted - BLOCK_SIZE, shifted), axis=1)
    upper = tl.sum(tl.where(wrapped, 0.0, skew), axis=0)
    lower = tl.sum(tl.where(wrapped, skew, 0.0), axis=0)
    base = dpos_ptr + slot_head.to(tl.int64) * WIDTH
    written = diag_j < BLOCK_SIZE * write.to(tl.int32)  # all or none
    tl.store(base + (BLOCK_SIZE - 1) + diag_j, upper, mask=written)
    tl.store(base + diag_j - 1, lower, mask=(diag_j > 0) & written)


@triton.jit
def _write_time_bias_grad(ds, bucket, slot_head, write, dtime_ptr, num_buckets, offs_i, offs_16):
    """One (block, head)'s share of the time bias's gradient, the sums of ``ds`` over each time bucket present in
    the block, into row ``slot_head`` of its partial buffer where ``write``. Per bucket present, row sums (within a
    warp: no barrier), gathered 16 buckets wide and summed over the rows once per 16; buckets the block lacks (a bit
    mask per 64) are skipped."""
    base = dtime_ptr + slot_head.to(tl.int64) * num_buckets
    last = tl.where(write, tl.max(tl.max(bucket, axis=1), axis=0), -1)
    for b0 in range(0, last + 1, 64):
        in_range = (bucket >= b0) & (bucket < b0 + 64)
        bits = tl.where(in_range, 1, 0).to(tl.int64) << tl.where(in_range, bucket - b0, 0).to(tl.int64)
        present = tl.reduce(bits, None, _bitwise_or)
        for c0 in range(b0, tl.minimum(b0 + 64, last + 1), 16):
            cols = c0 + offs_16
            sums = (offs_i[:, None] * 0 + offs_16[None, :] * 0).to(tl.float32)  # zeros, [BS, 16]
            for b in range(c0, tl.minimum(c0 + 16, last + 1)):
                if (present >> (b - b0)) & 1:
                    row_sums = tl.sum(tl.where(bucket == b, ds, 0.0), axis=1)
                    sums = tl.where(cols[None, :] == b, row_sums[:, None], sums)
            tl.store(base + cols, tl.sum(sums, axis=0), mask=cols <= last)


@triton.jit
def block_probs(scores, start, head, rows, row_ok, qk_scale_log2, mods, BLOCK_SIZE: tl.constexpr,
                IN_BLOCK: tl.constexpr, keys=None):
    """The forward's probabilities of one (block, head), fp32: the softmax of the scaled, biased, masked scores,
    times the dropout factors. ``mods``: the kernels' in-block arguments (:func:`kernel_args`) as one tuple.
    ``keys``: the keys of each row of a tile of several blocks (``tiles.same_block``; no in-block option then)."""
    offs = tl.arange(0, BLOCK_SIZE)
    if TIME_BIAS & IN_BLOCK:
        bucket = bucket_tile(start, rows, row_ok, offs, mods)
    else:
        bucket = rows  # not read
    if (CAUSAL | POS_BIAS | TIME_BIAS) & IN_BLOCK:
        p = softmax_probs(scores, row_ok, qk_scale_log2, _score_bias(head, bucket, mods, offs, offs, BLOCK_SIZE,
                                                                     IN_BLOCK))
    else:
        p = softmax_probs(scores, row_ok, qk_scale_log2, keys=keys)
    if DROPOUT & IN_BLOCK:
        p = p * dropout_factors(start, head, mods, offs, tl.arange(0, BLOCK_SIZE // 4), BLOCK_SIZE)
    return p


@triton.jit
def tile_probs_and_grads(scores, dp, keep, start, length, head, slot_head, write_bias_grads, offs_i, offs_j,
                         offs_16, qk_scale_log2, ds_scale, dtype: tl.constexpr, mods, dpos_ptr, dtime_ptr,
                         BLOCK_SIZE: tl.constexpr, IN_BLOCK: tl.constexpr, DIAGONALS_TILE: tl.constexpr,
                         SUMMED: tl.constexpr):
    """The backward's ``(P, dS, dS in fp32)`` of one (block, head), the first two in ``dtype``: ``P`` with the
    dropout factors ``keep`` (:func:`dropout_factors`, read under ``DROPOUT`` only) applied (it multiplies dO into
    dV), ``dS = P * (dP - rowsum(P * dP))`` (times ``ds_scale`` in ``dtype``), where ``dP`` (of the undropped
    probabilities) is ``dO V^T`` times the same factors. Where ``write_bias_grads``, the block's share of the
    gradients of the biases in ``SUMMED`` (``POS_BIAS | TIME_BIAS``, or fewer where the caller sums one itself) goes
    to row ``slot_head`` of the partial buffers (``DIAGONALS_TILE``: see :func:`write_pos_bias_grad`)."""
    if TIME_BIAS & IN_BLOCK:
        bucket = bucket_tile(start, start + offs_i, offs_i < length, offs_j, mods)
    else:
        bucket = offs_i  # not read
    key_ok = offs_j < length
    if (CAUSAL | POS_BIAS | TIME_BIAS) & IN_BLOCK:
        p = softmax_probs(scores, key_ok, qk_scale_log2, _score_bias(head, bucket, mods, offs_i, offs_j, BLOCK_SIZE,
                                                                     IN_BLOCK))
    else:
        p = softmax_probs(scores, key_ok, qk_scale_log2)
    if DROPOUT & IN_BLOCK:
        dp = dp * keep
    ds = p * (dp - tl.sum(p * dp, axis=1)[:, None])
    if POS_BIAS & SUMMED & IN_BLOCK:
        write_pos_bias_grad(ds, slot_head, write_bias_grads, dpos_ptr, offs_i, offs_j, BLOCK_SIZE, DIAGONALS_TILE)
    if TIME_BIAS & SUMMED & IN_BLOCK:
        _write_time_bias_grad(ds, bucket, slot_head, write_bias_grads, dtime_ptr, mods[8], offs_i, offs_16)
    if DROPOUT & IN_BLOCK:
        p = p * keep
    return p.to(dtype), (ds * ds_scale).to(dtype), ds


@triton.jit
def _as_given(ds, offs_i, offs_j):
    # The Triton kernels' DIAGONALS_TILE: their compiler picks the layout.
    return ds, offs_i, offs_j


@triton.jit
def block_probs_and_grads(scores, dp, start, length, head, slot_head, write_bias_grads, qk_scale_log2, ds_scale,
                          dtype: tl.constexpr, mods, dpos_ptr, dtime_ptr, BLOCK_SIZE: tl.constexpr,
                          IN_BLOCK: tl.constexpr):
    """:func:`tile_probs_and_grads` in the Triton kernels, whose layouts the compiler picks."""
    offs = tl.arange(0, BLOCK_SIZE)
    if DROPOUT & IN_BLOCK:
        keep = dropout_factors(start, head, mods, offs, tl.arange(0, BLOCK_SIZE // 4), BLOCK_SIZE)
    else:
        keep = 1.0  # not read
    p, ds, _ = tile_probs_and_grads(scores, dp, keep, start, length, head, slot_head, write_bias_grads, offs, offs,
                                    tl.arange(0, 16), qk_scale_log2, ds_scale, dtype, mods, dpos_ptr, dtime_ptr,
                                    BLOCK_SIZE, IN_BLOCK, _as_given, POS_BIAS | TIME_BIAS)
    return p, ds
