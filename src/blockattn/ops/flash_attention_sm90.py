"""Flash attention forward on Hopper (sm_90): the Gluon kernel of the ``warp_specialized`` variant, its launcher,
and what it takes (:func:`why_not`, which the dispatcher asks).

A program takes work items, ``BLOCK_M`` query rows of one head (64 a consumer warpgroup: 128 with two, 192 with
three; the configuration's ``block_m``), in turn: one program per multiprocessor (persistent) without a causal
mask, one per item with it. Its warps form these partitions:

- a producer warp lands each item's q tile, then streams the sequence's key and value tiles by TMA into a two-slot
  shared-memory ring, each slot as soon as every consumer released it (the ring runs on from one item to the
  next);
- two or three consumer warpgroups, 64 query rows each, overlap the softmax with the tensor cores as
  FlashAttention-3 does within a warpgroup: at tile ``j`` a consumer issues ``S_j = Q K_j^T`` and
  ``O += P_{j-1} V_{j-1}`` asynchronously, waits for ``S_j`` alone, runs the online softmax of ``S_j`` while the
  second product still runs, then waits for it and rescales ``O``. 16-bit ``P`` stays in registers as the
  product's first operand (the score accumulator's layout is that operand's layout for 16-bit types: no data
  moves); fp8 ``P`` goes through shared memory (:func:`_stage_probabilities`).

fp8 (``float8_e4m3fn``) as in the Triton kernels (``flash_attention``): both products in fp8 with fp32
accumulation, the descales read on the device, ``P`` scaled by ``P_SCALE = 2^8`` before its rounding to fp8 (here
inside the exponent: the row sums carry the same factor, which cancels). fp8 tensor cores take the second operand
K-major, so ``v`` comes from a copy with the tokens innermost (:func:`_transposed_values`), ``[D, BLOCK_N]`` tiles.

The score scale goes inside the exponent (``exp2(s * scale - m)``, one fused multiply-add per score; the row max is
taken before scaling), which a positive scale allows; a zero or negative one (a descale of 0) scales the tile first,
as the Triton kernels do. On an H100 that ran 2-18% faster than scaling first at D = 64 and 128, and bf16 3% slower
at D = 256, where the branch adds spills (docs/benchmarks.md).

Consumers are not made to alternate their products (FlashAttention-3's ping-pong): on an H100 that measured no faster
(docs/benchmarks.md). Nor are some exponentials computed by a polynomial on the FMA pipe (FlashAttention-4's trick): for
fp8 on an H100 one score in eight lost up to 7% and one in two up to 50%, and with no exponential at all the kernel ran
only 4-20% faster: the special-function unit is not what bounds it. A third consumer gives the tensor cores a third
chain of products to interleave; its warpgroups then hold 160 registers a thread instead of 240
(``flash_attention.flash_config`` says where it runs). A multiprocessor holds one program (180 KB of shared memory
at D = 128 with two consumers, 136 KB for fp8 with three).

Only the tiles that need it are masked: the one holding the sequence's last key, and under ``CAUSAL`` those crossing
the diagonal; the others run without a select per score. Key tiles past the diagonal are never visited.

The descriptors span all rows of the inputs (``[B * S, H * D]`` dense, ``[N, H * D]`` packed), so a tile that runs
past its sequence's end holds the next sequence's rows: their keys are masked to ``-inf`` and, in the last tile,
their values are zeroed in shared memory before the product (a NaN there must not reach this sequence). Output rows
past the end are not stored.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
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
from .flash_attention import (
    FlashConfig,
    _finish,
    _key_end,
    _key_mask,
    _tile_of,
    online_softmax,
    outputs_and_sequences,
    transposed_values,
)
from .gluon_sm90 import mma_layout, rows_layout, tma_load
from .launch import launch
from .tiles import LOG2E, fp8_score_scale

HEAD_DIMS = (64, 128, 256)
_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv}
_NUM_WARPS = 4  # a consumer warpgroup; the others and a producer warp are the kernel's workers
_ROWS = 64  # query rows a consumer warpgroup takes
_CONSUMER_REGS = gl.constexpr(240)
_CONSUMER_REGS_3 = gl.constexpr(160)
_PRODUCER_REGS = gl.constexpr(24)
# The barriers (one array): q landed; key and value slots landed and released; the last value tile fixed; q
# released.
_Q_READY = gl.constexpr(0)
_K_READY = gl.constexpr(1)
_V_READY = gl.constexpr(3)
_K_EMPTY = gl.constexpr(5)
_V_EMPTY = gl.constexpr(7)
_V_FIXED = gl.constexpr(9)
_Q_EMPTY = gl.constexpr(10)
_NUM_BARRIERS = gl.constexpr(11)


@gluon.jit
def _issue(desc, row, col, bar, dest, pred):
    """One tile by TMA into ``dest``, counted on ``bar``, where ``pred``."""
    mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
    tma_load(desc, [row, col], bar, dest, pred=pred)


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale_log2, start_n, offs_m, sk, mask_from, shift,
                  s_layout: gl.constexpr, CAUSAL: gl.constexpr, P_SHIFT: gl.constexpr):
    """Mask one score tile where it needs a mask and fold it, scaled to base 2, into the running max and sum;
    returns ``(p, alpha, m, l)`` with ``alpha`` the factor that rescales what was accumulated before, ``p`` and ``l``
    ``2^P_SHIFT`` times the probabilities and their sums."""
    BLOCK_N: gl.constexpr = s.shape[1]
    scale = qk_scale_log2
    if not (qk_scale_log2 > 0):  # masked scores times 0 or a negative scale are not -inf: scale first
        s = s * qk_scale_log2
        scale = 1.0
    if start_n + BLOCK_N > mask_from:  # the sequence's last key tile, or one crossing the diagonal
        kn = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(_key_mask(kn, offs_m, sk, shift, CAUSAL), s, float("-inf"))
    return online_softmax(s, m_i, l_i, scale, P_SHIFT)


@gluon.jit
def _program_tile(t, num_slots, cu_q_ptr, cu_k_ptr, block_cum_ptr, block_seq_ptr, seqlen_q, seqlen_k, tiles_per_seq,
                  num_seqs, num_q_tokens, num_k_tokens, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  VARLEN: gl.constexpr, CAUSAL: gl.constexpr, BOTTOM_RIGHT: gl.constexpr):
    """Work item ``t`` (query tile slots fastest, then heads: programs at work together share keys and values in
    L2): ``(head, batch, q_start, k_start, sk, m0, rows_left, shift, num_tiles, mask_from)``. Padding slots of a
    varlen grid, and causal ones past the rows, have no key tile and no row."""
    head = t // num_slots
    batch, q_start, k_start, sq, sk, m0 = _tile_of(
        t % num_slots, seqlen_q, seqlen_k, tiles_per_seq, cu_q_ptr, cu_k_ptr, block_cum_ptr, block_seq_ptr,
        num_seqs, num_q_tokens, num_k_tokens, BLOCK_M, VARLEN, CAUSAL)
    valid = (m0 >= 0) & (m0 < sq)
    m0 = gl.where(valid, m0, 0)
    rows_left = gl.where(valid, sq - m0, 0)
    shift = sk - sq if BOTTOM_RIGHT else 0
    end = gl.where(valid, _key_end(m0, sq, sk, BLOCK_M, CAUSAL, BOTTOM_RIGHT), 0)
    mask_from = sk
    if CAUSAL:
        mask_from = gl.minimum(sk, m0 + shift + 1)
    return head, batch, q_start, k_start, sk, m0, rows_left, shift, (end + BLOCK_N - 1) // BLOCK_N, mask_from


@gluon.jit
def _stage_probabilities(p32, p, p_buf):
    """One tile's probabilities as the ``P V`` product's first operand, ``p``'s type: 16-bit ones in registers (the
    score accumulator's layout is the operand's: no data moves), fp8 ones stored to ``p_buf``. An fp8 operand in
    registers needs a shuffle of its bytes across threads, and Triton's wait on the product cannot hold 8-bit
    registers: on an H100 the registers' route ran 0.85x as fast at D = 128, S = 16384."""
    if p.dtype.primitive_bitwidth == 8:
        p_buf.store(p32.to(p.dtype))
        fence_async_shared()
    else:
        p = gl.convert_layout(p32.to(p.dtype), p.type.layout)
    return p


@gluon.jit
def _probabilities(p, p_buf):
    """The ``P V`` product's first operand that :func:`_stage_probabilities` left."""
    if p.dtype.primitive_bitwidth == 8:
        p = p_buf
    return p


@gluon.jit
def _wait_values_product(acc, p):
    """Wait for ``acc += P V``; 16-bit ``p`` is tied to the wait, so that its registers hold until the product has
    read them."""
    if p.dtype.primitive_bitwidth == 8:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    else:
        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p))
    return acc, p


@gluon.jit
def _values(v_tile, TRANSPOSED: gl.constexpr):
    """A value tile as the ``P V`` product's ``[BLOCK_N, D]`` operand."""
    if TRANSPOSED:
        v_tile = v_tile.permute((1, 0))
    return v_tile


@gluon.jit
def _zero_values_past(v_tile, start_n, sk, HALF: gl.constexpr, TRANSPOSED: gl.constexpr):
    """Zero this consumer's half of a value tile (``[BLOCK_N, D]``, or ``[D, BLOCK_N]`` when ``TRANSPOSED``) at the
    keys from ``sk`` on."""
    if TRANSPOSED:
        D: gl.constexpr = v_tile.shape[0]
        BLOCK_N: gl.constexpr = v_tile.shape[1]
        layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // BLOCK_N, BLOCK_N // 16], [4, 1], [1, 0])
        half = v_tile.slice(HALF * (D // 2), D // 2, dim=0)
        values = half.load(layout)
        kn = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        half.store(gl.where((kn < sk)[None, :], values, gl.zeros_like(values)))
    else:
        BLOCK_N: gl.constexpr = v_tile.shape[0]
        D: gl.constexpr = v_tile.shape[1]
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [4, 1], [1, 0])
        half = v_tile.slice(HALF * (BLOCK_N // 2), BLOCK_N // 2, dim=0)
        values = half.load(layout)
        kn = start_n + HALF * (BLOCK_N // 2) + gl.arange(0, BLOCK_N // 2, layout=gl.SliceLayout(1, layout))
        half.store(gl.where((kn < sk)[:, None], values, gl.zeros_like(values)))


@gluon.jit
def _consumer(tensors, VARLEN: gl.constexpr, CAUSAL: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, FP8: gl.constexpr,
              C: gl.constexpr):
    """Consumer warpgroup ``C``: query rows ``[64 C, 64 C + 64)`` of each work item's tile, through every key
    tile the producer lands; releases each slot (one arrival per consumer) as soon as its product is done, and q's
    tile after the item's last ``Q K^T``. fp8 value tiles are ``[D, BLOCK_N]`` (K-major, as fp8 products take them)."""
    (q_smem, k_smem, v_smem, p_smem, bars, o_ptr, lse_ptr, num_slots, num_items, cu_q_ptr, cu_k_ptr, block_cum_ptr,
     block_seq_ptr, stride_ob, stride_on, stride_oh, stride_lb, stride_lh, seqlen_q, seqlen_k, tiles_per_seq, num_seqs,
     num_q_tokens, num_k_tokens, qk_scale_log2, q_descale_ptr, k_descale_ptr, v_descale_ptr) = tensors
    CONSUMERS: gl.constexpr = q_smem.shape[0]
    ROWS: gl.constexpr = q_smem.shape[1]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    D: gl.constexpr = q_smem.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = mma_layout(ROWS, BLOCK_N, 4, dtype)
    o_layout: gl.constexpr = mma_layout(ROWS, D, 4, dtype)
    # A register operand packs 4 bytes a thread along the reduction.
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                 k_width=32 // dtype.primitive_bitwidth)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    # Whole rows, 8 elements a thread: the output's stores.
    out_layout: gl.constexpr = rows_layout(D, 4)
    # fp8 P comes out of the exponent times P_SCALE = 2^8 (and the row sums with it).
    p_shift: gl.constexpr = 8.0 if FP8 else 0.0
    qk_scale_log2 = fp8_score_scale(qk_scale_log2, q_descale_ptr, k_descale_ptr, FP8)
    q = q_smem.index(C)
    p_buf = p_smem.index(C)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    # Counts over this program's items, which set the barriers' phases: key/value tiles, q tiles, fixed tiles.
    done = 0
    q_loads = 0
    fixes = 0
    for t in range(gl.program_id(0), num_items, gl.num_programs(0)):
        head, batch, q_start, _, sk, m0, rows_left, shift, num_tiles, mask_from = _program_tile(
            t, num_slots, cu_q_ptr, cu_k_ptr, block_cum_ptr, block_seq_ptr, seqlen_q, seqlen_k, tiles_per_seq,
            num_seqs, num_q_tokens, num_k_tokens, CONSUMERS * ROWS, BLOCK_N, VARLEN, CAUSAL, BOTTOM_RIGHT)
        offs_m = m0 + C * ROWS + gl.arange(0, ROWS, layout=row_layout)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([ROWS], gl.float32, row_layout)
        acc = gl.zeros([ROWS, D], gl.float32, o_layout)
        p = gl.zeros([ROWS, BLOCK_N], dtype, p_layout)
        if num_tiles > 0:
            mbarrier.wait(bars.index(_Q_READY), q_loads & 1)
            mbarrier.wait(bars.index(_K_READY + done % 2), (done // 2) & 1)
            s = warpgroup_mma(q, k_smem.index(done % 2).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            mbarrier.arrive(bars.index(_K_EMPTY + done % 2))
            mbarrier.arrive(bars.index(_Q_EMPTY), pred=num_tiles == 1)
            p32, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale_log2, 0, offs_m, sk, mask_from, shift,
                                                 s_layout, CAUSAL, p_shift)
            p = _stage_probabilities(p32, p, p_buf)
        for j in range(1, num_tiles):
            g = done + j
            slot = g % 2
            prev = 1 - slot
            mbarrier.wait(bars.index(_K_READY + slot), (g // 2) & 1)
            s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(bars.index(_V_READY + prev), ((g - 1) // 2) & 1)
            acc = warpgroup_mma(_probabilities(p, p_buf), _values(v_smem.index(prev), FP8), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            mbarrier.arrive(bars.index(_K_EMPTY + slot))
            mbarrier.arrive(bars.index(_Q_EMPTY), pred=j == num_tiles - 1)
            p32, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale_log2, j * BLOCK_N, offs_m, sk, mask_from,
                                                 shift, s_layout, CAUSAL, p_shift)
            acc, p = _wait_values_product(acc, p)
            mbarrier.arrive(bars.index(_V_EMPTY + prev))
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p = _stage_probabilities(p32, p, p_buf)
        if num_tiles > 0:
            last = num_tiles - 1
            g = done + last
            v_last = v_smem.index(g % 2)
            mbarrier.wait(bars.index(_V_READY + g % 2), (g // 2) & 1)
            if last * BLOCK_N + BLOCK_N > sk:
                # The values past the sequence's last key are the next sequence's (or padding, or TMA's zeros): P
                # is 0 there, but 0 * NaN is not. The first two consumers zero half the tile each, then all wait.
                if C < 2:
                    _zero_values_past(v_last, last * BLOCK_N, sk, C, FP8)
                fence_async_shared()
                mbarrier.arrive(bars.index(_V_FIXED))
                mbarrier.wait(bars.index(_V_FIXED), fixes & 1)
                fixes += 1
            acc = warpgroup_mma(_probabilities(p, p_buf), _values(v_last, FP8), acc, is_async=True)
            acc, p = _wait_values_product(acc, p)
            mbarrier.arrive(bars.index(_V_EMPTY + g % 2))
            done += num_tiles
            q_loads += 1
        # The sum's 2^p_shift cancels the one in acc; lse = m + log2(sum) takes it off.
        out, lse = _finish(acc, gl.convert_layout(m_i - p_shift, gl.SliceLayout(1, o_layout)),
                           gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)))
        if FP8:
            out = out * gl.load(v_descale_ptr)
        # 16 bytes a thread or more per store (the compiler stages the accumulator through shared memory).
        out = gl.convert_layout(out.to(o_ptr.dtype.element_ty), out_layout)
        rows = C * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, out_layout))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, out_layout))
        o_base = o_ptr + batch.to(gl.int64) * stride_ob + (q_start + m0).to(gl.int64) * stride_on + head * stride_oh
        gl.store(o_base + rows.to(gl.int64)[:, None] * stride_on + cols[None, :], out,
                 mask=(rows < rows_left)[:, None])
        lse_rows = C * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
        lse_base = lse_ptr + batch.to(gl.int64) * stride_lb + head * stride_lh + q_start + m0
        gl.store(lse_base + lse_rows, lse, mask=lse_rows < rows_left)


@gluon.jit
def _producer(loads, GROUP: gl.constexpr, VARLEN: gl.constexpr, CAUSAL: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
              FP8: gl.constexpr):
    """One warp: each work item's q tile once the consumers are done with the last one, then its key and value
    tiles, each into its slot once every consumer released it. The ring runs on across items, so the next item's
    first tiles land while the consumers finish the last. fp8 values come from their transposed copy
    (:func:`_transposed_values`), a ``[D, BLOCK_N]`` tile at a time."""
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, num_slots, num_items, cu_q_ptr, cu_k_ptr, block_cum_ptr,
     block_seq_ptr, seqlen_q, seqlen_k, tiles_per_seq, num_seqs, num_q_tokens, num_k_tokens, num_kv_heads) = loads
    CONSUMERS: gl.constexpr = q_smem.shape[0]
    ROWS: gl.constexpr = q_smem.shape[1]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    D: gl.constexpr = q_smem.shape[2]
    done = 0
    q_loads = 0
    for t in range(gl.program_id(0), num_items, gl.num_programs(0)):
        head, batch, q_start, k_start, _, m0, _, _, num_tiles, _ = _program_tile(
            t, num_slots, cu_q_ptr, cu_k_ptr, block_cum_ptr, block_seq_ptr, seqlen_q, seqlen_k, tiles_per_seq,
            num_seqs, num_q_tokens, num_k_tokens, CONSUMERS * ROWS, BLOCK_N, VARLEN, CAUSAL, BOTTOM_RIGHT)
        k_row = (batch * seqlen_k + k_start).to(gl.int32)
        kv_col = (head // GROUP) * D
        if FP8:
            if VARLEN:
                v_row = (head // GROUP) * D
                v_col = ((k_start // 16 + batch) * 16).to(gl.int32)
            else:
                v_row = (batch * num_kv_heads + head // GROUP) * D
                v_col = 0
        else:
            v_row = k_row
            v_col = kv_col
        if num_tiles > 0:
            # A fresh barrier counts as completed in the phase before its first: the first wait returns at once.
            mbarrier.wait(bars.index(_Q_EMPTY), (q_loads & 1) ^ 1)
            # One tile of 64 rows a consumer, counted on one barrier.
            mbarrier.expect(bars.index(_Q_READY), CONSUMERS * q_desc.block_type.nbytes)
            q_row = (batch * seqlen_q + q_start + m0).to(gl.int32)
            for c in gl.static_range(CONSUMERS):
                tma_load(q_desc, [q_row + c * ROWS, head * D], bars.index(_Q_READY), q_smem.index(c))
            q_loads += 1
        for j in range(num_tiles):
            g = done + j
            slot = g % 2
            free = ((g // 2) & 1) ^ 1
            mbarrier.wait(bars.index(_K_EMPTY + slot), free)
            _issue(k_desc, k_row + j * BLOCK_N, kv_col, bars.index(_K_READY + slot), k_smem.index(slot), True)
            mbarrier.wait(bars.index(_V_EMPTY + slot), free)
            if FP8:
                _issue(v_desc, v_row, v_col + j * BLOCK_N, bars.index(_V_READY + slot), v_smem.index(slot), True)
            else:
                _issue(v_desc, v_row + j * BLOCK_N, v_col, bars.index(_V_READY + slot), v_smem.index(slot), True)
        done += num_tiles


@gluon.jit
def _flash_fwd_sm90_kernel(
    q_desc, k_desc, v_desc, o_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, block_cum_ptr, block_seq_ptr,
    q_descale_ptr, k_descale_ptr, v_descale_ptr,
    stride_ob, stride_on, stride_oh, stride_lb, stride_lh,
    seqlen_q, seqlen_k, tiles_per_seq, num_seqs, num_q_tokens, num_k_tokens, num_kv_heads, qk_scale_log2, num_slots,
    num_items, GROUP: gl.constexpr, VARLEN: gl.constexpr, CAUSAL: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
    FP8: gl.constexpr, CONSUMERS: gl.constexpr,
):
    # Each program takes work items (query tile, head) in turn: the grid is the launcher's choice.
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, v_desc.block_type.shape[0], v_desc.block_type.shape[1]],
                                       v_desc.layout)
    if FP8:  # each consumer's P (BLOCK_N bytes a row)
        p_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, BLOCK_N],
                                           gl.NVMMASharedLayout(swizzle_byte_width=BLOCK_N, element_bitwidth=8,
                                                                rank=2))
    else:  # unused: 16-bit P stays in registers
        p_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 8, 8], gl.NVMMASharedLayout(swizzle_byte_width=0,
                                                                                   element_bitwidth=16, rank=2))
    bars = gl.allocate_shared_memory(gl.int64, [_NUM_BARRIERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(_NUM_BARRIERS):
        # Every consumer warpgroup arrives on the releases and on the fixed value tile.
        mbarrier.init(bars.index(i), count=CONSUMERS if i >= _K_EMPTY else 1)
    # Each partition's runtime arguments as one tuple, its constexprs after it (inside a tuple a constexpr would
    # turn into a plain value).
    tensors = (q_smem, k_smem, v_smem, p_smem, bars, o_ptr, lse_ptr, num_slots, num_items, cu_q_ptr, cu_k_ptr,
               block_cum_ptr, block_seq_ptr, stride_ob, stride_on, stride_oh, stride_lb, stride_lh, seqlen_q, seqlen_k,
               tiles_per_seq, num_seqs, num_q_tokens, num_k_tokens, qk_scale_log2, q_descale_ptr, k_descale_ptr,
               v_descale_ptr)
    loads = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, num_slots, num_items, cu_q_ptr, cu_k_ptr,
             block_cum_ptr, block_seq_ptr, seqlen_q, seqlen_k, tiles_per_seq, num_seqs, num_q_tokens, num_k_tokens,
             num_kv_heads)
    if CONSUMERS == 3:
        gl.warp_specialize([(_consumer, (tensors, VARLEN, CAUSAL, BOTTOM_RIGHT, FP8, 0)),
                            (_consumer, (tensors, VARLEN, CAUSAL, BOTTOM_RIGHT, FP8, 1)),
                            (_consumer, (tensors, VARLEN, CAUSAL, BOTTOM_RIGHT, FP8, 2)),
                            (_producer, (loads, GROUP, VARLEN, CAUSAL, BOTTOM_RIGHT, FP8))],
                           [4, 4, 1], [_CONSUMER_REGS_3, _CONSUMER_REGS_3, _PRODUCER_REGS])
    else:
        gl.warp_specialize([(_consumer, (tensors, VARLEN, CAUSAL, BOTTOM_RIGHT, FP8, 0)),
                            (_consumer, (tensors, VARLEN, CAUSAL, BOTTOM_RIGHT, FP8, 1)),
                            (_producer, (loads, GROUP, VARLEN, CAUSAL, BOTTOM_RIGHT, FP8))],
                           [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])


def why_not(dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the kernel does not take flash inputs of ``dtype`` and ``head_dim`` on a Hopper GPU, or ``None``."""
    if dtype not in _GL_DTYPES:
        return "takes float16, bfloat16 and float8_e4m3fn only"
    if head_dim not in HEAD_DIMS:
        return f"takes head dims {HEAD_DIMS}, not {head_dim}"
    return None


def config_reason(cfg: FlashConfig) -> str | None:
    """Why the kernel cannot run ``cfg`` (``flash_attention.flash_config``'s, which shrinks tiles to the GPU's shared
    memory), or ``None``."""
    if cfg.block_m not in (2 * _ROWS, 3 * _ROWS) or (cfg.num_warps, cfg.num_stages) != (_NUM_WARPS, 2):
        return "needs 128- or 192-row tiles and two key/value slots: more shared memory than this GPU has"
    return None


@functools.cache
def _tile_layout(rows: int, head_dim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], _GL_DTYPES[dtype])


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """Over all rows of ``t`` (``[B, S, H, D]`` or ``[N, H, D]`` whose rows follow each other), tiles of ``rows``."""
    h, d = t.shape[-2:]
    n = t.numel() // (h * d)
    return TensorDescriptor(t, [n, h * d], [t.stride(-3), 1], [rows, d], _tile_layout(rows, d, t.dtype))


@triton.jit
def _transpose_sequences_kernel(src_ptr, dst_ptr, cu_ptr, num_seqs, search_steps, tokens, width, heads, stride_st,
                                stride_sh, stride_dd, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    """:func:`_transposed_values` of packed one-byte values on a GPU: ``BLOCK_C`` columns of one head's rows. Column
    ``c`` belongs to the last sequence ``s`` that starts at or before it (a binary search over the starts ``16
    (cu[s] // 16 + s)``, which rise by at least 16 a sequence), and holds its token ``c - start + cu[s]`` or a 0.
    Every column up to ``width`` (a multiple of 16) is written, so the stores go out 16 bytes a thread; the tokens'
    rows load 16 bytes a thread along D. Tokens outside ``[0, tokens)`` are never read, whatever ``cu`` holds."""
    h = (tl.program_id(0) % heads).to(tl.int64)
    c = (tl.program_id(0) // heads) * BLOCK_C + tl.arange(0, BLOCK_C)
    lo = tl.zeros([BLOCK_C], dtype=tl.int32)
    hi = lo + num_seqs
    for _ in range(search_steps):  # start(lo) <= c < start(hi), start(num_seqs) taken as infinite
        mid = (lo + hi) // 2
        at_or_before = 16 * (tl.load(cu_ptr + mid, mask=mid < num_seqs, other=0) // 16 + mid) <= c
        lo = tl.where(at_or_before, mid, lo)
        hi = tl.where(at_or_before, hi, mid)
    seq_start = tl.load(cu_ptr + lo)
    token = c - 16 * (seq_start // 16 + lo) + seq_start
    valid = (token < tl.load(cu_ptr + lo + 1)) & (token >= 0) & (token < tokens)
    d = tl.arange(0, BLOCK_D)
    x = tl.load(src_ptr + token.to(tl.int64)[:, None] * stride_st + h * stride_sh + d[None, :],
                mask=valid[:, None] & (d < D)[None, :], other=0)
    tl.store(dst_ptr + (h * D + d)[:, None] * stride_dd + c[None, :], tl.trans(x),
             mask=(d < D)[:, None] & (c < width)[None, :])


def _transposed_values(v: torch.Tensor, cu_seqlens_k: torch.Tensor | None) -> torch.Tensor:
    """fp8 values as the ``P V`` product's K-major operand: ``[rows, columns]``, a head's ``D`` rows with tokens
    along the columns, where every sequence starts at a multiple of 16 columns (a TMA box must start 16-byte
    aligned: an fp8 tile at any other column is an illegal instruction on an H100). Dense: batch ``b``, kv head
    ``h`` at rows ``(b Hkv + h) D``, its tokens from column 0. Packed: kv head ``h`` at rows ``h D``, sequence
    ``s`` from column ``16 (cu[s] // 16 + s)`` (the producer's), which leaves room for every sequence's rounding.
    Columns between sequences hold zeros (the consumers also zero a tile's columns past its sequence, whatever they
    hold). The copy holds ``N + 16 (B + 1)`` columns a row at most: with sequences of a few
    tokens, several times ``v``'s bytes. On a GPU kernels make it (:func:`_transpose_sequences_kernel`; PyTorch's
    ``searchsorted`` and ``index_put``, the CPU's way, took 25 times as long on an H100)."""
    if cu_seqlens_k is None:
        return transposed_values(v).movedim(-3, -1).flatten(0, -2)
    tokens, heads, d = v.shape
    num_seqs = cu_seqlens_k.numel() - 1
    width = 16 * (tokens // 16 + num_seqs + 1)
    vt = torch.empty(heads, d, width, dtype=torch.uint8, device=v.device)  # indexing takes no fp8
    # The kernel's columns are int32: wider copies (2^31 columns, some 134 M sequences) take PyTorch's way.
    if v.is_cuda and v.stride(-1) == 1 and tokens > 0 and num_seqs > 0 and width < 2**31:
        block_c = 64
        launch(_transpose_sequences_kernel, (triton.cdiv(width, block_c) * heads,), src_ptr=v.view(torch.uint8),
               dst_ptr=vt, cu_ptr=cu_seqlens_k, num_seqs=num_seqs, search_steps=max(num_seqs - 1, 1).bit_length(),
               tokens=tokens, width=width, heads=heads, stride_st=v.stride(0), stride_sh=v.stride(1),
               stride_dd=vt.stride(1), D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_C=block_c, num_warps=4)
    else:
        vt.zero_()
        token = torch.arange(tokens, device=v.device, dtype=cu_seqlens_k.dtype)
        seq = torch.searchsorted(cu_seqlens_k[1:], token, right=True)
        # Clamped: cumulative lengths unchecked on the host must not send a token out of the copy.
        column = (token + 16 * seq - cu_seqlens_k[seq] % 16).clamp_(0, width - 1)
        vt[:, :, column] = v.view(torch.uint8).permute(1, 2, 0)
    return vt.view(v.dtype).flatten(0, 1)


def _values_descriptor(v: torch.Tensor, cu_seqlens_k: torch.Tensor | None, columns: int) -> TensorDescriptor:
    """Over :func:`_transposed_values`' ``[rows, columns]`` of fp8 ``v``: tiles of one head's ``D`` rows and
    ``columns`` tokens; columns past the copy's read as zeros."""
    vt = _transposed_values(v, cu_seqlens_k)
    d = v.shape[-1]
    return TensorDescriptor(vt, list(vt.shape), [vt.stride(0), 1], [d, columns], _tile_layout(d, columns, vt.dtype))


def flash_attention_fwd_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
                             cu_seqlens_k: torch.Tensor | None, table: BlockTable | None, scale: float, causal: bool,
                             bottom_right: bool, out_dtype: torch.dtype,
                             descales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, cfg: FlashConfig
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` as ``flash_attention.flash_attention_fwd_triton`` returns them, for inputs that :func:`why_not`
    takes and whose rows TMA can read (``backends.tma_rows_ready``); ``descales`` for fp8 inputs."""
    out, lse, slots, sequences = outputs_and_sequences(q, k, cu_seqlens_q, cu_seqlens_k, table, cfg.block_m,
                                                       out_dtype)
    if slots == 0:  # no query row
        return out, lse
    if k.numel() == 0:  # no key at all (TMA takes no empty tensor): every row sees nothing
        return out.zero_(), lse.fill_(float("-inf"))
    num_items = slots * q.shape[-2]
    # Persistent without a mask: 0-4% faster than a program per item at S = 2048-4096 (H100, D = 128: the next
    # item's first tiles land while the last one finishes). Causal items differ in length, and a program per item
    # lets the GPU's scheduler balance them: persistent, causal ran 0.70-0.89x as fast at S >= 8192.
    programs = num_items if causal else min(num_items, devices.multiprocessors(q.device))
    fp8 = descales is not None
    q_descale, k_descale, v_descale = descales if fp8 else (lse, lse, lse)  # never read without fp8
    launch(
        _flash_fwd_sm90_kernel, (programs,),
        q_desc=_descriptor(q, _ROWS), k_desc=_descriptor(k, cfg.block_n),
        v_desc=_values_descriptor(v, cu_seqlens_k, cfg.block_n) if fp8 else _descriptor(v, cfg.block_n),
        o_ptr=out, lse_ptr=lse, **sequences, q_descale_ptr=q_descale, k_descale_ptr=k_descale,
        v_descale_ptr=v_descale, stride_oh=out.stride(-2), num_kv_heads=k.shape[-2], qk_scale_log2=scale * LOG2E,
        num_slots=slots, num_items=num_items,
        GROUP=q.shape[-2] // k.shape[-2], VARLEN=cu_seqlens_q is not None, CAUSAL=causal, BOTTOM_RIGHT=bottom_right,
        FP8=fp8, CONSUMERS=cfg.block_m // _ROWS, num_warps=_NUM_WARPS,
    )
    return out, lse
