"""Where every configuration stands: the newest figure of each (device, block size, head dim, GQA ratio, dtype,
rotary, pass) over the ``bench --sweep`` JSONs given, as a markdown table per device, and a heatmap per device.

    python benchmarks/sweep_summary.py [docs/sweep-*.json ...] [--dtype bfloat16 float8_e4m3fn] [--over 1.15]
                                       [--out DIR]

Sweeps are often run one axis at a time (``--block-size``, ``--head-dim``...), so the state of the grid is spread
over many files; a later sweep of a configuration replaces an earlier one (``sweep.newest_figures``). Each table
cell is a (block size, head dim, rotary) row's time over the floor across the GQA ratios measured, for one pass;
``--over`` lists every configuration above that ratio; ``--out`` writes ``bench --sweep``'s heatmap of the merged
figures, ``sweep-summary-<gpu>-<date of the newest sweep>.png``.
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

from blockattn.bench import sweep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="sweep JSONs (default: docs/sweep-*.json)")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", sweep.FP8], choices=sweep.DTYPES)
    parser.add_argument("--over", type=float, default=None, help="also list the configurations above this ratio")
    parser.add_argument("--out", type=Path, default=None, help="write a heatmap per device here")
    args = parser.parse_args()
    paths = args.paths or sorted(glob.glob(str(Path(__file__).resolve().parents[1] / "docs" / "sweep-*.json")))
    reports = [(Path(p).name, json.loads(Path(p).read_text())) for p in paths]
    for device, results in sweep.newest_figures(reports, tuple(args.dtype)).items():
        dates = sorted(e[p]["date"][:16] for e in results.values() for p in sweep.PASSES if p in e)
        print(f"\n### {device}: {len(results)} configurations, sweeps of {dates[0]} to {dates[-1]} UTC\n")
        print(sweep.summary_table(results))
        if args.over is not None:
            over = sorted((k, p, e[p]["x_floor"], e[p]["name"]) for k, e in results.items() for p in sweep.PASSES
                          if p in e and e[p]["x_floor"] > args.over)
            print(f"\n{len(over)} (configuration, pass) above {args.over}x:")
            for (bs, d, kv, dtype, rotary), pass_name, x, name in over:
                print(f"  BS {bs}, D {d}, {sweep.NUM_HEADS}:{kv}, {dtype}, {rotary}, {pass_name}: {x:.2f}x ({name})")
        if args.out is not None:
            import matplotlib.pyplot as plt

            rows = [{**e, "gqa": sweep.NUM_HEADS // k[2]} for k, e in results.items()]
            fig = sweep.heatmap({"environment": {"device": device, "date": dates[-1]}, "results": rows})
            fig.suptitle(f"blockattn configuration sweep, {device}: the newest figure of each configuration, sweeps "
                         f"of {dates[0][:10]} to {dates[-1][:10]}")
            args.out.mkdir(parents=True, exist_ok=True)
            path = args.out / f"sweep-summary-{device.split()[1].lower()}-{dates[-1][:10]}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
