"""EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test"): one decoder layer drafting from fused low/middle/high target features.

Entry e of the head's sequence pairs the target's features at position e (the layers in
`config.feature_layers`, concatenated and fused by `fc`: 3d -> d) with the embedding of token e+1;
inside the layer q/k/v read [input_layernorm(embedding); hidden_norm(feature)] (2d wide), and the
layer's output o_e, through `norm` and the output head, predicts token e+2. Drafting continues on the
head's own outputs: the next entry pairs o_e (in place of fused features) with the guessed token.

Training-time test: the head is trained unrolled for `config.ttt_steps` steps. Step s at anchor e sees
the step-0 entries 0..e (the target's real features) and its own step 1..s entries for that anchor,
exactly what it sees at inference when drafting the (s+1)-th token after position e; its loss is
the cross-entropy against the target's distribution, weighted by `ttt_decay ** s` (token loss only).

Draft vocabulary (`draft_vocab_size`; the recipe's default is a quarter of the target's, as EAGLE-3's
32,000 of Llama 3's 128,256): the output head keeps only the most frequent target tokens of the
training traffic. `d2t[d]` holds OFFSETS (target id = d + d2t[d]); `t2d` is a boolean
mask over the target vocabulary; `check_vocab_maps` rejects inconsistent maps. The output head is the
target's, restricted to those rows and frozen, or with `config.own_lm_head` a `lm_head` of the head's own
over the draft vocabulary, started from those rows and trained with the rest (EAGLE-3's reference recipe).
Module and buffer names follow the EAGLE-3 checkpoints SGLang and vLLM load (`fc`, `midlayer.*`, `norm`,
`lm_head`, `d2t`, `t2d`); drafters/eagle_export.py reads a head back from those exports.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP

from drafters.base import Proposal
from drafters.head_losses import label_cross_entropy, label_stats, soft_cross_entropy, step_stats
from drafters.heads import ChainBatch, FeatureDrafter, TreeDrafting
from drafters.kv_cache import KVCache, RaggedRows
from drafters.layers import Attention, RMSNorm, Rotary, SharedTarget, causal_mask, last_entries, mlp_decode, norm
from drafters.sampling import Sampling, draw


def draft_vocabulary(counts: torch.Tensor, size: int, always: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t (offsets, int64 [size]) and t2d (bool [V]) for the `size` most frequent target tokens.

    counts: (V,) token frequencies in the training traffic; `always` (e.g. EOS) are kept whatever
    their count. Draft ids follow target-id order, so offsets are >= 0.
    """
    vocab = counts.numel()
    if not 0 < size <= vocab:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab} (the target's vocabulary), got {size}")
    score = counts.double().clone()
    score[list(always)] = float("inf")
    # Most frequent first, lower id first among equals (a stable sort of ids by descending count).
    order = torch.sort(-score, stable=True).indices[:size]
    kept = torch.sort(order).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return kept - torch.arange(size), t2d


def vocabulary_size_for(counts: torch.Tensor, coverage: float, always: list[int] = ()) -> int:
    """The smallest draft vocabulary (as `draft_vocabulary` ranks it) whose tokens make up at least
    `coverage` of `counts`' total: e.g. 0.999 keeps all but the rarest tenth of a percent of the traffic.
    `always` tokens count first, as `draft_vocabulary` keeps them whatever their count."""
    if not 0 < coverage <= 1:
        raise ValueError(f"draft_vocab_coverage must be in (0, 1], got {coverage}")
    total = float(counts.double().sum())
    if total <= 0:
        raise ValueError("no training tokens were counted: cannot size the draft vocabulary by coverage")
    score = counts.double().clone()
    score[list(always)] = float("inf")
    order = torch.sort(-score, stable=True).indices
    held = torch.cumsum(counts.double()[order], 0) / total
    # The first rank whose partial sum reaches the share (rounding may leave the last a hair under 1).
    size = int(torch.searchsorted(held, torch.tensor(coverage - 1e-12, dtype=held.dtype))) + 1
    return min(max(size, len(set(always))), counts.numel())


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Raise ValueError unless d2t and t2d describe the same vocabulary; return the target ids."""
    if d2t.dim() != 1 or t2d.dim() != 1 or t2d.dtype != torch.bool:
        raise ValueError("d2t must be a 1-d integer tensor of offsets and t2d a 1-d boolean mask")
    target_ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
    if int(t2d.sum()) != d2t.numel():
        raise ValueError(f"t2d marks {int(t2d.sum())} target tokens but d2t maps {d2t.numel()} draft tokens")
    if target_ids.min() < 0 or target_ids.max() >= t2d.numel():
        raise ValueError(f"d2t maps draft ids outside the target vocabulary 0..{t2d.numel() - 1}")
    if (target_ids[1:] <= target_ids[:-1]).any():
        raise ValueError("d2t maps two draft ids to the same target id, or out of order")
    if not t2d.to(target_ids.device)[target_ids].all():
        raise ValueError("d2t maps a draft id to a target token that t2d does not mark: d2t and t2d disagree")
    return target_ids


def vocabulary_coverage(token_ids: list[int], t2d: torch.Tensor) -> float:
    """Share of the given target tokens that the draft vocabulary can propose."""
    if not token_ids:
        return float("nan")
    return float(t2d.cpu()[torch.tensor(token_ids)].float().mean())


class DraftVocabulary:
    """A head's draft vocabulary (`config.draft_vocab_size` of the target's `config.vocab_size` tokens), shared by
    EAGLE-3 and DFlash: the `d2t` (offsets) and `t2d` (mask) buffers the engines read, the target's output-head rows
    of those tokens, and the loss's view of the target's labels and distributions over them. An nn.Module mixin:
    `_init_vocabulary` registers the buffers; `self.shared` is the attached target (drafters/layers.py `SharedTarget`)."""

    def _init_vocabulary(self, config, maps_always: bool = True) -> int:
        """Register the maps; without `maps_always`, only for a draft vocabulary smaller than the target's (a head
        over the whole vocabulary then saves exactly what it saved before it could keep one)."""
        size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        keep = maps_always or size < config.vocab_size
        self.register_buffer("d2t", torch.zeros(size, dtype=torch.long) if keep else None)
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool) if keep else None)
        self._rows: tuple | None = None  # (key, draft-vocabulary rows of the target's output head)
        return size

    def set_vocabulary(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        check_vocab_maps(d2t, t2d)
        if self.d2t is None:
            raise ValueError("this head drafts over the target's whole vocabulary (no draft_vocab_size): it has no maps")
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"maps of shape {tuple(d2t.shape)}/{tuple(t2d.shape)} do not fit a head with "
                             f"{self.d2t.numel()} draft and {self.t2d.numel()} target tokens")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        self._rows = None

    @property
    def reduced(self) -> bool:
        return self.d2t is not None and self.d2t.numel() < self.t2d.numel()

    def target_ids(self) -> torch.Tensor:
        return check_vocab_maps(self.d2t, self.t2d)

    def _target_rows(self) -> torch.Tensor:
        """The target's output-head rows of the draft vocabulary, gathered once (the target is frozen) and again
        only when the maps or the device change."""
        weight = self.shared.lm_head.weight
        key = (self.d2t.device, weight.device, weight.data_ptr())
        if self._rows is None or self._rows[0] != key:
            self._rows = (key, weight[self.target_ids()].detach())
        return self._rows[1]

    def draft_index(self) -> torch.Tensor:
        """(V,) each target token's index in the draft vocabulary, -1 where the head cannot propose it."""
        if self.t2d is None:
            return torch.arange(self.config.vocab_size, device=self.fc.weight.device)
        return torch.where(self.t2d, torch.cumsum(self.t2d.long(), 0) - 1, -1)

    def restrict(self, p: torch.Tensor) -> torch.Tensor:
        """The target's distributions (N, V) restricted to the draft vocabulary and renormalised (N, draft)."""
        if not self.reduced:
            return p
        kept = p[:, self.target_ids()]
        return kept / kept.sum(-1, keepdim=True).clamp_min(1e-12)


class Eagle3Layer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d = config.hidden_size
        self.self_attn = Attention(config, input_size=2 * d)
        self.mlp = LlamaMLP(config)
        self.hidden_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.input_layernorm = RMSNorm(d, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, eps=config.rms_norm_eps)
        # EAGLE-3.1 (speculators' default): the residual is the normed hidden state, not the raw one.
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, embeds, hidden, cos, sin, mask, cache=None, base=None, diagonal=()):
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h, kv = self.self_attn(x, cos, sin, mask, cache, base, diagonal)
        h = (normed if self.norm_before_residual else hidden) + h
        return h + self.mlp(self.post_attention_layernorm(h)), kv

    def decode(self, embeds, hidden, cos, sin, mask, cache: KVCache, last: bool = False):
        """`forward(...)[0]` on top of `cache` for drafting (inference only), on the fused ops. `last`:
        the last entry's output only, every entry's keys and values cached (`Attention.decode`)."""
        normed = norm(hidden, self.hidden_norm)
        x = torch.cat([norm(embeds, self.input_layernorm), normed], dim=-1)
        residual = normed if self.norm_before_residual else hidden
        h = last_entries(residual, last) + self.self_attn.decode(x, cos, sin, mask, cache, last)
        return h + mlp_decode(self.mlp, norm(h, self.post_attention_layernorm))


class Eagle3(DraftVocabulary, nn.Module):
    """The head. config: a Llama config from drafters.heads.head_config with `ttt_steps`, `ttt_decay`
    and optionally `draft_vocab_size`."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        fused = len(config.feature_layers) * config.target_hidden_size
        # EAGLE-3.1 (speculators' defaults, config flags as its format names them): an RMS norm over the fused
        # features before fc (`norm_before_fc`), and the final norm's output, not the layer's, fed to the next draft
        # step (`norm_output`); `norm_before_residual` is the layer's (Eagle3Layer).
        self.input_norm = RMSNorm(fused, eps=config.rms_norm_eps) if getattr(config, "norm_before_fc", False) else None
        self.norm_output = bool(getattr(config, "norm_output", False))
        # `head_norm` false: the output head reads the layer's output un-normed, as SpecForge's norm_output=false
        # drafts (drafters/eagle_export.py `load_engine_eagle3`); true (absent) for every head draftsmith trains.
        self.head_norm = bool(getattr(config, "head_norm", True))
        self.fc = nn.Linear(fused, d, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.rotary = Rotary(config)
        size = self._init_vocabulary(config)
        # config.own_lm_head: an output head of its own over the draft vocabulary, trained with the rest (EAGLE-3's
        # reference recipe); otherwise the head drafts through the target's output head, restricted to those rows.
        self.lm_head = nn.Linear(d, size, bias=False) if getattr(config, "own_lm_head", False) else None
        self.shared: SharedTarget | None = None

    def attach(self, target) -> None:
        self.shared = SharedTarget(target)
        self._rows = None

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's fused features (..., L*d_target) as the layer's hidden input (..., d)."""
        return self.fc(features if self.input_norm is None else norm(features, self.input_norm))

    def _out(self, h: torch.Tensor) -> torch.Tensor:
        """What a step hands on (to the output head and the next step): the layer's output, or with `norm_output`
        the final norm's."""
        return norm(h, self.norm) if self.norm_output else h

    def draft_logits(self, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over the draft vocabulary: the head's own output head, or the target's (only the kept rows),
        on norm(h) (on h itself with `norm_output`, whose steps hand on the normed state). `rows`: `_draft_rows()`
        already looked up (drafting fetches them once per round)."""
        if rows is None and (self.reduced or self.lm_head is not None):
            rows = self._draft_rows()
        return self.shared.logits(h if self.norm_output or not self.head_norm else norm(h, self.norm), rows)

    def init_lm_head(self, saved: "Eagle3 | None" = None) -> None:
        """Fill the head's own output head (config.own_lm_head) with the target's rows of the draft vocabulary;
        where `saved` (a head this one starts from) owns one, with its rows for the tokens both vocabularies hold."""
        ids = self.target_ids()
        rows = self.shared.lm_head.weight.detach()[ids].to(self.lm_head.weight.dtype)
        if saved is not None and saved.lm_head is not None:
            at = torch.full((self.config.vocab_size,), -1, dtype=torch.long)
            at[saved.target_ids().cpu()] = torch.arange(saved.d2t.numel())
            where = at[ids.cpu()]
            both = where >= 0
            rows[both.to(rows.device)] = saved.lm_head.weight.detach()[where[both].to(rows.device)].to(rows)
        with torch.no_grad():
            self.lm_head.weight.copy_(rows)

    def _draft_rows(self) -> torch.Tensor:
        """The output head's rows of the draft vocabulary: the head's own, or the target's."""
        return self.lm_head.weight if self.lm_head is not None else self._target_rows()

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, start: int, cache: KVCache,
             last: bool = False) -> torch.Tensor:
        """Inference: entries (hidden (1, q, d), tokens (q,)) at positions start..start+q-1 on top of
        `cache`; their outputs (1, q, d), or with `last` the last one's (1, 1, d) alone: drafting reads
        only that, and the one layer's other outputs feed nothing (their keys and values are cached)."""
        q = hidden.shape[1]
        cos, sin = self.rotary.decode(hidden, start, q)
        mask = causal_mask(q, len(cache), hidden.device) if q > 1 and not last else None
        embeds = self.shared.embed_tokens(tokens[None], hidden.dtype)
        return self._out(self.midlayer.decode(embeds, hidden, cos, sin, mask, cache, last))

    def step_tree(self, hidden: torch.Tensor, tokens: torch.Tensor, position: int, mask: torch.Tensor,
                  cache: KVCache) -> torch.Tensor:
        """Tree drafting (drafters/heads.py `TreeDrafting`): q sibling entries of one depth (hidden (1, q, d),
        tokens (q,)), all at `position`, each seeing the keys `mask` (q, len(cache) + q) allows; outputs (1, q, d)."""
        cos, sin = self.rotary.decode(hidden, position, 1)
        embeds = self.shared.embed_tokens(tokens[None], hidden.dtype)
        return self._out(self.midlayer.decode(embeds, hidden, cos, sin, mask[None, None], cache))

    def step_rows(self, hidden: torch.Tensor, tokens: torch.Tensor, rows: RaggedRows, cache: KVCache,
                  last: torch.Tensor | None = None) -> torch.Tensor:
        """`step` for a ragged batch (eval/batching.py): row b's entries at its own next positions on top
        of `cache` (over `rows`; the caller advances them). hidden (B, q, d), tokens (B, q); with `last`
        (B,), row b's entry last[b] alone, (B, 1, d)."""
        q = hidden.shape[1]
        cos, sin = self.rotary.decode_rows(hidden, rows.positions(q), rows.end(q))
        embeds = self.shared.embed_tokens(tokens, hidden.dtype)
        return self._out(self.midlayer.decode(embeds, hidden, cos, sin, rows.mask(q), cache,
                                              False if last is None else last))

    def unroll(self, features, input_ids, attention_mask) -> list[torch.Tensor]:
        """Training-time test over whole sequences: draft-vocabulary logits (B, T-1, N) of each step.

        Step s, entry e: the head's (s+1)-th draft after position e, i.e. its guess for token e+s+2,
        given the target's features at 0..e, tokens through e+s+1 and its own outputs of steps < s.
        """
        return [self.draft_logits(out) for out in self.unroll_states(features, input_ids, attention_mask)]

    def unroll_states(self, features, input_ids, attention_mask):
        """`unroll`'s steps before the output head: the layer's outputs (B, T-1, d), one step at a time."""
        B, T = input_ids.shape
        S, E = self.config.ttt_steps, T - 1
        ids = torch.cat([input_ids, input_ids.new_zeros(B, S)], dim=1)  # tokens past the end: padding
        key_valid = attention_mask[:, 1:].bool().clone()
        key_valid[:, 0] = True  # never a query with no key at all (padding rows are masked out of the loss)
        mask = causal_mask(E, 0, input_ids.device, key_valid)
        hidden = self.fuse(features[:, :-1])
        base, diagonal = None, []
        for s in range(S):
            cos, sin = self.rotary(hidden, s, E)
            embeds = self.shared.embed_tokens(ids[:, 1 + s: 1 + s + E], hidden.dtype)
            out, kv = self.midlayer(embeds, hidden, cos, sin, mask, base=base, diagonal=diagonal)
            out = self._out(out)
            if s == 0:
                base = kv
            else:
                diagonal = [*diagonal, kv]
            yield out
            hidden = out

    def forward(self, features, input_ids, attention_mask, loss_mask, target_probs):
        """Training loss: features (B, T, L*d_target); input_ids, attention_mask, loss_mask (B, T);
        target_probs (B, T, V), the target's next-token distribution at each position, or (B, T) integer
        labels, the token it gives all its probability to (its argmax: a label temperature of 0).
        Returns (loss, [stats per step]).

        The output head runs only where the loss reads it (the assistant tokens): over a draft
        vocabulary of N tokens that matmul, (positions x d x N) per step, is most of a step's work."""
        B, T = input_ids.shape
        S, E = self.config.ttt_steps, T - 1
        pad = lambda t: torch.cat([t, t.new_zeros((B, S + 1))], dim=1)  # noqa: E731
        lmask, valid = pad(loss_mask), pad(attention_mask)
        target_ids = self.target_ids() if self.reduced else None
        labels = not target_probs.is_floating_point()
        if labels:  # a label's index in the draft vocabulary, -1 where the head cannot propose it
            draft_index = self.draft_index()
        loss, stats = 0.0, []
        for s, out in enumerate(self.unroll_states(features, input_ids, attention_mask)):
            # Entry e of step s guesses token e+s+2, whose distribution the target gave at position e+s+1.
            rows, entries = (lmask[:, 2 + s: 2 + s + E].bool() & valid[:, 2 + s: 2 + s + E].bool()).nonzero(as_tuple=True)
            logits = self.draft_logits(out[rows, entries])
            p = target_probs[rows, entries + 1 + s]
            decay = self.config.ttt_decay ** s
            if labels:
                loss = loss + decay * label_cross_entropy(logits, draft_index[p])
                stats.append(label_stats(logits.detach(), p, draft_index[p], target_ids, at=(rows, entries, (B, T)),
                                         hits=not self.training))
                continue
            loss = loss + decay * soft_cross_entropy(logits, self.restrict(p), torch.ones_like(rows))
            stats.append(step_stats(torch.softmax(logits.detach().float(), -1), p, draft_ids=target_ids,
                                    at=(rows, entries, (B, T)), hits=not self.training))
        return loss, stats

    def drafter(self, name: str = "eagle", stop_below: float = 0.0, stop_rule: str = "propose") -> "Eagle3Drafter":
        return Eagle3Drafter(self, name, stop_below, stop_rule)

    def batch_drafter(self, name: str = "eagle", stop_below: float = 0.0, stop_rule: str = "propose") -> "Eagle3Batch":
        return Eagle3Batch(self, name, stop_below, stop_rule)


class Eagle3Drafter(TreeDrafting, FeatureDrafter):
    """Drafts a chain of k tokens (or a dynamic tree) with an EAGLE-3 head, with its own KV cache rolled back on
    commit."""

    def start(self, prompt_ids, features=None) -> None:
        super().start(prompt_ids, features)
        self.cache = KVCache()
        self.fed = 0  # entries in the cache built from the target's real features
        self.target_ids = self.head.target_ids() if self.head.reduced else None

    def first(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        return self.head.step(self.head.fuse(self.pending)[None], tokens, start, self.cache, last=True)

    def tree_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head.draft_logits(h, self.head._draft_rows() if self.target_ids is not None else None)

    @torch.inference_mode()
    def propose(self, k: int, sampling: Sampling, generator: torch.Generator | None = None) -> Proposal:
        head, m = self.head, len(self.ids) - 1
        if m == 0:  # a one-token prompt: no features yet, nothing to draft from
            self.guesses = []
            return Proposal(torch.empty(0, dtype=torch.long, device=self.device))
        new = self.pending.shape[0]
        tokens = torch.tensor(self.ids[m - new + 1: m + 1], device=self.device)
        h = head.step(head.fuse(self.pending)[None], tokens, m - new, self.cache, last=True)
        self.pending, self.fed = self.pending[:0], m
        rows = head._draft_rows() if self.target_ids is not None else None
        guesses, dists = [], []
        for s in range(k):
            logits = head.draft_logits(h, rows)[0, -1]
            token, q = _pick(logits, sampling, generator, self.target_ids, head.config.vocab_size)
            unsure = bool(self.stop) and self.stop.unsure(logits, q, token)
            if unsure and self.stop.drops:
                break
            guesses.append(token)
            dists.append(q)
            if unsure:
                break
            if s < k - 1:
                h = head.step(h, token.view(1), m + s, self.cache)
        self.guesses = [int(t) for t in guesses]
        if not guesses:  # the first guess was dropped
            return Proposal(torch.empty(0, dtype=torch.long, device=self.device))
        return Proposal(torch.stack(guesses), None if sampling.greedy else torch.stack(dists))

    def commit(self, n_accepted: int, next_token: int, features=None) -> None:
        self.cache.crop(self.fed)  # draft entries were built on the head's own outputs: drop them
        super().commit(n_accepted, next_token, features)


class Eagle3Batch(ChainBatch):
    """EAGLE-3 drafting for a batch (drafters/heads.py `ChainBatch`): its ragged cache holds, per row, the
    entries built from the target's features; each round's drafted entries are dropped at commit."""

    def start(self, prompts, features=None) -> None:
        super().start(prompts, features)
        self.target_ids = self.head.target_ids() if self.head.reduced else None

    def first(self, hidden, tokens, last):
        return self.head.step_rows(self.head.fuse(hidden), tokens, self.rows, self.cache, last)

    def next(self, h, tokens):
        return self.head.step_rows(h, tokens, self.rows, self.cache)

    def logits(self, h):
        return self.head.draft_logits(h, self.head._draft_rows() if self.target_ids is not None else None)[:, -1]

    def pick(self, logits, sampling, generator):
        return _pick(logits, sampling, generator, self.target_ids, self.head.config.vocab_size)


def _pick(logits, sampling, generator, target_ids, vocab_size):
    """A guess (as a target id) and, when sampling, the full-vocabulary distribution it came from."""
    d, q = draw(logits, sampling, generator)
    if target_ids is None:
        return d, q
    return target_ids[d], (None if q is None else q.new_zeros(*q.shape[:-1], vocab_size).index_copy_(-1, target_ids, q))


# EAGLE-3.1's norm switches, as speculators' and SGLang's config.json name them (Eagle3, Eagle3Layer).
NORM_FLAGS = ("norm_before_fc", "norm_before_residual", "norm_output")


HEAD = Eagle3
