"""Benchmark the draft-LM objectives on the toy world with one training budget (figures in docs/benchmarks/distillation.md).

    python scripts/bench_train.py                                     # toy world, every objective
    python scripts/bench_train.py --steps 6 --variants sft,tvd --overrides target=tiny   # smoke run

Each variant is trained by the real recipe (`train.__main__.train`) from the off-the-shelf draft with
the same steps, batch and data (regenerated once and shared); then ONE evaluation run measures the
off-the-shelf draft (baseline) and every trained draft on the same held-out prompts, so the table's
acceptance lengths and speed-ups are side by side. Training tokens/s come from each run's metrics.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from drafters.draft_lm import DraftLM
from eval.engines.engine import stop_on_sigterm
from eval.evaluate import EvalPlan, evaluate
from eval.report import build_report, next_report_dir, write_report
from eval.report_markdown import console_summary
from eval.run import build_drafter, held_out_path, load_target, read_traffic, target_source, tokenize_prompts
from train.__main__ import train

CONF = str(Path(__file__).resolve().parents[1] / "conf")
VARIANTS = {
    "sft": ["drafter.loss=sft"],
    "forward_kl": ["drafter.loss=forward_kl"],
    "forward_kl+cached_top64": ["drafter.loss=forward_kl", "drafter.target_logits=cached", "drafter.cached_top_k=64"],
    "reverse_kl": ["drafter.loss=reverse_kl"],
    "jsd": ["drafter.loss=jsd", "drafter.beta=0.5"],
    "tvd": ["drafter.loss=tvd"],
    "forward_kl+on_policy": ["drafter.loss=forward_kl", "drafter.on_policy.ratio=0.5"],
    "tvd+on_policy": ["drafter.loss=tvd", "drafter.on_policy.ratio=0.5"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="runs/bench_train")
    ap.add_argument("--ks", default="4")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per category")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--overrides", nargs="*", default=[], help="extra Hydra overrides for every run")
    args = ap.parse_args()
    out = Path(args.out)
    trained = {}
    for name in args.variants.split(","):
        run_dir = out / name
        overrides = [*VARIANTS[name], f"trainer.max_steps={args.steps}", f"out_dir={run_dir}",
                     "evaluate.enabled=false", "progress=false", *args.overrides]
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            cfg = compose(config_name="train", overrides=overrides)
        if not (run_dir / "train_summary.json").exists():  # finished variants are not trained again
            train(cfg)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        trained[name] = {"dir": run_dir / "best", "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
                         "best": json.loads((run_dir / "best" / "best.json").read_text())}
        print(f"{name}: best held-out acceptance estimate {trained[name]['best']['acceptance']:.3f} at step "
              f"{trained[name]['best']['step']}; training {trained[name]['tokens_per_s']:.0f} tokens/s")

    target, tok = load_target(target_source(cfg.target), device=torch.device("cpu"))
    traffic = read_traffic(held_out_path(cfg.data.path, cfg.data.eval_path) or cfg.data.path)
    prompts = tokenize_prompts(traffic, tok, device=target.device, max_per_category=args.prompts)
    drafters = [build_drafter({"name": "off_the_shelf", "kind": "draft_lm", "path": cfg.drafter.init_from},
                              target=target, tokenizer=tok)]
    drafters += [DraftLM.from_pretrained(info["dir"], target=target, target_tokenizer=tok, name=name)
                 for name, info in trained.items()]
    plan = EvalPlan(ks=[int(k) for k in args.ks.split(",")], max_new_tokens=64, repeats=args.repeats)
    rows = evaluate(target, drafters, prompts, plan, eos_token_id=tok.eos_token_id)
    report = build_report(rows, target=target_source(cfg.target), baseline="off_the_shelf",
                          settings={"data": traffic.describe(prompts), "steps": args.steps, "variants": list(trained), "ks": plan.ks,
                                    "training_tokens_per_s": {n: t["tokens_per_s"] for n, t in trained.items()}})
    paths = write_report(report, next_report_dir(out))
    print(console_summary(report))
    print(f"report: {paths['md']}")


if __name__ == "__main__":
    stop_on_sigterm()
    main()
