"""Speculative and plain decoding of B prompts at once, each row accepting its own number of guesses.

Every production engine serves batches, and speculation that pays at batch 1 can lose at batch 32:
verifying k+1 positions per row stops being nearly free once a forward is no longer memory-bound. This
module runs the loop of eval/speculative.py on B rows together, so the cost is measured where it is paid.

**Ragged KV caches.** After a round, row b has kept a_b guesses and row c another number, so the rows'
committed lengths differ. The target decodes on a `RaggedCache` (drafters/hf_cache.py, which explains the
layout): one length per row in one buffer, so a row's rollback is an integer and no prefix is ever
recomputed; a row that finishes leaves the batch, as a request leaves a serving engine's batch, and the
others continue at the smaller batch.

**Equality with batch 1.** Each row computes what it computes alone, but a batched matmul may sum in
another order than a single row's, so logits can differ from batch 1's in the last bits (fp32 on this
CPU: within 1e-5, tests/eval/test_batching.py). A greedy choice flips only on an exact near-tie; the
tests check every row's greedy output against that prompt's plain output at batch 1, token for token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from drafters.hf_cache import RaggedCache, forward_rows
from drafters.layers import RaggedRows
from drafters.sampling import Sampling, choose, probs_from_logits
from eval.speculative import Generation, Round, _finish, _since, _sync, accept_sampled


@dataclass
class BatchRound:
    """One round over the rows still generating: how many, and what it cost (shared by them): drafting,
    verification, and the whole round (both, plus rollback and bookkeeping; None where not timed)."""

    rows: int
    draft_s: float
    verify_s: float
    round_s: float | None = None


@dataclass
class BatchGeneration:
    """Per-row generations (tokens, rounds with each row's own acceptance) and the batch's timings."""

    rows: list[Generation]
    seconds: float
    target_forwards: int
    rounds: list[BatchRound] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)  # plain decoding: one entry per whole batched step
    step_rows: list[int] = field(default_factory=list)  # plain decoding: the rows each step decoded
    prefill_s: float | None = None  # the start until the first step or round (None where not timed)

    @property
    def tokens(self) -> int:
        return sum(len(g.tokens) for g in self.rows)

    @property
    def occupancy(self) -> float | None:
        """The mean share of the batch's rows still running per round (plain decoding: per step)."""
        running = [r.rows for r in self.rounds] or self.step_rows
        return sum(running) / len(running) / len(self.rows) if running else None


def _check_prompts(prompts: list[torch.Tensor]) -> None:
    if not prompts:
        raise ValueError("no prompts to decode")
    if any(p.numel() == 0 for p in prompts):
        raise ValueError("a prompt is empty: decoding needs at least one token to start from")


def _choose_rows(logits: torch.Tensor, sampling: Sampling, generator) -> list[int]:
    """One token per row from (B, V) logits, every row at once."""
    return choose(logits, sampling, generator).tolist()


@torch.inference_mode()
def autoregressive_generate_batch(target: PreTrainedModel, prompts: list[torch.Tensor], *, sampling: Sampling,
                                  max_new_tokens: int, eos_token_id: int | None = None,
                                  generator: torch.Generator | None = None, timed: bool = False) -> BatchGeneration:
    """Plain decoding of the prompts as one batch, one token per row per forward; rows leave when done."""
    _check_prompts(prompts)
    device = prompts[0].device
    clock = time.perf_counter
    t_start = clock()
    rows = RaggedRows(len(prompts), device)
    cache = RaggedCache(target, rows)
    logits, _, _ = forward_rows(target, [p.tolist() for p in prompts], cache, logits_for="last")
    new: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))  # the prompt index of each row of the batch
    forwards, steps, step_rows = 1, [], []
    prefill_s = _since(t_start, device, timed)
    while True:
        t0 = clock()  # a step: choose every row's token, then the forward that gives the next logits
        tokens = _choose_rows(logits, sampling, generator)
        still = []
        for row, (index, token) in enumerate(zip(live, tokens)):
            new[index].append(token)
            if len(new[index]) < max_new_tokens and token != eos_token_id:
                still.append(row)
        if not still:
            break
        if len(still) < len(live):
            rows.select(still)
            live, tokens = [live[r] for r in still], [tokens[r] for r in still]
        step_rows.append(len(live))
        logits, _, _ = forward_rows(target, [[t] for t in tokens], cache, logits_for="all")
        logits = logits[:, -1]
        if timed:
            _sync(device)
            steps.append(clock() - t0)
        forwards += 1
    _sync(device)
    seconds = clock() - t_start
    return BatchGeneration([Generation(tokens, seconds, forwards) for tokens in new], seconds, forwards, step_s=steps,
                           step_rows=step_rows, prefill_s=prefill_s)


@torch.inference_mode()
def speculative_generate_batch(target: PreTrainedModel, drafter, prompts: list[torch.Tensor], *, k: int,
                               sampling: Sampling, max_new_tokens: int, eos_token_id: int | None = None,
                               generator: torch.Generator | None = None, timed: bool = False) -> BatchGeneration:
    """eval/speculative.py's loop on the prompts as one batch: every round the drafter proposes up to k
    guesses per row (`drafters.base.BatchDrafter`), the target verifies all rows in ONE forward of
    max(n_b) + 1 positions per row, and each row keeps its own accepted prefix plus one target token."""
    if k < 1:
        raise ValueError(f"k (draft tokens per round) must be >= 1, got {k}")
    _check_prompts(prompts)
    device = prompts[0].device
    clock = time.perf_counter
    t_start = clock()
    layers = getattr(drafter, "feature_layers", None)
    rows = RaggedRows(len(prompts), device)
    cache = RaggedCache(target, rows)
    logits, features, counts = forward_rows(target, [p.tolist() for p in prompts], cache, logits_for="last",
                                            layers=layers)
    firsts = _choose_rows(logits, sampling, generator)
    forwards = 1
    new: list[list[int]] = [[] for _ in prompts]
    row_rounds: list[list[Round]] = [[] for _ in prompts]
    live, lasts = [], []  # the prompt index of each row still generating, and its last token
    for index, first in enumerate(firsts):
        new[index], done = _finish([first], max_new_tokens, eos_token_id)
        if not done:
            live.append(index)
            lasts.append(first)
    batch_rounds: list[BatchRound] = []
    if live:
        if len(live) < len(prompts):
            rows.select(live)  # the prefill's rows are the prompts, in order
        committed = [torch.cat([prompts[i], prompts[i].new_tensor([new[i][0]])]) for i in live]
        # A head reads the features of every prompt position (all committed positions but the first new token's).
        drafter.start(committed, [features[i, : counts[i]] for i in live] if layers else None)
    prefill_s = _since(t_start, device, timed)
    while live:
        if timed:
            _sync(device)
        t0 = clock()
        proposals = drafter.propose(k, sampling, generator)
        if any(len(p) > k for p in proposals):
            raise RuntimeError(f"drafter {drafter.name!r} proposed more than k={k} tokens")
        if timed:
            _sync(device)
        t1 = clock()
        guesses = [p.tokens.tolist() for p in proposals]
        logits, features, _ = forward_rows(target, [[last, *g] for last, g in zip(lasts, guesses)], cache,
                                           logits_for="all", layers=layers)
        forwards += 1
        accepted, nexts = _accept_rows(proposals, guesses, logits, sampling, generator)
        t2 = clock()
        still, ended = [], []
        for row, index in enumerate(live):
            a, g = accepted[row], guesses[row]
            kept = g.index(eos_token_id) + 1 if eos_token_id is not None and eos_token_id in g[:a] else a
            ended.append(Round(len(g), min(kept, max_new_tokens - len(new[index])), t1 - t0, t2 - t1))
            new[index], done = _finish(new[index] + g[:a] + [nexts[row]], max_new_tokens, eos_token_id)
            if not done:
                still.append(row)
        # The target's rows hold the previous length plus all n_b + 1 fed entries; keep last + accepted.
        rows.crop([length - (len(g) + 1) + a + 1 for length, g, a in zip(rows.lengths, guesses, accepted)])
        drafter.commit(accepted, nexts, [features[r, : a + 1] for r, a in enumerate(accepted)] if layers else None)
        if still and len(still) < len(live):  # finished rows leave the batch
            rows.select(still)
            drafter.keep(still)
        round_s = _since(t0, device, timed)
        batch_rounds.append(BatchRound(len(live), t1 - t0, t2 - t1, round_s))
        for index, r in zip(live, ended):
            r.round_s = round_s
            row_rounds[index].append(r)
        live, lasts = [live[r] for r in still], [nexts[r] for r in still]
    _sync(device)
    seconds = clock() - t_start
    return BatchGeneration([Generation(tokens, seconds, len(r) + 1, r) for tokens, r in zip(new, row_rounds)],
                           seconds, forwards, batch_rounds, prefill_s=prefill_s)


def _accept_rows(proposals, guesses, logits, sampling: Sampling, generator) -> tuple[list[int], list[int]]:
    """Each row's accepted count and next token from the batch's verification logits (B, q, V)."""
    if sampling.greedy:
        choice = logits.argmax(-1)  # (B, q)
        q = choice.shape[1]
        drafted = torch.full_like(choice, -1)
        for row, g in enumerate(guesses):
            if g:
                drafted[row, : len(g)] = proposals[row].tokens
        accepted = (drafted[:, : q - 1] == choice[:, : q - 1]).int().cumprod(1).sum(1)  # padding never matches
        nexts = choice.gather(1, accepted[:, None])[:, 0]
        both = torch.stack([accepted, nexts]).tolist()  # one host sync for the batch
        return both[0], both[1]
    accepted, nexts = [], []
    for row, (proposal, g) in enumerate(zip(proposals, guesses)):
        target_probs = probs_from_logits(logits[row, : len(g) + 1], sampling)
        a, t = accept_sampled(proposal.tokens, proposal.probs, target_probs, generator)
        accepted.append(a)
        nexts.append(t)
    return accepted, nexts
