"""``torch.library`` custom ops: autograd, fake (meta) implementations and FLOP formulas, around the dispatcher.

The ops are opaque to ``torch.compile`` (one node each, no graph break) and their fake implementations give the
output metadata without running anything (``torch.compile``, meta tensors). In eager mode the public functions
take a shorter route to the same implementations (:func:`eager_route`): a ``torch.autograd.Function`` that calls
them directly (or a direct call where nothing needs a gradient, and for the forward-only flash op), since the
custom op's dispatch and autograd wrapper cost more host time than the kernels of a small batch. The attention ops'
implementations are :func:`ops.plans.planned`: on a GPU, a repeated call signature replays the recorded
allocations and launches instead of running the dispatcher and launchers again; a repeated public call goes
straight to that replay (``call_cache``, through :func:`block_attention_replay` and its siblings). Each attention op
asks ``backends.select`` which backend runs it; the rotary op runs its Triton kernel where
``devices.kernels_run_on`` says the kernels run, else PyTorch. The forwards also return the block table they
built, so that the backwards reuse it instead of building it again; an eager call whose kernel finds its blocks in
the offsets builds none (``Backend.finds_blocks``): its forward saves none, and its backward builds one unless its
kernel finds its blocks too.

Three families: ``rotary`` (``apply_rotary``), ``block_attention_*`` on separate ``q, k, v`` and
``qkv_block_attention_*`` on one packed ``[N, (Hq + 2 Hkv) * D]`` projection, whose backward writes the packed
gradient in one buffer. ``rotate`` is a mask of ``ops.tiles.ROTATE_BITS``; ``sinu_pos`` gets no gradient. The
attention ops end with the in-block options (``ops.in_block``: ``causal, pos_bias, timestamps, time_bias,
time_bucket_width, dropout_p, dropout_seed``); their backwards also return the biases' gradients (0-element
tensors for absent biases: an op's outputs cannot be None).
"""

from __future__ import annotations

import functools
import operator

import torch
from torch.utils.flop_counter import register_flop_formula

from . import backends
from .backends import FLASH_BACKENDS, AttentionCall, FlashCall
from .block_table import BlockTable, OffsetsOnly, build_block_table, check_offsets, empty_block_table, max_blocks
from .devices import kernels_run_on
from .ops import fp8, in_block, tiles
from .ops.block_attention_torch import rotary_torch
from .ops.fp8 import Fp8Scales
from .ops.in_block import DEFAULT_BUCKET_WIDTH, InBlock
from .ops.plans import Plan, current_device, planned
from .ops.rotary import rotary_triton
from .ops.tiles import ROTATE_NONE
from .signatures import TENSORS


@torch.library.custom_op("blockattn::rotary", mutates_args=())
def rotary(x: torch.Tensor, sinu_pos: torch.Tensor, inverse: bool) -> torch.Tensor:
    run = rotary_triton if kernels_run_on(x.device) else rotary_torch
    return run(x, sinu_pos, inverse)


@rotary.register_fake
def _(x, sinu_pos, inverse):
    return torch.empty_like(x)


def _rotary_setup_context(ctx, inputs, output):
    _, sinu_pos, inverse = inputs
    ctx.save_for_backward(sinu_pos)
    ctx.inverse = inverse


def _rotary_backward(ctx, grad):
    (sinu_pos,) = ctx.saved_tensors
    return rotary(grad, sinu_pos, not ctx.inverse), None, None  # a rotation's adjoint is the opposite rotation


rotary.register_autograd(_rotary_backward, setup_context=_rotary_setup_context)


def packed_head_dim(qkv, num_heads, num_kv_heads) -> int:
    return qkv.shape[1] // (num_heads + 2 * num_kv_heads)


def split_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, ...]:
    """Views ``q [N, Hq, D]``, ``k, v [N, Hkv, D]`` of a packed ``[N, (Hq + 2 Hkv) * D]`` projection (no copy)."""
    heads = qkv.view(qkv.shape[0], num_heads + 2 * num_kv_heads, packed_head_dim(qkv, num_heads, num_kv_heads))
    return heads[:, :num_heads], heads[:, num_heads:num_heads + num_kv_heads], heads[:, num_heads + num_kv_heads:]


def _rotate_mask(sinu_pos, rotate: int) -> int:
    """Nothing is rotated without angles: the launchers may then take ``rotate`` at its word."""
    return rotate if sinu_pos is not None else ROTATE_NONE


def _forward(q, k, v, offsets, sinu_pos, block_size, scale, rotate, options: InBlock, block_cum, block_seq,
             fp8_scales: Fp8Scales | None = None) -> tuple[torch.Tensor, BlockTable | None, torch.Tensor | None]:
    """``(out, table, buckets)``: the forward by the backend the dispatcher picks, on the table :func:`_call_table`
    gives, which it returns (``table``) for the backward where it built it here (else None); and the time buckets'
    table where :func:`_builds_buckets` (else ``buckets`` is None). Only the eager route passes no table: the forward
    op's outputs hold one (:func:`_op_table`)."""
    rotate = _rotate_mask(sinu_pos, rotate)
    call = AttentionCall.of("fwd", q, k, block_size, rotate, options.bits, tensors=(q, k, v),
                            angles=sinu_pos if rotate else None)
    backend = backends.select(call)
    table = _call_table(backend, call, offsets, q.shape[0], block_size, block_cum, block_seq)
    built = table if block_cum is None and isinstance(table, BlockTable) else None
    buckets = None
    if _builds_buckets(q, options.time_bias, options.buckets):
        buckets = in_block.call_buckets(options, offsets, table, block_size)
        options = options._replace(buckets=buckets)
    out = backend.forward(q, k, v, offsets, table, block_size, scale, sinu_pos, rotate, options, fp8_scales)
    return out, built, buckets


def _call_table(backend: backends.Backend, call: AttentionCall, offsets: torch.Tensor, num_tokens: int,
                block_size: int, block_cum: torch.Tensor | None,
                block_seq: torch.Tensor | None) -> BlockTable | OffsetsOnly:
    """The table a call runs on: the one given (a layout's, the forward op's, or the one its forward built for a
    backward), else none where the backend's kernel finds its blocks in the offsets (``Backend.finds_blocks``), else
    one built here."""
    if block_cum is not None:
        return BlockTable(block_cum, block_seq)
    num_seqs = offsets.shape[0] - 1
    if backend.finds_blocks is not None and backend.finds_blocks(call, num_seqs, num_tokens):
        return OffsetsOnly(max_blocks(num_tokens, num_seqs, block_size))
    return build_block_table(offsets, num_tokens, block_size)


def _builds_buckets(q: torch.Tensor, time_bias: torch.Tensor | None, time_buckets: torch.Tensor | None) -> bool:
    """Whether a forward builds the time buckets' table (and returns it, for its backward to read): with a time
    bias, on a device the kernels serve, unless a layout's table was given. (The PyTorch path, where it runs there,
    leaves it unread.)"""
    return time_bias is not None and time_buckets is None and kernels_run_on(q.device)


def _op_outputs(out: torch.Tensor, built: BlockTable | None, buckets: torch.Tensor | None,
                offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A forward op's outputs ``(out, *table, buckets)``: 0-element tensors stand for a table it did not build (a
    layout's table was passed in, or no time buckets were needed; an op's outputs can be neither None nor its
    inputs). The eager route keeps ``(out, built, buckets)``."""
    return out, *(_no_table(offsets) if built is None else built), _no_buckets(offsets) if buckets is None else buckets


def _no_buckets(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0, dtype=torch.uint8)


def _buckets_fake(q: torch.Tensor, time_bias, time_buckets, block_size: int) -> torch.Tensor:
    if not _builds_buckets(q, time_bias, time_buckets):
        return _no_buckets(q)
    return q.new_empty(q.shape[0], block_size, dtype=in_block.bucket_dtype(time_bias.shape[1], block_size))


def _saved_buckets(input_buckets: torch.Tensor | None, output_buckets: torch.Tensor | None) -> torch.Tensor | None:
    """The time buckets' table the backward reads: the one the forward built (a 0-element output where it built
    none), else the layout's (inputs), else None (the backward builds its own)."""
    return output_buckets if output_buckets is not None and output_buckets.numel() else input_buckets


# The forward ops' table, built before their implementation runs (which, given none, might build none), so that
# they return it as their fakes say; planned, as the table's steps were in the forward's plan.
_op_table = planned(build_block_table)


def _no_table(offsets: torch.Tensor) -> BlockTable:
    return BlockTable(offsets.new_empty(0, dtype=torch.int32), offsets.new_empty(0, dtype=torch.int32))


def _fwd_table_fakes(offsets, num_tokens, block_size, block_cum) -> BlockTable:
    return empty_block_table(offsets, num_tokens, block_size) if block_cum is None else _no_table(offsets)


def _saved_table(inputs_table: tuple, output_table: tuple | None) -> tuple:
    """The table the backward reads: the layout's (inputs) where one was given, else the one the forward built, else
    ``(None, None)``: the forward ran without one (its kernel checked the offsets), and the backward runs on one of
    its own (:func:`_call_table`)."""
    if inputs_table[0] is not None:
        return inputs_table
    return (None, None) if output_table is None else output_table


def _backward(grad_out, q, k, v, offsets, sinu_pos, block_cum, block_seq, block_size, scale, rotate,
              options: InBlock, grads):
    """Write ``(dq, dk, dv)`` into ``grads`` by the backend the dispatcher picks, on the saved table
    (:func:`_saved_table`) or as :func:`_call_table` says; return the biases' gradients (None for absent biases)."""
    rotate = _rotate_mask(sinu_pos, rotate)
    call = AttentionCall.of("bwd", q, k, block_size, rotate, options.bits, tensors=(q, k, v, grad_out), grads=grads)
    backend = backends.select(call)
    table = _call_table(backend, call, offsets, q.shape[0], block_size, block_cum, block_seq)
    return backend.backward(grad_out, q, k, v, offsets, table, block_size, scale, sinu_pos, rotate, options, grads)


def _op_grads(grads: tuple, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A backward op's outputs: 0-element tensors for the absent biases' gradients (an op's output cannot be
    None). The eager route keeps the Nones."""
    return tuple(like.new_empty(0) if g is None else g for g in grads)


def _bias_grad_fakes(q, pos_bias, time_bias) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(q.new_empty(0) if b is None else torch.empty_like(b) for b in (pos_bias, time_bias))


def _bias_grads_out(grads: tuple, options: tuple) -> tuple:
    """The autograd results of the option inputs (``causal, pos_bias, timestamps, time_bias, width, p, seed``)."""
    dpos, dtime = grads
    return (None, dpos if options[1] is not None else None, None, dtime if options[3] is not None else None, None,
            None, None)


@torch.library.custom_op("blockattn::block_table", mutates_args=())
def block_table(offsets: torch.Tensor, num_tokens: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block_cum, block_seq)`` of ``offsets``, checked (``block_table.build_block_table``): what
    ``blockattn.block_layout`` keeps, as one opaque op so that it can be built inside a compiled model too."""
    return tuple(build_block_table(offsets, num_tokens, block_size))


@block_table.register_fake
def _(offsets, num_tokens, block_size):
    return tuple(empty_block_table(offsets, num_tokens, block_size))


@torch.library.custom_op("blockattn::time_bucket_table", mutates_args=())
def time_bucket_table(offsets: torch.Tensor, block_cum: torch.Tensor, block_seq: torch.Tensor,
                      timestamps: torch.Tensor, num_buckets: int, width: float, block_size: int) -> torch.Tensor:
    """The time buckets' table of a batch's layout (``ops.in_block.bucket_table``), built once for every call on
    it, as one opaque op (for a compiled model)."""
    return in_block.bucket_table(timestamps, num_buckets, width, offsets, BlockTable(block_cum, block_seq),
                                 block_size)


@time_bucket_table.register_fake
def _(offsets, block_cum, block_seq, timestamps, num_buckets, width, block_size):
    return timestamps.new_empty(timestamps.shape[0], block_size, dtype=in_block.bucket_dtype(num_buckets, block_size))


def _register_autograd(name: str, fwd_op, bwd_op, fwd_impl, bwd_impl, save, input_grads,
                       differentiable: tuple[int, ...]) -> type[torch.autograd.Function]:
    """Autograd of a forward op whose outputs are ``(out, *block_table, time_buckets)``, and the same as a
    ``torch.autograd.Function`` on the ops' implementations (the eager route, :func:`eager_route`), which it
    returns: ``fwd_impl`` returns ``(out, table, buckets)`` (the tables it built, or None), ``bwd_impl`` the
    backward op's outputs with None for absent biases' gradients. ``save(ctx, inputs, table, buckets)`` keeps what
    ``input_grads(ctx, grad_out, backward)`` needs to call ``backward`` (the backward op, or its implementation).

    The Function is applied as ``apply(plan, inputs, *(inputs[i] for i in differentiable))``: the plan of
    ``fwd_impl`` to replay on the inputs (``ops.plans``; None: call ``fwd_impl``), the op's inputs as one tuple, and
    apart the ones that may take a gradient (``differentiable``, the Function's attribute). The others get none;
    ``autograd.Function.apply`` spends host time on every argument it is given (23 or 18 here otherwise). The eager
    route applies it by ``eager_apply``, the C ``apply`` beneath ``autograd.Function.apply``'s Python wrapper: that
    wrapper unwraps functorch's dead wrappers and binds defaults for a ``setup_context``, neither of which applies
    there (no functorch transform, no ``setup_context``), and took ~4 µs a call on a 2-core CPU. The backward of a
    replayed forward finds its own plan by :func:`_backward_after_replay`."""
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(*output[1:])
        save(ctx, inputs, output[1:3], output[3])

    fwd_op.register_autograd(lambda ctx, grad_out, *_table_grads: input_grads(ctx, grad_out, bwd_op),
                             setup_context=setup_context)

    def forward(ctx, plan, inputs, *differentiable_inputs):
        out, table, buckets = fwd_impl(*inputs) if plan is None else plan(inputs)
        save(ctx, inputs, table, buckets)
        ctx.plan = plan
        return out

    def backward(ctx, grad_out):
        backward_impl = bwd_impl if ctx.plan is None else functools.partial(_backward_after_replay, ctx.plan, bwd_impl)
        grads = input_grads(ctx, grad_out, backward_impl)
        if torch.is_grad_enabled():  # create_graph=True
            grads = _second_order_refused(grads)
        return None, None, *(grads[i] for i in differentiable)

    function = type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                       "backward": staticmethod(backward),
                                                       "differentiable": differentiable})
    function.eager_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, function)
    return function


def _second_order_refused(grads: tuple) -> tuple:
    """The gradients of a backward that autograd records (``create_graph=True``): those that carry no graph (the
    kernels computed them; the PyTorch path's ops record one) become tensors whose own backward raises, as
    ``torch.autograd.function.once_differentiable`` makes them, instead of constants that would silently drop the
    second-order terms. Not that decorator itself: it enters ``torch.no_grad()`` at every backward (~3 µs of host
    time a call on the 2-core development CPU), where this costs the caller one ``torch.is_grad_enabled()``."""
    constant = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor) and g.grad_fn is None]
    if not constant:
        return grads
    refuse = torch._C._functions.DelayedError(
        b"blockattn's attention kernels compute first-order gradients only: a second derivative (double backward) "
        b"through them is not supported", len(constant))
    refused = refuse(*[grads[i].detach().requires_grad_() for i in constant])
    refused = refused if isinstance(refused, tuple) else (refused,)
    grads = list(grads)
    for i, g in zip(constant, refused):
        grads[i] = g
    return tuple(grads)


# Backward plans kept a forward plan (``grad_out`` of other strides or alignments: a few at most).
_MAX_BACKWARD_PLANS = 8


def _backward_after_replay(forward_plan: Plan, bwd_impl, *args):
    """``bwd_impl(*args)`` for the backward of a call whose forward replayed ``forward_plan``. Every argument but
    ``grad_out`` (the first) is the forward's (its saved inputs and the tables it built, its Python values), so
    their metadata are fixed by the forward plan's signature: the backward's plan is found by ``grad_out``'s
    metadata and the current device, kept with the forward plan, rather than by ``planned``'s signature of ~19
    arguments (~5 µs of host time)."""
    grad_out = args[0]
    if type(grad_out) not in TENSORS or not eager_context():
        return bwd_impl(*args)
    key = (grad_out.shape, grad_out.stride(), grad_out.dtype, grad_out.data_ptr() & 15, current_device())
    plan = forward_plan.backward_plans.get(key)
    if plan is not None:
        return plan(args)
    result = bwd_impl(*args)
    plan = bwd_impl.plan_of(args)
    if isinstance(plan, Plan) and len(forward_plan.backward_plans) < _MAX_BACKWARD_PLANS:
        forward_plan.backward_plans[key] = plan
    return result


@planned
def _block_attention_forward(q, k, v, offsets, sinu_pos, block_size, scale, rotate, causal=False, pos_bias=None,
                             timestamps=None, time_bias=None, time_bucket_width=DEFAULT_BUCKET_WIDTH, dropout_p=0.0,
                             dropout_seed=None, block_cum=None, block_seq=None, q_descale=None, k_descale=None,
                             v_descale=None, out_scale=None, out_dtype=None,
                             time_buckets=None) -> tuple:
    """``(out, table, buckets)`` (:func:`_forward`) of the forward op's arguments: what the op and the eager route
    run."""
    options = InBlock(causal, pos_bias, timestamps, time_bias, time_bucket_width, dropout_p, dropout_seed,
                      time_buckets)
    scales = None if q_descale is None else Fp8Scales(q_descale, k_descale, v_descale,
                                                      fp8.out_dtype_of(q.dtype, out_dtype) or q.dtype, out_scale)
    return _forward(q, k, v, offsets, sinu_pos, block_size, scale, rotate, options, block_cum, block_seq, scales)


def _block_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, sinu_pos: torch.Tensor | None,
    block_size: int, scale: float, rotate: int, causal: bool = False, pos_bias: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None, time_bias: torch.Tensor | None = None,
    time_bucket_width: float = DEFAULT_BUCKET_WIDTH, dropout_p: float = 0.0, dropout_seed: torch.Tensor | None = None,
    block_cum: torch.Tensor | None = None, block_seq: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None, out_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
    time_buckets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(out, block_cum, block_seq, time_buckets)``: the block table (``block_table.BlockTable``) it built,
    or 0-element tensors where a layout's table was passed in (``block_cum``, ``block_seq``); the time buckets'
    table it built for its backward, or a 0-element tensor (:func:`_builds_buckets`). float8 inputs come with their
    descales and the output's dtype (and scale, for an fp8 output): ``ops.fp8``. ``time_buckets``: a layout's table
    of time buckets (:func:`time_bucket_table`), or None."""
    built = None if block_cum is not None else _op_table(offsets, q.shape[0], block_size)
    out, _, buckets = _block_attention_forward(
        q, k, v, offsets, sinu_pos, block_size, scale, rotate, causal, pos_bias, timestamps, time_bias,
        time_bucket_width, dropout_p, dropout_seed, *(built or (block_cum, block_seq)), q_descale, k_descale,
        v_descale, out_scale, out_dtype, time_buckets)
    return _op_outputs(out, built, buckets, offsets)


block_attention_fwd = torch.library.custom_op("blockattn::block_attention_fwd", _block_attention_fwd, mutates_args=())


@block_attention_fwd.register_fake
def _(q, k, v, offsets, sinu_pos, block_size, scale, rotate, causal=False, pos_bias=None, timestamps=None,
      time_bias=None, time_bucket_width=DEFAULT_BUCKET_WIDTH, dropout_p=0.0, dropout_seed=None, block_cum=None,
      block_seq=None, q_descale=None, k_descale=None, v_descale=None, out_scale=None, out_dtype=None,
      time_buckets=None):
    return (torch.empty_like(q, dtype=fp8.out_dtype_of(q.dtype, out_dtype) or q.dtype),
            *_fwd_table_fakes(offsets, q.shape[0], block_size, block_cum),
            _buckets_fake(q, time_bias, time_buckets, block_size))


@planned
def _block_attention_backward(grad_out, q, k, v, offsets, sinu_pos, block_cum, block_seq, block_size, scale, rotate,
                              causal=False, pos_bias=None, timestamps=None, time_bias=None,
                              time_bucket_width=DEFAULT_BUCKET_WIDTH, dropout_p=0.0, dropout_seed=None,
                              time_buckets=None) -> tuple:
    """``(dq, dk, dv, dpos_bias, dtime_bias)``, None for an absent bias's: what the op and the eager route run."""
    grads = (tiles.new_output(q), tiles.new_output(k), tiles.new_output(v))
    options = InBlock(causal, pos_bias, timestamps, time_bias, time_bucket_width, dropout_p, dropout_seed,
                      time_buckets)
    bias_grads = _backward(grad_out, q, k, v, offsets, sinu_pos, block_cum, block_seq, block_size, scale, rotate,
                           options, grads)
    return *grads, *bias_grads


def _block_attention_bwd(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
    sinu_pos: torch.Tensor | None, block_cum: torch.Tensor, block_seq: torch.Tensor, block_size: int, scale: float,
    rotate: int, causal: bool = False, pos_bias: torch.Tensor | None = None, timestamps: torch.Tensor | None = None,
    time_bias: torch.Tensor | None = None, time_bucket_width: float = DEFAULT_BUCKET_WIDTH, dropout_p: float = 0.0,
    dropout_seed: torch.Tensor | None = None, time_buckets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dpos_bias, dtime_bias)``."""
    return _op_grads(_block_attention_backward(grad_out, q, k, v, offsets, sinu_pos, block_cum, block_seq, block_size,
                                               scale, rotate, causal, pos_bias, timestamps, time_bias,
                                               time_bucket_width, dropout_p, dropout_seed, time_buckets), q)


block_attention_bwd = torch.library.custom_op("blockattn::block_attention_bwd", _block_attention_bwd, mutates_args=())


@block_attention_bwd.register_fake
def _(grad_out, q, k, v, offsets, sinu_pos, block_cum, block_seq, block_size, scale, rotate, causal=False,
      pos_bias=None, timestamps=None, time_bias=None, *options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), *_bias_grad_fakes(q, pos_bias, time_bias)


def _save_for_backward(ctx, inputs: tuple, table: tuple, buckets: torch.Tensor | None) -> None:
    """Both routes (:func:`block_attention`): what the backward reads. ``inputs`` as the forward op takes them."""
    (q, k, v, offsets, sinu_pos, block_size, scale, rotate, causal, pos_bias, timestamps, time_bias, width, p, seed,
     *layout_table) = inputs[:17]  # the fp8 forward's arguments follow (it has no backward), then the time buckets
    block_cum, block_seq = _saved_table(layout_table, table)
    time_buckets = _saved_buckets(inputs[22] if len(inputs) > 22 else None, buckets)
    ctx.save_for_backward(q, k, v, offsets, sinu_pos, block_cum, block_seq, pos_bias, timestamps, time_bias, seed,
                          time_buckets)
    ctx.block_size, ctx.scale, ctx.rotate = block_size, scale, rotate
    ctx.flags = (causal, width, p)


def _input_grads(ctx, grad_out, backward) -> tuple:
    """The gradients of the forward op's inputs, by ``backward`` (the backward op, or its implementation)."""
    q, k, v, offsets, sinu_pos, block_cum, block_seq, pos_bias, timestamps, time_bias, seed, time_buckets = (
        ctx.saved_tensors)
    causal, width, p = ctx.flags
    options = (causal, pos_bias, timestamps, time_bias, width, p, seed)
    dq, dk, dv, *bias_grads = backward(grad_out, q, k, v, offsets, sinu_pos, block_cum, block_seq, ctx.block_size,
                                       ctx.scale, ctx.rotate, *options, time_buckets)
    # fp8 inputs take no gradient (the public function refuses them then): their five arguments get none.
    return (dq, dk, dv, None, None, None, None, None, *_bias_grads_out(bias_grads, options), None, None, None, None,
            None, None, None, None)


_EagerBlockAttention = _register_autograd("EagerBlockAttention", block_attention_fwd, block_attention_bwd,
                                          _block_attention_forward, _block_attention_backward, _save_for_backward,
                                          _input_grads, differentiable=(0, 1, 2, 9, 11))  # q, k, v and the biases


@planned
def _qkv_block_attention_forward(qkv, offsets, sinu_pos, num_heads, num_kv_heads, block_size, scale, rotate,
                                 causal=False, pos_bias=None, timestamps=None, time_bias=None,
                                 time_bucket_width=DEFAULT_BUCKET_WIDTH, dropout_p=0.0, dropout_seed=None,
                                 block_cum=None, block_seq=None,
                                 time_buckets=None) -> tuple:
    """``(out, table, buckets)`` (:func:`_forward`) of the packed forward op's arguments."""
    options = InBlock(causal, pos_bias, timestamps, time_bias, time_bucket_width, dropout_p, dropout_seed,
                      time_buckets)
    return _forward(*split_heads(qkv, num_heads, num_kv_heads), offsets, sinu_pos, block_size, scale, rotate, options,
                    block_cum, block_seq)


def _qkv_block_attention_fwd(
    qkv: torch.Tensor, offsets: torch.Tensor, sinu_pos: torch.Tensor | None, num_heads: int, num_kv_heads: int,
    block_size: int, scale: float, rotate: int, causal: bool = False, pos_bias: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None, time_bias: torch.Tensor | None = None,
    time_bucket_width: float = DEFAULT_BUCKET_WIDTH, dropout_p: float = 0.0, dropout_seed: torch.Tensor | None = None,
    block_cum: torch.Tensor | None = None, block_seq: torch.Tensor | None = None,
    time_buckets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block attention on the heads of a packed projection, read in place through strides; the outputs of
    :func:`_block_attention_fwd`."""
    built = None if block_cum is not None else _op_table(offsets, qkv.shape[0], block_size)
    out, _, buckets = _qkv_block_attention_forward(
        qkv, offsets, sinu_pos, num_heads, num_kv_heads, block_size, scale, rotate, causal, pos_bias, timestamps,
        time_bias, time_bucket_width, dropout_p, dropout_seed, *(built or (block_cum, block_seq)), time_buckets)
    return _op_outputs(out, built, buckets, offsets)


qkv_block_attention_fwd = torch.library.custom_op("blockattn::qkv_block_attention_fwd", _qkv_block_attention_fwd,
                                                  mutates_args=())


@qkv_block_attention_fwd.register_fake
def _(qkv, offsets, sinu_pos, num_heads, num_kv_heads, block_size, scale, rotate, causal=False, pos_bias=None,
      timestamps=None, time_bias=None, time_bucket_width=DEFAULT_BUCKET_WIDTH, dropout_p=0.0, dropout_seed=None,
      block_cum=None, block_seq=None, time_buckets=None):
    n = qkv.shape[0]
    head_dim = packed_head_dim(qkv, num_heads, num_kv_heads)
    return (qkv.new_empty(n, num_heads, head_dim), *_fwd_table_fakes(offsets, n, block_size, block_cum),
            _buckets_fake(qkv, time_bias, time_buckets, block_size))


@planned
def _qkv_block_attention_backward(grad_out, qkv, offsets, sinu_pos, block_cum, block_seq, num_heads, num_kv_heads,
                                  block_size, scale, rotate, causal=False, pos_bias=None, timestamps=None,
                                  time_bias=None, time_bucket_width=DEFAULT_BUCKET_WIDTH, dropout_p=0.0,
                                  dropout_seed=None, time_buckets=None) -> tuple:
    """``(dqkv, dpos_bias, dtime_bias)``, None for an absent bias's; ``dqkv`` in the packed layout of ``qkv``: the
    kernel writes dq, dk, dv straight into views of one buffer."""
    options = InBlock(causal, pos_bias, timestamps, time_bias, time_bucket_width, dropout_p, dropout_seed,
                      time_buckets)
    heads = split_heads(qkv, num_heads, num_kv_heads)
    # Under create_graph=True the PyTorch path records its gradients' graph, which writes into views of one buffer
    # would break: there they are written apart and joined after.
    recorded = torch.is_grad_enabled()
    dqkv = None if recorded else tiles.new_output(qkv)
    grads = tuple(map(tiles.new_output, heads)) if recorded else split_heads(dqkv, num_heads, num_kv_heads)
    bias_grads = _backward(grad_out, *heads, offsets, sinu_pos, block_cum, block_seq, block_size, scale, rotate,
                           options, grads)
    if recorded:
        dqkv = torch.cat([g.flatten(1) for g in grads], 1)
    return dqkv, *bias_grads


def _qkv_block_attention_bwd(
    grad_out: torch.Tensor, qkv: torch.Tensor, offsets: torch.Tensor, sinu_pos: torch.Tensor | None,
    block_cum: torch.Tensor, block_seq: torch.Tensor, num_heads: int, num_kv_heads: int, block_size: int,
    scale: float, rotate: int, causal: bool = False, pos_bias: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None, time_bias: torch.Tensor | None = None,
    time_bucket_width: float = DEFAULT_BUCKET_WIDTH, dropout_p: float = 0.0, dropout_seed: torch.Tensor | None = None,
    time_buckets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dqkv, dpos_bias, dtime_bias)``."""
    return _op_grads(_qkv_block_attention_backward(grad_out, qkv, offsets, sinu_pos, block_cum, block_seq, num_heads,
                                                   num_kv_heads, block_size, scale, rotate, causal, pos_bias,
                                                   timestamps, time_bias, time_bucket_width, dropout_p,
                                                   dropout_seed, time_buckets), qkv)


qkv_block_attention_bwd = torch.library.custom_op("blockattn::qkv_block_attention_bwd", _qkv_block_attention_bwd,
                                                  mutates_args=())


@qkv_block_attention_bwd.register_fake
def _(grad_out, qkv, offsets, sinu_pos, block_cum, block_seq, num_heads, num_kv_heads, block_size, scale, rotate,
      causal=False, pos_bias=None, timestamps=None, time_bias=None, *options):
    return torch.empty_like(qkv), *_bias_grad_fakes(qkv, pos_bias, time_bias)


def _qkv_save_for_backward(ctx, inputs: tuple, table: tuple, buckets: torch.Tensor | None) -> None:
    (qkv, offsets, sinu_pos, num_heads, num_kv_heads, block_size, scale, rotate, causal, pos_bias, timestamps,
     time_bias, width, p, seed, *layout_table) = inputs[:17]
    block_cum, block_seq = _saved_table(layout_table, table)
    time_buckets = _saved_buckets(inputs[17] if len(inputs) > 17 else None, buckets)
    ctx.save_for_backward(qkv, offsets, sinu_pos, block_cum, block_seq, pos_bias, timestamps, time_bias, seed,
                          time_buckets)
    ctx.shape_options = (num_heads, num_kv_heads, block_size, scale, rotate)
    ctx.flags = (causal, width, p)


def _qkv_input_grads(ctx, grad_out, backward) -> tuple:
    qkv, offsets, sinu_pos, block_cum, block_seq, pos_bias, timestamps, time_bias, seed, time_buckets = (
        ctx.saved_tensors)
    causal, width, p = ctx.flags
    options = (causal, pos_bias, timestamps, time_bias, width, p, seed)
    dqkv, *bias_grads = backward(grad_out, qkv, offsets, sinu_pos, block_cum, block_seq, *ctx.shape_options,
                                 *options, time_buckets)
    return (dqkv, None, None, None, None, None, None, None, *_bias_grads_out(bias_grads, options), None, None,
            None)


_EagerQkvBlockAttention = _register_autograd("EagerQkvBlockAttention", qkv_block_attention_fwd,
                                             qkv_block_attention_bwd, _qkv_block_attention_forward,
                                             _qkv_block_attention_backward, _qkv_save_for_backward,
                                             _qkv_input_grads, differentiable=(0, 9, 11))  # qkv and the biases


def eager_route(*inputs) -> bool:
    """Whether a call on ``inputs`` (an op's arguments, the first its main input) may run the op's implementation
    under a ``torch.autograd.Function`` instead of through the custom op: the op's dispatch and autograd wrapper
    measured ~250 µs of host time per forward with gradients on an H100's host, a ``torch.autograd.Function`` ~26 µs
    (docs/benchmarks.md), more than the kernels of a small batch take. Not while ``torch.compile`` traces, under
    a dispatch mode (``FlopCounterMode``, ``FakeTensorMode``) or a functorch transform, nor for tensor subclasses
    or meta tensors: there the op's registrations (fake, FLOP formula) are what is asked for."""
    return eager_context() and not inputs[0].is_meta and _EAGER_TYPES.issuperset(map(type, inputs))


def eager_context() -> bool:
    """Whether nothing traces or watches the ops' calls: ``torch.compile`` is not tracing, and no dispatch mode or
    functorch transform is active (:func:`eager_route`'s conditions on the context, which ``call_cache`` shares)."""
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
                or torch._C._are_functorch_transforms_active())


# What an op's arguments may be on the eager route: plain tensors and Python values (not a tensor subclass).
_EAGER_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, type(None), bool, int, float, str, torch.dtype})


def _records_grad(differentiable) -> bool:
    """Whether autograd records a call whose differentiable inputs are ``differentiable`` (None for absent ones)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in differentiable)


def _attention(op, eager: type[torch.autograd.Function], forward, inputs: tuple) -> torch.Tensor:
    if eager_route(*inputs):
        # Gradients flow to the Function's differentiable inputs alone: whether autograd records is theirs to say.
        differentiable = [inputs[i] for i in eager.differentiable]
        if _records_grad(differentiable):
            return eager.eager_apply(None, inputs, *differentiable)
        # Nothing to differentiate (inference): the implementation itself, without the Function's bookkeeping.
        return forward(*inputs)[0]
    return op(*inputs)[0]


def _replay_of(implementation, eager: type[torch.autograd.Function] | None, inputs: tuple):
    """What the eager route runs for calls on the signature of ``inputs``, as a function of the op's inputs that
    replays ``implementation``'s plan for them (through ``eager``, the Function, where a gradient is needed; the
    output alone for an attention op, all of it for the forward-only flash op): for ``call_cache``. False where the
    call never replays a plan (not the eager route, a ``NoPlan``), None while the plan is not recorded yet."""
    if not eager_route(*inputs):
        return False
    plan = implementation.plan_of(inputs)
    if not isinstance(plan, Plan):
        return None if plan is None else False
    if eager is None:
        return plan
    differentiable = operator.itemgetter(*eager.differentiable)
    if _records_grad(differentiable(inputs)):
        return lambda inputs: eager.eager_apply(plan, inputs, *differentiable(inputs))
    return lambda inputs: plan(inputs)[0]


def block_attention(*inputs) -> torch.Tensor:
    """``block_attention_fwd(*inputs)``'s output with autograd: by the eager route where it may run."""
    return _attention(block_attention_fwd, _EagerBlockAttention, _block_attention_forward, inputs)


def block_attention_replay(inputs: tuple):
    """:func:`block_attention`'s replay for ``call_cache`` (:func:`_replay_of`)."""
    return _replay_of(_block_attention_forward, _EagerBlockAttention, inputs)


def qkv_block_attention(*inputs) -> torch.Tensor:
    """``qkv_block_attention_fwd(*inputs)``'s output with autograd: by the eager route where it may run."""
    return _attention(qkv_block_attention_fwd, _EagerQkvBlockAttention, _qkv_block_attention_forward, inputs)


def qkv_block_attention_replay(inputs: tuple):
    """:func:`qkv_block_attention`'s replay for ``call_cache`` (:func:`_replay_of`)."""
    return _replay_of(_qkv_block_attention_forward, _EagerQkvBlockAttention, inputs)


def in_block_pairs(offsets: torch.Tensor, num_tokens: int, block_size: int, causal: bool = False) -> int:
    """Number of (query, key) pairs that attend, ``sum over blocks of len^2`` (``len (len + 1) / 2`` under the
    causal mask; an upper bound on fake tensors)."""
    if isinstance(offsets, torch._subclasses.FakeTensor) or offsets.device.type == "meta":
        return num_tokens * block_size
    lengths = (offsets[1:] - offsets[:-1]).long()
    full, rest = torch.div(lengths, block_size, rounding_mode="floor"), lengths % block_size
    if causal:
        return int((full * (block_size * (block_size + 1) // 2) + rest * (rest + 1) // 2).sum())
    return int((full * block_size * block_size + rest * rest).sum())


# Products per pass: q k^T and P V; the backward's recomputed q k^T, dO V^T, dV, dQ and dK.
MATMULS = {"fwd": 2, "bwd": 5}


def attention_flops(offsets, num_tokens, num_heads, head_dim, block_size, causal, matmuls) -> int:
    """FLOPs of ``matmuls`` products (``MATMULS``) over the in-block pairs of ``num_heads`` query heads: ``2 * D``
    per pair, head and product (rotary, biases and dropout add a few per element)."""
    return 2 * matmuls * in_block_pairs(offsets, num_tokens, block_size, causal) * num_heads * head_dim


@register_flop_formula(torch.ops.blockattn.block_attention_fwd, get_raw=True)
def _fwd_flops(q, k, v, offsets, sinu_pos, block_size, scale, rotate, causal=False, *args, **kwargs) -> int:
    return attention_flops(offsets, q.shape[0], q.shape[1], q.shape[2], block_size, causal, MATMULS["fwd"])


@register_flop_formula(torch.ops.blockattn.block_attention_bwd, get_raw=True)
def _bwd_flops(grad_out, q, k, v, offsets, sinu_pos, block_cum, block_seq, block_size, scale, rotate, causal=False,
               *args, **kwargs) -> int:
    return attention_flops(offsets, q.shape[0], q.shape[1], q.shape[2], block_size, causal, MATMULS["bwd"])


@register_flop_formula(torch.ops.blockattn.qkv_block_attention_fwd, get_raw=True)
def _qkv_fwd_flops(qkv, offsets, sinu_pos, num_heads, num_kv_heads, block_size, scale, rotate, causal=False,
                   *args, **kwargs) -> int:
    head_dim = packed_head_dim(qkv, num_heads, num_kv_heads)
    return attention_flops(offsets, qkv.shape[0], num_heads, head_dim, block_size, causal, MATMULS["fwd"])


@register_flop_formula(torch.ops.blockattn.qkv_block_attention_bwd, get_raw=True)
def _qkv_bwd_flops(grad_out, qkv, offsets, sinu_pos, block_cum, block_seq, num_heads, num_kv_heads, block_size,
                   scale, rotate, causal=False, *args, **kwargs) -> int:
    head_dim = packed_head_dim(qkv, num_heads, num_kv_heads)
    return attention_flops(offsets, qkv.shape[0], num_heads, head_dim, block_size, causal, MATMULS["bwd"])


@planned
def _flash_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int | None, max_seqlen_k: int | None, scale: float, causal: bool,
    bottom_right: bool, out_dtype: torch.dtype, q_descale: torch.Tensor | None, k_descale: torch.Tensor | None,
    v_descale: torch.Tensor | None, variant: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of dense ``[B, S, H, D]`` inputs (``cu_seqlens_q`` None; ``lse [B, H, Sq]``) or packed
    ``[N, H, D]`` ones (``lse [H, Nq]``), by the backend the dispatcher picks for ``variant``. Forward only."""
    call = FlashCall.of(q, k, v, variant, causal=causal)
    backend = backends.select(call, FLASH_BACKENDS)
    config = None if backend.name == "torch" else call.with_config(backend.name).config
    table = None
    if cu_seqlens_q is not None:
        check_offsets(cu_seqlens_k, k.shape[0], max_seqlen_k, "cu_seqlens_k")
        if config is None:
            check_offsets(cu_seqlens_q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
        else:
            table = build_block_table(cu_seqlens_q, q.shape[0], config.block_m, max_seqlen_q, "cu_seqlens_q")
            if max_seqlen_q is not None:  # a tighter grid: at most ceil(max_seqlen_q / BLOCK_M) tiles per sequence
                slots = (cu_seqlens_q.numel() - 1) * -(-max_seqlen_q // config.block_m)
                table = BlockTable(table.block_cum, table.block_seq[:slots])
    descales = None if q_descale is None else (q_descale, k_descale, v_descale)
    return backend.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, table, scale, causal, bottom_right, out_dtype,
                           descales, config)


flash_attention_fwd = torch.library.custom_op("blockattn::flash_attention_fwd", _flash_attention_fwd,
                                              mutates_args=())


def flash_attention(*inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_attention_fwd(*inputs)``: its implementation called directly where the eager route may run (the
    op's dispatch costs more host time than a small call's kernel; forward only, so there is no autograd to set
    up), the op elsewhere."""
    if eager_route(*inputs):
        return _flash_attention_fwd(*inputs)
    return flash_attention_fwd(*inputs)


def flash_attention_replay(inputs: tuple):
    """:func:`flash_attention`'s replay for ``call_cache`` (:func:`_replay_of`)."""
    return _replay_of(_flash_attention_fwd, None, inputs)


@flash_attention_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, bottom_right, out_dtype,
      q_descale, k_descale, v_descale, variant):
    out = q.new_empty(q.shape, dtype=out_dtype)
    if cu_seqlens_q is None:
        return out, q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _visible_pairs(sq: int, sk: int, causal: bool, bottom_right: bool) -> int:
    """(query, key) pairs one sequence computes: ``Sq * Sk``, or under a causal mask ``sum_i clamp(i + 1 + shift, 0,
    Sk)`` with ``shift = Sk - Sq`` (bottom-right) or 0."""
    if not causal:
        return sq * sk
    shift = sk - sq if bottom_right else 0
    # Rows i with 0 < i + 1 + shift < Sk see i + 1 + shift keys, the rows above none, the rows below all Sk.
    first = max(0, -shift)  # first row that sees a key
    full = max(first, min(sq, sk - shift - 1))  # first row that sees every key
    partial = sum(range(first + 1 + shift, full + 1 + shift)) if full > first else 0
    return partial + (sq - full) * sk


def attended_pairs(q, k, cu_seqlens_q, cu_seqlens_k, causal: bool, bottom_right: bool) -> int:
    """Pairs the call computes over all sequences (an upper bound on fake tensors)."""
    if cu_seqlens_q is None:
        return q.shape[0] * _visible_pairs(q.shape[1], k.shape[1], causal, bottom_right)
    if isinstance(cu_seqlens_q, torch._subclasses.FakeTensor) or cu_seqlens_q.device.type == "meta":
        return q.shape[0] * k.shape[0]
    lengths = zip(cu_seqlens_q.diff().tolist(), cu_seqlens_k.diff().tolist())
    return sum(_visible_pairs(sq, sk, causal, bottom_right) for sq, sk in lengths)


@register_flop_formula(torch.ops.blockattn.flash_attention_fwd, get_raw=True)
def _flash_flops(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, bottom_right,
                 *args, **kwargs) -> int:
    # Two products of 2 D H FLOPs per visible pair. (The bench's TFLOP/s take FlashAttention's convention instead:
    # half of Sq Sk under a causal mask, which for Sq = Sk differs from this by Sq / 2 pairs.)
    return 4 * attended_pairs(q, k, cu_seqlens_q, cu_seqlens_k, causal, bottom_right) * q.shape[-1] * q.shape[-2]
