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


def floor_bytes(w: Workload, num_tokens: int, rotary: bool = False) -> dict[str, int]:
    """SPEC §4: fwd reads q, k, v and writes o; bwd reads q, k, v, do and writes dq, dk, dv. A fused rotary reads
    ``sinu_pos`` ([N, D]) in each pass too."""
    per_head = num_tokens * w.head_dim * w.torch_dtype.itemsize
    fwd = (2 * w.heads + 2 * w.kv_heads + rotary) * per_head
    bwd = (3 * w.heads + 4 * w.kv_heads + rotary) * per_head
    return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}


def make_case(w: Workload, offsets: torch.Tensor, seed: int) -> Case:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    n = int(offsets[-1])

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=w.torch_dtype, generator=generator) * scale

    sinu_pos = projection = None
    if w.rotary:
        angles = torch.rand(n, w.head_dim // 2, device="cuda", generator=generator) * 2 * math.pi
        sinu_pos = torch.cat([angles.sin(), angles.cos()], dim=1).to(w.torch_dtype)
        d_model, width = w.heads * w.head_dim, (w.heads + 2 * w.kv_heads) * w.head_dim
        projection = (randn(n, d_model), randn(d_model, width, scale=d_model**-0.5), randn(width))
    return Case(randn(n, w.heads, w.head_dim), randn(n, w.kv_heads, w.head_dim), randn(n, w.kv_heads, w.head_dim),
                randn(n, w.heads, w.head_dim), offsets, w.block_size, 1.0 / math.sqrt(w.head_dim), sinu_pos,
                projection)


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
    tbps = report.copy_tbps * 1e12
    expected = None
    rows = []
    for name, factory in factories.items():
        progress.update(task, description=f"{w.name} {group}: {name}")
        try:
            runner: Runner = factory(case)
            results = runner.check()
            if expected is None:
                expected = [t.detach() for t in results]
            else:
                agreement = _check(results, expected)
                if not agreement >= MATCH_SNR_DB:
                    raise Unavailable(f"result differs from {next(iter(factories))} (SNR {agreement:.1f} dB)")
            del results
            timings = {p: time_ms(getattr(runner, p), rep_ms) for p in passes}
            extra = {label: time_ms(fn, rep_ms) for label, fn in runner.extra.items()}
        except Unavailable as why:
            report.skipped.append({"workload": w.name, "group": group, "impl": name, "reason": str(why)})
            continue
        finally:
            runner = None
            gc.collect()
            torch.cuda.empty_cache()
            progress.advance(task)
        for p, ms in timings.items():
            row = {"workload": w.name, "group": group, "pass": p, "impl": name, "ms": ms, "extra_ms": extra,
                   "reference": reference, "floor_ms": None, "x_floor": None, "floor_tbps": None}
            if floor is not None:
                row.update(floor_ms=floor[p] / tbps * 1e3, x_floor=ms / (floor[p] / tbps * 1e3),
                           floor_tbps=floor[p] / (ms * 1e-3) / 1e12)
            if group == "rotary":  # the yardstick: the attention-only floor
                row["x_attention_floor"] = ms / (floor_bytes(w, case.q.shape[0])[p] / tbps * 1e3)
            rows.append(row)
    for row in rows:
        ref = next((r["ms"] for r in rows if r["impl"] == reference and r["pass"] == row["pass"]), None)
        if ref:
            row["speedup_vs_fa2"] = ref / row["ms"]
    report.results += rows


def run(workloads: list[Workload], passes: list[str], baselines: list[str], rep_ms: int, seed: int,
        progress) -> Report:
    report = Report(environment(), copy_bandwidth_tbps(rep_ms))
    plans = []
    for w in workloads:
        plans.append((w, w.offsets(seed, device="cuda")))
    total = sum(len(g[1]) for w, o in plans for g in _groups(w, int(o[-1]), baselines))
    task = progress.add_task("benchmark", total=total)
    for w, offsets in plans:
        case = make_case(w, offsets, seed)
        n = case.q.shape[0]
        report.workloads.append({**w.to_dict(), "tokens": n, "blocks": int(case.rows.shape[0]),
                                 "floor_ms": {p: b / (report.copy_tbps * 1e12) * 1e3
                                              for p, b in floor_bytes(w, n).items()}})
        for group in _groups(w, n, baselines):
            _time_group(report, w, case, *group, passes, rep_ms, progress, task)
        progress.update(task, description=f"{w.name}: accuracy vs float64")
        report.accuracy += _accuracy(w, offsets, seed)
        del case
        gc.collect()
        torch.cuda.empty_cache()
    return report


def write_chart(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(f"{r['workload']} {r['group']}", r["pass"]) for r in report.results},
                    key=lambda g: (g[0], PASSES.index(g[1])))
    references = {r["reference"] for r in report.results}
    impls = [i for i in dict.fromkeys(r["impl"] for r in report.results) if i not in references]
    speed = {(f"{r['workload']} {r['group']}", r["pass"], r["impl"]): r.get("speedup_vs_fa2") for r in report.results}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(groups) + 2), 4.5))
    width = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
        xs = [g + i * width for g in range(len(groups))]
        ys = [speed.get((*grp, impl)) or 0.0 for grp in groups]
        ax.bar(xs, ys, width, label=impl)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([g + width * (len(impls) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"{w}\n{p}" for w, p in groups])
    ax.set_ylabel("speedup over the FlashAttention-2 path of its group")
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
