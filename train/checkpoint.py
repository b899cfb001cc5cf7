"""Training checkpoints that survive a crash: written atomically, complete or absent, fully resumable.

A checkpoint is a directory `step-000120/` holding

- `model.safetensors`: the trainable model's state dict (weights: safetensors, never pickle);
- `optimizer.pt`: the optimizer's state dict (tensors and numbers only, loaded with
  `torch.load(weights_only=True)`, which refuses arbitrary objects);
- `rng.safetensors`: the torch CPU (and CUDA) generator states;
- `state.json`: step, scheduler state, Python `random` state and the metric used to pick the best;
- `COMPLETE`: written last.

Everything is written into `step-000120.tmp-<pid>/` and renamed into place, so a checkpoint directory
exists under its final name only when complete; `latest` ignores anything else.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

MARKER = "COMPLETE"


def _name(step: int) -> str:
    return f"step-{step:06d}"


def save(directory: str | Path, step: int, model: torch.nn.Module, optimizer, scheduler, extra: dict | None = None,
         keep: int | None = None) -> Path:
    """Write checkpoint `step` under directory atomically; keep only the newest `keep` (None = all)."""
    directory = Path(directory)
    final = directory / _name(step)
    tmp = directory / f"{_name(step)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "model.safetensors"))  # handles tied weights (embedding = LM head)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    save_file(rng, str(tmp / "rng.safetensors"))
    py_state = random.getstate()
    (tmp / "state.json").write_text(json.dumps({
        "step": step,
        "scheduler": scheduler.state_dict(),
        "python_random": [py_state[0], list(py_state[1]), py_state[2]],
        **(extra or {}),
    }))
    (tmp / MARKER).write_text("")
    if final.exists():  # a previous complete save of the same step (e.g. re-run after resume)
        shutil.rmtree(final)
    tmp.rename(final)
    if keep is not None:
        for old in complete(directory)[:-keep]:
            shutil.rmtree(old)
    return final


def complete(directory: str | Path) -> list[Path]:
    """Complete checkpoints under directory, oldest first."""
    directory = Path(directory)
    if not directory.exists():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and p.name.startswith("step-") and "." not in p.name
             and (p / MARKER).exists()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    found = complete(directory)
    return found[-1] if found else None


def load(path: str | Path, model: torch.nn.Module, optimizer, scheduler) -> dict:
    """Restore model, optimizer, scheduler and RNG states from a checkpoint; return its state.json."""
    path = Path(path)
    if not (path / MARKER).exists():
        raise ValueError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
    load_model(model, str(path / "model.safetensors"), strict=True)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    state = json.loads((path / "state.json").read_text())
    scheduler.load_state_dict(state["scheduler"])
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available():
        cuda = [rng[k] for k in sorted(rng) if k.startswith("cuda")]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
    version, internal, gauss = state["python_random"]
    random.setstate((version, tuple(internal), gauss))
    return state
