"""Company traffic in: read and check records, and turn them into prompts and training examples.

A record (one JSON object per line, or a Parquet row) holds one conversation in one of the formats
production traffic is logged in (traffic/formats.py: OpenAI chat messages with tool calls, tool turns and
reasoning; request/response log pairs; ShareGPT; benchmark question files; Alpaca; prompt/response),
detected per record from its keys or named for every record with `data.format=`, with optional `id`, `category` (or
`route`), `timestamp` and `model`. Records without a category are put in the category "uncategorized" and
counted in a warning; "all" is reserved for the aggregate.

Local JSONL files are checked line by line, so an error names the file, the line and the field.
Anything else `datasets` can read (Parquet, a glob, a hub dataset id) is loaded with `datasets` and
checked row by row.
"""

from __future__ import annotations

import glob
import json
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from traffic import formats

log = logging.getLogger(__name__)

UNCATEGORIZED = "uncategorized"
RESERVED_CATEGORIES = ("all",)


class RecordError(ValueError):
    """A record that cannot be used, with where it came from."""

    def __init__(self, source: str, line: int | None, field_name: str | None, problem: str) -> None:
        where = f"{source}:{line}" if line is not None else source
        what = f" field {field_name!r}:" if field_name else ""
        super().__init__(f"{where}:{what} {problem}")
        self.source, self.line, self.field_name, self.problem = source, line, field_name, problem


@dataclass
class Record:
    """One conversation from the traffic, checked."""

    messages: list[dict]
    category: str
    id: str
    source: str
    line: int | None
    tools: list[dict] | None = None  # the tools the request offered (handed to the chat template)

    @property
    def prompt_messages(self) -> list[dict]:
        """The conversation up to (not including) the last assistant turn: what a model is asked."""
        last = max((i for i, m in enumerate(self.messages) if m["role"] == "assistant"), default=len(self.messages))
        return self.messages[:last]


@dataclass
class LoadSummary:
    """What loading skipped or defaulted, printed at the end."""

    loaded: int = 0
    skipped: Counter = field(default_factory=Counter)
    uncategorized: int = 0
    formats: Counter = field(default_factory=Counter)  # format -> records
    notes: Counter = field(default_factory=Counter)  # what reading left out of records it kept

    def __str__(self) -> str:
        parts = [f"{self.loaded} records loaded" + (f" ({', '.join(f'{n} {f}' for f, n in self.formats.most_common())})"
                                                   if self.formats else "")]
        if self.notes:
            parts.append(", ".join(f"{n}× {why}" for why, n in self.notes.most_common()))
        if self.skipped:
            parts.append(f"{sum(self.skipped.values())} skipped (" +
                         ", ".join(f"{n}× {why}" for why, n in self.skipped.most_common()) + ")")
        if self.uncategorized:
            parts.append(f"{self.uncategorized} without a category put in {UNCATEGORIZED!r}")
        return "; ".join(parts)


def _check(raw: object, source: str, line: int | None, format: str | None,
           reasoning: str) -> tuple[Record, Counter, str]:
    """The record, what reading it left out, and its format (`format`, or detected from its keys)."""
    if not isinstance(raw, dict):
        raise RecordError(source, line, None, f"expected a JSON object, got {type(raw).__name__}")
    format = format or formats.detect(raw)
    if format is None:
        raise RecordError(source, line, None, "a record needs one of the keys "
                          + ", ".join(repr(k) for k in formats.FORMATS.values()) + " (traffic/formats.py)")
    rid = raw.get("id", raw.get("question_id"))
    if rid is not None and not isinstance(rid, (str, int)):
        raise RecordError(source, line, "id", f"expected a string or integer, got {type(rid).__name__}")
    category = raw.get("category", raw.get("route"))
    if category is not None:
        if not isinstance(category, str) or not category.strip():
            raise RecordError(source, line, "category", f"expected a non-empty string, got {category!r}")
        if category in RESERVED_CATEGORIES:
            raise RecordError(source, line, "category", f"{category!r} is reserved for the aggregate over categories")
    try:
        conversation = formats.read(raw, format, reasoning)
    except formats.FieldError as e:
        raise RecordError(source, line, e.field_name, e.problem) from None
    return Record(conversation.messages, category or UNCATEGORIZED, str(rid) if rid is not None else f"{source}:{line}",
                  source, line, conversation.tools), conversation.notes, format


def _jsonl_rows(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed object) per non-blank line; an unreadable line yields a RecordError as the
    object, so the caller can skip it and go on."""
    with open(path, "rb") as f:
        for number, raw_line in enumerate(f, start=1):
            try:
                text = raw_line.decode("utf-8")
            except UnicodeDecodeError as e:
                yield number, RecordError(str(path), number, None, f"not valid UTF-8 ({e.reason} at byte {e.start})")
                continue
            if not text.strip():
                continue
            try:
                yield number, json.loads(text)
            except json.JSONDecodeError as e:
                yield number, RecordError(str(path), number, None, f"invalid JSON ({e.msg}, column {e.colno})")


def _dataset_rows(spec: str, split: str) -> Iterator[tuple[int | None, object]]:
    import datasets  # heavy (pyarrow): only where a hub dataset is read

    builder = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}.get(Path(spec).suffix)
    if builder:  # a file or a glob of files of a known format
        ds = datasets.load_dataset(builder, data_files=spec, split=split, streaming=True)
    else:  # a directory or a hub dataset id
        ds = datasets.load_dataset(spec, split=split, streaming=True)
    for i, row in enumerate(ds):
        yield i, {k: v for k, v in row.items() if v is not None}


def iter_records(spec: str, *, split: str = "train", on_bad_record: str = "error", format: str | None = None,
                 reasoning: str = "keep", summary: LoadSummary | None = None) -> Iterator[Record]:
    """Yield checked records from a JSONL file, a glob of them, a Parquet file or a hub dataset id.

    format: one of traffic/formats.py's FORMATS for every record, or None to detect each record's from its
    keys. reasoning: keep | drop (traffic/formats.py). on_bad_record: "error" raises RecordError naming
    file, line and field; "skip" counts the record in `summary` and goes on.
    """
    if on_bad_record not in ("error", "skip"):
        raise ValueError(f"on_bad_record must be 'error' or 'skip', got {on_bad_record!r}")
    formats.check_options(format, reasoning)
    summary = summary if summary is not None else LoadSummary()
    paths = sorted(glob.glob(spec)) if glob.has_magic(spec) else ([spec] if Path(spec).exists() else [])
    if paths and all(p.endswith(".jsonl") for p in paths):
        sources = [(p, _jsonl_rows(Path(p))) for p in paths]
    elif glob.has_magic(spec) and not paths:
        raise FileNotFoundError(f"no files match {spec!r}")
    else:
        sources = [(spec, _dataset_rows(spec, split))]
    seen: dict[str, str] = {}
    for source, rows in sources:
        for line, raw in rows:
            try:
                if isinstance(raw, RecordError):
                    raise raw
                record, notes, record_format = _check(raw, source, line, format, reasoning)
                if record.id in seen:
                    # Duplicate ids make resumable caches and held-out splits ambiguous.
                    raise RecordError(source, line, "id", f"duplicate id {record.id!r} (first at {seen[record.id]})")
                seen[record.id] = f"{source}:{line}"
            except RecordError as e:
                if on_bad_record == "error":
                    raise
                summary.skipped[e.problem.split(" (")[0].split(",")[0]] += 1
                continue
            summary.loaded += 1
            summary.formats[record_format] += 1
            summary.notes.update(notes)
            summary.uncategorized += record.category == UNCATEGORIZED
            yield record


def load_records(spec: str, *, split: str = "train", on_bad_record: str = "error", format: str | None = None,
                 reasoning: str = "keep") -> tuple[list[Record], LoadSummary]:
    """All records of `spec` (see `iter_records`), and what loading skipped; an empty result is an error."""
    summary = LoadSummary()
    records = list(iter_records(spec, split=split, on_bad_record=on_bad_record, format=format, reasoning=reasoning,
                                summary=summary))
    if not records:
        raise ValueError(f"{spec}: no usable records ({summary})")
    if summary.uncategorized:
        log.warning("%s: %d records have no 'category' (or 'route'); they are reported as %r",
                    spec, summary.uncategorized, UNCATEGORIZED)
    return records, summary


def prompt_ids(record: Record, tokenizer) -> list[int]:
    """Token ids of the record's prompt through the tokenizer's chat template, ending with the
    assistant-turn opener so the model answers."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; set one "
            "(tokenizer.chat_template) to turn chat records into prompts"
        )
    ids = tokenizer.encode(render(tokenizer, record.prompt_messages, True, record.tools), add_special_tokens=False)
    return list(ids)


@dataclass
class Example:
    """One tokenized conversation for training.

    input_ids: the whole conversation through the chat template.
    loss_mask: 1 on the tokens a drafter learns (every assistant turn, including its end-of-turn
        token), 0 on system and user turns and template scaffolding.
    """

    id: str
    category: str
    input_ids: list[int]
    loss_mask: list[int]


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
    """The conversation as the tokenizer's chat template writes it (traffic/formats.py's template_messages:
    developer and reasoning as the template knows them), with the record's tools."""
    return tokenizer.apply_chat_template(formats.template_messages(messages, tokenizer.chat_template),
                                         tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False)


_EMPTY_THINK = re.compile(r"\s*<think>\s*</think>\s*")  # matched at a turn's start


def tokenize_record(record: Record, tokenizer, max_length: int | None = None) -> Example:
    """Tokenize a conversation with the chat template and mask everything but the assistant turns.

    Each assistant turn's characters are located by rendering the conversation up to that turn with
    the generation prompt (where the answer starts) and through that turn (where it ends); a token is
    masked in when its characters overlap that span (a token merging the template's last newline
    with the answer's first characters counts as the answer's). This needs a template whose rendering
    of a prefix is a prefix of the whole; one that is not (e.g. one that drops past reasoning blocks)
    is an error, never a wrong mask.

    The span is the turn as the template renders it: its reasoning, text and tool calls (their names and
    arguments are tokens the target generates). An empty `<think></think>` a template inserts into a turn
    that had no reasoning is not the assistant's and stays out; a turn whose tool calls the template does
    not render is an error (the drafter would never see them).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                         "set one (tokenizer.chat_template) to train on chat records")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("locating assistant tokens needs a fast tokenizer (character offsets)")
    text = render(tokenizer, record.messages, False, record.tools)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    for i, message in enumerate(record.messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, record.messages[:i], True, record.tools)
        through = render(tokenizer, record.messages[: i + 1], False, record.tools)
        if not (text.startswith(before) and text.startswith(through)):
            raise RecordError(record.source, record.line, f"messages[{i}]",
                              "the chat template does not render this conversation's prefixes as prefixes; "
                              "cannot locate the assistant turn to mask")
        start, end = len(before), len(through)
        if "reasoning_content" not in message and (empty := _EMPTY_THINK.match(text, start)):
            start = empty.end()
        missing = [c["function"]["name"] for c in message.get("tool_calls", []) if c["function"]["name"] not in text[start:end]]
        if missing:
            raise RecordError(record.source, record.line, f"messages[{i}].tool_calls",
                              f"the chat template does not render tool calls ({', '.join(missing)} missing from the "
                              "assistant turn); use the target's own template, which writes them")
        for j, (a, b) in enumerate(offsets):
            if a < end and b > start:
                mask[j] = 1
    if max_length is not None and len(ids) > max_length:
        raise RecordError(record.source, record.line, "messages",
                          f"conversation is {len(ids)} tokens, longer than the context of {max_length}")
    return Example(record.id, record.category, ids, mask)

