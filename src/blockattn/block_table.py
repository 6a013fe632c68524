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
from .ops.tiles import assert_offsets, sequence_blocks


class BlockTable(NamedTuple):
    """``block_cum[b]``: blocks in sequences ``0..b`` (inclusive prefix sum), int32 ``[B]``. ``block_seq[s]``: the
    sequence that grid slot ``s`` belongs to, int32 ``[max_blocks]`` (``B`` for the padding slots past the last
    block). Slot ``s`` of sequence ``b`` is its block number ``s - (block_cum[b] - nblocks[b])``."""

    block_cum: torch.Tensor
    block_seq: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.block_seq.numel()

    def kernel_args(self, offsets: torch.Tensor) -> dict:
        """What a kernel takes to find its grid slot's block (``ops.tiles.block_bounds``)."""
        return {"block_seq_ptr": self.block_seq, "block_cum_ptr": self.block_cum, "offsets_ptr": offsets,
                "num_seqs": offsets.numel() - 1}


# Grid slots come in whole groups of this many: the kernels that run 4 blocks a program (``ops.tiles.
# blocks_per_tile``) read the slots of a group without a bound.
SLOT_GROUP = 4


def max_blocks(num_tokens: int, num_seqs: int, block_size: int) -> int:
    """Upper bound on the number of blocks, ``sum ceil(len_b / BS) <= (N + B * (BS - 1)) // BS``, rounded up to a
    multiple of :data:`SLOT_GROUP` (the rest are padding slots)."""
    bound = (num_tokens + num_seqs * (block_size - 1)) // block_size
    return -(-bound // SLOT_GROUP) * SLOT_GROUP


class OffsetsOnly(NamedTuple):
    """No block table: what a call passes, in place of a :class:`BlockTable`, to a kernel that finds each grid slot's
    block in the offsets itself (``backends.Backend.finds_blocks``: on batches of few sequences, where building a
    table took a launch and two allocations of host time, more than the kernel's search costs it). A forward's
    kernel also asserts that they are valid (``ops.tiles.assert_offsets``); a backward runs without a table only
    where its forward did, which checked the same offsets. ``num_slots``: the grid's slots, :func:`max_blocks`."""

    num_slots: int

    def kernel_args(self, offsets: torch.Tensor) -> dict:
        """:meth:`BlockTable.kernel_args` without a table (``ops.tiles.block_bounds`` then searches the offsets)."""
        return {"block_seq_ptr": None, "block_cum_ptr": None, "offsets_ptr": offsets, "num_seqs": offsets.numel() - 1}


@triton.jit
def _block_table_kernel(offsets_ptr, block_cum_ptr, block_seq_ptr, ok_ptr, num_seqs, num_tokens, max_len, num_slots,
                        BLOCK_SIZE: tl.constexpr, SEQS: tl.constexpr, CHUNK: tl.constexpr, SLOTS: tl.constexpr,
                        FILL: tl.constexpr):
    """The whole block table in one launch. Program ``p`` takes sequences ``p * SEQS ...``: it counts the blocks of
    the sequences before them (``CHUNK`` at a time), writes their ``block_cum`` and (``FILL``) the grid slots of their
    blocks, which follow one another, ``SLOTS`` at a time; the program of the last sequence also writes the padding
    slots up to ``num_slots``. Program 0 checks the offsets (``offsets[0] == 0``, non-decreasing, ``offsets[-1] ==
    N``, no length above ``max_len``): a device-side assertion where the kernel is compiled with ``debug`` (always
    on a GPU: :func:`kernel_table`), and the verdict written to ``ok_ptr`` where one is given (Triton's interpreter
    asserts nothing). Every slot below ``num_slots`` gets a sequence in ``[0, B]``, valid offsets or not."""
    pid = tl.program_id(0)
    first = pid * SEQS
    before = tl.zeros((), dtype=tl.int32)
    for chunk in range(0, first, CHUNK):
        before += tl.sum(sequence_blocks(offsets_ptr, chunk + tl.arange(0, CHUNK), first, BLOCK_SIZE)[1], axis=0)
    idx = first + tl.arange(0, SEQS)
    nblocks = sequence_blocks(offsets_ptr, idx, num_seqs, BLOCK_SIZE)[1]
    cum = tl.cumsum(nblocks, axis=0) + before
    tl.store(block_cum_ptr + idx, cum, mask=idx < num_seqs)
    if FILL:
        end = before + tl.sum(nblocks, axis=0)
        for slot0 in range(before, end, SLOTS):
            slot = slot0 + tl.arange(0, SLOTS)
            # The slot's sequence: the first whose inclusive block count passes it.
            seq = first + tl.sum((cum[None, :] <= slot[:, None]).to(tl.int32), axis=1)
            tl.store(block_seq_ptr + slot, seq, mask=(slot < end) & (slot < num_slots))
        if first + SEQS >= num_seqs:
            for slot0 in range(end, num_slots, SLOTS):
                slot = slot0 + tl.arange(0, SLOTS)
                tl.store(block_seq_ptr + slot, num_seqs, mask=slot < num_slots)
    if pid == 0:
        ok = assert_offsets(offsets_ptr, num_seqs, num_tokens, max_len, CHUNK)
        if ok_ptr is not None:
            tl.store(ok_ptr, ok)


# Sequences per program of the table kernel: each program fills its sequences' slots in turn, so few sequences per
# program keep long ones (the `long` preset's 64 blocks a sequence) from serialising; 72-256 programs at the presets.
_TABLE_SEQS = 16


def kernel_table(offsets: torch.Tensor, num_tokens: int, block_size: int, max_len: int | None = None,
                 fill: bool = True, verdict: bool = False) -> tuple[BlockTable, torch.Tensor | None]:
    """``(table, ok)`` by the one-launch table kernel, which asserts on the device that the offsets are valid (one
    launch, where ``torch._assert_async`` of a verdict took a second launch and an allocation). ``verdict``: also
    ``ok``, a bool scalar saying whether they are (else None), for Triton's interpreter, whose kernels assert
    nothing. Without ``fill`` only ``block_cum`` is written (``block_seq`` is empty): the check of cumulative
    lengths that need no table."""
    num_seqs = offsets.numel() - 1
    num_slots = max_blocks(num_tokens, num_seqs, block_size) if fill else 0
    block_cum = torch.empty(num_seqs, dtype=torch.int32, device=offsets.device)
    block_seq = torch.empty(num_slots, dtype=torch.int32, device=offsets.device)
    ok = torch.empty((), dtype=torch.bool, device=offsets.device) if verdict else None
    # ``debug`` compiles the assertion in; without ``sanitize_overflow`` (which ``debug`` turns on) every int32 sum
    # would be checked too.
    launch(_block_table_kernel, (max(1, triton.cdiv(num_seqs, _TABLE_SEQS)),), offsets_ptr=offsets,
           block_cum_ptr=block_cum, block_seq_ptr=block_seq, ok_ptr=ok, num_seqs=num_seqs, num_tokens=num_tokens,
           max_len=num_tokens if max_len is None else max_len, num_slots=num_slots, BLOCK_SIZE=block_size,
           SEQS=_TABLE_SEQS, CHUNK=1024, SLOTS=256, FILL=fill, debug=True, sanitize_overflow=False)
    return BlockTable(block_cum, block_seq), ok


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


def _checked_table(offsets: torch.Tensor, num_tokens: int, block_size: int, max_len: int | None, name: str,
                   fill: bool) -> BlockTable:
    """The table of ``offsets`` (``block_seq`` empty without ``fill``), whose values are checked (see
    :func:`build_block_table`)."""
    if kernels_run_on(offsets.device):
        return kernel_table(offsets, num_tokens, block_size, max_len, fill)[0]
    lengths = offsets[1:] - offsets[:-1]
    if offsets.device.type == "cpu":
        _check_offsets_on_host(offsets, num_tokens, max_len, name)
    else:
        ok = (offsets[0] == 0) & (offsets[-1] == num_tokens) & (lengths >= 0).all()
        if max_len is not None:
            ok = ok & (lengths <= max_len).all()
        torch._assert_async(ok, f"blockattn: {name} must start at 0, be non-decreasing and end at N"
                            + ("" if max_len is None else f", with no sequence above the max_seqlen hint {max_len}"))
    block_cum = torch.cumsum(_blocks_per_seq(lengths, block_size), 0, dtype=torch.int32)
    if not fill:
        return BlockTable(block_cum, block_cum.new_empty(0))
    slots = torch.arange(max_blocks(num_tokens, offsets.numel() - 1, block_size), device=offsets.device,
                         dtype=torch.int32)
    return BlockTable(block_cum, torch.searchsorted(block_cum, slots, right=True, out_int32=True))


def check_offsets(offsets: torch.Tensor, num_tokens: int, max_len: int | None = None, name: str = "offsets") -> None:
    """The checks of :func:`build_block_table` alone, for cumulative lengths that need no table."""
    _checked_table(offsets, num_tokens, 1, max_len, name, fill=False)


def build_block_table(offsets: torch.Tensor, num_tokens: int, block_size: int, max_len: int | None = None,
                      name: str = "offsets") -> BlockTable:
    """Check the values of ``offsets`` and build the block table, without a host synchronisation on a GPU.

    Checks: ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == N``. On the CPU a ``ValueError`` says what is
    wrong. On a GPU reading the values would stall the host, so the check is a device-side assertion instead: it
    fails the next synchronising call with "device-side assert triggered". The kernels clamp every block to
    ``[0, N)`` meanwhile, so bad offsets never cause an out-of-bounds access. On a GPU that runs the Triton kernels
    one launch builds the table and asserts (one message for every name there); on other GPUs PyTorch ops do.
    ``max_len``, when given, bounds every sequence's length too; ``name`` is the argument the messages name.
    """
    return _checked_table(offsets, num_tokens, block_size, max_len, name, fill=True)


class BlockLayout(NamedTuple):
    """The block structure of one batch, built once (:func:`blockattn.block_layout`) and passed in place of
    ``offsets`` to every attention call on that batch, as FlexAttention's ``BlockMask`` is: the calls then skip
    building the block table (the offsets' checks and a launch each). With ``timestamps``, also the batch's
    time buckets (``num_time_buckets`` of ``time_bucket_width``): ``time_buckets``, their table where the kernels
    run (``ops.in_block.bucket_table``; None elsewhere), which every call's time bias then reads instead of building
    its own."""

    offsets: torch.Tensor
    num_tokens: int
    block_size: int
    table: BlockTable
    timestamps: torch.Tensor | None = None
    num_time_buckets: int | None = None
    time_bucket_width: float | None = None
    time_buckets: torch.Tensor | None = None


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
