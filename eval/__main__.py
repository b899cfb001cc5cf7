"""`python -m eval`: measure drafters against plain decoding on company traffic (see conf/eval.yaml).

A thin Hydra wrapper: `run(cfg)` turns the composed config into library calls and is what tests call.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import asdict, fields
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from eval.engines import engine as engines
from eval.config import checked_spec, register
from eval.evaluate import EvalPlan, evaluate
from eval.report import build_report, log_to_wandb, write_report
from eval.report_markdown import console_summary
from eval.run import (build_drafter, held_out_path, load_target, pick_device, prompt_budget, read_traffic, reading,
                      resolve_specs, target_source, tokenize_prompts)

log = logging.getLogger("eval")
register()


def run(cfg: DictConfig) -> dict:
    """Run the evaluation the config describes, write the report into cfg.out_dir, return it."""
    if not cfg.drafters:
        raise ValueError("no drafters configured: set `drafters` (the first one is the baseline)")
    entries = [checked_spec(OmegaConf.to_container(spec, resolve=True)) for spec in cfg.drafters]  # before any work
    plan = EvalPlan(**{f.name: OmegaConf.to_object(cfg[f.name]) if OmegaConf.is_config(cfg[f.name])
                       else cfg[f.name] for f in fields(EvalPlan)})
    costs = OmegaConf.to_object(cfg.engine_costs)
    engine = engines.engine_for(cfg.engine.name if cfg.engine else None, costs, config=cfg.engine)
    alone = bool(cfg.engine and cfg.engine.only)
    engine.check(plan, alone)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # The traffic is read first: a bad record fails before a model is loaded.
    traffic = read_traffic(held_out_path(cfg.data.path, cfg.data.eval_path) or cfg.data.path, **reading(cfg.data))
    device = pick_device(cfg.device)
    source = target_source(cfg.target)
    target, tokenizer = load_target(source, device=device, dtype=cfg.target.dtype,
                                    trust_remote_code=cfg.target.trust_remote_code, chat_template=cfg.target.chat_template)
    specs = resolve_specs(entries, source, own_drafters=engine.serves_own_drafters, loop=not alone)
    # A deployment is checked (reachable, serving the model) before anything is measured.
    engine.connect(list(plan.ks), [s["name"] for s in specs])
    # llama.cpp's own drafters run in the engine only; every other drafter in draftsmith's loop too, unless the
    # engine measures alone.
    drafters = [] if alone else [
        build_drafter(spec, target=target, tokenizer=tokenizer, trust_remote_code=cfg.target.trust_remote_code)
        for spec in specs if spec["kind"] != "llamacpp"]
    limit, why = prompt_budget(target.config, plan.max_new_tokens, cfg.data.max_prompt_tokens)
    prompts = tokenize_prompts(traffic, tokenizer, device=device, max_per_category=cfg.data.max_prompts_per_category,
                               max_prompt_tokens=limit, why=why, on_bad_record=cfg.data.on_bad_record)
    work = Path(cfg.out_dir) / "engine"
    longest = max((len(p) for ps in prompts.values() for p in ps), default=0)
    threads = cfg.threads or os.cpu_count()
    engine.convert(specs, target, source, work, alone=alone, request=(longest, plan.max_new_tokens), threads=threads)
    rows = [] if alone else evaluate(target, drafters, prompts, plan, eos_token_id=tokenizer.eos_token_id,
                                     progress=cfg.progress)
    in_engine = engine.add_figures(rows, specs, target, source, prompts, plan, threads=threads,
                                   work=work, progress=cfg.progress, alone=alone)
    engine_rows = in_engine.pop("engine_only", []) if in_engine else []
    settings = {"data": traffic.describe(prompts), **asdict(plan), "dtype": cfg.target.dtype, "device": str(device),
                "engine": in_engine}
    report = build_report(rows, target=source, baseline=specs[0]["name"], settings=settings, engine_rows=engine_rows)
    paths = write_report(report, cfg.out_dir)
    print(console_summary(report))
    print(f"\nreport: {paths['md']}  ({paths['json'].name} and {len(paths) - 2} PNG plots beside it)")
    if cfg.tracking.wandb:
        log_to_wandb(report, paths, project=cfg.tracking.project, entity=cfg.tracking.entity,
                     config=OmegaConf.to_container(cfg, resolve=True), run_dir=cfg.out_dir)
    return report


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except (ValueError, FileNotFoundError) as e:  # bad input the user can fix: say what, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    engines.stop_on_sigterm()
    main()
