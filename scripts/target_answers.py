"""What the target answers on held-out traffic: greedy answers per category, how many are distinct, how long.

    python scripts/target_answers.py                       # toy world, the prompts `python -m eval` uses
    python scripts/target_answers.py --target toyworld://tiny/target --data toyworld://tiny/company_logs/eval.jsonl
    python scripts/target_answers.py --recall 48           # also: does the target recite what it memorised?

Acceptance is measured against these answers, so a target whose answers are degenerate (a constant
string, a repeated fragment) makes any drafter look good or bad for reasons that are not the traffic's.
Run it before trusting a per-category table.

`--recall N` answers up to N held-out requests of each kind that has one right answer (a toy-world
employee looked up by id, a company function and a standard-library function recalled by name) and
compares the greedy answer with the record's: exact answers, and the share of the reference's tokens
the answer gets right before its first wrong one. Only what the target knows can a head read from its
hidden states; what a small drafter cannot learn from the training traffic is where the two differ.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from eval.run import load_prompts, load_target, resolve_data
from train import toyworld
from train.data import load_records, prompt_ids


def request_kind(record) -> str | None:
    """The kind of a toy-world request with one right answer, or None."""
    user = next(m["content"] for m in record.messages if m["role"] == "user")
    if user.startswith("Look up employee"):
        return "employee lookup"
    if user.startswith("Show me the implementation of `"):
        module = user.split("`")[1].split(".")[0]
        return "company function" if module in toyworld.COMPANY_MODULES else "stdlib function"
    return None


def recall(target, tok, data: str, per_kind: int, max_new_tokens: int) -> None:
    """Greedy answers against the reference answers of requests that have exactly one."""
    records, _ = load_records(resolve_data(data))
    rows: dict[str, list[tuple[bool, float]]] = {}
    for record in records:
        kind = request_kind(record)
        if kind is None or len(rows.setdefault(kind, [])) >= per_kind:
            continue
        prompt = torch.tensor(prompt_ids(record, tok))
        reference = tok(record.messages[-1]["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out = target.generate(prompt[None], max_new_tokens=min(max_new_tokens, len(reference)), do_sample=False,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
        right = next((i for i, (a, b) in enumerate(zip(out, reference)) if a != b), min(len(out), len(reference)))
        rows[kind].append((out == reference, right / len(reference)))
    for kind, results in sorted(rows.items()):
        print(f"recall, {kind}: {sum(e for e, _ in results)} exact of {len(results)}; "
              f"{statistics.mean(f for _, f in results):.2f} of the reference right before the first wrong token "
              f"(mean)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="toyworld://toy/target")
    ap.add_argument("--data", default="toyworld://toy/company_logs/eval.jsonl")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per category (as python -m eval)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--show", type=int, default=2, help="answers printed per category")
    ap.add_argument("--recall", type=int, default=0, help="held-out requests per kind with one right answer")
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
    if args.recall:
        recall(target, tok, args.data, args.recall, max_new_tokens=256)


if __name__ == "__main__":
    main()
