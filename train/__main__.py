"""`python -m train`: train a drafter for a target on company traffic (see conf/train.yaml).

A thin Hydra wrapper: `train(cfg)` picks the recipe for `drafter.kind` and is what tests call.
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from omegaconf import DictConfig

from train.config import register

register()

RECIPES = {"draft_lm": "train.distill", "eagle": "train.heads", "eagle1": "train.heads", "mtp": "train.heads",
           "medusa": "train.heads"}


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
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # All ranks have passed a final barrier and every file is written. Tearing gloo down through
        # destructors can deadlock (the DDP reducer's process group destructor waits on a lock held by
        # a group already shut down), so a distributed run leaves without running them.
        logging.getLogger(__name__).info("rank %d of %d: done, leaving without destructors",
                                         dist.get_rank(), dist.get_world_size())
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(0)


if __name__ == "__main__":
    main()
