"""Requests the target itself would be asked: prompts synthesized through its own chat template.

A drafter learns the target's answers to the requests it trains on, and keeps few guesses on kinds of request it
rarely saw (docs/benchmarks/smollm2-training.md: SmolLM2's head trained on 128 chat and writing prompts). Where a team's
logs hold too few of a kind, the target can write more: given its chat template up to the start of a user turn
and nothing after it, an instruction-tuned model writes a user's request from the distribution it was tuned on
(Magpie: Xu et al., 2024, "Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with Nothing"). A
system prompt steers the kind ("You are a writing assistant ..."); it only writes the request: the record keeps
the user turn alone, and `python -m train` has the target answer it as production would (train/regenerate.py).

Requests are sampled through an OpenAI-compatible server (a llama-server draftsmith starts on the target's GGUF,
or one a team runs), `parallel` at once, each with a seed derived from its number, in fixed batches: a batch's
records are appended in one write and fsync'ed, so an interrupted run resumes from its last complete batch and
writes what an uninterrupted one writes (up to the engine's own determinism). A request is kept when the model
ended the turn itself (one cut off at `max_tokens` is dropped), it is not empty or shorter than `min_chars`,
and no earlier request has the same words (case and spacing aside).
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from traffic.records import render

# Stands in for the user's words while the template is rendered; what comes before it is the prefix.
_SENTINEL = "\u2063draftsmith-user-turn\u2063"


def user_turn_prefix(tokenizer, system: str | None = None, lead: str = "") -> list[int]:
    """The token ids a user turn's text follows in the tokenizer's chat template: the conversation's start, the
    system turn (`system`, else whatever the template puts there by default) and the user turn's header, then
    `lead`, the first words of every request (e.g. "Write": the strongest steer a small model follows)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _SENTINEL}]
    try:
        text = render(tokenizer, messages, False)
    except Exception as e:  # a template that refuses a system turn raises from inside Jinja
        raise ValueError(f"the chat template cannot render {'a system turn and ' if system else ''}a user turn: "
                         f"{e}") from e
    at = text.find(_SENTINEL)
    if at < 0:
        raise ValueError("the chat template does not write the user's words where they were given, so the prefix of "
                         "a user turn cannot be cut from it")
    if system and system not in text[:at]:
        raise ValueError("the chat template puts the system prompt after the user's words: --system cannot steer it")
    return tokenizer.encode(text[:at] + lead, add_special_tokens=False)


def normalized(text: str) -> str:
    """The words of a request, as duplicates are told apart: lower case, runs of whitespace as one space."""
    return " ".join(text.lower().split())


@dataclass
class SynthesisStats:
    """What a synthesis run did: requests sampled (now and before a resume) and why the dropped ones went."""

    sampled: int = 0
    kept: int = 0
    resumed: int = 0
    cut_off: int = 0
    too_short: int = 0
    duplicate: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        return (f"{self.kept} requests kept ({self.resumed} from before) of {self.sampled} sampled now; dropped: "
                f"{self.cut_off} cut off at max_tokens, {self.too_short} too short, {self.duplicate} duplicates; "
                f"{self.tokens} tokens in {self.seconds:.1f} s")


def _read(path: Path) -> tuple[list[dict], int]:
    """The records already written and the number of the next batch; a torn last line is cut off."""
    if not path.exists():
        return [], 0
    records, good, offset, last = [], 0, 0, -1
    with open(path, "rb") as f:
        for raw in f:
            offset += len(raw)
            if not raw.endswith(b"\n"):
                break
            record = json.loads(raw)
            records.append(record)
            last = max(last, record["batch"])
            good = offset
    if good < path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good)
    return records, last + 1


def synthesize(endpoint, prefixes: list[list[int]], out: str | Path, *, count: int, category: str = "chat",
               system: str | None = None, leads: list[str] = ("",), seed: int = 0, temperature: float = 1.0,
               top_p: float = 1.0, max_tokens: int = 256, min_chars: int = 16, parallel: int = 4, batch_size: int = 32,
               max_batches: int | None = None, id_prefix: str | None = None, progress: bool = True) -> SynthesisStats:
    """Append requests sampled from `endpoint` (an eval.engines.endpoint.Endpoint) to the chat-format JSONL file `out`
    until it holds `count` of them, each a record {id, category, messages: [user turn], batch} (`batch`: the
    batch that sampled it, which a resume starts after; readers of the chat format ignore it).

    Request i (counted from 0 over the whole run) continues prefixes[i % len(prefixes)] (user_turn_prefix of
    `system` and leads[i % len(leads)], the words it starts with), sampled with seed crc32(f"{seed}-{i}"); its
    record's id is f"{id_prefix}-{i}" (default id_prefix: f"{category}-synth"; give another to runs whose files
    will be joined, as ids must be distinct across a data set). Resumes an interrupted run with the same settings
    (`out`.meta.json holds them; other settings are an error). Stops after `max_batches` batches (default: enough for 4 × `count` requests) and
    says how many it kept, so a model that rarely ends its requests does not sample forever.
    """
    if count < 1 or batch_size < 1 or parallel < 1:
        raise ValueError(f"count, batch_size and parallel must be at least 1, got {count}, {batch_size}, {parallel}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    leads = list(leads)
    id_prefix = id_prefix or f"{category}-synth"
    if len(leads) != len(prefixes) or not prefixes:
        raise ValueError(f"one prefix per lead: {len(prefixes)} prefixes, {len(leads)} leads")
    meta = {"prefixes": zlib.crc32(json.dumps(prefixes).encode()), "category": category, "system": system,
            "leads": leads, "seed": seed, "temperature": temperature, "top_p": top_p, "max_tokens": max_tokens,
            "min_chars": min_chars, "batch_size": batch_size, "model": getattr(endpoint, "model", None),
            "id_prefix": id_prefix}
    meta_path = out.with_name(out.name + ".meta.json")
    # Files written before ids could be chosen hold the default prefix.
    if meta_path.exists() and {"id_prefix": f"{category}-synth"} | json.loads(meta_path.read_text()) != meta:
        raise ValueError(f"{out} was written with other settings or another model ({meta_path}): delete both, or "
                         "write to another file")
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    records, first = _read(out)
    seen = {normalized(r["messages"][0]["content"]) for r in records}
    stats = SynthesisStats(kept=len(records), resumed=len(records))
    max_batches = max_batches if max_batches is not None else -(-4 * count // batch_size)
    bar = tqdm(total=count, initial=len(records), desc=f"synthesize {category}", unit="request",
               disable=not progress, file=sys.stderr)
    started = time.perf_counter()

    def one(i: int):
        return endpoint.complete(prefixes[i % len(prefixes)], max_tokens=max_tokens, temperature=temperature,
                                 top_p=top_p, seed=zlib.crc32(f"{seed}-{i}".encode()))

    try:
        with open(out, "ab") as f, ThreadPoolExecutor(max_workers=parallel) as pool:
            for b in range(first, max_batches):
                if stats.kept >= count:
                    break
                numbers = range(b * batch_size, (b + 1) * batch_size)
                lines = []
                for i, answer in zip(numbers, pool.map(one, numbers)):
                    stats.sampled += 1
                    stats.tokens += answer.tokens
                    text = (leads[i % len(leads)] + answer.text).strip()
                    key = normalized(text)
                    if answer.finish_reason != "stop":
                        stats.cut_off += 1
                    elif len(text) < min_chars:
                        stats.too_short += 1
                    elif key in seen:
                        stats.duplicate += 1
                    elif stats.kept < count:
                        seen.add(key)
                        stats.kept += 1
                        lines.append(json.dumps({"id": f"{id_prefix}-{i}", "category": category, "batch": b,
                                                 "messages": [{"role": "user", "content": text}]}) + "\n")
                f.write("".join(lines).encode())
                f.flush()
                os.fsync(f.fileno())
                bar.update(len(lines))
    finally:
        bar.close()
    stats.seconds = time.perf_counter() - started
    if stats.kept < count:
        print(f"synthesize: {out} holds {stats.kept} of the {count} requests asked for after {max_batches} batches "
              f"of {batch_size}; {stats.summary()}", file=sys.stderr)
    return stats

