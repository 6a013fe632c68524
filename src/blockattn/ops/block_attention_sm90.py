"""The backward of block attention on Hopper (sm_90), plain or with a fused rotary: a Gluon kernel, its launcher,
and what it takes (:func:`why_not`, which the dispatcher asks).

One program per (block, head), as the Triton kernels, but its four tiles come in by TMA: one thread issues four bulk
copies into 64 KB of shared memory and nothing is staged in registers, so every byte of the program is in flight at
once, while the angles load beside them. The rotated operands are then turned in place (rows past the block's end
zeroed: TMA fetched the next block's rows there), and the five products read whole 128-wide rows straight from
those tiles (``wgmma``): pairs stay interleaved, since a product over the head dim does not care about the order of
its terms. The gradients are turned back in fp32 in the products' own layout, where each thread holds both halves
of its pairs, staged in the tiles that are no longer read, and stored 16 bytes per thread.

Measured against the Triton kernels it replaces there (docs/benchmarks.md, times over the memory floor): the rotary
backward at the ``ads-rotary`` shape 1.18x -> 1.05x on an H100 and 1.45x -> 1.30x on an H200 (where its 210
registers leave two programs per multiprocessor); the plain backward on an H200 1.12x -> 1.01x (``ads``).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

try:
    from triton.experimental.gluon.language.nvidia.hopper.tma import async_load as tma_load
except ImportError:  # triton 3.6 names it async_copy_global_to_shared (removed later)
    from triton.experimental.gluon.language.nvidia.hopper.tma import async_copy_global_to_shared as tma_load

from ..block_table import BlockTable
from .in_block import InBlock
from .launch import launch
from .tiles import (
    LOG2E,
    ROTATE_K,
    ROTATE_Q,
    ROTATE_V,
    block_bounds,
    grad_scores,
    rotary_operand,
    softmax_probs,
)

_BLOCK_SIZE = 64
_HEAD_DIM = 128
_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


@gluon.jit
def _pairs(x):
    """``(even, odd)`` columns of ``x``: in a layout that holds both elements of a pair in one thread (the products'
    accumulators and operands do), no data moves."""
    return gl.split(gl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))


@gluon.jit
def _unpairs(even, odd):
    joined = gl.join(even, odd)
    return gl.reshape(joined, [joined.shape[0], joined.shape[1] * 2])


@gluon.jit
def _prepare_tile(tile, sin, cos, row_ok, layout: gl.constexpr, ROTATE: gl.constexpr, partial):
    """Rotate a landed tile in place when ``ROTATE`` (in fp32, rounded back as an unfused rotary would have stored
    it); either way rows past the block's end become zeros, so that the next block's rows add nothing, not even a
    NaN."""
    if ROTATE:
        x = tile.load(layout)
        even, odd = _pairs(x)
        even = even.to(gl.float32)
        odd = odd.to(gl.float32)
        sin = sin.to(gl.float32)
        cos = cos.to(gl.float32)
        turned_even = gl.where(row_ok, even * cos - odd * sin, 0.0).to(x.dtype)
        turned_odd = gl.where(row_ok, odd * cos + even * sin, 0.0).to(x.dtype)
        tile.store(_unpairs(turned_even, turned_odd))
    elif partial:
        x = tile.load(layout)
        even, odd = _pairs(x)
        tile.store(_unpairs(gl.where(row_ok, even, 0.0).to(x.dtype), gl.where(row_ok, odd, 0.0).to(x.dtype)))


@gluon.jit
def _store_gradient(acc, stage, base, stride_n, length, sin, cos, ROTATE: gl.constexpr, out_layout: gl.constexpr):
    """Store a gradient tile, turned back (``sin -> -sin``, fp32) when ``ROTATE``: through ``stage`` (a tile no
    longer read) so that each thread writes 16 contiguous bytes; rows past the block's end are not written."""
    dtype: gl.constexpr = base.dtype.element_ty
    if ROTATE:
        even, odd = _pairs(acc)
        sin = sin.to(gl.float32)
        cos = cos.to(gl.float32)
        stage.store(_unpairs(even * cos + odd * sin, odd * cos - even * sin).to(dtype))
    else:
        stage.store(acc.to(dtype))
    tile = stage.load(out_layout)
    rows = gl.arange(0, tile.shape[0], layout=gl.SliceLayout(1, out_layout))
    cols = gl.arange(0, tile.shape[1], layout=gl.SliceLayout(0, out_layout))
    gl.store(base + rows.to(gl.int64)[:, None] * stride_n + cols[None, :], tile, mask=(rows < length)[:, None])


@gluon.jit
def _block_attention_bwd_sm90_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_ptr, dk_ptr, dv_ptr, sinu_ptr,
    block_seq_ptr, block_cum_ptr, offsets_ptr,
    num_seqs, num_tokens, scale, qk_scale_log2,
    stride_dqn, stride_dkn, stride_dvn, stride_sn, stride_sd,
    NUM_HEADS: gl.constexpr, ROTATE: gl.constexpr,
):
    # Heads vary fastest, as in the Triton kernels. ROTATE is a bit mask (tiles.ROTATE_Q/K/V) of the rotated operands.
    BLOCK: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    # One warpgroup: score tiles and gradient tiles in the wgmma accumulator layouts.
    scores_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BLOCK, 16])
    grad_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, D, 16])
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [4, 1], [1, 0])

    pid = gl.program_id(0)
    head = pid % NUM_HEADS
    start, length = block_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, pid // NUM_HEADS, num_seqs, num_tokens,
                                 BLOCK)
    if length > 0:
        tiles = gl.allocate_shared_memory(dtype, [4, BLOCK, D], q_desc.layout)
        probs = gl.allocate_shared_memory(dtype, [BLOCK, BLOCK], gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK],
                                                                                                       dtype))
        landed = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(landed, count=1)
        q = tiles.index(0)
        k = tiles.index(1)
        v = tiles.index(2)
        do = tiles.index(3)
        mbarrier.expect(landed, 4 * q_desc.block_type.nbytes)
        row = start.to(gl.int32)
        col = head * D
        tma_load(q_desc, [row, col], landed, q)
        tma_load(k_desc, [row, col], landed, k)
        tma_load(v_desc, [row, col], landed, v)
        tma_load(do_desc, [row, col], landed, do)

        # The angles of each pair, in the pair halves of the gradient layout: they turn the operands (loaded in
        # that layout too) and the gradients. Loaded while the tiles land.
        rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, grad_layout))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, grad_layout))
        pair_rows, _ = _pairs(gl.zeros([BLOCK, D], gl.int32, grad_layout) + rows[:, None])
        row_ok = pair_rows < length
        if ROTATE != 0:
            pair_cols, _ = _pairs(gl.zeros([BLOCK, D], gl.int32, grad_layout) + (cols // 2)[None, :])
            angle_ptrs = sinu_ptr + (start + pair_rows) * stride_sn + pair_cols * stride_sd
            sin = gl.load(angle_ptrs, mask=row_ok, other=0.0)
            cos = gl.load(angle_ptrs + (D // 2) * stride_sd, mask=row_ok, other=0.0)
        else:
            sin = None
            cos = None
        partial = length < BLOCK
        mbarrier.wait(landed, 0)
        mbarrier.invalidate(landed)
        _prepare_tile(q, sin, cos, row_ok, grad_layout, ROTATE_Q & ROTATE, partial)
        _prepare_tile(k, sin, cos, row_ok, grad_layout, ROTATE_K & ROTATE, partial)
        _prepare_tile(v, sin, cos, row_ok, grad_layout, ROTATE_V & ROTATE, partial)
        _prepare_tile(do, sin, cos, row_ok, grad_layout, 0, partial)
        fence_async_shared()

        zeros = gl.zeros([BLOCK, BLOCK], gl.float32, scores_layout)
        scores = warpgroup_mma(q, k.permute((1, 0)), zeros, use_acc=False, is_async=True)
        dp = warpgroup_mma(do, v.permute((1, 0)), zeros, use_acc=False, is_async=True)
        scores, dp = warpgroup_mma_wait(num_outstanding=0, deps=(scores, dp))
        key_ok = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, scores_layout)) < length
        p = softmax_probs(scores, key_ok, qk_scale_log2)
        ds = grad_scores(p, dp, dtype, scale)  # before dV's product: p and dp die sooner
        probs.store(p.to(dtype))
        fence_async_shared()
        zeros = gl.zeros([BLOCK, D], gl.float32, grad_layout)
        dv = warpgroup_mma(probs.permute((1, 0)), do, zeros, use_acc=False, is_async=True)
        dv = warpgroup_mma_wait(num_outstanding=0, deps=(dv,))
        probs.store(ds)
        fence_async_shared()
        _store_gradient(dv, do, dv_ptr + start * stride_dvn + col, stride_dvn, length, sin, cos, ROTATE_V & ROTATE,
                        out_layout)
        dk = warpgroup_mma(probs.permute((1, 0)), q, zeros, use_acc=False, is_async=True)
        dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk,))
        _store_gradient(dk, v, dk_ptr + start * stride_dkn + col, stride_dkn, length, sin, cos, ROTATE_K & ROTATE,
                        out_layout)
        dq = warpgroup_mma(probs, k, zeros, use_acc=False, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        _store_gradient(dq, q, dq_ptr + start * stride_dqn + col, stride_dqn, length, sin, cos, ROTATE_Q & ROTATE,
                        out_layout)


def why_not(call) -> str | None:
    """Why this kernel does not take a Hopper backward ``call`` (``backends.AttentionCall``), or ``None``: it takes
    64-token blocks, D = 128, no GQA, 16-bit inputs that TMA can read and gradients laid out as ``[N, H * D]``
    rows, with or without a rotary, and none of the in-block options (causal, biases, dropout)."""
    if call.in_block:
        return "takes none of the in-block options (causal, biases, dropout)"
    if call.block_size != _BLOCK_SIZE or call.head_dim != _HEAD_DIM:
        return f"takes {_BLOCK_SIZE}-token blocks at D = {_HEAD_DIM} only"
    if call.num_heads != call.num_kv_heads:
        return "takes no GQA"
    if call.dtype not in _GL_DTYPES:
        return "takes float16 and bfloat16 only"
    if not call.tma_rows:
        return "needs q, k, v, dO as 16-byte aligned [N, H * D] rows and gradients as [N, H * D] rows"
    return None


@functools.cache
def _tile_layout(head_dim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for([_BLOCK_SIZE, head_dim], _GL_DTYPES[dtype])


def _descriptor(t: torch.Tensor) -> TensorDescriptor:
    n, h, d = t.shape
    return TensorDescriptor(t, [n, h * d], [t.stride(0), 1], [_BLOCK_SIZE, d], _tile_layout(d, t.dtype))


def block_attention_bwd_sm90(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             offsets: torch.Tensor, table: BlockTable, block_size: int, scale: float,
                             sinu_pos: torch.Tensor | None, rotate: int, options: InBlock,
                             grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[None, None]:
    """Write ``(dq, dk, dv)`` into ``grads``, where :func:`why_not` says nothing against the call (the dispatcher's
    backward signature, ``backends``; ``options`` are then the plain op's, whose biases have no gradient)."""
    n, h, _ = q.shape
    dq, dk, dv = grads
    if table.num_slots == 0:
        return None, None
    sinu_ptr, stride_sn, stride_sd = rotary_operand(sinu_pos, q)
    launch(
        _block_attention_bwd_sm90_kernel, (table.num_slots * h,),
        q_desc=_descriptor(q), k_desc=_descriptor(k), v_desc=_descriptor(v), do_desc=_descriptor(grad_out),
        dq_ptr=dq, dk_ptr=dk, dv_ptr=dv, sinu_ptr=sinu_ptr,
        block_seq_ptr=table.block_seq, block_cum_ptr=table.block_cum, offsets_ptr=offsets,
        num_seqs=offsets.numel() - 1, num_tokens=n, scale=scale, qk_scale_log2=scale * LOG2E,
        stride_dqn=dq.stride(0), stride_dkn=dk.stride(0), stride_dvn=dv.stride(0),
        stride_sn=stride_sn, stride_sd=stride_sd,
        NUM_HEADS=h, ROTATE=rotate, num_warps=4,
    )
    return None, None
