"""conf/experiment/llama3_8b_eagle.yaml: the GPU recipe for an EAGLE-3 head on Llama-3.1-8B-Instruct composes to
the settings its header promises, and runs, two steps, on a random tiny Llama with the 8B's architecture (32 layers,
GQA, SiLU, Llama-3 RoPE, untied output head) in place of the hub models, on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from train.config import register
from train.hidden_states import default_layers

CONF = Path(__file__).resolve().parents[2] / "conf"
# Llama-3.1-8B-Instruct's config.json, the settings an EAGLE-3 head's shapes and features depend on
# (hidden size, heads, vocabulary aside: the tiny model keeps their ratios, the test world's tokenizer its own).
LLAMA31_8B = dict(num_hidden_layers=32, hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False,
                  attention_bias=False, mlp_bias=False, max_position_embeddings=131072,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def make_cfg(*overrides):
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=["experiment=llama3_8b_eagle", *overrides])


def test_the_recipe_composes_to_the_settings_its_header_names():
    cfg = make_cfg("data.path=mine.jsonl")
    # trainer=gpu underneath: every key the experiment leaves alone is gpu.yaml's.
    gpu = yaml.safe_load((CONF / "trainer" / "gpu.yaml").read_text())
    mine = yaml.safe_load((CONF / "experiment" / "llama3_8b_eagle.yaml").read_text())["trainer"]
    assert {k: cfg.trainer[k] for k in gpu if k not in mine} == {k: v for k, v in gpu.items() if k not in mine}
    assert cfg.trainer.resume == "auto" and cfg.trainer.cpu is False
    t = cfg.trainer
    assert (t.precision, t.lr, t.max_length, t.batch_size, t.max_grad_norm) == ("bf16", 1e-4, 4096, 1, 0.5)
    assert list(t.adam_betas) == [0.9, 0.999] and t.weight_decay == 0.0
    assert t.warmup_steps == round(0.015 * t.max_steps)  # SpecForge's warm-up ratio
    d = cfg.drafter
    assert d.kind == "eagle" and d.hidden_states == "online"
    assert list(d.layers) == [2, 16, 29] == default_layers("eagle", 32)  # SpecForge's [1, 15, 28], one higher
    assert (d.ttt_steps, d.ttt_decay, d.draft_vocab_size, d.own_lm_head) == (7, 0.8, 32000, True)
    assert cfg.target.name_or_path == "meta-llama/Llama-3.1-8B-Instruct"
    assert cfg.target.off_the_shelf_draft == "meta-llama/Llama-3.2-1B-Instruct"
    assert cfg.target.dtype == "bfloat16"
    assert cfg.data.path == "mine.jsonl" and cfg.regenerate.engine == "torch" and cfg.regenerate.endpoint is None
    assert list(cfg.export.formats) == ["sglang", "speculators"]
    # The OpenAI-compatible server the header names is one override away.
    served = make_cfg("data.path=mine.jsonl", "regenerate.endpoint=http://localhost:30000/v1")
    assert served.regenerate.endpoint == "http://localhost:30000/v1"


def tiny_llama31(tokenizer, out: Path) -> Path:
    """A random Llama with Llama-3.1-8B's architecture at hidden size 32 (4 query heads to 1 KV head: the 8B's
    32 to 8), saved with the test world's tokenizer, as a hub snapshot would be."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=112, num_attention_heads=4,
                         num_key_value_heads=1, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **LLAMA31_8B)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # random init is near uniform; sharper, the labels say something
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.slow
def test_the_recipe_trains_two_steps_on_a_tiny_model_of_the_8bs_architecture(tiny_world, tmp_path, capsys):
    from accelerate.state import AcceleratorState

    from train.__main__ import train

    tokenizer = AutoTokenizer.from_pretrained(tiny_world / "target")
    target = tiny_llama31(tokenizer, tmp_path / "llama31_tiny")
    # The recipe as it is, but the models (the tiny one; the test world's draft shares its tokenizer), the traffic
    # (the test world's, a few records), the sizes that scale with them (the draft vocabulary: half of the 320
    # tokens instead of 32,000 of 128,256; 4 held-out records instead of 256; answers of 8 new tokens) and the
    # device: the CPU (trainer.cpu). bf16 stays: torch runs bf16 autocast and bf16 weights on every CPU (natively
    # with AVX512-BF16 or AMX, emulated elsewhere, slower, same dtypes), so the recipe's precision is the one tested.
    cfg = make_cfg(f"target.name_or_path={target}", f"target.off_the_shelf_draft={tiny_world / 'draft'}",
                   f"data.path={tiny_world / 'company_logs' / 'train.jsonl'}", "data.max_records=8",
                   "trainer.eval_examples=4", "trainer.max_steps=2", "trainer.cpu=true", "drafter.draft_vocab_size=160",
                   "regenerate.max_new_tokens=8", "evaluate.enabled=false", "export.force=true", "progress=false",
                   f"out_dir={tmp_path / 'run'}", f"data_cache={tmp_path / 'data'}")
    assert cfg.trainer.precision == "bf16" and cfg.target.dtype == "bfloat16"
    AcceleratorState._reset_state(reset_partial_state=True)  # one precision per process, as Accelerate keeps it
    try:
        summary = train(cfg)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)

    run = tmp_path / "run"
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) and r["loss"] > 0 for r in rows)
    assert rows[0]["lr"] == pytest.approx(1e-4 * 2 / 180)  # the second of 180 warm-up steps (the scheduler's step 1)
    # The held-out check at the last step, one acceptance per unrolled step: the recipe's TTT length, 7.
    assert 0 < rows[-1]["heldout_acceptance"] <= 1 and len(rows[-1]["heldout_step_acceptance"]) == 7
    checkpoint = run / "checkpoints" / "step-000002"
    assert (checkpoint / "model.safetensors").exists()
    # The head it saved: EAGLE-3 on the recipe's layers, its own output head over the 160-token draft vocabulary.
    head = json.loads((run / "best" / "config.json").read_text())
    assert head["feature_layers"] == [2, 16, 29] and head["draft_vocab_size"] == 160
    assert (head["ttt_steps"], head["own_lm_head"], head["rope_parameters"]) == (7, True, LLAMA31_8B["rope_parameters"])
    weights = load_file(str(run / "best" / "model.safetensors"))
    assert any(t.shape[0] == 160 for name, t in weights.items() if "lm_head" in name)
    # The recipe's export at the end: SGLang's and vLLM's (speculators) formats.
    assert set(summary["export"]) == {"sglang", "speculators"}
    assert all(Path(p).exists() for p in summary["export"].values())
    assert "draft vocabulary: 160 of 320 tokens" in capsys.readouterr().out
