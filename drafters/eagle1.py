"""EAGLE-1 (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"):
one decoder layer that extrapolates the target's last-layer feature.

Entry e of the head's sequence is fc([embedding of token e+1; target feature at e]) (2d -> d), run
through one Llama decoder layer without its input norm (attention reads fc's output itself, as in the
paper's code and in vLLM's `EagleLlamaForCausalLM`, which loads the export: eval/engines/formats/eagle1.py); its output o_e is trained to be the target's feature at e+1
(smooth-L1 feature regression) and, through the target's own output head, to predict token e+2
(cross-entropy against the target's distribution, weight `token_loss_weight`). Drafting continues on
the head's own outputs: the next entry pairs o_e with the guessed token.

The feature is `output_hidden_states[n]` of an n-layer target, the (final-normed) state its output
head reads, so o_e needs no norm of its own before that head.

Heads saved before the layer lost its input norm have no `input_norm` in their config.json: they load
with the norm they were trained with, and draft as before, but have no engine format.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from drafters.base import Proposal
from drafters.head_losses import soft_cross_entropy, step_stats
from drafters.heads import ChainBatch, FeatureDrafter, TreeDrafting, beside, head_config, load_engine_state
from drafters.kv_cache import KVCache, RaggedRows
from drafters.layers import DecoderLayer, Rotary, SharedTarget, causal_mask
from drafters.sampling import Sampling, draw


class Eagle1(nn.Module):
    """The head. config: drafters.heads.head_config(..., token_loss_weight=...), one feature layer;
    `config.input_norm` (False for every head built now) keeps a norm before the layer's attention."""

    # What drafters/registry.py build_head sets in a new head's config: the paper's layer, without a norm before
    # attention (saved heads without the key keep theirs: True).
    CONFIG_DEFAULTS = {"input_norm": False}

    def __init__(self, config) -> None:
        super().__init__()
        if len(config.feature_layers) != 1:
            raise ValueError(f"EAGLE-1 reads one feature layer (the last), got {list(config.feature_layers)}")
        self.config = config
        d = config.hidden_size
        self.fc = nn.Linear(d + config.target_hidden_size, d, bias=False)
        self.layer = DecoderLayer(config, input_norm=getattr(config, "input_norm", True))
        self.rotary = Rotary(config)
        self.shared: SharedTarget | None = None

    def attach(self, target) -> None:
        self.shared = SharedTarget(target)

    def _entries(self, hidden, tokens, start, mask, cache=None, last=False):
        """Training (no cache) or drafting on top of `cache` (inference only, the fused ops)."""
        embeds = self.shared.embed_tokens(tokens, hidden.dtype)
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        if cache is None:
            return self.layer(x, *self.rotary(hidden, start, hidden.shape[1]), mask)
        return self.layer.decode(x, *self.rotary.decode(hidden, start, hidden.shape[1]), mask, cache, last)

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, start: int, cache: KVCache,
             last: bool = False) -> torch.Tensor:
        """Inference: entries (hidden (1, q, d), tokens (q,)) at positions start..start+q-1 on top of
        `cache`; their outputs (1, q, d), or with `last` the last one's (1, 1, d) alone (the one
        layer's other outputs feed nothing; their keys and values are cached)."""
        q = hidden.shape[1]
        mask = causal_mask(q, len(cache), hidden.device) if q > 1 and not last else None
        return self._entries(hidden, tokens[None], start, mask, cache, last)

    def step_tree(self, hidden: torch.Tensor, tokens: torch.Tensor, position: int, mask: torch.Tensor,
                  cache: KVCache) -> torch.Tensor:
        """Tree drafting (drafters/heads.py `TreeDrafting`): q sibling entries of one depth, all at `position`,
        each seeing the keys `mask` (q, len(cache) + q) allows; their outputs (1, q, d)."""
        embeds = self.shared.embed_tokens(tokens[None], hidden.dtype)
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        return self.layer.decode(x, *self.rotary.decode(hidden, position, 1), mask[None, None], cache)

    def step_rows(self, hidden: torch.Tensor, tokens: torch.Tensor, rows: RaggedRows, cache: KVCache,
                  last: torch.Tensor | None = None) -> torch.Tensor:
        """`step` for a ragged batch (eval/batching.py): hidden (B, q, d), tokens (B, q) at each row's own
        next positions on top of `cache` (over `rows`; the caller advances them); with `last` (B,), row b's
        entry last[b] alone."""
        q = hidden.shape[1]
        x = self.fc(torch.cat([self.shared.embed_tokens(tokens, hidden.dtype), hidden], dim=-1))
        cos, sin = self.rotary.decode_rows(hidden, rows.positions(q), rows.end(q))
        return self.layer.decode(x, cos, sin, rows.mask(q), cache, False if last is None else last)

    def forward(self, features, input_ids, attention_mask, loss_mask, target_probs):
        """Training loss (teacher forced): feature regression + token loss. Shapes as in drafters/eagle.py."""
        B, T = input_ids.shape
        E = T - 1
        key_valid = attention_mask[:, 1:].bool().clone()
        key_valid[:, 0] = True
        mask = causal_mask(E, 0, input_ids.device, key_valid)
        out = self._entries(features[:, :-1], input_ids[:, 1:], 0, mask)
        # Entry e predicts the feature at e+1 and the token at e+2 (whose distribution is target_probs[e+1]).
        m = torch.zeros_like(loss_mask[:, 1:], dtype=torch.bool)
        m[:, :-1] = loss_mask[:, 2:].bool() & attention_mask[:, 2:].bool()
        regression = F.smooth_l1_loss(out.float(), features[:, 1:].float(), reduction="none").mean(-1)
        regression = (regression * m).sum() / m.sum().clamp_min(1)
        logits = self.shared.logits(out)
        p = target_probs[:, 1:]
        loss = regression + self.config.token_loss_weight * soft_cross_entropy(logits, p, m)
        return loss, [step_stats(torch.softmax(logits.detach(), -1), p, m, hits=not self.training)]

    def drafter(self, name: str = "eagle1", stop_below: float = 0.0, stop_rule: str = "propose") -> "Eagle1Drafter":
        return Eagle1Drafter(self, name, stop_below, stop_rule)

    def batch_drafter(self, name: str = "eagle1", stop_below: float = 0.0, stop_rule: str = "propose") -> "Eagle1Batch":
        return Eagle1Batch(self, name, stop_below, stop_rule)


class Eagle1Drafter(TreeDrafting, FeatureDrafter):
    """Drafts a chain of k tokens (or a dynamic tree) with an EAGLE-1 head, with its own KV cache rolled back on
    commit."""

    def first(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        return self.head.step(self.pending[None], tokens, start, self.cache, last=True)

    def tree_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head.shared.logits(h)

    def start(self, prompt_ids, features=None) -> None:
        super().start(prompt_ids, features)
        self.cache = KVCache()
        self.fed = 0

    @torch.inference_mode()
    def propose(self, k: int, sampling: Sampling, generator: torch.Generator | None = None) -> Proposal:
        head, m = self.head, len(self.ids) - 1
        if m == 0:
            self.guesses = []
            return Proposal(torch.empty(0, dtype=torch.long, device=self.device))
        new = self.pending.shape[0]
        tokens = torch.tensor(self.ids[m - new + 1: m + 1], device=self.device)
        h = head.step(self.pending[None], tokens, m - new, self.cache, last=True)
        self.pending, self.fed = self.pending[:0], m
        guesses, dists = [], []
        for s in range(k):
            logits = head.shared.logits(h)[0, -1]
            token, q = draw(logits, sampling, generator)
            unsure = bool(self.stop) and self.stop.unsure(logits, q, token)
            if unsure and self.stop.drops:
                break
            if q is not None:
                dists.append(q)
            guesses.append(token)
            if unsure:
                break
            if s < k - 1:
                h = head.step(h, token.view(1), m + s, self.cache)
        self.guesses = [int(t) for t in guesses]
        if not guesses:  # the first guess was dropped
            return Proposal(torch.empty(0, dtype=torch.long, device=self.device))
        return Proposal(torch.stack(guesses), torch.stack(dists) if dists else None)

    def commit(self, n_accepted: int, next_token: int, features=None) -> None:
        self.cache.crop(self.fed)
        super().commit(n_accepted, next_token, features)


class Eagle1Batch(ChainBatch):
    """EAGLE-1 drafting for a batch (drafters/heads.py `ChainBatch`)."""

    def first(self, hidden, tokens, last):
        return self.head.step_rows(hidden, tokens, self.rows, self.cache, last)

    def next(self, h, tokens):
        return self.head.step_rows(h, tokens, self.rows, self.cache)

    def logits(self, h):
        return self.head.shared.logits(h)[:, -1]

    def pick(self, logits, sampling, generator):
        return draw(logits, sampling, generator)


def load_engine_eagle1(path, raw: dict, target, dtype: torch.dtype | None = None) -> Eagle1:
    """An EAGLE-1 head from its engine export (vLLM's `EagleLlamaForCausalLM` layout, as
    eval/engines/formats/eagle1.py writes it: `fc`, `layers.0.*` without an input norm, no embedding or output head),
    attached to `target`."""


    path = Path(path)
    if raw.get("hidden_size") != target.config.hidden_size:
        raise ValueError(f"{path}/config.json: hidden_size {raw.get('hidden_size')} is not the target's "
                         f"{target.config.hidden_size}; an EAGLE-1 head has the target's width")
    state = {name.replace("layers.0.", "layer.", 1): t for name, t in load_file(str(path / "model.safetensors")).items()}
    shared = [name for name in ("embed_tokens.weight", "lm_head.weight") if name in state]
    if shared:
        raise ValueError(f"{path}: {shared} stored in the checkpoint; draftsmith drafts with the target's own")
    config = head_config(target.config, "eagle1", [target.config.num_hidden_layers],
                         intermediate_size=raw["intermediate_size"], token_loss_weight=0.0, input_norm=False)
    head = Eagle1(config)
    load_engine_state(head, state, path)
    return beside(head, target, dtype)


HEAD = Eagle1
