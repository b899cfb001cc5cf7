"""The engine's cost model: c (one draft step over one target step) and β (one verification of k+1 positions
over one target step, minus 1) turn an acceptance length τ into a speed-up, τ / (1 + n̄·c + f·β)
(eval/metrics.py `predicted_speedup`). llama.cpp's c and β are measured here (eval/engines/llama_cpp_measure.py); a team
whose engine cannot run here (vLLM or SGLang on GPUs) measures them there and enters them (`engine_costs.c`,
`engine_costs.beta`, a drafter's own `engine_c`), and `predict` turns draftsmith's τ into a per-category
predicted speed-up and verdict for that engine, labelled a prediction. `ceilings` and `tau_to_pay` say what the
engine allows and what a drafter must keep to pay there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional

from drafters.tree import StaticTree, TreeShape
from eval.evaluate import base_drafter
from eval.metrics import predicted_speedup

# Fields every result row gets (None where a drafter or a temperature has no engine figure).
FIELDS = ("engine", "engine_acceptance_length", "engine_mean_proposed", "engine_ar_tokens_per_s",
          "engine_sd_tokens_per_s", "engine_speedup", "engine_speedup_ci", "engine_verdict", "engine_lossless",
          "engine_cost_ratio",
          "engine_verify_overhead", "engine_predicted_speedup", "engine_ceiling", "engine_tau_ceiling",
          "engine_tau_to_pay", "engine_tau_vs_baseline", "engine_tau_vs_baseline_ci", "engine_note")


@dataclass
class EngineCosts:
    """c and β measured in an engine that cannot run here, for a predicted verdict there.

    name: what they describe ("vLLM 0.11, 1x H100, batch 1"); c: one draft step over one target step in
    that engine (every drafter without its own `engine_c`); beta: one verification of k+1 positions over
    one target step, minus 1. betas: β measured at given verification widths (positions verified in one
    forward: k+1 for a chain, nodes+1 for a tree), {width: β} ('+engine_costs.betas={17: 0.3}' on the command
    line); a width not listed takes `beta`, which is what a GPU's flat cost over small widths looks like and
    what a CPU's is not: give the widths where they differ.
    A tree of depth D is charged D draft steps (each expands its top-k nodes in one forward) and β at its width.
    """

    name: str = "your engine"
    c: Optional[float] = None
    beta: Optional[float] = None
    betas: Dict[int, float] = field(default_factory=dict)

    def beta_at(self, width: int) -> float | None:
        return self.betas.get(width, self.beta)

    @property
    def given(self) -> bool:
        return self.c is not None or self.beta is not None


def predict(rows: list[dict], costs: EngineCosts, drafter_c: dict[str, float | None], pays_off_at: float,
            drafter_cs: dict[str, dict[int, float]] | None = None) -> None:
    """Rows gain the speed-up these costs predict from draftsmith's τ, and its verdict, marked predicted.
    drafter_c: each drafter's own c (`engine_c`); drafter_cs: a parallel drafter's c per k (`engine_cs`), the cost of
    its one forward over a round's block, which grows with the block as β grows with the verified width."""
    drafter_cs = drafter_cs or {}
    if costs.beta is None:
        raise ValueError("engine_costs.beta is not set: a prediction needs β, the verification overhead measured "
                         "in your engine (one forward of k+1 positions over one decoding step, minus 1)")
    for r in rows:
        if r.get("batch_size", 1) != 1:  # c and β are a team's batch-1 measurements
            continue
        tree = TreeShape.parse(r["tree"]) if r.get("tree") else None
        base = base_drafter(r)
        c = drafter_c.get(base)
        c = costs.c if c is None else c
        # A chain's full round verifies the guesses it drafted, k or fewer (a DFlash block of b drafts b - 1, MTP its
        # modules: `max_proposed`), plus one, and a round drafts its mean proposal; a tree verifies nodes+1 and
        # drafts depth steps; a parallel drafter (DFlash, P-EAGLE, PARD) drafts one forward a round, whose cost its c
        # is (at this k, its engine_cs' entry).
        n = r["k"] if tree else min(r["k"], r.get("max_proposed") or r["k"])
        width = tree.nodes + 1 if tree else n + 1
        beta = costs.beta_at(width)
        parallel = bool(r.get("parallel"))
        if parallel:
            c = drafter_cs.get(base, {}).get(r["k"], c)
        steps = 1 if parallel else tree.depth if tree else r["mean_proposed"]
        figures = dict.fromkeys(FIELDS)
        figures.update(engine=f"{costs.name} (predicted)", engine_cost_ratio=c, engine_verify_overhead=beta)
        if c is None:
            figures["engine_note"] = f"no c for drafter {base!r}: set engine_costs.c or its engine_c"
        else:
            predicted = predicted_speedup(r["acceptance_length"], steps, c, beta)
            figures.update(engine_predicted_speedup=predicted,
                           engine_verdict=("pays off" if predicted >= pays_off_at else "turn it off") + " (predicted)")
        figures.update(ceilings(n, r["acceptance_length"], beta),
                       engine_tau_to_pay=tau_to_pay(steps, c, beta, pays_off_at))
        r.update(figures)
    _engine_best_shape(rows)


def _engine_best_shape(rows: list[dict]) -> None:
    """Each predicted row names its drafter's shape (chains at each k, trees) the engine's costs favour per category
    and temperature: `engine_best_shape`, with the settings SGLang takes for it (`sglang_settings`)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("engine_predicted_speedup") is None or r.get("batch_size", 1) != 1:
            continue
        groups.setdefault((base_drafter(r), r["temperature"], r["category"]), []).append(r)
    for group in groups.values():
        best = max(group, key=lambda r: r["engine_predicted_speedup"])
        shape = TreeShape.parse(best["tree"]) if best.get("tree") else TreeShape(best["k"], 1, best["k"])
        for r in group:
            r["engine_best_shape"] = f"tree {shape.label}" if best.get("tree") else f"chain k={best['k']}"
            r["sglang_settings"] = sglang_settings(shape)


def sglang_settings(shape: TreeShape | StaticTree) -> str | None:
    """SGLang's EAGLE flags for a shape: steps = depth, top-k, and the tokens verified, which SGLang counts with the
    root (the last committed token), nodes + 1 (a chain of k: k + 1). None for a static tree: SGLang's trees are
    dynamic. (vLLM 0.33.0's SpeculativeConfig has no tree setting: it drafts chains.)"""
    if isinstance(shape, StaticTree):
        return None
    return (f"--speculative-num-steps {shape.depth} --speculative-eagle-topk {shape.topk} "
            f"--speculative-num-draft-tokens {shape.nodes + 1}")


def ceilings(k: int, tau: float | None, beta: float | None, verified: float | None = 1.0) -> dict:
    """What the engine allows at zero draft cost, from its own β (verifying k+1 positions over one step, minus
    1): `engine_ceiling` = (k+1)/(1+β), a perfect drafter's speed-up; `engine_tau_ceiling` = τ/(1+f·β), the
    speed-up the engine's measured τ allows, f the share of rounds that verify (1 but for a drafter that drafts
    nothing in some rounds). Below the first, the hardware limits (a quantization whose verification is
    compute-bound, a CPU); between the measured speed-up and the second, the draft's cost. k is the guesses the
    rounds β was measured on verified (`verified_width`), which a drafter with fewer steps than the k asked for
    (a DFlash block, MTP modules, Medusa heads) keeps below it."""
    if beta is None:
        return {"engine_ceiling": None, "engine_tau_ceiling": None}
    f = 1.0 if verified is None else verified
    # A drafter that leaves rounds without a draft verifies fewer than k+1 positions, so its β is not the cost of
    # a perfect drafter's round: no ceiling from it (the same drafter without its stop gives one).
    return {"engine_ceiling": (k + 1) / (1 + beta) if f == 1.0 else None,
            "engine_tau_ceiling": tau / (1 + f * beta) if tau else None}


def verified_width(k: int, drafted: float | None) -> int:
    """The guesses a full round verified: k, or fewer where the drafter's rounds drafted fewer on average (a
    DFlash drafter with a block of b drafts min(k, b - 1)); `drafted` is the mean draft per verified round."""
    return k if drafted is None else max(1, min(k, math.ceil(drafted - 1e-9)))


def tau_to_pay(proposed: float | None, c: float | None, beta: float | None, pays_off_at: float,
               verified: float | None = 1.0) -> float | None:
    """The τ at which the cost model's speed-up reaches the pay-off line at these costs, pays_off_at·(1 + n̄·c +
    f·β) with n̄ the tokens drafted a round and f the share of rounds that verify: what a drafter drafting as
    much must keep in this engine to pay, beside the τ it keeps (`predicted_speedup` solved for τ)."""
    if None in (proposed, c, beta):
        return None
    return pays_off_at * (1 + proposed * c + (1.0 if verified is None else verified) * beta)
