"""Command line: ``python -m blockattn bench`` and ``python -m blockattn info``."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path

import torch

from . import checks
from .bench import harness
from .bench.baselines import BASELINES
from .bench.presets import CPU_DEMO, PRESETS, Workload, lengths_for_sparsity
from .checks import BLOCK_SIZES, MAX_HEAD_DIM, MIN_HEAD_DIM

PASS_CHOICES = {"fwd": ["fwd"], "bwd": ["bwd"], "fwdbwd": ["fwdbwd"], "all": ["fwd", "bwd", "fwdbwd"]}
CUSTOM_FLAGS = ("seqs", "max_len", "sparsity", "heads", "kv_heads", "head_dim", "block_size")
REQUIRED_CUSTOM_FLAGS = ("seqs", "max_len", "heads", "head_dim")
DEFAULT_SPARSITY, DEFAULT_BLOCK_SIZE = 0.7, 64
# Piped into a file, rich would cut every line to 80 columns; there it gets this width instead.
LOG_WIDTH = 200


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def at_least(low: int):
    """An argparse ``type``: an integer ``>= low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def head_dim(text: str) -> int:
    """An argparse ``type``: a head dim the kernels take (``checks.head_dim``)."""
    value = at_least(1)(text)
    try:
        checks.head_dim(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("head_dim ")) from None
    return value


def sparsity(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (a density: mean length / max-len), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="time block attention against every baseline this machine can run")
    bench.add_argument("--preset", nargs="+", choices=sorted(PRESETS), default=None,
                       help='workloads to time, from docs/semantics.md, "Workloads" (default: ads; with custom '
                            "shape flags: none)")
    bench.add_argument("--pass", dest="passes", choices=sorted(PASS_CHOICES), default="all",
                       help="the passes to time (default: all; --sweep: fwd, bwd or all)")
    bench.add_argument("--dtype", choices=["bfloat16", "float16", "float8_e4m3fn"], default=None,
                       help="override the dtype (float8_e4m3fn: --sweep only, its forward)")
    bench.add_argument("--seqs", type=at_least(1), help="custom workload: number of sequences")
    bench.add_argument("--max-len", type=at_least(2), help="custom workload: longest sequence")
    bench.add_argument("--sparsity", type=sparsity,
                       help=f"custom workload: mean length / max-len, in (0, 1] (default {DEFAULT_SPARSITY})")
    bench.add_argument("--heads", type=at_least(1), help="custom workload: query heads")
    bench.add_argument("--kv-heads", type=at_least(1),
                       help="custom workload: key/value heads, a divisor of --heads (default: --heads)")
    bench.add_argument("--head-dim", type=head_dim,
                       help=f"custom workload: head dim, a multiple of 8 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    bench.add_argument("--block-size", type=int, choices=BLOCK_SIZES,
                       help=f"custom workload: block size (default {DEFAULT_BLOCK_SIZE})")
    bench.add_argument("--rotary", action="store_true",
                       help="also time fused rotary and projection (always on for the ads-rotary preset)")
    bench.add_argument("--dense", action="store_true",
                       help="time flash attention instead (whole sequences: dense shapes B 1/4, S 512-16384, D 64/128, "
                            "causal and not, and varlen on the long preset's lengths) against SDPA cuDNN/flash and "
                            "FA2 varlen; writes dense.json and dense.png")
    bench.add_argument("--options", action="store_true",
                       help="time the in-block options instead (causal, position and time biases, dropout, each alone "
                            "and causal + both biases) on one workload (default: ads) against the plain op, "
                            "FlexAttention and padded SDPA with a bias; writes options.json")
    bench.add_argument("--latency", action="store_true",
                       help="time host wall time per call instead, on small and medium batches (1 x 500 to 256 x 1400 "
                            "tokens, H 4, D 128), eager (offsets, and a BlockLayout) and as CUDA graphs, against FA2 "
                            "varlen; writes latency.json")
    bench.add_argument("--sweep", action="store_true",
                       help="time every configuration instead: block size x head dim x GQA ratio x dtype x rotary "
                            "(none, fp32 angles, angles in the inputs' dtype), forward and backward replayed as CUDA "
                            "graphs, over each one's memory floor; --block-size, --head-dim, --kv-heads and --dtype "
                            "restrict an axis to one value, --pass to one pass; writes sweep.json and sweep.png")
    bench.add_argument("--baselines", nargs="*", choices=list(BASELINES), metavar="NAME", default=None,
                       help="baselines to run (default: all): " + ", ".join(f"'{b}'" for b in BASELINES))
    bench.add_argument("--rep-ms", type=at_least(1), default=300, help="time spent repeating each measurement")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for bench.json and bench.png")
    # Checks across flags report through the bench parser too: its usage, exit status 2.
    bench.set_defaults(usage_error=bench.error)
    sub.add_parser("info", help="GPU, library versions, backends and baselines, and which of them run here")
    return parser


def workloads_from_args(args: argparse.Namespace) -> list[Workload]:
    """The workloads the flags ask for; a combination that makes no workload is a usage error."""
    given = [f for f in CUSTOM_FLAGS if getattr(args, f) is not None]
    selected = [PRESETS[name] for name in (args.preset or ([] if given else ["ads"]))]
    if given:
        missing = [flag(f) for f in REQUIRED_CUSTOM_FLAGS if f not in given]
        if missing:
            args.usage_error(f"a custom workload ({', '.join(map(flag, given))}) also needs {', '.join(missing)}")
        kv_heads = args.kv_heads or args.heads
        if args.heads % kv_heads:
            args.usage_error(f"--heads {args.heads} must be a multiple of --kv-heads {kv_heads} (each key/value head "
                             "serves a group of query heads)")
        lo, hi = lengths_for_sparsity(args.max_len, DEFAULT_SPARSITY if args.sparsity is None else args.sparsity)
        try:
            selected.append(Workload(name="custom", num_seqs=args.seqs, min_len=lo, max_len=hi, heads=args.heads,
                                     kv_heads=kv_heads, head_dim=args.head_dim,
                                     block_size=args.block_size or DEFAULT_BLOCK_SIZE))
        except ValueError as error:  # Workload's own checks: a usage error too, not a traceback
            args.usage_error(f"custom workload: {error}")
    if args.dtype:
        selected = [dataclasses.replace(w, dtype=args.dtype) for w in selected]
    if args.rotary:
        selected = [dataclasses.replace(w, rotary=True) for w in selected]
    return selected


def cpu_demo(workloads: list[Workload], out: Path) -> int:
    """No GPU: show that the op works (CPU path against the float64 reference); time nothing, write nothing."""
    from . import block_attention
    from .reference import block_attention_reference

    w = CPU_DEMO
    offsets = w.offsets()
    n = int(offsets[-1])
    q, k, v = (torch.randn(n, h, w.head_dim) for h in (w.heads, w.kv_heads, w.kv_heads))
    out_cpu = block_attention(q, k, v, offsets, block_size=w.block_size)
    ref = block_attention_reference(q, k, v, offsets, block_size=w.block_size)
    err = (out_cpu.double() - ref).abs().max().item()
    print("No CUDA GPU here, so no timings: a CPU measurement would say nothing about the kernels.")
    print(f"Asked for: {', '.join(w.name for w in workloads)}; run `blockattn bench` on an NVIDIA GPU to time them.")
    print(f"The op works: CPU path on {w.num_seqs} sequences ({n} tokens, H={w.heads}, D={w.head_dim}), "
          f"max |out - float64 reference| = {err:.2e}.")
    print(f"Nothing written to {out}: there are no timings to write.")
    return 0


def make_console(file=None):
    """rich's console. Where the output is no terminal (a log file, a pipe), rich would cut lines to 80 columns and
    shorten table cells with "…"; there it gets a fixed wide width and no colour."""
    from rich.console import Console

    console = Console(file=file)
    if not console.is_terminal:
        console.width = LOG_WIDTH
        console.no_color = True
    return console


def _number(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _status_note(entry: dict) -> str:
    return f"{'FAILED' if entry['status'] == harness.FAILED else entry['status']}: {entry['reason']}"


def print_report(report, console) -> None:
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    def add_row(table, *cells):
        table.add_row(*(Text(cell) for cell in cells))  # Text: names and error messages are not rich markup

    env = report.environment
    console.print(f"[bold]{escape(env['device'])}[/] (sm_{env['compute_capability'].replace('.', '')}, "
                  f"{env['sm_count']} SMs), torch {env['torch']}, triton {env['triton']}, {env['date']}")
    console.print(f"copy bandwidth: {report.copy_tbps:.2f} TB/s (device-to-device, read + write)")
    table = Table(title="time per call")
    for col in ("workload", "group", "pass", "implementation", "ms", "floor ms", "x floor", "TB/s", "vs FA2",
                "peak MiB", "notes"):
        # Folded, never cut: a number split over two lines in a narrow terminal still reads right.
        table.add_column(col, justify="left" if col in ("workload", "group", "pass", "implementation", "notes")
                         else "right", overflow="fold")
    for entry in report.workloads:
        for group, impls in entry.get("implementations", {}).items():
            for impl in impls:
                key = (entry["name"], group, impl)
                for r in (r for r in report.results if (r["workload"], r["group"], r["impl"]) == key):
                    notes = [f"{label}: {ms:.3f} ms" for label, ms in r["extra_ms"].items()]
                    if r["checked_against"] not in (None, impls[0]):
                        notes.append(f"checked against {r['checked_against']} ({impls[0]} gave no result)")
                    speedup = r.get("speedup_vs_fa2")
                    add_row(table, *key[:2], r["pass"], impl, f"{r['ms']:.3f}", _number(r["floor_ms"], 3),
                            _number(r["x_floor"], 2), _number(r["floor_tbps"], 2),
                            f"{speedup:.2f}x" if speedup else "-", f"{r['peak_mib']:.0f}", "; ".join(notes))
                for s in (s for s in report.skipped if (s["workload"], s["group"], s["impl"]) == key):
                    add_row(table, *key[:2], "-", impl, *["-"] * 6, _status_note(s))
    console.print(table)
    console.print(
        "ms: median time per call (p20 and p80 in bench.json); floor ms: the bytes that must move at the copy "
        'bandwidth (docs/semantics.md, "Memory floor"); x floor: ms / floor ms; TB/s: the floor\'s bytes / ms; '
        "vs FA2: speedup over the FA2 path of the group; peak MiB: the most memory one call allocates above what "
        "was allocated before it."
    )
    console.print("Groups: attention (speedups vs FA2 varlen); rotary: q, k, v rotated then attention, floor with "
                  "sinu_pos (vs FA2 + PyTorch rotary); qkv: x @ w + bias, rotary, attention, forward and backward to "
                  "dx, dw, dbias (vs matmul + PyTorch rotary + FA2; no floor).")
    acc = Table(title="accuracy against float64 (first sequences of each workload)")
    for col in ("workload", "implementation", "tokens", "max |out|", "max |dq|", "max |dk|", "max |dv|",
                "mean |dq|", "SNR dq dB", "notes"):
        acc.add_column(col, overflow="fold")
    for a in report.accuracy:
        if "status" in a:
            add_row(acc, a["workload"], a["impl"], *["-"] * 7, _status_note(a))
            continue
        add_row(acc, a["workload"], a["impl"], str(a["tokens"]),
                *(f"{a[f'max_{t}']:.4f}" for t in ("out", "dq", "dk", "dv")),
                f"{a['mean_dq']:.2e}", f"{a['snr_dq_db']:.1f}", "")
    console.print(acc)
    for line in report.headline_failures():
        console.print(Text(f"FAILED: {line}", style="bold red"))


def dense_bench(args: argparse.Namespace) -> int:
    """``bench --dense``: flash attention against SDPA and FA2 varlen; exit status 1 where a blockattn kernel
    failed."""
    from rich.progress import Progress
    from rich.text import Text

    from .bench import dense

    console = make_console()
    with Progress(console=console, transient=True) as progress:
        report = dense.run(rep_ms=args.rep_ms, seed=args.seed, progress=progress)
    paths = dense.write_files(report, args.out)
    dense.print_report(report, console)
    for path in paths:
        console.print(Text(f"wrote {path}"))
    failures = [s for s in report["skipped"] if s["status"] == harness.FAILED and harness.uses_blockattn(s["impl"])]
    for s in failures:
        console.print(Text(f"FAILED: {s['impl']} on {s['case']}: {s['reason']}", style="bold red"))
    return 1 if failures else 0


def options_bench(args: argparse.Namespace, workloads: list[Workload]) -> int:
    """``bench --options``: the in-block options on one workload; exit status 1 where blockattn failed."""
    from rich.progress import Progress
    from rich.text import Text

    from .bench import options

    console = make_console()
    with Progress(console=console, transient=True) as progress:
        report = options.run(workloads[0], rep_ms=args.rep_ms, seed=args.seed, progress=progress)
    path = options.write_file(report, args.out)
    options.print_report(report, console)
    console.print(Text(f"wrote {path}"))
    failures = [s for s in report["skipped"] if s["status"] == harness.FAILED and harness.uses_blockattn(s["impl"])]
    for s in failures:
        console.print(Text(f"FAILED: {s['impl']} with {s['option']}: {s['reason']}", style="bold red"))
    return 1 if failures else 0


def latency_bench(args: argparse.Namespace) -> int:
    """``bench --latency``: host wall time per call against FA2 varlen."""
    from rich.progress import Progress
    from rich.text import Text

    from .bench import latency

    console = make_console()
    with Progress(console=console, transient=True) as progress:
        report = latency.run(seed=args.seed, progress=progress)
    path = latency.write_file(report, args.out)
    latency.print_report(report, console)
    console.print(Text(f"wrote {path}"))
    return 0


def sweep_bench(args: argparse.Namespace) -> int:
    """``bench --sweep``: every configuration (or the axes' restrictions); exit status 1 where one failed."""
    from rich.progress import Progress
    from rich.text import Text

    from .bench import sweep

    axes = {"block_sizes": args.block_size, "head_dims": args.head_dim, "kv_heads": args.kv_heads,
            "dtypes": args.dtype}
    configs = sweep.grid(**{axis: (value,) for axis, value in axes.items() if value is not None})
    console = make_console()
    with Progress(console=console, transient=True) as progress:
        report = sweep.run(configs, rep_ms=args.rep_ms, seed=args.seed, progress=progress,
                           passes=sweep.PASSES if args.passes == "all" else (args.passes,))
    paths = sweep.write_files(report, args.out)
    sweep.print_report(report, console)
    for path in paths:
        console.print(Text(f"wrote {path}"))
    return 1 if report["failed"] else 0


def bench(args: argparse.Namespace, workloads: list[Workload]) -> int:
    """Exit status 1 where blockattn or a whole workload failed (the report says which); 0 otherwise."""
    if not torch.cuda.is_available():
        special = {"--dense": (args.dense, "the flash-attention kernels"), "--latency": (args.latency, "host latency"),
                   "--sweep": (args.sweep, "every kernel configuration")}
        for name, (asked, what) in special.items():
            if asked:
                print(f"No CUDA GPU here, so no timings: `blockattn bench {name}` times {what} on an NVIDIA GPU. "
                      "Nothing written.")
                return 0
        return cpu_demo(workloads, args.out)
    missing = [m for m in ("rich", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"blockattn bench needs {' and '.join(missing)}: pip install 'blockattn[bench]'")
    if args.dense:
        return dense_bench(args)
    if args.options:
        return options_bench(args, workloads)
    if args.latency:
        return latency_bench(args)
    if args.sweep:
        return sweep_bench(args)
    from rich.progress import Progress
    from rich.text import Text

    console = make_console()
    with Progress(console=console, transient=True) as progress:
        report = harness.run(workloads=workloads, passes=PASS_CHOICES[args.passes],
                             baselines=list(BASELINES) if args.baselines is None else args.baselines,
                             rep_ms=args.rep_ms, seed=args.seed, progress=progress)
    # The files first: they hold what was measured even if printing it fails.
    paths = harness.write_files(report, args.out)
    print_report(report, console)
    for path in paths:
        console.print(Text(f"wrote {path}"))
    return 1 if report.headline_failures() else 0


def preset_calls(device: torch.device) -> dict:
    """The attention calls the bench makes for each preset, ``{label: {pass: AttentionCall}}``: the plain call, and
    for rotary presets the fused rotary one (angles in the inputs' dtype, as the bench passes them)."""
    from .backends import AttentionCall
    from .ops.tiles import ROTATE_ALL, ROTATE_NONE

    calls = {}
    for w in PRESETS.values():
        for label, rotate in [(w.name, ROTATE_NONE)] + ([(f"{w.name} rotary", ROTATE_ALL)] if w.rotary else []):
            calls[label] = {p: AttentionCall(pass_name=p, device=device, dtype=w.torch_dtype, num_heads=w.heads,
                                             num_kv_heads=w.kv_heads, head_dim=w.head_dim, block_size=w.block_size,
                                             rotate=rotate, angles_dtype=w.torch_dtype if rotate else None)
                            for p in ("fwd", "bwd")}
    return calls


def print_backends(device: torch.device) -> None:
    """Each backend, why it declines this machine's preset calls, and which backend runs each preset's passes."""
    from .backends import BACKENDS, select

    calls = preset_calls(device)
    print("Backends (blockattn), most preferred first; each call runs on the first that takes it:")
    for backend in BACKENDS.values():
        print(f"  {backend.name} ({', '.join(backend.passes)}): {backend.summary}")
        declined = {}  # reason -> labels of the calls it declines for that reason
        considered = 0
        for label, by_pass in calls.items():
            for p in backend.passes:
                considered += 1
                if reason := backend.why_not(by_pass[p]):
                    declined.setdefault(reason, []).append(label)
        if sum(map(len, declined.values())) == considered and len(declined) == 1:
            print(f"      not here: {next(iter(declined))}")
            continue
        for reason, labels in declined.items():
            print(f"      not for {', '.join(dict.fromkeys(labels))}: {reason}")

    def runs(call) -> str:
        try:
            return select(call).name
        except ValueError as error:
            return f"none ({error})"

    print(f"Presets here ({device}), the backend of each pass:")
    width = max(map(len, calls))
    for label, by_pass in calls.items():
        print(f"  {label:<{width}}  " + "  ".join(f"{p}: {runs(call)}" for p, call in by_pass.items()))
    print_flash_backends(device)


def print_flash_backends(device: torch.device) -> None:
    """The flash-attention backends and which one ``variant="auto"`` takes here, per dtype and head dim."""
    from .backends import FLASH_BACKENDS, FlashCall, select
    from .checks import FP8_DTYPE

    print("Flash attention backends (flash_attention, flash_attention_varlen), most preferred first:")
    for backend in FLASH_BACKENDS.values():
        print(f"  {backend.name}: {backend.summary}")
    print(f"  variant='auto' here ({device}):")
    for dtype in (torch.bfloat16, FP8_DTYPE):
        for head_dim in (64, 128, 256):
            call = FlashCall("fwd", device, dtype, head_dim, "auto", True, True)
            try:
                choice = select(call, FLASH_BACKENDS).name
            except ValueError as error:
                choice = f"none ({error})"
            print(f"    {str(dtype).removeprefix('torch.')} D={head_dim}: {choice}")


def info() -> int:
    import triton

    from . import __version__
    from .bench.baselines import why_not_here

    print(f"blockattn {__version__}, torch {torch.__version__}, triton {triton.__version__}, "
          f"python {sys.version.split()[0]}")
    if not torch.cuda.is_available():
        print("GPU: none (CUDA not available): the PyTorch path runs, the GPU backends need a CUDA GPU.")
        device = torch.device("cpu")
    else:
        props = torch.cuda.get_device_properties(0)
        print(f"GPU: {props.name}, compute capability {props.major}.{props.minor}, "
              f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}")
        device = torch.device("cuda", torch.cuda.current_device())
    print_backends(device)
    print("Baselines (bench):")
    width = max(map(len, BASELINES))
    for name in BASELINES:
        reason = why_not_here(name)
        print(f"  {name:<{width}}  {'usable here' if reason is None else 'not here: ' + reason}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "info":
        return info()
    if args.dense or args.latency:
        mode = "--dense" if args.dense else "--latency"
        given = [flag(f) for f in ("preset", *CUSTOM_FLAGS) if getattr(args, f) is not None]
        given += (["--rotary"] * args.rotary + ["--dtype"] * (args.dtype is not None)
                  + ["--baselines"] * (args.baselines is not None) + ["--options"] * args.options
                  + ["--latency"] * (args.dense and args.latency) + ["--sweep"] * args.sweep
                  + ["--pass"] * (args.passes != "all"))
        if given:
            args.usage_error(f"{mode} times its own shapes and passes; it takes no {', '.join(given)}")
        return bench(args, [])
    if args.sweep:
        given = [flag(f) for f in ("preset", "seqs", "max_len", "sparsity", "heads") if getattr(args, f) is not None]
        given += (["--rotary"] * args.rotary + ["--baselines"] * (args.baselines is not None)
                  + ["--options"] * args.options)
        if given:
            args.usage_error(f"--sweep times its own grid (restricted by --block-size, --head-dim, --kv-heads, "
                             f"--dtype, --pass); it takes no {', '.join(given)}")
        if args.passes == "fwdbwd":
            args.usage_error("--sweep times the forward and the backward apart: --pass fwd, bwd or all")
        return bench(args, [])
    if args.dtype == "float8_e4m3fn":
        args.usage_error("--dtype float8_e4m3fn applies to --sweep only (the fp8 forward's configurations)")
    workloads = workloads_from_args(args)
    if args.options:
        if args.rotary or args.baselines is not None:
            args.usage_error("--options times its own baselines on the plain op; it takes no --rotary or --baselines")
        if len(workloads) != 1:
            args.usage_error(f"--options times one workload, got {len(workloads)}")
    return bench(args, workloads)


if __name__ == "__main__":
    sys.exit(main())
