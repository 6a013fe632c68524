"""Rotary position embedding with interleaved pairs (docs/semantics.md, "Rotary"): the tile helpers the attention
kernels fuse, a standalone kernel for ``apply_rotary``, and its launcher.

``sinu_pos`` is ``[N, D]``: columns ``0 : D/2`` hold the sines and ``D/2 : D`` the cosines of the pair angles, so
pair ``i`` (columns ``2i, 2i+1``) turns by angle ``i``. The inverse rotation (the backward) negates the sines.

Each pair is read and written as one machine word (32 bits for 16-bit dtypes, 64 for fp32; fp8 pairs are read as
16-bit words, written as bytes) and split in registers into an "even" and an "odd" ``[rows, D/2]`` tile: both come
out in the layout of the ``[rows, D/2]`` sine and cosine tiles, so the rotation is elementwise, and loads and
stores stay 16-byte vectors. Kernels then work on the two halves (two half-width products instead of one). A bf16
half becomes fp32 with one shift or mask, and on NVIDIA GPUs one ``cvt`` rounds two fp32 results and packs them
into a word. This needs ``stride_d == 1`` and word-aligned rows (:func:`pair_aligned`). All arithmetic is fp32;
results are stored once, in the output's dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import tiles
from .launch import launch
from .tiles import load_or_zero, tile_mask, tile_ptrs


@triton.jit
def pair_ptrs(base, rows, pair0, stride_n, WORD: tl.constexpr, PAIRS: tl.constexpr):
    """``WORD`` pointers to pairs ``pair0 : pair0 + PAIRS`` of ``rows`` (columns ``2 * pair0 ...``)."""
    row_starts = (base + rows * stride_n).to(tl.pointer_type(WORD))
    return row_starts[:, None] + (pair0 + tl.arange(0, PAIRS))[None, :]


@triton.jit
def load_words(base, rows, pair0, stride_n, mask, PAIRS: tl.constexpr):
    """Pairs ``pair0 : pair0 + PAIRS`` of ``rows`` as ``[rows, PAIRS]`` words: uint16 for fp8, uint32 for 16-bit
    dtypes, uint64 for fp32. The lower address (the even column) is the low half (little-endian)."""
    if base.dtype.element_ty.primitive_bitwidth == 8:
        words = load_or_zero(pair_ptrs(base, rows, pair0, stride_n, tl.uint16, PAIRS), mask)
    elif base.dtype.element_ty.primitive_bitwidth == 16:
        words = load_or_zero(pair_ptrs(base, rows, pair0, stride_n, tl.uint32, PAIRS), mask)
    else:
        words = load_or_zero(pair_ptrs(base, rows, pair0, stride_n, tl.uint64, PAIRS), mask)
    return words


@triton.jit
def split_words(words, ELEM: tl.constexpr):
    """``(even, odd)`` halves of pair words, in the pairs' dtype ``ELEM`` (no arithmetic)."""
    if ELEM.primitive_bitwidth == 8:
        even = words.to(tl.uint8).to(ELEM, bitcast=True)
        odd = (words >> 8).to(tl.uint8).to(ELEM, bitcast=True)
    elif ELEM.primitive_bitwidth == 16:
        even = words.to(tl.uint16).to(ELEM, bitcast=True)
        odd = (words >> 16).to(tl.uint16).to(ELEM, bitcast=True)
    else:
        even = words.to(tl.uint32).to(ELEM, bitcast=True)
        odd = (words >> 32).to(tl.uint32).to(ELEM, bitcast=True)
    return even, odd


@triton.jit
def unpack_words(words, ELEM: tl.constexpr):
    """``(even, odd)`` halves of pair words in fp32. A bf16 is the top half of an fp32: one shift or mask each."""
    if ELEM.is_bf16():
        even = (words << 16).to(tl.float32, bitcast=True)
        odd = (words & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        even, odd = split_words(words, ELEM)
        even = even.to(tl.float32)
        odd = odd.to(tl.float32)
    return even, odd


@triton.jit
def pack_words(even, odd, ELEM: tl.constexpr, INLINE_ASM: tl.constexpr):
    """Pair words of ``(even, odd)`` (any float dtype) rounded to ``ELEM``. With ``INLINE_ASM`` (NVIDIA GPUs) one
    ``cvt`` rounds and packs two fp32 at once."""
    if ELEM.primitive_bitwidth == 16:
        if INLINE_ASM:
            if ELEM.is_bf16():
                words = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f",
                                                  [even.to(tl.float32), odd.to(tl.float32)], dtype=tl.uint32,
                                                  is_pure=True, pack=1)
            else:
                words = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f",
                                                  [even.to(tl.float32), odd.to(tl.float32)], dtype=tl.uint32,
                                                  is_pure=True, pack=1)
        else:
            low = even.to(ELEM).to(tl.uint16, bitcast=True).to(tl.uint32)
            high = odd.to(ELEM).to(tl.uint16, bitcast=True).to(tl.uint32)
            words = low | (high << 16)
    else:
        low = even.to(ELEM).to(tl.uint32, bitcast=True).to(tl.uint64)
        high = odd.to(ELEM).to(tl.uint32, bitcast=True).to(tl.uint64)
        words = low | (high << 32)
    return words


@triton.jit
def fence(x, INLINE_ASM: tl.constexpr):
    """``x`` unchanged, through an opaque instruction (removed by ptxas). Triton moves a tile's conversion to the
    tensor-core operand layout up through elementwise math to its load; a rotated operand would then be rotated in
    that layout, with ``sin``/``cos`` converted to it through shared memory, and every such conversion waits for its
    load before the next load is issued (H100, `ads-rotary`: the forward at 1.22x its floor unfenced, 0.99x fenced;
    docs/benchmarks.md)."""
    if INLINE_ASM:
        if x.dtype.primitive_bitwidth == 16:
            x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)
        else:
            bits = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x.to(tl.uint32, bitcast=True)],
                                             dtype=tl.uint32, is_pure=False, pack=1)
            x = bits.to(x.dtype, bitcast=True)
    return x


@triton.jit
def store_pairs(base, rows, pair0, stride_n, even, odd, mask, PAIRS: tl.constexpr, INLINE_ASM: tl.constexpr):
    """Store ``even``/``odd`` ``[rows, PAIRS]`` tiles (any float dtype) into the interleaved columns of ``base``."""
    elem_ty: tl.constexpr = base.dtype.element_ty
    if elem_ty.primitive_bitwidth == 8:
        # fp8 (outputs only): interleaved in registers and stored as bytes. Packed into 16-bit words by shifts
        # instead, two columns of every row came out wrong on an H100 (triton 3.6).
        width: tl.constexpr = 2 * PAIRS
        tile = tl.join(even.to(elem_ty), odd.to(elem_ty)).reshape(even.shape[0], width)
        tl.store(tile_ptrs(base, rows, 2 * pair0, stride_n, 1, width), tile,
                 mask=tl.join(mask, mask).reshape(even.shape[0], width))
    else:
        words = pack_words(even, odd, elem_ty, INLINE_ASM)
        if elem_ty.primitive_bitwidth == 16:
            tl.store(pair_ptrs(base, rows, pair0, stride_n, tl.uint32, PAIRS), words, mask=mask)
        else:
            tl.store(pair_ptrs(base, rows, pair0, stride_n, tl.uint64, PAIRS), words, mask=mask)


@triton.jit
def store_pairs_wide(base, rows, pair0, stride_n, even, odd, mask, PAIRS: tl.constexpr):
    """:func:`store_pairs` for NVIDIA GPUs, from the layout the tiles are in (a product's accumulator layout): each
    store is one inline-PTX ``st.global.v2`` of two adjacent pair words. ``tl.store`` would first move the words to a
    coalesced layout through shared memory, a barrier per store (the rotary backward measured 1.22x its floor that
    way on `ads-rotary`, H100, against 1.21x with these stores and 1.18x with unpredicated loads on top,
    docs/benchmarks.md). The two words of a store come from a reshape and split, so they are adjacent in any
    layout. Needs :func:`wide_stores_ok` and ``mask`` constant over each pair of pairs."""
    elem_ty: tl.constexpr = base.dtype.element_ty
    words = pack_words(even, odd, elem_ty, True)
    low, high = tl.split(tl.reshape(words, (words.shape[0], PAIRS // 2, 2)))
    ok, _ = tl.split(tl.reshape(mask.to(tl.int32), (words.shape[0], PAIRS // 2, 2)))
    if elem_ty.primitive_bitwidth == 16:
        ptrs = pair_ptrs(base, rows, pair0 // 2, stride_n, tl.uint64, PAIRS // 2)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $4, 0; @p st.global.v2.b32 [$1], {$2, $3}; mov.u32 $0, 0; }",
            "=r,l,r,r,r", [ptrs, low, high, ok], dtype=tl.int32, is_pure=False, pack=1)
    else:
        row_starts = (base + rows * stride_n).to(tl.pointer_type(tl.uint64))
        ptrs = row_starts[:, None] + (pair0 + 2 * tl.arange(0, PAIRS // 2))[None, :]
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $4, 0; @p st.global.v2.b64 [$1], {$2, $3}; mov.u32 $0, 0; }",
            "=r,l,l,l,r", [ptrs, low, high, ok], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def load_angles(sinu_ptr, rows, pair0, half_dim, stride_sn, stride_sd, mask, PAIRS: tl.constexpr):
    """fp32 ``(sin, cos)``, each ``[rows, PAIRS]``, of pairs ``pair0 : pair0 + PAIRS``."""
    ptrs = tile_ptrs(sinu_ptr, rows, pair0, stride_sn, stride_sd, PAIRS)
    sin = load_or_zero(ptrs, mask).to(tl.float32)
    cos = load_or_zero(ptrs + half_dim * stride_sd, mask).to(tl.float32)
    return sin, cos


@triton.jit
def turn_pairs(even, odd, sin, cos, INVERSE: tl.constexpr):
    """Turn each pair ``(even, odd)`` by its angle (by the opposite angle if ``INVERSE``); fp32 results."""
    even = even.to(tl.float32)
    odd = odd.to(tl.float32)
    if INVERSE:
        sin = -sin
    return even * cos - odd * sin, odd * cos + even * sin


@triton.jit
def _rotary_kernel(
    x_ptr, sinu_ptr, y_ptr,
    num_tokens, num_heads, head_dim,
    stride_xn, stride_xh, stride_yn, stride_yh, stride_sn, stride_sd,
    BLOCK_ROWS: tl.constexpr, PAIRS: tl.constexpr, EVEN_D: tl.constexpr, INVERSE: tl.constexpr,
    INLINE_ASM: tl.constexpr,
):
    # One program per BLOCK_ROWS tokens, all heads: the angles are read once and reused by every head.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    half = head_dim // 2
    mask = tile_mask(rows < num_tokens, 0, half, PAIRS, EVEN_D)
    sin, cos = load_angles(sinu_ptr, rows, 0, half, stride_sn, stride_sd, mask, PAIRS)
    for head in range(num_heads):
        words = load_words(x_ptr + head * stride_xh, rows, 0, stride_xn, mask, PAIRS)
        even, odd = unpack_words(words, x_ptr.dtype.element_ty)
        even, odd = turn_pairs(even, odd, sin, cos, INVERSE)
        store_pairs(y_ptr + head * stride_yh, rows, 0, stride_yn, even, odd, mask, PAIRS, INLINE_ASM)


def inline_asm(x: torch.Tensor) -> bool:
    """Whether kernels on ``x`` may use PTX inline assembly: NVIDIA GPUs, not Triton's interpreter."""
    return x.is_cuda and torch.version.hip is None and os.environ.get("TRITON_INTERPRET", "0") != "1"


def pairs_readable(x: torch.Tensor) -> bool:
    """Whether ``x``'s pairs can be read as words: ``stride_d == 1``, even strides, a word-aligned start."""
    return (x.stride(-1) == 1 and all(s % 2 == 0 for s in x.stride()[:-1])
            and x.data_ptr() % (2 * x.element_size()) == 0)


def wide_stores_ok(x: torch.Tensor) -> bool:
    """Whether :func:`store_pairs_wide` may write ``x``: NVIDIA GPUs, pairs of pairs aligned (every stride and the
    start a multiple of four elements, so each two-word store is aligned), ``D`` a multiple of 4."""
    return (inline_asm(x) and x.stride(-1) == 1 and x.shape[-1] % 4 == 0
            and all(s % 4 == 0 for s in x.stride()[:-1]) and x.data_ptr() % (4 * x.element_size()) == 0)


def pair_aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` if :func:`pairs_readable`, else a contiguous copy."""
    return x if pairs_readable(x) else x.contiguous()


def rotary_triton(x: torch.Tensor, sinu_pos: torch.Tensor, inverse: bool,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, H, D]`` rotated by ``sinu_pos`` (or by the opposite angles), in ``x``'s dtype; written into ``out``
    (``x``'s shape and dtype) when given, through a copy where its pairs cannot be written as words."""
    if out is not None and not pairs_readable(out):
        return out.copy_(rotary_triton(x, sinu_pos, inverse))
    n, h, d = x.shape
    x = pair_aligned(x)
    y = tiles.new_output(x) if out is None else out
    if y.numel() == 0:
        return y
    pairs = triton.next_power_of_2(d // 2)
    block_rows = max(1, 2048 // pairs)
    launch(
        _rotary_kernel, (triton.cdiv(n, block_rows),),
        x_ptr=x, sinu_ptr=sinu_pos, y_ptr=y, num_tokens=n, num_heads=h, head_dim=d,
        stride_xn=x.stride(0), stride_xh=x.stride(1), stride_yn=y.stride(0), stride_yh=y.stride(1),
        stride_sn=sinu_pos.stride(0), stride_sd=sinu_pos.stride(1),
        BLOCK_ROWS=block_rows, PAIRS=pairs, EVEN_D=2 * pairs == d, INVERSE=inverse, INLINE_ASM=inline_asm(x),
        num_warps=4,
    )
    return y
