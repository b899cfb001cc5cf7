"""PARD (AMD, arXiv 2504.18583, "PARD: Accelerating LLM Inference with Low-Cost PARallel Draft Model Adaptation"):
a standalone draft LM (drafters/draft_lm.py) adapted to guess k tokens in one forward from k - 1 appended mask
tokens.

Drafting: a round feeds the committed tokens the draft's cache has not seen (the last of them the target's bonus
token b at position p) followed by k - 1 copies of the mask token at positions p + 1 .. p + k - 1, causal; the
logits after b and after each mask are the k guesses, tokens p + 1 .. p + k. The mask entries are cropped from the
cache after the forward (their guesses are fed, if kept, as ordinary tokens the next round). This is vLLM 0.33's
`draft_model` with `parallel_drafting` (its proposer appends k - 1 copies of the one `pard_token` after the bonus
at the next positions, causal), which serves the `hf` export: the draft's own Hugging Face directory with
`pard_token` in its config.json. A draft LM whose config has `pard_token` drafts this way in `python -m eval`.

Training (train/pard.py) is PARD's objective: each sequence's real tokens at depth 0, plus, for depth d = 1 ..
`depths` - 1, copies of the answer's anchors a as mask entries at position a + d, drawn by conditional drop
(depth d keeps int((n - d) * max(`cod_ratio` ** d, `cod_min_ratio`)) of the n anchors the loss reads, each among
depth d - 1's, as drafters/peagle.py draws them). Entry (a, d) sees the real tokens 0..a and its own chain's masks
1..d (`parallel_sequences`' mask), what mask d sees when drafting after the real token at a, and is trained
towards token a + d + 1: the draft LM recipe's objective (the target's tokens or its distribution there), averaged
over every entry of every depth alike.

Trees: no (a round is one forward over one chain).
"""

from __future__ import annotations

import torch

from drafters.base import Proposal
from drafters.draft_lm import DraftLM, DraftLMBatch
from drafters.hf_cache import cache_keyword, forward_rows
from drafters.parallel import chain_mask, cut_at_stop, draw_chains, pack_chains
from drafters.sampling import Sampling, draw


def pard_settings(config) -> tuple[int, int] | None:
    """(mask token, depths it was trained on) of a PARD draft's config (`pard_token`, vLLM's and AMD's key;
    `pard_depths`, draftsmith's, else 8: PARD's own default), or None for an ordinary draft LM."""
    token = getattr(config, "pard_token", None)
    if token is None:
        return None
    return int(token), int(getattr(config, "pard_depths", None) or 8)


def parallel_sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor, *,
                       mask_token_id: int, depths: int, ratio: float, min_ratio: float, max_anchors: int,
                       keep_all: bool = False) -> dict[str, torch.Tensor]:
    """PARD's training rows for a batch (B, T): `input_ids`, `position_ids` (B, N) of every entry, `anchors` and
    `depth` (B, N), `used` (B, N) (False: padding to the batch's longest), `allowed` (B, N, N) bool, what each entry
    may attend to, and `reads` (B, N), the entries whose next token the loss reads (token anchor + depth + 1)."""
    B, T = input_ids.shape
    device = input_ids.device
    pad = torch.zeros(B, depths + 1, dtype=loss_mask.dtype, device=device)
    # reads[b, j]: the loss reads token j + 1 (entry j's depth-0 guess, entry j - d's depth-d guess).
    reads = (torch.cat([loss_mask, pad], 1)[:, 1: T + depths].bool()
             & torch.cat([attention_mask, pad.to(attention_mask.dtype)], 1)[:, 1: T + depths].bool())
    picks = [draw_chains(reads[b], T, depths, ratio, min_ratio, max_anchors, keep_all) for b in range(B)]
    anchors, depth, used = pack_chains(picks, device)
    ids = torch.where(depth == 0, input_ids.gather(1, anchors), mask_token_id)
    # A depth-0 key is real where its token is; padding entries sit at anchor 0, depth 0, and see that one key.
    real = attention_mask.bool().clone()
    real[:, 0] = True
    allowed = chain_mask(anchors, depth, used & ((depth > 0) | real.gather(1, anchors)))
    return {"input_ids": ids, "position_ids": anchors + depth, "anchors": anchors, "depth": depth, "used": used,
            "allowed": allowed, "reads": used & reads.gather(1, (anchors + depth).clamp(max=T + depths - 2))}


class PardLM(DraftLM):
    """A PARD draft LM at batch 1: k guesses in one forward (module docstring)."""

    parallel = True  # its k guesses cost one forward (eval/metrics.py `cost_model` charges a round so)

    def __init__(self, model, name: str = "pard", lean: bool = True, stop_below: float = 0.0,
                 stop_rule: str = "propose") -> None:
        super().__init__(model, name=name, lean=lean, stop_below=stop_below, stop_rule=stop_rule)
        settings = pard_settings(model.config)
        if settings is None:
            raise ValueError(f"drafter {name!r}: its config has no pard_token; it is not a PARD draft")
        self.mask_token_id, self.depths = settings

    @torch.inference_mode()
    def propose(self, k: int, sampling: Sampling, generator: torch.Generator | None = None) -> Proposal:
        n = min(k, self.depths)
        feed = torch.tensor(self.ids[self._fed:] + [self.mask_token_id] * (n - 1), device=self.device)
        if self.lean is not None:
            logits = self.lean.forward(feed, last=n).view(n, -1)
            self.lean.crop(len(self.ids))  # the masks' entries: never kept
        else:
            logits = self.model(input_ids=feed[None], **{cache_keyword(self.model): self.cache}, use_cache=True,
                                logits_to_keep=n).logits[0]
            self.cache.crop(len(self.ids) - self.cache.get_seq_length())  # a negative count: that many dropped
        self._fed = len(self.ids)
        tokens, q = draw(logits, sampling, generator)
        cut = cut_at_stop(self.stop, logits[None], tokens[None], None if q is None else q[None])[0]
        proposal = Proposal(tokens[:cut], None if q is None else q[:cut])
        self._guesses = proposal.tokens.tolist()
        return proposal

    def propose_tree(self, shape, sampling, generator=None):
        raise ValueError(f"drafter {self.name!r} (PARD) drafts chains only: a tree ({shape.label}) needs a drafter "
                         "that drafts on its own guesses (EAGLE-3, EAGLE-1 heads and draft LMs)")

    def batched(self) -> "PardBatch":
        return PardBatch(self)


class PardBatch(DraftLMBatch):
    """A PARD draft for B rows: one forward a round, each row's unseen committed tokens and its k - 1 masks; the
    rows' caches are cropped back to their committed tokens after it."""

    parallel = True  # its k guesses cost one forward (eval/metrics.py `cost_model` charges a round so)

    @torch.inference_mode()
    def propose(self, k: int, sampling: Sampling, generator: torch.Generator | None = None) -> list[Proposal]:
        mask, n = self.drafter.mask_token_id, min(k, self.drafter.depths)
        feed = [ids[fed:] + [mask] * (n - 1) for ids, fed in zip(self.ids, self.fed)]
        if self.lean is not None:
            logits = self.lean.forward_rows(feed, self.rows, self.caches, last=n).view(len(feed), n, -1)
        else:
            every, _, counts = forward_rows(self.model, feed, self.cache, logits_for="all")  # (B, q, V)
            at = torch.tensor(counts, device=every.device)[:, None] - n + torch.arange(n, device=every.device)
            logits = every.gather(1, at[..., None].expand(-1, -1, every.shape[-1]))
        self.rows.crop([len(ids) for ids in self.ids])
        self.fed = [len(ids) for ids in self.ids]
        tokens, q = draw(logits, sampling, generator)
        cut = cut_at_stop(self.stop, logits, tokens, q)
        proposals = [Proposal(tokens[b, :c], None if q is None else q[b, :c]) for b, c in enumerate(cut)]
        self.guesses = [p.tokens.tolist() for p in proposals]
        return proposals

