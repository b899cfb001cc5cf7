"""`python -m train drafter=pard` (train/pard.py): PARD's rows train the draft, every depth's held-out figure is kept,
the saved draft names its mask token, `python -m eval` drafts with it in parallel, and bad settings are clear
errors. (Its export and vLLM: tests/train/test_export.py; its drafting: tests/drafters/test_pard.py.)"""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from train.__main__ import train

CONF = Path(__file__).resolve().parents[2] / "conf"


def make_cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=["experiment=smoke", "target=tiny_deep", "progress=false",
                                                       f"out_dir={tmp_path / 'run'}", f"data_cache={tmp_path / 'data'}",
                                                       "drafter=pard", *overrides])


def test_pard_trains_scores_every_depth_and_is_measured_drafting_in_parallel(tiny_world, tmp_path):
    summary = train(make_cfg(tmp_path, "trainer.max_steps=30", "trainer.eval_every=10", "trainer.lr=3e-3",
                             "drafter.num_depths=3", "evaluate.ks=[3]", "evaluate.prompts_per_category=2",
                             "evaluate.repeats=1", "evaluate.max_new_tokens=16"))
    run = tmp_path / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert sum(losses[-5:]) < sum(losses[:5])  # PARD's rows train the draft
    scored = [m for m in metrics if "heldout_tokens_per_round" in m]
    assert scored and len(scored[-1]["heldout_step_acceptance"]) == 3 and scored[-1]["heldout_tau_greedy"] >= 1
    best = json.loads((run / "best" / "best.json").read_text())
    assert len(best["acceptance_per_depth"]) == 3 and best["tokens_per_round"] > 1
    config = json.loads((run / "best" / "config.json").read_text())
    assert config["pard_depths"] == 3 and 0 <= config["pard_token"] < config["vocab_size"]
    report = json.loads((run / "report.json").read_text())
    trained = [r for r in report["results"] if r["drafter"] == "trained_pard"]
    assert trained and all(r["k"] == 3 for r in trained)
    assert summary is not None


@pytest.mark.parametrize("objective", [["drafter.loss=sft"], ["drafter.target_logits=cached"],
                                       ["drafter.lora.enabled=true", "drafter.init_from=null", "drafter.init_layers=2"]])
def test_pard_trains_with_every_objective_and_start(tiny_world, tmp_path, objective):
    """The draft LM recipe's choices carry over: the target's tokens (SFT), its cached top-k logits, LoRA on the
    target's own first layers (merged on save); the saved draft names its mask token either way."""
    train(make_cfg(tmp_path, "trainer.max_steps=4", "trainer.eval_every=4", "evaluate.enabled=false", *objective))
    config = json.loads((tmp_path / "run" / "best" / "config.json").read_text())
    assert config["pard_token"] is not None and config["pard_depths"] == 8


@pytest.mark.parametrize("override, message", [
    ("drafter.num_depths=0", "drafter.num_depths must be >= 1"),
    ("drafter.cod_ratio=0", "drafter.cod_ratio must be in"),
    ("drafter.on_policy.ratio=0.5", "on_policy does not apply to PARD"),
    ("drafter.mask_token_id=100000", "is not a row of the draft's embedding"),
])
def test_bad_pard_settings_are_clear_errors(tiny_world, tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        train(make_cfg(tmp_path, "trainer.max_steps=1", override))
