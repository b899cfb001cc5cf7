"""Recipe: train a PARD draft LM (drafters/pard.py): the off-the-shelf draft, or the target's own first layers,
adapted to guess k tokens in one forward from k - 1 appended mask tokens.

    python -m train drafter=pard                                  # toy world, from the off-the-shelf draft
    python -m train drafter=pard drafter.loss=sft drafter.num_depths=4
    python -m train drafter=pard drafter.init_from=null drafter.init_layers=8    # from the target's first 8 layers

The draft LM recipe as it is (train/distill.py: the objectives, LoRA, the target's logits online or cached, the
checkpoints and the final evaluation). What is PARD's own: each batch becomes PARD's rows (every token at depth 0,
conditional-drop chains of mask entries at the deeper depths, their mask; drafters/pard.py `parallel_sequences`),
the objective is taken at every entry whose token the loss reads, and the held-out evaluation scores every chain at
every depth and keeps the checkpoint with the best estimate of tokens per round, 1 + sum_d prod_{r<=d} alpha_r
(alpha: the expected acceptance sum_x min(p, q) of depth r, or with `trainer.select_by=top1` greedy agreement).
The saved draft's config names its mask token (`pard_token`, what vLLM reads) and its depths.
"""

from __future__ import annotations

import logging

import torch
from omegaconf import DictConfig

from drafters.hf_cache import entry_masks
from drafters.pard import parallel_sequences
from drafters.parallel import mask_token_for
from train.config import check_chains
from train.distill import DraftLMRecipe
from train.heads import tokens_per_round_estimate
from train.losses import acceptance_estimate, divergence, divergence_topk, greedy_agreement, sft
from train.recipe import _records_batch
from train.recipe import run as run_recipe

log = logging.getLogger(__name__)


class PardRecipe(DraftLMRecipe):
    """One training run of a PARD draft (see the module docstring)."""

    KIND = "pard"

    def _validate(self) -> None:
        super()._validate()
        d = self.cfg.drafter
        check_chains(d)
        if d.on_policy.ratio > 0:
            raise ValueError("drafter.on_policy does not apply to PARD: its rows are built from the traffic's answers")

    def _prepare_model(self, model) -> None:
        """The mask token (`drafter.mask_token_id`, else resolved from the tokenizer) and the depths, in the config
        every checkpoint saves: vLLM reads `pard_token`, draftsmith's loop `pard_depths` too."""
        d = self.cfg.drafter
        mask = d.mask_token_id if d.mask_token_id is not None else mask_token_for(self.tokenizer,
                                                                                   model.config.vocab_size)
        if not 0 <= mask < model.config.vocab_size:
            raise ValueError(f"drafter.mask_token_id {mask} is not a row of the draft's embedding "
                             f"(0..{model.config.vocab_size - 1})")
        self.mask_token_id = mask
        model.config.pard_token, model.config.pard_depths, model.config.spd_type = mask, d.num_depths, "pard"
        log.info("PARD's mask token: id %d (%r)", mask, self.tokenizer.convert_ids_to_tokens(mask)
                 if mask < len(self.tokenizer) else "an unused embedding row")

    def _rows(self, batch: dict[str, torch.Tensor], keep_all: bool = False) -> dict[str, torch.Tensor]:
        d = self.cfg.drafter
        return parallel_sequences(batch["input_ids"], batch["attention_mask"], batch["loss_mask"],
                                  mask_token_id=self.mask_token_id, depths=d.num_depths, ratio=d.cod_ratio,
                                  min_ratio=d.cod_min_ratio, max_anchors=d.max_anchors, keep_all=keep_all)

    def _forward(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """The draft's logits (B, N, V) over PARD's rows, under their mask."""
        model = self.acc.unwrap_model(self.model)
        mask = entry_masks(model, rows["allowed"], rows["position_ids"])
        return self.model(input_ids=rows["input_ids"], position_ids=rows["position_ids"], attention_mask=mask).logits

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        d = self.cfg.drafter
        rows = self._rows(batch)
        logits = self._forward(rows)
        read = rows["reads"]
        T = batch["input_ids"].shape[1]
        where = (rows["anchors"] + rows["depth"]).clamp(max=T - 2)  # the position whose next token entry reads
        drafted = logits[read][None]  # (1, R, V): only the entries the loss reads
        ones = torch.ones(drafted.shape[:2], device=drafted.device)
        b = torch.arange(where.shape[0], device=where.device)[:, None].expand_as(where)[read]
        at = where[read]
        if d.loss == "sft":
            return sft(drafted, batch["input_ids"][b, at + 1][None], ones)
        if "top_idx" in batch:
            return divergence_topk(d.loss, drafted, batch["top_logp"][b, at][None], batch["top_idx"][b, at][None],
                                   ones, temperature=d.temperature, beta=d.beta)
        with torch.no_grad():
            target = self.target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return divergence(d.loss, drafted, target[b, at][None], ones, temperature=d.temperature, beta=d.beta)

    @torch.no_grad()
    def evaluate_heldout(self) -> dict:
        """Per depth, over every chain of the held-out answers (one record at a time: a record's rows are up to
        num_depths times its length), the expected acceptance sum_x min(p, q) and greedy agreement with the target;
        keeps the best model by the tokens-per-round estimate `trainer.select_by` names."""
        self.model.eval()
        D = self.cfg.drafter.num_depths
        sums = torch.zeros(3, D, dtype=torch.float64)  # acceptance, agreement, count per depth
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for i in range(len(self.eval_set)):
            batch = _records_batch(self.eval_set.select([i]), pad, self.cfg.trainer.max_length, self.device)
            rows = self._rows(batch, keep_all=True)
            read = rows["reads"][0]
            if not read.any():
                continue
            logits = self._forward(rows)[0][read][None]
            at = (rows["anchors"] + rows["depth"])[0][read]
            target = self.target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            p = target[0, at][None]
            depth = rows["depth"][0][read]
            for d in range(D):
                mask = (depth == d)[None].float()
                n = float(mask.sum())
                if n:
                    sums[:, d] += torch.tensor([float(acceptance_estimate(logits, p, mask)) * n,
                                                float(greedy_agreement(logits, p, mask)) * n, n], dtype=torch.float64)
        self.model.train()
        # Depths no held-out chain reaches (answers shorter than the depths) have no figure; the estimates stop there.
        reached = int((sums[2] > 0).sum()) if bool((sums[2] > 0).all()) else int((sums[2] > 0).long().argmin())
        acceptance = (sums[0, :reached] / sums[2, :reached]).tolist()
        top1 = (sums[1, :reached] / sums[2, :reached]).tolist()
        if not reached:
            raise ValueError("no held-out record has an answer token to score: the held-out set has no answers")
        result = {"heldout_acceptance": acceptance[0], "heldout_top1": top1[0],
                  "heldout_tokens_per_round": tokens_per_round_estimate(acceptance),
                  "heldout_tokens_per_round_greedy": tokens_per_round_estimate(top1),
                  **{f"heldout_acceptance_depth{d}": a for d, a in enumerate(acceptance)}}
        key = "heldout_tokens_per_round" + ("_greedy" if self.cfg.trainer.select_by == "top1" else "")
        if self.best is None or result[key] > self.best[key.removeprefix("heldout_")]:
            self.best = {"acceptance": acceptance[0], "top1": top1[0], "acceptance_per_depth": acceptance,
                         "top1_per_depth": top1, "tokens_per_round": result["heldout_tokens_per_round"],
                         "tokens_per_round_greedy": result["heldout_tokens_per_round_greedy"], "step": self.step}
            self._save_best()
        return result

    def _trained_name(self) -> str:
        return "trained_pard"


def run(cfg: DictConfig) -> dict:
    """setup, train, finish, cleanup: what `python -m train drafter=pard` does."""
    return run_recipe(cfg, PardRecipe)
