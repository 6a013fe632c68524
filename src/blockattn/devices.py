"""Which devices the Triton kernels run on: NVIDIA GPUs from Ampere on. Elsewhere the PyTorch path runs."""

from __future__ import annotations

import functools

import torch

# The Triton kernels use tensor-core products of Ampere and later (bf16, tf32).
MIN_CAPABILITY = (8, 0)


@functools.cache
def capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


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
    """Whether the Triton kernels (attention, the block table's scan, ``apply_rotary``'s kernel) run on ``device``."""
    return kernels_reason(device) is None
