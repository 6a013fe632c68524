"""Sweep the kernels' launch settings on a GPU, and split the op's time into block table + kernel.

    python benchmarks/tune_block_attention.py --preset ads ads-d64 short

Prints, per workload and pass, the median time of each num_warps choice as a multiple of the memory floor.
"""

import argparse
import math

import torch

from blockattn.bench.harness import copy_bandwidth_tbps, floor_bytes, make_case, time_ms
from blockattn.bench.presets import PRESETS
from blockattn.layout import block_table
from blockattn.ops import block_attention as impl


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", nargs="+", default=["ads", "ads-d64"])
    parser.add_argument("--rep-ms", type=int, default=200)
    args = parser.parse_args()
    tbps = copy_bandwidth_tbps(args.rep_ms)
    print(f"copy bandwidth {tbps:.2f} TB/s")
    for name in args.preset:
        w = PRESETS[name]
        case = make_case(w, w.offsets(0, "cuda"), 0)
        n = case.q.shape[0]
        floors = {p: b / (tbps * 1e12) * 1e3 for p, b in floor_bytes(w, n).items()}
        bs, scale = w.block_size, 1 / math.sqrt(w.head_dim)
        table_ms = time_ms(lambda: block_table(case.offsets, n, bs), args.rep_ms)
        print(f"{name}: N={n} floor fwd {floors['fwd']:.3f} ms, bwd {floors['bwd']:.3f} ms; "
              f"block table {table_ms * 1e3:.1f} us")
        for warps in (2, 4, 8):
            ms = time_ms(lambda: impl.block_attention_fwd_triton(case.q, case.k, case.v, case.offsets, *case.table,
                                                                 bs, scale, num_warps=warps), args.rep_ms)
            print(f"  fwd num_warps={warps}: {ms:.3f} ms = {ms / floors['fwd']:.3f} x floor")
        for warps in (4, 8):
            ms = time_ms(lambda: impl.block_attention_bwd_triton(case.do, case.q, case.k, case.v, case.offsets,
                                                                 *case.table, bs, scale, num_warps=warps),
                         args.rep_ms)
            print(f"  bwd num_warps={warps}: {ms:.3f} ms = {ms / floors['bwd']:.3f} x floor")
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
