"""The evaluation a training run ends with: the drafters of `specs` (the baseline, `evaluate.drafters`, the
trained one) measured on the held-out traffic as `python -m eval` measures them, in draftsmith's loop and, with
`evaluate.engine`, in the engine; the report written beside the run."""

from __future__ import annotations

import logging

import torch

from eval.engines import engine
from eval.evaluate import EvalPlan, evaluate
from eval.report import build_report, write_report
from eval.report_markdown import console_summary
from eval.run import (Traffic, build_drafter, held_out_path, prompt_budget, read_traffic, reading, resolve_specs,
                      target_source, tokenize_prompts)

log = logging.getLogger(__name__)


def final_eval_traffic(cfg, held_records: list, summary):
    """The traffic the final evaluation measures: the held-out file, or the records training held out
    (`held_records`, read as training read them: split, bad-record policy)."""
    eval_path = held_out_path(cfg.data.path, cfg.data.eval_path)
    if eval_path is not None:
        return read_traffic(eval_path, **reading(cfg.data))
    # One file: measure the records training held out, never the trained-on ones.
    log.warning("data.eval_path is not set: the final evaluation reads the %d records of %s held out of "
                "training (trainer.heldout=%s), which also chose the best checkpoint; set data.eval_path to "
                "separate traffic for an unbiased measurement", len(held_records), cfg.data.path,
                cfg.trainer.heldout)
    return Traffic(cfg.data.path, held_records, summary, len(held_records), held_out_by=cfg.trainer.heldout)


def final_eval(cfg, target, tokenizer, device, traffic, specs: list[dict], *, trained_on: dict, out) -> str:
    """Measure `specs` on `traffic` with the `evaluate` settings of `cfg`; write the report into `out` and print
    its summary; return the report.json path."""
    e = cfg.evaluate
    limit, why = prompt_budget(target.config, e.max_new_tokens, cfg.data.max_prompt_tokens)
    prompts = tokenize_prompts(traffic, tokenizer, device=device, max_per_category=e.prompts_per_category,
                               max_prompt_tokens=limit, why=why, on_bad_record=cfg.data.on_bad_record)
    source = target_source(cfg.target)
    in_engine = engine.engine_for(e.engine, engine.EngineCosts(), runs=("llamacpp",))
    specs = resolve_specs(specs, source, own_drafters=in_engine.serves_own_drafters)
    drafters = [build_drafter(spec, target=target, tokenizer=tokenizer) for spec in specs if spec["kind"] != "llamacpp"]
    plan = EvalPlan(ks=list(e.ks), trees=list(e.trees), batch_sizes=list(e.batch_sizes),
                    max_new_tokens=e.max_new_tokens, repeats=e.repeats, seed=cfg.trainer.seed)
    # The drafters in the engine's formats first, as `python -m eval` does: a conversion that fails stops the
    # run before the measurement, not after it.
    in_engine.convert(specs, target, source, out / "engine")
    rows = evaluate(target, drafters, prompts, plan, eos_token_id=tokenizer.eos_token_id, progress=cfg.progress)
    figures = in_engine.add_figures(rows, specs, target, source, prompts, plan, threads=torch.get_num_threads(),
                                    work=out / "engine", progress=cfg.progress)
    engine_rows = figures.pop("engine_only", []) if figures else []
    report = build_report(rows, target=source, baseline=drafters[0].name, engine_rows=engine_rows,
                          settings={"data": traffic.describe(prompts), "trained_on": trained_on,
                                    "ks": list(e.ks), "trees": list(e.trees), "batch_sizes": list(e.batch_sizes),
                                    "max_new_tokens": e.max_new_tokens, "repeats": e.repeats,
                                    "pays_off_at": plan.pays_off_at, "engine": figures})
    paths = write_report(report, out)
    print(console_summary(report))
    print(f"\nreport: {paths['md']}")
    return str(paths["json"])
