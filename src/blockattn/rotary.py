"""The public ``apply_rotary``: argument checks around the ``blockattn::rotary`` custom op."""

from __future__ import annotations

import torch

from . import custom_ops
from .layout import GPU_DTYPES, validate_sinu_pos

# One program holds whole rows of a head.
MAX_ROTARY_DIM = 512


def apply_rotary(x: torch.Tensor, sinu_pos: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding with interleaved pairs, for ``[N, H, D]`` tensors.

    ``sinu_pos`` is ``[N, D]`` per token, shared by all heads: columns ``0 : D/2`` hold ``sin_i``, columns
    ``D/2 : D`` hold ``cos_i``, the angle of pair ``i``. For ``i < D/2``::

        y[2i]   = x[2i]   * cos_i - x[2i+1] * sin_i
        y[2i+1] = x[2i+1] * cos_i + x[2i]   * sin_i

    Computed in fp32 and returned in ``x``'s dtype (a Triton kernel on CUDA, PyTorch on the CPU). Differentiable
    in ``x``: the gradient is the rotation by the opposite angles. ``sinu_pos`` is a constant and gets no
    gradient (it must not require one). ``D`` must be even, at most 512; ``sinu_pos`` may be float16, bfloat16 or float32.
    To fuse the rotation into attention instead, pass ``sinu_pos`` to :func:`blockattn.block_attention`.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"x must be 3-D [N, heads, head_dim], got shape {tuple(x.shape)}")
    if x.dtype not in GPU_DTYPES:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.shape[-1] % 2 or not 2 <= x.shape[-1] <= MAX_ROTARY_DIM:
        raise ValueError(f"head_dim must be even (pairs of columns turn together) and in [2, {MAX_ROTARY_DIM}], "
                         f"got {x.shape[-1]}")
    validate_sinu_pos(sinu_pos, x, "x")
    return custom_ops.rotary(x, sinu_pos, False)
