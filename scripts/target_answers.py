"""What the target answers on held-out traffic: greedy answers per category, how many are distinct, how long.

    python scripts/target_answers.py                       # toy world, the prompts `python -m eval` uses
    python scripts/target_answers.py --target toyworld://tiny/target --data toyworld://tiny/company_logs/eval.jsonl
    python scripts/target_answers.py --reference 24        # also: how close to the logged answers is it?
    python scripts/target_answers.py --reference 24 --match "Look up employee"   # only the requests that match

Acceptance is measured against these answers, so a target whose answers are degenerate (a constant
string, a repeated fragment) makes any drafter look good or bad for reasons that are not the traffic's.
Run it before trusting a per-category table.

`--reference N` answers the first N held-out records of each category and compares each greedy answer
with the answer the record logged: how many it reproduces exactly, and the share of the logged answer's
tokens it gets right before its first wrong one. A target that knows its traffic (the function recalled
by name, the paragraph asked by topic, the values described in the request) reproduces much of it;
what it knows and a small drafter cannot learn is what an EAGLE head can read from its hidden states.
`--match REGEX` keeps only the records whose last request matches (in `toy_wiki`: "Look up employee" for
the directory's lookups, "(billing|shipping|routing|quotas)\\." for the company's functions).
"""

from __future__ import annotations

import argparse
import re
import statistics

import torch

from eval.run import load_prompts, load_target, resolve_data
from traffic.records import load_records, prompt_ids


def reference_agreement(target, tok, data: str, per_category: int, max_new_tokens: int,
                        match: str | None = None) -> dict[str, list]:
    """Greedy answers against the answers logged in the records, per category: how much of what the
    traffic says the target itself would say. With `match` (a regular expression), only the records
    whose last request matches it. Prints a line per category and returns, per category,
    (reproduced exactly, share right before the first wrong token) for each record."""
    records, _ = load_records(resolve_data(data))
    rows: dict[str, list[tuple[bool, float]]] = {}
    for record in records:
        request = [m["content"] for m in record.messages if m["role"] == "user"][-1]
        if match is not None and not re.search(match, request):
            continue
        if len(rows.setdefault(record.category, [])) >= per_category:
            continue
        prompt = torch.tensor(prompt_ids(record, tok))
        logged = [m["content"] for m in record.messages if m["role"] == "assistant"][-1]  # what the prompt asks for
        reference = tok(logged, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out = target.generate(prompt[None], max_new_tokens=min(max_new_tokens, len(reference)), do_sample=False,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
        right = next((i for i, (a, b) in enumerate(zip(out, reference)) if a != b), min(len(out), len(reference)))
        rows[record.category].append((out == reference, right / len(reference)))
    label = f" matching {match!r}" if match is not None else ""
    for category, results in sorted(rows.items()):
        print(f"logged answers{label}, {category}: {sum(e for e, _ in results)} of {len(results)} reproduced exactly; "
              f"mean share of the logged answer right before the first wrong token "
              f"{statistics.mean(f for _, f in results):.2f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="toyworld://toy/target")
    ap.add_argument("--data", default="toyworld://toy/company_logs/eval.jsonl")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per category (as python -m eval)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--show", type=int, default=2, help="answers printed per category")
    ap.add_argument("--reference", type=int, default=0, help="held-out records per category to compare with "
                    "their logged answers")
    ap.add_argument("--match", help="with --reference: only records whose last request matches this regex")
    args = ap.parse_args()
    target, tok = load_target(args.target, device=torch.device("cpu"))
    prompts = load_prompts(args.data, tok, device=target.device, max_per_category=args.prompts)
    answers: dict[str, list[list[int]]] = {}
    for category, ids in prompts.items():
        for prompt in ids:
            out = target.generate(prompt[None], max_new_tokens=args.max_new_tokens, do_sample=False,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            answers.setdefault(category, []).append(out[0, len(prompt):].tolist())
    for category, rows in sorted(answers.items()):
        print(f"{category}: {len(set(map(tuple, rows)))} distinct answers of {len(rows)}, "
              f"{statistics.mean(map(len, rows)):.1f} new tokens on average "
              f"({sum(len(r) == args.max_new_tokens for r in rows)} stopped by the token limit)")
        for row in rows[: args.show]:
            print("   ", repr(tok.decode(row))[:200])
    if args.reference:
        reference_agreement(target, tok, args.data, args.reference, max_new_tokens=256, match=args.match)


if __name__ == "__main__":
    main()
