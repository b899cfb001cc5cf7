"""The target's top-k next-token log-probabilities, precomputed once for token-level distillation.

    python -m train drafter=draft_lm drafter.loss=forward_kl drafter.target_logits=cached drafter.cached_top_k=64

Online distillation runs the target forward in every training step; with a cache the target runs once
over the training set and each step reads, for every position whose next token is an assistant
token, the k most likely tokens under the target at the distillation temperature and their
log-probabilities (fp32; the full vocabulary's softmax, then top-k). The loss treats the remaining
tokens as one bucket (train/losses.py `divergence_topk`), so the cache costs k x 8 bytes per
predicted token instead of the vocabulary's V x 4. Epochs after the first cost no target forward;
on-policy steps still score the draft's fresh samples online.

Stored per example (train/shards.py): `top_logp` (n, k) float32 and `top_idx` (n, k) int32 for the n
positions t with loss_mask[t + 1] = 1, in order.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from traffic.records import Example
from train.shards import ExampleShards, write_example_shards


def bytes_per_token(top_k: int) -> int:
    """Upper bound per token: log-prob (fp32) and index (int32) per kept token, plus id and mask."""
    return top_k * 8 + 4 + 1


def write_logit_cache(
    examples: list[Example],
    target,
    out_dir: str | Path,
    *,
    top_k: int,
    temperature: float,
    batch_size: int = 8,
    max_bytes: int | None = None,
    progress: bool = True,
) -> Path:
    """Compute the target's top-k log-probabilities at every predicted position of `examples`."""
    vocab = target.get_output_embeddings().weight.shape[0]
    if not 1 <= top_k <= vocab:
        raise ValueError(f"drafter.cached_top_k must be in 1..{vocab} (the target's vocabulary), got {top_k}")
    if temperature <= 0:
        raise ValueError(f"distillation temperature must be > 0, got {temperature}")

    @torch.no_grad()
    def compute(batch, ids, mask):
        logits = target(input_ids=ids, attention_mask=mask).logits.float()
        log_p = F.log_softmax(logits / temperature, dim=-1)
        out = []
        for j, e in enumerate(batch):
            positions = torch.tensor(e.loss_mask[1:], dtype=torch.bool).nonzero().flatten().to(log_p.device)
            values, indices = log_p[j, positions].topk(top_k, dim=-1)
            out.append({"top_logp": values, "top_idx": indices.to(torch.int32)})
        return out

    return write_example_shards(examples, compute, out_dir,
                                meta={"top_k": top_k, "temperature": temperature, "vocab_size": vocab},
                                bytes_per_token=bytes_per_token(top_k), device=next(target.parameters()).device,
                                what="target logits", batch_size=batch_size, max_bytes=max_bytes, progress=progress)


class LogitCache(ExampleShards):
    """cache[i] -> {"input_ids", "loss_mask", "top_logp" (n, k), "top_idx" (n, k)}; `dense` lays a batch
    out on the training batch's grid."""

    def dense(self, indices: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, width - 1, k) log-probs and indices for positions 0..width-2 of the listed examples (zeros
        where nothing is predicted: those positions are masked out of the loss)."""
        k = self.meta["top_k"]
        logp = torch.zeros(len(indices), width - 1, k)
        idx = torch.zeros(len(indices), width - 1, k, dtype=torch.long)
        for row, i in enumerate(indices):
            item = self[i]
            positions = item["loss_mask"][1:width].nonzero().flatten()
            logp[row, positions] = item["top_logp"][: len(positions)].float()
            idx[row, positions] = item["top_idx"][: len(positions)].long()
        return logp, idx
