"""GPU-only behaviour of the block attention kernels (skipped without a CUDA GPU)."""

import dataclasses
import fcntl
import itertools
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import triton.compiler.compiler
from conftest import (
    BLOCK_SIZES,
    ON_HOPPER,
    assert_within_2x_pytorch,
    capture_cuda_graph,
    dispatch_without,
    forward_of,
    make_offsets,
    max_err,
    odd_lengths,
    random_angles,
    random_inputs,
    reference_grads,
    requires_gpu,
)
from triton.runtime.errors import OutOfResources

import blockattn
from blockattn import backends, custom_ops, devices
from blockattn.backends import AttentionCall
from blockattn.checks import rotate_mask
from blockattn.ops import block_attention as triton_ops
from blockattn.ops import launch, plans
from blockattn.ops.tiles import ROTATE_ALL
from blockattn.reference import rotary_reference, snr_db

pytestmark = [requires_gpu, pytest.mark.gpu]


@pytest.fixture
def gpu_memory_alone():
    """One test at a time (across pytest-xdist workers) for the cases that fill a third of an 80 GB card: two of
    them at once, beside the other tests, run out of memory."""
    with open(Path(tempfile.gettempdir()) / "blockattn-large-gpu-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
        torch.cuda.empty_cache()


def public_op(q, k, v, do, offsets, block_size, **rotary):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = blockattn.block_attention(*leaves, offsets, block_size=block_size, **rotary)
    out.backward(do)
    return [out.detach(), *(t.grad for t in leaves)]


def random_lengths(num_seqs, max_len, block_size):
    lengths = torch.randint(0, max_len, (num_seqs,)).tolist()
    return lengths + odd_lengths(block_size)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", [16, 40, 64, 128, 256])
def test_accuracy_contract(dtype, block_size, head_dim, poisoned_outputs):
    """docs/semantics.md, "Accuracy": 2x PyTorch's error in the same precision; bf16 SNR > 40 dB forward, > 45 dB
    gradients."""
    q, k, v, do, offsets = random_inputs(random_lengths(6, 300, block_size), 4, 2, head_dim, dtype, "cuda")
    results = public_op(q, k, v, do, offsets, block_size)
    assert_within_2x_pytorch(results, q, k, v, do, offsets, block_size)
    exact = reference_grads(q, k, v, do, offsets, block_size)
    for name, got, ref, floor in zip(("out", "dq", "dk", "dv"), results, exact, (40, 45, 45, 45)):
        assert snr_db(got, ref) > floor, f"{name}: SNR {snr_db(got, ref):.1f} dB"


@pytest.mark.parametrize("heads", [(8, 1), (6, 2), (3, 3)])
def test_gqa_mqa(heads):
    q, k, v, do, offsets = random_inputs(random_lengths(5, 200, 64), *heads, 64, torch.bfloat16, "cuda")
    assert_within_2x_pytorch(public_op(q, k, v, do, offsets, 64), q, k, v, do, offsets, 64)


def test_float32_is_true_fp32():
    q, k, v, do, offsets = random_inputs(random_lengths(4, 200, 64), 2, 2, 64, torch.float32, "cuda")
    for got, ref in zip(public_op(q, k, v, do, offsets, 64), reference_grads(q, k, v, do, offsets, 64)):
        assert max_err(got, ref) < 1e-5


def test_backward_is_bitwise_deterministic():
    q, k, v, do, offsets = random_inputs(random_lengths(64, 500, 64), 8, 2, 128, torch.bfloat16, "cuda")
    first = public_op(q, k, v, do, offsets, 64)
    for _ in range(3):
        for a, b in zip(first, public_op(q, k, v, do, offsets, 64)):
            assert torch.equal(a, b)


def test_cuda_graph_replay_with_new_offsets():
    """Capture once; replay after changing the offsets' values (same B and N): the result follows the new values."""
    n, num_seqs = 1000, 7
    q, k, v, do, offsets = random_inputs([n // num_seqs] * (num_seqs - 1) + [n - (num_seqs - 1) * (n // num_seqs)],
                                         4, 4, 64, torch.bfloat16, "cuda")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    static_offsets = offsets.clone()

    def step():
        for t in leaves:
            t.grad = None
        out = blockattn.block_attention(*leaves, static_offsets, block_size=64)
        out.backward(do)
        return out

    graph, static_out = capture_cuda_graph(step)
    for lengths in ([0, 1, 63, 64, 65, 300, n - 493], [n, 0, 0, 0, 0, 0, 0]):
        static_offsets.copy_(make_offsets(lengths, "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        exact = reference_grads(q, k, v, do, static_offsets, 64)
        for got, ref in zip([static_out, *(t.grad for t in leaves)], exact):
            assert snr_db(got, ref) > 40


def test_compile_fullgraph_no_graph_break():
    q, k, v, do, offsets = random_inputs(random_lengths(8, 300, 64), 4, 2, 64, torch.bfloat16, "cuda")

    def layer(q, k, v, offsets):
        # Exact elementwise ops around the op (Inductor may round silu & co. differently from eager): compiled and
        # eager then feed the op the same bits, and it must return the same bits.
        return blockattn.block_attention(q * 2, k, v.neg(), offsets) * 2

    explanation = torch._dynamo.explain(layer)(q, k, v, offsets)
    assert explanation.graph_break_count == 0
    compiled = torch.compile(layer, fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = compiled(*leaves, offsets)
    out.backward(do)
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = layer(*eager, offsets)
    ref.backward(do)
    for a, b in zip([out, *(t.grad for t in leaves)], [ref, *(t.grad for t in eager)]):
        assert torch.equal(a, b)


def test_nested_on_gpu():
    lengths = [70, 0, 129]
    q, k, v, do, offsets = random_inputs(lengths, 2, 2, 64, torch.bfloat16, "cuda", torch.int64)
    nested = [torch.nested.nested_tensor_from_jagged(t, offsets) for t in (q, k, v)]
    out = blockattn.block_attention(*nested)
    assert out.is_nested
    assert snr_db(out.values(), reference_grads(q, k, v, do, offsets, 64)[0]) > 40


@pytest.mark.parametrize("hq,hkv,rotary", [(8, 1, False), (3, 3, False), (3, 3, True)], ids=["mqa", "mha", "rotary"])
def test_more_than_2_pow_31_elements(hq, hkv, rotary, gpu_memory_alone):
    """N * H * D > 2^31: row offsets must be computed in int64. Checks the blocks at the far end."""
    d = 128
    n = 2**31 // (hq * d) + 1000
    lengths = [n - 200, 77, 123]
    q = torch.randn(n, hq, d, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(n, hkv, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    do = torch.randn_like(q)
    sinu_pos = random_angles(n, d, torch.bfloat16, "cuda") if rotary else None
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = blockattn.block_attention(*leaves, make_offsets(lengths, "cuda"), sinu_pos=sinu_pos)
    out.backward(do)
    # From a block boundary of the long sequence on, the tail is a problem of its own.
    tail = ((n - 200) // 64 - 1) * 64
    assert tail * hq * d > 2**31
    tail_offsets = make_offsets([n - 200 - tail, 77, 123], "cuda")
    exact = reference_grads(q[tail:], k[tail:], v[tail:], do[tail:], tail_offsets, 64,
                            sinu_pos=None if sinu_pos is None else sinu_pos[tail:], rotate=ROTATE_ALL if rotary else 0)
    for got, ref in zip([out, q.grad, k.grad, v.grad], exact):
        assert snr_db(got[tail:], ref) > 40


@pytest.mark.parametrize("block_size,heads,head_dim", [(64, (8, 2), 256), (128, (8, 8), 64)])
def test_forward_fallbacks_for_99_kib_of_shared_memory(block_size, heads, head_dim, monkeypatch, poisoned_outputs):
    """The forward rules that take more shared memory than sm_86 and sm_89 give (``kernel_config``: the rotary
    forward under GQA past D = 128 at 64-token blocks, the rotary's 8 heads at 128-token blocks) give way to smaller
    programs there; those run here with this GPU's limit faked to 99 KiB, forward and backward within 2x PyTorch's
    error."""
    monkeypatch.setattr(devices, "shared_memory_limit", lambda device: 99 * 1024)
    q, k, v, do, offsets = random_inputs(odd_lengths(block_size) + [300, 517], *heads, head_dim, torch.bfloat16,
                                         "cuda")
    sinu_pos = random_angles(q.shape[0], head_dim, torch.float32, "cuda")
    assert_within_2x_pytorch(public_op(q, k, v, do, offsets, block_size, sinu_pos=sinu_pos), q, k, v, do, offsets,
                             block_size, sinu_pos=sinu_pos, rotate=ROTATE_ALL)


FWD, BWD = triton_ops._block_attention_fwd_kernel, triton_ops._block_attention_bwd_kernel
PERSISTENT = triton_ops._block_attention_bwd_persistent_kernel


@pytest.mark.parametrize("heads,angles,limit_kib,expected", [
    ((12, 3), None, 44, [(FWD, None, False), (FWD, None, True), (PERSISTENT, 3, False), (PERSISTENT, 2, False),
                         (BWD, None, True)]),
    ((12, 12), None, 44, [(FWD, None, True), (PERSISTENT, 3, False), (BWD, None, True)]),
    ((12, 3), torch.float32, 44, [(FWD, None, False), (FWD, None, True), (BWD, None, False), (BWD, None, True)]),
    ((12, 4), None, 160, [(FWD, None, True), (PERSISTENT, 3, False), (PERSISTENT, 2, True)]),
], ids=["gqa", "mha", "gqa-rotary", "gqa-two-stages"])
def test_launchers_fall_back_where_the_gpu_cannot_run_the_rule(heads, angles, limit_kib, expected, monkeypatch,
                                                              poisoned_outputs):
    """Where a program of the rule's configuration needs more shared memory than the GPU gives (faked here: Triton's
    limit and ``devices``' at ``limit_kib``; 64-token blocks at D = 128, which on sm_90 with triton 3.6 take 48 KiB
    for the GQA group's forward, 96 with a rotary, 204-212 KiB for the pipelined backward, 144 two stages deep
    under GQA), Triton refuses it at its first launch and the launchers fall back to ``kernel_config``'s lean
    configuration (32-40 KiB), under GQA the persistent backward to two stages first. ``expected``: the attention
    kernels' launches in turn, (kernel, pipeline stages, whether it ran). Forward and backward within 2x PyTorch's
    error; a second call through the launchers (no recorded plan) the same launches, none through Triton (the
    refused keys remembered by ``launch``), its results bitwise the first's. 12 query heads, which no other test
    launches, and kv heads that no other case does under another limit (a key refused is refused for the process),
    so that every kernel compiles and loads under its faked limit."""
    limit = limit_kib * 1024
    monkeypatch.setattr(triton.compiler.compiler, "max_shared_mem", lambda device: limit)
    monkeypatch.setattr(devices, "shared_memory_limit", lambda device: limit)
    dispatch_without(monkeypatch, "sm90-gluon")
    plans.forget()
    launches = []

    def recorded(kernel, grid, **kwargs):
        try:
            launch.launch(kernel, grid, **kwargs)
        except OutOfResources:
            launches.append((kernel, kwargs.get("PIPELINE_STAGES"), False))
            raise
        launches.append((kernel, kwargs.get("PIPELINE_STAGES"), True))

    monkeypatch.setattr(triton_ops, "launch", recorded)
    q, k, v, do, offsets = random_inputs(odd_lengths(64) + [300, 517], *heads, 128, torch.bfloat16, "cuda")
    rotary = {} if angles is None else {"sinu_pos": random_angles(q.shape[0], 128, angles, "cuda")}
    first = public_op(q, k, v, do, offsets, 64, **rotary)
    assert_within_2x_pytorch(first, q, k, v, do, offsets, 64, rotate=ROTATE_ALL if rotary else 0, **rotary)
    assert [launched for launched in launches if launched[0] in (FWD, BWD, PERSISTENT)] == expected
    through_triton = []
    compile_or_find = launch._through_triton
    monkeypatch.setattr(launch, "_through_triton",
                        lambda kernel, *args: through_triton.append(kernel) or compile_or_find(kernel, *args))
    plans.forget()
    launches.clear()
    for got, want in zip(public_op(q, k, v, do, offsets, 64, **rotary), first):
        assert torch.equal(got, want)
    assert [launched for launched in launches if launched[0] in (FWD, BWD, PERSISTENT)] == expected
    assert through_triton == []


@pytest.mark.parametrize("call", [
    "blockattn.block_attention(q, q, q, torch.tensor([1, 7, 10], device='cuda'))",
    "blockattn.block_attention(q, q, q, torch.tensor([0, 7, 3, 10], device='cuda', dtype=torch.int32))",
    "blockattn.block_attention(q, q, q, torch.tensor([0, 7, 9], device='cuda'))",
    "blockattn.block_attention(q, q, q, torch.tensor([1] * 70 + [10], device='cuda'))",
    "blockattn.block_layout(torch.tensor([0, 7, 3, 10], device='cuda'), 10)",
    ("blockattn.flash_attention_varlen(q, q, q, *[torch.tensor([0, 7, 10], device='cuda', dtype=torch.int32)] * 2,"
     " max_seqlen_q=5, max_seqlen_k=7)"),
], ids=["start", "decreasing", "end", "start-of-many", "layout", "max_seqlen"])
def test_bad_offsets_trip_device_assert(call):
    """Offsets on the GPU are checked without a host sync, by the table kernel's assertion, or on few sequences the
    forward kernel's, which runs without a table (``OffsetsOnly``; 70 sequences take a table): a bad value (a first
    offset other than 0, a decreasing one, a last one other than N, a sequence above the max_seqlen hint) fails the
    next synchronising call."""
    script = f"import torch, blockattn\nq = torch.randn(10, 2, 64, device='cuda', dtype=torch.bfloat16)\n{call}\n" \
             "torch.cuda.synchronize()\nprint('no assertion')\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode != 0 and "no assertion" not in result.stdout
    assert "device-side assert" in result.stderr
    assert "blockattn: bad offsets or cu_seqlens" in result.stdout + result.stderr


@pytest.mark.parametrize("num_seqs,heads,head_dim,kernels", [
    (3, (4, 4), 128, "dispatched"), (64, (4, 4), 128, "dispatched"), (65, (4, 4), 128, "dispatched"),
    (3, (8, 1), 128, "dispatched"), (3, (8, 2), 128, "dispatched"), (3, (4, 4), 64, "triton"),
    (64, (8, 2), 64, "triton"), (3, (4, 4), 128, "triton"), (65, (4, 4), 64, "triton"), (3, (4, 4), 32, "dispatched"),
    (3, (4, 4), 32, "triton")])
def test_eager_call_without_a_table(num_seqs, heads, head_dim, kernels, monkeypatch, poisoned_outputs):
    """An eager call on up to 64 sequences runs the Triton forward without a block table (the table kernel's launch
    and allocations are host time a small batch's kernel does not need; at D = 32 the forward of 4 heads a
    program), and its backward where the one-block kernel runs (D = 32 and 64; at D = 128 the persistent one, which
    reads a table, builds it); on Hopper without GQA the Gluon backward too, while the Hopper backward under GQA
    (8:1) builds the table itself. On more sequences, and where the warp-specialised Hopper forward runs it (8:2),
    the forward builds it, and the backward reads it. Without a gradient, only the forward's. The results are the
    reference's either way, and the gradients those of a call on a layout's table, bitwise. ``kernels="triton"``:
    the Hopper kernels taken out of the dispatcher, so the Triton kernels run these calls on a Hopper GPU too."""
    if kernels == "triton":
        dispatch_without(monkeypatch, "sm90-gluon")
    hopper = ON_HOPPER and backends.sm90_ops is not None and kernels == "dispatched"
    built = []
    build = custom_ops.build_block_table
    monkeypatch.setattr(custom_ops, "build_block_table", lambda *args: built.append(args) or build(*args))
    plans.forget()
    lengths = torch.randint(0, 150, (num_seqs,)).tolist()
    q, k, v, do, offsets = random_inputs(lengths, *heads, head_dim, torch.bfloat16, "cuda")
    forward_call = AttentionCall.of("fwd", q, k, 64, 0, 0, tensors=(q, k, v))
    backward_call = AttentionCall.of("bwd", q, k, 64, 0, 0, tensors=(q, k, v, do),
                                     grads=tuple(map(torch.empty_like, (q, k, v))))
    tableless, backward_tableless = (backends.select(call).finds_blocks is not None
                                     and backends.select(call).finds_blocks(call, num_seqs, q.shape[0])
                                     for call in (forward_call, backward_call))
    few = (num_seqs <= triton_ops.FIND_BLOCKS_MAX_SEQS
           and q.shape[0] * heads[0] * head_dim <= triton_ops.FIND_BLOCKS_MAX_ELEMENTS)
    assert tableless == (few and (heads != (8, 2) or not hopper))
    assert backward_tableless == (few and (heads[0] == heads[1] if hopper else head_dim <= 64))
    with torch.no_grad():
        out = blockattn.block_attention(q, k, v, offsets)
    assert len(built) == (0 if tableless else 1)
    built.clear()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    results = [blockattn.block_attention(*leaves, offsets)]
    assert len(built) == (0 if tableless else 1)
    built.clear()
    results[0].backward(do)
    assert len(built) == (1 if tableless and not backward_tableless else 0)
    on_layout = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    blockattn.block_attention(*on_layout, blockattn.block_layout(offsets, q.shape[0])).backward(do)
    for leaf, want in zip(leaves, on_layout):
        assert torch.equal(leaf.grad.view(torch.int16), want.grad.view(torch.int16))
    # Repeated, the calls launch their compiled kernels straight away (a key for a pointer passed as None), and
    # replay their plans.
    through_triton = []
    monkeypatch.setattr(launch, "_through_triton", lambda *args: through_triton.append(args))
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(blockattn.block_attention(q, k, v, offsets), out, rtol=0, atol=0)
    assert not through_triton
    exact = reference_grads(q, k, v, do, offsets, 64)
    for name, got, ref, floor in zip(("inference out", "out", "dq", "dk", "dv"),
                                     [out, *results, *(t.grad for t in leaves)], [exact[0], *exact],
                                     (40, 40, 45, 45, 45)):
        assert snr_db(got, ref) > floor, f"{name}: SNR {snr_db(got, ref):.1f} dB"


# --- rotary: apply_rotary, fused into the kernels, and the packed projection ----------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 64, 128])
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
@pytest.mark.parametrize("rotate", [("q", "k", "v"), ("q", "k"), ("v",)], ids=["qkv", "qk", "v"])
def test_fused_rotary_accuracy_contract(rotate, dtype, block_size, head_dim, poisoned_outputs):
    """The accuracy contract for rotary + attention: 2x PyTorch's same-precision error (rotary then attention), bf16
    SNR."""
    q, k, v, do, offsets = random_inputs(random_lengths(6, 300, block_size), 3, 3, head_dim, dtype, "cuda")
    sinu_pos = random_angles(q.shape[0], head_dim, dtype, "cuda")
    mask = rotate_mask(rotate)
    results = public_op(q, k, v, do, offsets, block_size, sinu_pos=sinu_pos, rotate=rotate)
    assert_within_2x_pytorch(results, q, k, v, do, offsets, block_size, sinu_pos=sinu_pos, rotate=mask)
    exact = reference_grads(q, k, v, do, offsets, block_size, sinu_pos=sinu_pos, rotate=mask)
    for name, got, ref, floor in zip(("out", "dq", "dk", "dv"), results, exact, (40, 45, 45, 45)):
        assert snr_db(got, ref) > floor, f"{name}: SNR {snr_db(got, ref):.1f} dB"


@pytest.mark.parametrize("head_dim", [40, 128])
def test_fused_rotary_float32(head_dim, poisoned_outputs):
    """fp32 tensors: pairs read as 64-bit words, true fp32 products."""
    q, k, v, do, offsets = random_inputs(random_lengths(5, 200, 64), 2, 2, head_dim, torch.float32, "cuda")
    sinu_pos = random_angles(q.shape[0], head_dim, torch.float32, "cuda")
    results = public_op(q, k, v, do, offsets, 64, sinu_pos=sinu_pos)
    assert_within_2x_pytorch(results, q, k, v, do, offsets, 64, sinu_pos=sinu_pos, rotate=ROTATE_ALL)


@pytest.mark.parametrize("heads", [(8, 1), (4, 2), (8, 8), (3, 3)])
def test_fused_rotary_fp32_angles(heads):
    """fp32 angles with bf16 tensors under GQA, and without it, where the forward runs 4 (8 heads) or 3 (3 heads)
    query heads a program on the angles read once."""
    q, k, v, do, offsets = random_inputs(random_lengths(5, 300, 64), *heads, 128, torch.bfloat16, "cuda")
    sinu_pos = random_angles(q.shape[0], 128, torch.float32, "cuda")  # fp32 angles with bf16 tensors
    results = public_op(q, k, v, do, offsets, 64, sinu_pos=sinu_pos)
    assert_within_2x_pytorch(results, q, k, v, do, offsets, 64, sinu_pos=sinu_pos, rotate=ROTATE_ALL)


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("head_dim", [192, 256])
@pytest.mark.parametrize("heads", [(8, 2), (6, 1)], ids=lambda h: f"{h[0]}:{h[1]}")
@pytest.mark.parametrize("dtype,angles_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float16)],
                         ids=["bf16-fp32angles", "fp16"])
def test_fused_rotary_past_d128_under_gqa(dtype, angles_dtype, heads, head_dim, block_size, poisoned_outputs):
    """The rotary forward under GQA past D = 128 runs whole rows and the group in a program (8 warps at 64-token
    blocks, 4 below; ``kernel_config``): the accuracy contract, odd lengths, fp32 and input-dtype angles."""
    q, k, v, do, offsets = random_inputs(random_lengths(6, 300, block_size), *heads, head_dim, dtype, "cuda")
    sinu_pos = random_angles(q.shape[0], head_dim, angles_dtype, "cuda")
    results = public_op(q, k, v, do, offsets, block_size, sinu_pos=sinu_pos)
    assert_within_2x_pytorch(results, q, k, v, do, offsets, block_size, sinu_pos=sinu_pos, rotate=ROTATE_ALL)


@pytest.mark.parametrize("heads", [(3, 3), (8, 2)], ids=lambda h: f"{h[0]}:{h[1]}")
def test_fused_rotary_backward_is_bitwise_deterministic(heads):
    q, k, v, do, offsets = random_inputs(random_lengths(32, 500, 64), *heads, 128, torch.bfloat16, "cuda")
    sinu_pos = random_angles(q.shape[0], 128, torch.bfloat16, "cuda")
    first = public_op(q, k, v, do, offsets, 64, sinu_pos=sinu_pos)
    for _ in range(2):
        for a, b in zip(first, public_op(q, k, v, do, offsets, 64, sinu_pos=sinu_pos)):
            assert torch.equal(a, b)


def test_dispatcher_on_this_gpu():
    """On this GPU the Hopper kernels take the backward of every block size at D = 128 (16 and 32 tokens as 64-row
    tiles, but for the rotary without GQA), with or without GQA, 16-bit tensors that TMA reads as [N, H * D] rows,
    with or without a rotary, the plain forward under GQA at every block size and the plain forward of 128-token
    blocks without GQA (on other GPUs the Triton kernels do); every other forward and backward runs the Triton
    kernels."""
    q, k, v, do, _ = random_inputs([100], 3, 3, 128, torch.bfloat16, "cuda")
    narrow = random_inputs([100], 3, 3, 16, torch.bfloat16, "cuda")[:4]

    def chosen(pass_name, q, k, v, do, grads, block_size, rotate):
        call = AttentionCall.of(pass_name, q, k, block_size, rotate, tensors=(q, k, v, do), grads=grads)
        return backends.select(call).name

    production = "sm90-gluon" if ON_HOPPER else "triton"
    for rotate, block_size in itertools.product((0, 1, ROTATE_ALL), (16, 32, 64, 128)):
        tiles = block_size >= 64 or not rotate
        assert chosen("bwd", q, k, v, do, (q, k, v), block_size, rotate) == (production if tiles else "triton")
        gqa = (q, k[:, :1], v[:, :1], do, (q, k[:, :1], v[:, :1]), block_size, rotate)
        assert chosen("bwd", *gqa) == production
        halves = not rotate and block_size == 128  # the warp-specialised forward in halves
        assert chosen("fwd", q, k, v, do, (), block_size, rotate) == (production if halves else "triton")
        # 3 query heads a kv head, plain: the warp-specialised forward (in halves at 128-token blocks)
        assert chosen("fwd", *gqa[:4], (), block_size, rotate) == (production if not rotate else "triton")
        # 2 query heads a kv head with fp32 angles TMA reads: the warp-specialised forward up to 64-token blocks
        angles = random_angles(100, 128, torch.float32, "cuda")
        call = AttentionCall.of("fwd", q[:, :2], k[:, :1], block_size, ROTATE_ALL, tensors=(q, k, v), angles=angles)
        assert backends.select(call).name == (production if block_size <= 64 else "triton")
    padded_heads = torch.randn(100, 3, 136, dtype=torch.bfloat16, device="cuda")[..., :128]
    odd_rows = torch.randn(100, 385, dtype=torch.bfloat16, device="cuda")[:, :384].view(100, 3, 128)
    for other in [
        (*narrow, narrow[:3], 16, ROTATE_ALL),  # D = 16
        (*(t.float() for t in (q, k, v, do)), (q, k, v), 64, ROTATE_ALL),
        (q[..., :64], k[..., :64], v[..., :64], do[..., :64], (q, k, v), 64, ROTATE_ALL),  # D 64 as strided views
        (padded_heads, k, v, do, (q, k, v), 64, ROTATE_ALL),  # heads not side by side: no [N, H * D] descriptor
        (odd_rows, k, v, do, (q, k, v), 64, ROTATE_ALL),  # rows not 16-byte aligned
        (q, k, v, do, (padded_heads, k, v), 64, ROTATE_ALL),
    ]:
        assert chosen("bwd", *other) == "triton"


def check_sm90_backward(block_size, head_dim, heads, dtype, rotate, monkeypatch):
    """The Hopper kernels (checked to run) on odd lengths: the accuracy contract against float64, and an SNR bound
    on each gradient."""
    calls = []
    hopper = backends.BACKENDS["sm90-gluon"]
    monkeypatch.setitem(backends.BACKENDS, "sm90-gluon", dataclasses.replace(
        hopper, backward=lambda *args: calls.append(1) or hopper.backward(*args)))
    q, k, v, do, offsets = random_inputs(random_lengths(6, 400, block_size), *heads, head_dim, dtype, "cuda")
    sinu_pos = random_angles(q.shape[0], head_dim, dtype, "cuda") if rotate else None
    rotary = {"sinu_pos": sinu_pos, "rotate": rotate} if rotate else {}
    results = public_op(q, k, v, do, offsets, block_size, **rotary)
    assert calls == [1]
    mask = rotate_mask(rotate) if rotate else 0
    assert_within_2x_pytorch(results, q, k, v, do, offsets, block_size, sinu_pos=sinu_pos, rotate=mask)
    exact = reference_grads(q, k, v, do, offsets, block_size, sinu_pos=sinu_pos, rotate=mask)
    for name, got, ref in zip(("dq", "dk", "dv"), results[1:], exact[1:]):
        assert snr_db(got, ref) > 45, f"{name}: SNR {snr_db(got, ref):.1f} dB"


def sm90_launches(monkeypatch) -> list[dict]:
    """The keyword arguments of every launch of the Hopper backward's kernels from here on, recorded."""
    plans.forget()  # a replayed plan would launch without sm90.launch
    launched = []
    monkeypatch.setattr(backends.sm90_ops, "launch",
                        lambda kernel, grid, **kw: launched.append(kw) or launch.launch(kernel, grid, **kw))
    return launched


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("heads", [(3, 3), (4, 2), (6, 2), (8, 1)], ids=lambda h: f"{h[0]}:{h[1]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rotate", [(), ("q",), ("k",), ("q", "k"), ("v",), ("q", "v"), ("k", "v"), ("q", "k", "v")],
                         ids=lambda r: "".join(r) or "plain")
def test_sm90_backward_accuracy_contract(rotate, dtype, heads, head_dim, poisoned_outputs, monkeypatch):
    """One warpgroup (64-token blocks, D <= 128), without and with GQA (odd and even groups), plain and with every
    rotate choice."""
    check_sm90_backward(64, head_dim, heads, dtype, rotate, monkeypatch)


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("block_size,head_dim,heads", [
    (64, 256, (3, 3)), (64, 256, (6, 2)), (64, 256, (8, 1)), (128, 32, (3, 3)), (128, 32, (6, 2)),
    (128, 64, (3, 3)), (128, 64, (4, 2)), (128, 64, (8, 1)), (128, 128, (3, 3)), (128, 128, (1, 1)),
    (128, 128, (6, 2)), (128, 128, (8, 1))],
    ids=lambda x: f"{x[0]}:{x[1]}" if isinstance(x, tuple) else str(x))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rotate", [(), ("q", "k"), ("v",), ("q", "k", "v")], ids=lambda r: "".join(r) or "plain")
def test_sm90_backward_two_warpgroups(rotate, dtype, block_size, head_dim, heads, poisoned_outputs, monkeypatch):
    """Two warpgroups: 128-token blocks (warpgroups down the rows; under GQA at D = 128 side by side on half the
    block's query rows a step, ``test_sm90_backward_query_halves``), D = 256 at 64-token blocks (side by side along
    the columns), without and with GQA (odd and even groups, MQA), plain and rotary; without GQA at 128-token blocks
    and D <= 64 one program runs every head of a block in turn (3 heads: the first buffer twice, its barrier's phase
    flipped)."""
    check_sm90_backward(block_size, head_dim, heads, dtype, rotate, monkeypatch)


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("block_size,head_dim,heads,rotate", [
    (block_size, head_dim, heads, rotate)
    for block_size in (16, 32) for head_dim in (32, 64, 128, 256) for heads in ((3, 3), (6, 2), (8, 1))
    for rotate in ((), ("q", "k"), ("q", "k", "v"))
    if heads[0] != heads[1] or not rotate or head_dim < 4 * block_size],  # where tiles.blocks_per_tile packs them
    ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sm90_backward_blocks_in_tiles(dtype, block_size, head_dim, heads, rotate, poisoned_outputs, monkeypatch):
    """16- and 32-token blocks, 4 or 2 to a 64-row tile (``tiles.blocks_per_tile``), the forward's Triton tiles
    too: odd lengths, so that tiles hold blocks of several sequences, partial blocks and padding slots."""
    check_sm90_backward(block_size, head_dim, heads, dtype, rotate, monkeypatch)


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("heads", [(2, 1), (6, 2), (8, 1), (3, 3)], ids=lambda h: f"{h[0]}:{h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rotate", [(), ("q",), ("k", "v"), ("q", "k", "v")], ids=lambda r: "".join(r) or "plain")
def test_sm90_backward_query_halves(rotate, dtype, head_dim, heads, poisoned_outputs, monkeypatch):
    """Under GQA at 128-token blocks and D = 128 the GQA kernel runs each query head in two steps of 64 query rows
    (``_query_rows``; its q tiles land 64 rows at a time), on odd lengths: a second step partly in the block (127
    tokens) or wholly past its end (1 token, and the tails of 129); [128, 128] tiles elsewhere, S before dP under
    GQA (``_split_products``)."""
    launched = sm90_launches(monkeypatch)
    check_sm90_backward(128, head_dim, heads, dtype, rotate, monkeypatch)
    gqa = heads[0] != heads[1]
    assert [kw["q_desc"].block_shape[0] for kw in launched] == [64 if gqa and head_dim == 128 else 128]
    assert [kw["k_desc"].block_shape[0] for kw in launched] == [128]
    assert [kw.get("SPLIT", False) for kw in launched] == [gqa]


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("num_heads,per_program", [(4, 4), (5, 5), (9, 8)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rotate", [(), ("q", "k"), ("q", "k", "v")], ids=lambda r: "".join(r) or "plain")
def test_sm90_backward_heads_a_program_at_d32(rotate, dtype, num_heads, per_program, block_size, poisoned_outputs,
                                              monkeypatch):
    """At D = 32 on 64-row tiles one program runs up to 8 heads of a block in turn (``_heads_per_program``): an
    odd count reuses the first buffer (its barrier's phase flipped), 9 heads leave the second program one."""
    launched = sm90_launches(monkeypatch)
    check_sm90_backward(block_size, 32, (num_heads, num_heads), dtype, rotate, monkeypatch)
    assert [kw["HEADS"] for kw in launched] == [per_program]


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("heads", [(3, 3), (4, 2), (6, 2), (8, 1), (8, 4)], ids=lambda h: f"{h[0]}:{h[1]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sm90_forward_accuracy_contract(dtype, heads, head_dim, block_size, poisoned_outputs):
    """Every shape the kernel takes, on odd lengths: 64-row tiles of one 64-token block or of several sequences'
    16- and 32-token blocks, 128-token blocks in two halves (blocks of up to 64 tokens among them), partial blocks,
    padding slots; groups of 1 to 8 query heads, odd and even (at D = 128 fewer q slots than the group)."""
    q, k, v, do, offsets = random_inputs(random_lengths(6, 400, block_size), *heads, head_dim, dtype, "cuda")
    assert backends.sm90_fwd_ops.kernel_reason(AttentionCall.of("fwd", q, k, block_size, 0, tensors=(q, k, v))) is None
    out = forward_of("sm90-gluon", q, k, v, offsets, block_size)
    assert_within_2x_pytorch([out], q, k, v, do, offsets, block_size, names=("out",))


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("block_size", [16, 64, 128])
@pytest.mark.parametrize("heads", [(3, 3), (8, 2), (5, 1), (6, 1)], ids=lambda h: f"{h[0]}:{h[1]}")
def test_sm90_forward_several_items_a_program(heads, block_size, monkeypatch, poisoned_outputs):
    """Two programs (the grid is one a multiprocessor, here said to be two), so that each runs dozens of items in
    turn: the k/v and q rings and their barriers carried from item to item, past a batch of bounds (32 items), and
    at 128-token blocks the barrier on which both consumers fix a partial block's values, phase after phase; groups
    of 5 and 6 query heads."""
    monkeypatch.setattr(devices, "multiprocessors", lambda device: 2)
    q, k, v, do, offsets = random_inputs(random_lengths(24, 700, block_size), *heads, 64, torch.bfloat16, "cuda")
    out = forward_of("sm90-gluon", q, k, v, offsets, block_size)
    assert_within_2x_pytorch([out], q, k, v, do, offsets, block_size, names=("out",))


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("heads", [(3, 3), (6, 2), (8, 4), (8, 1)], ids=lambda h: f"{h[0]}:{h[1]}")
def test_sm90_forward_rotary(heads, head_dim, block_size, poisoned_outputs):
    """The warp-specialised forward with a rotary (k and v turned by the turner warpgroup, q by the consumers): every
    shape it takes on odd lengths (partial tiles, whose k and v rows past the end the turner zeroes; tiles of
    several blocks), fp32 angles, all three operands turned (at D = 128 one angle tile and one k/v slot a consumer,
    two of each below), whether or not the dispatcher's rule gives it the shape."""
    q, k, v, do, offsets = random_inputs(random_lengths(6, 400, block_size), *heads, head_dim, torch.bfloat16, "cuda")
    sinu_pos = random_angles(q.shape[0], head_dim, torch.float32, "cuda")
    call = AttentionCall.of("fwd", q, k, block_size, ROTATE_ALL, tensors=(q, k, v), angles=sinu_pos)
    assert backends.sm90_fwd_ops.kernel_reason(call) is None
    out = forward_of("sm90-gluon", q, k, v, offsets, block_size, sinu_pos=sinu_pos, rotate=ROTATE_ALL)
    assert_within_2x_pytorch([out], q, k, v, do, offsets, block_size, names=("out",), sinu_pos=sinu_pos,
                             rotate=ROTATE_ALL)


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("rotate", [("q", "k", "v"), ("q", "k"), ("v",), ("q",)], ids=["qkv", "qk", "v", "q"])
@pytest.mark.parametrize("dtype,angles_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float16, torch.float16)], ids=["bf16-fp32", "bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sm90_forward_rotary_operands_and_angles(head_dim, dtype, angles_dtype, rotate, poisoned_outputs):
    """Any subset of q, k, v turned, angles in fp32 or the inputs' dtype, fp16 and bf16; the dispatcher declines
    angles TMA cannot read (every other column of a wider tensor), which the Triton forward then takes."""
    q, k, v, do, offsets = random_inputs(random_lengths(6, 300, 64), 8, 2, head_dim, dtype, "cuda")
    sinu_pos = random_angles(q.shape[0], head_dim, angles_dtype, "cuda")
    mask = rotate_mask(rotate)
    out = forward_of("sm90-gluon", q, k, v, offsets, 64, sinu_pos=sinu_pos, rotate=mask)
    assert_within_2x_pytorch([out], q, k, v, do, offsets, 64, names=("out",), sinu_pos=sinu_pos, rotate=mask)
    strided = torch.stack([sinu_pos, sinu_pos], dim=-1).flatten(1)[:, ::2]
    call = AttentionCall.of("fwd", q, k, 64, mask, tensors=(q, k, v), angles=strided)
    assert "angles" in backends.sm90_fwd_ops.kernel_reason(call)
    assert backends.select(call).name == "triton"


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(3, 3), (8, 2), (5, 1)], ids=lambda h: f"{h[0]}:{h[1]}")
def test_sm90_forward_rotary_several_items_a_program(heads, head_dim, block_size, monkeypatch, poisoned_outputs):
    """Two programs, so that each turns dozens of items in turn: the angle tiles and their barriers carried from item
    to item and past a batch of bounds (one tile a consumer at D = 128, reused item after item; two at D = 64), a
    group of 5 query heads through 2 (D = 128) or 4 (D = 64) q slots a consumer."""
    monkeypatch.setattr(devices, "multiprocessors", lambda device: 2)
    q, k, v, do, offsets = random_inputs(random_lengths(24, 700, block_size), *heads, head_dim, torch.bfloat16,
                                         "cuda")
    sinu_pos = random_angles(q.shape[0], head_dim, torch.float32, "cuda")
    out = forward_of("sm90-gluon", q, k, v, offsets, block_size, sinu_pos=sinu_pos, rotate=ROTATE_ALL)
    assert_within_2x_pytorch([out], q, k, v, do, offsets, block_size, names=("out",), sinu_pos=sinu_pos,
                             rotate=ROTATE_ALL)


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("ends_early", [True, False], ids=["short-first", "long-first"])
@pytest.mark.parametrize("backend", ["sm90-gluon", "triton"])
@pytest.mark.parametrize("block_size", [64, 128])
def test_forward_nan_stays_in_its_block(backend, block_size, ends_early):
    """A NaN in one sequence's q, k, v reaches no other row, though the kernels load it with the rows of the
    partial block before it (there zeroed before the product: at 128-token blocks each consumer zeroes half the
    rows, here the first sequence's first half or second half). (Tiles of several 16- or 32-token blocks do not
    keep a NaN or inf of v in its block: docs/semantics.md.)"""
    scale = block_size // 64
    lengths = [23 if ends_early else 40 * scale + 30 * (scale - 1), 23, 64 * scale, 9, 70 * scale]
    q, k, v, _, offsets = random_inputs(lengths, 8, 2, 64, torch.bfloat16, "cuda")
    clean = forward_of(backend, q, k, v, offsets, block_size)
    poisoned = slice(lengths[0], lengths[0] + lengths[1])  # the second sequence
    for t in (q, k, v):
        t[poisoned] = float("nan")
    out = forward_of(backend, q, k, v, offsets, block_size)
    outside = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
    outside[poisoned] = False
    assert torch.equal(out[outside], clean[outside])
    assert out[poisoned].isnan().all()


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("heads", [(3, 3), (6, 2)], ids=lambda h: f"{h[0]}:{h[1]}")
@pytest.mark.parametrize("angles_layout", ["contiguous", "strided"])
def test_sm90_backward_fp32_angles_and_packed_heads(angles_layout, heads, poisoned_outputs):
    """fp32 angles with bf16 tensors, contiguous (loaded 16 bytes at a time) or every other column of a wider
    tensor, and q, k, v, dO as strided views of wider rows (TMA reads them in place)."""
    lengths = random_lengths(5, 300, 64)
    offsets = make_offsets(lengths, "cuda")
    n = int(offsets[-1])
    hq, hkv = heads
    widths = [hq * 128, hkv * 128, hkv * 128, hq * 128]
    packed = torch.randn(n, sum(widths) + 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    q, k, v, do = (packed[:, sum(widths[:i]):sum(widths[:i + 1])].view(n, -1, 128) for i in range(4))
    do = do.detach()
    sinu_pos = random_angles(n, 128, torch.float32, "cuda")
    if angles_layout == "strided":
        sinu_pos = torch.stack([sinu_pos, torch.full_like(sinu_pos, float("nan"))], dim=-1).flatten(1)[:, ::2]
        assert sinu_pos.stride() == (256, 2)
    call = AttentionCall.of("bwd", q, k, 64, ROTATE_ALL, tensors=(q, k, v, do), grads=(q, k, v))
    assert backends.select(call).name == "sm90-gluon"
    out = blockattn.block_attention(q, k, v, offsets, sinu_pos=sinu_pos)
    results = [out.detach(), *torch.autograd.grad(out, (q, k, v), do)]
    assert_within_2x_pytorch(results, *(t.detach() for t in (q, k, v)), do, offsets, 64, sinu_pos=sinu_pos,
                             rotate=ROTATE_ALL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_apply_rotary_on_gpu(dtype, poisoned_outputs):
    x = torch.randn(1000, 3, 128, dtype=dtype, device="cuda", requires_grad=True)
    sinu_pos = random_angles(1000, 128, torch.float32, "cuda")
    y = blockattn.apply_rotary(x, sinu_pos)
    grad = torch.randn_like(y)
    y.backward(grad)
    for got, ref, low in ((y, rotary_reference(x.detach(), sinu_pos),
                           rotary_reference(x.detach(), sinu_pos, compute_dtype=dtype)),
                          (x.grad, rotary_reference(grad, sinu_pos, inverse=True),
                           rotary_reference(grad, sinu_pos, inverse=True, compute_dtype=dtype))):
        assert max_err(got, ref) <= max(max_err(low, ref), 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,head_dim,rotate",
                         [((3, 3), 128, ROTATE_ALL), ((4, 1), 64, rotate_mask(("q", "k"))), ((2, 2), 40, 0)],
                         ids=["ads-rotary-shape", "gqa-qk", "d40-plain"])
def test_qkv_block_attention_on_gpu(dtype, heads, head_dim, rotate):
    from test_rotary import check_qkv_block_attention

    check_qkv_block_attention("cuda", dtype, *heads, rotate, d=head_dim, d_model=96)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_qkv_block_attention_compiles_and_captures(head_dim):
    """torch.compile(fullgraph=True) without a graph break, and a CUDA graph of forward + backward."""
    lengths = random_lengths(8, 300, 64)
    offsets = make_offsets(lengths, "cuda")
    n = int(offsets[-1])
    x = torch.randn(n, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    w = (torch.randn(64, 9 * head_dim, dtype=torch.bfloat16, device="cuda") / 8).requires_grad_()
    sinu_pos = random_angles(n, head_dim, torch.bfloat16, "cuda")

    def layer(x, w):
        out = blockattn.qkv_block_attention(x, w, offsets, num_heads=3, num_kv_heads=3, sinu_pos=sinu_pos)
        return out.float().square().mean()

    assert torch._dynamo.explain(layer)(x, w).graph_break_count == 0
    torch.compile(layer, fullgraph=True)(x, w).backward()
    compiled_grads = [x.grad.clone(), w.grad.clone()]
    x.grad = w.grad = None
    layer(x, w).backward()
    for a, b in zip(compiled_grads, [x.grad, w.grad]):
        torch.testing.assert_close(a, b)

    def step():
        x.grad = w.grad = None
        loss = layer(x, w)
        loss.backward()
        return loss

    graph, _ = capture_cuda_graph(step)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(compiled_grads, [x.grad, w.grad]):
        torch.testing.assert_close(a, b)


def test_gpu_before_ampere_runs_the_pytorch_path(monkeypatch, poisoned_outputs):
    """A GPU the kernels were not built for gets the PyTorch path (and the block table from PyTorch ops), not a
    kernel it cannot compile: pretend this one is a Turing (7.5)."""
    monkeypatch.setattr(devices, "capability", lambda device: (7, 5))
    q, k, v, do, offsets = random_inputs(random_lengths(5, 200, 32), 4, 2, 64, torch.bfloat16, "cuda")
    sinu_pos = random_angles(q.shape[0], 64, torch.float32, "cuda")
    results = public_op(q, k, v, do, offsets, 32, sinu_pos=sinu_pos, rotate=("q", "k"))
    mask = rotate_mask(("q", "k"))
    assert_within_2x_pytorch(results, q, k, v, do, offsets, 32, sinu_pos=sinu_pos, rotate=mask)
    y = blockattn.apply_rotary(q, sinu_pos)
    assert max_err(y, rotary_reference(q, sinu_pos)) <= 2 * torch.finfo(torch.bfloat16).eps * 8


def test_float64_is_refused_on_the_gpu():
    q = torch.randn(10, 2, 16, dtype=torch.float64, device="cuda")
    with pytest.raises(TypeError, match="q must be float16, bfloat16, float32 or float8_e4m3fn on cuda, got torch.float64"):
        blockattn.block_attention(q, q, q, make_offsets([10], "cuda"))
