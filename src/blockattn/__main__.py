"""Command line: ``python -m blockattn bench`` and ``python -m blockattn info``."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

from .bench.presets import CPU_DEMO, PRESETS, Workload, lengths_for_sparsity

PASS_CHOICES = {"fwd": ["fwd"], "bwd": ["bwd"], "fwdbwd": ["fwdbwd"], "all": ["fwd", "bwd", "fwdbwd"]}
CUSTOM_FLAGS = ("seqs", "max_len", "sparsity", "heads", "kv_heads", "head_dim", "block_size")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="time block attention against every baseline this machine can run")
    bench.add_argument("--preset", nargs="+", choices=sorted(PRESETS), default=None,
                       help="workloads of SPEC §3 (default: ads; with custom shape flags: none)")
    bench.add_argument("--pass", dest="passes", choices=sorted(PASS_CHOICES), default="all")
    bench.add_argument("--dtype", choices=["bfloat16", "float16"], default=None, help="override the dtype")
    bench.add_argument("--seqs", type=int, help="custom workload: number of sequences")
    bench.add_argument("--max-len", type=int, help="custom workload: longest sequence")
    bench.add_argument("--sparsity", type=float, default=0.7, help="custom workload: mean length / max-len")
    bench.add_argument("--heads", type=int, help="custom workload: query heads")
    bench.add_argument("--kv-heads", type=int, help="custom workload: key/value heads (default: --heads)")
    bench.add_argument("--head-dim", type=int, help="custom workload: head dim")
    bench.add_argument("--block-size", type=int, help="custom workload: block size (default 64)")
    bench.add_argument("--rotary", action="store_true",
                       help="also time fused rotary and projection (always on for the ads-rotary preset)")
    bench.add_argument("--baselines", nargs="*", default=None,
                       help="names of baselines to run (default: all); see `blockattn info`")
    bench.add_argument("--rep-ms", type=int, default=300, help="time spent repeating each measurement")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for bench.json and bench.png")
    sub.add_parser("info", help="GPU, library versions, available kernels and baselines")
    return parser


def workloads_from_args(args: argparse.Namespace) -> list[Workload]:
    custom = {flag: getattr(args, flag) for flag in CUSTOM_FLAGS if flag != "sparsity" and getattr(args, flag)}
    selected = [PRESETS[name] for name in (args.preset or ([] if custom else ["ads"]))]
    if custom:
        missing = [f"--{f.replace('_', '-')}" for f in ("seqs", "max_len", "heads", "head_dim") if f not in custom]
        if missing:
            raise SystemExit(f"blockattn bench: a custom workload needs {', '.join(missing)}")
        lo, hi = lengths_for_sparsity(args.max_len, args.sparsity)
        selected.append(Workload("custom", args.seqs, lo, hi, args.heads, args.kv_heads or args.heads,
                                 args.head_dim, args.block_size or 64))
    if args.dtype:
        selected = [Workload(**{**w.to_dict(), "dtype": args.dtype}) for w in selected]
    if args.rotary:
        selected = [Workload(**{**w.to_dict(), "rotary": True}) for w in selected]
    return selected


def cpu_demo() -> int:
    """No GPU: show that the op works (CPU path against the float64 reference); time nothing."""
    from . import block_attention
    from .reference import block_attention_reference

    w = CPU_DEMO
    offsets = w.offsets()
    n = int(offsets[-1])
    q, k, v = (torch.randn(n, h, w.head_dim) for h in (w.heads, w.kv_heads, w.kv_heads))
    out = block_attention(q, k, v, offsets, block_size=w.block_size)
    ref = block_attention_reference(q, k, v, offsets, block_size=w.block_size)
    err = (out.double() - ref).abs().max().item()
    print("No CUDA GPU here, so no timings: a CPU measurement would say nothing about the kernels.")
    print(f"The op works: CPU path on {w.num_seqs} sequences ({n} tokens, H={w.heads}, D={w.head_dim}), "
          f"max |out - float64 reference| = {err:.2e}.")
    return 0


def print_report(report, console) -> None:
    from rich.table import Table

    env = report.environment
    console.print(f"[bold]{env['device']}[/] (sm_{env['compute_capability'].replace('.', '')}, "
                  f"{env['sm_count']} SMs), torch {env['torch']}, triton {env['triton']}, {env['date']}")
    console.print(f"copy bandwidth: {report.copy_tbps:.2f} TB/s (device-to-device, read + write)")
    table = Table(title="time per call (median)")
    for col in ("workload", "group", "pass", "implementation", "ms", "floor ms", "x floor", "TB/s at floor bytes",
                "speedup vs FA2 path", "reported apart (ms)"):
        table.add_column(col, justify="left" if col in ("workload", "group", "pass", "implementation") else "right")

    def number(value, digits):
        return "-" if value is None else f"{value:.{digits}f}"

    for r in report.results:
        speedup = r.get("speedup_vs_fa2")
        table.add_row(r["workload"], r["group"], r["pass"], r["impl"], f"{r['ms']:.3f}", number(r["floor_ms"], 3),
                      number(r["x_floor"], 2), number(r["floor_tbps"], 2), f"{speedup:.2f}x" if speedup else "-",
                      ", ".join(f"{k}: {v:.3f}" for k, v in r["extra_ms"].items()))
    console.print(table)
    console.print("Groups: attention (speedups vs FA2 varlen); rotary: q, k, v rotated then attention, floor with "
                  "sinu_pos (vs FA2 + PyTorch rotary); qkv: x @ w + bias, rotary, attention, forward and backward to "
                  "dx, dw, dbias (vs matmul + PyTorch rotary + FA2; no floor).")
    for s in report.skipped:
        console.print(f"skipped {s['impl']} on {s['workload']} ({s.get('group', 'attention')}): {s['reason']}")
    acc = Table(title="accuracy against float64 (first sequences of each workload)")
    for col in ("workload", "implementation", "tokens", "max |out|", "max |dq|", "max |dk|", "max |dv|",
                "mean |dq|", "SNR dq dB"):
        acc.add_column(col)
    for a in report.accuracy:
        if "skipped" in a:
            continue
        acc.add_row(a["workload"], a["impl"], str(a["tokens"]),
                    *(f"{a[f'max_{t}']:.4f}" for t in ("out", "dq", "dk", "dv")),
                    f"{a['mean_dq']:.2e}", f"{a['snr_dq_db']:.1f}")
    console.print(acc)


def bench(args: argparse.Namespace) -> int:
    workloads = workloads_from_args(args)
    if not torch.cuda.is_available():
        return cpu_demo()
    missing = [m for m in ("rich", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"blockattn bench needs {' and '.join(missing)}: pip install 'blockattn[bench]'")
    from rich.console import Console
    from rich.progress import Progress

    from .bench import harness
    from .bench.baselines import BASELINES

    unknown = sorted(set(args.baselines or []) - set(BASELINES))
    if unknown:
        raise SystemExit(f"blockattn bench: unknown baselines {unknown}; known: {sorted(BASELINES)}")
    console = Console()
    with Progress(console=console, transient=True) as progress:
        report = harness.run(workloads, PASS_CHOICES[args.passes],
                             list(BASELINES) if args.baselines is None else args.baselines,
                             args.rep_ms, args.seed, progress)
    print_report(report, console)
    for path in harness.write_files(report, args.out):
        console.print(f"wrote {path}")
    return 0


def info() -> int:
    import triton

    from . import __version__
    from .bench.baselines import BASELINES

    print(f"blockattn {__version__}, torch {torch.__version__}, triton {triton.__version__}, "
          f"python {sys.version.split()[0]}")
    if not torch.cuda.is_available():
        print("GPU: none (CUDA not available). Kernels: PyTorch CPU path only.")
    else:
        props = torch.cuda.get_device_properties(0)
        print(f"GPU: {props.name}, compute capability {props.major}.{props.minor}, "
              f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}")
        supported = props.major >= 8
        print(f"Kernels: Triton block attention forward/backward: {'yes' if supported else 'no (needs sm_80+)'}")
    print("Baselines (bench):")
    for name in BASELINES:
        print(f"  {name}")
    for module in ("flash_attn", "flash_attn_interface", "xformers"):
        print(f"  package {module}: {'installed' if importlib.util.find_spec(module) else 'not installed'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return bench(args) if args.command == "bench" else info()


if __name__ == "__main__":
    sys.exit(main())
