"""Logit processing shared by plain decoding and by both models in speculative decoding.

Lossless speculative sampling needs the target's distribution `p` and the drafter's `q` to go through
exactly the same temperature / top-k / top-p processing that target-only decoding uses; one function,
`probs_from_logits`, is that processing for everybody.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen from logits.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it before softmax.
    top_k: keep only the k most likely tokens (0 = no limit).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1.0 = no limit).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Turn logits (..., V) into the sampling distribution (..., V) in float32.

    Greedy gives the one-hot distribution of the argmax, so the lossless acceptance rule reduces to
    exact matching for it.
    """
    logits = logits.float()
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p; the most likely
        # token is therefore always kept.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row from probs (..., V); returns (...,) int64."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def draw(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The next token(s) from logits (..., V) and, when sampling, the distribution they were drawn from
    (what a drafter reports as q); greedy picks the argmax and reports None (one-hot q)."""
    if sampling.greedy:
        return logits.argmax(-1), None
    probs = probs_from_logits(logits, sampling)
    return sample(probs, generator), probs


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick the next token(s) from logits (..., V) the way target-only decoding does."""
    return draw(logits, sampling, generator)[0]
