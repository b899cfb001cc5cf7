"""Recipe: train a PARD draft LM (drafters/pard.py): the off-the-shelf draft, or the target's own first layers,
adapted to guess k tokens in one forward from k - 1 appended mask tokens.

    python -m train drafter=pard                                  # toy world, from the off-the-shelf draft
    python -m train drafter=pard drafter.loss=sft drafter.num_depths=4
    python -m train drafter=pard drafter.init_from=null drafter.init_layers=8    # from the target's first 8 layers

The draft LM recipe as it is (train/distill.py: the objectives, LoRA, the target's logits online or cached, the
checkpoints and the final evaluation). What is PARD's own: each batch becomes PARD's rows (every token at depth 0,
conditional-drop chains of mask entries at the deeper depths, their mask; drafters/pard.py `parallel_sequences`),
the objective is taken at every entry whose token the loss reads, and the held-out evaluation scores every chain at
every depth (the best checkpoint chosen as for every kind, train/heldout.py).
The saved draft's config names its mask token (`pard_token`, what vLLM reads) and its depths.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from drafters.hf_cache import entry_masks
from drafters.pard import parallel_sequences
from train.config import check_chains
from train.distill import DraftLMRecipe
from train.heldout import HeldoutScores
from train.losses import acceptance_estimate_topk, divergence, divergence_topk, sft
from train.recipe import run as run_recipe


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
        self.mask_token_id = self._mask_token(model.config.vocab_size)
        model.config.pard_token, model.config.pard_depths, model.config.spd_type = self.mask_token_id, d.num_depths, "pard"

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

    def _heldout_batch_size(self) -> int:
        return 1  # a record's rows are up to num_depths times its length

    def _score_heldout(self, batch: dict[str, torch.Tensor]) -> HeldoutScores:
        """Per depth, over every chain of a held-out record's answer, the expected acceptance sum_x min(p, q) and
        greedy agreement with the target, and the hits: the depth-d guess from anchor a (the tokens through a, d
        masks) is a round's guess d from entry a - 1."""
        D = self.cfg.drafter.num_depths
        T = batch["input_ids"].shape[1]
        rows = self._rows(batch, keep_all=True)
        read = rows["reads"][0]
        sums = torch.zeros(3, D, dtype=torch.float64)  # acceptance, agreement, count per depth
        hits = [torch.zeros(1, T, dtype=torch.bool) for _ in range(D)]
        if read.any():
            logits = self._forward(rows)[0][read][None]
            at = (rows["anchors"] + rows["depth"])[0][read]
            top_logp, top_idx = (t[0, at][None] for t in self._heldout_target(batch["input_ids"],
                                                                               batch["attention_mask"]))
            depth, anchors = rows["depth"][0][read], rows["anchors"][0][read]
            agree = (logits.argmax(-1) == top_idx[..., 0])[0].cpu()
            for d in range(D):
                mask = (depth == d)[None].float()
                n = float(mask.sum())
                if n:
                    sums[:, d] += torch.tensor([float(acceptance_estimate_topk(logits, top_logp, top_idx, mask)) * n,
                                                float(agree[(depth == d).cpu()].sum()), n], dtype=torch.float64)
                    entries = anchors[depth == d].cpu() - 1
                    keep = entries >= 0
                    hits[d][0, entries[keep]] = agree[(depth == d).cpu()][keep]
        return HeldoutScores(accept=sums[0].tolist(), top1=sums[1].tolist(), count=sums[2].tolist(), hits=hits)

    def _trained_name(self) -> str:
        return "trained_pard"


def run(cfg: DictConfig) -> dict:
    """setup, train, finish, cleanup: what `python -m train drafter=pard` does."""
    return run_recipe(cfg, PardRecipe)
