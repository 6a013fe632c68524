"""Rotary embedding: ``apply_rotary``, rotary fused into the attention kernels, and ``qkv_block_attention``, against
float64 PyTorch (projection -> rotary -> reference attention). Triton kernels run in the interpreter on CPU and for
real on a GPU; the CPU path through the public functions."""

import math

import pytest
import torch
from conftest import (
    HAS_GPU,
    KERNEL_DEVICE,
    KERNEL_DTYPES,
    absolute_slack,
    assert_within_2x_pytorch,
    max_err,
    odd_lengths,
    random_angles,
    random_inputs,
    reference_grads,
    rotated_reference,
    run_kernels,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blockattn
from blockattn.block_table import build_block_table
from blockattn.checks import rotate_mask
from blockattn.custom_ops import split_heads
from blockattn.ops import rotary as rotary_impl
from blockattn.ops import tiles
from blockattn.ops.block_attention_torch import rotary_torch
from blockattn.ops.tiles import ROTATE_ALL, ROTATE_BITS
from blockattn.reference import block_attention_reference, rotary_reference

# Every subset of q, k, v as a ROTATE mask, with readable ids.
ROTATE_MASKS = [rotate_mask(tuple(names)) for names in ("qkv", "qk", "q", "k", "v", "")]
ROTATE_IDS = ["qkv", "qk", "q", "k", "v", "none"]


# --- apply_rotary ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [2, 6, 16, 40, 128, 256])
@pytest.mark.parametrize(
    "run,dtype",
    [(rotary_impl.rotary_triton, dtype) for dtype in KERNEL_DTYPES]
    + [(rotary_torch, dtype) for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)],
    ids=lambda arg: str(arg).replace("torch.", "") if isinstance(arg, torch.dtype) else arg.__name__,
)
def test_rotary_forward_and_inverse(run, dtype, head_dim, poisoned_outputs):
    device = KERNEL_DEVICE if run is rotary_impl.rotary_triton else "cpu"
    n = 77
    x = torch.randn(n, 3, head_dim, dtype=dtype, device=device)
    sinu_pos = random_angles(n, head_dim, device=device)
    for inverse in (False, True):
        got = run(x, sinu_pos, inverse)
        ref = rotary_reference(x, sinu_pos, inverse=inverse)
        same_precision = rotary_reference(x, sinu_pos, inverse=inverse, compute_dtype=dtype)
        assert got.dtype == dtype and got.shape == x.shape
        # Computed in fp32 and rounded once: at most the one rounding PyTorch's same-precision result also has.
        assert max_err(got, ref) <= max(max_err(same_precision, ref), absolute_slack(dtype) / 10)
    # Turning back recovers the input up to the two roundings (and the fp32 angles' sin^2 + cos^2 != 1).
    back = run(run(x, sinu_pos, False), sinu_pos, True)
    eps = max(torch.finfo(dtype).eps, torch.finfo(sinu_pos.dtype).eps)
    torch.testing.assert_close(back.double(), x.double(), atol=4 * eps * 4, rtol=0)


def test_rotary_kernel_strided_input_fp32_angles_and_empty():
    packed = torch.randn(50, 2, 4, 32, dtype=torch.float16, device=KERNEL_DEVICE)
    x = packed[:, 1]  # non-contiguous rows and heads
    sinu_pos = random_angles(100, 32, device=KERNEL_DEVICE)[::2]  # strided angles
    torch.testing.assert_close(rotary_impl.rotary_triton(x, sinu_pos, False).double(),
                               rotary_reference(x, sinu_pos), atol=2e-3, rtol=0)
    # Into given outputs: one whose pairs can be written as words, one whose pairs cannot (an odd start: a copy)
    for out in (torch.empty_like(x), torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view(x.shape)):
        assert rotary_impl.rotary_triton(x, sinu_pos, True, out=out) is out
        torch.testing.assert_close(out.double(), rotary_reference(x, sinu_pos, inverse=True), atol=2e-3, rtol=0)
    empty = torch.empty(0, 2, 32, dtype=torch.float16, device=KERNEL_DEVICE)
    assert rotary_impl.rotary_triton(empty, sinu_pos[:0], False).shape == empty.shape


def test_apply_rotary_autograd_cpu():
    x = torch.randn(33, 2, 24, requires_grad=True)
    sinu_pos = random_angles(33, 24)
    grad = torch.randn(33, 2, 24)
    y = blockattn.apply_rotary(x, sinu_pos)
    y.backward(grad)
    x64 = x.detach().double().requires_grad_()
    rotary_reference(x64, sinu_pos).backward(grad.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps every head's norm


# --- rotary fused into the attention kernels ------------------------------------------------------------------------


@pytest.mark.parametrize("rotate", ROTATE_MASKS, ids=ROTATE_IDS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_fused_kernels_every_rotate_gqa_odd_lengths(rotate, dtype, poisoned_outputs):
    q, k, v, do, offsets = random_inputs(odd_lengths(16), 4, 2, 32, dtype, KERNEL_DEVICE)
    sinu_pos = random_angles(q.shape[0], 32, dtype, KERNEL_DEVICE)
    assert_within_2x_pytorch(run_kernels(q, k, v, do, offsets, 16, sinu_pos, rotate), q, k, v, do, offsets, 16,
                             sinu_pos=sinu_pos, rotate=rotate)


@pytest.mark.parametrize(
    "block_size,head_dim,hq,hkv,options",
    [(16, 16, 1, 1, {}), (32, 40, 3, 1, {}), (128, 136, 2, 1, {}), (16, 256, 2, 2, {}),
     (64, 128, 2, 2, {}), (64, 72, 3, 3, {}), (128, 64, 2, 2, {}), (32, 42, 2, 2, {})],
    ids=["d16", "d40-gqa", "sliced-gqa", "d256", "d128", "d72", "bs128", "d42"],
)
def test_fused_kernels_head_dims(block_size, head_dim, hq, hkv, options, poisoned_outputs):
    """Every kernel variant with all three operands rotated: padded head dims (D = 16 pads its pairs to 16),
    head-dim slices (the angles of each slice), GQA, the production shape. D = 42 has an odd number of pairs: the
    GPU backward stores its gradients through the coalesced path, not two pair words at a time."""
    q, k, v, do, offsets = random_inputs(odd_lengths(block_size), hq, hkv, head_dim, torch.float16, KERNEL_DEVICE)
    sinu_pos = random_angles(q.shape[0], head_dim, torch.float16, KERNEL_DEVICE)
    assert_within_2x_pytorch(run_kernels(q, k, v, do, offsets, block_size, sinu_pos, ROTATE_ALL, **options), q, k, v,
                             do, offsets, block_size, sinu_pos=sinu_pos, rotate=ROTATE_ALL)


def test_wide_stores_only_where_each_store_is_aligned():
    """The backward stores two pair words at once (inline PTX) only on NVIDIA GPUs and where every such store is
    aligned: D a multiple of 4, strides and start multiples of four elements."""
    x = torch.empty(8, 2, 128, dtype=torch.float16, device=KERNEL_DEVICE)
    assert rotary_impl.wide_stores_ok(x) == (KERNEL_DEVICE == "cuda")
    assert not rotary_impl.wide_stores_ok(torch.empty(8, 2, 42, dtype=torch.float16, device=KERNEL_DEVICE))
    shifted = torch.empty(8 * 2 * 128 + 2, dtype=torch.float16, device=KERNEL_DEVICE)[2:].view(8, 2, 128)
    assert not rotary_impl.wide_stores_ok(shifted)
    assert not rotary_impl.wide_stores_ok(torch.empty(8, 2, 128, 2, dtype=torch.float16, device=KERNEL_DEVICE)[..., 0])
    assert not rotary_impl.wide_stores_ok(torch.empty(8, 2, 130, dtype=torch.float16, device=KERNEL_DEVICE)[..., :128])


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 70), min_size=1, max_size=4),
    block_size=st.sampled_from([16, 32, 64]),
    heads=st.sampled_from([(1, 1), (2, 1), (3, 3)]),
    head_dim=st.sampled_from([16, 24, 64]),
    rotate=st.sampled_from(ROTATE_MASKS),
    seed=st.integers(0, 2**31 - 1),
)
def test_fused_kernels_random_shapes(lengths, block_size, heads, head_dim, rotate, seed):
    torch.manual_seed(seed)
    q, k, v, do, offsets = random_inputs(lengths, *heads, head_dim, torch.float16, KERNEL_DEVICE)
    sinu_pos = random_angles(q.shape[0], head_dim, torch.float32, KERNEL_DEVICE)
    assert_within_2x_pytorch(run_kernels(q, k, v, do, offsets, block_size, sinu_pos, rotate), q, k, v, do, offsets,
                             block_size, sinu_pos=sinu_pos, rotate=rotate)


@pytest.mark.parametrize("rotate", [ROTATE_ALL, 0], ids=["rotary", "plain"])
@pytest.mark.parametrize("hq,hkv", [(3, 3), (4, 2)], ids=["mha", "gqa"])
def test_fused_kernels_packed_qkv_layout(hq, hkv, rotate, poisoned_outputs):
    """q, k, v read from one packed [N, (Hq + 2 Hkv) D] projection through strides, the gradients written into views
    of one packed buffer; grad_out has its own layout (without rotary and GQA: the persistent backward's separate
    dO tile)."""
    _check_packed_qkv(odd_lengths(64) + [130], hq, hkv, 128, 64, rotate, torch.float16)


def _check_packed_qkv(lengths, hq, hkv, d, block_size, rotate, angles_dtype):
    """The kernels on q, k, v read out of one packed fp16 projection, their gradients written into views of one
    packed buffer: written there, and within the accuracy contract."""
    _, _, _, do, offsets = random_inputs(lengths, hq, hkv, d, torch.float16, KERNEL_DEVICE)
    n = do.shape[0]
    qkv = torch.randn(n, (hq + 2 * hkv) * d, dtype=torch.float16, device=KERNEL_DEVICE)
    q, k, v = split_heads(qkv, hq, hkv)
    sinu_pos = random_angles(n, d, angles_dtype, KERNEL_DEVICE)
    dqkv = tiles.new_output(qkv)
    out, *grads = run_kernels(q, k, v, do, offsets, block_size, sinu_pos, rotate, grads=split_heads(dqkv, hq, hkv))
    assert all(g.data_ptr() == p.data_ptr() for g, p in zip(grads, split_heads(dqkv, hq, hkv)))
    assert_within_2x_pytorch((out, *split_heads(dqkv, hq, hkv)), q, k, v, do, offsets, block_size, sinu_pos=sinu_pos,
                             rotate=rotate)


@pytest.mark.parametrize("rotate", [ROTATE_ALL, rotate_mask(("q", "k")), rotate_mask(("v",))], ids=["qkv", "qk", "v"])
def test_backward_rotated_apart_at_128_token_blocks_past_d128(rotate, poisoned_outputs, monkeypatch):
    """At 128-token blocks past D = 128 under GQA the Triton backward rotates apart (the rotary kernel, the plain
    backward, the rotary kernel turning the gradients back): within the accuracy contract, the gradients written into
    views of one packed buffer, and only there (D = 128, or without GQA, keeps the fused rotation)."""
    from blockattn.ops import block_attention as triton_ops

    assert triton_ops.rotates_apart(128, 256, 2) and triton_ops.rotates_apart(128, 136, 4)
    assert not (triton_ops.rotates_apart(128, 128, 2) or triton_ops.rotates_apart(128, 256, 1)
                or triton_ops.rotates_apart(64, 256, 2))
    rotated = []
    turn = rotary_impl.rotary_triton
    monkeypatch.setattr(triton_ops, "rotary_triton", lambda *a, **kw: rotated.append(a[2]) or turn(*a, **kw))
    lengths = odd_lengths(128) if HAS_GPU else [0, 1, 129]  # the interpreter: a full block and two partial ones
    _check_packed_qkv(lengths, 4, 2, 136, 128, rotate, torch.float32)
    # the forward rotates fused; the backward's rotary kernel turns each rotated operand, then its gradient back
    assert rotated == [False] * rotate.bit_count() + [True] * rotate.bit_count()


# --- public functions (the CPU path here; the kernels through them in test_gpu.py) ----------------------------------


@pytest.mark.parametrize("rotate", [("q", "k", "v"), ("q", "k"), ("v",), ()], ids=str)
def test_block_attention_sinu_pos_autograd_cpu(rotate):
    q, k, v, do, offsets = random_inputs(odd_lengths(32), 4, 2, 32, torch.float32, "cpu")
    sinu_pos = random_angles(q.shape[0], 32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = blockattn.block_attention(*leaves, offsets, block_size=32, sinu_pos=sinu_pos, rotate=rotate)
    out.backward(do)
    mask = rotate_mask(rotate)
    exact = reference_grads(q, k, v, do, offsets, 32, sinu_pos=sinu_pos, rotate=mask)
    for got, ref in zip([out, *(t.grad for t in leaves)], exact):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-4)


def test_block_attention_nested_sinu_pos():
    lengths = [5, 0, 40]
    q, k, v, _do, offsets = random_inputs(lengths, 2, 1, 16, torch.float32, "cpu", torch.int64)
    sinu_pos = random_angles(q.shape[0], 16)
    nested = [torch.nested.nested_tensor_from_jagged(t, offsets) for t in (q, k, v, sinu_pos)]
    out = blockattn.block_attention(*nested[:3], block_size=16, sinu_pos=nested[3])
    plain = blockattn.block_attention(q, k, v, offsets, block_size=16, sinu_pos=sinu_pos)
    torch.testing.assert_close(out.values(), plain)


def qkv_reference(x, w, bias, offsets, hq, hkv, sinu_pos, rotate, block_size, compute_dtype):
    """Projection -> rotary -> reference attention in ``compute_dtype``; returns out and the leaves (x, w, bias)."""
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (x, w, bias)]
    qkv = leaves[0] @ leaves[1] + leaves[2]
    q, k, v = rotated_reference(split_heads(qkv, hq, hkv), sinu_pos, rotate, compute_dtype)
    out = block_attention_reference(q, k, v, offsets, block_size=block_size, compute_dtype=compute_dtype)
    return out, leaves, qkv


def check_qkv_block_attention(device, dtype, hq, hkv, rotate, block_size=64, d=32, d_model=48):
    """out, dx, dw, dbias and the packed dqkv within 2x PyTorch's same-precision error of float64."""
    _, _, _, _, offsets = random_inputs(odd_lengths(block_size), 1, 1, 8, dtype, device)
    n = int(offsets[-1])
    x = torch.randn(n, d_model, dtype=dtype, device=device)
    w = torch.randn(d_model, (hq + 2 * hkv) * d, dtype=dtype, device=device) / math.sqrt(d_model)
    bias = torch.randn((hq + 2 * hkv) * d, dtype=dtype, device=device)
    do = torch.randn(n, hq, d, dtype=dtype, device=device)
    sinu_pos = random_angles(n, d, dtype, device)
    names = tuple(name for name in "qkv" if rotate & ROTATE_BITS[name])
    leaves = [t.clone().requires_grad_() for t in (x, w, bias)]
    out = blockattn.qkv_block_attention(leaves[0], leaves[1], offsets, num_heads=hq, num_kv_heads=hkv,
                                        sinu_pos=sinu_pos, bias=leaves[2], block_size=block_size, rotate=names)
    out.backward(do)
    # The packed gradient, as the backward op writes it.
    qkv = torch.addmm(bias, x, w)
    scale = 1.0 / math.sqrt(d)
    _, block_cum, block_seq, _ = torch.ops.blockattn.qkv_block_attention_fwd(qkv, offsets, sinu_pos, hq, hkv,
                                                                             block_size, scale, rotate)
    dqkv, *_ = torch.ops.blockattn.qkv_block_attention_bwd(do, qkv, offsets, sinu_pos, block_cum, block_seq, hq, hkv,
                                                           block_size, scale, rotate)
    results = [out, dqkv, *(t.grad for t in leaves)]
    expected = []
    for compute_dtype in (torch.float64, dtype):
        ref, ref_leaves, ref_qkv = qkv_reference(x, w, bias, offsets, hq, hkv, sinu_pos, rotate, block_size,
                                                 compute_dtype)
        expected.append([ref, *torch.autograd.grad(ref, [ref_qkv, *ref_leaves], do.to(compute_dtype))])
    for name, got, exact, same_precision in zip(("out", "dqkv", "dx", "dw", "dbias"), results, *expected):
        assert got.shape == exact.shape and got.dtype == dtype, name
        err, pt_err = max_err(got, exact), max_err(same_precision, exact)
        assert err <= 2 * pt_err + 1e-5, f"{name}: max error {err:.3e} > 2 x PyTorch's {pt_err:.3e}"


@pytest.mark.parametrize("rotate", [ROTATE_ALL, rotate_mask(("q", "k")), 0], ids=["qkv", "qk", "none"])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1)], ids=["mha", "gqa"])
def test_qkv_block_attention_cpu(hq, hkv, rotate):
    check_qkv_block_attention("cpu", torch.float32, hq, hkv, rotate)


def test_qkv_block_attention_without_bias_and_sinu_pos():
    _, _, _, _, offsets = random_inputs([30, 70], 1, 1, 8, torch.float32, "cpu")
    x, w = torch.randn(100, 16), torch.randn(16, 3 * 2 * 16)
    out = blockattn.qkv_block_attention(x, w, offsets, num_heads=2, num_kv_heads=2, block_size=32)
    q, k, v = split_heads(x @ w, 2, 2)
    torch.testing.assert_close(out, blockattn.block_attention(q, k, v, offsets, block_size=32))


def test_fake_tensors_and_opcheck_rotary_ops():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        qkv = torch.empty(100, 9 * 64, dtype=torch.bfloat16)
        offsets = torch.zeros(3, dtype=torch.int32)
        sinu_pos = torch.empty(100, 64, dtype=torch.bfloat16)
        out, block_cum, block_seq, _ = torch.ops.blockattn.qkv_block_attention_fwd(qkv, offsets, sinu_pos, 3, 3, 64,
                                                                                   0.125, ROTATE_ALL)
        dqkv, *_ = torch.ops.blockattn.qkv_block_attention_bwd(out, qkv, offsets, sinu_pos, block_cum, block_seq, 3,
                                                               3, 64, 0.125, ROTATE_ALL)
        rotated = blockattn.apply_rotary(torch.empty(100, 3, 64), sinu_pos.float())
    assert out.shape == (100, 3, 64) and dqkv.shape == qkv.shape and rotated.shape == (100, 3, 64)

    q, k, v, do, offsets = random_inputs([30, 3], 4, 2, 16, torch.float32, "cpu")
    sinu_pos = random_angles(33, 16)
    table = build_block_table(offsets, 33, 16)
    torch.library.opcheck(torch.ops.blockattn.block_attention_bwd.default,
                          (do, q, k, v, offsets, sinu_pos, *table, 16, 0.25, 5))
    torch.library.opcheck(torch.ops.blockattn.block_attention_fwd.default,
                          (*(t.requires_grad_() for t in (q, k, v)), offsets, sinu_pos, 16, 0.25, ROTATE_ALL))
    qkv = torch.randn(33, 4 * 16, requires_grad=True)
    torch.library.opcheck(torch.ops.blockattn.qkv_block_attention_fwd.default,
                          (qkv, offsets, sinu_pos, 2, 1, 16, 0.25, 3))
    torch.library.opcheck(torch.ops.blockattn.qkv_block_attention_bwd.default,
                          (torch.randn(33, 2, 16), qkv.detach(), offsets, sinu_pos, *table, 2, 1, 16, 0.25, 3))
    torch.library.opcheck(torch.ops.blockattn.rotary.default, (torch.randn(33, 2, 16, requires_grad=True), sinu_pos,
                                                                False))


def test_compile_fullgraph_qkv_cpu():
    _, _, _, _, offsets = random_inputs([9, 40], 1, 1, 8, torch.float32, "cpu")
    x, w, bias = torch.randn(49, 16), torch.randn(16, 4 * 16), torch.randn(4 * 16)
    sinu_pos = random_angles(49, 16)

    def layer(x, w, bias):
        out = blockattn.qkv_block_attention(x, w, offsets, num_heads=2, num_kv_heads=1, sinu_pos=sinu_pos,
                                            bias=bias, block_size=16)
        return blockattn.apply_rotary(out, sinu_pos).sum()

    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    leaves = [t.clone().requires_grad_() for t in (x, w, bias)]
    compiled(*leaves).backward()
    eager = [t.clone().requires_grad_() for t in (x, w, bias)]
    layer(*eager).backward()
    # Inductor may reorder fp32 sums: allow a few roundings per term of the longest reduction (dw and dbias sum
    # over the 49 tokens, dx over the 64 projected columns).
    reduction = max(x.shape[0], w.shape[1])
    for a, b in zip(leaves, eager):
        atol = 4 * torch.finfo(torch.float32).eps * reduction * b.grad.abs().max().item()
        torch.testing.assert_close(a.grad, b.grad, atol=atol, rtol=0)
