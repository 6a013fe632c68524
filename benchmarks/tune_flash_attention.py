"""Sweep the flash-attention kernels' configurations (tiles, warps, stages) on this GPU: TFLOP/s of each, the best
per (variant, dtype, head dim, causal). The launchers' table (``ops.flash_attention._CONFIGS``) is set from these
runs by hand (docs/benchmarks.md); nothing is tuned at call time.

    python benchmarks/tune_flash_attention.py [--seqlen 4096] [--batch 4] [--heads 16] [--out tune.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import torch
import triton.testing

from blockattn import devices
from blockattn.backends import FLASH_BACKENDS
from blockattn.checks import FP8_DTYPE
from blockattn.ops import flash_attention as flash_ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--variants", nargs="+", default=["pipelined", "warp_specialized"])
    p.add_argument("--rep-ms", type=int, default=60)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    capability = torch.cuda.get_device_capability()
    limit = devices.shared_memory_limit(torch.device("cuda"))
    rows = []
    for d, dtype, causal in itertools.product(args.head_dims, (torch.bfloat16, FP8_DTYPE), (False, True)):
        q, k, v = (torch.randn(args.batch, args.seqlen, args.heads, d, device="cuda").to(dtype) for _ in range(3))
        fp8 = dtype == FP8_DTYPE
        descales = tuple(torch.ones(1, device="cuda") for _ in range(3)) if fp8 else None
        flops = 4 * args.batch * args.seqlen**2 * d * args.heads / (2 if causal else 1)
        # The TMA kernel takes 16-bit inputs only (backends.TMA_DTYPES).
        for variant in (v for v in args.variants if not (fp8 and v == "warp_specialized")):
            warps = (4,) if variant == "warp_specialized" else (4, 8)
            for bm, bn, nw, st in itertools.product((64, 128) if d > 128 else (128,), (64, 128), warps, (2, 3)):
                cfg = flash_ops.FlashConfig(bm, bn, nw, st)
                if cfg.shared_bytes(flash_ops.block_d(d, fp8), 1 if fp8 else 2) > limit:
                    continue

                def call(cfg=cfg, variant=variant, inputs=(q, k, v), d=d, causal=causal, descales=descales):
                    return FLASH_BACKENDS[variant].forward(*inputs, None, None, None, 1 / math.sqrt(d), causal,
                                                           False, torch.bfloat16, descales, cfg)
                row = {"variant": variant, "dtype": str(dtype), "head_dim": d, "causal": causal,
                       "config": [bm, bn, nw, st]}
                try:
                    ms = triton.testing.do_bench(call, warmup=10, rep=args.rep_ms)
                    row.update(ms=ms, tflops=flops / ms / 1e9)
                except Exception as error:  # noqa: BLE001 -- a configuration the compiler refuses (registers, shared memory)
                    row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                rows.append(row)
            done = [r for r in rows if r["variant"] == variant and r["head_dim"] == d and r["dtype"] == str(dtype)
                    and r["causal"] == causal and "tflops" in r]
            best = max(done, key=lambda r: r["tflops"], default=None)
            print(f"{capability} D={d} {dtype} causal={causal} {variant}: best "
                  f"{best and best['config']} {best and round(best['tflops'])} TFLOP/s "
                  f"(of {len(done)} configs)", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "seqlen": args.seqlen,
                                        "batch": args.batch, "heads": args.heads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
