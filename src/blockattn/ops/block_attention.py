"""Block-diagonal attention on jagged sequences: Triton kernels, their launchers, and the PyTorch (CPU) path.

Each query block attends to exactly one key/value block, so one program holds a whole ``[BS, BS]`` score tile:
the softmax is exact in one pass (no online rescaling, no log-sum-exp), and the backward recomputes ``P`` from
``q`` and ``k`` and forms ``Di = rowsum(P * dP)`` in the tile (no preprocessing kernel, no ``o`` read, no atomics).

Head dims are processed in ``CHUNK``-wide column slices: scores and ``dP`` accumulate over the slices, outputs are
written slice by slice. For small tiles there is one slice (each tensor is read once); large tiles (``BS * D``
beyond what registers hold) are split so that no program needs a full ``[BS, 256]`` fp32 accumulator.

The backward has a second kernel for the production shape (64-token blocks, 64 < D <= 128, no GQA, one memory
layout for all tensors): a persistent loop over blocks that the compiler software-pipelines, so loads of the next
block overlap the current one's math.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layout import block_rows

_LOG2E = 1.4426950408889634


def kernel_config(block_size: int, head_dim: int, backward: bool, group: int = 1, element_size: int = 2) -> dict:
    """Compile-time shape and launch of a kernel, as measured best on an H200 (docs/benchmarks.md).

    Head-dim slices are at most 64 x 128 elements in the forward and 64 x 64 in the backward, which holds more
    tiles at once (larger slices spill registers). One exception: the backward of 64-token blocks with
    64 < D <= 128, 16-bit inputs and no GQA group takes whole rows in a persistent loop that prefetches the next
    block's tiles three deep (1.12x the memory floor on the `ads` preset, against 1.28x for 64-wide slices); fp32
    tiles would not fit three deep in shared memory.
    """
    block_d = max(16, triton.next_power_of_2(head_dim))
    pipelined = backward and group == 1 and block_size == 64 and 64 < block_d <= 128 and element_size == 2
    max_slice = 64 * 64 if backward and not pipelined else 64 * 128
    chunk = min(block_d, max(16, max_slice // block_size))
    return {
        "BLOCK_D": block_d,
        "CHUNK": chunk,
        "NUM_CHUNKS": triton.cdiv(block_d, chunk),
        "EVEN_D": block_d == head_dim,
        "PIPELINE_STAGES": 3 if pipelined else 1,
    }


def _num_warps(block_size: int) -> int:
    # On an H200 4 warps beat 2 and 8 for 64-token blocks at D = 64 and 128, in both passes, even where 8 would
    # spill fewer registers (docs/benchmarks.md). 128-token blocks hold a 128 x 128 fp32 score tile: 8 warps.
    return 8 if block_size == 128 else 4


@triton.jit
def _block_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, slot, num_seqs, num_tokens, BLOCK_SIZE: tl.constexpr):
    """First row and length of grid slot ``slot``'s block; length 0 for padding slots.

    Clamped to ``[0, N)`` so that offsets whose values were not checked on the host never cause an out-of-bounds
    access (see ``layout.block_table``).
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


@triton.jit
def _tile_ptrs(base, rows, col0, stride_n, stride_d, CHUNK: tl.constexpr):
    cols = col0 + tl.arange(0, CHUNK)
    return base + rows[:, None] * stride_n + cols[None, :] * stride_d


@triton.jit
def _store_tile(base, rows, col0, stride_n, stride_d, value, mask, CHUNK: tl.constexpr):
    tl.store(_tile_ptrs(base, rows, col0, stride_n, stride_d, CHUNK), value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _tile_mask(row_ok, col0, head_dim, CHUNK: tl.constexpr, EVEN_D: tl.constexpr):
    if EVEN_D:
        # Constant along the row, so loads under this mask stay 16-byte vectorised.
        mask = tl.broadcast_to(row_ok[:, None], (row_ok.shape[0], CHUNK))
    else:
        cols = col0 + tl.arange(0, CHUNK)
        mask = row_ok[:, None] & (cols < head_dim)[None, :]
    return mask


@triton.jit
def _softmax_probs(scores, col_ok, qk_scale_log2):
    """Exact row softmax of a score tile whose every key lies in the tile (``col_ok`` masks the partial block)."""
    scores = tl.where(col_ok[None, :], scores * qk_scale_log2, float("-inf"))
    p = tl.exp2(scores - tl.max(scores, axis=1)[:, None])
    return p / tl.sum(p, axis=1)[:, None]


@triton.jit
def _block_attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    block_seq_ptr, block_cum_ptr, offsets_ptr,
    num_seqs, num_tokens, head_dim, qk_scale_log2,
    stride_qn, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_on, stride_oh, stride_od,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Heads vary fastest so that the programs of one block (which share its rows, and k/v under GQA) run together.
    pid = tl.program_id(0)
    slot = pid // NUM_Q_HEADS
    head = pid % NUM_Q_HEADS
    start, length = _block_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, slot, num_seqs, num_tokens, BLOCK_SIZE)
    if length <= 0:
        return
    offs = tl.arange(0, BLOCK_SIZE)
    row_ok = offs < length
    rows = start + offs
    kv_head = head // GROUP
    q_base = q_ptr + head * stride_qh
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    o_base = o_ptr + head * stride_oh

    scores = tl.zeros((BLOCK_SIZE, BLOCK_SIZE), dtype=tl.float32)
    for c in tl.static_range(NUM_CHUNKS):
        mask = _tile_mask(row_ok, c * CHUNK, head_dim, CHUNK, EVEN_D)
        q = tl.load(_tile_ptrs(q_base, rows, c * CHUNK, stride_qn, stride_qd, CHUNK), mask=mask, other=0.0)
        k = tl.load(_tile_ptrs(k_base, rows, c * CHUNK, stride_kn, stride_kd, CHUNK), mask=mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), scores, input_precision=DOT_PRECISION)
    p = _softmax_probs(scores, row_ok, qk_scale_log2).to(q_ptr.dtype.element_ty)

    for c in tl.static_range(NUM_CHUNKS):
        mask = _tile_mask(row_ok, c * CHUNK, head_dim, CHUNK, EVEN_D)
        v = tl.load(_tile_ptrs(v_base, rows, c * CHUNK, stride_vn, stride_vd, CHUNK), mask=mask, other=0.0)
        o = tl.dot(p, v, input_precision=DOT_PRECISION)
        _store_tile(o_base, rows, c * CHUNK, stride_on, stride_od, o, mask, CHUNK)


@triton.jit
def _bwd_slice_products(q_base, k_base, v_base, do_base, rows, row_ok, col0, head_dim, scores, dp,
                        stride_qn, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd, stride_don, stride_dod,
                        CHUNK: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add one head-dim slice's share of ``q k^T`` and ``dO v^T``; return the slice's q, k, dO tiles too."""
    mask = _tile_mask(row_ok, col0, head_dim, CHUNK, EVEN_D)
    q = tl.load(_tile_ptrs(q_base, rows, col0, stride_qn, stride_qd, CHUNK), mask=mask, other=0.0)
    k = tl.load(_tile_ptrs(k_base, rows, col0, stride_kn, stride_kd, CHUNK), mask=mask, other=0.0)
    scores = tl.dot(q, tl.trans(k), scores, input_precision=DOT_PRECISION)
    # Loaded after the first product: fewer tiles live at once (no register spills at D = 64).
    v = tl.load(_tile_ptrs(v_base, rows, col0, stride_vn, stride_vd, CHUNK), mask=mask, other=0.0)
    do = tl.load(_tile_ptrs(do_base, rows, col0, stride_don, stride_dod, CHUNK), mask=mask, other=0.0)
    dp = tl.dot(do, tl.trans(v), dp, input_precision=DOT_PRECISION)
    return q, k, do, scores, dp


@triton.jit
def _grad_scores(p, dp, dtype):
    """``dS = P * (dP - rowsum(P * dP))``: ``Di`` from the tile itself, no preprocessing pass and no ``o`` read."""
    return (p * (dp - tl.sum(p * dp, axis=1)[:, None])).to(dtype)


@triton.jit
def _block_attention_bwd_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, dk_ptr, dv_ptr,
    block_seq_ptr, block_cum_ptr, offsets_ptr,
    num_seqs, num_tokens, head_dim, scale, qk_scale_log2,
    stride_qn, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_don, stride_doh, stride_dod,
    stride_dqn, stride_dqh, stride_dqd,
    stride_dkn, stride_dkh, stride_dkd,
    stride_dvn, stride_dvh, stride_dvd,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLICES_PER_PROGRAM: tl.constexpr,
):
    # Each program owns SLICES_PER_PROGRAM of the NUM_CHUNKS head-dim slices of one (block, kv head): it recomputes
    # P and dS (over all slices) and writes its slices of dq, dk, dv. Without GQA (GROUP == 1) each result is stored
    # as soon as it is computed. With GQA a program owns one slice and loops over the GROUP query heads that share
    # the kv head, accumulating that slice of dk/dv in registers. No atomics: bitwise reproducible.
    PROGRAMS_PER_HEAD: tl.constexpr = NUM_CHUNKS // SLICES_PER_PROGRAM
    pid = tl.program_id(0)
    first_slice = (pid % PROGRAMS_PER_HEAD) * SLICES_PER_PROGRAM
    kv_head = (pid // PROGRAMS_PER_HEAD) % NUM_KV_HEADS
    slot = pid // (PROGRAMS_PER_HEAD * NUM_KV_HEADS)
    start, length = _block_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, slot, num_seqs, num_tokens, BLOCK_SIZE)
    if length <= 0:
        return
    offs = tl.arange(0, BLOCK_SIZE)
    row_ok = offs < length
    rows = start + offs
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    dk_base = dk_ptr + kv_head * stride_dkh
    dv_base = dv_ptr + kv_head * stride_dvh

    dk = tl.zeros((BLOCK_SIZE, CHUNK), dtype=tl.float32)
    dv = tl.zeros((BLOCK_SIZE, CHUNK), dtype=tl.float32)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        q_base = q_ptr + head * stride_qh
        do_base = do_ptr + head * stride_doh
        scores = tl.zeros((BLOCK_SIZE, BLOCK_SIZE), dtype=tl.float32)
        dp = tl.zeros((BLOCK_SIZE, BLOCK_SIZE), dtype=tl.float32)
        if NUM_CHUNKS == 1:
            q, k, do, scores, dp = _bwd_slice_products(
                q_base, k_base, v_base, do_base, rows, row_ok, 0, head_dim, scores, dp,
                stride_qn, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd, stride_don, stride_dod,
                CHUNK, EVEN_D, DOT_PRECISION)
        else:
            for c in range(NUM_CHUNKS):  # a loop, not unrolled: unrolled, every slice's loads are hoisted
                q, k, do, scores, dp = _bwd_slice_products(
                    q_base, k_base, v_base, do_base, rows, row_ok, c * CHUNK, head_dim, scores, dp,
                    stride_qn, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd, stride_don, stride_dod,
                    CHUNK, EVEN_D, DOT_PRECISION)
        p = _softmax_probs(scores, row_ok, qk_scale_log2)
        ds = _grad_scores(p, dp, q_ptr.dtype.element_ty)
        p = p.to(q_ptr.dtype.element_ty)
        for i in range(SLICES_PER_PROGRAM):
            col0 = (first_slice + i) * CHUNK
            mask = _tile_mask(row_ok, col0, head_dim, CHUNK, EVEN_D)
            if NUM_CHUNKS > 1:
                # Read the slice again (an L1/L2 hit): holding every slice would spill registers.
                q = tl.load(_tile_ptrs(q_base, rows, col0, stride_qn, stride_qd, CHUNK), mask=mask, other=0.0)
                k = tl.load(_tile_ptrs(k_base, rows, col0, stride_kn, stride_kd, CHUNK), mask=mask, other=0.0)
                do = tl.load(_tile_ptrs(do_base, rows, col0, stride_don, stride_dod, CHUNK), mask=mask, other=0.0)
            if GROUP == 1:
                _store_tile(dv_base, rows, col0, stride_dvn, stride_dvd,
                            tl.dot(tl.trans(p), do, input_precision=DOT_PRECISION), mask, CHUNK)
            else:
                dv = tl.dot(tl.trans(p), do, dv, input_precision=DOT_PRECISION)
            dq = tl.dot(ds, k, input_precision=DOT_PRECISION) * scale
            _store_tile(dq_ptr + head * stride_dqh, rows, col0, stride_dqn, stride_dqd, dq, mask, CHUNK)
            if GROUP == 1:
                _store_tile(dk_base, rows, col0, stride_dkn, stride_dkd,
                            tl.dot(tl.trans(ds), q, input_precision=DOT_PRECISION) * scale, mask, CHUNK)
            else:
                dk = tl.dot(tl.trans(ds), q, dk, input_precision=DOT_PRECISION)

    if GROUP > 1:
        mask = _tile_mask(row_ok, first_slice * CHUNK, head_dim, CHUNK, EVEN_D)
        _store_tile(dv_base, rows, first_slice * CHUNK, stride_dvn, stride_dvd, dv, mask, CHUNK)
        _store_tile(dk_base, rows, first_slice * CHUNK, stride_dkn, stride_dkd, dk * scale, mask, CHUNK)


@triton.jit
def _block_attention_bwd_persistent_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, dk_ptr, dv_ptr,
    block_seq_ptr, block_cum_ptr, offsets_ptr,
    num_seqs, num_slots, num_tokens, head_dim, scale, qk_scale_log2,
    stride_n, stride_h, stride_d,
    NUM_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PIPELINE_STAGES: tl.constexpr,
):
    # The backward without GQA, whole head dim in one slice, as a persistent loop over (block, head): the compiler
    # prefetches the next item's tiles into shared memory while the current one computes, which hides the load
    # latency that bounds one-block programs when few fit on a multiprocessor (D = 128). All seven tensors share
    # one layout (the launcher checks), so one tile of offsets serves every load and store.
    num_blocks = tl.minimum(tl.load(block_cum_ptr + num_seqs - 1), num_slots)  # the rest of the slots are padding
    offs = tl.arange(0, BLOCK_SIZE)
    for item in tl.range(tl.program_id(0), num_blocks * NUM_HEADS, tl.num_programs(0), num_stages=PIPELINE_STAGES):
        start, length = _block_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, item // NUM_HEADS, num_seqs,
                                      num_tokens, BLOCK_SIZE)
        row_ok = offs < length
        mask = _tile_mask(row_ok, 0, head_dim, CHUNK, EVEN_D)
        tile = _tile_ptrs((item % NUM_HEADS) * stride_h, start + offs, 0, stride_n, stride_d, CHUNK)
        # All four tiles before the products (before the shared offsets: 1.17x the floor on `ads`, 1.22x interleaved).
        q = tl.load(q_ptr + tile, mask=mask, other=0.0)
        k = tl.load(k_ptr + tile, mask=mask, other=0.0)
        v = tl.load(v_ptr + tile, mask=mask, other=0.0)
        do = tl.load(do_ptr + tile, mask=mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        p = _softmax_probs(scores, row_ok, qk_scale_log2)
        ds = _grad_scores(p, dp, q_ptr.dtype.element_ty)
        p = p.to(q_ptr.dtype.element_ty)
        tl.store(dv_ptr + tile, tl.dot(tl.trans(p), do, input_precision=DOT_PRECISION).to(dv_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(dq_ptr + tile, (tl.dot(ds, k, input_precision=DOT_PRECISION) * scale).to(dq_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(dk_ptr + tile,
                 (tl.dot(tl.trans(ds), q, input_precision=DOT_PRECISION) * scale).to(dk_ptr.dtype.element_ty),
                 mask=mask)


def new_output(like: torch.Tensor) -> torch.Tensor:
    """Allocation of every kernel output (one place, so tests can poison it)."""
    return torch.empty_like(like)


def _persistent_programs(device: torch.device) -> int:
    """Programs of a persistent kernel: one per multiprocessor. Off the GPU (Triton's interpreter) a few, so that
    each runs several work items as on the GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 3


def _register_cap(maxnreg: int | None) -> dict:
    return {} if maxnreg is None else {"maxnreg": maxnreg}


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs get true fp32 products ("ieee"), not TF32: callers who pass fp32 asked for fp32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _strides(*tensors: torch.Tensor) -> list[int]:
    return [s for t in tensors for s in t.stride()]


def block_attention_fwd_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    block_cum: torch.Tensor,
    block_seq: torch.Tensor,
    block_size: int,
    scale: float,
    *,
    num_warps: int | None = None,
    maxnreg: int | None = None,
) -> torch.Tensor:
    """Launch the forward kernel over the block table of ``layout.block_table``. Arguments are assumed validated
    (``layout.validate``); ``num_warps`` and ``maxnreg`` (a register cap) override the tuned launch (for tuning
    sweeps)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    out = new_output(q)
    if block_seq.numel() == 0:
        return out
    cfg = kernel_config(block_size, d, backward=False)
    grid = (block_seq.numel() * hq,)
    _block_attention_fwd_kernel[grid](
        q, k, v, out, block_seq, block_cum, offsets,
        offsets.numel() - 1, n, d, scale * _LOG2E,
        *_strides(q, k, v, out),
        NUM_Q_HEADS=hq, GROUP=hq // hkv, BLOCK_SIZE=block_size,
        CHUNK=cfg["CHUNK"], NUM_CHUNKS=cfg["NUM_CHUNKS"], EVEN_D=cfg["EVEN_D"],
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=num_warps or _num_warps(block_size), num_stages=1, **_register_cap(maxnreg),
    )
    return out


def block_attention_bwd_triton(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    block_cum: torch.Tensor,
    block_seq: torch.Tensor,
    block_size: int,
    scale: float,
    *,
    num_warps: int | None = None,
    maxnreg: int | None = None,
    slices_per_program: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernel; returns ``(dq, dk, dv)`` in the inputs' dtypes. ``num_warps``, ``maxnreg`` and
    ``slices_per_program`` override the tuned choices (for tuning sweeps; the last must be 1 under GQA, and
    giving it selects the one-block-per-program kernel)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    dq, dk, dv = new_output(q), new_output(k), new_output(v)
    if block_seq.numel() == 0:
        return dq, dk, dv
    group = hq // hkv
    cfg = kernel_config(block_size, d, backward=True, group=group, element_size=q.element_size())
    common = dict(BLOCK_SIZE=block_size, CHUNK=cfg["CHUNK"], EVEN_D=cfg["EVEN_D"],
                  DOT_PRECISION=_dot_precision(q.dtype), num_warps=num_warps or _num_warps(block_size),
                  num_stages=1, **_register_cap(maxnreg))
    tensors = (q, k, v, grad_out, dq, dk, dv, block_seq, block_cum, offsets)
    num_seqs, num_slots = offsets.numel() - 1, block_seq.numel()
    one_layout = len({t.stride() for t in (q, k, v, grad_out, dq, dk, dv)}) == 1
    if cfg["PIPELINE_STAGES"] > 1 and one_layout and slices_per_program is None:
        programs = min(num_slots * hq, _persistent_programs(q.device))
        _block_attention_bwd_persistent_kernel[(programs,)](
            *tensors, num_seqs, num_slots, n, d, scale, scale * _LOG2E, *q.stride(),
            NUM_HEADS=hq, PIPELINE_STAGES=cfg["PIPELINE_STAGES"], **common,
        )
        return dq, dk, dv
    slices = slices_per_program or (cfg["NUM_CHUNKS"] if group == 1 else 1)
    grid = (num_slots * hkv * (cfg["NUM_CHUNKS"] // slices),)
    _block_attention_bwd_kernel[grid](
        *tensors, num_seqs, n, d, scale, scale * _LOG2E, *_strides(q, k, v, grad_out, dq, dk, dv),
        NUM_KV_HEADS=hkv, GROUP=group, NUM_CHUNKS=cfg["NUM_CHUNKS"], SLICES_PER_PROGRAM=slices, **common,
    )
    return dq, dk, dv


# --- PyTorch path (CPU tensors): the same semantics on padded blocks, computed in fp32 ------------------------------


def _gather_blocks(x: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[N, H, D]`` -> ``[blocks, H, BS, D]`` in fp32, zeros where ``valid`` is False (they read a zero row N)."""
    padded = torch.cat([x.float(), x.new_zeros((1, *x.shape[1:]), dtype=torch.float32)])
    return padded[torch.where(valid, rows, x.shape[0])].transpose(1, 2)


def _scatter_blocks(blocks: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_gather_blocks`: padded rows go to a spare row ``N`` that is dropped."""
    n = like.shape[0]
    out = like.new_empty((n + 1, *like.shape[1:]), dtype=blocks.dtype)
    out[torch.where(valid, rows, n).flatten()] = blocks.transpose(1, 2).flatten(0, 1)
    return out[:n].to(like.dtype)


def _probs(qb: torch.Tensor, kb: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    scores = (qb @ kb.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padding slots have no valid key at all


def block_attention_fwd_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    block_cum: torch.Tensor,
    block_seq: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    rows, valid = block_rows(offsets, block_cum, block_seq, block_size)
    qb = _gather_blocks(q, rows, valid)
    kb, vb = (_gather_blocks(t, rows, valid).repeat_interleave(group, dim=1) for t in (k, v))
    return _scatter_blocks(_probs(qb, kb, valid, scale) @ vb, rows, valid, q)


def block_attention_bwd_torch(
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
    hkv = k.shape[1]
    group = q.shape[1] // hkv
    rows, valid = block_rows(offsets, block_cum, block_seq, block_size)
    qb, dob = _gather_blocks(q, rows, valid), _gather_blocks(grad_out, rows, valid)
    kb, vb = (_gather_blocks(t, rows, valid).repeat_interleave(group, dim=1) for t in (k, v))
    p = _probs(qb, kb, valid, scale)
    dp = dob @ vb.transpose(-1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    dqb = (ds @ kb) * scale
    dkb = (ds.transpose(-1, -2) @ qb) * scale
    dvb = p.transpose(-1, -2) @ dob

    def per_kv_head(blocks: torch.Tensor) -> torch.Tensor:
        return blocks.unflatten(1, (hkv, group)).sum(2)

    return (
        _scatter_blocks(dqb, rows, valid, q),
        _scatter_blocks(per_kv_head(dkb), rows, valid, k),
        _scatter_blocks(per_kv_head(dvb), rows, valid, v),
    )
