"""Shared test helpers. Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors.

Every test draws fresh random inputs from a seed chosen for that run; a failing test prints its seed, and
``BLOCKATTN_TEST_SEED=<seed> python -m pytest <test>`` draws the same inputs again.
"""

import os
import random

import torch

if not torch.cuda.is_available():
    # Must be set before triton.jit decorates the kernels, i.e. before blockattn is imported.
    os.environ["TRITON_INTERPRET"] = "1"

import math

import pytest

from blockattn import backends, checks, devices, reference
from blockattn.block_table import build_block_table
from blockattn.ops import plans, tiles
from blockattn.ops.in_block import PLAIN, dropout_keep
from blockattn.ops.tiles import ROTATE_BITS
from blockattn.reference import block_attention_reference, rotary_reference

HAS_GPU = torch.cuda.is_available()
KERNEL_DEVICE = "cuda" if HAS_GPU else "cpu"
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
ON_HOPPER = HAS_GPU and torch.cuda.get_device_capability()[0] == 9
BLOCK_SIZES = [16, 32, 64, 128]
# Triton's interpreter gets bf16 wrong (tl.dot returns garbage, conversions truncate instead of rounding): bf16
# kernels are tested on the GPU only.
KERNEL_DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_GPU else [])


@pytest.fixture(autouse=True)
def fresh_plans():
    """No call plan (``ops.plans``) recorded by another test, under other patches, replays in this one, and no
    signature that passed the checks (``checks.once_per_signature``) there skips them here."""
    plans.forget()
    checks.forget()


@pytest.fixture
def public_calls_on_kernels(monkeypatch):
    """The device where the public functions run the Triton kernels: the GPU, or without one the CPU, its tensors
    then taken by the kernels in Triton's interpreter (an Ampere GPU of 4 SMs faked; fp16 and fp32 only there)."""
    if not HAS_GPU:
        monkeypatch.setattr(devices, "kernels_reason", lambda device: None)
        monkeypatch.setattr(devices, "capability", lambda device: (8, 0))
        monkeypatch.setattr(devices, "multiprocessors", lambda device: 4)
        monkeypatch.setattr(devices, "shared_memory_limit", lambda device: 100 * 1024)
    return KERNEL_DEVICE


@pytest.fixture(autouse=True)
def seeded(request):
    """A fresh seed per test (or ``BLOCKATTN_TEST_SEED``), shown in the report of a failing test."""
    seed = int(os.environ.get("BLOCKATTN_TEST_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    return seed


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        seed = dict(item.user_properties).get("seed")
        report.sections.append(("seed", f"inputs drawn with seed {seed}: rerun with BLOCKATTN_TEST_SEED={seed}"))
    return report


def make_offsets(lengths, device="cpu", dtype=torch.int32) -> torch.Tensor:
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=dtype, device=device)


def odd_lengths(block_size: int) -> list[int]:
    """0, 1, BS-1, BS, BS+1 and a few multi-block sequences, shuffled so no position is special."""
    lengths = [0, 1, block_size - 1, block_size, block_size + 1, 2 * block_size + 5, 0, 3]
    return [lengths[i] for i in torch.randperm(len(lengths)).tolist()]


def random_inputs(lengths, hq, hkv, d, dtype, device, offsets_dtype=torch.int32):
    offsets = make_offsets(lengths, device, offsets_dtype)
    n = sum(lengths)
    q = torch.randn(n, hq, d, dtype=dtype, device=device)
    k = torch.randn(n, hkv, d, dtype=dtype, device=device)
    v = torch.randn(n, hkv, d, dtype=dtype, device=device)
    do = torch.randn(n, hq, d, dtype=dtype, device=device)
    return q, k, v, do, offsets


def random_angles(num_tokens, head_dim, dtype=torch.float32, device="cpu"):
    """``sinu_pos = [sin | cos]`` of random angles, ``[N, D]``."""
    return reference.random_angles(num_tokens, head_dim, device).to(dtype)


def run_backend(name, q, k, v, do, offsets, block_size, sinu_pos=None, rotate=0, grads=None, in_block=PLAIN,
                forward=True, **options):
    """``(out, dq, dk, dv)`` of one backend's launchers (``backends.BACKENDS[name]``), bypassing the dispatcher,
    then the gradients of ``in_block``'s biases where it has them; ``options`` go to the backward launcher (the
    Triton kernels' tuning overrides). ``out`` is None where the backend has no forward or ``forward`` is False (a
    backward whose forward kernel does not take the call: the Hopper forward takes no in-block option, and a rotary
    only by angles TMA reads)."""
    backend = backends.BACKENDS[name]
    table = build_block_table(offsets, q.shape[0], block_size)
    rotate = rotate if sinu_pos is not None else 0
    out = (forward_of(name, q, k, v, offsets, block_size, sinu_pos, rotate, in_block, table)
           if backend.forward and forward else None)
    grads = grads or (tiles.new_output(q), tiles.new_output(k), tiles.new_output(v))
    bias_grads = backend.backward(do, q, k, v, offsets, table, block_size, 1.0 / math.sqrt(q.shape[-1]), sinu_pos,
                                  rotate, in_block, grads, **options)
    return (out, *grads, *(g for g in bias_grads if g is not None))


def uniform_batch(num_seqs, length, head_dim, dtype=torch.bfloat16):
    """``(n, offsets, randn)`` of ``num_seqs`` sequences of ``length`` tokens on the GPU; ``randn(h)``: a random
    ``[n, h, head_dim]`` tensor."""
    n = num_seqs * length
    offsets = torch.arange(0, n + 1, length, device="cuda")
    return n, offsets, lambda h: torch.randn(n, h, head_dim, device="cuda", dtype=dtype)


def dispatch_without(monkeypatch, name: str) -> None:
    """The dispatcher without backend ``name`` for one test. A copy of the table, not ``delitem``: undoing that
    would put the backend back last, and the dispatcher takes the first backend that takes a call."""
    monkeypatch.setattr(backends, "BACKENDS", {key: b for key, b in backends.BACKENDS.items() if key != name})


def forward_of(name, q, k, v, offsets, block_size, sinu_pos=None, rotate=0, in_block=PLAIN, table=None,
               fp8_scales=None):
    """One backend's forward launcher (``backends.BACKENDS[name]``), bypassing the dispatcher."""
    table = build_block_table(offsets, q.shape[0], block_size) if table is None else table
    return backends.BACKENDS[name].forward(q, k, v, offsets, table, block_size, 1.0 / math.sqrt(q.shape[-1]),
                                           sinu_pos, rotate, in_block, fp8_scales)


def run_kernels(q, k, v, do, offsets, block_size, sinu_pos=None, rotate=0, **options):
    """The Triton kernels (the interpreter without a GPU)."""
    return run_backend("triton", q, k, v, do, offsets, block_size, sinu_pos, rotate, **options)


def rotated_reference(leaves, sinu_pos, rotate, compute_dtype):
    """q, k, v turned by the reference rotary where ``rotate`` (a ROTATE_BITS mask) says, in ``compute_dtype``."""
    if sinu_pos is None:
        return leaves
    return [rotary_reference(t, sinu_pos, compute_dtype=compute_dtype) if rotate & ROTATE_BITS[name] else t
            for name, t in zip("qkv", leaves)]


def reference_grads(q, k, v, do, offsets, block_size, compute_dtype=torch.float64, sinu_pos=None, rotate=0,
                    in_block=PLAIN):
    """Reference output and (dq, dk, dv), then the gradients of ``in_block``'s biases where it has them, all in
    ``compute_dtype``; with ``sinu_pos``, of rotary then attention; under dropout with the kernels' mask."""
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    pos, time = (None if b is None else b.detach().to(compute_dtype).requires_grad_()
                 for b in (in_block.pos_bias, in_block.time_bias))

    def mask(start, length):
        keep = dropout_keep(in_block.seed, torch.tensor([start], device=q.device), q.shape[1], block_size,
                            in_block.dropout_p)
        return keep[0, :, :length, :length]

    out = block_attention_reference(*rotated_reference(leaves, sinu_pos, rotate, compute_dtype), offsets,
                                    block_size=block_size, causal=in_block.causal, pos_bias=pos,
                                    timestamps=in_block.timestamps, time_bias=time,
                                    time_bucket_width=in_block.bucket_width, dropout_p=in_block.dropout_p,
                                    dropout_mask=mask, compute_dtype=compute_dtype)
    inputs = leaves + [b for b in (pos, time) if b is not None]
    grads = (torch.autograd.grad(out, inputs, do.to(compute_dtype), allow_unused=True) if out.requires_grad
             else [None] * len(inputs))  # no tokens: the reference returns a constant
    return [out.detach(), *(torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs))]


def max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def rounding_allowance(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """One unit of ``dtype``'s rounding at the result's largest magnitude. Where PyTorch's own error is itself about
    one rounding (tiny head dims and blocks), twice it is no bound at all: a kernel that rounds its intermediates
    (P, dS) once more than PyTorch's composition of ops does is allowed that (docs/semantics.md, "Accuracy")."""
    return torch.finfo(dtype).eps * (ref.abs().max().item() if ref.numel() else 0.0)


def absolute_slack(dtype: torch.dtype) -> float:
    """An absolute allowance on top of the 2x rule: 1e-5 for the kernels' dtypes (where fp32 sums in another order
    differ at that level), 1e-12 for float64, whose "PyTorch's own error" is zero against the float64 reference."""
    return 1e-12 if dtype == torch.float64 else 1e-5


def assert_within_2x_pytorch(results, q, k, v, do, offsets, block_size, names=("out", "dq", "dk", "dv"),
                             sinu_pos=None, rotate=0, in_block=PLAIN):
    """Each result's max error vs float64 is at most 2x PyTorch's own in the inputs' precision, plus
    :func:`rounding_allowance` and :func:`absolute_slack`; the gradients of ``in_block``'s biases follow
    ``names``."""
    exact = reference_grads(q, k, v, do, offsets, block_size, sinu_pos=sinu_pos, rotate=rotate, in_block=in_block)
    same_precision = reference_grads(q, k, v, do, offsets, block_size, compute_dtype=q.dtype, sinu_pos=sinu_pos,
                                     rotate=rotate, in_block=in_block)
    names = [*names, *(n for n, b in (("dpos_bias", in_block.pos_bias), ("dtime_bias", in_block.time_bias))
                       if b is not None)]
    assert len(results) == len(exact) or len(names) == len(results) < len(exact)
    for name, got, ref, pt in zip(names, results, exact, same_precision):
        assert got.shape == ref.shape, name
        assert torch.isfinite(got).all(), f"{name}: non-finite values (unwritten or NaN)"
        err, pt_err = max_err(got, ref), max_err(pt, ref)
        bound = 2 * pt_err + rounding_allowance(ref, q.dtype) + absolute_slack(q.dtype)
        assert err <= bound, f"{name}: max error {err:.3e} > 2 x PyTorch's {pt_err:.3e} + one rounding"


def assert_eager_route_matches_the_ops(run, probe: torch.Tensor, monkeypatch) -> None:
    """``run()`` (a list of tensors) by the eager route (``custom_ops.eager_route``, which ``probe`` takes) and then
    through the custom ops alone give bitwise the same tensors."""
    from blockattn import custom_ops

    assert custom_ops.eager_route(probe)
    eager = run()
    monkeypatch.setattr(custom_ops, "eager_route", lambda *tensors: False)
    through_ops = run()
    assert len(through_ops) == len(eager)
    for got, want in zip(through_ops, eager):
        assert torch.equal(got, want)


def capture_cuda_graph(step):
    """A CUDA graph of ``step()`` (run once on a side stream first, so kernels compile outside the capture), and
    what the captured call returned."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Kernel outputs start as NaN, so any element a kernel fails to write shows up."""

    def new_output(like, shape=None, dtype=None):
        return torch.full(like.shape if shape is None else shape, float("nan"), dtype=dtype or like.dtype,
                          device=like.device)

    monkeypatch.setattr(tiles, "new_output", new_output)
