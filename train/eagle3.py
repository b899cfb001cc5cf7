"""EAGLE-3's own part of the head recipe (train/heads.py): its draft vocabulary, sized by a share, a number of
tokens or a coverage of the training traffic, ranked by token counts or by the target's probabilities, with
its coverage of each held-out category reported (`drafter.draft_vocab_*`); an output head of its own
(`drafter.own_lm_head`); and labels read only where its loss reads them.

    python -m train drafter=eagle drafter.draft_vocab_size=2048 drafter.hidden_states=offline
    python -m train drafter=eagle drafter.draft_vocab_coverage=0.999   # sized to the traffic's tokens
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import datasets
import torch
from omegaconf import DictConfig

from drafters.eagle import draft_vocabulary, vocabulary_coverage, vocabulary_size_for
from drafters.head_losses import ReadRows
from train.heads import HeadRecipe, label_distribution
from train.data import records_batch
from train.recipe import run as run_recipe

log = logging.getLogger(__name__)

# The recipe warns when the draft vocabulary can propose less than this share of a held-out category's tokens.
WARN_BELOW_COVERAGE = 0.99


@torch.no_grad()
def expected_token_counts(target, rows, *, batch_size: int, max_length: int, pad_id: int, device: torch.device,
                          logits: Callable | None = None) -> dict[str, tuple[torch.Tensor, int]]:
    """Per category of `rows` (tokenized records): the target's next-token distribution (temperature 1)
    summed over the positions that predict an assistant token, as fp32 (V,), and how many positions.
    A token's entry is its expected count when the target samples that traffic: what a draft
    vocabulary must hold for sampled serving to accept (greedy-regenerated responses alone show only
    the target's argmax tokens). `logits(tensors, indices)`: the target's logits (B, T, V) of a batch of the rows at
    `indices` (None: the target's forward)."""
    sums: dict[str, tuple[torch.Tensor, int]] = {}
    for start in range(0, len(rows), batch_size):
        indices = list(range(start, min(start + batch_size, len(rows))))
        batch = [rows[i] for i in indices]
        tensors = records_batch(batch, pad_id, max_length, device)
        loss_mask = tensors["loss_mask"].bool()
        if logits is None:
            out = target(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"]).logits[:, :-1]
        else:
            out = logits(tensors, indices)[:, :-1]
        for j, row in enumerate(batch):
            # Position t predicts token t + 1; only those positions are turned into fp32 probabilities.
            chosen = torch.softmax(out[j][loss_mask[j, 1:]].float(), dim=-1)
            total, count = sums.get(row["category"], (torch.zeros(out.shape[-1], device=device), 0))
            sums[row["category"]] = (total + chosen.sum(0), count + chosen.shape[0])
    return {c: (total.cpu(), count) for c, (total, count) in sums.items()}


def draft_vocab_size(drafter_cfg, vocab_size: int) -> int | None:
    """EAGLE-3's draft vocabulary in tokens: `draft_vocab_size` if set, else `draft_vocab_share` of the
    target's vocabulary (EAGLE-3 keeps 32,000 of Llama 3's 128,256, about a quarter); None = all of it."""
    size, share = drafter_cfg.get("draft_vocab_size"), drafter_cfg.get("draft_vocab_share")
    if size is None and share is not None:
        if not 0 < share <= 1:
            raise ValueError(f"drafter.draft_vocab_share must be in (0, 1], got {share}")
        size = max(1, round(share * vocab_size))
    return None if size is None or size == vocab_size else size


class DraftVocabularyRecipe:
    """The draft vocabulary of a head that keeps one (EAGLE-3's, P-EAGLE's, DFlash's; drafters/eagle.py
    `DraftVocabulary`): sized from `drafter.draft_vocab_*` (`_vocabulary_settings`), its maps set on the new head
    (`_prepare_vocabulary`), its coverage of each held-out category reported. A mixin of a `HeadRecipe`."""

    def _validate(self) -> None:
        super()._validate()
        d = self.cfg.drafter
        if d.draft_vocab_from not in ("tokens", "target_probabilities"):
            raise ValueError(f"drafter.draft_vocab_from must be tokens or target_probabilities, "
                             f"got {d.draft_vocab_from!r}")
        coverage = d.draft_vocab_coverage
        if coverage is not None and not 0 < coverage <= 1:
            raise ValueError(f"drafter.draft_vocab_coverage must be in (0, 1], got {coverage}")
        if d.draft_vocab_examples < 1:
            raise ValueError(f"drafter.draft_vocab_examples must be >= 1, got {d.draft_vocab_examples}")
        if d.draft_vocab_from == "target_probabilities" and d.target_weights == "ends":
            raise ValueError("drafter.draft_vocab_from=target_probabilities runs the target over the training records, "
                             "and drafter.target_weights=ends loads its ends only: rank by tokens")

    def _vocabulary_settings(self) -> dict:
        """{"draft_vocab_size": N or None (all)}, sized from the run's settings (and the traffic's counts where
        `drafter.draft_vocab_coverage` sizes it, kept for `_prepare_vocabulary`)."""
        d, target = self.cfg.drafter, self.target
        size = draft_vocab_size(d, target.config.vocab_size)
        self.counts = None
        if d.draft_vocab_coverage is not None and d.draft_vocab_size is None:
            self.counts = self._vocabulary_counts()
            size = vocabulary_size_for(self.counts, d.draft_vocab_coverage, self._always_kept())
            log.info("draft vocabulary sized by coverage %s of the training tokens: %d of %d",
                     d.draft_vocab_coverage, size, target.config.vocab_size)
            size = None if size == target.config.vocab_size else size
        return {"draft_vocab_size": size}

    def _prepare_vocabulary(self, head) -> None:
        """The draft vocabulary's maps on the new head."""
        if head.config.draft_vocab_size:
            self._set_draft_vocabulary(head, head.config.draft_vocab_size, self.counts)

    def _always_kept(self) -> list[int]:
        return [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []

    def _vocabulary_counts(self) -> torch.Tensor:
        """(V,) what ranks the draft vocabulary: token counts in the training traffic's assistant turns
        (`drafter.draft_vocab_from=tokens`) or the target's expected counts there (`target_probabilities`,
        over the first `drafter.draft_vocab_examples` training records)."""
        d, t = self.cfg.drafter, self.cfg.trainer
        counts = torch.zeros(self.target.config.vocab_size)
        if d.draft_vocab_from == "tokens":
            for row in self.train_set:
                ids = torch.tensor(row["input_ids"])[torch.tensor(row["loss_mask"], dtype=torch.bool)]
                counts += torch.bincount(ids, minlength=counts.numel()).float()
            return counts
        rows = self.train_set.select(range(min(len(self.train_set), d.draft_vocab_examples)))
        expected = expected_token_counts(self.target, rows, batch_size=t.batch_size, max_length=t.max_length,
                                         pad_id=self.pad_id, device=self.device)
        for total, _ in expected.values():
            counts += total
        return counts

    def _set_draft_vocabulary(self, head, size: int, counts: torch.Tensor | None = None) -> None:
        """The `size` target tokens most frequent in the training traffic's assistant turns (plus EOS):
        counted as tokens (`drafter.draft_vocab_from=tokens`, EAGLE-3's recipe) or as the target's
        probabilities at those positions (`target_probabilities`, over the first
        `drafter.draft_vocab_examples` training records). Reports two coverages per held-out category:
        the share of assistant tokens the vocabulary can propose (greedy serving's ceiling), and the
        share of the target's probability it holds (sampled serving's: sum_x min(p, q) <= that mass)."""
        d, t = self.cfg.drafter, self.cfg.trainer
        expected = functools.partial(expected_token_counts, self.target, batch_size=t.batch_size,
                                     max_length=t.max_length, pad_id=self.pad_id, device=self.device)
        if counts is None:
            counts = self._vocabulary_counts()
        d2t, t2d = draft_vocabulary(counts, size, always=self._always_kept())
        head.set_vocabulary(d2t, t2d)
        if self.heldout_shards is None:
            held_out = datasets.load_from_disk(str(self.data_dirs["eval"] / "tokenized"))
        else:  # the target's ends only: the held-out records with features, its distributions from them
            held_out = self.eval_set
            expected = functools.partial(expected, logits=lambda tensors, indices: self._logits_of(
                self._states(self._with_features(tensors, self.heldout_shards, indices))[:, :, -1]))
        per_category: dict[str, list[int]] = {}
        for row in held_out:
            per_category.setdefault(row["category"], []).extend(
                t for t, m in zip(row["input_ids"], row["loss_mask"]) if m)
        self.coverage = {c: round(vocabulary_coverage(ids, t2d), 4) for c, ids in sorted(per_category.items())}
        self.mass = {c: round(float(total[t2d.to(total.device)].sum()) / max(n, 1), 4)
                     for c, (total, n) in sorted(expected(held_out).items())}
        log.info("draft vocabulary %d of %d tokens (from %s); held-out coverage per category: %s; target "
                 "probability inside it: %s", size, counts.numel(), d.draft_vocab_from, self.coverage, self.mass)
        if self.is_main:
            print(f"draft vocabulary: {size} of {counts.numel()} tokens; coverage of held-out assistant tokens "
                  f"per category: {self.coverage}; share of the target's probability (temperature 1) inside "
                  f"it, the most sampled serving can accept: {self.mass}")
        short = {c: v for c, v in self.coverage.items() if v < WARN_BELOW_COVERAGE}
        if short and self.is_main:
            # Greedy serving rejects every guess at a token the head cannot propose. Counted from tokens, a
            # vocabulary sized from the training answers never reaches the tokens they lack.
            seen = t2d | (counts.to(t2d.device) > 0)  # unseen: left out, and never in the training answers
            unseen = {c: 1 - vocabulary_coverage(per_category[c], seen) for c in short} \
                if d.draft_vocab_from == "tokens" else {}
            msg = (f"the draft vocabulary of {size} tokens cannot propose "
                   + ", ".join(f"{1 - v:.1%} of held-out {c} tokens"
                               + (f" ({unseen[c]:.1%} never in the training answers)" if unseen.get(c) else "")
                               for c, v in short.items())
                   + "; a larger one (drafter.draft_vocab_share, or drafter.draft_vocab_coverage=0.999) "
                     "costs one wider output-head matmul per drafted token"
                   + ("; tokens the training answers lack need traffic that has them (or draft_vocab_share=1)"
                      if any(unseen.values()) else ""))
            log.warning(msg)
            print(f"warning: {msg}")


class Eagle3Layer(DraftVocabularyRecipe):
    """What every recipe of a head on EAGLE-3's layer shares (EAGLE-3's and P-EAGLE's, each a `HeadRecipe`): the
    fused features, the draft vocabulary, an output head of its own and labels read only where the loss reads them.
    A mixin, so both kinds stay one level below the head recipe."""

    def _validate(self) -> None:
        super()._validate()
        d = self.cfg.drafter
        if d.intermediate_size is not None and d.intermediate_size < 1:
            raise ValueError(f"drafter.intermediate_size must be >= 1 (null = the target's), got {d.intermediate_size}")

    def _capture_layers(self) -> list[int]:
        """Its own layers are fused into its input; the target's last state, for the labels, always comes too."""
        return self.layers + [self.target.config.num_hidden_layers]

    def _layout_settings(self) -> dict:
        """The layer's settings every EAGLE-3 head has (drafters/kinds/eagle.py `Eagle3Layout`), its draft vocabulary
        sized from the run's settings."""
        d = self.cfg.drafter
        return {**self._vocabulary_settings(),
                "intermediate_size": d.intermediate_size, "own_lm_head": d.own_lm_head,
                "norm_before_fc": d.norm_before_fc, "norm_before_residual": d.norm_before_residual,
                "norm_output": d.norm_output}

    def _prepare_head(self, head) -> None:
        """The draft vocabulary's maps, and an output head of its own started from the target's rows (unless
        `drafter.init_from` brings one)."""
        d = self.cfg.drafter
        self._prepare_vocabulary(head)
        if d.own_lm_head and not d.init_from:
            head.init_lm_head()

    def _features(self, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's input features (B, T, L*d) and its labels, computed only where its loss reads them (before
        each assistant token): at temperature 0 the target's argmax itself, (B, T) token ids (-1 elsewhere), and
        otherwise the target's distributions at `temperature` as `ReadRows`. The full vocabulary's logits at
        every position were most of a step's work, and gigabytes for Gemma-3's vocabulary."""
        states = self._states(batch)
        head_states = states[:, :, : len(self.layers)].flatten(2).float()
        with torch.no_grad():
            read = torch.zeros_like(batch["loss_mask"], dtype=torch.bool)
            read[:, :-1] = batch["loss_mask"][:, 1:].bool()
            logits = self._logits_of(states[:, :, -1][read])
            if temperature == 0:
                labels = torch.full(read.shape, -1, dtype=torch.long, device=read.device)
                labels[read] = logits.argmax(-1)
                return head_states, labels
            index = torch.full(read.shape, -1, dtype=torch.long, device=read.device)
            index[read] = torch.arange(logits.shape[0], device=read.device)
            return head_states, ReadRows(index, label_distribution(logits, temperature))


class Eagle3Recipe(Eagle3Layer, HeadRecipe):
    """One training run of an EAGLE-3 head: the head recipe, with EAGLE-3's layer and its steps of training-time
    test."""

    def _head_settings(self) -> dict:
        d = self.cfg.drafter
        return {**self._layout_settings(), "ttt_steps": d.ttt_steps, "ttt_decay": d.ttt_decay}


def run(cfg: DictConfig) -> dict:
    """setup, train, finish, cleanup: what `python -m train drafter=eagle` does."""
    return run_recipe(cfg, Eagle3Recipe)
