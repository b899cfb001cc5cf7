"""`report.md` and the console summary: the tables a person reads, per category, with what was measured and the
verdict lines (eval/report.py)."""

from __future__ import annotations

from eval.evaluate import ALL, EvalPlan, base_drafter
from eval.engines.report import engine_alone_markdown, engine_device, engine_section, engine_verdict_lines
from eval.report_tables import (BATCH_COLUMNS, TRAFFIC_KEYS, TREE_COLUMNS, batch_sizes, fmt, fmt_interval, in_order,
                                pays_up_to, table, traffic_lines)


def markdown(report: dict) -> str:
    """report.md: settings, the summary table, the per-position acceptance and the verdicts."""
    if not report["results"]:
        return engine_alone_markdown(report)
    rows = in_order(report["results"])
    hw = report["hardware"]
    out = [
        "# draftsmith evaluation",
        "",
        f"- target: `{report['target']}`; baseline drafter: `{report['baseline']}`",
        *(f"- {line}" for line in traffic_lines(report["settings"])),
        f"- hardware: {hw['gpu'] or hw['cpu']}, {hw['torch_threads']} torch threads, torch {hw['torch']}",
        *([f"- {engine['name']} on: {engine_device(report)}, {engine.get('threads')} engine threads"]
          if (engine := report["settings"].get("engine") or {}).get("device") else []),
        "- settings: " + ", ".join(f"{k}={v}" for k, v in report["settings"].items() if k not in TRAFFIC_KEYS),
        "",
        "prop = guesses proposed per round (below k with a confidence stop); τ = 1 + guesses kept per round"
        " (the first new token comes from the prompt's forward, as in serving engines);"
        " c = one draft step / one plain decoding step; β = the rest of a full round (verification of k+1"
        " positions, rollback, bookkeeping) / one step − 1; pred × = the speed-up these costs predict for a whole"
        " generation, (p + N) / (p' + R·(1 + prop·c + β)) for N plain steps and R speculative rounds per generation"
        " and the prefills p (plain) and p' (speculative, the drafter's start included) in steps (at B > 1 a"
        " generation is charged its share, 1/B, of every step and round it took part in); speed-up × = speculative / plain tokens/s"
        " (pooled over repeats and prompts, run side by side); plain and spec tok/s are medians over repeats;"
        f" verdict: pays off at a speed-up of {report['settings'].get('pays_off_at', EvalPlan.pays_off_at):g}× or more,"
        " turn it off below, undecided where the 95 % interval holds 1 (the measurement cannot tell faster from"
        " slower: measure more prompts or repeats).",
        "",
        "## Summary",
        "",
        table(rows),
        *lossless_lines(rows),
        "",
        "## Throughput",
        "",
        table(rows, [("category", "category"), ("drafter", "drafter"), ("k", "k"), ("B", "batch_size"),
                     ("T", "temperature"),
                     ("prompts", "prompts"), ("rounds", "rounds"), ("plain tok/s", "ar_tokens_per_s"),
                     ("spec tok/s", "sd_tokens_per_s"), ("speed-up ×", "speedup"), ("95 % interval", "speedup_ci"),
                     ("× vs base", "speedup_vs_baseline"), ("95 % interval", "speedup_vs_baseline_ci"),
                     ("best k", "best_k")]),
        "",
        "## Which drafter is fastest",
        "",
        "Each drafter's speed over the fastest one's at the same k and temperature, on the same prompts, with"
        " a 95 % interval from resampling the prompts: \"slower\" when the interval lies below 1, \"tied\" when"
        " it holds 1 (this measurement cannot order the two; more prompts can).",
        "",
        *_fastest_lines(rows),
        "",
        "## Acceptance by draft position",
        "",
        "P(guess i kept | guesses before it kept); histogram = rounds that kept 0, 1, …, k guesses.",
        "",
        "| category | drafter | k | T | by position | histogram | τ if i.i.d. |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pos = " ".join(fmt(p) for p in r["position_acceptance"])
        out.append(f"| {r['category']} | {r['drafter']} | {r['k']} | {fmt(r['temperature'])} | {pos} | "
                   f"{r['accept_hist']} | {fmt(r['acceptance_length_iid'])} |")
    out += length_section(rows)
    out += ["", "## Verdict per category (best k)", ""]
    for r in rows:
        if r["k"] == r["best_k"]:
            engine = (f"; in {r['engine']}: {fmt(r.get('engine_speedup') or r.get('engine_predicted_speedup'))}× → "
                      f"{r['engine_verdict']}") if r.get("engine_verdict") else ""
            batch = f", batch {r['batch_size']}" if len(batch_sizes(rows)) > 1 else ""
            shape = (f"; fastest shape: {r['best_shape']} ({fmt(r['best_shape_speedup'])}×"
                     + (f": {r['best_shape_why']})" if r.get("best_shape_why") else ")")
                     if r.get("best_shape") and not r.get("tree") and any(x.get("tree") for x in rows) else "")
            out.append(f"- **{r['category']}**, {r['drafter']}, T={fmt(r['temperature'])}{batch}: best k={r['k']}, "
                       f"speed-up {fmt(r['speedup'])}× → {r['verdict']}{engine}{shape}")
    out += tree_section(rows)
    if len(batch_sizes(rows)) > 1:
        out += ["", "## Speed-up against batch size", "",
                "Each drafter at its best k per batch size: a category's prompts decoded B at a time as a serving"
                " engine under constant load decodes them (a prompt joins as a row finishes; every slot stays"
                " busy), each prompt charged its share of every step and round. Speculation pays while the curve"
                " stays above the verdict's line; c and β, measured at each batch size in the same run, are in the"
                " table.", "",
                *pays_up_to(rows), "", *(f"![{p}]({p})" for p in report.get("plots", [])), "",
                table([r for r in rows if r["k"] == r["best_k"]], BATCH_COLUMNS)]
    out += engine_section(rows + report.get("engine_results", []), report.get("plots", []))
    return "\n".join(out) + "\n"


def lossless_lines(rows: list[dict]) -> list[str]:
    """Under the summary, each greedy row whose output is not plain decoding's: on how many generations, and how near
    a tie of the target's logits each parts at (a tie the target's own rounding can break either way, or not)."""
    notes = [f"- {r['category']}, {r['drafter']}, k={r['k']}, B={r.get('batch_size', 1)}: {r['lossless_note']}"
             for r in rows if r.get("lossless_note")]
    if not notes:
        return []
    return ["", "Not lossless here: greedy speculative decoding must write plain decoding's tokens. A gap near 0 is a "
            "near tie that verifying several positions at once rounds otherwise than one position (bfloat16 far more "
            "often than float32); a large one is a drafter's token the target never chose, a bug.", "", *notes]


def length_section(rows: list[dict]) -> list[str]:
    """report.md's τ by prompt length: each drafter at its best k, its prompts split by length in tokens
    (eval/metrics.py LENGTH_EDGES), τ and the prompts in each bucket; omitted where every prompt falls in one."""
    shown = [r for r in rows if r.get("acceptance_by_length") and r["k"] == r.get("best_k") and not r.get("tree")]
    buckets = list(dict.fromkeys(b for r in shown if r["category"] == ALL for b in r["acceptance_by_length"]))
    if len(buckets) < 2:
        return []
    return ["", "## Acceptance by prompt length", "",
            "τ of each drafter at its best k over the prompts of each length (tokens, the chat template"
            " applied), the prompts in brackets: a head trained on windows shorter than the prompts it serves"
            " (`trainer.max_length`) keeps less of its acceptance as prompts grow.", "",
            "| category | drafter | k | T | " + " | ".join(buckets) + " |",
            "|---|---|---|---|" + "---|" * len(buckets),
            *(f"| {r['category']} | {r['drafter']} | {r['k']} | {fmt(r['temperature'])} | "
              + " | ".join(_bucket_cell(r["acceptance_by_length"].get(b)) for b in buckets) + " |" for r in shown)]


def _bucket_cell(bucket: dict | None) -> str:
    return "" if bucket is None else f"{fmt(bucket['tau'])} ({bucket['prompts']})"


def tree_section(rows: list[dict]) -> list[str]:
    """report.md's trees: each drafter's dynamic trees (`trees=[...]`) beside its chains, and the shape that was
    fastest here."""
    if not any(r.get("tree") for r in rows):
        return []
    bases = {base_drafter(r) for r in rows if r.get("tree")}
    shown = [r for r in rows if r.get("batch_size", 1) == 1 and (r.get("tree") or r["drafter"] in bases)]
    return ["", "## Trees and chains", "",
            "EAGLE-2 dynamic trees (`<drafter>@d<depth>t<top-k>n<nodes>`: depth draft steps, the top-k most likely"
            " nodes expanded at each, the `nodes` most likely verified in one target forward with a tree mask) beside"
            " the same drafter's chains. nodes = the nodes verified per round; τ = 1 + the kept path's length; τ /"
            " chain = over the chain of the tree's depth; c = drafting time per node over one plain step, β = the"
            " rest of the round (verifying nodes + 1 positions) minus 1, so pred × = τ / (1 + nodes·c + β) as for"
            " chains; fastest shape = the drafter's fastest chain or tree in this run. A tree keeps more per round"
            " and costs a wider verification: it pays where verifying more positions costs little (a GPU at small"
            " batch), not where each position costs nearly a step (a CPU).", "",
            table(shown, TREE_COLUMNS)]


def _fastest_lines(rows: list[dict]) -> list[str]:
    """One line per (category, k, temperature): the fastest drafter, then every other one against it."""
    lines = []
    groups: dict[tuple, list[dict]] = {}
    several = len(batch_sizes(rows)) > 1
    for r in rows:
        groups.setdefault((r["category"], r["k"], r["temperature"], r.get("batch_size", 1)), []).append(r)
    for (category, k, temperature, batch), group in groups.items():
        others = sorted((r for r in group if r["vs_fastest"] != "fastest"), key=lambda r: -r["speedup_vs_fastest"])
        against = "; ".join(f"{r['drafter']} {r['speedup_vs_fastest']:.2f}× ({fmt_interval(r['speedup_vs_fastest_ci'])}) "
                            f"{r['vs_fastest']}" for r in others)
        lines.append(f"- {category}, k={k}, T={fmt(temperature)}{f', batch {batch}' if several else ''}: "
                     f"fastest {group[0]['fastest']}"
                     + (f"; against it: {against}" if against else ""))
    return lines


def console_summary(report: dict) -> str:
    """A short fixed-width summary for the terminal."""
    if not report["results"]:  # llama.cpp alone
        rows = [r for r in report.get("engine_results", []) if r.get("engine_speedup") is not None]
        name = rows[0]["engine"] if rows else "the engine"
        head = f"{'category':<14}{'drafter':<18}{'k':>3}{'B':>4}{'tau eng':>9}{'x eng':>8}{'pred':>7}{'ceil':>7}  verdict"
        return "\n".join([*traffic_lines(report["settings"]), "", f"In {name} alone:", head, "-" * len(head), *(
            f"{r['category'][:13]:<14}{r['drafter'][:17]:<18}{r['k']:>3}{r.get('batch_size', 1):>4}"
            f"{fmt(r.get('engine_acceptance_length')):>9}{fmt(r['engine_speedup']):>8}"
            f"{fmt(r.get('engine_predicted_speedup')):>7}{fmt(r.get('engine_ceiling')):>7}  {r['engine_verdict']}"
            for r in rows), "", f"Each drafter at its best k in {name}:", *engine_verdict_lines(rows)])
    rows = in_order(report["results"])
    traffic = traffic_lines(report["settings"])
    head = (f"{'category':<14}{'drafter':<18}{'k':>3}{'B':>4}{'T':>5}{'tau':>7}{'zero':>7}{'x':>7}{'pred':>7}"
            f"{'vs base':>9}  verdict")
    lines = [*traffic, *([""] if traffic else []), head, "-" * len(head)]
    for r in rows:
        pred = r["predicted_speedup"]
        lines.append(
            f"{r['category'][:13]:<14}{r['drafter'][:17]:<18}{r['k']:>3}{r.get('batch_size', 1):>4}{r['temperature']:>5.1f}"
            f"{r['acceptance_length']:>7.2f}{r['zero_accept_rate']:>7.2f}{r['speedup']:>7.2f}"
            f"{(pred if pred is not None else float('nan')):>7.2f}{r['speedup_vs_baseline']:>9.2f}  {r['verdict']}"
        )
    lines += ["", "Which drafter is fastest (speed over the fastest's, 95 % interval over prompts):",
              *_fastest_lines(rows)]
    split = [r for r in rows if len(r.get("acceptance_by_length") or {}) > 1 and r["k"] == r.get("best_k")
             and not r.get("tree")]
    if split:
        lines += ["", "τ by prompt length in tokens (each drafter at its best k; prompts in brackets):",
                  *(f"- {r['category']}, {r['drafter']}, k={r['k']}, T={fmt(r['temperature'])}: "
                    + ", ".join(f"{b} {_bucket_cell(v)}" for b, v in r["acceptance_by_length"].items()) for r in split)]
    if len(batch_sizes(rows)) > 1:
        lines += ["", "Up to which batch size speculation pays (each drafter at its best k per batch size):",
                  *pays_up_to(rows)]
    engine = [r for r in rows + report.get("engine_results", []) if r.get("engine_verdict")]
    if engine:
        measured = any(r.get("engine_speedup") is not None for r in engine)
        lines += ["", f"In {engine[0]['engine']}:" if measured else f"For {engine[0]['engine']}:",
                  f"{'category':<14}{'drafter':<18}{'k':>3}{'B':>4}{'tau':>7}{'tau eng':>9}{'x eng':>8}{'pred':>7}"
                  f"{'ceil':>7}  verdict"]
        for r in engine:
            tau_e, x_e = r.get("engine_acceptance_length"), r.get("engine_speedup")
            lines.append(f"{r['category'][:13]:<14}{r['drafter'][:17]:<18}{r['k']:>3}{r.get('batch_size', 1):>4}"
                         f"{fmt(r.get('acceptance_length')):>7}{fmt(tau_e):>9}{fmt(x_e):>8}"
                         f"{fmt(r['engine_predicted_speedup']):>7}{fmt(r.get('engine_ceiling')):>7}"
                         f"  {r['engine_verdict']}")
    return "\n".join(lines)
