"""The evaluation report: `report.json` (schema "draftsmith.eval/1", read by other tools), `report.md`
(tables a person reads), and one accepted-count histogram PNG per category.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

from eval.engine_formats import GGUF_OUTTYPE
from eval.evaluate import EvalPlan, base_drafter
from eval.llama_cpp import NGRAM_TYPES

SCHEMA = "draftsmith.eval/1"


def hardware() -> dict:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
    }
    return info


def build_report(rows: list[dict], *, target: str, baseline: str, settings: dict,
                 engine_rows: list[dict] | None = None) -> dict:
    """The report.json document: `results`, draftsmith's rows (with the engine's figures where measured), and
    `engine_results`, the rows of drafters only the engine runs (llama.cpp's n-gram modes)."""
    return {
        "schema": SCHEMA,
        "target": target,
        "baseline": baseline,
        "hardware": hardware(),
        "settings": settings,
        "results": rows,
        "engine_results": engine_rows or [],
    }


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    if isinstance(value, list):
        return " ".join(_fmt(v, digits) for v in value)
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
    ("β", "verify_overhead"),
    ("pred ×", "predicted_speedup"),
    ("speed-up ×", "speedup"),
    ("τ vs base", "tau_vs_baseline"),
    ("× vs base", "speedup_vs_baseline"),
    ("lossless", "lossless"),
    ("verdict", "verdict"),
]


def _interval(value) -> str:
    """A 95 % interval [low, high] as "low–high"; "–" when there is none (too few prompts)."""
    return "–" if value is None else f"{value[0]:.2f}–{value[1]:.2f}"


def table(rows: list[dict], columns=SUMMARY_COLUMNS) -> str:
    """A Markdown table of the given rows."""
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_interval(r.get(key)) if key.endswith("_ci") else _fmt(r.get(key))
                                       for _, key in columns) + " |")
    return "\n".join(lines)


def _sorted(rows: list[dict]) -> list[dict]:
    cats = list(dict.fromkeys(r["category"] for r in rows))
    rows = [{"batch_size": 1, **r} for r in rows]  # rows from before batch sizes were measured: batch 1
    return sorted(rows, key=lambda r: (cats.index(r["category"]), r["batch_size"], r["temperature"],
                                       r["drafter"], r["k"]))


def markdown(report: dict) -> str:
    """report.md: settings, the summary table, the per-position acceptance and the verdicts."""
    if not report["results"]:
        return engine_alone_markdown(report)
    rows = _sorted(report["results"])
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
        pos = " ".join(_fmt(p) for p in r["position_acceptance"])
        out.append(f"| {r['category']} | {r['drafter']} | {r['k']} | {_fmt(r['temperature'])} | {pos} | "
                   f"{r['accept_hist']} | {_fmt(r['acceptance_length_iid'])} |")
    out += ["", "## Verdict per category (best k)", ""]
    for r in rows:
        if r["k"] == r["best_k"]:
            engine = (f"; in {r['engine']}: {_fmt(r.get('engine_speedup') or r.get('engine_predicted_speedup'))}× → "
                      f"{r['engine_verdict']}") if r.get("engine_verdict") else ""
            batch = f", batch {r['batch_size']}" if len(batch_sizes(rows)) > 1 else ""
            shape = (f"; fastest shape: {r['best_shape']} ({_fmt(r['best_shape_speedup'])}×"
                     + (f": {r['best_shape_why']})" if r.get("best_shape_why") else ")")
                     if r.get("best_shape") and not r.get("tree") and any(x.get("tree") for x in rows) else "")
            out.append(f"- **{r['category']}**, {r['drafter']}, T={_fmt(r['temperature'])}{batch}: best k={r['k']}, "
                       f"speed-up {_fmt(r['speedup'])}× → {r['verdict']}{engine}{shape}")
    out += tree_section(rows)
    if len(batch_sizes(rows)) > 1:
        out += ["", "## Speed-up against batch size", "",
                "Each drafter at its best k per batch size: a category's prompts decoded B at a time as a serving"
                " engine under constant load decodes them (a prompt joins as a row finishes; every slot stays"
                " busy), each prompt charged its share of every step and round. Speculation pays while the curve"
                " stays above the verdict's line; c and β, measured at each batch size in the same run, are in the"
                " table.", "",
                *_pays_up_to(rows), "", *(f"![{p}]({p})" for p in report.get("plots", [])), "",
                table([r for r in rows if r["k"] == r["best_k"]], BATCH_COLUMNS)]
    out += engine_section(rows + report.get("engine_results", []), report.get("plots", []))
    return "\n".join(out) + "\n"


TREE_COLUMNS = [
    ("category", "category"), ("drafter", "drafter"), ("depth k", "k"), ("T", "temperature"),
    ("nodes", "mean_proposed"), ("τ", "acceptance_length"), ("τ / chain", "tau_vs_chain"), ("c", "cost_ratio"),
    ("β", "verify_overhead"), ("pred ×", "predicted_speedup"), ("speed-up ×", "speedup"),
    ("95 % interval", "speedup_ci"), ("fastest shape", "best_shape"),
]


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


BATCH_COLUMNS = [
    ("category", "category"), ("drafter", "drafter"), ("B", "batch_size"), ("best k", "k"), ("T", "temperature"),
    ("τ", "acceptance_length"), ("c", "cost_ratio"), ("β", "verify_overhead"), ("pred ×", "predicted_speedup"),
    ("speed-up ×", "speedup"),
]
ENGINE_COLUMNS = [
    ("category", "category"), ("drafter", "drafter"), ("k", "k"), ("τ", "acceptance_length"),
    ("τ engine", "engine_acceptance_length"), ("prop engine", "engine_mean_proposed"),
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
    ("τ engine", "engine_acceptance_length"), ("by position", "engine_acceptance_by_position"),
    ("plain tok/s", "engine_ar_tokens_per_s"), ("spec tok/s", "engine_sd_tokens_per_s"),
    ("speed-up ×", "engine_speedup"), ("95 % interval", "engine_speedup_ci"), ("throughput ×", "engine_throughput_ratio"),
    ("pred ×", "engine_predicted_speedup"), ("τ to pay", "engine_tau_to_pay"), ("lossless", "engine_lossless"),
    ("verdict here", "verdict"), ("verdict in the engine", "engine_verdict"),
]


def _latency(pair) -> str:
    return "–" if not pair else f"{pair[0]:.1f} / {pair[1]:.1f}"


def deployment_section(rows: list[dict], name: str) -> list[str]:
    """report.md's section for a team's deployment measured through its OpenAI-compatible API (eval/deployment.py)."""
    out = ["", f"## In {name}", "",
           "The same prompts, greedy and with the same budget, sent to the deployment with its drafter and without it,"
           " streamed, B requests in flight (a new one sent as one returns). τ engine = 1 + accepted drafts per"
           " verification from the server's own counters at /metrics (the server's: other clients' traffic counts"
           " too), by position = the share of verifications that kept the guess at each position; tok/s = tokens"
           " after the first over the time from the first token to the last, the median over repeats; speed-up ×"
           " pooled over repeats and prompts, with a 95 % interval over prompts; throughput × = the stream's tokens"
           " over its wall-clock time, with the drafter over without; with engine_costs given, pred × = τ / (1 +"
           " prop·c + β) and τ to pay = pays_off_at · (1 + prop·c + β), the τ the drafter must keep there to pay;"
           " lossless = its greedy answer equals the plain server's, text for text.", "",
           table(rows, [c for c in DEPLOYMENT_COLUMNS if any(r.get(c[1]) is not None for r in rows)]),
           "", "Latency as a user sees it (ms, p50 / p90 over answers): time to first token, and time per output token"
           " after it.", "",
           "| category | drafter | B | time to first token, plain | with the drafter | per output token, plain |"
           " with the drafter |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ttft, tpot = r.get("engine_ttft_ms") or {}, r.get("engine_tpot_ms") or {}
        out.append(f"| {r['category']} | {r['drafter']} | {r.get('batch_size', 1)} | {_latency(ttft.get('plain'))} | "
                   f"{_latency(ttft.get('spec'))} | {_latency(tpot.get('plain'))} | {_latency(tpot.get('spec'))} |")
    return out


def _needs(r: dict) -> str:
    tau, to_pay = r.get("engine_acceptance_length"), r.get("engine_tau_to_pay")
    if tau is None or to_pay is None or tau >= to_pay or r.get("engine_verdict") == "pays off":
        return ""
    return f" (τ {tau:.2f}; it pays from τ {to_pay:.2f} here)"


def engine_verdict_lines(rows: list[dict]) -> list[str]:
    """Per category (and batch size): every drafter at its best k by the engine's measured speed-up, fastest first,
    with its interval and the engine's verdict, and where it does not pay, the τ it keeps there and the τ it
    would need to (`engine_tau_to_pay`)."""
    best: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r.get("engine_speedup") is None:
            continue
        group = best.setdefault((r["category"], r.get("batch_size", 1)), {})
        if r["drafter"] not in group or r["engine_speedup"] > group[r["drafter"]]["engine_speedup"]:
            group[r["drafter"]] = r
    several = len({b for _, b in best}) > 1
    lines = []
    for (category, batch), group in best.items():
        ranked = sorted(group.values(), key=lambda r: -r["engine_speedup"])
        lines.append(f"- **{category}**{f', batch {batch}' if several else ''}: " + "; ".join(
            f"{r['drafter']} k={r['k']} {r['engine_speedup']:.2f}× ({_interval(r.get('engine_speedup_ci'))}) → "
            f"{r['engine_verdict']}{_needs(r)}" for r in ranked))
    return lines


def engine_device(report: dict) -> str:
    """Where the engine ran the model: the GPU its log names (settings.engine.device), else the processor (a
    report written before the engine's device was recorded: torch's GPU if any, else the processor)."""
    hw, device = report["hardware"], (report["settings"].get("engine") or {}).get("device")
    if device is None:
        return hw["gpu"] or hw["cpu"]
    return hw["cpu"] if device == "CPU" else device


def engine_alone_markdown(report: dict) -> str:
    """report.md of `engine.only=true`: llama.cpp measured alone, no loop of draftsmith's beside it."""
    hw = report["hardware"]
    engine = report["settings"].get("engine") or {}
    out = ["# draftsmith evaluation: " + f"{engine.get('name', 'the engine')} alone", "",
           f"- target: `{report['target']}`",
           *(f"- {line}" for line in traffic_lines(report["settings"])),
           f"- hardware: {engine_device(report)}, {engine.get('threads')} engine threads",
           f"- served: {engine.get('name')} {engine.get('version')} on `{engine.get('target_gguf')}`"
           + "".join(f"; {name} as {GGUF_OUTTYPE.get(t, t)}" for name, t in (engine.get("draft_types") or {}).items())
           + "".join(f"; {name} with --spec-draft-p-min {p:g}" for name, p in (engine.get("p_min") or {}).items()),
           "- settings: " + ", ".join(f"{k}={v}" for k, v in report["settings"].items()
                                      if k not in TRAFFIC_KEYS and k != "engine"),
           "",
           "Measured in the engine only (`engine.only=true`): no τ, speed-up or verdict of draftsmith's loop (τ –),"
           " so pred × is the engine's own τ through its c and β, τ engine / (1 + n̄·c + f·β) with n̄ its drafted"
           " tokens per round and f the share of its rounds that verify a draft (1 unless a confidence stop or an"
           " n-gram mode leaves some rounds without one): the cost model checked against the speed-up measured"
           " beside it. Verdict:"
           f" pays off at a speed-up of {report['settings'].get('pays_off_at', EvalPlan.pays_off_at):g}× or more,"
           " turn it off below, undecided where the 95 % interval holds 1."]
    out += engine_section(report.get("engine_results", []), report.get("plots", []))
    served = {r["drafter"] for r in report.get("engine_results", [])}
    left_out = [f"- {name}: {why}" for name, why in (engine.get("served") or {}).items() if name not in served]
    if left_out:
        out += ["", "Not measured (the engine does not serve them):", "", *left_out]
    return "\n".join(out) + "\n"


def engine_section(rows: list[dict], report_plots: list[str] = ()) -> list[str]:
    """report.md's engine section: measured in llama.cpp beside draftsmith's loop, in a team's deployment through
    its API, or predicted for a team's own engine from the c and β it measured there (eval/engine.py)."""
    from eval.deployment import NAME

    rows = [r for r in rows if r.get("engine")]
    if not rows:
        return []
    name = rows[0]["engine"]
    notes = sorted({f"{r['drafter']}: {r['engine_note']}" for r in rows if r.get("engine_note")})
    if name == NAME:
        return deployment_section(rows, name) + (["", *(f"- {n}" for n in notes)] if notes else [])
    if name.endswith("(predicted)"):
        out = ["", f"## Predicted for {name.removesuffix(' (predicted)')}", "",
               "A prediction, not a measurement: draftsmith's τ per category with the c and β measured in that engine,"
               " pred × = τ / (1 + prop·c + β); ceiling × = (k+1) / (1 + β) and τ ceiling × = τ / (1 + β), what a"
               " drafter costing nothing could reach there; τ to pay = pays_off_at · (1 + prop·c + β), the τ at which"
               " the prediction reaches the pay-off line: what the drafter must keep there. Acceptance carries over"
               " between engines; cost is the engine's.", "",
               table(rows, PREDICTED_COLUMNS)]
        if any(r.get("tree") for r in rows):
            out += ["", "A tree is charged depth draft steps and β at its width (nodes + 1 positions; engine_costs.betas,"
                    " else engine_costs.beta). The settings SGLang takes for the shape these costs favour (its trees"
                    " are dynamic; vLLM 0.33.0 drafts chains only, and llama.cpp too):", "",
                    *sorted({f"- {r['category']}, {base_drafter(r)}: {r['engine_best_shape']}: "
                             f"`{r['sglang_settings'] or 'a static tree, which SGLang does not draft'}`"
                             for r in rows if r.get("engine_best_shape")})]
    else:
        measured = [r for r in rows if r.get("engine_speedup") is not None]
        out = ["", f"## In {name}", "",
               f"The same drafters, prompts, k and budget served by {name} (greedy). τ engine = 1 + accepted drafts per"
               " round (its draft calls) from its own counters; tok/s = generated tokens over its own generation time, the median"
               " over repeats; speed-up × pooled over repeats and prompts, with a 95 % interval over prompts; c and β"
               " from the same drafter and k keeping none of its drafts (llama.cpp's synthetic acceptance): c = its"
               " drafting time per drafted token, β = the rest of its round minus 1, both over the plain time per token;"
               " pred × = draftsmith's τ / (1 + prop·c + f·β), f the share of the engine's rounds that verify a draft (1"
               " unless a confidence stop or an n-gram mode leaves some rounds without one); ceiling × = (k+1) / (1 +"
               " β), what a perfect drafter costing nothing could reach in this engine on this hardware, τ ceiling ×"
               " = τ engine / (1 + f·β), what"
               " the measured τ allows at no draft cost (a speed-up far below it: the draft costs too much; a low"
               " ceiling: the hardware, the quantization or k limits); τ to pay = pays_off_at · (1 + prop·c + f·β), the"
               " τ at which pred × reaches the pay-off line: what a drafter drafting as much must keep in this engine"
               " to pay; lossless = its greedy output equals its plain output.", ""]
        # Engine-only rows (llama.cpp alone, its n-gram modes) have no τ or verdict of draftsmith's loop.
        columns = [c for c in ENGINE_COLUMNS if c[1] not in ("acceptance_length", "verdict")
                   or any(r.get(c[1]) is not None for r in measured)]
        if len(batch_sizes(rows)) > 1:
            columns = [*columns[:3], ("B", "batch_size"), *columns[3:]]
            out += [f"At B > 1 {name} serves with B slots, each category's prompts streamed through them as under"
                    " constant load (a client per slot sends the next prompt when its answer is back; extra requests"
                    " keep every slot busy until every prompt is answered), plain and speculative alike; τ engine is"
                    " the server's over each category's stream (extra requests included); c and β are batch-1 figures.",
                    ""]
        own = sorted({f"{r['drafter']} ({r['engine_only']})" for r in rows if r.get("engine_only") in NGRAM_TYPES})
        if own:
            out += [f"{', '.join(own)}: {name}'s own model-free speculation, what its users have without a draft"
                    " model; draftsmith has no loop for it (τ –), and as it drafts only where the text repeats, c and β"
                    " are not calibrated for it.",
                    ""]
        out.append(table(measured, columns))
        out += ["", f"### Verdict per category in {name} (each drafter at its best k)", "",
                f"Each drafter at the k {name} ran it fastest, fastest first; the verdict is {name}'s own.", "",
                *engine_verdict_lines(measured)]
        out += [f"![{p}]({p})" for p in report_plots if p.startswith("engine_k_")]
    if notes:
        out += ["", *(f"- {n}" for n in notes)]
    return out


TRAFFIC_KEYS = ("data", "trained_on")


def _records(d: dict) -> str:
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
        lines.append(f"measured: {_records(data)}" + (f"; prompts per category: {prompts}" if prompts else "")
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


def _fastest_lines(rows: list[dict]) -> list[str]:
    """One line per (category, k, temperature): the fastest drafter, then every other one against it."""
    lines = []
    groups: dict[tuple, list[dict]] = {}
    several = len(batch_sizes(rows)) > 1
    for r in rows:
        groups.setdefault((r["category"], r["k"], r["temperature"], r.get("batch_size", 1)), []).append(r)
    for (category, k, temperature, batch), group in groups.items():
        others = sorted((r for r in group if r["vs_fastest"] != "fastest"), key=lambda r: -r["speedup_vs_fastest"])
        against = "; ".join(f"{r['drafter']} {r['speedup_vs_fastest']:.2f}× ({_interval(r['speedup_vs_fastest_ci'])}) "
                            f"{r['vs_fastest']}" for r in others)
        lines.append(f"- {category}, k={k}, T={_fmt(temperature)}{f', batch {batch}' if several else ''}: "
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
            f"{_fmt(r.get('engine_acceptance_length')):>9}{_fmt(r['engine_speedup']):>8}"
            f"{_fmt(r.get('engine_predicted_speedup')):>7}{_fmt(r.get('engine_ceiling')):>7}  {r['engine_verdict']}"
            for r in rows), "", f"Each drafter at its best k in {name}:", *engine_verdict_lines(rows)])
    rows = _sorted(report["results"])
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
    if len(batch_sizes(rows)) > 1:
        lines += ["", "Up to which batch size speculation pays (each drafter at its best k per batch size):",
                  *_pays_up_to(rows)]
    engine = [r for r in rows + report.get("engine_results", []) if r.get("engine_verdict")]
    if engine:
        measured = any(r.get("engine_speedup") is not None for r in engine)
        lines += ["", f"In {engine[0]['engine']}:" if measured else f"For {engine[0]['engine']}:",
                  f"{'category':<14}{'drafter':<18}{'k':>3}{'B':>4}{'tau':>7}{'tau eng':>9}{'x eng':>8}{'pred':>7}"
                  f"{'ceil':>7}  verdict"]
        for r in engine:
            tau_e, x_e = r.get("engine_acceptance_length"), r.get("engine_speedup")
            lines.append(f"{r['category'][:13]:<14}{r['drafter'][:17]:<18}{r['k']:>3}{r.get('batch_size', 1):>4}"
                         f"{_fmt(r.get('acceptance_length')):>7}{_fmt(tau_e):>9}{_fmt(x_e):>8}"
                         f"{_fmt(r['engine_predicted_speedup']):>7}{_fmt(r.get('engine_ceiling')):>7}"
                         f"  {r['engine_verdict']}")
    return "\n".join(lines)


def plot_histograms(report: dict, out_dir: Path) -> list[Path]:
    """One PNG per category: share of rounds that kept 0..k guesses, a panel per (temperature, k)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def batch_sizes(rows: list[dict]) -> list[int]:
    return sorted({r.get("batch_size", 1) for r in rows})


def _best_per_batch(rows: list[dict]) -> dict[tuple, dict[int, dict]]:
    """(category, temperature, drafter) -> batch size -> the row of the best k there."""
    best: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        if r["k"] == r["best_k"]:
            best.setdefault((r["category"], r["temperature"], r["drafter"]), {})[r.get("batch_size", 1)] = r
    return best


def _pays_up_to(rows: list[dict]) -> list[str]:
    """Per category, temperature and drafter: the speed-up at each batch size (best k) and the largest batch
    size up to which every measured one pays."""
    lines = []
    for (category, temperature, drafter), by_batch in _best_per_batch(rows).items():
        curve = ", ".join(f"B={b}: {by_batch[b]['speedup']:.2f}× (k={by_batch[b]['k']})" for b in sorted(by_batch))
        paying = 0
        for b in sorted(by_batch):
            if by_batch[b]["verdict"] != "pays off":
                break
            paying = b
        where = f"pays up to batch {paying}" if paying else "does not pay at any batch size measured"
        lines.append(f"- {category}, T={_fmt(temperature)}, {drafter}: {where} ({curve})")
    return lines


def plot_batch_curves(report: dict, out_dir: Path) -> list[Path]:
    """With several batch sizes, one PNG per category: speed-up over plain decoding (each drafter at its best
    k per batch size, with its 95 % interval) against batch size: the cliff, drawn."""
    rows = report["results"]
    if len(batch_sizes(rows)) < 2:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    best = _best_per_batch(rows)
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)


def next_report_dir(parent: str | Path) -> Path:
    """`<parent>/report-N`, one past the highest N there, for scripts that evaluate the same checkpoints
    again: every evaluation keeps its own report beside the earlier ones."""
    parent = Path(parent)
    taken = [int(p.name[len("report-"):]) for p in parent.glob("report-*") if p.name[len("report-"):].isdigit()]
    return parent / f"report-{max(taken, default=0) + 1}"


def write_report(report: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write report.json, report.md and the histogram PNGs into out_dir; return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "report.json", "md": out_dir / "report.md"}

    def write(key: str, text: str) -> None:  # to a temporary name, then renamed: never a half-written report
        tmp = paths[key].with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(paths[key])

    # The measurement first: a failure drawing or rendering it afterwards loses nothing measured.
    write("json", json.dumps(report, indent=2) + "\n")
    for p in [*plot_batch_curves(report, out_dir), *plot_engine_k(report, out_dir)]:  # before report.md, which links them
        paths[p.stem] = p
    report = {**report, "plots": sorted(p for p in paths if p.startswith(("batch_curve_", "engine_k_")))}
    report["plots"] = [f"{name}.png" for name in report["plots"]]
    write("json", json.dumps(report, indent=2) + "\n")
    write("md", markdown(report))
    for p in plot_histograms(report, out_dir):
        paths[p.stem] = p
    return paths


def log_to_wandb(report: dict, paths: dict[str, Path], *, project: str, entity: str | None, config: dict,
                 run_dir: str | Path) -> None:
    """Log the result rows and histograms to Weights & Biases; offline when there is no API key.

    The key itself is never printed or logged: wandb reads it from the environment.
    """
    import wandb

    mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    run = wandb.init(project=project, entity=entity, config=config, dir=str(run_dir), mode=mode, job_type="eval")
    # Lists (histograms, positions, intervals) do not fit a table cell; an interval is None in some rows.
    # llama.cpp alone (engine.only) has the engine's rows only.
    rows = report["results"] or report["engine_results"]
    columns = [c for c in rows[0] if not any(isinstance(r.get(c), list) for r in rows)]
    run.log({
        "results": wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows]),
        **{f"accept_hist/{name}": wandb.Image(str(p)) for name, p in paths.items() if p.suffix == ".png"},
    })
    run.finish()
