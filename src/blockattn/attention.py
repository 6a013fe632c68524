"""The public ``block_attention`` function: argument handling around the custom ops."""

from __future__ import annotations

import math

import torch

from . import checks, custom_ops, devices
from .block_table import BlockLayout, BlockTable
from .call_cache import CallCache
from .ops import fp8

_BLOCK_ATTENTION_CALLS = CallCache(custom_ops.block_attention_replay)
_QKV_BLOCK_ATTENTION_CALLS = CallCache(custom_ops.qkv_block_attention_replay, autocast=True)


def block_layout(offsets: torch.Tensor, num_tokens: int, block_size: int = checks.DEFAULT_BLOCK_SIZE, *,
                 timestamps: torch.Tensor | None = None, num_time_buckets: int | None = None,
                 time_bucket_width: float | None = None) -> BlockLayout:
    """The block structure of one batch, to pass in place of ``offsets`` to every attention call on it.

    A model with many attention layers, or a serving loop that runs one batch through several calls, builds it once
    per batch: each call then skips building the block table (the offsets' checks and a GPU launch), as
    FlexAttention's ``BlockMask`` is built once and reused. (An eager call on up to 64 sequences and 2^22 query
    elements needs none where its kernels find their blocks in the offsets: the Triton forward, the Triton
    backward's one-block kernel and the Hopper backward without GQA, one block a program.) The values of
    ``offsets`` are checked here, as a call checks them (a ``ValueError`` on the CPU, a device-side assertion on a
    GPU: no host synchronisation).

    With ``timestamps`` the layout also holds the batch's time buckets: every pair of tokens of a block, bucketed
    once (one kernel, ``N * block_size`` bytes) where the kernels run, instead of in every call's forward (at the
    ``ads`` workload on an H100 that table takes 0.13 ms, 6% of the plain forward; a call's backward reads its
    forward's). Calls with a ``time_bias`` then take the layout's timestamps and width (leave theirs out) and need
    ``time_bias.shape[1] == num_time_buckets``; the layers of a model share the timestamps and each has its own
    ``time_bias``.

    Args:
        offsets: ``[B + 1]`` int32/int64 sequence boundaries, as for :func:`block_attention`.
        num_tokens: ``N``, the number of packed tokens (``q.shape[0]``; a shape, so nothing is read on the host).
        block_size: 16, 32, 64 or 128; the attention calls take the layout's (their own ``block_size`` left out).
        timestamps: ``[N]`` int64, int32 or float32 on the device of ``offsets``, as for :func:`block_attention`;
            with ``num_time_buckets``, the time bias's number of buckets, and ``time_bucket_width`` (0.301 by
            default; only with timestamps).

    Works under ``torch.compile`` (built inside the compiled model or passed into it; opaque ops, dynamic shapes
    included) and CUDA-graph capture like the calls themselves.
    """
    num_tokens, block_size = checks.layout(offsets, num_tokens, block_size)
    offsets = checks.contiguous_offsets(offsets)
    num_time_buckets, width = checks.layout_times(timestamps, num_time_buckets, time_bucket_width, offsets,
                                                  num_tokens)
    table = BlockTable(*custom_ops.block_table(offsets, num_tokens, block_size))
    if timestamps is None:
        return BlockLayout(offsets, num_tokens, block_size, table)
    buckets = (custom_ops.time_bucket_table(offsets, *table, timestamps, num_time_buckets, width, block_size)
               if devices.kernels_run_on(offsets.device) else None)
    return BlockLayout(offsets, num_tokens, block_size, table, timestamps, num_time_buckets, width, buckets)


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor | BlockLayout | None = None,
    *,
    block_size: int | None = None,
    scale: float | None = None,
    sinu_pos: torch.Tensor | None = None,
    rotate: tuple[str, ...] = ("q", "k", "v"),
    causal: bool = False,
    pos_bias: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None,
    time_bias: torch.Tensor | None = None,
    time_bucket_width: float | None = None,
    dropout_p: float = 0.0,
    out_dtype: torch.dtype | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block-diagonal attention on jagged sequences, optionally with a fused rotary embedding and what
    recommendation models put inside a block (a causal mask, relative position and time biases, dropout).

    Every sequence ``b`` (rows ``offsets[b]:offsets[b+1]``) is cut into blocks of ``block_size`` tokens from its
    first token; each token attends, bidirectionally, to the tokens of its own block only:
    ``out[i] = softmax(scale * q[i] @ K_block.T) @ V_block``.

    Args:
        q: ``[N, Hq, D]`` queries of all sequences packed back to back, or a ``torch.jagged`` nested tensor
            ``[B, j, Hq, D]`` (then ``k`` and ``v`` are nested too, ``offsets`` is taken from ``q``, and the result
            is a nested tensor with the same structure).
        k, v: ``[N, Hkv, D]`` with ``Hq % Hkv == 0``: query head ``h`` uses key/value head ``h // (Hq // Hkv)``.
        offsets: ``[B + 1]`` int32/int64, ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == N``, on the device
            of ``q``. Length-0 sequences are allowed. Or a :class:`BlockLayout` of them (:func:`block_layout`),
            built once per batch and reused by every call on it.
        block_size: 16, 32, 64 or 128; 64 by default, or the layout's.
        scale: score scale, ``1 / sqrt(D)`` by default.
        sinu_pos: rotary angles ``[N, D]`` (or nested ``[B, j, D]`` like ``q``) shared by all heads: columns
            ``0 : D/2`` hold ``sin``, ``D/2 : D`` hold ``cos`` of the angle of pair ``i = (2i, 2i+1)`` (interleaved
            pairs, see :func:`blockattn.apply_rotary`). When given, the operands named in ``rotate`` are rotated
            inside the kernels as they are loaded: the result equals ``block_attention(apply_rotary(q, sinu_pos),
            ...)`` but the rotated tensors never reach memory (except in one backward, below), and the gradients
            are those of the unrotated inputs. ``sinu_pos`` is a constant: it gets no gradient (it must not require
            one).
        rotate: which of ``"q"``, ``"k"``, ``"v"`` to rotate, a tuple (or list, set) naming each at most once
            (all three by default, as in the workload this comes from; standard RoPE is ``("q", "k")``). Checked
            always; without ``sinu_pos`` nothing is rotated.
        causal: within each block, query ``i`` sees keys ``j <= i`` only (positions inside the block).
        pos_bias: learnable relative position bias ``[Hq, 2 * block_size - 1]`` (float32 or the inputs' dtype):
            ``scale * q_i . k_j + pos_bias[h, j - i + block_size - 1]``.
        timestamps, time_bias: ``timestamps [N]`` (int64, int32 or float32, e.g. seconds; nested ``[B, j]`` like
            ``q`` too) and a learnable ``time_bias [Hq, num_buckets]``: adds ``time_bias[h, bucket(t_j - t_i)]``
            with ``bucket(dt) = min(num_buckets - 1, floor(ln(max(|dt|, 1)) / time_bucket_width))``, ``|dt|``
            rounded to fp32 (``time_bucket_width >= 0.001``, 0.301 by default, given only with a time bias).
            ``timestamps`` get no gradient.
            A layout built with timestamps (:func:`block_layout`) passed as ``offsets`` gives its own: leave
            ``timestamps`` and ``time_bucket_width`` out.
        dropout_p: dropout on the probabilities (after the softmax, kept ones scaled by ``1 / (1 - p)``), from a
            counter-based generator in the kernels seeded by ``torch``'s generator: reproducible from
            ``torch.manual_seed``, a new mask at each call and each CUDA-graph replay, the backward using the
            forward's mask (recomputed, never stored). In ``[0, 1)``; 0 is exactly the op without dropout. Pass
            ``0.0`` in evaluation (this function does not know about ``module.eval()``).
        out_dtype, q_descale, k_descale, v_descale, out_scale: float8 inference. With ``float8_e4m3fn`` q, k, v,
            the three descales are required (1-element float32 tensors on the inputs' device, read on the device:
            the result is that of the dequantised inputs ``q * q_descale`` etc.); ``out_dtype`` is bfloat16 by
            default, or float16, float32 or float8_e4m3fn, which needs ``out_scale`` (the output is the fp8 tensor
            times it; values beyond e4m3's range saturate). Forward only (no input may require grad). The kernels
            widen the fp8 inputs to fp16 in registers: 16-bit products on half the bytes.

    Biases are added to the scaled scores before the softmax; under ``causal`` masked pairs get neither bias nor
    gradient. The biases' gradients are deterministic (per-block partial sums, added in a fixed order).

    ``D`` is a multiple of 8 in [16, 256]. On NVIDIA GPUs from Ampere on the Triton kernels run (on Hopper a
    Gluon kernel takes the backward of the production shape; ``python -m blockattn info`` lists the backends); fp16
    and bf16 multiply in their own precision with fp32 accumulation and an fp32 softmax; rotations are computed in
    fp32, the rotated operands rounded to the inputs' dtype, and gradients turned back in fp32 before their one
    store (at 128-token blocks past D = 128 under GQA, stored first and turned back after, as an unfused rotary's
    backward does: docs/semantics.md). float32 inputs are computed in true fp32 (no TF32). Elsewhere (the CPU,
    older GPUs) a PyTorch implementation of the same semantics runs in fp32, and float64 inputs are accepted on the
    CPU (for ``torch.autograd.gradcheck``). Meta tensors give the output's metadata. Gradients flow to ``q``, ``k``
    and ``v``; the backward is deterministic. A NaN or inf in an input stays in its own block and head.

    Validation (docs/semantics.md): shapes, dtypes, devices and options raise ``TypeError``/``ValueError`` before any
    kernel runs; ``scale`` must be finite and positive.
    The values of ``offsets`` are checked with a ``ValueError`` on the CPU; on a GPU, reading them would stall the
    host, so they are checked by a device-side assertion that fails the next synchronising call, and the kernels
    never read or write outside ``[0, N)`` even for bad offsets.
    """
    args = (q, k, v, *_signed(offsets), block_size, scale, sinu_pos, rotate, causal, pos_bias, timestamps, time_bias,
            time_bucket_width, dropout_p, out_dtype, q_descale, k_descale, v_descale, out_scale)
    key, replay = _BLOCK_ATTENTION_CALLS.lookup(args)
    if replay is not None:
        return replay(args)
    checks.no_func_derivatives("block_attention", q, k, v, sinu_pos, pos_bias, time_bias)
    nested = isinstance(q, torch.Tensor) and q.is_nested
    if nested:
        if offsets is not None:
            raise ValueError("offsets must be None when q, k, v are nested tensors (their offsets are used)")
        nested_q = q
        q, k, v, offsets = checks.unpack_nested(q, k, v)
    elif offsets is None:
        raise TypeError("offsets is required when q, k, v are [N, H, D] tensors")
    layout = offsets
    offsets, block_size, table = checks.block_structure(offsets, checks.num_tokens(q), block_size)
    timestamps, time_bucket_width, time_buckets = checks.layout_time_bias(layout, timestamps, time_bias,
                                                                          time_bucket_width)
    sinu_pos = checks.jagged_values("sinu_pos", sinu_pos, offsets, "[B, j, D]")
    timestamps = checks.jagged_values("timestamps", timestamps, offsets, "[B, j]")
    checks.block_attention_call(q, k, v, offsets, block_size, scale, sinu_pos, rotate, causal, pos_bias, timestamps,
                                time_bias, time_bucket_width, dropout_p, out_dtype, q_descale, k_descale, v_descale,
                                out_scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    block_size = checks.plain(block_size)
    inputs = (q, k, v, offsets, sinu_pos, block_size, scale, checks.rotate_bits(rotate, sinu_pos), causal, pos_bias,
              timestamps, time_bias, float(time_bucket_width), float(dropout_p), _dropout_seed(dropout_p, q.device),
              *_table_args(table), q_descale, k_descale, v_descale, out_scale, fp8.out_dtype_of(q.dtype, out_dtype),
              time_buckets)
    out = custom_ops.block_attention(*inputs)
    _BLOCK_ATTENTION_CALLS.learn(key, args, inputs)
    if nested:
        # q's own offsets (not their contiguous copy, where they are strided): the result has q's structure
        return torch.nested.nested_tensor_from_jagged(out, nested_q.offsets(),
                                                      min_seqlen=nested_q._maybe_min_seqlen,
                                                      max_seqlen=nested_q._maybe_max_seqlen)
    return out


def qkv_block_attention(
    x: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor | BlockLayout,
    *,
    num_heads: int,
    num_kv_heads: int,
    sinu_pos: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    block_size: int | None = None,
    scale: float | None = None,
    rotate: tuple[str, ...] = ("q", "k", "v"),
    causal: bool = False,
    pos_bias: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None,
    time_bias: torch.Tensor | None = None,
    time_bucket_width: float | None = None,
    dropout_p: float = 0.0,
    x_descale: torch.Tensor | None = None,
    w_descale: torch.Tensor | None = None,
    qkv_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out_scale: torch.Tensor | None = None,
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
        offsets, block_size, scale, sinu_pos, rotate, causal, pos_bias, timestamps, time_bias, time_bucket_width,
            dropout_p: as for :func:`block_attention` (``sinu_pos`` is ``[N, D]`` and gets no gradient).
        num_heads, num_kv_heads: ``Hq`` and ``Hkv`` (``Hq % Hkv == 0``).
        bias: optional ``[(num_heads + 2 * num_kv_heads) * D]``.
        x_descale, w_descale, qkv_scale, out_dtype, out_scale: float8 inference. With ``float8_e4m3fn`` ``x`` and
            ``w`` (and a float32, bfloat16 or float16 ``bias``), the projection is that of the dequantised inputs
            ``x * x_descale``, ``w * w_descale``, quantised as ``qkv / qkv_scale`` to e4m3 (saturated); the
            attention then runs on the fp8 q, k, v with ``qkv_scale`` as their descale, as
            :func:`block_attention`'s float8 forward (``out_dtype``, ``out_scale`` as there). The three scales
            are required, 1-element float32 tensors on the device. On GPUs with fp8 tensor cores the projection is
            one fp8 matmul (``torch._scaled_mm``) when ``w`` is column-major (``linear.weight.t()``) and
            ``d_model`` and its width are multiples of 16; otherwise it runs in float32 on the dequantised
            operands. Forward only: nothing may require grad.

    Returns ``[N, num_heads, D]``. Gradients flow to ``x``, ``w``, ``bias`` and the attention biases.
    """
    args = (x, w, *_signed(offsets), num_heads, num_kv_heads, sinu_pos, bias, block_size, scale, rotate, causal,
            pos_bias, timestamps, time_bias, time_bucket_width, dropout_p, x_descale, w_descale, qkv_scale, out_dtype,
            out_scale)
    key, replay = _QKV_BLOCK_ATTENTION_CALLS.lookup(args)
    if replay is not None:  # not fp8: its q, k, v are no arguments, so such a call is never learned
        return replay((*args, _projection(x, w, bias)))
    checks.no_func_derivatives("qkv_block_attention", x, w, bias, sinu_pos, pos_bias, time_bias)
    layout = offsets
    offsets, block_size, table = checks.block_structure(offsets, checks.num_tokens(x), block_size)
    timestamps, time_bucket_width, time_buckets = checks.layout_time_bias(layout, timestamps, time_bias,
                                                                          time_bucket_width)
    sinu_pos = checks.jagged_values("sinu_pos", sinu_pos, offsets, "[B, j, D]")
    timestamps = checks.jagged_values("timestamps", timestamps, offsets, "[B, j]")
    checks.qkv_block_attention_call(x, w, bias, num_heads, num_kv_heads, offsets, block_size, scale, sinu_pos, rotate,
                                    causal, pos_bias, timestamps, time_bias, time_bucket_width, dropout_p, x_descale,
                                    w_descale, qkv_scale, out_dtype, out_scale)
    num_heads, num_kv_heads, block_size = map(checks.plain, (num_heads, num_kv_heads, block_size))
    head_dim = custom_ops.packed_head_dim(w, num_heads, num_kv_heads)  # w's columns are those of the projection
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    rotate = checks.rotate_bits(rotate, sinu_pos)
    options = (causal, pos_bias, timestamps, time_bias, float(time_bucket_width), float(dropout_p),
               _dropout_seed(dropout_p, x.device), *_table_args(table))
    if x.dtype == checks.FP8_DTYPE:
        qkv = fp8.projection(x, w, bias, x_descale, w_descale, qkv_scale)
        return custom_ops.block_attention(*custom_ops.split_heads(qkv, num_heads, num_kv_heads), offsets, sinu_pos,
                                          block_size, scale, rotate, *options, qkv_scale, qkv_scale, qkv_scale,
                                          out_scale, fp8.out_dtype_of(x.dtype, out_dtype), time_buckets)
    qkv = _projection(x, w, bias)
    inputs = (qkv, offsets, sinu_pos, num_heads, num_kv_heads, block_size, scale, rotate, *options, time_buckets)
    out = custom_ops.qkv_block_attention(*inputs)
    _QKV_BLOCK_ATTENTION_CALLS.learn(key, (*args, qkv), inputs)
    return out


def _projection(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The packed ``qkv`` of 16-bit or fp32 inputs (in the dtype CUDA autocast picks, where it is on)."""
    return x @ w if bias is None else torch.addmm(bias, x, w)


def _signed(offsets) -> tuple:
    """``offsets`` as it enters a call's signature (``call_cache``): a layout's fields, its table's two tensors among
    them, else ``offsets`` itself. A layout whose table is no tuple gets an unhashable stand-in: no signature."""
    if not isinstance(offsets, BlockLayout):
        return (offsets,)
    if not isinstance(offsets.table, tuple):
        return (offsets.offsets, [])
    return (*offsets[:3], *offsets.table, *offsets[4:])


def _table_args(table) -> tuple:
    """The ops' ``block_cum, block_seq``: a layout's table, or ``None, None`` (the op builds its own)."""
    return (None, None) if table is None else tuple(table)


def _dropout_seed(dropout_p: float, device: torch.device) -> torch.Tensor | None:
    """The kernels' dropout seed: one int64 from torch's generator for ``device``, drawn on the device (no host
    copy; a CUDA graph replays the draw, so each replay has its own mask)."""
    if dropout_p == 0:
        return None
    return torch.randint(2**62, (1,), dtype=torch.int64, device=device)
