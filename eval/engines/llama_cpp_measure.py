"""The drafters measured in llama.cpp (`python -m eval engine=llamacpp`), beside draftsmith's loop and on the
same prompts, k and budget (greedy):

- every drafter that has an engine format (a draft LM, an EAGLE-3 head) served by llama-server on
  127.0.0.1 (eval/engines/llama_cpp.py), the plain server and every speculative one up together, each prompt sent to
  each in turn (the machine's speed drifts over minutes; prompts seconds apart see the same machine);
- the engine's acceptance length from its own counters (1 + accepted drafts per round, its draft calls, from
  the drafting statistics llama-server logs for each request; per verification at B > 1), its
  generation speed (tokens over llama-server's `predicted_ms`: the prompt's processing, the same with and
  without a drafter, is left out) with and without the drafter, the speed-up pooled over prompts and
  repeats with a 95 % interval over prompts (eval/compare.py), its verdict, and whether its greedy output
  equals its plain output (losslessness, in the engine);
- the engine's costs, each from the engine's own clock, measured by a second llama-server per drafter and
  k that drafts and verifies as usual but keeps none of the drafts (llama.cpp's synthetic acceptance for
  benchmarking, `--spec-synth-len 1`; its output is still the plain output), on the first
  `cost_prompts` prompts of each category: c = its drafting time (its `dur(g)` statistic) per drafted
  token over the plain server's time per token; β = the rest of its round, everything the round spends
  outside drafting (the target's forward over k+1 positions, sampling and checking them, the batch and
  cache bookkeeping), over the plain time per token, minus 1. Those costs depend on no acceptance, so
  with draftsmith's τ per category they predict the engine's speed-up, τ / (1 + n·c + β) (n = guesses
  per round), printed beside the one measured with real acceptance. (A bare forward of k+1 tokens, as
  llama-bench times it, leaves out about one target step per round that llama-server spends around it:
  docs/benchmarks/llama-cpp-toy.md.)

With `batch_sizes`, llama.cpp is measured at each batch size B too: llama-server with B slots, each
category's prompts streamed through them as under constant load (`stream`: a client per slot sends the
next prompt as soon as its answer is back, and extra requests keep every slot busy until every prompt is
answered), the plain server and each speculative one alike. A request's generation time is then its own
wall-clock time with the other slots decoding beside it, so pooled tokens over time is the server's
throughput over B, and the speed-up, its interval, the verdict and losslessness are measured per B. The
engine's τ at B is its counters' over each category's stream (the server's, extra requests included); c
and β, and so the prediction, stay batch-1 figures.
"""

from __future__ import annotations

import re
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from eval.engines import llama_cpp
from eval.compare import Timings
from eval.engines.endpoint import stream
from eval.engines.llama_cpp_drafters import Served

_STATS = re.compile(r"statistics\s+\S+: #calls\(b,g,a\) =\s*\d+\s+(\d+)\s+(\d+),.*#gen tokens =\s*(\d+), "
                    r"#acc tokens =\s*(\d+).*dur\(b,g,a\) = [\d.]+, ([\d.]+), [\d.]+ ms")


@dataclass
class DraftStats:
    """llama-server's own drafting counters: rounds (its draft calls), verifications (its accept calls: the
    rounds whose draft was not empty), tokens drafted, drafts accepted, and milliseconds spent drafting. A
    drafter that always drafts verifies every round; one with a confidence stop, or an n-gram mode without a
    match, drafts nothing in some rounds, which the target decodes as plain steps."""

    verifications: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_ms: float = 0.0
    rounds: int = 0

    def __add__(self, other: "DraftStats") -> "DraftStats":
        return DraftStats(self.verifications + other.verifications, self.drafted + other.drafted,
                          self.accepted + other.accepted, self.draft_ms + other.draft_ms, self.rounds + other.rounds)

    def __sub__(self, other: "DraftStats") -> "DraftStats":
        return DraftStats(self.verifications - other.verifications, self.drafted - other.drafted,
                          self.accepted - other.accepted, self.draft_ms - other.draft_ms, self.rounds - other.rounds)


def _counters(groups: tuple[str, ...]) -> DraftStats:
    rounds, verifications, drafted, accepted, draft_ms = groups
    return DraftStats(int(verifications), int(drafted), int(accepted), float(draft_ms), int(rounds))


@dataclass
class RoundCosts:
    """What a server that keeps none of the drafts spent, summed over requests: generation time
    (llama-server's `predicted_ms`), tokens generated and its drafting counters. Each verification then
    emits one token; each request's first token comes from the prompt's forward (not generation time), and
    the last ones of an answer, when too few remain to draft, from plain steps."""

    requests: int = 0
    generation_ms: float = 0.0
    tokens: int = 0
    stats: DraftStats = field(default_factory=DraftStats)

    def add(self, completion: llama_cpp.Completion, stats: DraftStats) -> "RoundCosts":
        return RoundCosts(self.requests + 1, self.generation_ms + completion.predicted_ms,
                          self.tokens + len(completion.tokens), self.stats + stats)

    def c(self, step_ms: float) -> float | None:
        """Drafting time per drafted token, in plain steps."""
        return self.stats.draft_ms / self.stats.drafted / step_ms if self.stats.drafted else None

    def beta(self, step_ms: float) -> float | None:
        """A round's time outside drafting, in plain steps, minus 1: the verification's overhead."""
        if not self.stats.verifications:
            return None
        plain_steps = self.tokens - self.requests - self.stats.verifications
        verify_ms = self.generation_ms - self.stats.draft_ms - max(plain_steps, 0) * step_ms
        return verify_ms / self.stats.verifications / step_ms - 1


class DraftCounters:
    """llama-server's drafting counters as it logs them, reading only what it logged since the last call
    (the whole log each time would be quadratic in the requests of a long evaluation)."""

    def __init__(self, server: llama_cpp.LlamaServer) -> None:
        self.server, self.logged, self.partial, self.last = server, 0, "", None

    def after(self, requests: int, timeout: float = 30.0) -> DraftStats:
        """The counters once the server has logged the statistics of `requests` requests since its start:
        it logs them when it releases the slot, which can be just after its reply."""
        deadline = time.monotonic() + timeout
        while True:
            complete, _, self.partial = (self.partial + self.server.new_log()).rpartition("\n")  # whole lines only
            found = _STATS.findall(complete)
            if found:
                self.logged, self.last = self.logged + len(found), _counters(found[-1])
            if self.logged >= requests:
                return self.last
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server logged drafting statistics for {self.logged} of {requests} requests "
                                   f"in {timeout:.0f} s (it needs -lv 4)")
            time.sleep(0.01)


def measure_llama_cpp(target_gguf: Path, served: list[Served], prompts: dict[str, list[list[int]]], ks: list[int],
                      *, max_new_tokens: int, repeats: int, threads: int, log_dir: Path, cost_prompts: int = 4,
                      progress: bool = True, batch: int = 1) -> dict:
    """Plain and speculative llama-server over every prompt, `repeats` times (each server's first prompt is run
    once untimed); after them, each drafter and k keeping none of its drafts over the first `cost_prompts`
    prompts of each category.

    At batch 1 the configurations are measured side by side: the plain server and every speculative one up at
    once, each prompt sent to each in turn (the order rotating from prompt to prompt), so the speeds compared were
    measured seconds apart, not minutes. (A shared machine's speed drifts over minutes, so plain decoding measured
    once at the start would misprice the rest: docs/benchmarks/smollm2.md, llama.cpp alone.)

    Returns the completions and, for speculative servers, the drafting counters of each request, by
    configuration and (repeat, category, prompt index), the RoundCosts of each configuration, and the
    completions of the servers that kept no drafts (`verified`: the target's own tokens, verified in rounds).

    batch > 1: servers with `batch` slots, each category's prompts streamed through them (`stream`), one
    configuration after another; the drafting counters are then the stream's (the server's, its extra requests
    included), given with the category's first prompt, and the costs are measured at batch 1 only."""
    items = [(c, i, p) for c, ps in prompts.items() for i, p in enumerate(ps)]
    cost_items = [(c, i, p) for c, i, p in items if i < cost_prompts] if batch == 1 else []
    configs = [(s, k) for s in served if s.spec_type is not None for k in s.ks(ks)]
    together = batch == 1
    calibrated = sum(1 for config in configs if not config[0].engine_only)
    bar = tqdm(total=repeats * (len(items) * (len(configs) + 1) + calibrated * len(cost_items)),
               desc="llama.cpp" if batch == 1 else f"llama.cpp (batch {batch})", unit="gen", disable=not progress)
    completions: dict = {}
    counters: dict = {}
    costs: dict = {}
    verified: dict = {}  # the servers that keep no drafts: their completions, by configuration and prompt
    device: list[str] = []  # where the plain server runs the model, from its log
    ctx = max(len(p) for _, _, p in items) + max_new_tokens + 16

    def server(config, rep: int, accept_none: bool = False) -> llama_cpp.LlamaServer:
        spec = {} if config is None else {"draft": config[0].gguf, "spec_type": config[0].spec_type, "k": config[1],
                                          "accept_none": accept_none, "p_min": config[0].p_min}
        name = "plain" if config is None else f"{config[0].name}-k{config[1]}" + ("-accept-none" if accept_none else "")
        name += f"-b{batch}" if batch > 1 else ""
        return llama_cpp.LlamaServer(target_gguf, threads=threads, ctx_size=ctx, log_verbosity=4, parallel=batch,
                                     log_file=log_dir / f"llama-server-{name}-{rep}.log", **spec)

    def serve(config, rep: int, todo: list, accept_none: bool = False):
        """(completion, its drafting counters or None) for each prompt of `todo`, from one server."""
        out = []
        with server(config, rep, accept_none) as running:
            if config is None:
                device.append(running.device())
            running.complete(todo[0][2], max_new_tokens)  # warm-up, untimed
            drafting = DraftCounters(running) if config is not None else None
            before = drafting.after(1) if config is not None else None
            if batch > 1:  # each category's prompts streamed through the slots
                sent = 1
                for category in prompts:
                    chosen = [p for c, _, p in todo if c == category]
                    answers, requests = stream(lambda p: running.complete(p, max_new_tokens), chosen,
                                               running.parallel, bar.update)
                    sent, stats = sent + requests, None
                    if config is not None:
                        now = drafting.after(sent)
                        stats, before = now - before, now
                    # The stream's counters (the server's, its extra requests included) go with the category's
                    # first prompt, zeros with the others: summed over a category, they are the stream's.
                    out += [(a, stats if n == 0 or stats is None else DraftStats()) for n, a in enumerate(answers)]
                return out
            for n, (_, _, prompt) in enumerate(todo, start=2):
                completion, stats = running.complete(prompt, max_new_tokens), None
                if config is not None:
                    now = drafting.after(n)
                    stats, before = now - before, now
                out.append((completion, stats))
                bar.update()
        return out

    def serve_together(rep: int) -> list:
        """For every prompt, the plain completion and each configuration's completion and drafting counters: every
        server up at once, each prompt sent to each in turn (the order rotating from prompt to prompt)."""
        out = []
        with ExitStack() as stack:
            servers = [stack.enter_context(server(config, rep)) for config in [None, *configs]]
            device.append(servers[0].device())
            for running in servers:
                running.complete(items[0][2], max_new_tokens)  # warm-ups, untimed
            drafting = [DraftCounters(running) for running in servers[1:]]
            before = [d.after(1) for d in drafting]
            for n, (_, _, prompt) in enumerate(items):
                answers = [None] * len(servers)
                for j in range(len(servers)):
                    which = (n + j) % len(servers)
                    answers[which] = servers[which].complete(prompt, max_new_tokens)
                    bar.update()
                now = [d.after(n + 2) for d in drafting]
                out.append((answers[0], [(a, b - b0) for a, b, b0 in zip(answers[1:], now, before)]))
                before = now
        return out

    keys = [(config[0].name, config[1]) for config in configs]
    for rep in range(repeats):
        if together:
            for (category, i, _), (reference, answers) in zip(items, serve_together(rep)):
                completions.setdefault("plain", {})[rep, category, i] = reference
                for key, (completion, stats) in zip(keys, answers):
                    completions.setdefault(key, {})[rep, category, i] = completion
                    counters.setdefault(key, {})[rep, category, i] = stats
        else:
            for (category, i, _), (completion, _) in zip(items, serve(None, rep, items)):
                completions.setdefault("plain", {})[rep, category, i] = completion
        for config, key in zip(configs, keys):
            if not together:
                for (category, i, _), (completion, stats) in zip(items, serve(config, rep, items)):
                    completions.setdefault(key, {})[rep, category, i] = completion
                    counters.setdefault(key, {})[rep, category, i] = stats
            # llama.cpp's n-gram modes draft only where the text repeats, so a server that keeps none of their
            # drafts says little of a round's cost: c and β are measured for drafters that always draft.
            if cost_items and not config[0].engine_only:
                for (category, i, _), (completion, stats) in zip(cost_items,
                                                                 serve(config, rep, cost_items, accept_none=True)):
                    costs[key] = costs.get(key, RoundCosts()).add(completion, stats)
                    verified.setdefault(key, {})[rep, category, i] = completion
    bar.close()
    return {"completions": completions, "counters": counters, "costs": costs, "verified": verified,
            "items": [(c, i) for c, i, _ in items], "device": device[0]}


def generation_timings(runs: dict, keys: list[tuple[str, int]], repeats: int) -> Timings:
    gens = [[runs[r, c, i] for c, i in keys] for r in range(repeats)]
    return Timings(np.array([[len(g.tokens) for g in row] for row in gens], dtype=float),
                   np.array([[g.predicted_ms / 1000 for g in row] for row in gens]))
