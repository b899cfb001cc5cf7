"""The target's hidden states, for drafters that read its features (EAGLE, MTP, Medusa heads).

Layer index convention (one convention everywhere in draftsmith): an index is a position in Hugging
Face's `output_hidden_states` tuple of a model with n decoder layers, so

- 0 is the embedding output (the input to layer 0),
- i (1 <= i < n) is the output of decoder layer i-1, i.e. the input to layer i,
- n is the model's last hidden state as Hugging Face returns it (after the final norm), the feature
  the LM head reads.

vLLM's `eagle_aux_hidden_state_layer_ids` use this same convention; SGLang's are one lower (0-based
layer outputs). Exporters convert at the boundary; nothing inside draftsmith does.

Two ways to get them:
- online: `capture` inside the training step (memory bounded by the batch);
- offline: `write_shards` precomputes them to sharded safetensors in fp16/bf16, after estimating the
  size and checking it against free disk and a cap, resumable shard by shard; `ShardReader` reads them
  back one example at a time.
"""

from __future__ import annotations

import bisect
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from drafters.heads import check_layers, features_of
from eval.run import DTYPES
from train.data import Example


def default_layers(kind: str, num_layers: int) -> list[int]:
    """The feature layers a head reads by default (indices in the convention of the module docstring).

    eagle1, medusa, mtp: the last hidden state [n]. eagle3 (alias eagle): a low, a middle and a high layer,
    [2, n//2, n-3] as EAGLE-3 and vLLM choose; on targets too shallow for three distinct layers there,
    [1, n//2, n-1], and on 2- or 3-layer test targets [0, n//2, n].
    """
    if kind in ("eagle1", "medusa", "mtp"):
        return [num_layers]
    if kind in ("eagle3", "eagle"):
        layers = [2, num_layers // 2, num_layers - 3]
        if len(set(layers)) < 3 or min(layers) < 1:
            layers = [1, num_layers // 2, num_layers - 1]
        if len(set(layers)) < 3 or min(layers) < 1:  # very shallow (test) targets: embedding, middle, last
            layers = [0, num_layers // 2, num_layers]
        if len(set(layers)) < 3:
            raise ValueError(f"a target with {num_layers} layers is too shallow for three distinct EAGLE-3 layers")
        return layers
    raise ValueError(f"unknown head kind {kind!r}; known: eagle1, eagle3, mtp, medusa")


@torch.no_grad()
def capture(target, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layers: list[int]) -> torch.Tensor:
    """Hidden states of `layers` for a batch: (B, T) ids -> (B, T, len(layers), d) in the target's dtype."""
    check_layers(layers, target.config.num_hidden_layers)
    out = target.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    return features_of(out.hidden_states, layers)


def bytes_per_token(hidden_size: int, n_layers: int, dtype: str) -> int:
    """Offline cache cost of one token: its features plus its id (int32) and loss-mask byte."""
    return hidden_size * n_layers * DTYPES[dtype].itemsize + 4 + 1


def estimate_bytes(examples: list[Example], hidden_size: int, n_layers: int, dtype: str) -> int:
    return sum(len(e.input_ids) for e in examples) * bytes_per_token(hidden_size, n_layers, dtype)


@dataclass
class ShardManifest:
    """manifest.json of an offline cache: which examples each finished shard holds."""

    layers: list[int]
    dtype: str
    hidden_size: int
    shards: list[dict]  # {"file", "first", "count", "tokens"}
    examples: int

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.__dict__, indent=1) + "\n")
        tmp.replace(path)


def write_shards(
    examples: list[Example],
    target,
    layers: list[int],
    out_dir: str | Path,
    *,
    dtype: str = "float16",
    batch_size: int = 8,
    shard_tokens: int = 65536,
    max_bytes: int | None = None,
    progress: bool = True,
) -> Path:
    """Precompute hidden states of `layers` for every example into sharded safetensors under out_dir.

    Checks the estimated size against `max_bytes` and the free disk before computing anything.
    Resumable: finished shards are listed in manifest.json and skipped on a rerun with the same inputs.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hidden = target.config.hidden_size
    check_layers(layers, target.config.num_hidden_layers)
    need = estimate_bytes(examples, hidden, len(layers), dtype)
    per_token = bytes_per_token(hidden, len(layers), dtype)
    if max_bytes is not None and need > max_bytes:
        raise ValueError(f"the offline hidden-state cache would take {need / 2**30:.2f} GiB ({per_token} bytes/token), "
                         f"over the cap of {max_bytes / 2**30:.2f} GiB; use online hidden states, fewer layers or "
                         "fewer examples, or raise the cap")
    free = shutil.disk_usage(out).free
    manifest_path = out / "manifest.json"
    if manifest_path.exists():
        manifest = ShardManifest(**json.loads(manifest_path.read_text()))
        if (manifest.layers, manifest.dtype, manifest.hidden_size, manifest.examples) != (layers, dtype, hidden,
                                                                                          len(examples)):
            raise ValueError(f"{manifest_path} was written for other layers, dtype or examples; use another directory")
    else:
        manifest = ShardManifest(layers, dtype, hidden, [], len(examples))
    start = sum(s["count"] for s in manifest.shards)
    remaining = estimate_bytes(examples[start:], hidden, len(layers), dtype)
    if remaining > free * 0.95:
        raise OSError(f"the offline hidden-state cache needs {remaining / 2**30:.2f} GiB more but {out} has "
                      f"{free / 2**30:.2f} GiB free")
    device = next(target.parameters()).device
    pad = 0
    bar = tqdm(total=len(examples), initial=start, desc="hidden states", unit="ex", disable=not progress,
               file=sys.stderr)
    tensors: dict[str, torch.Tensor] = {}
    first, tokens = start, 0
    for b in range(start, len(examples), batch_size):
        batch = examples[b: b + batch_size]
        width = max(len(e.input_ids) for e in batch)
        ids = torch.tensor([e.input_ids + [pad] * (width - len(e.input_ids)) for e in batch], device=device)
        mask = torch.tensor([[1] * len(e.input_ids) + [0] * (width - len(e.input_ids)) for e in batch], device=device)
        states = capture(target, ids, mask, layers).to(DTYPES[dtype]).cpu()  # (B, T, L, d)
        for j, e in enumerate(batch):
            n = len(e.input_ids)
            i = b + j
            tensors[f"{i}.hidden"] = states[j, :n].contiguous()
            tensors[f"{i}.input_ids"] = torch.tensor(e.input_ids, dtype=torch.int32)
            tensors[f"{i}.loss_mask"] = torch.tensor(e.loss_mask, dtype=torch.uint8)
            tokens += n
        bar.update(len(batch))
        last = b + batch_size >= len(examples)
        if tokens >= shard_tokens or last:
            name = f"shard-{len(manifest.shards):05d}.safetensors"
            tmp = out / (name + ".tmp")
            save_file(tensors, str(tmp))
            tmp.replace(out / name)  # a shard exists under its name only when complete
            count = b + len(batch) - first
            manifest.shards.append({"file": name, "first": first, "count": count, "tokens": tokens})
            manifest.save(manifest_path)
            tensors, first, tokens = {}, b + len(batch), 0
    bar.close()
    return manifest_path


class ShardReader:
    """Read an offline cache back: reader[i] -> {"input_ids", "loss_mask", "hidden" (T, L, d)}.

    Shards are opened memory-mapped (`safe_open`) and only the requested example's tensors are read,
    so random access (the training order) costs one example, and memory is bounded by the batch.
    """

    def __init__(self, out_dir: str | Path) -> None:
        self.dir = Path(out_dir)
        self.manifest = ShardManifest(**json.loads((self.dir / "manifest.json").read_text()))
        done = sum(s["count"] for s in self.manifest.shards)
        if done != self.manifest.examples:
            raise ValueError(f"{self.dir} is incomplete: {done} of {self.manifest.examples} examples written; "
                             "rerun write_shards to finish it")
        self._firsts = [s["first"] for s in self.manifest.shards]
        self._open: dict[str, object] = {}

    def __len__(self) -> int:
        return self.manifest.examples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        shard = self.manifest.shards[bisect.bisect_right(self._firsts, i) - 1]
        if shard["file"] not in self._open:
            self._open[shard["file"]] = safe_open(str(self.dir / shard["file"]), framework="pt")
        f = self._open[shard["file"]]
        return {"input_ids": f.get_tensor(f"{i}.input_ids").long(), "loss_mask": f.get_tensor(f"{i}.loss_mask").bool(),
                "hidden": f.get_tensor(f"{i}.hidden")}

    @property
    def layers(self) -> list[int]:
        return self.manifest.layers
