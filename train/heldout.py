"""The held-out numbers every recipe chooses its best checkpoint by, the same for every drafter kind.

A kind scores a batch of held-out records (`Recipe._score_heldout`) into `HeldoutScores`: per draft depth d
(the guess d tokens past the target's own one), sums of the expected acceptance sum_x min(p, q) and of greedy
agreement with the target, their count, and the grid of greedy hits. `HeldoutTotals` adds batches up and turns
them into the figures a run logs:

- `heldout_tokens_per_round`: 1 + sum_d prod_{r<=d} alpha_r, the tokens a round keeps when sampling, alpha_r the
  expected acceptance at depth r;
- `heldout_tau_greedy` (over all and per category): greedy chain drafting replayed on the held-out answers
  (`greedy_rounds`), which the loop measures exactly where those answers are the target's greedy output;
- `heldout_acceptance`, `heldout_top1` (depth 0), `heldout_step_acceptance` (every depth) and
  `heldout_tokens_per_round_greedy` (the estimate from top-1 agreement) beside them.

`trainer.select_by` names one of the two for every kind (`SELECT_BY`): `acceptance` keeps the checkpoint with the
most tokens per round when sampling, `top1` the one with the highest replayed greedy τ.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# trainer.select_by -> the figure (without its `heldout_` prefix) the best checkpoint has the highest of.
SELECT_BY = {"acceptance": "tokens_per_round", "top1": "tau_greedy"}


def tokens_per_round_estimate(alphas: list[float]) -> float:
    """1 + sum_s prod_{r<=s} alpha_r: expected tokens per round if step s is accepted with alpha_s."""
    total, prod = 1.0, 1.0
    for a in alphas:
        prod *= a
        total += prod
    return total


def greedy_rounds(hits: list[torch.Tensor], answer: torch.Tensor) -> list[tuple[int, int]]:
    """Greedy chain drafting at k = len(hits), replayed on teacher-forced answers: (tokens, rounds) per row.

    hits[s][b, e]: the drafter's guess of step s from entry e (the target's features through position e,
    tokens through e+1) is the target's greedy token e+s+2; answer (B, T): the assistant tokens. A round
    starts at an entry whose next two tokens are answer tokens (the first comes from the target), keeps
    the leading run of hits, and yields it plus the target's own token, so the next round starts that
    many entries on. Where the answers are the target's greedy output, this is the τ greedy serving
    measures on them: unlike 1 + a1 + a1·a2 + ..., it keeps how misses cluster (a round starts right
    after one)."""
    steps = [h.cpu() for h in hits]
    answer = answer.bool().cpu()
    out = []
    for b in range(answer.shape[0]):
        row, e, T = answer[b].tolist(), 0, answer.shape[1]
        tokens = rounds = 0
        while e + 2 < T:
            if not (row[e + 1] and row[e + 2]):
                e += 1
                continue
            kept = 0
            while kept < len(steps) and e + kept + 2 < T and row[e + kept + 2] and bool(steps[kept][b, e]):
                kept += 1
            tokens, rounds = tokens + kept + 1, rounds + 1
            e += kept + 1
        out.append((tokens, rounds))
    return out


@dataclass
class HeldoutScores:
    """One batch of held-out records as a kind scores it: per depth d, the sums over the positions it scores of
    sum_x min(p, q) (`accept`) and of greedy agreement (`top1`), how many (`count`), and `hits[d]` (B, T) bool, as
    `greedy_rounds` reads them."""

    accept: list[float]
    top1: list[float]
    count: list[float]
    hits: list[torch.Tensor]


@dataclass
class HeldoutTotals:
    """Held-out scores added up over the batches of one evaluation, with each record's replayed rounds."""

    sums: torch.Tensor | None = None  # (3, depths) float64: accept, top1, count
    per_record: list[tuple[str, int, int]] = field(default_factory=list)  # (category, tokens, rounds), in order

    def add(self, scores: HeldoutScores, categories: list[str], answer: torch.Tensor) -> None:
        """Add a batch's `scores`; `categories` and `answer` (B, T: its assistant tokens) are its records'."""
        sums = torch.tensor([scores.accept, scores.top1, scores.count], dtype=torch.float64)
        self.sums = sums if self.sums is None else self.sums + sums
        for category, (tokens, rounds) in zip(categories, greedy_rounds(scores.hits, answer)):
            self.per_record.append((category, tokens, rounds))

    def figures(self) -> dict:
        """The `heldout_*` figures of the module docstring. Depths no held-out answer reaches (answers shorter than
        the depths) have none: the estimates stop there."""
        counts = self.sums[2] if self.sums is not None else torch.zeros(1)
        reached = int((counts > 0).long().cumprod(0).sum())
        if not reached:
            raise ValueError("no held-out record has an answer token to score: the held-out set has no answers")
        alphas = (self.sums[0, :reached] / counts[:reached]).tolist()
        top1 = (self.sums[1, :reached] / counts[:reached]).tolist()
        replayed: dict[str, list[int]] = {}
        for category, tokens, rounds in self.per_record:
            total = replayed.setdefault(category, [0, 0])
            total[0], total[1] = total[0] + tokens, total[1] + rounds
        tokens, rounds = (sum(t[i] for t in replayed.values()) for i in (0, 1))
        return {"heldout_acceptance": alphas[0], "heldout_top1": top1[0],
                "heldout_step_acceptance": [round(a, 4) for a in alphas],
                "heldout_step_top1": [round(a, 4) for a in top1],
                "heldout_tokens_per_round": tokens_per_round_estimate(alphas),
                "heldout_tokens_per_round_greedy": tokens_per_round_estimate(top1),
                "heldout_tau_greedy": tokens / max(rounds, 1),
                "heldout_tau_greedy_by_category": {c: round(t / max(r, 1), 4) for c, (t, r) in sorted(replayed.items())}}


def best_record(figures: dict, step: int) -> dict:
    """What best.json (and a checkpoint's `best`) keeps of a held-out evaluation's `figures` at `step`."""
    return {"acceptance": figures["heldout_acceptance"], "top1": figures["heldout_top1"], "step": step,
            "acceptance_per_depth": figures["heldout_step_acceptance"], "top1_per_depth": figures["heldout_step_top1"],
            "tokens_per_round": figures["heldout_tokens_per_round"],
            "tokens_per_round_greedy": figures["heldout_tokens_per_round_greedy"],
            "tau_greedy": figures["heldout_tau_greedy"]}
