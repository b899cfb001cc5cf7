"""Recipe: train a DFlash drafter (drafters/dflash.py) on the frozen target's features.

    python -m train drafter=dflash                                # on the toy world's company traffic
    python -m train drafter=dflash drafter.block_size=9 drafter.num_layers=2

The head recipe as it is (train/heads.py): features online or offline, the target's distributions as labels, the
held-out replay choosing the best checkpoint. What is DFlash's own: the mask token, resolved from the target's
tokenizer where `drafter.mask_token_id` is not set, and the checks the engines' formats need. Its draft vocabulary
(`drafter.draft_vocab_size`, `_share`, `_coverage`; all of the target's by default) is EAGLE-3's
(train/eagle3.py `DraftVocabularyRecipe`):

    python -m train drafter=dflash drafter.draft_vocab_size=4096   # the 4,096 most frequent answer tokens
"""

from __future__ import annotations

import dataclasses

from omegaconf import DictConfig

from drafters.kinds import DraftVocabularyConfig, HeadConfig
from train.eagle3 import DraftVocabularyRecipe
from train.heads import HeadRecipe
from train.recipe import run as run_recipe


# The keys that size the draft vocabulary: the recipe turns them into the head's one setting, `draft_vocab_size`.
VOCABULARY_KEYS = ({f.name for f in dataclasses.fields(DraftVocabularyConfig)}
                   - {f.name for f in dataclasses.fields(HeadConfig)})


class DFlashRecipe(DraftVocabularyRecipe, HeadRecipe):
    """One training run of a DFlash drafter."""

    def _validate(self) -> None:
        super()._validate()
        d = self.cfg.drafter
        if d.block_size < 2:
            raise ValueError(f"drafter.block_size must be >= 2 (the anchor and a masked position), got {d.block_size}")
        if d.num_layers < 1:
            raise ValueError(f"drafter.num_layers must be >= 1, got {d.num_layers}")
        if d.max_anchors < 1:
            raise ValueError(f"drafter.max_anchors must be >= 1, got {d.max_anchors}")
        if d.loss_decay_gamma is not None and not d.loss_decay_gamma > 0:
            raise ValueError(f"drafter.loss_decay_gamma must be > 0 (null: no decay), got {d.loss_decay_gamma}")

    def _head_settings(self) -> dict:
        settings = {k: v for k, v in super()._head_settings().items() if k not in VOCABULARY_KEYS}
        settings["mask_token_id"] = self._mask_token(self.target.config.vocab_size)
        return {**settings, **self._vocabulary_settings()}

    def _prepare_head(self, head) -> None:
        self._prepare_vocabulary(head)


def run(cfg: DictConfig) -> dict:
    """setup, train, finish, cleanup: what `python -m train drafter=dflash` does."""
    return run_recipe(cfg, DFlashRecipe)
