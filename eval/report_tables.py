"""The report's tables: how each figure is printed, and the columns of each table (eval/report.py)."""

from __future__ import annotations


def fmt(value, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    if isinstance(value, list):
        return " ".join(fmt(v, digits) for v in value)
    return str(value)


SUMMARY_COLUMNS = [
    ("category", "category"),
    ("drafter", "drafter"),
    ("k", "k"),
    ("B", "batch_size"),
    ("T", "temperature"),
    ("prop", "mean_proposed"),
    ("τ", "acceptance_length"),
    ("mean acc", "mean_accepted"),
    ("p10", "p10_accepted"),
    ("zero-acc", "zero_accept_rate"),
    ("full-hit", "full_hit_rate"),
    ("c", "cost_ratio"),
    ("draft/round", "draft_cost_per_round"),  # a round's drafting in target steps (a parallel drafter: one forward)
    ("β", "verify_overhead"),
    ("pred ×", "predicted_speedup"),
    ("speed-up ×", "speedup"),
    ("τ vs base", "tau_vs_baseline"),
    ("95 % interval", "tau_vs_baseline_ci"),  # over prompts, paired as the speed-ups are (eval/compare.py tau_counts)
    ("× vs base", "speedup_vs_baseline"),
    ("lossless", "lossless"),
    ("verdict", "verdict"),
]


def fmt_interval(value) -> str:
    """A 95 % interval [low, high] as "low–high"; "–" when there is none (too few prompts)."""
    return "–" if value is None else f"{value[0]:.2f}–{value[1]:.2f}"


def table(rows: list[dict], columns=SUMMARY_COLUMNS) -> str:
    """A Markdown table of the given rows."""
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(fmt_interval(r.get(key)) if key.endswith("_ci") else fmt(r.get(key))
                                       for _, key in columns) + " |")
    return "\n".join(lines)


def in_order(rows: list[dict]) -> list[dict]:
    cats = list(dict.fromkeys(r["category"] for r in rows))
    rows = [{"batch_size": 1, **r} for r in rows]  # rows from before batch sizes were measured: batch 1
    return sorted(rows, key=lambda r: (cats.index(r["category"]), r["batch_size"], r["temperature"],
                                       r["drafter"], r["k"]))


TREE_COLUMNS = [
    ("category", "category"), ("drafter", "drafter"), ("depth k", "k"), ("T", "temperature"),
    ("nodes", "mean_proposed"), ("τ", "acceptance_length"), ("τ / chain", "tau_vs_chain"), ("c", "cost_ratio"),
    ("β", "verify_overhead"), ("pred ×", "predicted_speedup"), ("speed-up ×", "speedup"),
    ("95 % interval", "speedup_ci"), ("fastest shape", "best_shape"),
]


BATCH_COLUMNS = [
    ("category", "category"), ("drafter", "drafter"), ("B", "batch_size"), ("best k", "k"), ("T", "temperature"),
    ("τ", "acceptance_length"), ("c", "cost_ratio"), ("β", "verify_overhead"), ("pred ×", "predicted_speedup"),
    ("speed-up ×", "speedup"),
]


ENGINE_COLUMNS = [
    ("category", "category"), ("drafter", "drafter"), ("k", "k"), ("τ", "acceptance_length"),
    ("τ engine", "engine_acceptance_length"), ("τ engine vs base", "engine_tau_vs_baseline"),
    ("95 % interval", "engine_tau_vs_baseline_ci"), ("prop engine", "engine_mean_proposed"),
    ("plain tok/s", "engine_ar_tokens_per_s"),
    ("spec tok/s", "engine_sd_tokens_per_s"), ("c", "engine_cost_ratio"), ("β", "engine_verify_overhead"),
    ("pred ×", "engine_predicted_speedup"), ("speed-up ×", "engine_speedup"), ("95 % interval", "engine_speedup_ci"),
    ("ceiling ×", "engine_ceiling"), ("τ ceiling ×", "engine_tau_ceiling"), ("τ to pay", "engine_tau_to_pay"),
    ("lossless", "engine_lossless"), ("verdict here", "verdict"), ("verdict in the engine", "engine_verdict"),
]


PREDICTED_COLUMNS = [
    ("category", "category"), ("drafter", "drafter"), ("k", "k"), ("τ", "acceptance_length"), ("prop", "mean_proposed"),
    ("c", "engine_cost_ratio"), ("β", "engine_verify_overhead"), ("pred ×", "engine_predicted_speedup"),
    ("ceiling ×", "engine_ceiling"), ("τ ceiling ×", "engine_tau_ceiling"), ("τ to pay", "engine_tau_to_pay"),
    ("verdict here", "verdict"), ("verdict predicted", "engine_verdict"), ("best shape there", "engine_best_shape"),
]


DEPLOYMENT_COLUMNS = [
    ("category", "category"), ("drafter", "drafter"), ("k", "k"), ("B", "batch_size"), ("τ", "acceptance_length"),
    ("τ engine", "engine_acceptance_length"), ("τ engine vs base", "engine_tau_vs_baseline"),
    ("95 % interval", "engine_tau_vs_baseline_ci"), ("by position", "engine_acceptance_by_position"),
    ("prop engine", "engine_mean_proposed"), ("plain tok/s", "engine_ar_tokens_per_s"), ("spec tok/s", "engine_sd_tokens_per_s"),
    ("speed-up ×", "engine_speedup"), ("95 % interval", "engine_speedup_ci"),
    ("× vs base", "engine_speedup_vs_baseline"), ("95 % interval", "engine_speedup_vs_baseline_ci"),
    ("throughput ×", "engine_throughput_ratio"),
    ("c", "engine_cost_ratio"), ("β", "engine_verify_overhead"), ("pred ×", "engine_predicted_speedup"),
    ("ceiling ×", "engine_ceiling"), ("τ ceiling ×", "engine_tau_ceiling"), ("τ to pay", "engine_tau_to_pay"),
    ("lossless", "engine_lossless"), ("verdict here", "verdict"), ("verdict in the engine", "engine_verdict"),
]


def fmt_latency(pair) -> str:
    return "–" if not pair else f"{pair[0]:.1f} / {pair[1]:.1f}"


TRAFFIC_KEYS = ("data", "trained_on")


def records_described(d: dict) -> str:
    """'`F`: N records', or the slice of F training held out."""
    if d.get("held_out"):
        if d.get("held_out_by", "last") == "last":
            return f"the last {d['records']} records of `{d['path']}` (held out of training)"
        return f"{d['records']} records of `{d['path']}`, as many of each category (held out of training)"
    return f"`{d['path']}`: {d['records']} records"


def traffic_lines(settings: dict) -> list[str]:
    """What was measured (file, records, prompts per category) and, after training, what was trained on."""
    lines = []
    data = settings.get("data")
    if isinstance(data, dict):
        prompts = ", ".join(f"{c} {n}" for c, n in data.get("prompts", {}).items())
        lines.append(f"measured: {records_described(data)}" + (f"; prompts per category: {prompts}" if prompts else "")
                     + (f"; {data['skipped_too_long']} prompts longer than the context allows skipped"
                        if data.get("skipped_too_long") else ""))
        lines += [f"not measured: {category}, all {n} of its prompts read were longer than the context allows"
                  for category, n in data.get("emptied", {}).items()]
    elif data:
        lines.append(f"measured: `{data}`")
    trained = settings.get("trained_on")
    if trained:
        lines.append(f"trained on: the first {trained['records']} records of `{trained['path']}` "
                     f"(its last {trained['checkpoint_chosen_on']} chose the checkpoint)")
    return lines


def batch_sizes(rows: list[dict]) -> list[int]:
    return sorted({r.get("batch_size", 1) for r in rows})


def best_per_batch(rows: list[dict]) -> dict[tuple, dict[int, dict]]:
    """(category, temperature, drafter) -> batch size -> the row of the best k there."""
    best: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        if r["k"] == r["best_k"]:
            best.setdefault((r["category"], r["temperature"], r["drafter"]), {})[r.get("batch_size", 1)] = r
    return best


def pays_up_to(rows: list[dict]) -> list[str]:
    """Per category, temperature and drafter: the speed-up at each batch size (best k) and the largest batch
    size up to which every measured one pays."""
    lines = []
    for (category, temperature, drafter), by_batch in best_per_batch(rows).items():
        curve = ", ".join(f"B={b}: {by_batch[b]['speedup']:.2f}× (k={by_batch[b]['k']})" for b in sorted(by_batch))
        paying = 0
        for b in sorted(by_batch):
            if by_batch[b]["verdict"] != "pays off":
                break
            paying = b
        where = f"pays up to batch {paying}" if paying else "does not pay at any batch size measured"
        lines.append(f"- {category}, T={fmt(temperature)}, {drafter}: {where} ({curve})")
    return lines
