"""Implementations that `bench` times: blockattn and every alternative a user would otherwise reach for.

Each factory takes a :class:`Case` and returns a :class:`Runner`, or raises :class:`Unavailable` with the reason
shown in the report when it cannot run here (a package not installed, inputs its kernel does not take). Anything
else it raises, then or while it runs, the harness reports as a failure. The harness checks every runner's result
against blockattn's (or, where blockattn failed, the first result it got) before timing it, so a baseline that
computes something else never makes it into the table.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import blockattn
from blockattn.block_table import BlockTable, block_rows, build_block_table
from blockattn.custom_ops import split_heads
from blockattn.ops.tiles import ROTATE_ALL, ROTATE_NONE
from blockattn.reference import rotary_reference


class Unavailable(Exception):
    """This baseline cannot run here; the message says why."""


@dataclass
class Case:
    """One workload's inputs on the GPU, plus the block structure the baselines need (computed once, untimed)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    offsets: torch.Tensor
    block_size: int
    scale: float
    sinu_pos: torch.Tensor | None = None  # rotary angles [N, D] of rotary workloads
    projection: tuple[torch.Tensor, ...] | None = None  # (x, w, bias) of rotary workloads' qkv projection
    rows: torch.Tensor = field(init=False)  # [num_blocks, BS] token rows of each real block
    valid: torch.Tensor = field(init=False)  # [num_blocks, BS] which of them exist
    cu_blocks: torch.Tensor = field(init=False)  # int32 [num_blocks + 1]: one boundary per block
    table: BlockTable = field(init=False)

    def __post_init__(self):
        self.table = build_block_table(self.offsets, self.q.shape[0], self.block_size)
        rows, valid = block_rows(self.offsets, self.table, self.block_size)
        real = valid[:, 0]
        self.rows, self.valid = rows[real], valid[real]
        lengths = self.valid.sum(1, dtype=torch.int32)
        self.cu_blocks = torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)])

    @property
    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q, self.k, self.v

    @property
    def gqa(self) -> bool:
        return self.q.shape[1] != self.k.shape[1]


@dataclass
class Runner:
    """What the harness times and checks.

    ``fwd()``, ``bwd()`` (from a saved forward) and ``fwdbwd()`` are timed; ``check()`` returns
    ``(out, dq, dk, dv)`` in the ``[N, H, D]`` layout for the exactness check and the accuracy report. ``extra``
    holds work the runner needs but that is reported apart (padding, mask building), keyed by what it is.
    """

    fwd: Callable[[], object]
    bwd: Callable[[], object]
    fwdbwd: Callable[[], object]
    check: Callable[[], tuple[torch.Tensor, ...]]
    extra: dict[str, Callable[[], object]] = field(default_factory=dict)


def autograd_runner(forward: Callable[..., torch.Tensor], inputs, do, to_tokens=lambda x: x, **extra) -> Runner:
    """Runner for anything differentiable: ``forward(q, k, v) -> out``; ``to_tokens`` maps results to [N, H, D]."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    saved = forward(*leaves)

    def fwdbwd():
        out = forward(*leaves)
        return (out, *torch.autograd.grad(out, leaves, do))

    return Runner(
        fwd=lambda: forward(*inputs),
        bwd=lambda: torch.autograd.grad(saved, leaves, do, retain_graph=True),
        fwdbwd=fwdbwd,
        check=lambda: tuple(to_tokens(t) for t in fwdbwd()),
        **extra,
    )


def blockattn_runner(case: Case) -> Runner:
    def forward(q, k, v):
        return blockattn.block_attention(q, k, v, case.offsets, block_size=case.block_size, scale=case.scale)

    runner = autograd_runner(forward, case.inputs, case.do)
    # The backward op alone, as autograd calls it on the forward's block table (the forward op's, or an eager
    # forward's on more than 64 sequences): no graph bookkeeping.
    runner.bwd = lambda: torch.ops.blockattn.block_attention_bwd(
        grad_out=case.do, q=case.q, k=case.k, v=case.v, offsets=case.offsets, sinu_pos=None, **case.table._asdict(),
        block_size=case.block_size, scale=case.scale, rotate=ROTATE_NONE,
    )
    return runner


NEEDS_GPU = "needs a CUDA GPU"


def flash_build_reason() -> str | None:
    """Why this torch build cannot run PyTorch's FlashAttention kernels (aten's and SDPA's), or ``None``."""
    return None if torch.backends.cuda.is_flash_attention_available() else "this torch build has no FlashAttention"


def fa2_reason(device: torch.device) -> str | None:
    """Why aten's FlashAttention-2 cannot run on ``device``, or ``None``: it needs an NVIDIA GPU from Ampere on and
    a torch build that includes it."""
    if device.type != "cuda":
        return NEEDS_GPU
    if reason := flash_build_reason():
        return reason
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "needs compute capability 8.0+ (Ampere)"
    return None


def require_fa2(case: Case) -> None:
    """Raise :class:`Unavailable` where aten's FlashAttention-2 cannot take ``case``."""
    if reason := fa2_reason(case.q.device):
        raise Unavailable(f"FlashAttention-2 {reason}")
    if case.q.dtype not in (torch.float16, torch.bfloat16):
        raise Unavailable(f"FlashAttention-2 takes fp16/bf16, not {case.q.dtype}")


def flash2_aten_runner(case: Case) -> Runner:
    """PyTorch's own FlashAttention-2 build with one ``cu_seqlens`` boundary per block: exactly block-diagonal."""
    require_fa2(case)
    cu, bs = case.cu_blocks, case.block_size

    def forward(q, k, v):
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, bs, bs, 0.0, False, False, scale=case.scale)

    def backward(out, lse, rng, unused):
        return torch.ops.aten._flash_attention_backward(
            case.do, case.q, case.k, case.v, out, lse, cu, cu, bs, bs, 0.0, False, rng, unused, scale=case.scale
        )

    saved = forward(*case.inputs)

    def fwdbwd():
        out, lse, rng, unused, _ = forward(*case.inputs)
        return (out, *backward(out, lse, rng, unused))

    return Runner(fwd=lambda: forward(*case.inputs)[0], bwd=lambda: backward(*saved[:4]), fwdbwd=fwdbwd,
                  check=fwdbwd)


def sdpa_refusal(backend: torch.nn.attention.SDPBackend, q, k, v, mask, gqa: bool) -> str | None:
    """Which of torch's own checks says SDPA's fused ``backend`` would not take these inputs; ``None`` if it would.
    The math backend takes everything."""
    can_use = {
        torch.nn.attention.SDPBackend.FLASH_ATTENTION: torch.backends.cuda.can_use_flash_attention,
        torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.can_use_efficient_attention,
        torch.nn.attention.SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.can_use_cudnn_attention,
    }.get(backend)
    if can_use is None:
        return None
    # Without debug: its reasons go to the C++ log, not to Python, and would only clutter the output.
    if can_use(torch.backends.cuda.SDPAParams(q, k, v, mask, 0.0, False, gqa), debug=False):
        return None
    return f"torch.backends.cuda.{can_use.__name__} says no (shapes, dtype, GQA or mask)"


def padded_sdpa_runner(backend: torch.nn.attention.SDPBackend) -> Callable[[Case], Runner]:
    """SDPA on ``[num_blocks, H, BS, D]`` padded blocks; padded keys are masked out, so the result is exact."""

    def make(case: Case) -> Runner:
        from torch.nn.attention import sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        n = case.q.shape[0]
        gather_rows = torch.where(case.valid, case.rows, n)  # row n is a zero row appended for the padding
        all_full = bool(case.valid.all())
        if backend == torch.nn.attention.SDPBackend.FLASH_ATTENTION and not all_full:
            raise Unavailable("takes no mask, and partial blocks need their padded keys masked out")
        mask = None if all_full else case.valid[:, None, None, :]

        def pad(x):
            return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[gather_rows].transpose(1, 2)

        def unpad(blocks):
            out = blocks.new_empty(n + 1, *blocks.shape[1:2], blocks.shape[-1])
            out[gather_rows.flatten()] = blocks.transpose(1, 2).flatten(0, 1)
            return out[:n]

        def attention(q, k, v):
            with sdpa_kernel(backend):
                return sdpa(q, k, v, attn_mask=mask, scale=case.scale, enable_gqa=case.gqa)

        padded = [pad(t) for t in case.inputs]
        with sdpa_kernel(backend):
            if reason := sdpa_refusal(backend, *padded, mask, case.gqa):
                raise Unavailable(f"refused these inputs: {reason}")
        runner = autograd_runner(attention, padded, pad(case.do), to_tokens=unpad)
        runner.extra = {
            "pad q,k,v + unpad out": lambda: [pad(t) for t in case.inputs] + [unpad(padded[0])],
            "pad do + unpad dq,dk,dv": lambda: [pad(case.do)] + [unpad(t) for t in padded],
        }
        return runner

    return make


FLEX_TILE = 128


def flex_block_mask(case: Case):
    """FlexAttention block mask over all tokens as one sequence: query and key in the same block.

    Built from the known structure rather than by evaluating the mask everywhere: a 128-query tile can only meet
    keys in its own and the two neighbouring 128-key tiles, and the ``mask_mod`` decides the pattern inside them.
    """
    from torch.nn.attention.flex_attention import BlockMask

    n, device = case.q.shape[0], case.q.device
    num_tiles = -(-n // FLEX_TILE)
    block_id = torch.empty(n, dtype=torch.int32, device=device)
    ids = torch.arange(case.rows.shape[0], dtype=torch.int32, device=device)
    block_id[case.rows[case.valid]] = ids[:, None].expand_as(case.rows)[case.valid]
    neighbours = torch.arange(num_tiles, device=device)[:, None] + torch.tensor([-1, 0, 1], device=device)
    in_range = (neighbours >= 0) & (neighbours < num_tiles)
    # Valid tiles first, as BlockMask expects; it wants one column per kv tile, the tail is never read.
    order = torch.argsort((~in_range).int(), dim=1, stable=True)
    kv_indices = torch.zeros(num_tiles, num_tiles, dtype=torch.int32, device=device)
    kv_indices[:, : min(3, num_tiles)] = torch.gather(neighbours.clamp(0, num_tiles - 1), 1, order)[:, :num_tiles]
    kv_num_blocks = in_range.sum(1, dtype=torch.int32)

    def same_block(b, h, q_idx, kv_idx):
        return block_id[q_idx] == block_id[kv_idx]

    return BlockMask.from_kv_blocks(kv_num_blocks[None, None], kv_indices[None, None], BLOCK_SIZE=FLEX_TILE,
                                    mask_mod=same_block, seq_lengths=(n, n))


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[N, H, D]`` -> ``[1, H, N, D]``, a view."""
    return x.transpose(0, 1).unsqueeze(0)


def flex_runner(case: Case) -> Runner:
    """FlexAttention (compiled) with :func:`flex_block_mask`; building the mask is reported apart."""
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = flex_block_mask(case)
    # The harness replays one backward many times (retain_graph), which donated buffers forbid.
    torch._functorch.config.donated_buffer = False
    compiled = torch.compile(flex_attention, dynamic=False)

    def attention(q, k, v):
        out = compiled(heads_first(q), heads_first(k), heads_first(v), block_mask=block_mask, scale=case.scale,
                       enable_gqa=case.gqa)
        return out.squeeze(0).transpose(0, 1)  # back to [N, H, D], a view

    runner = autograd_runner(attention, case.inputs, case.do)
    runner.extra = {"build block mask": lambda: flex_block_mask(case)}
    return runner


def _import(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise Unavailable(f"`{module}` is not installed ({error})") from None


def installed(module: str) -> bool:
    """Whether ``module`` is there to import, without importing it (a dotted name imports its parents only)."""
    try:
        return all(importlib.util.find_spec(name) is not None for name in (module.partition(".")[0], module))
    except ImportError:  # a parent package that is there but fails to import
        return False


def flash_attn_package_runner(module: str, function: str) -> Callable[[Case], Runner]:
    """The ``flash_attn`` packages' varlen functions (FA2 ``flash_attn``, FA3 ``flash_attn_interface``,
    FA4 ``flash_attn.cute``), one ``cu_seqlens`` boundary per block."""

    def make(case: Case) -> Runner:
        varlen = getattr(_import(module), function)
        cu, bs = case.cu_blocks, case.block_size

        def forward(q, k, v):
            out = varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=bs, max_seqlen_k=bs,
                         softmax_scale=case.scale)
            return out[0] if isinstance(out, tuple) else out

        return autograd_runner(forward, case.inputs, case.do)

    return make


def xformers_runner(case: Case) -> Runner:
    memory_efficient_attention = _import("xformers.ops").memory_efficient_attention
    BlockDiagonalMask = _import("xformers.ops.fmha.attn_bias").BlockDiagonalMask

    if case.gqa:
        raise Unavailable("GQA needs xformers' 5-D layout; not wired here")
    block_lengths = case.valid.sum(1).tolist()
    bias = BlockDiagonalMask.from_seqlens(block_lengths)

    def forward(q, k, v):
        return memory_efficient_attention(q[None], k[None], v[None], attn_bias=bias, scale=case.scale)[0]

    runner = autograd_runner(forward, case.inputs, case.do)
    runner.extra = {"build BlockDiagonalMask": lambda: BlockDiagonalMask.from_seqlens(block_lengths)}
    return runner


def _sdpa(name: str):
    return padded_sdpa_runner(getattr(torch.nn.attention.SDPBackend, name))


# The module each flash_attn baseline calls ``flash_attn_varlen_func`` of.
FLASH_ATTN_MODULES = {"flash_attn FA2": "flash_attn", "flash_attn FA3": "flash_attn_interface",
                      "flash_attn FA4": "flash_attn.cute"}

# Name shown in the report -> factory. FlashAttention-2 (aten) is the reference for the speedups.
BASELINES: dict[str, Callable[[Case], Runner]] = {
    "FA2 varlen (aten)": flash2_aten_runner,
    "SDPA cuDNN padded": _sdpa("CUDNN_ATTENTION"),
    "SDPA flash padded": _sdpa("FLASH_ATTENTION"),
    "SDPA mem-eff padded": _sdpa("EFFICIENT_ATTENTION"),
    "FlexAttention": flex_runner,
    "xformers BlockDiagonalMask": xformers_runner,
    **{name: flash_attn_package_runner(module, "flash_attn_varlen_func")
       for name, module in FLASH_ATTN_MODULES.items()},
}
REFERENCE_BASELINE = "FA2 varlen (aten)"


def _package(module: str) -> Callable[[], str | None]:
    return lambda: None if installed(module) else f"`{module}` not installed"


# What each baseline needs besides a CUDA GPU, as checks that run nothing (for `blockattn info`).
NEEDS: dict[str, Callable[[], str | None]] = {
    "FA2 varlen (aten)": flash_build_reason,
    "SDPA cuDNN padded": lambda: None if torch.backends.cudnn.is_available() else "this torch build has no cuDNN",
    "SDPA flash padded": flash_build_reason,
    "SDPA mem-eff padded": lambda: None,
    "FlexAttention": lambda: None if installed("torch.nn.attention.flex_attention")
    else "needs torch.nn.attention.flex_attention (torch 2.5+)",
    "xformers BlockDiagonalMask": _package("xformers"),
    **{name: _package(module) for name, module in FLASH_ATTN_MODULES.items()},
}


def why_not_here(name: str) -> str | None:
    """Why baseline ``name`` cannot run on this machine, or ``None`` where it may; cheap checks only, nothing runs.
    Whether it takes a workload's inputs is known when the bench runs it."""
    reasons = [r for r in (None if torch.cuda.is_available() else NEEDS_GPU, NEEDS[name]()) if r]
    return "; ".join(reasons) or None


# --- rotary workloads: rotary fused into attention, and projection + rotary + attention -----------------------------


def torch_rotary(x: torch.Tensor, sinu_pos: torch.Tensor) -> torch.Tensor:
    """The plain PyTorch rotary (the reference formula) in the inputs' dtype, as an unfused model runs it."""
    return rotary_reference(x, sinu_pos, compute_dtype=x.dtype)


def blockattn_attention(case: Case) -> Callable[..., torch.Tensor]:
    return lambda q, k, v: blockattn.block_attention(q, k, v, case.offsets, block_size=case.block_size,
                                                     scale=case.scale)


def fa2_attention(case: Case) -> Callable[..., torch.Tensor]:
    """Differentiable FlashAttention-2 (aten) with one boundary per block."""
    require_fa2(case)
    cu, bs = case.cu_blocks, case.block_size
    return lambda q, k, v: torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, bs, bs, 0.0, False, False,
                                                                   scale=case.scale)[0]


def fused_rotary_runner(case: Case) -> Runner:
    def forward(q, k, v):
        return blockattn.block_attention(q, k, v, case.offsets, block_size=case.block_size, scale=case.scale,
                                         sinu_pos=case.sinu_pos)

    runner = autograd_runner(forward, case.inputs, case.do)
    runner.bwd = lambda: torch.ops.blockattn.block_attention_bwd(
        grad_out=case.do, q=case.q, k=case.k, v=case.v, offsets=case.offsets, sinu_pos=case.sinu_pos,
        **case.table._asdict(), block_size=case.block_size, scale=case.scale, rotate=ROTATE_ALL,
    )
    return runner


def unfused_rotary_runner(attention, rotary) -> Callable[[Case], Runner]:
    """``rotary`` on q, k, v, then ``attention``; the backward is autograd's: attention's, then the rotary's."""

    def make(case: Case) -> Runner:
        attend = attention(case)

        def forward(q, k, v):
            return attend(*(rotary(t, case.sinu_pos) for t in (q, k, v)))

        return autograd_runner(forward, case.inputs, case.do)

    return make


def qkv_runner(case: Case) -> Runner:
    hq, hkv = case.q.shape[1], case.k.shape[1]

    def forward(x, w, bias):
        return blockattn.qkv_block_attention(x, w, case.offsets, num_heads=hq, num_kv_heads=hkv,
                                             sinu_pos=case.sinu_pos, bias=bias, block_size=case.block_size,
                                             scale=case.scale)

    return autograd_runner(forward, case.projection, case.do)


def unfused_qkv_runner(attention) -> Callable[[Case], Runner]:
    """``x @ w + bias``, split into q, k, v, PyTorch rotary, then ``attention``; all through autograd."""

    def make(case: Case) -> Runner:
        attend = attention(case)
        hq, hkv = case.q.shape[1], case.k.shape[1]

        def forward(x, w, bias):
            heads = split_heads(torch.addmm(bias, x, w), hq, hkv)
            return attend(*(torch_rotary(t, case.sinu_pos) for t in heads))

        return autograd_runner(forward, case.projection, case.do)

    return make


ROTARY_IMPLS: dict[str, Callable[[Case], Runner]] = {
    "blockattn fused rotary": fused_rotary_runner,
    "blockattn + blockattn.apply_rotary": unfused_rotary_runner(blockattn_attention, blockattn.apply_rotary),
    "blockattn + torch rotary": unfused_rotary_runner(blockattn_attention, torch_rotary),
    "FA2 varlen + torch rotary": unfused_rotary_runner(fa2_attention, torch_rotary),
}
ROTARY_REFERENCE = "FA2 varlen + torch rotary"
QKV_IMPLS: dict[str, Callable[[Case], Runner]] = {
    "blockattn qkv_block_attention": qkv_runner,
    "matmul + torch rotary + blockattn": unfused_qkv_runner(blockattn_attention),
    "matmul + torch rotary + FA2 varlen": unfused_qkv_runner(fa2_attention),
}
QKV_REFERENCE = "matmul + torch rotary + FA2 varlen"
