"""Turn company traffic into training data for every drafter kind.

    records --(regenerate with the target)--> regenerated.jsonl
            --(chat template, assistant-only loss mask)--> tokenized/ (a `datasets` dataset)
            --(optional: target hidden states at chosen layers)--> hidden/ (sharded safetensors)

`python -m train.prepare` (conf/prepare.yaml) is the Hydra entry point; `prepare` is the library call.
Every stage is resumable: regeneration through its cache, hidden states shard by shard.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets
import hydra
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from drafters.sampling import Sampling
from eval.engines.engine import stop_on_sigterm
from eval.run import load_target, pick_device, read_traffic, reading, target_source
from traffic.records import Example, Record, RecordError, tokenize_record
from train.config import register
from train.hidden_states import bytes_per_token, default_layers, write_shards
from train.regenerate import TorchWriter, Writer, answer_writer, regenerate, summary, write_records

log = logging.getLogger(__name__)
register()


@dataclass
class PrepareSummary:
    """What `prepare` produced, written to prepare.json."""

    records: int
    examples: int
    skipped: int
    tokens: int
    assistant_tokens: int
    regen_turns: int
    regen_tokens_per_s: float | None
    regenerated_by: str | None  # what wrote the answers: torch, llama.cpp on a GGUF, a server at a URL
    hidden_layers: list[int] | None
    hidden_bytes_per_token: int | None
    hidden_bytes: int | None
    data: dict | None = None  # the traffic prepared: {path, records}


def held_out_indices(categories: list[str], n: int, how: str = "last") -> list[int]:
    """Which records (given by their categories, in file order) training holds out to choose its checkpoint:
    the last n (`last`), or n taken in turn from the end of each category's records (`per_category`), so
    every category weighs alike in the choice and in the held-out τ. In file order."""
    if how == "last":
        return list(range(max(0, len(categories) - n), len(categories)))
    if how != "per_category":
        raise ValueError(f"trainer.heldout must be last or per_category, got {how!r}")
    newest_first: dict[str, list[int]] = {}
    for i in reversed(range(len(categories))):
        newest_first.setdefault(categories[i], []).append(i)
    queues = [newest_first[c] for c in sorted(newest_first)]
    chosen: list[int] = []
    for rank in range(max(map(len, queues), default=0)):
        chosen += [q[rank] for q in queues if rank < len(q)][: n - len(chosen)]
        if len(chosen) == n:
            break
    return sorted(chosen)


def tokenize_all(records: list[Record], tokenizer, max_length: int, on_bad_record: str = "error",
                 progress: bool = True) -> tuple[list[Example], int]:
    """Tokenize and mask every record; conversations longer than max_length are errors (or skipped)."""
    examples, skipped = [], 0
    for r in tqdm(records, desc="tokenize", unit="rec", disable=not progress, file=sys.stderr):
        try:
            examples.append(tokenize_record(r, tokenizer, max_length))
        except RecordError:
            if on_bad_record == "error":
                raise
            skipped += 1
    return examples, skipped


def prepare(
    records: list[Record],
    target,
    tokenizer,
    out_dir: str | Path,
    *,
    sampling: Sampling = Sampling(),
    regenerate_responses: bool = True,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    seed: int = 0,
    max_length: int | None = None,
    on_bad_record: str = "error",
    hidden_layers: list[int] | None = None,
    hidden_dtype: str = "float16",
    hidden_max_bytes: int | None = None,
    progress: bool = True,
    data: dict | None = None,
    writer: Writer | None = None,
) -> PrepareSummary:
    """Regenerate (with `writer`: train/regenerate.py; None: the target in PyTorch), tokenize and (optionally)
    cache hidden states into out_dir; return what was made. `data` describes where the records came from
    ({path, records}) for prepare.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    max_length = max_length or target.config.max_position_embeddings
    regen, stats = regenerate(records, target, tokenizer, out / "regen_cache.jsonl", sampling=sampling,
                              max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
                              keep_logged=not regenerate_responses, progress=progress, writer=writer)
    if regenerate_responses:
        log.info("regeneration: %s", summary(stats))
    write_records(regen, out / "regenerated.jsonl")
    examples, skipped = tokenize_all(regen, tokenizer, max_length, on_bad_record, progress)
    if not examples:
        raise ValueError("no example fits the context; raise max_length or shorten the conversations")
    datasets.Dataset.from_list([asdict(e) for e in examples]).save_to_disk(str(out / "tokenized"))
    hidden_bytes = None
    if hidden_layers:
        manifest = write_shards(examples, target, list(hidden_layers), out / "hidden", dtype=hidden_dtype,
                                batch_size=batch_size, max_bytes=hidden_max_bytes, progress=progress)
        hidden_bytes = sum(f.stat().st_size for f in manifest.parent.glob("*.safetensors"))
    result = PrepareSummary(
        records=len(records), examples=len(examples), skipped=skipped,
        tokens=sum(len(e.input_ids) for e in examples), assistant_tokens=sum(sum(e.loss_mask) for e in examples),
        regen_turns=stats.jobs, regen_tokens_per_s=stats.tokens_per_s if regenerate_responses else None,
        regenerated_by=(writer.name if writer else TorchWriter.name) if regenerate_responses else None,
        hidden_layers=list(hidden_layers) if hidden_layers else None,
        hidden_bytes_per_token=bytes_per_token(target.config.hidden_size, len(hidden_layers), hidden_dtype)
        if hidden_layers else None,
        hidden_bytes=hidden_bytes,
        data=data,
    )
    (out / "prepare.json").write_text(json.dumps(asdict(result), indent=2) + "\n")
    return result


def run(cfg: DictConfig) -> PrepareSummary:
    """Run the preparation a composed conf/prepare.yaml describes (what `python -m train.prepare` does)."""
    # The traffic is read first: a bad record fails before a model is loaded.
    traffic = read_traffic(cfg.data.path, **reading(cfg.data))
    records = traffic.records[: cfg.data.max_records]
    device = pick_device(cfg.device)
    target, tokenizer = load_target(target_source(cfg.target), device=device, dtype=cfg.target.dtype,
                                    trust_remote_code=cfg.target.trust_remote_code, chat_template=cfg.target.chat_template)
    hs = cfg.hidden_states
    layers = None
    if hs.kind or hs.layers:
        layers = list(hs.layers) if hs.layers else default_layers(hs.kind, target.config.num_hidden_layers)
    regen = OmegaConf.to_container(cfg.regenerate, resolve=True)
    with answer_writer(regen, tokenizer, target_source(cfg.target), records, max_new_tokens=regen["max_new_tokens"],
                       work=Path(cfg.out_dir)) if regen["enabled"] else contextlib.nullcontext() as writer:
        result = prepare(
            records, target, tokenizer, cfg.out_dir,
            sampling=Sampling(regen["temperature"], regen["top_k"], regen["top_p"]),
            regenerate_responses=regen["enabled"], max_new_tokens=regen["max_new_tokens"],
            batch_size=cfg.batch_size, seed=cfg.seed, max_length=cfg.max_length, on_bad_record=cfg.data.on_bad_record,
            hidden_layers=layers, hidden_dtype=hs.dtype,
            hidden_max_bytes=int(hs.max_gib * 2**30) if hs.max_gib is not None else None, progress=cfg.progress,
            data={"path": cfg.data.path, "records": len(records)}, writer=writer,
        )
    print(json.dumps(asdict(result), indent=2))
    print(f"prepared data: {cfg.out_dir}")
    return result


@hydra.main(version_base="1.3", config_path="../conf", config_name="prepare")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except (ValueError, FileNotFoundError, OSError) as e:  # bad input the user can fix: no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    stop_on_sigterm()
    main()
