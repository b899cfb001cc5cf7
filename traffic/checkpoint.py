"""Training checkpoints that survive a crash: written atomically, complete or absent, fully resumable.

A checkpoint is a directory `step-000120/` holding

- `model.safetensors`: the trainable model's whole state dict (weights: safetensors, never pickle);
- `optimizer.pt`: the optimizer's whole state dict, keyed by parameter name (tensors, names and numbers
  only, loaded with `torch.load(weights_only=True)`, which refuses arbitrary objects);
- `rng.safetensors`: the torch CPU (and CUDA) generator states;
- `state.json`: step, scheduler state, Python `random` state and the metric used to pick the best;
- `COMPLETE`: written last.

Everything is written into `step-000120.tmp-<pid>/` and renamed into place, so a checkpoint directory
exists under its final name only when complete; `latest` ignores anything else.

Model and optimizer states go through torch's distributed state-dict API
(`torch.distributed.checkpoint.state_dict`), which sees through the wrappers Accelerate puts around
them: a plain module, DDP, or FSDP with sharded parameters and optimizer state. Saving gathers the full
states (every process must call `save`; the first one writes), loading gives each process its part.
The files are therefore the same whatever ran the training, and a checkpoint written by an FSDP run
loads into a single process and the other way round. DeepSpeed's engine keeps its partitions outside
that API; the recipes refuse it (train/recipe.py).

The training recipes (train/) and the toy world's own model training (traffic/toy_lm.py `train_lm`)
both checkpoint through this module, which is why it sits in `traffic`, below them both.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

MARKER = "COMPLETE"


def _is_main() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _raw(optimizer):
    """The torch optimizer inside Accelerate's wrapper (AcceleratedOptimizer keeps it as `.optimizer`)."""
    return getattr(optimizer, "optimizer", optimizer)


def full_model_state(model: torch.nn.Module, everywhere: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's weights as CPU tensors, whatever wraps or shards it. Collective: every process
    calls it. The first process gets the weights, the others {} unless `everywhere`."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=not everywhere))
    return {name: t.detach().cpu() for name, t in state.items()}


def write_weights(state: dict[str, torch.Tensor], path: str | Path) -> None:
    """A state dict to safetensors. Tied weights (an embedding shared with the output head) are
    written under each of their names, so the file loads strictly into the model either way."""
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone().contiguous() if ptr in seen else t.contiguous()
        seen.add(ptr)
    save_file(out, str(path))


def _name(step: int) -> str:
    return f"step-{step:06d}"


def save(directory: str | Path, step: int, model: torch.nn.Module, optimizer, scheduler, extra: dict | None = None,
         keep: int | None = None) -> Path:
    """Write checkpoint `step` under directory atomically; keep only the newest `keep` (None = all).

    Collective: every process calls it with its (possibly wrapped or sharded) model and optimizer; the
    first process writes. Returns the checkpoint's path."""
    directory = Path(directory)
    final = directory / _name(step)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = full_model_state(model)
    optim_state = get_optimizer_state_dict(model, _raw(optimizer), options=options)
    if not _is_main():
        return final
    tmp = directory / f"{_name(step)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_weights(weights, tmp / "model.safetensors")
    torch.save(optim_state, tmp / "optimizer.pt")
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
    """Restore model, optimizer, scheduler and RNG states from a checkpoint; return its state.json.

    Every process calls it (each reads the files and keeps its own part of sharded states)."""
    path = Path(path)
    if not (path / MARKER).exists():
        raise ValueError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
    options = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(model, load_file(str(path / "model.safetensors")), options=options)
    set_optimizer_state_dict(model, _raw(optimizer), torch.load(path / "optimizer.pt", weights_only=True),
                             options=options)
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
