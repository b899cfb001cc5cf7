"""SpecForge 0.2.0 (`specforge train --config run.yaml`) on draftsmith's records and features.

What it reads: offline features as one file per record, a dict saved with torch.save (its own capture script's
format; its reader walks `data.hidden_states_path` for *.ckpt): input_ids (T,), loss_mask (T,), hidden_state
(1, T, d), the target's last state AFTER its final norm (its TargetHead applies only lm_head), and aux_hidden_state
(1, T, 3d), the auxiliary layers concatenated in ascending order. Alignment: its TargetHead shifts input_ids and the
last state left by one and leaves loss_mask alone, so entry t reads token t's features and token t+1's embedding,
predicts token t+2 and is gated by loss_mask[t]; draftsmith gates that prediction by loss_mask[t+2]. The converter
stores loss_mask'[t] = loss_mask[t+2]; each TTT step shifts mask and target together, so every step reads the
positions draftsmith's reads. SpecForge does not cast features: they are written in the run's model dtype.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import sys
from collections import Counter
from pathlib import Path

import torch

from peers import elapsed_at, free_port, on_cpu, on_path, pin_threads, run_peer

DEFAULTS = {"lr": 1e-4, "warmup_ratio": 0.015, "schedule": "cosine", "ttt_length": 7, "ttt_decay": 0.8,
            "max_grad_norm": 0.5, "max_length": 2048, "torch_dtype": "bfloat16", "vocabulary": "own"}
# What each rung of the ladder (peers.LADDER) adds to the defaults, from `matched`.
RUNGS = {"+lr": ["lr"], "+schedule": ["warmup_steps", "schedule"], "+ttt": ["ttt_length", "ttt_decay"]}
# What `matched` cannot give it (no configuration key reaches it), so differences that remain.
GAPS = ("its loss is a sum over the supervised positions divided by all B·T positions, padding included "
        "(draftsmith: a mean over the supervised ones); positions whose target token is outside the draft vocabulary "
        "leave the loss (draftsmith keeps them, with zero loss); soft labels at temperature 1 (no key trains on the "
        "target's argmax, which draftsmith's recipe may); its own output head, from random (draftsmith: the target's "
        "rows; the `target-head` control starts SpecForge from them); cosine to 0 (draftsmith: to 0.1 of the peak); "
        "AdamW betas (0.9, 0.999) (draftsmith: (0.9, 0.95))")


def matched(cfg, dtype: str) -> dict:
    t, d = cfg.trainer, cfg.drafter
    return {"lr": t.lr, "warmup_steps": t.warmup_steps, "schedule": "cosine", "ttt_length": d.ttt_steps,
            "ttt_decay": d.ttt_decay, "max_grad_norm": t.max_grad_norm, "max_length": t.max_length,
            "torch_dtype": dtype, "vocabulary": "draftsmith"}


def depth(settings: dict) -> int:
    """The TTT depth the head trains: the one to replay it at too."""
    return {**DEFAULTS, **settings}["ttt_length"]


def convert(tokenized_dir: Path, shards_dir: Path, out: Path, dtype: str, record) -> Path:
    """draftsmith's tokenized records and offline features as SpecForge's offline .ckpt files, in `dtype`;
    `record(rows, reader, i)`: record i's features, tokens and loss mask as far as its features reach."""
    import datasets

    from train.hidden_states import ShardReader

    if (out / "done").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    rows, reader = datasets.load_from_disk(str(tokenized_dir)), ShardReader(shards_dir)
    if len(reader.layers) != 4 or len(reader) != len(rows):
        raise ValueError(f"{shards_dir}: expected three auxiliary layers and the last state for each of {len(rows)} "
                         f"records, found layers {reader.layers} for {len(reader)}")
    for i in range(len(rows)):
        item, ids, mask = record(rows, reader, i)
        mask = mask.long()
        shifted = torch.zeros_like(mask)
        shifted[:-2] = mask[2:]  # entry t predicts token t + 2 (above)
        hidden = item["hidden"].to(getattr(torch, dtype))  # (T, 4, d)
        torch.save({"input_ids": ids, "loss_mask": shifted, "hidden_state": hidden[None, :, 3].clone(),
                    "aux_hidden_state": hidden[None, :, :3].flatten(2).clone()}, out / f"data_{i:08d}.ckpt")
    (out / "done").touch()
    return out


def _target_view(target_dir: Path, out: Path) -> tuple[Path, str]:
    """The target as SpecForge's TargetHead reads it: it requires a `*.index.json` beside the weights, so a
    single-file checkpoint gets a directory of links and a generated index; a tied target's head is its embedding."""
    from safetensors import safe_open

    config = json.loads((target_dir / "config.json").read_text())
    key = "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
    if list(target_dir.glob("*.index.json")):
        return target_dir, key
    view = out / "target_view"
    view.mkdir(parents=True, exist_ok=True)
    for f in target_dir.iterdir():
        if not (view / f.name).exists():
            (view / f.name).symlink_to(f.resolve())
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
        index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}
    (view / "model.safetensors.index.json").write_text(json.dumps(index))
    return view, key


def _warm_start(draft, referee, d2t: torch.Tensor, out: Path, seed: int) -> Path:
    """SpecForge's own draft model, initialised as it initialises one, with its output head replaced by the target's
    rows of the draft vocabulary (draftsmith's start): the `target-head` control, loaded through SpecForge's
    weights-only warm start (`model.draft_checkpoint_path`)."""
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    torch.manual_seed(seed)
    model = LlamaForCausalLMEagle3(draft)
    rows = referee.recipe.target.get_output_embeddings().weight.detach().float().cpu()
    target_ids = torch.arange(d2t.numel()) + d2t.long()  # d2t holds offsets: target id = draft id + d2t
    with torch.no_grad():
        model.lm_head.weight.copy_(rows[target_ids].to(model.lm_head.weight))
    model.save_pretrained(str(out / "warm_start"))
    return out / "warm_start"


def train(data: Path, referee, out: Path, steps: int, settings: dict, batch_size: int, seed: int,
          threads: int, saves: list[int]) -> dict:
    """`specforge train` in a subprocess, saving its checkpoint at each of `saves` (evenly spaced: its
    `save_interval`); its draft config is SpecForge's own for the target, with the target's RoPE,
    the draft vocabulary's size and the auxiliary layers (SGLang's convention, one lower than draftsmith's) set.
    SpecForge copies the target's `rope_theta` and `rope_scaling`; transformers 5 keeps the base inside
    `rope_parameters` and has no `rope_theta`, but answers `rope_scaling` with `rope_parameters`, so the copy carries
    the base (checked with transformers 5.24: a target at base 100,000 gave a draft at 100,000). The RoPE is set
    here all the same, so it does not hang on that alias."""
    import datasets
    import yaml

    on_path("specforge")
    from specforge.algorithms.eagle3.providers import algorithm_providers
    from specforge.config import Config
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.training.model_loading import resolve_draft_config

    s = {**DEFAULTS, **settings}
    out.mkdir(parents=True, exist_ok=True)
    target_dir = referee.target_dir
    view, head_key = _target_view(target_dir, out)
    d2t, t2d = referee.draft_vocabulary()
    if s["vocabulary"] == "own":  # SpecForge's rule over the same assistant tokens, at draftsmith's size
        counts = Counter()
        for row in datasets.load_from_disk(str(referee.feature_dirs()[0])):
            counts.update(t for t, m in zip(row["input_ids"], row["loss_mask"]) if m)
        d2t, t2d = process_token_dict_to_mappings(counts, d2t.numel(), t2d.numel())
    torch.save({"d2t": d2t.long(), "t2d": t2d.bool()}, out / "vocab_mapping.pt")
    cfg = Config.model_validate({"model": {"target_model_path": str(target_dir)}, "data": {"hidden_states_path": str(out)}})
    draft = resolve_draft_config(cfg, provider=algorithm_providers().model.draft_config)
    draft.draft_vocab_size = d2t.numel()
    draft.eagle_config = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in referee.layers]}
    draft.rope_parameters = dict(referee.rope_parameters)
    draft.to_json_file(str(out / "draft_config.json"))
    records = sorted(data.glob("*.ckpt"))
    warmup = min(s["warmup_steps"], steps - 1) / steps if "warmup_steps" in s else s["warmup_ratio"]
    model = {"target_model_path": str(view), "draft_model_config": str(out / "draft_config.json"),
             "vocab_mapping_path": str(out / "vocab_mapping.pt"), "lm_head_key": head_key,
             "torch_dtype": s["torch_dtype"]}
    if s.get("target_head"):
        model["draft_checkpoint_path"] = str(_warm_start(draft, referee, d2t, out, seed))
    training = {"strategy": "eagle3", "max_steps": steps,
                "num_epochs": math.ceil(steps / max(1, len(records) // batch_size)),  # else capped by the data
                "batch_size": batch_size, "learning_rate": s["lr"], "lr_scheduler": s["schedule"],
                "warmup_ratio": warmup, "max_grad_norm": s["max_grad_norm"], "ttt_length": s["ttt_length"],
                "fsdp_sharding": "NO_SHARD", "log_interval": 1, "save_interval": saves[0], "seed": seed}
    if on_cpu():  # flex attention has no backward on a CPU; with a GPU SpecForge picks its own backend
        training["attention_backend"] = "sdpa"
    run = {"run_id": "bench-peers", "output_dir": str(out / "run"), "model": model,
           "data": {"hidden_states_path": str(data), "max_length": s["max_length"], "dataloader_num_workers": 0},
           "training": training, "deployment": {"mode": "local_colocated"}}
    (out / "run.yaml").write_text(yaml.safe_dump(run, sort_keys=False))
    # A one-rank torchrun environment: SpecForge's CLI then runs its worker in this subprocess.
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "BENCH_PEERS_TOKENS": str(out / "tokens.txt")}
    if on_cpu():
        # SpecForge's device, and every @torch.compile run eagerly: CPU inductor needs a C++ toolchain and
        # recompiles per sequence length.
        env.update({"SPECFORGE_DEVICE": "cpu", "TORCHDYNAMO_DISABLE": "1"})
    (out / "tokens.txt").unlink(missing_ok=True)
    wall = run_peer("specforge", ["--ttt-decay", str(s["ttt_decay"]), "--dtype", s["torch_dtype"], "train",
                                  "--config", str(out / "run.yaml")], env, out / "train.log", threads)
    # its logger prints `step N: {metrics}`, a Python dict's repr (training/assembly.py)
    logged = [ast.literal_eval(m) for m in re.findall(r"^step \d+: (\{.*\})$", (out / "train.log").read_text(), re.M)]
    tokens = [int(line) for line in (out / "tokens.txt").read_text().split()][:steps]  # one line a step's batch
    checkpoints = {int(p.name.rsplit("-step", 1)[1]): p for p in (out / "run").glob("*-step*")}
    missing = sorted(set(saves) - set(checkpoints))
    if missing:
        raise SystemExit(f"specforge saved no checkpoint at steps {missing} (it saved {sorted(checkpoints)}): "
                         f"{out / 'train.log'}")
    seconds = [m["perf/optimizer_step_time_s"] for m in logged]
    return {"wall_s": wall, "train_s": sum(seconds), "tokens": sum(tokens), "checkpoint": checkpoints[steps],
            "curve": [[step, at, str(checkpoints[step])] for step, at in zip(saves, elapsed_at(seconds, saves))],
            "final_loss": logged[-1]["loss"] if logged else None}


def export(checkpoint: Path, referee, out: Path) -> Path:
    """SpecForge's SGLang exporter (LlamaForCausalLMEagle3), and the top-level eagle_aux_hidden_state_layer_ids in
    vLLM's convention that llama.cpp and draftsmith read (SpecForge writes only SGLang's, nested)."""
    on_path("specforge")
    from specforge.export.to_sglang import export_to_sglang

    path = Path(export_to_sglang(str(checkpoint), str(checkpoint.parent.parent / "draft_config.json"), str(out)))
    config = json.loads((path / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = referee.layers
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def main(argv: list[str]) -> int:
    """In the training subprocess: the CPU shims where there is no accelerator, the step counter, then SpecForge's
    CLI."""
    import types

    ap = argparse.ArgumentParser()
    ap.add_argument("--ttt-decay", type=float, required=True)
    ap.add_argument("--dtype", required=True)
    args, rest = ap.parse_known_args(argv)
    on_path("specforge")
    pin_threads()
    import torch._dynamo  # noqa: F401  (imports Triton where present: before the stub below exists)

    try:
        import triton  # noqa: F401
    except ImportError:
        # core/loss.py imports Triton at module level for its fused log-softmax loss, and a CPU has no Triton: that
        # one import gets a stub, and the loss is SpecForge's pure-torch reference beside the kernel (the same value).
        stub = types.ModuleType("triton")
        stub.jit = lambda fn: fn
        stub.language = types.SimpleNamespace(constexpr=int)
        sys.modules["triton"], sys.modules["triton.language"] = stub, stub.language
        import specforge.core.loss as loss

        del sys.modules["triton"], sys.modules["triton.language"]  # nothing else may take the stub for Triton
        loss.LogSoftmaxLoss = types.SimpleNamespace(apply=loss._compute_loss)

    # TargetHead.from_pretrained casts the frozen output head to bf16 whatever the run's dtype (float32 features
    # then fail in F.linear): loaded with SpecForge's own load_weights, in the run's dtype.
    from specforge.modeling.target.target_head import TargetHead
    from specforge.training.strategies.base import Eagle3TrainStrategy
    from specforge.utils import get_local_device

    dtype = getattr(torch, args.dtype)

    def from_pretrained(cls, model_path, lm_head_key="lm_head.weight", cache_dir=None, trust_remote_code=False):
        head = cls(model_path, trust_remote_code=trust_remote_code, cache_dir=cache_dir)
        head.load_weights(model_path=model_path, lm_head_key=lm_head_key, cache_dir=cache_dir)
        head.freeze_weights()
        return head.eval().to(device=get_local_device(), dtype=dtype)

    TargetHead.from_pretrained = classmethod(from_pretrained)
    # The TTT steps' loss decay is a constructor default (0.8) no configuration key reaches.
    init = Eagle3TrainStrategy.__init__
    Eagle3TrainStrategy.__init__ = lambda self, *a, ploss_decay=args.ttt_decay, **k: init(
        self, *a, ploss_decay=ploss_decay, **k)
    # Not a CPU fix: the real tokens of each step's batch, counted where the step reads it (its loader shuffles with
    # its own seed, so the records a step trains on are known only there).
    forward_loss = Eagle3TrainStrategy.forward_loss

    def counted(self, batch, ctx=None):
        with open(os.environ["BENCH_PEERS_TOKENS"], "a") as f:
            f.write(f"{int(batch.tensors['attention_mask'].sum())}\n")
        return forward_loss(self, batch, ctx)

    Eagle3TrainStrategy.forward_loss = counted
    from specforge.cli import main as cli

    return cli(rest)
