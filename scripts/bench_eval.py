"""Benchmark the speculative loop against Hugging Face assisted generation (`make bench`).

    python scripts/bench_eval.py                       # toy world, k=4, greedy
    python scripts/bench_eval.py --target toyworld://tiny/target --prompts 2 --repeats 1   # smoke run

Two drafters built from the target, as the evaluation issue asks until trained pairs exist:
`self` (the target drafting for itself: every guess is right, so it measures pure loop overhead) and
`first_layers` (a draft made of the target's embedding, first N decoder layers, final norm and head).

For each drafter, on the same prompts, k and budget, interleaved per prompt and repeated:
1. plain greedy decoding with our cached loop (the speed-up baseline);
2. our speculative loop;
3. transformers' `generate(assistant_model=..., num_assistant_tokens=k)` with the assistant's
   schedule made constant and its confidence early-exit off, so both draft exactly k per round.
It checks that all three produce identical tokens, and reports medians of per-repeat throughputs, the
ratios measured side by side, the cost-model prediction from `eval.evaluate`, and the peak
resident memory of a fresh process running each loop. Both loops run the draft through the Hugging
Face forward (`DraftLM(lean=False)`), so the comparison is of the loops alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import multiprocessing
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from drafters.draft_lm import DraftLM
from drafters.sampling import Sampling
from eval.evaluate import ALL, EvalPlan, evaluate
from eval.report import hardware
from eval.run import load_prompts, load_target
from eval.speculative import autoregressive_generate, speculative_generate


def first_layers_draft(target, n_layers: int):
    """A draft LM made of the target's first n decoder layers (plus its embedding, final norm and head)."""
    config = target.config.to_dict()
    config["num_hidden_layers"] = n_layers
    for key in ("layer_types",):  # per-layer lists must shrink with the layer count
        if config.get(key):
            config[key] = config[key][:n_layers]
    draft = AutoModelForCausalLM.from_config(type(target.config).from_dict(config))
    missing, unexpected = draft.load_state_dict(
        {k: v for k, v in target.state_dict().items()
         if not k.startswith("model.layers.") or int(k.split(".")[2]) < n_layers}, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"first-layers draft: missing {missing}, unexpected {unexpected}")
    return draft.eval()


def _peak_rss_mb(method: str, target_path: str, draft: str, layers: int, prompts: list[list[int]], k: int,
                 n: int, eos: int) -> float:
    """Peak resident memory (MB) of a fresh process that loads the pair and runs one method on all prompts.

    Run in its own process so each method's peak is its own (ru_maxrss never goes down).
    """
    import resource

    target, _ = load_target(target_path, device=torch.device("cpu"))
    model = target if draft == "self" else first_layers_draft(target, layers)
    for p in prompts:
        ids = torch.tensor(p)
        if method == "ours":
            speculative_generate(target, DraftLM(model, lean=False), ids, k=k, sampling=Sampling(), max_new_tokens=n,
                                 eos_token_id=eos)
        else:
            hf_assisted(target, model, ids, k, n, eos)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def hf_assisted(target, draft, prompt, k, max_new_tokens, eos):
    """transformers' assisted generation with exactly k drafts per round (no schedule, no early exit)."""
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    out = target.generate(prompt[None], assistant_model=draft, do_sample=False, max_new_tokens=max_new_tokens,
                          eos_token_id=eos, pad_token_id=eos, num_assistant_tokens=k)
    return out[0, prompt.numel():].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="toyworld://toy/target")
    ap.add_argument("--data", default=None, help="company logs (default: the toy world's held-out traffic)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2, help="decoder layers in the first-layers draft")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    device = torch.device("cpu")
    target, tokenizer = load_target(args.target, device=device)
    preset = args.target[len("toyworld://"):].split("/")[0] if args.target.startswith("toyworld://") else None
    data = args.data or f"toyworld://{preset}/company_logs/eval.jsonl"
    prompts = load_prompts(data, tokenizer, device=device, max_per_category=args.prompts)
    flat = [p for ps in prompts.values() for p in ps]
    eos, k, n = tokenizer.eos_token_id, args.k, args.max_new_tokens
    greedy = Sampling()
    drafts = {"self": target, "first_layers": first_layers_draft(target, args.layers)}
    results = {"hardware": hardware(), "args": vars(args), "drafters": {}}

    for name, draft in drafts.items():
        # The draft runs through the Hugging Face forward, as in assisted generation: this compares the
        # loops, not the draft's decode path (the lean path is measured in bench_draft_step / bench_heads).
        ours = DraftLM(draft, name=name, lean=False)
        # Warm-up, untimed.
        hf_assisted(target, draft, flat[0], k, n, eos)
        speculative_generate(target, ours, flat[0], k=k, sampling=greedy, max_new_tokens=n, eos_token_id=eos)
        times = {"plain": [], "ours": [], "hf": []}
        tokens = {"plain": [], "ours": [], "hf": []}
        identical = True
        for _ in range(args.repeats):
            rep = {key: [0.0, 0] for key in times}
            for prompt in flat:
                t0 = time.perf_counter()
                plain = autoregressive_generate(target, prompt, sampling=greedy, max_new_tokens=n, eos_token_id=eos)
                t1 = time.perf_counter()
                spec = speculative_generate(target, ours, prompt, k=k, sampling=greedy, max_new_tokens=n,
                                            eos_token_id=eos)
                t2 = time.perf_counter()
                hf = hf_assisted(target, draft, prompt, k, n, eos)
                t3 = time.perf_counter()
                identical &= plain.tokens == spec.tokens == hf
                for key, dt, toks in (("plain", t1 - t0, plain.tokens), ("ours", t2 - t1, spec.tokens),
                                      ("hf", t3 - t2, hf)):
                    rep[key][0] += dt
                    rep[key][1] += len(toks)
            for key, (secs, count) in rep.items():
                times[key].append(secs)
                tokens[key].append(count)
        tps = {key: [c / s for c, s in zip(tokens[key], times[key])] for key in times}
        spawn = multiprocessing.get_context("spawn")
        with spawn.Pool(1, maxtasksperchild=1) as pool:  # a fresh process per measurement
            mem = {m: pool.apply(_peak_rss_mb, (m, args.target, name, args.layers, [p.tolist() for p in flat], k, n,
                                                eos)) for m in ("ours", "hf")}
        rows = evaluate(target, [ours], prompts, EvalPlan(ks=[k], max_new_tokens=n, repeats=args.repeats),
                        eos_token_id=eos, progress=False)
        agg = next(r for r in rows if r["category"] == ALL)
        results["drafters"][name] = {
            "identical_outputs": identical,
            "tokens_per_s": {key: statistics.median(v) for key, v in tps.items()},
            "ours_vs_hf": statistics.median(o / h for o, h in zip(tps["ours"], tps["hf"])),
            "ours_vs_plain": statistics.median(o / p for o, p in zip(tps["ours"], tps["plain"])),
            "hf_vs_plain": statistics.median(h / p for h, p in zip(tps["hf"], tps["plain"])),
            "eval_speedup": agg["speedup"],
            "eval_predicted_speedup": agg["predicted_speedup"],
            "measured_over_predicted": agg["speedup"] / agg["predicted_speedup"],
            "acceptance_length": agg["acceptance_length"],
            "cost_ratio": agg["cost_ratio"],
            "verify_overhead": agg["verify_overhead"],
            "peak_rss_mb": mem,
        }
        r = results["drafters"][name]
        print(f"{name:>13}: identical={identical}  tok/s plain {r['tokens_per_s']['plain']:.0f}, "
              f"ours {r['tokens_per_s']['ours']:.0f}, HF assisted {r['tokens_per_s']['hf']:.0f}  |  "
              f"ours/HF {r['ours_vs_hf']:.2f}x  ours/plain {r['ours_vs_plain']:.2f}x  |  "
              f"eval speed-up {agg['speedup']:.2f}x vs predicted {agg['predicted_speedup']:.2f}x "
              f"({r['measured_over_predicted']:.0%}); tau {agg['acceptance_length']:.2f}, c {agg['cost_ratio']:.3f}, "
              f"beta {agg['verify_overhead']:.2f}  |  peak RSS ours {r['peak_rss_mb']['ours']:.1f} MB, "
              f"HF {r['peak_rss_mb']['hf']:.1f} MB")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
