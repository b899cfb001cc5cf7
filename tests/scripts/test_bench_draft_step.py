"""scripts/bench_draft_step.py runs on the tiny world and reports every path."""

import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from drafters.registry import build_head, save_head
from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_draft_step.py"


def test_reports_both_paths_for_draft_and_target(tiny_world):
    out = subprocess.run([sys.executable, str(SCRIPT), "--draft", str(tiny_world / "draft"),
                          "--target", str(tiny_world / "target"), "--context", "16", "--steps", "3", "--blocks", "1"],
                         capture_output=True, text=True, check=True).stdout
    for path in ("target, Hugging Face forward", "draft, Hugging Face forward", "draft, lean path", "target, lean path"):
        assert path in out
    assert "target, Hugging Face forward" in out and "1.000x" in out  # the reference row


def test_times_an_eagle_head_layer_on_both_paths(tiny_world, tmp_path):
    target = AutoModelForCausalLM.from_pretrained(tiny_world / "target")
    save_head(build_head("eagle", target, [0, 1, 2], ttt_steps=2, ttt_decay=0.8), tmp_path / "eagle")
    save_head(build_head("medusa", target, [target.config.num_hidden_layers], num_heads=2, num_layers=1,
                         head_decay=0.8), tmp_path / "medusa")
    cmd = [sys.executable, str(SCRIPT), "--draft", str(tiny_world / "draft"), "--target", str(tiny_world / "target"),
           "--context", "16", "--steps", "3", "--blocks", "1"]
    out = subprocess.run([*cmd, "--eagle", str(tmp_path / "eagle")], capture_output=True, text=True, check=True).stdout
    assert "EAGLE-3 layer, forward" in out and "EAGLE-3 layer, fused decode" in out
    assert "EAGLE-3 round after target" in out and "draft round, lean path" in out
    narrow = subprocess.run([*cmd, "--eagle", str(tmp_path / "eagle"), "--eagle-intermediate", "16,8", "--accepted", "4"],
                            capture_output=True, text=True, check=True).stdout
    assert "then 4 accepted" in narrow  # each round's first step feeds 5 entries
    assert "EAGLE-3 round, MLP 16, after target / draft round after target" in narrow
    assert "EAGLE-3 round, MLP 8, after target / draft round after target" in narrow
    wrong = subprocess.run([*cmd, "--eagle", str(tmp_path / "medusa")], capture_output=True, text=True)
    assert wrong.returncode != 0 and "not an EAGLE-3 head" in wrong.stderr


def test_narrowed_head_keeps_all_but_the_mlp(tiny_world):
    module = load_script("bench_draft_step")
    target = AutoModelForCausalLM.from_pretrained(tiny_world / "target")
    head = build_head("eagle", target, [0, 1, 2], ttt_steps=2, ttt_decay=0.8)
    narrow = module.narrowed(head, 8, target)
    assert narrow.config.intermediate_size == 8 and head.config.intermediate_size != 8
    wide, thin = head.state_dict(), narrow.state_dict()
    assert wide.keys() == thin.keys()
    for name in wide:
        if ".mlp." in name:
            assert 8 in thin[name].shape
        else:
            assert torch.equal(wide[name], thin[name]), name


def test_times_a_draft_of_another_depth(tiny_world):
    out = subprocess.run([sys.executable, str(SCRIPT), "--draft", str(tiny_world / "draft"),
                          "--target", str(tiny_world / "target"), "--context", "16", "--steps", "2", "--blocks", "1",
                          "--draft-layers", "3"], capture_output=True, text=True, check=True).stdout
    assert AutoModelForCausalLM.from_pretrained(tiny_world / "draft").config.num_hidden_layers != 3
    assert "draft: 3 layers" in out and "randomly initialised" in out
