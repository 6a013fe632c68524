"""float8 inference (``block_attention`` with ``float8_e4m3fn`` q, k, v): the kernels (Triton's interpreter on CPU,
the real ones on a GPU) and the PyTorch path against the float64 reference on the dequantised inputs, by SNR."""

import pytest
import torch
from conftest import HAS_GPU, KERNEL_DEVICE, ON_HOPPER, forward_of, make_offsets, odd_lengths, requires_gpu

import blockattn
from blockattn import backends, devices
from blockattn.backends import AttentionCall
from blockattn.block_table import build_block_table
from blockattn.ops import block_attention as triton_ops
from blockattn.ops import fp8
from blockattn.ops.in_block import PLAIN
from blockattn.reference import block_attention_reference, quantised_fp8, snr_db

FP8 = torch.float8_e4m3fn
# SNR bounds against the reference on the dequantised inputs (dB): the products are 16-bit with fp32 accumulation,
# so the output's own rounding dominates. Triton's interpreter truncates where the GPU rounds to nearest: looser
# bounds there.
MIN_SNR_DB = {torch.bfloat16: 45.0, torch.float16: 60.0, torch.float32: 60.0, FP8: 28.0 if HAS_GPU else 20.0}


def quantized_inputs(lengths, hq, hkv, d, device):
    """fp8 q, k, v (random, each scaled into e4m3's range by its own descale), the descales, and the dequantised
    inputs in float64."""
    n = sum(lengths)
    scales = [torch.tensor([s], device=device) for s in (0.02, 0.015, 0.03)]
    tensors = [(torch.randn(n, h, d, device=device) / s).to(FP8) for h, s in zip((hq, hkv, hkv), scales)]
    exact = [t.double() * s.double() for t, s in zip(tensors, scales)]
    return tensors, scales, exact


def out_scale_for(out_dtype, device):
    return torch.tensor([0.01], device=device) if out_dtype == FP8 else None


def as_float64(out, out_scale):
    return out.double() * (out_scale.double() if out_scale is not None else 1.0)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32, FP8])
@pytest.mark.parametrize("block_size", [16, 64] + ([32, 128] if HAS_GPU else []))
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1)])
def test_kernel_matches_dequantised_reference(out_dtype, block_size, hq, hkv, poisoned_outputs):
    lengths = odd_lengths(block_size)
    offsets = make_offsets(lengths, KERNEL_DEVICE)
    (q, k, v), scales, exact = quantized_inputs(lengths, hq, hkv, 32, KERNEL_DEVICE)
    out_scale = out_scale_for(out_dtype, KERNEL_DEVICE)
    table = build_block_table(offsets, q.shape[0], block_size)
    out = triton_ops.block_attention_fwd_triton(q, k, v, offsets, table, block_size, 32**-0.5, None, 0, PLAIN,
                                                fp8.Fp8Scales(*scales, out_dtype, out_scale))
    assert out.dtype == out_dtype and out.shape == q.shape
    assert not out.float().isnan().any()  # every element written (outputs start as NaN)
    ref = block_attention_reference(*exact, offsets, block_size=block_size)
    assert snr_db(as_float64(out, out_scale), ref) > MIN_SNR_DB[out_dtype]


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32, FP8])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("hq,hkv", [(3, 3), (4, 2), (8, 1), (8, 4)])
def test_sm90_forward(hq, hkv, head_dim, block_size, out_dtype, poisoned_outputs):
    """The warp-specialised Hopper forward on fp8 inputs (its q k^T on fp8 tensor cores, the values widened to fp16
    in shared memory; at 128-token blocks in halves, each consumer widening half of a block's values), on odd
    lengths and more, every group it takes, every output dtype: the bounds of the Triton forward."""
    lengths = odd_lengths(block_size) + torch.randint(0, 300, (4,)).tolist()
    offsets = make_offsets(lengths, "cuda")
    (q, k, v), scales, exact = quantized_inputs(lengths, hq, hkv, head_dim, "cuda")
    out_scale = out_scale_for(out_dtype, "cuda")
    call = AttentionCall.of("fwd", q, k, block_size, 0, 0, tensors=(q, k, v))
    assert backends.sm90_fwd_ops.kernel_reason(call) is None
    out = forward_of("sm90-gluon", q, k, v, offsets, block_size,
                     fp8_scales=fp8.Fp8Scales(*scales, out_dtype, out_scale))
    assert out.dtype == out_dtype and out.shape == q.shape
    assert not out.float().isnan().any()  # every element written (outputs start as NaN)
    ref = block_attention_reference(*exact, offsets, block_size=block_size)
    assert snr_db(as_float64(out, out_scale), ref) > MIN_SNR_DB[out_dtype]


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("ends_early", [True, False], ids=["short-first", "long-first"])
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(3, 3), (6, 2)])
def test_sm90_forward_several_items_a_program(hq, hkv, block_size, ends_early, monkeypatch, poisoned_outputs):
    """Two programs (the grid is one a multiprocessor, here said to be two), each running dozens of items in turn: at
    128-token blocks the two widened value tiles taken in turn and the barrier on which both consumers widen every
    block's values, phase after phase. Then a NaN in one sequence's q, k and v, which the partial block before it
    loads past its end, reaches no other row: that block ends in the first or (at 128-token blocks) the second half
    of its rows, each widened by one consumer."""
    monkeypatch.setattr(devices, "multiprocessors", lambda device: 2)
    lengths = ([23 if ends_early else block_size // 2 + 5, 23] + torch.randint(0, 700, (24,)).tolist()
               + odd_lengths(block_size))
    offsets = make_offsets(lengths, "cuda")
    (q, k, v), scales, exact = quantized_inputs(lengths, hq, hkv, 64, "cuda")
    fp8_scales = fp8.Fp8Scales(*scales, torch.bfloat16)
    clean = forward_of("sm90-gluon", q, k, v, offsets, block_size, fp8_scales=fp8_scales)
    ref = block_attention_reference(*exact, offsets, block_size=block_size)
    assert snr_db(clean.double(), ref) > MIN_SNR_DB[torch.bfloat16]
    poisoned = slice(lengths[0], lengths[0] + lengths[1])  # the second sequence
    for t in (q, k, v):
        t[poisoned] = float("nan")
    out = forward_of("sm90-gluon", q, k, v, offsets, block_size, fp8_scales=fp8_scales)
    outside = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
    outside[poisoned] = False
    assert torch.equal(out[outside], clean[outside])
    assert out[poisoned].isnan().all()


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("backend", ["sm90-gluon", "triton"])
def test_a_zero_descale_gives_uniform_weights(backend, block_size, poisoned_outputs):
    """A q descale of 0 makes every score 0: each row averages its block's values. The masked keys stay out: their
    -inf is set after the scale (masking first would give 0 * -inf = NaN)."""
    lengths = odd_lengths(block_size) + [200]
    offsets = make_offsets(lengths, "cuda")
    (q, k, v), (_, k_descale, v_descale), exact = quantized_inputs(lengths, 4, 2, 128, "cuda")
    zero = torch.zeros(1, device="cuda")
    out = forward_of(backend, q, k, v, offsets, block_size,
                     fp8_scales=fp8.Fp8Scales(zero, k_descale, v_descale, torch.bfloat16))
    ref = block_attention_reference(exact[0] * 0, *exact[1:], offsets, block_size=block_size)
    assert snr_db(out.double(), ref) > MIN_SNR_DB[torch.bfloat16]


@pytest.mark.parametrize("head_dim", [32, 128])
def test_fp8_dot_override(head_dim, poisoned_outputs):
    """q k^T on fp8 tensor cores (the default where slices are 32+ wide) and on operands widened to fp16 both meet
    the bf16 output's bound, with fp32 outputs. On a GPU they differ (which shows the override reaches the kernel): Hopper's fp8 tensor
    cores sum with fewer bits than fp32 (outputs differed by up to 1.5e-3 at D = 128 on an H100); Triton's
    interpreter widens fp8 products itself. Where fp8 tensor cores cannot run, the override is refused."""
    lengths = odd_lengths(64)
    offsets = make_offsets(lengths, KERNEL_DEVICE)
    (q, k, v), scales, exact = quantized_inputs(lengths, 4, 2, head_dim, KERNEL_DEVICE)
    table = build_block_table(offsets, q.shape[0], 64)
    ref = block_attention_reference(*exact, offsets, block_size=64)

    def run(**override):
        return triton_ops.block_attention_fwd_triton(q, k, v, offsets, table, 64, head_dim**-0.5, None, 0, PLAIN,
                                                     fp8.Fp8Scales(*scales, torch.float32), **override)

    outs = [run(fp8_dot=fp8_dot) for fp8_dot in (False, True)]
    for out in outs:
        assert not out.isnan().any()  # every element written (outputs start as NaN)
        assert snr_db(out.double(), ref) > MIN_SNR_DB[torch.bfloat16]
    if HAS_GPU:
        assert not torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="fp8_dot needs fp8 inputs, no rotary"):
        triton_ops.block_attention_fwd_triton(q, k, v, offsets, table, 64, head_dim**-0.5,
                                              torch.zeros(q.shape[0], head_dim, device=KERNEL_DEVICE), 1, PLAIN,
                                              fp8.Fp8Scales(*scales, torch.float32), fp8_dot=True)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("rotate", [("q", "k"), ("q", "k", "v")])
def test_kernel_fused_rotary(out_dtype, rotate, poisoned_outputs):
    """fp8 with a fused rotary: the dequantised operands turned (and rounded to fp16) in the kernel, against the
    reference of the turned dequantised inputs."""
    from conftest import random_angles

    from blockattn.ops.tiles import ROTATE_BITS
    from blockattn.reference import rotary_reference

    lengths = odd_lengths(32) + [70]
    offsets = make_offsets(lengths, KERNEL_DEVICE)
    (q, k, v), scales, exact = quantized_inputs(lengths, 4, 2, 64, KERNEL_DEVICE)
    n = q.shape[0]
    sinu_pos = random_angles(n, 64, device=KERNEL_DEVICE)
    out_scale = out_scale_for(out_dtype, KERNEL_DEVICE)
    table = build_block_table(offsets, n, 32)
    mask = sum(ROTATE_BITS[name] for name in rotate)
    out = triton_ops.block_attention_fwd_triton(q, k, v, offsets, table, 32, 64**-0.5, sinu_pos, mask, PLAIN,
                                                fp8.Fp8Scales(*scales, out_dtype, out_scale))
    assert not out.float().isnan().any()  # every element written (outputs start as NaN)
    turned = [rotary_reference(t, sinu_pos.double()) if name in rotate else t for name, t in zip("qkv", exact)]
    ref = block_attention_reference(*turned, offsets, block_size=32)
    assert snr_db(as_float64(out, out_scale), ref) > MIN_SNR_DB[out_dtype]


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, FP8])
def test_public_op_with_options_and_the_pytorch_path(out_dtype):
    """Through ``block_attention`` (the kernels where they run, and the PyTorch path on the CPU), with a causal mask,
    a position bias and a fused rotary; the PyTorch path within the bound too."""
    from conftest import random_angles

    from blockattn.reference import rotary_reference

    lengths = odd_lengths(32) + [100]
    hq = 2
    options = {"causal": True, "pos_bias": torch.randn(hq, 63), "sinu_pos": random_angles(sum(lengths), 32)}
    for device in dict.fromkeys(("cpu", KERNEL_DEVICE)):
        offsets = make_offsets(lengths, device)
        (q, k, v), scales, exact = quantized_inputs(lengths, hq, hq, 32, device)
        out_scale = out_scale_for(out_dtype, device)
        kwargs = {name: t.to(device) if isinstance(t, torch.Tensor) else t for name, t in options.items()}
        out = blockattn.block_attention(q, k, v, offsets, block_size=32, q_descale=scales[0], k_descale=scales[1],
                                        v_descale=scales[2], out_dtype=out_dtype, out_scale=out_scale, **kwargs)
        turned = [rotary_reference(t.cpu(), options["sinu_pos"].double()) for t in exact]
        ref = block_attention_reference(*turned, offsets.cpu(), block_size=32, causal=True,
                                        pos_bias=options["pos_bias"].double())
        assert out.dtype == out_dtype
        assert snr_db(as_float64(out, out_scale).cpu(), ref) > MIN_SNR_DB[out_dtype]


def test_default_output_is_bfloat16_and_fp8_saturates():
    lengths = [40]
    offsets = make_offsets(lengths)
    (q, k, v), scales, _ = quantized_inputs(lengths, 1, 1, 16, "cpu")
    assert blockattn.block_attention(q, k, v, offsets, block_size=16, q_descale=scales[0], k_descale=scales[1],
                                     v_descale=scales[2]).dtype == torch.bfloat16
    tiny = torch.tensor([1e-6])  # every output far beyond e4m3's range: saturated, never NaN
    out = blockattn.block_attention(q, k, v, offsets, block_size=16, q_descale=scales[0], k_descale=scales[1],
                                    v_descale=scales[2], out_dtype=FP8, out_scale=tiny)
    assert not out.float().isnan().any() and out.float().abs().max() == fp8.FP8_MAX


def test_fakes_and_compile():
    """Meta tensors and torch.compile see the output dtype."""
    with torch.device("meta"):
        q = torch.empty(50, 2, 16, dtype=FP8)
        scales = [torch.ones(1) for _ in range(3)]
        out = blockattn.block_attention(q, q, q, torch.tensor([0, 50]), block_size=16, q_descale=scales[0],
                                        k_descale=scales[1], v_descale=scales[2], out_dtype=torch.float16)
    assert out.device.type == "meta" and out.dtype == torch.float16
    lengths = [9, 40]
    offsets = make_offsets(lengths)
    (q, k, v), scales, _ = quantized_inputs(lengths, 2, 2, 16, "cpu")

    def run(q, k, v):
        return blockattn.block_attention(q, k, v, offsets, block_size=16, q_descale=scales[0], k_descale=scales[1],
                                         v_descale=scales[2])

    compiled = torch.compile(run, fullgraph=True)
    assert torch.equal(compiled(q, k, v), run(q, k, v))


def _call(**overrides):
    lengths = [20]
    offsets = make_offsets(lengths)
    (q, k, v), scales, _ = quantized_inputs(lengths, 2, 2, 16, "cpu")
    kwargs = {"q_descale": scales[0], "k_descale": scales[1], "v_descale": scales[2], **overrides}
    tensors = {"q": q, "k": k, "v": v}
    for name in ("q", "k", "v"):
        if name in kwargs:
            tensors[name] = kwargs.pop(name)
    return blockattn.block_attention(*tensors.values(), offsets, block_size=16, **kwargs)


@pytest.mark.parametrize("overrides,error,message", [
    ({"k_descale": None}, ValueError, "k_descale is required with float8_e4m3fn inputs"),
    ({"q_descale": torch.ones(2)}, ValueError, "q_descale must be a 1-element float32 tensor"),
    ({"v_descale": torch.ones(1, dtype=torch.float64)}, ValueError, "v_descale must be a 1-element float32"),
    ({"out_dtype": torch.int8}, ValueError, "out_dtype must be bfloat16, float16, float32 or float8_e4m3fn"),
    ({"out_dtype": FP8}, ValueError, "out_scale is required with out_dtype=torch.float8_e4m3fn"),
    ({"out_scale": torch.ones(1)}, ValueError, "out_scale is required with out_dtype=torch.float8_e4m3fn"),
    ({"out_dtype": FP8, "out_scale": torch.ones(3)}, ValueError, "out_scale must be a 1-element float32 tensor"),
    ({"q": torch.zeros(20, 2, 16)}, TypeError, "q, k and v must share a dtype"),
])
def test_validation(overrides, error, message):
    with pytest.raises(error, match=message):
        _call(**overrides)


def test_validation_non_fp8_inputs_and_gradients():
    lengths = [20]
    offsets = make_offsets(lengths)
    q = torch.randn(20, 2, 16)
    with pytest.raises(ValueError, match="q_descale applies to float8_e4m3fn inputs only"):
        blockattn.block_attention(q, q, q, offsets, block_size=16, q_descale=torch.ones(1))
    with pytest.raises(ValueError, match="out_dtype applies to float8_e4m3fn inputs only"):
        blockattn.block_attention(q, q, q, offsets, block_size=16, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="the float8 forward is for inference: q must not require grad"):
        _call(q=torch.zeros(20, 2, 16).to(FP8).requires_grad_())
    with pytest.raises(ValueError, match="inference: k_descale, pos_bias must not require grad"):
        _call(k_descale=torch.ones(1, requires_grad=True), pos_bias=torch.zeros(2, 31, requires_grad=True))
    with torch.no_grad():  # nothing is differentiated there
        _call(pos_bias=torch.zeros(2, 31, requires_grad=True))
    with pytest.raises(TypeError, match=r"time_bias must be float32, bfloat16 or float16 \(with float8 inputs\)"):
        _call(time_bias=torch.zeros(2, 8).to(FP8), timestamps=torch.arange(20))


def test_raw_op_defaults_to_a_bfloat16_output():
    """Called as ``torch.ops.blockattn.block_attention_fwd`` without ``out_dtype`` (the public function always
    passes one), fp8 inputs give bf16 in the fake and in the implementation alike."""
    lengths = [20]
    offsets = make_offsets(lengths)
    (q, k, v), scales, exact = quantized_inputs(lengths, 2, 2, 16, "cpu")
    op = torch.ops.blockattn.block_attention_fwd
    out, *_ = op(q, k, v, offsets, None, 16, 0.25, 0, q_descale=scales[0], k_descale=scales[1], v_descale=scales[2])
    assert out.dtype == torch.bfloat16
    with torch.device("meta"):
        fake, *_ = op(*(t.to("meta") for t in (q, k, v, offsets)), None, 16, 0.25, 0,
                      q_descale=torch.ones(1), k_descale=torch.ones(1), v_descale=torch.ones(1))
    assert fake.dtype == torch.bfloat16
    assert snr_db(out.double(), block_attention_reference(*exact, offsets, block_size=16, scale=0.25)) > 45


@requires_gpu
@pytest.mark.parametrize("hkv", [2, 4])
def test_gpu_compile_and_cuda_graph(hkv):
    from conftest import capture_cuda_graph

    lengths = odd_lengths(64) + [300]
    offsets = make_offsets(lengths, "cuda")
    (q, k, v), scales, exact = quantized_inputs(lengths, 8, hkv, 128, "cuda")
    if ON_HOPPER:  # the warp-specialised forward's (the dispatcher's rule)
        assert backends.select(AttentionCall.of("fwd", q, k, 64, 0, 0, tensors=(q, k, v))).name == "sm90-gluon"

    def run():
        return blockattn.block_attention(q, k, v, offsets, q_descale=scales[0], k_descale=scales[1],
                                         v_descale=scales[2])

    eager = run()
    assert torch.equal(torch.compile(run, fullgraph=True)(), eager)
    graph, result = capture_cuda_graph(run)
    graph.replay()
    assert torch.equal(result, eager)
    assert snr_db(eager.double().cpu(), block_attention_reference(*(t.cpu() for t in exact), offsets.cpu())) > 45


# ---------------------------------------------------------------------------------------------------------------
# float8 through qkv_block_attention: the packed projection quantised with qkv_scale, then the fp8 attention.

# Against the reference on the unquantised projection the fp8 rounding of q, k, v (3 mantissa bits) dominates.
MIN_QKV_SNR_DB = 24.0
# Against the attention of the projection quantised in float64 (the same fp8 q, k, v but for rounding ties and the
# matmul's summation order), or the fp8 output's own rounding bound: far above what a wrong scale or a misplaced
# head would give.
MIN_WIRING_SNR_DB = 35.0


def quantized_projection(n, d_model, hq, hkv, d, device, column_major=True):
    """fp8 ``x [N, d_model]`` and ``w [d_model, (hq + 2 hkv) d]`` (column-major, as ``linear.weight.t()``, or
    row-major), their descales, a float32 bias, ``qkv_scale`` (the projection's max over 448) and the float64
    projection of the dequantised inputs."""
    width = (hq + 2 * hkv) * d
    x8, x_descale = quantised_fp8(torch.randn(n, d_model, device=device))
    w8, w_descale = quantised_fp8(torch.randn(width, d_model, device=device) / d_model**0.5)
    w8 = w8.t()
    bias = 0.1 * torch.randn(width, device=device)
    if not column_major:
        w8 = w8.contiguous()
    exact = (x8.double() * x_descale.double()) @ (w8.double() * w_descale.double()) + bias.double()
    qkv_scale = (exact.abs().max() / fp8.FP8_MAX).float().reshape(1)
    return x8, w8, bias, x_descale, w_descale, qkv_scale, exact


@pytest.mark.parametrize("device,heads", [("cpu", (4, 2, 32))] + ([("cuda", (4, 2, 32)), ("cuda", (8, 2, 128))]
                                                                   if HAS_GPU else []),
                         ids=lambda v: v if isinstance(v, str) else "{}:{} D {}".format(*v))
@pytest.mark.parametrize("w_layout", ["column-major", "row-major"])
@pytest.mark.parametrize("out_dtype,with_bias", [(torch.bfloat16, True), (FP8, True), (torch.bfloat16, False)])
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_qkv_block_attention_fp8(device, heads, w_layout, out_dtype, with_bias, rotary):
    """The projection's fp8 matmul (on a GPU with a column-major ``w``) or its float32 path, with and without a
    bias, then the fp8 attention (GQA, a fused rotary; on Hopper the warp-specialised forward reads the plain
    8:2 D = 128 case's q, k, v out of the packed projection): against the reference of the unquantised projection,
    and against block attention of the projection quantised in float64."""
    from conftest import random_angles

    from blockattn.reference import rotary_reference

    torch.manual_seed(0)
    lengths = odd_lengths(32) + [100]
    (hq, hkv, d), n = heads, sum(lengths)
    offsets = make_offsets(lengths, device)
    x8, w8, bias, x_descale, w_descale, qkv_scale, exact = quantized_projection(
        n, 64, hq, hkv, d, device, column_major=w_layout == "column-major")
    assert fp8._scaled_mm_takes(x8, w8) == (device == "cuda" and w_layout == "column-major")
    if not with_bias:
        exact = exact - bias.double()
        bias = None
    sinu_pos = random_angles(n, d, device=device) if rotary else None
    out_scale = out_scale_for(out_dtype, device)
    out = blockattn.qkv_block_attention(x8, w8, offsets, num_heads=hq, num_kv_heads=hkv, bias=bias, block_size=32,
                                        sinu_pos=sinu_pos, x_descale=x_descale, w_descale=w_descale,
                                        qkv_scale=qkv_scale, out_dtype=out_dtype, out_scale=out_scale)
    assert out.dtype == out_dtype and out.shape == (n, hq, d)
    heads = [t.cpu() for t in exact.view(n, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)]
    if rotary:
        heads = [rotary_reference(t, sinu_pos.double().cpu()) for t in heads]
    ref = block_attention_reference(*heads, offsets.cpu(), block_size=32)
    assert snr_db(as_float64(out, out_scale).cpu(), ref) > MIN_QKV_SNR_DB
    qkv8 = fp8.saturated_fp8(exact, qkv_scale.double())
    q8, k8, v8 = qkv8.view(n, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
    wired = blockattn.block_attention(q8, k8, v8, offsets, block_size=32, sinu_pos=sinu_pos, q_descale=qkv_scale,
                                      k_descale=qkv_scale, v_descale=qkv_scale, out_dtype=torch.float32)
    assert snr_db(as_float64(out, out_scale), wired.double()) > min(MIN_WIRING_SNR_DB, MIN_SNR_DB[out_dtype])


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if HAS_GPU else []))
def test_fp8_projection_saturates(device):
    """A projection beyond ``448 * qkv_scale`` saturates to e4m3's largest value, never NaN (the fp8 matmul and the
    float32 path alike)."""
    x8, w8, bias, x_descale, w_descale, qkv_scale, _ = quantized_projection(40, 64, 2, 1, 16, device)
    qkv = fp8.projection(x8, w8, bias, x_descale, w_descale, qkv_scale / 4)
    assert qkv.dtype == FP8 and not qkv.float().isnan().any()
    assert qkv.float().abs().max() == fp8.FP8_MAX
    assert (qkv.float().abs() == fp8.FP8_MAX).sum() < qkv.numel()  # the rest keeps its values


def _qkv_call(**overrides):
    x8, w8, bias, x_descale, w_descale, qkv_scale, _ = quantized_projection(20, 32, 2, 2, 16, "cpu")
    kwargs = {"x": x8, "w": w8, "bias": bias, "x_descale": x_descale, "w_descale": w_descale,
              "qkv_scale": qkv_scale, **overrides}
    return blockattn.qkv_block_attention(kwargs.pop("x"), kwargs.pop("w"), make_offsets([20]), num_heads=2,
                                         num_kv_heads=2, block_size=16, **kwargs)


@pytest.mark.parametrize("overrides,error,message", [
    ({"w": torch.zeros(32, 96)}, TypeError, r"w must have the dtype of x \(torch.float8_e4m3fn\)"),
    ({"bias": torch.zeros(96).to(FP8)}, TypeError, "bias must be float32, bfloat16 or float16 with float8 x"),
    ({"qkv_scale": None}, ValueError, "qkv_scale is required with float8_e4m3fn inputs"),
    ({"x_descale": torch.ones(2)}, ValueError, "x_descale must be a 1-element float32 tensor"),
    ({"w_descale": torch.ones(1, dtype=torch.float16)}, ValueError, "w_descale must be a 1-element float32"),
    ({"out_dtype": FP8}, ValueError, "out_scale is required with out_dtype=torch.float8_e4m3fn"),
    ({"bias": torch.zeros(96, requires_grad=True)}, ValueError,
     "the float8 forward is for inference: bias must not require grad"),
    ({"x": torch.zeros(20, 32)}, TypeError, r"w must have the dtype of x \(torch.float32\)"),
])
def test_qkv_fp8_validation(overrides, error, message):
    with pytest.raises(error, match=message):
        _qkv_call(**overrides)


def test_qkv_fp8_arguments_need_fp8_inputs():
    x, w = torch.randn(20, 32), torch.randn(32, 96)
    for name, value in (("qkv_scale", torch.ones(1)), ("out_dtype", torch.bfloat16), ("x_descale", torch.ones(1))):
        with pytest.raises(ValueError, match=f"{name} applies to float8_e4m3fn x and w only; x is torch.float32"):
            blockattn.qkv_block_attention(x, w, make_offsets([20]), num_heads=2, num_kv_heads=2, **{name: value})


@requires_gpu
def test_gpu_qkv_fp8_refused_before_ada_compiled_and_graphed(monkeypatch):
    """On a GPU without fp8 tensor cores the float8 projection is refused before anything runs; under
    ``torch.compile(fullgraph=True)`` and in a CUDA graph it gives the eager result."""
    from conftest import capture_cuda_graph

    from blockattn import checks, devices

    lengths = odd_lengths(64) + [300]
    offsets = make_offsets(lengths, "cuda")
    x8, w8, bias, x_descale, w_descale, qkv_scale, _ = quantized_projection(sum(lengths), 128, 4, 2, 64, "cuda")

    def run():
        return blockattn.qkv_block_attention(x8, w8, offsets, num_heads=4, num_kv_heads=2, bias=bias,
                                             x_descale=x_descale, w_descale=w_descale, qkv_scale=qkv_scale)

    eager = run()
    # Compiled, the scales' arithmetic may fuse differently: the same up to a rare fp8 rounding of q, k or v.
    assert snr_db(torch.compile(run, fullgraph=True)().double(), eager.double()) > 40
    graph, result = capture_cuda_graph(run)
    graph.replay()
    assert torch.equal(result, eager)
    monkeypatch.setattr(devices, "capability", lambda device: (8, 6))
    checks.forget()  # the eager call above passed the checks on this GPU's real capability
    with pytest.raises(ValueError, match=r"x and w: float8_e4m3fn needs a GPU with fp8 tensor cores"):
        run()
