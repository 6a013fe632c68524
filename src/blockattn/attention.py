"""The public ``block_attention`` function: argument handling around the custom ops."""

from __future__ import annotations

import math

import torch

from . import checks, custom_ops


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor | None = None,
    *,
    block_size: int = 64,
    scale: float | None = None,
    sinu_pos: torch.Tensor | None = None,
    rotate: tuple[str, ...] = ("q", "k", "v"),
) -> torch.Tensor:
    """Block-diagonal attention on jagged sequences, optionally with a fused rotary embedding.

    Every sequence ``b`` (rows ``offsets[b]:offsets[b+1]``) is cut into blocks of ``block_size`` tokens from its
    first token; each token attends, bidirectionally, to the tokens of its own block only:
    ``out[i] = softmax(scale * q[i] @ K_block.T) @ V_block``.

    Args:
        q: ``[N, Hq, D]`` queries of all sequences packed back to back, or a ``torch.jagged`` nested tensor
            ``[B, j, Hq, D]`` (then ``k`` and ``v`` are nested too, ``offsets`` is taken from ``q``, and the result
            is a nested tensor with the same structure).
        k, v: ``[N, Hkv, D]`` with ``Hq % Hkv == 0``: query head ``h`` uses key/value head ``h // (Hq // Hkv)``.
        offsets: ``[B + 1]`` int32/int64, ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == N``, on the device
            of ``q``. Length-0 sequences are allowed.
        block_size: 16, 32, 64 or 128.
        scale: score scale, ``1 / sqrt(D)`` by default.
        sinu_pos: rotary angles ``[N, D]`` (or nested ``[B, j, D]`` like ``q``) shared by all heads: columns
            ``0 : D/2`` hold ``sin``, ``D/2 : D`` hold ``cos`` of the angle of pair ``i = (2i, 2i+1)`` (interleaved
            pairs, see :func:`blockattn.apply_rotary`). When given, the operands named in ``rotate`` are rotated
            inside the kernels as they are loaded: the result equals ``block_attention(apply_rotary(q, sinu_pos),
            ...)`` but the rotated tensors never reach memory, and the gradients are those of the unrotated
            inputs. ``sinu_pos`` is a constant: it gets no gradient (it must not require one).
        rotate: which of ``"q"``, ``"k"``, ``"v"`` to rotate (all three by default, as in the workload this
            comes from; standard RoPE is ``("q", "k")``). Ignored without ``sinu_pos``.

    ``D`` is a multiple of 8 in [16, 256]. On NVIDIA GPUs from Ampere on the Triton kernels run (on Hopper a
    Gluon kernel takes the backward of the production shape; ``python -m blockattn info`` lists the backends); fp16
    and bf16 multiply in their own precision with fp32 accumulation and an fp32 softmax; rotations are computed in
    fp32, the rotated operands rounded to the inputs' dtype, and gradients turned back in fp32 before their one
    store. float32 inputs are computed in true fp32 (no TF32). Elsewhere (the CPU, older GPUs) a PyTorch
    implementation of the same semantics runs in fp32, and float64 inputs are accepted on the CPU (for
    ``torch.autograd.gradcheck``). Meta tensors give the output's metadata. Gradients flow to ``q``, ``k`` and
    ``v``; the backward is deterministic. A NaN or inf in an input stays in its own block and head.

    Validation (docs/semantics.md): shapes, dtypes, devices and options raise ``TypeError``/``ValueError`` before any
    kernel runs; ``scale`` must be finite and positive.
    The values of ``offsets`` are checked with a ``ValueError`` on the CPU; on a GPU, reading them would stall the
    host, so they are checked by a device-side assertion that fails the next synchronising call, and the kernels
    never read or write outside ``[0, N)`` even for bad offsets.
    """
    nested = isinstance(q, torch.Tensor) and q.is_nested
    if nested:
        if offsets is not None:
            raise ValueError("offsets must be None when q, k, v are nested tensors (their offsets are used)")
        nested_q = q
        q, k, v, offsets = checks.unpack_nested(q, k, v)
    elif offsets is None:
        raise TypeError("offsets is required when q, k, v are [N, H, D] tensors")
    checks.attention(q, k, v, offsets, block_size, scale)
    sinu_pos, rotate = checks.rotary_args(sinu_pos, rotate, q, offsets)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out = custom_ops.block_attention_fwd(q, k, v, offsets, sinu_pos, block_size, scale, rotate)[0]
    if nested:
        return torch.nested.nested_tensor_from_jagged(out, offsets, min_seqlen=nested_q._maybe_min_seqlen,
                                                      max_seqlen=nested_q._maybe_max_seqlen)
    return out


def qkv_block_attention(
    x: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    sinu_pos: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    block_size: int = 64,
    scale: float | None = None,
    rotate: tuple[str, ...] = ("q", "k", "v"),
) -> torch.Tensor:
    """Projection, rotary and block attention: ``block_attention(q, k, v)`` with ``[q | k | v] = x @ w + bias``.

    The projection runs as one matmul into a packed ``qkv`` buffer ``[N, (Hq + 2 Hkv) * D]`` (columns: the ``Hq``
    query heads, then the ``Hkv`` key heads, then the ``Hkv`` value heads, each ``D`` wide); the attention
    kernels read ``q``, ``k``, ``v`` straight out of it through strides, rotating them in registers when
    ``sinu_pos`` is given. The backward writes ``dqkv`` in the same packed layout, in one buffer, from which
    autograd forms ``dx = dqkv @ w.T``, ``dw = x.T @ dqkv`` and ``dbias = dqkv.sum(0)``.

    Args:
        x: ``[N, d_model]`` tokens of all sequences packed back to back.
        w: ``[d_model, (num_heads + 2 * num_kv_heads) * D]``, the dtype and device of ``x``.
        offsets, block_size, scale, sinu_pos, rotate: as for :func:`block_attention` (``sinu_pos`` is ``[N, D]``
            and gets no gradient).
        num_heads, num_kv_heads: ``Hq`` and ``Hkv`` (``Hq % Hkv == 0``).
        bias: optional ``[(num_heads + 2 * num_kv_heads) * D]``.

    Returns ``[N, num_heads, D]``. Gradients flow to ``x``, ``w`` and ``bias``.
    """
    checks.projection(x, w, bias, num_heads, num_kv_heads)
    checks.tensor("offsets", offsets)
    # Check the attention arguments from shapes alone, before the projection runs: views of a zero-stride tensor.
    shapes = custom_ops.split_heads(x.new_empty(()).expand(x.shape[0], w.shape[1]), num_heads, num_kv_heads)
    checks.attention(*shapes, offsets, block_size, scale)
    sinu_pos, rotate = checks.rotary_args(sinu_pos, rotate, shapes[0], offsets)
    scale = 1.0 / math.sqrt(shapes[0].shape[-1]) if scale is None else float(scale)
    qkv = x @ w if bias is None else torch.addmm(bias, x, w)
    return custom_ops.qkv_block_attention_fwd(qkv, offsets, sinu_pos, num_heads, num_kv_heads, block_size, scale,
                                              rotate)[0]
