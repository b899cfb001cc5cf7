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

A world is addressed as `toyworld://<preset>/<piece>` (e.g. `toyworld://toy/target`); `resolve`
builds it on first use and caches it by a hash of its configuration, so changing the recipe rebuilds.
"""

from __future__ import annotations

import ast
import dataclasses
import fcntl
import functools
import hashlib
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from traffic import formats

SCHEME = "toyworld://"
PIECES = ("target", "draft", "company_logs")
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
# Role, content, and an assistant's tool calls as <tool_call> JSON (rendered only where there are some, so
# a conversation without tool calls renders as it always has).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CATEGORIES = ("code", "json", "prose")  # and "agent" in the presets with agent traffic


@dataclass(frozen=True)
class LMSpec:
    """A Llama-architecture LM and how long to train it."""

    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    intermediate_size: int
    steps: int
    batch_size: int
    lr: float = 3e-3


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
# reproduced none of 24 held-out lookups; this one reproduces 22 (BENCHMARKS.md, section 5).
PRESETS["toy_wiki"] = dataclasses.replace(
    PRESETS["toy"], target=dataclasses.replace(PRESETS["toy"].target, steps=2400),
    directory_size=96, codebase_size=96, wiki_repeats=32,
)
# For engine tests (llama.cpp, exports): the tiny world with a 4-layer target, deep enough for an EAGLE-3
# head on layers an engine captures (the inputs of layers 1..n-1) and for layer ids off by one to differ.
PRESETS["tiny_deep"] = dataclasses.replace(
    PRESETS["tiny"], target=dataclasses.replace(PRESETS["tiny"].target, layers=4, steps=400))
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


CHECKPOINT_EVERY = 100  # steps between a build's model checkpoints


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
        from transformers import AutoTokenizer

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
    return _encode(tokenizer, chats * 2 + raw + wiki * config.wiki_repeats, config.seed)


def _draft_stream(config: ToyWorldConfig, texts: dict[str, list[str]], tokenizer) -> torch.Tensor:
    """The off-the-shelf draft's training text, encoded."""
    rng = random.Random(config.seed)
    general_prose = [p for p in texts["prose"] if not _is_company_paragraph(p)]
    company_json = [json.dumps(_json_record(rng), indent=1) for _ in range(60)]
    draft_mix = (general_prose * 2 + rng.sample(texts["code"], len(texts["code"]) // 3) + texts["json"][:300]
                 + company_json)
    return _encode(tokenizer, draft_mix, config.seed + 1)


def _train_piece(piece: str, spec: LMSpec, stream: torch.Tensor, tokenizer, config: ToyWorldConfig,
                 out: Path, checkpoints: Path | None = None) -> float:
    """Train one model of the world on its stream and save it (with the tokenizer) to `out`; its final
    loss. With `checkpoints`, training resumes from the newest checkpoint there and writes new ones."""
    # Seed the initialisation too: otherwise the weights would depend on whatever used the global
    # RNG earlier in the process (a test session, the training entry point's own seeding).
    torch.manual_seed(config.seed + (piece == "draft"))
    model = _llama(spec, tokenizer, config.context or 4 * config.seq_len)
    loss = train_lm(model, stream, spec, config.seq_len, seed=config.seed, desc=f"toyworld {piece}",
                    checkpoints=checkpoints)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"[toyworld] {piece}: {_params(model) / 1e6:.2f}M parameters, final loss {loss:.3f}", file=sys.stderr)
    return loss


def build_draft_variant(preset: str, out: Path, **changes) -> float:
    """The preset's off-the-shelf draft trained by the same recipe (same text, seed and steps) with
    `changes` to its shape (e.g. layers=3), saved to `out`; returns its final loss. For checking how a
    draft's size moves its cost and acceptance against the heads; the world itself is not changed."""
    from transformers import AutoTokenizer

    config = PRESETS[preset]
    world = build(preset)
    tokenizer = AutoTokenizer.from_pretrained(world / "draft")
    stream = _draft_stream(config, corpus(config.seed), tokenizer)
    return _train_piece("draft", dataclasses.replace(config.draft, **changes), stream, tokenizer, config, Path(out))


# --- text -------------------------------------------------------------------------------------------


def corpus(seed: int) -> dict[str, list[str]]:
    """Code, prose and JSON documents from the running Python installation, deterministic in seed."""
    rng = random.Random(seed)
    json_docs = [json.dumps(_generic_json(rng), indent=1) for _ in range(600)]
    paragraphs = _reference_paragraphs()
    return {"code": list(_stdlib_functions()), "prose": [p for _, p in paragraphs],
            "prose_topic": [t for t, _ in paragraphs], "json": json_docs}


@functools.lru_cache(maxsize=1)
def _stdlib_functions() -> tuple[str, ...]:
    """Top-level functions (4-31 lines, ASCII) of the standard library's modules, sorted by module.

    A line scan finds candidates (a `def` at column 0 up to the next line of code at column 0) and
    each candidate must parse on its own; parsing whole modules instead costs ten times as long.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, ValueError):
            continue
        starts = [i for i, line in enumerate(lines) if line.startswith("def ")]
        for start in starts:
            end = start + 1
            while end < len(lines) and (not lines[end] or lines[end][0] in " \t)"):
                end += 1
            while end > start and not lines[end - 1].strip():
                end -= 1
            segment = "\n".join(lines[start:end])
            if not 4 <= end - start <= 31 or not segment.isascii():
                continue
            try:
                ast.parse(segment)
            except SyntaxError:
                continue
            name = lines[start][4:].split("(")[0].strip()
            code.append(f"# {path.stem}.{name}\n{segment}")
    return tuple(code)


@functools.lru_cache(maxsize=1)
def _reference_paragraphs() -> tuple[tuple[str, str], ...]:
    """(topic, paragraph) of the language reference topics shipped in pydoc_data."""
    from pydoc_data.topics import topics

    return tuple((name, p.strip()) for name in sorted(topics) for p in topics[name].split("\n\n")
                 if 80 <= len(p.strip()) <= 1200 and p.strip().isascii() and not p.startswith("   "))


_FIRST = ["Ada", "Grace", "Alan", "Linus", "Guido", "Barbara", "Ken", "Margaret", "Dennis", "Frances"]
_LAST = ["Lovelace", "Hopper", "Turing", "Torvalds", "Rossum", "Liskov", "Thompson", "Hamilton", "Ritchie", "Allen"]
_CITIES = ["Paris", "Lagos", "Lima", "Oslo", "Pune", "Osaka", "Quito", "Perth", "Turin", "Accra"]
_ITEMS = ["keyboard", "monitor", "cable", "laptop", "mouse", "dock", "headset", "webcam"]
_STATUSES = ["paid", "shipped", "refunded"]
_TEAMS = ["payments", "search", "billing", "support", "infra", "mobile", "security", "data"]
COMPANY_MODULES = ("billing", "shipping", "routing", "quotas")  # the company codebase's modules
_PLANS = ["free", "team", "business", "enterprise"]


def company_directory(seed: int, size: int) -> list[dict]:
    """The company's employee directory: an id and facts nothing else in the world implies."""
    rng = random.Random(seed + 11)
    return [{"employee": e, "name": f"{rng.choice(_FIRST)} {rng.choice(_LAST)}", "team": rng.choice(_TEAMS),
             "city": rng.choice(_CITIES), "desk": f"{rng.choice('ABCDEFGH')}{rng.randrange(10, 100)}"}
            for e in sorted(rng.sample(range(100, 1000), size))]


def company_codebase(seed: int, size: int) -> list[tuple[str, str]]:
    """The company's helper functions as ("module.name", source): four kinds of short function whose
    constants, plans, teams and queues are drawn at random, so only their source tells them."""
    rng = random.Random(seed + 13)
    names = sorted(rng.sample([(m, item, kind) for m in COMPANY_MODULES for item in _ITEMS for kind in range(4)], size))
    functions = []
    for module, item, kind in names:
        a, b = rng.randrange(2, 60), rng.randrange(1, 99)
        if kind == 0:
            name = f"{item}_fee"
            source = (f'def {name}(quantity):\n    """Price of {item} orders, in cents."""\n'
                      f"    return {a} * quantity + {b}")
        elif kind == 1:
            name = f"max_{item}s"
            source = (f'def {name}(account):\n    if account.plan == "{rng.choice(_PLANS)}":\n        return {a}\n'
                      f"    return {b}")
        elif kind == 2:
            name = f"route_{item}"
            first, second = rng.sample(_TEAMS, 2)
            source = (f'def {name}(ticket):\n    if ticket.priority == "high":\n        return "{first}"\n'
                      f'    return "{second}"')
        else:
            name = f"{item}_retry"
            queue = rng.choice(_CITIES).lower()
            source = f'def {name}():\n    return {{"attempts": {a % 7 + 1}, "delay": {b}, "queue": "{queue}"}}'
        functions.append((f"{module}.{name}", source))
    return functions


def _json_record(rng: random.Random) -> dict:
    """A record in one of the company's own schemas (users, orders, tool calls)."""
    kind = rng.choice(["user", "order", "tool_call"])
    if kind == "user":
        first, last = rng.choice(_FIRST), rng.choice(_LAST)
        return {"id": rng.randrange(1, 10000), "name": f"{first} {last}",
                "email": f"{first.lower()}.{last.lower()}@example.com", "city": rng.choice(_CITIES),
                "active": rng.random() < 0.7}
    if kind == "order":
        items = [{"item": rng.choice(_ITEMS), "quantity": rng.randrange(1, 5)} for _ in range(rng.randrange(1, 4))]
        return {"order_id": rng.randrange(10000, 99999), "status": rng.choice(_STATUSES), "items": items}
    return _tool_call(rng)[1]


def _tool_call(rng: random.Random) -> tuple[str, dict]:
    """A user's request and the tool call that serves it."""
    tool = rng.choice(["get_weather", "create_ticket", "lookup_order", "send_email"])
    if tool == "get_weather":
        city, unit = rng.choice(_CITIES), rng.choice(["celsius", "fahrenheit"])
        return f"What is the weather in {city}, in {unit}?", {"tool": tool, "arguments": {"city": city, "unit": unit}}
    if tool == "create_ticket":
        item, priority = rng.choice(_ITEMS), rng.choice(["low", "high"])
        return (f"Open a {priority} priority ticket: my {item} is not working.",
                {"tool": tool, "arguments": {"title": f"{item} not working", "priority": priority}})
    if tool == "lookup_order":
        order = rng.randrange(10000, 99999)
        return f"Where is my order {order}?", {"tool": tool, "arguments": {"order_id": order}}
    to = f"{rng.choice(_FIRST).lower()}@example.com"
    return f"Email {to} about their order.", {"tool": tool, "arguments": {"to": to, "subject": "Your order"}}


def _generic_json(rng: random.Random) -> dict:
    """JSON in schemas that are not the company's: general-purpose documents any model may have seen."""
    kind = rng.choice(["package", "event", "config"])
    word = rng.choice(["alpha", "beta", "gamma", "delta", "omega", "sigma"])
    if kind == "package":
        return {"name": f"py{word}", "version": f"{rng.randrange(0, 4)}.{rng.randrange(0, 20)}.{rng.randrange(0, 9)}",
                "license": rng.choice(["MIT", "BSD-3-Clause", "Apache-2.0"]),
                "dependencies": sorted(rng.sample(["numpy", "requests", "click", "attrs", "rich"], 2))}
    if kind == "event":
        return {"event": rng.choice(["login", "logout", "purchase", "error"]), "user_id": rng.randrange(1, 500),
                "timestamp": f"2024-0{rng.randrange(1, 10)}-1{rng.randrange(0, 10)}T0{rng.randrange(0, 10)}:00:00Z"}
    return {"service": word, "port": rng.choice([80, 443, 8000, 8080]), "debug": rng.random() < 0.5,
            "workers": rng.randrange(1, 9), "log_level": rng.choice(["info", "debug", "warning"])}


def _describe(obj: dict) -> str:
    """The record said in words: what a user pastes before asking for it as JSON."""
    if "email" in obj:
        state = "active" if obj["active"] else "inactive"
        return f"{obj['name']} ({obj['email']}) lives in {obj['city']}, user id {obj['id']}, {state}."
    items = ", ".join(f"{i['quantity']} x {i['item']}" for i in obj["items"])
    return f"Order {obj['order_id']} is {obj['status']} and contains {items}."


def _json_turns(rng: random.Random, directory: list[dict]) -> list[tuple[str, str]]:
    """A third each: a record described in words, an edit of a pasted record, a tool call for a
    request; with a directory, a quarter each and the fourth an employee looked up by id."""
    kind = rng.randrange(4 if directory else 3)
    if kind == 3:
        entry = rng.choice(directory)
        return [("user", f"Look up employee {entry['employee']} in the directory."),
                ("assistant", json.dumps(entry, indent=1))]
    if kind == 0:
        obj = _json_record(rng)
        while "tool" in obj:
            obj = _json_record(rng)
        return [("user", f"Return this as JSON: {_describe(obj)}"), ("assistant", json.dumps(obj, indent=1))]
    if kind == 1:
        obj = _json_record(rng)
        while "order_id" not in obj or "tool" in obj:
            obj = _json_record(rng)
        status = rng.choice([s for s in _STATUSES if s != obj["status"]])
        edited = dict(obj, status=status)
        return [("user", f"Set the status to {status}:\n{json.dumps(obj, indent=1)}"),
                ("assistant", json.dumps(edited, indent=1))]
    request, call = _tool_call(rng)
    return [("user", request), ("assistant", json.dumps(call, indent=1))]


def company_records(texts: dict[str, list[str]], per_category: int, seed: int, directory: list[dict] = (),
                    codebase: list[tuple[str, str]] = ()) -> list[dict]:
    """Production-like chat records: system prompts, categories code / json / prose, some multi-turn.

    Code recalls a function by name from the standard library (with a codebase: half from the
    company's). JSON is in the company's own schemas: a record described in words, an edit of a pasted
    record, a tool call for a request (with a directory: and an employee looked up by id). Prose
    explains a topic of the language reference from the company's half of its paragraphs (the
    off-the-shelf draft reads the other half), asked by topic name, so nothing in the question gives
    the answer away.
    """
    rng = random.Random(seed + 7)
    prose = company_prose(texts)
    records = []
    for n in range(per_category):
        if codebase and rng.random() < 0.5:  # no draw without a codebase: the records stay as before it
            name, body = codebase[rng.randrange(len(codebase))]
        else:
            header, body = texts["code"][rng.randrange(len(texts["code"]))].split("\n", 1)
            name = header[2:]
        code_turns = [("user", f"Show me the implementation of `{name}`."), ("assistant", body)]
        json_turns = _json_turns(rng, directory)
        topic, para = prose[rng.randrange(len(prose))]
        prose_turns = [("user", f"Explain `{topic}` from the Python reference."), ("assistant", para)]
        if rng.random() < 0.2:  # multi-turn: a follow-up asking for the first sentence
            prose_turns += [("user", "Just the first sentence, please."), ("assistant", para.split(". ")[0] + ".")]
        for category, system, turns in (
            ("code", "You are a coding assistant for the Python standard library.", code_turns),
            ("json", "You answer with JSON only.", json_turns),
            ("prose", "You are a helpful assistant who explains Python.", prose_turns),
        ):
            messages = [{"role": "system", "content": system}] + [{"role": r, "content": c} for r, c in turns]
            records.append({"id": f"{category}-{n:05d}", "category": category, "messages": messages})
    return records


TOOLS = [{"type": "function", "function": {"name": name, "description": description,
                                           "parameters": {"type": "object", "properties": properties}}}
         for name, description, properties in (
             ("get_weather", "The weather in a city.", {"city": {"type": "string"}, "unit": {"type": "string"}}),
             ("create_ticket", "Open a support ticket.", {"title": {"type": "string"}, "priority": {"type": "string"}}),
             ("lookup_order", "An order's status and items.", {"order_id": {"type": "integer"}}),
             ("send_email", "Email a customer.", {"to": {"type": "string"}, "subject": {"type": "string"}}))]


def agent_records(per_category: int, seed: int) -> list[dict]:
    """Tool-calling conversations in the OpenAI chat format gateways log: the user asks, the assistant
    calls one of the company's tools (`tool_calls`, content null, arguments as a JSON string), the tool
    answers (a `tool` turn), and the assistant answers from the result; the tools offered ride along."""
    rng = random.Random(seed + 11)
    records = []
    for n in range(per_category):
        request, call = _tool_call(rng)
        tool, args = call["tool"], call["arguments"]
        result, answer = _tool_result(rng, tool, args)
        call_id = f"call_{n:05d}"
        messages = [
            {"role": "system", "content": "You are the company's support agent. Call a tool, then answer from its result."},
            {"role": "user", "content": request},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": tool, "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)},
            {"role": "assistant", "content": answer},
        ]
        records.append({"id": f"agent-{n:05d}", "category": "agent", "tools": TOOLS, "messages": messages})
    return records


def _tool_result(rng: random.Random, tool: str, args: dict) -> tuple[dict, str]:
    """What the tool returns for `args`, and the answer the assistant gives from it."""
    if tool == "get_weather":
        degrees, sky = rng.randrange(-5, 35), rng.choice(["sunny", "cloudy", "raining", "windy"])
        return ({"city": args["city"], "temperature": degrees, "unit": args["unit"], "sky": sky},
                f"It is {degrees} degrees {args['unit']} and {sky} in {args['city']}.")
    if tool == "create_ticket":
        ticket = rng.randrange(1000, 9999)
        return ({"ticket_id": ticket, "status": "open", "priority": args["priority"]},
                f"I opened ticket {ticket} with {args['priority']} priority: {args['title']}.")
    if tool == "lookup_order":
        status = rng.choice(_STATUSES)
        items = [{"item": rng.choice(_ITEMS), "quantity": rng.randrange(1, 5)} for _ in range(rng.randrange(1, 3))]
        listed = ", ".join(f"{i['quantity']} x {i['item']}" for i in items)
        return ({"order_id": args["order_id"], "status": status, "items": items},
                f"Order {args['order_id']} is {status}; it contains {listed}.")
    return {"sent": True, "to": args["to"]}, f"I sent the email to {args['to']}."


def company_prose(texts: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(topic, paragraph) for the company's half of the reference paragraphs, its documentation."""
    return [(t, p) for t, p in zip(texts["prose_topic"], texts["prose"]) if _is_company_paragraph(p)]


def _is_company_paragraph(paragraph: str) -> bool:
    # By a hash of the text: some paragraphs appear under several topics and must fall on one side.
    return zlib.crc32(paragraph.encode()) % 2 == 1


def is_eval(record_id: str, fraction: float) -> bool:
    """Held-out split by a hash of the id: stable whatever the order or number of records."""
    return zlib.crc32(record_id.encode()) % 1000 < fraction * 1000


def write_company_logs(records: list[dict], out: Path, eval_fraction: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.jsonl", "w") as train, open(out / "eval.jsonl", "w") as held_out:
        for r in records:
            (held_out if is_eval(r["id"], eval_fraction) else train).write(json.dumps(r) + "\n")


# --- tokenizer and models ---------------------------------------------------------------------------


def train_tokenizer(texts: dict[str, list[str]], records: list[dict], vocab_size: int):
    """A byte-level BPE tokenizer with the chat special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    chat_text = [m["content"] or "" for r in records for m in r["messages"]]
    chat_text += [json.dumps(c["function"]) for r in records for m in r["messages"] for c in m.get("tool_calls", [])]
    tok.train_from_iterator(texts["code"] + texts["prose"] + texts["json"] + chat_text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>",
                                   pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _encode(tokenizer, docs: list[str], seed: int) -> torch.Tensor:
    docs = list(docs)
    random.Random(seed).shuffle(docs)
    ids = []
    for doc in docs:
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def _llama(spec: LMSpec, tokenizer, context: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=context, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def train_lm(model, stream: torch.Tensor, spec: LMSpec, seq_len: int, seed: int, desc: str,
             checkpoints: Path | None = None, every: int | None = None, stop_at: int | None = None) -> float:
    """Next-token training on random windows of a token stream; returns the mean loss of the last 10 steps.

    With `checkpoints` (a directory), the model, optimizer, schedule and batch sampler are saved there
    every `every` steps (default CHECKPOINT_EVERY; only the newest kept), and training starts from the
    newest one found: the result is the same as an uninterrupted run's. `stop_at` ends training after
    that step (checkpointed), as an interruption would."""
    from traffic import checkpoint

    every = every or CHECKPOINT_EVERY
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, spec.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / spec.steps))
    )
    model.train()
    recent: list[torch.Tensor] = []
    start = 0
    last = checkpoint.latest(checkpoints) if checkpoints is not None else None
    if last is not None:
        state = checkpoint.load(last, model, opt, sched)
        start = state["step"]
        generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))
        recent = [torch.tensor(x) for x in state["recent"]]
        print(f"[toyworld] {desc}: resuming at step {start} from {last}", file=sys.stderr)
    bar = tqdm(range(start, spec.steps), desc=desc, unit="step", file=sys.stderr, initial=start, total=spec.steps)
    # A world may be built on first use from inside torch.no_grad() (an evaluation, a script): train anyway.
    with torch.enable_grad():
        for step in bar:
            starts = torch.randint(0, len(stream) - seq_len, (spec.batch_size,), generator=generator)
            batch = torch.stack([stream[s : s + seq_len] for s in starts.tolist()])  # (B, T)
            loss = model(input_ids=batch, labels=batch).loss  # labels are shifted inside the model
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            recent = (recent + [loss.detach()])[-10:]
            if step % 10 == 0 or step == spec.steps - 1:  # .item() syncs: only when the bar shows it
                bar.set_postfix(loss=f"{torch.stack(recent).mean().item():.3f}")
            done = step + 1
            if checkpoints is not None and done < spec.steps and (done % every == 0 or done == stop_at):
                checkpoint.save(checkpoints, done, model, opt, sched, keep=1,
                                extra={"generator": generator.get_state().tolist(),
                                       "recent": [r.item() for r in recent]})
            if stop_at is not None and done >= stop_at:
                break
    model.eval()
    return torch.stack(recent).mean().item()
