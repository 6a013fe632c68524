"""Where the host time of one small eager call goes: the calls of ``bench --latency`` on one batch, the pieces
they are made of (a torch op, an allocation, the block table, an empty autograd round trip), and optionally a
cProfile of two of them, and the block table's time on the presets' batches.

    python benchmarks/profile_host.py [--batch 1 500] [--profile] [--tables]

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
from blockattn.bench.presets import PRESETS
from blockattn.block_table import build_block_table

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


def calls(num_seqs: int, length: int) -> dict:
    n = num_seqs * length
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(n, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
                   for _ in range(4))
    offsets = torch.arange(0, n + 1, length, device="cuda")
    layout = blockattn.block_layout(offsets, n)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs=2, default=(1, 500), metavar=("SEQUENCES", "LENGTH"))
    parser.add_argument("--profile", action="store_true", help="cProfile the eager forward and fwd+bwd")
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
    if args.tables:
        for name in ("ads", "short", "long"):
            offsets = PRESETS[name].offsets(0, "cuda")
            n = int(offsets[-1])
            ms = triton.testing.do_bench(lambda offsets=offsets, n=n: build_block_table(offsets, n, BLOCK_SIZE),
                                         warmup=50, rep=300, return_mode="median")
            print(f"block table, {name} ({offsets.numel() - 1} sequences, {n} tokens): {ms * 1000:.1f} µs")


if __name__ == "__main__":
    main()
