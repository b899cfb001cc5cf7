"""Benchmark every drafter kind on the toy world with one training budget (figures in docs/benchmarks/toy-drafters.md).

    python scripts/bench_heads.py                                   # toy world: draft LM, eagle, eagle1, mtp, medusa
    python scripts/bench_heads.py --steps 6 --overrides experiment=smoke   # smoke run on the tiny world

Each kind is trained by the real recipe (`train.__main__.train`) with the same steps, batch and data
(regenerated once and shared); the draft LMs start from the off-the-shelf draft (SFT on the target's
regenerated responses, and forward KL), the heads from scratch on the frozen target's hidden states. Then ONE evaluation run measures the
off-the-shelf draft (baseline) and every trained drafter on the same held-out prompts, so acceptance
lengths, cost ratios c and speed-ups sit side by side; each invocation writes its report to a new
`<out>/report-N`. Training tokens/s (median over steps) come from
each run's metrics; `--offline` also trains EAGLE-3 for `--offline-steps` from precomputed hidden-state
shards, for the online/offline throughput comparison (not evaluated: same model, same data).
The SFT draft LM is measured twice in that run: on the lean decode path (the default for Llama-family
drafts) and through the Hugging Face forward (`draft_lm_sft_hf_forward`), to show what the draft's
per-call overhead costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from eval.engines.engine import stop_on_sigterm
from eval.evaluate import EvalPlan, evaluate
from eval.report import build_report, next_report_dir, write_report
from eval.report_markdown import console_summary
from eval.run import build_drafter, held_out_path, load_target, read_traffic, target_source, tokenize_prompts
from train.__main__ import train
from train.config import drafter_keys

CONF = str(Path(__file__).resolve().parents[1] / "conf")
KINDS = {
    "draft_lm_sft": ["drafter=draft_lm", "drafter.loss=sft"],
    "draft_lm_fkl": ["drafter=draft_lm", "drafter.loss=forward_kl"],
    "eagle": ["drafter=eagle"],  # default: a draft vocabulary of a quarter of the target's
    "eagle_full_vocab": ["drafter=eagle", "drafter.draft_vocab_share=null"],
    "eagle_argmax_labels": ["drafter=eagle", "drafter.label_temperature=0"],  # trained towards greedy choices
    # the draft vocabulary ranked by the target's probabilities instead of token counts (sampled serving)
    "eagle_probability_vocab": ["drafter=eagle", "drafter.draft_vocab_from=target_probabilities"],
    "eagle1": ["drafter=eagle1"],
    "mtp": ["drafter=mtp"],
    "medusa": ["drafter=medusa"],
}


def for_kind(overrides: list[str], kind: str) -> list[str]:
    """The overrides a run of `kind` takes: a `drafter.KEY=...` only where the kind has KEY (train/config.py), so
    one list can set, say, EAGLE-3's draft vocabulary beside a draft LM."""
    return [o for o in overrides if not o.startswith("drafter.") or o[8:].split("=")[0].split(".")[0] in drafter_keys(kind)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--offline", action="store_true", help="also train eagle from offline hidden-state shards")
    ap.add_argument("--offline-steps", type=int, default=60, help="steps of the offline run (throughput only)")
    ap.add_argument("--out", default="runs/bench_heads")
    ap.add_argument("--ks", default="4")
    ap.add_argument("--temperatures", default="0", help="sampling temperatures to measure (0 = greedy)")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per category")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--overrides", nargs="*", default=[], help="extra Hydra overrides for every run")
    args = ap.parse_args()
    out = Path(args.out)
    variants = {name: KINDS[name] for name in args.kinds.split(",")}
    if args.offline:
        variants["eagle_offline"] = ["drafter=eagle", "drafter.hidden_states=offline"]
    trained = {}
    for name, extra in variants.items():
        run_dir = out / name
        steps = args.offline_steps if name == "eagle_offline" else args.steps
        overrides = [*extra, f"trainer.max_steps={steps}", f"out_dir={run_dir}", "evaluate.enabled=false",
                     "progress=false", *for_kind(args.overrides, next(o for o in extra if o.startswith("drafter="))[8:])]
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            cfg = compose(config_name="train", overrides=overrides)
        if not (run_dir / "train_summary.json").exists():  # finished runs are not trained again
            train(cfg)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        best = json.loads((run_dir / "best" / "best.json").read_text())
        trained[name] = {"dir": run_dir / "best", "kind": "draft_lm" if name.startswith("draft_lm") else "head",
                         "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows), "best": best}
        print(f"{name}: best at step {best['step']}; training {trained[name]['tokens_per_s']:.0f} tokens/s")

    target, tok = load_target(target_source(cfg.target), device=torch.device("cpu"))
    traffic = read_traffic(held_out_path(cfg.data.path, cfg.data.eval_path) or cfg.data.path)
    prompts = tokenize_prompts(traffic, tok, device=target.device, max_per_category=args.prompts)
    drafters = [build_drafter({"name": "off_the_shelf", "kind": "draft_lm", "path": cfg.target.off_the_shelf_draft},
                              target=target, tokenizer=tok)]
    drafters += [build_drafter({"name": name, "kind": info["kind"], "path": str(info["dir"])}, target=target,
                               tokenizer=tok) for name, info in trained.items() if name != "eagle_offline"]
    if "draft_lm_sft" in trained:
        drafters.append(build_drafter({"name": "draft_lm_sft_hf_forward", "kind": "draft_lm", "lean": False,
                                       "path": str(trained["draft_lm_sft"]["dir"])}, target=target, tokenizer=tok))
    plan = EvalPlan(ks=[int(k) for k in args.ks.split(",")],
                    temperatures=[float(t) for t in args.temperatures.split(",")],
                    max_new_tokens=64, repeats=args.repeats)
    rows = evaluate(target, drafters, prompts, plan, eos_token_id=tok.eos_token_id)
    report = build_report(rows, target=target_source(cfg.target), baseline="off_the_shelf",
                          settings={"data": traffic.describe(prompts), "steps": args.steps, "drafters": list(trained), "ks": plan.ks,
                                    "temperatures": plan.temperatures,
                                    "training_tokens_per_s": {n: round(t["tokens_per_s"]) for n, t in trained.items()}})
    paths = write_report(report, next_report_dir(out))
    print(console_summary(report))
    print("training tokens/s (median over steps):",
          {n: round(t["tokens_per_s"]) for n, t in trained.items()})
    print(f"report: {paths['md']}")


if __name__ == "__main__":
    stop_on_sigterm()
    main()
