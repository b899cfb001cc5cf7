"""The training recipe every drafter kind shares, on Accelerate: the loop, the data, checkpoints and exact
resume, held-out evaluation, tracking, the final evaluation and export. A kind's recipe is a subclass that
sets up its model and says how it learns (train/distill.py: a standalone draft LM; train/heads.py: a head on
the target's hidden states):

    setup -> train -> save_checkpoint / evaluate_heldout (every N steps) -> finish -> cleanup.

What a subclass provides: `_setup_models` (self.model), `_loss(batch)`, `_score_heldout(batch)` (its held-out
scores per draft depth, train/heldout.py), `_write_best(directory, state)` (best/ in its format) and `_final_specs()`
(the final evaluation's drafters); optionally `_validate` (its settings, before any work), `_check_sharding`,
`_setup_data`, `_collate` and `_heldout_collate` (super() first, then its own), `_on_policy_step` and `_batch_for_step`
(steps on other data than the training set's).

The best checkpoint is chosen by a held-out figure, not by the loss (`trainer.select_by`: the same figure for
every kind, train/heldout.py), on `trainer.eval_examples` records of
the training traffic (its last ones, or as many of each category: `trainer.heldout`; train/data.py), which training
never reads; the final evaluation measures the held-out traffic (`data.eval_path`, or the built-in world's held-out
file; see eval.run.held_out_path), so its numbers are not the ones the checkpoint was chosen on.

Data order is a seeded permutation per epoch (grouped by length with `trainer.group_by_length`, train/data.py
`epoch_order`) and every random choice is seeded by the step, so a run resumed from a checkpoint continues exactly
as the uninterrupted run would have.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import shutil
import sys
import time
import zlib
from abc import ABC, abstractmethod
from pathlib import Path

import datasets
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from drafters.parallel import mask_token_for
from eval.engines import engine
from eval.config import checked_spec
from eval.run import check_draft_vocabulary, load_target, target_source
from traffic import checkpoint
from traffic.records import Example
from train.data import EpochOrders, prepare_splits, record_lengths, records_batch, split_records, warn_long_prompts
from train.export import export
from train.final_eval import final_eval, final_eval_traffic
from train.heldout import SELECT_BY, HeldoutScores, HeldoutTotals, best_record
from train.precision import mixed_precision
from train.resume import drop_metrics_after, point_to_unfinished_runs

log = logging.getLogger(__name__)


class Recipe(ABC):
    """One training run (see the module docstring); a kind's recipe subclasses it."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.step = 0
        self.best: dict | None = None
        self._order: EpochOrders | None = None  # the order each epoch reads the training set in

    # --- setup ------------------------------------------------------------------------------------

    def setup(self) -> None:
        self._setup_accelerator()
        self._setup_data()
        self._setup_models()
        self._setup_optimizer()
        self._setup_tracking()
        self._maybe_resume()

    def _setup_accelerator(self) -> None:
        t = self.cfg.trainer
        if self.cfg.evaluate.enabled and self.cfg.evaluate.engine:  # fail now, not after training
            engine.engine_for(self.cfg.evaluate.engine, engine.EngineCosts(), runs=("llamacpp",)).check(None)
        if t.select_by not in SELECT_BY:
            raise ValueError(f"trainer.select_by must be acceptance or top1, got {t.select_by!r}")
        if t.max_steps < 0:
            raise ValueError(f"trainer.max_steps must be 0 (evaluate the starting weights only) or more, "
                             f"got {t.max_steps}")
        self._extra_specs()  # a drafter entry with a key its kind does not have fails now, not after training
        self._validate()
        on_cpu = t.cpu or not torch.cuda.is_available()
        precision = mixed_precision(t.precision, on_cpu)
        if precision != t.precision:
            log.info("trainer.precision=auto: %s", precision)
        self.acc = Accelerator(cpu=on_cpu, mixed_precision=precision)
        self.device = self.acc.device
        self.is_main = self.acc.is_main_process
        self._check_distributed()
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            # The composed config, resolved: what `python -m train.export` reads (target, drafter kind, data).
            OmegaConf.save(OmegaConf.to_container(self.cfg, resolve=True), self.out / "train_config.yaml")
        torch.manual_seed(t.seed)
        random.seed(t.seed)

    def _check_distributed(self) -> None:
        """Refuse the set-ups whose weights this recipe cannot gather into a checkpoint."""
        kind = self.acc.distributed_type
        if kind == DistributedType.DEEPSPEED:
            raise ValueError("DeepSpeed is not supported: its engine keeps weights and optimizer state partitioned "
                             "outside torch's state-dict API, which draftsmith's checkpoints use. Use FSDP or DDP "
                             "(`accelerate config`)")
        self._check_sharding(kind)

    def _check_sharding(self, kind) -> None:
        """A recipe's own refusals of a distributed set-up (`kind`, Accelerate's DistributedType)."""

    def _validate(self) -> None:
        """The kind's own settings, checked before any work (nothing here)."""

    def _setup_data(self) -> None:
        cfg = self.cfg
        # The training set and the held-out examples that choose the best checkpoint (train/data.py).
        split = split_records(cfg, warn=self.is_main)
        self.trained_on = split.trained_on
        if cfg.evaluate.enabled:  # read now, so a bad held-out file fails before training, not after it
            self.eval_traffic = final_eval_traffic(cfg, split.held, split.summary)
        # The target is loaded once here; prepare() regenerates with it and training scores with it.
        self.target, self.tokenizer = self._load_target()
        self.target.requires_grad_(False)
        check_draft_vocabulary(self.target, cfg.target.off_the_shelf_draft, "target.off_the_shelf_draft")
        if cfg.evaluate.enabled and self.is_main:  # the prompts served past the windows the drafter trains on
            warn_long_prompts(cfg, self.eval_traffic, self.tokenizer)
        self.data_dirs = prepare_splits(cfg, split, self.target, self.tokenizer, self.acc,
                                        progress=cfg.progress and self.is_main)
        self.train_set = datasets.load_from_disk(str(self.data_dirs["train"] / "tokenized"))
        held_out = datasets.load_from_disk(str(self.data_dirs["eval"] / "tokenized"))
        self.eval_set = held_out.select(range(min(len(held_out), cfg.trainer.eval_examples)))

    def _load_target(self):
        """The target and its tokenizer, on this process's device: every weight, or a head's `drafter.target_weights`."""
        t = self.cfg.target
        return load_target(target_source(t), device=self.device, dtype=t.dtype, trust_remote_code=t.trust_remote_code,
                           chat_template=t.chat_template, weights=self.cfg.drafter.get("target_weights", "all"))

    def _cache_dir(self, prefix: str, *settings, split: str = "train") -> Path:
        """Where a cache computed from the training set (or the held-out one, `split="eval"`) with these settings
        lives (under data_cache)."""
        key = zlib.crc32(json.dumps([str(self.data_dirs[split]), *settings]).encode())
        return Path(self.cfg.data_cache) / f"{prefix}-{key:08x}"

    def _training_examples(self, rows=None) -> list:
        """The training set (or tokenized `rows`) as the steps see it: truncated to trainer.max_length."""
        limit = self.cfg.trainer.max_length
        return [Example(r["id"], r["category"], r["input_ids"][:limit], r["loss_mask"][:limit])
                for r in (self.train_set if rows is None else rows)]

    @abstractmethod
    def _setup_models(self) -> None:
        """self.model: the drafter to train, on self.device."""

    def _setup_optimizer(self) -> None:
        t = self.cfg.trainer
        if len(t.adam_betas) != 2 or not all(0 <= b < 1 for b in t.adam_betas):
            raise ValueError(f"trainer.adam_betas must be two numbers in [0, 1), got {list(t.adam_betas)}")
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, betas=tuple(t.adam_betas))

        def schedule(step: int) -> float:
            if step < t.warmup_steps:
                return (step + 1) / t.warmup_steps
            progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
            return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.model, self.optimizer = self.acc.prepare(self.model, self.optimizer)

    def _setup_tracking(self) -> None:
        self.metrics_path = self.out / "metrics.jsonl"
        self.wandb = None
        if self.cfg.tracking.wandb and self.is_main:
            import wandb  # optional: only with tracking.wandb=true

            self.wandb = wandb.init(project=self.cfg.tracking.project, entity=self.cfg.tracking.entity,
                                    dir=str(self.out), config=OmegaConf.to_container(self.cfg, resolve=True),
                                    mode="online" if os.environ.get("WANDB_API_KEY") else "offline", job_type="train")

    def _maybe_resume(self) -> None:
        resume = self.cfg.trainer.resume
        if resume == "none":
            return
        path = checkpoint.latest(self.out / "checkpoints") if resume == "auto" else Path(resume)
        if path is None:
            log.info("trainer.resume=auto: no complete checkpoint in %s, starting from scratch", self.out)
            if self.is_main:
                point_to_unfinished_runs(self.out)
            return
        state = checkpoint.load(path, self.model, self.optimizer, self.scheduler)
        self.step = state["step"]
        self.best = state.get("best")
        dropped = drop_metrics_after(self.metrics_path, self.step) if self.is_main else 0
        log.info("resumed from %s at step %d%s", path, self.step,
                 f" (dropped {dropped} metrics lines past it: the resumed run writes them again)" if dropped else "")

    # --- data -------------------------------------------------------------------------------------

    def _batch_indices(self, step: int) -> list[int]:
        """This process's example indices for micro-batches of `step`: a seeded order per epoch (train/data.py
        `epoch_order`, grouped by length with trainer.group_by_length), the global batch split across processes. A
        function of the step alone, so resume is exact."""
        t = self.cfg.trainer
        global_batch = t.batch_size * self.acc.num_processes * t.grad_accum
        if self._order is None:
            lengths = record_lengths(self.train_set, t.max_length) if t.group_by_length else None
            self._order = EpochOrders(len(self.train_set), t.seed, global_batch, lengths)
        out = [self._order[pos] for pos in range(step * global_batch, (step + 1) * global_batch)]
        return out[self.acc.process_index :: self.acc.num_processes]

    @property
    def pad_id(self) -> int:
        """The id batches are padded with: the tokenizer's pad token, else 0 (padding is masked out)."""
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def _mask_token(self, vocab_size: int) -> int:
        """The mask token of a parallel drafter's masked entries: `drafter.mask_token_id`, else the one the tokenizer
        offers (drafters/parallel.py `mask_token_for`); checked against the `vocab_size` rows that embed it."""
        configured = self.cfg.drafter.get("mask_token_id")
        mask = configured if configured is not None else mask_token_for(self.tokenizer, vocab_size)
        if not 0 <= mask < vocab_size:
            raise ValueError(f"drafter.mask_token_id {mask} is not a row of the draft's embedding (0..{vocab_size - 1})")
        if configured is None:
            log.info("%s's mask token: id %d (%r)", self.cfg.drafter.kind, mask,
                     self.tokenizer.convert_ids_to_tokens(mask) if mask < len(self.tokenizer) else "an unused embedding row")
        return int(mask)

    def _collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        return records_batch(self.train_set.select(indices) if indices else [], self.pad_id,
                              self.cfg.trainer.max_length, self.device)

    def _on_policy_step(self, step: int) -> bool:
        """Whether `step` trains on the drafter's own samples instead of the training set (never, here)."""
        return False

    def _batch_for_step(self, batch: dict[str, torch.Tensor], step: int, on_policy: bool) -> dict[str, torch.Tensor]:
        """The batch a step trains on, from the training set's (`batch`): itself, here."""
        return batch

    # --- training ---------------------------------------------------------------------------------

    @abstractmethod
    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The training loss of a batch (a scalar)."""

    def train(self) -> None:
        t = self.cfg.trainer
        bar = tqdm(total=t.max_steps, initial=self.step, desc="train", unit="step",
                   disable=not (self.cfg.progress and self.is_main), file=sys.stderr)
        tokens, started = 0, time.perf_counter()
        if t.max_steps == 0 and self.step == 0:  # evaluate only: the starting weights' held-out numbers, kept as best/
            self._log({"step": 0, **self.evaluate_heldout()})
        self.model.train()
        while self.step < t.max_steps:
            step_started = time.perf_counter()
            on_policy = self._on_policy_step(self.step)
            indices = self._batch_indices(self.step)
            micro = [indices[i * t.batch_size:(i + 1) * t.batch_size] for i in range(t.grad_accum)]
            total = torch.zeros((), device=self.device)
            step_tokens = tokens
            for i, chunk in enumerate(micro):
                batch = self._collate(chunk)
                batch = self._batch_for_step(batch, self.step, on_policy)
                tokens += int(batch["attention_mask"].sum())
                # Gradients are synchronised across processes only on the last micro-batch.
                ctx = self.acc.no_sync(self.model) if i < len(micro) - 1 else contextlib.nullcontext()
                with ctx:
                    loss = self._loss(batch) / len(micro)
                    self.acc.backward(loss)
                total += loss.detach()
            grad_norm = self.acc.clip_grad_norm_(self.model.parameters(), t.max_grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            mean_loss = self.acc.reduce(total, "mean").item()  # waits for the device: the step's time is its own
            now = time.perf_counter()
            # step_s: this step alone, its batch to its optimizer step (not the held-out evaluation or checkpoint
            # after it); tokens: this step's real tokens, every process's; tokens_per_s: every step since this
            # process started, evaluations included.
            record = {"step": self.step, "loss": mean_loss, "on_policy": on_policy, "lr": self.scheduler.get_last_lr()[0],
                      "grad_norm": float(grad_norm), "step_s": now - step_started,
                      "tokens": (tokens - step_tokens) * self.acc.num_processes,
                      "tokens_per_s": tokens * self.acc.num_processes / (now - started)}
            if self.step % t.eval_every == 0 or self.step == t.max_steps:
                record.update(self.evaluate_heldout())
            self._log(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}",
                            acc=f"{self.best['acceptance'] if self.best else float('nan'):.3f}", refresh=False)
            bar.update()
            if self.step % t.checkpoint_every == 0 or self.step == t.max_steps:
                self.save_checkpoint()
        bar.close()

    @torch.no_grad()
    def evaluate_heldout(self) -> dict:
        """The held-out figures of the model now (train/heldout.py), the best so far kept in self.best and written
        to best/. Every process scores the whole held-out set: nothing to gather."""
        self.model.eval()
        totals = HeldoutTotals()
        size = self._heldout_batch_size()
        for start in range(0, len(self.eval_set), size):
            indices = list(range(start, min(start + size, len(self.eval_set))))
            rows = self.eval_set.select(indices)
            batch = self._heldout_collate(rows, indices)
            answer = batch["loss_mask"].bool() & batch["attention_mask"].bool()
            totals.add(self._score_heldout(batch), [r["category"] for r in rows], answer)
        self.model.train()
        self.heldout_rounds = totals.per_record  # for intervals over records (scripts/bench_peers.py); not logged
        result = totals.figures()
        key = SELECT_BY[self.cfg.trainer.select_by]
        if self.best is None or result[f"heldout_{key}"] > self.best.get(key, float("-inf")):
            self.best = best_record(result, self.step)
            self._save_best()
        return result

    def _heldout_collate(self, rows, indices: list[int]) -> dict[str, torch.Tensor]:
        """The tensors of held-out `rows` (the records at `indices` of the held-out set)."""
        return records_batch(rows, self.pad_id, self.cfg.trainer.max_length, self.device)

    def _heldout_batch_size(self) -> int:
        """Held-out records scored at once."""
        return self.cfg.trainer.batch_size

    @abstractmethod
    def _score_heldout(self, batch: dict[str, torch.Tensor]) -> HeldoutScores:
        """The model's held-out scores on a batch of records (`_records_batch`'s tensors), per draft depth."""

    def _save_best(self) -> None:
        """best/: the best model so far, written whole into best.tmp/ and then renamed, so a run killed meanwhile
        keeps the previous best/ (or none), never half of one."""
        self.acc.wait_for_everyone()
        state = self._best_state()  # collective: every process takes part
        if not self.is_main:
            return
        tmp = self.out / "best.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self._write_best(tmp, state)
        (tmp / "best.json").write_text(json.dumps({**self.best, **self._best_notes()}) + "\n")
        final = self.out / "best"
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)

    def _best_state(self) -> dict | None:
        """The weights best/ saves, whole even when sharded (collective)."""
        return checkpoint.full_model_state(self.model)

    @abstractmethod
    def _write_best(self, directory: Path, state: dict | None) -> None:
        """Save the model (its `_best_state`) into `directory`, in the format the kind loads from."""

    def _best_notes(self) -> dict:
        """What best.json records beside the held-out figures (nothing, here)."""
        return {}

    def save_checkpoint(self) -> None:
        self.acc.wait_for_everyone()
        # Every process takes part (the states are gathered); the first one writes.
        checkpoint.save(self.out / "checkpoints", self.step, self.model, self.optimizer, self.scheduler,
                        extra={"best": self.best}, keep=self.cfg.trainer.keep_checkpoints)
        self.acc.wait_for_everyone()

    def _log(self, record: dict) -> None:
        if not self.is_main:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])

    # --- the end ----------------------------------------------------------------------------------

    def finish(self) -> dict:
        """Check that every process holds the same weights, then run the evaluation instrument
        (off-the-shelf draft as baseline, the best trained draft as candidate)."""
        weights = checkpoint.full_model_state(self.model, everywhere=True)  # whole, even when sharded
        checksum = torch.tensor([sum(float(t.double().sum()) for t in weights.values())], dtype=torch.float64,
                                device=self.device)
        sums = self.acc.gather(checksum).tolist()
        summary = {"steps": self.step, "best": self.best, "rank_checksums": sums}
        if len(set(sums)) != 1:
            raise RuntimeError(f"processes ended with different weights (checksums {sums})")
        if self.is_main:
            if self.cfg.evaluate.enabled:
                summary["report"] = self._final_eval()
            if self.cfg.export.formats:
                summary["export"] = self._export()
            (self.out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def _export(self) -> dict[str, str]:
        """The best drafter in the engines' formats, into <run>/export/ (see train/export.py)."""
        written = export(self.out, self.out / "export", OmegaConf.to_object(self.cfg.export))  # an ExportSettings
        for name, path in written.items():
            print(f"exported {name}: {path}")
        return {name: str(path) for name, path in written.items()}

    @abstractmethod
    def _final_specs(self) -> list[dict]:
        """The final evaluation's drafters as `python -m eval` specs, the baseline first."""

    def _extra_specs(self) -> list[dict]:
        """`evaluate.drafters`, each checked against its kind's keys (eval/config.py checked_spec)."""
        return [checked_spec(OmegaConf.to_container(spec, resolve=True)) for spec in self.cfg.evaluate.drafters]

    def _final_eval(self) -> str:
        self.target.eval()
        return final_eval(self.cfg, self.target, self.tokenizer, self.device, self.eval_traffic, self._final_specs(),
                          trained_on=self.trained_on, out=self.out)

    def cleanup(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        # Not acc.end_training(): it destroys the process group, after which the interpreter's exit frees the
        # DDP reducer and gloo's threads through destructors, and that aborts now and then ("terminate
        # called without an active exception", SIGABRT on one rank). The group stays up; every rank passes
        # a last barrier and the entry point leaves without destructors (see train/__main__.py).
        if torch.distributed.is_initialized():
            self.acc.wait_for_everyone()


_KEEP_ALIVE: list = []


def run(cfg: DictConfig, recipe_class: type[Recipe]) -> dict:
    """setup, train, finish, cleanup: what `python -m train` does with the kind's recipe class."""
    recipe = recipe_class(cfg)
    if torch.distributed.is_initialized() or "LOCAL_RANK" in os.environ:
        # Keep a distributed run's recipe (and its DDP reducer) alive until the process exits: freeing
        # the reducer joins gloo threads that wait for a peer that may already be gone (see __main__).
        _KEEP_ALIVE.append(recipe)
    recipe.setup()
    try:
        recipe.train()
        return recipe.finish()
    finally:
        recipe.cleanup()
