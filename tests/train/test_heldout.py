"""The held-out figures every recipe chooses its best checkpoint by (train/heldout.py): the greedy replay, the
figures from per-depth sums, and each sequential or parallel draft LM's hits, whose replay must give the loop's own
rounds on the target's greedy answers (the heads' is tests/train/test_heads.py
`test_the_greedy_replay_keeps_what_the_loop_keeps`)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from drafters.draft_lm import DraftLM
from drafters.pard import PardLM
from drafters.sampling import Sampling
from eval.speculative import autoregressive_generate, speculative_generate
from helpers import tiny_llama
from train.distill import DraftLMRecipe
from train.heldout import HeldoutScores, HeldoutTotals, best_record, greedy_rounds
from train.pard import PardRecipe

VOCAB, MASK = 64, 63


def test_the_greedy_replay_on_a_hand_made_answer():
    answer = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]])  # the target's first answer token at 2
    all_hits = [torch.ones_like(answer, dtype=torch.bool)] * 3
    # rounds at entries 1 (keeps 3: tokens 3-5, +6), 5 (keeps 3: 7-9, +10 past the answer): 8 tokens, 2 rounds
    assert greedy_rounds(all_hits, answer) == [(8, 2)]
    assert greedy_rounds([torch.zeros_like(answer, dtype=torch.bool)] * 3, answer) == [(7, 7)]
    second_misses = [all_hits[0], torch.zeros_like(answer, dtype=torch.bool), all_hits[2]]
    # rounds at 1, 3, 5, 7 keep 1 each; the last one's own token falls past the answer and counts, as in the loop
    assert greedy_rounds(second_misses, answer) == [(8, 4)]
    assert greedy_rounds([h.repeat(2, 1) for h in all_hits], torch.cat([answer, answer.roll(1)])) == [(8, 2), (8, 2)]


def test_the_figures_from_the_sums():
    answer = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]])
    hits = [torch.ones_like(answer, dtype=torch.bool)] * 3
    totals = HeldoutTotals()
    totals.add(HeldoutScores(accept=[3.0, 1.0, 0.0], top1=[4.0, 2.0, 0.0], count=[4.0, 4.0, 0.0], hits=hits),
               ["code"], answer)
    totals.add(HeldoutScores(accept=[1.0, 1.0, 0.0], top1=[0.0, 0.0, 0.0], count=[4.0, 4.0, 0.0],
                             hits=[torch.zeros_like(h) for h in hits]), ["chat"], answer)
    got = totals.figures()
    # depth 2 scored nothing: the figures stop at depth 1 (alphas 0.5, 0.25; top-1 0.5, 0.25)
    assert got["heldout_step_acceptance"] == [0.5, 0.25] and got["heldout_acceptance"] == 0.5
    assert got["heldout_tokens_per_round"] == pytest.approx(1 + 0.5 + 0.5 * 0.25)
    assert got["heldout_tokens_per_round_greedy"] == pytest.approx(1 + 0.5 + 0.5 * 0.25)
    assert got["heldout_tau_greedy_by_category"] == {"chat": 1.0, "code": 4.0}
    assert got["heldout_tau_greedy"] == pytest.approx((8 + 7) / (2 + 7))
    assert best_record(got, 7)["step"] == 7 and best_record(got, 7)["tau_greedy"] == got["heldout_tau_greedy"]
    with pytest.raises(ValueError, match="no held-out record has an answer token"):
        empty = HeldoutTotals()
        empty.add(HeldoutScores(accept=[0.0], top1=[0.0], count=[0.0], hits=[hits[0]]), ["code"], answer)
        empty.figures()


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, hidden=32, layers=2, seed=0, logit_scale=4.0).requires_grad_(False)


def _noisy(model, seed: int):
    """`model` with a noisy output head: its guesses mix hits and misses."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        w = model.lm_head.weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(seed)) * w.std())
    return model


def _greedy_records(target, n_records: int = 3):
    """(prompt length, ids (1, T), answer mask (1, T)) of the target's greedy answers to random prompts."""
    out = []
    for n in (2, 5, 9)[:n_records]:
        prompt = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n))
        answer = autoregressive_generate(target, prompt, sampling=Sampling(), max_new_tokens=40).tokens
        ids = torch.cat([prompt, torch.tensor(answer)])[None]
        mask = torch.zeros_like(ids)
        mask[:, n:] = 1
        out.append((prompt, ids, mask))
    return out


def _batch(ids, mask):
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}


@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_draft_lms_replay_keeps_what_the_loop_keeps(target, k):
    draft = _noisy(target, 3)
    recipe = SimpleNamespace(model=draft, target=target, cfg=OmegaConf.create({"evaluate": {"ks": [2, k]}}),
                             heldout_target={})
    recipe._heldout_target = lambda ids, attn: DraftLMRecipe._heldout_target(recipe, ids, attn)
    kept = set()
    for prompt, ids, mask in _greedy_records(target):
        with torch.no_grad():
            scores = DraftLMRecipe._score_heldout(recipe, _batch(ids, mask))
        assert len(scores.hits) == max(2, k) and len(scores.accept) == max(2, k)
        out = speculative_generate(target, DraftLM(draft), prompt, k=max(2, k), sampling=Sampling(), max_new_tokens=40)
        assert out.tokens == ids[0, len(prompt):].tolist()
        assert greedy_rounds(scores.hits, mask) == [(sum(r.accepted + 1 for r in out.rounds), len(out.rounds))]
        kept |= {r.accepted for r in out.rounds}
    assert len(kept) > 2  # rounds that kept different numbers of guesses: not all hits, not all misses


def test_a_pard_drafts_replay_keeps_what_the_loop_keeps(target):
    depths = 4
    draft = _noisy(target, 5)
    draft.config.pard_token, draft.config.pard_depths = MASK, depths
    recipe = SimpleNamespace(model=draft, target=target, mask_token_id=MASK, acc=SimpleNamespace(unwrap_model=lambda m: m),
                             cfg=OmegaConf.create({"drafter": {"num_depths": depths, "cod_ratio": 0.7,
                                                               "cod_min_ratio": 0.2, "max_anchors": 512}}),
                             heldout_target={})
    recipe._heldout_target = lambda ids, attn: PardRecipe._heldout_target(recipe, ids, attn)
    recipe._rows = lambda batch, keep_all=False: PardRecipe._rows(recipe, batch, keep_all)
    recipe._forward = lambda rows: PardRecipe._forward(recipe, rows)
    kept = set()
    for prompt, ids, mask in _greedy_records(target):
        with torch.no_grad():
            scores = PardRecipe._score_heldout(recipe, _batch(ids, mask))
        out = speculative_generate(target, PardLM(draft), prompt, k=depths, sampling=Sampling(), max_new_tokens=40)
        assert out.tokens == ids[0, len(prompt):].tolist()
        assert greedy_rounds(scores.hits, mask) == [(sum(r.accepted + 1 for r in out.rounds), len(out.rounds))]
        kept |= {r.accepted for r in out.rounds}
    assert len(kept) >= 2  # hits and misses (an untrained draft seldom guesses past a mask)
