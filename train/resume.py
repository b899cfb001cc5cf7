"""What resuming a run touches beyond its checkpoint (train/recipe.py `Recipe._maybe_resume`, traffic/checkpoint.py):
the metrics an interrupted run logged past its last checkpoint, and the runs a launch without its name left behind."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from traffic import checkpoint

log = logging.getLogger(__name__)


def drop_metrics_after(metrics: Path, step: int) -> int:
    """Keep `metrics` (a run's metrics.jsonl) up to `step`, and say how many lines went: the steps an interrupted run
    logged after its last checkpoint are trained again, so each step is logged once. A torn last line (a kill
    mid-write) goes too."""
    if not metrics.exists():
        return 0
    kept, dropped = [], 0
    for line in metrics.read_text().splitlines():
        try:
            keep = json.loads(line)["step"] <= step
        except (json.JSONDecodeError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        tmp = metrics.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        tmp.replace(metrics)
    return dropped


def point_to_unfinished_runs(out: Path) -> None:
    """A run launched again without its name starts in a new time-stamped directory (`out`): say which runs beside it
    stopped before their end with a checkpoint, and the option that resumes one."""
    unfinished = sorted((run for run in out.parent.iterdir() if run != out and run.is_dir()
                         and not (run / "train_summary.json").exists()
                         and checkpoint.latest(run / "checkpoints") is not None), key=lambda r: r.stat().st_mtime)
    if unfinished:
        last = unfinished[-1]
        msg = (f"{len(unfinished)} run(s) in {out.parent} stopped before their end with a checkpoint, the "
               f"latest {last.name} at {checkpoint.latest(last / 'checkpoints').name}: the same command with "
               f"name={last.name} resumes it (this run starts from scratch in {out.name})")
        log.warning(msg)
        print(f"warning: {msg}")
