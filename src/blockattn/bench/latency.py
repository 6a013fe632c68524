"""Host latency (``python -m blockattn bench --latency``): the wall time of one call as the host sees it, on small
and medium batches, where Python, dispatch and launches rather than the GPU set the time.

Batches of equal-length sequences (1 x 500, 8 x 200, 64 x 1400, 256 x 1400 tokens), H 4, D 128, bf16, 64-token
blocks. Passes: ``fwd`` (inference: inputs without gradients) and ``fwdbwd`` (forward, then
``torch.autograd.grad`` of q, k, v). Modes: ``eager`` with ``offsets``, ``eager`` with a :class:`BlockLayout`
built once per batch (``eager layout``), and a CUDA graph of the call replayed (``graph``). Against FA2 varlen
(PyTorch's ``aten._flash_attention_forward``/``_backward`` with one boundary per block): called directly, the
backward too (no autograd: the least host time FA2 can take), eager and as a graph; and eager through a
``torch.autograd.Function`` around the two ops (``FA2 varlen (autograd)``), as ``flash_attn_varlen_func`` runs it
and as a model's backward reaches it: ``torch.autograd.grad`` then pays the autograd engine for it as for
blockattn.

Each figure is the median over repeats of ``calls`` back-to-back calls followed by one synchronisation, divided
by ``calls``: a host-bound call shows its host time, a GPU-bound one its GPU time. The calls of one batch are timed
in turn within each repeat, so that a slow spell of a shared host falls on all of them alike. The eager calls repeat
one argument signature, as a model's layers do, so from the third on they replay a call plan (``ops.plans``).
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
OURS, FA2, FA2_AUTOGRAD = "blockattn", "FA2 varlen (aten)", "FA2 varlen (autograd)"


def wall_us(fns: dict, calls: int = 200, repeats: int = 9) -> dict:
    """``{name: µs per call}``: the median over ``repeats`` of the wall time of ``calls`` calls of each function and
    one synchronisation, per call; each repeat times every function in turn."""
    for fn in fns.values():
        for _ in range(max(10, calls // 10)):
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


class _FlashVarlen(torch.autograd.Function):
    """FA2 varlen under autograd, as ``flash_attn_varlen_func`` wraps its kernels: the two aten ops."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_seqlen,
                                                                            max_seqlen, 0.0, False, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng, unused)
        ctx.max_seqlen, ctx.scale = max_seqlen, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(grad_out, q, k, v, out, lse, cu, cu, ctx.max_seqlen,
                                                              ctx.max_seqlen, 0.0, False, rng, unused,
                                                              scale=ctx.scale)
        return dq, dk, dv, None, None, None


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

    def fa2_autograd_fwd():
        return _FlashVarlen.apply(q, k, v, cu, BLOCK_SIZE, scale)

    def fa2_autograd_fwdbwd():
        return torch.autograd.grad(_FlashVarlen.apply(*grads_of, cu, BLOCK_SIZE, scale), grads_of, do)

    calls = {}
    for mode, where in (("eager", offsets), ("eager layout", layout)):
        calls[(OURS, mode, "fwd")], calls[(OURS, mode, "fwdbwd")] = ours(where)
    calls[(OURS, "graph", "fwd")], calls[(OURS, "graph", "fwdbwd")] = ours(layout)
    calls[(FA2, "eager", "fwd")], calls[(FA2, "eager", "fwdbwd")] = fa2_fwd, fa2_fwdbwd
    calls[(FA2, "graph", "fwd")], calls[(FA2, "graph", "fwdbwd")] = fa2_fwd, fa2_fwdbwd
    calls[(FA2_AUTOGRAD, "eager", "fwd")], calls[(FA2_AUTOGRAD, "eager", "fwdbwd")] = (fa2_autograd_fwd,
                                                                                        fa2_autograd_fwdbwd)
    return calls


def run(seed: int = 0, batches=BATCHES, calls_per_repeat: int = 200, progress=None) -> dict:
    """Every batch, implementation, mode and pass; returns the report (``results``: one row per figure, with
    ``x_fa2``, the time over FA2 varlen's called directly in the same mode and pass, eager figures against FA2
    eager; eager rows also ``x_fa2_autograd``, over FA2's through autograd)."""
    if not torch.backends.cuda.is_flash_attention_available():
        raise SystemExit("bench --latency compares against PyTorch's FlashAttention-2, which this build lacks")
    rows = []
    task = progress.add_task("latency", total=len(batches)) if progress else None
    for num_seqs, length in batches:
        calls = {key: harness.graphed(fn) if key[1] == "graph" else fn
                 for key, fn in _calls(num_seqs, length, seed).items()}
        for (impl, mode, pass_name), us in wall_us(calls, calls_per_repeat).items():
            rows.append({"batch": f"{num_seqs} x {length}", "tokens": num_seqs * length, "impl": impl, "mode": mode,
                         "pass": pass_name, "us": us})
        if progress:
            progress.advance(task)
    baseline = {(r["batch"], r["impl"], r["mode"], r["pass"]): r["us"] for r in rows if r["impl"] != OURS}
    for r in rows:
        r["x_fa2"] = r["us"] / baseline[(r["batch"], FA2, "graph" if r["mode"] == "graph" else "eager", r["pass"])]
        if r["mode"] != "graph":
            r["x_fa2_autograd"] = r["us"] / baseline[(r["batch"], FA2_AUTOGRAD, "eager", r["pass"])]
    return {"environment": harness.environment(), "heads": HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE,
            "dtype": "bfloat16", "calls_per_repeat": calls_per_repeat, "results": rows}


def print_report(report: dict, console) -> None:
    from rich.table import Table

    env = report["environment"]
    console.print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; H {report['heads']}, "
                  f"D {report['head_dim']}, BS {report['block_size']}, {report['dtype']}")
    table = Table(title="host wall time per call (µs)")
    for col in ("batch", "pass", "mode", OURS, FA2, "x FA2", FA2_AUTOGRAD, "x FA2 (autograd)"):
        table.add_column(col)
    results = report["results"]
    by_key = {(r["batch"], r["impl"], r["mode"], r["pass"]): r for r in results}
    for batch in dict.fromkeys(r["batch"] for r in results):
        for pass_name in PASSES:
            for mode in MODES:
                ours = by_key[(batch, OURS, mode, pass_name)]
                fa2, fa2_autograd = (by_key.get((batch, impl, mode, pass_name)) for impl in (FA2, FA2_AUTOGRAD))
                table.add_row(batch, pass_name, mode, f"{ours['us']:.1f}", f"{fa2['us']:.1f}" if fa2 else "",
                              f"{ours['x_fa2']:.2f}", f"{fa2_autograd['us']:.1f}" if fa2_autograd else "",
                              f"{ours['x_fa2_autograd']:.2f}" if "x_fa2_autograd" in ours else "")
    console.print(table)
    console.print("x FA2: blockattn's time over FA2 varlen's ops called directly in the same pass (eager modes "
                  "against FA2 eager, graph against FA2's graph; FA2's backward op called without autograd, "
                  "blockattn's through torch.autograd.grad). x FA2 (autograd): over FA2 varlen in a "
                  "torch.autograd.Function, as flash_attn_varlen_func runs it, its fwdbwd through "
                  "torch.autograd.grad like blockattn's.")


def write_file(report: dict, out_dir: Path) -> Path:
    return harness.write_json(report, out_dir, "latency.json")
