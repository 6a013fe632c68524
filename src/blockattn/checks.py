"""Every argument check of the public functions, in one place (docs/semantics.md, "Validation").

Each public entry point calls one function here, before any kernel runs; a bad argument raises a ``TypeError`` or
``ValueError`` that names it and says what was expected. Only metadata is read (shapes, dtypes, devices, strides),
so the checks cost no device work and are safe under ``torch.compile``; the *values* of ``offsets`` are checked
where the block table is built (``block_table.build_block_table``).

Because only metadata is read, the checks of a call run once per signature of its arguments
(:func:`once_per_signature`): a model's layers call the attention functions on the same shapes again and again, and
the checks cost more host time than the kernels of a small batch.
"""

from __future__ import annotations

import functools
import itertools
import numbers
import sys
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch._C import _functorch as functorch

from . import devices
from .block_table import BlockLayout, BlockTable, max_blocks
from .ops.fp8 import FP8_DTYPE, out_dtype_of
from .ops.in_block import DEFAULT_BUCKET_WIDTH, MIN_BUCKET_WIDTH, bucket_dtype
from .ops.tiles import ROTATE_BITS
from .signatures import Signature

BLOCK_SIZES = (16, 32, 64, 128)
DEFAULT_BLOCK_SIZE = 64
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
# One rotary program holds whole rows of a head.
MAX_ROTARY_DIM = 512
# The kernels take these; the PyTorch path (CPU, meta) takes float64 too, for torch.autograd.gradcheck.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLOAT64_DEVICES = ("cpu", "meta")
OFFSET_DTYPES = (torch.int32, torch.int64)
# Timestamps of the time bias: integers (e.g. seconds) or float32.
TIMESTAMP_DTYPES = (torch.int64, torch.int32, torch.float32)
# Flash attention: the kernels take fp16, bf16 and fp8; the PyTorch path takes float32 too (on any device) and float64
# on the CPU. Outputs are 16-bit or fp32.
FLASH_DTYPES = (torch.float16, torch.bfloat16, FP8_DTYPE, torch.float32)
FLASH_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")
FLASH_VARIANTS = ("auto", "pipelined", "warp_specialized")


# What the checks of a call (below) read: the tensors' types, shapes, dtypes, devices, layouts (dense or sparse) and
# requires_grad, the other arguments' values, and whether autograd records (the float8 forward's inference-only
# check). Not strides, nor which arguments are one tensor.
_SIGNATURE = Signature("({t}.shape, {t}.dtype, {t}.device, {t}.layout, {t}.requires_grad)", torch.is_grad_enabled,
                       aliases=False)
MAX_PASSED = 256


def once_per_signature(check):
    """``check`` (a function of metadata alone that raises on a bad argument) skipped for arguments whose signature
    (``signatures``) is among the last :data:`MAX_PASSED` that passed it: a layer's second call on the same shapes
    costs the signature and a look-up instead of the checks. Arguments without a signature (a tensor
    subclass, an unhashable value) are checked every time, and so is every call while ``torch.compile`` traces
    (nothing of this cache enters a graph). Only calls that passed are remembered: a refused one raises again."""
    passed: OrderedDict = OrderedDict()
    _EVERY_CACHE.append(passed)

    @functools.wraps(check)
    def checked(*args) -> None:
        if torch.compiler.is_compiling():
            return check(*args)
        try:
            key = _SIGNATURE(args)
            seen = key in passed
        except TypeError:  # no signature: a tensor subclass, an unhashable value
            return check(*args)
        if seen:
            return None
        check(*args)
        passed[key] = None
        if len(passed) > MAX_PASSED:  # the oldest goes (one C call each: safe between threads under the GIL)
            passed.popitem(last=False)
        return None

    checked.passed = passed  # for tests
    return checked


_EVERY_CACHE: list[OrderedDict] = []


def forget() -> None:
    """Forget every signature that passed: the next calls are checked again. A check's outcome depends on its
    arguments alone but for the device's compute capability (float8 projections), a constant of the hardware; tests
    that fake it call this."""
    for passed in _EVERY_CACHE:
        passed.clear()


def forget_with_checks(cache: dict) -> None:
    """Have :func:`forget` clear ``cache`` too (a cache that skips the checks: ``call_cache``)."""
    _EVERY_CACHE.append(cache)


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


def _apply(names: list[str]) -> str:
    """``"a applies"`` or ``"a, b apply"``: the subject and verb of a message about the arguments ``names``."""
    return f"{', '.join(names)} {'apply' if len(names) > 1 else 'applies'}"


def _dtype_names(dtypes) -> str:
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def tensor(name: str, t, optional: bool = False) -> None:
    """``t`` a tensor, not a sparse one (nested tensors have checks of their own); ``optional``: the argument may
    also be None (its caller took that case)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{' or None' if optional else ''}, got {type(t).__name__}")
    if t.layout not in (torch.strided, torch.jagged):
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout={t.layout}: pass {name}.to_dense()")
    if t.is_nested and t.layout != torch.jagged:
        raise TypeError(f"{name} is a nested tensor of layout={t.layout}: nested inputs must be torch.jagged "
                        "(torch.nested.nested_tensor(..., layout=torch.jagged)), where they are taken at all")


def no_func_derivatives(function: str, *tensors) -> None:
    """``torch.func``'s differentiation transforms on a call's ``tensors``: forward mode (``jvp``, ``jacfwd``,
    ``hessian``) takes the library's custom ops for constants and would return zero tangents, reverse mode
    (``grad``, ``vjp``, ``jacrev``) raises deep in PyTorch; a clear error instead. A call whose tensors no transform
    differentiates (a frozen attention inside a gradient taken through other inputs), or that ``vmap`` batches,
    runs; where no transform is active this costs one C call."""
    if functorch.peek_interpreter_stack() is None or torch.compiler.is_compiling():
        return
    for t in tensors:
        while isinstance(t, torch.Tensor):  # through vmap's batching wrappers to a grad or jvp level's
            if functorch.is_gradtrackingtensor(t):
                raise NotImplementedError(f"blockattn.{function} does not support torch.func's derivatives (grad, "
                                          "vjp, jacrev, jvp, jacfwd, hessian): differentiate with torch.autograd "
                                          "(backward(), torch.autograd.grad)")
            if not functorch.is_batchedtensor(t):
                break
            t = functorch.get_unwrapped(t)


def contiguous_offsets(value):
    """``offsets`` (or ``cu_seqlens``) as the kernels read them: one int after another. A strided view (a column of
    a table, say) is copied; anything else is returned as it is, for its check to refuse."""
    return value.contiguous() if isinstance(value, torch.Tensor) and value.layout == torch.strided else value


def float_tensor(name: str, t, ndim: int, layout: str, also: tuple[torch.dtype, ...] = ()) -> None:
    """``t`` a tensor of ``ndim`` dimensions (``layout`` names them) in a dtype its device computes in (or one of
    ``also``)."""
    tensor(name, t)
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")
    if t.dtype in KERNEL_DTYPES or t.dtype in also:  # every call's case first: no device object to make
        return
    dtypes = KERNEL_DTYPES + ((torch.float64,) if t.device.type in FLOAT64_DEVICES else ()) + also
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be {_dtype_names(dtypes)} on {t.device.type}, got {t.dtype}")


# The kinds of number the checks take: Python's and every registered kind (numpy's among them), but bool.
INT = (numbers.Integral,)
REAL = (numbers.Real,)


def number(name: str, value, kinds: tuple[type, ...], what: str, valid: Callable[[float], bool]):
    """A number of one of ``kinds`` (a ``TypeError`` otherwise; a bool counts as none: True is no size or scale)
    for which ``valid`` holds (a ``ValueError`` otherwise); both messages say it must be ``what``. Returns it as
    the ops take it (:func:`plain`)."""
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(f"{name} must be {what}, got {value!r} of type {_qualified(type(value))}")
    value = plain(value)
    if not valid(value):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    if type(value) is int and not -2**63 <= value < 2**63:  # the ops' ints are int64
        raise ValueError(f"{name} must be {what} within int64, got {value!r}")
    return value


def plain(value):
    """A checked number as the custom ops' schemas take it: a numpy (or other registered) int or float as Python's
    int or float; Python's numbers and SymInts as they are (a SymInt must not be specialised)."""
    if type(value) in (int, float) or isinstance(value, torch.SymInt):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def positive_int(name: str, value) -> int:
    return number(name, value, INT, "a positive int", lambda n: n >= 1)


def probability(name: str, value) -> float:
    """A dropout probability, in ``[0, 1)``."""
    return number(name, value, REAL, "a float in [0, 1)", lambda p: 0 <= p < 1)


def head_dim(d, source: str = "") -> None:
    """``source``: where ``d`` comes from, when the caller did not pass it (e.g. a weight's width)."""
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM or d % 8 != 0:
        raise ValueError(f"head_dim{source} must be a multiple of 8 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {d}")


def block_size(value, name: str = "block_size") -> int:
    return number(name, value, INT, f"one of {BLOCK_SIZES}", lambda n: n in BLOCK_SIZES)


def token_count(name: str, value):
    """A number of tokens ``N``: an int (a SymInt where torch.compile traces shapes), at least 0."""
    return number(name, value, (*INT, torch.SymInt), "a non-negative int (the N of the inputs)", lambda n: n >= 0)


def finite_positive(name: str, value, optional: bool = False) -> float | None:
    if optional and value is None:
        return None
    return number(name, value, REAL, f"a finite positive float{' or None' if optional else ''}",
                  lambda x: _finite(x) and x > 0)


def _finite(value: float) -> bool:
    """Whether an int or float is finite and within float's range (``math.isfinite`` raises OverflowError for a
    larger int)."""
    return abs(value) <= sys.float_info.max


def offsets(value, like: torch.Tensor | None = None, like_name: str = "", name: str = "offsets") -> None:
    """``offsets [B + 1]`` (or cumulative lengths called ``name``), int32 or int64 (on the device of ``like`` when
    given); its values are checked where the block table is built."""
    tensor(name, value)
    if value.dim() != 1 or value.numel() < 1:
        raise ValueError(f"{name} must be 1-D [B + 1] with at least one element, got shape {tuple(value.shape)}")
    if value.dtype not in OFFSET_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {value.dtype}")
    if like is not None and value.device != like.device:
        raise ValueError(f"{name} must be on the device of {like_name} ({like.device}), got {value.device}")


def some_sequence(offsets_: torch.Tensor, num_tokens_, what: str) -> None:
    """At least one sequence in ``offsets`` where the inputs have ``num_tokens`` tokens (``what`` names that count:
    "q's N", "num_tokens"): decidable from shapes alone, and the kernels need a sequence to look blocks up in."""
    if offsets_.numel() == 1 and num_tokens_ != 0:
        raise ValueError(f"offsets describes no sequence (B = 0) but {what} = {num_tokens_}; expected "
                         "offsets[-1] == N")


def attention(q, k, v, offsets_, block, scale) -> None:
    """``q [N, Hq, D]``, ``k, v [N, Hkv, D]``, ``offsets [B + 1]`` and the options of block attention."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        float_tensor(name, t, 3, "[N, heads, head_dim]", also=(FP8_DTYPE,))
    offsets(offsets_)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if len({t.device for t in (q, k, v, offsets_)}) != 1:
        raise ValueError(f"q, k, v and offsets must be on one device, got q {q.device}, k {k.device}, v {v.device}, "
                         f"offsets {offsets_.device}")
    n, hq, d = q.shape
    some_sequence(offsets_, q.shape[0], "q's N")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {_describe(k)} and v {_describe(v)}")
    if k.shape[0] != n:
        raise ValueError(f"q, k and v must have the same number of tokens N, got q {n} and k/v {k.shape[0]}")
    if k.shape[2] != d:
        raise ValueError(f"q, k and v must have the same head_dim, got q {d} and k/v {k.shape[2]}")
    hkv = k.shape[1]
    if hkv == 0 or hq == 0 or hq % hkv != 0:
        raise ValueError(f"q heads must be a positive multiple of k/v heads (GQA), got Hq={hq}, Hkv={hkv}")
    head_dim(d)
    block_size(block)
    finite_positive("scale", scale, optional=True)


# Outputs of the float8 forward.
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8_DTYPE)


def fp8_inference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descales: tuple, out_dtype, out_scale,
                  biases: dict) -> None:
    """float8 inputs of block attention (forward only), their descales and the output's dtype and scale; for other
    inputs, that none of these is given. ``biases``: the in-block bias tables by name (None where absent), which
    must not require grad with fp8 inputs either."""
    _descales(q.dtype, q.device, descales)
    if q.dtype != FP8_DTYPE:
        given = [name for name, value in (("out_dtype", out_dtype), ("out_scale", out_scale)) if value is not None]
        if given:
            raise ValueError(f"{_apply(given)} to float8_e4m3fn inputs only; q, k, v are {q.dtype}")
        return
    if out_dtype not in FP8_OUT_DTYPES:
        raise ValueError(f"out_dtype must be {_dtype_names(FP8_OUT_DTYPES)} for float8 inputs, got {out_dtype}")
    if (out_dtype == FP8_DTYPE) != (out_scale is not None):
        raise ValueError("out_scale is required with out_dtype=torch.float8_e4m3fn (a 1-element float32 tensor: the "
                         "output is the fp8 tensor times it) and applies to it only")
    if out_scale is not None:
        tensor("out_scale", out_scale)
        if out_scale.numel() != 1 or out_scale.dtype != torch.float32 or out_scale.device != q.device:
            raise ValueError(f"out_scale must be a 1-element float32 tensor on the device of q ({q.device}), got "
                             f"{_describe(out_scale)}")
    _inference_only({"q": q, "k": k, "v": v, **dict(zip(("q_descale", "k_descale", "v_descale"), descales)),
                     **biases})


def _inference_only(named: dict) -> None:
    """The float8 forward's tensors (None where absent) must not require grad where autograd records."""
    if not torch.is_grad_enabled():
        return
    needing = [name for name, t in named.items() if t is not None and t.requires_grad]
    if needing:
        raise ValueError(f"the float8 forward is for inference: {', '.join(needing)} must not require grad "
                         "(call it under torch.no_grad() or detach them)")


def sinu_pos(angles, x: torch.Tensor, x_name: str, optional: bool) -> None:
    """``angles`` (``sinu_pos``) must be ``[N, D]`` of ``x = [N, H, D]``, floating, on ``x``'s device, and need no
    gradient; ``optional``: the function also takes None (no rotary), which its caller handled."""
    tensor("sinu_pos", angles, optional)
    n, _, d = x.shape
    if angles.shape != (n, d):
        raise ValueError(f"sinu_pos must be [N, head_dim] = [{n}, {d}] ([sin | cos] per token), got "
                         f"{tuple(angles.shape)}")
    float_tensor("sinu_pos", angles, 2, "[N, head_dim]")
    if angles.device != x.device:
        raise ValueError(f"sinu_pos must be on the device of {x_name} ({x.device}), got {angles.device}")
    if angles.requires_grad:
        raise ValueError("sinu_pos requires grad, but no gradient flows to the rotary angles: pass "
                         "sinu_pos.detach()")


def rotate_mask(rotate) -> int:
    """``rotate`` (a tuple of names from ``ROTATE_BITS``) as the ops' bit mask."""
    if isinstance(rotate, str) or not isinstance(rotate, (tuple, list, set, frozenset)):
        raise TypeError(f"rotate must be a tuple (or list, set) of names from {tuple(ROTATE_BITS)}, e.g. ('q', 'k'), "
                        f"got {rotate!r}")
    unknown = [name for name in rotate if not isinstance(name, str) or name not in ROTATE_BITS]
    if unknown:
        raise ValueError(f"rotate names the operands to rotate, from {tuple(ROTATE_BITS)}; got unknown {unknown}")
    if len(set(rotate)) != len(rotate):
        raise ValueError(f"rotate names an operand more than once: {tuple(rotate)}")
    mask = 0
    for name in rotate:
        mask |= ROTATE_BITS[name]
    return mask


def same_structure(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same offsets: the same tensor, or equal values where comparing them is free (CPU); on a GPU comparing values
    would stall the host, so there only the shape is compared."""
    if a is b:
        return True
    if a.shape != b.shape or a.device != b.device:
        return False
    return a.device.type != "cpu" or torch.equal(a, b)


def unpack_nested(q, k, v) -> tuple[torch.Tensor, ...]:
    """``torch.jagged`` nested tensors ``[B, j, H, D]`` -> their ``[N, H, D]`` values and shared offsets."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_nested:
            raise TypeError(f"{name} must be a nested tensor (layout=torch.jagged) when q is one")
        if t.layout != torch.jagged:
            raise TypeError(f"{name} must be a nested tensor of layout=torch.jagged, got layout={t.layout} (build "
                            f"it with torch.nested.nested_tensor(..., layout=torch.jagged))")
        if t.dim() != 4 or t._ragged_idx != 1:
            raise ValueError(f"{name} must be a jagged nested tensor of shape [B, j, H, D], got {t.shape}")
        without_holes(name, t)
    offsets = q.offsets()
    for name, t in (("k", k), ("v", v)):
        if not same_structure(t.offsets(), offsets):
            raise ValueError(f"{name} must have the same jagged structure (offsets) as q")
    return q.values(), k.values(), v.values(), offsets


def without_holes(name: str, t: torch.Tensor) -> None:
    """A jagged nested tensor whose sequences lie back to back in its values: one with holes (``lengths()``, as
    ``torch.nested.narrow`` makes) has values that are not its sequences' tokens."""
    if t.lengths() is not None:
        raise ValueError(f"{name} is a jagged nested tensor with holes between its sequences (it has lengths(), as "
                         f"torch.nested.narrow makes): pass {name}.contiguous()")


def jagged_values(name: str, value, offsets_: torch.Tensor, shape: str):
    """An optional per-token input given, like ``q``, as a ``torch.jagged`` nested tensor (``shape``): its values,
    once its structure is checked to be that of ``q`` (``offsets``); any other value as it is."""
    if not (isinstance(value, torch.Tensor) and value.is_nested):
        return value
    offsets(offsets_)
    if value.layout != torch.jagged or not same_structure(value.offsets(), offsets_):
        raise ValueError(f"{name}, when nested, must be a torch.jagged tensor {shape} with the structure of q")
    without_holes(name, value)
    return value.values()


def rotary_args(angles, rotate, q: torch.Tensor) -> None:
    """``sinu_pos`` (``[N, D]``: nested ones unpacked by :func:`jagged_values` first) and ``rotate``; the bit
    mask is :func:`rotate_bits`'s."""
    rotate_mask(rotate)
    if angles is not None:
        sinu_pos(angles, q, "q", optional=True)


# rotate_bits' masks of every tuple of distinct names, filled once: only read afterwards (torch.compile warns on
# tracing an lru_cache, and a dict written while it traces makes it compile the function again)
_MASKS = {names: rotate_mask(names) for count in range(len(ROTATE_BITS) + 1)
          for names in itertools.permutations(ROTATE_BITS, count)}


def rotate_bits(rotate, angles) -> int:
    """The ops' bit mask of a checked ``rotate`` (:func:`rotary_args`); 0 without ``angles``: nothing is rotated
    then."""
    return 0 if angles is None else _MASKS[tuple(rotate)]


def projection(x, w, bias, num_heads, num_kv_heads) -> None:
    """``x [N, d_model]``, ``w [d_model, (Hq + 2 Hkv) * D]``, ``bias`` and the head counts of the projection. float8
    ``x`` needs a float8 ``w`` and a floating ``bias`` (:func:`fp8_projection` checks their scales)."""
    float_tensor("x", x, 2, "[N, d_model]", also=(FP8_DTYPE,))
    tensor("w", w)
    positive_int("num_heads", num_heads)
    positive_int("num_kv_heads", num_kv_heads)
    num_all = num_heads + 2 * num_kv_heads
    if w.dim() != 2 or w.shape[0] != x.shape[1] or w.shape[1] % num_all != 0:
        raise ValueError(f"w must be [d_model, (num_heads + 2 * num_kv_heads) * head_dim] = [{x.shape[1]}, "
                         f"{num_all} * head_dim], got {tuple(w.shape)}")
    head_dim(w.shape[1] // num_all, f" (w's {w.shape[1]} columns over num_heads + 2 * num_kv_heads = {num_all})")
    others = [("w", w)]
    if bias is not None:
        tensor("bias", bias, optional=True)
        if bias.shape != (w.shape[1],):
            raise ValueError(f"bias must be 1-D [{w.shape[1]}] (one per projected column), got {tuple(bias.shape)}")
        others.append(("bias", bias))
    for name, t in others:
        if name == "bias" and x.dtype == FP8_DTYPE:
            if t.dtype not in FP8_BIAS_DTYPES:
                raise TypeError(f"bias must be {_dtype_names(FP8_BIAS_DTYPES)} with float8 x, got {t.dtype}")
        elif t.dtype != x.dtype:
            raise TypeError(f"{name} must have the dtype of x ({x.dtype}), got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} must be on the device of x ({x.device}), got {t.device}")


# The bias of a float8 projection: added to its float32 result before the result is quantised.
FP8_BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fp8_projection(x, w, bias, x_descale, w_descale, qkv_scale, out_dtype, out_scale) -> None:
    """float8 ``x`` and ``w`` of ``qkv_block_attention`` (inference): the GPU, their descales and the scale the packed
    projection is quantised with, none requiring grad; for other inputs, that none of these (nor ``out_dtype``,
    ``out_scale``, which :func:`fp8_inference` checks) is given."""
    scales = {"x_descale": x_descale, "w_descale": w_descale, "qkv_scale": qkv_scale}
    if x.dtype != FP8_DTYPE:
        given = [name for name, value in {**scales, "out_dtype": out_dtype, "out_scale": out_scale}.items()
                 if value is not None]
        if given:
            raise ValueError(f"{_apply(given)} to float8_e4m3fn x and w only; x is {x.dtype}")
        return
    if devices.kernels_run_on(x.device) and (reason := devices.fp8_reason(x.device)):
        raise ValueError(f"x and w: {reason}")
    _scale_tensors(scales, x.device, "x")
    _inference_only({"x": x, "w": w, "bias": bias, **scales})


def rotary_input(x, angles) -> None:
    """``x [N, H, D]`` with an even ``D`` of at most ``MAX_ROTARY_DIM``, and its ``sinu_pos``."""
    float_tensor("x", x, 3, "[N, heads, head_dim]")
    if x.shape[-1] % 2 or not 2 <= x.shape[-1] <= MAX_ROTARY_DIM:
        raise ValueError(f"head_dim must be even (pairs of columns turn together) and in [2, {MAX_ROTARY_DIM}], "
                         f"got {x.shape[-1]}")
    sinu_pos(angles, x, "x", optional=False)


def _choice(name: str, value, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r} of type {_qualified(type(value))}")


def _qualified(kind: type) -> str:
    """A type's name, with its module where it is not a builtin (numpy.bool, not bool)."""
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _descales(q_dtype: torch.dtype, device: torch.device, descales) -> None:
    """fp8 inputs need the three descales (1-element float32 tensors on the inputs' device); others take none."""
    names = ("q_descale", "k_descale", "v_descale")
    if q_dtype != FP8_DTYPE:
        given = [name for name, t in zip(names, descales) if t is not None]
        if given:
            raise ValueError(f"{_apply(given)} to float8_e4m3fn inputs only; q, k, v are {q_dtype}")
        return
    _scale_tensors(dict(zip(names, descales)), device, "q")


def _scale_tensors(named: dict, device: torch.device, input_name: str) -> None:
    """The scales of float8 inputs: each given, a 1-element float32 tensor on ``device`` (that of ``input_name``)."""
    for name, t in named.items():
        if t is None:
            raise ValueError(f"{name} is required with float8_e4m3fn inputs (a 1-element float32 tensor; "
                             "docs/semantics.md, fp8 inference)")
        tensor(name, t)
        if t.numel() != 1 or t.dtype != torch.float32:
            raise ValueError(f"{name} must be a 1-element float32 tensor, got {_describe(t)}")
        if t.device != device:
            raise ValueError(f"{name} must be on the device of {input_name} ({device}), got {t.device}")


def flash(q, k, v, *, packed: bool, causal, causal_alignment, scale, return_lse, out_dtype, descales,
          variant) -> None:
    """``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]`` (``packed``: ``[N, H, D]``) and the options of flash
    attention."""
    layout = "[N, heads, head_dim]" if packed else "[batch, seq, heads, head_dim]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        tensor(name, t)
        if t.is_nested:
            raise TypeError(f"{name} must be a dense tensor {layout}, got a nested tensor"
                            + ("" if packed else "; for sequences of different lengths pass the nested tensors' "
                               "values() and offsets() to flash_attention_varlen"))
        if t.dim() != (3 if packed else 4):
            raise ValueError(f"{name} must be {3 if packed else 4}-D {layout}, got shape {tuple(t.shape)}")
        dtypes = FLASH_DTYPES + ((torch.float64,) if t.device.type in FLOAT64_DEVICES else ())
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must be {_dtype_names(dtypes)}, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if len({t.device for t in (q, k, v)}) != 1:
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {_describe(k)} and v {_describe(v)}")
    if not packed and k.shape[0] != q.shape[0]:
        raise ValueError(f"q, k and v must have the same batch size, got q {q.shape[0]} and k/v {k.shape[0]}")
    hq, d = q.shape[-2:]
    hkv = k.shape[-2]
    if k.shape[-1] != d:
        raise ValueError(f"q, k and v must have the same head_dim, got q {d} and k/v {k.shape[-1]}")
    if hkv == 0 or hq == 0 or hq % hkv != 0:
        raise ValueError(f"q heads must be a positive multiple of k/v heads (GQA), got Hq={hq}, Hkv={hkv}")
    head_dim(d)
    flag("causal", causal)
    _choice("causal_alignment", causal_alignment, CAUSAL_ALIGNMENTS)
    finite_positive("scale", scale, optional=True)
    flag("return_lse", return_lse)
    if out_dtype is not None:
        if not isinstance(out_dtype, torch.dtype):
            raise TypeError(f"out_dtype must be a torch.dtype or None, got {type(out_dtype).__name__}")
        allowed = FLASH_OUT_DTYPES + ((torch.float64,) if q.device.type in FLOAT64_DEVICES else ())
        if out_dtype not in allowed:
            raise ValueError(f"out_dtype must be {_dtype_names(allowed)} or None, got {out_dtype}")
    _descales(q.dtype, q.device, descales)
    _choice("variant", variant, FLASH_VARIANTS)


def cu_seqlens(cu_q, cu_k, q, k, max_seqlen_q, max_seqlen_k) -> None:
    """``cu_seqlens_q``, ``cu_seqlens_k`` (``[B + 1]``, int32/int64, on the device of ``q``, of one length) and the
    optional ``max_seqlen`` hints; the values are checked where the block table is built."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        offsets(cu, q, "q", name)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length B + 1, got {cu_q.numel()} and "
                         f"{cu_k.numel()}")
    if cu_q.numel() == 1 and (q.shape[0] or k.shape[0]):
        raise ValueError(f"cu_seqlens_q describes no sequence (B = 0) but q has {q.shape[0]} and k {k.shape[0]} "
                         "tokens")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is not None:
            number(name, value, INT, "a non-negative int or None", lambda n: n >= 0)


def _bias_table(name: str, bias, shape: tuple[int, int], what: str, q: torch.Tensor) -> None:
    """A learnable bias ``[Hq, width]`` in float32 or ``q``'s dtype (with float8 inputs: float32, bfloat16 or
    float16), on ``q``'s device."""
    tensor(name, bias, optional=True)
    if bias.dim() != 2 or bias.shape[0] != shape[0] or (shape[1] and bias.shape[1] != shape[1]) or not bias.shape[1]:
        expected = f"[{shape[0]}, {shape[1]}]" if shape[1] else f"[{shape[0]}, num_buckets >= 1]"
        raise ValueError(f"{name} must be [num_heads, {what}] = {expected}, got {tuple(bias.shape)}")
    if q.dtype == FP8_DTYPE:
        dtypes, why = (torch.float32, torch.bfloat16, torch.float16), "with float8 inputs"
    else:
        dtypes, why = tuple(dict.fromkeys((torch.float32, q.dtype))), "float32 or the dtype of q"
    if bias.dtype not in dtypes:
        raise TypeError(f"{name} must be {_dtype_names(dtypes)} ({why}), got {bias.dtype}")
    if bias.device != q.device:
        raise ValueError(f"{name} must be on the device of q ({q.device}), got {bias.device}")


def _timestamps(timestamps, n: int, device: torch.device, device_of: str) -> None:
    tensor("timestamps", timestamps)
    if timestamps.shape != (n,):
        raise ValueError(f"timestamps must be 1-D [N] = [{n}] (one per token), got {tuple(timestamps.shape)}")
    if timestamps.dtype not in TIMESTAMP_DTYPES:
        raise TypeError(f"timestamps must be {_dtype_names(TIMESTAMP_DTYPES)}, got {timestamps.dtype}")
    if timestamps.device != device:
        raise ValueError(f"timestamps must be on the device of {device_of} ({device}), got {timestamps.device}")
    if timestamps.requires_grad:
        raise ValueError("timestamps requires grad, but no gradient flows to them: pass timestamps.detach()")


# Built once: an f-string built on every call failed to trace under torch.compile(dynamic=True).
_BUCKET_WIDTH = f"a finite float >= {MIN_BUCKET_WIDTH}"


def _bucket_width(time_bucket_width, name: str = "time_bucket_width") -> float:
    return number(name, time_bucket_width, REAL, _BUCKET_WIDTH, lambda x: _finite(x) and x >= MIN_BUCKET_WIDTH)


def layout_times(timestamps, num_time_buckets, time_bucket_width, offsets_: torch.Tensor,
                 num_tokens_: int) -> tuple[int, float] | tuple[None, None]:
    """The time-bias arguments of :func:`blockattn.block_layout`: both or neither of ``timestamps [N]`` and
    ``num_time_buckets``, a width only with them; returns ``(num_time_buckets, width)`` (the width 0.301 when left
    out), Nones without timestamps."""
    if (timestamps is None) != (num_time_buckets is None):
        raise ValueError("block_layout takes timestamps and num_time_buckets together (the time bias's "
                         "time_bias.shape[1]), or neither")
    if timestamps is None:
        if time_bucket_width is not None:
            raise ValueError("time_bucket_width was given to block_layout without timestamps: it is the width of "
                             "the timestamps' buckets")
        return None, None
    _timestamps(timestamps, num_tokens_, offsets_.device, "offsets")
    num_time_buckets = positive_int("num_time_buckets", num_time_buckets)
    width = DEFAULT_BUCKET_WIDTH if time_bucket_width is None else time_bucket_width
    return num_time_buckets, float(_bucket_width(width))


def layout_time_bias(value, timestamps, time_bias, time_bucket_width) -> tuple:
    """``(timestamps, time_bucket_width, time_buckets)`` of a call: those given, 0.301 for a width left out (None)
    and no table, or, where ``value`` (its ``offsets``) is a :class:`BlockLayout` with timestamps and the call has a
    time bias, the layout's (the call's timestamps and width must then be left out or be the layout's)."""
    if not (isinstance(value, BlockLayout) and value.timestamps is not None and time_bias is not None):
        if time_bucket_width is not None and timestamps is None and time_bias is None:
            raise ValueError("time_bucket_width was given without a time bias (timestamps and time_bias): it is the "
                             "width of the timestamps' buckets")
        return timestamps, DEFAULT_BUCKET_WIDTH if time_bucket_width is None else time_bucket_width, None
    if timestamps is not None and timestamps is not value.timestamps:
        raise ValueError("timestamps differ from those of the BlockLayout passed as offsets: leave timestamps out, "
                         "the layout's are used")
    if time_bucket_width is not None and time_bucket_width != value.time_bucket_width:
        raise ValueError(f"time_bucket_width={time_bucket_width!r} differs from the BlockLayout's "
                         f"{value.time_bucket_width}: leave it out when passing a layout with timestamps")
    if isinstance(time_bias, torch.Tensor) and time_bias.dim() == 2 and time_bias.shape[1] != value.num_time_buckets:
        raise ValueError(f"time_bias has {time_bias.shape[1]} buckets (shape[1]), but the BlockLayout passed as "
                         f"offsets was built for num_time_buckets={value.num_time_buckets}")
    buckets = value.time_buckets
    if buckets is not None:
        # A layout is a NamedTuple: one assembled by hand must not hand the kernels a table they would overrun.
        shape, dtype = (value.num_tokens, value.block_size), bucket_dtype(value.num_time_buckets, value.block_size)
        if (not isinstance(buckets, torch.Tensor) or tuple(buckets.shape) != shape or buckets.dtype != dtype
                or buckets.device != value.offsets.device or not buckets.is_contiguous()):
            raise ValueError(f"the BlockLayout's time_buckets must be a contiguous {dtype} tensor {list(shape)} on "
                             f"the device of its offsets, as blockattn.block_layout builds it")
    return value.timestamps, value.time_bucket_width, buckets


def in_block(causal, pos_bias, timestamps, time_bias, time_bucket_width, dropout_p, q: torch.Tensor,
             block: int) -> None:
    """The in-block options of block attention (docs/semantics.md, "Inside a block") for ``q [N, Hq, D]``;
    ``timestamps [N]`` (nested ones unpacked by :func:`jagged_values` first)."""
    flag("causal", causal)
    n, hq = q.shape[:2]
    if pos_bias is not None:
        _bias_table("pos_bias", pos_bias, (hq, 2 * block - 1), "2 * block_size - 1 relative positions", q)
    if (timestamps is None) != (time_bias is None):
        given, missing = ("timestamps", "time_bias") if time_bias is None else ("time_bias", "timestamps")
        raise ValueError(f"{given} was given without {missing}: the time bias needs both (timestamps [N] and "
                         "time_bias [num_heads, num_buckets])")
    if timestamps is not None:
        _timestamps(timestamps, n, q.device, "q")
        _bias_table("time_bias", time_bias, (hq, 0), "num_buckets", q)
        _bucket_width(time_bucket_width)
    probability("dropout_p", dropout_p)


def num_tokens(x) -> int | None:
    """``N`` of the inputs ``x [N, ...]``, or ``None`` for what is no such tensor (its own check says why)."""
    return x.shape[0] if isinstance(x, torch.Tensor) and not x.is_nested and x.dim() else None


def block_structure(value, tokens: int | None, block_size_, block_size_of: str | None = None
                    ) -> tuple[torch.Tensor, int, BlockTable | None]:
    """``offsets`` as passed to an attention function, a tensor or a :class:`BlockLayout` (then ``block_size``
    must be left out or match it, and it must be built for the ``tokens`` of the inputs): ``(offsets, block_size,
    table)``, the table ``None`` where the call builds its own. ``block_size`` ``None`` means the layout's or the
    default; ``block_size_of`` names what set it where the caller did not pass it (a layer's, say)."""
    if not isinstance(value, BlockLayout):
        return contiguous_offsets(value), DEFAULT_BLOCK_SIZE if block_size_ is None else block_size_, None
    _layout_fields(value)
    if tokens is not None and value.num_tokens != tokens:
        raise ValueError(f"offsets is a BlockLayout built for N = {value.num_tokens} tokens, but the inputs have N = "
                         f"{tokens}")
    if block_size_ is not None and block_size_ != value.block_size:
        if block_size_of is not None:
            raise ValueError(f"offsets is a BlockLayout of {value.block_size}-token blocks, but {block_size_of} is "
                             f"{block_size_}: build it with block_layout(offsets, N, block_size={block_size_})")
        raise ValueError(f"block_size={block_size_!r} differs from the BlockLayout's {value.block_size}: leave "
                         "block_size out when passing a layout")
    # The kernels read a table of exactly these shapes (a program may read a group of slots without a bound).
    num_seqs = value.offsets.shape[0] - 1
    slots = max_blocks(value.num_tokens, num_seqs, value.block_size)
    if tuple(value.table.block_cum.shape) != (num_seqs,) or tuple(value.table.block_seq.shape) != (slots,):
        raise ValueError(f"the BlockLayout's table must have block_cum of shape [{num_seqs}] and block_seq of shape "
                         f"[{slots}] (as blockattn.block_layout builds it), got {list(value.table.block_cum.shape)} "
                         f"and {list(value.table.block_seq.shape)}")
    return contiguous_offsets(value.offsets), value.block_size, value.table


def _layout_fields(value: BlockLayout) -> None:
    """A :class:`BlockLayout`'s fields of the kinds :func:`blockattn.block_layout` gives them (a NamedTuple can be
    assembled by hand): :func:`_layout_field_values`, once per signature of the fields."""
    table = value.table
    block_cum, block_seq = table if isinstance(table, BlockTable) else (None, None)
    _layout_field_values(value.offsets, value.num_tokens, value.block_size, type(table), block_cum, block_seq,
                         value.timestamps, value.num_time_buckets, value.time_bucket_width)


@once_per_signature
def _layout_field_values(offsets_, num_tokens_, block_size_, table_type, block_cum, block_seq, timestamps,
                         num_time_buckets, time_bucket_width) -> None:
    """A layout's offsets, sizes and table (its type and tensors), and with timestamps its bucket count and width."""
    offsets(offsets_, name="the BlockLayout's offsets")
    token_count("the BlockLayout's num_tokens", num_tokens_)
    block_size(block_size_, "the BlockLayout's block_size")
    if table_type is not BlockTable or not all(isinstance(t, torch.Tensor) and t.dtype == torch.int32
                                               and t.device == offsets_.device for t in (block_cum, block_seq)):
        raise TypeError("the BlockLayout's table must be a BlockTable of two int32 tensors on the device of its "
                        "offsets, as blockattn.block_layout builds it")
    if timestamps is not None:
        positive_int("the BlockLayout's num_time_buckets", num_time_buckets)
        _bucket_width(time_bucket_width, "the BlockLayout's time_bucket_width")


def layout(offsets_, num_tokens, block) -> tuple:
    """The arguments of :func:`blockattn.block_layout`; returns ``(num_tokens, block_size)`` as the ops take them."""
    offsets(offsets_)
    num_tokens = token_count("num_tokens", num_tokens)
    some_sequence(offsets_, num_tokens, "num_tokens")
    return num_tokens, block_size(block)


# The checks of each public attention call, run once per signature of its arguments (once_per_signature).


@once_per_signature
def block_attention_call(q, k, v, offsets_, block, scale, angles, rotate, causal, pos_bias, timestamps, time_bias,
                         time_bucket_width, dropout_p, out_dtype, q_descale, k_descale, v_descale, out_scale) -> None:
    """A ``block_attention`` call on ``[N, H, D]`` tensors, once its layout is taken apart (:func:`block_structure`,
    :func:`layout_time_bias`) and nested inputs unpacked (:func:`unpack_nested`, :func:`jagged_values`)."""
    attention(q, k, v, offsets_, block, scale)
    rotary_args(angles, rotate, q)
    in_block(causal, pos_bias, timestamps, time_bias, time_bucket_width, dropout_p, q, block)
    fp8_inference(q, k, v, (q_descale, k_descale, v_descale), out_dtype_of(q.dtype, out_dtype), out_scale,
                  {"pos_bias": pos_bias, "time_bias": time_bias})


@once_per_signature
def qkv_block_attention_call(x, w, bias, num_heads, num_kv_heads, offsets_, block, scale, angles, rotate, causal,
                             pos_bias, timestamps, time_bias, time_bucket_width, dropout_p, x_descale, w_descale,
                             qkv_scale, out_dtype, out_scale) -> None:
    """A ``qkv_block_attention`` call, as :func:`block_attention_call`: the attention's arguments are checked from
    the shapes of the projection before it runs (views of a zero-stride tensor)."""
    from .custom_ops import split_heads  # custom_ops imports the dispatcher, which imports this module

    projection(x, w, bias, num_heads, num_kv_heads)
    tensor("offsets", offsets_)
    fp8_projection(x, w, bias, x_descale, w_descale, qkv_scale, out_dtype, out_scale)
    q, k, v = split_heads(x.new_empty(()).expand(x.shape[0], w.shape[1]), num_heads, num_kv_heads)
    attention(q, k, v, offsets_, block, scale)
    rotary_args(angles, rotate, q)
    in_block(causal, pos_bias, timestamps, time_bias, time_bucket_width, dropout_p, q, block)
    if x.dtype == FP8_DTYPE:
        fp8_inference(q, k, v, (qkv_scale,) * 3, out_dtype_of(x.dtype, out_dtype), out_scale,
                      {"pos_bias": pos_bias, "time_bias": time_bias})


@once_per_signature
def flash_call(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, causal_alignment, scale, return_lse,
               out_dtype, q_descale, k_descale, v_descale, variant) -> None:
    """A ``flash_attention`` call (``cu_q`` None) or a ``flash_attention_varlen`` one, forward only."""
    packed = cu_q is not None
    flash(q, k, v, packed=packed, causal=causal, causal_alignment=causal_alignment, scale=scale,
          return_lse=return_lse, out_dtype=out_dtype, descales=(q_descale, k_descale, v_descale), variant=variant)
    if packed:
        cu_seqlens(cu_q, cu_k, q, k, max_seqlen_q, max_seqlen_k)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("flash attention is forward only: q, k, v must not require grad (call it under "
                         "torch.no_grad() or detach them)")
