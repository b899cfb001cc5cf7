"""Is one configuration really faster than another? Paired speed ratios with bootstrap intervals.

The evaluation runs plain decoding and every (drafter, k) on the same prompts, interleaved per prompt,
so two configurations are compared prompt by prompt on the same machine state. A speed ratio is

    (sum_{r,p} tokens_A[r, p] / sum_{r,p} seconds_A[r, p]) / (sum_{r,p} tokens_B[r, p] / sum_{r,p} seconds_B[r, p])

over the repeats r and the prompts p of a category: tokens/s pooled over the whole measurement. A
drafter's `speedup` is this ratio against plain decoding. Pooled ratios compose: A against B is exactly
speedup_A / speedup_B, so the drafter with the highest speed-up is never slower than another one
(a median over repeats of per-repeat ratios does not compose, and could call one drafter the fastest
while another measured faster than it).

Measured on a few prompts the ratio is an estimate. Its 95 % interval resamples the prompts with
replacement (Efron's bootstrap), the same prompts for A and B so the pairing is kept, and within each
category separately so the aggregate keeps the traffic's mix; each prompt keeps all its repeats. The
plain percentile interval is too narrow on few prompts (the bootstrap's variance is (n-1)/n of the
true one, and its tails are the normal's): two equally fast drafters measured on 8 prompts were called
different in 14 % of simulated measurements instead of 5 % (`scripts/bench_compare.py`). So the
percentile interval of log(ratio) is widened around the estimate by sqrt(n / df) * t_df / z, with
df = prompts - categories, which brings that to 6.5 % on 8 prompts and 5 % on 20 and 48.
The interval covers how much the ratio moves with the choice of prompts and with the timing noise
inside this run. It cannot cover a machine that is faster or slower as a whole in another run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import stats

LEVEL = 0.95
RESAMPLES = 2000


@dataclass
class Timings:
    """One configuration's new tokens and seconds, shape (repeats, prompts); every configuration
    compared with it lists the same prompts in the same order."""

    tokens: np.ndarray
    seconds: np.ndarray

    def median_tokens_per_s(self) -> float:
        """Tokens over seconds within each repeat, the median over repeats."""
        return float(np.median(self.tokens.sum(1) / self.seconds.sum(1)))


@dataclass
class Comparison:
    """A's speed over B's: the ratio, its interval (None with fewer than 2 prompts in a category) and
    the verdict: "faster" or "slower" when the interval excludes 1, "tied" when it holds 1,
    "too few prompts" without an interval."""

    ratio: float
    low: float | None
    high: float | None
    verdict: str

    @property
    def interval(self) -> list[float] | None:
        return None if self.low is None else [self.low, self.high]


UNDECIDED = "undecided: measure more prompts or repeats"


def verdict(ratio: float, interval: Sequence[float] | None, pays_off_at: float) -> str:
    """Whether to turn speculation on: "pays off" at a speed-up of at least `pays_off_at`, else "turn it off";
    but where the 95 % interval holds 1 (or there is none: one prompt in a category), the measurement cannot
    tell faster from slower, and the verdict says so instead of guessing from the point estimate."""
    if interval is None or interval[0] <= 1.0 <= interval[1]:
        return UNDECIDED
    return "pays off" if ratio >= pays_off_at else "turn it off"


def tau_counts(rounds: np.ndarray, accepted: np.ndarray) -> Timings:
    """A drafter's τ in the form `compare` reads, shape (repeats, prompts): each prompt's rounds and the guesses
    they kept. τ = 1 + kept guesses per round = (rounds + kept) / rounds, the pooled ratio of the module docstring
    with rounds in place of seconds, so `compare` of two of them is the ratio of their τ on the same prompts, with
    the same paired interval."""
    rounds = np.asarray(rounds, dtype=float)
    return Timings(rounds + np.asarray(accepted, dtype=float), rounds)


def speed_ratio(a: Timings, b: Timings, samples: np.ndarray,
                baselines: tuple[Timings, Timings] | None = None) -> np.ndarray:
    """The statistic of the module docstring for each row of `samples` (S, n), prompt indices; (S,). With
    `baselines` (A's and B's own baselines, each measured beside it), A's speed-up over its baseline over B's."""
    def throughput(t: Timings) -> np.ndarray:  # (S,): tokens / seconds over every repeat of the drawn prompts
        return t.tokens[:, samples].sum((0, -1)) / t.seconds[:, samples].sum((0, -1))

    ratio = throughput(a) / throughput(b)
    if baselines is not None:
        ratio = ratio * throughput(baselines[1]) / throughput(baselines[0])
    return ratio


def compare(a: Timings, b: Timings, strata: Sequence[str], *, baselines: tuple[Timings, Timings] | None = None,
            level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0, widen: bool = True) -> Comparison:
    """A's speed over B's on the same prompts; `strata[p]` is prompt p's category (resampled apart). With
    `baselines` (A's and B's own, each measured beside it, A and B measured apart): A's speed-up over its baseline
    over B's, so a machine faster or slower as a whole between A's measurement and B's cancels.
    `widen=False` gives the plain percentile interval (for measuring what the widening does)."""
    for t in (b, *(baselines or ())):
        if t.tokens.shape != a.tokens.shape or t.seconds.shape != t.tokens.shape or a.seconds.shape != a.tokens.shape:
            raise ValueError(f"timings of different shapes: {a.tokens.shape} against {t.tokens.shape}")
    if len(strata) != a.tokens.shape[1]:
        raise ValueError(f"{len(strata)} categories for {a.tokens.shape[1]} prompts")
    ratio = float(speed_ratio(a, b, np.arange(len(strata))[None], baselines)[0])
    groups = [np.flatnonzero(np.asarray(strata) == s) for s in dict.fromkeys(strata)]
    if min(len(g) for g in groups) < 2:  # one prompt says nothing about how much the ratio varies
        return Comparison(ratio, None, None, "too few prompts")
    rng = np.random.default_rng(seed)
    samples = np.concatenate([rng.choice(g, size=(resamples, len(g))) for g in groups], axis=1)
    tails = np.log(np.quantile(speed_ratio(a, b, samples, baselines), [(1 - level) / 2, (1 + level) / 2]))
    n, df = len(strata), len(strata) - len(groups)
    factor = np.sqrt(n / df) * stats.t.ppf((1 + level) / 2, df) / stats.norm.ppf((1 + level) / 2) if widen else 1.0
    low, high = np.exp(np.log(ratio) + factor * (tails - np.log(ratio)))
    verdict = "faster" if low > 1 else "slower" if high < 1 else "tied"
    return Comparison(ratio, float(low), float(high), verdict)
