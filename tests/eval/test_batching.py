"""Batched decoding (eval/batching.py) is lossless at every batch size: each row's greedy output equals that
prompt's plain greedy output at batch 1, and sampled rows follow the target's distribution."""

from __future__ import annotations

import copy

import pytest
import torch

from drafters.draft_lm import DraftLM
from drafters.pard import PardLM
from drafters.kv_cache import RaggedRows
from drafters.ngram import NgramDrafter
from drafters.sampling import Sampling
from eval.batching import autoregressive_generate_batch, speculative_generate_batch
from eval.speculative import accept_sampled, autoregressive_generate, speculative_generate
from helpers import FAMILIES, batched_pvalues, tiny, tiny_llama

VOCAB = 64
GREEDY = Sampling()
SAMPLED = Sampling(temperature=1.0)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=0, logit_scale=4.0)


@pytest.fixture(scope="module")
def draft():
    """The target with a noisy output head: right often enough that rows keep different numbers of guesses."""
    model = tiny_llama(VOCAB, seed=0, logit_scale=4.0)
    with torch.no_grad():
        weight = model.lm_head.weight
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)) * weight.std())
    return model


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    repetitive = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5, 6])
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in (1, 4, 11, 7, 2)] + [repetitive]


def reference(target, prompt, n, eos=None):
    return autoregressive_generate(target, prompt, sampling=GREEDY, max_new_tokens=n, eos_token_id=eos).tokens


def test_the_lean_draft_path_batches_with_each_rows_logits_alone(draft, prompts):
    """The draft LM's lean decoder on a ragged batch (drafters/llama_decode.py `forward_rows`): after feeds of
    different lengths and different rollbacks, each row's last logits are its own batch-1 forward's."""
    lean = DraftLM(draft).lean
    assert lean is not None
    rows = RaggedRows(3, torch.device("cpu"))
    caches = lean.start_rows(rows)
    seqs = [prompts[i].tolist() for i in (1, 2, 4)]
    first = lean.forward_rows(seqs, rows, caches)
    extra = [[3, 9, 12], [4], [7, 7]]
    lean.forward_rows(extra, rows, caches)
    rows.crop([len(s) + len(e) - drop for s, e, drop in zip(seqs, extra, (2, 0, 1))])
    kept = [s + e[: len(e) - drop] for s, e, drop in zip(seqs, extra, (2, 0, 1))]
    more = [[30], [31, 32], [33]]
    after = lean.forward_rows(more, rows, caches)
    with torch.no_grad():
        for b in range(3):
            torch.testing.assert_close(first[b], draft(torch.tensor([seqs[b]])).logits[0, -1], rtol=1e-5, atol=1e-5)
            alone = draft(torch.tensor([kept[b] + more[b]])).logits[0, -1]
            torch.testing.assert_close(after[b], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 2, 3, 6])
def test_plain_batched_decoding_equals_batch_1(target, prompts, batch):
    chosen = prompts[:batch]
    out = autoregressive_generate_batch(target, chosen, sampling=GREEDY, max_new_tokens=20)
    assert [g.tokens for g in out.rows] == [reference(target, p, 20) for p in chosen]


def _pard(model, depths=4):
    """`model` as a PARD draft (drafters/pard.py): its config names a mask token (the last id) and its depths."""
    model = copy.deepcopy(model)
    model.config.pard_token, model.config.pard_depths = model.config.vocab_size - 1, depths
    return model


def _single(draft):
    pard = _pard(draft)
    return {"draft_lm": lambda: DraftLM(draft), "draft_lm_hf_forward": lambda: DraftLM(draft, lean=False),
            "pard": lambda: PardLM(pard), "pard_hf_forward": lambda: PardLM(pard, lean=False),
            "ngram": lambda: NgramDrafter()}


def _drafters(draft):
    return {name: (lambda make=make: make().batched()) for name, make in _single(draft).items()}


WHICH = ["draft_lm", "draft_lm_hf_forward", "pard", "pard_hf_forward", "ngram"]


@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("batch", [1, 2, 6])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_rows_equal_their_plain_output_at_batch_1(target, draft, prompts, which, batch, k):
    chosen = prompts[:batch]
    out = speculative_generate_batch(target, _drafters(draft)[which](), chosen, k=k, sampling=GREEDY,
                                     max_new_tokens=24)
    assert [g.tokens for g in out.rows] == [reference(target, p, 24) for p in chosen]
    # Rows keep their own numbers of guesses: acceptance differs between rows somewhere.
    if batch > 1 and k > 1:
        assert len({tuple(r.accepted for r in g.rounds) for g in out.rows}) > 1


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("lean", [True, False])
def test_each_row_drafts_round_by_round_as_the_draft_lm_alone(target, draft, prompts, lean, parallel):
    """The batch's draft LM (ragged cache, per-row rollback, per-row confidence stop), and a PARD draft's, proposes
    and keeps, round by round, what it proposes and keeps drafting each prompt alone."""
    from eval.speculative import speculative_generate

    cls, model = (PardLM, _pard(draft)) if parallel else (DraftLM, draft)
    for stop, rule in ((0.0, "propose"), (0.6, "propose"), (0.6, "drop")):
        out = speculative_generate_batch(target, cls(model, lean=lean, stop_below=stop, stop_rule=rule).batched(),
                                         prompts, k=4, sampling=GREEDY, max_new_tokens=24)
        alone = [speculative_generate(target, cls(model, lean=lean, stop_below=stop, stop_rule=rule), p, k=4,
                                      sampling=GREEDY, max_new_tokens=24) for p in prompts]
        assert [[(r.proposed, r.accepted) for r in g.rounds] for g in out.rows] == \
            [[(r.proposed, r.accepted) for r in a.rounds] for a in alone]
        if stop:
            assert any(r.proposed < 4 for g in out.rows for r in g.rounds)


def test_rows_that_end_leave_the_batch_and_the_rest_go_on(target, draft, prompts):
    """An end token that only some rows produce early: those rows stop there, the others run to the budget."""
    refs = [reference(target, p, 30) for p in prompts]
    eos = refs[2][3]  # the fourth token of row 2: row 2 ends early, others where (if) they produce it
    out = speculative_generate_batch(target, DraftLM(draft).batched(), prompts, k=3, sampling=GREEDY,
                                     max_new_tokens=30, eos_token_id=eos)
    assert [g.tokens for g in out.rows] == [reference(target, p, 30, eos) for p in prompts]
    assert len(out.rows[2].tokens) <= 4 and max(len(g.tokens) for g in out.rows) == 30
    assert out.rounds[-1].rows < len(prompts)  # the batch shrank
    assert out.occupancy == sum(r.rows for r in out.rounds) / len(out.rounds) / len(prompts) < 1
    plain = autoregressive_generate_batch(target, prompts, sampling=GREEDY, max_new_tokens=30, eos_token_id=eos)
    assert [g.tokens for g in plain.rows] == [g.tokens for g in out.rows]
    assert plain.step_rows[0] == len(prompts) > plain.step_rows[-1] and plain.occupancy < 1


@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("slots", [1, 2, 4])
def test_prompts_join_as_rows_finish_and_each_decodes_as_alone(target, draft, prompts, which, slots):
    """Continuous batching (`slots` rows at once): a prompt joins as a row finishes (an end token makes the
    rows finish at different rounds); every prompt's output is its plain output at batch 1, and it proposes
    and keeps, round by round, what the drafter proposes and keeps on that prompt alone."""
    refs = [reference(target, p, 30) for p in prompts]
    eos = refs[2][3]
    expected = [reference(target, p, 30, eos) for p in prompts]
    plain = autoregressive_generate_batch(target, prompts, sampling=GREEDY, max_new_tokens=30, eos_token_id=eos,
                                          slots=slots)
    assert [g.tokens for g in plain.rows] == expected
    assert max(plain.step_rows) == slots
    out = speculative_generate_batch(target, _drafters(draft)[which](), prompts, k=3, sampling=GREEDY,
                                     max_new_tokens=30, eos_token_id=eos, slots=slots)
    assert [g.tokens for g in out.rows] == expected
    assert max(r.rows for r in out.rounds) == slots
    single = _single(draft)[which]
    alone = [speculative_generate(target, single(), p, k=3, sampling=GREEDY, max_new_tokens=30, eos_token_id=eos)
             for p in prompts]
    assert [[(r.proposed, r.accepted) for r in g.rounds] for g in out.rows] == \
        [[(r.proposed, r.accepted) for r in a.rounds] for a in alone]


def test_keep_full_keeps_every_slot_busy_until_the_last_prompt_ends(target, draft, prompts):
    """`keep_full`: extra rows (cycling through the prompts) fill the slots until every prompt has ended, so
    every round and step decodes `slots` rows; only the prompts' Generations come back, each with its share
    of the time, and the shares of all rows together are the run's time."""
    for slots in (2, 4):
        out = speculative_generate_batch(target, DraftLM(draft).batched(), prompts, k=3, sampling=GREEDY,
                                         max_new_tokens=20, slots=slots, keep_full=True, timed=True)
        assert [g.tokens for g in out.rows] == [reference(target, p, 20) for p in prompts]
        assert {r.rows for r in out.rounds} == {slots} and out.occupancy == 1.0
        assert all(g.seconds > g.prefill_s > 0 for g in out.rows)
        assert sum(g.seconds for g in out.rows) < out.seconds
        plain = autoregressive_generate_batch(target, prompts, sampling=GREEDY, max_new_tokens=20, slots=slots,
                                              keep_full=True, timed=True)
        assert [g.tokens for g in plain.rows] == [g.tokens for g in out.rows]
        assert set(plain.step_rows) == {slots} and len(plain.step_s) == len(plain.step_rows)
        assert all(len(g.step_s) == len(g.tokens) - 1 for g in plain.rows)  # each prompt's own steps
    # Without extra rows the batch empties at the end, and the rows' shares add up to the run's time.
    out = speculative_generate_batch(target, DraftLM(draft).batched(), prompts, k=3, sampling=GREEDY,
                                     max_new_tokens=20, slots=4)
    assert out.rounds[-1].rows < 4 and out.occupancy < 1
    assert sum(g.seconds for g in out.rows) == pytest.approx(out.seconds, rel=0.05)


@pytest.mark.parametrize("batch", [1, 3])
def test_timed_loops_time_whole_rounds_steps_and_the_prefill(target, draft, prompts, batch):
    """What the cost model reads: a round's whole time holds its drafting and verification, a plain step is
    timed per forward after the prefill, and untimed loops record none of it."""
    rows = prompts[:batch]
    kw = dict(sampling=GREEDY, max_new_tokens=12)
    if batch == 1:
        plain = autoregressive_generate(target, rows[0], **kw, timed=True)
        spec = speculative_generate(target, DraftLM(draft), rows[0], k=3, **kw, timed=True)
        rounds, steps = spec.rounds, plain.step_s
    else:
        plain = autoregressive_generate_batch(target, rows, **kw, timed=True)
        spec = speculative_generate_batch(target, DraftLM(draft).batched(), rows, k=3, **kw, timed=True)
        rounds = spec.rounds + [r for g in spec.rows for r in g.rounds]
        steps = plain.step_s
    assert rounds and all(r.round_s >= r.draft_s + r.verify_s > 0 for r in rounds)
    assert len(steps) == plain.target_forwards - 1 and all(s > 0 for s in steps)
    assert plain.prefill_s > 0 and spec.prefill_s > 0
    untimed = speculative_generate_batch(target, DraftLM(draft).batched(), rows, k=3, **kw)
    assert untimed.prefill_s is None and all(r.round_s is None for r in untimed.rounds)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_batches_losslessly(family):
    target, draft = tiny(family), tiny(family)
    with torch.no_grad():  # the target with a noisy output head: accepted sometimes, row by row
        weight = draft.get_output_embeddings().weight
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)) * weight.std())
    g = torch.Generator().manual_seed(2)
    chosen = [torch.randint(2, 48, (n,), generator=g) for n in (3, 9, 5)]
    refs = [reference(target, p, 16) for p in chosen]
    assert [r.tokens for r in autoregressive_generate_batch(target, chosen, sampling=GREEDY,
                                                            max_new_tokens=16).rows] == refs
    for drafter in (DraftLM(draft).batched(), NgramDrafter().batched()):
        out = speculative_generate_batch(target, drafter, chosen, k=3, sampling=GREEDY, max_new_tokens=16)
        assert [r.tokens for r in out.rows] == refs


# --- sampled rows follow the target's distribution ------------------------------------------------------

SMALL_V = 6
N_SAMPLES = 3000


@pytest.fixture(scope="module")
def small_pair():
    target = tiny_llama(SMALL_V, hidden=16, layers=1, seed=10, logit_scale=12.0)
    draft = tiny_llama(SMALL_V, hidden=16, layers=1, seed=11, logit_scale=12.0)
    return target, draft


def _pvalues(target, make, slots=None):
    return batched_pvalues(target, make, SAMPLED, SMALL_V, N_SAMPLES // 2, slots=slots)


@pytest.mark.parametrize("slots", [None, 3])
@pytest.mark.parametrize("which", WHICH)
def test_sampled_rows_follow_the_target_distribution(small_pair, which, slots):
    target, draft = small_pair
    make = {**_drafters(draft), "ngram": lambda: NgramDrafter(max_ngram=1).batched()}[which]
    assert min(_pvalues(target, make, slots)) > 1e-3


def test_the_batched_distribution_test_catches_a_wrong_residual(small_pair, monkeypatch):
    """On rejection, resampling from p instead of normalize(max(0, p - q)) is caught at batch 4."""
    import eval.batching

    target, draft = small_pair

    def wrong(draft_tokens, draft_probs, target_probs, generator=None):
        accepted, token = accept_sampled(draft_tokens, draft_probs, target_probs, generator)
        if accepted < draft_tokens.numel():
            token = int(torch.multinomial(target_probs[accepted], 1, generator=generator).item())
        return accepted, token

    monkeypatch.setattr(eval.batching, "accept_sampled", wrong)
    assert min(_pvalues(target, lambda: DraftLM(draft).batched())) < 1e-3
