"""The benchmark: copy bandwidth, memory floors, exactness checks, timings, peak memory, accuracy, and the report
files.

An implementation that cannot run here (:class:`Unavailable`) is reported as unavailable, one that raises anything
else (a cuDNN error, out of memory, a compile error) or computes something else as failed; either way the run goes
on with the next implementation and workload, and the report is written at the end.
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import math
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch

from blockattn.reference import block_attention_reference, random_angles, snr_db

from .baselines import (
    BASELINES,
    QKV_IMPLS,
    QKV_REFERENCE,
    REFERENCE_BASELINE,
    ROTARY_IMPLS,
    ROTARY_REFERENCE,
    Case,
    Runner,
    Unavailable,
    blockattn_runner,
)
from .presets import Workload

PASSES = ("fwd", "bwd", "fwdbwd")
OURS = "blockattn"
UNAVAILABLE, FAILED = "unavailable", "failed"
# A baseline whose result is further than this from the checked one computes something else (bf16 is ~50 dB).
MATCH_SNR_DB = 30.0
# The accuracy report runs the float64 reference on the first sequences of a workload, up to this many tokens.
ACCURACY_TOKENS = 32768
QUANTILES = {"p20": 0.2, "p50": 0.5, "p80": 0.8}


class WrongResult(Exception):
    """An implementation's result is not the one it was checked against."""


def describe(error: BaseException) -> str:
    """``Type: first line of the message``: enough to tell a cuDNN error from an out-of-memory in a table row."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def uses_blockattn(impl: str) -> bool:
    """Implementations that run blockattn say so in their name; a failure of one is a failure of the library."""
    return OURS in impl


def time_ms(fn, rep_ms: int) -> dict[str, float]:
    """p20, median and p80 time of ``fn`` in ms over CUDA events, warm-up excluded (triton's do_bench also clears
    L2 between runs)."""
    import triton.testing

    times = triton.testing.do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, quantiles=list(QUANTILES.values()))
    return dict(zip(QUANTILES, map(float, times)))


def graphed(fn):
    """``fn`` captured in a CUDA graph (after warm-up on a side stream, as PyTorch's docs do); returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def peak_mib(fn) -> float:
    """Memory one call of ``fn`` allocates at its peak, above what was allocated before it, in MiB. A call of its
    own rather than around the timing: do_bench allocates a buffer to flush L2 that would count too."""
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - held) / 2**20


def free_memory() -> None:
    """Drop what a finished (or failed: its traceback held its tensors) implementation left in the caching
    allocator, so the next one starts from the same memory."""
    gc.collect()
    torch.cuda.empty_cache()


def copy_bandwidth_tbps(rep_ms: int, gib: float = 2.0) -> float:
    """Device-to-device copy bandwidth, bytes read plus bytes written."""
    src = torch.randn(int(gib * 2**30) // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), rep_ms)["p50"]
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e12


def floor_bytes(w: Workload, num_tokens: int, rotary: bool = False) -> dict[str, int]:
    """The memory floor (docs/semantics.md, "Memory floor"): fwd reads q, k, v and writes o; bwd reads q, k, v, do
    and writes dq, dk, dv. A fused rotary reads ``sinu_pos`` ([N, D]) in each pass too."""
    per_head = num_tokens * w.head_dim * w.torch_dtype.itemsize
    fwd = (2 * w.heads + 2 * w.kv_heads + rotary) * per_head
    bwd = (3 * w.heads + 4 * w.kv_heads + rotary) * per_head
    return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}


def fp8_forward_floor_bytes(w: Workload, num_tokens: int) -> int:
    """The fp8 forward's memory floor: q, k, v read at one byte per element, the bf16 output written."""
    return (w.heads + 2 * w.kv_heads + 2 * w.heads) * num_tokens * w.head_dim


def make_case(w: Workload, offsets: torch.Tensor, seed: int) -> Case:
    """Random inputs of ``w`` on the device of ``offsets``."""
    device = offsets.device
    generator = torch.Generator(device=device).manual_seed(seed)
    n = int(offsets[-1])

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device=device, dtype=w.torch_dtype, generator=generator) * scale

    sinu_pos = projection = None
    if w.rotary:
        sinu_pos = random_angles(n, w.head_dim, device, generator).to(w.torch_dtype)
        d_model, width = w.heads * w.head_dim, (w.heads + 2 * w.kv_heads) * w.head_dim
        projection = (randn(n, d_model), randn(d_model, width, scale=d_model**-0.5), randn(width))
    return Case(randn(n, w.heads, w.head_dim), randn(n, w.kv_heads, w.head_dim), randn(n, w.kv_heads, w.head_dim),
                randn(n, w.heads, w.head_dim), offsets, w.block_size, 1.0 / math.sqrt(w.head_dim), sinu_pos,
                projection)


@dataclass
class Report:
    """What a run measured. ``results``: one row per (workload, group, implementation, pass) that was timed.
    ``skipped``: one entry per implementation that was not, with ``status`` "unavailable" (cannot run here) or
    "failed" (raised while running, or computed something else) and the ``reason``. ``workloads``: each workload's
    shape, tokens and floors, the implementations of each of its groups in the order they ran, and ``failed`` where
    the workload itself could not be run."""

    environment: dict
    copy_tbps: float
    results: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    accuracy: list[dict] = field(default_factory=list)
    workloads: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"environment": self.environment, "copy_bandwidth_tbps": self.copy_tbps, "workloads": self.workloads,
                "results": self.results, "skipped": self.skipped, "accuracy": self.accuracy}

    def headline_failures(self) -> list[str]:
        """Failures that get a line of their own: whole workloads, and implementations that run blockattn."""
        lines = [f"workload {w['name']}: {w['failed']}" for w in self.workloads if "failed" in w]
        lines += [f"{s['impl']} on {s['workload']} ({s['group']}): {s['reason']}" for s in self.skipped
                  if s["status"] == FAILED and uses_blockattn(s["impl"])]
        return lines


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30, check=False).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        driver = "unknown"
    import triton

    import blockattn

    return {
        "device": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "blockattn": blockattn.__version__,
        "python": platform.python_version(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _check(results, expected) -> float:
    return min(snr_db(got, ref) for got, ref in zip(results, expected))


def _accuracy(w: Workload, offsets: torch.Tensor, seed: int) -> list[dict]:
    """Max and mean |error| of out, dq, dk, dv against float64, for blockattn and FA2 on the same inputs; an
    implementation that cannot run or fails gets a row saying so."""
    bounds = offsets.tolist()
    num_seqs = max(1, sum(1 for b in bounds[1:] if b <= ACCURACY_TOKENS))
    rows = []
    try:
        case = make_case(w, offsets[: num_seqs + 1].clone(), seed)
        leaves = [t.double().requires_grad_() for t in case.inputs]
        ref = block_attention_reference(*leaves, case.offsets, block_size=case.block_size, scale=case.scale)
        exact = [ref.detach(), *torch.autograd.grad(ref, leaves, case.do.double())]
    except Exception as error:  # noqa: BLE001 -- without the reference there is nothing to compare; the timings stand
        return [{"workload": w.name, "impl": "float64 reference", "status": FAILED, "reason": describe(error)}]
    for name, factory in ((OURS, blockattn_runner), (REFERENCE_BASELINE, BASELINES[REFERENCE_BASELINE])):
        try:
            results = factory(case).check()
        except Unavailable as why:
            rows.append({"workload": w.name, "impl": name, "status": UNAVAILABLE, "reason": str(why)})
            continue
        except Exception as error:  # noqa: BLE001 -- a baseline that raises is reported, the others still run
            rows.append({"workload": w.name, "impl": name, "status": FAILED, "reason": describe(error)})
            continue
        row = {"workload": w.name, "impl": name, "tokens": int(case.offsets[-1])}
        for label, got, want in zip(("out", "dq", "dk", "dv"), results, exact):
            err = (got.double() - want).abs()
            row[f"max_{label}"], row[f"mean_{label}"] = err.max().item(), err.mean().item()
            row[f"snr_{label}_db"] = snr_db(got, want)
        rows.append(row)
    return rows


def _groups(w: Workload, n: int, baselines: list[str]) -> list[tuple]:
    """What one workload times: ``(group, {name: factory}, reference name, floor bytes or None)``. The attention
    group always; rotary workloads add rotary fused into attention (against attention + a separate rotary) and the
    whole projection + rotary + attention (matmul-bound, so no floor)."""
    groups = [("attention", {OURS: blockattn_runner, **{b: BASELINES[b] for b in baselines}}, REFERENCE_BASELINE,
               floor_bytes(w, n))]
    if w.rotary:
        groups += [("rotary", ROTARY_IMPLS, ROTARY_REFERENCE, floor_bytes(w, n, rotary=True)),
                   ("qkv", QKV_IMPLS, QKV_REFERENCE, None)]
    return groups


def _time_group(report: Report, w: Workload, case: Case, group: str, factories: dict, reference: str,
                floor: dict | None, passes: list[str], rep_ms: int, progress, task) -> None:
    """Check, time and measure each implementation of one group. ``reference`` is the speedups' yardstick; results
    are checked against the first implementation whose check ran (blockattn's, unless it failed): each row names
    it in ``checked_against``."""
    tbps = report.copy_tbps * 1e12
    expected = checked_against = None
    rows = []
    for name, factory in factories.items():
        progress.update(task, description=f"{w.name} {group}: {name}")
        where = {"workload": w.name, "group": group, "impl": name}
        runner = results = None
        try:
            runner: Runner = factory(case)
            results = runner.check()
            if expected is None:
                expected, checked_against = [t.detach() for t in results], name
            else:
                agreement = _check(results, expected)
                if not agreement >= MATCH_SNR_DB:
                    raise WrongResult(f"differs from {checked_against}'s result (SNR {agreement:.1f} dB)")
            results = None  # not held while timing
            measured = {p: {**time_ms(getattr(runner, p), rep_ms), "peak_mib": peak_mib(getattr(runner, p))}
                        for p in passes}
            extra = {label: time_ms(fn, rep_ms)["p50"] for label, fn in runner.extra.items()}
        except Unavailable as why:
            report.skipped.append({**where, "status": UNAVAILABLE, "reason": str(why)})
            continue
        except Exception as error:  # noqa: BLE001 -- whatever one implementation raises, the others still run
            report.skipped.append({**where, "status": FAILED, "reason": describe(error)})
            continue
        finally:
            runner = results = None
            free_memory()
            progress.advance(task)
        for p, m in measured.items():
            ms = m["p50"]
            row = {**where, "pass": p, "ms": ms, "quantiles_ms": {q: m[q] for q in QUANTILES},
                   "peak_mib": m["peak_mib"], "extra_ms": extra, "reference": reference,
                   "checked_against": None if name == checked_against else checked_against,
                   "floor_ms": None, "x_floor": None, "floor_tbps": None}
            if floor is not None:
                row.update(floor_ms=floor[p] / tbps * 1e3, x_floor=ms / (floor[p] / tbps * 1e3),
                           floor_tbps=floor[p] / (ms * 1e-3) / 1e12)
            if group == "rotary":  # also against the attention-only floor: the fused rotary's bytes are extra work
                row["x_attention_floor"] = ms / (floor_bytes(w, case.q.shape[0])[p] / tbps * 1e3)
            rows.append(row)
    for row in rows:
        ref = next((r["ms"] for r in rows if r["impl"] == reference and r["pass"] == row["pass"]), None)
        if ref:
            row["speedup_vs_fa2"] = ref / row["ms"]
    report.results += rows


def _bench_workload(report: Report, entry: dict, w: Workload, offsets: torch.Tensor, passes: list[str],
                    baselines: list[str], rep_ms: int, seed: int, progress, task) -> None:
    case = make_case(w, offsets, seed)
    n = case.q.shape[0]
    entry.update(tokens=n, blocks=int(case.rows.shape[0]),
                 floor_ms={p: b / (report.copy_tbps * 1e12) * 1e3 for p, b in floor_bytes(w, n).items()},
                 implementations={})
    for group, factories, *rest in _groups(w, n, baselines):
        entry["implementations"][group] = list(factories)
        _time_group(report, w, case, group, factories, *rest, passes, rep_ms, progress, task)
    progress.update(task, description=f"{w.name}: accuracy vs float64")
    report.accuracy += _accuracy(w, offsets, seed)


def run(workloads: list[Workload], passes: list[str], baselines: list[str], rep_ms: int, seed: int, progress,
        device: str = "cuda") -> Report:
    """Time every workload; a workload that fails as a whole (its inputs do not fit, say) is marked ``failed`` in
    ``report.workloads`` and the next one runs."""
    report = Report(environment(), copy_bandwidth_tbps(rep_ms))
    plans = [(w, w.offsets(seed, device=device)) for w in workloads]
    total = sum(len(g[1]) for w, o in plans for g in _groups(w, int(o[-1]), baselines))
    task = progress.add_task("benchmark", total=total)
    for w, offsets in plans:
        entry = w.to_dict()
        report.workloads.append(entry)
        try:
            _bench_workload(report, entry, w, offsets, passes, baselines, rep_ms, seed, progress, task)
        except Exception as error:  # noqa: BLE001 -- the later workloads still run; the report keeps what was timed
            entry["failed"] = describe(error)
        finally:
            free_memory()
    return report


def chart(report: Report):
    """Speedup over each group's FA2 path: one panel per group, bars per implementation, ticks per pass under the
    name of their workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(r["group"] for r in report.results))
    workload_order = list(dict.fromkeys(r["workload"] for r in report.results))
    ticks = {g: sorted({(r["workload"], r["pass"]) for r in report.results if r["group"] == g},
                       key=lambda t: (workload_order.index(t[0]), PASSES.index(t[1]))) for g in groups}
    fig, axes = plt.subplots(len(groups), 1, squeeze=False, layout="constrained",
                             figsize=(max(8.0, 0.6 * max(map(len, ticks.values())) + 4.5), 3.2 * len(groups)))
    for ax, group in zip(axes[:, 0], groups):
        rows = [r for r in report.results if r["group"] == group]
        references = sorted({r["reference"] for r in rows})
        impls = [i for i in dict.fromkeys(r["impl"] for r in rows) if i not in references]
        speed = {(r["workload"], r["pass"], r["impl"]): r.get("speedup_vs_fa2") for r in rows}
        width = 0.8 / max(1, len(impls))
        for i, impl in enumerate(impls):
            ax.bar([x + i * width for x in range(len(ticks[group]))],
                   [speed.get((*t, impl)) or 0.0 for t in ticks[group]], width, label=impl)
        ax.axhline(1.0, color="black", linewidth=0.8)
        middle = width * (len(impls) - 1) / 2
        for x, t in enumerate(ticks[group]):
            if not any(speed.get((*t, ref)) for ref in references):  # why no bars: the table says more
                ax.text(x + middle, 0.05, "no reference\nresult", transform=ax.get_xaxis_transform(), ha="center",
                        va="bottom", rotation=90, fontsize=7, color="grey")
        ax.set_xticks([x + middle for x in range(len(ticks[group]))], labels=[p for _, p in ticks[group]],
                      fontsize=8)
        # Workload names once, centred under their passes, on a second axis below the pass labels.
        names = list(dict.fromkeys(w for w, _ in ticks[group]))
        spans = [[x for x, t in enumerate(ticks[group]) if t[0] == name] for name in names]
        below = ax.secondary_xaxis("bottom")
        below.set_xticks([(s[0] + s[-1]) / 2 + middle for s in spans], labels=names, fontsize=9)
        below.tick_params(axis="x", length=0, pad=16)
        for s in spans[1:]:
            ax.axvline(s[0] - 0.5 + middle, color="grey", linewidth=0.5)
        ax.set_ylabel("speedup")
        ax.set_title(f"{group}: speedup over {', '.join(references)}", fontsize=10)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    env = report.environment
    fig.suptitle(f"block attention, {env['device']}, {env['date'][:10]}")
    return fig


def write_chart(report: Report, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = chart(report)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(report: dict, out_dir: Path, name: str) -> Path:
    """``report`` as ``out_dir / name``, the folder made where missing."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(json.dumps(report, indent=2))
    return path


def write_files(report: Report, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, chart_path = out_dir / "bench.json", out_dir / "bench.png"
    json_path.write_text(json.dumps(report.to_json(), indent=2))
    paths = [json_path]
    if report.results:
        write_chart(report, chart_path)
        paths.append(chart_path)
    return paths
