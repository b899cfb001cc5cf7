"""Where a drafter is rejected: held-out answers printed round by round, kept guesses plain, the target's
own token (its correction, or the bonus token after a full hit) in brackets.

    python scripts/show_rounds.py --drafter eagle:head:runs/bench_heads/eagle/best --category code
    python scripts/show_rounds.py --drafter sft:draft_lm:runs/bench_heads/draft_lm_sft/best --prompts 2 --k 4

A drafter spec is name:kind:path with kind draft_lm, head or ngram (path unused), as in `python -m eval`.
Several --drafter flags print each prompt's answer once per drafter, so two drafters can be read side by
side. Greedy decoding: the text is the target's own greedy answer whatever the drafter (checked).
"""

from __future__ import annotations

import argparse

import torch

from drafters.sampling import Sampling
from eval.run import build_drafter, load_prompts, load_target
from eval.speculative import autoregressive_generate, speculative_generate


def rounds_text(tokens: list[int], rounds, decode) -> str:
    """The generated text with every round's target token in brackets: the prefill's token, then round by round
    the kept guesses and [the target's own token] (empty where the token budget ended the answer on a guess)."""
    if not tokens:
        return ""
    out, i = [decode(tokens[:1])], 1
    for r in rounds:
        kept, own = tokens[i: i + r.accepted], tokens[i + r.accepted: i + r.accepted + 1]
        out.append(decode(kept) + "[" + decode(own) + "]")
        i += r.accepted + 1
    return "".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", action="append", required=True, help="name:kind:path (repeatable)")
    ap.add_argument("--target", default="toyworld://toy/target")
    ap.add_argument("--data", default="toyworld://toy/company_logs/eval.jsonl")
    ap.add_argument("--category", default=None, help="only this traffic category")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per category")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    target, tok = load_target(args.target, device=torch.device("cpu"))
    drafters = []
    for spec in args.drafter:
        name, _, rest = spec.partition(":")
        kind, _, path = rest.partition(":")
        if not name or not kind:
            raise SystemExit(f"--drafter {spec!r}: expected name:kind:path")
        drafters.append(build_drafter({"name": name, "kind": kind, "path": path or None}, target=target, tokenizer=tok))
    prompts = load_prompts(args.data, tok, device=target.device, max_per_category=args.prompts)
    greedy = Sampling(0.0)
    for category, items in prompts.items():
        if args.category and category != args.category:
            continue
        for n, prompt in enumerate(items):
            print(f"=== {category} #{n}: ...{tok.decode(prompt[-24:].tolist())!r}")
            reference = autoregressive_generate(target, prompt, sampling=greedy, max_new_tokens=args.max_new_tokens,
                                                eos_token_id=tok.eos_token_id).tokens
            for drafter in drafters:
                g = speculative_generate(target, drafter, prompt, k=args.k, sampling=greedy,
                                         max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id)
                if g.tokens != reference:
                    raise SystemExit(f"{drafter.name}: speculative output differs from the target's greedy output")
                tau = (len(g.tokens) - 1) / max(len(g.rounds), 1)
                print(f"--- {drafter.name}: {len(g.rounds)} rounds, {tau:.2f} tokens per round")
                print(rounds_text(g.tokens, g.rounds, tok.decode))


if __name__ == "__main__":
    main()
