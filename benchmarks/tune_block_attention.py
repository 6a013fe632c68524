"""Sweep the kernels' launch settings on a GPU, and time the block table apart from the kernels.

    python benchmarks/tune_block_attention.py --preset ads ads-d64 short

Prints, per workload, each setting's median time as a multiple of the memory floor (kernels only; the op adds
the block table, printed first). It calls the Triton launchers directly, with their tuning overrides: on Hopper the
dispatcher sends the production backward to the Gluon kernel instead (`python -m blockattn info`).
"""

import argparse
import itertools
import math
from functools import partial

import torch

from blockattn.bench.harness import copy_bandwidth_tbps, floor_bytes, make_case, time_ms
from blockattn.bench.presets import PRESETS
from blockattn.block_table import build_block_table
from blockattn.ops import block_attention as triton_ops
from blockattn.ops.in_block import PLAIN


def tune(w, tbps: float, rep_ms: int) -> None:
    case = make_case(w, w.offsets(0, "cuda"), 0)
    n = case.q.shape[0]
    floors = {p: b / (tbps * 1e12) * 1e3 for p, b in floor_bytes(w, n).items()}
    bs, scale = w.block_size, 1 / math.sqrt(w.head_dim)
    table_ms = time_ms(lambda: build_block_table(case.offsets, n, bs), rep_ms)
    print(f"{w.name}: N={n} floor fwd {floors['fwd']:.3f} ms, bwd {floors['bwd']:.3f} ms; "
          f"block table alone {table_ms * 1e3:.1f} us")
    for warps, cap in itertools.product((4, 8), (None, 168, 128)):
        ms = time_ms(partial(triton_ops.block_attention_fwd_triton, case.q, case.k, case.v, case.offsets, case.table,
                             bs, scale, None, 0, num_warps=warps, maxnreg=cap), rep_ms)
        print(f"  fwd warps={warps} maxnreg={cap}: {ms:.3f} ms = {ms / floors['fwd']:.3f} x floor")
    chunks = triton_ops.kernel_config(bs, w.head_dim, backward=True)["NUM_CHUNKS"]
    grads = tuple(torch.empty_like(t) for t in case.inputs)
    # slices None: the default kernel choice (persistent where kernel_config pipelines); a number: one block
    # per program with that many head-dim slices each.
    for warps, cap, slices in itertools.product((4, 8), (None, 168, 128), [None, *sorted({1, chunks})]):
        ms = time_ms(partial(triton_ops.block_attention_bwd_triton, case.do, case.q, case.k, case.v, case.offsets,
                             case.table, bs, scale, None, 0, PLAIN, grads, num_warps=warps, maxnreg=cap,
                             slices_per_program=slices), rep_ms)
        print(f"  bwd warps={warps} maxnreg={cap} slices/program={slices}: {ms:.3f} ms = "
              f"{ms / floors['bwd']:.3f} x floor")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", nargs="+", default=["ads", "ads-d64"])
    parser.add_argument("--rep-ms", type=int, default=200)
    args = parser.parse_args()
    tbps = copy_bandwidth_tbps(args.rep_ms)
    print(f"copy bandwidth {tbps:.2f} TB/s")
    for name in args.preset:
        tune(PRESETS[name], tbps, args.rep_ms)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
