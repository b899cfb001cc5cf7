"""The batch-size cliff against its goals (docs/benchmarks/batch-size.md), from a `python -m eval batch_sizes=[...]` report.

    python -m eval 'ks=[2,4,8]' 'batch_sizes=[1,2,4,8,16,32]' data.max_prompts_per_category=16 \
        out_dir=runs/bench/batch 'drafters=[{name: off_the_shelf, kind: draft_lm, path: toyworld://toy/draft},
                                            {name: draft_lm, kind: draft_lm, path: <draft run>/best},
                                            {name: eagle3, kind: head, path: <eagle run>/best}]'
    python scripts/bench_batch.py runs/bench/batch

Per category and drafter, greedy: the speed-up at its best k for each batch size (with the 95 % interval),
the largest batch size up to which it pays and where it crosses 1, how the best k moves; then per batch
size, the cost model's prediction over the measured speed-up for every (drafter, k, category) row
(goal: within ±10 %), with c and β as measured at that batch size.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report_dir", help="the out_dir of a `python -m eval batch_sizes=[...]` run")
    args = ap.parse_args()
    report = json.loads((Path(args.report_dir) / "report.json").read_text())
    rows = [r for r in report["results"] if r["temperature"] == 0]
    sizes = sorted({r["batch_size"] for r in rows})
    threshold = report["settings"]["pays_off_at"]

    print("| category | drafter | " + " | ".join(f"B={b}" for b in sizes) + " | pays up to | crosses 1 |")
    print("|---|---|" + "---|" * len(sizes) + "---|---|")
    best: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        if r["k"] == r["best_k"]:
            best.setdefault((r["category"], r["drafter"]), {})[r["batch_size"]] = r
    for (category, drafter), by in best.items():
        cells, pays, crosses = [], 0, None
        for b in sizes:
            r = by[b]
            lo, hi = r["speedup_ci"] or (float("nan"), float("nan"))
            cells.append(f"{r['speedup']:.2f}× k={r['k']} ({lo:.2f}–{hi:.2f})")
        for b in sizes:
            if by[b]["speedup"] < threshold:
                break
            pays = b
        below = [b for b in sizes if by[b]["speedup"] < 1.0]
        crosses = f"below 1 from B={below[0]}" if below else "never below 1"
        print(f"| {category} | {drafter} | " + " | ".join(cells) + f" | {pays or '–'} | {crosses} |")

    print("\n| batch size | c (median) | β (median) | rows | predicted within ±10 % | predicted / measured (min–max) |")
    print("|---|---|---|---|---|---|")
    for b in sizes:
        at = [r for r in rows if r["batch_size"] == b and r["predicted_speedup"] is not None]
        ratios = [r["predicted_speedup"] / r["speedup"] for r in at]
        within = sum(abs(x - 1) <= 0.10 for x in ratios)
        print(f"| {b} | {statistics.median(r['cost_ratio'] for r in at):.3f} | "
              f"{statistics.median(r['verify_overhead'] for r in at):.3f} | {len(at)} | {within}/{len(at)} | "
              f"{min(ratios):.3f}–{max(ratios):.3f} |")


if __name__ == "__main__":
    main()
