"""Sweep the kernels' launch settings on a GPU, and time the block table apart from the kernels.

    python benchmarks/tune_block_attention.py --preset ads ads-d64 short
    python benchmarks/tune_block_attention.py --preset ads --kv-heads 1 --rotary   # GQA 4:1, fused rotary

Prints, per workload, each setting's median time as a multiple of the memory floor (kernels only; the op adds the
block table, printed first), for the backward, the forward and the fp8 forward (inputs quantised from the
workload's; ``--backward-only`` skips both forwards); ``--warps`` picks the warp counts tried; ``--in-block`` adds a
causal mask and both biases (floors are the plain op's). It calls the Triton launchers directly, with their tuning
overrides: on Hopper the dispatcher sends the production backward to the Gluon kernel instead (`python -m blockattn
info`). ``--heads``, ``--kv-heads`` (GQA), ``--block-size`` and ``--head-dim`` override the presets' shape;
``--rotary`` fuses a rotary of q, k, v with fp32 angles (floors count them). Settings the GPU cannot run are listed
with the reason.
"""

import argparse
import dataclasses
import itertools
import math
from functools import partial

import torch

from blockattn.bench.harness import copy_bandwidth_tbps, floor_bytes, fp8_forward_floor_bytes, make_case, time_ms
from blockattn.bench.options import NUM_BUCKETS
from blockattn.bench.presets import PRESETS
from blockattn.block_table import build_block_table
from blockattn.ops import block_attention as triton_ops
from blockattn.ops import fp8
from blockattn.ops.in_block import PLAIN, InBlock
from blockattn.ops.tiles import ROTATE_ALL, ROTATE_NONE
from blockattn.reference import quantised_fp8, random_angles


def _backward_variants(w, rotary: bool, in_block: bool) -> list[dict]:
    """The default launch, then each slices-per-program choice and each other head-dim slice width (no GQA), or
    under GQA each width with the group's loop one and two stages deep, and (no rotary, no in-block options) the
    persistent kernel at 2 and 3 stages."""
    group = triton_ops.backward_group(w.block_size, w.head_dim, w.heads // w.kv_heads)
    cfg = triton_ops.kernel_config(w.block_size, w.head_dim, backward=True, group=group, rotary=rotary,
                                   persistent=not in_block)
    variants = [{}]
    if w.heads == w.kv_heads:
        # a number: one block per program with that many head-dim slices each (None: the default kernel choice,
        # persistent where kernel_config pipelines)
        variants += [{"slices_per_program": s} for s in sorted({1, cfg["NUM_CHUNKS"]})]
    widths = [c for c in (16, 32, 64, 128, 256) if triton_ops.min_chunk(rotary) <= c <= cfg["BLOCK_D"]]
    if w.heads > w.kv_heads:  # the loop over the group's query heads, one and two stages deep, at every width
        variants += [{"chunk": c, "group_stages": s} for c in widths for s in (1, 2)]
    else:
        variants += [{"chunk": c} for c in widths if c != cfg["CHUNK"]]
    if not rotary and not in_block and not triton_ops.splits_group(w.block_size, w.head_dim, w.heads // w.kv_heads):
        variants += [{"pipeline_stages": s} for s in (2, 3) if s != cfg["PIPELINE_STAGES"]]
    return variants


def _report(label: str, run, rep_ms: int, floor_ms: float, of: str = "floor") -> None:
    """Print one setting's median time over ``floor_ms``; a setting the GPU cannot run (shared memory, registers)
    prints why instead of ending the sweep."""
    try:
        ms = time_ms(run, rep_ms)["p50"]
    except Exception as error:  # noqa: BLE001 -- triton's OutOfResources and compile errors alike
        print(f"  {label}: not run ({type(error).__name__}: {str(error).splitlines()[0][:120]})")
        return
    print(f"  {label}: {ms:.3f} ms = {ms / floor_ms:.3f} x {of}")


def _causal_and_biases(w, n: int) -> InBlock:
    """A causal mask and both biases, drawn as the options bench draws them (``bench.options``)."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    return InBlock(causal=True, pos_bias=torch.randn(w.heads, 2 * w.block_size - 1, device="cuda", generator=generator),
                   timestamps=torch.randint(1, 1200, (n,), device="cuda", generator=generator).cumsum(0),
                   time_bias=torch.randn(w.heads, NUM_BUCKETS, device="cuda", generator=generator))


def tune(w, tbps: float, rep_ms: int, rotary: bool, caps: tuple, warps_tried: tuple, backward_only: bool,
         in_block: bool) -> None:
    case = make_case(w, w.offsets(0, "cuda"), 0)
    n = case.q.shape[0]
    options = _causal_and_biases(w, n) if in_block else PLAIN
    sinu_pos, rotate = (random_angles(n, w.head_dim, "cuda"), ROTATE_ALL) if rotary else (None, ROTATE_NONE)
    angle_bytes = 0 if sinu_pos is None else sinu_pos.numel() * sinu_pos.element_size()
    floors = {p: (b + angle_bytes) / (tbps * 1e12) * 1e3 for p, b in floor_bytes(w, n).items()}
    bs, scale = w.block_size, 1 / math.sqrt(w.head_dim)
    table_ms = time_ms(lambda: build_block_table(case.offsets, n, bs), rep_ms)["p50"]
    print(f"{w.name} (Hq {w.heads}, Hkv {w.kv_heads}, rotary {rotary}, in-block options {in_block}): N={n} "
          f"floor fwd {floors['fwd']:.3f} ms, bwd {floors['bwd']:.3f} ms; block table alone {table_ms * 1e3:.1f} us")
    group = triton_ops.backward_group(bs, w.head_dim, w.heads // w.kv_heads)
    rule = triton_ops.kernel_config(bs, w.head_dim, backward=True, group=group, rotary=rotary,
                                    persistent=not in_block)
    print(f"  the rule's backward ('default' rows, at its warps): {dict(rule)}")
    grads = tuple(torch.empty_like(t) for t in case.inputs)
    for warps, cap, variant in itertools.product(warps_tried, caps, _backward_variants(w, rotary, in_block)):
        _report(f"bwd warps={warps} maxnreg={cap} {variant or 'default'}",
                partial(triton_ops.block_attention_bwd_triton, case.do, case.q, case.k, case.v, case.offsets,
                        case.table, bs, scale, sinu_pos, rotate, options, grads, num_warps=warps, maxnreg=cap,
                        **variant), rep_ms, floors["bwd"])
    if backward_only:
        return
    for warps, cap in itertools.product(warps_tried, caps):
        _report(f"fwd warps={warps} maxnreg={cap}",
                partial(triton_ops.block_attention_fwd_triton, case.q, case.k, case.v, case.offsets, case.table, bs,
                        scale, sinu_pos, rotate, options, num_warps=warps, maxnreg=cap), rep_ms, floors["fwd"])
    if in_block:  # the fp8 forward is inference: timed without options
        return
    # The fp8 forward (q, k, v quantised per tensor, bf16 output): one byte per input element.
    quantised = [quantised_fp8(t) for t in case.inputs]
    scales = fp8.Fp8Scales(*(s for _, s in quantised), torch.bfloat16)
    fp8_floor = (fp8_forward_floor_bytes(w, n) + angle_bytes) / (tbps * 1e12) * 1e3
    for warps, cap, fp8_dot in itertools.product(warps_tried, caps, (False,) if rotary else (False, True)):
        _report(f"fp8 fwd warps={warps} maxnreg={cap} fp8_dot={fp8_dot}",
                partial(triton_ops.block_attention_fwd_triton, *(t for t, _ in quantised), case.offsets, case.table,
                        bs, scale, sinu_pos, rotate, PLAIN, scales, num_warps=warps, maxnreg=cap, fp8_dot=fp8_dot),
                rep_ms, fp8_floor, "its floor")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", nargs="+", default=["ads", "ads-d64"])
    parser.add_argument("--heads", type=int, default=None, help="override the presets' query heads")
    parser.add_argument("--kv-heads", type=int, default=None, help="override the presets' kv heads (GQA)")
    parser.add_argument("--block-size", type=int, default=None, help="override the presets' block size")
    parser.add_argument("--head-dim", type=int, default=None, help="override the presets' head dim")
    parser.add_argument("--rotary", action="store_true", help="fuse a rotary of q, k, v (fp32 angles)")
    parser.add_argument("--register-caps", nargs="+", default=["none", "168", "128"],
                        help="maxnreg values to try ('none': no cap)")
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8], help="num_warps values to try")
    parser.add_argument("--backward-only", action="store_true", help="time the backward's settings only")
    parser.add_argument("--in-block", action="store_true",
                        help="with a causal mask and both biases (as bench --options draws them; no fp8 forward)")
    parser.add_argument("--rep-ms", type=int, default=200)
    args = parser.parse_args()
    tbps = copy_bandwidth_tbps(args.rep_ms)
    print(f"copy bandwidth {tbps:.2f} TB/s")
    for name in args.preset:
        w = PRESETS[name]
        overrides = {"heads": args.heads, "kv_heads": args.kv_heads, "block_size": args.block_size,
                     "head_dim": args.head_dim}
        w = dataclasses.replace(w, **{field: value for field, value in overrides.items() if value is not None})
        caps = tuple(None if c == "none" else int(c) for c in args.register_caps)
        tune(w, tbps, args.rep_ms, args.rotary, caps, tuple(args.warps), args.backward_only, args.in_block)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
