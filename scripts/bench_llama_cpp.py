"""draftsmith's loop and llama.cpp side by side on the same exported drafters (docs/benchmark-log.md,
"Section 7"; superseded by `python -m eval engine=llamacpp`, docs/benchmarks/llama-cpp-toy.md).

    python scripts/bench_llama_cpp.py --eagle runs/train/eagle/<time> --draft runs/train/draft_lm/<time> \
        --prompts 16 --k 4 --new-tokens 64 --repeats 3 --out runs/bench/llama_cpp

For each trained run: export it (`python -m train.export`'s library call, GGUF through llama.cpp's own
converter), then on the held-out traffic of the run's data, per category and greedy:
- draftsmith's acceptance length τ (tokens per verification) in its own loop;
- llama.cpp's τ with the same drafter, k, prompts and budget: 1 + accepted drafts per verification, from
  llama-server's own drafting counters (eval.engines.llama_cpp_measure.DraftStats). Both loops take the first new token
  from the prompt's forward and draft after it;
- llama.cpp's speed-up over its own plain decoding: generated tokens / generation time as llama-server
  reports them, pooled over the category's prompts, plain and speculative servers run in turn in each
  repeat; the median over repeats of the ratio.
Whether greedy output with each drafter equals plain output in llama.cpp is counted too.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from drafters.sampling import Sampling
from eval.engines import llama_cpp
from eval.engines.engine import stop_on_sigterm
from eval.engines.llama_cpp_measure import DraftCounters, DraftStats
from eval.engines.formats.writing import target_directory
from eval.run import build_drafter, held_out_path, load_target, read_traffic, tokenize_prompts
from eval.speculative import speculative_generate
from train.export import ExportSettings, export, read_run

SPEC_TYPES = {"draft_lm": "draft-simple", "eagle": "draft-eagle3"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eagle", help="a `python -m train drafter=eagle` run directory")
    ap.add_argument("--draft", help="a `python -m train drafter=draft_lm` run directory")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts per category")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="llama-server threads (and torch's)")
    ap.add_argument("--out", default="runs/bench/llama_cpp")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    runs = {name: read_run(path) for name, path in (("eagle", args.eagle), ("draft_lm", args.draft)) if path}
    if not runs:
        ap.error("give --eagle and/or --draft")
    first = next(iter(runs.values()))
    target, tok = load_target(first.target, device=torch.device("cpu"))
    data = first.config["data"]
    traffic = read_traffic(held_out_path(data["path"], data.get("eval_path")) or data["path"])
    prompts = {c: [p.tolist() for p in ps] for c, ps in
               tokenize_prompts(traffic, tok, device=torch.device("cpu"), max_per_category=args.prompts).items()}
    target_gguf = llama_cpp.convert_to_gguf(target_directory(first.target), out / "target.gguf")

    drafters, ggufs = {}, {}
    for name, run in runs.items():
        ggufs[name] = export(run.path, out / name, ExportSettings(formats=["gguf"]))["gguf"]
        drafters[name] = build_drafter({"name": name, "kind": "head" if name == "eagle" else "draft_lm",
                                        "path": str(run.best)}, target=target, tokenizer=tok)

    result = {"settings": {**vars(args), "data": traffic.describe(prompts), "target": first.target}, "rows": []}
    ours = {}  # (drafter, category) -> (kept guesses, rounds) in draftsmith's loop
    for name, drafter in drafters.items():
        for category, ps in prompts.items():
            accepted = rounds = 0
            for p in ps:
                g = speculative_generate(target, drafter, torch.tensor(p), k=args.k, sampling=Sampling(),
                                         max_new_tokens=args.new_tokens, eos_token_id=tok.eos_token_id)
                accepted, rounds = accepted + sum(r.accepted for r in g.rounds), rounds + len(g.rounds)
            ours[name, category] = (accepted, rounds)
        ours[name, "all"] = tuple(sum(ours[name, c][i] for c in prompts) for i in (0, 1))

    counters = {}  # (drafter, category) -> llama-server's drafting counters, first repeat

    def serve(name):
        spec = {} if name == "plain" else {"draft": ggufs[name], "spec_type": SPEC_TYPES[name], "k": args.k}
        with llama_cpp.LlamaServer(target_gguf, threads=args.threads, ctx_size=4096, log_verbosity=4, **spec) as server:
            out, done, before, drafting = {}, 0, DraftStats(), DraftCounters(server)
            for c, ps in prompts.items():
                out[c] = [server.complete(p, args.new_tokens) for p in ps]
                done += len(ps)
                if name != "plain":
                    now = drafting.after(done)
                    counters.setdefault((name, c), now - before)
                    before = now
            return out

    repeats = [{name: serve(name) for name in ["plain", *ggufs]} for _ in range(args.repeats)]
    speed = lambda cs: sum(len(c.tokens) for c in cs) / sum(c.predicted_ms for c in cs) * 1000  # noqa: E731
    for r in repeats:  # every category pooled, as draftsmith's report pools them into "all"
        for name in r:
            r[name]["all"] = [c for category in prompts for c in r[name][category]]
    for name in ggufs:
        for category in [*prompts, "all"]:
            first_run = repeats[0][name][category]
            stats = (sum((counters[name, c] for c in prompts), DraftStats()) if category == "all"
                     else counters[name, category])
            theirs = 1 + stats.accepted / stats.verifications
            ratios = [speed(r[name][category]) / speed(r["plain"][category]) for r in repeats]
            equal = sum(a.tokens == b.tokens for a, b in zip(first_run, repeats[0]["plain"][category]))
            result["rows"].append({
                "drafter": name, "category": category, "prompts": len(first_run),
                "mean_new_tokens": round(sum(len(c.tokens) for c in first_run) / len(first_run), 1),
                "tau_draftsmith": round(1 + ours[name, category][0] / ours[name, category][1], 3),
                "tau_llama_cpp": round(theirs, 3),
                "tau_ratio": round(theirs / (1 + ours[name, category][0] / ours[name, category][1]), 3),
                "accepted_share": round(sum(c.draft_n_accepted for c in first_run)
                                        / max(sum(c.draft_n for c in first_run), 1), 3),
                "llama_cpp_speedup_median": round(statistics.median(ratios), 3),
                "llama_cpp_speedups": [round(x, 3) for x in ratios],
                "equal_to_plain": f"{equal}/{len(first_run)}",
            })
    (out / "bench_llama_cpp.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print("| drafter | category | prompts | new tokens | τ draftsmith | τ llama.cpp | ratio | accepted | llama.cpp "
          "speed-up (median; each repeat) | output = plain |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['drafter']} | {r['category']} | {r['prompts']} | {r['mean_new_tokens']} | {r['tau_draftsmith']:.2f} | "
              f"{r['tau_llama_cpp']:.2f} | {r['tau_ratio']:.3f} | {r['accepted_share']:.2f} | "
              f"{r['llama_cpp_speedup_median']:.2f}× ({', '.join(f'{x:.2f}' for x in r['llama_cpp_speedups'])}) | "
              f"{r['equal_to_plain']} |")
    print(f"\n{out / 'bench_llama_cpp.json'}")


if __name__ == "__main__":
    stop_on_sigterm()
    main()
