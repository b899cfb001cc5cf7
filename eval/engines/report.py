"""The report's engine sections: llama.cpp's or a deployment's figures beside draftsmith's, the verdict lines in the
engine, and the report of `engine.only` runs (eval/report.py)."""

from __future__ import annotations

from eval.engines import vllm
from eval.engines.deployment import NAME
from eval.engines.formats.writing import GGUF_OUTTYPE
from eval.evaluate import EvalPlan, base_drafter
from eval.engines.llama_cpp import NGRAM_TYPES
from eval.report_tables import (DEPLOYMENT_COLUMNS, ENGINE_COLUMNS, PREDICTED_COLUMNS, TRAFFIC_KEYS, batch_sizes,
                                fmt_interval, fmt_latency, table, traffic_lines)


VLLM_COSTS = (" vLLM's costs, at B = 1: β = what the plain server's forward over k+1 new positions after a cached prefix"
              " costs beyond its forward over one, in decode steps, by its own clock (vllm:request_prefill_time_seconds"
              " and vllm:request_decode_time_seconds, medians of 5 requests on the longest prompt); ceiling × = (k+1) / (1"
              " + β), what a drafter that cost nothing and kept every guess could reach in this engine on this hardware,"
              " τ ceiling × = τ engine / (1 + β), what the τ it measured allows at no draft cost (a speed-up far below"
              " it: the draft costs too much); c = what the drafting server's round spends beyond that verification"
              " per drafted token (drafting, and whatever else its rounds add), in decode steps, read off the measured"
              " speed-up through the cost model: (τ engine / speed-up − 1 − β) / prop engine; τ to pay = pays_off_at ·"
              " (1 + prop·c + β), the τ a round of that cost would need to pay.")

VERSUS = (" Several drafters were served in turn, each beside the same plain server: × vs base = a drafter's speed-up"
          " over the plain server in its own pass over the baseline drafter's in the baseline's (the passes ran one"
          " after the other; a machine whose speed drifts between them cancels), and τ engine vs base its τ over the"
          " baseline's (from each request's own counters, at B = 1), on the same prompts, with 95 % intervals over"
          " prompts.")


def deployment_section(rows: list[dict], name: str) -> list[str]:
    """report.md's section for a team's deployment measured through its OpenAI-compatible API (eval/engines/deployment.py),
    or for vLLM's servers that `engine=vllm` starts here (with the costs it measures on them)."""
    served_here = name == vllm.SERVED
    out = ["", f"## In {name}", "",
           ("draftsmith served the target in vLLM (engine=vllm) with the drafter (each listed drafter in turn) and"
            " without it, and sent both the same prompts, greedy and with the same budget," if served_here else
            "The same prompts, greedy and with the same budget, sent to the deployment with its drafter and without it,")
           + " streamed, B requests in flight (a new one sent as one returns). τ engine = 1 + accepted drafts per"
           " verification from the server's own counters at /metrics (the server's: other clients' traffic counts"
           " too), by position = the share of verifications that kept the guess at each position; tok/s = tokens"
           " after the first over the time from the first token to the last, the median over repeats; speed-up ×"
           " pooled over repeats and prompts, with a 95 % interval over prompts; throughput × = the stream's tokens"
           " over its wall-clock time, with the drafter over without; prop engine = tokens drafted per verification;"
           + (VLLM_COSTS if served_here else " with engine_costs given, pred × = τ / (1 + prop·c + β) and τ to pay ="
              " pays_off_at · (1 + prop·c + β), the τ the drafter must keep there to pay;")
           + " lossless = its greedy answer equals the plain server's, text for text."
           + (VERSUS if any(r.get("engine_speedup_vs_baseline") is not None for r in rows) else ""), "",
           table(rows, [c for c in DEPLOYMENT_COLUMNS if any(r.get(c[1]) is not None for r in rows)]),
           "", "Latency as a user sees it (ms, p50 / p90 over answers): time to first token, and time per output token"
           " after it.", "",
           "| category | drafter | B | time to first token, plain | with the drafter | per output token, plain |"
           " with the drafter |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ttft, tpot = r.get("engine_ttft_ms") or {}, r.get("engine_tpot_ms") or {}
        out.append(f"| {r['category']} | {r['drafter']} | {r.get('batch_size', 1)} | {fmt_latency(ttft.get('plain'))} | "
                   f"{fmt_latency(ttft.get('spec'))} | {fmt_latency(tpot.get('plain'))} | {fmt_latency(tpot.get('spec'))} |")
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
            f"{r['drafter']} k={r['k']} {r['engine_speedup']:.2f}× ({fmt_interval(r.get('engine_speedup_ci'))}) → "
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
    its API, or predicted for a team's own engine from the c and β it measured there (eval/engines/engine.py)."""

    rows = [r for r in rows if r.get("engine")]
    if not rows:
        return []
    name = rows[0]["engine"]
    notes = sorted({f"{r['drafter']}: {r['engine_note']}" for r in rows if r.get("engine_note")})
    if name in (NAME, vllm.SERVED):
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
               " unless a confidence stop or an n-gram mode leaves some rounds without one); ceiling × = (n+1) / (1 +"
               " β), n the guesses its rounds verified (k, fewer for a DFlash block shorter than k), what a perfect"
               " drafter costing nothing could reach in this engine on this hardware, τ ceiling ×"
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
