"""What a set of speculative rounds says: the acceptance distribution, the cost model, and where a greedy output
that differs from plain decoding parts from it.

Acceptance is reported as a distribution, not only a mean: real acceptance is bimodal (many rounds
accept nothing, many accept everything) and falls with draft position, and a mean hides both.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import torch

from eval.speculative import Round


@dataclass
class AcceptanceStats:
    """Acceptance over a set of rounds drafted with at most k guesses each.

    accept_hist[a]: rounds that kept exactly a guesses (a = 0..k).
    mean_proposed: guesses proposed per round (k for a drafter that always drafts k; fewer with a
        confidence stop, or for a model-free drafter without a match).
    max_proposed: the most guesses a round proposed, what a full round verifies: k, or fewer for a drafter with
        fewer steps than k (a DFlash block of b drafts b - 1, MTP its modules, Medusa its heads); a tree's nodes.
    acceptance_rate: kept guesses / proposed guesses (a drafter that proposes nothing is not penalised
        here; it is in acceptance_length).
    position_acceptance[i]: P(guess i+1 kept | guesses 1..i kept and guess i+1 proposed); real
        drafters fall with position, which an i.i.d. rate hides.
    acceptance_length: tau = 1 + kept guesses per round (a round yields its kept guesses and one token of the
        target's), the serving engines' "mean acceptance length" as llama.cpp and vLLM count it (the first
        new token, from the prompt's forward, is in no round; in a round cut by the end of the answer or the
        budget, only the guesses the answer emits count, the end token included).
    """

    rounds: int
    accept_hist: list[int]
    mean_proposed: float
    max_proposed: int
    mean_accepted: float
    median_accepted: float
    p10_accepted: float
    p90_accepted: float
    zero_accept_rate: float
    full_hit_rate: float
    acceptance_rate: float
    position_acceptance: list[float | None]
    acceptance_length: float

    def to_dict(self) -> dict:
        return asdict(self)


def acceptance_stats(rounds: Sequence[Round], k: int) -> AcceptanceStats:
    """Summarise rounds drafted with k guesses, or trees of depth k (whose rounds propose more nodes than k and
    keep at most k: `acceptance_rate` is then the kept share of the nodes verified)."""
    if not rounds:
        raise ValueError("no rounds to summarise")
    accepted = np.array([r.accepted for r in rounds])
    proposed = np.array([r.proposed for r in rounds])
    tree = any(getattr(r, "depth", None) is not None for r in rounds)
    if (accepted > proposed).any() or (accepted > k).any() or (not tree and (proposed > k).any()):
        raise ValueError("inconsistent rounds: accepted > proposed, or more than k guesses")
    hist = np.bincount(accepted, minlength=k + 1)
    positions: list[float | None] = []
    for i in range(k):
        reached = (accepted >= i) & (proposed > i)
        positions.append(float((accepted[reached] > i).mean()) if reached.any() else None)
    return AcceptanceStats(
        rounds=len(rounds),
        accept_hist=hist.tolist(),
        mean_proposed=float(proposed.mean()),
        max_proposed=int(proposed.max()),
        mean_accepted=float(accepted.mean()),
        median_accepted=float(np.median(accepted)),
        p10_accepted=float(np.percentile(accepted, 10)),
        p90_accepted=float(np.percentile(accepted, 90)),
        zero_accept_rate=float((accepted == 0).mean()),
        full_hit_rate=float((accepted == k).mean()),
        acceptance_rate=float(accepted.sum() / proposed.sum()) if proposed.sum() else 0.0,
        position_acceptance=positions,
        acceptance_length=1 + float(accepted.mean()),
    )


@dataclass
class CostModel:
    """Measured costs, in units of one target decoding step (plain decoding's whole step: choosing a token
    and the target's 1-token forward).

    cost_ratio c: one draft step (a full round's drafting time / its n guesses).
    verify_overhead beta: the rest of a full round (the target's forward of n+1 positions, the acceptance
        test, the rollback and the bookkeeping), minus 1.
    round_overhead: the rest of a round as the drafter's rounds verified it, minus 1, averaged over its rounds:
        a round whose proposal was m guesses pays the overhead of rounds of m guesses (0 guesses: a plain step),
        so a drafter that proposes fewer than n in some rounds, or none, is charged what those rounds cost.
    prefill, spec_prefill: the time before the first step (plain) or round (speculative: the target's
        prefill, its first token and the drafter's start on the prompt), None where not timed.
    batch_acceptance_length: the tokens a generation advances per round, its plain decoding steps over its
        speculative rounds (tau, counted per generation rather than per round).
    predicted_speedup: the speed-up these costs predict (`predicted_speedup`), with the batch's acceptance
        length and the prefill where they are known, else with tau in the steady state.
    draft_round: what a round's drafting costs as the prediction charges it.
    """

    cost_ratio: float
    verify_overhead: float | None
    predicted_speedup: float | None
    prefill: float | None = None
    spec_prefill: float | None = None
    batch_acceptance_length: float | None = None
    round_overhead: float | None = None
    draft_round: float | None = None  # a round's drafting, in target steps: mean proposal × c (parallel: n × c)


def cost_model(rounds: Sequence[Round], target_step_s: Sequence[float], k: int, acceptance_length: float, *,
               steps: float | None = None, spec_rounds: float | None = None, prefill_s: Sequence[float] = (),
               spec_prefill_s: Sequence[float] = (), parallel: bool = False) -> CostModel:
    """Estimate c and beta from the timed rounds and the timed plain-decoding steps of the same prompts.

    Medians throughout: a noisy machine adds outliers, not a shift. A drafter's full proposal is n =
    the most it proposed in any round: k for draft models, fewer for heads with fewer steps than k
    (MTP depth, Medusa heads); a model-free drafter, or one with a confidence stop, proposes fewer in
    some rounds. c and beta come from the full rounds (n guesses drafted and verified): c is the cost of
    one drafted token (a full round's draft time / n), beta the rest of the round. Rounds timed without
    their whole (`round_s` None) take beta from the verification alone. The prediction charges each round
    its mean proposal length, and the rest of each round at the width it verified (`round_overhead`: a round
    of m guesses, the median of such rounds; an empty proposal is a plain step, not a full round). With `steps` and `spec_rounds` (plain decoding's mean steps and speculative
    decoding's mean rounds per generation) and both loops' prefill times it predicts the end-to-end
    speed-up: each generation pays its prefill once and `spec_rounds` full rounds. At B > 1 a generation's
    steps and rounds are shared with the other rows, 1/B of each (eval/batching.py), so the prefill is
    passed as the generation's share times B.

    `parallel`: a drafter whose guesses cost one forward (DFlash, P-EAGLE, PARD). Its round costs that forward
    whatever it proposes (a confidence stop cuts the proposal, not the forward), so c comes from every round's draft
    time (c = that median / n, per drafted token like any drafter's) and the prediction charges each round n·c,
    the forward, not its mean proposal times c.
    """
    if not target_step_s:
        raise ValueError("no timed target steps: cannot express costs in target steps")
    step = statistics.median(target_step_s)
    n = max((r.proposed for r in rounds), default=0) or k
    full = [r for r in rounds if r.proposed == n]
    c = statistics.median(r.draft_s for r in (rounds if parallel else full or rounds)) / n / step
    if not full:
        return CostModel(c, None, None, draft_round=n * c)
    rest: dict[int, list[float]] = {}  # the rest of each round, by the guesses it verified
    for r in rounds:
        rest.setdefault(r.proposed, []).append(r.verify_s if r.round_s is None else r.round_s - r.draft_s)
    overhead = {m: statistics.median(times) / step - 1 for m, times in rest.items()}
    beta, charged = overhead[n], statistics.fmean(overhead[r.proposed] for r in rounds)
    charged_steps = n if parallel else statistics.fmean(r.proposed for r in rounds)  # draft steps a round pays
    prefill = statistics.median(prefill_s) / step if prefill_s else None
    spec_prefill = statistics.median(spec_prefill_s) / step if spec_prefill_s else None
    if steps is None or not spec_rounds or prefill is None or spec_prefill is None:
        return CostModel(c, beta, predicted_speedup(acceptance_length, charged_steps, c, charged),
                         round_overhead=charged, draft_round=charged_steps * c)
    batch_tau = steps / spec_rounds
    predicted = predicted_speedup(batch_tau, charged_steps, c, charged, steps=steps, prefill=prefill,
                                  spec_prefill=spec_prefill)
    return CostModel(c, beta, predicted, prefill, spec_prefill, batch_tau, round_overhead=charged,
                     draft_round=charged_steps * c)


def predicted_speedup(acceptance_length: float, proposed: float, c: float, beta: float, *,
                      steps: float | None = None, prefill: float = 0.0, spec_prefill: float = 0.0,
                      verified: float = 1.0) -> float:
    """The cost model's speed-up, in target steps (ANCHORS section 1). A round costs its n draft steps and
    the rest of the round, 1 + n*c + beta, and yields tau tokens: in the steady state (an engine's decoding
    phase) the speed-up is tau / (1 + n*c + beta). A whole generation of `steps` plain decoding steps also
    pays its prefill once, in both loops: (prefill + steps) / (spec_prefill + steps / tau * (1 + n*c + beta)),
    with tau the tokens the generation advances per round. `verified`: the share of rounds that verify a
    draft, where the engine decodes a round with an empty draft as a plain step (llama.cpp), which pays no
    beta: 1 + n*c + verified*beta."""
    round_cost = 1 + proposed * c + verified * beta
    if steps is None:
        return acceptance_length / round_cost
    return (prefill + steps) / (spec_prefill + steps / acceptance_length * round_cost)


def expected_acceptance_length(alpha: float, k: float) -> float:
    """tau for an i.i.d. per-guess acceptance rate alpha and k guesses per round: (1 - alpha^(k+1)) / (1 - alpha).
    k may be a mean number of guesses (a drafter that stops early, or proposes nothing in some rounds)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return float(k + 1) if math.isclose(alpha, 1.0) else (1 - alpha ** (k + 1)) / (1 - alpha)


# Prompt-length buckets, in tokens: each four times the last, wide enough that a category's prompts fill few of
# them, narrow enough to part a chat turn (tens of tokens) from a RAG prompt (thousands). A head trained on short
# windows loses acceptance on long prompts (speculators' long-context study: τ 2.30 at 2k tokens, 1.08 at 20k).
LENGTH_EDGES = (128, 512, 2048, 8192, 32768)


def length_bucket(tokens: int) -> str:
    """The label of the bucket a prompt of `tokens` tokens falls in: "<128", "128–511", …, "≥32768"."""
    low = 0
    for edge in LENGTH_EDGES:
        if tokens < edge:
            return f"<{edge}" if low == 0 else f"{low}–{edge - 1}"
        low = edge
    return f"≥{LENGTH_EDGES[-1]}"


def acceptance_by_length(rounds_by_prompt: Sequence[tuple[object, int, Sequence[Round]]], k: int) -> dict[str, dict]:
    """τ split by prompt length: {bucket: {"prompts", "rounds", "tau"}} over (prompt id, prompt tokens, rounds of
    one generation) triples (a prompt measured several times comes once per repeat), buckets in increasing length,
    only those some prompt falls in; "tau" is None where no generation in the bucket drafted a round."""
    groups: dict[int, tuple[set, list[Round], int]] = {}
    for prompt, tokens, rounds in rounds_by_prompt:
        index = sum(tokens >= edge for edge in LENGTH_EDGES)
        prompts, pooled, _ = groups.setdefault(index, (set(), [], tokens))
        prompts.add(prompt)
        pooled.extend(rounds)
    return {length_bucket(tokens): {"prompts": len(prompts), "rounds": len(pooled),
                                    "tau": acceptance_stats(pooled, k).acceptance_length if pooled else None}
            for _, (prompts, pooled, tokens) in sorted(groups.items())}


class PartingGaps:
    """Where a drafter's greedy output parts from plain decoding's (in draftsmith's loop or in an engine):
    draftsmith's target's logit of plain's token minus the drafter's at that position, given the tokens both wrote
    before it (one forward each, cached). Near 0 is a near tie, which the numerics may break either way (scoring
    several positions at once rounds differently from one); a large gap is a token the target does not come close
    to preferring, which no rounding explains."""

    def __init__(self, target, prompts: dict[str, list[list[int]]]) -> None:
        self.target, self.prompts, self._seen = target, prompts, {}
        parameter = next(target.parameters())
        self.device, self.dtype = parameter.device, str(parameter.dtype).removeprefix("torch.")

    @torch.inference_mode()
    def __call__(self, category: str, index: int, plain: list[int], other: list[int]) -> float | None:
        """The gap for prompt `index` of `category` whose plain output is `plain` and the drafter's `other`;
        None where they do not part at a token (one is the other cut short)."""
        part = next((j for j, (a, b) in enumerate(zip(plain, other)) if a != b), None)
        if part is None:
            return None
        key = (category, index, tuple(plain[:part + 1]), other[part])
        if key not in self._seen:
            ids = torch.tensor([self.prompts[category][index] + plain[:part]], device=self.device)
            logits = self.target(input_ids=ids).logits[0, -1].float()
            self._seen[key] = float(logits[plain[part]] - logits[other[part]])
        return self._seen[key]


def parting_note(differs: list[tuple], total: int, runs: dict, plain: dict, gaps: PartingGaps | None) -> str:
    """What a greedy row whose output differs from plain decoding says: on how many of its `total` generations, and,
    with `gaps`, how near a tie of the target's logits each parts at. differs: the keys (repeat, category, prompt
    index) of `runs` and `plain` (token lists under `.tokens`) that differ."""
    line = f"its output differs from plain decoding on {len(differs)} of {total} generations"
    if gaps is not None:
        found = [g for g in (gaps(c, i, plain[r, c, i].tokens, runs[r, c, i].tokens) for r, c, i in differs)
                 if g is not None]
        if found:
            line += (f"; where each parts from plain, draftsmith's target ({gaps.dtype}) scores plain's token above "
                     f"the drafter's by {', '.join(f'{g:.2f}' for g in sorted(found))} (logits; near 0: a near tie)")
    return line
