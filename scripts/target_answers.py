"""What the target answers on held-out traffic: greedy answers per category, how many are distinct, how long.

    python scripts/target_answers.py                       # toy world, the prompts `python -m eval` uses
    python scripts/target_answers.py --target toyworld://tiny/target --data toyworld://tiny/company_logs/eval.jsonl

Acceptance is measured against these answers, so a target whose answers are degenerate (a constant
string, a repeated fragment) makes any drafter look good or bad for reasons that are not the traffic's.
Run it before trusting a per-category table.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from eval.run import load_prompts, load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="toyworld://toy/target")
    ap.add_argument("--data", default="toyworld://toy/company_logs/eval.jsonl")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per category (as python -m eval)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--show", type=int, default=2, help="answers printed per category")
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


if __name__ == "__main__":
    main()
