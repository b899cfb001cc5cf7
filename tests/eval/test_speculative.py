"""The loop is lossless: greedy equals target greedy token for token; sampling follows the target."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import DynamicCache

import eval.speculative as spec
from helpers import Recording, ScriptedDrafter, chi2_pvalue, empirical_joint, exact_joint, stop_point, tiny_llama
from drafters.draft_lm import DraftLM
from drafters.hf_cache import cache_keyword
from drafters.ngram import NgramDrafter
from drafters.sampling import Sampling
from drafters.tree import TreeShape
from eval.speculative import accept_greedy, accept_sampled, autoregressive_generate, rollback, speculative_generate

VOCAB = 64
GREEDY = Sampling()


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=0, logit_scale=4.0)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    # A repetitive prompt gives the n-gram drafter something to find.
    repetitive = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5, 6])
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in (1, 4, 11)] + [repetitive]


def reference(target, prompt, n=40, eos=None):
    return autoregressive_generate(target, prompt, sampling=GREEDY, max_new_tokens=n, eos_token_id=eos).tokens


POLICIES = {
    "always": lambda pos: True,
    "never": lambda pos: False,
    "sometimes": lambda pos: pos % 3 != 2,
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_equals_target_with_stub_drafters(target, prompts, policy, k):
    for prompt in prompts:
        ref = reference(target, prompt)
        drafter = ScriptedDrafter(ref, VOCAB, POLICIES[policy])
        out = speculative_generate(target, drafter, prompt, k=k, sampling=GREEDY, max_new_tokens=40)
        assert out.tokens == ref
        accepted = [r.accepted for r in out.rounds]
        if policy == "always":
            assert all(a == k for a in accepted[:-1])  # the last round may be cut by the budget
            assert out.target_forwards == 1 + -(-39 // (k + 1))  # the prompt's forward gives the first
        elif policy == "never":
            assert set(accepted) == {0} and out.target_forwards == 40


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_target_with_model_and_ngram_drafters(target, prompts, k):
    other = tiny_llama(VOCAB, seed=3, logit_scale=4.0)
    drafters = [DraftLM(target, name="self"), DraftLM(other, name="other"),
                DraftLM(other, name="other, Hugging Face forward", lean=False), NgramDrafter()]
    assert drafters[0].lean is not None and drafters[2].lean is None
    for prompt, drafter in itertools.product(prompts, drafters):
        ref = reference(target, prompt)
        out = speculative_generate(target, drafter, prompt, k=k, sampling=GREEDY, max_new_tokens=40)
        assert out.tokens == ref, drafter.name
        if drafter.name == "self":  # the target drafting for itself is always right
            assert all(r.accepted == k for r in out.rounds[:-1])


def test_ngram_drafter_is_accepted_on_repetitive_text(target, prompts):
    ref = reference(target, prompts[-1])
    out = speculative_generate(target, NgramDrafter(), prompts[-1], k=4, sampling=GREEDY, max_new_tokens=40)
    assert out.tokens == ref
    # A random target falls into a loop within 40 tokens; the n-gram drafter must then be accepted.
    assert max(r.accepted for r in out.rounds) >= 2


def test_stops_after_eos(target, prompts):
    ref = reference(target, prompts[1], n=40)
    eos = ref[9]  # pretend the 10th generated token is EOS
    expected = ref[: ref.index(eos) + 1]
    for drafter in (DraftLM(target), ScriptedDrafter(ref, VOCAB, POLICIES["always"])):
        out = speculative_generate(target, drafter, prompts[1], k=4, sampling=GREEDY, max_new_tokens=40,
                                   eos_token_id=eos)
        assert out.tokens == expected
    assert reference(target, prompts[1], eos=eos) == expected


def test_a_round_cut_by_the_end_of_the_answer_or_the_budget_keeps_only_the_guesses_emitted(target, prompts):
    """The target confirms guesses past an accepted end token (its greedy text goes on), but the answer
    never emits them: they are not kept, as llama.cpp counts them. Likewise guesses past the budget."""
    # Round 1 guesses tokens 1..4 (token 0 is the prompt forward's), round 2 tokens 6..9: an end token
    # there that appears nowhere before it.
    prompt, ref, position = next((p, ref, i) for p in prompts for ref in [reference(target, p, n=40)]
                                 for i in range(6, 9) if ref[i] not in ref[:i])
    drafter = ScriptedDrafter(ref, VOCAB, POLICIES["always"])
    out = speculative_generate(target, drafter, prompt, k=4, sampling=GREEDY, max_new_tokens=40,
                               eos_token_id=ref[position])
    assert out.tokens == ref[: position + 1]
    assert [r.accepted for r in out.rounds] == [4, position - 5]  # the end token kept, nothing after it
    out = speculative_generate(target, drafter, prompt, k=4, sampling=GREEDY, max_new_tokens=8)
    assert out.tokens == ref[:8] and [r.accepted for r in out.rounds] == [4, 2]


def test_rejects_bad_arguments(target):
    with pytest.raises(ValueError, match="k .* must be >= 1"):
        speculative_generate(target, NgramDrafter(), torch.tensor([1, 2]), k=0, sampling=GREEDY, max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt is empty"):
        speculative_generate(target, NgramDrafter(), torch.tensor([], dtype=torch.long), k=2, sampling=GREEDY,
                             max_new_tokens=4)


# --- acceptance rules on hand-built tensors ---------------------------------------------------------


def test_accept_greedy_counts_the_matching_prefix():
    logits = torch.full((4, 5), -1.0)
    for pos, tok in enumerate([2, 3, 4, 1]):
        logits[pos, tok] = 1.0
    assert accept_greedy(torch.tensor([2, 3, 4]), logits) == (3, 1)  # all kept, bonus token 1
    assert accept_greedy(torch.tensor([2, 0, 4]), logits) == (1, 3)  # correction at position 2
    assert accept_greedy(torch.tensor([0, 3, 4]), logits) == (0, 2)
    assert accept_greedy(torch.tensor([], dtype=torch.long), logits[:1]) == (0, 2)


def test_accept_sampled_certain_cases():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.5, 0.5, 0.0]])
    g = torch.Generator().manual_seed(0)
    # p(x)=1 >= q(x): always accepted, then the bonus from p[1].
    assert accept_sampled(torch.tensor([1]), q, p, g) == (1, 2)
    # p(x)=0: always rejected; the residual max(0, p - q) puts all mass on token 1.
    assert accept_sampled(torch.tensor([0]), q, p, g) == (0, 1)
    # Deterministic guess (q one-hot) of a token p gives probability 0: rejected, residual = p.
    assert accept_sampled(torch.tensor([2]), None, p, g) == (0, 1)


# --- distribution: sampled speculative decoding follows the target ----------------------------------


SMALL_V = 6
SAMPLED = Sampling(temperature=1.0)
N_SAMPLES = 2500


@pytest.fixture(scope="module")
def small_pair():
    target = tiny_llama(SMALL_V, hidden=16, layers=1, seed=10, logit_scale=12.0)
    draft = tiny_llama(SMALL_V, hidden=16, layers=1, seed=11, logit_scale=12.0)
    return target, draft, torch.tensor([1, 4, 2])


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("which", ["draft_lm", "draft_lm_hf_forward", "ngram"])
def test_sampled_output_follows_target_distribution(small_pair, k, which):
    target, draft, prompt = small_pair
    exact = exact_joint(target, prompt, SAMPLED, SMALL_V)
    drafter = NgramDrafter(max_ngram=1) if which == "ngram" else DraftLM(draft, lean=which == "draft_lm")
    counts = empirical_joint(target, drafter, prompt, SAMPLED, SMALL_V, k, N_SAMPLES)
    assert chi2_pvalue(counts, exact) > 1e-3


# --- the draft LM's confidence stop (drafters/base.py) -------------------------------------------------


@pytest.mark.parametrize("lean", [True, False])
def test_draft_lm_confidence_stop_ends_the_round_at_the_first_unsure_guess(target, prompts, lean):
    draft = tiny_llama(VOCAB, seed=5, logit_scale=4.0)
    ends = [stop_point(target, lambda stop: DraftLM(draft, lean=lean, stop_below=stop), prompt, 5, 0.013, seed)
            for prompt in prompts for seed in range(3)]
    # The random draft is near-uniform over 64 tokens (q about 1/64): 0.013 stops some rounds, at several places.
    assert min(ends) < 5 and max(ends) > 1, ends


@pytest.mark.parametrize("lean", [True, False])
def test_draft_lm_greedy_with_confidence_stop_equals_target(target, prompts, lean):
    draft, proposed = tiny_llama(VOCAB, seed=5, logit_scale=4.0), []
    for prompt in prompts:
        drafter = DraftLM(draft, lean=lean, stop_below=0.03)
        out = speculative_generate(target, drafter, prompt, k=5, sampling=GREEDY, max_new_tokens=40)
        assert out.tokens == reference(target, prompt), prompt.tolist()
        proposed += [r.proposed for r in out.rounds]
    assert min(proposed) < 5 and max(proposed) == 5, proposed  # the stop was exercised, and not always


@pytest.mark.parametrize("lean", [True, False])
def test_draft_lm_greedy_with_llama_cpps_stop_equals_target(target, prompts, lean):
    """stop_rule=drop (llama.cpp's --spec-draft-p-min): the unsure guess is not proposed, so rounds propose
    0 to k guesses, and the cache bookkeeping (every proposed guess fed) stays right."""
    draft, proposed = tiny_llama(VOCAB, seed=5, logit_scale=4.0), []
    for prompt in prompts:
        drafter = DraftLM(draft, lean=lean, stop_below=0.15, stop_rule="drop")  # p 0.12-0.23 over its top 10
        out = speculative_generate(target, drafter, prompt, k=5, sampling=GREEDY, max_new_tokens=40)
        assert out.tokens == reference(target, prompt), prompt.tolist()
        proposed += [r.proposed for r in out.rounds]
    assert min(proposed) == 0 and 0 < max(proposed), proposed


def test_draft_lm_sampled_with_confidence_stop_follows_target_distribution(small_pair):
    target, draft, prompt = small_pair
    exact = exact_joint(target, prompt, SAMPLED, SMALL_V)
    drafter = Recording(DraftLM(draft, stop_below=0.2))  # its first guesses have q 0.06 to 0.31
    counts = empirical_joint(target, drafter, prompt, SAMPLED, SMALL_V, 2, N_SAMPLES)
    assert chi2_pvalue(counts, exact) > 1e-3
    assert {len(p) for p in drafter.proposals} == {1, 2}  # first rounds stopped after one guess, and not


def test_draft_lm_sampled_with_llama_cpps_stop_follows_target_distribution(small_pair):
    target, draft, prompt = small_pair
    exact = exact_joint(target, prompt, SAMPLED, SMALL_V)
    def lengths(stop):  # llama.cpp's probability is the argmax's, whatever is drawn: find one that cuts some rounds
        drafter = Recording(DraftLM(draft, stop_below=stop, stop_rule="drop"))
        empirical_joint(target, drafter, prompt, SAMPLED, SMALL_V, 2, 40)
        return {len(p) for p in drafter.proposals}

    stop = next(s for s in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9) if {0, 2} <= lengths(s))
    drafter = Recording(DraftLM(draft, stop_below=stop, stop_rule="drop"))
    counts = empirical_joint(target, drafter, prompt, SAMPLED, SMALL_V, 2, N_SAMPLES)
    assert chi2_pvalue(counts, exact) > 1e-3
    assert {len(p) for p in drafter.proposals} >= {0, 2}  # the unsure first guess dropped, and not


def test_draft_lm_rejects_a_bad_stop_threshold(target):
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="stop_below must be in"):
            DraftLM(target, stop_below=bad)


@pytest.mark.parametrize("lean", [True, False])
def test_a_drafter_that_is_the_target_has_every_sampled_guess_accepted(target, prompts, lean):
    """q = p: each guess is kept with probability min(1, p/q) = 1, so every round accepts all k (the
    last may be cut by the budget). A mismatch between the distribution the drafter samples from and
    the one it reports (temperature, top-k/top-p, the draft-vocabulary mapping) would reject some."""
    for sampling in (Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=20, top_p=0.9)):
        for prompt in prompts:
            out = speculative_generate(target, DraftLM(target, lean=lean), prompt, k=4, sampling=sampling,
                                       max_new_tokens=30, generator=torch.Generator().manual_seed(0))
            assert [r.accepted for r in out.rounds[:-1]] == [4] * (len(out.rounds) - 1)
            assert out.target_forwards == 1 + -(-29 // 5)


def test_sampled_with_top_k_top_p_follows_processed_target(small_pair):
    target, draft, prompt = small_pair
    sampling = Sampling(temperature=0.8, top_k=4, top_p=0.9)
    exact = exact_joint(target, prompt, sampling, SMALL_V)
    counts = empirical_joint(target, DraftLM(draft), prompt, sampling, SMALL_V, 2, N_SAMPLES)
    assert counts[exact == 0].sum() == 0  # never a token the processing removed
    assert chi2_pvalue(counts, exact) > 1e-3


def _wrong_residual(draft_tokens, draft_probs, target_probs, generator=None):
    """The classic bug: on rejection, resample from p instead of normalize(max(0, p - q))."""
    accepted, token = accept_sampled(draft_tokens, draft_probs, target_probs, generator)
    if accepted < draft_tokens.numel():
        token = int(torch.multinomial(target_probs[accepted], 1, generator=generator).item())
    return accepted, token


def test_distribution_test_catches_a_wrong_residual(small_pair, monkeypatch):
    target, draft, prompt = small_pair
    monkeypatch.setattr(spec, "accept_sampled", _wrong_residual)
    exact = exact_joint(target, prompt, SAMPLED, SMALL_V)
    counts = empirical_joint(target, DraftLM(draft), prompt, SAMPLED, SMALL_V, 2, N_SAMPLES)
    assert chi2_pvalue(counts, exact) < 1e-3


def test_the_loop_passes_the_cache_under_the_keyword_the_model_takes(target, prompts):
    # transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and goes in 5.40): the loop
    # and the draft LM pass it under drafters/hf_cache.py's cache_keyword, so neither warns.
    import warnings

    other = tiny_llama(VOCAB, seed=3, logit_scale=4.0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        for drafter in (DraftLM(other, lean=False), NgramDrafter()):
            out = speculative_generate(target, drafter, prompts[2], k=3, sampling=GREEDY, max_new_tokens=12)
            assert out.tokens == reference(target, prompts[2], n=12)


# --- rollback ---------------------------------------------------------------------------------------


def test_rollback_gives_the_logits_of_a_recompute(target):
    seq = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        cache = DynamicCache()
        kw = cache_keyword(target)
        target(input_ids=seq[:, :8], **{kw: cache}, use_cache=True)
        target(input_ids=torch.tensor([[1, 2, 3, 4]]), **{kw: cache}, use_cache=True)  # rejected guesses
        rollback(cache, 8)
        assert cache.get_seq_length() == 8
        rolled = target(input_ids=seq[:, 8:], **{kw: cache}, use_cache=True).logits
        fresh = target(input_ids=seq).logits[:, 8:]
    torch.testing.assert_close(rolled, fresh, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lean", [True, False])
def test_draft_lm_cache_matches_recompute_after_rounds(target, prompts, lean):
    other = tiny_llama(VOCAB, seed=3, logit_scale=4.0)
    drafter = DraftLM(other, lean=lean)
    speculative_generate(target, drafter, prompts[2], k=3, sampling=GREEDY, max_new_tokens=25)
    # After generation the drafter's cache covers a prefix of its committed ids; continuing from the
    # cache must give the same next-token logits as reading all ids from scratch.
    with torch.no_grad():
        fresh = other(input_ids=torch.tensor([drafter.ids])).logits[0, -1]
        if lean:
            fed = drafter.lean.length
            assert 0 < fed < len(drafter.ids)
            cont = drafter.lean.forward(torch.tensor(drafter.ids[fed:]))
        else:
            fed = drafter.cache.get_seq_length()
            cont = other(input_ids=torch.tensor([drafter.ids[fed:]]),
                         **{cache_keyword(other): drafter.cache}).logits[0, -1]
    torch.testing.assert_close(cont, fresh, rtol=1e-5, atol=1e-5)


# --- trees (drafters/tree.py) --------------------------------------------------------------------------


@pytest.mark.parametrize("lean", [True, False])
def test_draft_lm_trees_of_width_one_keep_exactly_the_chain(target, prompts, lean):
    draft = tiny_llama(VOCAB, seed=3, logit_scale=4.0)
    for prompt in prompts:
        chain = speculative_generate(target, DraftLM(draft, lean=lean), prompt, k=4, sampling=GREEDY,
                                     max_new_tokens=30)
        tree = speculative_generate(target, DraftLM(draft, lean=lean), prompt, k=0, tree=TreeShape(4, 1, 4),
                                    sampling=GREEDY, max_new_tokens=30)
        assert tree.tokens == chain.tokens == reference(target, prompt, 30)
        assert [(r.proposed, r.accepted) for r in tree.rounds] == [(r.proposed, r.accepted) for r in chain.rounds]


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("shape", ["d3t3n8", "d5t2n9", "static:0,1,0.0,0.1,0.0.0,0.0.0.0"])
def test_draft_lm_trees_equal_target_greedy(target, prompts, lean, shape):
    """A draft LM close to the target (the target with noise) keeps long paths: the kept path's cache entries are
    moved in place, in the target's cache and in the draft's own, round after round."""
    draft = tiny_llama(VOCAB, seed=0, logit_scale=4.0)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    kept = 0
    for prompt in prompts:
        out = speculative_generate(target, DraftLM(draft, lean=lean), prompt, k=0, tree=TreeShape.parse(shape),
                                   sampling=GREEDY, max_new_tokens=40)
        assert out.tokens == reference(target, prompt, 40), prompt.tolist()
        kept += sum(r.accepted for r in out.rounds)
        assert all(r.depth == TreeShape.parse(shape).depth and r.proposed <= TreeShape.parse(shape).nodes
                   for r in out.rounds)
    assert kept > 40  # paths below the root's first child are kept and moved


@pytest.mark.parametrize("which", ["draft_lm", "draft_lm_hf_forward"])
def test_sampled_draft_lm_trees_follow_target_distribution(small_pair, which):
    target, draft, prompt = small_pair
    exact = exact_joint(target, prompt, SAMPLED, SMALL_V)
    counts = empirical_joint(target, DraftLM(draft, lean=which == "draft_lm"), prompt, SAMPLED, SMALL_V, 0,
                             N_SAMPLES, tree=TreeShape(2, 3, 6))
    assert chi2_pvalue(counts, exact) > 1e-3


@pytest.mark.parametrize("lean", [True, False])
def test_a_draft_lm_tree_scores_each_node_by_its_paths_log_probability(target, prompts, lean):
    """Every node of a draft LM's dynamic tree carries the draft's cumulative log-probability of the path to it,
    as plain forwards of the prefix and path give it: each depth's entries saw the prefix and their own
    ancestors, at their own positions, and nothing else."""
    draft = tiny_llama(VOCAB, seed=3, logit_scale=4.0)
    drafter = DraftLM(draft, lean=lean)
    drafter.start(prompts[2])
    tree = drafter.propose_tree(TreeShape(4, 3, 20), GREEDY)
    ids = prompts[2].tolist()
    for node in range(len(tree)):
        tokens = tree.tokens[tree.path_to(node)].tolist()
        with torch.no_grad():
            logp = torch.log_softmax(draft(input_ids=torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1], -1)
        assert float(tree.scores[node]) == pytest.approx(float(logp[range(len(tokens)), tokens].sum()), abs=1e-4)


def test_a_chain_only_drafter_refuses_a_tree(target, prompts):
    with pytest.raises(ValueError, match="drafter 'ngram' drafts chains only"):
        speculative_generate(target, NgramDrafter(), prompts[3], k=0, tree=TreeShape(2, 2, 4), sampling=GREEDY,
                             max_new_tokens=8)
