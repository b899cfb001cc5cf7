"""Each objective against values computed by hand on two-token vocabularies."""

import math

import pytest
import torch

from train.losses import DIVERGENCES, acceptance_estimate, acceptance_estimate_topk, divergence, divergence_topk, sft


def logits_of(*probs):
    """(1, T, V) logits whose softmax is the given distributions."""
    return torch.tensor([probs]).log()


P = logits_of([0.5, 0.5], [0.9, 0.1])
Q = logits_of([0.25, 0.75], [0.9, 0.1])
MASK = torch.tensor([[1, 0]])  # only the first position counts


def test_forward_and_reverse_kl_by_hand():
    fkl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    rkl = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert divergence("forward_kl", Q, P, MASK).item() == pytest.approx(fkl, rel=1e-5)
    assert divergence("reverse_kl", Q, P, MASK).item() == pytest.approx(rkl, rel=1e-5)


def test_jsd_and_tvd_by_hand():
    beta = 0.3
    m = [beta * 0.5 + (1 - beta) * 0.25, beta * 0.5 + (1 - beta) * 0.75]
    kl_pm = 0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1])
    kl_qm = 0.25 * math.log(0.25 / m[0]) + 0.75 * math.log(0.75 / m[1])
    assert divergence("jsd", Q, P, MASK, beta=beta).item() == pytest.approx(beta * kl_pm + (1 - beta) * kl_qm, rel=1e-5)
    assert divergence("tvd", Q, P, MASK).item() == pytest.approx(0.25, rel=1e-5)
    assert acceptance_estimate(Q, P, MASK).item() == pytest.approx(0.75, rel=1e-5)  # = 1 - TV


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_zero_when_distributions_are_equal(kind):
    assert divergence(kind, P, P, torch.ones(1, 2)).item() == pytest.approx(0.0, abs=1e-6)
    # ... and the masked-out position (where Q == P) does not count, so Q vs P is positive.
    assert divergence(kind, Q, P, MASK).item() > 0


def test_temperature_flattens_both_sides():
    hot = divergence("forward_kl", Q, P, MASK, temperature=2.0).item()
    assert 0 < hot < divergence("forward_kl", Q, P, MASK).item()
    with pytest.raises(ValueError, match="temperature"):
        divergence("forward_kl", Q, P, MASK, temperature=0)


def test_sft_and_errors():
    tokens = torch.tensor([[1, 0]])
    assert sft(Q, tokens, MASK).item() == pytest.approx(-math.log(0.75), rel=1e-5)
    with pytest.raises(ValueError, match="unknown divergence"):
        divergence("kl", Q, P, MASK)
    with pytest.raises(ValueError, match="beta"):
        divergence("jsd", Q, P, MASK, beta=1.0)


def _top(logits, k):
    values, indices = torch.log_softmax(logits, -1).topk(k, -1)
    return values, indices


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_topk_with_the_whole_vocabulary_is_the_full_divergence(kind):
    g = torch.Generator().manual_seed(0)
    draft, target = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g) * 2
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0
    top_logp, top_idx = _top(target, 11)
    full = divergence(kind, draft, target, mask)
    assert divergence_topk(kind, draft, top_logp, top_idx, mask).item() == pytest.approx(full.item(), rel=1e-4)
    assert divergence_topk(kind, target, top_logp, top_idx, mask).item() == pytest.approx(0.0, abs=1e-5)


def test_acceptance_on_the_targets_top_k_is_exact_with_the_vocabulary_and_bounded_below_it():
    g = torch.Generator().manual_seed(1)
    draft, target = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g) * 2
    mask = torch.ones(2, 5)
    mask[0, :2] = 0
    full = acceptance_estimate(draft, target, mask).item()
    assert acceptance_estimate_topk(draft, *_top(target, 11), mask).item() == pytest.approx(full, rel=1e-5)
    p = torch.softmax(target, -1)
    for k in (1, 3, 6):
        outside = 1 - p.topk(k, -1).values.sum(-1)  # the target's mass the merge can add, at most
        most = (outside * mask).sum().item() / mask.sum().item()
        merged = acceptance_estimate_topk(draft, *_top(target, k), mask).item()
        assert full - 1e-6 <= merged <= full + most + 1e-6
    # By hand, k = 1: p = (0.6, 0.3, 0.1) -> (0.6, 0.4), q = (0.2, 0.5, 0.3) -> (0.2, 0.8): 0.2 + 0.4, where the
    # full vocabulary gives 0.2 + 0.3 + 0.1.
    merged = acceptance_estimate_topk(logits_of([0.2, 0.5, 0.3]), *_top(logits_of([0.6, 0.3, 0.1]), 1), torch.ones(1, 1))
    assert merged.item() == pytest.approx(0.6, rel=1e-5)


def test_topk_merges_the_rest_into_one_bucket_by_hand():
    # Three tokens, k = 1: p = (0.6, 0.3, 0.1) keeps token 0 and the bucket 0.4; q = (0.2, 0.5, 0.3) -> (0.2, 0.8).
    p, q = logits_of([0.6, 0.3, 0.1]), logits_of([0.2, 0.5, 0.3])
    top_logp, top_idx = _top(p, 1)
    mask = torch.ones(1, 1)
    fkl = 0.6 * math.log(0.6 / 0.2) + 0.4 * math.log(0.4 / 0.8)
    rkl = 0.2 * math.log(0.2 / 0.6) + 0.8 * math.log(0.8 / 0.4)
    assert divergence_topk("forward_kl", q, top_logp, top_idx, mask).item() == pytest.approx(fkl, rel=1e-5)
    assert divergence_topk("reverse_kl", q, top_logp, top_idx, mask).item() == pytest.approx(rkl, rel=1e-5)
    assert divergence_topk("tvd", q, top_logp, top_idx, mask).item() == pytest.approx(0.4, rel=1e-5)
    # Merging outcomes can only shrink a divergence: a lower bound of the full one.
    for kind in DIVERGENCES:
        assert divergence_topk(kind, q, top_logp, top_idx, mask) <= divergence(kind, q, p, mask) + 1e-6


def test_topk_gradient_is_finite_and_moves_q_towards_p():
    g = torch.Generator().manual_seed(1)
    target = torch.randn(1, 4, 9, generator=g) * 3
    draft = torch.zeros(1, 4, 9, requires_grad=True)
    for k in (3, 9):  # k = V leaves an empty bucket on both sides
        top_logp, top_idx = _top(target, k)
        for kind in DIVERGENCES:
            loss = divergence_topk(kind, draft, top_logp, top_idx, torch.ones(1, 4))
            (grad,) = torch.autograd.grad(loss, draft)
            assert torch.isfinite(grad).all(), (kind, k)
            stepped = divergence_topk(kind, draft - 0.5 * grad, top_logp, top_idx, torch.ones(1, 4))
            assert stepped < loss, (kind, k)
