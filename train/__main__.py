"""`python -m train`: train a drafter for a target on company traffic (see conf/train.yaml).

A thin Hydra wrapper: `train(cfg)` picks the recipe for `drafter.kind` and is what tests call.
"""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

from eval.config import register

log = logging.getLogger("train")
register()

RECIPES = {"draft_lm": "train.distill"}


def train(cfg: DictConfig) -> dict:
    """Run the recipe for cfg.drafter.kind; return its summary."""
    import importlib

    if cfg.drafter.kind not in RECIPES:
        raise ValueError(f"drafter.kind={cfg.drafter.kind!r} has no training recipe; known: {sorted(RECIPES)}")
    return importlib.import_module(RECIPES[cfg.drafter.kind]).run(cfg)


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        train(cfg)
    except (ValueError, FileNotFoundError) as e:  # bad input the user can fix: say what, not a traceback
        log.error("%s", e)
        sys.exit(2)


if __name__ == "__main__":
    main()
