"""The public ``apply_rotary``: argument checks around the ``blockattn::rotary`` custom op."""

from __future__ import annotations

import torch

from . import checks, custom_ops


def apply_rotary(x: torch.Tensor, sinu_pos: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding with interleaved pairs, for ``[N, H, D]`` tensors.

    ``sinu_pos`` is ``[N, D]`` per token, shared by all heads: columns ``0 : D/2`` hold ``sin_i``, columns
    ``D/2 : D`` hold ``cos_i``, the angle of pair ``i``. For ``i < D/2``::

        y[2i]   = x[2i]   * cos_i - x[2i+1] * sin_i
        y[2i+1] = x[2i+1] * cos_i + x[2i]   * sin_i

    Computed in fp32 (float64 for float64 inputs, CPU only) and returned in ``x``'s dtype (a Triton kernel on
    NVIDIA GPUs, PyTorch elsewhere). Differentiable in ``x``: the gradient is the rotation by the opposite angles
    (docs/semantics.md, "Rotary"). ``sinu_pos`` is a constant and gets no gradient (it must not require one).
    ``D`` must be even, at most 512; ``sinu_pos`` may be float16, bfloat16 or float32 (float64 on the CPU).
    To fuse the rotation into attention instead, pass ``sinu_pos`` to :func:`blockattn.block_attention`.
    """
    checks.no_func_derivatives("apply_rotary", x, sinu_pos)
    checks.rotary_input(x, sinu_pos)
    return custom_ops.rotary(x, sinu_pos, False)
