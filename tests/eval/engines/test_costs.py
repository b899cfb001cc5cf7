"""The engine's cost model (eval/engines/costs.py): τ turned into a speed-up with an engine's c and β, its ceilings
and the width a round verified."""

import pytest

from eval.engines.costs import EngineCosts, ceilings, predict, verified_width
from eval.metrics import predicted_speedup


def row(drafter, tau, proposed, k=4, category="all"):
    return {"drafter": drafter, "k": k, "category": category, "temperature": 0.0, "acceptance_length": tau,
            "mean_proposed": proposed, "verdict": "pays off"}


def test_predict_turns_tau_into_a_speedup_with_the_engines_costs():
    rows = [row("head", 3.0, 4.0), row("draft", 3.0, 4.0), row("ngram", 1.5, 2.0)]
    costs = EngineCosts(name="vLLM on 1x H100", c=0.5, beta=0.1)
    predict(rows, costs, {"head": 0.05, "draft": None, "ngram": None}, pays_off_at=1.05)
    head, draft, ngram = rows
    assert head["engine_predicted_speedup"] == pytest.approx(3.0 / (1 + 4 * 0.05 + 0.1))  # its own c
    assert head["engine_verdict"] == "pays off (predicted)"
    # What it must keep there to pay: the τ at which the prediction reaches 1.05.
    assert head["engine_tau_to_pay"] == pytest.approx(1.05 * (1 + 4 * 0.05 + 0.1))
    assert predicted_speedup(head["engine_tau_to_pay"], 4.0, 0.05, 0.1) == pytest.approx(1.05)
    assert draft["engine_predicted_speedup"] == pytest.approx(3.0 / (1 + 4 * 0.5 + 0.1))  # the shared c
    assert draft["engine_verdict"] == "turn it off (predicted)"
    assert ngram["engine_cost_ratio"] == 0.5 and ngram["engine"] == "vLLM on 1x H100 (predicted)"
    assert all(r["engine_speedup"] is None for r in rows)  # nothing was measured


def test_predict_charges_a_parallel_drafter_one_forward_at_its_k():
    """A parallel drafter's c is its one forward over the round's block (`engine_cs` per k, else `engine_c`): a round
    pays it once, however many guesses it proposed."""
    rows = [{**row("dflash", 3.0, 3.5, k=4), "parallel": True}, {**row("dflash", 3.4, 7.0, k=8), "parallel": True}]
    predict(rows, EngineCosts(c=0.5, beta=0.1), {"dflash": 0.2}, 1.05, {"dflash": {8: 0.3}})
    at4, at8 = rows
    assert at4["engine_predicted_speedup"] == pytest.approx(3.0 / (1 + 0.2 + 0.1))
    assert at8["engine_predicted_speedup"] == pytest.approx(3.4 / (1 + 0.3 + 0.1)) and at8["engine_cost_ratio"] == 0.3
    assert at4["engine_tau_to_pay"] == pytest.approx(1.05 * (1 + 0.2 + 0.1))


def test_predict_charges_a_short_block_beta_and_its_ceiling_at_the_width_it_verified():
    """A DFlash block of 3 asked for k = 8 drafts 2 a round: its rounds verify 3 positions, so the prediction charges β
    at 3 and its ceiling is a perfect block of 3's, not k = 8's. A stop drafter that sometimes drafts the full k is
    still charged at k + 1."""
    block = {**row("dflash_b3", 2.0, 2.0, k=8), "parallel": True, "max_proposed": 2}
    stop = {**row("head", 2.0, 2.6, k=8), "max_proposed": 8}
    costs = EngineCosts(c=0.1, beta=0.2, betas={3: 0.05, 9: 0.6})
    predict([block, stop], costs, {}, 1.05)
    assert block["engine_verify_overhead"] == 0.05 and stop["engine_verify_overhead"] == 0.6
    assert block["engine_predicted_speedup"] == pytest.approx(2.0 / (1 + 0.1 + 0.05))
    assert block["engine_ceiling"] == pytest.approx(3 / 1.05)
    assert stop["engine_ceiling"] == pytest.approx(9 / 1.6)


def test_predict_needs_beta_and_says_which_drafter_lacks_c():
    with pytest.raises(ValueError, match="engine_costs.beta"):
        predict([row("head", 3.0, 4.0)], EngineCosts(c=0.1), {}, 1.05)
    rows = [row("head", 3.0, 4.0)]
    predict(rows, EngineCosts(beta=0.1), {}, 1.05)
    assert rows[0]["engine_predicted_speedup"] is None and "no c for drafter 'head'" in rows[0]["engine_note"]


def test_predict_prices_a_tree_at_its_width_and_names_the_shape_the_costs_favour():
    """A tree of depth 4 and 16 nodes is charged 4 draft steps and β at 17 positions: where β is flat (a GPU at
    batch 1) its larger τ wins and SGLang's settings for it are given; where β grows with the width, the chain."""
    def rows():
        tree = {**row("head@d4t4n16", 3.0, 16.0), "tree": "d4t4n16", "base_drafter": "head"}
        return [row("head", 2.4, 4.0), tree]

    flat = rows()
    predict(flat, EngineCosts(c=0.05, beta=0.1), {}, pays_off_at=1.05)
    chain, tree = flat
    assert tree["engine_predicted_speedup"] == pytest.approx(3.0 / (1 + 4 * 0.05 + 0.1))  # depth steps, not nodes
    assert tree["engine_tau_to_pay"] == pytest.approx(1.05 * (1 + 4 * 0.05 + 0.1))
    assert chain["engine_best_shape"] == tree["engine_best_shape"] == "tree d4t4n16"
    assert tree["sglang_settings"] == ("--speculative-num-steps 4 --speculative-eagle-topk 4 "
                                       "--speculative-num-draft-tokens 17")
    steep = rows()
    predict(steep, EngineCosts(c=0.05, beta=0.1, betas={17: 1.2}), {}, pays_off_at=1.05)
    chain, tree = steep
    assert tree["engine_verify_overhead"] == 1.2 and chain["engine_verify_overhead"] == 0.1
    assert chain["engine_best_shape"] == "chain k=4"
    assert chain["sglang_settings"].endswith("--speculative-eagle-topk 1 --speculative-num-draft-tokens 5")


def test_rounds_without_a_draft_count_in_tau_and_pay_no_verification():
    """A drafter that drafts nothing in some rounds (a confidence stop): llama.cpp's τ per round, as
    draftsmith's loop counts it, and the cost model's β paid by the rounds that verify only."""
    assert predicted_speedup(2.0, 1.5, 0.1, 1.0, verified=0.5) == pytest.approx(2.0 / (1 + 0.15 + 0.5))
    assert ceilings(4, 2.0, 1.0, 0.5) == {"engine_ceiling": None, "engine_tau_ceiling": pytest.approx(2.0 / 1.5)}
    assert ceilings(4, 2.0, 1.0)["engine_tau_ceiling"] == pytest.approx(1.0)


def test_the_ceiling_is_taken_at_the_width_the_rounds_verified():
    """β is what the engine's rounds cost at the width they verified: a DFlash block of 3 served at k = 4 drafts 2 a
    round, so a perfect drafter's ceiling from that β is 3/(1+β), not 5/(1+β); a drafter that drafts k in all but
    a round cut short by the answer's end keeps k."""
    assert verified_width(4, 2.0) == 2 and verified_width(4, 3.97) == 4 and verified_width(4, None) == 4
    assert verified_width(4, 6.5) == 4  # several slots: llama.cpp counts one draft call per batch
    assert ceilings(verified_width(4, 2.0), 1.8, 0.5)["engine_ceiling"] == pytest.approx(3 / 1.5)
