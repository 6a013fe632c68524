"""The Hopper kernels against the Triton ones they replace, in one process (the sweep's measurement: ``bench
--sweep``'s workload, each op alone replayed as a CUDA graph): the warp-specialised forward against the Triton
forward, the Hopper backward's heads-per-program rule against fixed counts, and 16- and 32-token blocks in 64-row
tiles against one block a program.

    python benchmarks/hopper_ab.py                  # --rep-ms 10
    python benchmarks/hopper_ab.py --pass fwd       # the forward's cases alone
    python benchmarks/hopper_ab.py --dtype float8_e4m3fn --head-dim 128  # fp8 inputs: the forward kernels' cases
    python benchmarks/hopper_ab.py --block-size 128 --pass fwd

Prints, per configuration (bf16 unless ``--dtype``, 8 query heads), the pass's time over its memory floor for each variant: ``rule``
(the dispatcher's choice), ``triton`` (the dispatcher without the Hopper kernels), ``ws`` (the warp-specialised
forward wherever its kernel runs the call), ``q2`` (the same with two q slots a consumer, not the group's),
``h1``/``h2``/``h4`` (the non-GQA backward kernel with that many heads a program), ``b1`` (one block a program at
16 and 32 tokens: the forward's Triton kernel on the block, the backward's Triton kernels), ``tiles`` (64-row tiles
of 16- or 32-token blocks in both passes: the Triton forward, the Hopper backward).
"""

import argparse
import dataclasses

from blockattn import backends
from blockattn.bench import harness, sweep
from blockattn.ops import block_attention_sm90 as sm90
from blockattn.ops import block_attention_sm90_fwd as sm90_fwd
from blockattn.ops import plans, tiles

# (block size, head dim, kv heads, rotary), pass, variants
CASES = [
    *(((bs, d, kv, "none"), "fwd", ["rule", "triton", "ws", *(["q2"] if d == 64 and kv <= 2 else [])])
      for bs in (64, 32, 16) for d in (128, 64, 32) for kv in (8, 4, 2, 1)),
    *(((128, d, kv, "none"), "fwd", ["rule", "triton", "ws"]) for d in (128, 64, 32) for kv in (8, 4, 2, 1)),
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
FORWARD_RULE = sm90_fwd._triton_faster
Q_SLOTS = sm90_fwd._q_slots
BLOCKS = tiles.blocks_per_tile


def use(variant: str) -> None:
    if variant == "triton":
        del backends.BACKENDS["sm90-gluon"]
    elif variant in ("ws", "q2"):
        sm90_fwd._triton_faster = lambda call: None
        if variant == "q2":
            sm90_fwd._q_slots = lambda *args: 2
    elif variant in ("b1", "tiles"):  # the Triton forward's packing: the Hopper forward taken out
        backends.BACKENDS["sm90-gluon"] = dataclasses.replace(HOPPER, forward=None)
        if variant == "b1":
            tiles.blocks_per_tile = lambda *args, **kwargs: 1
        else:
            tiles.blocks_per_tile = lambda block_size, *args, **kwargs: tiles.TILE_ROWS // block_size
    elif variant != "rule":
        count = int(variant[1:])
        sm90._heads_per_program = lambda block_size, head_dim, num_heads, options: count


def restore() -> None:
    sm90._heads_per_program = RULE
    sm90_fwd._triton_faster = FORWARD_RULE
    sm90_fwd._q_slots = Q_SLOTS
    tiles.blocks_per_tile = BLOCKS
    others = {name: b for name, b in backends.BACKENDS.items() if name != "sm90-gluon"}
    backends.BACKENDS.clear()
    backends.BACKENDS.update({"sm90-gluon": HOPPER, **others})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rep-ms", type=int, default=10)
    parser.add_argument("--pass", dest="pass_name", choices=("fwd", "bwd"), help="the cases of one pass alone")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", sweep.FP8), default="bfloat16",
                        help="the inputs' dtype (fp8: the warp-specialised forward against the Triton one alone)")
    parser.add_argument("--head-dim", type=int, help="the cases of one head dim alone")
    parser.add_argument("--block-size", type=int, help="the cases of one block size alone")
    args = parser.parse_args()
    tbps = harness.copy_bandwidth_tbps(args.rep_ms)
    print(f"{harness.environment()['device']}; copy bandwidth {tbps:.2f} TB/s", flush=True)
    for (block_size, head_dim, kv_heads, rotary), pass_name, variants in CASES:
        if (args.pass_name not in (None, pass_name) or args.head_dim not in (None, head_dim)
                or args.block_size not in (None, block_size) or (args.dtype == sweep.FP8 and "ws" not in variants)):
            continue
        config = sweep.Config(block_size, head_dim, kv_heads, args.dtype, rotary)
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
        print(f"{pass_name} {args.dtype} BS {block_size} D {head_dim} 8:{kv_heads} {rotary}: " + " | ".join(cells),
              flush=True)


if __name__ == "__main__":
    main()
