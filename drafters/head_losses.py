"""What the heads' training losses share: the token loss against the target's distribution (soft labels) or its
argmax (labels), computed only at the rows the loss reads (`ReadRows`), and the per-step statistics the held-out
evaluation reads (acceptance sum_x min(p, q), top-1 agreement, greedy hits: `step_stats`).
"""

from __future__ import annotations

import torch


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked positions of -sum_x p(x) log q(x): the token loss against the target's distribution."""
    per_pos = -(target_probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
    mask = mask.float()
    return (per_pos * mask).sum() / mask.sum().clamp_min(1.0)


def label_cross_entropy(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`soft_cross_entropy` against one-hot labels, over rows (N, V): the mean of -log q(label), where
    `index` is the label's column, or -1 for a label the logits cannot express (it adds 0, as a one-hot
    row with no mass on these columns would, and still counts in the mean)."""
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, index.clamp_min(0)[:, None])[:, 0]
    return -(logp * (index >= 0)).sum() / max(index.numel(), 1)


@torch.no_grad()
def label_stats(logits: torch.Tensor, labels: torch.Tensor, index: torch.Tensor,
                draft_ids: torch.Tensor | None = None, at: tuple | None = None,
                hits: bool = False) -> dict[str, torch.Tensor]:
    """`step_stats` against one-hot labels (target ids, (N,)): sum_x min(p, q) is q(label); `index` is the
    label's column in the logits (-1: none), `draft_ids` the target ids of the logits' columns; `at` and
    `hits` as in `step_stats`."""
    q = torch.softmax(logits.float(), -1)
    accept = q.gather(-1, index.clamp_min(0)[:, None])[:, 0] * (index >= 0)
    guess = q.argmax(-1)
    if draft_ids is not None:
        guess = draft_ids[guess]
    agree = guess == labels
    return {"accept": accept.sum(), "top1": agree.float().sum(),
            "count": torch.tensor(float(labels.numel()), device=labels.device),
            **(_hits(agree, at) if hits else {})}


def _hits(agree: torch.Tensor, at: tuple | None = None, mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """{"hits": (B, T) bool, where each row's greedy guess agreed, placed at its (rows, entries) of `at` or
    at the mask's positions in a (B, T) grid}: what train/heads.py `greedy_rounds` replays; {} without either."""
    if mask is not None:
        return {"hits": torch.zeros_like(mask).masked_scatter_(mask, agree)}
    if at is None:
        return {}
    rows, entries, shape = at
    hits = torch.zeros(shape, dtype=torch.bool, device=agree.device)
    hits[rows, entries] = agree
    return {"hits": hits}


class ReadRows:
    """The target's next-token distributions at the positions a loss reads, and nowhere else: `rows` (n, V)
    and `index` (B, T) into them (-1 where nothing reads). Indexed like the dense (B, T, V) tensor it stands
    for (`probs[b, t]` for read positions), so a head's loss takes either; a 262,144-token vocabulary (Gemma-3)
    at every position of a batch is gigabytes, most of them never read."""

    def __init__(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        self.index, self.rows = index, rows

    def __getitem__(self, key) -> torch.Tensor:
        return self.rows[self.index[key]]

    def is_floating_point(self) -> bool:
        return True


@torch.no_grad()
def step_stats(draft_probs: torch.Tensor, target_probs: torch.Tensor, mask: torch.Tensor | None = None,
               draft_ids: torch.Tensor | None = None, at: tuple | None = None,
               hits: bool = False) -> dict[str, torch.Tensor]:
    """Sums (over masked positions, or every row without a mask) of the sampling acceptance estimate
    sum_x min(p, q) and of greedy top-1 agreement, plus the count: summed across batches and processes,
    then divided. `draft_ids`: the target ids of draft_probs' last dimension (a draft vocabulary; q is 0
    elsewhere, so the sum runs over those ids alone). With `hits` (held-out evaluation; training steps skip
    it) also "hits": the agreements in a (B, T) grid, placed by the mask (B, T) or by `at` = (rows, entries,
    (B, T)) naming where unmasked rows sit."""
    if mask is not None:
        mask = mask.bool()
        draft_probs, target_probs = draft_probs[mask], target_probs[mask]
    guess = draft_probs.argmax(-1)
    if draft_ids is not None:
        guess = draft_ids[guess]
        accept = torch.minimum(draft_probs, target_probs[..., draft_ids]).sum(-1)
    else:
        accept = torch.minimum(draft_probs, target_probs).sum(-1)
    agree = guess == target_probs.argmax(-1)
    return {"accept": accept.sum(), "top1": agree.float().sum(),
            "count": torch.tensor(float(agree.numel()), device=agree.device),
            **(_hits(agree, at, mask) if hits else {})}
