"""speculators 0.9.0 (`speculators train`) on draftsmith's records and features.

What it reads: a `datasets` directory (input_ids, loss_mask, seq_len; torch format) and, for record i,
hidden_states/hs_{i}.safetensors: token_ids (T,) and hidden_states (T, 4, d), the auxiliary layers then the target's
last state BEFORE its final norm, which it turns into the teacher's logits with the target's own norm and output
rows. draftsmith caches the state after the norm; the norm maps state / weight back to that state (an RMS norm
ignores its input's scale), so the converter stores that, exact for the labels, without a target forward.
Alignment: its loss_mask[t] trains the distribution at position t (the one predicting token t+1); draftsmith marks
token t. The converter stores loss_mask'[t] = loss_mask[t+1]. The draft vocabulary is handed over as d2t-N.npy /
t2d-N.npy beside the data (draftsmith's own maps: both use offsets and a mask).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

from peers import elapsed_at, on_cpu, on_path, pin_threads, run_peer

# On a CPU: SDPA attention (flex attention has no backward on a CPU; eager materialises the scores: 3x slower) and
# the eager losses (the fused ones need Triton). Everywhere: no vLLM server for missing features, and the same
# dataloader workers as the other trainers (none).
CPU = {"draft_attn_impl": "sdpa", "loss_implementation": "eager"}
COMMON = {"on_missing": "raise", "num_workers": 0}
DEFAULTS_TTT = 3  # its --ttt-steps default
RUNGS = {"+lr": ["optimizer", "lr", "weight_decay"], "+schedule": ["scheduler_type", "scheduler_warmup_steps"],
         "+ttt": ["ttt_steps", "ttt_step_loss_decay"]}
GAPS = ("its batches pack records to a token budget (the records' mean length × records per step) where draftsmith "
        "pads a fixed number of records; cosine to 0; AdamW betas (0.9, 0.999); one record of the training set held "
        "back for its own validation split")


def matched(cfg, dtype: str) -> dict:
    t, d = cfg.trainer, cfg.drafter
    return {"optimizer": "adamw", "lr": t.lr, "weight_decay": t.weight_decay, "scheduler_type": "cosine",
            "scheduler_warmup_steps": t.warmup_steps, "ttt_steps": d.ttt_steps, "ttt_step_loss_decay": d.ttt_decay,
            # plain EAGLE-3, as draftsmith's head; attention over the whole sequence (its default: a 2,048-token
            # sliding window)
            "norm_before_fc": False, "norm_output": False, "norm_before_residual": False,
            "full_attention_indices": [0], "hidden_states_dtype": dtype,
            # the labels draftsmith's recipe trains on: the target's argmax (cross-entropy), or its softmax (KL)
            "loss_fn": "ce" if d.label_temperature == 0 else "kl_div"}


def depth(settings: dict) -> int:
    """The TTT depth the head trains: the one to replay it at too."""
    return settings.get("ttt_steps", DEFAULTS_TTT)


def convert(tokenized_dir: Path, shards_dir: Path, referee, out: Path, record) -> Path:
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
        item, ids, mask = record(rows, reader, i)
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


def train(data: Path, referee, out: Path, steps: int, settings: dict, batch_size: int, seed: int,
          threads: int, saves: list[int]) -> dict:
    """`speculators train` in a subprocess, its model saved after each of `saves` as checkpoints/step{N} (main's
    hook: its own checkpoints are one a epoch, each over the last)."""
    import datasets

    on_path("speculators")
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    out.mkdir(parents=True, exist_ok=True)
    lengths = datasets.load_from_disk(str(data)).with_format(None)["seq_len"]
    budget = round(batch_size * statistics.fmean(lengths))  # packed tokens a step: the records' mean length each
    ratio = (len(lengths) - 0.5) / len(lengths)  # its own validation split, which it requires: one record
    # The trainer runs every --epochs even past --max-steps (each further epoch one more step, a checkpoint and a
    # validation): the epochs are the fewest that hold the steps, counted with its own packing sampler.
    sampler = MultipackDistributedBatchSamplerV2(budget, lengths[: int(len(lengths) * ratio)], num_replicas=1, rank=0,
                                                 seed=seed)
    epochs = batches = 0
    while batches < steps:
        sampler.set_epoch(epochs)
        batches, epochs = batches + len(sampler), epochs + 1
    d2t, _ = referee.draft_vocabulary()
    options = {**(CPU if on_cpu() else {}), **COMMON, **settings, "verifier_name_or_path": str(referee.target_dir),
               "data_path": str(data), "target_layer_ids": referee.layers, "draft_vocab_size": d2t.numel(),
               "total_seq_len": budget, "train_data_ratio": ratio, "seed": seed, "max_steps": steps, "epochs": epochs,
               "checkpoint_freq": epochs, "save_path": str(out / "checkpoints"), "log_dir": str(out / "logs")}
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = {"BENCH_PEERS_METRICS": str(metrics), "BENCH_PEERS_SAVE_AT": ",".join(map(str, saves[:-1]))}
    wall = run_peer("speculators", _flags(options), env, out / "train.log", threads,
                    drop=("LOCAL_RANK", "RANK", "WORLD_SIZE"))
    logged = [m for m in map(json.loads, metrics.read_text().splitlines()) if "train" in m]
    checkpoint = max((d for d in (out / "checkpoints").iterdir() if d.name.isdigit() and not d.is_symlink()),
                     key=lambda d: int(d.name))
    # A save after step n runs once the step's clock has stopped and before the next step's starts: that step's
    # time holds it, taken out here.
    saved = [0.0] + [m.get("save_s", 0.0) for m in logged]
    seconds = [m["profile"]["step_ms"] / 1000 - saved[i] for i, m in enumerate(logged)]
    curve = [[step, at, str(checkpoint if step == steps else out / "checkpoints" / f"step{step}")]
             for step, at in zip(saves, elapsed_at(seconds, saves))]
    return {"wall_s": wall, "train_s": sum(seconds), "tokens": sum(m["profile"]["tokens"] for m in logged),
            "checkpoint": checkpoint, "curve": curve, "final_loss": logged[-1]["train"]["loss"] if logged else None}


def export(checkpoint: Path, referee, out: Path) -> Path:
    """speculators' own from_pretrained and save_pretrained (Eagle3Speculator, what `vllm serve <dir>` reads), with
    two fields its trainer's save leaves otherwise: `target_hidden_size` (null: vLLM then takes the draft's, the
    same value) and `architectures`, which transformers overwrites with the class name."""
    on_path("speculators")
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
    tokens (its profile's own count: tokens_per_s × step_ms). After each step in `save_at` (1-based) the trainer's
    model is saved to checkpoints/step{N} by its own checkpointer, and the seconds that took are on the line."""

    def __init__(self, path: str, save_at: set[int]) -> None:
        super().__init__()
        self.path, self.save_at, self.trainer = path, save_at, None

    def emit(self, record: logging.LogRecord) -> None:
        message = record.msg
        if isinstance(message, dict) and "train" in message and message.get("profile"):
            profile = message["profile"]
            profile = {**profile, "tokens": round(profile["tokens_per_s"] * profile["step_ms"] / 1000)}
            line = {**message, "profile": profile}
            step = message["global_step"] + 1
            if step in self.save_at:
                started = time.perf_counter()
                self.trainer.checkpointer.save_checkpoint(self.trainer.model, self.trainer.optimizers, f"step{step}")
                line["save_s"] = time.perf_counter() - started
            with open(self.path, "a") as f:
                f.write(json.dumps(line, default=str) + "\n")


def main(argv: list[str]) -> int:
    """In the training subprocess: the CPU shims where there is no accelerator, then `speculators train`."""
    on_path("speculators")
    pin_threads()
    from speculators.train import cli, trainer
    from speculators.train.config import TrainConfig

    if on_cpu():
        # Every logged step calls torch.accelerator.synchronize(), which raises where there is no accelerator.
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
    # Not a CPU fix: each step's metrics (its "speculators.metrics" logger) kept for bench_peers, and the model
    # saved at the time-to-τ curve's steps.
    lines = _MetricLines(os.environ["BENCH_PEERS_METRICS"],
                         {int(s) for s in os.environ.get("BENCH_PEERS_SAVE_AT", "").split(",") if s})
    setup = cli.setup_metric_logger

    def setup_and_keep(*args, **kwargs):
        setup(*args, **kwargs)
        logging.getLogger("speculators.metrics").addHandler(lines)

    cli.setup_metric_logger = setup_and_keep
    init_trainer = trainer.Trainer.__init__

    def init_and_keep(self, *args, **kwargs):
        init_trainer(self, *args, **kwargs)
        lines.trainer = self

    trainer.Trainer.__init__ = init_and_keep
    cli.main(TrainConfig.resolve(argv))
    return 0
