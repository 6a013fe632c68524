"""Host latency (``python -m blockattn bench --latency``): the wall time of one call as the host sees it, on small
and medium batches, where Python, dispatch and launches rather than the GPU set the time.

Batches of equal-length sequences (1 x 500, 8 x 200, 64 x 1400, 256 x 1400 tokens), H 4, D 128, bf16, 64-token
blocks. Passes: ``fwd`` (inference: inputs without gradients) and ``fwdbwd`` (forward, then
``torch.autograd.grad`` of q, k, v). Modes: ``eager`` with ``offsets``, ``eager`` with a :class:`BlockLayout`
built once per batch (``eager layout``), and a CUDA graph of the call replayed (``graph``). Against FA2 varlen
(PyTorch's ``aten._flash_attention_forward``/``_backward`` with one boundary per block, the backward called
directly: no autograd), eager and as a graph.

Each figure is the median over repeats of ``calls`` back-to-back calls followed by one synchronisation, divided
by ``calls``: a host-bound call shows its host time, a GPU-bound one its GPU time.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

import blockattn

from . import harness

BATCHES = ((1, 500), (8, 200), (64, 1400), (256, 1400))
HEADS, HEAD_DIM, BLOCK_SIZE = 4, 128, 64
PASSES = ("fwd", "fwdbwd")
MODES = ("eager", "eager layout", "graph")
OURS, FA2 = "blockattn", "FA2 varlen (aten)"


def wall_us(fn, calls: int = 200, repeats: int = 5) -> float:
    """Median over ``repeats`` of the wall time of ``calls`` calls of ``fn`` and one synchronisation, per call."""
    for _ in range(max(10, calls // 10)):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def _calls(num_seqs: int, length: int, seed: int) -> dict:
    """The timed calls of one batch: ``{(impl, mode, pass): fn}``."""
    n = num_seqs * length
    generator = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(n, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
                   for _ in range(4))
    offsets = torch.arange(0, n + 1, length, device="cuda")
    layout = blockattn.block_layout(offsets, n)
    grads_of = [t.detach().requires_grad_() for t in (q, k, v)]
    scale = HEAD_DIM**-0.5
    block_lengths = [min(BLOCK_SIZE, length - s) for s in range(0, length, BLOCK_SIZE)] * num_seqs
    cu = torch.tensor([0, *block_lengths], device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)

    def ours(where):
        def fwd():
            return blockattn.block_attention(q, k, v, where)

        def fwdbwd():
            return torch.autograd.grad(blockattn.block_attention(*grads_of, where), grads_of, do)
        return fwd, fwdbwd

    def fa2_fwd():
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, BLOCK_SIZE, BLOCK_SIZE, 0.0, False, False,
                                                       scale=scale)

    def fa2_fwdbwd():
        out, lse, rng, unused, _ = fa2_fwd()
        return torch.ops.aten._flash_attention_backward(do, q, k, v, out, lse, cu, cu, BLOCK_SIZE, BLOCK_SIZE, 0.0,
                                                        False, rng, unused, scale=scale)

    calls = {}
    for mode, where in (("eager", offsets), ("eager layout", layout)):
        calls[(OURS, mode, "fwd")], calls[(OURS, mode, "fwdbwd")] = ours(where)
    calls[(OURS, "graph", "fwd")], calls[(OURS, "graph", "fwdbwd")] = ours(layout)
    calls[(FA2, "eager", "fwd")], calls[(FA2, "eager", "fwdbwd")] = fa2_fwd, fa2_fwdbwd
    calls[(FA2, "graph", "fwd")], calls[(FA2, "graph", "fwdbwd")] = fa2_fwd, fa2_fwdbwd
    return calls


def run(seed: int = 0, batches=BATCHES, calls_per_repeat: int = 200, progress=None) -> dict:
    """Every batch, implementation, mode and pass; returns the report (``results``: one row per figure, with
    ``x_fa2``, the time over FA2 varlen's in the same mode and pass; eager figures against FA2 eager)."""
    if not torch.backends.cuda.is_flash_attention_available():
        raise SystemExit("bench --latency compares against PyTorch's FlashAttention-2, which this build lacks")
    rows = []
    task = progress.add_task("latency", total=len(batches)) if progress else None
    for num_seqs, length in batches:
        for (impl, mode, pass_name), fn in _calls(num_seqs, length, seed).items():
            timed = harness.graphed(fn) if mode == "graph" else fn
            rows.append({"batch": f"{num_seqs} x {length}", "tokens": num_seqs * length, "impl": impl, "mode": mode,
                         "pass": pass_name, "us": wall_us(timed, calls_per_repeat)})
        if progress:
            progress.advance(task)
    fa2 = {(r["batch"], r["mode"], r["pass"]): r["us"] for r in rows if r["impl"] == FA2}
    for r in rows:
        r["x_fa2"] = r["us"] / fa2[(r["batch"], "graph" if r["mode"] == "graph" else "eager", r["pass"])]
    return {"environment": harness.environment(), "heads": HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE,
            "dtype": "bfloat16", "calls_per_repeat": calls_per_repeat, "results": rows}


def print_report(report: dict, console) -> None:
    from rich.table import Table

    env = report["environment"]
    console.print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; H {report['heads']}, "
                  f"D {report['head_dim']}, BS {report['block_size']}, {report['dtype']}")
    table = Table(title="host wall time per call (µs)")
    for col in ("batch", "pass", "mode", OURS, FA2, "x FA2"):
        table.add_column(col)
    results = report["results"]
    by_key = {(r["batch"], r["impl"], r["mode"], r["pass"]): r for r in results}
    for batch in dict.fromkeys(r["batch"] for r in results):
        for pass_name in PASSES:
            for mode in MODES:
                ours = by_key[(batch, OURS, mode, pass_name)]
                fa2 = by_key.get((batch, FA2, mode, pass_name))
                table.add_row(batch, pass_name, mode, f"{ours['us']:.1f}", f"{fa2['us']:.1f}" if fa2 else "",
                              f"{ours['x_fa2']:.2f}")
    console.print(table)
    console.print("x FA2: blockattn's time over FA2 varlen's in the same pass (eager modes against FA2 eager, graph "
                  "against FA2's graph). FA2's fwdbwd calls its backward op directly; blockattn's goes through "
                  "autograd.")


def write_file(report: dict, out_dir: Path) -> Path:
    return harness.write_json(report, out_dir, "latency.json")
