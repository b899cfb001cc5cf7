"""The small protocol every drafter speaks to the speculative loop.

A round of speculative decoding, seen from the drafter:

1. `start(prompt_ids)` once per generation: forget everything, read the prompt.
2. `propose(k, sampling, generator)`: guess up to k next tokens after everything committed so far.
   A model drafter also returns the distribution q it sampled each guess from (None when its guesses
   are deterministic, which the acceptance rule treats as one-hot q).
3. `commit(n_accepted, next_token)`: the target kept the first `n_accepted` guesses and added
   `next_token` (its correction, or the bonus token when all guesses were kept). The drafter rolls its
   own state back to the accepted prefix; it never recomputes the prefix.

Drafters that read the target's features (EAGLE, MTP, Medusa heads; drafters/heads.py) declare
`feature_layers`, indices into Hugging Face `output_hidden_states`. The loop then also passes
`features` (n, len(layers), d) to `start` (every prompt position but the last) and `commit` (the
positions the verification pass committed: the previous last token and the kept guesses), each
position exactly once. Nothing else crosses: a drafter owns its state entirely, and the loop needs no
knowledge of what kind of drafter it drives.

Trees (drafters/tree.py; the EAGLE-3 and EAGLE-1 heads and the draft LM): `propose_tree(shape, sampling,
generator)` returns an EAGLE-2 dynamic tree instead of a chain, the loop verifies it in one forward with a
tree mask, and `commit_path(path, next_token[, features])` tells the drafter which nodes the target kept (a
head gets the features of the root and the kept path), so it keeps only their state.

Batches (eval/batching.py): `drafter.batched()` gives the same drafter for B rows at once, a
`BatchDrafter`: `start` takes a list of prompts (and per-row features), `propose` returns one Proposal
per row, `commit` takes each row's accepted count and next token, `keep(rows)` drops the rows that finished and
`join(prompts, features)` adds rows for new requests after the running ones (continuous batching: it
starts a batch of the new rows and takes over their caches). Its caches are ragged (one length per row),
so rows that keep different numbers of guesses never recompute a prefix. A batch drafter reads its
prompts in `start` (every position but the newest, which the first round feeds), so a round's draft
time is drafting only, whether or not requests joined before it.

Confidence stop (`stop_below`, every model drafter; off by default): a round ends early at the first
guess the drafter itself gives a probability below the threshold. That guess is still proposed; the
ones after it are not drafted, so an unsure round costs fewer draft steps and a narrower verification.
This is transformers' `assistant_confidence_threshold` for assisted generation. It stays lossless:
whether guess i+1 exists depends only on the drafter's own draws, and each position is still accepted
or resampled against the q it was drawn from (a position with no guess gets the target's own token).
`stop_rule="drop"` is llama.cpp's rule instead (`--spec-draft-p-min`, common/speculative.cpp): the unsure
guess is not proposed either, so a round may propose nothing, and the probability is the one llama.cpp
checks: its likeliest token's, in a softmax over the drafter's 10 likeliest (`LLAMA_CPP_CANDIDATES`), which
does not depend on the token drawn (sampled rounds stay lossless: a dropped draw says nothing about q). Where
verifying a position costs a large share of a decoding step (a quantized model on a CPU) dropping it pays;
`python -m eval engine=llamacpp` serves a drafter's stop only with this rule, so both loops run the same one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from drafters.sampling import Sampling


@dataclass
class Proposal:
    """Up to k guessed tokens.

    tokens: (n,) int64 with 0 <= n <= k; a drafter with nothing to say proposes n = 0.
    probs: (n, V) float32, the distribution each token was drawn from after the same sampling
        processing the target uses; None for deterministic guesses (one-hot q).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.numel())


def check_stop_below(stop_below: float, name: str) -> float:
    """The confidence threshold, checked: 0 (off) or a probability below 1."""
    if not 0.0 <= stop_below < 1.0:
        raise ValueError(f"drafter {name!r}: stop_below must be in [0, 1) (0 = always draft k), got {stop_below}")
    return float(stop_below)


STOP_RULES = ("propose", "drop")  # the unsure guess proposed (transformers) or not (llama.cpp)
LLAMA_CPP_CANDIDATES = 10  # llama.cpp's draft samplers keep the top 10 tokens (common/speculative.cpp)


class ConfidenceStop:
    """A drafter's confidence stop: `below` (0 = off, falsy) and `rule` (`STOP_RULES`), checked."""

    def __init__(self, below: float = 0.0, rule: str = "propose", name: str = "drafter") -> None:
        self.below = check_stop_below(below, name)
        if rule not in STOP_RULES:
            raise ValueError(f"drafter {name!r}: stop_rule must be one of {list(STOP_RULES)}, got {rule!r}")
        self.rule = rule

    def __bool__(self) -> bool:
        return self.below > 0.0

    @property
    def drops(self) -> bool:
        """True when the unsure guess is dropped rather than proposed (llama.cpp's rule)."""
        return self.rule == "drop"

    def unsure(self, logits: torch.Tensor, q: torch.Tensor | None, token: torch.Tensor) -> bool:
        """Whether the guess `token` (drawn from `logits`, or from q) ends the round. A host sync."""
        if self.drops:
            return bool(candidate_confidence(logits) < self.below)
        return confidence(logits, q, token) < self.below

    def rows_unsure(self, logits: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor) -> list[bool]:
        """`unsure` for a batch: logits (..., V'), q (..., V) or None, tokens (...) -> nested lists (...)."""
        p = candidate_confidence(logits) if self.drops else row_confidences(logits, q, tokens)
        return (p < self.below).tolist()


def candidate_confidence(logits: torch.Tensor) -> torch.Tensor:
    """llama.cpp's confidence in a draft step: the likeliest token's probability in a softmax over the
    `LLAMA_CPP_CANDIDATES` likeliest (its draft sampler's top-k). logits (..., V') -> (...). It does not
    depend on the token drawn, which keeps a sampled round lossless: whether a guess is proposed then
    depends on the drafter's distribution only, so a proposed guess is still distributed as q."""
    top = logits.float().topk(min(LLAMA_CPP_CANDIDATES, logits.shape[-1]), dim=-1).values
    return torch.exp(top[..., 0] - torch.logsumexp(top, dim=-1))


def confidence(logits: torch.Tensor, q: torch.Tensor | None, token: torch.Tensor) -> float:
    """The drafter's own probability of its guess `token`: q(token) when the guess was drawn from q,
    else (greedy, the argmax of `logits`) the argmax's probability under softmax(logits). A host sync,
    so drafters call it only when told to stop on low confidence."""
    if q is not None:
        return float(q[token])
    return float(torch.softmax(logits.float(), dim=-1).max())


def row_confidences(logits: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
    """`confidence` for a batch, one host-free op: logits (B, V'), q (B, V) or None, tokens (B,) -> (B,)."""
    if q is not None:
        return q.gather(-1, tokens[..., None])[..., 0]
    return torch.softmax(logits.float(), dim=-1).amax(-1)


class Chains:
    """A batch's proposals built one draft step at a time: the step's tokens (B,) and distributions (B, V)
    or None for the whole batch at once, each row's chain cut at its first unsure guess (`stop`): after it,
    or before it when the stop drops it."""

    def __init__(self, batch: int, stop: ConfidenceStop | None = None) -> None:
        self.tokens: list[torch.Tensor] = []
        self.dists: list[torch.Tensor] = []
        self.stop = stop or ConfidenceStop()
        self.lengths: list[int | None] = [None] * batch  # None: still drafting

    def add(self, logits: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor | None) -> bool:
        """Record a step; True when every row has stopped (the round may end)."""
        self.tokens.append(tokens)
        if q is not None:
            self.dists.append(q)
        if self.stop:
            unsure = self.stop.rows_unsure(logits, q, tokens)
            step = len(self.tokens) - self.stop.drops
            self.lengths = [n if n is not None or not u else step for n, u in zip(self.lengths, unsure)]
            return all(n is not None for n in self.lengths)
        return False

    def proposals(self) -> list[Proposal]:
        tokens = torch.stack(self.tokens, dim=1)  # (B, steps)
        dists = torch.stack(self.dists, dim=1) if self.dists else None  # (B, steps, V)
        cut = [tokens.shape[1] if n is None else n for n in self.lengths]
        return [Proposal(tokens[b, :n], None if dists is None else dists[b, :n]) for b, n in enumerate(cut)]


@runtime_checkable
class Drafter(Protocol):
    """What the speculative loop needs from a drafter (see the module docstring)."""

    name: str
    # True: its k guesses cost one forward of the drafter (DFlash, P-EAGLE, PARD), which the cost model charges a round
    # once (eval/metrics.py `cost_model`); False: one draft step per guess
    parallel: bool

    def start(self, prompt_ids: torch.Tensor) -> None:
        """Reset state and read the prompt, a (T,) int64 tensor on the target's device."""

    def propose(self, k: int, sampling: Sampling, generator: torch.Generator | None = None) -> Proposal:
        """Guess up to k tokens that follow the committed sequence."""

    def commit(self, n_accepted: int, next_token: int) -> None:
        """Keep the first n_accepted guesses plus next_token; roll back the rest."""


@runtime_checkable
class BatchDrafter(Protocol):
    """A drafter for B rows at once (module docstring; eval/batching.py drives it)."""

    name: str
    parallel: bool  # as `Drafter.parallel`

    def start(self, prompts: list[torch.Tensor], features: list[torch.Tensor] | None = None) -> None:
        """Reset state and read each row's prompt (and, for a head, the features of all but its last position)."""

    def propose(self, k: int, sampling: Sampling, generator: torch.Generator | None = None) -> list[Proposal]:
        """Up to k guesses per row."""

    def commit(self, accepted: list[int], next_tokens: list[int],
               features: list[torch.Tensor] | None = None) -> None:
        """Row b keeps accepted[b] guesses plus next_tokens[b]; each rolls back the rest."""

    def keep(self, rows: list[int]) -> None:
        """Only `rows` (indices into the current batch, in order) continue."""

    def join(self, prompts: list[torch.Tensor], features: list[torch.Tensor] | None = None) -> None:
        """New rows, started on `prompts` as `start` starts them, after the running rows (continuous batching)."""
