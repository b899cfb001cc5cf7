"""Distillation objectives for a draft model, over the positions a loss mask selects.

p is the target's next-token distribution and q the draft's, both at the same temperature. The
expected acceptance of a draft token at one position is exactly sum_x min(p(x), q(x)) = 1 - TV(p, q)
(DistillSpec, Zhou et al. 2023), so total variation is the divergence tied most directly to
acceptance; the others are smoother surrogates:

- forward KL(p || q): mass-covering, the classic distillation loss;
- reverse KL(q || p): mode-seeking;
- JSD(beta) = beta * KL(p || m) + (1 - beta) * KL(q || m), m = beta * p + (1 - beta) * q (GKD, Agarwal
  et al. 2024); beta -> 0 behaves like forward KL, beta -> 1 like reverse KL (after scaling by 1/beta,
  1/(1-beta));
- sft: cross-entropy on the target's tokens (sequence-level distillation, no logits needed).

Every function takes logits (B, T, V) and a mask (B, T) and returns the mean over masked positions;
`divergence_topk` takes the target's cached top-k log-probabilities instead of its logits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "tvd")
_TINY = math.exp(-60)  # floor of a probability in divergence_topk


def _masked_mean(per_position: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(per_position.dtype)
    return (per_position * mask).sum() / mask.sum().clamp_min(1)


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    # float32 for the softmax: bf16 log-probabilities make small divergences round to noise.
    return F.log_softmax(logits.float() / temperature, dim=-1)


def sft(draft_logits: torch.Tensor, target_tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the draft on the target's tokens (B, T) at the masked positions."""
    nll = F.cross_entropy(draft_logits.float().flatten(0, 1), target_tokens.flatten(), reduction="none")
    return _masked_mean(nll.view_as(target_tokens), mask)


def divergence(
    kind: str,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    beta: float = 0.5,
) -> torch.Tensor:
    """One of forward_kl, reverse_kl, jsd (with beta), tvd between target p and draft q per position."""
    if temperature <= 0:
        raise ValueError(f"distillation temperature must be > 0, got {temperature}")
    log_q = _log_probs(draft_logits, temperature)
    log_p = _log_probs(target_logits, temperature)
    return _masked_mean(_per_position(kind, log_p, log_q, beta), mask)


def divergence_topk(
    kind: str,
    draft_logits: torch.Tensor,
    top_logp: torch.Tensor,
    top_idx: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    beta: float = 0.5,
) -> torch.Tensor:
    """The divergence against a target known only on its top-k tokens (train/logit_cache.py).

    top_logp / top_idx (B, T, k): the target's log-probabilities at temperature of its k most likely
    tokens. Both distributions are coarsened to k + 1 outcomes, the k tokens and "any other token",
    whose probability is 1 - the top-k mass for p and the exact remaining mass for q. Every divergence
    here can only shrink under such a merge, so the loss is a lower bound of the full one; with k equal
    to the vocabulary it is the full one.
    """
    if temperature <= 0:
        raise ValueError(f"distillation temperature must be > 0, got {temperature}")
    log_q_all = _log_probs(draft_logits, temperature)
    log_q_top = log_q_all.gather(-1, top_idx)
    # The rest of q: log-sum-exp over the tokens outside the top k (exact, no 1 - sum cancellation).
    log_q_rest = log_q_all.scatter(-1, top_idx, float("-inf")).logsumexp(-1, keepdim=True)
    log_p_top = top_logp.float()
    p_rest = (1 - log_p_top.exp().sum(-1, keepdim=True)).clamp_min(0)
    # Floors keep an empty bucket (k = V, or a rounding-negative rest) finite: e^-60 is far below any
    # probability that changes the loss, and 0 * finite stays 0 in the gradient.
    log_p = torch.cat([log_p_top, p_rest.clamp_min(_TINY).log()], -1)
    log_q = torch.cat([log_q_top, log_q_rest.clamp_min(math.log(_TINY))], -1)
    return _masked_mean(_per_position(kind, log_p, log_q, beta), mask)


def _per_position(kind: str, log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """Divergence between p and q given as log-probabilities over the last dimension."""
    if kind == "forward_kl":
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    if kind == "reverse_kl":
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    if kind == "jsd":
        if not 0.0 < beta < 1.0:
            raise ValueError(f"JSD beta must be in (0, 1), got {beta}")
        log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log(1 - beta))
        kl_pm = (log_p.exp() * (log_p - log_m)).sum(-1)
        kl_qm = (log_q.exp() * (log_q - log_m)).sum(-1)
        return beta * kl_pm + (1 - beta) * kl_qm
    if kind == "tvd":
        return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    raise ValueError(f"unknown divergence {kind!r}; known: {list(DIVERGENCES)}")


@torch.no_grad()
def acceptance_estimate(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor,
                        temperature: float = 1.0) -> torch.Tensor:
    """Expected per-token acceptance sum_x min(p, q) at the masked positions (1 - TV)."""
    p = _log_probs(target_logits, temperature).exp()
    q = _log_probs(draft_logits, temperature).exp()
    return _masked_mean(torch.minimum(p, q).sum(-1), mask)


@torch.no_grad()
def acceptance_estimate_topk(draft_logits: torch.Tensor, top_logp: torch.Tensor, top_idx: torch.Tensor,
                             mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """`acceptance_estimate` against a target known on its top-k tokens (log-probabilities at `temperature`, as
    `divergence_topk` reads them): the k tokens and "any other token" as one outcome. Merging outcomes can only
    raise sum_x min(p, q), by at most the target's mass outside its top k; with k the vocabulary it is exact."""
    q_top = _log_probs(draft_logits, temperature).gather(-1, top_idx).exp()
    p_top = top_logp.float().exp()
    rest = torch.minimum((1 - p_top.sum(-1)).clamp_min(0), (1 - q_top.sum(-1)).clamp_min(0))
    return _masked_mean(torch.minimum(p_top, q_top).sum(-1) + rest, mask)
