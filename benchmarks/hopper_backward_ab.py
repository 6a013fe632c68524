"""The Hopper backward against the Triton one it replaces, its heads-per-program rule against fixed counts, and
16- and 32-token blocks in 64-row tiles against one block a program, in one process (the sweep's measurement:
``bench --sweep``'s workload, each op alone replayed as a CUDA graph).

    python benchmarks/hopper_backward_ab.py            # --rep-ms 10

Prints, per configuration (bf16, 8 query heads), the pass's time over its memory floor for each variant: ``h1``/
``h2``/``h4`` (the non-GQA kernel with that many heads a program), ``b1`` (one block a program at 16 and 32
tokens: the forward's Triton kernel on the block, the backward's Triton kernels), ``tiles`` (64-row tiles of 16-
or 32-token blocks in both passes, the backward's on the Hopper kernels), ``rule`` (the launchers' choice) and
``triton`` (the dispatcher without the Hopper backend).
"""

import argparse

from blockattn import backends
from blockattn.bench import harness, sweep
from blockattn.ops import block_attention_sm90 as sm90
from blockattn.ops import plans, tiles

# (block size, head dim, kv heads, rotary), pass, variants
CASES = [
    *(((bs, d, kv, rotary), pass_name, ["b1", "tiles"])
      for bs in (16, 32) for d in (32, 64, 128) for kv in (8, 2) for rotary in ("none", "fp32 angles")
      for pass_name in ("fwd", "bwd")),
    ((128, 64, 8, "none"), "bwd", ["h1", "h2", "h4", "rule", "triton"]),
    ((128, 32, 8, "none"), "bwd", ["h1", "h2", "h4", "rule", "triton"]),
    ((128, 64, 8, "fp32 angles"), "bwd", ["h1", "rule", "triton"]),
    ((128, 32, 8, "fp32 angles"), "bwd", ["h1", "rule"]),
    ((128, 128, 8, "none"), "bwd", ["rule", "triton"]),
    ((128, 128, 4, "none"), "bwd", ["rule", "triton"]),
    ((128, 128, 2, "none"), "bwd", ["rule", "triton"]),
    ((128, 128, 1, "none"), "bwd", ["rule", "triton"]),
    ((128, 128, 2, "fp32 angles"), "bwd", ["rule", "triton"]),
    ((128, 64, 2, "none"), "bwd", ["rule", "triton"]),
    ((64, 256, 8, "none"), "bwd", ["rule", "triton"]),
    ((64, 256, 2, "none"), "bwd", ["rule", "triton"]),
    ((64, 256, 2, "fp32 angles"), "bwd", ["rule", "triton"]),
    ((64, 64, 8, "none"), "bwd", ["h1", "h2"]),
]

HOPPER = backends.BACKENDS["sm90-gluon"]
RULE = sm90._heads_per_program
BLOCKS = tiles.blocks_per_tile


def use(variant: str) -> None:
    if variant == "triton":
        del backends.BACKENDS["sm90-gluon"]
    elif variant == "b1":
        tiles.blocks_per_tile = lambda *args, **kwargs: 1
    elif variant == "tiles":
        tiles.blocks_per_tile = lambda block_size, *args, **kwargs: tiles.TILE_ROWS // block_size
    elif variant != "rule":
        count = int(variant[1:])
        sm90._heads_per_program = lambda block_size, head_dim, num_heads, options: count


def restore() -> None:
    sm90._heads_per_program = RULE
    tiles.blocks_per_tile = BLOCKS
    others = {name: b for name, b in backends.BACKENDS.items() if name != "sm90-gluon"}
    backends.BACKENDS.clear()
    backends.BACKENDS.update({"sm90-gluon": HOPPER, **others})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rep-ms", type=int, default=10)
    args = parser.parse_args()
    tbps = harness.copy_bandwidth_tbps(args.rep_ms)
    print(f"{harness.environment()['device']}; copy bandwidth {tbps:.2f} TB/s", flush=True)
    for (block_size, head_dim, kv_heads, rotary), pass_name, variants in CASES:
        config = sweep.Config(block_size, head_dim, kv_heads, "bfloat16", rotary)
        cells = []
        for variant in variants:
            use(variant)
            plans.forget()
            try:
                row = sweep._measure(config, sweep.QUERY_ELEMENTS, args.rep_ms, tbps, 0, "cuda", (pass_name,))[pass_name]
                cells.append(f"{variant} {row['x_floor']:.2f} ({row['ms']:.3f} ms, {row['tflops']:.0f} TFLOP/s)")
            except Exception as error:  # noqa: BLE001 -- a variant's failure is a result; the others still run
                cells.append(f"{variant} failed: {harness.describe(error)}")
            finally:
                restore()
                harness.free_memory()
        print(f"{pass_name} BS {block_size} D {head_dim} 8:{kv_heads} {rotary}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
