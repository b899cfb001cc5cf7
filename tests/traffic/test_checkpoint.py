"""Checkpoints: atomic, complete or ignored, exact on resume, whole tensors even from a sharded run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.lr_scheduler import LambdaLR
from transformers import LlamaConfig, LlamaForCausalLM

from traffic import checkpoint

ROOT = Path(__file__).resolve().parents[2]
CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, tie_word_embeddings=True)


def _build(seed):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, LambdaLR(optimizer, lambda s: 1 / (1 + s))


def _step(model, optimizer, scheduler, s):
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(s))
    model(input_ids=x, labels=x).loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def test_resume_is_exact_and_tied_weights_stay_tied(tmp_path):
    model, optimizer, scheduler = _build(0)
    for s in range(3):
        _step(model, optimizer, scheduler, s)
    path = checkpoint.save(tmp_path, 3, model, optimizer, scheduler, extra={"best": {"acceptance": 0.5}})
    for s in range(3, 6):
        _step(model, optimizer, scheduler, s)

    model2, optimizer2, scheduler2 = _build(1)
    state = checkpoint.load(path, model2, optimizer2, scheduler2)
    assert state["step"] == 3 and state["best"] == {"acceptance": 0.5}
    assert model2.lm_head.weight.data_ptr() == model2.model.embed_tokens.weight.data_ptr()
    assert scheduler2.last_epoch == 3
    for s in range(3, 6):
        _step(model2, optimizer2, scheduler2, s)
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name
    # Both names of the tied weight are in the file, so it loads strictly into a fresh model.
    LlamaForCausalLM(CONFIG).load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
    # The optimizer state is keyed by parameter name, not by position in the optimizer.
    assert "model.layers.0.mlp.up_proj.weight" in torch.load(path / "optimizer.pt", weights_only=True)["state"]


def test_incomplete_checkpoints_are_ignored_and_refused(tmp_path):
    model, optimizer, scheduler = _build(0)
    checkpoint.save(tmp_path, 2, model, optimizer, scheduler)
    last = checkpoint.save(tmp_path, 4, model, optimizer, scheduler)
    (tmp_path / "step-000006.tmp-123").mkdir()  # a save killed half way
    half = tmp_path / "step-000008"
    half.mkdir()  # a directory with the final name but no marker
    assert checkpoint.latest(tmp_path) == last
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        checkpoint.load(half, model, optimizer, scheduler)


def test_keep_removes_the_oldest(tmp_path):
    model, optimizer, scheduler = _build(0)
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, model, optimizer, scheduler, keep=2)
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step-000002", "step-000003"]


def test_fsdp_sharded_checkpoint_round_trip(tmp_path):
    """Two processes shard a model with FSDP (torch's fully_shard on gloo): the checkpoint holds whole
    tensors, loads into a sharded model of another initialisation, and resuming continues exactly as the
    uninterrupted run; the file also loads into an unsharded model (tests/traffic/fsdp_worker.py)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "traffic" / "fsdp_worker.py"), str(tmp_path / "checkpoints")]
    # CPU ranks on a machine with a GPU too: fully_shard's default mesh would put rank i on cuda:i.
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout
