"""Where a draft LM misses the target, and whether training could reach it: per traffic category, the drafter's
top-1 agreement with the target on the target's own greedy answers, split by how sure the target itself was.

    python scripts/agreement.py --target pypi://qwen2.5_coder_1.5b --data coding_traffic/eval.jsonl \\
        --drafter shipped=pypi://qwen2.5_coder_0.5b --drafter lora=runs/train/draft_lm/qwen_lora/best \\
        --dtype bfloat16 --per-category 24 --k 8 --out runs/agreement

The target answers each prompt greedily (once: the answers are kept in the output directory and reused by a later
run with the same target and settings, on any of the same prompts); each drafter then reads prompt and answer in one
forward, so at every position it is conditioned on the answer so far, exactly as in a greedy round whose earlier
guesses were all kept. That makes the replay's rounds the loop's rounds (τ, tokens per target forward, up to the
numerics of a cached forward against a whole one), at the cost of one forward per drafter instead of a speculative
generation.

A position is *unsure* where the target gave its own token less than 0.5, *leaning* from 0.5 to 0.9, *sure* from 0.9.
A miss where the target is unsure is a near coin flip the target made; a miss where it is sure is a plain mistake
of the drafter's. Beside the replay's τ the report gives τ with each kind of miss turned into a hit: how much τ
is lost where the drafter could learn the target's choice, and how much where the target itself hesitates. Hits
within the drafter's top 2 say what drafting two branches per step (a tree) could recover. Every drafter after the
first gets its τ over the first's with the paired 95 % interval of eval/compare.py: on the same answers, so the
partings at near ties that make two loop runs generate different text do not widen it.

Writes agreement.json (every figure), agreement.md (the table) and agreement.png (agreement against the target's
confidence, a line per category and drafter).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from drafters.sampling import Sampling
from eval.compare import compare, tau_counts
from eval.run import build_drafter, dtype_of, load_prompts, load_target
from eval.speculative import autoregressive_generate

BUCKETS = (("unsure", 0.0, 0.5), ("leaning", 0.5, 0.9), ("sure", 0.9, 1.0001))
BINS = 10  # the plot's confidence bins


@dataclass
class Positions:
    """Per position of the answers (the first token, the prefill's, has no guess): the target's probability of its
    own token, and the rank of that token in the drafter's list (0: the drafter's top-1), answer by answer."""

    target_p: list[list[float]] = field(default_factory=list)
    rank: list[list[int]] = field(default_factory=list)


def replay_rounds(hits: list[bool], k: int) -> list[int]:
    """The guesses each greedy round keeps, as draftsmith's loop counts them (eval/speculative.py): the answer's
    first token comes from the prefill, each round then keeps the run of hits at its next positions, at most k and
    at most the tokens the answer has left, and adds the target's own token. hits[j] is the drafter's guess for
    the answer's token j + 1 given tokens 0..j."""
    rounds, i, n = [], 0, len(hits)
    while i < n:
        kept = 0
        while kept < min(k, n - i) and hits[i + kept]:
            kept += 1
        rounds.append(kept)
        i += kept + 1
    return rounds


def tau(answers_hits: list[list[bool]], k: int) -> float | None:
    """τ over several answers: 1 + the mean guesses kept per round, every answer's rounds pooled."""
    kept = [r for hits in answers_hits for r in replay_rounds(hits, k)]
    return 1 + sum(kept) / len(kept) if kept else None


def summarize(pos: Positions, k: int) -> dict:
    """The figures of one drafter on one category."""
    flat = [(p, r) for ps, rs in zip(pos.target_p, pos.rank) for p, r in zip(ps, rs)]
    n = len(flat)
    if not n:
        return {"positions": 0}
    out = {"positions": n, "answers": len(pos.rank),
           "top1": sum(r == 0 for _, r in flat) / n, "top2": sum(r <= 1 for _, r in flat) / n}
    misses = [p for p, r in flat if r]
    for name, lo, hi in BUCKETS:
        inside = [r for p, r in flat if lo <= p < hi]
        out[name] = {"share": len(inside) / n, "top1": sum(r == 0 for r in inside) / len(inside) if inside else None,
                     "share_of_misses": sum(lo <= p < hi for p in misses) / len(misses) if misses else None}
    hits = [[r == 0 for r in rs] for rs in pos.rank]
    out["tau"] = tau(hits, k)
    for name, lo, hi in BUCKETS:  # τ with this bucket's misses turned into hits
        fixed = [[r == 0 or lo <= p < hi for p, r in zip(ps, rs)] for ps, rs in zip(pos.target_p, pos.rank)]
        out[f"tau_{name}_fixed"] = tau(fixed, k)
    out["tau_top2"] = tau([[r <= 1 for r in rs] for rs in pos.rank], k)
    curve = []
    for b in range(BINS):
        lo, hi = b / BINS, (b + 1) / BINS + (1e-4 if b == BINS - 1 else 0)
        inside = [r for p, r in flat if lo <= p < hi]
        curve.append({"from": b / BINS, "positions": len(inside),
                      "top1": sum(r == 0 for r in inside) / len(inside) if inside else None})
    out["curve"] = curve
    return out


@torch.no_grad()
def teacher_forced(model, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """The model's logits (len(answer) - 1, V) for answer tokens 1.. given the prompt and the answer before them."""
    ids = torch.tensor([prompt + answer[:-1]], device=next(model.parameters()).device)
    return model(input_ids=ids).logits[0, len(prompt):].float()


def own_probability(target_logits: torch.Tensor, answer: list[int]) -> list[float]:
    """The target's probability of each of its answer's tokens 1.."""
    own = torch.tensor(answer[1:], device=target_logits.device)
    return target_logits.softmax(-1).gather(1, own[:, None])[:, 0].tolist()


def own_rank(draft_logits: torch.Tensor, answer: list[int]) -> list[int]:
    """The rank of each answer token 1.. in the drafter's logits (0: its top-1)."""
    own = torch.tensor(answer[1:], device=draft_logits.device)
    return (draft_logits > draft_logits.gather(1, own[:, None])).sum(-1).tolist()


def prompt_digest(prompt: list[int]) -> str:
    return hashlib.sha256(json.dumps(prompt).encode()).hexdigest()[:16]


def reference_answers(target, tok, prompts: dict[str, list[torch.Tensor]], max_new_tokens: int, cache: Path,
                      key: str) -> dict[str, list[list[int]]]:
    """The target's greedy answer to every prompt, from `cache` where it holds one for this prompt and these settings
    (`key`: target, dtype, token budget), so a later run on some of the prompts, or with other drafters, reuses them.
    One line per answer, written as each is done: an interrupted run resumes where it stopped."""
    done: dict[tuple[str, str], list[int]] = {}
    if cache.exists():
        for line in cache.read_text().splitlines():
            row = json.loads(line)
            done[row["key"], row["prompt"]] = row["answer"]
    todo = [(c, i, prompt_digest(p.tolist())) for c, items in prompts.items() for i, p in enumerate(items)]
    todo = [(c, i, d) for c, i, d in todo if (key, d) not in done]
    with cache.open("a") as out:
        for category, i, digest in tqdm(todo, desc="the target's greedy answers", unit="answer"):
            answer = autoregressive_generate(target, prompts[category][i], sampling=Sampling(0.0),
                                             max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id).tokens
            done[key, digest] = answer
            out.write(json.dumps({"key": key, "prompt": digest, "category": category, "answer": answer}) + "\n")
            out.flush()
    return {c: [done[key, prompt_digest(p.tolist())] for p in items] for c, items in prompts.items()}


def answer_counts(pos: Positions, k: int) -> tuple[list[int], list[int]]:
    """Each answer's replayed rounds and the guesses they kept."""
    rounds = [replay_rounds([r == 0 for r in rs], k) for rs in pos.rank]
    return [len(r) for r in rounds], [sum(r) for r in rounds]


def versus(drafter: dict[str, Positions], baseline: dict[str, Positions], k: int) -> dict[str, dict]:
    """A drafter's τ over the baseline's per category and over all of them, on the same answers, with the paired
    95 % interval of eval/compare.py (prompts resampled within each category)."""
    rows = []  # (category, the drafter's rounds and kept guesses, the baseline's) of each answer with a round
    for category in drafter:
        a, b = answer_counts(drafter[category], k), answer_counts(baseline[category], k)
        rows += [(category, *counts) for counts in zip(*a, *b) if counts[0] and counts[2]]

    def over(chosen: list[tuple]) -> dict:
        strata, rounds_a, kept_a, rounds_b, kept_b = (list(column) for column in zip(*chosen))
        c = compare(tau_counts(np.array([rounds_a]), np.array([kept_a])),
                    tau_counts(np.array([rounds_b]), np.array([kept_b])), strata)
        return {"ratio": c.ratio, "interval": c.interval}

    out = {category: over([r for r in rows if r[0] == category]) for category in drafter}
    if len(drafter) > 1:
        out["all"] = over(rows)
    return out


def markdown(report: dict) -> str:
    k = report["k"]
    lines = [f"| drafter | category | positions | top-1 agreement | positions unsure / leaning / sure | top-1 there | "
             f"misses there | τ at k = {k} | τ over {report['baseline']}'s (95 %) | τ, misses as hits where unsure / "
             "leaning / sure | τ, top-2 as hits |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda x, d=2: "–" if x is None else f"{x:.{d}f}"  # noqa: E731
    pct = lambda x: "–" if x is None else f"{100 * x:.0f} %"  # noqa: E731
    for drafter, categories in report["drafters"].items():
        for category, s in categories.items():
            if not s["positions"]:
                continue
            shares = " / ".join(pct(s[b]["share"]) for b, _, _ in BUCKETS)
            agree = " / ".join(f(s[b]["top1"]) for b, _, _ in BUCKETS)
            misses = " / ".join(pct(s[b]["share_of_misses"]) for b, _, _ in BUCKETS)
            fixed = " / ".join(f(s[f"tau_{b}_fixed"]) for b, _, _ in BUCKETS)
            vs = report["versus"].get(drafter, {}).get(category)
            over = "–" if vs is None else f"{vs['ratio']:.2f}" + (
                f" ({vs['interval'][0]:.2f}–{vs['interval'][1]:.2f})" if vs["interval"] else "")
            lines.append(f"| {drafter} | {category} | {s['positions']} | {f(s['top1'])} | {shares} | {agree} | "
                         f"{misses} | {f(s['tau'])} | {over} | {fixed} | {f(s['tau_top2'])} |")
    for drafter, categories in report["versus"].items():
        if "all" in categories:
            vs = categories["all"]
            interval = f" ({vs['interval'][0]:.2f}–{vs['interval'][1]:.2f})" if vs["interval"] else ""
            lines.append(f"\n{drafter}'s τ over {report['baseline']}'s, every category: {vs['ratio']:.2f}{interval}")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> Path | None:
    """Agreement against the target's confidence: a panel per drafter, a line per category, the diagonal beside."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    drafters = report["drafters"]
    fig, axes = plt.subplots(1, len(drafters), figsize=(4.2 * len(drafters) + 1, 4.2), sharey=True, squeeze=False)
    for ax, (drafter, categories) in zip(axes[0], drafters.items()):
        for category, s in categories.items():
            points = [(b["from"] + 0.05, b["top1"]) for b in s.get("curve", []) if b["positions"] >= 20]
            if points:
                ax.plot(*zip(*points), marker="o", label=category)
        ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1)
        ax.set_title(drafter)
        ax.set_xlabel("the target's probability of its own token")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("the drafter's top-1 agreement")
    fig.suptitle("bins of 0.1 holding 20 positions or more; dotted: agreement equal to the target's probability",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="toyworld://toy/target")
    ap.add_argument("--data", default="toyworld://toy/company_logs/eval.jsonl")
    ap.add_argument("--drafter", action="append", required=True,
                    help="name=path of a draft LM (a hub id, a directory, a GGUF file or pypi://); repeatable: the "
                         "first is the baseline the others' τ is compared with")
    ap.add_argument("--category", action="append", help="only these categories (repeatable); all by default")
    ap.add_argument("--per-category", type=int, default=24, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=8, help="guesses per round for the replay's τ")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    specs = []
    for spec in args.drafter:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--drafter {spec!r}: expected name=path")
        specs.append((name, path))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu")
    target, tok = load_target(args.target, device=device, dtype=args.dtype)
    prompts = load_prompts(args.data, tok, device=device, max_per_category=args.per_category)
    if args.category:
        missing = sorted(set(args.category) - set(prompts))
        if missing:
            raise SystemExit(f"{args.data}: no prompts of categories {missing}; it has {sorted(prompts)}")
        prompts = {c: prompts[c] for c in args.category}
    key = f"{args.target}|{args.dtype}|{args.max_new_tokens}"
    answers = reference_answers(target, tok, prompts, args.max_new_tokens, out / "answers.jsonl", key)
    # The target's probability of its own tokens, once (not its logits: 0.6 MB a token at a 151,936-token vocabulary).
    target_p = {c: [own_probability(teacher_forced(target, prompts[c][i].tolist(), a), a) if len(a) > 1 else []
                    for i, a in enumerate(items)] for c, items in answers.items()}
    report = {"target": args.target, "data": args.data, "dtype": args.dtype, "k": args.k,
              "max_new_tokens": args.max_new_tokens, "buckets": {n: [lo, min(hi, 1.0)] for n, lo, hi in BUCKETS},
              "baseline": specs[0][0], "drafters": {}, "versus": {}}
    positions: dict[str, dict[str, Positions]] = {}
    for name, path in specs:
        drafter = build_drafter({"name": name, "kind": "draft_lm", "path": path}, target=target, tokenizer=tok)
        if getattr(drafter, "parallel", False):
            raise SystemExit(f"--drafter {name}: {path} drafts its guesses in parallel (PARD), not one after another; "
                             "this replay reads a draft LM's next-token guesses")
        model = drafter.model.to(dtype_of(args.dtype))
        per_category, positions[name] = {}, {}
        for category, items in tqdm(answers.items(), desc=f"{name}: teacher-forced", unit="category"):
            pos = Positions(target_p=target_p[category])  # an entry per answer, empty for a one-token answer
            pos.rank = [own_rank(teacher_forced(model, prompts[category][i].tolist(), a), a) if len(a) > 1 else []
                        for i, a in enumerate(items)]
            per_category[category] = summarize(pos, args.k) | {"raw": asdict(pos)}
            positions[name][category] = pos
        report["drafters"][name] = per_category
        if name != specs[0][0]:
            report["versus"][name] = versus(positions[name], positions[specs[0][0]], args.k)
        del drafter, model
    (out / "agreement.json").write_text(json.dumps(report, indent=1))
    table = markdown(report)
    (out / "agreement.md").write_text(table)
    plot(report, out / "agreement.png")
    print(table)
    return report


if __name__ == "__main__":
    main()
