"""Benchmark workloads: the presets (docs/semantics.md, "Workloads") and custom shapes."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Workload:
    """A jagged batch: ``num_seqs`` lengths drawn uniformly from ``[min_len, max_len)``."""

    name: str
    num_seqs: int
    min_len: int
    max_len: int
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int = 64
    dtype: str = "bfloat16"
    rotary: bool = False  # also time rotary fused into attention, and the whole projection + rotary + attention

    def __post_init__(self):
        if not 0 < self.min_len < self.max_len:
            raise ValueError(f"{self.name}: lengths need 0 < min_len < max_len, got [{self.min_len}, {self.max_len})")
        if self.num_seqs < 1 or self.heads < 1 or self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: need num_seqs >= 1 and heads a positive multiple of kv_heads")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def lengths(self, seed: int = 0) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(self.min_len, self.max_len, (self.num_seqs,), generator=generator)

    def offsets(self, seed: int = 0, device: str = "cpu") -> torch.Tensor:
        lengths = self.lengths(seed)
        return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(device=device, dtype=torch.int32)

    def to_dict(self) -> dict:
        return asdict(self)


def lengths_for_sparsity(max_len: int, sparsity: float) -> tuple[int, int]:
    """``[min_len, max_len)`` for a "sparsity", which is a density: mean length ``sparsity * max_len``
    (docs/semantics.md, "Workloads").

    ``s >= 0.5``: lengths uniform in ``[(2s - 1) * max, max)`` (at least 1); ``s < 0.5``: in ``[1, 2s * max)``.
    Where ``(2s - 1) * max`` rounds to ``max`` (``s = 1``) that range is empty, and every length is ``max``.
    """
    if not 0 < sparsity <= 1:
        raise ValueError(f"sparsity must be in (0, 1], got {sparsity}")
    if sparsity >= 0.5:
        low = max(1, round((2 * sparsity - 1) * max_len))
        return (low, max_len) if low < max_len else (max_len, max_len + 1)
    return 1, max(2, round(2 * sparsity * max_len))


PRESETS = {
    w.name: w
    for w in (
        Workload("ads", 1152, 800, 2000, 4, 4, 128),
        # 1.74 M tokens, mean ~1506: uniform in [1012, 2000) (sparsity 0.753 of 2000).
        Workload("ads-rotary", 1152, 1012, 2000, 3, 3, 128, rotary=True),
        Workload("ads-d64", 1152, 800, 2000, 4, 4, 64),
        Workload("long", 1152, 1, 8192, 2, 2, 128),
        Workload("short", 4096, 1, 307, 8, 8, 64),
    )
}

# What `bench` runs on a machine without a GPU: small enough for the CPU path.
CPU_DEMO = Workload("cpu-demo", 8, 1, 300, 2, 2, 64, dtype="float32")
