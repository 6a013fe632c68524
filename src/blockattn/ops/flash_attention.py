"""Flash attention on whole sequences (dense ``[B, S, H, D]`` and varlen ``[N, H, D]``): the Triton kernels and
their launchers, forward only.

The FlashAttention-2 algorithm: one program owns ``BLOCK_M`` query rows of one head and streams the key/value tiles
of its sequence, keeping a running row maximum ``m``, row sum ``l`` and accumulator (online softmax, in base 2).
Key tiles above the causal diagonal are never visited. Each kernel has one key loop (on an H100, Triton's software
pipeliner ran 0.22-0.28x as fast with an unmasked loop followed by a masked one at D = 128, and its Hopper warp
specialisation failed to compile two loops). The pipelined kernel sets keys past the sequence's end or above the
diagonal to ``-inf`` (one select per score) only in the tiles that hold such keys, under a branch in the loop; the
TMA kernel, whose warp specialisation ran 0.40-0.45x as fast with that branch, selects in every tile.

Two variants:

- ``pipelined``: pointer loads that the compiler software-pipelines ``num_stages`` deep (every NVIDIA GPU from
  Ampere on).
- ``warp_specialized``: TMA tensor descriptors built on the device per sequence (rows past a sequence's end are
  zero-filled on load and dropped on store), and a key/value loop that Triton warp-specialises on Hopper: producer
  warps fill a multi-stage shared-memory ring with TMA, consumer warps compute (Hopper and later; the dispatcher
  sends it 16-bit inputs with D = 128 only, ``backends.TMA_HEAD_DIMS``: other head dims and fp8 failed on triton 3.6).
  On Hopper the Gluon kernel of ``flash_attention_sm90`` serves this variant first (faster: docs/benchmarks.md);
  this one takes what it does not (batches whose rows do not follow each other).

fp8 (``float8_e4m3fn``) inputs multiply in fp8 with fp32 accumulation. The descales are read on the device: ``q`` and
``k``'s fold into the score scale, ``v``'s multiplies the output. ``P`` is quantised to fp8 for the ``P V`` product
after scaling by ``P_SCALE = 256``: probabilities in ``[2^-14, 1]`` then stay normal e4m3 numbers (a relative
rounding of at most 2^-4 each) instead of flushing towards the subnormals below 2^-6. Hopper's fp8 tensor cores take
the second operand K-major, so ``v`` is passed transposed (``[.., D, tokens]``, one copy by the launcher).

Varlen grids come from shapes: one slot per possible ``BLOCK_M`` tile, ``sum ceil(len_b / BLOCK_M) <= (N + B
(BLOCK_M - 1)) / BLOCK_M``, each looking its sequence up in a block table (``block_table``) built on the device.
Every row index is clamped to ``[0, N)``, so cumulative lengths whose values were not checked on the host never
cause an out-of-bounds access.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..block_table import BlockTable
from . import tiles
from .launch import launch, not_replayable
from .tiles import LOG2E, column_mask, fp8_score_scale, load_or_zero

P_SCALE = tl.constexpr(256.0)
LN2 = tl.constexpr(0.6931471805599453)


@dataclass(frozen=True)
class FlashConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def shared_bytes(self, block_d: int, element_size: int) -> int:
        """Shared memory the kernel needs, an upper bound: the ``q`` tile, ``num_stages`` key and value tiles, and
        two ``P`` tiles (staging for the second product; checked against the compiler's figures on an H100)."""
        return ((self.block_m + 2 * self.num_stages * self.block_n) * block_d
                + 2 * self.block_m * self.block_n) * element_size


# Swept on an H100 (benchmarks/tune_flash_attention.py: B 4, S 4096 and 8192, H 16; docs/benchmarks.md); keyed by
# (variant, fp8), then head dims up to. The warp-specialised loop takes 4 warps (Triton's Hopper pass splits them
# into a producer and consumer groups itself).
_CONFIGS = {
    ("pipelined", False): ((128, FlashConfig(128, 64, 8, 3)), (256, FlashConfig(128, 64, 8, 2))),
    ("pipelined", True): ((128, FlashConfig(128, 128, 8, 3)), (256, FlashConfig(128, 64, 8, 2))),
    ("warp_specialized", False): ((128, FlashConfig(128, 128, 4, 2)),),
    # The Gluon kernel (flash_attention_sm90): two consumer warpgroups of 4 warps, two slots; its accumulator takes
    # 128 registers a thread at D = 256, where a key tile of 64 keeps the scores' to 32.
    ("warp_specialized-sm90", False): ((128, FlashConfig(128, 128, 4, 2)), (256, FlashConfig(128, 64, 4, 2))),
    ("warp_specialized-sm90", True): ((128, FlashConfig(128, 128, 4, 2)), (256, FlashConfig(128, 64, 4, 2))),
}
# Without a causal mask the Gluon kernel takes a third consumer warpgroup (192-row tiles) where it measured faster on
# an H100 (docs/benchmarks.md): fp8 at D <= 128 (+10% at D = 128, +25% at D = 64) and 16-bit at D = 64 (+4%). At
# D = 128 in 16 bits its 160 registers a thread spill too much (0.75x), and causal items of 192 rows lost 3-7%. Its
# entry goes first; the head dims above it keep the table's.
_THREE_CONSUMERS = FlashConfig(192, 128, 4, 2)
_CONFIGS_NON_CAUSAL = {
    ("warp_specialized-sm90", False): ((64, _THREE_CONSUMERS),) + _CONFIGS[("warp_specialized-sm90", False)],
    ("warp_specialized-sm90", True): ((128, _THREE_CONSUMERS),) + _CONFIGS[("warp_specialized-sm90", True)],
}
# Ampere and Ada (never measured here): 4 warps and 2 stages, for their 100-164 KB of shared memory.
_CONFIGS_SM8X = ((128, FlashConfig(128, 64, 4, 2)), (256, FlashConfig(64, 64, 4, 2)))


def block_d(head_dim: int, fp8: bool) -> int:
    """Head dims are padded to a power of two, at least 32 for fp8 (the tensor cores' fp8 reduction depth)."""
    return max(32 if fp8 else 16, triton.next_power_of_2(head_dim))


@functools.cache  # the dispatcher's check and the launch ask the same question on every call
def flash_config(variant: str, capability: tuple[int, int], head_dim: int, fp8: bool,
                 shared_limit: int, causal: bool) -> tuple[FlashConfig | None, str | None]:
    """The tuned configuration, with stages then key tiles shrunk until it fits ``shared_limit`` bytes of shared
    memory; ``(None, reason)`` when nothing fits."""
    if capability[0] < 9:
        table = _CONFIGS_SM8X
    elif causal or (variant, fp8) not in _CONFIGS_NON_CAUSAL:
        table = _CONFIGS[(variant, fp8)]
    else:
        table = _CONFIGS_NON_CAUSAL[(variant, fp8)]
    cfg = next(c for limit, c in table if head_dim <= limit)
    width, elem = block_d(head_dim, fp8), 1 if fp8 else 2
    while cfg.shared_bytes(width, elem) > shared_limit:
        if cfg.num_stages > 2:
            cfg = FlashConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages - 1)
        elif cfg.block_n > 16:
            cfg = FlashConfig(cfg.block_m, cfg.block_n // 2, cfg.num_warps, cfg.num_stages)
        elif cfg.block_m > 32:
            cfg = FlashConfig(cfg.block_m // 2, cfg.block_n, cfg.num_warps, cfg.num_stages)
        else:
            return None, (f"head_dim {head_dim} needs {cfg.shared_bytes(width, elem)} bytes of shared memory at the "
                          f"smallest tiles, this GPU has {shared_limit}")
    return cfg, None


@triton.jit
def _tile_of(tile, seqlen_q, seqlen_k, tiles_per_seq, cu_q_ptr, cu_k_ptr, block_cum_ptr, block_seq_ptr, num_seqs,
             num_q_tokens, num_k_tokens, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr, CAUSAL: tl.constexpr):
    """``(seq, q_start, k_start, sq, sk, m0)``: the sequence of grid slot ``tile`` (the batch index when dense), where
    its queries and keys start (rows of the packed tensors; 0 when dense), their lengths, and the slot's first
    query row in the sequence. Padding slots of a varlen grid get ``sq = 0`` (and, under ``CAUSAL``, a negative
    ``m0``). Packed tensors have batch strides 0: ``seq`` times a batch stride is 0 for them."""
    if VARLEN:
        seq = tl.load(block_seq_ptr + tile)
        seq_c = tl.minimum(seq, num_seqs - 1)
        q_start = tl.minimum(tl.maximum(tl.load(cu_q_ptr + seq_c).to(tl.int64), 0), num_q_tokens)
        q_end = tl.minimum(tl.maximum(tl.load(cu_q_ptr + seq_c + 1).to(tl.int64), q_start), num_q_tokens)
        k_start = tl.minimum(tl.maximum(tl.load(cu_k_ptr + seq_c).to(tl.int64), 0), num_k_tokens)
        k_end = tl.minimum(tl.maximum(tl.load(cu_k_ptr + seq_c + 1).to(tl.int64), k_start), num_k_tokens)
        sq = tl.where(seq < num_seqs, q_end - q_start, 0).to(tl.int32)
        sk = (k_end - k_start).to(tl.int32)
        nblocks = (sq + BLOCK_M - 1) // BLOCK_M
        m_block = tile - (tl.load(block_cum_ptr + seq_c) - nblocks)
        batch = seq_c
    else:
        batch = tile // tiles_per_seq
        m_block = tile % tiles_per_seq
        q_start = 0
        k_start = 0
        sq = seqlen_q
        sk = seqlen_k
    if CAUSAL:
        m_block = (sq + BLOCK_M - 1) // BLOCK_M - 1 - m_block  # the longest rows first: they finish last
    return batch, q_start, k_start, sq, sk, m_block * BLOCK_M


@triton.jit
def _key_end(m0, sq, sk, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, BOTTOM_RIGHT: tl.constexpr):
    """End of the keys some row of the program sees: row ``i`` sees keys ``j < sk`` with, under ``CAUSAL``,
    ``j <= i + shift``; key tiles past the diagonal are never visited."""
    end = sk
    if CAUSAL:
        shift = sk - sq if BOTTOM_RIGHT else 0
        end = tl.minimum(tl.maximum(m0 + BLOCK_M + shift, 0), sk)
    return end


@triton.jit
def online_softmax(scores, m_i, l_i, scale, p_shift):
    """``(p, alpha, m, l)``: one key tile's ``scores`` (``-inf`` where masked) times ``scale`` (positive; base 2)
    folded into the running row max ``m_i`` and sum ``l_i``; ``alpha`` rescales what was accumulated before. ``p``
    and the sum come out ``2^p_shift`` times the probabilities. Scaling inside the exponent makes it one fused
    multiply-add per score. (Also called from the Gluon kernel: layout-free.)"""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1) * scale)
    # A row that has seen no key yet keeps m = -inf: subtract 0 instead, so that p and alpha are 0, not NaN.
    m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores * scale - (m_new - p_shift)[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _online_softmax_step(acc, m_i, l_i, scores, v, FP8: tl.constexpr):
    """Fold one key tile's ``scores`` (scaled to base 2, ``-inf`` where masked) and values into the running state."""
    p, alpha, m_new, l_i = online_softmax(scores, m_i, l_i, 1.0, 0.0)
    acc = acc * alpha[:, None]
    if FP8:
        acc = tl.dot((p * P_SCALE).to(v.dtype), v, acc)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _both(a, b):
    """``a & b`` where ``None`` stands for an all-true mask."""
    if a is None:
        mask = b
    else:
        if b is None:
            mask = a
        else:
            mask = a & b
    return mask


@triton.jit
def _key_mask(kn, offs_m, sk, shift, CAUSAL: tl.constexpr):
    visible = (kn < sk)[None, :]
    if CAUSAL:
        visible = visible & (kn[None, :] <= offs_m[:, None] + shift)
    return visible


@triton.jit
def _finish(acc, m_i, l_i):
    """``(out, lse)`` of the final state; rows that saw no key give 0 and ``-inf``."""
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    return out, lse


@triton.jit
def _unmasked_end(m0, sk, shift, end, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Where a program's key tiles that need a mask begin (a multiple of ``BLOCK_N``, at most ``end``): the tiles
    before it hold keys below ``sk`` that, under ``CAUSAL``, its first row ``m0`` sees too (``j <= m0 + shift``),
    and so every later row."""
    seen_by_all = sk
    if CAUSAL:
        seen_by_all = tl.minimum(sk, m0 + shift + 1)
    return tl.minimum(tl.maximum(seen_by_all, 0) // BLOCK_N * BLOCK_N, end)


@triton.jit
def _flash_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, block_cum_ptr, block_seq_ptr,
    q_descale_ptr, k_descale_ptr, v_descale_ptr,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_on, stride_oh, stride_lb, stride_lh,
    seqlen_q, seqlen_k, tiles_per_seq, num_seqs, num_q_tokens, num_k_tokens, qk_scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, VARLEN: tl.constexpr, CAUSAL: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, FP8: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """The ``pipelined`` variant: grid ``(tile slots, Hq)``; the mask only in the tiles from ``unmasked_end`` on
    (H100, bf16 and fp8 at S 4096-8192: 3-26% faster than a select in every tile, bitwise the same results)."""
    head = tl.program_id(1)
    batch, q_start, k_start, sq, sk, m0 = _tile_of(
        tl.program_id(0), seqlen_q, seqlen_k, tiles_per_seq, cu_q_ptr, cu_k_ptr, block_cum_ptr, block_seq_ptr,
        num_seqs, num_q_tokens, num_k_tokens, BLOCK_M, VARLEN, CAUSAL)
    kv_head = head // GROUP
    valid = (m0 >= 0) & (m0 < sq)  # padding slots (sq = 0, or a negative m0 under CAUSAL) loop over nothing
    m0 = tl.where(valid, m0, 0)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # Column masks only where D does not fill the tile (None: unpredicated, vectorised loads).
    d_cols = column_mask(0, HEAD_DIM, BLOCK_D, HEAD_DIM == BLOCK_D)
    d_rows = None if HEAD_DIM == BLOCK_D else (offs_d < HEAD_DIM)[:, None]
    row_ok = offs_m < tl.where(valid, sq, 0)
    row0 = (q_start + m0).to(tl.int64)  # 64-bit row offsets: N * H * D may pass 2^31
    q_base = q_ptr + batch.to(tl.int64) * stride_qb + row0 * stride_qn + head * stride_qh
    q = load_or_zero(q_base + tl.arange(0, BLOCK_M)[:, None] * stride_qn + offs_d[None, :],
                     _both(row_ok[:, None], d_cols))
    k_base = k_ptr + batch.to(tl.int64) * stride_kb + k_start * stride_kn + kv_head * stride_kh
    # The transposed fp8 copy of v has head and column strides of D * N and N.
    v_base = v_ptr + batch.to(tl.int64) * stride_vb + k_start * stride_vn + kv_head.to(tl.int64) * stride_vh
    # 16-bit k as [BLOCK_N, D], transposed for the product; fp8 k as [D, BLOCK_N] (K-major, as fp8 products need)
    # and fp8 v likewise from its transposed copy.
    if FP8:
        k_ptrs = k_base + offs_d[:, None] + offs_n[None, :] * stride_kn
        v_ptrs = v_base + offs_d.to(tl.int64)[:, None] * stride_vd + offs_n[None, :] * stride_vn
    else:
        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    qk_scale = fp8_score_scale(qk_scale_log2, q_descale_ptr, k_descale_ptr, FP8)
    shift = sk - sq if BOTTOM_RIGHT else 0
    end = _key_end(m0, sq, sk, BLOCK_M, CAUSAL, BOTTOM_RIGHT)
    end = tl.where(valid, end, 0)
    unmasked_end = _unmasked_end(m0, sk, shift, end, BLOCK_N, CAUSAL)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    # Pointers advance tile by tile (64-bit pointer arithmetic: no index product can overflow).
    for start_n in tl.range(0, end, BLOCK_N, num_stages=NUM_STAGES):
        kn = start_n + offs_n
        if FP8:
            key_cols = _both((kn < sk)[None, :], d_rows)
            k = load_or_zero(k_ptrs, key_cols)
            v = tl.trans(load_or_zero(v_ptrs, key_cols))
            products = tl.dot(q, k)
        else:
            key_rows = _both((kn < sk)[:, None], d_cols)
            k = load_or_zero(k_ptrs, key_rows)
            v = load_or_zero(v_ptrs, key_rows)
            products = tl.dot(q, tl.trans(k))
        scores = products * qk_scale
        if start_n >= unmasked_end:  # scaled before masking: a zero descale must not turn -inf into NaN
            scores = tl.where(_key_mask(kn, offs_m, sk, shift, CAUSAL), scores, float("-inf"))
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, scores, v, FP8)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    out, lse = _finish(acc, m_i, l_i)
    if FP8:
        out = out * (tl.load(v_descale_ptr) / P_SCALE)
    o_base = o_ptr + batch.to(tl.int64) * stride_ob + row0 * stride_on + head * stride_oh
    tl.store(o_base + tl.arange(0, BLOCK_M)[:, None] * stride_on + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=_both(row_ok[:, None], d_cols))
    lse_base = lse_ptr + batch.to(tl.int64) * stride_lb + head * stride_lh + row0
    tl.store(lse_base + tl.arange(0, BLOCK_M), lse, mask=row_ok)


@triton.jit
def _flash_fwd_tma_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, block_cum_ptr, block_seq_ptr,
    stride_qb, stride_qn, stride_kb, stride_kn, stride_vb, stride_vn,
    stride_ob, stride_on, stride_lb, stride_lh,
    seqlen_q, seqlen_k, tiles_per_seq, num_seqs, num_q_tokens, num_k_tokens, qk_scale_log2,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, VARLEN: tl.constexpr, CAUSAL: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """The ``warp_specialized`` variant: the same program as :func:`_flash_fwd_kernel`, loading through TMA
    descriptors whose row extent ends at the sequence's last row (rows past it are zero-filled on load, dropped
    on store). ``HEAD_DIM`` is a power of two and heads lie side by side in a row."""
    head = tl.program_id(1)
    batch, q_start, k_start, sq, sk, m0 = _tile_of(
        tl.program_id(0), seqlen_q, seqlen_k, tiles_per_seq, cu_q_ptr, cu_k_ptr, block_cum_ptr, block_seq_ptr,
        num_seqs, num_q_tokens, num_k_tokens, BLOCK_M, VARLEN, CAUSAL)
    # No branch: Triton's Hopper warp specialisation takes one loop and no if/else. A padding slot (sq = 0, or a
    # negative m0) loops over nothing, its stores fall outside the descriptor's rows (TMA drops them) or the mask.
    kv_head = head // GROUP
    q_rows = (q_start + sq).to(tl.int32)
    k_rows = tl.maximum(k_start + sk, 1).to(tl.int32)  # a descriptor needs one row; no loop reads it if sk = 0
    # 2-D descriptors over rows of side-by-side heads ([rows, H * D]; D fills the tile): the warp-specialising
    # pass partitions these loads, not reshaped 3-D ones.
    desc_q = tl.make_tensor_descriptor(q_ptr + batch.to(tl.int64) * stride_qb, [q_rows, NUM_Q_HEADS * HEAD_DIM],
                                       [stride_qn, 1], [BLOCK_M, HEAD_DIM])
    desc_o = tl.make_tensor_descriptor(o_ptr + batch.to(tl.int64) * stride_ob, [q_rows, NUM_Q_HEADS * HEAD_DIM],
                                       [stride_on, 1], [BLOCK_M, HEAD_DIM])
    desc_k = tl.make_tensor_descriptor(k_ptr + batch.to(tl.int64) * stride_kb, [k_rows, NUM_KV_HEADS * HEAD_DIM],
                                       [stride_kn, 1], [BLOCK_N, HEAD_DIM])
    desc_v = tl.make_tensor_descriptor(v_ptr + batch.to(tl.int64) * stride_vb, [k_rows, NUM_KV_HEADS * HEAD_DIM],
                                       [stride_vn, 1], [BLOCK_N, HEAD_DIM])
    valid = (m0 >= 0) & (m0 < sq)
    q_row = tl.where(valid, q_start + m0, q_rows).to(tl.int32)  # invalid: the first row past the descriptor
    k_row = k_start.to(tl.int32)
    q_col = head * HEAD_DIM
    kv_col = kv_head * HEAD_DIM
    q = desc_q.load([q_row, q_col])
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    shift = sk - sq if BOTTOM_RIGHT else 0
    end = _key_end(m0, sq, sk, BLOCK_M, CAUSAL, BOTTOM_RIGHT)
    end = tl.where(valid, end, 0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    # One loop, masked throughout: Triton's warp specialisation (3.6, Hopper) failed to compile an unmasked loop
    # followed by a masked one, and with the mask under a branch in the loop it ran 0.40-0.45x as fast (H100).
    for start_n in tl.range(0, end, BLOCK_N, num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE):
        k = desc_k.load([k_row + start_n, kv_col])
        v = desc_v.load([k_row + start_n, kv_col])
        kn = start_n + offs_n
        scores = tl.where(_key_mask(kn, offs_m, sk, shift, CAUSAL), tl.dot(q, k.T) * qk_scale_log2, float("-inf"))
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, scores, v, False)
    out, lse = _finish(acc, m_i, l_i)
    desc_o.store([q_row, q_col], out.to(o_ptr.dtype.element_ty))
    lse_base = lse_ptr + batch.to(tl.int64) * stride_lb + head * stride_lh + q_start + m0
    tl.store(lse_base + tl.arange(0, BLOCK_M), lse, mask=(offs_m >= 0) & (offs_m < sq))


def _allocate_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for the descriptors the TMA kernel builds on the device (the current device's)."""
    return torch.empty(size, dtype=torch.int8, device=torch.cuda.current_device())


def _batch_strides(prefix: str, t: torch.Tensor, dense: bool) -> dict:
    """``stride_{prefix}b/n`` of a dense ``[B, S, H, D]`` or a packed ``[N, H, D]`` tensor (batch stride 0)."""
    b, n = t.stride()[:2] if dense else (0, t.stride(0))
    return {f"stride_{prefix}b": b, f"stride_{prefix}n": n}


def _head_strides(*named: tuple[str, torch.Tensor]) -> dict:
    """The head strides the pipelined kernel reads (the TMA kernel's rows hold the heads side by side)."""
    return {f"stride_{prefix}h": t.stride(-2) for prefix, t in named}


def outputs_and_sequences(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
                          cu_seqlens_k: torch.Tensor | None, table: BlockTable | None, block_m: int,
                          out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int, dict]:
    """``(out, lse, slots, sequences)``: the outputs, the grid's number of tile slots, and the kernels' arguments
    that say where each slot's rows are (:func:`_tile_of`; the outputs' batch and row strides). Dense when
    ``cu_seqlens_q`` is None (``lse [B, H, Sq]``), else packed (``lse [H, N]``; ``table`` of ``cu_seqlens_q`` at
    ``block_m``)."""
    hq = q.shape[-2]
    dense = cu_seqlens_q is None
    out = tiles.new_output(q, dtype=out_dtype)
    if dense:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        lse = tiles.new_output(q, (batch, hq, seqlen_q), torch.float32)
        tiles_per_seq = triton.cdiv(seqlen_q, block_m)
        slots, num_seqs = batch * tiles_per_seq, batch
        lse_strides = {"stride_lb": lse.stride(0), "stride_lh": lse.stride(1)}
        cu_seqlens_q = cu_seqlens_k = block_cum = block_seq = lse  # never read
    else:
        seqlen_q = seqlen_k = tiles_per_seq = 0
        lse = tiles.new_output(q, (hq, q.shape[0]), torch.float32)
        slots, num_seqs = table.num_slots, cu_seqlens_q.numel() - 1
        lse_strides = {"stride_lb": 0, "stride_lh": lse.stride(0)}
        block_cum, block_seq = table
    return out, lse, slots, dict(
        cu_q_ptr=cu_seqlens_q, cu_k_ptr=cu_seqlens_k, block_cum_ptr=block_cum,
        block_seq_ptr=block_seq, **_batch_strides("o", out, dense), **lse_strides,
        seqlen_q=seqlen_q, seqlen_k=seqlen_k, tiles_per_seq=tiles_per_seq, num_seqs=num_seqs,
        num_q_tokens=q.shape[0], num_k_tokens=k.shape[0])


@triton.jit
def _transpose_tokens_kernel(src_ptr, dst_ptr, tokens, padded_tokens, heads, stride_sb, stride_st, stride_sh,
                             stride_db, stride_dh, stride_dd, D: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_T: tl.constexpr):
    """``BLOCK_T`` tokens of one (batch, head) of one-byte values: ``src`` rows ``[token, D]`` (D innermost) to
    ``dst`` rows ``[D, token]``, zeros in the columns from ``tokens`` to ``padded_tokens`` (a multiple of 16). Both
    sides move 16 bytes a thread (a store mask in runs of 16 allows it); the tile turns through shared memory. One
    grid axis (the others hold 65 535 programs at most): the (batch, head) pairs of a token block in turn."""
    pairs = tl.num_programs(0) // tl.cdiv(tokens, BLOCK_T)
    bh = tl.program_id(0) % pairs
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    t = (tl.program_id(0) // pairs) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    x = tl.load(src_ptr + b * stride_sb + t.to(tl.int64)[:, None] * stride_st + h * stride_sh + d[None, :],
                mask=(t < tokens)[:, None] & (d < D)[None, :], other=0)
    tl.store(dst_ptr + b * stride_db + h * stride_dh + d.to(tl.int64)[:, None] * stride_dd + t[None, :], tl.trans(x),
             mask=(d < D)[:, None] & (t < padded_tokens)[None, :])


def transposed_values(v: torch.Tensor) -> torch.Tensor:
    """``v`` with tokens innermost, the layout fp8 products need: a view ``[.., tokens, H, D]`` of a ``[.., H, D,
    tokens]`` copy whose rows are padded to 16 bytes (aligned, vectorised loads). On a GPU a kernel of ours makes
    the copy: PyTorch's strided copy of one-byte values moved about 0.3 TB/s on an H100 (docs/benchmarks.md)."""
    *lead, tokens, heads, d = v.shape
    width = triton.cdiv(max(tokens, 1), 16) * 16
    padded = torch.empty((*lead, heads, d, width), dtype=v.dtype, device=v.device)
    copy = padded[..., :tokens]
    if v.is_cuda and v.stride(-1) == 1 and v.numel() > 0 and width < 2**31:  # the kernel's token index is int32
        src, dst = v.view(torch.uint8), padded.view(torch.uint8)  # (a kernel takes no fp8 pointer on every GPU)
        if not lead:  # packed: one sequence of rows
            src, dst = src.unsqueeze(0), dst.unsqueeze(0)
        block_t = 64
        launch(_transpose_tokens_kernel, (triton.cdiv(tokens, block_t) * src.shape[0] * heads,), src_ptr=src,
               dst_ptr=dst, tokens=tokens, padded_tokens=width, heads=heads, stride_sb=src.stride(0),
               stride_st=src.stride(1), stride_sh=src.stride(2), stride_db=dst.stride(0), stride_dh=dst.stride(1),
               stride_dd=dst.stride(2), D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_T=block_t, num_warps=4)
    else:
        copy.copy_(v.movedim(-3, -1))
    return copy.movedim(-1, -3)


def flash_attention_fwd_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    table: BlockTable | None,
    scale: float,
    causal: bool,
    bottom_right: bool,
    out_dtype: torch.dtype,
    descales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    variant: str,
    config: FlashConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the ``variant`` kernel with ``config``; returns ``(out, lse)``. Dense when ``cu_seqlens_q`` is None
    (``[B, S, H, D]``, ``lse [B, H, Sq]``), else packed (``[N, H, D]``, ``lse [H, N]``) with ``table`` the block
    table of ``cu_seqlens_q`` at ``config.block_m``."""
    dense = cu_seqlens_q is None
    fp8 = descales is not None
    if fp8:
        v = transposed_values(v)
    d = q.shape[-1]
    out, lse, slots, sequences = outputs_and_sequences(q, k, cu_seqlens_q, cu_seqlens_k, table, config.block_m,
                                                       out_dtype)
    if slots == 0:  # no query row (N or B * Sq is 0)
        return out, lse
    args = dict(
        q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=out, lse_ptr=lse, **sequences,
        **_batch_strides("q", q, dense), **_batch_strides("k", k, dense), **_batch_strides("v", v, dense),
        qk_scale_log2=scale * LOG2E, HEAD_DIM=d, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        GROUP=q.shape[-2] // k.shape[-2], VARLEN=not dense, CAUSAL=causal, BOTTOM_RIGHT=bottom_right,
        NUM_STAGES=config.num_stages, num_warps=config.num_warps,
    )
    grid = (slots, q.shape[-2])
    if variant == "pipelined":
        q_descale, k_descale, v_descale = descales if fp8 else (q, q, q)  # never read without fp8
        launch(_flash_fwd_kernel, grid, **args, q_descale_ptr=q_descale, k_descale_ptr=k_descale,
               v_descale_ptr=v_descale, **_head_strides(("q", q), ("k", k), ("v", v), ("o", out)),
               stride_vd=v.stride(-1), BLOCK_D=block_d(d, fp8), FP8=fp8)
    else:
        # Triton's allocator is set per thread: a replay on another thread would find none.
        not_replayable("sets Triton's allocator for the TMA kernel's device-side descriptors")
        triton.set_allocator(_allocate_scratch)
        launch(_flash_fwd_tma_kernel, grid, **args, NUM_Q_HEADS=q.shape[-2], NUM_KV_HEADS=k.shape[-2],
               WARP_SPECIALIZE=q.device.type == "cuda")
    return out, lse
