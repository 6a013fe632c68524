"""Jagged layout: argument validation and the block table every kernel uses to find its block.

A sequence ``b`` owns rows ``offsets[b]:offsets[b+1]`` and is cut into blocks of ``block_size`` tokens starting at
its first token. The number of blocks is data-dependent, so the kernels are launched over a static upper bound
(:func:`max_blocks`) and each program looks up its block on the device: no host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_SIZES = (16, 32, 64, 128)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OFFSET_DTYPES = (torch.int32, torch.int64)
# The operands a fused rotary can turn, as bits of the kernels' ROTATE mask.
ROTATE_BITS = {"q": 1, "k": 2, "v": 4}


def max_blocks(num_tokens: int, num_seqs: int, block_size: int) -> int:
    """Upper bound on the number of blocks: ``sum ceil(len_b / BS) <= (N + B * (BS - 1)) // BS``."""
    return (num_tokens + num_seqs * (block_size - 1)) // block_size


@triton.jit
def _block_scan_kernel(offsets_ptr, block_cum_ptr, ok_ptr, num_seqs, num_tokens,
                       BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr):
    """One program: ``block_cum`` = inclusive prefix sum of ``ceil(len_b / BS)``, and whether the offsets are valid
    (``offsets[0] == 0``, non-decreasing, ``offsets[-1] == N``): one launch instead of a dozen small ones."""
    ok = (tl.load(offsets_ptr) == 0) & (tl.load(offsets_ptr + num_seqs) == num_tokens)
    carry = tl.zeros((), dtype=tl.int32)
    for first in range(0, num_seqs, CHUNK):
        idx = first + tl.arange(0, CHUNK)
        in_range = idx < num_seqs
        length = (tl.load(offsets_ptr + idx + 1, mask=in_range, other=0)
                  - tl.load(offsets_ptr + idx, mask=in_range, other=0)).to(tl.int32)
        ok = ok & (tl.min(length, axis=0) >= 0)
        nblocks = tl.where(in_range, (length + BLOCK_SIZE - 1) // BLOCK_SIZE, 0)
        tl.store(block_cum_ptr + idx, tl.cumsum(nblocks, axis=0) + carry, mask=in_range)
        carry += tl.sum(nblocks, axis=0)
    tl.store(ok_ptr, ok)


def _check_offsets_on_host(offsets: torch.Tensor, num_tokens: int) -> None:
    if int(offsets[0]) != 0:
        raise ValueError(f"offsets[0] must be 0, got {int(offsets[0])}")
    if not bool((offsets[1:] >= offsets[:-1]).all()):
        raise ValueError("offsets must be non-decreasing (sequence lengths >= 0)")
    if int(offsets[-1]) != num_tokens:
        raise ValueError(f"offsets[-1] must equal the number of tokens N={num_tokens}, got {int(offsets[-1])}")


def block_table(offsets: torch.Tensor, num_tokens: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the values of ``offsets`` and build the block table, without a host synchronisation on the GPU.

    Returns ``(block_cum, block_seq)``, int32: ``block_cum[b]`` is the number of blocks in sequences ``0..b``
    (inclusive prefix sum) and ``block_seq[s]`` the sequence that grid slot ``s`` belongs to (``B`` for the padding
    slots past the last block). Slot ``s`` of sequence ``b`` is its block number ``s - (block_cum[b] - nblocks[b])``.

    Checks: ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == N``. On the CPU a ``ValueError`` says what is
    wrong. On a GPU reading the values would stall the host, so the check is a device-side assertion instead: it
    fails the next synchronising call with "device-side assert triggered". The kernels clamp every block to
    ``[0, N)`` meanwhile, so bad offsets never cause an out-of-bounds access.
    """
    num_seqs = offsets.numel() - 1
    if offsets.device.type == "cpu":
        _check_offsets_on_host(offsets, num_tokens)
        lengths = offsets[1:] - offsets[:-1]
        nblocks = torch.div(lengths + (block_size - 1), block_size, rounding_mode="floor")
        block_cum = torch.cumsum(nblocks, 0, dtype=torch.int32)
    else:
        block_cum = torch.empty(num_seqs, dtype=torch.int32, device=offsets.device)
        ok = torch.empty((), dtype=torch.bool, device=offsets.device)
        _block_scan_kernel[(1,)](offsets, block_cum, ok, num_seqs, num_tokens, BLOCK_SIZE=block_size, CHUNK=1024)
        torch._assert_async(ok, "blockattn: offsets must start at 0, be non-decreasing and end at N")
    slots = torch.arange(max_blocks(num_tokens, num_seqs, block_size), device=offsets.device, dtype=torch.int32)
    block_seq = torch.searchsorted(block_cum, slots, right=True, out_int32=True)
    return block_cum, block_seq


def block_rows(
    offsets: torch.Tensor, block_cum: torch.Tensor, block_seq: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of every block slot, ``[max_blocks, block_size]``, and which of them are real.

    The PyTorch (CPU) path gathers blocks with these; the Triton kernels compute the same thing per program.
    """
    num_seqs = offsets.numel() - 1
    seq = block_seq.long().clamp(max=max(num_seqs - 1, 0))
    seq_start, seq_end = offsets[:-1].long()[seq], offsets[1:].long()[seq]
    nblocks = torch.div(seq_end - seq_start + (block_size - 1), block_size, rounding_mode="floor")
    first_slot = block_cum.long()[seq] - nblocks
    slots = torch.arange(block_seq.numel(), device=offsets.device)
    start = seq_start + (slots - first_slot) * block_size
    end = torch.minimum(start + block_size, seq_end)
    rows = start[:, None] + torch.arange(block_size, device=offsets.device)
    valid = (rows < end[:, None]) & (block_seq < num_seqs).unsqueeze(1)
    return rows, valid


def _name(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


def validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    block_size: int,
    scale: float | None,
) -> None:
    """Check shapes, dtypes, devices and options; raise ``TypeError``/``ValueError`` naming the argument.

    Only metadata is read here, so this is free and safe under ``torch.compile``. The *values* of ``offsets`` are
    checked by :func:`block_table` inside the op.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("offsets", offsets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [N, heads, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in GPU_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"offsets must be 1-D [B + 1] with at least one element, got shape {tuple(offsets.shape)}")
    if offsets.dtype not in OFFSET_DTYPES:
        raise TypeError(f"offsets must be int32 or int64, got {offsets.dtype}")
    devices = {t.device for t in (q, k, v, offsets)}
    if len(devices) != 1:
        raise ValueError(
            f"q, k, v and offsets must be on one device, got q {q.device}, k {k.device}, v {v.device}, "
            f"offsets {offsets.device}"
        )
    n, hq, d = q.shape
    if offsets.numel() == 1 and n != 0:
        # Decidable from shapes alone, and the kernels need at least one sequence to look blocks up in.
        raise ValueError(f"offsets describes no sequence (B = 0) but q has N = {n} tokens; expected offsets[-1] == N")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {_name(k)} and v {_name(v)}")
    if k.shape[0] != n:
        raise ValueError(f"q, k and v must have the same number of tokens N, got q {n} and k/v {k.shape[0]}")
    if k.shape[2] != d:
        raise ValueError(f"q, k and v must have the same head_dim, got q {d} and k/v {k.shape[2]}")
    hkv = k.shape[1]
    if hkv == 0 or hq == 0 or hq % hkv != 0:
        raise ValueError(f"q heads must be a positive multiple of k/v heads (GQA), got Hq={hq}, Hkv={hkv}")
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM or d % 8 != 0:
        raise ValueError(f"head_dim must be a multiple of 8 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {d}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {block_size!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0):
        raise ValueError(f"scale must be a positive float or None, got {scale!r}")


def validate_sinu_pos(sinu_pos: torch.Tensor, x: torch.Tensor, x_name: str) -> None:
    """``sinu_pos`` must be ``[N, D]`` of ``x = [N, H, D]``, floating, on ``x``'s device, and need no gradient."""
    if not isinstance(sinu_pos, torch.Tensor):
        raise TypeError(f"sinu_pos must be a torch.Tensor or None, got {type(sinu_pos).__name__}")
    n, _, d = x.shape
    if sinu_pos.shape != (n, d):
        raise ValueError(f"sinu_pos must be [N, head_dim] = [{n}, {d}] ([sin | cos] per token), got "
                         f"{tuple(sinu_pos.shape)}")
    if sinu_pos.dtype not in GPU_DTYPES:
        raise TypeError(f"sinu_pos must be float16, bfloat16 or float32, got {sinu_pos.dtype}")
    if sinu_pos.device != x.device:
        raise ValueError(f"sinu_pos must be on the device of {x_name} ({x.device}), got {sinu_pos.device}")
    if sinu_pos.requires_grad:
        raise ValueError("sinu_pos requires grad, but no gradient flows to the rotary angles: pass "
                         "sinu_pos.detach()")


def rotate_mask(rotate) -> int:
    """``rotate`` (a tuple of names from ``ROTATE_BITS``) as the kernels' bit mask."""
    if isinstance(rotate, str) or not isinstance(rotate, (tuple, list, set, frozenset)):
        raise TypeError(f"rotate must be a tuple of names from {tuple(ROTATE_BITS)}, e.g. ('q', 'k'), got {rotate!r}")
    unknown = [name for name in rotate if name not in ROTATE_BITS]
    if unknown:
        raise ValueError(f"rotate names the operands to rotate, from {tuple(ROTATE_BITS)}; got unknown {unknown}")
    mask = 0
    for name in rotate:
        mask |= ROTATE_BITS[name]
    return mask
