"""Block-diagonal attention on jagged sequences: the Triton kernels and their launchers.

Each query block attends to exactly one key/value block, so one program holds a whole ``[BS, BS]`` score tile:
the softmax is exact in one pass (no online rescaling, no log-sum-exp), and the backward recomputes ``P`` from
``q`` and ``k`` and forms ``Di = rowsum(P * dP)`` in the tile (no preprocessing kernel, no ``o`` read, no atomics).

Head dims are processed in ``CHUNK``-wide column slices: scores and ``dP`` accumulate over the slices, outputs are
written slice by slice. For small tiles there is one slice (each tensor is read once); large tiles (``BS * D``
beyond what registers hold) are split so that no program needs a full ``[BS, 256]`` fp32 accumulator.

The backward has a second kernel for the production shape (64-token blocks, 64 < D <= 128, 16-bit, q and dq in one
memory layout and k, v, dk, dv in another): a persistent loop over blocks, and under GQA over each block's group of
query heads, that the compiler software-pipelines, so loads of the next step overlap the current one's math.

A fused rotary (``ROTATE``, a mask of the operands to turn) switches the forward and the one-block backward to pair
halves (``ops.rotary``): operands are rotated right after loading, gradients turned back before their one store; but
for the backward of :func:`rotates_apart`, which runs the rotary kernel apart. At 128-token blocks past D = 128 the
backward runs a GQA group's query heads apart (:func:`splits_group`), each writing its share of dk and dv.

The in-block options (``IN_BLOCK``, a mask of ``ops.in_block``'s bits: causal mask, position and time biases,
dropout) change the score tile between the products and the softmax (``ops.in_block.block_probs`` and
``block_probs_and_grads``); they run in the forward and the one-block backward (the persistent backward takes none).
With a time bias a kernel first writes the call's table of time buckets (``ops.in_block.bucket_table_kernel``).

The forward runs 16- and 32-token blocks four or two to a program, in one 64-row tile whose scores are masked to
each row's block (``BLOCKS``; ``tiles.blocks_per_tile`` says where), with the 64-token launch rule; the backward's
Triton kernels run one block a program.

On Hopper GPUs the dispatcher (``backends``) sends the backward of 64- and 128-token blocks (16-bit, with or without
GQA), plain or rotary, with or without the in-block options at 64-token blocks (under GQA not both biases
together), and of 16- and 32-token blocks in 64-row tiles, to Gluon kernels instead (``block_attention_sm90``, which
says which head dims). The PyTorch path is in ``block_attention_torch``.
"""

from __future__ import annotations

import functools
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from .. import devices
from ..block_table import BlockTable, OffsetsOnly
from . import fp8, in_block, tiles
from .in_block import InBlock, block_probs, block_probs_and_grads
from .launch import launch, launch_fitting
from .rotary import (
    fence,
    inline_asm,
    load_angles,
    load_words,
    pair_aligned,
    pairs_readable,
    rotary_triton,
    split_words,
    store_pairs,
    store_pairs_wide,
    turn_pairs,
    unpack_words,
    wide_stores_ok,
)
from .tiles import (
    LOG2E,
    OFFSETS_CHUNK,
    ROTATE_K,
    ROTATE_Q,
    ROTATE_V,
    assert_offsets,
    block_bounds,
    column_mask,
    fp8_out_factor,
    fp8_output,
    fp8_score_scale,
    grad_scores,
    in_block_rows,
    rotary_operand,
    same_block,
    softmax_probs,
    store_tile,
    tile_bounds,
    tile_mask,
    tile_ptrs,
)


def min_chunk(rotary: bool) -> int:
    # With a fused rotary the kernels work on pair halves of a slice, each at least 16 wide for the tensor cores.
    return 32 if rotary else 16


@functools.cache  # read-only: one mapping per shape, computed once (launches are host-bound on small batches)
def kernel_config(block_size: int, head_dim: int, backward: bool, group: int = 1, element_size: int = 2,
                  rotary: bool = False, persistent: bool = True, in_block_bits: int = 0, num_heads: int = 1,
                  fp32_angles: bool = False, blocks: int = 1, shared_memory: int | None = None,
                  lean: bool = False) -> MappingProxyType:
    """Compile-time shape and launch of a kernel, by a rule measured on an H100 (the 4-warp default and the MHA
    persistent kernel also on an H200; docs/benchmarks.md). ``block_size`` is a program's tile of rows, ``blocks``
    the blocks in it (16- and 32-token blocks run four or two to a 64-row tile: ``tiles.blocks_per_tile``);
    ``shared_memory`` the bytes a program may take on the GPU (``devices.shared_memory_limit``; None: no limit).

    ``lean``: where the GPU cannot run the rule's program (Triton's ``OutOfResources`` at its first launch), the
    launchers fall back to this configuration (``launch.launch_fitting``): none of what the rules below add to hold more
    in shared memory, that is one query head a program, no loop pipelined (``GROUP_STAGES`` and ``PIPELINE_STAGES`` 1:
    the backward's one-block kernel), two head-dim slices where the rotary forward under GQA at 64-token blocks past D =
    128 takes whole rows, and backward slices of at most 64 x 64 elements (the warps follow the shape: 8 for one query
    head a program at 128-token blocks, and for the rotary forward under GQA at 64-token blocks from D = 128). Under GQA
    the pipelined backward first tries two stages instead of three. On the H200's Triton path (the sweep's lengths,
    bf16, 64-token blocks, D = 128, over the floor, 2026-11-29), three stages, two, lean: 8:2 2.17x, 2.40x, 3.43x; 8:1
    2.46x, 2.69x, 3.67x; 8:8 1.19x, 1.51x, 1.30x (the one-block kernel at its rule's whole rows 1.40x). The rules'
    shared memory depends on the GPU and on Triton's version: compiled offline for sm_86 (about 99 KiB a program there,
    and on sm_89 and sm_120; 163 KiB on the A100), the pipelined backward at 64-token blocks and D = 128 takes 144-152
    KiB with triton 3.9 and 152-160 KiB with triton 3.6 (two stages 80-88 and 88-96 KiB), and triton 3.6 takes 112-160
    KiB for the one-block backward at 128-token blocks and at D = 256 (at most 96 KiB with 3.9). The lean configurations
    took at most 88 KiB there (bf16, 16- to 128-token blocks, D = 64 to 256, triton 3.6;
    ``benchmarks/shared_memory.py``).

    Head-dim slices of at most 64 x 128 elements in the forward; 64 x 64 for 16-bit inputs without GQA or a rotary at
    64-token blocks and D = 128 with two or more of the options that add work to the score tile (``in_block_bits``:
    the position bias, the time bias, dropout), whose 128-wide tiles held too many registers for 4 programs an SM.
    At `ads` on an H100 (the plain op 2.151 ms; 2026-11-25, both with the register cap of
    ``_forward_register_cap``): causal + both biases 2.479 against 2.512 ms, the time bias with dropout 2.503
    against 3.009, the position bias with dropout 2.279 against 2.845, with the causal mask 2.277 against 2.992,
    the three 2.624 against 3.024; one such option alone lost (the time bias 2.366 against 2.337, the plain op
    2.193 against 2.151). The backward takes whole rows up to 128 x 128
    elements for 16-bit inputs without GQA (128-token blocks at D = 128 and 64-token blocks at D = 256: 1.54x and
    1.36x the floor on an H100, against 2.34x and 1.50x for 64 x 64 slices), in slices of 128 x 128 beyond. Under
    GQA (16-bit) 128-token blocks, and 64-token blocks at D > 128, take slices of 64 x 128 elements: each slice's
    program recomputes the whole block's scores for every query head of the group, so wider slices redo less, until
    the group's dk and dv accumulators spill registers (4:1 on an H100, against the 64 x 64 slices before:
    128-token blocks at D = 128 3.9x the floor against 7.3x, and 5.8x for whole rows; 2:1 at D = 256 5.4x against
    12.1x, 5.9x for 128 columns; 64-token blocks at D = 256 2.8x against 3.7x). At 128-token blocks past D = 128 the
    launcher now runs the group apart (:func:`splits_group`) on the rule without GQA. Other shapes, and fp32 inputs,
    take 64 x 64 slices; at 64-token blocks with D <= 128 that is the one-block kernel of in-block options and of
    layouts the persistent kernel does not take (4:1 with a causal mask and both biases at D = 128: 12.0x the
    plain floor against 14.5x for 64 x 128).

    The backward of 64-token blocks with 64 < D <= 128 and 16-bit inputs runs a persistent loop that prefetches the
    next step's tiles three deep (on Hopper GPUs the dispatcher sends it to ``block_attention_sm90``); fp32 tiles
    would not fit three deep in shared memory. Under GQA its steps run the group's query heads of a block in turn
    (1.24x and 1.47x the floor at 2:1 and 4:1 on an H100, against 2.18x and 2.42x for one program per block and
    64-wide slice). A GQA group's loop in the one-block kernel is pipelined two deep (``GROUP_STAGES``: 1.26x
    against 1.54x at D = 64, 4:1). ``persistent`` says whether the persistent kernel may
    run (it takes no in-block options, and needs q and dq in one layout, k, v, dk and dv in another); where it may
    not, its shapes get the one-block kernel's slices.

    The forward under GQA at 64-token blocks, where one slice holds the head dim, runs the group's query heads in one
    program on k and v read (and turned, with a rotary) once (``HEADS_PER_PROGRAM``, 4 warps; other block sizes keep a
    program per query head, but for the rotary forward past D = 128 below). At `ads` lengths on an H100, against one
    program per query head: bf16 4:1 at D = 128 1.02x the floor against 1.07x, 8:1 1.03x against 1.11x, 8:1 at D = 64
    1.09x against 1.25x; fp8 4:1 1.18x against 1.28x; with a rotary and fp32 angles 4:1 1.12x against 1.32x, 8:1 1.18x
    against 1.57x; 8 warps lost everywhere, by 15-75%. That loop is software-pipelined four deep (``GROUP_STAGES``: the
    next heads' q loads issued ahead), except for 16-bit inputs at D = 128 with up to four query heads per kv head and
    no rotary, where it lost or tied (H100: 4:2 1.07x against 0.99x, 8:2 1.02x against 1.01x; H200: 8:2 1.19x against
    1.13x; with a rotary it won: 8:2 1.10x against 1.17x, 4:1 1.05x against 1.12x). At `ads` lengths, one stage -> four,
    H100 (2026-11-25, 04:29-04:39 UTC): fp8 8:1 at D = 128 1.20x -> 1.08x, 4:2 1.16x -> 1.07x, 8:1 at D = 64 1.36x ->
    1.12x, 8:2 at D = 32 1.40x -> 1.27x; bf16 8:1 at D = 64 1.09x -> 1.06x, 8:2 at D = 32 1.23x -> 1.06x; with a rotary
    and fp32 angles, bf16 8:1 at D = 128 1.18x -> 1.02x, fp8 1.43x -> 1.21x. H200 (04:46 UTC): fp8 8:1 at D = 128 1.40x
    -> 1.11x, at D = 64 1.67x -> 1.27x; bf16 8:1 at D = 128 1.17x -> 1.14x, at D = 64 1.22x -> 1.06x; rotary bf16 8:1 at
    D = 128 1.46x -> 1.25x. Two stages lost to one (bf16 8:1 1.17x against 1.03x on the H100), and so did four with
    in-block options (the causal mask and the position bias at 4:1: 5.33 ms against 1.73), which keep one.

    The same holds for the 16-bit forward under GQA at 128-token blocks with tiles 32 or 64 wide (D = 24 to 64, and
    D = 16 with a rotary, whose pair halves pad it to 32), without in-block options: the group in a program, 4
    warps, two stages (one with a rotary). H200, the sweep's lengths, 8 query
    heads, bf16, over the floor against a program per query head (2026-11-28; not measured on an H100): D = 32 8:1
    4.13x -> 3.29x (8 warps: 3.21x two stages, 3.23x one), 8:2 3.77x -> 3.12x; D = 64 8:1 2.58x -> 2.38x, 8:2
    2.37x -> 2.20x (8 warps 3.10-3.25x); with a rotary and fp32 angles D = 32 8:1 3.60x -> 3.33x, 8:2 3.35x ->
    3.00x, D = 64 8:1 3.79x -> 2.52x, 8:2 3.57x -> 2.43x (two stages 2-4% slower but at D = 32 8:1, 3.23x; 8
    warps 2.85-4.88x). At D = 128 (two slices a program; whole rows with the group lost: 2.36x against 2.06x at
    8:1) it stays a program per query head.

    Under GQA of two query heads a kv head, the rotary forward with fp32 angles at 64-token blocks and D = 128 (no
    in-block option; one block a tile: 16- and 32-token blocks were not measured) runs its pair of heads in one stage
    under a cap of 168 registers (``MAXNREG``):
    98 KiB of shared memory and 250 registers held it to two programs an SM, three now. H200, the sweep's lengths,
    8 query heads, over the floor (2026-11-29, a `.gpu` script on this launcher's overrides, 03:10 UTC): 1.53x ->
    1.43x (two stages capped 1.50x; 128 registers 2.23-2.45x; 03:46 UTC, two rounds: 1.53x -> 1.43x again). With
    bf16 angles it lost (8:4 1.52x -> 1.61-1.62x, two stages capped a tie), and at 8:2 and 8:1 every cap lost (8:2
    1.41x -> 1.53x in one stage or two, 8:1 1.37x -> 1.55-1.61x; bf16 angles at 8:2 1.43x -> 1.55-1.61x), and so it
    did without GQA (four heads a program, 1.26x -> 1.58-1.78x). Not measured on an H100.

    The 16-bit forward with a fused rotary under GQA past D = 128 (16-, 32- and 64-token blocks, no in-block option)
    takes whole rows and the group in one program too, on k, v and the angles loaded and turned once: 8 warps and
    two stages at 64-token blocks, 4 warps and one stage below (one block a program there: ``tiles.blocks_per_tile``).
    It took two 128-column slices and a program per query head, each turning k and v and reading the block's 64 KiB
    of fp32 angles again. Times over the floor at D = 256, 8 query heads, the sweep's lengths, bf16 (2026-11-28): H100
    16-token blocks 8:2 fp32 angles 2.12x -> 1.28x, 8:1 bf16 angles 2.16x -> 1.25x, 32-token blocks 8:2 2.13x ->
    1.26x, 8:4 1.97x -> 1.27x, 64-token blocks 8:2 2.16x -> 1.60x, 8:1 2.43x -> 1.70x (8 warps at 16- and 32-token
    blocks 1.37-1.90x, 4 at 64-token blocks 2.13x; one stage 1.65x and 1.78x); H200 64-token blocks 8:2 2.87x ->
    2.11x, 8:1 3.07x -> 2.23x.

    Without GQA, a 16-bit forward with a fused rotary at 64-token blocks and D = 128 fed fp32 angles, or at 128-token
    blocks and D = 64 fed angles in the inputs' dtype (no in-block option), runs up to 4 query heads a program (the
    largest divisor of ``num_heads`` up to 4), each on its own k and v, on the block's angles read once, its loop two
    stages deep, 4 warps: every program re-read the block's angles from L2 (32 KiB in fp32, half again the bytes of its
    q, k, v and output tiles). At `ads` lengths (2026-11-25), one head a program against four, two stages: H100 8 heads
    1.10x -> 1.02x the floor, 4 heads 1.08x -> 1.01x, 3 heads (3 a program) 1.07x -> 1.02x; H200 8 heads 1.34x -> 1.19x,
    4 heads 1.30x -> 1.15x. With bf16 angles it tied on the H100 (0.99x -> 1.00x) and lost on the H200 (1.10x -> 1.18x);
    three stages lost everywhere (H100 8 heads 1.11x; H200, 2026-11-29, 8 heads 1.28x -> 1.56x). At 128-token blocks and
    D = 64, H200, the sweep's lengths, 8 heads: bf16 angles 2.38x -> 1.95x (2026-11-29, 07:18-07:23 UTC, twice; 8 heads
    three stages 2.04x, 8 warps 2.42x); fp32 angles 2.33x -> 2.01x (2026-11-28), since taken by the rule below.

    Without GQA, the rotary forward (no in-block option) runs up to 8 query heads a program (the largest divisor of
    ``num_heads`` up to 8), each on its own k and v, on the tile's angles read once, its loop three stages deep, on
    64-row tiles (64-token blocks, and 16- and 32-token blocks four or two to a tile) for fp8 inputs up to D = 128 and
    for 16-bit inputs up to D = 64 with fp32 angles, or with angles in their dtype at D = 32 on packed tiles; and with 8
    warps at 128-token blocks, D = 64, 16-bit inputs and fp32 angles, where it takes 144 KiB of shared memory (sm_90,
    triton 3.6; GPUs whose programs may take less, sm_86 and sm_89, keep the 4 heads of the rule above: 72 KiB there).
    One head a program read the tile's angles once a head. H200, the sweep's lengths, 8 heads, over the floor, the rules
    before against 8 heads three stages deep (2026-11-29, ``kernel_config`` patched in a `.gpu` script, 07:03-07:23
    UTC): bf16 with fp32 angles, 16-token blocks D = 32 2.05x -> 1.50x, D = 64 1.61x -> 1.29x; 32-token blocks 1.93x ->
    1.47x, 1.52x -> 1.27x; 64-token blocks 1.43x -> 1.35x, 1.29x -> 1.10x; 128-token blocks at D = 64 2.03x -> 1.82x
    (twice; 4 warps 2.76x); fp8 up to D = 64 with fp32 angles 1.75-3.29x -> 1.67-2.19x (bf16 angles 1.76-3.49x ->
    1.74-2.33x, four stages), at D = 128 16-, 32- and 64-token blocks 2.41x, 2.27x, 1.72x -> 1.72x, 1.67x, 1.63x (bf16
    angles 2.58x, 2.20x, 1.84x -> 1.75x, 1.70x, 1.66x); bf16 with bf16 angles at D = 32 on packed tiles 1.99-2.10x ->
    1.61-1.64x. With bf16 angles elsewhere it lost or won little (64-token blocks D = 32 1.36x -> 1.58x; D = 64
    1.28-1.50x -> 1.23-1.46x), and so it did for 16 bits at D = 128 (1.18-1.49x -> 1.43-1.72x) and at 128-token blocks
    and D = 32 with fp32 angles (2.22x -> 2.26x). Left out, measured once: bf16 angles at 128-token blocks and D = 32
    (2.53x -> 2.31x), and two stages at D = 128 (1.27-1.39x; with bf16 angles at 16-token blocks 1.49x -> 1.39x). Four
    stages tied or lost (but at 64-token blocks and D = 32, 1.31x against 1.35x; fp8 at D = 128 2.28-2.52x); two and six
    lost, and so did 8 warps on 64-row tiles, everywhere. Not measured on an H100.

    The plain forward without GQA on small tiles (16-bit or fp8 inputs; 16- and 32-token blocks, one a program, at
    D = 32 to 128; 64-token blocks at D = 32, and for fp8 at D = 64; no in-block option) runs 4 query heads a
    program (the largest divisor of ``num_heads`` up to 4; up to 8 for fp8 at 16- and 32-token blocks and for 16
    bits at 16-token blocks with D = 32), each on its own k and v, its loop four stages deep: the next heads' loads
    in flight, where a program of one head held too few bytes to keep the memory busy. H200, the sweep's lengths, 8
    heads, over the floor, one head a program against 4 (8) heads four stages deep (2026-11-29, ``kernel_config``
    patched in a `.gpu` script): bf16 at 16-token blocks D = 32 1.93x -> 1.80x (1.68x), D = 64 1.36x -> 1.10x, D =
    128 1.13x -> 1.06x; 32-token blocks D = 32 1.51x -> 1.16x, D = 64 1.20x -> 1.07x, D = 128 1.07x -> 1.05x;
    64-token blocks D = 32 1.24x -> 1.15x, but D = 64 1.04x -> 1.09x (two heads two stages deep a tie). Four heads
    in one stage lost everywhere (1.12-2.33x); 8 heads tied with 4 or lost but at 16-token blocks (D = 32 1.68x
    against 1.80x, D = 64 1.09x against 1.10x; two stages 1.09-1.70x). fp8 at
    16-token blocks D = 32 3.31x -> 2.80x (2.63x), D = 64 1.93x -> 1.74x (1.64x), D = 128 1.60x -> 1.37x (1.27x);
    32-token blocks D = 32 2.85x -> 2.25x (2.12x), D = 64 1.88x -> 1.55x (1.49x), D = 128 1.47x -> 1.42x (1.32x);
    64-token blocks D = 32 1.70x -> 1.46x (1.45x), D = 64 1.41x -> 1.24x (1.39x). Not measured on an H100.

    Warps: 8 where a program holds a 128 x 128 fp32 score tile (128-token blocks, but for the groups and heads a program
    above other than the rotary's 8 heads at D = 64), slices wider than 64 x 128, or, at 64-token blocks, dk and dv
    accumulators of 128+ columns across a GQA group; else 4, which beat 2 and 8 at 64-token blocks (an H200 without GQA;
    on an H100 8 lose by 1.8x at D = 64 under GQA). The 16-bit forward with a fused rotary under GQA, one program per
    query head, takes 8 at 64-token blocks and D >= 128 (measured at D = 128 before the group loop: 1.32x against 1.55x
    at 4:1; it now applies to D > 128 with in-block options), else 4.
    16- and 32-token blocks keep 4 where they run one block a program (measured only for the rotary forward past
    D = 128 above, where 8 lost); in 64-row tiles the launcher asks for the 64-token rule (``tiles.blocks_per_tile``).

    With a fused rotary the kernels work on pair halves, which must be at least 16 wide for the tensor cores:
    slices are at least 32 columns and at most 64 x 128 elements, and the backward does not run persistent (1.72x
    its floor against 1.30x for one whole-row block per program at `ads-rotary`, H100).
    """
    min_width = min_chunk(rotary)
    block_d = max(min_width, triton.next_power_of_2(head_dim))
    # The 16-bit rotary forward under GQA past D = 128, without in-block options: whole rows, the group in a program
    # (at 64-token blocks where a program may take the 128 KiB of shared memory it needs: Hopper, the A100; not
    # sm_86/89, whose programs run two head-dim slices and a query head each, 24 KiB there: the lean configuration,
    # chosen here so that no program the GPU refuses is compiled first)
    wide_rotary_group = (not backward and rotary and group > 1 and element_size == 2 and block_d > 128
                         and block_size <= 64 and not in_block_bits and not lean
                         and (block_size < 64 or shared_memory is None or shared_memory >= 128 * 1024))
    pipelined = (backward and persistent and not rotary and block_size == 64 and 64 < block_d <= 128
                 and element_size == 2 and not lean)
    wide_gqa = group > 1 and element_size == 2 and (block_size == 128 or (block_size == 64 and block_d > 128))
    if not backward or ((rotary or pipelined or wide_gqa) and not lean):
        max_slice = 64 * 128
    elif group == 1 and element_size == 2 and not lean:
        max_slice = 128 * 128
    else:
        max_slice = 64 * 64
    tile_options = in_block_bits & (in_block.POS_BIAS.value | in_block.TIME_BIAS.value | in_block.DROPOUT.value)
    if (not backward and block_size == 64 and block_d == 128 and group == 1 and element_size == 2 and not rotary
            and tile_options.bit_count() >= 2):
        max_slice = 64 * 64
    chunk = block_d if wide_rotary_group else min(block_d, max(min_width, max_slice // block_size))
    wide = ((block_size * chunk > 64 * 128 and not wide_rotary_group)
            or (backward and group > 1 and block_size == 64 and chunk >= 128))
    # The 16-bit forward under GQA at 128-token blocks with 32- or 64-wide tiles (whole rows), no in-block option:
    # the group in a program
    wide_block_group = (not backward and block_size == 128 and group > 1 and block_d in (32, 64) and element_size == 2
                        and not in_block_bits)
    heads_per_program = (group if not backward and (block_size == 64 or wide_rotary_group or wide_block_group)
                         and chunk >= block_d and not lean else 1)
    # The forward without GQA, whole rows, no in-block option: where several query heads a program pay (below)
    mha_whole_rows = not backward and group == 1 and chunk >= block_d and not in_block_bits and not lean
    # 128-token blocks at D = 64 with fp32 angles: 8 heads three stages deep take 144 KiB of shared memory (Hopper,
    # the A100; not sm_86/89), else the 4 heads of the rule below (72 KiB on sm_86)
    wide_tile_many_heads = (block_size == 128 and block_d == 64 and element_size == 2 and fp32_angles
                            and (shared_memory is None or shared_memory >= 144 * 1024))
    mha_rotary_heads = mha_whole_rows and rotary and element_size == 2 and (
        ((block_size, block_d) == (64, 128) and fp32_angles)
        or ((block_size, block_d) == (128, 64) and not wide_tile_many_heads))
    if mha_rotary_heads:
        heads_per_program = _largest_divisor(num_heads, 4)
    # Up to 8 heads a program, three stages deep: the rotary forward on 64-row tiles (fp8 up to D = 128; 16 bits up
    # to D = 64 with fp32 angles, or at D = 32 on packed tiles) and at 128-token blocks above
    mha_rotary_many_heads = mha_whole_rows and rotary and (
        (block_size == 64 and element_size == 1 and block_d <= 128)
        or (block_size == 64 and element_size == 2 and block_d <= 64
            and (fp32_angles or (block_d == 32 and blocks > 1)))
        or wide_tile_many_heads)
    if mha_rotary_many_heads:
        heads_per_program = _largest_divisor(num_heads, 8)
    # The plain 16-bit or fp8 forward on small tiles, each query head on its own k and v
    mha_plain_heads = (mha_whole_rows and not rotary and element_size <= 2 and 32 <= block_d <= 128
                       and (block_size <= 32 or (block_size == 64 and block_d <= (64 if element_size == 1 else 32))))
    if mha_plain_heads:
        most = 8 if (element_size == 1 and block_size <= 32) or (block_size, block_d) == (16, 32) else 4
        heads_per_program = _largest_divisor(num_heads, most)
    rotary_gqa_fwd = (not backward and rotary and group > 1 and element_size == 2 and block_size == 64
                      and block_d >= 128 and heads_per_program == 1)
    # The rotary forward of two query heads a program (fp32 angles, 64-token blocks, D = 128): one stage, under a
    # register cap (MAXNREG, which _forward_register_cap applies)
    rotary_pair_fwd = (not backward and rotary and fp32_angles and group == 2 and element_size == 2
                       and block_size == 64 and blocks == 1 and block_d == 128 and heads_per_program == 2
                       and not in_block_bits)
    return MappingProxyType({
        "BLOCK_D": block_d,
        "CHUNK": chunk,
        "NUM_CHUNKS": triton.cdiv(block_d, chunk),
        "EVEN_D": block_d == head_dim,
        "PIPELINE_STAGES": 3 if pipelined else 1,
        "GROUP_STAGES": (1 if lean
                         else (2 if group > 1 and not rotary else 1) if backward
                         else (2 if block_size == 64 else 1) if wide_rotary_group
                         else (1 if rotary else 2) if wide_block_group
                         else 2 if mha_rotary_heads and heads_per_program > 1
                         else 3 if mha_rotary_many_heads and heads_per_program > 1
                         else 4 if mha_plain_heads and heads_per_program > 1
                         else 1 if rotary_pair_fwd
                         else 4 if heads_per_program > 1 and not in_block_bits
                         and not (element_size == 2 and group <= 4 and block_d == 128 and not rotary) else 1),
        "HEADS_PER_PROGRAM": heads_per_program,
        "NUM_WARPS": (8 if (block_size == 128 and (heads_per_program == 1 or mha_rotary_many_heads)) or wide
                      or rotary_gqa_fwd or (wide_rotary_group and block_size == 64) else 4),
        "MAXNREG": 168 if rotary_pair_fwd else None,
    })


def _largest_divisor(n: int, most: int) -> int:
    """The largest divisor of ``n`` up to ``most``: query heads a program that split ``n`` heads evenly."""
    return max(h for h in range(1, most + 1) if n % h == 0)


@triton.jit
def _operand_halves(words, sin, cos, ON: tl.constexpr, ELEM: tl.constexpr, FENCE: tl.constexpr):
    """A product operand's ``(even, odd)`` pair halves from its words, rotated (in fp32, rounded back to ``ELEM``, as
    an unfused rotary would have stored it) when ``ON``; fp8 pairs come out in fp16, rotated or not (ops.fp8: the
    products of fp8 inputs are 16-bit). ``FENCE`` (NVIDIA GPUs) keeps the rotation in the load's layout
    (``rotary.fence``)."""
    FP8: tl.constexpr = ELEM == tl.float8e4nv
    if ON:
        even, odd = unpack_words(words, ELEM)
        even, odd = turn_pairs(even, odd, sin, cos, False)
        if FP8:
            even = even.to(tl.float16)
            odd = odd.to(tl.float16)
        else:
            even = even.to(ELEM)
            odd = odd.to(ELEM)
    else:
        even, odd = split_words(words, ELEM)
        even = _widened(even, FP8)
        odd = _widened(odd, FP8)
    return fence(even, FENCE), fence(odd, FENCE)


@triton.jit
def _store_unrotated(base, rows, pair0, stride_n, even, odd, mask, sin, cos, ON: tl.constexpr,
                     PAIRS: tl.constexpr, INLINE_ASM: tl.constexpr, WIDE_STORES: tl.constexpr):
    """Store the gradient of an operand, turned back (``sin -> -sin``, fp32) when the operand was rotated; from the
    product's own layout when ``WIDE_STORES`` (``rotary.store_pairs_wide``)."""
    if ON:
        even, odd = turn_pairs(even, odd, sin, cos, True)
    if WIDE_STORES:
        store_pairs_wide(base, rows, pair0, stride_n, even, odd, mask, PAIRS)
    else:
        store_pairs(base, rows, pair0, stride_n, even, odd, mask, PAIRS, INLINE_ASM)


@triton.jit
def _widened(tile, FP8: tl.constexpr):
    """An fp8 tile as fp16 (exact), for 16-bit tensor-core products; other tiles as they are."""
    if FP8:
        tile = tile.to(tl.float16)
    return tile


@triton.jit
def _pair_dot(a_even, a_odd, b_even, b_odd, acc, DOT_PRECISION: tl.constexpr):
    """``acc + a @ b^T`` over the head dim, from the pair halves of ``a`` and ``b``."""
    acc = tl.dot(a_even, tl.trans(b_even), acc, input_precision=DOT_PRECISION)
    return tl.dot(a_odd, tl.trans(b_odd), acc, input_precision=DOT_PRECISION)


@triton.jit
def _fwd_rotary_block(q_ptr, k_base, v_base, o_ptr, sinu_ptr, start, head, rows, row_ok, head_dim, qk_scale_log2,
                      out_factor, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on,
                      stride_oh, stride_sn, stride_sd, mods, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr,
                      NUM_CHUNKS: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                      ROTATE: tl.constexpr, INLINE_ASM: tl.constexpr, IN_BLOCK: tl.constexpr, FP8: tl.constexpr,
                      HEADS: tl.constexpr, SHARED_KV: tl.constexpr, GROUP_STAGES: tl.constexpr, keys):
    """The forward of one (block, head) on pair halves, the operands named by ROTATE turned after loading (fp8
    inputs: in fp16, ``out_factor`` their output's descale); with ``HEADS`` > 1 (one slice), of query heads
    ``head ...`` on the tile's angles read once, and on k and v read and turned once where they share them
    (``SHARED_KV``: GQA), else each on its own."""
    PAIRS: tl.constexpr = CHUNK // 2
    elem_ty: tl.constexpr = q_ptr.dtype.element_ty
    half = head_dim // 2
    if HEADS > 1:
        mask = tile_mask(row_ok, 0, half, PAIRS, EVEN_D)
        sin, cos = load_angles(sinu_ptr, rows, 0, half, stride_sn, stride_sd, mask, PAIRS)
        if SHARED_KV:
            k_even, k_odd = _operand_halves(load_words(k_base, rows, 0, stride_kn, mask, PAIRS), sin, cos,
                                            ROTATE_K & ROTATE, elem_ty, INLINE_ASM)
            v_even, v_odd = _operand_halves(load_words(v_base, rows, 0, stride_vn, mask, PAIRS), sin, cos,
                                            ROTATE_V & ROTATE, elem_ty, False)
        for g in tl.range(HEADS, num_stages=GROUP_STAGES):
            if not SHARED_KV:
                k_even, k_odd = _operand_halves(load_words(k_base + g * stride_kh, rows, 0, stride_kn, mask, PAIRS),
                                                sin, cos, ROTATE_K & ROTATE, elem_ty, INLINE_ASM)
                v_even, v_odd = _operand_halves(load_words(v_base + g * stride_vh, rows, 0, stride_vn, mask, PAIRS),
                                                sin, cos, ROTATE_V & ROTATE, elem_ty, False)
            q_words = load_words(q_ptr + (head + g) * stride_qh, rows, 0, stride_qn, mask, PAIRS)
            q_even, q_odd = _operand_halves(q_words, sin, cos, ROTATE_Q & ROTATE, elem_ty, INLINE_ASM)
            scores = _pair_dot(q_even, q_odd, k_even, k_odd, tl.zeros((BLOCK_SIZE, BLOCK_SIZE), dtype=tl.float32),
                               DOT_PRECISION)
            p = block_probs(scores, start, head + g, rows, row_ok, qk_scale_log2, mods, BLOCK_SIZE, IN_BLOCK, keys)
            p = p.to(v_even.dtype)
            o_even = fp8_output(tl.dot(p, v_even, input_precision=DOT_PRECISION), out_factor, FP8,
                                o_ptr.dtype.element_ty)
            o_odd = fp8_output(tl.dot(p, v_odd, input_precision=DOT_PRECISION), out_factor, FP8,
                               o_ptr.dtype.element_ty)
            store_pairs(o_ptr + (head + g) * stride_oh, rows, 0, stride_on, o_even, o_odd, mask, PAIRS, INLINE_ASM)
        return
    q_base = q_ptr + head * stride_qh
    o_base = o_ptr + head * stride_oh
    scores = tl.zeros((BLOCK_SIZE, BLOCK_SIZE), dtype=tl.float32)
    for c in tl.static_range(NUM_CHUNKS):
        mask = tile_mask(row_ok, c * PAIRS, half, PAIRS, EVEN_D)
        q_words = load_words(q_base, rows, c * PAIRS, stride_qn, mask, PAIRS)
        k_words = load_words(k_base, rows, c * PAIRS, stride_kn, mask, PAIRS)
        if NUM_CHUNKS == 1:
            # v with q and k (or after the softmax): issued in between, while q k^T runs, costs 1.17x the floor
            # against 0.99x on `ads-rotary` (H100)
            v_words = load_words(v_base, rows, 0, stride_vn, mask, PAIRS)
        sin, cos = load_angles(sinu_ptr, rows, c * PAIRS, half, stride_sn, stride_sd, mask, PAIRS)
        q_even, q_odd = _operand_halves(q_words, sin, cos, ROTATE_Q & ROTATE, elem_ty, INLINE_ASM)
        k_even, k_odd = _operand_halves(k_words, sin, cos, ROTATE_K & ROTATE, elem_ty, INLINE_ASM)
        scores = _pair_dot(q_even, q_odd, k_even, k_odd, scores, DOT_PRECISION)
    p = block_probs(scores, start, head, rows, row_ok, qk_scale_log2, mods, BLOCK_SIZE, IN_BLOCK, keys)
    if FP8:
        p = p.to(tl.float16)
    else:
        p = p.to(elem_ty)
    for c in tl.static_range(NUM_CHUNKS):
        mask = tile_mask(row_ok, c * PAIRS, half, PAIRS, EVEN_D)
        if NUM_CHUNKS > 1:  # else v and the angles come from the first loop
            sin, cos = load_angles(sinu_ptr, rows, c * PAIRS, half, stride_sn, stride_sd, mask, PAIRS)
            v_words = load_words(v_base, rows, c * PAIRS, stride_vn, mask, PAIRS)
        v_even, v_odd = _operand_halves(v_words, sin, cos, ROTATE_V & ROTATE, elem_ty, False)
        o_even = fp8_output(tl.dot(p, v_even, input_precision=DOT_PRECISION), out_factor, FP8,
                            o_base.dtype.element_ty)
        o_odd = fp8_output(tl.dot(p, v_odd, input_precision=DOT_PRECISION), out_factor, FP8, o_base.dtype.element_ty)
        store_pairs(o_base, rows, c * PAIRS, stride_on, o_even, o_odd, mask, PAIRS, INLINE_ASM)


@triton.jit
def _fwd_group(q_ptr, k_base, v_base, o_ptr, start, first_head, rows, row_ok, head_dim, qk_scale_log2, out_factor,
               stride_qn, stride_qh, stride_qd, stride_kn, stride_kh, stride_kd, stride_vn, stride_vh, stride_vd,
               stride_on, stride_oh, stride_od, mods, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr,
               EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, IN_BLOCK: tl.constexpr, FP8: tl.constexpr,
               FP8_QK: tl.constexpr, HEADS: tl.constexpr, GROUP_STAGES: tl.constexpr, SHARED_KV: tl.constexpr, keys):
    """The forward of query heads ``first_head ...`` in turn, whole rows: of one kv head (``SHARED_KV``), whose k and
    v are read once for all, or without GQA each on its own k and v (``k_base``, ``v_base``: the first head's)."""
    mask = tile_mask(row_ok, 0, head_dim, CHUNK, EVEN_D)
    if SHARED_KV:
        k = _widened(tl.load(tile_ptrs(k_base, rows, 0, stride_kn, stride_kd, CHUNK), mask=mask, other=0.0),
                     FP8 and not FP8_QK)
        v = _widened(tl.load(tile_ptrs(v_base, rows, 0, stride_vn, stride_vd, CHUNK), mask=mask, other=0.0), FP8)
    for g in tl.range(HEADS, num_stages=GROUP_STAGES):
        head = first_head + g
        if not SHARED_KV:
            k = _widened(tl.load(tile_ptrs(k_base + g * stride_kh, rows, 0, stride_kn, stride_kd, CHUNK), mask=mask,
                                 other=0.0), FP8 and not FP8_QK)
            v = _widened(tl.load(tile_ptrs(v_base + g * stride_vh, rows, 0, stride_vn, stride_vd, CHUNK), mask=mask,
                                 other=0.0), FP8)
        q = _widened(tl.load(tile_ptrs(q_ptr + head * stride_qh, rows, 0, stride_qn, stride_qd, CHUNK), mask=mask,
                             other=0.0), FP8 and not FP8_QK)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p = block_probs(scores, start, head, rows, row_ok, qk_scale_log2, mods, BLOCK_SIZE, IN_BLOCK, keys)
        o = fp8_output(tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION), out_factor, FP8,
                       o_ptr.dtype.element_ty)
        store_tile(o_ptr + head * stride_oh, rows, 0, stride_on, stride_od, o, mask, CHUNK)


@triton.jit
def _block_attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, sinu_ptr,
    block_seq_ptr, block_cum_ptr, offsets_ptr,
    num_seqs, num_tokens, head_dim, qk_scale_log2,
    stride_qn, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_on, stride_oh, stride_od,
    stride_sn, stride_sd,
    pos_bias_ptr, stride_pbh, stride_pbw, buckets_ptr, stride_bucket_row, time_bias_ptr, stride_tbh, stride_tbb,
    num_buckets, seed_ptr, keep_threshold, keep_scale,
    q_descale_ptr, k_descale_ptr, v_descale_ptr, out_scale_ptr,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCKS: tl.constexpr,
    CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ROTATE: tl.constexpr, INLINE_ASM: tl.constexpr, IN_BLOCK: tl.constexpr, FP8: tl.constexpr,
    FP8_QK: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, GROUP_STAGES: tl.constexpr,
):
    # Heads vary fastest so that the programs of one block (which share its rows, and k/v under GQA) run together.
    # ROTATE is a bit mask (tiles.ROTATE_Q/K/V) of the operands turned by the rotary angles right after their load;
    # IN_BLOCK one of the in-block options (ops.in_block: causal, biases, dropout), whose arguments are ``mods``.
    # FP8: q, k, v are float8_e4m3fn, widened to fp16 after loading, and descaled (ops.fp8). FP8_QK: q k^T on fp8
    # tensor cores instead (no widening; slices 32+ wide): 1.28x its floor against 1.42x widened at `ads` with GQA
    # 4:1 (H100). Hopper sums fp8 products with fewer bits than fp32, within the tested SNR bounds.
    # HEADS_PER_PROGRAM > 1 (one head-dim slice): a program runs the query heads of one kv head in turn, on the k
    # and v tiles it loaded (and turned) once (_fwd_group; with a rotary _fwd_rotary_block), or without GQA
    # consecutive heads, each on its own k and v (_fwd_group), with a rotary on the angles it loaded once
    # (_fwd_rotary_block).
    # BLOCK_SIZE is the rows a program holds: BLOCKS blocks of BLOCK_SIZE // BLOCKS tokens (tiles.blocks_per_tile),
    # each row's keys those of its block (``keys``), and no in-block option with more than one.
    tl.static_assert(BLOCKS == 1 or IN_BLOCK == 0)
    PROGRAMS_PER_BLOCK: tl.constexpr = NUM_Q_HEADS // HEADS_PER_PROGRAM
    pid = tl.program_id(0)
    if block_seq_ptr is None and pid == tl.num_programs(0) - 1:
        # No block table (block_table.OffsetsOnly): the table kernel's checks are ours, in a program of their own
        # past the blocks' (off the other programs' chains).
        assert_offsets(offsets_ptr, num_seqs, num_tokens, num_tokens, OFFSETS_CHUNK)
        return
    slot = pid // PROGRAMS_PER_BLOCK
    head = (pid % PROGRAMS_PER_BLOCK) * HEADS_PER_PROGRAM
    start, length, second, third, fourth = tile_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, slot, num_seqs,
                                                       num_tokens, BLOCK_SIZE, BLOCKS)
    if length <= 0:
        return
    offs = tl.arange(0, BLOCK_SIZE)
    row_ok = offs < length
    if BLOCKS > 1:
        keys = same_block(offs, offs, second, third, fourth)
    else:
        keys = None
    rows = start + offs
    kv_head = head // GROUP
    q_base = q_ptr + head * stride_qh
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    o_base = o_ptr + head * stride_oh
    mods = (pos_bias_ptr, stride_pbh, stride_pbw, buckets_ptr, stride_bucket_row, time_bias_ptr, stride_tbh,
            stride_tbb, num_buckets, seed_ptr, keep_threshold, keep_scale)

    qk_scale_log2 = fp8_score_scale(qk_scale_log2, q_descale_ptr, k_descale_ptr, FP8)
    out_factor = fp8_out_factor(v_descale_ptr, out_scale_ptr, FP8, o_ptr.dtype.element_ty)

    if ROTATE:
        _fwd_rotary_block(q_ptr, k_base, v_base, o_ptr, sinu_ptr, start, head, rows, row_ok, head_dim,
                          qk_scale_log2, out_factor, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                          stride_on, stride_oh, stride_sn, stride_sd, mods, BLOCK_SIZE, CHUNK, NUM_CHUNKS, EVEN_D,
                          DOT_PRECISION, ROTATE, INLINE_ASM, IN_BLOCK, FP8, HEADS_PER_PROGRAM, GROUP > 1,
                          GROUP_STAGES, keys)
        return
    if HEADS_PER_PROGRAM > 1:
        _fwd_group(q_ptr, k_base, v_base, o_ptr, start, head, rows, row_ok, head_dim, qk_scale_log2, out_factor,
                   stride_qn, stride_qh, stride_qd, stride_kn, stride_kh, stride_kd, stride_vn, stride_vh, stride_vd,
                   stride_on, stride_oh, stride_od, mods, BLOCK_SIZE, CHUNK, EVEN_D, DOT_PRECISION, IN_BLOCK, FP8,
                   FP8_QK, HEADS_PER_PROGRAM, GROUP_STAGES, GROUP > 1, keys)
        return
    scores = tl.zeros((BLOCK_SIZE, BLOCK_SIZE), dtype=tl.float32)
    for c in tl.static_range(NUM_CHUNKS):
        mask = tile_mask(row_ok, c * CHUNK, head_dim, CHUNK, EVEN_D)
        q = _widened(tl.load(tile_ptrs(q_base, rows, c * CHUNK, stride_qn, stride_qd, CHUNK), mask=mask, other=0.0),
                     FP8 and not FP8_QK)
        k = _widened(tl.load(tile_ptrs(k_base, rows, c * CHUNK, stride_kn, stride_kd, CHUNK), mask=mask, other=0.0),
                     FP8 and not FP8_QK)
        scores = tl.dot(q, tl.trans(k), scores, input_precision=DOT_PRECISION)
    p = block_probs(scores, start, head, rows, row_ok, qk_scale_log2, mods, BLOCK_SIZE, IN_BLOCK, keys)
    if FP8:
        p = p.to(tl.float16)
    else:
        p = p.to(q_ptr.dtype.element_ty)

    for c in tl.static_range(NUM_CHUNKS):
        mask = tile_mask(row_ok, c * CHUNK, head_dim, CHUNK, EVEN_D)
        v = _widened(tl.load(tile_ptrs(v_base, rows, c * CHUNK, stride_vn, stride_vd, CHUNK), mask=mask, other=0.0),
                     FP8)
        o = fp8_output(tl.dot(p, v, input_precision=DOT_PRECISION), out_factor, FP8, o_ptr.dtype.element_ty)
        store_tile(o_base, rows, c * CHUNK, stride_on, stride_od, o, mask, CHUNK)


@triton.jit
def _bwd_slice_products(q_base, k_base, v_base, do_base, rows, row_ok, col0, head_dim, scores, dp,
                        stride_qn, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd, stride_don, stride_dod,
                        CHUNK: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add one head-dim slice's share of ``q k^T`` and ``dO v^T``; return the slice's q, k, dO tiles too."""
    mask = tile_mask(row_ok, col0, head_dim, CHUNK, EVEN_D)
    q = tl.load(tile_ptrs(q_base, rows, col0, stride_qn, stride_qd, CHUNK), mask=mask, other=0.0)
    k = tl.load(tile_ptrs(k_base, rows, col0, stride_kn, stride_kd, CHUNK), mask=mask, other=0.0)
    scores = tl.dot(q, tl.trans(k), scores, input_precision=DOT_PRECISION)
    # Loaded after the first product: fewer tiles live at once (no register spills at D = 64).
    v = tl.load(tile_ptrs(v_base, rows, col0, stride_vn, stride_vd, CHUNK), mask=mask, other=0.0)
    do = tl.load(tile_ptrs(do_base, rows, col0, stride_don, stride_dod, CHUNK), mask=mask, other=0.0)
    dp = tl.dot(do, tl.trans(v), dp, input_precision=DOT_PRECISION)
    return q, k, do, scores, dp


@triton.jit
def _bwd_rotary_slice(q_base, k_base, v_base, do_base, sinu_ptr, rows_in, row_ok, pair0, half, cols,
                      stride_qn, stride_kn, stride_vn, stride_don, stride_sn, stride_sd,
                      PAIRS: tl.constexpr, ROTATE: tl.constexpr, INLINE_ASM: tl.constexpr):
    """One slice's angles and pair halves of the (rotated) q, k, v and of dO. ``rows_in`` are the block's rows with
    those past its end moved into it (``tiles.in_block_rows``), so the loads need no row predicate; ``cols`` is the
    column mask (``None`` for whole slices). dO is zero on rows past the end, so they add nothing to dk and dv."""
    # All loads before any rotation, without predicates (1.18x the floor on `ads-rotary`, H100, against 1.24x
    # rotating each operand right after its masked load, where each load waited for the previous operand's math).
    elem_ty: tl.constexpr = q_base.dtype.element_ty
    q_words = load_words(q_base, rows_in, pair0, stride_qn, cols, PAIRS)
    k_words = load_words(k_base, rows_in, pair0, stride_kn, cols, PAIRS)
    v_words = load_words(v_base, rows_in, pair0, stride_vn, cols, PAIRS)
    do_words = tl.where(row_ok[:, None], load_words(do_base, rows_in, pair0, stride_don, cols, PAIRS), 0)
    sin, cos = load_angles(sinu_ptr, rows_in, pair0, half, stride_sn, stride_sd, cols, PAIRS)
    q_even, q_odd = _operand_halves(q_words, sin, cos, ROTATE_Q & ROTATE, elem_ty, INLINE_ASM)
    k_even, k_odd = _operand_halves(k_words, sin, cos, ROTATE_K & ROTATE, elem_ty, INLINE_ASM)
    v_even, v_odd = _operand_halves(v_words, sin, cos, ROTATE_V & ROTATE, elem_ty, INLINE_ASM)
    do_even, do_odd = _operand_halves(do_words, sin, cos, False, elem_ty, INLINE_ASM)
    return sin, cos, q_even, q_odd, k_even, k_odd, v_even, v_odd, do_even, do_odd


@triton.jit
def _bwd_rotary_block(q_ptr, do_ptr, dq_ptr, k_base, v_base, dk_base, dv_base, sinu_ptr, start, length, slot, rows,
                      row_ok, kv_head, first_slice, head_dim, scale, qk_scale_log2,
                      stride_qn, stride_qh, stride_kn, stride_vn, stride_don, stride_doh, stride_dqn, stride_dqh,
                      stride_dkn, stride_dvn, stride_sn, stride_sd, mods, dpos_ptr, dtime_ptr,
                      GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                      EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, SLICES_PER_PROGRAM: tl.constexpr,
                      ROTATE: tl.constexpr, INLINE_ASM: tl.constexpr, WIDE_STORES: tl.constexpr,
                      NUM_Q_HEADS: tl.constexpr, IN_BLOCK: tl.constexpr, GROUP_STAGES: tl.constexpr):
    """``_block_attention_bwd_kernel``'s program on pair halves: GQA and head-dim slices, rotated operands. The
    softmax scale is folded into dS (one multiply per score instead of one per gradient element)."""
    PAIRS: tl.constexpr = CHUNK // 2
    half = head_dim // 2
    rows_in = in_block_rows(rows, row_ok)
    dk_even = tl.zeros((BLOCK_SIZE, PAIRS), dtype=tl.float32)
    dk_odd = tl.zeros((BLOCK_SIZE, PAIRS), dtype=tl.float32)
    dv_even = tl.zeros((BLOCK_SIZE, PAIRS), dtype=tl.float32)
    dv_odd = tl.zeros((BLOCK_SIZE, PAIRS), dtype=tl.float32)
    for g in tl.range(GROUP, num_stages=GROUP_STAGES):
        head = kv_head * GROUP + g
        q_base = q_ptr + head * stride_qh
        do_base = do_ptr + head * stride_doh
        scores = tl.zeros((BLOCK_SIZE, BLOCK_SIZE), dtype=tl.float32)
        dp = tl.zeros((BLOCK_SIZE, BLOCK_SIZE), dtype=tl.float32)
        if NUM_CHUNKS == 1:  # not in the loop below: its tiles are used again by the gradient products
            sin, cos, q_even, q_odd, k_even, k_odd, v_even, v_odd, do_even, do_odd = _bwd_rotary_slice(
                q_base, k_base, v_base, do_base, sinu_ptr, rows_in, row_ok, 0, half, column_mask(0, half, PAIRS, EVEN_D),
                stride_qn, stride_kn, stride_vn, stride_don, stride_sn, stride_sd, PAIRS, ROTATE, INLINE_ASM)
            scores = _pair_dot(q_even, q_odd, k_even, k_odd, scores, DOT_PRECISION)
            dp = _pair_dot(do_even, do_odd, v_even, v_odd, dp, DOT_PRECISION)
        else:
            for c in range(NUM_CHUNKS):
                sin, cos, q_even, q_odd, k_even, k_odd, v_even, v_odd, do_even, do_odd = _bwd_rotary_slice(
                    q_base, k_base, v_base, do_base, sinu_ptr, rows_in, row_ok, c * PAIRS, half,
                    column_mask(c * PAIRS, half, PAIRS, EVEN_D),
                    stride_qn, stride_kn, stride_vn, stride_don, stride_sn, stride_sd, PAIRS, ROTATE, INLINE_ASM)
                scores = _pair_dot(q_even, q_odd, k_even, k_odd, scores, DOT_PRECISION)
                dp = _pair_dot(do_even, do_odd, v_even, v_odd, dp, DOT_PRECISION)
        p, ds = block_probs_and_grads(scores, dp, start, length, head, slot * NUM_Q_HEADS + head, first_slice == 0,
                                      qk_scale_log2, scale, q_ptr.dtype.element_ty, mods, dpos_ptr, dtime_ptr,
                                      BLOCK_SIZE, IN_BLOCK)
        for i in range(SLICES_PER_PROGRAM):
            pair0 = (first_slice + i) * PAIRS
            cols = column_mask(pair0, half, PAIRS, EVEN_D)
            if NUM_CHUNKS == 1:
                # The angles again (an L1/L2 hit) rather than kept from the loads: held, they spill registers.
                sin, cos = load_angles(sinu_ptr, rows_in, pair0, half, stride_sn, stride_sd, cols, PAIRS)
            else:
                # The slice again (an L1/L2 hit): holding every slice would spill registers.
                sin, cos, q_even, q_odd, k_even, k_odd, v_even, v_odd, do_even, do_odd = _bwd_rotary_slice(
                    q_base, k_base, v_base, do_base, sinu_ptr, rows_in, row_ok, pair0, half, cols,
                    stride_qn, stride_kn, stride_vn, stride_don, stride_sn, stride_sd, PAIRS,
                    (ROTATE_Q | ROTATE_K) & ROTATE, INLINE_ASM)
            mask = tile_mask(row_ok, pair0, half, PAIRS, EVEN_D)
            if GROUP == 1:
                _store_unrotated(dv_base, rows, pair0, stride_dvn,
                                 tl.dot(tl.trans(p), do_even, input_precision=DOT_PRECISION),
                                 tl.dot(tl.trans(p), do_odd, input_precision=DOT_PRECISION),
                                 mask, sin, cos, ROTATE_V & ROTATE, PAIRS, INLINE_ASM, WIDE_STORES)
                _store_unrotated(dk_base, rows, pair0, stride_dkn,
                                 tl.dot(tl.trans(ds), q_even, input_precision=DOT_PRECISION),
                                 tl.dot(tl.trans(ds), q_odd, input_precision=DOT_PRECISION),
                                 mask, sin, cos, ROTATE_K & ROTATE, PAIRS, INLINE_ASM, WIDE_STORES)
            else:
                dv_even = tl.dot(tl.trans(p), do_even, dv_even, input_precision=DOT_PRECISION)
                dv_odd = tl.dot(tl.trans(p), do_odd, dv_odd, input_precision=DOT_PRECISION)
                dk_even = tl.dot(tl.trans(ds), q_even, dk_even, input_precision=DOT_PRECISION)
                dk_odd = tl.dot(tl.trans(ds), q_odd, dk_odd, input_precision=DOT_PRECISION)
            _store_unrotated(dq_ptr + head * stride_dqh, rows, pair0, stride_dqn,
                             tl.dot(ds, k_even, input_precision=DOT_PRECISION),
                             tl.dot(ds, k_odd, input_precision=DOT_PRECISION),
                             mask, sin, cos, ROTATE_Q & ROTATE, PAIRS, INLINE_ASM, WIDE_STORES)
    if GROUP > 1:
        pair0 = first_slice * PAIRS
        mask = tile_mask(row_ok, pair0, half, PAIRS, EVEN_D)
        sin, cos = load_angles(sinu_ptr, rows_in, pair0, half, stride_sn, stride_sd,
                               column_mask(pair0, half, PAIRS, EVEN_D), PAIRS)
        _store_unrotated(dv_base, rows, pair0, stride_dvn, dv_even, dv_odd, mask, sin, cos, ROTATE_V & ROTATE, PAIRS,
                         INLINE_ASM, WIDE_STORES)
        _store_unrotated(dk_base, rows, pair0, stride_dkn, dk_even, dk_odd, mask, sin, cos, ROTATE_K & ROTATE, PAIRS,
                         INLINE_ASM, WIDE_STORES)


@triton.jit
def _block_attention_bwd_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, dk_ptr, dv_ptr, sinu_ptr, dpos_ptr, dtime_ptr,
    block_seq_ptr, block_cum_ptr, offsets_ptr,
    num_seqs, num_tokens, head_dim, scale, qk_scale_log2,
    stride_qn, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_don, stride_doh, stride_dod,
    stride_dqn, stride_dqh, stride_dqd,
    stride_dkn, stride_dkh, stride_dkd,
    stride_dvn, stride_dvh, stride_dvd,
    stride_sn, stride_sd,
    pos_bias_ptr, stride_pbh, stride_pbw, buckets_ptr, stride_bucket_row, time_bias_ptr, stride_tbh, stride_tbb,
    num_buckets, seed_ptr, keep_threshold, keep_scale,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLICES_PER_PROGRAM: tl.constexpr, ROTATE: tl.constexpr, INLINE_ASM: tl.constexpr, WIDE_STORES: tl.constexpr,
    IN_BLOCK: tl.constexpr, GROUP_STAGES: tl.constexpr, HEADS_PER_KV: tl.constexpr,
):
    # Each program owns SLICES_PER_PROGRAM of the NUM_CHUNKS head-dim slices of one (block, kv head): it recomputes
    # P and dS (over all slices) and writes its slices of dq, dk, dv. Without GQA (GROUP == 1) each result is stored
    # as soon as it is computed. With GQA a program owns one slice and loops over the GROUP query heads that share
    # the kv head, accumulating that slice of dk/dv in registers (GROUP_STAGES > 1 software-pipelines that loop:
    # the next head's tiles load while this one computes). No atomics: bitwise reproducible.
    # With a rotary (ROTATE, bits tiles.ROTATE_Q/K/V) the same program runs on pair halves (_bwd_rotary_block):
    # operands are rotated after every load and their gradients turned back before the store. IN_BLOCK: as in the
    # forward; the programs of a (block, head)'s first slice write its share of the bias gradients (dpos, dtime).
    # HEADS_PER_KV > 1 (splits_group): the "kv heads" are the query heads, each program reading its group's k and v
    # (head // HEADS_PER_KV) and writing that query head's own share of dk and dv.
    PROGRAMS_PER_HEAD: tl.constexpr = NUM_CHUNKS // SLICES_PER_PROGRAM
    pid = tl.program_id(0)
    first_slice = (pid % PROGRAMS_PER_HEAD) * SLICES_PER_PROGRAM
    kv_head = (pid // PROGRAMS_PER_HEAD) % NUM_KV_HEADS
    slot = pid // (PROGRAMS_PER_HEAD * NUM_KV_HEADS)
    start, length = block_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, slot, num_seqs, num_tokens, BLOCK_SIZE)
    if length <= 0:
        return
    offs = tl.arange(0, BLOCK_SIZE)
    row_ok = offs < length
    rows = start + offs
    k_base = k_ptr + (kv_head // HEADS_PER_KV) * stride_kh
    v_base = v_ptr + (kv_head // HEADS_PER_KV) * stride_vh
    dk_base = dk_ptr + kv_head * stride_dkh
    dv_base = dv_ptr + kv_head * stride_dvh
    mods = (pos_bias_ptr, stride_pbh, stride_pbw, buckets_ptr, stride_bucket_row, time_bias_ptr, stride_tbh,
            stride_tbb, num_buckets, seed_ptr, keep_threshold, keep_scale)
    if ROTATE:
        _bwd_rotary_block(q_ptr, do_ptr, dq_ptr, k_base, v_base, dk_base, dv_base, sinu_ptr, start, length, slot, rows,
                          row_ok, kv_head, first_slice, head_dim, scale, qk_scale_log2,
                          stride_qn, stride_qh, stride_kn, stride_vn, stride_don, stride_doh, stride_dqn, stride_dqh,
                          stride_dkn, stride_dvn, stride_sn, stride_sd, mods, dpos_ptr, dtime_ptr,
                          GROUP, BLOCK_SIZE, CHUNK, NUM_CHUNKS, EVEN_D, DOT_PRECISION, SLICES_PER_PROGRAM, ROTATE,
                          INLINE_ASM, WIDE_STORES, NUM_KV_HEADS * GROUP, IN_BLOCK, GROUP_STAGES)
        return

    dk = tl.zeros((BLOCK_SIZE, CHUNK), dtype=tl.float32)
    dv = tl.zeros((BLOCK_SIZE, CHUNK), dtype=tl.float32)
    for g in tl.range(GROUP, num_stages=GROUP_STAGES):
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
        p, ds = block_probs_and_grads(scores, dp, start, length, head, slot * (NUM_KV_HEADS * GROUP) + head,
                                      first_slice == 0, qk_scale_log2, 1.0, q_ptr.dtype.element_ty, mods, dpos_ptr,
                                      dtime_ptr, BLOCK_SIZE, IN_BLOCK)
        for i in range(SLICES_PER_PROGRAM):
            col0 = (first_slice + i) * CHUNK
            mask = tile_mask(row_ok, col0, head_dim, CHUNK, EVEN_D)
            if NUM_CHUNKS > 1:
                # Read the slice again (an L1/L2 hit): holding every slice would spill registers.
                q = tl.load(tile_ptrs(q_base, rows, col0, stride_qn, stride_qd, CHUNK), mask=mask, other=0.0)
                k = tl.load(tile_ptrs(k_base, rows, col0, stride_kn, stride_kd, CHUNK), mask=mask, other=0.0)
                do = tl.load(tile_ptrs(do_base, rows, col0, stride_don, stride_dod, CHUNK), mask=mask, other=0.0)
            if GROUP == 1:
                store_tile(dv_base, rows, col0, stride_dvn, stride_dvd,
                           tl.dot(tl.trans(p), do, input_precision=DOT_PRECISION), mask, CHUNK)
            else:
                dv = tl.dot(tl.trans(p), do, dv, input_precision=DOT_PRECISION)
            dq = tl.dot(ds, k, input_precision=DOT_PRECISION) * scale
            store_tile(dq_ptr + head * stride_dqh, rows, col0, stride_dqn, stride_dqd, dq, mask, CHUNK)
            if GROUP == 1:
                store_tile(dk_base, rows, col0, stride_dkn, stride_dkd,
                           tl.dot(tl.trans(ds), q, input_precision=DOT_PRECISION) * scale, mask, CHUNK)
            else:
                dk = tl.dot(tl.trans(ds), q, dk, input_precision=DOT_PRECISION)

    if GROUP > 1:
        mask = tile_mask(row_ok, first_slice * CHUNK, head_dim, CHUNK, EVEN_D)
        store_tile(dv_base, rows, first_slice * CHUNK, stride_dvn, stride_dvd, dv, mask, CHUNK)
        store_tile(dk_base, rows, first_slice * CHUNK, stride_dkn, stride_dkd, dk * scale, mask, CHUNK)


@triton.jit
def _block_attention_bwd_persistent_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, dk_ptr, dv_ptr,
    block_seq_ptr, block_cum_ptr, offsets_ptr,
    num_seqs, num_slots, num_tokens, head_dim, scale, qk_scale_log2,
    stride_qn, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_don, stride_doh, stride_dod,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, PIPELINE_STAGES: tl.constexpr,
    KV_SHARES_TILE: tl.constexpr, DO_SHARES_LAYOUT: tl.constexpr,
):
    # The backward, whole head dim in one slice, as a persistent loop: the compiler prefetches the next step's tiles
    # into shared memory while the current one computes, which hides the load latency that bounds one-block programs
    # when few fit on a multiprocessor (D = 128). A program owns (block, kv head) items, pid + i * programs, and
    # runs one step per query head of the item's GQA group, all in one flat loop (so that every step pipelines):
    # dk and dv accumulate over the group's steps in registers and are stored at its last one (GROUP == 1: at
    # every step). No atomics: bitwise reproducible. q and dq share one layout, k, v, dk and dv another (the
    # launcher checks), so one tile of offsets serves each side; dO shares q's when DO_SHARES_LAYOUT, and k's side
    # shares it too when KV_SHARES_TILE (same layout, and without GQA the same head).
    num_items = tl.minimum(tl.load(block_cum_ptr + num_seqs - 1), num_slots) * NUM_KV_HEADS  # the rest: padding
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_SIZE)
    dk = tl.zeros((BLOCK_SIZE, CHUNK), dtype=tl.float32)
    dv = tl.zeros((BLOCK_SIZE, CHUNK), dtype=tl.float32)
    for step in tl.range(0, tl.cdiv(num_items - pid, programs) * GROUP, num_stages=PIPELINE_STAGES):
        item = pid + (step // GROUP) * programs
        g = step % GROUP
        kv_head = item % NUM_KV_HEADS
        start, length = block_bounds(block_seq_ptr, block_cum_ptr, offsets_ptr, item // NUM_KV_HEADS, num_seqs,
                                     num_tokens, BLOCK_SIZE)
        row_ok = offs < length
        rows = start + offs
        mask = tile_mask(row_ok, 0, head_dim, CHUNK, EVEN_D)
        q_tile = tile_ptrs((kv_head * GROUP + g) * stride_qh, rows, 0, stride_qn, stride_qd, CHUNK)
        if KV_SHARES_TILE:
            kv_tile = q_tile
        else:
            kv_tile = tile_ptrs(kv_head * stride_kh, rows, 0, stride_kn, stride_kd, CHUNK)
        if DO_SHARES_LAYOUT:
            do_tile = q_tile
        else:
            do_tile = tile_ptrs((kv_head * GROUP + g) * stride_doh, rows, 0, stride_don, stride_dod, CHUNK)
        # All four tiles before the products (before the shared offsets: 1.17x the floor on `ads`, 1.22x interleaved).
        q = tl.load(q_ptr + q_tile, mask=mask, other=0.0)
        k = tl.load(k_ptr + kv_tile, mask=mask, other=0.0)
        v = tl.load(v_ptr + kv_tile, mask=mask, other=0.0)
        do = tl.load(do_ptr + do_tile, mask=mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        p = softmax_probs(scores, row_ok, qk_scale_log2)
        ds = grad_scores(p, dp, q_ptr.dtype.element_ty, 1.0)
        p = p.to(q_ptr.dtype.element_ty)
        tl.store(dq_ptr + q_tile, (tl.dot(ds, k, input_precision=DOT_PRECISION) * scale).to(dq_ptr.dtype.element_ty),
                 mask=mask)
        if GROUP == 1:
            tl.store(dv_ptr + kv_tile,
                     tl.dot(tl.trans(p), do, input_precision=DOT_PRECISION).to(dv_ptr.dtype.element_ty), mask=mask)
            tl.store(dk_ptr + kv_tile,
                     (tl.dot(tl.trans(ds), q, input_precision=DOT_PRECISION) * scale).to(dk_ptr.dtype.element_ty),
                     mask=mask)
        else:
            dv = tl.dot(tl.trans(p), do, tl.where(g == 0, 0.0, dv), input_precision=DOT_PRECISION)
            dk = tl.dot(tl.trans(ds), q, tl.where(g == 0, 0.0, dk), input_precision=DOT_PRECISION)
            # Rows of the group's last step only (a row bound, not a scalar predicate: one mask shape for both).
            last = tile_mask(offs < tl.where(g == GROUP - 1, length, 0), 0, head_dim, CHUNK, EVEN_D)
            tl.store(dv_ptr + kv_tile, dv.to(dv_ptr.dtype.element_ty), mask=last)
            tl.store(dk_ptr + kv_tile, (dk * scale).to(dk_ptr.dtype.element_ty), mask=last)


def _persistent_programs(device: torch.device) -> int:
    """Programs of a persistent kernel: one per multiprocessor. Off the GPU (Triton's interpreter) a few, so that
    each runs several work items as on the GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 3


def _register_cap(maxnreg: int | None) -> dict:
    return {} if maxnreg is None else {"maxnreg": maxnreg}


def _forward_register_cap(cfg: MappingProxyType, heads: int, q: torch.Tensor, block_size: int, rotate: int,
                          options: InBlock) -> int | None:
    """The forward's register cap, at 64-token blocks, 4 warps and one query head a program (``heads``, as
    launched), without a rotary: 64 at D = 32 for 16-bit and fp8 inputs without an in-block option (there
    ``kernel_config`` runs 4 query heads a program where the head count allows: the cap holds for a count without a
    divisor from 2 to 4, and for the launcher's override of one head), 128 at D = 128 for 16-bit inputs with any;
    ``kernel_config``'s where it sets one; else none.

    At D = 32 the kernel takes 74 registers a thread (fp8, triton 3.6), which fit 6 programs an SM; 64 fit 8, whose
    loads keep more of the memory busy (H200, the sweep's lengths, 8 query heads, time over the floor, the compiler's
    choice against 64, 2026-11-28 20:49-20:51 UTC: bf16 1.29 -> 1.25x twice, fp8 1.80 -> 1.70x; at D = 64 it lost,
    1.05 -> 1.27x in bf16, and under GQA, fp8 1.44 -> 1.75x; 56 failed to compile). Measured on an H200 only, on a
    block table; it applies on every GPU, and without a table too. fp32 inputs, whose tiles take twice the
    registers, keep the compiler's choice.

    At D = 128 the options take the kernel past 128 registers a thread (3 programs an SM instead of 4; the time
    bias 148). At `ads` on an H100 (the plain op 2.151
    ms; 2026-11-25, 02:13-02:28 UTC), capped against the compiler's choice: the causal mask 2.164 against 2.198 ms,
    dropout 2.166 against 2.258, the causal mask with the position bias 2.221 against 2.401, with dropout 2.169
    against 2.285 (the time bias, capped first: 2.325 against 2.400 on 2026-11-24); the position bias alone 2.158
    against 2.155. Two or more of the options also take 64-wide slices (``kernel_config``), where the cap changes
    little (2.277 against 2.297 with the causal mask, the position bias and dropout; 2.479 against 2.474 with the
    causal mask and both biases). At other shapes the cap lost or tied (`ads` lengths, H100, 04:05-04:14 UTC): the
    time bias at 16-token blocks (D 64) 1.607 against 1.323 ms, at 32-token blocks (D 128) 2.536 against 2.266, at
    64-token blocks and D 256 2.446 against 2.360; D 64 within 1%."""
    if cfg["MAXNREG"] is not None:
        return cfg["MAXNREG"]
    one_head = cfg["NUM_WARPS"] == 4 and heads == 1 and not rotate and block_size == 64
    if one_head and q.shape[-1] == 32 and q.element_size() <= 2 and not options.bits:
        return 64
    sixteen_bit = q.dtype in (torch.float16, torch.bfloat16)
    return 128 if one_head and sixteen_bit and q.shape[-1] == 128 and options.bits else None


def _takes_heads_per_program(heads: int, num_heads: int, group: int, cfg: MappingProxyType) -> bool:
    """Whether a forward program may run ``heads`` query heads: where one head-dim slice holds the row, the GQA
    group (on k and v read once), or without GQA any divisor of the heads (each on its own k and v; with a rotary on
    the block's angles read once)."""
    return cfg["NUM_CHUNKS"] == 1 and (heads == group or (group == 1 and num_heads % heads == 0))


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs get true fp32 products ("ieee"), not TF32: callers who pass fp32 asked for fp32.
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def _stride_names(prefix: str) -> tuple[str, str, str]:
    return f"stride_{prefix}n", f"stride_{prefix}h", f"stride_{prefix}d"


def _strides(prefix: str, t: torch.Tensor) -> dict:
    """``stride_{prefix}n``, ``stride_{prefix}h``, ``stride_{prefix}d`` of an ``[N, H, D]`` tensor, as kernel
    keyword arguments."""
    return dict(zip(_stride_names(prefix), t.stride()))


# The most sequences on which the kernels run without a block table: each program then reads the offsets of all of
# them (one chunk of tiles.OFFSETS_CHUNK) to find its block.
FIND_BLOCKS_MAX_SEQS = 64
# The most query elements (tokens x heads x head dim) of a call without a block table: where the host's time sets a
# call's (2^22: some 8 µs of a forward's loads at 4 TB/s), not past it, where the kernels' search costs more than a
# table's launch (H200, 2026-11-28: 128-token blocks at D = 256, 8 heads, 67 827 tokens in ~50 sequences, the
# forward 0.34 -> 0.52 ms without a table; 64 x 1400 tokens, 4 heads, D = 128, 92.5 -> 98.6 µs an eager call).
FIND_BLOCKS_MAX_ELEMENTS = 2**22


def searches_offsets(call, num_seqs: int, num_tokens: int) -> bool:
    """Whether a kernel that can find its blocks in the offsets should, for ``call`` (``backends.AttentionCall``)
    on ``num_seqs`` sequences and ``num_tokens`` tokens: on few sequences and a small batch, and without a time
    bias, whose buckets' table is built from the block table."""
    return (num_seqs <= FIND_BLOCKS_MAX_SEQS and num_tokens * call.num_heads * call.head_dim <= FIND_BLOCKS_MAX_ELEMENTS
            and not call.in_block & in_block.TIME_BIAS.value)


def finds_blocks(call, num_seqs: int, num_tokens: int) -> bool:
    """Whether the Triton kernels run ``call`` without a block table (``block_table.OffsetsOnly``), where
    :func:`searches_offsets`: the forward on one block a program (a tile of several would search for each), and
    the backward where its one-block kernel runs (by the rule: where a GPU refuses the rule's persistent kernel,
    the one-block kernel it falls back to reads the table built for it). The persistent backward keeps the table:
    searching inside its loop over blocks, the loop held another, and Triton pipelines no such loop (triton 3.6,
    H200: no asynchronous copies left, 0.140 -> 0.232 ms on 8 x 4096 tokens, 8 heads, D = 128)."""
    group = call.num_heads // call.num_kv_heads
    if call.pass_name == "bwd":
        one_block = kernel_config(call.block_size, call.head_dim, backward=True,
                                  group=backward_group(call.block_size, call.head_dim, group),
                                  element_size=call.dtype.itemsize, rotary=call.rotate != 0,
                                  persistent=not call.in_block)["PIPELINE_STAGES"] == 1
    else:
        one_block = tiles.blocks_per_tile(call.block_size, call.head_dim, group, call.rotate != 0, call.in_block,
                                          backward=False) == 1
    return one_block and searches_offsets(call, num_seqs, num_tokens)


def block_attention_fwd_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    table: BlockTable | OffsetsOnly,
    block_size: int,
    scale: float,
    sinu_pos: torch.Tensor | None,
    rotate: int,
    options: InBlock = in_block.PLAIN,
    fp8_scales: fp8.Fp8Scales | None = None,
    *,
    num_warps: int | None = None,
    maxnreg: int | None = None,
    fp8_dot: bool | None = None,
    heads_per_program: int | None = None,
    group_stages: int | None = None,
) -> torch.Tensor:
    """Launch the forward kernel over ``table`` (or, an ``OffsetsOnly``, without one: :func:`finds_blocks`);
    returns ``out``. Arguments are those the dispatcher passes (``backends``), checked; ``rotate`` is a mask of
    ``tiles.ROTATE_BITS`` (0 without ``sinu_pos``): those operands are turned by ``sinu_pos`` after loading;
    ``options`` the in-block options; ``fp8_scales`` those of fp8 inputs (``ops.fp8``). ``num_warps``, ``maxnreg``
    (a register cap) and ``fp8_dot`` (fp8 q k^T on fp8 tensor cores, for fp8 inputs without a rotary and slices 32+
    wide; refused elsewhere), ``heads_per_program`` (1, or with one head-dim slice the GQA group, or without GQA
    a divisor of the heads) and ``group_stages`` (the pipelining depth of that loop over heads) override the tuned
    launch, for tuning sweeps."""
    n, hq, d = q.shape
    if rotate:
        q, k, v = (pair_aligned(t) for t in (q, k, v))
    out = tiles.new_output(q, dtype=None if fp8_scales is None else fp8_scales.out_dtype)
    checking = isinstance(table, OffsetsOnly)  # one program more, which checks the offsets (even with no block)
    if table.num_slots == 0 and not checking:
        return out
    group = hq // k.shape[1]
    blocks = tiles.blocks_per_tile(block_size, d, group, rotate != 0, options.bits, backward=False)
    tile = block_size * blocks
    config = functools.partial(kernel_config, tile, d, backward=False, group=group, element_size=q.element_size(),
                               rotary=bool(rotate), in_block_bits=options.bits, num_heads=hq,
                               fp32_angles=rotate != 0 and sinu_pos.dtype == torch.float32, blocks=blocks,
                               shared_memory=devices.shared_memory_limit(q.device) if q.is_cuda else None)
    rule = config()

    def takes_fp8_dot(cfg: MappingProxyType) -> bool:  # fp8 q k^T on fp8 tensor cores
        return fp8_scales is not None and not rotate and cfg["CHUNK"] >= 32

    if fp8_dot and not takes_fp8_dot(rule):
        raise ValueError("fp8_dot needs fp8 inputs, no rotary and head-dim slices at least 32 wide")
    if heads_per_program not in (None, 1) and not _takes_heads_per_program(heads_per_program, hq, group, rule):
        raise ValueError(f"heads_per_program must be 1, or, where one head-dim slice holds the row, the GQA group "
                         f"({group}) or without GQA a divisor of the {hq} heads; got {heads_per_program}")
    if group_stages is not None and group_stages < 1:
        raise ValueError(f"group_stages must be at least 1, got {group_stages}")
    sinu_ptr, stride_sn, stride_sd = rotary_operand(sinu_pos, q)
    # What no configuration changes, built once (a time bias's buckets among them), before any launch
    arguments = dict(
        q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=out, sinu_ptr=sinu_ptr, **table.kernel_args(offsets),
        num_tokens=n, head_dim=d, qk_scale_log2=scale * LOG2E,
        **_strides("q", q), **_strides("k", k), **_strides("v", v), **_strides("o", out),
        stride_sn=stride_sn, stride_sd=stride_sd, **in_block.call_args(options, q, offsets, table, block_size),
        **(fp8.no_scales_args(q) if fp8_scales is None else fp8_scales.kernel_args()), FP8=fp8_scales is not None,
        NUM_Q_HEADS=hq, GROUP=group, BLOCK_SIZE=tile, BLOCKS=blocks, DOT_PRECISION=_dot_precision(q.dtype),
        ROTATE=rotate, INLINE_ASM=inline_asm(q), num_stages=1,
        # Without a table the kernel asserts the offsets (``debug``, less the overflow checks it turns on).
        **({"debug": True, "sanitize_overflow": False} if checking else {}),
    )

    def run(cfg: MappingProxyType) -> None:
        heads = heads_per_program or cfg["HEADS_PER_PROGRAM"]
        launch(
            _block_attention_fwd_kernel, (triton.cdiv(table.num_slots, blocks) * hq // heads + checking,),
            **arguments, FP8_QK=takes_fp8_dot(cfg) and fp8_dot is not False,
            CHUNK=cfg["CHUNK"], NUM_CHUNKS=cfg["NUM_CHUNKS"], EVEN_D=cfg["EVEN_D"], HEADS_PER_PROGRAM=heads,
            GROUP_STAGES=group_stages or cfg["GROUP_STAGES"], num_warps=num_warps or cfg["NUM_WARPS"],
            **_register_cap(maxnreg or _forward_register_cap(cfg, heads, q, tile, rotate, options)),
        )

    tuned = any(x is not None for x in (num_warps, maxnreg, fp8_dot, heads_per_program, group_stages))
    launch_fitting(run, rule, None if tuned else lambda: (config(lean=True),))
    return out


def block_attention_bwd_triton(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    table: BlockTable | OffsetsOnly,
    block_size: int,
    scale: float,
    sinu_pos: torch.Tensor | None,
    rotate: int,
    options: InBlock,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    num_warps: int | None = None,
    maxnreg: int | None = None,
    slices_per_program: int | None = None,
    chunk: int | None = None,
    group_stages: int | None = None,
    pipeline_stages: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Launch the backward kernel over ``table`` (or, an ``OffsetsOnly``, without one: :func:`finds_blocks`; the
    persistent kernel reads a table, so the one-block kernel runs then): write ``(dq, dk, dv)``, the gradients of
    the unrotated inputs, into ``grads`` (new tensors or views of one packed buffer); return the gradients of
    ``options``' biases (None where absent). ``num_warps`` and ``maxnreg`` override the launch of either kernel.
    ``slices_per_program`` (1 under GQA, but where :func:`splits_group`), ``chunk`` (the head-dim slice's width: a
    power of two from 16, 32 with a rotary, up to the padded head dim) and ``group_stages`` (the pipelining depth
    of the loop over a GQA group's query heads) override the one-block-per-program kernel's choices and select that
    kernel, as does ``pipeline_stages=1``; ``pipeline_stages`` above 1 selects the persistent kernel, whole rows,
    that many stages deep. They are for tuning sweeps and change nothing but the Triton launch; a combination the
    chosen kernel cannot take is refused."""
    partials = in_block.bias_grad_partials(options, table.num_slots, block_size, q)
    if table.num_slots == 0:
        return in_block.summed_bias_grads(options, partials)
    overrides = {"num_warps": num_warps, "maxnreg": maxnreg, "slices_per_program": slices_per_program,
                 "chunk": chunk, "group_stages": group_stages, "pipeline_stages": pipeline_stages}
    if rotate and rotates_apart(block_size, q.shape[-1], q.shape[1] // k.shape[1]):
        _bwd_rotated_apart(grad_out, q, k, v, offsets, table, block_size, scale, sinu_pos, rotate, options, partials,
                           grads, overrides)
        return in_block.summed_bias_grads(options, partials)
    targets = grads
    if rotate:
        q, k, v, grad_out = (pair_aligned(t) for t in (q, k, v, grad_out))
        # Gradients are stored as pair words too: those that cannot take them are written apart and copied.
        targets = tuple(g if pairs_readable(g) else tiles.new_output(pair_aligned(g)) for g in grads)
    _launch_bwd(grad_out, q, k, v, offsets, table, block_size, scale, sinu_pos, rotate, options, partials, targets,
                **overrides)
    for grad, target in zip(grads, targets):
        if target is not grad:
            grad.copy_(target)
    return in_block.summed_bias_grads(options, partials)


def rotates_apart(block_size: int, head_dim: int, group: int) -> bool:
    """Whether the Triton backward of a fused rotary rotates apart: the rotated operands written by the rotary
    kernel, the plain backward run on them, its gradients turned back by the rotary kernel. At 128-token blocks past
    D = 128 under GQA, where each 64-column slice's program turns the block's q, k and v for its scores and spills
    registers (1 608 bytes a thread at 8:2, 288 without a rotary; ptxas): the fused backward took 15.7-25.6x the
    floor against 7.0-9.0x for the plain one; rotating apart, 8.6-10.5x (8:4 to 8:1 at D = 256, fp32 and bf16
    angles, the sweep's lengths, H200, 2026-11-28; not measured on an H100). With the group run apart since
    (:func:`splits_group`, its shares then added by ``torch.sum``), the fused rotation measured 6.24x, 6.94x and
    5.79x where rotating apart measured 6.49x, 6.50x and 6.42x (8:4 and 8:1 with fp32 angles, 8:2 with bf16 ones;
    one run each): a mix, so it still rotates apart. Without GQA the fused one is within 1.5x of the plain one
    (2.96-3.48x against 2.34x there) and stays."""
    return block_size == 128 and head_dim > 128 and group > 1


def backward_group(block_size: int, head_dim: int, group: int) -> int:
    """The query heads a Triton backward program runs for its kv head: 1 where :func:`splits_group`, else the
    group (what the backward's launch rule, ``kernel_config``, is asked for)."""
    return 1 if splits_group(block_size, head_dim, group) else group


def _bwd_rotated_apart(grad_out, q, k, v, offsets, table, block_size, scale, sinu_pos, rotate, options, partials,
                       grads, overrides) -> None:
    """:func:`rotates_apart`'s backward: the operands in ``rotate`` rotated as an unfused rotary stores them (in
    their dtype), the plain backward's gradients of them (in the gradients' dtype, as an unfused rotary's backward
    receives them) turned back into ``grads``."""
    turned = (ROTATE_Q.value, ROTATE_K.value, ROTATE_V.value)
    operands = [rotary_triton(t, sinu_pos, False) if rotate & bit else t for t, bit in zip((q, k, v), turned)]
    targets = [tiles.new_output(g) if rotate & bit else g for g, bit in zip(grads, turned)]
    _launch_bwd(grad_out, *operands, offsets, table, block_size, scale, None, 0, options, partials, targets,
                **overrides)
    for grad, target, bit in zip(grads, targets, turned):
        if rotate & bit:
            rotary_triton(target, sinu_pos, True, out=grad)


def splits_group(block_size: int, head_dim: int, group: int) -> bool:
    """Whether the Triton backward runs a GQA group's query heads apart: a program per query head (reading the
    group's k and v) writes its own share of dk and dv, which a sum over the group then adds up. At 128-token blocks
    past D = 128, where the group's dk and dv accumulators cannot be held whole, so each 64-column slice's program
    recomputed the block's scores and dP for every head of the group: four times the products of a program that
    runs a query head's whole rows, which is what each program now is (the launch rule without GQA). The shares
    take two ``[N, Hq, D]`` buffers for the backward's duration, and each is rounded to the gradients' dtype before
    the sum (as an unfused GQA's repeated k and v get theirs): bf16 gradients 50.6-50.8 dB against float64, 52.5
    before. H200, the sweep's lengths, 8 query heads, bf16, D = 256, group apart against in a program (2026-11-28,
    not measured on an H100): 8:4 3.70x the floor against 7.07x, 8:2 4.34x against 8.16x, 8:1 4.76x against 9.07x;
    with a rotary (:func:`rotates_apart`) fp32 angles 8:4 5.45x against 8.64x, 8:1 6.26x against 10.31x, bf16
    angles 8:2 5.97x against 9.70x (``torch.sum`` adding the shares: 4.77-4.97x, 6.36-6.53x)."""
    return block_size == 128 and head_dim > 128 and group > 1


@triton.jit
def _sum_group_shares_kernel(shares_ptr, out_ptr, num_tokens, head_dim, stride_on, stride_oh, stride_od,
                             NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
                             BLOCK_D: tl.constexpr):
    # :func:`splits_group`'s sum: a program adds up ROWS tokens' shares ([N, Hq, D], contiguous) of one kv head
    # over its group's query heads, in order, in fp32 (a kernel, not an ATen op, so that the backward replays).
    kv_head = tl.program_id(1)
    tokens = tl.program_id(0) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (tokens < num_tokens)[:, None] & (cols < head_dim)[None, :]
    shares = shares_ptr + ((tokens * NUM_KV_HEADS + kv_head) * GROUP * head_dim)[:, None] + cols[None, :]
    total = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    for g in tl.static_range(GROUP):
        total += tl.load(shares + g * head_dim, mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + (tokens * stride_on + kv_head * stride_oh)[:, None] + cols[None, :] * stride_od
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)


def _sum_group_shares(shares: torch.Tensor, grad: torch.Tensor) -> None:
    """``grad[:, h] = sum_g shares[:, h * G + g]``: the query heads' shares of a kv head's gradient added up."""
    n, hkv, d = grad.shape
    rows = 16
    launch(_sum_group_shares_kernel, (triton.cdiv(n, rows), hkv), shares_ptr=shares, out_ptr=grad, num_tokens=n,
           head_dim=d, **_strides("o", grad), NUM_KV_HEADS=hkv, GROUP=shares.shape[1] // hkv, ROWS=rows,
           BLOCK_D=triton.next_power_of_2(d), num_warps=4)


def _launch_bwd(grad_out, q, k, v, offsets, table, block_size, scale, sinu_pos, rotate, options, partials, grads, *,
                num_warps, maxnreg, slices_per_program, chunk, group_stages, pipeline_stages) -> None:
    n, hq, d = q.shape
    kv_heads = k.shape[1]
    group = backward_group(block_size, d, hq // kv_heads)
    split = group != hq // kv_heads
    hkv = hq // group  # the kernel's kv heads: the query heads where the group splits
    dq, dk, dv = grads
    if split:  # each query head's share, in the gradients' dtype (as an unfused GQA's repeated k and v get theirs)
        dk, dv = (tiles.new_output(q, dtype=g.dtype) for g in (dk, dv))
    two_layouts = q.stride() == dq.stride() and len({t.stride() for t in (k, v, dk, dv)}) == 1
    # The persistent kernel reads a block table, and runs a kv head's whole group (no split)
    persistent = two_layouts and not options.bits and not split and not isinstance(table, OffsetsOnly)
    config = functools.partial(kernel_config, block_size, d, backward=True, group=group,
                               element_size=q.element_size(), rotary=bool(rotate), persistent=persistent)
    rule = config()
    if chunk is not None:
        min_width = min_chunk(bool(rotate))
        if chunk < min_width or chunk > rule["BLOCK_D"] or chunk & (chunk - 1):
            raise ValueError(f"chunk must be a power of two in [{min_width}, {rule['BLOCK_D']}], got {chunk}")
        rule = {**rule, "CHUNK": chunk, "NUM_CHUNKS": rule["BLOCK_D"] // chunk}
    for name, stages in (("group_stages", group_stages), ("pipeline_stages", pipeline_stages)):
        if stages is not None and stages < 1:
            raise ValueError(f"{name} must be at least 1, got {stages}")
    one_block = chunk is not None or group_stages is not None or slices_per_program is not None
    if pipeline_stages is not None:
        if pipeline_stages > 1 and (rotate or one_block or not persistent):
            raise ValueError("pipeline_stages > 1 (the persistent backward) takes no rotary, in-block options, chunk, "
                             "group_stages or slices_per_program, nor a GQA group run apart (splits_group), and needs "
                             "a block table, q, dq in one layout and k, v, dk, dv in another")
        whole_rows = {"CHUNK": rule["BLOCK_D"], "NUM_CHUNKS": 1} if pipeline_stages > 1 else {}
        rule = {**rule, **whole_rows, "PIPELINE_STAGES": pipeline_stages}
    elif one_block:
        rule = {**rule, "PIPELINE_STAGES": 1}
    # Built once, before the first launch: what both kernels take, and the one-block kernel's in-block arguments (a
    # time bias's buckets: a refused launch must not build them again); the rest of each kernel's arguments are
    # built where that kernel runs.
    common = dict(**table.kernel_args(offsets), num_tokens=n, head_dim=d, scale=scale, qk_scale_log2=scale * LOG2E,
                  BLOCK_SIZE=block_size, DOT_PRECISION=_dot_precision(q.dtype), num_stages=1, **_register_cap(maxnreg),
                  q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=grad_out, dq_ptr=dq, dk_ptr=dk, dv_ptr=dv, NUM_KV_HEADS=hkv,
                  GROUP=group)
    in_block_args = in_block.call_args(options, q, offsets, table, block_size)

    def run(cfg: MappingProxyType) -> None:
        shape = {"CHUNK": cfg["CHUNK"], "EVEN_D": cfg["EVEN_D"], "num_warps": num_warps or cfg["NUM_WARPS"]}
        if cfg["PIPELINE_STAGES"] > 1:
            programs = min(table.num_slots * hkv, _persistent_programs(q.device))
            launch(_block_attention_bwd_persistent_kernel, (programs,), **common, **shape,
                   num_slots=table.num_slots, **_strides("q", q), **_strides("k", k), **_strides("do", grad_out),
                   KV_SHARES_TILE=group == 1 and k.stride() == q.stride(),
                   DO_SHARES_LAYOUT=grad_out.stride() == q.stride(), PIPELINE_STAGES=cfg["PIPELINE_STAGES"])
            return
        slices = slices_per_program or (cfg["NUM_CHUNKS"] if group == 1 else 1)
        sinu_ptr, stride_sn, stride_sd = rotary_operand(sinu_pos, q)
        launch(_block_attention_bwd_kernel, (table.num_slots * hkv * (cfg["NUM_CHUNKS"] // slices),),
               **common, **shape, **{name: stride for prefix, t in zip(("q", "k", "v", "do", "dq", "dk", "dv"),
                                                                       (q, k, v, grad_out, dq, dk, dv))
                                     for name, stride in _strides(prefix, t).items()},
               sinu_ptr=sinu_ptr, dpos_ptr=partials[0], dtime_ptr=partials[1], stride_sn=stride_sn,
               stride_sd=stride_sd, **in_block_args, ROTATE=rotate, INLINE_ASM=inline_asm(q),
               WIDE_STORES=bool(rotate) and all(wide_stores_ok(g) for g in (dq, dk, dv)),
               HEADS_PER_KV=hq // kv_heads if split else 1, NUM_CHUNKS=cfg["NUM_CHUNKS"], SLICES_PER_PROGRAM=slices,
               GROUP_STAGES=group_stages or cfg["GROUP_STAGES"])

    def leaner() -> list:
        # Under GQA the persistent kernel two stages deep first (``kernel_config``'s ``lean``)
        fallbacks = [config(lean=True)]
        if rule["PIPELINE_STAGES"] > 2 and group > 1:
            fallbacks.insert(0, MappingProxyType({**rule, "PIPELINE_STAGES": 2}))
        return fallbacks

    tuned = any(x is not None for x in (num_warps, maxnreg, slices_per_program, chunk, group_stages, pipeline_stages))
    launch_fitting(run, rule, None if tuned else leaner)
    if split:
        for shares, grad in zip((dk, dv), grads[1:]):
            _sum_group_shares(shares, grad)
