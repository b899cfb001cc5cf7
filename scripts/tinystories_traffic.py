"""Traffic for a story model from TinyStories text: each paragraph's first sentence is the prompt, the rest
of the paragraph the logged response, in `prompt` records (docs/data.md, "Formats"):

    python scripts/tinystories_traffic.py ../shared/data/tinystories/tinystories_val.txt runs/tinystories

Categories, by what the paragraph is: `opening` (it begins a story: "Once upon a time"), `dialogue` (it
quotes a character), `narration` (the rest). Paragraphs alternate between train.jsonl and eval.jsonl in
blocks of ten (every tenth block held out), so both files see the whole text. Paragraphs of one sentence
have nothing to answer and are left out.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"])")


def category(paragraph: str) -> str:
    if paragraph.startswith("Once upon a time"):
        return "opening"
    return "dialogue" if '"' in paragraph else "narration"


def records(text: str) -> list[dict]:
    out = []
    for i, paragraph in enumerate(p.strip() for p in re.split(r"\n\s*\n", text)):
        parts = _SENTENCE_END.split(paragraph, maxsplit=1)
        if len(parts) < 2 or not parts[1].strip():
            continue
        out.append({"id": f"p{i:05d}", "category": category(paragraph), "prompt": parts[0], "response": " " + parts[1]})
    return out


def write(source: Path, out: Path) -> dict[str, Counter]:
    rows = records(source.read_text(encoding="utf-8"))
    split = {"train": [], "eval": []}
    for n, r in enumerate(rows):
        split["eval" if (n // 10) % 10 == 9 else "train"].append(r)
    out.mkdir(parents=True, exist_ok=True)
    for name, chosen in split.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chosen), encoding="utf-8")
    return {name: Counter(r["category"] for r in chosen) for name, chosen in split.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="TinyStories text, paragraphs separated by blank lines")
    parser.add_argument("out", type=Path, help="directory for train.jsonl and eval.jsonl")
    args = parser.parse_args()
    for name, counts in write(args.source, args.out).items():
        print(f"{args.out / (name + '.jsonl')}: {sum(counts.values())} records, {dict(counts)}")


if __name__ == "__main__":
    main()
