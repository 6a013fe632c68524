"""The in-block options' benchmark (``python -m blockattn bench --options``): on a workload (the ``ads`` preset by
default), the plain op, each option alone and causal + both biases together, forward, backward (the op alone, from
the forward's block table and time buckets) and both (autograd, gradients of q, k, v and the biases), as time over
the memory floor and as overhead over the plain op in the same run; blockattn per call and on a batch layout built
once (the block table and the time buckets that a model's layers share); against the same computation built from
FlexAttention (``score_mod`` and ``mask_mod``, compiled, on the padded blocks) and from padded SDPA with an
additive bias tensor.

Timestamps are increasing within each sequence (gaps of 1 s to 20 min, the shape of a user's history), the time
bias has 64 buckets, dropout is 0.1. Each baseline's output is checked against blockattn's (SNR) before it is
timed, except under dropout (other generators). One that cannot run here is recorded with its reason.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

import blockattn
from blockattn.ops.in_block import DEFAULT_BUCKET_WIDTH
from blockattn.reference import snr_db

from . import harness
from .harness import FAILED, UNAVAILABLE, describe, environment, floor_bytes, free_memory, make_case, time_ms
from .presets import Workload

OPTION_SETS = ("plain", "causal", "pos_bias", "time_bias", "dropout", "causal+pos+time")
NUM_BUCKETS = 64
DROPOUT_P = 0.1
PASSES = ("fwd", "bwd", "fwdbwd")
MATCH_SNR_DB = 30.0
OURS = "blockattn"


class _Inputs:
    """One workload's tensors, the learnable biases and the padded-block views the baselines need (untimed)."""

    def __init__(self, w: Workload, seed: int, device: str = "cuda"):
        self.device = device
        offsets = w.offsets(seed, device=device)
        self.case = make_case(w, offsets, seed)
        case = self.case
        n, h, bs = case.q.shape[0], case.q.shape[1], case.block_size
        generator = torch.Generator(device=device).manual_seed(seed + 1)
        self.timestamps = torch.randint(1, 1200, (n,), device=device, generator=generator).cumsum(0)
        self.pos_bias = torch.randn(h, 2 * bs - 1, device=device, generator=generator).requires_grad_()
        self.time_bias = torch.randn(h, NUM_BUCKETS, device=device, generator=generator).requires_grad_()
        self.rows = case.rows.clamp(max=n - 1)  # [blocks, BS], real blocks only
        self.lengths = case.valid.sum(1)

    def options(self, name: str) -> dict:
        chosen = {"causal", "pos_bias", "time_bias"} if name == "causal+pos+time" else {name}
        kwargs = {}
        if "causal" in chosen:
            kwargs["causal"] = True
        if "pos_bias" in chosen:
            kwargs["pos_bias"] = self.pos_bias
        if "time_bias" in chosen:
            kwargs.update(timestamps=self.timestamps, time_bias=self.time_bias)
        if "dropout" in chosen:
            kwargs["dropout_p"] = DROPOUT_P
        return kwargs

    def leaves(self, kwargs: dict) -> tuple[list[torch.Tensor], dict]:
        """Fresh leaves of one implementation: ``[q, k, v, *biases]`` requiring grad (what the backward
        differentiates) and ``kwargs`` with its biases replaced by theirs."""
        qkv = [t.detach().requires_grad_() for t in self.case.inputs]
        own = {k: v.detach().requires_grad_() if k in ("pos_bias", "time_bias") else v for k, v in kwargs.items()}
        return qkv + [own[b] for b in ("pos_bias", "time_bias") if b in own], own

    def padded(self, t: torch.Tensor) -> torch.Tensor:
        """``[N, H, D]`` -> ``[blocks, H, BS, D]``, rows past a block's end read its last row (masked out)."""
        return t[self.rows].transpose(1, 2)

    def unpadded(self, blocks: torch.Tensor) -> torch.Tensor:
        """``[blocks, H, BS, D]`` -> ``[N, H, D]``: the valid rows, in token order (real blocks tile ``[0, N)``)."""
        return blocks.transpose(1, 2)[self.case.valid]


def _blockattn(inputs: _Inputs, kwargs: dict, batch_layout: bool = False) -> dict:
    """blockattn's calls; with ``batch_layout``, on a layout built once for the batch (untimed, as a model's layers
    share it) that holds the block table and the time buckets, which each call otherwise builds."""
    case = inputs.case
    leaves, own = inputs.leaves(kwargs)
    seed = torch.randint(2**62, (1,), device=inputs.device) if "dropout_p" in own else None
    op_args = {"q": case.q, "k": case.k, "v": case.v, "offsets": case.offsets, "sinu_pos": None,
               "block_size": case.block_size, "scale": case.scale, "rotate": 0, **own, "dropout_seed": seed}
    offsets, call_kwargs = case.offsets, {**own, "block_size": case.block_size}
    if batch_layout:
        offsets = blockattn.block_layout(case.offsets, case.q.shape[0], case.block_size, timestamps=inputs.timestamps,
                                         num_time_buckets=NUM_BUCKETS)
        time_buckets = offsets.time_buckets if "time_bias" in own else None
        call_kwargs = {k: v for k, v in own.items() if k != "timestamps"}
    else:  # what autograd hands the backward: the time buckets the forward built (a 0-element tensor: none)
        with torch.no_grad():
            built = torch.ops.blockattn.block_attention_fwd(**op_args)[3]
        time_buckets = built if built.numel() else None

    def forward():
        return blockattn.block_attention(*leaves[:3], offsets, scale=case.scale, **call_kwargs)

    def backward():  # the op alone, as autograd calls it
        return torch.ops.blockattn.block_attention_bwd(grad_out=case.do, **op_args, **case.table._asdict(),
                                                       time_buckets=time_buckets)

    return {"fwd": forward, "bwd": backward, "leaves": leaves, "out": forward}


def _log_buckets(dt: torch.Tensor) -> torch.Tensor:
    """The time buckets of differences ``dt`` as a user writes them in PyTorch (the baselines' formula)."""
    return (dt.abs().float().clamp(min=1.0).log() / DEFAULT_BUCKET_WIDTH).floor().long().clamp(max=NUM_BUCKETS - 1)


def _bias_tiles(inputs: _Inputs, kwargs: dict, block_size: int) -> torch.Tensor | None:
    """The additive ``[blocks, H, BS, BS]`` fp32 bias of the padded baselines, built from the tables (timed: the
    biases are learnable), ``-inf`` at padded keys and above the diagonal under ``causal``."""
    offs = torch.arange(block_size, device=inputs.device)
    keep = offs[None, None, :] < inputs.lengths[:, None, None]
    if kwargs.get("causal"):
        keep = keep & (offs[None, :, None] >= offs[None, None, :])
    bias = torch.zeros(keep.shape, device=inputs.device).masked_fill(~keep, float("-inf"))[:, None]
    if "pos_bias" in kwargs:
        bias = bias + kwargs["pos_bias"][:, offs[None, :] - offs[:, None] + block_size - 1]
    if "time_bias" in kwargs:
        times = kwargs["timestamps"][inputs.rows]
        buckets = _log_buckets(times[:, None, :] - times[:, :, None])
        bias = bias + kwargs["time_bias"][:, buckets].transpose(0, 1)
    return bias


def _sdpa(inputs: _Inputs, kwargs: dict) -> dict:
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    case = inputs.case
    leaves, biases = inputs.leaves(kwargs)

    def forward():
        q, k, v = (inputs.padded(t) for t in leaves[:3])
        mask = _bias_tiles(inputs, biases, case.block_size).to(q.dtype)
        out = sdpa(q, k, v, attn_mask=mask, dropout_p=biases.get("dropout_p", 0.0), scale=case.scale,
                   enable_gqa=case.gqa)
        return inputs.unpadded(out)

    return {"fwd": forward, "leaves": leaves, "out": forward}


# FlexAttention's grid puts batch x heads on one axis (at most 65 535): its batch entries hold this many blocks.
FLEX_BLOCKS_PER_ENTRY = 8
# Flex's default kernel configuration can ask for more shared memory than the GPU has (torch 2.11 on an H100: the
# position bias at D 64 needed 247 808 bytes of 232 448); the run then retries with these options and says so.
FLEX_FEWER_STAGES = {"num_stages": 1}


def _flex(inputs: _Inputs, kwargs: dict, kernel_options: dict | None = None) -> dict:
    """FlexAttention on the padded blocks, ``FLEX_BLOCKS_PER_ENTRY`` of them back to back per batch entry (one
    block per entry would put 25 000 blocks x heads on one grid axis, past CUDA's limit), with a block mask that
    keeps each block to itself; ``mask_mod`` masks other blocks, padded keys (and above the diagonal), ``score_mod``
    adds the biases. ``kernel_options`` go to Flex's kernels as they are."""
    if "dropout_p" in kwargs:
        raise NotImplementedError("FlexAttention has no dropout")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    case = inputs.case
    bs, per_entry = case.block_size, FLEX_BLOCKS_PER_ENTRY
    leaves, biases = inputs.leaves(kwargs)
    num_blocks, causal = inputs.lengths.numel(), kwargs.get("causal", False)
    entries = -(-num_blocks // per_entry)
    padding = entries * per_entry - num_blocks  # empty blocks that fill the last entry
    rows = torch.cat([inputs.rows, inputs.rows[-1:].expand(padding, bs)]).flatten()
    lengths = torch.cat([inputs.lengths, inputs.lengths.new_zeros(padding)])
    times = kwargs["timestamps"][rows] if "timestamps" in kwargs else None
    seq = per_entry * bs

    def mask_mod(b, h, q_idx, kv_idx):
        visible = (q_idx // bs == kv_idx // bs) & (kv_idx % bs < lengths[b * per_entry + kv_idx // bs])
        return visible & (kv_idx <= q_idx) if causal else visible

    def score_mod(score, b, h, q_idx, kv_idx):
        if "pos_bias" in biases:  # clamped: Flex may evaluate it on pairs of two blocks too (then masked)
            score = score + biases["pos_bias"][h, (kv_idx - q_idx + bs - 1).clamp(0, 2 * bs - 2)]
        if times is not None:
            score = score + biases["time_bias"][h, _log_buckets(times[b * seq + kv_idx] - times[b * seq + q_idx])]
        return score

    # The block mask keeps Flex's default 128-token tiles: its kernels need the mask's tiles to be multiples of theirs
    # (a 64-token mask was refused on an H100); mask_mod does the rest inside each tile.
    block_mask = create_block_mask(mask_mod, entries, None, seq, seq, device=inputs.device)
    # Compiled, as FlexAttention is meant to run (eager is a slow reference); eager off the GPU, for the tests. Each
    # option set's score_mod is a new closure and so a recompilation: a fresh start keeps them under dynamo's limit.
    if inputs.device == "cuda":
        torch._dynamo.reset()
        attend = torch.compile(flex_attention, fullgraph=True)
    else:
        attend = flex_attention

    def forward():
        q, k, v = (t[rows].unflatten(0, (entries, seq)).transpose(1, 2) for t in leaves[:3])
        out = attend(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=case.scale, enable_gqa=case.gqa,
                     kernel_options=kernel_options)
        blocks = out.transpose(1, 2).reshape(entries * per_entry, bs, *out.shape[1:2], out.shape[-1])
        return blocks[:num_blocks][case.valid]

    return {"fwd": forward, "leaves": leaves, "out": forward}


OURS_WITH_LAYOUT = "blockattn, batch layout"
IMPLEMENTATIONS = {OURS: _blockattn, OURS_WITH_LAYOUT: functools.partial(_blockattn, batch_layout=True),
                   "FlexAttention (padded blocks)": _flex, "SDPA + bias (padded blocks)": _sdpa}


def _timings(calls: dict, do: torch.Tensor, rep_ms: int) -> dict:
    """Median (and p20/p80) ms of each pass; the backward of an autograd-only implementation from one saved
    forward (retain_graph), which times the backward kernels and the bias gathers' gradients."""
    leaves = calls["leaves"]

    def fwdbwd():
        return torch.autograd.grad(calls["fwd"](), leaves, do)

    timed = {"fwd": calls["fwd"], "fwdbwd": fwdbwd}
    if "bwd" in calls:
        timed["bwd"] = calls["bwd"]
    else:
        saved = calls["fwd"]()
        timed["bwd"] = lambda: torch.autograd.grad(saved, leaves, do, retain_graph=True)
    return {p: time_ms(timed[p], rep_ms) for p in PASSES}


def _measure(build, inputs: _Inputs, kwargs: dict, expected, ours: bool, rep_ms: int):
    """``build``'s timings, after checking its output against ``expected`` (blockattn's, which it returns when
    ``ours``); the expected output for the next implementation."""
    calls = build(inputs, kwargs)
    out = calls["out"]().detach().float()
    if ours:
        expected = out
    elif "dropout_p" not in kwargs and expected is not None:
        snr = snr_db(out, expected)
        if not snr >= MATCH_SNR_DB:
            raise ValueError(f"differs from blockattn's result (SNR {snr:.1f} dB)")
    del out
    return _timings(calls, inputs.case.do, rep_ms), expected


def run(w: Workload, rep_ms: int, seed: int, progress) -> dict:
    """Every option set and implementation on ``w``; a JSON-able report."""
    from .harness import copy_bandwidth_tbps

    tbps = copy_bandwidth_tbps(rep_ms)
    inputs = _Inputs(w, seed)
    n = inputs.case.q.shape[0]
    floors = {p: b / (tbps * 1e12) * 1e3 for p, b in floor_bytes(w, n).items()}
    rows, skipped = [], []
    task = progress.add_task("in-block options", total=len(OPTION_SETS) * len(IMPLEMENTATIONS))
    for option in OPTION_SETS:
        kwargs = inputs.options(option)
        expected = None
        for impl, build in IMPLEMENTATIONS.items():
            progress.update(task, description=f"{option}: {impl}")
            where = {"option": option, "impl": impl}
            try:
                try:
                    measured, expected = _measure(build, inputs, kwargs, expected, impl == OURS, rep_ms)
                    note = ""
                except Exception as error:
                    if build is not _flex or "out of resource" not in str(error):
                        raise
                    free_memory()
                    retry = functools.partial(_flex, kernel_options=FLEX_FEWER_STAGES)
                    measured, expected = _measure(retry, inputs, kwargs, expected, False, rep_ms)
                    note = f"kernel_options={FLEX_FEWER_STAGES}: the default ran out of resources"
                for p, ms in measured.items():
                    rows.append({**where, "pass": p, "ms": ms["p50"], "quantiles_ms": ms, "floor_ms": floors[p],
                                 "x_floor": ms["p50"] / floors[p], "note": note})
            except NotImplementedError as error:
                skipped.append({**where, "status": UNAVAILABLE, "reason": str(error)})
            except Exception as error:  # noqa: BLE001 -- whatever one implementation raises, the others still run
                skipped.append({**where, "status": FAILED, "reason": describe(error)})
            finally:
                free_memory()
            progress.advance(task)
    plain = {(r["impl"], r["pass"]): r["ms"] for r in rows if r["option"] == "plain"}
    ours = {(r["option"], r["pass"]): r["ms"] for r in rows if r["impl"] == OURS}
    for r in rows:
        own = r["impl"] in (OURS, OURS_WITH_LAYOUT)
        base = plain.get((r["impl"] if own else OURS, r["pass"]))
        r["x_plain"] = r["ms"] / base if base else None
        mine = ours.get((r["option"], r["pass"]))
        r["blockattn_speedup"] = r["ms"] / mine if mine and not own else None
    return {"environment": environment(), "copy_bandwidth_tbps": tbps, "workload": w.to_dict(), "tokens": n,
            "num_buckets": NUM_BUCKETS, "dropout_p": DROPOUT_P, "floor_ms": floors, "results": rows,
            "skipped": skipped}


def print_report(report: dict, console) -> None:
    from rich.table import Table
    from rich.text import Text

    env = report["environment"]
    console.print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; copy bandwidth "
                  f"{report['copy_bandwidth_tbps']:.2f} TB/s; {report['workload']['name']}, {report['tokens']} tokens")
    table = Table(title="in-block options: time per call")
    for col in ("option", "implementation", "pass", "ms", "x floor", "x plain", "blockattn speedup", "notes"):
        table.add_column(col, overflow="fold")
    for option in OPTION_SETS:
        for r in (r for r in report["results"] if r["option"] == option):
            speedup = r["blockattn_speedup"]
            table.add_row(*(Text(c) for c in (option, r["impl"], r["pass"], f"{r['ms']:.3f}", f"{r['x_floor']:.2f}",
                                              f"{r['x_plain']:.2f}" if r["x_plain"] else "-",
                                              f"{speedup:.2f}x" if speedup else "-", r["note"])))
        for s in (s for s in report["skipped"] if s["option"] == option):
            table.add_row(*(Text(c) for c in (option, s["impl"], "-", "-", "-", "-", "-",
                                              f"{s['status']}: {s['reason']}")))
    console.print(table)
    console.print("x floor: ms over the plain op's memory floor (q, k, v, o; + dO, dq, dk, dv backward) at the copy "
                  "bandwidth; x plain: ms over blockattn's plain op in the same pass (the batch layout's rows: over "
                  "its own plain op); blockattn speedup: this implementation's ms over blockattn's with the same "
                  "option. Batch layout: blockattn on a block_layout built once (untimed) with the timestamps, "
                  "whose block table and time buckets a model's layers share. bwd: blockattn's backward op alone, "
                  "the baselines' autograd backward from one saved forward; fwdbwd: autograd, gradients of q, k, v "
                  "and the biases.")


def write_file(report: dict, out_dir: Path) -> Path:
    return harness.write_json(report, out_dir, "options.json")

