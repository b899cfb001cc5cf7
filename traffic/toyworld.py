"""The built-in toy world: a target, an off-the-shelf draft and company traffic, built on this machine.

No model hub can be reached here, so draftsmith builds a small world that its real code paths load
exactly as they would load a hub model and a user's logs (`from_pretrained` on a directory, `datasets`
on JSONL). Everything is trained on text every Python installation has:

- code: top-level functions of the standard library's own source;
- prose: the English reference topics in `pydoc_data.topics`;
- structured output: generated JSON documents in general-purpose schemas (packages, events, configs);
- in the `toy_wiki` preset only, the company's own knowledge, which only the target reads (its internal
  wiki): an employee directory and a codebase of short helper functions, generated from the seed
  (`company_directory`, `company_codebase`). Traffic asks for both, so a drafter must know what the
  target memorised, as on real pairs, where the target knows far more than a small model trained on a
  sample of its answers can learn.

Pieces (under `$DRAFTSMITH_HOME/toyworld/<preset>-<hash>/`, default `~/.cache/draftsmith`):

- `target/`: a Llama-architecture causal LM trained on all three kinds of text (and the company's
  wiki, repeated, where there is one) and on the company's chat traffic, with a byte-level BPE
  tokenizer and a chat template;
- `draft/`: a much smaller LM with the same tokenizer, trained on a general mix that
  under-represents the company's traffic (general prose that is not the company's, a third of the
  code, general JSON and a few company records, no chats), so training on that traffic has something
  to gain;
- `company_logs/{train,eval}.jsonl`: chat records in categories code / json / prose (and, in the
  `toy_agent` and `tiny_agent` presets, agent: tool-calling conversations, `agent_records`), split by a
  hash of the record id (see `company_records`).

Its text and traffic are traffic/toy_corpus.py's, its tokenizer and model training traffic/toy_lm.py's.

A world is addressed as `toyworld://<preset>/<piece>` (e.g. `toyworld://toy/target`); `resolve`
builds it on first use and caches it by a hash of its configuration, so changing the recipe rebuilds.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from traffic import formats
from traffic.toy_corpus import (agent_records, company_codebase, company_directory, company_records, corpus,
                                is_company_paragraph, is_eval, json_record, write_company_logs)
from traffic.toy_lm import LMSpec, encode, new_llama, parameter_count, train_lm, train_tokenizer

SCHEME = "toyworld://"
PIECES = ("target", "draft", "company_logs")
CATEGORIES = ("code", "json", "prose")  # and "agent" in the presets with agent traffic


@dataclass(frozen=True)
class ToyWorldConfig:
    """Everything that determines a toy world; its hash names the cache directory."""

    vocab_size: int
    seq_len: int
    records_per_category: int
    target: LMSpec
    draft: LMSpec
    eval_fraction: float = 0.1
    seed: int = 0
    version: int = 5  # bump when the recipe changes in a way the fields above do not show
    # The company's wiki (see the module docstring); 0 = none, the recipe of every world before it.
    directory_size: int = 0  # employees in the company's directory
    codebase_size: int = 0  # functions in the company's codebase
    wiki_repeats: int = 0  # copies of the directory and codebase in the target's text
    agent: bool = False  # traffic gains the `agent` category (tool-calling conversations)
    # The models' context (max_position_embeddings); 0 = 4 × seq_len, the recipe of every world before it.
    # RoPE has no position table, so this changes no weight: only how long a prompt plus its answer may be.
    context: int = 0

    @property
    def has_wiki(self) -> bool:
        return bool(self.wiki_repeats and (self.directory_size or self.codebase_size))

    def hashed_fields(self) -> dict:
        """The fields the cache name hashes: the wiki's only when there is one, so worlds built
        before the wiki existed keep their names."""
        fields = asdict(self)
        if not self.has_wiki:
            for name in ("directory_size", "codebase_size", "wiki_repeats"):
                del fields[name]
        if not self.agent:  # likewise for worlds built before agent traffic existed
            del fields["agent"]
        if not self.context:  # and before the context was set
            del fields["context"]
        return fields

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.hashed_fields(), sort_keys=True).encode()).hexdigest()[:10]


PRESETS = {
    # For tests: builds in seconds; the models are barely trained but share one tokenizer.
    "tiny": ToyWorldConfig(
        vocab_size=320,
        seq_len=96,
        context=768,  # its longest held-out prompt (332 tokens) plus the evaluation's 64 new tokens, with room
        records_per_category=60,
        target=LMSpec(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128, steps=60, batch_size=8),
        draft=LMSpec(hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate_size=64, steps=30, batch_size=8),
    ),
    # The default world.
    "toy": ToyWorldConfig(
        vocab_size=4096,
        seq_len=256,
        records_per_category=1000,
        target=LMSpec(hidden_size=256, layers=6, heads=8, kv_heads=4, intermediate_size=704, steps=350, batch_size=16,
                      lr=2e-3),
        draft=LMSpec(hidden_size=96, layers=2, heads=4, kv_heads=2, intermediate_size=256, steps=250, batch_size=16),
    ),
}
# A world whose target knows its company: the default world's shapes, plus the company's wiki in the
# target's text and traffic that asks for it, and the target trained 2,400 steps instead of 350 (about
# 70 minutes on 2 cores; for benchmarks, not the default). A 400-step target did not learn the wiki: it
# reproduced none of 24 held-out lookups; this one reproduces 22 (docs/benchmarks/toy-drafters.md, toy_wiki).
PRESETS["toy_wiki"] = dataclasses.replace(
    PRESETS["toy"], target=dataclasses.replace(PRESETS["toy"].target, steps=2400),
    directory_size=96, codebase_size=96, wiki_repeats=32,
)
# For engine tests (llama.cpp, exports): the tiny world with a 4-layer target, deep enough for an EAGLE-3
# head on layers an engine captures (the inputs of layers 1..n-1) and for layer ids off by one to differ.
PRESETS["tiny_deep"] = dataclasses.replace(
    PRESETS["tiny"], target=dataclasses.replace(PRESETS["tiny"].target, layers=4, steps=400))
# For the vLLM server tests: tiny_deep with attention heads of 32 dimensions, the smallest vLLM's CPU attention takes.
PRESETS["tiny_vllm"] = dataclasses.replace(
    PRESETS["tiny_deep"], target=dataclasses.replace(PRESETS["tiny_deep"].target, heads=2, kv_heads=1),
    draft=dataclasses.replace(PRESETS["tiny_deep"].draft, heads=1, kv_heads=1))
# Agent traffic: the default world's shapes, and a fourth category of tool-calling conversations (the
# assistant calls one of the company's tools, reads its result, answers), as gateways log them.
PRESETS["toy_agent"] = dataclasses.replace(PRESETS["toy"], agent=True)
PRESETS["tiny_agent"] = dataclasses.replace(PRESETS["tiny"], agent=True)
# For tests of the wiki's code path: the tiny world with a small wiki.
PRESETS["tiny_wiki"] = dataclasses.replace(PRESETS["tiny"], directory_size=12, codebase_size=12, wiki_repeats=2)


def home() -> Path:
    """Where built worlds are cached: $DRAFTSMITH_HOME or ~/.cache/draftsmith."""
    return Path(os.environ.get("DRAFTSMITH_HOME", Path.home() / ".cache" / "draftsmith"))


def resolve(name_or_path: str) -> str:
    """Map `toyworld://<preset>/<piece>` to a local directory (building the world if needed); pass
    anything else (a hub id or a path) through unchanged."""
    if not name_or_path.startswith(SCHEME):
        return name_or_path
    preset, _, piece = name_or_path[len(SCHEME):].partition("/")
    if preset not in PRESETS:
        raise ValueError(f"unknown toy world preset {preset!r} in {name_or_path!r}; known: {sorted(PRESETS)}")
    if piece not in PIECES:
        raise ValueError(f"unknown toy world piece {piece!r} in {name_or_path!r}; known: {list(PIECES)}")
    return str(build(preset) / piece)


def build(preset: str = "toy", root: Path | None = None, config: ToyWorldConfig | None = None) -> Path:
    """Build (or find cached) the named world and return its directory.

    A build works in `<name>.partial/` next to the final directory, under a lock (a second process
    waits, then finds the world built), and checkpoints each model every `CHECKPOINT_EVERY` steps: an
    interrupted build resumes where it stopped, with the same tokenizer, and ends with the same weights
    as an uninterrupted one. The directory takes its final name only when complete."""
    config = config or PRESETS[preset]
    out = (root or home() / "toyworld") / f"{preset}-{config.digest()}"
    if (out / "build.json").exists():  # written last: its presence means the build completed
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when the process dies
        if (out / "build.json").exists():  # built by another process while this one waited
            return out
        return _build_locked(preset, config, out)


def _build_locked(preset: str, config: ToyWorldConfig, out: Path) -> Path:
    partial = out.with_name(out.name + ".partial")
    resumed = partial.exists()
    partial.mkdir(exist_ok=True)
    started = time.perf_counter()
    print(f"[toyworld] {'resuming' if resumed else 'building'} preset {preset!r} into {out}", file=sys.stderr)
    texts = corpus(config.seed)
    directory = company_directory(config.seed, config.directory_size) if config.has_wiki else []
    codebase = company_codebase(config.seed, config.codebase_size) if config.has_wiki else []
    records = company_records(texts, config.records_per_category, config.seed, directory, codebase)
    if config.agent:  # one agent conversation after each round of the other three, so any prefix holds all four
        agent = agent_records(config.records_per_category, config.seed)
        records = [r for n, a in enumerate(agent) for r in (*records[3 * n: 3 * n + 3], a)]
    write_company_logs(records, partial / "company_logs", config.eval_fraction)
    if (partial / "tokenizer" / "tokenizer.json").exists():  # the checkpoints' token ids are this tokenizer's

        tokenizer = AutoTokenizer.from_pretrained(partial / "tokenizer")
    else:
        tokenizer = train_tokenizer(texts, records, config.vocab_size)
        tokenizer.save_pretrained(partial / "tokenizer")
    wiki = company_wiki(directory, codebase)
    target_stream = _target_stream(config, texts, records, wiki, tokenizer)
    draft_stream = _draft_stream(config, texts, tokenizer)
    losses_file = partial / "losses.json"
    losses = json.loads(losses_file.read_text()) if losses_file.exists() else {}
    for piece, spec, stream in (("target", config.target, target_stream), ("draft", config.draft, draft_stream)):
        if piece not in losses:  # a piece with a loss is saved and complete
            losses[piece] = _train_piece(piece, spec, stream, tokenizer, config, partial / piece,
                                         checkpoints=partial / "checkpoints" / piece)
            losses_file.write_text(json.dumps(losses))
    meta = {"preset": preset, "config": asdict(config), "final_loss": losses,
            "wiki_tokens": sum(len(tokenizer(doc)["input_ids"]) for doc in wiki),
            "build_seconds": round(time.perf_counter() - started, 1), "resumed": resumed,
            "tokens": {"target": len(target_stream), "draft": len(draft_stream)}}
    shutil.rmtree(partial / "checkpoints", ignore_errors=True)  # what only a resume needs
    shutil.rmtree(partial / "tokenizer")
    losses_file.unlink()
    (partial / "build.json").write_text(json.dumps(meta, indent=2) + "\n")
    if out.exists():  # a stale, incomplete build (no build.json): replace it
        shutil.rmtree(out)
    partial.rename(out)
    print(f"[toyworld] built in {meta['build_seconds']} s" + (" (this run; resumed)" if resumed else ""),
          file=sys.stderr)
    return out


def company_wiki(directory: list[dict], codebase: list[tuple[str, str]]) -> list[str]:
    """The wiki's documents: each employee's entry as the directory prints it, each function's source."""
    return [json.dumps(entry, indent=1) for entry in directory] + [f"# {name}\n{source}" for name, source in codebase]


def _target_stream(config: ToyWorldConfig, texts: dict[str, list[str]], records: list[dict], wiki: list[str],
                   tokenizer) -> torch.Tensor:
    """The target's training text, encoded: the company's training chats (twice), every kind of raw
    text and the company's wiki (`wiki_repeats` times), often enough to learn it by heart. The
    off-the-shelf draft (`_draft_stream`) reads a general mix instead: no chats and no wiki."""
    train_recs = [r for r in records if not is_eval(r["id"], config.eval_fraction)]
    chats = [tokenizer.apply_chat_template(formats.read(r, "chat").messages, tokenize=False) for r in train_recs]
    raw = texts["code"] + texts["prose"] + texts["json"]
    return encode(tokenizer, chats * 2 + raw + wiki * config.wiki_repeats, config.seed)


def _draft_stream(config: ToyWorldConfig, texts: dict[str, list[str]], tokenizer) -> torch.Tensor:
    """The off-the-shelf draft's training text, encoded."""
    rng = random.Random(config.seed)
    general_prose = [p for p in texts["prose"] if not is_company_paragraph(p)]
    company_json = [json.dumps(json_record(rng), indent=1) for _ in range(60)]
    draft_mix = (general_prose * 2 + rng.sample(texts["code"], len(texts["code"]) // 3) + texts["json"][:300]
                 + company_json)
    return encode(tokenizer, draft_mix, config.seed + 1)


def _train_piece(piece: str, spec: LMSpec, stream: torch.Tensor, tokenizer, config: ToyWorldConfig,
                 out: Path, checkpoints: Path | None = None) -> float:
    """Train one model of the world on its stream and save it (with the tokenizer) to `out`; its final
    loss. With `checkpoints`, training resumes from the newest checkpoint there and writes new ones."""
    # Seed the initialisation too: otherwise the weights would depend on whatever used the global
    # RNG earlier in the process (a test session, the training entry point's own seeding).
    torch.manual_seed(config.seed + (piece == "draft"))
    model = new_llama(spec, tokenizer, config.context or 4 * config.seq_len)
    loss = train_lm(model, stream, spec, config.seq_len, seed=config.seed, desc=f"toyworld {piece}",
                    checkpoints=checkpoints)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"[toyworld] {piece}: {parameter_count(model) / 1e6:.2f}M parameters, final loss {loss:.3f}", file=sys.stderr)
    return loss


def build_draft_variant(preset: str, out: Path, **changes) -> float:
    """The preset's off-the-shelf draft trained by the same recipe (same text, seed and steps) with
    `changes` to its shape (e.g. layers=3), saved to `out`; returns its final loss. For checking how a
    draft's size moves its cost and acceptance against the heads; the world itself is not changed."""
    config = PRESETS[preset]
    world = build(preset)
    tokenizer = AutoTokenizer.from_pretrained(world / "draft")
    stream = _draft_stream(config, corpus(config.seed), tokenizer)
    return _train_piece("draft", dataclasses.replace(config.draft, **changes), stream, tokenizer, config, Path(out))




