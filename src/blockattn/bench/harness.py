"""The benchmark: copy bandwidth, memory floors, exactness checks, timings, accuracy, and the report files."""

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

from blockattn.reference import block_attention_reference

from .baselines import BASELINES, REFERENCE_BASELINE, Case, Runner, Unavailable, blockattn_runner
from .presets import Workload

PASSES = ("fwd", "bwd", "fwdbwd")
OURS = "blockattn"
# A baseline whose result is further than this from blockattn's computes something else (bf16 is ~50 dB).
MATCH_SNR_DB = 30.0
# The accuracy report runs the float64 reference on the first sequences of a workload, up to this many tokens.
ACCURACY_TOKENS = 32768


def snr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    noise = (out.double() - ref.double()).pow(2).sum().item()
    return 10 * math.log10(ref.double().pow(2).sum().item() / max(noise, 1e-300))


def time_ms(fn, rep_ms: int) -> float:
    """Median time of ``fn`` over CUDA events, warm-up excluded (triton's do_bench also clears L2 between runs)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median"))


def copy_bandwidth_tbps(rep_ms: int, gib: float = 2.0) -> float:
    """Device-to-device copy bandwidth, bytes read plus bytes written."""
    src = torch.randn(int(gib * 2**30) // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), rep_ms)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e12


def floor_bytes(w: Workload, num_tokens: int) -> dict[str, int]:
    """SPEC §4: fwd reads q, k, v and writes o; bwd reads q, k, v, do and writes dq, dk, dv."""
    per_head = num_tokens * w.head_dim * w.torch_dtype.itemsize
    fwd = (2 * w.heads + 2 * w.kv_heads) * per_head
    bwd = (3 * w.heads + 4 * w.kv_heads) * per_head
    return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}


def make_case(w: Workload, offsets: torch.Tensor, seed: int) -> Case:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    n = int(offsets[-1])

    def randn(heads):
        return torch.randn(n, heads, w.head_dim, device="cuda", dtype=w.torch_dtype, generator=generator)

    return Case(randn(w.heads), randn(w.kv_heads), randn(w.kv_heads), randn(w.heads), offsets, w.block_size,
                1.0 / math.sqrt(w.head_dim))


@dataclass
class Report:
    environment: dict
    copy_tbps: float
    results: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    accuracy: list[dict] = field(default_factory=list)
    workloads: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"environment": self.environment, "copy_bandwidth_tbps": self.copy_tbps, "workloads": self.workloads,
                "results": self.results, "skipped": self.skipped, "accuracy": self.accuracy}


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
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
    """Max and mean |error| of out, dq, dk, dv against float64, for blockattn and FA2 on the same inputs."""
    bounds = offsets.tolist()
    num_seqs = max(1, sum(1 for b in bounds[1:] if b <= ACCURACY_TOKENS))
    case = make_case(w, offsets[: num_seqs + 1].clone(), seed)
    leaves = [t.double().requires_grad_() for t in case.inputs]
    ref = block_attention_reference(*leaves, case.offsets, block_size=case.block_size, scale=case.scale)
    exact = [ref.detach(), *torch.autograd.grad(ref, leaves, case.do.double())]
    rows = []
    for name, factory in ((OURS, blockattn_runner), (REFERENCE_BASELINE, BASELINES[REFERENCE_BASELINE])):
        try:
            results = factory(case).check()
        except Unavailable as why:
            rows.append({"workload": w.name, "impl": name, "skipped": str(why)})
            continue
        row = {"workload": w.name, "impl": name, "tokens": int(case.offsets[-1])}
        for label, got, want in zip(("out", "dq", "dk", "dv"), results, exact):
            err = (got.double() - want).abs()
            row[f"max_{label}"], row[f"mean_{label}"] = err.max().item(), err.mean().item()
            row[f"snr_{label}_db"] = snr_db(got, want)
        rows.append(row)
    return rows


def run(workloads: list[Workload], passes: list[str], baselines: list[str], rep_ms: int, seed: int,
        progress) -> Report:
    report = Report(environment(), copy_bandwidth_tbps(rep_ms))
    names = [OURS, *baselines]
    task = progress.add_task("benchmark", total=len(workloads) * len(names))
    for w in workloads:
        offsets = w.offsets(seed, device="cuda")
        case = make_case(w, offsets, seed)
        n = case.q.shape[0]
        floors = {p: b / (report.copy_tbps * 1e12) * 1e3 for p, b in floor_bytes(w, n).items()}
        report.workloads.append({**w.to_dict(), "tokens": n, "blocks": int(case.rows.shape[0]),
                                 "floor_ms": floors})
        expected = None
        timings: dict[str, dict[str, float]] = {}
        for name in names:
            progress.update(task, description=f"{w.name}: {name}")
            factory = blockattn_runner if name == OURS else BASELINES[name]
            try:
                runner: Runner = factory(case)
                results = runner.check()
                if expected is None:
                    expected = [t.detach() for t in results]
                else:
                    agreement = _check(results, expected)
                    if not agreement >= MATCH_SNR_DB:
                        raise Unavailable(f"result differs from blockattn (SNR {agreement:.1f} dB): not a baseline")
                del results
                timings[name] = {p: time_ms(getattr(runner, p), rep_ms) for p in passes}
                extra = {label: time_ms(fn, rep_ms) for label, fn in runner.extra.items()}
            except Unavailable as why:
                report.skipped.append({"workload": w.name, "impl": name, "reason": str(why)})
                progress.advance(task)
                continue
            finally:
                runner = None
                gc.collect()
                torch.cuda.empty_cache()
            for p in passes:
                ms = timings[name][p]
                report.results.append({
                    "workload": w.name, "pass": p, "impl": name, "ms": ms,
                    "floor_ms": floors[p], "x_floor": ms / floors[p],
                    "floor_tbps": floor_bytes(w, n)[p] / (ms * 1e-3) / 1e12,
                    "extra_ms": extra,
                })
            progress.advance(task)
        for row in report.results:
            fa2 = timings.get(REFERENCE_BASELINE, {}).get(row["pass"])
            if row["workload"] == w.name and fa2:
                row["speedup_vs_fa2"] = fa2 / row["ms"]
        progress.update(task, description=f"{w.name}: accuracy vs float64")
        report.accuracy += _accuracy(w, offsets, seed)
        del case, expected
        gc.collect()
        torch.cuda.empty_cache()
    return report


def write_chart(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["workload"], r["pass"]) for r in report.results}, key=lambda g: (g[0], PASSES.index(g[1])))
    impls = [i for i in dict.fromkeys(r["impl"] for r in report.results) if i != REFERENCE_BASELINE]
    speed = {(r["workload"], r["pass"], r["impl"]): r.get("speedup_vs_fa2") for r in report.results}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(groups) + 2), 4.5))
    width = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
        xs = [g + i * width for g in range(len(groups))]
        ys = [speed.get((*grp, impl)) or 0.0 for grp in groups]
        ax.bar(xs, ys, width, label=impl)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([g + width * (len(impls) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"{w}\n{p}" for w, p in groups])
    ax.set_ylabel("speedup over FlashAttention-2 varlen (aten)")
    env = report.environment
    ax.set_title(f"block attention, {env['device']}, {env['date'][:10]}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_files(report: Report, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, chart_path = out_dir / "bench.json", out_dir / "bench.png"
    json_path.write_text(json.dumps(report.to_json(), indent=2))
    paths = [json_path]
    if report.results:
        write_chart(report, chart_path)
        paths.append(chart_path)
    return paths
