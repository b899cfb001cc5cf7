"""Recipe: train a DFlash drafter (drafters/dflash.py) on the frozen target's features.

    python -m train drafter=dflash                                # on the toy world's company traffic
    python -m train drafter=dflash drafter.block_size=9 drafter.num_layers=2

The head recipe as it is (train/heads.py): features online or offline, the target's distributions as labels, the
held-out replay choosing the best checkpoint. What is DFlash's own: the mask token, resolved from the target's
tokenizer where `drafter.mask_token_id` is not set, and the checks the engines' formats need.
"""

from __future__ import annotations

from omegaconf import DictConfig

from train.heads import HeadRecipe
from train.recipe import run as run_recipe


class DFlashRecipe(HeadRecipe):
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
        settings = super()._head_settings()
        settings["mask_token_id"] = self._mask_token(self.target.config.vocab_size)
        return settings


def run(cfg: DictConfig) -> dict:
    """setup, train, finish, cleanup: what `python -m train drafter=dflash` does."""
    return run_recipe(cfg, DFlashRecipe)
