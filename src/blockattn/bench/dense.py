"""The flash-attention benchmark (``python -m blockattn bench --dense``): TFLOP/s of each kernel variant and dtype
next to SDPA's cuDNN and flash back ends on dense shapes, and against FlashAttention-2 varlen on the ``long``
preset's lengths.

FLOPs per call: ``4 Sq Sk D H`` per sequence, half of it under a causal mask (docs/semantics.md, "Flash
attention"). Each implementation's output is checked against blockattn's bf16 result (SNR) before it is timed; one
that cannot run here, raises or computes something else is recorded with its reason and the run goes on.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from blockattn import flash_attention, flash_attention_varlen
from blockattn.reference import quantised_fp8, snr_db

from .harness import FAILED, UNAVAILABLE, describe, free_memory, time_ms
from .presets import PRESETS

# bf16 results of two correct kernels agree to ~50 dB; fp8 inputs (3 mantissa bits) to ~25-30 dB.
MATCH_SNR_DB = {"bf16": 30.0, "fp8": 15.0}
HEADS = 16


@dataclass(frozen=True)
class DenseShape:
    batch: int
    seqlen: int
    head_dim: int
    causal: bool
    heads: int = HEADS

    @property
    def name(self) -> str:
        return f"B{self.batch} S{self.seqlen} D{self.head_dim}{' causal' if self.causal else ''}"

    def flops(self) -> float:
        return 4 * self.batch * self.seqlen**2 * self.head_dim * self.heads / (2 if self.causal else 1)


SHAPES = [DenseShape(b, s, d, c) for d in (64, 128) for c in (False, True) for b in (1, 4)
          for s in (512, 1024, 2048, 4096, 8192, 16384)]
VARLEN_PRESET = "long"


def _ours(variant: str, fp8: bool, varlen: tuple | None, causal: bool):
    def make(q, k, v):
        extra = {}
        if fp8:
            (q, qs), (k, ks), (v, vs) = quantised_fp8(q), quantised_fp8(k), quantised_fp8(v)
            extra = {"q_descale": qs, "k_descale": ks, "v_descale": vs, "out_dtype": torch.bfloat16}
        if varlen is None:
            return lambda: flash_attention(q, k, v, causal=causal, variant=variant, **extra)
        cu, max_len = varlen
        return lambda: flash_attention_varlen(q, k, v, cu, cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
                                              causal=causal, variant=variant, **extra)
    return make


def _sdpa(backend_name: str, causal: bool):
    def make(q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        backend = getattr(SDPBackend, backend_name)
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # SDPA's [B, H, S, D], not timed

        def call():
            with sdpa_kernel(backend):
                return sdpa(qt, kt, vt, is_causal=causal).transpose(1, 2)
        return call
    return make


def _fa2_varlen(cu, max_len, causal):
    def make(q, k, v):
        scale = 1.0 / math.sqrt(q.shape[-1])
        return lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, causal, False,
                                                               scale=scale)[0]
    return make


def _implementations(causal: bool, varlen: tuple | None = None) -> dict:
    impls = {f"blockattn {v} {dt}": _ours(v, dt == "fp8", varlen, causal)
             for dt in ("bf16", "fp8") for v in ("pipelined", "warp_specialized")}
    if varlen is None:
        impls.update({"SDPA cuDNN bf16": _sdpa("CUDNN_ATTENTION", causal),
                      "SDPA flash bf16": _sdpa("FLASH_ATTENTION", causal)})
    else:
        impls["FA2 varlen bf16"] = _fa2_varlen(*varlen, causal)
    return impls


def _time_case(rows, skipped, case: str, flops: float, impls: dict, reference: str, inputs, rep_ms: int) -> None:
    expected = None
    for name, make in impls.items():
        where = {"case": case, "impl": name}
        try:
            call = make(*inputs)
            out = call()
            if expected is None:
                expected = out.float()
            else:
                snr = snr_db(out.float(), expected)
                if not snr >= MATCH_SNR_DB["fp8" if "fp8" in name else "bf16"]:
                    raise ValueError(f"differs from {reference}'s result (SNR {snr:.1f} dB)")
            out = None
            ms = time_ms(call, rep_ms)
        except (ValueError, TypeError) as error:  # refused by a dispatcher or an argument check: not here
            status = FAILED if "differs" in str(error) else UNAVAILABLE
            skipped.append({**where, "status": status, "reason": describe(error)})
            continue
        except Exception as error:  # noqa: BLE001 -- whatever one implementation raises, the others still run
            skipped.append({**where, "status": FAILED, "reason": describe(error)})
            continue
        finally:
            free_memory()
        rows.append({**where, "ms": ms["p50"], "quantiles_ms": ms, "tflops": flops / (ms["p50"] * 1e-3) / 1e12})


def run(rep_ms: int, seed: int, progress) -> dict:
    """Every dense shape and the varlen case; a JSON-able report."""
    from .harness import environment

    rows, skipped, cases = [], [], []
    generator = torch.Generator(device="cuda").manual_seed(seed)
    long = PRESETS[VARLEN_PRESET]
    task = progress.add_task("flash attention", total=len(SHAPES) + 2)
    for shape in SHAPES:
        progress.update(task, description=f"flash attention {shape.name}")
        q, k, v = (torch.randn(shape.batch, shape.seqlen, shape.heads, shape.head_dim, device="cuda",
                               dtype=torch.bfloat16, generator=generator) for _ in range(3))
        cases.append({"case": shape.name, **asdict(shape), "flops": shape.flops(), "reference": "SDPA cuDNN bf16"})
        _time_case(rows, skipped, shape.name, shape.flops(), _implementations(shape.causal),
                   "blockattn pipelined bf16", (q, k, v), rep_ms)
        q = k = v = None
        free_memory()
        progress.advance(task)
    offsets = long.offsets(seed, device="cuda")
    lengths = (offsets[1:] - offsets[:-1]).long()
    max_len, n = int(lengths.max()), int(offsets[-1])
    for causal in (False, True):
        name = f"varlen {VARLEN_PRESET} H{long.heads} D{long.head_dim}{' causal' if causal else ''}"
        progress.update(task, description=f"flash attention {name}")
        flops = 4 * float((lengths * lengths).sum()) * long.head_dim * long.heads / (2 if causal else 1)
        q, k, v = (torch.randn(n, long.heads, long.head_dim, device="cuda", dtype=torch.bfloat16,
                               generator=generator) for _ in range(3))
        cases.append({"case": name, "num_seqs": long.num_seqs, "tokens": n, "heads": long.heads,
                      "head_dim": long.head_dim, "causal": causal, "flops": flops, "reference": "FA2 varlen bf16"})
        _time_case(rows, skipped, name, flops, _implementations(causal, (offsets, max_len)),
                   "blockattn pipelined bf16", (q, k, v), rep_ms)
        q = k = v = None
        free_memory()
        progress.advance(task)
    compare(rows, cases)
    return {"environment": environment(), "cases": cases, "results": rows, "skipped": skipped}


def compare(rows: list[dict], cases: list[dict]) -> None:
    """Each row's ``speedup_vs_reference`` (over its case's reference), and for our fp8 rows ``speedup_vs_bf16``:
    over the same kernel in bf16 on the same shape (what the fp8 target is stated against); None where the other
    row is missing."""
    ms = {(r["case"], r["impl"]): r["ms"] for r in rows}
    references = {c["case"]: c["reference"] for c in cases}
    for row in rows:
        ref = ms.get((row["case"], references[row["case"]]))
        row["speedup_vs_reference"] = ref / row["ms"] if ref else None
        if row["impl"].startswith("blockattn ") and row["impl"].endswith(" fp8"):
            bf16 = ms.get((row["case"], row["impl"].removesuffix(" fp8") + " bf16"))
            row["speedup_vs_bf16"] = bf16 / row["ms"] if bf16 else None


def print_report(report: dict, console) -> None:
    from rich.table import Table
    from rich.text import Text

    env = report["environment"]
    console.print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}")
    table = Table(title="flash attention forward: TFLOP/s (4 Sq Sk D H per sequence, half when causal)")
    for col in ("case", "implementation", "ms", "TFLOP/s", "vs reference", "notes"):
        table.add_column(col, overflow="fold")
    for case in report["cases"]:
        for r in (r for r in report["results"] if r["case"] == case["case"]):
            speed, over_bf16 = r["speedup_vs_reference"], r.get("speedup_vs_bf16")
            table.add_row(*(Text(c) for c in (case["case"], r["impl"], f"{r['ms']:.3f}", f"{r['tflops']:.0f}",
                                              f"{speed:.2f}x" if speed else "-",
                                              f"{over_bf16:.2f}x our bf16" if over_bf16 else "")))
        for s in (s for s in report["skipped"] if s["case"] == case["case"]):
            table.add_row(*(Text(c) for c in (case["case"], s["impl"], "-", "-", "-",
                                              f"{s['status']}: {s['reason']}")))
    console.print(table)
    console.print("vs reference: speedup over SDPA cuDNN bf16 (dense) or FA2 varlen bf16 (varlen); fp8 rows' notes: "
                  "speedup over the same kernel in bf16.")


def write_files(report: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, chart_path = out_dir / "dense.json", out_dir / "dense.png"
    json_path.write_text(json.dumps(report, indent=2))
    cases = [c["case"] for c in report["cases"]]
    impls = list(dict.fromkeys(r["impl"] for r in report["results"]))
    tflops = {(r["case"], r["impl"]): r["tflops"] for r in report["results"]}
    fig, ax = plt.subplots(figsize=(max(10.0, 0.55 * len(cases) + 3), 5), layout="constrained")
    width = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
        ax.bar([x + i * width for x in range(len(cases))], [tflops.get((c, impl), 0.0) for c in cases], width,
               label=impl)
    ax.set_xticks([x + width * (len(impls) - 1) / 2 for x in range(len(cases))], labels=cases, rotation=90,
                  fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"flash attention forward, {report['environment']['device']}, {report['environment']['date'][:10]}")
    fig.savefig(chart_path, dpi=120)
    plt.close(fig)
    return [json_path, chart_path]
