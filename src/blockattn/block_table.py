"""The block table: where each block of a jagged batch lies, built once per call and passed as one object.

A sequence ``b`` owns rows ``offsets[b]:offsets[b+1]`` and is cut into blocks of ``block_size`` tokens starting at
its first token (docs/semantics.md, "Block attention"). The number of blocks is data-dependent, so the kernels are
launched over a static upper bound (:func:`max_blocks`) and each program looks up its block on the device: no host
synchronisation.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .devices import kernels_run_on
from .ops.launch import launch


class BlockTable(NamedTuple):
    """``block_cum[b]``: blocks in sequences ``0..b`` (inclusive prefix sum), int32 ``[B]``. ``block_seq[s]``: the
    sequence that grid slot ``s`` belongs to, int32 ``[max_blocks]`` (``B`` for the padding slots past the last
    block). Slot ``s`` of sequence ``b`` is its block number ``s - (block_cum[b] - nblocks[b])``."""

    block_cum: torch.Tensor
    block_seq: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.block_seq.numel()


def max_blocks(num_tokens: int, num_seqs: int, block_size: int) -> int:
    """Upper bound on the number of blocks: ``sum ceil(len_b / BS) <= (N + B * (BS - 1)) // BS``."""
    return (num_tokens + num_seqs * (block_size - 1)) // block_size


@triton.jit
def _block_scan_kernel(offsets_ptr, block_cum_ptr, ok_ptr, num_seqs, num_tokens, max_len,
                       BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr):
    """One program: ``block_cum`` = inclusive prefix sum of ``ceil(len_b / BS)``, and whether the offsets are valid
    (``offsets[0] == 0``, non-decreasing, ``offsets[-1] == N``, no length above ``max_len``): one launch instead of
    a dozen small ones."""
    ok = (tl.load(offsets_ptr) == 0) & (tl.load(offsets_ptr + num_seqs) == num_tokens)
    carry = tl.zeros((), dtype=tl.int32)
    for first in range(0, num_seqs, CHUNK):
        idx = first + tl.arange(0, CHUNK)
        in_range = idx < num_seqs
        length = (tl.load(offsets_ptr + idx + 1, mask=in_range, other=0)
                  - tl.load(offsets_ptr + idx, mask=in_range, other=0)).to(tl.int32)
        ok = ok & (tl.min(length, axis=0) >= 0) & (tl.max(length, axis=0) <= max_len)
        nblocks = tl.where(in_range, (length + BLOCK_SIZE - 1) // BLOCK_SIZE, 0)
        tl.store(block_cum_ptr + idx, tl.cumsum(nblocks, axis=0) + carry, mask=in_range)
        carry += tl.sum(nblocks, axis=0)
    tl.store(ok_ptr, ok)


def scan_blocks(offsets: torch.Tensor, num_tokens: int, block_size: int,
                max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block_cum, ok)`` by the one-launch scan kernel; ``ok`` (a bool scalar) says whether the offsets are valid."""
    num_seqs = offsets.numel() - 1
    block_cum = torch.empty(num_seqs, dtype=torch.int32, device=offsets.device)
    ok = torch.empty((), dtype=torch.bool, device=offsets.device)
    launch(_block_scan_kernel, (1,), offsets_ptr=offsets, block_cum_ptr=block_cum, ok_ptr=ok, num_seqs=num_seqs,
           num_tokens=num_tokens, max_len=num_tokens if max_len is None else max_len, BLOCK_SIZE=block_size,
           CHUNK=1024)
    return block_cum, ok


def _check_offsets_on_host(offsets: torch.Tensor, num_tokens: int, max_len: int | None, name: str) -> None:
    if int(offsets[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(offsets[0])}")
    lengths = offsets[1:] - offsets[:-1]
    if not bool((lengths >= 0).all()):
        raise ValueError(f"{name} must be non-decreasing (sequence lengths >= 0)")
    if int(offsets[-1]) != num_tokens:
        raise ValueError(f"{name}[-1] must equal the number of tokens N={num_tokens}, got {int(offsets[-1])}")
    if max_len is not None and lengths.numel() and int(lengths.max()) > max_len:
        raise ValueError(f"a sequence of {name} has {int(lengths.max())} tokens, more than the max_seqlen hint "
                         f"{max_len}")


def _blocks_per_seq(lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    return torch.div(lengths + (block_size - 1), block_size, rounding_mode="floor")


def _checked_block_cum(offsets: torch.Tensor, num_tokens: int, block_size: int, max_len: int | None,
                       name: str) -> torch.Tensor:
    """``block_cum`` of ``offsets``, whose values are checked (see :func:`build_block_table`)."""
    if offsets.device.type == "cpu":
        _check_offsets_on_host(offsets, num_tokens, max_len, name)
        return torch.cumsum(_blocks_per_seq(offsets[1:] - offsets[:-1], block_size), 0, dtype=torch.int32)
    if kernels_run_on(offsets.device):
        block_cum, ok = scan_blocks(offsets, num_tokens, block_size, max_len)
    else:
        lengths = offsets[1:] - offsets[:-1]
        block_cum = torch.cumsum(_blocks_per_seq(lengths, block_size), 0, dtype=torch.int32)
        ok = (offsets[0] == 0) & (offsets[-1] == num_tokens) & (lengths >= 0).all()
        if max_len is not None:
            ok = ok & (lengths <= max_len).all()
    torch._assert_async(ok, f"blockattn: {name} must start at 0, be non-decreasing and end at N"
                        + ("" if max_len is None else f", with no sequence above the max_seqlen hint {max_len}"))
    return block_cum


def check_offsets(offsets: torch.Tensor, num_tokens: int, max_len: int | None = None, name: str = "offsets") -> None:
    """The checks of :func:`build_block_table` alone, for cumulative lengths that need no table."""
    _checked_block_cum(offsets, num_tokens, 1, max_len, name)


def build_block_table(offsets: torch.Tensor, num_tokens: int, block_size: int, max_len: int | None = None,
                      name: str = "offsets") -> BlockTable:
    """Check the values of ``offsets`` and build the block table, without a host synchronisation on a GPU.

    Checks: ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == N``. On the CPU a ``ValueError`` says what is
    wrong. On a GPU reading the values would stall the host, so the check is a device-side assertion instead: it
    fails the next synchronising call with "device-side assert triggered". The kernels clamp every block to
    ``[0, N)`` meanwhile, so bad offsets never cause an out-of-bounds access. On a GPU that runs the Triton kernels
    one launch builds the prefix sum and the check; on other GPUs PyTorch ops do. ``max_len``, when given, bounds
    every sequence's length too; ``name`` is the argument the messages name.
    """
    num_seqs = offsets.numel() - 1
    block_cum = _checked_block_cum(offsets, num_tokens, block_size, max_len, name)
    slots = torch.arange(max_blocks(num_tokens, num_seqs, block_size), device=offsets.device, dtype=torch.int32)
    return BlockTable(block_cum, torch.searchsorted(block_cum, slots, right=True, out_int32=True))


class BlockLayout(NamedTuple):
    """The block structure of one batch, built once (:func:`blockattn.block_layout`) and passed in place of
    ``offsets`` to every attention call on that batch, as FlexAttention's ``BlockMask`` is: the calls then skip
    building the block table (the offsets' checks and two launches each)."""

    offsets: torch.Tensor
    num_tokens: int
    block_size: int
    table: BlockTable


def empty_block_table(offsets: torch.Tensor, num_tokens: int, block_size: int) -> BlockTable:
    """A table of the right shapes and no values: what the fake (meta) implementations return."""
    num_seqs = offsets.shape[0] - 1
    return BlockTable(offsets.new_empty(num_seqs, dtype=torch.int32),
                      offsets.new_empty(max_blocks(num_tokens, num_seqs, block_size), dtype=torch.int32))


def block_rows(offsets: torch.Tensor, table: BlockTable, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of every block slot, ``[max_blocks, block_size]``, and which of them are real.

    The PyTorch path and the bench's baselines gather blocks with these; the Triton kernels compute the same thing
    per program.
    """
    num_seqs = offsets.numel() - 1
    seq = table.block_seq.long().clamp(max=max(num_seqs - 1, 0))
    seq_start, seq_end = offsets[:-1].long()[seq], offsets[1:].long()[seq]
    first_slot = table.block_cum.long()[seq] - _blocks_per_seq(seq_end - seq_start, block_size)
    slots = torch.arange(table.num_slots, device=offsets.device)
    start = seq_start + (slots - first_slot) * block_size
    end = torch.minimum(start + block_size, seq_end)
    rows = start[:, None] + torch.arange(block_size, device=offsets.device)
    valid = (rows < end[:, None]) & (table.block_seq < num_seqs).unsqueeze(1)
    return rows, valid
