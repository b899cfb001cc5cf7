"""Our EAGLE-3 trainer against SpecForge's and speculators' on the same records, features and held-out set.

    python scripts/bench_peers.py --data runs/peers/smollm2.jsonl --steps 100 --out runs/peers/smollm2 \
        --overrides experiment=smollm2_eagle regenerate.enabled=false
    python scripts/bench_peers.py --data tiny.jsonl --steps 4 --heldout 6 --out /tmp/peers --overrides experiment=smoke

Every trainer learns from draftsmith's own offline feature cache: the records tokenized once, the target's features
computed once (`drafter.hidden_states=offline`), the loss masks realigned so that all three learn the same
predictions (each peer's convention in `convert_specforge` and `convert_speculators`). Each peer runs as its own
command (`specforge train`, `speculators train`) in a subprocess; the few shims a CPU needs are applied in that
subprocess by this script (`python scripts/bench_peers.py _peer <name> ...`, each shim with its reason), and no
installed file of a peer is changed. Each head is exported by its trainer's own exporter and measured by draftsmith:
held-out greedy τ, replayed at the recipe's k on the same held-out records (`train/heads.py` `evaluate_heldout`, the
number `bench_data_scaling.py` fits), over all and per category, at each head's final step.

Two runs per peer: `matched` (draftsmith's learning rate, warm-up, cosine schedule, TTT depth and decay, clipping,
precision, draft vocabulary, records per step and sequence length) and `defaults` (the peer's own, the steps and
records per step aside). What a peer cannot be told is listed in `MATCHED_GAPS`. Throughput is trained tokens (the
real tokens of the records in each step) over the seconds of the training steps, start-up and evaluation left out.

Outputs: `<out>/peers.json` (one row per trainer and setting) and `<out>/peers.md` (the table); each run in
`<out>/<trainer>-<settings>/`. A finished run is not trained again.
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
# The peers, installed beside the project with `pip --target` (Makefile: make install): on sys.path after the
# project's own packages, so the venv's torch and transformers are the ones imported.
PEERS = {"specforge": ROOT / ".venv" / "specforge", "speculators": ROOT / ".venv" / "speculators"}
TRAINERS = ("draftsmith", "specforge", "speculators")
SETTINGS = ("matched", "defaults")

# What `matched` cannot give a peer (no configuration key reaches it), so differences that remain.
MATCHED_GAPS = {
    "specforge": "its loss is a sum over the supervised positions divided by all B·T positions, padding included "
                 "(draftsmith: a mean over the supervised ones); positions whose target token is outside the draft "
                 "vocabulary leave the loss (draftsmith keeps them, with zero loss); its own output head, from random "
                 "(draftsmith: the target's rows, frozen); soft labels at temperature 1 (draftsmith's recipe may "
                 "train on the target's argmax); cosine to 0 (draftsmith: to 0.1 of the peak); AdamW betas "
                 "(0.9, 0.999) (draftsmith: (0.9, 0.95))",
    "speculators": "its batches pack records to a token budget (the records' mean length × records per step) where "
                   "draftsmith pads a fixed number of records; KL to the target's softmax over the draft vocabulary "
                   "(draftsmith's recipe may train on the target's argmax); cosine to 0; AdamW betas (0.9, 0.999); "
                   "one record of the training set held back for its own validation split",
}


@dataclass
class Row:
    trainer: str             # draftsmith | specforge | speculators
    settings: str            # matched | defaults (draftsmith: its recipe, the overrides given)
    steps: int
    tokens: int              # real tokens of the records trained on, over all steps
    train_s: float           # seconds of the training steps alone
    wall_s: float            # the whole run: start-up, features read, steps, checkpoints
    tokens_per_s: float      # tokens / train_s
    heldout_tau: float       # held-out greedy τ, replayed at k = the recipe's ttt_steps, at the final step
    heldout_tau_by_category: dict
    heldout_top1: float      # top-1 agreement of the first draft step on the held-out assistant tokens
    head: str                # the head measured: the trainer's export (a draftsmith head for draftsmith)
    notes: dict = field(default_factory=dict)


# --- draftsmith: its recipe, in this process ------------------------------------------------------------------


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def recipe_overrides(args, out: Path) -> list[str]:
    """The recipe every trainer's records and features come from: the caller's overrides, EAGLE-3 on offline
    features, the same held-out records, and the steps; no final evaluation (this script measures)."""
    return [*args.overrides, "drafter=eagle", "drafter.hidden_states=offline", f"data.path={args.data}",
            "data.max_records=null", "trainer.heldout=per_category", f"trainer.eval_examples={args.heldout}",
            f"data_cache={args.data_cache or out / 'data'}", "evaluate.enabled=false", "progress=false"]


def train_draftsmith(args, out: Path) -> Row:
    from train.__main__ import train

    run = out / "draftsmith-recipe"
    steps = args.steps
    if not (run / "train_summary.json").exists():
        started = time.perf_counter()
        train(compose_cfg([*recipe_overrides(args, out), f"trainer.max_steps={steps}", f"trainer.eval_every={steps}",
                           f"trainer.checkpoint_every={steps}", f"out_dir={run}"]))
        (run / "wall_s").write_text(f"{time.perf_counter() - started:.1f}\n")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    stepped = [r for r in rows if "step_s" in r]
    tokens = sum(r["tokens"] for r in stepped)
    train_s = sum(r["step_s"] for r in stepped)
    final = [r for r in rows if r.get("step") == steps and "heldout_tau_greedy" in r][-1]
    return Row("draftsmith", "recipe", steps, tokens, round(train_s, 2), float((run / "wall_s").read_text()),
               round(tokens / train_s, 1), round(final["heldout_tau_greedy"], 4),
               final["heldout_tau_greedy_by_category"], round(final["heldout_top1"], 4), str(run / "best"))


class Referee:
    """draftsmith's held-out measurement of any EAGLE-3 head on the run's records: the recipe set up without a
    step (its data, features, held-out set and target), its head swapped for the one measured."""

    def __init__(self, args, out: Path) -> None:
        from train.eagle3 import Eagle3Recipe

        self.recipe = Eagle3Recipe(compose_cfg([*recipe_overrides(args, out), "trainer.max_steps=0",
                                                f"out_dir={out / 'referee'}"]))
        self.recipe.setup()

    @property
    def layers(self) -> list[int]:
        return list(self.recipe.layers)

    @property
    def target_dir(self) -> Path:
        from eval.engine_formats import target_directory
        from eval.run import target_source

        return Path(target_directory(target_source(self.recipe.cfg.target)))

    def feature_dirs(self) -> tuple[Path, Path]:
        """The tokenized training records and their offline features, as draftsmith's recipe trains on them."""
        return self.recipe.data_dirs["train"] / "tokenized", self.recipe.shards.dir

    def draft_vocabulary(self) -> tuple[torch.Tensor, torch.Tensor]:
        head = self.recipe.acc.unwrap_model(self.recipe.model)
        return head.d2t.detach().cpu(), head.t2d.detach().cpu()

    def measure(self, head_dir: Path) -> dict:
        from drafters.registry import load_head

        recipe = self.recipe
        head = load_head(head_dir, recipe.target)
        head.config.ttt_steps = recipe.cfg.drafter.ttt_steps  # replayed as deep as draftsmith's recipe drafts
        recipe.model, recipe.best = head, None
        return recipe.evaluate_heldout()


# --- SpecForge ---------------------------------------------------------------------------------------------------
#
# SpecForge 0.2.0 (`specforge train --config run.yaml`) reads offline features as one file per record, a dict saved
# with torch.save (its own capture script's format; its reader walks `data.hidden_states_path` for *.ckpt):
# input_ids (T,), loss_mask (T,), hidden_state (1, T, d), the target's last state AFTER its final norm (its
# TargetHead applies only lm_head), and aux_hidden_state (1, T, 3d), the auxiliary layers concatenated in ascending
# order. Alignment: its TargetHead shifts input_ids and the last state left by one and leaves loss_mask alone, so
# entry t reads token t's features and token t+1's embedding, predicts token t+2 and is gated by loss_mask[t];
# draftsmith gates that prediction by loss_mask[t+2]. The converter stores loss_mask'[t] = loss_mask[t+2]; each
# TTT step shifts mask and target together, so every step reads the positions draftsmith's reads. SpecForge does
# not cast features: they are written in the run's model dtype.

SPECFORGE_DEFAULTS = {"lr": 1e-4, "warmup_ratio": 0.015, "schedule": "cosine", "ttt_length": 7, "ttt_decay": 0.8,
                      "max_grad_norm": 0.5, "max_length": 2048, "torch_dtype": "bfloat16", "vocabulary": "own"}


def matched_specforge(cfg, dtype: str) -> dict:
    t, d = cfg.trainer, cfg.drafter
    return {"lr": t.lr, "warmup_steps": t.warmup_steps, "schedule": "cosine", "ttt_length": d.ttt_steps,
            "ttt_decay": d.ttt_decay, "max_grad_norm": t.max_grad_norm, "max_length": t.max_length,
            "torch_dtype": dtype, "vocabulary": "draftsmith"}


def convert_specforge(tokenized_dir: Path, shards_dir: Path, out: Path, dtype: str) -> Path:
    """draftsmith's tokenized records and offline features as SpecForge's offline .ckpt files, in `dtype`."""
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
        item, ids, mask = _record(rows, reader, i, shards_dir)
        mask = mask.long()
        shifted = torch.zeros_like(mask)
        shifted[:-2] = mask[2:]  # entry t predicts token t + 2 (above)
        hidden = item["hidden"].to(getattr(torch, dtype))  # (T, 4, d)
        torch.save({"input_ids": ids, "loss_mask": shifted, "hidden_state": hidden[None, :, 3].clone(),
                    "aux_hidden_state": hidden[None, :, :3].flatten(2).clone()}, out / f"data_{i:08d}.ckpt")
    (out / "done").touch()
    return out


def _record(rows, reader, i: int, shards_dir: Path) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Record i's features, and its tokens and loss mask as far as they reach: draftsmith's recipe computes features
    for the first `trainer.max_length` tokens of a record, the window it trains on."""
    item = reader[i]
    n = item["input_ids"].numel()
    ids, mask = torch.tensor(rows[i]["input_ids"][:n]), torch.tensor(rows[i]["loss_mask"][:n])
    if not torch.equal(item["input_ids"].long(), ids):
        raise ValueError(f"{shards_dir}: example {i}'s features are not tokenized record {i}'s")
    return item, ids, mask


def _specforge_target(target_dir: Path, out: Path) -> tuple[Path, str]:
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


def _peer_on_path(name: str) -> None:
    if str(PEERS[name]) not in sys.path:
        sys.path.append(str(PEERS[name]))


def train_specforge(data: Path, referee: Referee, out: Path, steps: int, settings: dict, batch_size: int) -> dict:
    """`specforge train` in a subprocess; its draft config is SpecForge's own for the target, with the draft
    vocabulary's size and the auxiliary layers (SGLang's convention, one lower than draftsmith's) set."""
    import datasets
    import yaml

    _peer_on_path("specforge")
    from specforge.algorithms.eagle3.providers import algorithm_providers
    from specforge.config import Config
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.training.model_loading import resolve_draft_config

    s = {**SPECFORGE_DEFAULTS, **settings}
    out.mkdir(parents=True, exist_ok=True)
    target_dir = referee.target_dir
    view, head_key = _specforge_target(target_dir, out)
    d2t, t2d = referee.draft_vocabulary()
    if s["vocabulary"] == "own":  # SpecForge's rule over the same assistant tokens, at draftsmith's size
        from collections import Counter

        counts = Counter()
        for row in datasets.load_from_disk(str(referee.feature_dirs()[0])):
            counts.update(t for t, m in zip(row["input_ids"], row["loss_mask"]) if m)
        d2t, t2d = process_token_dict_to_mappings(counts, d2t.numel(), t2d.numel())
    torch.save({"d2t": d2t.long(), "t2d": t2d.bool()}, out / "vocab_mapping.pt")
    cfg = Config.model_validate({"model": {"target_model_path": str(target_dir)}, "data": {"hidden_states_path": str(out)}})
    draft = resolve_draft_config(cfg, provider=algorithm_providers().model.draft_config)
    draft.draft_vocab_size = d2t.numel()
    draft.eagle_config = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in referee.layers]}
    draft.to_json_file(str(out / "draft_config.json"))
    records = sorted(data.glob("*.ckpt"))
    warmup = min(s["warmup_steps"], steps - 1) / steps if "warmup_steps" in s else s["warmup_ratio"]
    run = {"run_id": "bench-peers", "output_dir": str(out / "run"),
           "model": {"target_model_path": str(view), "draft_model_config": str(out / "draft_config.json"),
                     "vocab_mapping_path": str(out / "vocab_mapping.pt"), "lm_head_key": head_key,
                     "torch_dtype": s["torch_dtype"]},
           "data": {"hidden_states_path": str(data), "max_length": s["max_length"], "dataloader_num_workers": 1},
           "training": {"strategy": "eagle3", "max_steps": steps,
                        "num_epochs": math.ceil(steps / max(1, len(records) // batch_size)),  # else capped by the data
                        "batch_size": batch_size, "learning_rate": s["lr"], "lr_scheduler": s["schedule"],
                        "warmup_ratio": warmup, "max_grad_norm": s["max_grad_norm"], "ttt_length": s["ttt_length"],
                        "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD", "log_interval": 1, "seed": 0},
           "deployment": {"mode": "local_colocated"}}
    (out / "run.yaml").write_text(yaml.safe_dump(run, sort_keys=False))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # A one-rank torchrun environment: SpecForge's CLI then runs its worker in this subprocess (gloo on a CPU).
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "SPECFORGE_DEVICE": "cpu",
           # every @torch.compile runs eagerly: CPU inductor needs a C++ toolchain and recompiles per sequence length
           "TORCHDYNAMO_DISABLE": "1"}
    wall = run_peer("specforge", ["--ttt-decay", str(s["ttt_decay"]), "--dtype", s["torch_dtype"], "train",
                                  "--config", str(out / "run.yaml")], env, out / "train.log")
    # its logger prints `step N: {metrics}`, a Python dict's repr (training/assembly.py)
    logged = [ast.literal_eval(m) for m in re.findall(r"^step \d+: (\{.*\})$", (out / "train.log").read_text(), re.M)]
    lengths = [min(torch.load(p, mmap=True, weights_only=True)["input_ids"].numel(), s["max_length"]) for p in records]
    checkpoints = sorted((out / "run").glob("*-step*"), key=lambda p: int(p.name.rsplit("-step", 1)[1]))
    return {"wall_s": wall, "train_s": sum(m["perf/optimizer_step_time_s"] for m in logged),
            # its loader shuffles with its own seed: the steps' tokens as the records' mean length times the batch
            "tokens": round(steps * batch_size * statistics.fmean(lengths)), "checkpoint": checkpoints[-1],
            "final_loss": logged[-1]["loss"] if logged else None}


def export_specforge(checkpoint: Path, referee: Referee, out: Path) -> Path:
    """SpecForge's SGLang exporter (LlamaForCausalLMEagle3), and the top-level eagle_aux_hidden_state_layer_ids in
    vLLM's convention that llama.cpp and draftsmith read (SpecForge writes only SGLang's, nested)."""
    _peer_on_path("specforge")
    from specforge.export.to_sglang import export_to_sglang

    path = Path(export_to_sglang(str(checkpoint), str(checkpoint.parent.parent / "draft_config.json"), str(out)))
    config = json.loads((path / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = referee.layers
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def _specforge_main(argv: list[str]) -> int:
    """In the training subprocess: the CPU shims, then SpecForge's CLI."""
    import types

    ap = argparse.ArgumentParser()
    ap.add_argument("--ttt-decay", type=float, required=True)
    ap.add_argument("--dtype", required=True)
    args, rest = ap.parse_known_args(argv)
    _peer_on_path("specforge")
    import torch._dynamo  # noqa: F401  (imports Triton where present: before the stub below exists)

    # core/loss.py imports Triton at module level for its fused log-softmax loss, and a CPU has no Triton: that one
    # import gets a stub, and the loss is SpecForge's pure-torch reference beside the kernel (the same value).
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
    from specforge.utils import get_local_device

    dtype = getattr(torch, args.dtype)

    def from_pretrained(cls, model_path, lm_head_key="lm_head.weight", cache_dir=None, trust_remote_code=False):
        head = cls(model_path, trust_remote_code=trust_remote_code, cache_dir=cache_dir)
        head.load_weights(model_path=model_path, lm_head_key=lm_head_key, cache_dir=cache_dir)
        head.freeze_weights()
        return head.eval().to(device=get_local_device(), dtype=dtype)

    TargetHead.from_pretrained = classmethod(from_pretrained)
    # The TTT steps' loss decay is a constructor default (0.8) no configuration key reaches.
    if args.ttt_decay != 0.8:
        from specforge.training.strategies.base import Eagle3TrainStrategy

        init = Eagle3TrainStrategy.__init__
        Eagle3TrainStrategy.__init__ = lambda self, *a, ploss_decay=args.ttt_decay, **k: init(
            self, *a, ploss_decay=ploss_decay, **k)
    from specforge.cli import main

    return main(rest)


# --- speculators -------------------------------------------------------------------------------------------------
#
# speculators 0.9.0 (`speculators train`) reads a `datasets` directory (input_ids, loss_mask, seq_len; torch format)
# and, for record i, hidden_states/hs_{i}.safetensors: token_ids (T,) and hidden_states (T, 4, d), the auxiliary
# layers then the target's last state BEFORE its final norm, which it turns into the teacher's logits with the
# target's own norm and output rows. draftsmith caches the state after the norm; the norm maps state / weight back
# to that state (an RMS norm ignores its input's scale), so the converter stores that, exact for the labels, without
# a target forward. Alignment: its loss_mask[t] trains the distribution at position t (the one predicting token
# t+1); draftsmith marks token t. The converter stores loss_mask'[t] = loss_mask[t+1]. The draft vocabulary is
# handed over as d2t-N.npy / t2d-N.npy beside the data (draftsmith's own maps: both use offsets and a mask).

# Every CPU run: SDPA attention (flex attention has no backward on a CPU; eager materialises the scores: 3x slower),
# the eager losses (the fused ones need Triton), no vLLM server for missing features, no dataloader workers.
SPECULATORS_CPU = {"draft_attn_impl": "sdpa", "loss_implementation": "eager", "on_missing": "raise", "num_workers": 0}


def matched_speculators(cfg, dtype: str) -> dict:
    t, d = cfg.trainer, cfg.drafter
    return {"optimizer": "adamw", "lr": t.lr, "weight_decay": t.weight_decay, "scheduler_type": "cosine",
            "scheduler_warmup_steps": t.warmup_steps, "ttt_steps": d.ttt_steps, "ttt_step_loss_decay": d.ttt_decay,
            # plain EAGLE-3, as draftsmith's head; attention over the whole sequence (its default: a 2,048-token
            # sliding window)
            "norm_before_fc": False, "norm_output": False, "norm_before_residual": False,
            "full_attention_indices": [0], "hidden_states_dtype": dtype}


def convert_speculators(tokenized_dir: Path, shards_dir: Path, referee: Referee, out: Path) -> Path:
    import datasets
    import numpy as np
    from safetensors.torch import save_file

    from train.hidden_states import ShardReader

    if (out / "done").exists():
        return out
    rows, reader = datasets.load_from_disk(str(tokenized_dir)), ShardReader(shards_dir)
    final_norm = referee.recipe.target.model.norm
    weight = final_norm.weight.detach().float().cpu()
    if bool((weight == 0).any()):
        raise ValueError("the target's final norm has zero weights: its pre-norm state cannot be recovered")
    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    ids_col, mask_col = [], []
    for i in range(len(rows)):
        item, ids, mask = _record(rows, reader, i, shards_dir)
        post = item["hidden"][:, -1].float()
        pre = post / weight
        with torch.no_grad():
            rebuilt = final_norm(pre.to(final_norm.weight)).float().cpu()
        if not torch.allclose(rebuilt, post, atol=1e-2 * float(post.abs().max()) + 1e-3):
            raise ValueError("the target's final norm is not an RMS norm that state / weight inverts")
        save_file({"hidden_states": torch.cat([item["hidden"][:, :-1], pre.to(item["hidden"].dtype)[:, None]], 1)
                   .contiguous(), "token_ids": ids}, str(out / "hidden_states" / f"hs_{i}.safetensors"))
        ids_col.append(ids.tolist())
        mask_col.append(mask.tolist()[1:] + [0])
    data = datasets.Dataset.from_dict(
        {"input_ids": ids_col, "loss_mask": mask_col, "seq_len": [len(x) for x in ids_col]},
        features=datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                    "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                    "seq_len": datasets.Value("int64")}))
    data.set_format("torch")  # its reader compares tensors
    data.save_to_disk(str(out))
    d2t, t2d = referee.draft_vocabulary()
    np.save(out / f"d2t-{d2t.numel()}.npy", d2t.numpy())
    np.save(out / f"t2d-{d2t.numel()}.npy", t2d.numpy())
    (out / "done").touch()
    return out


def _flags(options: dict) -> list[str]:
    """{"norm_output": False, "target_layer_ids": [1, 2]} -> ["--no-norm-output", "--target-layer-ids", "1", "2"]."""
    argv = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, *map(str, value if isinstance(value, list) else [value])]
    return argv


def train_speculators(data: Path, referee: Referee, out: Path, steps: int, settings: dict, batch_size: int) -> dict:
    import datasets

    _peer_on_path("speculators")
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    out.mkdir(parents=True, exist_ok=True)
    lengths = datasets.load_from_disk(str(data)).with_format(None)["seq_len"]
    budget = round(batch_size * statistics.fmean(lengths))  # packed tokens a step: the records' mean length each
    ratio = (len(lengths) - 0.5) / len(lengths)  # its own validation split, which it requires: one record
    # The trainer runs every --epochs even past --max-steps (each further epoch one more step, a checkpoint and a
    # validation): the epochs are the fewest that hold the steps, counted with its own packing sampler.
    sampler = MultipackDistributedBatchSamplerV2(budget, lengths[: int(len(lengths) * ratio)], num_replicas=1, rank=0,
                                                 seed=42)
    epochs = batches = 0
    while batches < steps:
        sampler.set_epoch(epochs)
        batches, epochs = batches + len(sampler), epochs + 1
    d2t, _ = referee.draft_vocabulary()
    options = {**SPECULATORS_CPU, **settings, "verifier_name_or_path": str(referee.target_dir), "data_path": str(data),
               "target_layer_ids": referee.layers, "draft_vocab_size": d2t.numel(), "total_seq_len": budget,
               "train_data_ratio": ratio, "seed": 42, "max_steps": steps, "epochs": epochs, "checkpoint_freq": epochs,
               "save_path": str(out / "checkpoints"), "log_dir": str(out / "logs")}
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = {"BENCH_PEERS_METRICS": str(metrics)}
    wall = run_peer("speculators", _flags(options), env, out / "train.log", drop=("LOCAL_RANK", "RANK", "WORLD_SIZE"))
    logged = [m for m in map(json.loads, metrics.read_text().splitlines()) if "train" in m]
    checkpoint = max((d for d in (out / "checkpoints").iterdir() if d.name.isdigit() and not d.is_symlink()),
                     key=lambda d: int(d.name))
    return {"wall_s": wall, "train_s": sum(m["profile"]["step_ms"] for m in logged) / 1000,
            "tokens": sum(m["profile"]["tokens"] for m in logged), "checkpoint": checkpoint,
            "final_loss": logged[-1]["train"]["loss"] if logged else None}


def export_speculators(checkpoint: Path, referee: Referee, out: Path) -> Path:
    """speculators' own from_pretrained and save_pretrained (Eagle3Speculator, what `vllm serve <dir>` reads), with
    two fields its trainer's save leaves otherwise: `target_hidden_size` (null: vLLM then takes the draft's, the
    same value) and `architectures`, which transformers overwrites with the class name."""
    _peer_on_path("speculators")
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    model = Eagle3DraftModel.from_pretrained(str(checkpoint), verifier=str(referee.target_dir))
    model.config.eagle_aux_hidden_state_layer_ids = referee.layers
    model.config.target_hidden_size = model.config.transformer_layer_config.hidden_size
    model.save_pretrained(str(out))
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = Eagle3SpeculatorConfig.model_fields["architectures"].default_factory()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


class _MetricLines(logging.Handler):
    """speculators' per-step metric dicts (its "speculators.metrics" logger), one JSON line each, with the step's
    tokens."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        message = record.msg
        if isinstance(message, dict) and "train" in message and message.get("profile"):
            profile = message["profile"]  # tokens_per_s = tokens / the step's time
            profile = {**profile, "tokens": round(profile["tokens_per_s"] * profile["step_ms"] / 1000)}
            with open(self.path, "a") as f:
                f.write(json.dumps({**message, "profile": profile}, default=str) + "\n")


def _speculators_main(argv: list[str]) -> int:
    """In the training subprocess: the CPU shims, then `speculators train`."""
    _peer_on_path("speculators")
    from speculators.train import cli, trainer
    from speculators.train.config import TrainConfig

    # Every logged step calls torch.accelerator.synchronize(), which raises where there is no accelerator.
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *args, **kwargs: None
    # The model and batches go .to(get_local_rank()), i.e. cuda:0: the CPU here (no process group is set up
    # without LOCAL_RANK, which the parent removes).
    trainer.get_local_rank = lambda: "cpu"
    # Without an accelerator it autocasts on "cuda", disabled here, so bf16 batches would meet fp32 weights.
    init = trainer.Trainer.__init__

    def init_on_cpu(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer.Trainer.__init__ = init_on_cpu
    # Not a CPU fix: each step's metrics (its "speculators.metrics" logger) kept for this script.
    setup = cli.setup_metric_logger

    def setup_and_keep(*args, **kwargs):
        setup(*args, **kwargs)
        logging.getLogger("speculators.metrics").addHandler(_MetricLines(os.environ["BENCH_PEERS_METRICS"]))

    cli.setup_metric_logger = setup_and_keep
    cli.main(TrainConfig.resolve(argv))
    return 0


# --- running a peer ----------------------------------------------------------------------------------------------


def run_peer(name: str, argv: list[str], env: dict, log: Path, drop: tuple = ()) -> float:
    """`python scripts/bench_peers.py _peer <name> argv...` (the shims, then the peer's CLI) in a subprocess, its
    output in `log`; the seconds it ran. A peer that fails stops the benchmark with the log's tail."""
    environ = {k: v for k, v in os.environ.items() if k not in drop}
    environ.update(env)
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")])
    started = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, __file__, "_peer", name, *argv], env=environ, stdout=f,
                              stderr=subprocess.STDOUT, cwd=log.parent)
    if proc.returncode:
        raise SystemExit(f"{name} failed (exit {proc.returncode}); the end of {log}:\n{log.read_text()[-3000:]}")
    return round(time.perf_counter() - started, 1)


PEER_MAIN = {"specforge": _specforge_main, "speculators": _speculators_main}
PEER_STEPS = {"specforge": (convert_specforge, train_specforge, export_specforge),
              "speculators": (convert_speculators, train_speculators, export_speculators)}


def train_peer(name: str, settings: str, args, referee: Referee, out: Path) -> Row:
    """Convert (once per peer and dtype), train and export one peer run, and measure its export."""
    run = out / f"{name}-{settings}"
    result_path = run / "result.json"
    cfg = referee.recipe.cfg
    dtype = "bfloat16" if referee.recipe.acc.mixed_precision == "bf16" else "float32"
    if settings == "matched":
        chosen = (matched_specforge if name == "specforge" else matched_speculators)(cfg, dtype)
    else:
        chosen = {}
    if not result_path.exists():
        shutil.rmtree(run, ignore_errors=True)  # an unfinished run: a peer would resume its epochs from it
        convert, train, export = PEER_STEPS[name]
        tokenized, shards = referee.feature_dirs()
        feature_dtype = chosen.get("torch_dtype", SPECFORGE_DEFAULTS["torch_dtype"])
        if name == "specforge":
            data = convert(tokenized, shards, out / f"features-specforge-{feature_dtype}", feature_dtype)
        else:
            data = convert(tokenized, shards, referee, out / "features-speculators")
        result = train(data, referee, run, args.steps, chosen, cfg.trainer.batch_size)
        head = export(Path(result["checkpoint"]), referee, run / "export")
        result_path.write_text(json.dumps({**result, "checkpoint": str(result["checkpoint"]), "head": str(head)},
                                          indent=1) + "\n")
    result = json.loads(result_path.read_text())
    measured = referee.measure(Path(result["head"]))
    return Row(name, settings, args.steps, result["tokens"], round(result["train_s"], 2), result["wall_s"],
               round(result["tokens"] / result["train_s"], 1), round(measured["heldout_tau_greedy"], 4),
               measured["heldout_tau_greedy_by_category"], round(measured["heldout_top1"], 4), result["head"],
               notes={"settings": chosen, "final_loss": result.get("final_loss"),
                      **({"not_matched": MATCHED_GAPS[name]} if settings == "matched" else {})})


# --- the table ---------------------------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    categories = sorted({c for r in rows for c in r.heldout_tau_by_category})
    head = ["trainer", "settings", "steps", "tokens/s", "train s", "held-out τ", "top-1", *categories]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([r.trainer, r.settings, f"{r.steps:,}", f"{r.tokens_per_s:,.0f}",
                                        f"{r.train_s:,.1f}", f"{r.heldout_tau:.3f}", f"{r.heldout_top1:.3f}",
                                        *(f"{r.heldout_tau_by_category[c]:.2f}" if c in r.heldout_tau_by_category
                                          else "–" for c in categories)]) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "_peer":  # the training subprocess of one peer
        raise SystemExit(PEER_MAIN[sys.argv[2]](sys.argv[3:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="JSONL records with answers (a prepared regenerated.jsonl)")
    ap.add_argument("--steps", type=int, default=1000, help="training steps, every trainer")
    ap.add_argument("--heldout", type=int, default=100, help="records held out (trainer.heldout=per_category)")
    ap.add_argument("--trainers", default=",".join(TRAINERS))
    ap.add_argument("--settings", default=",".join(SETTINGS), help="the peers' runs: matched, defaults or both")
    ap.add_argument("--out", default="runs/peers")
    ap.add_argument("--data-cache", default=None, help="the records' and features' cache (default: <out>/data); "
                                                       "another run's, to train on exactly its records")
    ap.add_argument("--overrides", nargs="*", default=[], help="Hydra overrides of draftsmith's recipe")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    trainers = [t for t in args.trainers.split(",") if t]
    settings = [s for s in args.settings.split(",") if s]
    unknown = sorted(set(trainers) - set(TRAINERS)) + sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise SystemExit(f"unknown trainers or settings {unknown}: trainers are {TRAINERS}, settings {SETTINGS}")
    for name in trainers:
        if name != "draftsmith" and not PEERS[name].is_dir():
            raise SystemExit(f"{name} is not installed at {PEERS[name]}: `make install` installs it")
    out.mkdir(parents=True, exist_ok=True)
    rows = [train_draftsmith(args, out)] if "draftsmith" in trainers else []
    referee = Referee(args, out)
    rows += [train_peer(name, s, args, referee, out) for name in trainers if name != "draftsmith" for s in settings]
    if "draftsmith" in trainers:  # its own run measured by the same referee: the number the others are set beside
        again = referee.measure(Path(rows[0].head))
        rows[0].notes["referee_tau"] = round(again["heldout_tau_greedy"], 4)
    text = table(rows)
    (out / "peers.json").write_text(json.dumps({"data": args.data, "steps": args.steps, "heldout": args.heldout,
                                                "overrides": args.overrides, "rows": [asdict(r) for r in rows]},
                                               indent=2) + "\n")
    (out / "peers.md").write_text(text)
    print(text + f"written: {out / 'peers.json'}, {out / 'peers.md'}")


if __name__ == "__main__":
    main()
