"""Medusa (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads"): K residual heads on the target's last hidden state.

Head i (1-based) maps the target's feature at position t through `num_layers` residual blocks
x + SiLU(W x) (W zero-initialised, so an untrained head starts as the target's own output head) and
the target's frozen output head, and predicts token t+i+1: the target itself predicts t+1, head 1 the
token after it, and so on. All heads read the same feature, so a round drafts min(k, K) tokens with
one batched evaluation and keeps no cache. Loss: cross-entropy against the target's distribution at
t+i, head i weighted by `head_decay ** (i-1)`. (Medusa's tree attention is not used: the loop
verifies one chain.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from drafters.base import Proposal
from drafters.head_losses import soft_cross_entropy, step_stats
from drafters.heads import FeatureBatch, FeatureDrafter
from drafters.layers import SharedTarget
from drafters.sampling import Sampling, draw


class ResBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class Medusa(nn.Module):
    """The heads. config: drafters.heads.head_config(..., num_heads=K, num_layers=..., head_decay=...)."""

    def __init__(self, config) -> None:
        super().__init__()
        if len(config.feature_layers) != 1:
            raise ValueError(f"Medusa reads one feature layer (the last), got {list(config.feature_layers)}")
        self.config = config
        d = config.target_hidden_size
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(d) for _ in range(config.num_layers)]) for _ in range(config.num_heads)
        )
        self.shared: SharedTarget | None = None

    def attach(self, target) -> None:
        self.shared = SharedTarget(target)

    def logits(self, features: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """(..., d) -> (n, ..., V): the first n heads' logits."""
        return torch.stack([self.shared.logits(head(features)) for head in self.heads[:n]])

    def forward(self, features, input_ids, attention_mask, loss_mask, target_probs):
        B, T = input_ids.shape
        K = self.config.num_heads
        pad = lambda t: torch.cat([t, t.new_zeros((B, K + 1, *t.shape[2:]))], dim=1)  # noqa: E731
        lmask, valid, probs = pad(loss_mask), pad(attention_mask), pad(target_probs)
        logits = self.logits(features)  # (K, B, T, V)
        loss, stats = 0.0, []
        for i in range(1, K + 1):
            p = probs[:, i: i + T]  # position t+i: the target's distribution of token t+i+1
            m = lmask[:, i + 1: i + 1 + T].bool() & valid[:, i + 1: i + 1 + T].bool()
            loss = loss + self.config.head_decay ** (i - 1) * soft_cross_entropy(logits[i - 1], p, m)
            stats.append(step_stats(torch.softmax(logits[i - 1].detach(), -1), p, m, hits=not self.training))
        return loss, stats

    def drafter(self, name: str = "medusa", stop_below: float = 0.0, stop_rule: str = "propose") -> "MedusaDrafter":
        return MedusaDrafter(self, name, stop_below, stop_rule)

    def batch_drafter(self, name: str = "medusa", stop_below: float = 0.0, stop_rule: str = "propose") -> "MedusaBatch":
        return MedusaBatch(self, name, stop_below, stop_rule)


class MedusaDrafter(FeatureDrafter):
    """Drafts min(k, K) tokens from the last committed feature; no cache, so nothing to roll back."""

    def start(self, prompt_ids, features=None) -> None:
        super().start(prompt_ids, features)
        self._keep_last()

    def commit(self, n_accepted: int, next_token: int, features=None) -> None:
        super().commit(n_accepted, next_token, features)
        self._keep_last()

    def _keep_last(self) -> None:
        # Only the newest feature matters (the one that predicted the last committed token).
        self.pending = self.pending[-1:]

    @torch.inference_mode()
    def propose(self, k: int, sampling: Sampling, generator: torch.Generator | None = None) -> Proposal:
        if self.pending.shape[0] == 0:
            self.guesses = []
            return Proposal(torch.empty(0, dtype=torch.long, device=self.device))
        logits = self.head.logits(self.pending[-1], n=k)  # (n, V), n = min(k, K)
        tokens, probs = draw(logits, sampling, generator)
        if self.stop:  # all heads guess at once; keep guesses through the first unsure one (or before it)
            for i in range(tokens.shape[0]):
                if self.stop.unsure(logits[i], None if probs is None else probs[i], tokens[i]):
                    n = i if self.stop.drops else i + 1
                    tokens, probs = tokens[:n], None if probs is None else probs[:n]
                    break
        self.guesses = tokens.tolist()
        return Proposal(tokens, probs)


class MedusaBatch(FeatureBatch):
    """Medusa for a batch: every row's newest feature through the heads at once; no cache."""

    def start(self, prompts, features=None) -> None:
        super().start(prompts, features)
        self.pending = [p[-1:] for p in self.pending]

    def commit(self, accepted, next_tokens, features=None) -> None:
        super().commit(accepted, next_tokens, features)
        self.pending = [p[-1:] for p in self.pending]

    @torch.inference_mode()
    def propose(self, k: int, sampling: Sampling, generator: torch.Generator | None = None) -> list[Proposal]:
        logits = self.head.logits(torch.stack([p[-1] for p in self.pending]), n=k).transpose(0, 1)  # (B, n, V)
        tokens, probs = draw(logits, sampling, generator)  # (B, n), every row and head at once
        cut = [tokens.shape[1]] * tokens.shape[0]
        if self.stop:  # each row keeps its guesses through its first unsure one (or up to it)
            unsure = self.stop.rows_unsure(logits, probs, tokens)  # (B, n)
            cut = [next((i + (not self.stop.drops) for i, u in enumerate(row) if u), len(row)) for row in unsure]
        proposals = [Proposal(tokens[b, :n], None if probs is None else probs[b, :n]) for b, n in enumerate(cut)]
        self.guesses = [p.tokens.tolist() for p in proposals]
        return proposals


HEAD = Medusa
