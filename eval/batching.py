"""Speculative and plain decoding of B prompts at once, each row accepting its own number of guesses.

Every production engine serves batches, and speculation that pays at batch 1 can lose at batch 32:
verifying k+1 positions per row stops being nearly free once a forward is no longer memory-bound. This
module runs the loop of eval/speculative.py on B rows together, so the cost is measured where it is paid.

**Ragged KV caches.** After a round, row b has kept a_b guesses and row c another number, so the rows'
committed lengths differ. The target decodes on a `RaggedCache` (drafters/hf_cache.py, which explains the
layout): one length per row in one buffer, so a row's rollback is an integer and no prefix is ever
recomputed.

**Continuous batching.** `slots` rows decode at once (default: every prompt). A row that finishes leaves
the batch, as a request leaves a serving engine's batch, and the next prompt joins before the next round:
its prefill runs on a cache of its own (with the drafter's start on it, `BatchDrafter.join`), whose rows
the running batch then takes over (`RaggedCache.absorb`). Rows that finish at different rounds therefore
never leave a slot empty while prompts wait. With `keep_full`, extra rows cycling through the prompts keep
every slot busy until the last prompt ends (they are dropped from the result): every round decodes `slots`
rows, the steady state of an engine under constant load, without a batch's emptying tail that a finite
benchmark would otherwise add.

**Time per prompt.** Each prefill, round and plain step is timed whole and shared equally among the rows
it served; a prompt's `seconds` is the sum of its shares (its `prefill_s`, the share of its prefill), so
tokens over seconds pooled over prompts is the batch's throughput, and intervals resample prompts.

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
from drafters.kv_cache import RaggedRows
from drafters.sampling import Sampling, choose, probs_from_logits
from eval.speculative import Generation, Round, _finish, _sync, accept_sampled


@dataclass
class BatchRound:
    """One round over the rows decoding: how many, and what it cost (shared by them): drafting,
    verification, and the whole round (both, plus rollback and bookkeeping; None where not timed)."""

    rows: int
    draft_s: float
    verify_s: float
    round_s: float | None = None


@dataclass
class BatchGeneration:
    """One Generation per prompt, in order (its tokens, its rounds with its own acceptance, and its share of
    the time: `seconds` and `prefill_s`, module docstring), and the run's own timings."""

    rows: list[Generation]
    seconds: float  # the whole run, wall clock
    target_forwards: int
    slots: int  # rows decoded at once
    rounds: list[BatchRound] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)  # plain decoding: one entry per whole batched step
    step_rows: list[int] = field(default_factory=list)  # plain decoding: the rows each step decoded
    prefill_s: float | None = None  # every prefill (requests joining) together; None where not timed

    @property
    def tokens(self) -> int:
        return sum(len(g.tokens) for g in self.rows)

    @property
    def occupancy(self) -> float | None:
        """The mean share of the slots decoding per round (plain decoding: per step)."""
        running = [r.rows for r in self.rounds] or self.step_rows
        return sum(running) / len(running) / self.slots if running else None


class _Requests:
    """The prompts in order, then (`keep_full`) extra rows cycling through them while any prompt is
    unfinished; per request, its tokens and its share of the time."""

    def __init__(self, prompts: list[torch.Tensor], slots: int | None, keep_full: bool) -> None:
        if not prompts:
            raise ValueError("no prompts to decode")
        if any(p.numel() == 0 for p in prompts):
            raise ValueError("a prompt is empty: decoding needs at least one token to start from")
        self.prompts, self.keep_full = prompts, keep_full
        self.slots = len(prompts) if slots is None else slots
        if self.slots < 1:
            raise ValueError(f"slots (rows decoded at once) must be >= 1, got {self.slots}")
        self.admitted = 0  # requests started so far; request i decodes prompts[i % len(prompts)]
        self.tokens: list[list[int]] = []
        self.seconds: list[float] = []
        self.prefill: list[float] = []
        self.step_s: list[list[float]] = []  # plain decoding: the timed steps each request took part in
        self.open = len(prompts)  # prompts not finished yet

    def next(self, count: int) -> list[int]:
        """Up to `count` requests to start now."""
        last = self.admitted + count if self.keep_full and self.open else min(self.admitted + count, len(self.prompts))
        chosen = list(range(self.admitted, last))
        self.admitted = last
        self.tokens += [[] for _ in chosen]
        self.seconds += [0.0 for _ in chosen]
        self.prefill += [0.0 for _ in chosen]
        self.step_s += [[] for _ in chosen]
        return chosen

    def prompt(self, request: int) -> torch.Tensor:
        return self.prompts[request % len(self.prompts)]

    def charge(self, requests: list[int], seconds: float, prefill: bool = False) -> None:
        """Share `seconds` (a prefill, a round or a step) equally among the requests it served."""
        for r in requests:
            self.seconds[r] += seconds / len(requests)
            if prefill:
                self.prefill[r] += seconds / len(requests)

    def finished(self, request: int) -> None:
        if request < len(self.prompts):
            self.open -= 1

    def done(self) -> bool:
        return self.open == 0


def _choose_rows(logits: torch.Tensor, sampling: Sampling, generator) -> list[int]:
    """One token per row from (B, V) logits, every row at once."""
    return choose(logits, sampling, generator).tolist()


@torch.inference_mode()
def autoregressive_generate_batch(target: PreTrainedModel, prompts: list[torch.Tensor], *, sampling: Sampling,
                                  max_new_tokens: int, eos_token_id: int | None = None,
                                  generator: torch.Generator | None = None, timed: bool = False,
                                  slots: int | None = None, keep_full: bool = False) -> BatchGeneration:
    """Plain decoding of the prompts, `slots` rows at once (default: all), one token per row per forward;
    a row that finishes leaves and the next prompt joins (module docstring)."""
    requests = _Requests(prompts, slots, keep_full)
    device = prompts[0].device
    clock = time.perf_counter
    t_start = clock()
    rows = cache = logits = None
    live: list[int] = []  # the request each row of the batch decodes
    forwards, steps, step_rows, prefill_s = 0, [], [], 0.0
    while not requests.done():
        joined = requests.next(requests.slots - len(live))
        if joined:  # their prefill on a cache of their own, whose rows then join the batch's
            t0 = clock()
            fresh = RaggedRows(len(joined), device)
            fresh_cache = RaggedCache(target, fresh)
            first, _, _ = forward_rows(target, [requests.prompt(r).tolist() for r in joined], fresh_cache,
                                       logits_for="last")
            forwards += 1
            if live:
                cache.absorb(fresh_cache)
                rows.extend(fresh)
                logits = torch.cat([logits, first])
            else:
                rows, cache, logits = fresh, fresh_cache, first
            live += joined
            seconds = _elapsed(t0, device, timed)
            prefill_s += seconds
            requests.charge(joined, seconds, prefill=True)
        t0 = clock()  # a step: choose every row's token, then the forward that gives the next logits
        tokens = _choose_rows(logits, sampling, generator)
        still = []
        for row, (request, token) in enumerate(zip(live, tokens)):
            requests.tokens[request].append(token)
            if len(requests.tokens[request]) < max_new_tokens and token != eos_token_id:
                still.append(row)
            else:
                requests.finished(request)
        stepped = live
        if still and not requests.done():
            if len(still) < len(live):
                rows.select(still)
                live, tokens = [live[r] for r in still], [tokens[r] for r in still]
            step_rows.append(len(live))
            logits, _, _ = forward_rows(target, [[t] for t in tokens], cache, logits_for="all")
            logits = logits[:, -1]
            forwards += 1
        else:
            live = []
        seconds = _elapsed(t0, device, timed)
        requests.charge(stepped, seconds)
        if live and timed:
            steps.append(seconds)
            for request in live:
                requests.step_s[request].append(seconds)
    _sync(device)
    return _result(requests, clock() - t_start, forwards, timed, step_s=steps, step_rows=step_rows,
                   prefill_s=prefill_s, plain=True)


@torch.inference_mode()
def speculative_generate_batch(target: PreTrainedModel, drafter, prompts: list[torch.Tensor], *, k: int,
                               sampling: Sampling, max_new_tokens: int, eos_token_id: int | None = None,
                               generator: torch.Generator | None = None, timed: bool = False,
                               slots: int | None = None, keep_full: bool = False) -> BatchGeneration:
    """eval/speculative.py's loop on `slots` rows at once (default: every prompt): every round the drafter
    proposes up to k guesses per row (`drafters.base.BatchDrafter`), the target verifies all rows in ONE
    forward of max(n_b) + 1 positions per row, and each row keeps its own accepted prefix plus one target
    token. A row that finishes leaves and the next prompt joins (module docstring)."""
    if k < 1:
        raise ValueError(f"k (draft tokens per round) must be >= 1, got {k}")
    requests = _Requests(prompts, slots, keep_full)
    device = prompts[0].device
    clock = time.perf_counter
    t_start = clock()
    layers = getattr(drafter, "feature_layers", None)
    rows = cache = None
    live, lasts = [], []  # the request each row decodes, and its last token
    row_rounds: dict[int, list[Round]] = {}
    batch_rounds: list[BatchRound] = []
    forwards, prefill_s = 0, 0.0
    while not requests.done():
        while len(live) < requests.slots and not requests.done():  # requests join: their prefill, then their rows
            joined = requests.next(requests.slots - len(live))
            if not joined:
                break
            t0 = clock()
            fresh = RaggedRows(len(joined), device)
            fresh_cache = RaggedCache(target, fresh)
            logits, features, counts = forward_rows(target, [requests.prompt(r).tolist() for r in joined],
                                                    fresh_cache, logits_for="last", layers=layers)
            forwards += 1
            staying = []  # rows whose first token (from the prefill) does not already end them
            for row, (request, first) in enumerate(zip(joined, _choose_rows(logits, sampling, generator))):
                requests.tokens[request], done = _finish([first], max_new_tokens, eos_token_id)
                row_rounds[request] = []
                if done:
                    requests.finished(request)
                else:
                    staying.append(row)
                    lasts.append(first)
            if staying:
                if len(staying) < len(joined):
                    fresh.select(staying)
                ids = [torch.cat([requests.prompt(joined[r]), requests.prompt(joined[r]).new_tensor(
                    [requests.tokens[joined[r]][0]])]) for r in staying]
                # A head reads the features of every prompt position (all committed positions but the first new token's).
                feats = [features[r, : counts[r]] for r in staying] if layers else None
                if live:
                    cache.absorb(fresh_cache)
                    rows.extend(fresh)
                    drafter.join(ids, feats)
                else:
                    rows, cache = fresh, fresh_cache
                    drafter.start(ids, feats)
                live += [joined[r] for r in staying]
            seconds = _elapsed(t0, device, timed)
            prefill_s += seconds
            requests.charge(joined, seconds, prefill=True)
        if not live:
            break
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
        for row, request in enumerate(live):
            a, g = accepted[row], guesses[row]
            new = requests.tokens[request]
            kept = g.index(eos_token_id) + 1 if eos_token_id is not None and eos_token_id in g[:a] else a
            ended.append(Round(len(g), min(kept, max_new_tokens - len(new)), t1 - t0, t2 - t1))
            requests.tokens[request], done = _finish(new + g[:a] + [nexts[row]], max_new_tokens, eos_token_id)
            if done:
                requests.finished(request)
            else:
                still.append(row)
        # The target's rows hold the previous length plus all n_b + 1 fed entries; keep last + accepted.
        rows.crop([length - (len(g) + 1) + a + 1 for length, g, a in zip(rows.lengths, guesses, accepted)])
        drafter.commit(accepted, nexts, [features[r, : a + 1] for r, a in enumerate(accepted)] if layers else None)
        if still and len(still) < len(live):  # finished rows leave the batch
            rows.select(still)
            drafter.keep(still)
        seconds = _elapsed(t0, device, timed)
        round_s = seconds if timed else None
        batch_rounds.append(BatchRound(len(live), t1 - t0, t2 - t1, round_s))
        requests.charge(live, seconds)
        for request, r in zip(live, ended):
            r.round_s = round_s
            row_rounds[request].append(r)
        live, lasts = [live[r] for r in still], [nexts[r] for r in still]
    _sync(device)
    return _result(requests, clock() - t_start, forwards, timed, rounds=row_rounds, batch_rounds=batch_rounds,
                   prefill_s=prefill_s)


def _elapsed(start: float, device: torch.device, timed: bool) -> float:
    """Seconds since `start`, the device's work finished first when timed."""
    if timed:
        _sync(device)
    return time.perf_counter() - start


def _result(requests: _Requests, seconds: float, forwards: int, timed: bool, *, rounds=None, batch_rounds=(),
            step_s=(), step_rows=(), prefill_s: float = 0.0, plain: bool = False) -> BatchGeneration:
    """The prompts' Generations (requests beyond them, `keep_full`'s extra rows, are dropped) and the run's."""
    n = len(requests.prompts)
    gens = []
    for r in range(n):
        tokens = requests.tokens[r]
        own = [] if rounds is None else rounds[r]
        gens.append(Generation(tokens, requests.seconds[r], (len(tokens) if plain else len(own) + 1), own,
                               requests.step_s[r], requests.prefill[r] if timed else None))
    return BatchGeneration(gens, seconds, forwards, requests.slots, list(batch_rounds), list(step_s), list(step_rows),
                           prefill_s if timed else None)


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
