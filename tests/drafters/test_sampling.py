import pytest
import torch

from drafters.sampling import Sampling, choose, probs_from_logits


def test_greedy_is_one_hot_argmax():
    probs = probs_from_logits(torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]]), Sampling())
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, 3.0])
    torch.testing.assert_close(probs_from_logits(logits, Sampling(temperature=0.5)), (logits / 0.5).softmax(-1))


def test_top_k_keeps_k_most_likely():
    probs = probs_from_logits(torch.tensor([1.0, 4.0, 3.0, 2.0]), Sampling(temperature=1.0, top_k=2))
    assert (probs[[0, 3]] == 0).all()
    torch.testing.assert_close(probs[[1, 2]], torch.tensor([4.0, 3.0]).softmax(-1))


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    # 0.5 < 0.6, so the second token is needed; 0.8 >= 0.6, so the third is dropped.
    probs = probs_from_logits(logits, Sampling(temperature=1.0, top_p=0.6))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # The most likely token is kept even when it alone exceeds top_p.
    assert probs_from_logits(logits, Sampling(temperature=1.0, top_p=0.1)).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_choose_samples_from_processed_distribution():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([5.0, 4.0, -10.0])
    draws = [int(choose(logits, Sampling(temperature=1.0, top_k=1), g)) for _ in range(20)]
    assert set(draws) == {0}


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)])
def test_invalid_settings_are_rejected(kwargs):
    with pytest.raises(ValueError):
        Sampling(**kwargs)
