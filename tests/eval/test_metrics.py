import math

import pytest

from eval.metrics import acceptance_by_length, acceptance_stats, cost_model, expected_acceptance_length, length_bucket
from eval.speculative import Round


def rounds(accepted, proposed=None, k=4, draft_s=0.004, verify_s=0.012):
    proposed = proposed or [k] * len(accepted)
    return [Round(p, a, draft_s, verify_s) for a, p in zip(accepted, proposed)]


def test_acceptance_stats_on_hand_built_rounds():
    # 5 rounds at k=4: kept 0, 4, 2, 4, 0 -> tokens 1+5+3+5+1 = 15 in 5 rounds.
    s = acceptance_stats(rounds([0, 4, 2, 4, 0]), k=4)
    assert s.rounds == 5 and s.max_proposed == 4
    assert s.accept_hist == [2, 0, 1, 0, 2]
    assert s.mean_accepted == pytest.approx(2.0)
    assert s.median_accepted == 2.0
    assert s.p10_accepted == pytest.approx(0.0)
    assert s.p90_accepted == pytest.approx(4.0)
    assert s.zero_accept_rate == pytest.approx(0.4)
    assert s.full_hit_rate == pytest.approx(0.4)
    assert s.acceptance_rate == pytest.approx(10 / 20)
    assert s.acceptance_length == pytest.approx(3.0)
    # Position 1: 3 of 5 rounds kept it; position 2: 3 of 3 reached; position 3: 2 of 3; position 4: 2 of 2.
    assert s.position_acceptance == pytest.approx([0.6, 1.0, 2 / 3, 1.0])


def test_short_proposals_count_only_where_proposed():
    # An n-gram drafter proposing 2, 0 and 4 tokens at k=4.
    s = acceptance_stats(rounds([2, 0, 1], proposed=[2, 0, 4]), k=4)
    assert s.acceptance_rate == pytest.approx(3 / 6)
    assert s.mean_proposed == pytest.approx(2.0) and s.max_proposed == 4  # a full round still verified 4
    assert s.position_acceptance[0] == pytest.approx(2 / 2)  # the empty proposal did not reach position 1
    assert s.position_acceptance[2] is None  # nobody proposed a third token after keeping two


def test_inconsistent_rounds_are_rejected():
    with pytest.raises(ValueError, match="inconsistent"):
        acceptance_stats(rounds([3], proposed=[2]), k=4)
    with pytest.raises(ValueError, match="no rounds"):
        acceptance_stats([], k=4)


def test_cost_model():
    # draft 4 guesses in 4 ms -> 1 ms each; target step 10 ms -> c = 0.1; verify 12 ms -> beta = 0.2.
    cm = cost_model(rounds([1, 2, 3]), [0.010, 0.010, 0.011], k=4, acceptance_length=3.0)
    assert cm.cost_ratio == pytest.approx(0.1)
    assert cm.verify_overhead == pytest.approx(0.2)
    assert cm.predicted_speedup == pytest.approx(3.0 / (1 + 4 * 0.1 + 0.2))
    # A head with 2 draft steps at k=4 (MTP depth 2): its proposals are 2 long, so c is per drafted
    # token (4 ms / 2 = 2 ms -> 0.2) and the prediction counts 2 guesses per round.
    short = cost_model(rounds([1, 2], proposed=[2, 2]), [0.01], k=4, acceptance_length=2.5)
    assert short.cost_ratio == pytest.approx(0.2) and short.verify_overhead == pytest.approx(0.2)
    assert short.predicted_speedup == pytest.approx(2.5 / (1 + 2 * 0.2 + 0.2))
    # A model-free drafter proposing 2, 0 and 4: beta from the one round that verified 4 guesses.
    ngram = cost_model(rounds([1, 0, 2], proposed=[2, 0, 4], verify_s=0.013), [0.01], k=4, acceptance_length=2.0)
    assert ngram.verify_overhead == pytest.approx(0.3)


def test_a_round_that_proposes_nothing_is_charged_a_plain_step_not_a_full_round():
    """An n-gram drafter without a match proposes nothing: its round is the target's one forward, about a plain
    step, while its full rounds verify k+1 positions. Charging every round the full round's β predicted such a
    drafter 14-40 % below what it measured on SmolLM2 (make demo-real, the structure issue)."""
    ngram = [Round(4, 2, 0.0001, 0.016)] * 3 + [Round(0, 0, 0.0001, 0.0105)] * 6 + [Round(2, 1, 0.0001, 0.013)]
    cm = cost_model(ngram, [0.01], k=4, acceptance_length=1.8)
    assert cm.verify_overhead == pytest.approx(0.6)  # the full rounds' β, as reported
    assert cm.round_overhead == pytest.approx((3 * 0.6 + 6 * 0.05 + 0.3) / 10)
    mean_proposed = (3 * 4 + 2) / 10
    assert cm.predicted_speedup == pytest.approx(1.8 / (1 + mean_proposed * cm.cost_ratio + cm.round_overhead))
    assert cm.predicted_speedup > 1.8 / (1 + mean_proposed * cm.cost_ratio + cm.verify_overhead) * 1.2


def test_cost_model_with_a_confidence_stop():
    # Rounds of 4, 1, 4 and 2 guesses at k=4. c and beta come from the two full rounds (8 ms for 4 guesses ->
    # 2 ms each, c = 0.2; verify 13 ms -> beta = 0.3), not from the short ones' cheaper drafting; the
    # prediction charges the mean proposal, 11 / 4 guesses per round.
    stopped = [Round(4, 3, 0.008, 0.013), Round(1, 0, 0.003, 0.011), Round(4, 4, 0.008, 0.013),
               Round(2, 1, 0.005, 0.012)]
    cm = cost_model(stopped, [0.01], k=4, acceptance_length=2.5)
    assert cm.cost_ratio == pytest.approx(0.2) and cm.verify_overhead == pytest.approx(0.3)
    # Each round pays the rest of a round of its width: 0.3, 0.1, 0.3 and 0.2, 0.225 on average.
    assert cm.round_overhead == pytest.approx(0.225)
    assert cm.predicted_speedup == pytest.approx(2.5 / (1 + 11 / 4 * 0.2 + 0.225))
    assert acceptance_stats(stopped, k=4).mean_proposed == pytest.approx(11 / 4)


def test_a_parallel_drafter_pays_its_whole_forward_every_round():
    """A drafter whose k guesses are one forward (DFlash, P-EAGLE, PARD) pays that forward in every round, a short
    proposal included: c comes from every round's draft time, and the prediction charges n·c a round."""
    stopped = [Round(4, 3, 0.004, 0.013), Round(1, 0, 0.004, 0.011), Round(4, 4, 0.004, 0.013),
               Round(2, 1, 0.004, 0.012)]
    cm = cost_model(stopped, [0.01], k=4, acceptance_length=2.5, parallel=True)
    assert cm.cost_ratio == pytest.approx(0.1) and cm.draft_round == pytest.approx(0.4)
    assert cm.predicted_speedup == pytest.approx(2.5 / (1 + 0.4 + 0.225))
    sequential = cost_model(stopped, [0.01], k=4, acceptance_length=2.5)  # charged 11/4 steps of 0.1
    assert sequential.draft_round == pytest.approx(11 / 4 * 0.1)


def test_cost_model_charges_the_whole_round_and_the_prefill():
    # Draft 4 ms, verify 12 ms, the whole round 18 ms: the 2 ms of rollback and bookkeeping belong to the
    # round, so beta = (18 - 4) / 10 - 1 = 0.4, not the verification's 0.2.
    timed = [Round(4, a, 0.004, 0.012, 0.018) for a in (1, 2, 3)]
    steady = cost_model(timed, [0.01], k=4, acceptance_length=3.0)
    assert steady.verify_overhead == pytest.approx(0.4) and steady.prefill is None
    assert steady.predicted_speedup == pytest.approx(3.0 / (1 + 4 * 0.1 + 0.4))
    # 30 plain steps in 10 rounds after a 50 ms prefill (5 steps); the speculative prefill also starts the
    # drafter (60 ms, 6 steps): (5 + 30) / (6 + 10 * 1.8) = 35 / 24, below the steady state's 3 / 1.8.
    whole = cost_model(timed, [0.01], k=4, acceptance_length=3.0, steps=30, spec_rounds=10,
                       prefill_s=[0.05, 0.05, 0.07], spec_prefill_s=[0.06])
    assert (whole.prefill, whole.spec_prefill, whole.batch_acceptance_length) == pytest.approx((5.0, 6.0, 3.0))
    assert whole.predicted_speedup == pytest.approx(35 / 24)
    # A batch whose slowest row needs 12 rounds where its rows' tau says 10: every round is paid.
    batch = cost_model(timed, [0.01], k=4, acceptance_length=3.0, steps=30, spec_rounds=12, prefill_s=[0.05],
                       spec_prefill_s=[0.06])
    assert batch.batch_acceptance_length == pytest.approx(2.5)
    assert batch.predicted_speedup == pytest.approx(35 / (6 + 12 * 1.8))
    # Without the prefill times the prediction stays the steady state's.
    assert cost_model(timed, [0.01], k=4, acceptance_length=3.0, steps=30, spec_rounds=10).predicted_speedup == \
        pytest.approx(steady.predicted_speedup)



def test_expected_acceptance_length_matches_the_closed_form():
    assert expected_acceptance_length(0.8, 5) == pytest.approx(3.69, abs=0.01)  # ANCHORS section 1
    assert expected_acceptance_length(0.0, 5) == 1.0
    assert expected_acceptance_length(1.0, 5) == 6.0
    assert math.isclose(expected_acceptance_length(0.5, 1), 1.5)


def test_length_buckets_are_labelled_by_their_edges():
    assert [length_bucket(n) for n in (0, 127, 128, 511, 512, 2047, 2048, 8191, 8192, 32767, 32768, 10**6)] == [
        "<128", "<128", "128–511", "128–511", "512–2047", "512–2047", "2048–8191", "2048–8191", "8192–32767",
        "8192–32767", "≥32768", "≥32768"]


def test_acceptance_by_length_pools_each_buckets_rounds_and_counts_each_prompt_once():
    # Two short prompts (one measured twice, as repeats are), one long one whose generation drafted nothing.
    by_length = acceptance_by_length([
        (("code", 0), 40, rounds([4, 0])),  # τ 5 and 1
        (("code", 0), 40, rounds([2])),  # the same prompt again: a second repeat, τ 3
        (("chat", 1), 100, rounds([0, 0])),
        (("chat", 2), 3000, []),
    ], k=4)
    assert list(by_length) == ["<128", "2048–8191"]  # increasing length, only buckets a prompt fell in
    assert by_length["<128"] == {"prompts": 2, "rounds": 5, "tau": pytest.approx((5 + 1 + 3 + 1 + 1) / 5)}
    assert by_length["2048–8191"] == {"prompts": 1, "rounds": 0, "tau": None}
