"""`python -m train`: train a drafter for a target on company traffic (see conf/train.yaml).

A thin Hydra wrapper: `train(cfg)` picks the recipe for `drafter.kind` and is what tests call.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path

import hydra
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from eval.engines.engine import stop_on_sigterm
from train.config import KINDS, RECIPES, drafter_keys, register

register()
CONF = str(Path(__file__).resolve().parents[1] / "conf")



def train(cfg: DictConfig) -> dict:
    """Run the recipe for cfg.drafter.kind; return its summary."""
    if cfg.drafter.kind not in RECIPES:
        raise ValueError(f"drafter.kind={cfg.drafter.kind!r} has no training recipe; known: {sorted(RECIPES)}")
    return importlib.import_module(RECIPES[cfg.drafter.kind]).run(cfg)


def check_drafter_keys(arguments: list[str]) -> None:
    """Each `drafter.KEY=...` of the command line names a key of the drafter kind the rest of it composes, or this
    stops before any work, naming the kind and its keys (Hydra's own error names only the kind's schema)."""
    overrides = [a for a in arguments if not a.startswith("-")]
    keys = [o.lstrip("+~").split("=", 1)[0].split(".")[1] for o in overrides if o.lstrip("+~").startswith("drafter.")]
    if not keys:
        return

    rest = [o for o in overrides if not o.lstrip("+~").startswith(("drafter.", "hydra."))]
    try:
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            kind = compose("train", overrides=rest).drafter.kind
    except Exception:  # anything else amiss (a sweep, a typo elsewhere): Hydra's own run says what
        return
    unknown = [key for key in keys if kind in KINDS and key not in drafter_keys(kind)]
    if unknown:
        print(f"error: drafter kind {kind!r} has no key {', '.join(map(repr, unknown))}; its keys: "
              f"{', '.join(drafter_keys(kind))} (train/config.py)", file=sys.stderr)
        sys.exit(2)


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        train(cfg)
    except (ValueError, FileNotFoundError) as e:  # bad input the user can fix: say what, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
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
    check_drafter_keys(sys.argv[1:])
    stop_on_sigterm()
    main()
