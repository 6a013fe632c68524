"""The configuration sweep (``python -m blockattn bench --sweep``): block size x head dim x GQA ratio x dtype x
rotary, forward and backward, each as time over its own memory floor and as TFLOP/s (next to the rate the floor's
time would need: the GQA backward at 128-token blocks is bound by the kernels' arithmetic rate); a table,
``sweep.json`` and a heatmap ``sweep.png``.

Rotary is ``none``, ``fp32 angles`` (``sinu_pos`` in float32, as a user builds it) or ``input angles`` (in the
inputs' dtype, bf16 for fp8: half the angle bytes); each floor counts its own angle bytes. fp8 is the forward only
(inference: q, k, v quantised per tensor from bf16, bf16 output). Every configuration runs on ``ads``-like
lengths (800 to 2000 tokens) with 8 query heads and as many sequences as make about 2**27 query elements (256 MiB
of 16-bit queries, enough to fill an H100 or H200). Times: the forward through ``block_attention``, the backward
op alone from a block table built beforehand (as in ``bench``), each replayed as a CUDA graph: the GPU's time
without the host's (``bench --latency`` measures that; at this size the eager fp8 forward, about 0.26 ms of GPU
time, measured 0.36 ms a call on an H100's host).

The whole grid is 576 configurations, each compiling its kernels (28 of them took about 70 s on an H100 at
``--rep-ms 20``, so the grid about 25 minutes); ``--block-size``, ``--head-dim``, ``--kv-heads`` and ``--dtype``
restrict its axes to split it across runs, and ``--pass`` times the forward or the backward alone.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import blockattn
from blockattn.custom_ops import MATMULS, attention_flops
from blockattn.ops.tiles import ROTATE_ALL, ROTATE_NONE
from blockattn.reference import quantised_fp8, random_angles

from . import harness
from .presets import Workload

BLOCK_SIZES = (16, 32, 64, 128)
HEAD_DIMS = (32, 64, 128, 256)
NUM_HEADS = 8
KV_HEADS = (8, 4, 2, 1)  # GQA ratios 1, 2, 4 and 8 (MQA)
FP8 = "float8_e4m3fn"  # forward only (inference), bf16 output
DTYPES = ("bfloat16", "float16", FP8)
ROTARY = ("none", "fp32 angles", "input angles")
PASSES = ("fwd", "bwd")
QUERY_ELEMENTS = 2**27
MEAN_LENGTH = 1400


@dataclass(frozen=True)
class Config:
    block_size: int
    head_dim: int
    kv_heads: int
    dtype: str
    rotary: str

    @property
    def passes(self) -> tuple[str, ...]:
        return ("fwd",) if self.dtype == FP8 else PASSES

    @property
    def source_dtype(self) -> str:
        """The inputs' dtype before any quantisation: bf16 for fp8."""
        return "bfloat16" if self.dtype == FP8 else self.dtype

    @property
    def angle_dtype(self) -> torch.dtype | None:
        """``sinu_pos``'s dtype: None without a rotary, float32, or the source dtype ("input angles")."""
        if self.rotary == "none":
            return None
        return torch.float32 if self.rotary == "fp32 angles" else getattr(torch, self.source_dtype)

    def workload(self, query_elements: int) -> Workload:
        """The batch, in the source dtype (fp8 inputs are quantised from it)."""
        num_seqs = max(1, query_elements // (NUM_HEADS * self.head_dim * MEAN_LENGTH))
        return Workload("sweep", num_seqs, 800, 2000, NUM_HEADS, self.kv_heads, self.head_dim, self.block_size,
                        self.source_dtype)


def grid(block_sizes=BLOCK_SIZES, head_dims=HEAD_DIMS, kv_heads=KV_HEADS, dtypes=DTYPES,
         rotary=ROTARY) -> list[Config]:
    """Every configuration of the axes' values."""
    return [Config(*values) for values in itertools.product(block_sizes, head_dims, kv_heads, dtypes, rotary)]


def _fp8_forward(case, w: Workload, n: int, sinu_pos: torch.Tensor | None, angle_bytes: int, tbps: float):
    """The fp8 forward of ``case``'s inputs (quantised per tensor, bf16 output) and its floor: q, k, v read as one
    byte per element, the bf16 output written, the angles read."""
    (q8, q_descale), (k8, k_descale), (v8, v_descale) = (quantised_fp8(t) for t in case.inputs)

    def forward():
        return blockattn.block_attention(q8, k8, v8, case.offsets, block_size=case.block_size, scale=case.scale,
                                         sinu_pos=sinu_pos, q_descale=q_descale, k_descale=k_descale,
                                         v_descale=v_descale)

    return forward, (harness.fp8_forward_floor_bytes(w, n) + angle_bytes) / (tbps * 1e12) * 1e3


def _angles(config: Config, num_tokens: int, device, generator) -> torch.Tensor | None:
    """``sinu_pos`` of ``config.rotary``, in its ``angle_dtype``."""
    if config.angle_dtype is None:
        return None
    return random_angles(num_tokens, config.head_dim, device, generator).to(config.angle_dtype)


def _measure(config: Config, query_elements: int, rep_ms: int, tbps: float, seed: int, device: str,
             passes: tuple[str, ...] = PASSES) -> dict:
    w = config.workload(query_elements)
    case = harness.make_case(w, w.offsets(seed, device=device), seed)
    n = case.q.shape[0]
    sinu_pos = _angles(config, n, device, torch.Generator(device=device).manual_seed(seed + 1))
    rotate = ROTATE_NONE if sinu_pos is None else ROTATE_ALL
    angle_bytes = 0 if sinu_pos is None else sinu_pos.numel() * sinu_pos.element_size()
    floors = {p: (b + angle_bytes) / (tbps * 1e12) * 1e3 for p, b in harness.floor_bytes(w, n).items()}

    def forward():
        return blockattn.block_attention(case.q, case.k, case.v, case.offsets, block_size=case.block_size,
                                         scale=case.scale, sinu_pos=sinu_pos)

    def backward():  # the op alone, as autograd calls it
        return torch.ops.blockattn.block_attention_bwd(
            grad_out=case.do, q=case.q, k=case.k, v=case.v, offsets=case.offsets, sinu_pos=sinu_pos,
            **case.table._asdict(), block_size=case.block_size, scale=case.scale, rotate=rotate)

    if config.dtype == FP8:
        forward, floors["fwd"] = _fp8_forward(case, w, n, sinu_pos, angle_bytes, tbps)
    row = {**asdict(config), "tokens": n, "gqa": NUM_HEADS // config.kv_heads}
    for pass_name, fn in {"fwd": forward, "bwd": backward}.items():
        if pass_name not in config.passes or pass_name not in passes:
            continue
        ms = harness.time_ms(harness.graphed(fn), rep_ms)
        flops = attention_flops(case.offsets, n, NUM_HEADS, config.head_dim, config.block_size, False,
                                MATMULS[pass_name])
        row[pass_name] = {"ms": ms["p50"], "quantiles_ms": ms, "floor_ms": floors[pass_name],
                          "x_floor": ms["p50"] / floors[pass_name], "tflops": flops / ms["p50"] / 1e9,
                          "tflops_at_floor": flops / floors[pass_name] / 1e9}
    return row


def run(configs: list[Config], rep_ms: int, seed: int = 0, progress=None, query_elements: int = QUERY_ELEMENTS,
        device: str = "cuda", passes: tuple[str, ...] = PASSES) -> dict:
    """Every configuration, timing the ``passes`` it has (a configuration with none of them, the fp8 forward's
    when only the backward is asked for, is left out); one that fails is recorded with its reason and the others
    still run."""
    configs = [c for c in configs if set(c.passes) & set(passes)]
    tbps = harness.copy_bandwidth_tbps(rep_ms)
    rows, failed = [], []
    task = progress.add_task("sweep", total=len(configs)) if progress else None
    for config in configs:
        if progress:
            progress.update(task, description=f"sweep: {config}")
        try:
            rows.append(_measure(config, query_elements, rep_ms, tbps, seed, device, passes))
        except Exception as error:  # noqa: BLE001 -- one configuration's failure is a result; the rest still run
            failed.append({**asdict(config), "status": harness.FAILED, "reason": harness.describe(error)})
        finally:
            if device == "cuda":
                harness.free_memory()
        if progress:
            progress.advance(task)
    return {"environment": harness.environment(), "copy_bandwidth_tbps": tbps, "num_heads": NUM_HEADS,
            "query_elements": query_elements, "passes": list(passes), "results": rows, "failed": failed}


def print_report(report: dict, console) -> None:
    from rich.table import Table

    env = report["environment"]
    console.print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; copy bandwidth "
                  f"{report['copy_bandwidth_tbps']:.2f} TB/s; Hq = {report['num_heads']}")
    table = Table(title="configuration sweep: time over each configuration's memory floor")
    for col in ("BS", "D", "Hq:Hkv", "dtype", "rotary", "tokens", *(f"{p} {c}" for p in PASSES for c in
                                                                     ("ms", "x floor", "TFLOP/s (at floor)"))):
        table.add_column(col)
    for r in report["results"]:
        passes = [(f"{r[p]['ms']:.3f}", f"{r[p]['x_floor']:.2f}",
                   f"{r[p]['tflops']:.0f} ({r[p]['tflops_at_floor']:.0f})") if p in r else ("-", "-", "-")
                  for p in PASSES]
        table.add_row(str(r["block_size"]), str(r["head_dim"]), f"{report['num_heads']}:{r['kv_heads']}", r["dtype"],
                      r["rotary"], str(r["tokens"]), *passes[0], *passes[1])
    console.print(table)
    console.print("TFLOP/s: the products' FLOPs (2 forward, 5 backward, over the in-block pairs) per second; in "
                  "brackets the rate the memory floor's time would take: where that is beyond what the kernel "
                  "sustains, its arithmetic rate, not memory, bounds the configuration.")
    for f in report["failed"]:
        console.print(f"FAILED: BS {f['block_size']}, D {f['head_dim']}, Hkv {f['kv_heads']}, {f['dtype']}, "
                      f"{f['rotary']}: {f['reason']}", style="bold red", markup=False)


def newest_figures(reports: list[tuple[str, dict]], dtypes: tuple[str, ...] = DTYPES) -> dict[str, dict]:
    """Per device, every configuration's newest figures over ``reports`` (``(name, report)`` pairs; sweeps are
    often run one axis at a time, so the grid's state is spread over many): for each configuration of ``dtypes`` and
    each pass, that pass's entry from the newest report that timed it, with the report's ``date`` and ``name``.
    Returned as ``{device: {(block_size, head_dim, kv_heads, dtype, rotary): row}}``, rows as a report's."""
    merged: dict[str, dict] = {}
    for name, report in reports:
        env = report["environment"]
        device = merged.setdefault(env["device"], {})
        for row in report["results"]:
            if row["dtype"] not in dtypes:
                continue
            key = (row["block_size"], row["head_dim"], row["kv_heads"], row["dtype"], row["rotary"])
            entry = device.setdefault(key, {k: v for k, v in row.items() if k not in PASSES})
            for pass_name in PASSES:
                if pass_name in row and env["date"] >= entry.get(pass_name, {}).get("date", ""):
                    entry[pass_name] = {**row[pass_name], "date": env["date"], "name": name}
    return merged


def summary_table(results: dict) -> str:
    """Markdown of one device's :func:`newest_figures`: a row per (dtype, block size, head dim), a column per
    (pass, rotary), each cell the time over the floor across the GQA ratios measured (min-max)."""
    columns = [(p, r) for p in PASSES for r in ROTARY]
    rows = sorted({(k[3], k[0], k[1]) for k in results}, key=lambda k: (DTYPES.index(k[0]), k[1], k[2]))
    lines = ["| dtype | BS | D | " + " | ".join(f"{p}, {r}" for p, r in columns) + " |",
             "|---" * (3 + len(columns)) + "|"]
    for dtype, bs, d in rows:
        cells = []
        for pass_name, rotary in columns:
            values = [e[pass_name]["x_floor"] for k, e in results.items()
                      if k[:2] == (bs, d) and k[3:] == (dtype, rotary) and pass_name in e]
            cells.append("" if not values else f"{min(values):.2f}" if len(values) == 1
                         else f"{min(values):.2f}–{max(values):.2f}")
        lines.append(f"| {dtype} | {bs} | {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def heatmap(report: dict):
    """One panel per (pass timed, dtype, rotary): block size and head dim down, GQA ratio across, x floor in
    colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    passes = [p for p in PASSES if any(p in r for r in rows)]
    panels = sorted({(r["dtype"], r["rotary"]) for r in rows}, key=lambda p: (DTYPES.index(p[0]),
                                                                            ROTARY.index(p[1])))
    shapes = sorted({(r["block_size"], r["head_dim"]) for r in rows})
    ratios = sorted({r["gqa"] for r in rows})
    fig, axes = plt.subplots(len(passes), len(panels), figsize=(3.2 * len(panels) + 1, 0.32 * len(shapes) * 2 + 2),
                             squeeze=False, constrained_layout=True)
    by_key = {(r["dtype"], r["rotary"], r["block_size"], r["head_dim"], r["gqa"]): r for r in rows}
    image = None
    for i, pass_name in enumerate(passes):
        for j, (dtype, rotary) in enumerate(panels):
            values = [[by_key[(dtype, rotary, bs, d, g)][pass_name]["x_floor"]
                       if pass_name in by_key.get((dtype, rotary, bs, d, g), {}) else float("nan") for g in ratios]
                      for bs, d in shapes]
            ax = axes[i][j]
            image = ax.imshow(values, cmap="RdYlGn_r", vmin=0.9, vmax=2.0, aspect="auto")
            for y, line in enumerate(values):
                for x, value in enumerate(line):
                    if not math.isnan(value):
                        ax.text(x, y, f"{value:.2f}", ha="center", va="center", fontsize=7)
            ax.set_title(f"{pass_name}, {dtype}, {rotary}", fontsize=9)
            ax.set_xticks(range(len(ratios)), [f"{g}:1" for g in ratios])
            ax.set_yticks(range(len(shapes)), [f"BS {bs}, D {d}" for bs, d in shapes] if j == 0 else [])
    fig.colorbar(image, ax=axes, label="time / memory floor", shrink=0.6)
    env = report["environment"]
    fig.suptitle(f"blockattn configuration sweep, {env['device']}, {env['date'][:10]}")
    return fig


def write_files(report: dict, out_dir: Path) -> list[Path]:
    json_path = harness.write_json(report, out_dir, "sweep.json")
    if not report["results"]:
        return [json_path]
    import matplotlib.pyplot as plt

    png_path = out_dir / "sweep.png"
    fig = heatmap(report)
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return [json_path, png_path]
