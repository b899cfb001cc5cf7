"""The target's hidden states, for drafters that read its features (EAGLE, MTP, Medusa heads).

Layer index convention (one convention everywhere in draftsmith): an index is a position in Hugging
Face's `output_hidden_states` tuple of a model with n decoder layers, so

- 0 is the embedding output (the input to layer 0),
- i (1 <= i < n) is the output of decoder layer i-1, i.e. the input to layer i,
- n is the model's last hidden state as Hugging Face returns it (after the final norm), the feature
  the LM head reads.

vLLM's `eagle_aux_hidden_state_layer_ids` use this same convention; SGLang's are one lower (0-based
layer outputs). Exporters convert at the boundary; nothing inside draftsmith does.

Ways to get them:
- online: `capture` inside the training step (memory bounded by the batch);
- offline: `write_shards` precomputes them to sharded safetensors in fp16/bf16 (train/shards.py: the
  size estimated and checked against free disk and a cap, resumable shard by shard); `ShardReader`
  reads them back one example at a time, memory-mapped;
- from vLLM: `write_shards_from_vllm` has a vLLM server compute them (its `extract_hidden_states` method,
  eval/engines/vllm.py), as a target beyond one GPU is served, into the same cache;
- from files an engine already wrote: `write_shards_from_files` reads a folder of `hs_{i}.safetensors` files (what
  speculators' data generation has vLLM's hidden-states connector write: `hidden_states` (T, layers, d) and
  `token_ids` (T)), each record found by its token ids, into the same cache;
- from llama.cpp: `write_shards_from_llama_cpp` has llama.cpp's `llama-hidden-states` (a tool the project's patch
  adds, eval/engines/llama_cpp_patches/hidden-states-tool.patch) compute them on the target's GGUF, the quantized file
  a team serves, into such files, read into the same cache.

An engine's layer id n is the last layer's output before the final norm: every engine path puts it through the
target's final norm (`final_norm`), so every cache holds Hugging Face's convention.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tqdm.auto import tqdm

from drafters import kinds
from drafters.heads import check_layers, features_of
from eval.run import DTYPES
from traffic.records import Example
from train.shards import ExampleShards, write_example_shards

log = logging.getLogger(__name__)


def default_layers(kind: str, num_layers: int) -> list[int]:
    """The feature layers a head of `kind` reads by default on a target of `num_layers` layers (indices in the
    convention of the module docstring): its descriptor's (drafters/kinds/<kind>.py `KIND.layers`)."""
    layers = kinds.kind(kind).layers
    if layers is None:
        raise ValueError(f"drafter kind {kind!r} reads no target layers; the heads that do: "
                         f"{', '.join(sorted(k.name for k in kinds.kinds().values() if k.layers))}")
    return layers(num_layers)


@torch.no_grad()
def capture(target, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layers: list[int]) -> torch.Tensor:
    """Hidden states of `layers` for a batch: (B, T) ids -> (B, T, len(layers), d) in the target's dtype."""
    check_layers(layers, target.config.num_hidden_layers)
    out = target.base_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    return features_of(out.hidden_states, layers)


def bytes_per_token(hidden_size: int, n_layers: int, dtype: str) -> int:
    """Offline cache cost of one token: its features plus its id (int32) and loss-mask byte."""
    return hidden_size * n_layers * DTYPES[dtype].itemsize + 4 + 1


def estimate_bytes(examples: list[Example], hidden_size: int, n_layers: int, dtype: str) -> int:
    return sum(len(e.input_ids) for e in examples) * bytes_per_token(hidden_size, n_layers, dtype)


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
    """Precompute hidden states of `layers` for every example into sharded safetensors under out_dir
    (train/shards.py: size checked against `max_bytes` and the free disk first; resumable)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_layers(layers, target.config.num_hidden_layers)
    hidden = target.config.hidden_size

    def compute(batch, ids, mask):
        full = capture(target, ids, mask, layers)  # (B, T, L, d)
        states = full.to(DTYPES[dtype])
        if not bool(torch.isfinite(states).all()) and bool(torch.isfinite(full).all()):
            # Gemma's residual stream, for one, outgrows float16: its shards would hold inf and train NaN.
            raise ValueError(f"the target's hidden states reach {float(full.abs().max()):.4g}, beyond {dtype}'s range: "
                             "set drafter.offline_dtype=bfloat16 (or float32)")
        return [{"hidden": states[j, : len(e.input_ids)]} for j, e in enumerate(batch)]

    return write_example_shards(examples, compute, out_dir, meta={"layers": list(layers), "dtype": dtype,
                                                                  "hidden_size": hidden},
                                bytes_per_token=bytes_per_token(hidden, len(layers), dtype),
                                device=next(target.parameters()).device, what="hidden states",
                                batch_size=batch_size, shard_tokens=shard_tokens, max_bytes=max_bytes,
                                progress=progress)


class ShardReader(ExampleShards):
    """An offline hidden-state cache: reader[i] -> {"input_ids", "loss_mask", "hidden" (T, L, d)}."""

    @property
    def layers(self) -> list[int]:
        return self.meta["layers"]


def final_norm(target):
    """The target's final norm, which Hugging Face applies to the last layer's output before returning it as
    hidden state n (and vLLM does not: its id n is that output before the norm)."""
    base = target.base_model
    norm = next((getattr(base, name) for name in ("norm", "final_layernorm", "ln_f") if hasattr(base, name)), None)
    if norm is None:
        raise ValueError(f"{type(base).__name__} has no final norm draftsmith knows (norm, final_layernorm, ln_f): "
                         "the last layer's features from vLLM cannot be made Hugging Face's")
    return norm


def engine_layers(h: torch.Tensor, layers: list[int], n: int, norm) -> torch.Tensor:
    """An engine's (T, layers, d) states in float32 in this module's convention: layer n, the engine's last layer output
    before the final norm, through `norm` (the target's final norm; None: n is not among `layers`)."""
    h = h.float()
    if norm is not None:
        with torch.no_grad():
            for j in (j for j, layer in enumerate(layers) if layer == n):  # twice where a head's own layers end at n
                h[:, j] = norm(h[:, j].to(next(norm.parameters()).device)).float().cpu()
    return h


def write_shards_from_vllm(
    examples: list[Example],
    target,
    target_dir: str | Path,
    layers: list[int],
    out_dir: str | Path,
    *,
    dtype: str = "float16",
    served_dtype: str = "float32",
    batch_size: int = 8,
    shard_tokens: int = 65536,
    max_bytes: int | None = None,
    progress: bool = True,
    tensor_parallel_size: int = 1,
) -> Path:
    """`write_shards`, the features computed by a vLLM server on `target_dir` (eval/engines/vllm.py: started here and
    ended with the cache, the target sharded over `tensor_parallel_size` workers), `batch_size` requests in flight;
    each record's token ids are checked against the ones vLLM wrote. Layer n, vLLM's last layer output before the
    final norm, goes through `target`'s final norm."""
    from eval.engines import vllm  # only with drafter.hidden_states=vllm

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    n = target.config.num_hidden_layers
    check_layers(layers, n)
    out_dir = Path(out_dir)
    norm = final_norm(target) if n in layers else None

    def compute(batch, ids, mask):
        with ThreadPoolExecutor(max_workers=batch_size) as pool:
            states = list(pool.map(lambda e: server.hidden_states(list(e.input_ids)), batch))
        return [{"hidden": engine_layers(h, layers, n, norm).to(DTYPES[dtype])} for h in states]

    # Each request is a record and one token: the server needs no more context, nor the KV cache the model's would.
    longest = max((len(e.input_ids) for e in examples), default=0) + 1
    with vllm.VllmServer(target_dir, dtype=served_dtype, features=(layers, out_dir.with_name(out_dir.name + ".vllm")),
                         max_model_len=longest, log_file=out_dir.with_name(out_dir.name + ".vllm.log"),
                         tensor_parallel_size=tensor_parallel_size) as server:
        return write_example_shards(examples, compute, out_dir,
                                    meta={"layers": list(layers), "dtype": dtype, "hidden_size": target.config.hidden_size,
                                          "engine": f"vllm {vllm.VERSION}"},
                                    bytes_per_token=bytes_per_token(target.config.hidden_size, len(layers), dtype),
                                    device=torch.device("cpu"), what="hidden states (vLLM)", batch_size=batch_size,
                                    shard_tokens=shard_tokens, max_bytes=max_bytes, progress=progress)


def index_files(folder: str | Path) -> dict[tuple[int, ...], Path]:
    """The `hs_{i}.safetensors` files of `folder` by their token ids (only `token_ids` is read of each)."""
    folder = Path(folder)
    files = sorted(folder.glob("hs_*.safetensors"), key=lambda p: (len(p.name), p.name))
    if not files:
        raise FileNotFoundError(f"{folder}: no hs_*.safetensors files (speculators' data generation writes them into "
                                "its output's hidden_states/ folder)")
    index: dict[tuple[int, ...], Path] = {}
    for path in files:
        if path.with_name(path.name + ".lock").exists():
            raise ValueError(f"{path}: its .lock is still there: the engine is writing it, or was killed while it did")
        try:
            f = safe_open(path, "pt")
        except Exception as error:  # safetensors' header checks: a file cut short by an interrupted copy
            raise ValueError(f"{path}: not a whole safetensors file ({error}); delete it and generate it again") from None
        with f:
            if "token_ids" not in f.keys() or "hidden_states" not in f.keys():
                raise ValueError(f"{path}: holds {sorted(f.keys())}, not hidden_states and token_ids")
            index.setdefault(tuple(f.get_tensor("token_ids").tolist()), path)
    return index


def write_shards_from_files(
    examples: list[Example],
    target,
    folder: str | Path,
    layers: list[int],
    out_dir: str | Path,
    *,
    dtype: str = "float16",
    batch_size: int = 8,
    shard_tokens: int = 65536,
    max_bytes: int | None = None,
    progress: bool = True,
    engine: str | None = None,
    what: str = "hidden states (files)",
) -> Path:
    """`write_shards`, the features read from `folder`'s `hs_{i}.safetensors` files (an engine's, `index_files`): each
    example's from the file whose token ids start with the example's own (a record cut at trainer.max_length reads
    the first positions of its file). The files' layers must be `layers` in order, as the engine was started with
    them (vLLM's `eagle_aux_hidden_state_layer_ids`, the same convention); layer n goes through the target's final
    norm. A record no file holds is an error naming it, before anything is written. `engine` names what wrote the
    files in the cache's manifest (None: the folder); `what` names the work in its progress and log."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    n, hidden = target.config.num_hidden_layers, target.config.hidden_size
    check_layers(layers, n)
    index = index_files(folder)
    found = {e.id: index[tuple(e.input_ids)] for e in examples if tuple(e.input_ids) in index}
    # The rest were cut (at trainer.max_length: one length, or a few): looked up by the files' first positions, one
    # index per length, not by scanning every file for every record.
    cut = [e for e in examples if e.id not in found]
    for length in {len(e.input_ids) for e in cut}:
        starts: dict[tuple[int, ...], Path] = {}
        for key, path in index.items():
            if len(key) > length:
                starts.setdefault(key[:length], path)
        found.update((e.id, starts[tuple(e.input_ids)]) for e in cut
                     if len(e.input_ids) == length and tuple(e.input_ids) in starts)
    missing = [e.id for e in examples if e.id not in found]
    if missing:
        raise ValueError(f"{folder}: no hs_*.safetensors file holds the token ids of {len(missing)} of the "
                         f"{len(examples)} training records (first: {missing[0]!r}); the files were written for other "
                         f"records, another chat template or tokenizer ({len(index)} files read)")
    norm = final_norm(target) if n in layers else None

    def compute(batch, ids, mask):
        out = []
        for e in batch:
            h = load_file(found[e.id])["hidden_states"]
            if h.dim() != 3 or h.shape[1:] != (len(layers), hidden):
                raise ValueError(f"{found[e.id]}: hidden_states of shape {tuple(h.shape)}; this target and layers "
                                 f"{list(layers)} take (T, {len(layers)}, {hidden}): start the engine with these layers")
            out.append({"hidden": engine_layers(h[: len(e.input_ids)], layers, n, norm).to(DTYPES[dtype])})
        return out

    return write_example_shards(examples, compute, out_dir,
                                meta={"layers": list(layers), "dtype": dtype, "hidden_size": hidden,
                                      "engine": engine or f"files {Path(folder).resolve()}"},
                                bytes_per_token=bytes_per_token(hidden, len(layers), dtype),
                                device=torch.device("cpu"), what=what, batch_size=batch_size,
                                shard_tokens=shard_tokens, max_bytes=max_bytes, progress=progress)


def write_shards_from_llama_cpp(
    examples: list[Example],
    target,
    gguf: str | Path,
    layers: list[int],
    out_dir: str | Path,
    *,
    dtype: str = "float16",
    batch_size: int = 8,
    shard_tokens: int = 65536,
    max_bytes: int | None = None,
    threads: int | None = None,
    progress: bool = True,
) -> Path:
    """`write_shards`, the features computed by llama.cpp on `gguf` (the target's file as it is served, quantized or
    not), with `threads` threads (None: every core). llama.cpp's `llama-hidden-states` writes one `hs_{i}.safetensors`
    a record into `out_dir`.llama.cpp/ (a killed run resumes there: finished records are not computed again), read into
    the cache by `write_shards_from_files`, which finds each record by its token ids; the folder goes once the cache
    is whole. Its disk for each 1,000 records is logged."""
    from eval.engines import llama_cpp  # only with drafter.hidden_states=llamacpp

    out_dir = Path(out_dir)
    folder = out_dir.with_name(out_dir.name + ".llama.cpp")
    folder.mkdir(parents=True, exist_ok=True)
    records = folder / "records.txt"
    text = "".join(" ".join(map(str, e.input_ids)) + "\n" for e in examples)
    if not records.exists() or records.read_text() != text:  # other records: files of a line number are stale
        for stale in folder.glob("hs_*.safetensors*"):
            stale.unlink()
        records.write_text(text)
    command = [str(llama_cpp.binary("llama-hidden-states")), "-m", str(gguf), "-l", ",".join(map(str, layers)),
               "-i", str(records), "-o", str(folder), "-t", str(threads or os.cpu_count() or 1)]
    log_file = folder / "llama-hidden-states.log"
    with open(log_file, "w") as err, tqdm(total=len(examples), unit="ex", desc="hidden states (llama.cpp)",
                                          disable=not progress) as bar:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True)
        for line in proc.stdout:
            if line.startswith(("done ", "skip ")):
                bar.update(1)
        proc.wait()
    if proc.returncode != 0:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"llama.cpp's llama-hidden-states failed on {gguf} ({llama_cpp.died(proc.returncode)}); "
                           f"{log_file}:\n{tail}")
    files = list(folder.glob("hs_*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    log.info("llama.cpp's features: %d files, %.1f MB, %.2f GB for each 1,000 records (float32, %d layers)",
             len(files), size / 1e6, size / max(1, len(files)) / 1e6, len(layers))
    written = write_shards_from_files(examples, target, folder, layers, out_dir, dtype=dtype, batch_size=batch_size,
                                      shard_tokens=shard_tokens, max_bytes=max_bytes, progress=progress,
                                      engine=f"llama.cpp {llama_cpp.VERSION} ({Path(gguf).name})",
                                      what="hidden states (llama.cpp's files)")
    shutil.rmtree(folder)
    return written
