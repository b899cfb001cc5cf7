"""The engine verdict against its goals (docs/benchmarks/llama-cpp-toy.md), from a `python -m eval engine=llamacpp` report.

    python -m eval engine=llamacpp ks=[2,4,8] threads=2 out_dir=runs/bench/engine \
        'drafters=[{name: off_the_shelf, kind: draft_lm, path: toyworld://toy/draft},
                   {name: draft_lm, kind: draft_lm, path: <draft run>/best},
                   {name: eagle3, kind: head, path: <eagle run>/best}]'
    python scripts/bench_engine.py runs/bench/engine

Per drafter, k and category: τ in draftsmith's loop and in llama.cpp (goal: within 10 %), llama.cpp's
measured speed-up and the one predicted from draftsmith's τ with llama.cpp's c and β (goal: within ±10 %),
and whether the two verdicts agree (and whether draftsmith's own loop's verdict does). With `batch_sizes`,
a second table: per drafter and category, the best speed-up over k at each batch size in llama.cpp (B
slots) beside draftsmith's loop's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report_dir", help="the out_dir of a `python -m eval engine=llamacpp` run")
    args = ap.parse_args()
    report = json.loads((Path(args.report_dir) / "report.json").read_text())
    measured = [r for r in report["results"] if r.get("engine_speedup") is not None]
    rows = [r for r in measured if r.get("batch_size", 1) == 1]
    print("| drafter | k | category | τ draftsmith | τ llama.cpp | ratio | c | β | llama.cpp speed-up (95 % interval) "
          "| predicted | predicted / measured | verdict in llama.cpp | predicted verdict | draftsmith loop's verdict |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    tau_ok = pred_ok = agree = loop_agree = 0
    for r in rows:
        ratio = r["engine_acceptance_length"] / r["acceptance_length"]
        pred = r["engine_predicted_speedup"] / r["engine_speedup"]
        threshold = report["settings"]["pays_off_at"]
        predicted_verdict = "pays off" if r["engine_predicted_speedup"] >= threshold else "turn it off"
        tau_ok += abs(ratio - 1) <= 0.10
        pred_ok += abs(pred - 1) <= 0.10
        agree += predicted_verdict == r["engine_verdict"]
        loop_agree += r["verdict"] == r["engine_verdict"]
        lo, hi = r["engine_speedup_ci"] or (float("nan"), float("nan"))
        print(f"| {r['drafter']} | {r['k']} | {r['category']} | {r['acceptance_length']:.2f} | "
              f"{r['engine_acceptance_length']:.2f} | {ratio:.3f} | {r['engine_cost_ratio']:.3f} | "
              f"{r['engine_verify_overhead']:.3f} | {r['engine_speedup']:.2f}× ({lo:.2f}–{hi:.2f}) | "
              f"{r['engine_predicted_speedup']:.2f}× | {pred:.3f} | {r['engine_verdict']} | {predicted_verdict} | "
              f"{r['verdict']} |")
    n = len(rows)
    print(f"\nτ within 10 %: {tau_ok}/{n}; predicted speed-up within ±10 % of measured: {pred_ok}/{n}; "
          f"predicted verdict = llama.cpp's: {agree}/{n}; draftsmith loop's verdict = llama.cpp's: {loop_agree}/{n}")
    sizes = sorted({r.get("batch_size", 1) for r in measured})
    if len(sizes) > 1:
        batch_table(measured, sizes)


def batch_table(rows: list[dict], sizes: list[int]) -> None:
    """Per drafter and category, the best speed-up over k at each batch size: llama.cpp's, then draftsmith's."""
    print("\n| drafter | category | " + " | ".join(f"B={b} llama.cpp | B={b} draftsmith" for b in sizes) + " |")
    print("|---|---|" + "---|---|" * len(sizes))
    keys = dict.fromkeys((r["drafter"], r["category"]) for r in rows)
    lossless = all(r["engine_lossless"] for r in rows)
    for drafter, category in keys:
        cells = []
        for b in sizes:
            group = [r for r in rows if (r["drafter"], r["category"], r.get("batch_size", 1)) == (drafter, category, b)]
            engine = max(group, key=lambda r: r["engine_speedup"])
            ours = max(group, key=lambda r: r["speedup"])
            lo, hi = engine["engine_speedup_ci"] or (float("nan"), float("nan"))
            cells += [f"{engine['engine_speedup']:.2f}× k={engine['k']} ({lo:.2f}–{hi:.2f})",
                      f"{ours['speedup']:.2f}× k={ours['k']}"]
        print(f"| {drafter} | {category} | " + " | ".join(cells) + " |")
    print(f"\nevery llama.cpp row lossless (greedy output = its plain output at the same batch size): {lossless}")


if __name__ == "__main__":
    main()
