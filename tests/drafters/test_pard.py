"""PARD (drafters/pard.py): a draft LM guessing k tokens in one forward from k - 1 mask tokens. Its training rows
and their mask, drafting that is the training computation, lossless greedy and sampled output at batch 1 (lean
and Hugging Face paths) and the refusal of trees. Batches: tests/eval/test_batching.py."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from drafters.pard import PardLM, parallel_sequences, pard_settings
from drafters.sampling import Sampling
from drafters.tree import TreeShape
from eval.speculative import autoregressive_generate, speculative_generate
from helpers import chi2_pvalue, empirical_joint, exact_joint, tiny_llama

VOCAB = 64
GREEDY = Sampling()
MASK = VOCAB - 1


def pard(model, depths=4, mask=MASK):
    """`model` as a PARD draft: its config names the mask token and the depths."""
    model = copy.deepcopy(model)
    model.config.pard_token, model.config.pard_depths = mask, depths
    return model


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=0, logit_scale=4.0)


@pytest.fixture(scope="module")
def draft(target):
    """The target with a noisy output head, as a PARD draft: its guesses mix hits and misses."""
    model = pard(target)
    with torch.no_grad():
        weight = model.lm_head.weight
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)) * weight.std())
    return model


def test_the_settings_come_from_the_config(target):
    assert pard_settings(target.config) is None
    assert pard_settings(pard(target, depths=6, mask=7).config) == (7, 6)
    with pytest.raises(ValueError, match="no pard_token"):
        PardLM(target)


def test_training_rows_see_the_real_prefix_and_their_own_chain():
    """Entry (anchor a, depth d) sits at position a + d, carries the mask token past depth 0, and sees the real
    tokens 0..a and its own chain's masks 1..d: what mask d sees drafting after the real token at a."""
    ids = torch.arange(10, 20)[None]
    ones = torch.ones_like(ids)
    loss = torch.zeros_like(ids)
    loss[:, 4:] = 1
    rows = parallel_sequences(ids, ones, loss, mask_token_id=MASK, depths=3, ratio=1.0, min_ratio=1.0,
                              max_anchors=99, keep_all=True)
    anchors, depth, allowed = rows["anchors"][0], rows["depth"][0], rows["allowed"][0]
    assert (rows["input_ids"][0] == torch.where(depth == 0, ids[0, anchors], MASK)).all()
    assert (rows["position_ids"][0] == anchors + depth).all()
    for q in range(len(anchors)):
        for k in range(len(anchors)):
            a, d, b, e = int(anchors[q]), int(depth[q]), int(anchors[k]), int(depth[k])
            assert bool(allowed[q, k]) == ((e == 0 and b <= a) or (b == a and e <= d)), (a, d, b, e)
    # Chains start where the loss reads the next token (anchors 3..8) and end at the sequence's end.
    assert sorted(anchors[depth == 2].tolist()) == list(range(3, 7))
    assert rows["reads"][0].sum() == 6 + 5 + 4


def _training_guesses(model, ids, n):
    """What training's forward computes for the chain at the last committed token: its n greedy guesses."""
    m = len(ids) - 1
    seq = torch.tensor([ids + [0] * n])  # n tokens after it, whatever they are, for its chain to read
    loss = torch.zeros_like(seq)
    loss[:, m + 1:] = 1
    rows = parallel_sequences(seq, torch.ones_like(seq), loss, mask_token_id=MASK, depths=n, ratio=1.0, min_ratio=1.0,
                              max_anchors=99, keep_all=True)
    with torch.no_grad():
        logits = model(input_ids=rows["input_ids"], position_ids=rows["position_ids"],
                       attention_mask=rows["allowed"][:, None]).logits[0]
    at = [int(((rows["anchors"][0] == m) & (rows["depth"][0] == d)).nonzero()[0]) for d in range(n)]
    return logits[at].argmax(-1).tolist()


@pytest.mark.parametrize("lean", [True, False])
def test_drafting_with_cache_and_rollback_is_the_training_computation(draft, lean):
    """Random rounds of propose / commit: every proposal is what training's forward (the mask, the positions)
    computes on the committed sequence, so neither the cache nor the cropped masks drift from training."""
    rng = random.Random(0)
    drafter = PardLM(draft, lean=lean)
    ids = [rng.randrange(VOCAB - 1) for _ in range(6)]
    drafter.start(torch.tensor(ids))
    for _ in range(10):
        k = rng.choice([1, 2, 3, 4, 6])
        guesses = drafter.propose(k, GREEDY).tokens.tolist()
        assert len(guesses) == min(k, 4)
        assert guesses == _training_guesses(draft, ids, len(guesses)), (len(ids), k)
        a = rng.randrange(len(guesses) + 1)
        nxt = rng.randrange(VOCAB - 1)
        drafter.commit(a, nxt)
        ids = ids + guesses[:a] + [nxt]


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_output_is_the_targets(target, draft, lean, k):
    g = torch.Generator().manual_seed(1)
    for n in (1, 4, 11):
        prompt = torch.randint(0, VOCAB, (n,), generator=g)
        ref = autoregressive_generate(target, prompt, sampling=GREEDY, max_new_tokens=24).tokens
        out = speculative_generate(target, PardLM(draft, lean=lean), prompt, k=k, sampling=GREEDY, max_new_tokens=24)
        assert out.tokens == ref
        assert max(r.proposed for r in out.rounds) == min(k, 4)


def test_greedy_with_confidence_stop_is_the_targets_and_cuts_rounds(target, draft):
    prompt = torch.tensor([5, 9, 3, 17])
    ref = autoregressive_generate(target, prompt, sampling=GREEDY, max_new_tokens=30).tokens
    for rule in ("propose", "drop"):
        out = speculative_generate(target, PardLM(draft, stop_below=0.6, stop_rule=rule), prompt, k=4,
                                   sampling=GREEDY, max_new_tokens=30)
        assert out.tokens == ref
        assert any(r.proposed < 4 for r in out.rounds)


SMALL_V = 6


@pytest.mark.parametrize("lean", [True, False])
def test_sampled_output_follows_the_targets_distribution(lean):
    target = tiny_llama(SMALL_V, hidden=16, seed=5, logit_scale=3.0)
    draft = pard(tiny_llama(SMALL_V, hidden=16, seed=6, logit_scale=3.0), depths=3, mask=SMALL_V - 1)
    prompt, sampling = torch.tensor([1, 4, 2]), Sampling(temperature=1.0)
    exact = exact_joint(target, prompt, sampling, SMALL_V)
    counts = empirical_joint(target, PardLM(draft, lean=lean), prompt, sampling, SMALL_V, 2, 2000)
    assert chi2_pvalue(counts, exact) > 1e-3


def test_a_tree_is_a_clear_error(target, draft):
    with pytest.raises(ValueError, match="PARD\\) drafts chains only: a tree \\(d3t2n5\\)"):
        speculative_generate(target, PardLM(draft), torch.tensor([1, 2, 3]), k=0, tree=TreeShape(3, 2, 5),
                             sampling=GREEDY, max_new_tokens=8)
