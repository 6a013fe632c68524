"""Which devices the Triton kernels run on: NVIDIA GPUs from Ampere on (float8 from Ada on). Elsewhere the PyTorch
path runs."""

from __future__ import annotations

import functools

import torch

# The Triton kernels use tensor-core products of Ampere and later (bf16, tf32).
MIN_CAPABILITY = (8, 0)
# fp8 tensor cores, and Triton's float8_e4m3fn: Ada (8.9) and later.
FP8_CAPABILITY = (8, 9)


@functools.cache
@torch.compiler.assume_constant_result  # traced code (the float8 projection's checks) gets it as a constant
def capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The GPU's multiprocessors: the grid of the persistent kernels."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def shared_memory_limit(device: torch.device) -> int:
    """Bytes of shared memory one program may take on ``device`` (the opt-in limit where the GPU has one)."""
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block


def kernels_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device``, or ``None`` where they can."""
    if device.type != "cuda":
        return f"needs a CUDA GPU, got {device.type}"
    if torch.version.hip is not None:
        return "needs an NVIDIA GPU (the kernels were never built for ROCm)"
    major, minor = capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return f"needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+ (Ampere), got {major}.{minor}"
    return None


def kernels_run_on(device: torch.device) -> bool:
    """Whether the Triton kernels (attention, the block table's, ``apply_rotary``'s) run on ``device``."""
    return kernels_reason(device) is None


def fp8_reason(device: torch.device) -> str | None:
    """Why float8_e4m3fn cannot run on ``device``, a GPU the kernels serve (no fp8 tensor cores, and Triton has no
    e4m3 type, before Ada), or None."""
    major, minor = capability(device)
    if (major, minor) < FP8_CAPABILITY:
        return (f"float8_e4m3fn needs a GPU with fp8 tensor cores (compute capability {FP8_CAPABILITY[0]}."
                f"{FP8_CAPABILITY[1]}+), this GPU has {major}.{minor}")
    return None
