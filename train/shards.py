"""Per-example tensors precomputed by the target, in sharded safetensors: written once, read memory-mapped.

Two caches use this: the hidden states heads read (train/hidden_states.py) and the top-k target
logits a draft LM distils from (train/logit_cache.py). Both store, for example i, tensors named
`{i}.<field>` in the shard that holds it, and a manifest.json listing the finished shards:

    {"meta": {...what was computed...}, "examples": N, "shards": [{"file", "first", "count", "tokens"}]}

Writing checks the estimated size against a cap and the free disk before computing anything, and is
resumable: a shard exists under its name only once complete, and a rerun with the same inputs skips
the shards the manifest lists. Reading opens shards with `safe_open` (memory-mapped) and reads only the
requested example, so random access costs one example and memory is bounded by the batch.
"""

from __future__ import annotations

import bisect
import json
import logging
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from traffic.records import Example

log = logging.getLogger(__name__)

# compute(examples, input_ids (B, T), attention_mask (B, T)) -> one dict of tensors per example
Compute = Callable[[list[Example], torch.Tensor, torch.Tensor], list[dict[str, torch.Tensor]]]


def write_example_shards(
    examples: list[Example],
    compute: Compute,
    out_dir: str | Path,
    *,
    meta: dict,
    bytes_per_token: int,
    device: torch.device | str = "cpu",
    what: str = "cache",
    batch_size: int = 8,
    shard_tokens: int = 65536,
    max_bytes: int | None = None,
    progress: bool = True,
) -> Path:
    """Run `compute` over `examples` in padded batches and store its tensors in shards under out_dir.

    `meta` describes what is computed (a rerun must pass the same); `bytes_per_token` estimates the
    size, which is checked against `max_bytes` and the free disk first. Returns the manifest's path.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    need = sum(len(e.input_ids) for e in examples) * bytes_per_token
    if max_bytes is not None and need > max_bytes:
        raise ValueError(f"the offline {what} would take {need / 2**30:.2f} GiB ({bytes_per_token} bytes/token), "
                         f"over the cap of {max_bytes / 2**30:.2f} GiB; compute it online, store less per token or "
                         "fewer examples, or raise the cap")
    manifest_path = out / "manifest.json"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if (manifest["meta"], manifest["examples"]) != (meta, len(examples)):
            raise ValueError(f"{manifest_path} was written for other settings or examples ({manifest['meta']}, "
                             f"{manifest['examples']} examples); use another directory")
    else:
        manifest = {"meta": meta, "examples": len(examples), "shards": []}
    start = sum(s["count"] for s in manifest["shards"])
    remaining = sum(len(e.input_ids) for e in examples[start:]) * bytes_per_token
    free = shutil.disk_usage(out).free
    if remaining > free * 0.95:
        raise OSError(f"the offline {what} needs {remaining / 2**30:.2f} GiB more but {out} has "
                      f"{free / 2**30:.2f} GiB free")
    bar = tqdm(total=len(examples), initial=start, desc=what, unit="ex", disable=not progress, file=sys.stderr)
    tensors: dict[str, torch.Tensor] = {}
    first, tokens = start, 0
    for b in range(start, len(examples), batch_size):
        batch = examples[b: b + batch_size]
        width = max(len(e.input_ids) for e in batch)
        ids = torch.tensor([e.input_ids + [0] * (width - len(e.input_ids)) for e in batch], device=device)
        mask = torch.tensor([[1] * len(e.input_ids) + [0] * (width - len(e.input_ids)) for e in batch], device=device)
        for j, (e, fields) in enumerate(zip(batch, compute(batch, ids, mask))):
            i = b + j
            tensors[f"{i}.input_ids"] = torch.tensor(e.input_ids, dtype=torch.int32)
            tensors[f"{i}.loss_mask"] = torch.tensor(e.loss_mask, dtype=torch.uint8)
            tensors.update({f"{i}.{name}": t.contiguous().cpu() for name, t in fields.items()})
            tokens += len(e.input_ids)
        bar.update(len(batch))
        if tokens >= shard_tokens or b + batch_size >= len(examples):
            name = f"shard-{len(manifest['shards']):05d}.safetensors"
            tmp = out / (name + ".tmp")
            save_file(tensors, str(tmp))
            tmp.replace(out / name)  # a shard exists under its name only when complete
            manifest["shards"].append({"file": name, "first": first, "count": b + len(batch) - first,
                                       "tokens": tokens})
            tmp = manifest_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(manifest, indent=1) + "\n")
            tmp.replace(manifest_path)
            tensors, first, tokens = {}, b + len(batch), 0
    bar.close()
    size = sum((out / shard["file"]).stat().st_size for shard in manifest["shards"])
    log.info("%s: %s holds %d examples in %.1f MB, %.2f GB for each 1,000", what, out, len(examples), size / 1e6,
             size / max(1, len(examples)) / 1e6)
    return manifest_path


class ExampleShards:
    """Read shards back: shards[i] -> {"input_ids" (long), "loss_mask" (bool), ...computed fields}."""

    def __init__(self, out_dir: str | Path) -> None:
        self.dir = Path(out_dir)
        manifest = json.loads((self.dir / "manifest.json").read_text())
        self.meta, self.shards, self.examples = manifest["meta"], manifest["shards"], manifest["examples"]
        done = sum(s["count"] for s in self.shards)
        if done != self.examples:
            raise ValueError(f"{self.dir} is incomplete: {done} of {self.examples} examples written; "
                             "rerun the writer with the same inputs to finish it")
        self._firsts = [s["first"] for s in self.shards]
        self._open: dict[str, object] = {}
        self.fields: list[str] = []  # what each example holds, read from the first one
        if self.shards:
            f = self._shard(0)
            prefix = f"{self.shards[0]['first']}."
            self.fields = [k[len(prefix):] for k in f.keys() if k.startswith(prefix)]

    def __len__(self) -> int:
        return self.examples

    def _shard(self, i: int):
        shard = self.shards[bisect.bisect_right(self._firsts, i) - 1]
        if shard["file"] not in self._open:
            self._open[shard["file"]] = safe_open(str(self.dir / shard["file"]), framework="pt")
        return self._open[shard["file"]]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        f = self._shard(i)
        item = {name: f.get_tensor(f"{i}.{name}") for name in self.fields}
        item["input_ids"] = item["input_ids"].long()
        item["loss_mask"] = item["loss_mask"].bool()
        return item


def complete(out_dir: str | Path) -> bool:
    """Whether out_dir holds a finished cache (every example written)."""
    try:
        ExampleShards(out_dir)
        return True
    except (FileNotFoundError, ValueError):
        return False
