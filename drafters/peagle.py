"""P-EAGLE (arXiv 2602.01469, "Parallel EAGLE"): an EAGLE-3 head (drafters/eagle.py) that drafts all k tokens in
one forward, a learned `mask_hidden` standing in for the target's features at every depth past the first.

A drafting round feeds the head, as EAGLE-3's first step does, the entries of the positions committed since the
last round (entry e: the target's fused features at e and the token at e + 1, at position e), followed by k - 1
mask entries: depth d >= 1 is the token `mask_token_id` with hidden `fc(mask_hidden)` at position m - 1 + d, where
m - 1 is the last real entry. Attention is causal; the outputs of the last real entry (depth 0) and of the k - 1
mask entries are the k guesses, tokens m + 1 .. m + k. Nothing is fed back: one forward, whatever k. The mask
entries' keys and values are written past the committed ones and overwritten the next round. This is vLLM 0.33's
`eagle3` with `parallel_drafting` (the proposer's slot layout, `fc(input_norm?(mask_hidden))` for the mask slots,
plain causal attention), which serves the `speculators` export (`speculators_model_type: "peagle"`).

Training is speculators' P-EAGLE recipe (`speculators/models/peagle/`): every entry at depth 0 (exact EAGLE-3
step 0), plus copies of the entries at depths 1 .. `num_depths` - 1, drawn by conditional drop (COD): depth d keeps
int((n - d) * max(`cod_ratio` ** d, `cod_min_ratio`)) of the n anchors whose answer token the loss reads (at most
`max_anchors`), each drawn among the previous depth's kept anchors, so every kept chain is whole. One forward over
all of them under the depth-aware mask: anchor a at depth d sees the depth-0 entries 0..a and its own chain's
depths 1..d, exactly what the mask entry at depth d sees when drafting. Entry (a, d) is trained towards the
target's distribution of token a + d + 2 (over the draft vocabulary), the cross-entropy averaged over every kept
entry of every depth alike: deeper depths weigh less only by being fewer. The held-out evaluation keeps every
anchor at every depth (the training-time-test attention of drafters/layers.py, the same mask), so its per-depth
acceptance and its greedy replay are the loop's.

The mask token is a row of the target's embedding, which the head shares frozen (drafters/parallel.py
`mask_token_for` picks it, as for DFlash); `mask_hidden` (1, 1, L * d_target) is the head's own, trained. Trees: no
(a round is one forward over one chain).
"""

from __future__ import annotations

import torch
from torch import nn

from drafters.base import Proposal
from drafters.eagle import Eagle3, Eagle3Batch, _pick
from drafters.eagle_export import load_engine_eagle3
from drafters.head_losses import label_cross_entropy, label_stats, soft_cross_entropy, step_stats
from drafters.heads import BatchOfOne
from drafters.layers import causal_mask
from drafters.parallel import (COD_MIN_RATIO, COD_RATIO, MAX_ANCHORS, chain_mask, cut_at_stop, draw_chains,
                               pack_chains)
from drafters.sampling import Sampling


class PEagle(Eagle3):
    """The head: EAGLE-3's, plus `mask_hidden`. config: drafters.heads.head_config(...) with EAGLE-3's settings and
    `mask_token_id`, `num_depths`, `cod_ratio`, `cod_min_ratio`, `max_anchors` (defaults: drafters/kinds/peagle.py
    `PEagleConfig`)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        mask = getattr(config, "mask_token_id", None)
        if mask is None or not 0 <= mask < config.vocab_size:
            raise ValueError(f"mask_token_id must be a row of the target's embedding (0..{config.vocab_size - 1}), "
                             f"got {mask}")
        if config.num_depths < 1:
            raise ValueError(f"num_depths must be >= 1 (the guesses one forward drafts), got {config.num_depths}")
        fused = len(config.feature_layers) * config.target_hidden_size
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, fused))  # speculators' shape and initialisation

    @property
    def depths(self) -> int:
        """Guesses per forward: the depths it was trained on."""
        return self.config.num_depths

    def mask_state(self) -> torch.Tensor:
        """What a mask entry's hidden input is: fc(input_norm?(mask_hidden)), (1, d)."""
        return self.fuse(self.mask_hidden[0])

    # --- training ---------------------------------------------------------------------------------------

    def forward(self, features, input_ids, attention_mask, loss_mask, target_probs):
        """Training loss: features (B, T, L*d_target); input_ids, attention_mask, loss_mask (B, T); target_probs
        (B, T, V) or (B, T) labels, as for EAGLE-3. Returns (loss, [stats per depth]), depth d's greedy hits
        (evaluation) at entry e as EAGLE-3's step d (train/heads.py `greedy_rounds` replays them)."""
        B, T = input_ids.shape
        D, E = self.depths, T - 1
        pad = lambda t: torch.cat([t, t.new_zeros((B, D + 1))], dim=1)  # noqa: E731
        # reads[b, j]: the loss reads token j + 2 (entry j's depth-0 guess, entry j - d's depth-d guess).
        reads = (pad(loss_mask)[:, 2: 2 + E + D].bool() & pad(attention_mask)[:, 2: 2 + E + D].bool())
        if self.training:
            anchors, depth, used, states = self._sampled(features, input_ids, attention_mask, reads)
        else:
            anchors, depth, used, states = self._every_anchor(features, input_ids, attention_mask)
        keep = used & reads.gather(1, (anchors + depth).clamp(max=E + D - 1))
        labels = not target_probs.is_floating_point()
        target_ids = self.target_ids() if self.reduced else None
        if labels:  # a label's index in the draft vocabulary, -1 where the head cannot propose it
            draft_index = torch.where(self.t2d, torch.cumsum(self.t2d.long(), 0) - 1, -1)
        rows, slots = keep.nonzero(as_tuple=True)
        logits = self.draft_logits(states[rows, slots])
        p = target_probs[rows, anchors[rows, slots] + depth[rows, slots] + 1]  # the target's token a + d + 2
        if labels:
            loss = label_cross_entropy(logits, draft_index[p])
        else:
            if target_ids is not None:  # the target's distribution restricted to the draft vocabulary
                p_draft = p[:, target_ids]
                p_draft = p_draft / p_draft.sum(-1, keepdim=True).clamp_min(1e-12)
            loss = soft_cross_entropy(logits, p_draft if target_ids is not None else p, torch.ones_like(rows))
        stats, at_depth = [], depth[rows, slots]
        for d in range(self.depths):
            sel = at_depth == d
            at = (rows[sel], anchors[rows[sel], slots[sel]], (B, T))
            if labels:
                stats.append(label_stats(logits[sel].detach(), p[sel], draft_index[p[sel]], target_ids, at=at,
                                         hits=not self.training))
            else:
                stats.append(step_stats(torch.softmax(logits[sel].detach().float(), -1), p[sel], draft_ids=target_ids,
                                        at=at, hits=not self.training))
        return loss, stats

    def _inputs(self, features, input_ids, anchors, depth):
        """Entries (anchor, depth) (B, N): hidden (B, N, d) and tokens (B, N); depth 0 the target's features at the
        anchor and the token after it, deeper the mask."""
        real = depth == 0
        fused = self.fuse(features.gather(1, anchors[..., None].expand(-1, -1, features.shape[-1])))
        hidden = torch.where(real[..., None], fused, self.mask_state().to(fused.dtype))
        tokens = torch.where(real, input_ids.gather(1, (anchors + 1).clamp(max=input_ids.shape[1] - 1)),
                             self.config.mask_token_id)
        return hidden, tokens

    def _sampled(self, features, input_ids, attention_mask, reads):
        """Every depth-0 entry and the COD-drawn deeper ones (module docstring), in one forward under the
        depth-aware mask: (anchors, depth, used) (B, N) and the layer's outputs (B, N, d)."""
        B, T = input_ids.shape
        E, device = T - 1, input_ids.device
        c = self.config
        picks = [draw_chains(reads[b], E, self.depths, c.cod_ratio, c.cod_min_ratio, c.max_anchors) for b in range(B)]
        anchors, depth, used = pack_chains(picks, device)
        hidden, tokens = self._inputs(features, input_ids, anchors, depth)
        # A depth-0 key is real where the token after its anchor is (entry 0 always, so no query lacks a key);
        # padding entries sit at anchor 0, depth 0, and see that one key.
        real = attention_mask[:, 1:].bool().clone()
        real[:, 0] = True
        mask = chain_mask(anchors, depth, used & ((depth > 0) | real.gather(1, anchors)))
        cos, sin = self.rotary(hidden, 0, int((anchors + depth).max()) + 1)
        where = anchors + depth
        cos, sin = cos[0][where], sin[0][where]
        embeds = self.shared.embed_tokens(tokens, hidden.dtype)
        out, _ = self.midlayer(embeds, hidden, cos, sin, mask[:, None])
        return anchors, depth, used, self._out(out)

    def _every_anchor(self, features, input_ids, attention_mask):
        """Every anchor at every depth (evaluation): depth by depth as EAGLE-3's training-time test runs, the
        depth-0 entries as the causal base and each anchor's own chain as its diagonal keys, the same mask as
        `_sampled`'s. Returns (anchors, depth, used) (B, D*E) and the outputs (B, D*E, d)."""
        B, T = input_ids.shape
        E, device = T - 1, input_ids.device
        key_valid = attention_mask[:, 1:].bool().clone()
        key_valid[:, 0] = True
        mask = causal_mask(E, 0, device, key_valid)
        hidden = self.fuse(features[:, :-1])
        embeds = self.shared.embed_tokens(input_ids[:, 1:], hidden.dtype)
        mask_hidden = self.mask_state().to(hidden.dtype).expand(B, E, -1)
        mask_embeds = self.shared.embed_tokens(torch.full_like(input_ids[:, 1:], self.config.mask_token_id),
                                               hidden.dtype)
        base, diagonal, outs = None, [], []
        for d in range(self.depths):
            cos, sin = self.rotary(hidden, d, E)
            if d == 0:
                out, base = self.midlayer(embeds, hidden, cos, sin, mask)
            else:
                out, kv = self.midlayer(mask_embeds, mask_hidden, cos, sin, mask, base=base, diagonal=diagonal)
                diagonal = [*diagonal, kv]
            outs.append(self._out(out))
        anchors = torch.arange(E, device=device).repeat(self.depths).expand(B, -1)
        depth = torch.arange(self.depths, device=device).repeat_interleave(E).expand(B, -1)
        return anchors, depth, torch.ones_like(anchors, dtype=torch.bool), torch.cat(outs, dim=1)

    # --- drafting ---------------------------------------------------------------------------------------

    def drafter(self, name: str = "peagle", stop_below: float = 0.0, stop_rule: str = "propose") -> "PEagleDrafter":
        return PEagleDrafter(self, name, stop_below, stop_rule)

    def batch_drafter(self, name: str = "peagle", stop_below: float = 0.0, stop_rule: str = "propose") -> "PEagleBatch":
        return PEagleBatch(self, name, stop_below, stop_rule)


class PEagleBatch(Eagle3Batch):
    """P-EAGLE for B rows (drafters/base.py `BatchDrafter`); batch 1 is `PEagleDrafter`. The cache (one length per
    row) holds the entries built from the target's features, as EAGLE-3's does; a round writes each row's new
    entries and its k - 1 mask entries after them in one call, drafts from the last real entry and the masks, and
    advances past the real entries only."""

    parallel = True  # its k guesses cost one forward (eval/metrics.py `cost_model` charges a round so)

    def start(self, prompts, features=None) -> None:
        with torch.inference_mode():  # the head is fixed while it drafts: its mask entries' hidden, once
            self.mask_state = self.head.mask_state()
        super().start(prompts, features)

    @torch.inference_mode()
    def propose(self, k: int, sampling: Sampling, generator: torch.Generator | None = None) -> list[Proposal]:
        head = self.head
        n = min(k, head.depths)
        counts = [p.shape[0] for p in self.pending]
        Q = max(counts) + n - 1
        # Row b: its counts[b] new entries (features e, token e + 1), then masks to the call's width; its depth-d
        # mask sits at counts[b] - 1 + d, d < n, and later ones are written past it and never read.
        width = self.pending[0].shape[1]
        raw = torch.stack([torch.cat([p, p.new_zeros(Q - len(p), width)]) for p in self.pending])
        real = torch.arange(Q, device=self.device) < torch.tensor(counts, device=self.device)[:, None]
        hidden = torch.where(real[..., None], head.fuse(raw), self.mask_state)
        mask_id = head.config.mask_token_id
        tokens = torch.tensor([ids[len(ids) - c:] + [mask_id] * (Q - c) for ids, c in zip(self.ids, counts)],
                              device=self.device)
        out = head.step_rows(hidden, tokens, self.rows, self.cache)  # (B, Q, d)
        at = (torch.tensor(counts, device=self.device) - 1).clamp(min=0)[:, None] + torch.arange(n, device=self.device)
        logits = head.draft_logits(out.gather(1, at[..., None].expand(-1, -1, out.shape[-1])),
                                   head._draft_rows() if self.target_ids is not None else None)  # (B, n, V')
        drafted, probs = _pick(logits, sampling, generator, self.target_ids, head.config.vocab_size)
        cut = [c if counts[b] else 0 for b, c in enumerate(cut_at_stop(self.stop, logits, drafted, probs))]
        self.rows.advance(counts)
        self.fed = list(self.rows.lengths)
        self.pending = [p[:0] for p in self.pending]
        proposals = [Proposal(drafted[b, :c], None if probs is None else probs[b, :c]) for b, c in enumerate(cut)]
        self.guesses = [p.tokens.tolist() for p in proposals]
        return proposals


class PEagleDrafter(BatchOfOne):
    """P-EAGLE at batch 1: the batch drafter's state for one row."""

    batch_class = PEagleBatch
    parallel = True  # its k guesses cost one forward (eval/metrics.py `cost_model` charges a round so)


def load_engine_peagle(path, raw: dict, target, dtype: torch.dtype | None = None) -> PEagle:
    """A P-EAGLE head from its `speculators` export (eval/engines/formats/eagle3.py), attached to `target`: EAGLE-3's
    loader, with the mask token from the config, the depths it drafts from its speculative_tokens, and
    `mask_hidden` from the weights. The export does not carry the conditional drop it was trained with: a head
    trained further from it (`init_from`) takes the recipe's defaults."""
    mask = raw.get("mask_token_id")
    if mask is None:
        raise ValueError(f"{path}/config.json: no mask_token_id; a P-EAGLE export names the token its mask entries "
                         "carry (vLLM reads it as pard_token)")
    methods = (raw.get("speculators_config") or {}).get("proposal_methods") or [{}]
    depths = methods[0].get("speculative_tokens")
    if not depths:
        raise ValueError(f"{path}/config.json: no speculators_config.proposal_methods[0].speculative_tokens")
    return load_engine_eagle3(path, raw, target, dtype, cls=PEagle, kind="peagle",
                              settings={"mask_token_id": int(mask), "num_depths": int(depths), "cod_ratio": COD_RATIO,
                                        "cod_min_ratio": COD_MIN_RATIO, "max_anchors": MAX_ANCHORS})


HEAD = PEagle
