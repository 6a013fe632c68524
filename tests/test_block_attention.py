"""Block attention against the float64 reference: Triton kernels (interpreter on CPU, real on GPU) and the PyTorch
CPU path, through the launchers and through the public autograd op."""

import itertools
import re
from dataclasses import replace

import pytest
import torch
from conftest import (
    BLOCK_SIZES,
    HAS_GPU,
    KERNEL_DEVICE,
    KERNEL_DTYPES,
    assert_eager_route_matches_the_ops,
    assert_within_2x_pytorch,
    make_offsets,
    odd_lengths,
    random_angles,
    random_inputs,
    reference_grads,
    run_backend,
    run_kernels,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from triton.runtime.errors import OutOfResources

import blockattn
from blockattn import backends
from blockattn.backends import AttentionCall
from blockattn.block_table import (
    SLOT_GROUP,
    BlockTable,
    OffsetsOnly,
    build_block_table,
    kernel_table,
    max_blocks,
)
from blockattn.ops import block_attention as triton_ops
from blockattn.ops import fp8, in_block, tiles
from blockattn.ops.in_block import PLAIN
from blockattn.ops.launch import launch
from blockattn.ops.tiles import ROTATE_ALL
from blockattn.reference import block_attention_reference, quantised_fp8


def run_torch_path(q, k, v, do, offsets, block_size):
    return run_backend("torch", q, k, v, do, offsets, block_size)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize(
    "lengths,valid",
    [([0, 1, 15, 16, 17, 100, 0], True), ([], True), ([0] * 3000, True), ([5, -2, 9], False), ([7] * 2500, True),
     ([0, 64, 1, 200] * 40, True), ([30, 500, -400, 70] * 20, False)],
    ids=["odd", "none", "many-empty", "negative", "many", "programs", "programs-negative"],
)
def test_block_table_kernel(lengths, valid, block_size):
    """The GPU's one-launch table (here through the interpreter) agrees with the PyTorch block table, over one
    program's sequences and several; with bad offsets its verdict says so (the interpreter's kernels do not
    assert), and it still gives every slot a sequence in ``[0, B]`` in order (what keeps the kernels' reads in
    bounds)."""
    if HAS_GPU and not valid:
        pytest.skip("on a GPU bad offsets trip the kernel's device-side assertion (test_gpu.py)")
    offsets = make_offsets(lengths, KERNEL_DEVICE)
    n = int(offsets[-1])
    table, ok = kernel_table(offsets, n, block_size, verdict=True)
    assert bool(ok) == valid
    seq = table.block_seq.cpu()
    assert seq.numel() == max_blocks(n, len(lengths), block_size)
    assert bool((seq >= 0).all() and (seq <= len(lengths)).all() and (seq.diff() >= 0).all())
    if valid:
        expected = build_block_table(offsets.cpu(), n, block_size)  # the PyTorch ops of the other devices
        want_cum = torch.tensor([-(-n // block_size) for n in lengths], dtype=torch.int32).cumsum(0)
        assert torch.equal(expected.block_cum, want_cum.int())
        assert torch.equal(table.block_cum.cpu(), expected.block_cum)
        assert torch.equal(seq, expected.block_seq)
    if not HAS_GPU:
        bad_end = offsets.clone()
        bad_end[-1] += 1
        assert not bool(kernel_table(bad_end, n, block_size, verdict=True)[1])
    checked_only, ok = kernel_table(offsets, n, block_size, fill=False, verdict=True)
    assert bool(ok) == valid and checked_only.num_slots == 0


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernels_odd_lengths_gqa(block_size, dtype, poisoned_outputs):
    q, k, v, do, offsets = random_inputs(odd_lengths(block_size), 4, 2, 32, dtype, KERNEL_DEVICE)
    assert_within_2x_pytorch(run_kernels(q, k, v, do, offsets, block_size), q, k, v, do, offsets, block_size)


def strided_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a view of stride 2 (a column of a table, say)."""
    return torch.stack([t, torch.full_like(t, 7)], 1).flatten()[::2]


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_strided_offsets(offsets_dtype, public_calls_on_kernels, poisoned_outputs):
    """The kernels read offsets as consecutive ints: a strided view is taken as its values, in a call and in a
    layout, forward and backward, as its contiguous copy is."""
    dtype = torch.float32 if not HAS_GPU else torch.bfloat16
    q, k, v, do, offsets = random_inputs([5, 0, 17, 16, 1, 33], 4, 2, 32, dtype, public_calls_on_kernels,
                                         offsets_dtype)
    strided = strided_view(offsets)
    assert not strided.is_contiguous() and torch.equal(strided, offsets)

    def run(boundaries):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = blockattn.block_attention(*leaves, boundaries, block_size=16)
        return [out, *torch.autograd.grad(out, leaves, do)]

    expected = run(offsets)
    layout = blockattn.block_layout(offsets, q.shape[0], 16)
    for boundaries in (strided, blockattn.block_layout(strided, q.shape[0], 16), layout._replace(offsets=strided)):
        for got, want in zip(run(boundaries), expected):
            assert torch.equal(got, want)
    nested = [torch.nested.nested_tensor_from_jagged(t, strided) for t in (q, k, v)]
    out = blockattn.block_attention(*nested, block_size=16)
    assert out.offsets() is nested[0].offsets() and torch.equal(out.values(), expected[0])


def test_second_derivatives(public_calls_on_kernels):
    """The PyTorch path's backward records its graph (a gradient penalty trains through it); the kernels compute
    first-order gradients only, and a second derivative through them raises rather than silently dropping terms."""
    offsets = make_offsets([3, 0, 17])
    q, k, v = (torch.randn(20, h, 16, dtype=torch.float64, requires_grad=True) for h in (2, 1, 1))
    x = torch.randn(20, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4 * 16, dtype=torch.float64, requires_grad=True)
    angles = random_angles(20, 16, torch.float64)
    torch.autograd.gradgradcheck(lambda *t: blockattn.block_attention(*t, offsets, block_size=16, sinu_pos=angles,
                                                                       causal=True), (q, k, v), fast_mode=True)
    torch.autograd.gradgradcheck(lambda x, w: blockattn.qkv_block_attention(x, w, offsets, num_heads=2,
                                                                             num_kv_heads=1, block_size=16), (x, w),
                                 fast_mode=True)
    device = public_calls_on_kernels
    q, k, v = (t.detach().float().to(device).requires_grad_() for t in (q, k, v))
    out = blockattn.block_attention(q, k, v, offsets.to(device), block_size=16)
    dq, = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="first-order gradients only: a second derivative"):
        dq.pow(2).sum().backward()


def record_launches(monkeypatch) -> list[tuple]:
    """The Triton launchers' launches from now on, as ``(kernel, keyword arguments)``; each still runs."""
    launched = []
    launch = triton_ops.launch
    monkeypatch.setattr(triton_ops, "launch",
                        lambda kernel, grid, **kw: launched.append((kernel, kw)) or launch(kernel, grid, **kw))
    return launched


@pytest.mark.parametrize("block_size", [16, 32])
def test_forward_tiles_of_small_blocks(block_size, poisoned_outputs, monkeypatch):
    """16- and 32-token blocks run 4 or 2 to a 64-row tile where ``tiles.blocks_per_tile`` says so (under GQA, with a
    rotary), one a program in the plain forward without GQA: the reference's output either way, on lengths whose
    tiles hold blocks of several sequences, partial blocks and padding slots."""
    launched = record_launches(monkeypatch)
    lengths = odd_lengths(block_size) + [3 * block_size + 7, 1]
    tiles_of = 64 // block_size
    # (heads, head dim, dtype, rotate, blocks a program, heads a program): GQA; a rotary; the plain forward without
    # GQA; a rotary fed fp32 angles on 16-bit inputs at D = 128, 4 heads a program on the angles read once.
    for (hq, hkv), d, dtype, rotate, blocks, heads in (((4, 2), 32, torch.float32, 0, tiles_of, 2),
                                                       ((2, 2), 32, torch.float32, ROTATE_ALL, tiles_of, 1),
                                                       ((2, 2), 32, torch.float32, 0, 1, 1),
                                                       ((4, 4), 128, torch.float16, ROTATE_ALL, tiles_of, 4)):
        q, k, v, do, offsets = random_inputs(lengths, hq, hkv, d, dtype, KERNEL_DEVICE)
        sinu_pos = random_angles(q.shape[0], d, device=KERNEL_DEVICE) if rotate else None
        table = build_block_table(offsets, q.shape[0], block_size)
        out = triton_ops.block_attention_fwd_triton(q, k, v, offsets, table, block_size, d**-0.5, sinu_pos, rotate)
        kw = launched.pop()[1]
        assert (kw["BLOCKS"], kw["HEADS_PER_PROGRAM"]) == (blocks, heads)
        exact = reference_grads(q, k, v, do, offsets, block_size, sinu_pos=sinu_pos, rotate=rotate)[0]
        close = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 4e-3}
        torch.testing.assert_close(out.float(), exact.float(), **close)


@pytest.mark.parametrize("block_size,offsets_dtype", [(16, torch.int32), (64, torch.int64)])
def test_forward_without_a_table(block_size, offsets_dtype, poisoned_outputs):
    """Without a block table (``OffsetsOnly``) each program of the forward finds its block in the offsets: the same
    output, bitwise, as on the table. Odd lengths with empty sequences; more sequences than one chunk of the search
    (``tiles.OFFSETS_CHUNK``), whose blocks the programs past the first chunk's find; packed tiles of small blocks
    (under GQA, with a rotary); int32 and int64 offsets."""
    many = [(i * 7) % 5 for i in range(int(tiles.OFFSETS_CHUNK.value) + 9)] + [block_size + 1]
    for lengths, (hq, hkv), rotate in ((odd_lengths(block_size), (4, 2), 0), (many, (2, 2), 0),
                                       (odd_lengths(block_size) + [0, 5], (2, 2), ROTATE_ALL), ([], (2, 1), 0)):
        q, k, v, _, offsets = random_inputs(lengths, hq, hkv, 32, torch.float32, KERNEL_DEVICE, offsets_dtype)
        sinu_pos = random_angles(q.shape[0], 32, device=KERNEL_DEVICE) if rotate else None
        n = q.shape[0]
        args = (block_size, 32**-0.5, sinu_pos, rotate)
        on_table = triton_ops.block_attention_fwd_triton(q, k, v, offsets, build_block_table(offsets, n, block_size),
                                                         *args)
        searched = triton_ops.block_attention_fwd_triton(
            q, k, v, offsets, OffsetsOnly(max_blocks(n, len(lengths), block_size)), *args)
        assert torch.equal(searched, on_table), f"lengths {lengths}"


@pytest.mark.parametrize("block_size", [16, 64])
def test_backward_without_a_table(block_size, poisoned_outputs, monkeypatch):
    """The Triton backward without a block table (``OffsetsOnly``): each program finds its block in the offsets,
    and the gradients are those on the table, bitwise. Odd lengths with empty sequences, GQA, a rotary, more
    sequences than one chunk of the search; and at 64-token blocks D = 128 in fp16, where on a table the persistent
    kernel would run: it reads the table, so without one the one-block kernel runs (compared with it on the table,
    launched as its own rule launches it)."""
    many = [(i * 7) % 5 for i in range(int(tiles.OFFSETS_CHUNK.value) + 9)] + [block_size + 1]
    cases = [(odd_lengths(block_size), (4, 2), 0, 32, torch.float32, {}),
             (many, (2, 2), 0, 32, torch.float32, {}),
             (odd_lengths(block_size) + [0, 5], (2, 2), ROTATE_ALL, 32, torch.float32, {})]
    if block_size == 64:
        cases += [(odd_lengths(64) + [300, 7], (4, 1), 0, 128, torch.float16, {"chunk": 64, "num_warps": 4}),
                  (odd_lengths(64), (2, 2), 0, 128, torch.float16, {"pipeline_stages": 1})]
    launched = record_launches(monkeypatch)
    for lengths, (hq, hkv), rotate, d, dtype, one_block in cases:
        q, k, v, do, offsets = random_inputs(lengths, hq, hkv, d, dtype, KERNEL_DEVICE)
        sinu_pos = random_angles(q.shape[0], d, device=KERNEL_DEVICE) if rotate else None
        n = q.shape[0]
        grads = []
        for table, overrides in ((build_block_table(offsets, n, block_size), one_block),
                                 (OffsetsOnly(max_blocks(n, len(lengths), block_size)), {})):
            grads.append(tuple(torch.full_like(t, float("nan")) for t in (q, k, v)))
            launched.clear()
            triton_ops.block_attention_bwd_triton(do, q, k, v, offsets, table, block_size, d**-0.5, sinu_pos, rotate,
                                                  PLAIN, grads[-1], **overrides)
        assert [kernel for kernel, _ in launched] == [triton_ops._block_attention_bwd_kernel]
        for name, on_table, searched in zip("qkv", *grads):
            assert torch.equal(searched, on_table), f"d{name}, lengths {lengths}"
    with pytest.raises(ValueError, match="needs a block table"):
        triton_ops.block_attention_bwd_triton(do, q, k, v, offsets, OffsetsOnly(max_blocks(n, len(lengths), 64)), 64,
                                              1.0, None, 0, PLAIN, grads[-1], pipeline_stages=2)


@pytest.mark.parametrize("heads,dtype,options", [((4, 2), torch.float32, False), ((3, 1), torch.float16, True)],
                         ids=["4:2-fp32", "3:1-fp16-options"])
def test_backward_group_split_at_128_token_blocks_past_d128(heads, dtype, options, poisoned_outputs, monkeypatch):
    """At 128-token blocks past D = 128 under GQA the Triton backward runs a program per query head, each reading
    its group's k and v and writing its own share of dk and dv, then sums the shares over the group
    (``splits_group``): within the accuracy contract, with the causal mask and a position bias (its gradient from
    every query head), the gradients written into views of one packed buffer; only there."""
    assert triton_ops.splits_group(128, 136, 2) and triton_ops.splits_group(128, 256, 8)
    assert not (triton_ops.splits_group(128, 128, 2) or triton_ops.splits_group(128, 256, 1)
                or triton_ops.splits_group(64, 256, 2))
    launched = record_launches(monkeypatch)
    hq, hkv = heads
    lengths = odd_lengths(128) if HAS_GPU else [0, 1, 129]  # the interpreter: a full block and two partial ones
    _, _, _, do, offsets = random_inputs(lengths, hq, hkv, 136, dtype, KERNEL_DEVICE)
    n = do.shape[0]
    q, k, v = blockattn.custom_ops.split_heads(torch.randn(n, (hq + 2 * hkv) * 136, dtype=dtype,
                                                           device=KERNEL_DEVICE), hq, hkv)
    packed = tiles.new_output(torch.empty(n, (hq + 2 * hkv) * 136, dtype=dtype, device=KERNEL_DEVICE))
    options = in_block.InBlock(causal=True, pos_bias=torch.randn(hq, 255, device=KERNEL_DEVICE)) if options else PLAIN
    results = run_backend("triton", q, k, v, do, offsets, 128, in_block=options,
                          grads=blockattn.custom_ops.split_heads(packed, hq, hkv))
    assert [kw["HEADS_PER_KV"] for _, kw in launched if "HEADS_PER_KV" in kw] == [hq // hkv]
    assert all(g.data_ptr() == p.data_ptr() for g, p in zip(results[1:4], blockattn.custom_ops.split_heads(packed, hq,
                                                                                                            hkv)))
    assert_within_2x_pytorch(results, q, k, v, do, offsets, 128, in_block=options)


def test_kernels_without_a_table_rule():
    """The Triton forward runs without a table on up to ``FIND_BLOCKS_MAX_SEQS`` sequences and
    ``FIND_BLOCKS_MAX_ELEMENTS`` query elements, one block a program (not on tiles of several), but with a time bias
    (whose buckets' table is built from the block table); so does the
    Triton backward where its one-block kernel runs, not where the persistent one would (64-token blocks, D = 128,
    16-bit, no rotary or in-block option). The Hopper kernels run without one in the backward without GQA, one
    block a program, on as few sequences and without a time bias."""
    call = AttentionCall("fwd", torch.device("cuda"), torch.bfloat16, 4, 4, 128, 64)
    most = triton_ops.FIND_BLOCKS_MAX_SEQS
    finds = backends.BACKENDS["triton"].finds_blocks
    assert finds(call, 0, 1) and finds(call, most, 1) and not finds(call, most + 1, 1)
    tokens = triton_ops.FIND_BLOCKS_MAX_ELEMENTS // (call.num_heads * call.head_dim)
    assert finds(call, most, tokens) and not finds(call, 1, tokens + 1)
    assert finds(replace(call, block_size=16), 1, 1) and not finds(replace(call, block_size=16, num_kv_heads=2), 1, 1)
    assert finds(replace(call, in_block=in_block.CAUSAL.value | in_block.POS_BIAS.value | in_block.DROPOUT.value), 1, 1)
    assert not finds(replace(call, in_block=in_block.TIME_BIAS.value), 1, 1)
    backward = replace(call, pass_name="bwd")
    assert not finds(backward, 1, 1) and not finds(replace(backward, num_kv_heads=2), 1, 1)  # the persistent kernel's
    for one_block in ({"head_dim": 64}, {"rotate": ROTATE_ALL}, {"in_block": in_block.CAUSAL.value},
                      {"dtype": torch.float32}, {"block_size": 16, "num_kv_heads": 2}):
        changed = replace(backward, **one_block)
        assert finds(changed, most, 1) and not finds(changed, most + 1, 1)
    assert not finds(replace(backward, head_dim=64, in_block=in_block.TIME_BIAS.value), 1, 1)
    hopper = backends.BACKENDS["sm90-gluon"].finds_blocks
    assert hopper(backward, most, 1) and not hopper(backward, most + 1, 1) and not hopper(call, 1, 1)
    assert hopper(backward, 1, tokens) and not hopper(backward, 1, tokens + 1)
    assert hopper(replace(backward, in_block=in_block.CAUSAL.value | in_block.POS_BIAS.value, rotate=ROTATE_ALL), 1, 1)
    assert not hopper(replace(backward, in_block=in_block.TIME_BIAS.value), 1, 1)
    assert not hopper(replace(backward, num_kv_heads=2), 1, 1) and not hopper(replace(backward, block_size=16), 1, 1)
    assert backends.BACKENDS["torch"].finds_blocks is None


def test_small_blocks_tile_rule():
    """``tiles.blocks_per_tile`` packs 16- and 32-token blocks where it measured faster (its docstring): under GQA
    the backward and the forward up to D = 128; without GQA the rotary forward and the backward, but for the rotary
    from D = 4 * block_size; never with an in-block option. The table's slots come in whole groups, so that a
    tile's blocks never lie past them."""
    rule = tiles.blocks_per_tile
    for bs in (16, 32):
        packed = [rule(bs, 64, 2, False, 0, False), rule(bs, 128, 8, True, 0, False), rule(bs, 256, 4, True, 0, True),
                  rule(bs, 64, 1, True, 0, False), rule(bs, 256, 1, False, 0, True), rule(bs, 32, 1, True, 0, True),
                  rule(bs, 2 * bs, 1, True, 0, True)]
        assert packed == [64 // bs] * len(packed)
        alone = [rule(bs, 32, 1, False, 0, False), rule(bs, 256, 2, False, 0, False), rule(bs, 4 * bs, 1, True, 0, True),
                 rule(bs, 64, 2, False, 1, False), rule(bs, 64, 2, True, 8, True)]
        assert alone == [1] * len(alone)
    assert rule(64, 64, 2, False, 0, False) == rule(128, 32, 2, True, 0, True) == 1
    for n, b, bs in ((0, 0, 16), (5, 1, 16), (1000, 7, 32), (77, 3, 64), (64, 1, 64)):
        slots = max_blocks(n, b, bs)
        assert slots % SLOT_GROUP == 0 and 0 <= slots - (n + b * (bs - 1)) // bs < SLOT_GROUP
    assert SLOT_GROUP % (tiles.TILE_ROWS // min(BLOCK_SIZES)) == 0


@pytest.mark.parametrize(
    "block_size,head_dim,hq,hkv",
    [(16, 16, 1, 1), (32, 24, 3, 3), (16, 40, 2, 1), (64, 64, 2, 2), (16, 256, 2, 2), (32, 200, 4, 1),
     (64, 128, 2, 2), (64, 128, 4, 2), (64, 72, 1, 1), (128, 96, 2, 2), (64, 256, 1, 1), (128, 128, 4, 1),
     (64, 256, 2, 1)],
)
def test_kernels_head_dims(block_size, head_dim, hq, hkv, poisoned_outputs):
    q, k, v, do, offsets = random_inputs(odd_lengths(block_size), hq, hkv, head_dim, torch.float16, KERNEL_DEVICE)
    assert_within_2x_pytorch(run_kernels(q, k, v, do, offsets, block_size), q, k, v, do, offsets, block_size)


def test_kernels_split_head_dim(poisoned_outputs):
    """BS * D above the register budget: both kernels work on head-dim slices."""
    assert triton_ops.kernel_config(128, 256, backward=False)["NUM_CHUNKS"] > 1
    q, k, v, do, offsets = random_inputs([130, 5], 2, 1, 136, torch.float16, KERNEL_DEVICE)
    assert_within_2x_pytorch(run_kernels(q, k, v, do, offsets, 128), q, k, v, do, offsets, 128)


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1)], ids=["mha", "gqa"])
@pytest.mark.parametrize("grad_layout", ["same", "transposed"])
def test_kernels_persistent_backward(grad_layout, hq, hkv, poisoned_outputs):
    """64-token blocks at D = 128: the backward loops over many (block, kv head) items per program, pipelined,
    accumulating dk and dv over a GQA group's steps, when q and dq share one layout and k, v, dk, dv another; a
    grad_out with its own strides gets its own tile of offsets."""
    assert triton_ops.kernel_config(64, 128, backward=True, group=hq // hkv)["PIPELINE_STAGES"] > 1
    q, k, v, do, offsets = random_inputs(odd_lengths(64) + [300, 7, 129], hq, hkv, 128, torch.float16,
                                         KERNEL_DEVICE)
    if grad_layout == "transposed":
        do = do.transpose(0, 1).contiguous().transpose(0, 1)
    assert_within_2x_pytorch(run_kernels(q, k, v, do, offsets, 64), q, k, v, do, offsets, 64)


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_lean_config_adds_nothing_that_holds_shared_memory(backward):
    """``kernel_config(lean=True)``, where the launchers go when the GPU cannot run the rule's program: one query head
    a program, no pipelined loop, slices of at most 64 x 128 elements (64 x 64 in the backward), over every block
    size, head dim, GQA group, dtype, angles and in-block option the rules tell apart."""
    for block_size, head_dim, group, element_size, rotary, fp32_angles, bits, blocks in itertools.product(
            (16, 64, 128), (16, 32, 64, 96, 128, 256), (1, 2, 8), (1, 2, 4), (False, True), (False, True), (0, 7),
            (1, 4)):
        if blocks > 1 and block_size != 64 or (backward and element_size == 1):
            continue
        args = {"group": group, "element_size": element_size, "rotary": rotary, "in_block_bits": bits,
                "num_heads": 8, "fp32_angles": fp32_angles, "blocks": blocks}
        lean = triton_ops.kernel_config(block_size, head_dim, backward, lean=True, **args)
        assert (lean["HEADS_PER_PROGRAM"], lean["GROUP_STAGES"], lean["PIPELINE_STAGES"], lean["MAXNREG"]) == \
               (1, 1, 1, None), (block_size, head_dim, args)
        assert block_size * lean["CHUNK"] <= (64 * 64 if backward else 64 * 128), (block_size, head_dim, args)


FWD, BWD = triton_ops._block_attention_fwd_kernel, triton_ops._block_attention_bwd_kernel
PERSISTENT = triton_ops._block_attention_bwd_persistent_kernel


@pytest.mark.parametrize("hq,hkv,head_dim,fallbacks", [
    (4, 1, 64, [((FWD, None), (FWD, None)), ((BWD, None), (BWD, None))]),
    (2, 2, 128, [((PERSISTENT, 3), (BWD, None))]),
    (4, 2, 128, [((FWD, None), (FWD, None)), ((PERSISTENT, 3), (PERSISTENT, 2))]),
], ids=["gqa-d64", "mha-d128", "gqa-d128"])
def test_launchers_fall_back_where_the_gpu_cannot_run_the_rule(hq, hkv, head_dim, fallbacks, monkeypatch,
                                                              poisoned_outputs):
    """Where the GPU cannot run the rule's program (Triton's ``OutOfResources`` at its first launch: the pipelined
    backward's 144-160 KiB of shared memory on sm_86, which gives 99), the launchers fall back to ``kernel_config``'s
    lean configuration, under GQA the persistent backward to two stages first. Here every launch of more than one
    head a program, a GQA loop pipelined or the persistent kernel three stages deep is refused as a GPU would refuse
    it: GQA 4:1 at D = 64 (the forward's group in a program, the backward's loop two stages deep), D = 128 (the
    persistent backward; under GQA 2:1 the forward's group too). ``fallbacks``: (kernel, stages) refused, then the
    (kernel, stages) that ran. A launch tuned by hand is not changed: its error reaches the caller."""
    launches = []

    def launch_refusing_rich_programs(kernel, grid, **kwargs):
        stages = kwargs.get("PIPELINE_STAGES")
        rich = kwargs.get("HEADS_PER_PROGRAM", 1) > 1 or kwargs.get("GROUP_STAGES", 1) > 1 or stages == 3
        launches.append(((kernel, stages), not rich))
        if rich:
            raise OutOfResources(160 * 1024, 99 * 1024, "shared memory")
        launch(kernel, grid, **kwargs)

    monkeypatch.setattr(triton_ops, "launch", launch_refusing_rich_programs)
    q, k, v, do, offsets = random_inputs(odd_lengths(64) + [130], hq, hkv, head_dim, torch.float16, KERNEL_DEVICE)
    assert_within_2x_pytorch(run_kernels(q, k, v, do, offsets, 64), q, k, v, do, offsets, 64)
    for refused, fallback in fallbacks:
        assert launches[launches.index((refused, False)) + 1] == (fallback, True)
    table = build_block_table(offsets, q.shape[0], 64)
    with pytest.raises(OutOfResources):
        if head_dim == 64:
            triton_ops.block_attention_fwd_triton(q, k, v, offsets, table, 64, 0.125, None, 0, heads_per_program=4)
        else:
            triton_ops.block_attention_bwd_triton(do, q, k, v, offsets, table, 64, 0.125, None, 0, PLAIN,
                                                  tuple(map(torch.empty_like, (q, k, v))), pipeline_stages=3)


@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
@pytest.mark.parametrize("chunk", [32, 64])
def test_backward_chunk_override(chunk, rotary):
    """The tuning overrides of the backward's head-dim slice (one or two slices, under GQA), of the GQA loop's
    pipelining and of the persistent kernel's depth give the default launch's gradients; widths the kernels cannot
    take, and the persistent kernel with a rotary or with one-block overrides, are refused."""
    q, k, v, do, offsets = random_inputs(odd_lengths(16), 4, 2, 64, torch.float16, KERNEL_DEVICE)
    sinu_pos, rotate = (random_angles(q.shape[0], 64, device=KERNEL_DEVICE), ROTATE_ALL) if rotary else (None, 0)
    table = build_block_table(offsets, q.shape[0], 16)

    def grads(**override):
        out = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        triton_ops.block_attention_bwd_triton(do, q, k, v, offsets, table, 16, 0.125, sinu_pos, rotate, PLAIN, out,
                                              **override)
        return out

    default = grads()  # one 64-wide slice, the group's loop two stages deep (one without a rotary)
    overrides = [{"chunk": chunk, "group_stages": 1}, {"chunk": chunk, "group_stages": 3}]
    if not rotary:
        overrides.append({"pipeline_stages": 2})
    for override in overrides:
        for got, want in zip(grads(**override), default):
            torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    for bad in (8 if not rotary else 16, 48, 128):
        with pytest.raises(ValueError, match="chunk must be a power of two"):
            grads(chunk=bad)
    with pytest.raises(ValueError, match="takes no rotary"):
        grads(pipeline_stages=2, **({} if rotary else {"chunk": chunk}))
    with pytest.raises(ValueError, match="group_stages must be at least 1"):
        grads(group_stages=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_forward_heads_per_program_override(dtype):
    """Under GQA the forward's rule runs a kv head's group of query heads in one program at 64-token blocks, and at
    128-token blocks up to D = 64 (k and v read, and turned by a rotary, once); one program per query head gives the
    same output, here on 64-row tiles of 16-token blocks and on 128-token blocks through the override. Other counts,
    and the group where the head dim takes several slices, are refused before any launch."""
    assert triton_ops.kernel_config(64, 128, backward=False, group=2)["HEADS_PER_PROGRAM"] == 2
    # At 128-token blocks the group takes a program on 32- and 64-wide tiles, 16-bit, without in-block options (a
    # rotary pads D = 16 to 32); one program per query head elsewhere
    for head_dim, rotary, stages in ((64, False, 2), (24, False, 2), (64, True, 1), (16, True, 1)):
        cfg = triton_ops.kernel_config(128, head_dim, backward=False, group=2, rotary=rotary)
        assert (cfg["HEADS_PER_PROGRAM"], cfg["GROUP_STAGES"], cfg["NUM_WARPS"]) == (2, stages, 4)
    for other in ({"head_dim": 128}, {"head_dim": 16}, {"element_size": 4}, {"in_block_bits": 1}):
        assert triton_ops.kernel_config(**{"block_size": 128, "head_dim": 64, "backward": False, "group": 2,
                                           **other})["HEADS_PER_PROGRAM"] == 1, other
    # The group's loop pipelined four deep, but for 16-bit groups of up to 4 heads at D = 128 without a rotary
    # (measured slower there)
    stages = {(group, d, size): triton_ops.kernel_config(64, d, backward=False, group=group,
                                                         element_size=size)["GROUP_STAGES"]
              for group in (1, 2, 4, 8) for d in (64, 128) for size in (1, 2)}
    assert stages.pop((2, 128, 2)) == stages.pop((4, 128, 2)) == 1
    assert stages.pop((1, 64, 1)) == stages.pop((1, 64, 2)) == 1
    assert stages.pop((1, 128, 1)) == stages.pop((1, 128, 2)) == 1 and set(stages.values()) == {4}
    assert triton_ops.kernel_config(64, 128, backward=False, group=8, in_block_bits=1)["GROUP_STAGES"] == 1
    assert triton_ops.kernel_config(64, 128, backward=False, group=4, rotary=True)["GROUP_STAGES"] == 4

    inputs = {d: random_inputs(odd_lengths(16), 4, 2, d, dtype, KERNEL_DEVICE) for d in (64, 128)}

    def forward(head_dim=64, block_size=16, sinu_pos=None, rotate=0, **override):
        q, k, v, _, offsets = inputs[head_dim]
        table = build_block_table(offsets, q.shape[0], block_size)
        return triton_ops.block_attention_fwd_triton(q, k, v, offsets, table, block_size, 0.125, sinu_pos, rotate,
                                                     **override)

    torch.testing.assert_close(forward(), forward(heads_per_program=1))
    # On a GPU the two launches may round a few fp16 rotated operands, and so a few outputs, the other way (4 of
    # 22 784 outputs by up to 6e-5 on an H100).
    close = {"atol": 1e-3, "rtol": 1e-3} if dtype == torch.float16 else {}
    q, k, v, _, offsets = random_inputs(odd_lengths(128), 4, 2, 32, dtype, KERNEL_DEVICE)
    table = build_block_table(offsets, q.shape[0], 128)
    for angles, rotate in ((None, 0), (random_angles(q.shape[0], 32, device=KERNEL_DEVICE), ROTATE_ALL)):
        torch.testing.assert_close(*(triton_ops.block_attention_fwd_triton(q, k, v, offsets, table, 128, 0.125,
                                                                           angles, rotate, heads_per_program=heads)
                                     for heads in (2, 1)), **close)
    torch.testing.assert_close(forward(heads_per_program=2, group_stages=1), forward(heads_per_program=1))
    with pytest.raises(ValueError, match="group_stages must be at least 1"):
        forward(group_stages=0)
    angles = random_angles(sum(odd_lengths(16)), 64, device=KERNEL_DEVICE)
    torch.testing.assert_close(forward(sinu_pos=angles, rotate=ROTATE_ALL),
                               forward(sinu_pos=angles, rotate=ROTATE_ALL, heads_per_program=1), **close)
    for bad in (3, 4):
        with pytest.raises(ValueError, match="heads_per_program must be 1, or, where one head-dim slice"):
            forward(heads_per_program=bad)
    # Without GQA: any divisor of the heads, each with its own k and v (with a rotary on angles read once).
    mha = random_inputs(odd_lengths(16), 4, 4, 64, dtype, KERNEL_DEVICE)
    q, k, v, _, offsets = mha
    table = build_block_table(offsets, q.shape[0], 16)

    def mha_forward(sinu_pos=angles, rotate=ROTATE_ALL, **override):
        return triton_ops.block_attention_fwd_triton(q, k, v, offsets, table, 16, 0.125, sinu_pos, rotate,
                                                     **override)
    for heads, stages in ((2, 2), (4, 1), (4, 4)):
        torch.testing.assert_close(mha_forward(heads_per_program=heads, group_stages=stages), mha_forward(), **close)
        torch.testing.assert_close(mha_forward(None, 0, heads_per_program=heads, group_stages=stages),
                                   mha_forward(None, 0, heads_per_program=1))
    with pytest.raises(ValueError, match="a divisor of the 4 heads; got 3"):
        mha_forward(heads_per_program=3)
    with pytest.raises(ValueError, match="a divisor of the 4 heads; got 3"):
        mha_forward(None, 0, heads_per_program=3)
    assert triton_ops.kernel_config(128, 128, backward=False, group=2)["NUM_CHUNKS"] > 1
    with pytest.raises(ValueError, match="heads_per_program"):
        forward(head_dim=128, block_size=128, heads_per_program=2)


def launched_forward_config(block_size, head_dim, group=1, rotary=False, in_block_bits=0, **kwargs):
    """``kernel_config`` as the forward's launcher asks it: 16- and 32-token blocks in the 64-row tiles where
    ``tiles.blocks_per_tile`` packs them."""
    blocks = tiles.blocks_per_tile(block_size, head_dim, group, rotary, in_block_bits, backward=False)
    return triton_ops.kernel_config(block_size * blocks, head_dim, backward=False, group=group, rotary=rotary,
                                    in_block_bits=in_block_bits, blocks=blocks, **kwargs)


def test_forward_rotary_four_heads_per_program_without_gqa():
    """Without GQA, a 16-bit rotary forward at 64-token blocks and D = 128 fed fp32 angles, or at 128-token blocks
    and D = 64 fed angles in the inputs' dtype (no option), runs up to 4 query heads a program, two stages deep, 4
    warps (measured faster on an H100 and an H200, the second on an H200); elsewhere one, or the rule of
    ``test_forward_rotary_heads_per_program_on_narrow_tiles``. The rule's launch gives the output of one head a
    program."""
    def rule(**changes):
        args = {"rotary": True, "fp32_angles": True, "num_heads": 8, "element_size": 2, "in_block_bits": 0,
                "head_dim": 128, "block_size": 64} | changes
        cfg = triton_ops.kernel_config(args.pop("block_size"), args.pop("head_dim"), backward=False, **args)
        return cfg["HEADS_PER_PROGRAM"], cfg["GROUP_STAGES"]
    assert rule() == (4, 2) and rule(num_heads=12) == (4, 2)
    # 128-token blocks at D = 64: angles in the inputs' dtype take this rule, fp32 angles up to 8 heads (below)
    assert rule(block_size=128, head_dim=64, fp32_angles=False) == (4, 2)
    assert rule(block_size=128, head_dim=64) == (8, 3)
    # 4 warps where a program runs several heads; one head (5 heads: no divisor up to 4) keeps 8
    assert [triton_ops.kernel_config(128, 64, backward=False, rotary=True, num_heads=heads)["NUM_WARPS"]
            for heads in (8, 5)] == [4, 8]
    assert rule(num_heads=3) == (3, 2) and rule(num_heads=6) == (3, 2) and rule(num_heads=2) == (2, 2)
    assert rule(num_heads=5) == (1, 1) and rule(num_heads=1) == (1, 1)
    for other in ({"fp32_angles": False}, {"block_size": 32}, {"block_size": 128},
                  {"block_size": 128, "head_dim": 32}, {"element_size": 4}, {"in_block_bits": in_block.CAUSAL.value},
                  {"rotary": False}):
        assert rule(**other) == (1, 1), other

    q, k, v, _, offsets = random_inputs([70, 1, 130], 4, 4, 128, torch.float16, KERNEL_DEVICE)
    table = build_block_table(offsets, q.shape[0], 64)
    angles = random_angles(q.shape[0], 128, torch.float32, KERNEL_DEVICE)

    def forward(**override):
        return triton_ops.block_attention_fwd_triton(q, k, v, offsets, table, 64, 0.125, angles, ROTATE_ALL,
                                                     **override)
    # On a GPU the two launches may round a few fp16 outputs the other way (one unit in the last place).
    torch.testing.assert_close(forward(), forward(heads_per_program=1), atol=1e-3, rtol=1e-3)
    q, k, v, _, offsets = random_inputs([200, 1, 128], 4, 4, 64, torch.float16, KERNEL_DEVICE)
    table = build_block_table(offsets, q.shape[0], 128)
    angles = random_angles(q.shape[0], 64, torch.float32, KERNEL_DEVICE)
    torch.testing.assert_close(*(triton_ops.block_attention_fwd_triton(q, k, v, offsets, table, 128, 0.125, angles,
                                                                       ROTATE_ALL, heads_per_program=heads)
                                 for heads in (None, 1)), atol=1e-3, rtol=1e-3)


def test_forward_rotary_heads_per_program_on_narrow_tiles():
    """Without GQA and options, the rotary forward runs up to 8 query heads a program three stages deep, on the
    tile's angles read once: on 64-row tiles (64-token blocks, and 16- and 32-token blocks four or two to a tile)
    for fp8 inputs up to D = 128, and for 16-bit inputs up to D = 64 with fp32 angles or at D = 32 on packed tiles;
    at 128-token blocks and D = 64 with fp32 angles (8 warps) where a program may take 144 KiB of shared memory
    (measured faster on an H200); elsewhere the rules before. The rule's launch gives the output of one head a
    program, on odd lengths, 16-bit and fp8, both kinds of angles."""
    def rule(**changes):
        args = {"rotary": True, "fp32_angles": True, "num_heads": 8, "element_size": 2, "in_block_bits": 0,
                "head_dim": 64, "block_size": 16} | changes
        cfg = launched_forward_config(args.pop("block_size"), args.pop("head_dim"), **args)
        return cfg["HEADS_PER_PROGRAM"], cfg["GROUP_STAGES"], cfg["NUM_WARPS"]
    assert rule() == rule(block_size=32) == rule(block_size=64) == rule(head_dim=32) == (8, 3, 4)
    assert rule(head_dim=16) == rule(head_dim=40) == (8, 3, 4)  # padded to 32 and 64
    assert rule(element_size=1) == rule(element_size=1, fp32_angles=False, block_size=64) == (8, 3, 4)
    assert rule(element_size=1, head_dim=128) == rule(element_size=1, head_dim=96, fp32_angles=False) == (8, 3, 4)
    assert rule(block_size=128) == (8, 3, 8)
    assert rule(fp32_angles=False, head_dim=32) == rule(fp32_angles=False, head_dim=32, block_size=32) == (8, 3, 4)
    assert rule(num_heads=12)[0] == 6 and rule(num_heads=5)[0] == 5 and rule(num_heads=7) == (7, 3, 4)
    assert rule(num_heads=11) == (1, 1, 4)
    # 144 KiB of shared memory at 128-token blocks: a GPU with less (sm_86, sm_89) keeps 4 heads, two stages
    assert rule(block_size=128, shared_memory=144 * 1024) == (8, 3, 8)
    assert rule(block_size=128, shared_memory=99 * 1024) == rule(block_size=128, fp32_angles=False) == (4, 2, 4)
    # 64-row tiles take at most 88 KiB (sm_86 and sm_90, triton 3.9)
    assert rule(shared_memory=99 * 1024) == (8, 3, 4)
    for other, before in (({"fp32_angles": False}, (1, 1, 4)),
                          ({"fp32_angles": False, "head_dim": 32, "block_size": 64}, (1, 1, 4)),
                          ({"head_dim": 128}, (4, 2, 4)), ({"block_size": 128, "head_dim": 32}, (1, 1, 8)),
                          ({"block_size": 128, "element_size": 1}, (1, 1, 8)),
                          ({"element_size": 1, "head_dim": 256}, (1, 1, 4)), ({"element_size": 4}, (1, 1, 4)),
                          ({"in_block_bits": in_block.CAUSAL.value}, (1, 1, 4))):
        assert rule(**other) == before, other

    for block_size, head_dim, heads, dtype, angle_dtype in (
            (16, 32, 8, torch.float16, torch.float32), (32, 32, 4, torch.float16, torch.float16),
            (64, 64, 6, torch.float16, torch.float32), (128, 64, 4, torch.float16, torch.float32),
            (128, 64, 4, torch.float16, torch.float16),  # the 4-heads rule
            (32, 128, 4, torch.float8_e4m3fn, torch.float32), (16, 64, 4, torch.float8_e4m3fn, torch.bfloat16)):
        q, k, v, _, offsets = random_inputs(odd_lengths(block_size), heads, heads, head_dim, torch.float16,
                                            KERNEL_DEVICE)
        table = build_block_table(offsets, q.shape[0], block_size)
        angles = random_angles(q.shape[0], head_dim, angle_dtype, KERNEL_DEVICE)
        scales = None
        if dtype == torch.float8_e4m3fn:
            (q, qs), (k, ks), (v, vs) = (quantised_fp8(t) for t in (q, k, v))
            scales = fp8.Fp8Scales(qs, ks, vs, torch.bfloat16)
        assert rule(block_size=block_size, head_dim=head_dim, num_heads=heads, element_size=q.element_size(),
                    fp32_angles=angle_dtype == torch.float32)[0] == heads
        # On a GPU the two launches may round a few outputs the other way (one unit in the last place: fp16, or
        # the bf16 output of fp8 inputs).
        unit = 1e-3 if scales is None else 1e-2
        torch.testing.assert_close(*(triton_ops.block_attention_fwd_triton(q, k, v, offsets, table, block_size, 0.125,
                                                                           angles, ROTATE_ALL, PLAIN, scales,
                                                                           heads_per_program=per)
                                     for per in (None, 1)), atol=unit, rtol=unit)


def test_forward_rules_fit_99_kib_of_shared_memory():
    """Where a GPU's programs may take about 99 KiB of shared memory (sm_86, sm_89), the forward rules that take more
    give way (the compiled kernels' shared memory, offline; triton 3.6 for sm_90, 3.9 for sm_86): the 16-bit rotary
    forward under GQA past D = 128 at 64-token blocks (the group in a program: 128 KiB on sm_90, 112 on sm_86) to
    two head-dim slices and a program per query head (32 and 24 KiB); the rotary's 8 heads at 128-token blocks and
    D = 64 (144 and 120 KiB) to 4 heads two stages deep (96 and 72 KiB). Hopper's 227 KiB, and no limit (Triton's
    interpreter), keep the rules."""
    def cfg(block_size, head_dim, group, shared_memory):
        c = triton_ops.kernel_config(block_size, head_dim, backward=False, group=group, rotary=True,
                                     fp32_angles=True, num_heads=8, shared_memory=shared_memory)
        return c["HEADS_PER_PROGRAM"], c["NUM_CHUNKS"], c["NUM_WARPS"], c["GROUP_STAGES"]
    small, hopper = 99 * 1024, 227 * 1024
    for group in (2, 4, 8):
        assert cfg(64, 256, group, None) == cfg(64, 256, group, hopper) == (group, 1, 8, 2)
        assert cfg(64, 256, group, small) == (1, 2, 8, 1)
    # One 16- or 32-token block a program takes the group in 20-40 KiB: kept
    assert cfg(32, 256, 4, small) == cfg(32, 256, 4, None) == (4, 1, 4, 1)
    assert cfg(128, 64, 1, None) == cfg(128, 64, 1, hopper) == (8, 1, 8, 3)
    assert cfg(128, 64, 1, small) == (4, 1, 4, 2)


def test_forward_heads_per_program_without_gqa_on_small_tiles():
    """The plain forward without GQA runs up to 4 query heads a program four stages deep at 16- and 32-token blocks
    (D = 32 to 128) and at 64-token blocks with D = 32 (fp8 also D = 64), up to 8 at 16-token blocks with D = 32
    and for fp8 at 16- and 32-token blocks (measured faster on an H200); elsewhere one. The rule's launch gives the
    output of one head a program, on odd lengths."""
    def rule(**changes):
        args = {"num_heads": 8, "element_size": 2, "head_dim": 64, "block_size": 32} | changes
        cfg = triton_ops.kernel_config(args.pop("block_size"), args.pop("head_dim"), backward=False, **args)
        return cfg["HEADS_PER_PROGRAM"], cfg["GROUP_STAGES"], cfg["NUM_WARPS"]
    assert rule() == rule(block_size=16) == rule(head_dim=128) == rule(block_size=64, head_dim=32) == (4, 4, 4)
    assert rule(head_dim=40) == rule(head_dim=24) == (4, 4, 4)  # padded to 64 and 32
    assert rule(block_size=16, head_dim=32) == (8, 4, 4) and rule(block_size=16, head_dim=32, num_heads=12)[0] == 6
    assert rule(num_heads=6)[0] == 3 and rule(num_heads=2)[0] == 2 and rule(num_heads=1)[0] == 1
    assert rule(num_heads=5) == (1, 1, 4)
    assert rule(element_size=1) == rule(element_size=1, block_size=16, head_dim=128) == (8, 4, 4)
    assert rule(element_size=1, block_size=64) == (4, 4, 4) and rule(element_size=1, block_size=64, head_dim=128)[0] == 1
    for other in ({"block_size": 64}, {"block_size": 128, "head_dim": 32}, {"head_dim": 256}, {"head_dim": 16},
                  {"element_size": 4}, {"in_block_bits": in_block.CAUSAL.value}, {"group": 2}, {"rotary": True}):
        assert rule(**other)[:2] != (4, 4), other

    for block_size, head_dim, heads in ((16, 32, 8), (32, 64, 6), (64, 32, 4)):
        q, k, v, _, offsets = random_inputs(odd_lengths(block_size), heads, heads, head_dim, torch.float16,
                                            KERNEL_DEVICE)
        table = build_block_table(offsets, q.shape[0], block_size)
        assert triton_ops.kernel_config(block_size, head_dim, backward=False, num_heads=heads)[
            "HEADS_PER_PROGRAM"] > 1
        torch.testing.assert_close(*(triton_ops.block_attention_fwd_triton(q, k, v, offsets, table, block_size,
                                                                           0.125, None, 0, heads_per_program=per)
                                     for per in (None, 1)))


def test_forward_rotary_pair_of_heads_runs_one_stage_under_a_cap():
    """Under GQA of two query heads a kv head, the 16-bit rotary forward with fp32 angles at 64-token blocks and
    D = 128 (no in-block option) runs its pair of heads in one stage under a cap of 168 registers (measured faster on
    an H200); elsewhere no cap of this rule, 16- and 32-token blocks in 64-row tiles included (not measured). The
    rule's launch gives the output of the uncapped four-stage one."""
    def rule(**changes):
        args = {"rotary": True, "fp32_angles": True, "group": 2, "element_size": 2, "in_block_bits": 0,
                "head_dim": 128, "block_size": 64} | changes
        cfg = launched_forward_config(args.pop("block_size"), args.pop("head_dim"), **args)
        return cfg["HEADS_PER_PROGRAM"], cfg["GROUP_STAGES"], cfg["MAXNREG"]
    assert rule() == (2, 1, 168)
    for other in ({"fp32_angles": False}, {"group": 4}, {"group": 1}, {"head_dim": 64}, {"block_size": 32},
                  {"block_size": 16}, {"element_size": 1}, {"in_block_bits": in_block.CAUSAL.value},
                  {"rotary": False}):
        assert rule(**other)[2] is None, other

    q, k, v, _, offsets = random_inputs(odd_lengths(64), 4, 2, 128, torch.float16, KERNEL_DEVICE)
    table = build_block_table(offsets, q.shape[0], 64)
    angles = random_angles(q.shape[0], 128, torch.float32, KERNEL_DEVICE)

    def forward(**override):
        return triton_ops.block_attention_fwd_triton(q, k, v, offsets, table, 64, 0.125, angles, ROTATE_ALL,
                                                     **override)
    torch.testing.assert_close(forward(), forward(group_stages=4, maxnreg=255), atol=1e-3, rtol=1e-3)


def test_forward_rotary_past_d128_runs_the_group_on_whole_rows():
    """The 16-bit rotary forward under GQA past D = 128 (16- to 64-token blocks, no in-block option) runs whole rows
    and the group in a program: 8 warps and two stages at 64-token blocks, 4 warps and one stage below (measured
    faster on an H100 and an H200); elsewhere 128-column slices and a program per query head. The rule's launch
    gives the output of one head a program, here at D = 192 (columns past the head dim masked) on odd lengths."""
    def rule(block_size=64, head_dim=256, group=4, **changes):
        args = {"rotary": True, "element_size": 2, "in_block_bits": 0} | changes
        cfg = triton_ops.kernel_config(block_size, head_dim, backward=False, group=group, **args)
        return cfg["CHUNK"], cfg["HEADS_PER_PROGRAM"], cfg["NUM_WARPS"], cfg["GROUP_STAGES"]
    assert rule() == rule(head_dim=192) == (256, 4, 8, 2)
    assert rule(block_size=16) == rule(block_size=32) == (256, 4, 4, 1)
    assert rule(block_size=32, group=2) == (256, 2, 4, 1)
    for other in ({"rotary": False}, {"element_size": 1}, {"in_block_bits": in_block.CAUSAL.value}, {"group": 1},
                  {"block_size": 128}):
        assert rule(**other)[1] == 1, other
    assert rule(head_dim=128)[:2] == (128, 4) and rule(block_size=16, head_dim=128)[1] == 1  # the rules up to 128

    q, k, v, _, offsets = random_inputs(odd_lengths(16), 4, 2, 192, torch.float16, KERNEL_DEVICE)
    angles = random_angles(q.shape[0], 192, torch.float32, KERNEL_DEVICE)

    def forward(block_size, **override):
        table = build_block_table(offsets, q.shape[0], block_size)
        return triton_ops.block_attention_fwd_triton(q, k, v, offsets, table, block_size, 0.125, angles, ROTATE_ALL,
                                                     **override)
    for block_size in (16, 64):
        # On a GPU the two launches may round a few fp16 outputs the other way.
        torch.testing.assert_close(forward(block_size), forward(block_size, heads_per_program=1), atol=1e-3,
                                   rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_torch_path_odd_lengths_gqa(block_size, dtype, poisoned_outputs):
    q, k, v, do, offsets = random_inputs(odd_lengths(block_size), 6, 2, 24, dtype, "cpu", torch.int64)
    assert_within_2x_pytorch(run_torch_path(q, k, v, do, offsets, block_size), q, k, v, do, offsets, block_size)


@pytest.mark.parametrize("runner", [run_kernels, run_torch_path], ids=["kernels", "torch"])
@pytest.mark.parametrize("lengths", [[], [0], [0, 0, 0], [1], [5, 0]], ids=str)
def test_empty_and_tiny(runner, lengths):
    device = KERNEL_DEVICE if runner is run_kernels else "cpu"
    q, k, v, do, offsets = random_inputs(lengths, 2, 1, 16, torch.float16, device)
    results = runner(q, k, v, do, offsets, 16)
    for got, ref in zip(results, reference_grads(q, k, v, do, offsets, 16)):
        assert got.shape == ref.shape and got.dtype == q.dtype
        torch.testing.assert_close(got.double().cpu(), ref.cpu(), atol=2e-3, rtol=2e-3)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 70), min_size=1, max_size=5),
    block_size=st.sampled_from([16, 32, 64]),
    heads=st.sampled_from([(1, 1), (2, 1), (3, 3), (4, 2)]),
    head_dim=st.sampled_from([16, 32, 48]),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernels_random_shapes(lengths, block_size, heads, head_dim, seed):
    torch.manual_seed(seed)
    q, k, v, do, offsets = random_inputs(lengths, *heads, head_dim, torch.float16, KERNEL_DEVICE)
    assert_within_2x_pytorch(run_kernels(q, k, v, do, offsets, block_size), q, k, v, do, offsets, block_size)


def test_kernels_strided_inputs(poisoned_outputs):
    """q, k, v as views into one packed [N, 3, H, D] buffer (non-contiguous rows) and a stride-0 grad_out."""
    lengths = [20, 33]
    n, h, d = sum(lengths), 2, 32
    packed = torch.randn(n, 3, h, d, dtype=torch.float16, device=KERNEL_DEVICE)
    q, k, v = packed.unbind(1)
    do = torch.randn(1, 1, 1, dtype=torch.float16, device=KERNEL_DEVICE).expand(n, h, d)
    offsets = make_offsets(lengths, KERNEL_DEVICE)
    assert_within_2x_pytorch(run_kernels(q, k, v, do, offsets, 16), q, k, v, do, offsets, 16)


def test_custom_scale():
    q, k, v, _do, offsets = random_inputs([40, 7], 2, 2, 16, torch.float32, "cpu")
    out = blockattn.block_attention(q, k, v, offsets, block_size=16, scale=0.3)
    ref = block_attention_reference(q, k, v, offsets, block_size=16, scale=0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_public_op_autograd_cpu(offsets_dtype):
    q, k, v, do, offsets = random_inputs(odd_lengths(32), 4, 1, 32, torch.float32, "cpu", offsets_dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = blockattn.block_attention(*leaves, offsets, block_size=32)
    out.backward(do)
    for got, ref in zip([out, *(t.grad for t in leaves)], reference_grads(q, k, v, do, offsets, 32)):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-4)


def test_nested_jagged_input():
    lengths = [5, 0, 40, 17]
    q, k, v, do, offsets = random_inputs(lengths, 2, 1, 16, torch.float32, "cpu", torch.int64)
    nq, nk, nv = (torch.nested.nested_tensor_from_jagged(t, offsets).requires_grad_() for t in (q, k, v))
    out = blockattn.block_attention(nq, nk, nv, block_size=16)
    assert out.is_nested and out.layout == torch.jagged and out.shape[0] == len(lengths)
    out.values().backward(do)
    exact = reference_grads(q, k, v, do, offsets, 16)
    torch.testing.assert_close(out.values().double(), exact[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(nq.grad.values().double(), exact[1], atol=1e-5, rtol=1e-4)


def test_fake_tensor_propagation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(100, 4, 64, dtype=torch.bfloat16)
        k = torch.empty(100, 2, 64, dtype=torch.bfloat16)
        offsets = torch.zeros(3, dtype=torch.int32)
        out = blockattn.block_attention(q, k, k, offsets)
        _, block_cum, block_seq, _ = torch.ops.blockattn.block_attention_fwd(q, k, k, offsets, None, 64, 0.125, 0)
        # at most (100 + 2 * 63) // 64 = 3 blocks, in a whole group of 4 slots
        assert block_cum.shape == (2,) and block_seq.shape == (4,)
        dq, dk, dv, *_ = torch.ops.blockattn.block_attention_bwd(out, q, k, k, offsets, None, block_cum, block_seq,
                                                                 64, 0.125, 0)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


def test_opcheck_custom_ops():
    """torch.library.opcheck: fake vs real metadata, autograd registration, schema."""
    q, k, v, do, offsets = random_inputs([30, 3], 4, 2, 16, torch.float32, "cpu")
    table = build_block_table(offsets, q.shape[0], 16)
    torch.library.opcheck(torch.ops.blockattn.block_attention_bwd.default,
                          (do, q, k, v, offsets, None, *table, 16, 0.25, 0))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.blockattn.block_attention_fwd.default, (q, k, v, offsets, None, 16, 0.25, 0))


def test_compile_once_with_a_rotate_tuple_seen_first_while_tracing():
    """rotate's masks are looked up, never written, while torch.compile traces: a compiled call with a rotary runs
    again without compiling again (a cache filled during the trace guarded on its own contents)."""
    q = torch.randn(10, 2, 16)
    offsets = torch.tensor([0, 4, 10])
    sinu_pos = torch.randn(10, 16)
    compiled = torch.compile(lambda q: blockattn.block_attention(q, q, q, offsets, block_size=16, sinu_pos=sinu_pos,
                                                                 rotate=("v", "q")), fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            compiled(q)


def test_compile_fullgraph_cpu():
    q, k, v, _do, offsets = random_inputs([9, 40], 2, 2, 16, torch.float32, "cpu")

    def layer(q, k, v, offsets):
        return blockattn.block_attention(q * 2, k, v, offsets, block_size=16).sum(-1)

    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled(*leaves, offsets).sum().backward()
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    layer(*eager, offsets).sum().backward()
    for a, b in zip(leaves, eager):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("packed", [False, True], ids=["qkv", "packed"])
def test_eager_route_and_custom_op_give_the_same_results(packed, monkeypatch):
    """The eager route (the ops' implementations under a ``torch.autograd.Function``, or called directly where
    nothing needs a gradient) and the custom ops' own autograd compute bitwise the same outputs and gradients,
    biases' included."""
    q, k, v, do, offsets = random_inputs(odd_lengths(16), 4, 2, 16, torch.float32, "cpu")
    pos_bias = torch.randn(4, 31)
    x, w = torch.randn(q.shape[0], 24), torch.randn(24, 8 * 16)

    def attend(leaves):
        if packed:
            return blockattn.qkv_block_attention(*leaves[:2], offsets, num_heads=4, num_kv_heads=2, block_size=16,
                                                 causal=True, pos_bias=leaves[2])
        return blockattn.block_attention(*leaves[:3], offsets, block_size=16, causal=True, pos_bias=leaves[3])

    def run():
        leaves = [t.clone().requires_grad_() for t in ((x, w, pos_bias) if packed else (q, k, v, pos_bias))]
        out = attend(leaves)
        with torch.no_grad():
            inference = attend(leaves)
        assert inference.grad_fn is None and not inference.requires_grad
        return [out, inference, *torch.autograd.grad(out, leaves, do)]

    assert_eager_route_matches_the_ops(run, q, monkeypatch)


def test_eager_route_leaves_modes_subclasses_and_meta_to_the_ops():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from blockattn import custom_ops

    q = torch.randn(4, 2, 16)
    assert custom_ops.eager_route(q, torch.nn.Parameter(q))
    with FlopCounterMode(display=False):
        assert not custom_ops.eager_route(q)
    with FakeTensorMode() as mode:
        assert not custom_ops.eager_route(mode.from_tensor(q))
    assert not custom_ops.eager_route(q.to("meta"))
    assert not custom_ops.eager_route(q, torch.nested.nested_tensor([q[0], q[1]], layout=torch.jagged))
    seen = []
    torch.func.grad(lambda t: seen.append(custom_ops.eager_route(t)) or t.sum())(q)
    assert seen == [False]


def test_flop_counter_counts_in_block_work():
    from torch.utils.flop_counter import FlopCounterMode

    lengths, hq, d = [100, 3], 2, 16
    q, k, v, do, offsets = random_inputs(lengths, hq, 1, d, torch.float32, "cpu")
    q.requires_grad_()
    pairs = 64 * 64 + 36 * 36 + 3 * 3  # 100 = 64 + 36, then 3
    with FlopCounterMode(display=False) as counter:
        blockattn.block_attention(q, k, v, offsets).backward(do)
    counts = counter.get_flop_counts()["Global"]
    assert counts[torch.ops.blockattn.block_attention_fwd] == 4 * pairs * hq * d
    assert counts[torch.ops.blockattn.block_attention_bwd] == 10 * pairs * hq * d


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_torch_path_non_finite_input_stays_in_its_block_and_head(where, bad):
    """As on the GPU: a NaN or inf shows in the output of its own block and head, and nowhere else."""
    lengths, bs = [40, 7], 16
    q, k, v, _, offsets = random_inputs(lengths, 2, 2, 16, torch.float32, "cpu")
    inputs = {"q": q, "k": k, "v": v}
    inputs[where][20, 1, 3] = bad  # row 20: block 1 (rows 16..31) of sequence 0, head 1
    out = blockattn.block_attention(*inputs.values(), offsets, block_size=bs)
    ref = block_attention_reference(*inputs.values(), offsets, block_size=bs)
    poisoned = ~torch.isfinite(ref)
    assert poisoned.any()
    assert torch.equal(~torch.isfinite(out), poisoned)
    assert not poisoned[:16].any() and not poisoned[32:].any() and not poisoned[:, 0].any()
    torch.testing.assert_close(out[~poisoned].double(), ref[~poisoned], atol=1e-5, rtol=1e-4)


def test_float64_gradcheck_cpu():
    """float64 on the CPU path: torch.autograd.gradcheck of q, k, v, with a fused rotary."""
    from conftest import random_angles

    q, k, v, _, offsets = random_inputs([5, 0, 19], 2, 1, 16, torch.float64, "cpu")
    sinu_pos = random_angles(24, 16, torch.float64)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = blockattn.block_attention(*leaves, offsets, block_size=16, sinu_pos=sinu_pos, rotate=("q", "k"))
    assert out.dtype == torch.float64
    assert torch.autograd.gradcheck(
        lambda q, k, v: blockattn.block_attention(q, k, v, offsets, block_size=16, sinu_pos=sinu_pos,
                                                  rotate=("q", "k")), leaves)


def test_meta_tensors_give_shapes():
    """Model initialisation on ``device="meta"`` and shape inference: forward, backward, nested, projection and
    rotary run through the fake implementations, reading no values."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        q = torch.randn(100, 4, 64, requires_grad=True)
        k = torch.randn(100, 2, 64, requires_grad=True)
        offsets = torch.tensor([0, 30, 100])
        sinu_pos = torch.randn(100, 64)
        with FlopCounterMode(display=False):
            out = blockattn.block_attention(q, k, k, offsets, sinu_pos=sinu_pos)
            out.sum().backward()
        nested = [torch.nested.nested_tensor_from_jagged(t.detach(), offsets) for t in (q, k, k)]
        nested_out = blockattn.block_attention(*nested)
        x, w = torch.randn(100, 32), torch.randn(32, 8 * 64)
        projected = blockattn.qkv_block_attention(x, w, offsets, num_heads=4, num_kv_heads=2)
        rotated = blockattn.apply_rotary(q, sinu_pos)
    assert out.device.type == "meta" and out.shape == q.shape and q.grad.shape == q.shape
    assert k.grad.shape == k.shape and nested_out.is_nested and projected.shape == (100, 4, 64)
    assert rotated.shape == q.shape


def test_block_layout_is_reused_and_matches_offsets():
    """A layout built once gives bitwise the results of passing the offsets, forward and backward, through
    block_attention, qkv_block_attention and the layer, eager and compiled; its block size is the calls'."""
    q, k, v, _do, offsets = random_inputs(odd_lengths(32) + [70], 4, 2, 16, torch.float32, "cpu")
    layout = blockattn.block_layout(offsets, q.shape[0], block_size=32)
    assert layout.block_size == 32 and layout.num_tokens == q.shape[0]

    def grads(fn, *leaves):
        leaves = [t.detach().clone().requires_grad_() for t in leaves]
        out = fn(*leaves)
        return [out, *torch.autograd.grad(out, leaves, torch.randn_like(out, generator=torch.Generator()
                                                                          .manual_seed(0)))]

    attend = [lambda q, k, v: blockattn.block_attention(q, k, v, offsets, block_size=32, causal=True),
              lambda q, k, v: blockattn.block_attention(q, k, v, layout, causal=True)]
    for got, want in zip(grads(attend[1], q, k, v), grads(attend[0], q, k, v)):
        assert torch.equal(got, want)
    compiled = torch.compile(lambda q, k, v, layout: blockattn.block_attention(q, k, v, layout), fullgraph=True)
    assert torch.equal(compiled(q, k, v, layout), blockattn.block_attention(q, k, v, offsets, block_size=32))

    def two_layers(q, k, v, offsets):  # the layout built inside the compiled model, with dynamic shapes
        layout = blockattn.block_layout(offsets, q.shape[0], block_size=32)
        return blockattn.block_attention(blockattn.block_attention(q, k, v, layout), k, v, layout)

    inner = torch.compile(two_layers, fullgraph=True, dynamic=True)
    torch.testing.assert_close(inner(q, k, v, offsets), two_layers(q, k, v, offsets), atol=1e-6, rtol=1e-5)
    torch.library.opcheck(torch.ops.blockattn.block_table.default, (offsets, q.shape[0], 32))

    x, w = torch.randn(q.shape[0], 24), torch.randn(24, 8 * 16)
    project = [lambda x, w: blockattn.qkv_block_attention(x, w, offsets, num_heads=4, num_kv_heads=2, block_size=32),
               lambda x, w: blockattn.qkv_block_attention(x, w, layout, num_heads=4, num_kv_heads=2)]
    for got, want in zip(grads(project[1], x, w), grads(project[0], x, w)):
        assert torch.equal(got, want)

    layer = blockattn.nn.BlockSelfAttention(24, 4, 2, head_dim=16, block_size=32)
    assert torch.equal(layer(x, layout), layer(x, offsets))


def test_block_layout_refuses_what_does_not_fit():
    q, k, v, _, offsets = random_inputs([40, 7], 2, 2, 16, torch.float32, "cpu")
    layout = blockattn.block_layout(offsets, 47, block_size=16)
    with pytest.raises(ValueError, match="block_size=32 differs from the BlockLayout's 16"):
        blockattn.block_attention(q, k, v, layout, block_size=32)
    with pytest.raises(ValueError, match="built for N = 47 tokens, but the inputs have N = 40"):
        blockattn.block_attention(q[:40], k[:40], v[:40], layout)
    # A table cut short, as by hand: the kernels would read its slots in groups of 4 past its end.
    cut = layout._replace(table=BlockTable(layout.table.block_cum, layout.table.block_seq[:3]))
    with pytest.raises(ValueError, match=r"block_seq of shape \[4\] \(as blockattn.block_layout builds it\), "
                                         r"got \[2\] and \[3\]"):
        blockattn.block_attention(q, k, v, cut)
    with pytest.raises(ValueError, match=re.escape("offsets is a BlockLayout of 16-token blocks, but this layer's "
                                                   "block_size is 64: build it with block_layout(offsets, N, "
                                                   "block_size=64)")):
        blockattn.nn.BlockSelfAttention(32, 2, block_size=64)(torch.randn(47, 32), layout)
    with pytest.raises(ValueError, match="offsets\\[-1\\] must equal the number of tokens N=50"):
        blockattn.block_layout(offsets, 50, block_size=16)
    with pytest.raises(ValueError, match="num_tokens must be a non-negative int"):
        blockattn.block_layout(offsets, -1)
    with pytest.raises(ValueError, match="block_size must be one of"):
        blockattn.block_layout(offsets, 47, block_size=48)
