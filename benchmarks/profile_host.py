"""Where the host time of one small eager call goes: the calls of ``bench --latency`` on one batch, the pieces
they are made of (a torch op, an allocation, the block table, an empty autograd round trip), and optionally a
cProfile of two of them, the layers of a call with a layout each timed alone (``--layers``: the public function,
the custom op's route, the planned implementation, its plan's replay and each replayed step, the plan's
signature, and the replayed steps of a forward with ``offsets``; empty Triton launches of 1 and 57 arguments), the calls with their replays' direct launches against
Triton's runner in one process (``--launches``), and the block table's time on the presets' batches.

    python benchmarks/profile_host.py [--batch 1 500] [--profile] [--layers] [--launches] [--tables]

Every call repeats one argument signature: from the third on, the attention calls replay their call plan
(``blockattn/ops/plans.py``), as a model's layers do on one batch. To compare two versions of the code on one
machine, run it on each checkout in turn, several times: a shared host's figures move by tens of percent between
runs minutes apart. Each figure is the median (and the minimum) over 9
repeats of 300 back-to-back calls and one synchronisation, per call (µs).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import triton

import blockattn
from blockattn import custom_ops
from blockattn.bench.presets import PRESETS
from blockattn.block_table import build_block_table
from blockattn.ops import launch, plans

HEADS, HEAD_DIM, BLOCK_SIZE = 4, 128, 64


def per_call_us(fn, calls: int = 300, repeats: int = 9) -> tuple[float, float]:
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times), min(times)


class _Identity(torch.autograd.Function):
    """The least a custom autograd function costs: a view forward, the gradient passed through."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _batch(num_seqs: int, length: int) -> tuple:
    """``(n, q, k, v, do, offsets, layout)`` of ``num_seqs`` sequences of ``length`` tokens (seeded)."""
    n = num_seqs * length
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(n, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
                   for _ in range(4))
    offsets = torch.arange(0, n + 1, length, device="cuda")
    return n, q, k, v, do, offsets, blockattn.block_layout(offsets, n)


def calls(num_seqs: int, length: int) -> dict:
    n, q, k, v, do, offsets, layout = _batch(num_seqs, length)
    grads_of = [t.detach().requires_grad_() for t in (q, k, v)]
    out = blockattn.block_attention(*grads_of, layout)
    block_lengths = [min(BLOCK_SIZE, length - s) for s in range(0, length, BLOCK_SIZE)] * num_seqs
    cu = torch.tensor([0, *block_lengths], device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    return {
        "fwd, offsets": lambda: blockattn.block_attention(q, k, v, offsets),
        "fwd, layout": lambda: blockattn.block_attention(q, k, v, layout),
        "fwd+bwd, offsets": lambda: torch.autograd.grad(blockattn.block_attention(*grads_of, offsets), grads_of, do),
        "fwd+bwd, layout": lambda: torch.autograd.grad(blockattn.block_attention(*grads_of, layout), grads_of, do),
        "bwd alone (autograd.grad, retained graph)": lambda: torch.autograd.grad(out, grads_of, do,
                                                                                  retain_graph=True),
        "FA2 varlen fwd (aten op)": lambda: torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, BLOCK_SIZE, BLOCK_SIZE, 0.0, False, False, scale=scale),
        "torch.add": lambda: q + 1,
        "torch.empty": lambda: torch.empty_like(q),
        "block table (build_block_table)": lambda: build_block_table(offsets, n, BLOCK_SIZE),
        "identity autograd.Function fwd + autograd.grad": lambda: torch.autograd.grad(_Identity.apply(grads_of[0]),
                                                                                      grads_of[0], do),
    }


@triton.jit
def _empty_kernel(x):
    pass


@triton.jit
def _empty_kernel_57(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, c0, c1, c2, c3,
                     c4, c5, c6, c7, c8, c9, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, e0, e1, e2, e3, e4, e5, e6, e7,
                     e8, e9, f0, f1, f2, f3, f4, f5, f6):
    pass


def _replayed_steps(name: str, fn, args: tuple) -> dict:
    """``fn``'s plan for ``args`` (its third call records nothing new) as a whole, its signature and each step alone
    (on the slots the steps before it filled)."""
    for _ in range(3):
        fn(*args)
    plan = fn.plans[plans._signature(args)]
    if not hasattr(plan, "steps"):  # a NoPlan: why the call is not replayed
        raise RuntimeError(f"{name}: no plan ({plan})")
    parts = {f"{name}: plan replay": lambda: plan(args), f"{name}: plan signature": lambda: plans._signature(args)}
    slots = list(args)
    for i, step in enumerate(plan.steps):
        parts[f"{name}: step {i} alone"] = lambda step=step, before=list(slots): step(list(before))
        step(slots)
    return parts


def layers(num_seqs: int, length: int) -> dict:
    """The layers of a forward and a backward with a layout, outermost first (each includes the ones below), and
    the plan of a forward with ``offsets`` (which builds the block table)."""
    _, q, k, v, do, offsets, layout = _batch(num_seqs, length)
    scale = HEAD_DIM**-0.5
    # The forward op's inputs as the public function passes them (no options), with a layout and with offsets, and
    # the backward op's.
    inputs = (q, k, v, layout.offsets, None, BLOCK_SIZE, scale, 7, False, None, None, None, 0.301, 0.0, None,
              *layout.table, None, None, None, None, None, None)
    with_offsets = (*inputs[:3], offsets, *inputs[4:15], None, None, *inputs[17:])
    backward = (do, q, k, v, layout.offsets, None, *layout.table, BLOCK_SIZE, scale, 7, False, None, None, None,
                0.301, 0.0, None, None)
    one = _empty_kernel[(1,)](q)[(1, 1, 1)]
    args_57 = [q] * 20 + [7] * 37
    many = _empty_kernel_57[(1,)](*args_57)[(1, 1, 1)]
    return {
        "public fwd, layout": lambda: blockattn.block_attention(q, k, v, layout),
        "custom op's route (custom_ops.block_attention)": lambda: custom_ops.block_attention(*inputs),
        "planned forward implementation": lambda: custom_ops._block_attention_forward(*inputs),
        **_replayed_steps("fwd", custom_ops._block_attention_forward, inputs),
        **_replayed_steps("fwd, offsets", custom_ops._block_attention_forward, with_offsets),
        "planned backward implementation": lambda: custom_ops._block_attention_backward(*backward),
        **_replayed_steps("bwd", custom_ops._block_attention_backward, backward),
        "empty Triton kernel, 1 argument (compiled runner)": lambda: one(q),
        "empty Triton kernel, 57 arguments (compiled runner)": lambda: many(*args_57),
    }


def launches_ab(fns: dict, rounds: int = 6) -> None:
    """The public calls, their plans' Triton kernels launched directly (``launch.DirectLaunch``) and through
    Triton's runner, alternated round by round (one process: a shared host's slow spells fall on both)."""
    direct = launch._launch_hooks
    names = ("fwd, layout", "fwd, offsets", "fwd+bwd, layout", "torch.add")
    medians: dict = {}
    try:
        for _ in range(rounds):
            for mode, hooks in (("Triton's runner", lambda: True), ("direct", direct)):
                launch._launch_hooks = hooks
                for name in names:
                    medians.setdefault((name, mode), []).append(per_call_us(fns[name], calls=200, repeats=5)[0])
    finally:
        launch._launch_hooks = direct
    for (name, mode), values in medians.items():
        print(f"{name + ', ' + mode:48s} median {statistics.median(values):8.1f} µs over rounds "
              f"({' '.join(f'{v:.1f}' for v in values)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs=2, default=(1, 500), metavar=("SEQUENCES", "LENGTH"))
    parser.add_argument("--profile", action="store_true", help="cProfile the eager forward and fwd+bwd")
    parser.add_argument("--layers", action="store_true",
                        help="time the layers of a forward and a backward with a layout, and their plans' steps (and "
                             "those of a forward with offsets)")
    parser.add_argument("--launches", action="store_true",
                        help="the public calls with the replays' direct launches and with Triton's runner (as while "
                             "a launch hook is installed), alternated in this process: median of 6 rounds")
    parser.add_argument("--tables", action="store_true",
                        help="the block table's time on the ads, short and long presets' batches (triton's do_bench: "
                             "CUDA events around back-to-back calls, median)")
    args = parser.parse_args()
    fns = calls(*args.batch)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.batch[0]} x {args.batch[1]} tokens, "
          f"H {HEADS}, D {HEAD_DIM}, bf16")
    for name, fn in fns.items():
        median, least = per_call_us(fn)
        print(f"{name:48s} median {median:8.1f}  min {least:8.1f} µs")
    if args.layers:
        for name, fn in layers(*args.batch).items():
            median, least = per_call_us(fn)
            print(f"{name:48s} median {median:8.1f}  min {least:8.1f} µs")
    if args.profile:
        for name in ("fwd, offsets", "fwd+bwd, layout"):
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(1000):
                fns[name]()
            torch.cuda.synchronize()
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
            print(name, text.getvalue())
    if args.launches:
        launches_ab(fns)
    if args.tables:
        for name in ("ads", "short", "long"):
            offsets = PRESETS[name].offsets(0, "cuda")
            n = int(offsets[-1])
            ms = triton.testing.do_bench(lambda offsets=offsets, n=n: build_block_table(offsets, n, BLOCK_SIZE),
                                         warmup=50, rep=300, return_mode="median")
            print(f"block table, {name} ({offsets.numel() - 1} sequences, {n} tokens): {ms * 1000:.1f} µs")


if __name__ == "__main__":
    main()
