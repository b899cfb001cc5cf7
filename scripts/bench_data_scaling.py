"""How much traffic does a drafter need? One recipe trained on 1/n of the records for each n, scored on one
held-out set (figures in docs/benchmarks/data-scaling.md).

    python scripts/bench_data_scaling.py --data runs/prepared/synth5-answers/regenerated.jsonl --shares 1,2,4,8 \
        --steps 1000 --out runs/scaling --overrides experiment=smollm2_eagle regenerate.enabled=false
    python scripts/bench_data_scaling.py --data tiny.jsonl --steps 3 --heldout 6 --overrides experiment=smoke

The held-out records are chosen once from the whole file (`--heldout` of them, in turn from each category's last
records, as `trainer.heldout=per_category` does) and appended to every share's file, which its run holds out with
`trainer.heldout=last`: every share chooses its checkpoint on, and is scored on, the same records. A share of 1/n
keeps every n-th of the other records in file order, so a file grouped by category stays balanced. Every run is the
real recipe (`train.__main__.train`). With `--steps-per-share fixed` each share trains `--steps`: fewer records,
more passes over them (a team with less traffic and the same compute). With `scaled` share 1/n trains steps/n: the
same passes over its records as the whole file gets (compute grows with the traffic).

The best checkpoint's held-out greedy τ (replayed at the recipe's depth, train/heldout.py) is fitted against log2(records): the
slope is what each doubling of the records buys. Extending the line to `--goal` is an extrapolation and is printed as
one; with `scaled`, so are the steps those records would train and their hours at the largest run's median step time
(`step_s` in its metrics.jsonl), the training steps alone. Runs live in `<out>/<records>records-<steps>steps`,
outputs in `<out>/scaling-<steps-per-share>.{md,json,png}`; finished runs are not trained again, so an interrupted
sweep starts again at the run it stopped in.

`--more` doubles the file with new records (as many of each category as it trains on), each woven in after one of its
category: the doubled file's share 1/2n is the file's share 1/n record for record, so a sweep with `--more` and twice
the `--steps` trains only the doubled file and reads every other point from the runs already in `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hydra import compose, initialize_config_dir

from eval.engines.engine import stop_on_sigterm
from train.__main__ import train
from train.prepare import held_out_indices

CONF = str(Path(__file__).resolve().parents[1] / "conf")


@dataclass
class Point:
    share: int               # the run trained on every share-th record
    records: int             # training records (the held-out ones not counted)
    steps: int               # the steps it trained
    step: int                # the best checkpoint's step
    top1: float
    tau: float               # held-out greedy τ of the best checkpoint
    tau_by_category: dict
    step_s: float | None = None  # the median training step's seconds (None: a run from before they were logged)


@dataclass
class Fit:
    per_doubling: float      # τ gained by each doubling of the records
    intercept: float         # τ at one record, on the fitted line (log2(1) = 0)
    goal: float | None = None
    records_for_goal: float | None = None  # where the line reaches the goal; None where it never does
    per_doubling_by_category: dict = field(default_factory=dict)  # the same fit for each category's τ

    def tau_at(self, records: float) -> float:
        return self.intercept + self.per_doubling * math.log2(records)


def categories_of(lines: list[str], path: Path) -> list[str]:
    """The "category" of each JSONL line, a bad line named by file and line."""
    categories = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not valid JSON ({e})") from None
        if not isinstance(record, dict) or not isinstance(record.get("category"), str):
            raise ValueError(f"{path}:{number}: field 'category' missing or not a string; the shares are balanced "
                             f"by it (write the records with scripts/real_traffic.py or python -m train.prepare)")
        categories.append(record["category"])
    return categories


def held_out(categories: list[str], path: Path, heldout: int) -> set[int]:
    if len(categories) <= heldout:
        raise ValueError(f"{path}: {len(categories)} records, but --heldout {heldout} of them are held out")
    return set(held_out_indices(categories, heldout, "per_category"))


def split_shares(lines: list[str], path: Path, shares: list[int], heldout: int) -> dict[int, list[str]]:
    """Each share's file: every n-th of the records that are not held out, then the held-out ones (the same for all).
    `lines` are the file's non-empty JSONL lines, each a record with a "category"."""
    held = held_out(categories_of(lines, path), path, heldout)
    rest = [line for i, line in enumerate(lines) if i not in held]
    tail = [line for i, line in enumerate(lines) if i in held]
    out = {}
    for n in shares:
        if n < 1 or len(rest) // n < 1:
            raise ValueError(f"--shares: 1/{n} of {len(rest)} training records keeps none")
        out[n] = rest[::n] + tail
    return out


def doubled(lines: list[str], path: Path, more: list[str], more_path: Path, heldout: int) -> list[str]:
    """The file with `more` records woven in: each after a trained-on record of its category, so that the doubled
    file's share 1/2n is the file's share 1/n, record for record, and the held-out records stay the file's. `more`
    holds as many records of each category as the file trains on."""
    categories = categories_of(lines, path)
    held = held_out(categories, path, heldout)
    queues: dict[str, list[str]] = {}
    for line, category in zip(more, categories_of(more, more_path)):
        queues.setdefault(category, []).append(line)
    trained = Counter(c for i, c in enumerate(categories) if i not in held)
    if trained != Counter({c: len(q) for c, q in queues.items()}):
        have = {c: len(queues.get(c, [])) for c in sorted(trained.keys() | queues.keys())}
        raise ValueError(f"{more_path}: {have} records by category, but {path} trains on "
                         f"{dict(sorted(trained.items()))}: --more doubles the file, with as many records of each "
                         f"category as it trains on")
    feeds = {c: iter(q) for c, q in queues.items()}
    out, out_categories = [], []
    for i, (line, category) in enumerate(zip(lines, categories)):
        out.append(line)
        if i not in held:
            out.append(next(feeds[category]))
        out_categories += [category] * (1 if i in held else 2)
    tail = [line for i, line in enumerate(lines) if i in held]
    if [out[i] for i in sorted(held_out(out_categories, path, heldout))] != tail:
        raise ValueError(f"{path}: with --more woven in, --heldout {heldout} would hold out other records (a category "
                         f"with fewer records than its turn of them); lower --heldout")
    return out


def fit(points: list[Point], goal: float | None = None) -> Fit:
    """Least squares of τ on log2(records); where the slope is positive, the records at which the line meets the goal."""
    x = [math.log2(p.records) for p in points]
    slope, intercept = statistics.linear_regression(x, [p.tau for p in points])
    reach = None
    if goal is not None and slope > 0:
        reach = 2 ** ((goal - intercept) / slope)
    shared = set.intersection(*(set(p.tau_by_category) for p in points))
    by_category = {c: statistics.linear_regression(x, [p.tau_by_category[c] for p in points])[0] for c in sorted(shared)}
    return Fit(per_doubling=slope, intercept=intercept, goal=goal, records_for_goal=reach,
               per_doubling_by_category=by_category)


def goal_compute(points: list[Point], result: Fit) -> dict | None:
    """What the goal's records would cost in training steps with the steps growing with the records (`scaled`):
    the largest run's steps per record times the goal's records, at that run's median step time on this machine.
    None where the line does not meet the goal or that run logged no step times."""
    top = max(points, key=lambda p: p.records)
    if result.records_for_goal is None or top.step_s is None:
        return None
    steps = result.records_for_goal * top.steps / top.records
    return {"steps": steps, "hours": steps * top.step_s / 3600, "step_s": top.step_s, "records": top.records,
            "run_steps": top.steps}


def read_point(run_dir: Path, share: int, records: int, steps: int) -> Point:
    best = json.loads((run_dir / "best" / "best.json").read_text())
    if "tau_greedy" not in best:
        raise SystemExit(f"{run_dir / 'best' / 'best.json'} holds no held-out greedy τ (tau_greedy): "
                         f"a run of a draftsmith older than the held-out replay of every kind")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    scored = [r for r in rows if r.get("step") == best["step"] and "heldout_tau_greedy" in r]
    by_category = scored[-1].get("heldout_tau_greedy_by_category", {}) if scored else {}
    times = [r["step_s"] for r in rows if "step_s" in r]
    return Point(share=share, records=records, steps=steps, step=best["step"], top1=best["top1"], tau=best["tau_greedy"],
                 tau_by_category=by_category, step_s=statistics.median(times) if times else None)


def table(points: list[Point], result: Fit, compute: dict | None = None) -> str:
    points = sorted(points, key=lambda p: p.records)
    categories = sorted({c for p in points for c in p.tau_by_category})
    head = ["share", "records", "steps", "best step", "top-1", "τ (fit)", *categories]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        cells = [f"1/{p.share}", f"{p.records:,}", f"{p.steps:,}", f"{p.step:,}", f"{p.top1:.3f}",
                 f"{p.tau:.2f} ({result.tau_at(p.records):.2f})",
                 *(f"{p.tau_by_category[c]:.2f}" if c in p.tau_by_category else "–" for c in categories)]
        lines.append("| " + " | ".join(cells) + " |")
    per = result.per_doubling_by_category
    lines.append("| per doubling | | | | | " + " | ".join(
        [f"{result.per_doubling:+.3f}", *(f"{per[c]:+.3f}" if c in per else "–" for c in categories)]) + " |")
    lines.append("")
    lines.append(f"τ per doubling of the records: {result.per_doubling:+.3f} (least squares over {len(points)} shares)")
    gains = [f"{b.tau - a.tau:+.3f}" for a, b in zip(points, points[1:])]
    lines.append(f"each step up in the records, smallest first: {', '.join(gains)}")
    if result.goal is not None:
        if result.records_for_goal is None:
            lines.append(f"goal τ {result.goal}: the fitted line does not rise; more of this traffic does not reach it")
        else:
            lines.append(f"goal τ {result.goal}: the fitted line reaches it at about {result.records_for_goal:,.0f} records "
                         f"({result.records_for_goal / points[-1].records:,.1f}× the most measured); an "
                         f"extrapolation, which holds only if each doubling keeps buying the same")
    if compute is not None:
        lines.append(f"at the pace of the largest run ({compute['run_steps']:,} steps on {compute['records']:,} records, "
                     f"median {compute['step_s']:.3g} s a step on this machine), those records would train about "
                     f"{compute['steps']:,.0f} steps, {compute['hours']:,.1f} hours of training steps alone (not the "
                     f"answers, features or held-out evaluations): the same extrapolation")
    return "\n".join(lines) + "\n"


def plot(points: list[Point], result: Fit, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(points, key=lambda p: p.records)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = [p.records for p in points]
    for category in sorted({c for p in points for c in p.tau_by_category}):
        ax.plot(xs, [p.tau_by_category.get(category, math.nan) for p in points], marker=".", lw=0.8, alpha=0.6,
                label=category)
    ax.plot(xs, [p.tau for p in points], marker="o", color="black", lw=2, label="all (held out)")
    # The fitted line runs on to where it meets the goal, if that is within 16 doublings past the data (else 10
    # doublings on, the crossing named in a note): an extrapolation, drawn dashed and marked as one.
    reach = result.records_for_goal
    shown = reach is not None and reach <= max(xs) * 2 ** 16
    right = max(reach * 1.5, max(xs) * 4) if shown else max(xs) * 2 ** 10
    line_x = [min(xs), right]
    ax.plot(line_x, [result.tau_at(x) for x in line_x], ls="--", color="black", lw=1,
            label=f"fit: {result.per_doubling:+.3f} per doubling")
    if result.goal is not None:
        ax.axhline(result.goal, color="tab:red", lw=1, ls=":", label=f"goal τ {result.goal}")
    if shown:
        ax.plot([reach], [result.goal], marker="o", color="tab:red", ms=5)
        ax.annotate(f"about {reach:,.0f} records\n(extrapolated)", (reach, result.goal), textcoords="offset points",
                    xytext=(-8, -24), ha="right", fontsize=8, color="tab:red")
    elif reach is not None:
        ax.text(0.02, 0.9, f"the line meets τ {result.goal} at about {reach:,.0f} records, off the plot",
                transform=ax.transAxes, ha="left", va="top", fontsize=8, color="tab:red")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training records")
    ax.set_ylabel("held-out greedy τ")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="JSONL records with answers (a prepared regenerated.jsonl)")
    ap.add_argument("--shares", default="1,2,4,8", help="train on every n-th record, for each n")
    ap.add_argument("--steps", type=int, default=1000, help="training steps on the whole file")
    ap.add_argument("--steps-per-share", choices=("fixed", "scaled"), default="fixed",
                    help="fixed: every share trains --steps; scaled: share 1/n trains --steps/n")
    ap.add_argument("--more", default=None,
                    help="records that double --data (as many of each category as it trains on), woven in so that "
                         "the runs finished on --data alone are shares of the doubled file and are not trained again")
    ap.add_argument("--heldout", type=int, default=100, help="records held out from the whole file, shared by all")
    ap.add_argument("--goal", type=float, default=None, help="a τ to extrapolate the fitted line to")
    ap.add_argument("--out", default="runs/scaling")
    ap.add_argument("--overrides", nargs="*", default=[], help="extra Hydra overrides for every run")
    args = ap.parse_args()
    out, data = Path(args.out), Path(args.data)
    shares = sorted({int(n) for n in args.shares.split(",")})
    lines = [line for line in data.read_text().splitlines() if line.strip()]
    if args.more:
        more = Path(args.more)
        lines = doubled(lines, data, [line for line in more.read_text().splitlines() if line.strip()], more,
                        args.heldout)
    files = split_shares(lines, data, shares, args.heldout)
    (out / "data").mkdir(parents=True, exist_ok=True)
    points = []
    for n, share_lines in files.items():
        steps = args.steps if args.steps_per_share == "fixed" else max(1, round(args.steps / n))
        records = len(share_lines) - args.heldout
        # A run is named by what it trained on and for how long, so a sweep over more traffic finds the runs
        # an earlier sweep finished on the same records.
        path, run_dir = out / "data" / f"{records}records.jsonl", out / f"{records}records-{steps}steps"
        text = "\n".join(share_lines) + "\n"
        same = path.exists() and path.read_text() == text
        if (run_dir / "train_summary.json").exists():  # finished runs are not trained again
            if path.exists() and not same:
                raise SystemExit(f"{run_dir} trained on other records than this sweep's share 1/{n} ({path} "
                                 f"differs): give another --out")
        else:
            if not same:  # the same file keeps its prepared caches
                path.write_text(text)
            overrides = [*args.overrides, f"data.path={path}", "data.max_records=null", "trainer.heldout=last",
                         f"trainer.eval_examples={args.heldout}", f"trainer.max_steps={steps}",
                         f"out_dir={run_dir}", "evaluate.enabled=false", "progress=false"]
            with initialize_config_dir(config_dir=CONF, version_base="1.3"):
                train(compose(config_name="train", overrides=overrides))
        points.append(read_point(run_dir, n, records, steps))
        print(f"1/{n}: {records} records, {steps} steps, held-out τ {points[-1].tau:.3f} at step {points[-1].step}")
    if len(points) < 2:
        raise SystemExit("one share measured; a fit needs two or more (--shares)")
    result = fit(points, args.goal)
    # Only where the steps grow with the records is the line's cost a number of steps in proportion to them.
    compute = goal_compute(points, result) if args.steps_per_share == "scaled" else None
    text = table(points, result, compute)
    stem = out / f"scaling-{args.steps_per_share}"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(
        {"data": str(data), "more": args.more, "steps": args.steps, "steps_per_share": args.steps_per_share,
         "heldout": args.heldout, "overrides": args.overrides, "points": [asdict(p) for p in points],
         "fit": asdict(result), "goal_compute": compute}, indent=2) + "\n")
    plot(points, result, stem.with_suffix(".png"),
         f"{args.steps} steps on the whole file, {args.steps_per_share} per share")
    print(text + f"written: {stem}.md, .json, .png")


if __name__ == "__main__":
    stop_on_sigterm()
    main()
