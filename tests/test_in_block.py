"""The in-block options (causal mask, relative position and time biases, dropout) against the float64 reference:
every backend through its launchers (Triton's interpreter on CPU, the real kernels on a GPU), the public ops with
autograd, the dropout stream, torch.compile, CUDA graphs."""

import dataclasses

import pytest
import torch
from conftest import (
    BLOCK_SIZES,
    HAS_GPU,
    KERNEL_DEVICE,
    ON_HOPPER,
    assert_within_2x_pytorch,
    capture_cuda_graph,
    make_offsets,
    odd_lengths,
    random_angles,
    random_inputs,
    reference_grads,
    requires_gpu,
    run_backend,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blockattn
from blockattn import backends, checks
from blockattn.block_table import build_block_table
from blockattn.ops import block_attention as triton_ops
from blockattn.ops import in_block, plans, tiles
from blockattn.ops.in_block import InBlock, dropout_keep
from blockattn.ops.tiles import ROTATE_ALL
from blockattn.reference import block_attention_reference, snr_db

OPTIONS = ["causal", "pos", "time", "dropout", "causal+pos+time", "all"]
# Triton's interpreter (no GPU) is slow: there the kernels get each option at one block size and dtype, and all
# options together at a second of each; the GPU gets every block size (and the accuracy contract below).
KERNEL_CASES = ([(n, bs, torch.bfloat16) for n in OPTIONS for bs in BLOCK_SIZES]
                + [("all", bs, dt) for bs in (32, 128) for dt in (torch.float16, torch.float32)] if HAS_GPU
                else [(n, 16, torch.float16) for n in OPTIONS] + [("all", 32, torch.float32)])


def make_options(names: str, hq: int, block_size: int, n: int, device, bias_dtype=torch.float32,
                 dropout_p=0.25, num_buckets=24) -> InBlock:
    """Options named by ``names`` (``"all"``: every one) with random biases and integer timestamps that span many
    buckets."""
    chosen = {"causal", "pos", "time", "dropout"} if names == "all" else set(names.split("+"))
    return InBlock(
        causal="causal" in chosen,
        pos_bias=torch.randn(hq, 2 * block_size - 1, device=device).to(bias_dtype) if "pos" in chosen else None,
        timestamps=torch.randint(0, 10**6, (n,), device=device) if "time" in chosen else None,
        time_bias=torch.randn(hq, num_buckets, device=device).to(bias_dtype) if "time" in chosen else None,
        dropout_p=dropout_p if "dropout" in chosen else 0.0,
        seed=torch.randint(2**62, (1,), device=device) if "dropout" in chosen else None,
    )


@pytest.mark.parametrize("names,block_size,dtype", KERNEL_CASES)
def test_kernels_each_option_odd_lengths_gqa(names, block_size, dtype, poisoned_outputs):
    q, k, v, do, offsets = random_inputs(odd_lengths(block_size), 4, 2, 32, dtype, KERNEL_DEVICE)
    options = make_options(names, 4, block_size, q.shape[0], KERNEL_DEVICE)
    results = run_backend("triton", q, k, v, do, offsets, block_size, in_block=options)
    assert_within_2x_pytorch(results, q, k, v, do, offsets, block_size, in_block=options)


@pytest.mark.parametrize("names", OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_torch_path_each_option(names, dtype, poisoned_outputs):
    q, k, v, do, offsets = random_inputs(odd_lengths(16), 6, 2, 24, dtype, "cpu", torch.int64)
    # float64 biases with float64 inputs: float32 ones would return float32 gradients, rounded.
    options = make_options(names, 6, 16, q.shape[0], "cpu", torch.float64 if dtype == torch.float64 else torch.float32)
    results = run_backend("torch", q, k, v, do, offsets, 16, in_block=options)
    assert_within_2x_pytorch(results, q, k, v, do, offsets, 16, in_block=options)


@pytest.mark.parametrize("block_size,head_dim,hq,hkv", [(16, 256, 2, 2), (32, 200, 4, 1), (64, 128, 2, 2)] + (
    [(128, 136, 2, 1), (64, 128, 4, 2)] if HAS_GPU else []))
def test_kernels_all_options_head_dims_and_slices(block_size, head_dim, hq, hkv, poisoned_outputs):
    """Head dims that split into slices (several programs share a block's dS: one writes the bias gradients), and
    the production shape with and without GQA (its persistent backward takes no options: the one-block kernel
    does, on whole rows; without GQA the forward takes 64-wide slices with these options)."""
    q, k, v, do, offsets = random_inputs([block_size + 3, 5], hq, hkv, head_dim, torch.float16, KERNEL_DEVICE)
    options = make_options("all", hq, block_size, q.shape[0], KERNEL_DEVICE)
    results = run_backend("triton", q, k, v, do, offsets, block_size, in_block=options)
    assert_within_2x_pytorch(results, q, k, v, do, offsets, block_size, in_block=options)


def test_forward_slices_narrow_with_two_tile_options():
    """The production shape's forward (64-token blocks, D = 128, no GQA) takes 64-wide slices with two or more of
    the position bias, the time bias and dropout; with one of them (and the causal mask) whole rows."""
    bit = {"causal": in_block.CAUSAL, "pos": in_block.POS_BIAS, "time": in_block.TIME_BIAS, "dropout": in_block.DROPOUT}

    def chunk(*names, **kwargs):
        bits = sum(bit[name].value for name in names)
        return triton_ops.kernel_config(64, 128, backward=False, in_block_bits=bits, **kwargs)["CHUNK"]
    assert chunk("pos", "dropout") == chunk("time", "dropout") == chunk("causal", "pos", "time") == 64
    assert chunk() == chunk("causal") == chunk("causal", "time") == chunk("dropout") == 128
    assert chunk("pos", "time", group=2) == chunk("pos", "time", rotary=True) == 128


@pytest.mark.parametrize("block_size,head_dim,dtype,rotate,names,cap", [
    (64, 128, torch.bfloat16, 0, ("causal",), 128), (64, 128, torch.float16, 0, ("time", "dropout"), 128),
    (64, 128, torch.bfloat16, 0, (), None),  # no option
    (16, 64, torch.bfloat16, 0, ("time",), None), (32, 128, torch.bfloat16, 0, ("time",), None),
    (64, 256, torch.bfloat16, 0, ("causal",), None), (64, 64, torch.bfloat16, 0, ("dropout",), None),
    (64, 128, torch.float32, 0, ("causal",), None), (64, 128, torch.bfloat16, ROTATE_ALL, ("causal",), None),
    (64, 32, torch.bfloat16, 0, (), 64), (64, 32, torch.float16, 0, (), 64),  # plain, at D = 32
    (64, 32, torch.float8_e4m3fn, 0, (), 64), (64, 32, torch.float32, 0, (), None),
    (64, 32, torch.bfloat16, 0, ("causal",), None), (64, 32, torch.bfloat16, ROTATE_ALL, (), None),
    (32, 32, torch.bfloat16, 0, (), None), (64, 64, torch.bfloat16, 0, (), None)])
@pytest.mark.parametrize("group", [1, 4])
def test_forward_register_cap_only_where_it_measured_faster(block_size, head_dim, dtype, rotate, names, cap, group):
    """The forward's register caps hold where they measured faster: 128 with in-block options at 64-token blocks
    and D = 128 (elsewhere slower: 16- and 32-token blocks, D = 256; or tied), 64 for the plain forward of 64-token
    blocks at D = 32 with one query head a program but in fp32 (slower at D = 64, and under GQA, whose programs run
    the group); 5 query heads have no divisor from 2 to 4, which the rule would run together at D = 32 (then
    uncapped). The rule sees the tile the launcher passes (blocks packed under GQA)."""
    bits = sum({"causal": in_block.CAUSAL, "time": in_block.TIME_BIAS, "dropout": in_block.DROPOUT}[n].value
               for n in names)
    num_heads = 5 if group == 1 else 4
    q = torch.empty(2, num_heads, head_dim, dtype=dtype)
    tile = block_size * tiles.blocks_per_tile(block_size, head_dim, group, bool(rotate), bits, backward=False)
    cfg = triton_ops.kernel_config(tile, head_dim, backward=False, group=group, element_size=q.element_size(),
                                   rotary=bool(rotate), in_block_bits=bits, num_heads=num_heads)
    cap = cap if group == 1 else None
    options = InBlock(causal="causal" in names, dropout_p=0.25 if "dropout" in names else 0.0,
                      time_bias=torch.zeros(num_heads, 8) if "time" in names else None)
    assert options.bits == bits
    heads = cfg["HEADS_PER_PROGRAM"]
    assert triton_ops._forward_register_cap(cfg, heads, q, tile, rotate, options) == cap
    if cap == 64:  # 4 heads run 4 a program there, uncapped, unless launched one a program
        four = triton_ops.kernel_config(tile, head_dim, backward=False, element_size=q.element_size(), num_heads=4)
        assert four["HEADS_PER_PROGRAM"] == 4
        assert triton_ops._forward_register_cap(four, 4, q, tile, rotate, options) is None
        assert triton_ops._forward_register_cap(four, 1, q, tile, rotate, options) == 64


@pytest.mark.parametrize("heads,names", [((4, 1), "all")] + ([((2, 2), "causal+pos+time")] if HAS_GPU else []))
def test_kernels_options_with_fused_rotary(heads, names, poisoned_outputs):
    q, k, v, do, offsets = random_inputs(odd_lengths(16), *heads, 32, torch.float32, KERNEL_DEVICE)
    sinu_pos = random_angles(q.shape[0], 32, device=KERNEL_DEVICE)
    options = make_options(names, heads[0], 16, q.shape[0], KERNEL_DEVICE)
    results = run_backend("triton", q, k, v, do, offsets, 16, sinu_pos, ROTATE_ALL, in_block=options)
    assert_within_2x_pytorch(results, q, k, v, do, offsets, 16, sinu_pos=sinu_pos, rotate=ROTATE_ALL,
                             in_block=options)


@settings(max_examples=10 if HAS_GPU else 4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 50), min_size=1, max_size=4),
    block_size=st.sampled_from([16, 32]),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]),
    names=st.sampled_from(OPTIONS),
    bias_dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernels_random_shapes(lengths, block_size, heads, names, bias_dtype, seed):
    torch.manual_seed(seed)
    q, k, v, do, offsets = random_inputs(lengths, *heads, 16, torch.float16, KERNEL_DEVICE)
    options = make_options(names, heads[0], block_size, q.shape[0], KERNEL_DEVICE, bias_dtype)
    results = run_backend("triton", q, k, v, do, offsets, block_size, in_block=options)
    assert_within_2x_pytorch(results, q, k, v, do, offsets, block_size, in_block=options)


def _timestamps(pattern: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Times in the orders and spreads the time bias's gradient must take: many ties, rising (a history), falling,
    and gaps far past fp32's exact integers (int64) or fractional ones (float32)."""
    if pattern == "ties":
        times = torch.randint(0, 4, (n,)).double()
    elif pattern in ("rising", "falling"):
        times = torch.randint(0, 1200, (n,)).cumsum(0).double()
        times = times if pattern == "rising" else times.flip(0)
    else:  # wide
        times = torch.randint(-(2**40), 2**40, (n,)).double()
    if dtype == torch.float32:
        return (times * 0.37).float()
    return times.clamp(-(2**31), 2**31 - 1).to(dtype)


@settings(max_examples=16 if HAS_GPU else 8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pattern=st.sampled_from(["ties", "rising", "falling", "wide"]),
    timestamps_dtype=st.sampled_from([torch.int64, torch.int32, torch.float32]),
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    block_size=st.sampled_from([16, 32]),
    num_buckets=st.sampled_from([1, 7, 40]),
    seed=st.integers(0, 2**31 - 1),
)
def test_time_bias_gradient_any_order_ties_and_spread(pattern, timestamps_dtype, lengths, block_size, num_buckets,
                                                      seed):
    """The kernels sum the time bias's gradient per bucket a block holds (a bit mask of them, 16 buckets' row sums
    at a time): whatever the order, ties, spread and dtype of the times, and so whichever buckets occur, it matches
    the reference."""
    torch.manual_seed(seed)
    q, k, v, do, offsets = random_inputs(lengths, 2, 1, 16, torch.float32, KERNEL_DEVICE)
    times = _timestamps(pattern, q.shape[0], timestamps_dtype).to(KERNEL_DEVICE)
    options = InBlock(timestamps=times, time_bias=torch.randn(2, num_buckets, device=KERNEL_DEVICE),
                      bucket_width=0.301 if pattern != "wide" else 0.9)
    results = run_backend("triton", q, k, v, do, offsets, block_size, in_block=options)
    assert_within_2x_pytorch(results, q, k, v, do, offsets, block_size, in_block=options)


@pytest.mark.parametrize("timestamps_dtype", [torch.int64, torch.float32])
@pytest.mark.parametrize("width,num_buckets", [(0.301, 20), (0.9, 45), (in_block.MIN_BUCKET_WIDTH, 40_000)])
def test_time_buckets_exact_at_the_edges(timestamps_dtype, width, num_buckets):
    """Key times exactly at bucket edges and one fp32 step below them (20 edges spread over the table; at widths
    0.9 and the narrowest up to ``|dt|`` ~ 1e17, where the fast log2's error is largest and integer times span more
    than the kernel's 32-bit differences hold): the kernels' fast log2 plus correction and the PyTorch path's
    searchsorted give the reference's buckets (a wrong bucket moves a score by 3), and the time bias's gradient sums
    each bucket's pairs."""
    picked = torch.linspace(1, num_buckets - 1, 20, dtype=torch.float64).round().long().unique()
    exact = torch.exp(picked.double() * width)
    if timestamps_dtype == torch.int64:
        deltas = torch.cat([exact.ceil(), exact.ceil() - 1]).long()
    else:
        edges = in_block.bucket_edges(num_buckets, width, torch.device("cpu"))[picked]
        deltas = torch.cat([edges, torch.nextafter(edges, torch.zeros(()))])
    # One block of 64: a query at t = 0 and keys at +-delta.
    times = torch.cat([torch.zeros(1, dtype=deltas.dtype), deltas, -deltas[:25]])[:64].to(timestamps_dtype)
    n = times.numel()
    offsets = make_offsets([n])
    q, k, v, do, _ = random_inputs([n], 1, 1, 16, torch.float32, "cpu")
    q = q * 0.01  # flat scores: the bias decides
    time_bias = torch.arange(num_buckets, dtype=torch.float32)[None] * 10.0 % 7.0
    options = InBlock(timestamps=times, time_bias=time_bias, bucket_width=width)
    expected = reference_grads(q, k, v, do, offsets, 64, in_block=options)
    # The interpreter's log2 is exact and its loop over 40 000 buckets takes a minute: the narrow width's kernel
    # case is the GPU's.
    names = ("torch", "triton") if HAS_GPU or num_buckets < 1000 else ("torch",)
    for name in names:
        device = "cpu" if name == "torch" or not HAS_GPU else "cuda"
        moved = [t.to(device) for t in (q, k, v, do, offsets)]
        opts = InBlock(timestamps=times.to(device), time_bias=time_bias.to(device), bucket_width=width)
        results = run_backend(name, *moved, 64, in_block=opts)
        for got, ref in zip(results, expected):
            torch.testing.assert_close(got.double().cpu(), ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("num_buckets", [6, 400])
def test_non_finite_time_differences(num_buckets):
    """Float timestamps whose difference is infinite (an inf timestamp, or two past fp32's range apart) put the pair
    in the last bucket, and a NaN timestamp's pairs in bucket 0 (its difference counts as 0), in every backend as in
    the reference (which indexed out of range there); with 400 buckets of the default width the last edges pass
    fp32's range."""
    times = torch.tensor([0.0, 1.0, float("inf"), 5.0, float("nan"), -3e38, 3e38, float("-inf"), 2.0, 7.0, 1e6, 9.0])
    n = times.numel()
    offsets = make_offsets([n])
    q, k, v, do, _ = random_inputs([n], 2, 2, 16, torch.float32, "cpu")
    q = q * 0.01  # flat scores: the bias decides
    time_bias = torch.randn(2, num_buckets) * 3
    options = InBlock(timestamps=times, time_bias=time_bias)
    expected = reference_grads(q, k, v, do, offsets, 16, in_block=options)
    for name in ("torch", "triton"):
        device = "cpu" if name == "torch" or not HAS_GPU else "cuda"
        moved = [t.to(device) for t in (q, k, v, do, offsets)]
        opts = InBlock(timestamps=times.to(device), time_bias=time_bias.to(device))
        for got, ref in zip(run_backend(name, *moved, 16, in_block=opts), expected):
            torch.testing.assert_close(got.double().cpu(), ref, atol=1e-5, rtol=1e-4)


def test_philox_twin_matches_triton():
    """The PyTorch Philox (the PyTorch path's and the tests' view of the mask) equals Triton's tl.philox."""
    import triton
    import triton.language as tl

    @triton.jit
    def words_kernel(out_ptr, seed_ptr, c1, c2):
        c0 = tl.arange(0, 64).to(tl.uint32)
        zero = c0 * 0
        r0, r1, r2, r3 = tl.philox(tl.load(seed_ptr), c0, zero + c1, zero + c2, zero)
        offs = tl.arange(0, 64)
        tl.store(out_ptr + offs, r0.to(tl.int64))
        tl.store(out_ptr + 64 + offs, r1.to(tl.int64))
        tl.store(out_ptr + 128 + offs, r2.to(tl.int64))
        tl.store(out_ptr + 192 + offs, r3.to(tl.int64))

    seed = torch.randint(2**62, (1,), device=KERNEL_DEVICE)
    got = torch.empty(256, dtype=torch.int64, device=KERNEL_DEVICE)
    words_kernel[(1,)](got, seed, 123457, 5)
    c0 = torch.arange(64, device=KERNEL_DEVICE)
    want = in_block.philox(seed, c0, torch.full_like(c0, 123457), torch.full_like(c0, 5), torch.zeros_like(c0))
    assert torch.equal(got, torch.cat(want))


def test_dropout_keep_rate_and_independence():
    """About 1 - p of the probabilities are kept, blocks and heads draw different masks."""
    keep = dropout_keep(torch.tensor([987654321]), torch.tensor([0, 64, 128]), 4, 64, 0.3)
    rate = keep.float().mean().item()
    assert abs(rate - 0.7) < 0.01
    assert not torch.equal(keep[0, 0], keep[1, 0]) and not torch.equal(keep[0, 0], keep[0, 1])


def public_call(q, k, v, offsets, block_size, options: InBlock, **kwargs):
    return blockattn.block_attention(q, k, v, offsets, block_size=block_size, causal=options.causal,
                                     pos_bias=options.pos_bias, timestamps=options.timestamps,
                                     time_bias=options.time_bias, dropout_p=options.dropout_p, **kwargs)


def public_grads(q, k, v, do, offsets, block_size, options: InBlock, **kwargs):
    """``[out, dq, dk, dv, dpos?, dtime?]`` of the public op under autograd."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    biases = [b.detach().clone().requires_grad_() if b is not None else None
              for b in (options.pos_bias, options.time_bias)]
    opts = options._replace(pos_bias=biases[0], time_bias=biases[1])
    out = public_call(*leaves, offsets, block_size, opts, **kwargs)
    inputs = leaves + [b for b in biases if b is not None]
    return [out, *torch.autograd.grad(out, inputs, do)]


def test_public_op_matches_reference_with_seeded_dropout():
    """Through the public function: the seed comes from torch's generator, so re-seeding and asking the debug path
    for the mask of that seed reproduces the reference exactly."""
    q, k, v, do, offsets = random_inputs(odd_lengths(32), 4, 2, 16, torch.float32, "cpu")
    options = make_options("all", 4, 32, q.shape[0], "cpu")
    torch.manual_seed(77)
    got = public_grads(q, k, v, do, offsets, 32, options)
    torch.manual_seed(77)
    options = options._replace(seed=torch.randint(2**62, (1,)))
    for g, r in zip(got, reference_grads(q, k, v, do, offsets, 32, in_block=options)):
        torch.testing.assert_close(g.double(), r, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("device", ["cpu", KERNEL_DEVICE] if HAS_GPU else ["cpu"])
def test_dropout_zero_is_no_dropout_and_seeds_reproduce(device):
    q, k, v, do, offsets = random_inputs(odd_lengths(16), 2, 2, 16, torch.float32, device)
    options = make_options("causal+pos", 2, 16, q.shape[0], device)
    plain = public_grads(q, k, v, do, offsets, 16, options)
    zero = public_grads(q, k, v, do, offsets, 16, options._replace(dropout_p=0.0))
    assert all(torch.equal(a, b) for a, b in zip(plain, zero))
    dropped = options._replace(dropout_p=0.4)
    torch.manual_seed(5)
    first = public_grads(q, k, v, do, offsets, 16, dropped)
    torch.manual_seed(5)
    again = public_grads(q, k, v, do, offsets, 16, dropped)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    other = public_grads(q, k, v, do, offsets, 16, dropped)
    assert not torch.equal(first[0], other[0])


def test_dropout_mean_over_seeds_approaches_no_dropout():
    q, k, v, _, offsets = random_inputs([40, 17], 2, 2, 16, torch.float32, "cpu")
    plain = blockattn.block_attention(q, k, v, offsets, block_size=16)
    mean = torch.stack([blockattn.block_attention(q, k, v, offsets, block_size=16, dropout_p=0.3)
                        for _ in range(200)]).mean(0)
    spread = plain.abs().mean().item()
    assert (mean - plain).abs().mean().item() < 0.1 * spread
    assert (mean - plain).abs().mean().item() < 0.5 * (plain - blockattn.block_attention(
        q, k, v, offsets, block_size=16, dropout_p=0.3)).abs().mean().item()


@pytest.mark.parametrize("names", ["causal+pos+time", "all"])
def test_backward_is_bitwise_deterministic(names):
    lengths = [100, 37, 64] if HAS_GPU else [40, 7]
    q, k, v, do, offsets = random_inputs(lengths, 4, 2, 32, torch.float16, KERNEL_DEVICE)
    options = make_options(names, 4, 32, q.shape[0], KERNEL_DEVICE)
    first = run_backend("triton", q, k, v, do, offsets, 32, in_block=options)
    again = run_backend("triton", q, k, v, do, offsets, 32, in_block=options)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_qkv_block_attention_with_options():
    """The packed projection takes the options and returns the biases' gradients."""
    lengths, hq, hkv, d, bs = [30, 0, 17], 4, 2, 16, 16
    n = sum(lengths)
    offsets = make_offsets(lengths)
    x = torch.randn(n, 24, dtype=torch.float64, requires_grad=True)
    w = torch.randn(24, (hq + 2 * hkv) * d, dtype=torch.float64, requires_grad=True)
    options = make_options("causal+pos+time", hq, bs, n, "cpu", torch.float64)
    pos, time = (b.requires_grad_() for b in (options.pos_bias, options.time_bias))
    out = blockattn.qkv_block_attention(x, w, offsets, num_heads=hq, num_kv_heads=hkv, block_size=bs, causal=True,
                                        pos_bias=pos, timestamps=options.timestamps, time_bias=time)
    q, k, v = blockattn.custom_ops.split_heads(x @ w, hq, hkv)
    ref = block_attention_reference(q, k, v, offsets, block_size=bs, causal=True, pos_bias=pos,
                                    timestamps=options.timestamps, time_bias=time)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, w, pos, time), do)
    want = torch.autograd.grad(ref, (x, w, pos, time), do)
    for g, r in zip([out, *got], [ref, *want]):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("names", ["time", "causal+pos+time"])
def test_kernels_on_a_prebuilt_bucket_table(names, poisoned_outputs):
    """The kernels on a table of time buckets built once (a layout's, ``in_block.bucket_table``) give the bits of
    those that build their own per call, forward and backward."""
    q, k, v, do, offsets = random_inputs(odd_lengths(32), 4, 2, 32, torch.float16, KERNEL_DEVICE)
    options = make_options(names, 4, 32, q.shape[0], KERNEL_DEVICE, num_buckets=40)
    table = build_block_table(offsets, q.shape[0], 32)
    buckets = in_block.bucket_table(options.timestamps, 40, options.bucket_width, offsets, table, 32)
    assert buckets.shape == (q.shape[0], 32) and buckets.dtype == torch.uint8
    per_call = run_backend("triton", q, k, v, do, offsets, 32, in_block=options)
    prebuilt = run_backend("triton", q, k, v, do, offsets, 32, in_block=options._replace(buckets=buckets))
    assert all(torch.equal(a, b) for a, b in zip(per_call, prebuilt))
    # The given table is what the kernels read: another one changes the output.
    other = run_backend("triton", q, k, v, do, offsets, 32, in_block=options._replace(buckets=buckets // 2))
    assert not torch.equal(other[0], per_call[0])


def test_layout_with_timestamps_matches_per_call_timestamps():
    """A layout built with the timestamps stands for them (and their width) in every call: the same outputs and
    gradients as passing them per call, for block_attention and the packed projection; on the CPU the layout holds
    no table (the PyTorch path buckets per call)."""
    lengths, hq, d, bs = [40, 0, 17, 33], 2, 16, 16
    q, k, v, do, offsets = random_inputs(lengths, hq, hq, d, torch.float32, "cpu")
    times = torch.randint(0, 10**5, (q.shape[0],))
    layout = blockattn.block_layout(offsets, q.shape[0], bs, timestamps=times, num_time_buckets=12,
                                    time_bucket_width=0.5)
    assert layout.time_buckets is None and layout.time_bucket_width == 0.5
    time_bias = torch.randn(hq, 12, requires_grad=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = blockattn.block_attention(*leaves, layout, causal=True, time_bias=time_bias)
    want = blockattn.block_attention(*leaves, offsets, block_size=bs, causal=True, timestamps=times,
                                     time_bias=time_bias, time_bucket_width=0.5)
    assert torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got, [*leaves, time_bias], do),
                    torch.autograd.grad(want, [*leaves, time_bias], do)):
        assert torch.equal(a, b)
    x, w = torch.randn(q.shape[0], 8), torch.randn(8, 3 * hq * d)
    packed = [blockattn.qkv_block_attention(x, w, where, num_heads=hq, num_kv_heads=hq, time_bias=time_bias,
                                            **extra)
              for where, extra in ((layout, {}), (offsets, {"block_size": bs, "timestamps": times,
                                                            "time_bucket_width": 0.5}))]
    assert torch.equal(*packed)
    # Calls without a time bias ignore the layout's timestamps.
    assert torch.equal(blockattn.block_attention(q, k, v, layout), blockattn.block_attention(q, k, v, offsets,
                                                                                              block_size=bs))


def test_layout_with_timestamps_refuses_what_does_not_match():
    q, k, v, _, offsets = random_inputs([20, 9], 2, 2, 16, torch.float32, "cpu")
    n = q.shape[0]
    times = torch.arange(n)
    with pytest.raises(ValueError, match="timestamps and num_time_buckets together"):
        blockattn.block_layout(offsets, n, 16, timestamps=times)
    with pytest.raises(ValueError, match="timestamps and num_time_buckets together"):
        blockattn.block_layout(offsets, n, 16, num_time_buckets=8)
    with pytest.raises(ValueError, match="num_time_buckets must be a positive int"):
        blockattn.block_layout(offsets, n, 16, timestamps=times, num_time_buckets=0)
    with pytest.raises(ValueError, match=r"timestamps must be 1-D \[N\]"):
        blockattn.block_layout(offsets, n, 16, timestamps=times[:-1], num_time_buckets=8)
    with pytest.raises(TypeError, match="timestamps must be"):
        blockattn.block_layout(offsets, n, 16, timestamps=times.to(torch.int16), num_time_buckets=8)
    with pytest.raises(ValueError, match="time_bucket_width must be"):
        blockattn.block_layout(offsets, n, 16, timestamps=times, num_time_buckets=8, time_bucket_width=0.0)
    layout = blockattn.block_layout(offsets, n, 16, timestamps=times, num_time_buckets=8)
    bias = torch.randn(2, 8)
    with pytest.raises(ValueError, match="timestamps differ from those of the BlockLayout"):
        blockattn.block_attention(q, k, v, layout, timestamps=times.clone(), time_bias=bias)
    with pytest.raises(ValueError, match="time_bucket_width=0.5 differs from the BlockLayout's 0.301"):
        blockattn.block_attention(q, k, v, layout, time_bias=bias, time_bucket_width=0.5)
    with pytest.raises(ValueError, match="time_bias has 9 buckets"):
        blockattn.block_attention(q, k, v, layout, time_bias=torch.randn(2, 9))
    with pytest.raises(ValueError, match="time_bucket_width was given to block_layout without timestamps"):
        blockattn.block_layout(offsets, n, 16, time_bucket_width=0.5)
    for target in (offsets, layout):  # and to an attention call without a time bias, as to block_layout
        with pytest.raises(ValueError, match="time_bucket_width was given without a time bias"):
            blockattn.block_attention(q, k, v, target, block_size=None if target is layout else 16,
                                      time_bucket_width=0.5)
    with pytest.raises(ValueError, match=r"time_buckets must be a contiguous torch.int32 tensor \[29, 16\]"):
        blockattn.block_attention(q, k, v, layout._replace(time_buckets=torch.zeros(n, 8, dtype=torch.uint8)),
                                  time_bias=bias)
    # A table as block_layout builds it where the kernels run (Triton's interpreter without a GPU) is accepted.
    kernel_offsets, kernel_times = offsets.to(KERNEL_DEVICE), times.to(KERNEL_DEVICE)
    kernel_layout = blockattn.block_layout(kernel_offsets, n, 16, timestamps=kernel_times, num_time_buckets=8)
    built = in_block.bucket_table(kernel_times, 8, 0.301, kernel_offsets, kernel_layout.table, 16)
    assert checks.layout_time_bias(kernel_layout._replace(time_buckets=built), None, bias, None)[2] is built
    # The layout's own timestamps and width, passed again, are accepted.
    assert torch.equal(blockattn.block_attention(q, k, v, layout, timestamps=times, time_bias=bias,
                                                 time_bucket_width=0.301),
                       blockattn.block_attention(q, k, v, layout, time_bias=bias))


def test_gradcheck_biases_float64():
    """torch.autograd.gradcheck of the biases (q, k, v have theirs in test_block_attention)."""
    q, k, v, _, offsets = random_inputs([5, 0, 19], 2, 1, 16, torch.float64, "cpu")
    pos = torch.randn(2, 31, dtype=torch.float64, requires_grad=True)
    time = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    times = torch.randint(0, 1000, (24,))
    assert torch.autograd.gradcheck(
        lambda pos, time: blockattn.block_attention(q, k, v, offsets, block_size=16, causal=True, pos_bias=pos,
                                                    timestamps=times, time_bias=time), (pos, time))


def test_nested_with_timestamps():
    lengths = [5, 0, 40, 17]
    q, k, v, _, offsets = random_inputs(lengths, 2, 1, 16, torch.float32, "cpu", torch.int64)
    times = torch.randint(0, 10**5, (sum(lengths),))
    nested = [torch.nested.nested_tensor_from_jagged(t, offsets) for t in (q, k, v, times)]
    time_bias = torch.randn(2, 16)
    out = blockattn.block_attention(*nested[:3], block_size=16, causal=True, timestamps=nested[3],
                                    time_bias=time_bias)
    ref = block_attention_reference(q, k, v, offsets, block_size=16, causal=True, timestamps=times,
                                    time_bias=time_bias)
    torch.testing.assert_close(out.values().double(), ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_with_options_cpu(dynamic):
    q, k, v, _, offsets = random_inputs([9, 40], 2, 2, 16, torch.float32, "cpu")
    options = make_options("all", 2, 16, q.shape[0], "cpu")
    pos = options.pos_bias.requires_grad_()

    def layer(q, k, v, pos):
        return blockattn.block_attention(q, k, v, offsets, block_size=16, causal=True, pos_bias=pos,
                                         timestamps=options.timestamps, time_bias=options.time_bias,
                                         dropout_p=0.2).sum(-1)

    compiled = torch.compile(layer, fullgraph=True, dynamic=dynamic)
    torch.manual_seed(3)
    # Inductor draws random numbers its own way unless told to call eager's generator: the same seed then.
    with torch._inductor.config.patch(fallback_random=True):
        got = torch.autograd.grad(compiled(q, k, v, pos).sum(), pos)[0]
    torch.manual_seed(3)
    want = torch.autograd.grad(layer(q, k, v, pos).sum(), pos)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_opcheck_and_fakes_with_options():
    q, k, v, do, offsets = random_inputs([30, 3], 4, 2, 16, torch.float32, "cpu")
    options = make_options("all", 4, 16, q.shape[0], "cpu")
    table = build_block_table(offsets, q.shape[0], 16)
    args = (True, options.pos_bias, options.timestamps, options.time_bias, 0.301, 0.25, options.seed)
    torch.library.opcheck(torch.ops.blockattn.block_attention_bwd.default,
                          (do, q, k, v, offsets, None, *table, 16, 0.25, 0, *args))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    options.pos_bias.requires_grad_()
    torch.library.opcheck(torch.ops.blockattn.block_attention_fwd.default,
                          (q, k, v, offsets, None, 16, 0.25, 0, *args))
    kernel_args = [t.to(KERNEL_DEVICE) for t in (offsets, *table, options.timestamps)]
    torch.library.opcheck(torch.ops.blockattn.time_bucket_table.default, (*kernel_args, 24, 0.301, 16))


def test_flop_counter_counts_causal_pairs():
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v, do, offsets = random_inputs([100, 3], 2, 1, 16, torch.float32, "cpu")
    pairs = 64 * 65 // 2 + 36 * 37 // 2 + 3 * 4 // 2
    with FlopCounterMode(display=False) as counter:
        blockattn.block_attention(q.requires_grad_(), k, v, offsets, causal=True).backward(do)
    counts = counter.get_flop_counts()["Global"]
    assert counts[torch.ops.blockattn.block_attention_fwd] == 4 * pairs * 2 * 16
    assert counts[torch.ops.blockattn.block_attention_bwd] == 10 * pairs * 2 * 16


# ---------------------------------------------------------------------------------------------------------------
# GPU: bf16, the accuracy contract, CUDA graphs, compile.
# ---------------------------------------------------------------------------------------------------------------


@requires_gpu
@pytest.mark.parametrize("names", OPTIONS)
@pytest.mark.parametrize("block_size,head_dim,dtype", [(16, 64, torch.bfloat16), (64, 128, torch.bfloat16),
                                                       (128, 128, torch.float16), (64, 256, torch.bfloat16),
                                                       (32, 40, torch.float16)])
def test_gpu_accuracy_contract(names, dtype, block_size, head_dim, poisoned_outputs):
    lengths = torch.randint(0, 3 * block_size, (12,)).tolist() + [block_size, block_size + 1]
    q, k, v, do, offsets = random_inputs(lengths, 4, 4, head_dim, dtype, "cuda")
    options = make_options(names, 4, block_size, q.shape[0], "cuda")
    results = run_backend("triton", q, k, v, do, offsets, block_size, in_block=options)
    assert_within_2x_pytorch(results, q, k, v, do, offsets, block_size, in_block=options)


@requires_gpu
@pytest.mark.parametrize("heads", [(8, 1), (8, 2)])
@pytest.mark.parametrize("rotary", [False, True])
def test_gpu_gqa_rotary_all_options(heads, rotary, poisoned_outputs):
    q, k, v, do, offsets = random_inputs(odd_lengths(64) + [300, 129], *heads, 128, torch.bfloat16, "cuda")
    sinu_pos = random_angles(q.shape[0], 128, device="cuda") if rotary else None
    options = make_options("all", heads[0], 64, q.shape[0], "cuda", torch.bfloat16)
    results = run_backend("triton", q, k, v, do, offsets, 64, sinu_pos, ROTATE_ALL, in_block=options)
    assert_within_2x_pytorch(results, q, k, v, do, offsets, 64, sinu_pos=sinu_pos, rotate=ROTATE_ALL,
                             in_block=options)


@requires_gpu
@pytest.mark.parametrize("names,heads", [("all", (4, 4)), ("all", (4, 2)), ("causal+pos+dropout", (4, 2))])
def test_gpu_public_op_deterministic_and_dispatch(names, heads, monkeypatch):
    """The public op on the production shape: on Hopper the Gluon backward takes every option, under GQA not both
    biases together; the Triton kernels take the rest (and everything on other GPUs). Every gradient is bitwise
    reproducible."""
    expected = "sm90-gluon" if ON_HOPPER and (heads[0] == heads[1] or names != "all") else "triton"
    calls = []
    backend = backends.BACKENDS[expected]
    monkeypatch.setitem(backends.BACKENDS, expected, dataclasses.replace(
        backend, backward=lambda *args: calls.append(1) or backend.backward(*args)))
    q, k, v, do, offsets = random_inputs([1400, 900, 63], *heads, 128, torch.bfloat16, "cuda")
    options = make_options(names, heads[0], 64, q.shape[0], "cuda")
    torch.manual_seed(1)
    first = public_grads(q, k, v, do, offsets, 64, options)
    torch.manual_seed(1)
    again = public_grads(q, k, v, do, offsets, 64, options)
    assert calls == [1, 1]
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("names", OPTIONS)
@pytest.mark.parametrize("head_dim,dtype", [(32, torch.float16), (64, torch.bfloat16), (128, torch.bfloat16)])
@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=lambda h: f"{h[0]}:{h[1]}")
def test_gpu_sm90_backward_with_options(heads, names, head_dim, dtype, rotary, poisoned_outputs):
    """The Hopper backward with each option, alone and together, with and without GQA, plain and with a fused
    rotary, on odd lengths, after the Triton forward (the dropout mask regenerated the same): the accuracy
    contract, the bias gradient included."""
    q, k, v, do, offsets = random_inputs(odd_lengths(64) + [300, 129], *heads, head_dim, dtype, "cuda")
    sinu_pos = random_angles(q.shape[0], head_dim, device="cuda") if rotary else None
    rotate = ROTATE_ALL if rotary else 0
    options = make_options(names, heads[0], 64, q.shape[0], "cuda")
    out = run_backend("triton", q, k, v, do, offsets, 64, sinu_pos, rotate, in_block=options)[0]
    grads = run_backend("sm90-gluon", q, k, v, do, offsets, 64, sinu_pos, rotate, in_block=options, forward=False)[1:]
    assert_within_2x_pytorch((out, *grads), q, k, v, do, offsets, 64, sinu_pos=sinu_pos, rotate=rotate,
                             in_block=options)


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("num_buckets,width", [(5, 0.301), (64, 0.301), (100, 0.12), (300, 0.04)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_sm90_time_bias_gradient_in_passes(num_buckets, width, head_dim, causal, poisoned_outputs):
    """The Hopper kernel without GQA sums the time bias's gradient in shared memory once a program's products are
    done, 32 to 128 buckets a pass (what its tiles' memory holds at this head dim): one pass to ten, a uint8 and an
    int32 table of buckets, times that fill the buckets. Within the contract and bitwise reproducible."""
    q, k, v, do, offsets = random_inputs(odd_lengths(64) + [300, 129], 4, 4, head_dim, torch.bfloat16, "cuda")
    options = InBlock(causal=causal, timestamps=_timestamps("rising", q.shape[0], torch.int64).cuda(),
                      time_bias=torch.randn(4, num_buckets, device="cuda"), bucket_width=width)
    out = run_backend("triton", q, k, v, do, offsets, 64, in_block=options)[0]
    grads = run_backend("sm90-gluon", q, k, v, do, offsets, 64, in_block=options, forward=False)[1:]
    assert_within_2x_pytorch((out, *grads), q, k, v, do, offsets, 64, in_block=options)
    again = run_backend("sm90-gluon", q, k, v, do, offsets, 64, in_block=options, forward=False)[1:]
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


@requires_gpu
def test_gpu_cuda_graph_replay_new_mask_each_replay(monkeypatch):
    """A captured forward + backward with dropout: each replay draws a new seed on the device (a new mask), and each
    replay's output and bias gradient match the reference with the mask of the seed that replay drew."""
    from blockattn import attention

    drawn = []
    draw = attention._dropout_seed
    monkeypatch.setattr(attention, "_dropout_seed", lambda *args: drawn.append(draw(*args)) or drawn[-1])
    q, k, v, do, offsets = random_inputs([130, 64, 7], 2, 2, 64, torch.float16, "cuda")
    pos = torch.randn(2, 127, device="cuda", requires_grad=True)

    def step():
        pos.grad = None
        out = blockattn.block_attention(q, k, v, offsets, block_size=64, pos_bias=pos, dropout_p=0.3)
        out.backward(do)
        return out

    graph, out = capture_cuda_graph(step)
    seed = drawn[-1]  # the captured draw: each replay writes its new value here
    outs = []
    for _ in range(3):
        graph.replay()
        outs.append(out.clone())
        options = InBlock(pos_bias=pos.detach(), dropout_p=0.3, seed=seed.clone())
        ref = reference_grads(q, k, v, do, offsets, 64, in_block=options)
        torch.testing.assert_close(out.double(), ref[0], atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(pos.grad.double(), ref[4], atol=2e-2, rtol=2e-3)
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])


@requires_gpu
def test_gpu_compile_fullgraph_with_options():
    q, k, v, do, offsets = random_inputs([200, 64, 5], 4, 2, 64, torch.bfloat16, "cuda")
    options = make_options("causal+pos+time", 4, 64, q.shape[0], "cuda")

    def layer(q, k, v, pos):
        return blockattn.block_attention(q, k, v, offsets, causal=True, pos_bias=pos, timestamps=options.timestamps,
                                         time_bias=options.time_bias)

    pos = options.pos_bias.clone().requires_grad_()
    got = torch.autograd.grad(torch.compile(layer, fullgraph=True)(q, k, v, pos), pos, do)[0]
    want = torch.autograd.grad(layer(q, k, v, pos), pos, do)[0]
    assert torch.equal(got, want)


@requires_gpu
def test_gpu_qkv_block_attention_with_options():
    """The packed projection with every option but dropout on the GPU (the kernels read q, k, v through strides):
    its output and the gradients of x, w and both biases against autograd through the float64 reference."""
    lengths, hq, hkv, d = [300, 64, 7, 129], 4, 2, 64
    n = sum(lengths)
    offsets = make_offsets(lengths, "cuda")
    x = torch.randn(n, 96, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(96, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16) * 96**-0.5
    options = make_options("causal+pos+time", hq, 64, n, "cuda")
    leaves = [t.clone().requires_grad_() for t in (x, w, options.pos_bias, options.time_bias)]
    out = blockattn.qkv_block_attention(leaves[0], leaves[1], offsets, num_heads=hq, num_kv_heads=hkv, causal=True,
                                        pos_bias=leaves[2], timestamps=options.timestamps, time_bias=leaves[3])
    exact = [t.detach().double().requires_grad_() for t in leaves]
    q, k, v = blockattn.custom_ops.split_heads(exact[0] @ exact[1], hq, hkv)
    ref = block_attention_reference(q, k, v, offsets, causal=True, pos_bias=exact[2], timestamps=options.timestamps,
                                    time_bias=exact[3])
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, do)
    want = torch.autograd.grad(ref, exact, do.double())
    assert snr_db(out, ref) > 40
    for g, r in zip(got, want):
        assert snr_db(g, r) > 40


@requires_gpu
def test_gpu_block_layout_compiles_and_captures():
    """A BlockLayout on the GPU: the same bits as offsets, inside torch.compile, and in a CUDA graph whose replays
    follow new offsets written into the layout's buffers by a fresh layout of the same shapes."""
    lengths = [300, 0, 64, 129, 7]
    q, k, v, do, offsets = random_inputs(lengths, 4, 2, 64, torch.bfloat16, "cuda")
    layout = blockattn.block_layout(offsets, q.shape[0])
    assert torch.equal(blockattn.block_attention(q, k, v, layout, causal=True),
                       blockattn.block_attention(q, k, v, offsets, causal=True))
    compiled = torch.compile(lambda q, k, v, offsets: blockattn.block_attention(
        q, k, v, blockattn.block_layout(offsets, q.shape[0])), fullgraph=True)
    assert torch.equal(compiled(q, k, v, offsets), blockattn.block_attention(q, k, v, offsets))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def step():
        for t in leaves:
            t.grad = None
        out = blockattn.block_attention(*leaves, layout)
        out.backward(do)
        return out

    graph, static_out = capture_cuda_graph(step)
    for new_lengths in ([100, 100, 100, 100, 100], [500, 0, 0, 0, 0]):
        new = blockattn.block_layout(make_offsets(new_lengths, "cuda"), q.shape[0])
        layout.offsets.copy_(new.offsets)
        for mine, theirs in zip(layout.table, new.table):
            mine.copy_(theirs)
        graph.replay()
        exact = reference_grads(q, k, v, do, layout.offsets, 64)
        for got, ref in zip([static_out, *(t.grad for t in leaves)], exact):
            assert snr_db(got, ref) > 40


@requires_gpu
@pytest.mark.parametrize("head_dim,block_size,num_buckets,width", [
    (64, 64, 40, None), (128, 64, 40, None), (64, 16, 300, 0.5)])  # the last: an int32 table, a width of its own
def test_gpu_layout_time_buckets_bitwise_compiled_and_captured(head_dim, block_size, num_buckets, width, monkeypatch):
    """A layout built with the timestamps holds their table of buckets on the GPU, which the forward and the
    backward read (and neither builds its own): the bits of per-call timestamps, inside torch.compile (the layout
    built there too) and in a CUDA graph; another table changes the output and the time bias's gradient."""
    lengths = [300, 0, 64, 129, 7]
    q, k, v, do, offsets = random_inputs(lengths, 4, 4, head_dim, torch.bfloat16, "cuda")
    options = make_options("causal+pos+time", 4, block_size, q.shape[0], "cuda", num_buckets=num_buckets)
    layout = blockattn.block_layout(offsets, q.shape[0], block_size, timestamps=options.timestamps,
                                    num_time_buckets=num_buckets, time_bucket_width=width)
    assert layout.time_buckets.shape == (q.shape[0], block_size)
    assert layout.time_buckets.dtype == (torch.uint8 if num_buckets <= 256 else torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, options.pos_bias, options.time_bias)]
    per_call = {"timestamps": options.timestamps, "block_size": block_size} | (
        {} if width is None else {"time_bucket_width": width})

    def forward(where, **extra):
        return blockattn.block_attention(*leaves[:3], where, causal=True, pos_bias=leaves[3], time_bias=leaves[4],
                                         **extra)

    def step(forward, *args, **extra):
        out = forward(*args, **extra)
        return [out, *torch.autograd.grad(out, leaves, do)]

    def training_step():
        for t in leaves:
            t.grad = None
        out = forward(layout)
        out.backward(do)
        return out

    graph, static_out = capture_cuda_graph(training_step)
    graph.replay()
    want = step(forward, offsets, **per_call)
    assert all(torch.equal(a, b) for a, b in zip([static_out, *(t.grad for t in leaves)], want))
    built = []
    monkeypatch.setattr(in_block, "bucket_table", lambda *args: built.append(args) or pytest.fail("a table built"))
    plans.forget()  # a replayed plan would launch a table kernel without calling bucket_table
    assert all(torch.equal(a, b) for a, b in zip(step(forward, layout), want))
    # The layout's table is what the kernels read, forward and backward: another one changes both.
    other = step(forward, layout._replace(time_buckets=layout.time_buckets // 2))
    assert not built and not torch.equal(other[0], want[0]) and not torch.equal(other[5], want[5])
    monkeypatch.undo()
    compiled = torch.compile(lambda offsets: forward(blockattn.block_layout(
        offsets, q.shape[0], block_size, timestamps=options.timestamps, num_time_buckets=num_buckets,
        time_bucket_width=width)), fullgraph=True)
    assert all(torch.equal(a, b) for a, b in zip(step(compiled, offsets), want))


@requires_gpu
def test_gpu_backward_reads_the_forward_time_buckets(monkeypatch):
    """Per call, the forward builds the time buckets' table and its backward reads it: one table a training step,
    the forward op's fourth output (its fake's shape and dtype, by opcheck)."""
    q, k, v, do, offsets = random_inputs([300, 64, 7], 4, 4, 128, torch.bfloat16, "cuda")
    options = make_options("causal+pos+time", 4, 64, q.shape[0], "cuda", num_buckets=40)
    built = []
    build = in_block.bucket_table
    monkeypatch.setattr(in_block, "bucket_table", lambda *args: built.append(build(*args)) or built[-1])
    leaves = [t.clone().requires_grad_() for t in (q, k, v, options.pos_bias, options.time_bias)]
    out = blockattn.block_attention(*leaves[:3], offsets, causal=True, pos_bias=leaves[3],
                                    timestamps=options.timestamps, time_bias=leaves[4])
    torch.autograd.grad(out, leaves, do)
    assert len(built) == 1 and built[0].shape == (q.shape[0], 64) and built[0].dtype == torch.uint8
    args = (q, k, v, offsets, None, 64, 128**-0.5, 0, True, options.pos_bias, options.timestamps, options.time_bias)
    outputs = torch.ops.blockattn.block_attention_fwd(*args)
    assert torch.equal(outputs[0], out) and torch.equal(outputs[3], built[0])
    torch.library.opcheck(torch.ops.blockattn.block_attention_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    qkv = torch.cat([q, k, v], dim=1).flatten(1)
    packed = (qkv, offsets, None, 4, 4, 64, 128**-0.5, 0, True, options.pos_bias, options.timestamps,
              options.time_bias)
    outputs = torch.ops.blockattn.qkv_block_attention_fwd(*packed)
    assert torch.equal(outputs[0], out) and torch.equal(outputs[3], built[0])
    torch.library.opcheck(torch.ops.blockattn.qkv_block_attention_fwd.default, packed,
                          test_utils=("test_schema", "test_faketensor"))
