"""Recipe: fine-tune or distil a standalone draft LM for a target, on Accelerate.

    python -m train drafter=draft_lm                       # toy world, forward KL from the off-the-shelf draft
    python -m train drafter=draft_lm drafter.loss=tvd drafter.on_policy.ratio=0.5
    accelerate launch --multi_gpu --num_processes 2 -m train drafter=draft_lm hydra.run.dir=runs/ddp

setup -> train -> save_checkpoint / evaluate_heldout (every N steps) -> finish -> cleanup.

Objectives (`drafter.loss`, see train/losses.py): `sft` on the target's regenerated responses
(sequence-level distillation), or token-level `forward_kl`, `reverse_kl`, `jsd` (beta) and `tvd`
against the target's logits, computed online in each step or, with `drafter.target_logits=cached`, its
top-k log-probabilities computed once (train/logit_cache.py); `drafter.on_policy.ratio` replaces that share of steps by
sequences the draft samples itself, scored by the target. The best checkpoint is chosen by a
held-out estimate, not by the loss: the acceptance sum_x min(p, q) or, with `trainer.select_by=top1`,
greedy top-1 agreement, on `trainer.eval_examples` records of the training traffic (its last ones, or as
many of each category: `trainer.heldout`), which training never reads; the final evaluation measures the
held-out traffic (`data.eval_path`, or the built-in world's held-out file; see eval.run.held_out_path), so
its numbers are not the ones the checkpoint was chosen on.

Data order is a seeded permutation per epoch and every random choice is seeded by the step, so a run
resumed from a checkpoint continues exactly as the uninterrupted run would have.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import sys
import time
import zlib
from collections import Counter
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from traffic import checkpoint
from train.losses import DIVERGENCES, acceptance_estimate, divergence, divergence_topk, greedy_agreement, sft

log = logging.getLogger(__name__)
LOSSES = ("sft", *DIVERGENCES)


def held_out_indices(categories: list[str], n: int, how: str = "last") -> list[int]:
    """Which records (given by their categories, in file order) training holds out to choose its checkpoint:
    the last n (`last`), or n taken in turn from the end of each category's records (`per_category`), so
    every category weighs alike in the choice and in the held-out τ. In file order."""
    if how == "last":
        return list(range(max(0, len(categories) - n), len(categories)))
    if how != "per_category":
        raise ValueError(f"trainer.heldout must be last or per_category, got {how!r}")
    newest_first: dict[str, list[int]] = {}
    for i in reversed(range(len(categories))):
        newest_first.setdefault(categories[i], []).append(i)
    queues = [newest_first[c] for c in sorted(newest_first)]
    chosen: list[int] = []
    for rank in range(max(map(len, queues), default=0)):
        chosen += [q[rank] for q in queues if rank < len(q)][: n - len(chosen)]
        if len(chosen) == n:
            break
    return sorted(chosen)


def cpu_multiplies_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX), where bf16 matrix products run
    several times faster than float32 (BENCHMARKS.md section 13.10); without them bf16 is emulated."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def mixed_precision(precision: str, on_cpu: bool) -> str:
    """trainer.precision as Accelerate takes it: `auto` is bf16 where the hardware multiplies bf16 natively,
    else no (float32)."""
    if precision not in ("no", "bf16", "fp16", "auto"):
        raise ValueError(f"trainer.precision must be no, bf16, fp16 or auto, got {precision!r}")
    if precision != "auto":
        return precision
    if on_cpu:
        return "bf16" if cpu_multiplies_bf16() else "no"
    return "bf16" if torch.cuda.is_bf16_supported() else "no"


def _pad(rows: list[list[int]], value: int, left: bool = False) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([([value] * (width - len(r)) + r) if left else (r + [value] * (width - len(r))) for r in rows])


def _records_batch(rows, pad_id: int, max_length: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Tokenized records (input_ids, loss_mask), cut at max_length and right-padded: input_ids,
    attention_mask and loss_mask (B, T) on `device`."""
    return {"input_ids": _pad([r["input_ids"][:max_length] for r in rows], pad_id).to(device),
            "attention_mask": _pad([[1] * min(len(r["input_ids"]), max_length) for r in rows], 0).to(device),
            "loss_mask": _pad([r["loss_mask"][:max_length] for r in rows], 0).to(device)}


class DistillRecipe:
    """One training run of a standalone draft LM (see the module docstring)."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.step = 0
        self.best: dict | None = None
        self._perms: dict[int, torch.Tensor] = {}  # the current epoch's permutation of the training set

    # --- setup ------------------------------------------------------------------------------------

    def setup(self) -> None:
        self._setup_accelerator()
        self._setup_data()
        self._setup_models()
        self._setup_optimizer()
        self._setup_tracking()
        self._maybe_resume()

    def _setup_accelerator(self) -> None:
        from accelerate import Accelerator

        t = self.cfg.trainer
        if self.cfg.evaluate.enabled and self.cfg.evaluate.engine:  # fail now, not after training
            from eval import engine

            engine.check(self.cfg.evaluate.engine, engine.EngineCosts(), runs=("llamacpp",))
        if t.select_by not in ("acceptance", "top1"):
            raise ValueError(f"trainer.select_by must be acceptance or top1, got {t.select_by!r}")
        if t.max_steps < 0:
            raise ValueError(f"trainer.max_steps must be 0 (evaluate the starting weights only) or more, "
                             f"got {t.max_steps}")
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
        from accelerate.utils import DistributedType

        kind = self.acc.distributed_type
        if kind == DistributedType.DEEPSPEED:
            raise ValueError("DeepSpeed is not supported: its engine keeps weights and optimizer state partitioned "
                             "outside torch's state-dict API, which draftsmith's checkpoints use. Use FSDP or DDP "
                             "(`accelerate config`)")
        if kind == DistributedType.FSDP and self.cfg.drafter.lora.enabled:
            raise ValueError("drafter.lora with FSDP is not supported: merging LoRA into the weights on save needs "
                             "unsharded weights. Use DDP, or train without LoRA")

    def _validate(self) -> None:
        if self.cfg.drafter.loss not in LOSSES:
            raise ValueError(f"drafter.loss must be one of {list(LOSSES)}, got {self.cfg.drafter.loss!r}")
        if self.cfg.drafter.loss == "sft" and self.cfg.drafter.on_policy.ratio > 0:
            raise ValueError("on-policy data needs a divergence loss (the target scores the draft's samples); "
                             "drafter.loss=sft has no target logits to learn from")
        if self.cfg.drafter.target_logits not in ("online", "cached"):
            raise ValueError(f"drafter.target_logits must be online or cached, got {self.cfg.drafter.target_logits!r}")
        if self.cfg.drafter.loss == "sft" and self.cfg.drafter.target_logits == "cached":
            raise ValueError("drafter.target_logits=cached needs a divergence loss; drafter.loss=sft reads no logits")
        if not 0 <= self.cfg.drafter.on_policy.ratio <= 1:
            raise ValueError(f"drafter.on_policy.ratio must be in [0, 1], got {self.cfg.drafter.on_policy.ratio}")

    def _setup_data(self) -> None:
        import datasets

        from eval.run import load_target, reading, resolve_data, target_source
        from drafters.sampling import Sampling
        from traffic.records import load_records
        from train.prepare import prepare
        from train.regenerate import answer_writer

        cfg = self.cfg
        # The held-out examples that choose the best checkpoint are `trainer.eval_examples` records of the
        # training traffic (the last ones, or as many of each category: trainer.heldout): never trained on, and
        # never the prompts the final evaluation measures (those come from the held-out traffic), so the
        # reported numbers are not selected on.
        records, summary = load_records(resolve_data(cfg.data.path), **reading(cfg.data))
        log.info("%s: %s", cfg.data.path, summary)
        held, how = cfg.trainer.eval_examples, cfg.trainer.heldout
        if len(records) <= held:
            raise ValueError(f"{cfg.data.path}: {len(records)} usable records, but training holds "
                             f"{'the last ' if how == 'last' else ''}trainer.eval_examples={held} out to choose the "
                             f"best checkpoint; lower trainer.eval_examples or add records")
        held_idx = held_out_indices([r.category for r in records], held, how)
        held_records, held_set = [records[i] for i in held_idx], set(held_idx)
        train_records = [r for i, r in enumerate(records) if i not in held_set]
        n_train = len(train_records)
        if cfg.data.max_records is not None:
            n_train = min(n_train, cfg.data.max_records)
        self.trained_on = {"path": cfg.data.path, "records": n_train, "checkpoint_chosen_on": held,
                           "categories": dict(Counter(r.category for r in train_records[:n_train]))}
        missing = sorted(set(self.trained_on["categories"]) - {r.category for r in held_records})
        if missing and self.is_main:
            # The checkpoint is then chosen on traffic unlike part of what the drafter serves.
            fix = ("order the file so its end mixes every category, or set trainer.heldout=per_category"
                   if how == "last" else f"raise trainer.eval_examples to at least {len(set(r.category for r in records))}")
            msg = (f"the {held} records that choose the best checkpoint (trainer.heldout={how} of {cfg.data.path}) "
                   f"hold no {', '.join(missing)} records; {fix}")
            log.warning(msg)
            print(f"warning: {msg}")
        if cfg.evaluate.enabled:  # read now, so a bad held-out file fails before training, not after it
            self.eval_traffic = self._final_eval_traffic(held_records, summary)
        # The target is loaded once here; prepare() regenerates with it and training scores with it.
        self.target, self.tokenizer = load_target(target_source(cfg.target), device=self.device, dtype=cfg.target.dtype,
                                                  trust_remote_code=cfg.target.trust_remote_code,
                                                  chat_template=cfg.target.chat_template)
        self.target.requires_grad_(False)
        regen = OmegaConf.to_container(cfg.regenerate, resolve=True)
        sampling = Sampling(regen["temperature"], regen["top_k"], regen["top_p"])
        splits = {"train": (train_records[:n_train], [n_train]), "eval": (held_records, [how, held])}
        self.data_dirs = {}
        for split, (chosen, which) in splits.items():
            # Keyed by the records' content, not the path: a file edited in place is prepared anew.
            content = [[r.id, r.category, r.messages] + ([r.tools] if r.tools else []) for r in chosen]
            key = zlib.crc32(json.dumps([target_source(cfg.target), content, regen, *which]).encode())
            directory = Path(cfg.data_cache) / f"{cfg.target.name}-{split}-{key:08x}"
            self.data_dirs[split] = directory
            with self.acc.main_process_first():  # rank 0 regenerates; the others then read its cache
                if not (directory / "prepare.json").exists():
                    with answer_writer(regen, self.tokenizer, target_source(cfg.target), chosen, work=directory,
                                       max_new_tokens=regen["max_new_tokens"]) \
                            if regen["enabled"] else contextlib.nullcontext() as writer:
                        prepare(chosen, self.target, self.tokenizer, directory, sampling=sampling,
                                regenerate_responses=regen["enabled"], max_new_tokens=regen["max_new_tokens"],
                                on_bad_record=cfg.data.on_bad_record, progress=cfg.progress and self.is_main,
                                writer=writer)
        self.train_set = datasets.load_from_disk(str(self.data_dirs["train"] / "tokenized"))
        held_out = datasets.load_from_disk(str(self.data_dirs["eval"] / "tokenized"))
        self.eval_set = held_out.select(range(min(len(held_out), cfg.trainer.eval_examples)))
        self.logit_cache = None
        if cfg.drafter.get("target_logits") == "cached":
            self._setup_logit_cache()

    def _setup_logit_cache(self) -> None:
        """The target's top-k log-probabilities over the training set, computed once (rank 0) and shared."""
        from train.logit_cache import LogitCache, write_logit_cache
        from train.shards import complete

        t, d = self.cfg.trainer, self.cfg.drafter
        directory = self._cache_dir("logits", t.max_length, d.cached_top_k, d.temperature)
        with self.acc.main_process_first():
            if not complete(directory):
                write_logit_cache(self._training_examples(), self.target, directory, top_k=d.cached_top_k,
                                  temperature=d.temperature, batch_size=t.batch_size,
                                  progress=self.cfg.progress and self.is_main)
        self.logit_cache = LogitCache(directory)

    def _cache_dir(self, prefix: str, *settings) -> Path:
        """Where a cache computed from the training set with these settings lives (under data_cache)."""
        key = zlib.crc32(json.dumps([str(self.data_dirs["train"]), *settings]).encode())
        return Path(self.cfg.data_cache) / f"{prefix}-{key:08x}"

    def _training_examples(self) -> list:
        """The training set as the steps see it: truncated to trainer.max_length."""
        from traffic.records import Example

        limit = self.cfg.trainer.max_length
        return [Example(r["id"], r["category"], r["input_ids"][:limit], r["loss_mask"][:limit])
                for r in self.train_set]

    def _setup_models(self) -> None:
        from transformers import AutoModelForCausalLM

        from drafters.draft_lm import check_same_vocabulary

        d = self.cfg.drafter
        if d.kind != "draft_lm":
            raise ValueError(f"this recipe trains drafter.kind=draft_lm, got {d.kind!r}")
        from eval.run import target_source
        from traffic import models

        # The model training starts from, and the baseline the final evaluation measures it against.
        if d.init_from:
            self.init_path, self.init_name = models.resolve(d.init_from), "off_the_shelf"
        elif d.get("init_layers"):  # a target without a smaller sibling: its own first layers and head
            source = models.resolve(target_source(self.cfg.target))
            self.init_path, self.init_name = str(models.self_draft(source, d.init_layers)), "self_draft"
        else:
            raise ValueError("drafter.init_from is not set: the draft model to start from (hub id or directory), or "
                             "drafter.init_layers=N to start from the target's own first N layers")
        model = AutoModelForCausalLM.from_pretrained(self.init_path, dtype=torch.float32,
                                                     trust_remote_code=self.cfg.target.trust_remote_code)
        check_same_vocabulary(self.tokenizer, None, self.target.get_output_embeddings().weight.shape[0],
                              model.get_output_embeddings().weight.shape[0], d.init_from)
        if d.lora.enabled:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=d.lora.r, lora_alpha=d.lora.alpha, lora_dropout=d.lora.dropout,
                                                     target_modules=d.lora.target_modules, task_type="CAUSAL_LM"))
        self.model = model.to(self.device)

    def _setup_optimizer(self) -> None:
        t = self.cfg.trainer
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))

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
            import os

            import wandb

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
            return
        state = checkpoint.load(path, self.model, self.optimizer, self.scheduler)
        self.step = state["step"]
        self.best = state.get("best")
        log.info("resumed from %s at step %d", path, self.step)

    # --- data -------------------------------------------------------------------------------------

    def _batch_indices(self, step: int) -> list[int]:
        """This process's example indices for micro-batches of `step`: a seeded permutation per epoch,
        the global batch split across processes. A function of the step alone, so resume is exact."""
        t = self.cfg.trainer
        global_batch = t.batch_size * self.acc.num_processes * t.grad_accum
        n = len(self.train_set)
        out = []
        for pos in range(step * global_batch, (step + 1) * global_batch):
            epoch, offset = divmod(pos, n)
            if epoch not in self._perms:
                self._perms = {epoch: torch.randperm(n, generator=torch.Generator().manual_seed(t.seed * 100_003 + epoch))}
            out.append(int(self._perms[epoch][offset]))
        return out[self.acc.process_index :: self.acc.num_processes]

    def _collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        rows = self.train_set.select(indices) if indices else []
        limit = self.cfg.trainer.max_length
        ids = [r["input_ids"][:limit] for r in rows]
        masks = [r["loss_mask"][:limit] for r in rows]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        batch = {"input_ids": _pad(ids, pad).to(self.device),
                 "attention_mask": _pad([[1] * len(i) for i in ids], 0).to(self.device),
                 "loss_mask": _pad(masks, 0).to(self.device)}
        if self.logit_cache is not None and indices:
            logp, idx = self.logit_cache.dense(indices, batch["input_ids"].shape[1])
            batch.update(top_logp=logp.to(self.device), top_idx=idx.to(self.device))
        return batch

    @torch.no_grad()
    def _on_policy(self, batch: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
        """Replace the responses by the draft's own samples: prompt = everything before the first
        assistant token; the loss covers the sampled tokens (through EOS)."""
        op = self.cfg.drafter.on_policy
        prompts = []
        for ids, attn, mask in zip(batch["input_ids"], batch["attention_mask"], batch["loss_mask"]):
            first = int(mask.nonzero()[0]) if mask.any() else int(attn.sum())
            prompts.append(ids[:first].tolist())
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        inputs = _pad(prompts, pad, left=True).to(self.device)
        attn = _pad([[1] * len(p) for p in prompts], 0, left=True).to(self.device)
        torch.manual_seed(self.cfg.trainer.seed * 7_919 + step)  # the draws depend on the step only
        model = self.acc.unwrap_model(self.model)
        out = model.generate(input_ids=inputs, attention_mask=attn, do_sample=True, temperature=op.temperature,
                             max_new_tokens=op.max_new_tokens, pad_token_id=pad,
                             eos_token_id=self.tokenizer.eos_token_id)
        gen = out[:, inputs.shape[1]:]
        # Keep generated tokens through the first EOS; HF pads finished rows with pad_token_id.
        eos = (gen == self.tokenizer.eos_token_id).int()
        after_eos = (eos.cumsum(1) - eos) > 0
        gen_mask = ~after_eos
        mask = torch.cat([torch.zeros_like(inputs), gen_mask.long()], dim=1)
        full_attn = torch.cat([attn, gen_mask.long()], dim=1)
        return {"input_ids": out, "attention_mask": full_attn, "loss_mask": mask}

    # --- training ---------------------------------------------------------------------------------

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        d = self.cfg.drafter
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        # Logits at position t predict token t+1: the mask of the predicted token selects the position.
        mask = batch["loss_mask"][:, 1:]
        if d.loss == "sft":
            return sft(logits[:, :-1], batch["input_ids"][:, 1:], mask)
        if "top_idx" in batch:  # cached top-k target log-probabilities (on-policy batches never have them)
            return divergence_topk(d.loss, logits[:, :-1], batch["top_logp"], batch["top_idx"], mask,
                                   temperature=d.temperature, beta=d.beta)
        with torch.no_grad():
            target_logits = self.target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return divergence(d.loss, logits[:, :-1], target_logits[:, :-1], mask, temperature=d.temperature, beta=d.beta)

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
            on_policy = random.Random(t.seed * 1_000_003 + self.step).random() < self.cfg.drafter.on_policy.ratio
            indices = self._batch_indices(self.step)
            micro = [indices[i * t.batch_size:(i + 1) * t.batch_size] for i in range(t.grad_accum)]
            total = torch.zeros((), device=self.device)
            for i, chunk in enumerate(micro):
                batch = self._collate(chunk)
                if on_policy:
                    batch = self._on_policy(batch, self.step)
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
            # after it); tokens_per_s: every step since this process started, evaluations included.
            record = {"step": self.step, "loss": mean_loss, "on_policy": on_policy, "lr": self.scheduler.get_last_lr()[0],
                      "grad_norm": float(grad_norm), "step_s": now - step_started,
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
        """Expected acceptance sum_x min(p, q) and greedy top-1 agreement with the target on held-out
        assistant tokens; keeps the best model by the one `trainer.select_by` names."""
        self.model.eval()
        acc_sum = agree_sum = count = 0.0
        bs = self.cfg.trainer.batch_size
        for start in range(0, len(self.eval_set), bs):
            rows = self.eval_set.select(range(start, min(start + bs, len(self.eval_set))))
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            batch = _records_batch(rows, pad, self.cfg.trainer.max_length, self.device)
            ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"][:, 1:]
            q = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            p = self.target(input_ids=ids, attention_mask=attn).logits[:, :-1]
            n = float(mask.sum())
            acc_sum += float(acceptance_estimate(q, p, mask)) * n
            agree_sum += float(greedy_agreement(q, p, mask)) * n
            count += n
        self.model.train()
        result = {"heldout_acceptance": acc_sum / count, "heldout_top1": agree_sum / count}
        key = self.cfg.trainer.select_by  # acceptance | top1
        if self.best is None or result[f"heldout_{key}"] > self.best[key]:
            self.best = {"acceptance": result["heldout_acceptance"], "top1": result["heldout_top1"], "step": self.step}
            self._save_best()
        return result

    def _save_best(self) -> None:
        """The best model so far, in Hugging Face format (LoRA merged) with the target's tokenizer."""
        self.acc.wait_for_everyone()
        model = self.acc.unwrap_model(self.model)
        state = None if self.cfg.drafter.lora.enabled else checkpoint.full_model_state(self.model)  # collective
        if not self.is_main:
            return
        if self.cfg.drafter.lora.enabled:  # never sharded (see _check_distributed)
            import copy

            model = copy.deepcopy(model).merge_and_unload()
        tmp = self.out / "best.tmp"
        model.save_pretrained(tmp, state_dict=state)
        self.tokenizer.save_pretrained(tmp)
        (tmp / "best.json").write_text(json.dumps(self.best) + "\n")
        final = self.out / "best"
        if final.exists():
            import shutil

            shutil.rmtree(final)
        tmp.rename(final)

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
        from train.export import export

        written = export(self.out, self.out / "export", OmegaConf.to_object(self.cfg.export))  # an ExportSettings
        for name, path in written.items():
            print(f"exported {name}: {path}")
        return {name: str(path) for name, path in written.items()}

    def _final_specs(self) -> list[dict]:
        """The final evaluation's drafters as `python -m eval` specs: baseline first, the model training started
        from (the off-the-shelf draft, or the self-draft of `drafter.init_layers`), then `evaluate.drafters`, then
        the best trained one (reloaded from disk)."""
        return [{"name": self.init_name, "kind": "draft_lm", "path": str(self.init_path)}, *self._extra_specs(),
                {"name": f"trained_{self.cfg.drafter.loss}", "kind": "draft_lm", "path": str(self.out / "best")}]

    def _extra_specs(self) -> list[dict]:
        return [OmegaConf.to_container(spec, resolve=True) for spec in self.cfg.evaluate.drafters]

    def _final_eval_traffic(self, held_records: list, summary):
        """The traffic the final evaluation measures: the held-out file, or the records training held out
        (`held_records`, read as training read them: split, bad-record policy)."""
        from eval.run import Traffic, held_out_path, read_traffic, reading

        cfg = self.cfg
        eval_path = held_out_path(cfg.data.path, cfg.data.eval_path)
        if eval_path is not None:
            return read_traffic(eval_path, **reading(cfg.data))
        # One file: measure the records training held out, never the trained-on ones.
        log.warning("data.eval_path is not set: the final evaluation reads the %d records of %s held out of "
                    "training (trainer.heldout=%s), which also chose the best checkpoint; set data.eval_path to "
                    "separate traffic for an unbiased measurement", len(held_records), cfg.data.path,
                    cfg.trainer.heldout)
        return Traffic(cfg.data.path, held_records, summary, len(held_records), held_out_by=cfg.trainer.heldout)

    def _final_eval(self) -> str:
        from eval import engine
        from eval.evaluate import EvalPlan, evaluate
        from eval.report import build_report, console_summary, write_report
        from eval.run import build_drafter, prompt_budget, resolve_specs, target_source, tokenize_prompts

        e, cfg, traffic = self.cfg.evaluate, self.cfg, self.eval_traffic
        self.target.eval()
        limit, why = prompt_budget(self.target.config, e.max_new_tokens, cfg.data.max_prompt_tokens)
        prompts = tokenize_prompts(traffic, self.tokenizer, device=self.device, max_per_category=e.prompts_per_category,
                                   max_prompt_tokens=limit, why=why, on_bad_record=cfg.data.on_bad_record)
        specs = resolve_specs(self._final_specs(), target_source(cfg.target), e.engine)
        drafters = [build_drafter(spec, target=self.target, tokenizer=self.tokenizer) for spec in specs
                    if spec["kind"] != "llamacpp"]
        plan = EvalPlan(ks=list(e.ks), trees=list(e.trees), batch_sizes=list(e.batch_sizes),
                        max_new_tokens=e.max_new_tokens, repeats=e.repeats, seed=cfg.trainer.seed)
        # The drafters in the engine's formats first, as `python -m eval` does: a conversion that fails stops the
        # run before the measurement, not after it.
        converted = engine.convert(e.engine, specs, self.target, target_source(cfg.target), self.out / "engine")
        rows = evaluate(self.target, drafters, prompts, plan, eos_token_id=self.tokenizer.eos_token_id,
                        progress=cfg.progress)
        in_engine = engine.add_figures(rows, specs, self.target, target_source(cfg.target), prompts, plan, engine=e.engine,
                                       costs=engine.EngineCosts(), threads=torch.get_num_threads(),
                                       work=self.out / "engine", converted=converted, progress=cfg.progress)
        engine_rows = in_engine.pop("engine_only", []) if in_engine else []
        report = build_report(rows, target=target_source(cfg.target), baseline=drafters[0].name, engine_rows=engine_rows,
                              settings={"data": traffic.describe(prompts), "trained_on": self.trained_on,
                                        "ks": list(e.ks), "trees": list(e.trees), "batch_sizes": list(e.batch_sizes),
                                        "max_new_tokens": e.max_new_tokens, "repeats": e.repeats,
                                        "pays_off_at": plan.pays_off_at, "engine": in_engine})
        paths = write_report(report, self.out)
        print(console_summary(report))
        print(f"\nreport: {paths['md']}")
        return str(paths["json"])

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


def run(cfg: DictConfig, recipe_class: type[DistillRecipe] | None = None) -> dict:
    """setup, train, finish, cleanup: what `python -m train drafter=draft_lm` does (another recipe
    class, e.g. train.heads.HeadRecipe, runs the same way)."""
    recipe = (recipe_class or DistillRecipe)(cfg)
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
