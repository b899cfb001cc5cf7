"""Recipe: fine-tune or distil a standalone draft LM for a target, on Accelerate.

    python -m train drafter=draft_lm                       # toy world, forward KL from the off-the-shelf draft
    python -m train drafter=draft_lm drafter.loss=tvd drafter.on_policy.ratio=0.5
    accelerate launch --multi_gpu --num_processes 2 -m train drafter=draft_lm hydra.run.dir=runs/ddp

The loop, data, checkpoints, held-out evaluation, tracking and final evaluation are train/recipe.py's.

Objectives (`drafter.loss`, see train/losses.py): `sft` on the target's regenerated responses
(sequence-level distillation), or token-level `forward_kl`, `reverse_kl`, `jsd` (beta) and `tvd`
against the target's logits, computed online in each step or, with `drafter.target_logits=cached`, its
top-k log-probabilities computed once (train/logit_cache.py); `drafter.on_policy.ratio` replaces that share of steps by
sequences the draft samples itself, scored by the target. The best checkpoint is chosen by the held-out
acceptance sum_x min(p, q) or, with `trainer.select_by=top1`, greedy top-1 agreement.
"""

from __future__ import annotations

import copy
import hashlib
import random

import torch
from accelerate.utils import DistributedType
from omegaconf import DictConfig
from transformers import AutoModelForCausalLM

from drafters.draft_lm import check_same_vocabulary
from eval.run import target_source
from traffic import models
from train.heldout import HeldoutScores
from train.launch import rank0_first
from train.logit_cache import LogitCache, write_logit_cache
from train.losses import DIVERGENCES, acceptance_estimate_topk, divergence, divergence_topk, sft
from train.data import pad_rows
from train.recipe import Recipe
from train.recipe import run as run_recipe
from train.shards import complete

LOSSES = ("sft", *DIVERGENCES)
# The target's side of a held-out replay is the same at every replay: its HELDOUT_TOP_K most likely tokens per
# position are kept after the first (32 records of 512 tokens: 50 MB), so later replays run the draft alone. Where
# the target is larger than its draft (the 1.5B over its 0.5B) its forward is most of what a replay costs.
HELDOUT_TOP_K = 256


class DraftLMRecipe(Recipe):
    """One training run of a standalone draft LM (see the module docstring)."""

    KIND = "draft_lm"  # the drafter.kind it trains (PARD's recipe, train/pard.py, is this one on its own rows)

    def _check_sharding(self, kind) -> None:
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
        super()._setup_data()
        self.heldout_target: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (HELDOUT_TOP_K) by batch
        self.logit_cache = None
        if self.cfg.drafter.target_logits == "cached":
            self._setup_logit_cache()

    def _setup_logit_cache(self) -> None:
        """The target's top-k log-probabilities over the training set, computed once (rank 0) and shared."""
        t, d = self.cfg.trainer, self.cfg.drafter
        directory = self._cache_dir("logits", t.max_length, d.cached_top_k, d.temperature)
        with rank0_first(self.acc, lambda: complete(directory), "the logit cache"):
            if not complete(directory):
                write_logit_cache(self._training_examples(), self.target, directory, top_k=d.cached_top_k,
                                  temperature=d.temperature, batch_size=t.batch_size,
                                  progress=self.cfg.progress and self.is_main)
        self.logit_cache = LogitCache(directory)

    def _setup_models(self) -> None:
        d = self.cfg.drafter
        if d.kind != self.KIND:
            raise ValueError(f"this recipe trains drafter.kind={self.KIND}, got {d.kind!r}")
        # The model training starts from, and the baseline the final evaluation measures it against.
        start = None  # the weights training starts from, where they are not the baseline's
        if d.init_from:
            self.init_path, self.init_name = models.resolve(d.init_from), "off_the_shelf"
            if d.get("init_layers"):  # a shallower draft: the off-the-shelf draft's first N layers, measured against it
                start = str(models.self_draft(self.init_path, d.init_layers))
        elif d.get("init_layers"):  # a target without a smaller sibling: its own first layers and head
            source = models.resolve(target_source(self.cfg.target))
            self.init_path, self.init_name = str(models.self_draft(source, d.init_layers)), "self_draft"
        else:
            raise ValueError("drafter.init_from is not set: the draft model to start from (hub id or directory), or "
                             "drafter.init_layers=N to start from the target's own first N layers")
        model = AutoModelForCausalLM.from_pretrained(start or self.init_path, dtype=torch.float32,
                                                     trust_remote_code=self.cfg.target.trust_remote_code)
        check_same_vocabulary(self.tokenizer, None, self.target.get_output_embeddings().weight.shape[0],
                              model.get_output_embeddings().weight.shape[0], d.init_from)
        self._prepare_model(model)
        if d.lora.enabled:
            from peft import LoraConfig, get_peft_model  # only with drafter.lora.enabled

            model = get_peft_model(model, LoraConfig(r=d.lora.r, lora_alpha=d.lora.alpha, lora_dropout=d.lora.dropout,
                                                     target_modules=d.lora.target_modules, task_type="CAUSAL_LM"))
        self.model = model.to(self.device)

    def _prepare_model(self, model) -> None:
        """A kind's own set-up of the model training starts from, before LoRA wraps it (PARD: its config's mask token)."""

    def _collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        batch = super()._collate(indices)
        if self.logit_cache is not None and indices:
            logp, idx = self.logit_cache.dense(indices, batch["input_ids"].shape[1])
            batch.update(top_logp=logp.to(self.device), top_idx=idx.to(self.device))
        return batch

    def _on_policy_step(self, step: int) -> bool:
        return random.Random(self.cfg.trainer.seed * 1_000_003 + step).random() < self.cfg.drafter.on_policy.ratio

    def _batch_for_step(self, batch: dict[str, torch.Tensor], step: int, on_policy: bool) -> dict[str, torch.Tensor]:
        return self._on_policy(batch, step) if on_policy else batch

    @torch.no_grad()
    def _on_policy(self, batch: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
        """Replace the responses by the draft's own samples: prompt = everything before the first
        assistant token; the loss covers the sampled tokens (through EOS)."""
        op = self.cfg.drafter.on_policy
        prompts = []
        for ids, attn, mask in zip(batch["input_ids"], batch["attention_mask"], batch["loss_mask"]):
            first = int(mask.nonzero()[0]) if mask.any() else int(attn.sum())
            prompts.append(ids[:first].tolist())
        pad = self.pad_id
        inputs = pad_rows(prompts, pad, left=True).to(self.device)
        attn = pad_rows([[1] * len(p) for p in prompts], 0, left=True).to(self.device)
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

    def _score_heldout(self, batch: dict[str, torch.Tensor]) -> HeldoutScores:
        """The draft's expected acceptance sum_x min(p, q) and greedy agreement with the target on the held-out
        assistant tokens, read at every depth up to the longest chain the final evaluation drafts (`evaluate.ks`):
        teacher-forced, a sequential draft's guess d tokens into a round whose earlier guesses were right is its
        next-token guess at that position, so depth d's hit from entry e is its agreement at position e + d + 1."""
        ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"][:, 1:]
        q = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        top_logp, top_idx = (t[:, :-1] for t in self._heldout_target(ids, attn))
        n = float(mask.sum())
        agree = (q.argmax(-1) == top_idx[..., 0]) & mask.bool()  # (B, T - 1): position t's guess of token t + 1
        accept, top1 = float(acceptance_estimate_topk(q, top_logp, top_idx, mask)) * n, float(agree.sum())
        depths = max(self.cfg.evaluate.ks, default=1)
        hits = [torch.nn.functional.pad(agree[:, d + 1:], (0, d + 2)) for d in range(depths)]
        return HeldoutScores(accept=[accept] * depths, top1=[top1] * depths, count=[n] * depths, hits=hits)

    @torch.no_grad()
    def _heldout_target(self, ids: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's HELDOUT_TOP_K log-probabilities and their tokens (B, T, k) at every position of a held-out
        batch, best first: computed at the first replay, kept for the later ones (`acceptance_estimate_topk`)."""
        key = (tuple(ids.shape), hashlib.blake2b(ids.cpu().numpy().tobytes() + attn.cpu().numpy().tobytes(),
                                                 digest_size=16).hexdigest())
        if key not in self.heldout_target:
            logp = torch.log_softmax(self.target(input_ids=ids, attention_mask=attn).logits.float(), dim=-1)
            self.heldout_target[key] = logp.topk(min(HELDOUT_TOP_K, logp.shape[-1]), dim=-1)
        return self.heldout_target[key]

    def _best_state(self) -> dict | None:
        return None if self.cfg.drafter.lora.enabled else super()._best_state()  # LoRA: never sharded

    def _write_best(self, directory, state) -> None:
        """Hugging Face format (LoRA merged), with the target's tokenizer."""
        model = self.acc.unwrap_model(self.model)
        if self.cfg.drafter.lora.enabled:
            model = copy.deepcopy(model).merge_and_unload()
        model.save_pretrained(directory, state_dict=state)
        self.tokenizer.save_pretrained(directory)

    def _final_specs(self) -> list[dict]:
        """The final evaluation's drafters as `python -m eval` specs: baseline first, the model training started
        from (the off-the-shelf draft, or the self-draft of `drafter.init_layers`), then `evaluate.drafters`, then
        the best trained one (reloaded from disk). An off-the-shelf draft named by its GGUF is measured as that file (in
        llama.cpp: served as shipped), and the trained one is served in that file's type (quantized by llama.cpp), so
        neither pays for a precision the other does not."""
        init, trained = self.cfg.drafter.init_from, {"name": self._trained_name(), "kind": "draft_lm",
                                                     "path": str(self.out / "best")}
        shipped = models.gguf_file(init) if init else None
        if shipped is not None:
            trained["gguf_type"] = models.gguf_type(shipped)
        return [{"name": self.init_name, "kind": "draft_lm", "path": init if shipped else str(self.init_path)},
                *self._extra_specs(), trained]

    def _trained_name(self) -> str:
        return f"trained_{self.cfg.drafter.loss}"


def run(cfg: DictConfig) -> dict:
    """setup, train, finish, cleanup: what `python -m train drafter=draft_lm` does."""
    return run_recipe(cfg, DraftLMRecipe)
