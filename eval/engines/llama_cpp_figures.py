"""llama.cpp's measurements as figures of draftsmith's report: per drafter, k, category and batch size, the
engine's τ, speed-up and interval, verdict, losslessness, c, β, predicted speed-up, ceilings and τ to pay
(`engine_figures`), and why an output that differs from plain decoding differs (`numerics_note`).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from eval.engines import llama_cpp
from eval.compare import Timings, compare, tau_counts, verdict
from eval.engines.costs import FIELDS, ceilings, tau_to_pay, verified_width
from eval.evaluate import ALL
from eval.engines.llama_cpp_drafters import Converted, Served
from eval.engines.llama_cpp_measure import DraftStats, generation_timings, measure_llama_cpp
from eval.metrics import PartingGaps, parting_note, predicted_speedup

NAME = "llama.cpp"  # what the report calls it
# What the vendored llama.cpp verifies: common/speculative.cpp drafts a token list per sequence and the server
# verifies it as one chain; there is no tree drafting or tree attention (llama-cpp-python 0.3.36's llama.cpp).
CHAINS_ONLY = "llama.cpp drafts and verifies chains only: a tree's τ and speed are draftsmith's"


# The verdict where a drafter proposed nothing (llama.cpp's n-gram modes on text that does not repeat): its
# generations were plain decoding, and any difference from the plain runs' speed is the machine's noise.
NOTHING_DRAFTED = "it drafted nothing here: plain decoding"


def engine_figures(rows: list[dict], measured: dict, served: list[Served], *, repeats: int, pays_off_at: float,
                   seed: int = 0, batch: int = 1, alone: bool = False, ks: list[int] | None = None,
                   gaps: PartingGaps | None = None) -> list[dict]:
    """Rows of draftsmith's report at batch size `batch` gain llama.cpp's figures for the same (drafter, k,
    category) at that batch size; rows at temperature > 0 and drafters llama.cpp cannot serve get a note
    instead. At batch > 1 the engine's τ is the server's over each category's stream, and c and β (measured
    at batch 1) and the prediction are left out. Returns the rows of the drafters only the engine runs
    (llama.cpp's n-gram modes), one per category and k as draftsmith's rows have them (ngram-cache at its
    fixed k, `Served.ks`), with the engine's figures alone.

    alone (`engine.only`: no loop of draftsmith's ran, `rows` is empty): every drafter the engine serves gets
    such rows, one per category (and all traffic) and k of `ks`, and a drafter's prediction is its engine τ
    through the engine's c and β, τ / (1 + n̄·c + f·β) with n̄ its drafted tokens per round and f the share of
    its rounds that verify a draft: the cost model checked against the speed-up measured beside it.

    gaps: a row whose outputs differ from plain decoding says how near a tie each parts at (`PartingGaps`)."""
    completions, counters, items = measured["completions"], measured["counters"], measured["items"]
    plain = completions["plain"]

    step_ms = statistics.median(sum(g.predicted_ms for (r, _, _), g in plain.items() if r == rep)
                                / sum(len(g.tokens) for (r, _, _), g in plain.items() if r == rep)
                                for rep in range(repeats))
    notes = {s.name: s.note for s in served if s.note}
    costs = {key: (rc.c(step_ms), rc.beta(step_ms)) for key, rc in measured["costs"].items()}
    baseline = served[0].name if served else None  # the evaluation's first drafter, as draftsmith's loop has it

    def figures_of(drafter: str, k: int, category: str, tau: float | None, proposed: float | None) -> dict:
        """The engine's figures for one drafter, k and category (`tau`, `proposed`: draftsmith's, if any)."""
        key = (drafter, k)
        runs = completions[key]
        keys = [(c, i) for c, i in items if category in (ALL, c)]
        spec_t, plain_t = generation_timings(runs, keys, repeats), generation_timings(plain, keys, repeats)
        vs_plain = compare(spec_t, plain_t, [c for c, _ in keys], seed=seed)
        chosen = sum((counters[key][rep, c, i] for rep in range(repeats) for c, i in keys), DraftStats()) \
            if key in counters else DraftStats()
        c, beta = costs.get(key, (None, None))
        # τ against the baseline's in the engine, on the same prompts, with the paired interval (batch 1: per round)
        vs_base = (compare(_tau_counts(counters[key], keys, repeats), _tau_counts(counters[baseline, k], keys, repeats),
                           [category for category, _ in keys], seed=seed)
                   if batch == 1 and key in counters and (baseline, k) in counters else None)
        # Per round, as draftsmith counts τ: a round whose draft was empty (a confidence stop, an n-gram mode
        # without a match) emits the target's one token and verifies nothing. With several slots llama.cpp
        # counts a draft call per batch, not per request: there τ is per verification, as the field gives it.
        rounds = chosen.rounds if batch == 1 else chosen.verifications
        tau_engine = 1 + chosen.accepted / rounds if chosen.verifications and rounds else None
        proposed_engine = chosen.drafted / rounds if chosen.verifications and rounds else None
        verified = chosen.verifications / rounds if chosen.verifications and rounds else None
        if alone:  # no τ of draftsmith's: the engine's own through its costs
            tau, proposed = tau_engine, proposed_engine
        predicted = (predicted_speedup(tau, proposed, c, beta, verified=verified)
                     if None not in (tau, proposed, c, beta, verified) else None)
        drafted = sum(runs[rep, c, i].draft_n for rep in range(repeats) for c, i in keys)
        generations = [(rep, c, i) for rep in range(repeats) for c, i in keys]
        lossless = all(runs[g].tokens == plain[g].tokens for g in generations)
        note = None if lossless else numerics_note(runs, plain, measured.get("verified", {}).get(key, {}), generations,
                                                   gaps)
        return dict(
            engine=NAME, engine_acceptance_length=tau_engine, engine_mean_proposed=proposed_engine,
            engine_ar_tokens_per_s=plain_t.median_tokens_per_s(), engine_sd_tokens_per_s=spec_t.median_tokens_per_s(),
            engine_speedup=vs_plain.ratio, engine_speedup_ci=vs_plain.interval,
            engine_verdict=verdict(vs_plain.ratio, vs_plain.interval, pays_off_at) if drafted else NOTHING_DRAFTED,
            engine_lossless=lossless, engine_note=note,
            engine_cost_ratio=c, engine_verify_overhead=beta, engine_predicted_speedup=predicted,
            engine_tau_to_pay=tau_to_pay(proposed, c, beta, pays_off_at, verified),
            engine_tau_vs_baseline=vs_base and vs_base.ratio, engine_tau_vs_baseline_ci=vs_base and vs_base.interval,
            # β is what the rounds it verified cost: a perfect drafter's ceiling at that width (a DFlash block
            # shorter than k verifies fewer than k+1 positions a round)
            **ceilings(verified_width(k, chosen.drafted / chosen.verifications if chosen.verifications else None),
                       tau_engine, beta, verified))

    greedy = [r for r in rows if r.get("batch_size", 1) == batch and r["temperature"] == 0 and not r.get("tree")]
    for r in rows:
        if r.get("batch_size", 1) != batch:
            continue
        figures = {**dict.fromkeys(FIELDS), "engine": NAME}
        if r["temperature"] != 0:
            figures["engine_note"] = "the engine is measured greedy (temperature 0) only"
        elif r.get("tree"):
            figures["engine_note"] = CHAINS_ONLY
        elif r["drafter"] in notes:
            figures["engine_note"] = notes[r["drafter"]]
        else:
            figures.update(figures_of(r["drafter"], r["k"], r["category"], r["acceptance_length"], r["mean_proposed"]))
        r.update(figures)
    if alone:
        cells = [(category, k) for category in [*dict.fromkeys(c for c, _ in items), ALL] for k in ks]
    else:
        cells = list(dict.fromkeys((r["category"], r["k"]) for r in greedy))
    return [{"category": category, "drafter": s.name, "k": k, "batch_size": batch, "temperature": 0.0,
             "engine_only": s.spec_type, **dict.fromkeys(FIELDS), **figures_of(s.name, k, category, None, None)}
            for s in served if s.spec_type is not None and (alone or s.engine_only)
            for category, k in dict.fromkeys((c, k) for c, k0 in cells for k in s.ks([k0]))]


def _tau_counts(counters: dict, keys: list[tuple[str, int]], repeats: int) -> Timings:
    """(repeats, prompts) rounds and kept drafts from llama-server's counters, as `tau_counts` has them."""
    stats = [[counters[rep, c, i] for c, i in keys] for rep in range(repeats)]
    return tau_counts(np.array([[s.rounds for s in row] for row in stats]),
                      np.array([[s.accepted for s in row] for row in stats]))


def numerics_note(runs: dict, plain: dict, verified: dict, keys: list[tuple], gaps: PartingGaps | None = None) -> str:
    """Why a drafter's greedy output in llama.cpp differs from its plain output, where the server that kept none
    of its drafts says: if that server's output (the target's own tokens, verified k+1 positions at a time) differs
    from plain on the same prompts as the drafter's and equals the drafter's, the difference is llama.cpp's own
    numerics (a batch of positions and a single one round differently at a near tie of the target's logits), not
    the drafter's guesses. With `gaps`, draftsmith's target's logit gap where each differing output parts from
    plain's (keys are (repeat, category, prompt index)), which says how near that tie is."""
    differs = [key for key in keys if runs[key].tokens != plain[key].tokens]
    checked = [key for key in differs if key in verified]
    same = [key for key in checked if verified[key].tokens == runs[key].tokens]
    line = parting_note(differs, len(keys), runs, plain, gaps)
    if checked and len(same) == len(checked):
        return (f"{line}; on the {len(checked)} of them its server that kept none of its drafts measured, that "
                "server's output (the target's own tokens, verified in rounds) is the drafter's: llama.cpp's "
                "numerics when it verifies several positions at once, not the drafter")
    return line + ("" if checked else "; none of them is a prompt the cost servers measured")


def run_llama_cpp(rows: list[dict], converted: Converted, prompts: dict[str, list[list[int]]], *, ks: list[int],
                  max_new_tokens: int, repeats: int, pays_off_at: float, threads: int, work: Path,
                  cost_prompts: int = 4, seed: int = 0, progress: bool = True, batch_sizes=(1,),
                  alone: bool = False, target=None) -> dict:
    """Everything `engine=llamacpp` adds once the models are converted: measure them in llama.cpp at each
    batch size (calibrating c and β at batch 1), and add the engine's figures to `rows`. Returns the
    settings to report, with the rows of the drafters only the engine runs under `engine_only` (the caller
    reports them apart: report.json's `engine_results`); with `alone` (no loop of draftsmith's ran), the rows
    of every drafter the engine serves. `target`, draftsmith's: where an output differs from plain decoding, its
    logits say how near a tie it parts at (`PartingGaps`)."""
    target_gguf, served = converted.target_gguf, converted.served
    gaps = PartingGaps(target, prompts) if target is not None else None
    engine_only, devices = [], []
    for batch in batch_sizes:
        measured = measure_llama_cpp(target_gguf, served, prompts, ks, max_new_tokens=max_new_tokens, repeats=repeats,
                                     threads=threads, log_dir=work, cost_prompts=cost_prompts, progress=progress,
                                     batch=batch)
        devices.append(measured["device"])
        engine_only += engine_figures(rows, measured, served, repeats=repeats, pays_off_at=pays_off_at, seed=seed,
                                      batch=batch, alone=alone, ks=ks, gaps=gaps)
    return {"name": NAME, "version": llama_cpp.VERSION, "target_gguf": str(target_gguf),
            "threads": threads, "device": ", ".join(dict.fromkeys(devices)), "work_dir": str(work), "alone": alone,
            "cost_prompts_per_category": cost_prompts, "served": {s.name: s.spec_type or s.note for s in served},
            "p_min": {s.name: s.p_min for s in served if s.p_min},
            "draft_types": {s.name: s.dtype for s in served if s.dtype},
            "batch_sizes": list(batch_sizes), "engine_only": engine_only}
