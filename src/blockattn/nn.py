"""``torch.nn`` layers built on the ops: :class:`BlockSelfAttention`, and the rotary angles it computes.

``blockattn.nn.BlockSelfAttention``, as ``torch.nn.Linear``.
"""

from __future__ import annotations

import torch
from torch import nn

from . import checks
from .attention import qkv_block_attention
from .block_table import BlockLayout


def sequence_ids(offsets: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The sequence each of the ``num_tokens`` packed tokens belongs to, int64 ``[N]``; on the device, no host sync
    (length-0 sequences own no token)."""
    tokens = torch.arange(num_tokens, device=offsets.device, dtype=offsets.dtype)
    # Not searchsorted(offsets[1:], ...): Inductor misreads a sliced boundary tensor (pytorch#182343). The clamp, a
    # no-op for valid offsets, bounds the index for Inductor, which otherwise asserts on the GPU (pytorch#186536).
    return (torch.searchsorted(offsets, tokens, right=True) - 1).clamp(0, offsets.shape[0] - 2)


def positions_in_sequence(offsets: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Each token's position inside its own sequence, int64 ``[N]`` (``0`` at every sequence's first token)."""
    tokens = torch.arange(num_tokens, device=offsets.device, dtype=torch.int64)
    return tokens - offsets.long()[sequence_ids(offsets, num_tokens)]


def rotary_sinu_pos(offsets: torch.Tensor, num_tokens: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """``sinu_pos = [sin | cos]``, fp32 ``[N, head_dim]``, of each token's position inside its sequence.

    The angle of pair ``i`` (columns ``2i, 2i+1``, see :func:`blockattn.apply_rotary`) at position ``p`` is
    ``p * base ** (-2i / head_dim)``. Computed on ``offsets``' device from ``num_tokens`` (a shape), so it reads no
    tensor value on the host: safe under ``torch.compile``, ``torch.export`` and CUDA-graph capture.
    """
    pos = positions_in_sequence(offsets, num_tokens).float()
    pair = torch.arange(head_dim // 2, device=offsets.device, dtype=torch.float32)
    theta = pos[:, None] * torch.pow(float(base), -2.0 * pair / head_dim)[None, :]
    return torch.cat([theta.sin(), theta.cos()], dim=1)


class BlockSelfAttention(nn.Module):
    """Self-attention of jagged sequences within blocks: projection, rotary, block attention, output projection.

    ``forward(x, offsets)`` takes ``x [N, d_model]`` (all sequences packed back to back) with ``offsets [B + 1]``,
    or a ``torch.jagged`` nested tensor ``[B, j, d_model]`` alone, and returns the same kind. Each token attends to
    the tokens of its own block of ``block_size`` (:func:`blockattn.block_attention`). The q/k/v projection, the
    rotary and the attention run fused in :func:`blockattn.qkv_block_attention`; the rotary angles are each token's
    position inside its own sequence, computed on the device (:func:`rotary_sinu_pos`).

    Args:
        d_model: model width.
        num_heads: query heads ``Hq``.
        num_kv_heads: key/value heads ``Hkv`` (``num_heads`` by default; ``num_heads % num_kv_heads == 0``).
        head_dim: ``D``, a multiple of 8 in [16, 256]; ``d_model // num_heads`` by default.
        block_size: 16, 32, 64 or 128.
        rotary: apply the rotary position embedding.
        rotate: which of ``"q"``, ``"k"``, ``"v"`` it turns (standard RoPE: ``("q", "k")``).
        rotary_base: the angle of pair ``i`` at position ``p`` is ``p * rotary_base ** (-2i / head_dim)``.
        bias: biases in both projections.
        causal: within each block, a token attends to itself and the tokens before it only.
        dropout: attention dropout on the probabilities inside the kernels (``dropout_p`` of
            :func:`blockattn.block_attention`), applied in training mode only.
        device, dtype: of the parameters.

    Parameters: ``qkv``, an ``nn.Linear(d_model, (Hq + 2 Hkv) * D)`` whose outputs are ``[q heads | k heads |
    v heads]``, and ``out``, an ``nn.Linear(Hq * D, d_model)``: the state dict is that of these two Linears.
    ``forward`` reads ``qkv``'s parameters directly (it does not call ``qkv``), so wrap this module or a parent
    with FSDP's ``fully_shard``, not ``qkv`` alone. Under ``torch.autocast`` the projection and the attention run
    in the autocast dtype.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        block_size: int = 64,
        rotary: bool = True,
        rotate: tuple[str, ...] = ("q", "k"),
        rotary_base: float = 10000.0,
        bias: bool = True,
        causal: bool = False,
        dropout: float = 0.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        d_model = checks.positive_int("d_model", d_model)
        num_heads = checks.positive_int("num_heads", num_heads)
        num_kv_heads = checks.positive_int("num_kv_heads", num_heads if num_kv_heads is None else num_kv_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads must be a multiple of num_kv_heads (GQA), got num_heads={num_heads}, "
                             f"num_kv_heads={num_kv_heads}")
        if head_dim is None:
            if d_model % num_heads:
                raise ValueError(f"d_model must be divisible by num_heads when head_dim is None, got d_model="
                                 f"{d_model}, num_heads={num_heads}; pass head_dim")
            head_dim = d_model // num_heads
        head_dim = checks.positive_int("head_dim", head_dim)
        checks.head_dim(head_dim)
        block_size = checks.block_size(block_size)
        checks.rotate_mask(rotate)
        rotary_base = checks.finite_positive("rotary_base", rotary_base)
        dropout = checks.probability("dropout", dropout)
        checks.flag("causal", causal)
        checks.flag("rotary", rotary)
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, num_heads, num_kv_heads, head_dim
        self.block_size, self.rotary, self.rotate = block_size, rotary, tuple(rotate)
        self.rotary_base, self.causal, self.dropout = float(rotary_base), causal, float(dropout)
        factory = {"device": device, "dtype": dtype}
        self.qkv = nn.Linear(d_model, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias, **factory)
        self.out = nn.Linear(num_heads * head_dim, d_model, bias=bias, **factory)

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default initialisation of both projections."""
        self.qkv.reset_parameters()
        self.out.reset_parameters()

    def extra_repr(self) -> str:
        rotary = f"rotary_base={self.rotary_base}, rotate={self.rotate}" if self.rotary else "rotary=False"
        return (f"d_model={self.d_model}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, block_size={self.block_size}, {rotary}, causal={self.causal}, "
                f"dropout={self.dropout}")

    def attend(self, x: torch.Tensor, offsets: torch.Tensor | BlockLayout) -> torch.Tensor:
        """The attention heads before the output projection: ``[N, Hq, D]`` of ``x [N, d_model]``; ``offsets`` may
        be a :class:`blockattn.BlockLayout` of this layer's ``block_size``."""
        checks.float_tensor("x", x, 2, "[N, d_model]")
        if x.shape[1] != self.d_model:
            raise ValueError(f"x must be [N, d_model={self.d_model}], got {tuple(x.shape)}")
        boundaries = checks.block_structure(offsets, x.shape[0], self.block_size, "this layer's block_size")[0]
        checks.offsets(boundaries, x, "x")  # before the angles are computed from it
        checks.some_sequence(boundaries, x.shape[0], "x's N")
        w, bias = self.qkv.weight, self.qkv.bias
        # (meta tensors have no autocast: asking whether it is on raises)
        if x.device.type != "meta" and torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w = x.to(dtype), w.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        elif x.dtype != w.dtype:
            raise TypeError(f"x must have the dtype of the layer's parameters ({w.dtype}) outside torch.autocast, "
                            f"got {x.dtype}")
        sinu_pos = None
        if self.rotary:
            sinu_pos = rotary_sinu_pos(boundaries, x.shape[0], self.head_dim, self.rotary_base)
        # a layout as it is (its table is built), offsets as checked (a strided tensor copied once, here)
        offsets = offsets if isinstance(offsets, BlockLayout) else boundaries
        return qkv_block_attention(x, w.t(), offsets, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                   sinu_pos=sinu_pos, bias=bias, block_size=self.block_size,
                                   rotate=self.rotate, causal=self.causal,
                                   dropout_p=self.dropout if self.training else 0.0)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor | BlockLayout | None = None) -> torch.Tensor:
        """``x [N, d_model]`` with ``offsets [B + 1]`` (or their :func:`blockattn.block_layout`, built once per
        batch and shared by every layer), or a jagged nested ``x [B, j, d_model]``; returns the same kind,
        ``d_model`` wide."""
        if isinstance(x, torch.Tensor) and x.is_nested:
            if offsets is not None:
                raise ValueError("offsets must be None when x is a nested tensor (its own offsets are used)")
            if x.layout != torch.jagged:
                raise ValueError(f"x, when nested, must be a torch.jagged tensor [B, j, d_model], got layout "
                                 f"{x.layout}")
            if x.dim() != 3 or x._ragged_idx != 1:
                raise ValueError(f"x, when nested, must be a torch.jagged tensor [B, j, d_model], got {x.shape}")
            checks.without_holes("x", x)
            out = self.out(self.attend(x.values(), x.offsets()).flatten(1))
            return torch.nested.nested_tensor_from_jagged(out, x.offsets(), min_seqlen=x._maybe_min_seqlen,
                                                          max_seqlen=x._maybe_max_seqlen)
        if offsets is None:
            raise TypeError("offsets is required when x is an [N, d_model] tensor")
        return self.out(self.attend(x, offsets).flatten(1))
