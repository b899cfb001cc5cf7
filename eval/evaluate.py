"""Measure drafters against plain decoding on the same prompts, per traffic category.

For every sampling temperature, repeat and prompt, plain decoding runs first and then every
(drafter, k) pair on the same prompt, so slow and fast phases of a noisy machine hit all of them alike
(repeats interleaved). Reported throughputs are sums of tokens over sums of seconds within one repeat,
the median over repeats; speed-ups are tokens/s pooled over every repeat and prompt, against plain
decoding's over the same (eval/compare.py says why pooled). A warm-up pass is run first and thrown
away (allocator, kernel selection and page-cache effects).

Every speed-up comes with a 95 % interval from resampling the prompts (eval/compare.py), and so does
every drafter's speed against the baseline and against the fastest drafter of its (k, temperature,
category): whether a lead is larger than the measurement can tell apart from nothing.
"""

from __future__ import annotations

import logging
import statistics
import zlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from drafters.base import Drafter
from drafters.sampling import Sampling
from drafters.tree import StaticTree, TreeShape
from eval.batching import autoregressive_generate_batch, speculative_generate_batch
from eval.compare import Comparison, Timings, compare, tau_counts, verdict
from eval.metrics import (PartingGaps, acceptance_by_length, acceptance_stats, cost_model, expected_acceptance_length,
                          parting_note)
from eval.speculative import Generation, autoregressive_generate, speculative_generate

ALL = "all"  # the aggregate over every category; reserved, no category may use the name
log = logging.getLogger(__name__)


@dataclass
class EvalPlan:
    """What to measure.

    ks: draft lengths to sweep. trees: tree shapes to sweep beside them (drafters/tree.py): EAGLE-2's dynamic
    `d4t4n16` (depth 4, top-4, 16 nodes) or a static `static:0,1,0.0` (rank paths), each measured as a drafter of its own, `<drafter>@<shape>`, for every drafter
    that drafts trees, at batch 1. temperatures: 0 = greedy. top_k / top_p apply to every non-greedy run.
    repeats: timed passes over all prompts (medians over them). warmup: untimed prompts run first.
    pays_off_at: the measured speed-up a configuration must reach to be called worth turning on.
    batch_sizes: decode B prompts of one category at once (eval/batching.py) as a serving engine under
    constant load does: a category's prompts go through B slots, the next joining as a row finishes, and
    extra rows keep every slot busy until the last prompt ends (their tokens are not counted). Each
    prompt's time is its share of every prefill, round and step it took part in.
    """

    ks: list[int] = field(default_factory=lambda: [2, 4])  # draft lengths swept
    trees: list[str] = field(default_factory=list)  # tree shapes beside the chains: d4t4n16, static:0,1,0.0
    batch_sizes: list[int] = field(default_factory=lambda: [1])  # rows decoded at once (eval/batching.py)
    temperatures: list[float] = field(default_factory=lambda: [0.0])  # 0 = greedy
    top_k: int = 0  # sampled runs: keep the k likeliest (0 = all)
    top_p: float = 1.0  # sampled runs: nucleus mass
    max_new_tokens: int = 64  # tokens generated per prompt
    repeats: int = 3  # timed passes over all prompts; medians over them
    warmup: int = 1  # untimed prompts run first
    seed: int = 0  # sampling and prompt selection
    pays_off_at: float = 1.05  # measured speed-up needed for the verdict "pays off"

    def __post_init__(self) -> None:
        if not self.ks or min(self.ks) < 1:
            raise ValueError(f"every k (draft tokens per round) must be >= 1, got ks={list(self.ks)}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.max_new_tokens < 2:
            raise ValueError(f"max_new_tokens must be >= 2 (the first new token comes from the prompt's forward; "
                             f"speculation drafts the ones after it), got {self.max_new_tokens}")
        for t in self.temperatures:
            Sampling(t, self.top_k, self.top_p)  # validates
        for shape in self.trees:
            TreeShape.parse(shape)  # validates
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"every batch size must be >= 1, got batch_sizes={list(self.batch_sizes)}")


@dataclass
class _Runs:
    """Generations of one configuration, keyed by (repeat, category, prompt index)."""

    by_key: dict[tuple[int, str, int], Generation] = field(default_factory=dict)

    def select(self, category: str) -> list[Generation]:
        return [g for (_, c, _), g in self.by_key.items() if category in (ALL, c)]


@dataclass
class TreeDrafter:
    """A drafter measured drafting trees of one shape: rows of its own, named `<drafter>@<shape>`, whose k is the
    tree's depth."""

    parallel = False  # its k guesses cost k draft steps (drafters/base.py `Drafter.parallel`)

    base: Drafter
    shape: TreeShape | StaticTree

    @property
    def name(self) -> str:
        return f"{self.base.name}@{self.shape.label}"


def _ks(drafter, plan: EvalPlan) -> list[int]:
    return [drafter.shape.depth] if isinstance(drafter, TreeDrafter) else list(plan.ks)


def base_drafter(row: dict) -> str:
    """The drafter behind a result row: a tree row's (`<drafter>@<shape>`) is the drafter that drafted it."""
    return row.get("base_drafter") or row["drafter"]


def _seed(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def evaluate(
    target: PreTrainedModel,
    drafters: Sequence[Drafter],
    prompts: dict[str, list[torch.Tensor]],
    plan: EvalPlan,
    *,
    eos_token_id: int | None = None,
    progress: bool = True,
) -> list[dict]:
    """Run plain and speculative decoding on every prompt; return one result row per
    (drafter, k, temperature, category), categories plus "all". The first drafter is the baseline.
    """
    if not drafters:
        raise ValueError("no drafters to evaluate")
    names = [d.name for d in drafters]
    if len(set(names)) != len(names):
        raise ValueError(f"drafter names must be unique, got {names}")
    if ALL in prompts:
        raise ValueError(f"category name {ALL!r} is reserved for the aggregate over all categories")
    if not any(prompts.values()):
        raise ValueError("no prompts to evaluate")
    shapes = [TreeShape.parse(t) for t in plan.trees]
    trees = [TreeDrafter(d, shape) for shape in shapes for d in drafters if hasattr(d, "propose_tree")]
    if shapes and not trees:
        raise ValueError(f"trees={[s.label for s in shapes]}: none of the drafters {names} drafts trees (EAGLE-3 and "
                         "EAGLE-1 heads and draft LMs do)")
    if shapes and len(trees) < len(shapes) * len(drafters):
        log.info("trees: %s draft chains only; their rows are chains", [n for n, d in zip(names, drafters)
                                                                         if not hasattr(d, "propose_tree")])
    rows: list[dict] = []
    for batch in plan.batch_sizes:
        if trees and batch > 1:
            log.warning("trees are verified at batch 1 only: batch %d measures the chains", batch)
        measured = [*drafters, *trees] if batch == 1 else list(drafters)
        rows += _evaluate_batch(target, measured, prompts, plan, batch, eos_token_id=eos_token_id, progress=progress)
    _best_k_and_verdict(rows, plan.pays_off_at)
    _best_shape(rows)
    return rows


def _evaluate_batch(target, drafters, prompts, plan: EvalPlan, batch: int, *, eos_token_id, progress) -> list[dict]:
    """`evaluate` at one batch size: a unit is one prompt (batch 1) or a category's prompts streamed through
    `batch` slots (eval/batching.py, `EvalPlan.batch_sizes`); either way every prompt gets its own Generation,
    so intervals resample prompts at every batch size."""
    names = [d.name for d in drafters]
    device = next(target.parameters()).device
    if batch == 1:
        units = [(c, [i], [p]) for c, ps in prompts.items() for i, p in enumerate(ps)]
        warm = units[: plan.warmup]
    else:
        units = [(c, list(range(len(ps))), ps) for c, ps in prompts.items() if ps]
        batched = {d.name: d.batched() for d in drafters}
        # Warm-up: one batch of the first category's prompts (cycled to fill it), not a whole stream.
        c, _, ps = units[0]
        warm = [(c, list(range(batch)), [ps[r % len(ps)] for r in range(batch)])][: plan.warmup]
    rows: list[dict] = []
    total = (len(plan.temperatures) * plan.repeats * sum(len(i) for _, i, _ in units)
             * (1 + sum(len(_ks(d, plan)) for d in drafters)))
    bar = tqdm(total=total, desc=f"eval (batch {batch})" if batch > 1 else "eval", unit="gen", disable=not progress)
    for temperature in plan.temperatures:
        sampling = Sampling(temperature, plan.top_k, plan.top_p)
        generator = torch.Generator(device=device)

        def run(drafter: Drafter | None, k: int, unit: list[torch.Tensor], seed: int, stream=True) -> list[Generation]:
            generator.manual_seed(seed)
            common = dict(sampling=sampling, max_new_tokens=plan.max_new_tokens, eos_token_id=eos_token_id,
                          generator=generator, timed=True)
            if batch == 1:
                if drafter is None:
                    return [autoregressive_generate(target, unit[0], **common)]
                if isinstance(drafter, TreeDrafter):
                    return [speculative_generate(target, drafter.base, unit[0], k=k, tree=drafter.shape, **common)]
                return [speculative_generate(target, drafter, unit[0], k=k, **common)]
            common.update(slots=batch, keep_full=stream)
            if drafter is None:
                return autoregressive_generate_batch(target, unit, **common).rows
            return speculative_generate_batch(target, batched[drafter.name], unit, k=k, **common).rows

        for _, _, unit in warm:
            run(None, 0, unit, 0, stream=False)
            for drafter in drafters:
                for k in _ks(drafter, plan):
                    run(drafter, k, unit, 0, stream=False)

        plain = _Runs()
        spec = {(d.name, k): _Runs() for d in drafters for k in _ks(d, plan)}
        lengths = {(c, i): int(p.shape[-1]) for c, ps in prompts.items() for i, p in enumerate(ps)}
        # Where a greedy output differs from plain decoding, how near a tie of the target's logits it parts at.
        gaps = PartingGaps(target, {c: [p.tolist() for p in ps] for c, ps in prompts.items()})
        for rep in range(plan.repeats):
            for category, indices, unit in units:
                seed = _seed(plan.seed, temperature, rep, category, indices[0])
                for i, gen in zip(indices, run(None, 0, unit, seed)):
                    plain.by_key[rep, category, i] = gen
                bar.update(len(indices))
                for drafter in drafters:
                    for k in _ks(drafter, plan):
                        for i, gen in zip(indices, run(drafter, k, unit, seed)):
                            spec[drafter.name, k].by_key[rep, category, i] = gen
                        bar.set_postfix_str(f"T={temperature} {category} {drafter.name} k={k}", refresh=False)
                        bar.update(len(indices))

        for category in [*prompts, ALL]:
            keys = [(c, i) for c, indices, _ in units for i in indices if category in (ALL, c)]
            strata = [c for c, _ in keys]
            seed = _seed(plan.seed, temperature, category)
            plain_t = _timings(plain, keys, plan.repeats)
            for k in sorted({k for d in drafters for k in _ks(d, plan)}):
                at_k = [d for d in drafters if k in _ks(d, plan)]
                timings = {d.name: _timings(spec[d.name, k], keys, plan.repeats) for d in at_k}
                kept = {d.name: _tau_counts(spec[d.name, k], keys, plan.repeats) for d in at_k}
                group = [_row(d.name, k, sampling, category, plain, spec[d.name, k], timings[d.name], plain_t,
                              compare(timings[d.name], plain_t, strata, seed=seed), lengths, batch,
                              *((d.shape, d.base.name) if isinstance(d, TreeDrafter) else ()),
                              parallel=d.parallel, gaps=gaps) for d in at_k]
                # Against the first drafter (or, at a tree depth no chain is measured at, the first tree).
                _compare_drafters(group, timings, kept, strata,
                                  baseline=names[0] if names[0] in timings else at_k[0].name, seed=seed)
                rows += group
    bar.close()
    return rows


def _timings(runs: _Runs, keys: list[tuple[str, int]], repeats: int) -> Timings:
    """(repeats, prompts) new tokens and seconds of `runs` over the prompts `keys`, in that order."""
    gens = [[runs.by_key[r, c, i] for c, i in keys] for r in range(repeats)]
    return Timings(np.array([[len(g.tokens) for g in row] for row in gens], dtype=float),
                   np.array([[g.seconds for g in row] for row in gens]))


def _tau_counts(runs: _Runs, keys: list[tuple[str, int]], repeats: int) -> Timings:
    """(repeats, prompts) rounds and kept guesses of `runs` over the prompts `keys`, as `tau_counts` has them."""
    gens = [[runs.by_key[r, c, i] for c, i in keys] for r in range(repeats)]
    return tau_counts(np.array([[len(g.rounds) for g in row] for row in gens]),
                      np.array([[sum(x.accepted for x in g.rounds) for g in row] for row in gens]))


def _row(drafter: str, k: int, sampling: Sampling, category: str, plain: _Runs, spec: _Runs, spec_t: Timings,
         plain_t: Timings, vs_plain: Comparison, lengths: dict[tuple[str, int], int], batch: int = 1,
         tree: TreeShape | StaticTree | None = None, base: str | None = None, parallel: bool = False,
         gaps: PartingGaps | None = None) -> dict:
    gens = spec.select(category)
    rounds = [r for g in gens for r in g.rounds]
    if not rounds:
        raise ValueError(f"drafter {drafter!r}, {category}: every generation ended at its first token (EOS or the "
                         "budget), so no round was drafted; raise max_new_tokens")
    stats = acceptance_stats(rounds, k)
    plain_gens = plain.select(category)
    # Plain steps and speculative rounds per generation: what the prediction charges. At B > 1 a prompt's time
    # is its share of the batch's steps and rounds, 1/B of each, and of its prefill: counted B times, that
    # share is in the units of a whole step.
    steps = statistics.fmean(g.target_forwards - 1 for g in plain_gens)
    spec_rounds = statistics.fmean(g.target_forwards - 1 for g in gens)
    costs = cost_model(rounds, [s for g in plain_gens for s in g.step_s], k, stats.acceptance_length,
                       steps=steps, spec_rounds=spec_rounds,
                       prefill_s=[g.prefill_s * batch for g in plain_gens if g.prefill_s is not None],
                       spec_prefill_s=[g.prefill_s * batch for g in gens if g.prefill_s is not None],
                       parallel=parallel)
    lossless = lossless_note = None
    if sampling.greedy:
        # Greedy speculative decoding must reproduce plain greedy decoding token for token. Where it does not, the
        # note says how near a tie each output parts at: verifying k+1 positions at once rounds otherwise than
        # one, which a near tie can feel (bfloat16 more than float32); a large gap is no rounding.
        keys = [key for key in spec.by_key if category in (ALL, key[1])]
        differs = [key for key in keys if spec.by_key[key].tokens != plain.by_key[key].tokens]
        lossless = not differs
        if differs:
            lossless_note = parting_note(differs, len(keys), spec.by_key, plain.by_key, gaps)
    return {
        "drafter": drafter,
        "k": k,
        "temperature": sampling.temperature,
        "category": category,
        "batch_size": batch,  # rows decoded at once; tokens/s counts every row's tokens
        "prompts": len({key[1:] for key in spec.by_key if category in (ALL, key[1])}),
        # A tree's shape (drafters/tree.py; k is its depth, `mean_proposed` the nodes verified, `acceptance_rate`
        # the kept share of them); None for a chain.
        "tree": tree.label if tree else None,
        "base_drafter": base or drafter,  # the drafter a tree row's shape was drafted by (a chain row's own name)
        **stats.to_dict(),
        # What tau would be if each proposed guess were kept independently at the measured rate (chains only).
        # τ by the prompt's length in tokens (eval/metrics.py LENGTH_EDGES): where a head trained on short windows
        # loses acceptance on long prompts.
        "acceptance_by_length": acceptance_by_length(
            [(key[1:], lengths[key[1:]], gen.rounds) for key, gen in spec.by_key.items() if category in (ALL, key[1])], k),
        "acceptance_length_iid": (None if tree else
                                  expected_acceptance_length(stats.acceptance_rate, stats.mean_proposed)),
        "ar_tokens_per_s": plain_t.median_tokens_per_s(),
        "sd_tokens_per_s": spec_t.median_tokens_per_s(),
        "speedup": vs_plain.ratio,  # pooled sd / ar tokens/s, as eval/compare.py defines
        "speedup_ci": vs_plain.interval,
        "cost_ratio": costs.cost_ratio,
        # Its k guesses in one drafter forward (DFlash, P-EAGLE, PARD): a round's drafting is that forward.
        "parallel": parallel,
        "draft_cost_per_round": costs.draft_round,  # a round's drafting in target steps, as the prediction charges
        "verify_overhead": costs.verify_overhead,
        "round_overhead": costs.round_overhead,  # β as this drafter's rounds verified: what the prediction charges
        "predicted_speedup": costs.predicted_speedup,
        # A prompt's prefill (plain, speculative: the target's prefill, its first token, the drafter's start), in
        # target steps (at B > 1, its share of the batch's prefills counted B times, as above).
        "prefill_steps": costs.prefill,
        "spec_prefill_steps": costs.spec_prefill,
        # Plain steps over speculative rounds per generation: what the prediction charges rounds for.
        "batch_acceptance_length": costs.batch_acceptance_length,
        "lossless": lossless,
        "lossless_note": lossless_note,  # where a greedy output differs: on how many, how near a tie each parts at
    }


def _compare_drafters(group: list[dict], timings: dict[str, Timings], kept: dict[str, Timings], strata: list[str], *,
                      baseline: str, seed: int) -> None:
    """Rows of one (k, temperature, category): each drafter's τ and speed against the baseline's (`kept`: their
    rounds and kept guesses, for τ's interval), and its speed against the fastest drafter's (the highest
    speed-up), on the same prompts."""
    fastest = max(group, key=lambda r: r["speedup"])["drafter"]
    for r in group:
        vs_base = compare(timings[r["drafter"]], timings[baseline], strata, seed=seed)
        vs_fastest = compare(timings[r["drafter"]], timings[fastest], strata, seed=seed)
        standing = "fastest" if r["drafter"] == fastest else vs_fastest.verdict  # "slower", "tied" or too few
        tau = compare(kept[r["drafter"]], kept[baseline], strata, seed=seed)
        r.update(tau_vs_baseline=tau.ratio, tau_vs_baseline_ci=tau.interval,  # the ratio of their acceptance_length
                 speedup_vs_baseline=vs_base.ratio, speedup_vs_baseline_ci=vs_base.interval,
                 fastest=fastest, speedup_vs_fastest=vs_fastest.ratio, speedup_vs_fastest_ci=vs_fastest.interval,
                 vs_fastest=standing)


def _best_shape(rows: list[dict]) -> None:
    """Each row names its drafter's fastest shape per (temperature, category, batch size), chains at every k and
    its trees alike: `best_shape` ("chain k=4", "tree d4t4n16") and that shape's speed-up."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((base_drafter(r), r["temperature"], r["category"], r.get("batch_size", 1)), []).append(r)
    for group in groups.values():
        best = max(group, key=lambda r: r["speedup"])
        chains = {r["k"]: r for r in group if not r.get("tree")}
        why = _why_shape(best, group)
        for r in group:
            r["best_shape"] = f"tree {best['tree']}" if best.get("tree") else f"chain k={best['k']}"
            r["best_shape_speedup"] = best["speedup"]
            r["best_shape_why"] = why
            if r.get("tree"):  # τ over the same drafter's chain of the tree's depth, where one was measured
                chain = chains.get(r["k"])
                r["tau_vs_chain"] = r["acceptance_length"] / chain["acceptance_length"] if chain else None


def _why_shape(best: dict, group: list[dict]) -> str | None:
    """Why the fastest shape won, where trees and chains were both measured: the trees' τ against the chains', and
    what verifying their width cost (β); None without both."""
    trees = [r for r in group if r.get("tree")]
    chains = [r for r in group if not r.get("tree")]
    if not trees or not chains or any(r.get("verify_overhead") is None for r in group):
        return None
    other = max(chains if best.get("tree") else trees, key=lambda r: r["speedup"])
    tree, chain = (best, other) if best.get("tree") else (other, best)
    return (f"tree {tree['tree']} keeps τ {tree['acceptance_length']:.2f} against the chain's "
            f"{chain['acceptance_length']:.2f} (k={chain['k']}) and costs β {tree['verify_overhead']:.2f} for "
            f"{TreeShape.parse(tree['tree']).nodes}+1 positions against {chain['verify_overhead']:.2f} for "
            f"{chain['k']}+1")


def _best_k_and_verdict(rows: list[dict], pays_off_at: float) -> None:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["drafter"], r["temperature"], r["category"], r.get("batch_size", 1)), []).append(r)
    for group in groups.values():
        best = max(group, key=lambda r: r["speedup"])
        for r in group:
            r["best_k"] = best["k"]
            r["verdict"] = verdict(r["speedup"], r["speedup_ci"], pays_off_at)
