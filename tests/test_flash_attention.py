"""Flash attention (whole sequences, dense and varlen) against the float64 reference: the Triton kernels (the
interpreter on CPU, real on a GPU), the PyTorch path, the public functions, validation, compile, CUDA graphs."""

import math

import pytest
import torch
from conftest import (
    HAS_GPU,
    KERNEL_DEVICE,
    absolute_slack,
    assert_eager_route_matches_the_ops,
    capture_cuda_graph,
    make_offsets,
    requires_gpu,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blockattn
from blockattn import backends, devices
from blockattn.backends import FLASH_BACKENDS, FlashCall
from blockattn.block_table import build_block_table
from blockattn.checks import FP8_DTYPE
from blockattn.ops import flash_attention as flash_ops
from blockattn.reference import flash_attention_reference, snr_db
from blockattn.reference import quantised_fp8 as quantised

VARIANTS = ["pipelined", "warp_specialized"]
# Every kernel backend, and the variant that asks for it (the Gluon kernel: the warp-specialised one on Hopper).
KERNELS = {"pipelined": "pipelined", "warp_specialized": "warp_specialized",
           "warp_specialized-sm90": "warp_specialized"}
# The interpreter runs small tiles (fast, and several tiles per sequence); a GPU runs the tuned configuration.
INTERPRETER_CONFIG = flash_ops.FlashConfig(32, 16, 4, 2)
# What fp8 reaches against the float64 reference on the dequantised inputs (measured on an H100: docs/benchmarks.md).
FP8_MIN_SNR_DB = 30.0
CAUSAL_MODES = [(False, False), (True, False), (True, True)]
CAUSAL_IDS = ["full", "top_left", "bottom_right"]


def packed_inputs(lengths_q, lengths_k, hq, hkv, d, dtype, device):
    cu_q, cu_k = make_offsets(lengths_q, device), make_offsets(lengths_k, device)
    q = torch.randn(sum(lengths_q), hq, d, device=device)
    k = torch.randn(sum(lengths_k), hkv, d, device=device)
    v = torch.randn(sum(lengths_k), hkv, d, device=device)
    return (*(t.to(dtype) for t in (q, k, v)), cu_q, cu_k)


def dequantised(t8, descale):
    return t8.double() * descale.double()


def run_variant(variant, q, k, v, cu_q, cu_k, causal, bottom_right, descales=None, out_dtype=None):
    """``(out, lse)`` of one kernel backend's launcher (``variant``: its name), bypassing the dispatcher (tuned
    config on a GPU)."""
    call = FlashCall.of(q, k, v, KERNELS[variant], causal=causal)
    if variant == "warp_specialized" and (reason := backends.tma_reason(q.shape[-1], q.dtype)):
        pytest.skip(reason)
    if variant == "warp_specialized-sm90" and (reason := FLASH_BACKENDS[variant].why_not(call)):
        pytest.skip(reason)
    config = call.with_config(variant).config if HAS_GPU else INTERPRETER_CONFIG
    assert config is not None, call.with_config(variant).config_reason
    table = None if cu_q is None else build_block_table(cu_q, q.shape[0], config.block_m)
    out_dtype = out_dtype or (torch.bfloat16 if descales is not None else q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    return FLASH_BACKENDS[variant].forward(q, k, v, cu_q, cu_k, table, scale, causal, bottom_right, out_dtype,
                                           descales, config)


def assert_flash_accurate(out, lse, q, k, v, cu_q, cu_k, causal, bottom_right):
    """The 2x rule against the float64 reference (plus one rounding of the output dtype and the absolute slack),
    the log-sum-exp to fp32 accuracy, and the rows that see no key: 0 and -inf."""
    exact, exact_lse = flash_attention_reference(q, k, v, cu_q, cu_k, causal=causal, bottom_right=bottom_right)
    same, _ = flash_attention_reference(q, k, v, cu_q, cu_k, causal=causal, bottom_right=bottom_right,
                                        compute_dtype=q.dtype)
    assert not out.isnan().any() and not lse.isnan().any()
    err = (out.double() - exact).abs().max().item() if out.numel() else 0.0
    torch_err = (same.double() - exact).abs().max().item() if out.numel() else 0.0
    allowance = torch.finfo(out.dtype).eps * (exact.abs().max().item() if out.numel() else 0.0)
    assert err <= 2 * torch_err + allowance + absolute_slack(q.dtype), (err, torch_err)
    assert torch.equal(torch.isinf(lse), torch.isinf(exact_lse))
    finite = torch.isfinite(exact_lse)
    if finite.any():
        lse_err = (lse.double()[finite] - exact_lse[finite]).abs().max().item()
        assert lse_err <= 1e-4 * (1 + exact_lse[finite].abs().max().item()), lse_err


def dense_as_packed(q, k, v):
    """Dense ``[B, S, H, D]`` tensors as packed ones with their cumulative lengths."""
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    cu_q = torch.arange(b + 1, device=q.device, dtype=torch.int32) * sq
    cu_k = torch.arange(b + 1, device=q.device, dtype=torch.int32) * sk
    return q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k


def assert_fp8_accurate(out, lse, exact, exact_lse):
    """fp8 against the float64 reference on the dequantised inputs: SNR at least FP8_MIN_SNR_DB, the log-sum-exp to
    1e-3 (relative to its size) and infinite exactly where the reference's is (packed ``[N, H, D]``, ``[H, N]``)."""
    assert not out.isnan().any()
    assert snr_db(out, exact) >= FP8_MIN_SNR_DB
    assert torch.equal(torch.isinf(lse), torch.isinf(exact_lse))
    finite = torch.isfinite(exact_lse)
    assert (lse.double()[finite] - exact_lse[finite]).abs().max().item() < 1e-3 * (1 + exact_lse.abs()[finite].max())


# --------------------------------------------------------------------------------------------------------------------
# Kernels: the interpreter on the CPU (fp16, small), the GPU for the rest
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", KERNELS)
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES, ids=CAUSAL_IDS)
@pytest.mark.parametrize("head_dim", [40, 128])
def test_kernels_varlen_odd_lengths(variant, causal, bottom_right, head_dim, poisoned_outputs):
    """Length-0 query and key sequences, Sq < Sk and Sq > Sk, lengths off the tiles, GQA."""
    lengths_q = [5, 0, 3, 70, 33, 1]
    lengths_k = [9, 4, 0, 50, 33, 64]
    q, k, v, cu_q, cu_k = packed_inputs(lengths_q, lengths_k, 4, 2, head_dim, torch.float16, KERNEL_DEVICE)
    out, lse = run_variant(variant, q, k, v, cu_q, cu_k, causal, bottom_right)
    assert_flash_accurate(out, lse, q, k, v, cu_q, cu_k, causal, bottom_right)


@pytest.mark.parametrize("variant", KERNELS)
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES, ids=CAUSAL_IDS)
def test_kernels_dense(variant, causal, bottom_right, poisoned_outputs):
    q = torch.randn(2, 37, 2, 128, device=KERNEL_DEVICE, dtype=torch.float16)
    k, v = (torch.randn(2, 21, 1, 128, device=KERNEL_DEVICE, dtype=torch.float16) for _ in range(2))
    out, lse = run_variant(variant, q, k, v, None, None, causal, bottom_right)
    assert out.shape == q.shape and lse.shape == (2, 2, 37)
    pq, pk, pv, cu_q, cu_k = dense_as_packed(q, k, v)
    assert_flash_accurate(out.flatten(0, 1), lse.transpose(0, 1).flatten(1), pq, pk, pv, cu_q, cu_k, causal,
                          bottom_right)


@pytest.mark.parametrize("variant", KERNELS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernels_grid_cut_by_max_seqlen(variant, causal, head_dim, poisoned_outputs):
    """The grid the ``max_seqlen_q`` hint allows (B * ceil(max / BLOCK_M) slots, fewer than the block table's)
    still covers every row (on a Hopper GPU, D = 64 without a mask takes 192-row tiles)."""
    call = FlashCall.of(*(torch.empty(1, 1, head_dim, dtype=torch.float16, device=KERNEL_DEVICE) for _ in range(3)),
                        KERNELS[variant], causal=causal)
    cfg = call.with_config(variant).config if HAS_GPU else INTERPRETER_CONFIG
    unit = cfg.block_m // 32  # lengths in units of the tile, as on the interpreter's 32-row tiles
    q, k, v, cu_q, cu_k = packed_inputs([32 * unit, 32 * unit, 0, 30 * unit], [20, 5, 33, 70 * unit], 2, 1, head_dim,
                                        torch.float16, KERNEL_DEVICE)
    table = build_block_table(cu_q, q.shape[0], cfg.block_m)
    slots = 4 * -(-32 * unit // cfg.block_m)
    assert slots < table.num_slots
    table = type(table)(table.block_cum, table.block_seq[:slots])
    if variant == "warp_specialized" and (reason := backends.tma_reason(head_dim, q.dtype)):
        pytest.skip(reason)
    if variant == "warp_specialized-sm90" and (reason := FLASH_BACKENDS[variant].why_not(call)):
        pytest.skip(reason)
    out, lse = FLASH_BACKENDS[variant].forward(q, k, v, cu_q, cu_k, table, head_dim**-0.5, causal, False, q.dtype,
                                               None, cfg)
    assert_flash_accurate(out, lse, q, k, v, cu_q, cu_k, causal, False)


@pytest.mark.parametrize("variant", KERNELS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernels_out_dtype(variant, out_dtype, poisoned_outputs):
    """An output dtype other than the inputs' (fp16 inputs, fp32 or bf16 out), causal over tiles that need a mask
    and tiles that do not."""
    q, k, v, cu_q, cu_k = packed_inputs([5, 70, 33], [9, 50, 33], 4, 2, 64, torch.float16, KERNEL_DEVICE)
    out, lse = run_variant(variant, q, k, v, cu_q, cu_k, True, False, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    assert_flash_accurate(out, lse, q, k, v, cu_q, cu_k, True, False)


GPU_SHAPES = [(1, 1, 1), (2, 17, 17), (4, 128, 128), (1, 257, 257), (2, 512, 1024), (2, 1024, 512), (1, 2048, 2048)]


@requires_gpu
@pytest.mark.parametrize("variant", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES, ids=CAUSAL_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k", GPU_SHAPES)
def test_gpu_dense(variant, dtype, causal, bottom_right, head_dim, batch, seqlen_q, seqlen_k, poisoned_outputs):
    heads = 8 if seqlen_q <= 1024 else 1
    q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(batch, seqlen_k, heads // 2 if heads > 1 else 1, head_dim, device="cuda", dtype=dtype)
            for _ in range(2))
    out, lse = run_variant(variant, q, k, v, None, None, causal, bottom_right)
    pq, pk, pv, cu_q, cu_k = dense_as_packed(q, k, v)
    assert_flash_accurate(out.flatten(0, 1), lse.transpose(0, 1).flatten(1), pq, pk, pv, cu_q, cu_k, causal,
                          bottom_right)


@requires_gpu
@pytest.mark.parametrize("variant", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [16, 24, 40, 80, 96, 192, 256])
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES, ids=CAUSAL_IDS)
def test_gpu_varlen_head_dims(variant, dtype, head_dim, causal, bottom_right, poisoned_outputs):
    """Every other supported head dim, varlen with length-0 sequences, GQA 4:1 and MQA."""
    lengths_q = [0, 300, 1, 129, 1000, 64]
    lengths_k = [7, 300, 0, 200, 513, 64]
    for hkv in (2, 1):
        q, k, v, cu_q, cu_k = packed_inputs(lengths_q, lengths_k, 8, hkv, head_dim, dtype, "cuda")
        out, lse = run_variant(variant, q, k, v, cu_q, cu_k, causal, bottom_right)
        assert_flash_accurate(out, lse, q, k, v, cu_q, cu_k, causal, bottom_right)


@requires_gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_no_key_at_all(causal, poisoned_outputs):
    """Keys of length 0 in every sequence (no key row at all: the Gluon kernel's descriptors cannot span them):
    every row gives 0 and a log-sum-exp of -inf."""
    q, k, v, cu_q, cu_k = packed_inputs([3, 0, 2], [0, 0, 0], 2, 1, 64, torch.bfloat16, "cuda")
    for variant in ("warp_specialized-sm90", "auto"):
        if variant == "auto":
            out, lse = blockattn.flash_attention_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)
        else:
            out, lse = run_variant(variant, q, k, v, cu_q, cu_k, causal, False)
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@requires_gpu
@pytest.mark.parametrize("variant", KERNELS)
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES, ids=CAUSAL_IDS)
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 128), (torch.bfloat16, 64), (FP8_DTYPE, 128)],
                         ids=["bf16-128", "bf16-64", "fp8-128"])
def test_gpu_many_work_items(variant, causal, bottom_right, dtype, head_dim, poisoned_outputs):
    """More (query tile, head) items than a GPU has multiprocessors, padding slots among them: the persistent
    Gluon kernel runs several items per program, its ring and barriers carried from one to the next (with two
    consumer warpgroups, and with three where the configuration takes 192-row tiles)."""
    lengths_q = torch.randint(0, 400, (48,)).tolist()
    lengths_k = torch.randint(0, 400, (48,)).tolist()
    lengths_q[:3], lengths_k[:3] = [0, 5, 300], [7, 0, 129]
    if dtype != FP8_DTYPE:
        q, k, v, cu_q, cu_k = packed_inputs(lengths_q, lengths_k, 8, 2, head_dim, dtype, "cuda")
        out, lse = run_variant(variant, q, k, v, cu_q, cu_k, causal, bottom_right)
        assert_flash_accurate(out, lse, q, k, v, cu_q, cu_k, causal, bottom_right)
        return
    q, k, v, cu_q, cu_k = packed_inputs(lengths_q, lengths_k, 8, 2, head_dim, torch.float32, "cuda")
    (q8, qs), (k8, ks), (v8, vs) = quantised(q), quantised(k), quantised(v)
    out, lse = run_variant(variant, q8, k8, v8, cu_q, cu_k, causal, bottom_right, (qs, ks, vs))
    exact, exact_lse = flash_attention_reference(dequantised(q8, qs), dequantised(k8, ks), dequantised(v8, vs),
                                                 cu_q, cu_k, causal=causal, bottom_right=bottom_right)
    assert_fp8_accurate(out, lse, exact, exact_lse)


@requires_gpu
@pytest.mark.parametrize("variant", KERNELS)
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES, ids=CAUSAL_IDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_fp8(variant, causal, bottom_right, head_dim, out_dtype, poisoned_outputs):
    """fp8 inputs against the float64 reference on the dequantised inputs: SNR at least FP8_MIN_SNR_DB."""
    lengths_q, lengths_k = [0, 700, 1, 2048, 129], [5, 700, 0, 1500, 129]
    q, k, v, cu_q, cu_k = packed_inputs(lengths_q, lengths_k, 8, 2, head_dim, torch.float32, "cuda")
    (q8, qs), (k8, ks), (v8, vs) = quantised(q), quantised(k), quantised(v)
    out, lse = run_variant(variant, q8, k8, v8, cu_q, cu_k, causal, bottom_right, (qs, ks, vs), out_dtype)
    assert out.dtype == out_dtype
    exact, exact_lse = flash_attention_reference(dequantised(q8, qs), dequantised(k8, ks), dequantised(v8, vs),
                                                 cu_q, cu_k, causal=causal, bottom_right=bottom_right)
    print(f"fp8 {variant} D={head_dim} causal={causal} bottom_right={bottom_right} out={out_dtype}: "
          f"{snr_db(out, exact):.1f} dB")
    assert_fp8_accurate(out, lse, exact, exact_lse)


@requires_gpu
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES, ids=CAUSAL_IDS)
@pytest.mark.parametrize("head_dim", [16, 24, 40, 80, 96, 192])
def test_gpu_fp8_head_dims(head_dim, causal, bottom_right, poisoned_outputs):
    """fp8 at the head dims only the pipelined kernel takes (padded to a power of two, at least 32), GQA 4:1."""
    q, k, v, cu_q, cu_k = packed_inputs([0, 300, 1, 129], [7, 300, 0, 200], 8, 2, head_dim, torch.float32, "cuda")
    (q8, qs), (k8, ks), (v8, vs) = quantised(q), quantised(k), quantised(v)
    out, lse = run_variant("pipelined", q8, k8, v8, cu_q, cu_k, causal, bottom_right, (qs, ks, vs))
    exact, exact_lse = flash_attention_reference(dequantised(q8, qs), dequantised(k8, ks), dequantised(v8, vs),
                                                 cu_q, cu_k, causal=causal, bottom_right=bottom_right)
    assert_fp8_accurate(out, lse, exact, exact_lse)


@pytest.mark.skipif(backends.flash_sm90_ops is None, reason="this triton has no Gluon Hopper API")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_gpu)])
@pytest.mark.parametrize("lengths", [[13, 0, 700, 1, 31, 16, 17], [0], [33], [0, 0], "random"])
def test_fp8_values_copy_starts_every_sequence_16_aligned(lengths, device):
    """The Gluon kernel's transposed fp8 values: head h's rows h D .. h D + D, sequence s's tokens from column
    16 (cu[s] // 16 + s) (a multiple of 16, where the producer's TMA boxes start), in order; dense, batch b's rows
    from (b H + h) D, token s in column s; zeros between sequences. PyTorch ops make the copy on the CPU and of no
    token, kernels on a GPU (there the packed copy's binary search over the sequences' starts takes several steps
    with 57 sequences)."""
    if lengths == "random":
        lengths = torch.randint(0, 90, (57,)).tolist()
    _, _, v, _, cu_k = packed_inputs([1] * len(lengths), lengths, 1, 3, 32, torch.float32, device)
    v = v.to(FP8_DTYPE)
    for offsets in (cu_k, cu_k.long()):
        vt = backends.flash_sm90_ops._transposed_values(v, offsets)
        assert vt.dtype == FP8_DTYPE and vt.shape[0] == 3 * 32 and vt.shape[1] % 16 == 0
        written = torch.zeros(vt.shape[1], dtype=torch.bool, device=device)
        for s, (start, end) in enumerate(zip(cu_k[:-1].tolist(), cu_k[1:].tolist())):
            column = 16 * (start // 16 + s)
            expected = v[start:end].permute(1, 2, 0).flatten(0, 1).view(torch.uint8)
            assert torch.equal(vt[:, column:column + end - start].view(torch.uint8), expected)
            written[column:column + end - start] = True
        assert not vt.view(torch.uint8)[:, ~written].any()  # zeros between sequences
    dense = torch.randn(2, 21, 3, 32, device=device).to(FP8_DTYPE)[:, 2:]
    vt = backends.flash_sm90_ops._transposed_values(dense, None)
    assert vt.shape == (2 * 3 * 32, 19)
    assert torch.equal(vt.view(torch.uint8), dense.permute(0, 2, 3, 1).flatten(0, 2).view(torch.uint8))


@requires_gpu
@pytest.mark.parametrize("shape", [(2, 37, 3, 40), (1, 1, 1, 256), (3, 200, 2, 128), (100, 2, 64), (17, 1, 16)])
def test_gpu_transposed_values_match_a_copy(shape):
    """The fp8 values' transposing kernel: ``[.., tokens, H, D]`` to rows of tokens, as PyTorch's copy makes them
    (head dims off a power of two, one token, packed inputs, a strided ``v``: every other head of a wider one)."""
    *lead, tokens, heads, d = shape
    v = torch.randn(*lead, tokens, 2 * heads, d, device="cuda").to(FP8_DTYPE)[..., ::2, :]
    got = flash_ops.transposed_values(v)
    assert got.shape == v.shape and got.stride(-3) == 1 and got.stride(-1) % 16 == 0
    assert torch.equal(got.view(torch.uint8), v.view(torch.uint8))


@requires_gpu
@pytest.mark.parametrize("variant", KERNELS)
@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES, ids=CAUSAL_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k", [(3, 257, 129), (2, 100, 300), (1, 1, 17)])
def test_gpu_fp8_dense(variant, causal, bottom_right, head_dim, batch, seqlen_q, seqlen_k, poisoned_outputs):
    """Dense fp8 batches, Sq != Sk both ways and off the tiles, GQA: each batch's values (the Gluon kernel reads
    them from the transposed copy, a head's rows per batch) against the reference."""
    q = torch.randn(batch, seqlen_q, 4, head_dim, device="cuda")
    k, v = (torch.randn(batch, seqlen_k, 2, head_dim, device="cuda") for _ in range(2))
    (q8, qs), (k8, ks), (v8, vs) = quantised(q), quantised(k), quantised(v)
    out, lse = run_variant(variant, q8, k8, v8, None, None, causal, bottom_right, (qs, ks, vs))
    pq, pk, pv, cu_q, cu_k = dense_as_packed(dequantised(q8, qs), dequantised(k8, ks), dequantised(v8, vs))
    exact, exact_lse = flash_attention_reference(pq, pk, pv, cu_q, cu_k, causal=causal, bottom_right=bottom_right)
    assert_fp8_accurate(out.flatten(0, 1), lse.transpose(0, 1).flatten(1), exact, exact_lse)


@requires_gpu
@pytest.mark.parametrize("variant", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8_DTYPE], ids=["bf16", "fp8"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_nan_in_a_neighbouring_sequence_stays_there(variant, dtype, head_dim, poisoned_outputs):
    """Values of one sequence all NaN: the sequences before and after it (whose last key tiles run into its rows)
    are exact; only its own rows are NaN (two consumer warpgroups zero the rows past a sequence, with three too)."""
    q, k, v, cu_q, cu_k = packed_inputs([70, 40, 200], [100, 50, 130], 4, 2, head_dim, torch.float32, "cuda")
    if dtype == FP8_DTYPE:
        (q, qs), (k, ks), (v, vs) = quantised(q), quantised(k), quantised(v)
        descales, exact_inputs = (qs, ks, vs), (dequantised(q, qs), dequantised(k, ks), dequantised(v, vs))
    else:
        q, k, v = (t.to(dtype) for t in (q, k, v))
        descales, exact_inputs = None, (q.double(), k.double(), v.double())
    for values in (v, exact_inputs[2]):
        values[100:150] = torch.full_like(values[100:150], float("nan"), dtype=torch.float32).to(values.dtype)
    out, _ = run_variant(variant, q, k, v, cu_q, cu_k, False, False, descales)
    exact, _ = flash_attention_reference(*exact_inputs, cu_q, cu_k)
    own = torch.zeros(out.shape[0], dtype=torch.bool, device="cuda")
    own[70:110] = True
    assert out[own].isnan().all()
    assert not out[~own].isnan().any()
    assert snr_db(out[~own], exact[~own]) >= (FP8_MIN_SNR_DB if dtype == FP8_DTYPE else 40)


# --------------------------------------------------------------------------------------------------------------------
# The public functions: dispatcher, PyTorch path, compile, CUDA graphs
# --------------------------------------------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=4),
       heads=st.sampled_from([(1, 1), (4, 2), (4, 1)]), head_dim=st.sampled_from([16, 24, 64]),
       causal_mode=st.sampled_from(CAUSAL_MODES), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_torch_path_matches_reference(lengths, heads, head_dim, causal_mode, dtype):
    """The CPU path through the public varlen function, any lengths (0 included)."""
    q, k, v, cu_q, cu_k = packed_inputs([a for a, _ in lengths], [b for _, b in lengths], *heads, head_dim, dtype,
                                        "cpu")
    causal, bottom_right = causal_mode
    out, lse = blockattn.flash_attention_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True,
                                                causal_alignment="bottom_right" if bottom_right else "top_left")
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_flash_accurate(out, lse, q, k, v, cu_q, cu_k, causal, bottom_right)


@pytest.mark.parametrize("causal,bottom_right", CAUSAL_MODES, ids=CAUSAL_IDS)
def test_dense_equals_varlen(causal, bottom_right):
    """The dense function is the varlen one on equal-length sequences (the dispatcher's choice on this machine)."""
    dtype = torch.float16 if HAS_GPU else torch.float32
    q = torch.randn(3, 45, 4, 64, device=KERNEL_DEVICE, dtype=dtype)
    k, v = (torch.randn(3, 30, 2, 64, device=KERNEL_DEVICE, dtype=dtype) for _ in range(2))
    alignment = "bottom_right" if bottom_right else "top_left"
    out, lse = blockattn.flash_attention(q, k, v, causal=causal, causal_alignment=alignment, return_lse=True)
    packed = dense_as_packed(q, k, v)
    out_v, lse_v = blockattn.flash_attention_varlen(*packed, causal=causal, causal_alignment=alignment,
                                                    return_lse=True)
    torch.testing.assert_close(out.flatten(0, 1), out_v, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse.transpose(0, 1).flatten(1), lse_v, atol=1e-4, rtol=0)


def test_strided_cu_seqlens(public_calls_on_kernels):
    """The kernels read cu_seqlens as consecutive ints: strided views are taken as their values."""
    q, k, v, cu_q, cu_k = packed_inputs([5, 0, 17, 20, 1], [9, 3, 16, 20, 0], 4, 2, 32, torch.float16,
                                        public_calls_on_kernels)
    strided_q, strided_k = (torch.stack([c, torch.full_like(c, 3)], 1).flatten()[::2] for c in (cu_q, cu_k))
    assert not strided_q.is_contiguous() and torch.equal(strided_q, cu_q)
    assert torch.equal(blockattn.flash_attention_varlen(q, k, v, strided_q, strided_k),
                       blockattn.flash_attention_varlen(q, k, v, cu_q, cu_k))


def test_fp8_on_the_torch_path():
    """fp8 through dequantisation on the CPU: exactly the result of the dequantised inputs (fp32 compute)."""
    q, k, v, cu_q, cu_k = packed_inputs([7, 0, 20], [9, 3, 20], 4, 2, 32, torch.float32, "cpu")
    (q8, qs), (k8, ks), (v8, vs) = quantised(q), quantised(k), quantised(v)
    out = blockattn.flash_attention_varlen(q8, k8, v8, cu_q, cu_k, q_descale=qs, k_descale=ks, v_descale=vs,
                                           out_dtype=torch.float32)
    exact, _ = flash_attention_reference(dequantised(q8, qs), dequantised(k8, ks), dequantised(v8, vs), cu_q, cu_k)
    assert (out.double() - exact).abs().max().item() < 1e-5


def test_meta_tensors_and_flop_count():
    from torch.utils.flop_counter import FlopCounterMode

    q = torch.empty(2, 100, 8, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 60, 2, 64, device="meta", dtype=torch.bfloat16)
    out, lse = blockattn.flash_attention(q, k, k, return_lse=True)
    assert out.shape == q.shape and out.device.type == "meta" and lse.shape == (2, 8, 100)
    q, k, v, cu_q, cu_k = packed_inputs([5, 0, 30], [10, 4, 30], 4, 2, 32, torch.float32, "cpu")
    # Visible pairs: all of them; top-left causal, row i sees min(i + 1, Sk) keys; bottom-right, i + 1 + Sk - Sq.
    for alignment, pairs in (("none", 5 * 10 + 30 * 30), ("top_left", 15 + 465), ("bottom_right", 40 + 465)):
        with FlopCounterMode(display=False) as counter:
            blockattn.flash_attention_varlen(q, k, v, cu_q, cu_k, causal=alignment != "none",
                                             causal_alignment="top_left" if alignment == "none" else alignment)
        assert counter.get_total_flops() == 4 * pairs * 32 * 4, alignment


def test_compile_fullgraph():
    q, k, v, cu_q, cu_k = packed_inputs([7, 0, 40], [9, 3, 40], 4, 2, 32,
                                        torch.float16 if HAS_GPU else torch.float32, KERNEL_DEVICE)
    fn = torch.compile(lambda *a: blockattn.flash_attention_varlen(*a, causal=True, max_seqlen_q=40), fullgraph=True)
    eager = blockattn.flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, max_seqlen_q=40)
    torch.testing.assert_close(fn(q, k, v, cu_q, cu_k), eager, atol=0, rtol=0)
    dense = torch.compile(lambda a, b, c: blockattn.flash_attention(a, b, c, causal=True, return_lse=True),
                          fullgraph=True)
    qd, kd, vd = q[:40].unsqueeze(0), k[:40].unsqueeze(0), v[:40].unsqueeze(0)
    for got, want in zip(dense(qd, kd, vd), blockattn.flash_attention(qd, kd, vd, causal=True, return_lse=True)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_eager_route_and_custom_op_give_the_same_results(monkeypatch):
    """Eager calls run the op's implementation directly (``custom_ops.eager_route``); through the custom op the
    results are bitwise the same, dense and varlen."""
    q, k, v, cu_q, cu_k = packed_inputs([7, 0, 20], [9, 3, 20], 4, 2, 32,
                                        torch.float16 if HAS_GPU else torch.float32, KERNEL_DEVICE)

    def run():
        return [*blockattn.flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True),
                *blockattn.flash_attention(q[:20].unsqueeze(0), k[:20].unsqueeze(0), v[:20].unsqueeze(0),
                                           return_lse=True)]

    assert_eager_route_matches_the_ops(run, q, monkeypatch)


def test_opcheck():
    """The custom op's fake agrees with its implementations (shapes, strides, dtypes), dense and varlen."""
    q, k, v, cu_q, cu_k = packed_inputs([7, 0, 20], [9, 3, 20], 4, 2, 32,
                                        torch.float16 if HAS_GPU else torch.float32, KERNEL_DEVICE)
    op = torch.ops.blockattn.flash_attention_fwd.default
    torch.library.opcheck(op, (q, k, v, cu_q, cu_k, None, None, 0.2, True, True, q.dtype, None, None, None, "auto"))
    qd, kd = q[:20].unsqueeze(0), k[:20].unsqueeze(0)
    torch.library.opcheck(op, (qd, kd, kd, None, None, None, None, 0.2, True, False, q.dtype, None, None, None,
                               "auto"))


@requires_gpu
def test_gpu_float32_and_strided_inputs_take_the_pytorch_path():
    """What the kernels do not take on their GPU (float32, a strided last dimension) runs in PyTorch, exactly."""
    q, k, v, cu_q, cu_k = packed_inputs([50, 0, 70], [60, 5, 70], 4, 2, 64, torch.float32, "cuda")
    out = blockattn.flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    exact, _ = flash_attention_reference(q, k, v, cu_q, cu_k, causal=True)
    assert (out.double() - exact).abs().max().item() < 1e-5
    strided = q.half().repeat_interleave(2, dim=-1)[..., ::2]
    assert strided.stride(-1) == 2
    out = blockattn.flash_attention_varlen(strided, k.half(), v.half(), cu_q, cu_k)
    torch.testing.assert_close(out, blockattn.flash_attention_varlen(q.half(), k.half(), v.half(), cu_q, cu_k),
                               atol=2e-3, rtol=0)


@requires_gpu
def test_gpu_fp8_zero_descale_gives_no_nan():
    """A zero descale (an all-zero tensor quantised naively) gives uniform attention, not NaN, in masked rows."""
    q, k, v, cu_q, cu_k = packed_inputs([100, 3], [40, 90], 4, 2, 128, torch.float32, "cuda")
    (q8, _), (k8, ks), (v8, vs) = quantised(q), quantised(k), quantised(v)
    out = blockattn.flash_attention_varlen(q8, k8, v8, cu_q, cu_k, causal=True, causal_alignment="bottom_right",
                                           q_descale=torch.zeros(1, device="cuda"), k_descale=ks, v_descale=vs)
    exact, _ = flash_attention_reference(q8.double() * 0, k8.double(), dequantised(v8, vs), cu_q, cu_k, causal=True,
                                         bottom_right=True)
    assert not out.isnan().any() and snr_db(out, exact) > 30


@requires_gpu
@pytest.mark.parametrize("variant", ["auto", *VARIANTS])
def test_gpu_cuda_graph_new_lengths(variant):
    """Captured once; replayed with other cumulative lengths (same shapes): the results of the new lengths."""
    q, k, v, cu_q, cu_k = packed_inputs([100, 0, 900], [300, 5, 695], 8, 2, 128, torch.bfloat16, "cuda")
    graph, out = capture_cuda_graph(lambda: blockattn.flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True,
                                                                             variant=variant))
    for lengths_q, lengths_k in (([500, 500, 0], [1, 999, 0]), ([1000, 0, 0], [0, 0, 1000])):
        cu_q.copy_(make_offsets(lengths_q, "cuda"))
        cu_k.copy_(make_offsets(lengths_k, "cuda"))
        graph.replay()
        expected = blockattn.flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, variant=variant)
        torch.testing.assert_close(out, expected, atol=0, rtol=0)


@requires_gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_cuda_graph_dense(fp8):
    """A dense call captured once, replayed on new values of its inputs and, for fp8, of its descales: the results
    of an eager call on them, bitwise."""
    q, k, v = (torch.randn(2, 300, 4, 128, device="cuda") for _ in range(3))
    descales = {}
    if fp8:
        (q, qs), (k, ks), (v, vs) = quantised(q), quantised(k), quantised(v)
        descales = {"q_descale": qs, "k_descale": ks, "v_descale": vs}
    else:
        q, k, v = (t.bfloat16() for t in (q, k, v))
    graph, out = capture_cuda_graph(lambda: blockattn.flash_attention(q, k, v, causal=True, **descales))
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, device="cuda").to(t.dtype))
    for descale in descales.values():
        descale.mul_(1.5)
    graph.replay()
    torch.testing.assert_close(out, blockattn.flash_attention(q, k, v, causal=True, **descales), atol=0, rtol=0)


@requires_gpu
def test_gpu_compile_fullgraph_fp8():
    """fp8 with its descales under ``torch.compile(fullgraph=True)``: the eager call's results, bitwise."""
    q, k, v, cu_q, cu_k = packed_inputs([7, 0, 300], [9, 3, 200], 4, 2, 128, torch.float32, "cuda")
    (q, qs), (k, ks), (v, vs) = quantised(q), quantised(k), quantised(v)

    def call(q, k, v, cu_q, cu_k, qs, ks, vs):
        return blockattn.flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True, q_descale=qs,
                                                k_descale=ks, v_descale=vs, out_dtype=torch.float16)

    compiled = torch.compile(call, fullgraph=True)
    for got, want in zip(compiled(q, k, v, cu_q, cu_k, qs, ks, vs), call(q, k, v, cu_q, cu_k, qs, ks, vs)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@requires_gpu
def test_gpu_variant_that_cannot_run_is_refused():
    """A variant asked for that no kernel of this GPU takes (the warp-specialised one at D = 40) is a ValueError
    naming each backend's reason, not a silent fallback."""
    q = torch.randn(1, 64, 2, 40, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no backend takes.*takes head dims"):
        blockattn.flash_attention(q, q, q, variant="warp_specialized")


@requires_gpu
def test_gpu_auto_picks_a_kernel():
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    call = FlashCall.of(q, q, q, "auto", causal=False)
    assert backends.select(call, FLASH_BACKENDS).name in KERNELS


def test_fp8_refused_without_fp8_tensor_cores(monkeypatch):
    """An Ampere GPU (faked) gets a clear error for fp8, and the PyTorch path does not take it silently."""
    monkeypatch.setattr(devices, "capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    call = FlashCall("fwd", torch.device("cuda", 0), FP8_DTYPE, 128, "auto", True, True)
    with pytest.raises(ValueError, match="fp8 tensor cores"):
        backends.select(call, FLASH_BACKENDS)


def test_configuration_that_does_not_fit_is_refused():
    cfg, reason = flash_ops.flash_config("pipelined", (9, 0), 256, False, shared_limit=16 * 1024, causal=False)
    assert cfg is None and "shared memory" in reason
    a100 = 163 * 1024
    cfg, reason = flash_ops.flash_config("pipelined", (8, 0), 256, False, shared_limit=a100, causal=False)
    assert reason is None and cfg.shared_bytes(256, 2) <= a100


# --------------------------------------------------------------------------------------------------------------------
# Validation: before any kernel runs
# --------------------------------------------------------------------------------------------------------------------


def _dense(dtype=torch.float32, **shape):
    b, sq, sk, hq, hkv, d = (shape.get(n, x) for n, x in (("b", 2), ("sq", 5), ("sk", 6), ("hq", 4), ("hkv", 2),
                                                            ("d", 32)))
    return (torch.randn(b, sq, hq, d).to(dtype), torch.randn(b, sk, hkv, d).to(dtype),
            torch.randn(b, sk, hkv, d).to(dtype))


@pytest.mark.parametrize("args,kwargs,error,match", [
    (_dense(), {"causal": 1}, TypeError, "causal must be a bool"),
    (_dense(), {"causal_alignment": "top-left"}, ValueError, "causal_alignment must be one of"),
    (_dense(), {"scale": -1.0}, ValueError, "scale must be a finite positive"),
    (_dense(), {"variant": "fast"}, ValueError, "variant must be one of"),
    (_dense(), {"out_dtype": torch.int8}, ValueError, "out_dtype must be"),
    (_dense(), {"out_dtype": "bf16"}, TypeError, "out_dtype must be a torch.dtype"),
    (_dense(), {"return_lse": None}, TypeError, "return_lse must be a bool"),
    (_dense(), {"q_descale": torch.ones(1)}, ValueError, "q_descale applies to float8_e4m3fn inputs only"),
    (_dense(FP8_DTYPE), {"q_descale": torch.ones(1), "k_descale": torch.ones(1)}, ValueError,
     "v_descale is required"),
    (_dense(FP8_DTYPE), {"q_descale": torch.ones(2), "k_descale": torch.ones(1), "v_descale": torch.ones(1)},
     ValueError, "q_descale must be a 1-element float32"),
    (_dense(FP8_DTYPE), {"q_descale": torch.ones(1, dtype=torch.float64), "k_descale": torch.ones(1),
                         "v_descale": torch.ones(1)}, ValueError, "q_descale must be a 1-element float32"),
    (_dense(d=20), {}, ValueError, "head_dim must be a multiple of 8"),
    (_dense(hq=3), {}, ValueError, "positive multiple of k/v heads"),
    (_dense(torch.int32), {}, TypeError, "q must be"),
    ((torch.randn(2, 5, 4, 32), torch.randn(3, 6, 2, 32), torch.randn(3, 6, 2, 32)), {}, ValueError,
     "same batch size"),
    ((torch.randn(5, 4, 32), torch.randn(6, 2, 32), torch.randn(6, 2, 32)), {}, ValueError, "q must be 4-D"),
    ((torch.randn(2, 5, 4, 32), torch.randn(2, 6, 2, 32), torch.randn(2, 7, 2, 32)), {}, ValueError,
     "k and v must have the same shape"),
    ((torch.randn(2, 5, 4, 32), torch.randn(2, 6, 2, 32).half(), torch.randn(2, 6, 2, 32)), {}, TypeError,
     "share a dtype"),
])
def test_dense_validation(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        blockattn.flash_attention(*args, **kwargs)


def test_varlen_validation():
    q, k, v, cu_q, cu_k = packed_inputs([3, 4], [5, 6], 4, 2, 32, torch.float32, "cpu")
    call = blockattn.flash_attention_varlen
    with pytest.raises(ValueError, match="same length B"):
        call(q, k, v, cu_q, cu_k[:-1])
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32 or int64"):
        call(q, k, v, cu_q.float(), cu_k)
    with pytest.raises(TypeError, match="max_seqlen_q must be a non-negative int or None, got 2.5 of type float"):
        call(q, k, v, cu_q, cu_k, max_seqlen_q=2.5)
    with pytest.raises(ValueError, match="max_seqlen_q must be a non-negative int"):
        call(q, k, v, cu_q, cu_k, max_seqlen_q=-1)
    with pytest.raises(ValueError, match="more than the max_seqlen hint"):
        call(q, k, v, cu_q, cu_k, max_seqlen_q=3)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\] must equal"):
        call(q, k, v, cu_q, cu_k + torch.tensor([0, 0, 1], dtype=cu_k.dtype))
    with pytest.raises(ValueError, match="non-decreasing"):
        call(q, k, v, torch.tensor([0, 8, 7], dtype=torch.int32), cu_k)
    with pytest.raises(ValueError, match="B = 0"):
        call(q, k, v, cu_q[:1], cu_k[:1])
    with pytest.raises(ValueError, match="forward only"):
        call(q.requires_grad_(), k, v, cu_q, cu_k)
    with torch.no_grad():
        assert call(q, k, v, cu_q, cu_k).shape == q.shape
