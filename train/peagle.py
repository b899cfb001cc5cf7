"""Recipe: train a P-EAGLE head (drafters/peagle.py) on the frozen target's features.

    python -m train drafter=peagle                               # on the toy world's company traffic
    python -m train drafter=peagle drafter.num_depths=4 drafter.draft_vocab_size=1024

EAGLE-3's layer as its recipe trains it (train/eagle3.py `Eagle3Layer`: the draft vocabulary, an output head of its own, labels read only where
the loss reads them). What is P-EAGLE's own: the mask token, resolved from the target's tokenizer where
`drafter.mask_token_id` is not set (as for DFlash), and the depths and conditional drop it trains with.
"""

from __future__ import annotations

from omegaconf import DictConfig

from train.config import check_chains
from train.eagle3 import Eagle3Layer
from train.heads import HeadRecipe
from train.recipe import run as run_recipe


class PEagleRecipe(Eagle3Layer, HeadRecipe):
    """One training run of a P-EAGLE head."""

    def _validate(self) -> None:
        super()._validate()
        d = self.cfg.drafter
        check_chains(d)
        if d.norm_output:
            raise ValueError("drafter.norm_output does not apply to P-EAGLE: it hands no state to a next draft step "
                             "(one forward drafts every guess), and vLLM does not read it for P-EAGLE")

    def _head_settings(self) -> dict:
        d = self.cfg.drafter
        settings = {key: value for key, value in self._layout_settings().items() if key != "norm_output"}
        mask = self._mask_token(self.target.config.vocab_size)
        return {**settings, "mask_token_id": mask, "num_depths": d.num_depths, "cod_ratio": d.cod_ratio,
                "cod_min_ratio": d.cod_min_ratio, "max_anchors": d.max_anchors}


def run(cfg: DictConfig) -> dict:
    """setup, train, finish, cleanup: what `python -m train drafter=peagle` does."""
    return run_recipe(cfg, PEagleRecipe)
