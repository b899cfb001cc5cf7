"""Prompt-lookup (n-gram) drafting: no model, near-free, the baseline every trained drafter must beat.

Find the most recent earlier occurrence of the sequence's last n tokens (longest n first, from
`max_ngram` down to `min_ngram`) and propose the tokens that followed it (Saxena 2023, "prompt lookup
decoding"; the same idea as transformers' `prompt_lookup_num_tokens`). Guesses are deterministic, so
they carry no distribution: the lossless acceptance rule treats them as one-hot q.
"""

from __future__ import annotations

import torch

from drafters.base import Proposal
from drafters.sampling import Sampling


class NgramDrafter:
    """Proposes the continuation of the latest earlier match of the current suffix."""

    parallel = False  # its k guesses cost k draft steps (drafters/base.py `Drafter.parallel`)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, name: str = "ngram") -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram, self.name = max_ngram, min_ngram, name
        self.ids: list[int] = []
        self._guesses: list[int] = []
        self.device = torch.device("cpu")

    def start(self, prompt_ids: torch.Tensor) -> None:
        self.ids = prompt_ids.tolist()
        self.device = prompt_ids.device
        self._guesses = []

    def lookup(self, k: int) -> list[int]:
        """The up-to-k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        ids = self.ids
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            suffix = ids[-n:]
            # Scan backwards so the most recent occurrence wins; the suffix itself (start = len - n) is excluded.
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start : start + n] == suffix:
                    return ids[start + n : start + n + k]
        return []

    def propose(self, k: int, sampling: Sampling, generator: torch.Generator | None = None) -> Proposal:
        self._guesses = self.lookup(k)
        return Proposal(torch.tensor(self._guesses, dtype=torch.long, device=self.device), None)

    def commit(self, n_accepted: int, next_token: int) -> None:
        self.ids.extend(self._guesses[:n_accepted])
        self.ids.append(next_token)

    def batched(self) -> "NgramBatch":
        return NgramBatch(self.max_ngram, self.min_ngram, self.name)


class NgramBatch:
    """n-gram drafting for a batch (drafters/base.py `BatchDrafter`): the lookup is a host-side search in
    each row's own sequence, row by row, as serving engines run it; there is no model to batch."""

    parallel = False  # its k guesses cost k draft steps (drafters/base.py `Drafter.parallel`)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, name: str = "ngram") -> None:
        self.settings, self.name = (max_ngram, min_ngram, name), name
        self.rows: list[NgramDrafter] = []

    def start(self, prompts: list[torch.Tensor], features=None) -> None:
        self.rows = [NgramDrafter(*self.settings) for _ in prompts]
        for row, prompt in zip(self.rows, prompts):
            row.start(prompt)

    def propose(self, k: int, sampling: Sampling, generator: torch.Generator | None = None) -> list[Proposal]:
        return [row.propose(k, sampling, generator) for row in self.rows]

    def commit(self, accepted: list[int], next_tokens: list[int], features=None) -> None:
        for row, a, token in zip(self.rows, accepted, next_tokens):
            row.commit(a, token)

    def keep(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]

    def join(self, prompts: list[torch.Tensor], features=None) -> None:
        """New rows after the running ones, each started on its prompt."""
        other = NgramBatch(*self.settings)
        other.start(prompts)
        self.rows = self.rows + other.rows
