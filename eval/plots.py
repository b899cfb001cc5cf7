"""The report's plots, PNGs beside report.md: accepted drafts per round per category, speed-up against batch
size, and the engine's speed-up against k (eval/report.py)."""

from __future__ import annotations

from pathlib import Path

from eval.evaluate import EvalPlan
from eval.report_tables import batch_sizes, best_per_batch


def pyplot():
    """matplotlib's pyplot drawing to files (Agg), imported only when a report draws: it takes a second to import and
    a report without plots never needs it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_histograms(report: dict, out_dir: Path) -> list[Path]:
    """One PNG per category: share of rounds that kept 0..k guesses, a panel per (temperature, k)."""
    plt = pyplot()
    rows = report["results"]
    if not rows:  # llama.cpp alone: its counters give no per-round histogram
        return []
    smallest = min(batch_sizes(rows))  # acceptance is the batch's business only through timing: one batch size
    rows = [r for r in rows if r.get("batch_size", 1) == smallest]
    paths = []
    for category in dict.fromkeys(r["category"] for r in rows):
        cat_rows = [r for r in rows if r["category"] == category]
        panels = sorted({(r["temperature"], r["k"]) for r in cat_rows})
        drafters = list(dict.fromkeys(r["drafter"] for r in cat_rows))
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
        for ax, (temperature, k) in zip(axes[0], panels):
            width = 0.8 / len(drafters)
            for j, name in enumerate(drafters):
                r = next((r for r in cat_rows if r["drafter"] == name and r["k"] == k
                          and r["temperature"] == temperature), None)
                if r is None:  # a tree is measured at its own depth only
                    continue
                share = [h / r["rounds"] for h in r["accept_hist"]]
                ax.bar([a + (j - (len(drafters) - 1) / 2) * width for a in range(k + 1)], share, width,
                       label=f"{name} (τ={r['acceptance_length']:.2f})")
            ax.set_title(f"{category}: k={k}, T={temperature:g}")
            ax.set_xlabel("guesses kept per round")
            ax.set_ylabel("share of rounds")
            ax.set_xticks(range(k + 1))
            ax.legend(fontsize=7)
        paths.append(_save(fig, out_dir / f"accept_hist_{_safe(category)}.png"))
    return paths


def plot_batch_curves(report: dict, out_dir: Path) -> list[Path]:
    """With several batch sizes, one PNG per category: speed-up over plain decoding (each drafter at its best
    k per batch size, with its 95 % interval) against batch size: the cliff, drawn."""
    rows = report["results"]
    if len(batch_sizes(rows)) < 2:
        return []
    plt = pyplot()
    paths = []
    best = best_per_batch(rows)
    pays_off_at = report["settings"].get("pays_off_at", EvalPlan.pays_off_at)
    for category in dict.fromkeys(r["category"] for r in rows):
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for (cat, temperature, drafter), by_batch in best.items():
            if cat != category:
                continue
            xs = sorted(by_batch)
            ys = [by_batch[b]["speedup"] for b in xs]
            line, = ax.plot(xs, ys, marker="o", label=f"{drafter}, T={temperature:g}")
            cis = [by_batch[b].get("speedup_ci") for b in xs]
            if all(cis):
                ax.fill_between(xs, [c[0] for c in cis], [c[1] for c in cis], color=line.get_color(), alpha=0.15)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(pays_off_at, color="grey", lw=0.8, ls="--", label=f"pays off at {pays_off_at:g}×")
        ax.set_xscale("log", base=2)
        ax.set_xticks(batch_sizes(rows), [str(b) for b in batch_sizes(rows)])
        ax.set_xlabel("batch size")
        ax.set_ylabel("speed-up over plain decoding (best k)")
        ax.set_title(f"{category}: speed-up against batch size")
        ax.legend(fontsize=7)
        paths.append(_save(fig, out_dir / f"batch_curve_{_safe(category)}.png"))
    return paths


def plot_engine_k(report: dict, out_dir: Path) -> list[Path]:
    """With several k measured in an engine, one PNG: a panel per category, each drafter's speed-up in the engine
    against k (95 % intervals), beside the engine's ceiling (k+1)/(1+β), what a perfect drafter costing nothing
    could reach, and the line of no gain: whether the drafter or the hardware limits, and at which k."""
    rows = [r for r in report["results"] + report.get("engine_results", [])
            if r.get("engine_speedup") is not None and r.get("batch_size", 1) == 1 and not r.get("tree")]
    if len({r["k"] for r in rows}) < 2:
        return []
    plt = pyplot()
    categories = list(dict.fromkeys(r["category"] for r in rows))
    fig, axes = plt.subplots(1, len(categories), figsize=(3.6 * len(categories), 3.4), squeeze=False, sharey=True)
    for ax, category in zip(axes[0], categories):
        here = [r for r in rows if r["category"] == category]
        for drafter in dict.fromkeys(r["drafter"] for r in here):
            mine = sorted((r for r in here if r["drafter"] == drafter), key=lambda r: r["k"])
            ks, x = [r["k"] for r in mine], [r["engine_speedup"] for r in mine]
            ci = [r.get("engine_speedup_ci") or (v, v) for r, v in zip(mine, x)]
            ax.errorbar(ks, x, yerr=[[v - lo for v, (lo, _) in zip(x, ci)], [hi - v for v, (_, hi) in zip(x, ci)]],
                        marker="o", capsize=2, label=drafter)
        ceiling = {}
        for r in here:  # the engine's ceiling at k, from the first drafter calibrated there
            if r.get("engine_ceiling") is not None:
                ceiling.setdefault(r["k"], r["engine_ceiling"])
        if ceiling:
            ks = sorted(ceiling)
            ax.plot(ks, [ceiling[k] for k in ks], "k--", linewidth=1, label="ceiling (k+1)/(1+β)")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(category)
        ax.set_xlabel("k")
        ax.set_xticks(sorted({r["k"] for r in here}))
    axes[0][0].set_ylabel(f"speed-up in {rows[0]['engine']}")
    axes[0][0].legend(fontsize=7)
    return [_save(fig, out_dir / "engine_k_speedup.png")]


def _save(fig, path: Path) -> Path:
    """A finished figure written to `path` and closed."""
    plt = pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)
