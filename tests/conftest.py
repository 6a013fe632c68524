"""Shared test helpers. Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton.jit decorates the kernels, i.e. before blockattn is imported.
    os.environ["TRITON_INTERPRET"] = "1"

import math

import pytest

from blockattn.layout import ROTATE_BITS
from blockattn.ops import tiles
from blockattn.reference import block_attention_reference, rotary_reference

HAS_GPU = torch.cuda.is_available()
KERNEL_DEVICE = "cuda" if HAS_GPU else "cpu"
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")


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
    theta = torch.rand(num_tokens, head_dim // 2, device=device) * 2 * math.pi
    return torch.cat([theta.sin(), theta.cos()], dim=1).to(dtype)


def rotated_reference(leaves, sinu_pos, rotate, compute_dtype):
    """q, k, v turned by the reference rotary where ``rotate`` (a ROTATE_BITS mask) says, in ``compute_dtype``."""
    if sinu_pos is None:
        return leaves
    return [rotary_reference(t, sinu_pos, compute_dtype=compute_dtype) if rotate & ROTATE_BITS[name] else t
            for name, t in zip("qkv", leaves)]


def reference_grads(q, k, v, do, offsets, block_size, compute_dtype=torch.float64, sinu_pos=None, rotate=0):
    """Reference output and (dq, dk, dv), all in ``compute_dtype``; with ``sinu_pos``, of rotary then attention."""
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    out = block_attention_reference(*rotated_reference(leaves, sinu_pos, rotate, compute_dtype), offsets,
                                    block_size=block_size, compute_dtype=compute_dtype)
    grads = torch.autograd.grad(out, leaves, do.to(compute_dtype)) if out.numel() else [t * 0 for t in leaves]
    return [out.detach(), *grads]


def max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def snr_db(out, ref) -> float:
    noise = (out.double() - ref.double()).pow(2).sum().item()
    return 10 * math.log10(ref.double().pow(2).sum().item() / max(noise, 1e-300))


def assert_within_2x_pytorch(results, q, k, v, do, offsets, block_size, names=("out", "dq", "dk", "dv"),
                             sinu_pos=None, rotate=0):
    """SPEC §5: each result's max error vs float64 is at most 2x PyTorch's own in the inputs' precision."""
    exact = reference_grads(q, k, v, do, offsets, block_size, sinu_pos=sinu_pos, rotate=rotate)
    same_precision = reference_grads(q, k, v, do, offsets, block_size, compute_dtype=q.dtype, sinu_pos=sinu_pos,
                                     rotate=rotate)
    for name, got, ref, pt in zip(names, results, exact, same_precision):
        assert got.shape == ref.shape, name
        assert torch.isfinite(got).all(), f"{name}: non-finite values (unwritten or NaN)"
        err, pt_err = max_err(got, ref), max_err(pt, ref)
        assert err <= 2 * pt_err + 1e-5, f"{name}: max error {err:.3e} > 2 x PyTorch's {pt_err:.3e}"


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Kernel outputs start as NaN, so any element a kernel fails to write shows up."""

    def new_output(like):
        return torch.full_like(like, float("nan"))

    monkeypatch.setattr(tiles, "new_output", new_output)
