#!/usr/bin/env python
"""Train a small ads-ranking model on jagged user histories with ``blockattn.nn.BlockSelfAttention``.

Each example is one user: a history of events (item id, action id) of any length, and a candidate ad (an item id)
with a click label. The item id, the item's category (a catalogue feature the model looks up) and the action id are
embedded and summed, a stack of pre-norm residual layers (block self-attention, then an MLP) runs over all
histories packed back to back (``[N, d_model]`` with ``offsets``), each history is mean-pooled (on the device, no
host sync), and a head scores the pooled history against the candidate's embedding: the click logit.

The synthetic data are a pure function of ``(--seed, step, sequence index, position)`` through an integer hash,
computed on the device: any rank makes any part of any batch without a generator state, so the data position of a
checkpoint is its step. Lengths follow the ``ads`` bench preset (uniform in [800, 2000), 1152 sequences per batch;
``--scale`` multiplies the number of sequences). Every user has a hidden preference over item categories; events
are impressions (action 0, any category) or engagements (actions 1..3, drawn from the preference); the click
probability of the candidate grows with the user's preference for its category. The data loader reports the
labels' base-rate entropy and the loss of the true click probabilities (the best any model can do): a model that
learns gets between the two.

    python examples/train_ranking.py --device cpu --scale 0.05 --min-len 20 --max-len 200 --num-categories 4 \
        --d-model 64 --heads 2 --head-dim 32 --steps 100                                        # ~15 s on a CPU
    python examples/train_ranking.py --device cuda --dtype bfloat16 --steps 300              # ads preset, 1 GPU
    torchrun --nproc_per_node=2 examples/train_ranking.py --device cuda --dtype bfloat16      # DDP (NCCL)
    torchrun --nproc_per_node=2 examples/train_ranking.py --device cuda --dtype bfloat16 --fsdp   # FSDP2
    python examples/train_ranking.py ... --ckpt runs/a --save-every 50     # then --resume continues the same curve
    python examples/train_ranking.py ... --export runs/ranker.pt2 [--aoti]  # torch.export (and AOTInductor)

Under ``torchrun`` every rank builds its own shard of each global batch: the batch's sequences, sorted by length,
are dealt to the rank with the fewest tokens so far (deterministic, the same on every rank), and the loss is
normalised by the global number of sequences, so the gradients equal those of one process on the whole batch.
The last line on stdout is a JSON summary (tokens/s, losses, AUC) of the run.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from blockattn import BlockLayout, block_layout
from blockattn.nn import BlockSelfAttention, positions_in_sequence, sequence_ids

# The `ads` preset of the bench (blockattn.bench.presets.PRESETS["ads"]): 1152 sequences of [800, 2000) tokens.
ADS_SEQS, ADS_MIN_LEN, ADS_MAX_LEN = 1152, 800, 2000
EVAL_STEP0 = 1 << 30  # held-out batches are those of steps EVAL_STEP0, EVAL_STEP0 + 1, ...: never trained on

# --------------------------------------------------------------------------------------------------------------------
# Synthetic data: a counter-based hash (lowbias32), exact in int64 on any device.
# --------------------------------------------------------------------------------------------------------------------

M32 = 0xFFFFFFFF
# Independent random streams of one (seed, step).
S_LENGTH, S_PREFERENCE, S_ACTION, S_CATEGORY, S_ITEM, S_TARGET, S_LABEL = range(7)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for ``0 <= x < 2**32`` in int64 without overflow (16-bit halves)."""
    return (((((x >> 16) * c) & 0xFFFF) << 16) + (x & 0xFFFF) * c) & M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hash32(*keys) -> torch.Tensor:
    """A 32-bit hash of the keys (ints, or int64 tensors broadcast together), in ``[0, 2**32)``: an int64 tensor on
    the tensors' device (Python ints stay on the host: no copy to the device)."""
    h = 0x3C6EF372
    for key in keys:
        h = _mix32((h + 0x9E3779B9 + _mix32(key & M32)) & M32)
    return h


def uniform(h: torch.Tensor) -> torch.Tensor:
    """fp32 in ``[0, 1)`` from a hash (its top 24 bits)."""
    return (h >> 8).float() * 2.0**-24


def normal(h1: torch.Tensor, h2: torch.Tensor) -> torch.Tensor:
    """Standard normal from two hashes (Box-Muller)."""
    return torch.sqrt(-2.0 * torch.log1p(-uniform(h1))) * torch.cos(2 * math.pi * uniform(h2))


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device`` without stalling the host (pinned memory, asynchronous copy)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class Batch:
    """One rank's part of a batch: packed histories and one candidate (target item, label) per sequence."""

    item_ids: torch.Tensor  # int64 [N]
    action_ids: torch.Tensor  # int64 [N]
    offsets: torch.Tensor  # int32 [B + 1]
    target_ids: torch.Tensor  # int64 [B]
    labels: torch.Tensor  # fp32 [B], 0 or 1
    click_prob: torch.Tensor  # fp32 [B], the true probability the labels were drawn with
    num_tokens: int  # N, known on the host

    @property
    def model_inputs(self) -> tuple[torch.Tensor, ...]:
        return self.item_ids, self.action_ids, self.offsets, self.target_ids


class SyntheticAds:
    """The batches of one data set: ``lengths(step)`` on the host, ``batch(step, seqs)`` on the device."""

    def __init__(self, seed: int, num_seqs: int, min_len: int, max_len: int, num_items: int, num_actions: int,
                 num_categories: int, preference_scale: float = 2.0, affinity: float = 2.0, click_bias: float = -1.0):
        if not 1 <= min_len < max_len or num_seqs < 1:
            raise ValueError(f"need num_seqs >= 1 and 1 <= min_len < max_len, got {num_seqs}, [{min_len}, {max_len})")
        if num_items < num_categories or num_actions < 2:
            raise ValueError("need num_items >= num_categories and num_actions >= 2")
        self.seed, self.num_seqs, self.min_len, self.max_len = seed, num_seqs, min_len, max_len
        self.num_items, self.num_actions, self.num_categories = num_items, num_actions, num_categories
        self.items_per_category = num_items // num_categories  # item i is of category i % num_categories
        self.preference_scale, self.affinity, self.click_bias = preference_scale, affinity, click_bias

    def lengths(self, step: int) -> torch.Tensor:
        """int64 ``[num_seqs]`` on the CPU: uniform in ``[min_len, max_len)``."""
        u = uniform(hash32(self.seed, step, S_LENGTH, torch.arange(self.num_seqs)))
        return self.min_len + (u.double() * (self.max_len - self.min_len)).long()

    def batch(self, step: int, seqs: torch.Tensor, lengths: torch.Tensor, device) -> Batch:
        """The sequences ``seqs`` (global indices, CPU int64) of batch ``step``, whose lengths are ``lengths``."""
        k = (self.seed, step)
        num_tokens = int(lengths.sum())
        offsets = _to_device(torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).int(), device)
        seqs = _to_device(seqs, device)
        local = sequence_ids(offsets, num_tokens)
        seq = seqs[local]  # the global sequence index of each token: the same data on any number of ranks
        pos = positions_in_sequence(offsets, num_tokens)
        cats = torch.arange(self.num_categories, device=device)
        # Each user's hidden preference over categories.
        preference = torch.softmax(self.preference_scale * normal(
            hash32(*k, S_PREFERENCE, seqs[:, None], cats, 0),
            hash32(*k, S_PREFERENCE, seqs[:, None], cats, 1)), dim=1)  # [B, C]
        action = hash32(*k, S_ACTION, seq, pos) % self.num_actions
        u = uniform(hash32(*k, S_CATEGORY, seq, pos))
        preferred = torch.searchsorted(preference.cumsum(1)[local], u[:, None]).squeeze(1)
        category = torch.where(action == 0, (u * self.num_categories).long(), preferred)
        category = category.clamp(max=self.num_categories - 1)
        item = category + self.num_categories * (hash32(*k, S_ITEM, seq, pos) % self.items_per_category)
        target = hash32(*k, S_TARGET, seqs) % (self.num_categories * self.items_per_category)
        liking = self.num_categories * preference.gather(1, (target % self.num_categories)[:, None]).squeeze(1)
        click_prob = torch.sigmoid(self.affinity * (liking - 1) + self.click_bias)
        labels = (uniform(hash32(*k, S_LABEL, seqs)) < click_prob).float()
        return Batch(item, action, offsets, target, labels, click_prob, num_tokens)


def deal(lengths: list[int], world_size: int) -> list[list[int]]:
    """Token-balanced shards: sequences by decreasing length (ties by index), each to the rank with the fewest tokens
    so far (ties to the lowest rank). Deterministic; each shard's indices come back sorted."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    loads = [(0, rank) for rank in range(world_size)]
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        tokens, rank = heapq.heappop(loads)
        shards[rank].append(i)
        heapq.heappush(loads, (tokens + lengths[i], rank))
    return [sorted(shard) for shard in shards]


def local_batch(data: SyntheticAds, step: int, rank: int, world_size: int, device) -> tuple[Batch, int]:
    """This rank's shard of batch ``step`` and the global number of tokens."""
    lengths = data.lengths(step)
    seqs = torch.tensor(deal(lengths.tolist(), world_size)[rank], dtype=torch.int64)
    return data.batch(step, seqs, lengths[seqs], device), int(lengths.sum())


# --------------------------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------------------------


def segment_mean(h: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Mean of each sequence's rows of ``h [N, d]``: ``[B, d]`` (zeros for a length-0 sequence), summed in fp32;
    no host sync."""
    seq = sequence_ids(offsets, h.shape[0])
    sums = torch.zeros(offsets.shape[0] - 1, h.shape[1], device=h.device).index_add(0, seq, h.float())
    counts = (offsets[1:] - offsets[:-1]).clamp(min=1).float()
    return (sums / counts[:, None]).to(h.dtype)


class Layer(nn.Module):
    """Pre-norm residual layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 mlp_ratio: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = BlockSelfAttention(d_model, num_heads, num_kv_heads, head_dim, block_size=block_size)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(),
                                 nn.Linear(mlp_ratio * d_model, d_model))

    def forward(self, x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), layout)
        return x + self.mlp(self.norm2(x))


class RankingModel(nn.Module):
    """Click logit ``[B]`` of a candidate item per user from the packed event history ``[N]`` (items, actions)."""

    def __init__(self, num_items: int, num_categories: int, num_actions: int, d_model: int = 512, num_heads: int = 4,
                 num_kv_heads: int | None = None, head_dim: int | None = None, num_layers: int = 2,
                 block_size: int = 64, mlp_ratio: int = 2):
        super().__init__()
        self.block_size = block_size
        # The catalogue: each item's category, a side feature looked up with the item (item i is of category i % C).
        self.register_buffer("item_category", torch.arange(num_items) % num_categories)
        self.item = nn.Embedding(num_items, d_model)
        self.category = nn.Embedding(num_categories, d_model)
        self.action = nn.Embedding(num_actions, d_model)
        self.layers = nn.ModuleList(
            Layer(d_model, num_heads, num_kv_heads or num_heads, head_dim or d_model // num_heads, block_size,
                  mlp_ratio) for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)
        self.target_norm = nn.LayerNorm(d_model)
        self.head = nn.Sequential(nn.Linear(3 * d_model, d_model), nn.GELU(), nn.Linear(d_model, 1))
        for table in (self.item, self.category, self.action):
            nn.init.normal_(table.weight, std=0.02)

    def embed(self, item_ids: torch.Tensor) -> torch.Tensor:
        return self.item(item_ids) + self.category(self.item_category[item_ids])

    def forward(self, item_ids: torch.Tensor, action_ids: torch.Tensor, offsets: torch.Tensor,
                target_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(item_ids) + self.action(action_ids)
        layout = block_layout(offsets, x.shape[0], self.block_size)  # once per batch, read by every layer
        for layer in self.layers:
            x = layer(x, layout)
        user = segment_mean(self.norm(x), offsets)
        target = self.target_norm(self.embed(target_ids)).to(user.dtype)
        logits = self.head(torch.cat([user, target, user * target], dim=1))
        return logits.squeeze(1).clone()  # not a view: FSDP2's backward hook on the output needs its own tensor


# --------------------------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="bfloat16: torch.autocast around the forward (parameters and optimizer stay fp32)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (dynamic shapes)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP under torchrun")
    p.add_argument("--steps", type=int, default=100, help="train until this many steps in total (resume included)")
    p.add_argument("--scale", type=float, default=1.0, help="sequences per batch = round(1152 * scale)")
    p.add_argument("--batch-seqs", type=int, default=None, help="sequences per global batch (overrides --scale)")
    p.add_argument("--min-len", type=int, default=ADS_MIN_LEN)
    p.add_argument("--max-len", type=int, default=ADS_MAX_LEN, help="lengths are uniform in [min-len, max-len)")
    p.add_argument("--num-items", type=int, default=16384)
    p.add_argument("--num-categories", type=int, default=16)
    p.add_argument("--num-actions", type=int, default=4)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--mlp-ratio", type=int, default=2)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=10, help="linear learning-rate warmup steps")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0: off)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and data")
    p.add_argument("--ckpt", type=Path, default=None, help="checkpoint directory (saved at the end of the run)")
    p.add_argument("--save-every", type=int, default=0, help="also save every this many steps")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt, if any")
    p.add_argument("--log-every", type=int, default=10, help="steps between loss/AUC reports (a host sync)")
    p.add_argument("--eval-batches", type=int, default=2, help="held-out batches evaluated at the end")
    p.add_argument("--timing-warmup", type=int, default=3, help="steps left out of tokens/s (compilation, caches)")
    p.add_argument("--export", type=Path, default=None,
                   help="torch.export the trained model to this .pt2")
    p.add_argument("--aoti", action="store_true",
                   help="with --export, also compile it with AOTInductor to a package beside it (see examples/README)")
    p.add_argument("--dump-grads", type=Path, default=None,
                   help="save the full gradients of the first step of this run to this file (rank 0), for tests")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.batch_seqs is None:
        args.batch_seqs = max(1, round(ADS_SEQS * args.scale))
    return args


@dataclass
class Dist:
    rank: int
    world_size: int
    device: torch.device

    @property
    def enabled(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup(args) -> Dist:
    """Join the process group when launched by ``torchrun`` (NCCL on GPUs, gloo on the CPU)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here")
    if "WORLD_SIZE" not in os.environ:
        if args.fsdp:
            raise SystemExit("--fsdp needs torchrun (e.g. torchrun --nproc_per_node=2 ...)")
        device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
        return Dist(0, 1, device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), device)


def build_model(args, device) -> RankingModel:
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    return RankingModel(args.num_items, args.num_categories, args.num_actions, args.d_model, args.heads,
                        args.kv_heads, args.head_dim, args.layers, args.block_size, args.mlp_ratio).to(device)


def wrap(model: RankingModel, args, env: Dist) -> nn.Module:
    """DDP or FSDP2 under torchrun, then ``torch.compile`` if asked."""
    runner: nn.Module = model
    if env.enabled and args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(env.device.type, (env.world_size,))
        for layer in model.layers:  # each layer is one all-gather/reduce-scatter unit; the rest go with the root
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif env.enabled:
        from torch.nn.parallel import DistributedDataParallel

        runner = DistributedDataParallel(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
    if args.compile:
        runner = torch.compile(runner, dynamic=True)
    return runner


def make_optimizer(model: nn.Module, args):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    warmup = max(args.warmup, 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    return optimizer, scheduler


# --- checkpoints: model + optimizer + scheduler + step (the data position) + RNG states ------------------------------


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(root: Path, step: int, model, optimizer, scheduler, args, env: Dist) -> Path:
    """``root/step-XXXXXXXX/``: FSDP2 through ``torch.distributed.checkpoint`` (every rank writes its shards),
    otherwise one ``state.pt`` by rank 0; RNG states per rank; then ``root/latest`` names it."""
    path = root / f"step-{step:08d}"
    if env.main:
        path.mkdir(parents=True, exist_ok=True)
    if env.enabled:
        dist.barrier()
    meta = {"step": step, "scheduler": scheduler.state_dict(), "args": {k: str(v) for k, v in vars(args).items()}}
    if args.fsdp and env.enabled:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path / "dcp")
        if env.main:
            torch.save(meta, path / "meta.pt")
    elif env.main:
        torch.save({**meta, "model": model.state_dict(), "optim": optimizer.state_dict()}, path / "state.pt")
    torch.save(_rng_state(env.device), path / f"rng-rank{env.rank}.pt")
    if env.enabled:
        dist.barrier()
    if env.main:
        tmp = root / "latest.tmp"
        tmp.write_text(path.name)
        tmp.replace(root / "latest")
    return path


def load_checkpoint(root: Path, model, optimizer, scheduler, args, env: Dist) -> int:
    """Restore the latest checkpoint under ``root``; returns its step (0 if there is none)."""
    if not (root / "latest").exists():
        return 0
    path = root / (root / "latest").read_text().strip()
    if args.fsdp and env.enabled:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path / "dcp")
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        meta = torch.load(path / "meta.pt", weights_only=False)
    else:
        meta = torch.load(path / "state.pt", map_location=env.device, weights_only=False)
        model.load_state_dict(meta["model"])
        optimizer.load_state_dict(meta["optim"])
    scheduler.load_state_dict(meta["scheduler"])
    rng = path / f"rng-rank{env.rank}.pt"
    if rng.exists():
        _set_rng_state(torch.load(rng, weights_only=False), env.device)
    return int(meta["step"])


# --- metrics ---------------------------------------------------------------------------------------------------------


def binary_entropy(p: float) -> float:
    p = min(max(p, 1e-12), 1 - 1e-12)
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


class Window:
    """Loss, AUC and label statistics over the steps since the last report; one host sync per report."""

    def __init__(self, device, env: Dist):
        from torchmetrics.classification import BinaryAUROC

        self.env, self.device = env, device
        # validate_args=False: checking the labels' values would stall the host at every update.
        self.auroc = BinaryAUROC(validate_args=False).to(device)
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, oracle loss sum, positives
        self.count = 0  # labels (known on the host)

    def update(self, logits: torch.Tensor, batch: Batch, loss_sum: torch.Tensor) -> None:
        oracle = F.binary_cross_entropy(batch.click_prob, batch.labels, reduction="sum")
        self.sums += torch.stack([loss_sum.detach(), oracle, batch.labels.sum()]).double()
        self.count += batch.labels.numel()
        self.auroc.update(torch.sigmoid(logits.detach().float()), batch.labels.long())

    def report(self) -> dict:
        """Global (all ranks) figures of the window; then starts a new window. Every rank must call it."""
        sums = torch.cat([self.sums, torch.tensor([float(self.count)], dtype=torch.float64).to(self.device)])
        if self.env.enabled:
            dist.all_reduce(sums)
        auc = float(self.auroc.compute())  # torchmetrics gathers every rank's predictions
        loss, oracle, positives, count = sums.tolist()
        self.sums.zero_()
        self.count = 0
        self.auroc.reset()
        rate = positives / max(count, 1)
        return {"loss": loss / max(count, 1), "auc": auc, "base_rate": rate, "base_entropy": binary_entropy(rate),
                "oracle_loss": oracle / max(count, 1)}


class Progress:
    """A rich progress bar with tokens/s, loss and AUC on rank 0 (or nothing)."""

    def __init__(self, enabled: bool, total: int, start: int):
        self.bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                TextColumn("{task.fields[stats]}"), console=Console(stderr=True))
            self.task = self.bar.add_task("train", total=total, completed=start, stats="")
            self.bar.start()

    def update(self, stats: str | None = None) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, **({"stats": stats} if stats is not None else {}))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def log(env: Dist, *args) -> None:
    if env.main:
        print(*args, file=sys.stderr, flush=True)


def autocast(args, device: torch.device):
    if args.dtype == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient on the CPU (FSDP2's sharded gradients gathered: all ranks must call)."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None and hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        grads[name] = None if grad is None else grad.detach().cpu().clone()
    return grads


def full_state_dict(model: nn.Module, args, env: Dist) -> dict[str, torch.Tensor]:
    """The whole model's state dict on the CPU (gathered under FSDP2: all ranks must call)."""
    if args.fsdp and env.enabled:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


@torch.no_grad()
def evaluate(runner, data: SyntheticAds, args, env: Dist) -> dict:
    runner.eval()
    window = Window(env.device, env)
    for i in range(args.eval_batches):
        batch, _ = local_batch(data, EVAL_STEP0 + i, env.rank, env.world_size, env.device)
        with autocast(args, env.device):
            logits = runner(*batch.model_inputs).float()
        window.update(logits, batch, F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum"))
    runner.train()
    return {f"eval_{k}": v for k, v in window.report().items()}


def train(args) -> dict:
    """Train as ``args`` say; returns the summary (also printed as the last stdout line, as JSON, by rank 0)."""
    env = setup(args)
    try:
        return _train(args, env)
    finally:
        if env.enabled:
            dist.destroy_process_group()


def _train(args, env: Dist) -> dict:
    if args.batch_seqs < env.world_size:
        raise SystemExit(f"need at least one sequence per rank: {args.batch_seqs} sequences, {env.world_size} ranks")
    device = env.device
    data = SyntheticAds(args.seed, args.batch_seqs, args.min_len, args.max_len, args.num_items, args.num_actions,
                        args.num_categories)
    model = build_model(args, device)
    runner = wrap(model, args, env)
    optimizer, scheduler = make_optimizer(model, args)
    start = load_checkpoint(args.ckpt, model, optimizer, scheduler, args, env) if args.resume and args.ckpt else 0
    if start:
        log(env, f"resumed from step {start} ({args.ckpt})")
    parallel = "fsdp2" if args.fsdp and env.enabled else "ddp" if env.enabled else "single"
    log(env, f"{env.world_size} rank(s) ({parallel}) on {device.type}, {args.batch_seqs} sequences of "
             f"[{args.min_len}, {args.max_len}) tokens per step, "
             f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    window = Window(device, env)
    progress = Progress(env.main and not args.quiet, args.steps, start)
    losses: list[torch.Tensor] = []  # the global mean loss of each step, kept on the device until the end
    reports: list[dict] = []
    # tokens/s: all ranks' tokens over the steps after the first `timing_warmup` ones (compilation, allocator).
    timed_from = start + min(args.timing_warmup, max(args.steps - start - 1, 0))
    timed_tokens, timed_start = 0, None
    window_tokens, window_start = 0, time.perf_counter()
    for step in range(start, args.steps):
        if step == timed_from:
            sync()
            timed_start = time.perf_counter()
        batch, global_tokens = local_batch(data, step, env.rank, env.world_size, device)
        with autocast(args, device):
            logits = runner(*batch.model_inputs).float()
        loss_sum = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum")
        # DDP and FSDP average gradients over ranks: scaled so, the gradient is that of the global batch's mean loss.
        (loss_sum * (env.world_size / args.batch_seqs)).backward()
        if args.dump_grads is not None and step == start:
            grads = full_gradients(model)
            if env.main:
                torch.save({"grads": grads, "loss_sum": loss_sum.detach().cpu()}, args.dump_grads)
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        global_loss = loss_sum.detach().double()
        if env.enabled:
            dist.all_reduce(global_loss)
        losses.append(global_loss / args.batch_seqs)
        window.update(logits, batch, loss_sum)
        window_tokens += global_tokens
        if step >= timed_from:
            timed_tokens += global_tokens

        done, stats = step + 1, None
        if done % args.log_every == 0 or done == args.steps:
            report = window.report()  # a host sync, so the window's tokens/s is exact
            now = time.perf_counter()
            report.update(step=done, tokens_per_s=window_tokens / (now - window_start))
            window_tokens, window_start = 0, now
            reports.append(report)
            stats = (f"{report['tokens_per_s'] / 1e3:,.0f} k tok/s  loss {report['loss']:.4f} "
                     f"(base-rate entropy {report['base_entropy']:.4f}, best {report['oracle_loss']:.4f})  "
                     f"AUC {report['auc']:.3f}")
            if args.quiet:
                log(env, f"step {done}: {stats}")
        progress.update(stats)
        if args.ckpt and args.save_every and done % args.save_every == 0 and done != args.steps:
            save_checkpoint(args.ckpt, done, model, optimizer, scheduler, args, env)
    sync()
    elapsed = time.perf_counter() - timed_start if timed_start is not None else 0.0
    progress.close()
    if args.ckpt and args.steps > start:
        save_checkpoint(args.ckpt, args.steps, model, optimizer, scheduler, args, env)

    summary = {
        "event": "summary", "world_size": env.world_size, "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "dtype": args.dtype, "compile": args.compile, "parallel": parallel, "start_step": start, "steps": args.steps,
        "batch_seqs": args.batch_seqs, "timed_steps": max(args.steps - timed_from, 0),
        "tokens_per_s": timed_tokens / elapsed if elapsed > 0 else None,
        "losses": torch.stack(losses).tolist() if losses else [], "last": reports[-1] if reports else None,
    }
    summary["tokens_per_s_per_gpu"] = summary["tokens_per_s"] / env.world_size if elapsed > 0 else None
    if args.eval_batches:
        summary.update(evaluate(runner, data, args, env))
    if args.export is not None:
        state = full_state_dict(model, args, env)
        if env.main:
            summary.update(export_model(state, args, data, device))
    if env.main:
        print(json.dumps(summary), flush=True)
    return summary


# --------------------------------------------------------------------------------------------------------------------
# Serving: torch.export with dynamic N and B, and AOTInductor
# --------------------------------------------------------------------------------------------------------------------


def export_program(model: RankingModel, example: Batch):
    """``torch.export`` of ``model`` with a dynamic number of tokens ``N`` and of sequences ``B`` (1 included)."""
    num_tokens, num_seqs = torch.export.Dim("N", min=1, max=1 << 26), torch.export.Dim("B", min=1, max=1 << 20)
    dynamic_shapes = {"item_ids": {0: num_tokens}, "action_ids": {0: num_tokens}, "offsets": {0: num_seqs + 1},
                      "target_ids": {0: num_seqs}}
    # Size-oblivious tracing: without it, export assumes every dynamic size of the example (>= 2) is never 1, and
    # the program would refuse a batch of one sequence.
    config = torch.fx.experimental._config
    oblivious = config.patch(backed_size_oblivious=True) if hasattr(config, "backed_size_oblivious") \
        else contextlib.nullcontext()
    with oblivious:
        return torch.export.export(model, example.model_inputs, dynamic_shapes=dynamic_shapes)


def export_model(state: dict, args, data: SyntheticAds, device: torch.device) -> dict:
    """Export the model with weights ``state`` to ``args.export`` (and with ``args.aoti`` compile it with
    AOTInductor beside it); check both against eager on batches of other sizes. Returns their max errors."""
    model = build_model(args, device)
    model.load_state_dict(state)
    model.eval()
    if args.dtype == "bfloat16" and device.type == "cuda":
        model = model.to(torch.bfloat16)  # serve in bf16
    example = data.batch(EVAL_STEP0, torch.arange(4), data.lengths(EVAL_STEP0)[:4], device)
    program = export_program(model, example)
    args.export.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, args.export)
    # Batches of other sizes than the example's: 7 sequences, and a single one.
    checks = [data.batch(EVAL_STEP0 + 1, torch.arange(7), data.lengths(EVAL_STEP0 + 1)[:7], device),
              data.batch(EVAL_STEP0 + 2, torch.arange(1), data.lengths(EVAL_STEP0 + 2)[:1], device)]
    served = {"export": torch.export.load(args.export).module()}
    result = {"export_path": str(args.export)}
    if args.aoti:
        aoti_path = args.export.with_name(args.export.stem + "-aoti.pt2")
        torch._inductor.aoti_compile_and_package(program, package_path=str(aoti_path))
        served["aoti"] = torch._inductor.aoti_load_package(str(aoti_path))
        result["aoti_path"] = str(aoti_path)
    with torch.no_grad():
        for name, program_module in served.items():
            result[f"{name}_max_err"] = max((program_module(*b.model_inputs).float() - model(*b.model_inputs).float())
                                            .abs().max().item() for b in checks)
    return result


def main(argv=None) -> dict:
    return train(parse_args(argv))


if __name__ == "__main__":
    main()
