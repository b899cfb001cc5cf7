"""evaluate() on tiny models: every row has the contract's keys and consistent numbers."""

import dataclasses

import pytest
import torch

import eval.evaluate as evaluate_module
from drafters.draft_lm import DraftLM
from drafters.ngram import NgramDrafter
from drafters.sampling import Sampling
from eval.evaluate import ALL, EvalPlan, evaluate
from eval.compare import UNDECIDED
from eval.report_markdown import lossless_lines
from eval.speculative import autoregressive_generate
from helpers import tiny_llama

VOCAB = 48
ROW_KEYS = {"drafter", "k", "temperature", "category", "prompts", "rounds", "accept_hist", "mean_proposed",
            "mean_accepted", "median_accepted", "p10_accepted", "zero_accept_rate", "acceptance_rate", "acceptance_length",
            "ar_tokens_per_s", "sd_tokens_per_s", "speedup", "cost_ratio", "verify_overhead",
            "predicted_speedup", "lossless", "verdict", "tau_vs_baseline", "speedup_vs_baseline", "speedup_ci",
            "speedup_vs_baseline_ci", "tau_vs_baseline_ci", "fastest", "speedup_vs_fastest", "speedup_vs_fastest_ci", "vs_fastest"}


@pytest.fixture(scope="module")
def setup():
    target = tiny_llama(VOCAB, seed=0, logit_scale=4.0)
    drafters = [DraftLM(tiny_llama(VOCAB, seed=1, logit_scale=4.0), name="base"), DraftLM(target, name="self"),
                NgramDrafter()]
    g = torch.Generator().manual_seed(0)
    prompts = {"a": [torch.randint(0, VOCAB, (6,), generator=g) for _ in range(2)],
               "b": [torch.randint(0, VOCAB, (9,), generator=g)]}
    return target, drafters, prompts


def test_rows_cover_every_configuration(setup):
    target, drafters, prompts = setup
    plan = EvalPlan(ks=[1, 3], temperatures=[0.0, 1.0], max_new_tokens=12, repeats=2, warmup=1)
    rows = evaluate(target, drafters, prompts, plan, progress=False)
    assert len(rows) == 3 * 2 * 2 * 3  # drafters x ks x temperatures x (2 categories + all)
    for r in rows:
        assert ROW_KEYS <= set(r)
        assert sum(r["accept_hist"]) == r["rounds"] and len(r["accept_hist"]) == r["k"] + 1
        assert r["lossless"] is (True if r["temperature"] == 0 else None)
        ci = r["speedup_ci"]
        if ci is None or ci[0] <= 1 <= ci[1]:
            assert r["verdict"] == UNDECIDED
        else:
            assert r["verdict"] == ("pays off" if r["speedup"] >= plan.pays_off_at else "turn it off")
        if r["drafter"] == "base":
            assert r["tau_vs_baseline"] == 1.0 and r["speedup_vs_baseline"] == 1.0
        base = next(b for b in rows if b["drafter"] == "base" and (b["k"], b["temperature"], b["category"])
                    == (r["k"], r["temperature"], r["category"]))
        assert r["speedup_vs_baseline"] == pytest.approx(r["speedup"] / base["speedup"])
        # Category "b" has one prompt, so it and the aggregate have no interval; "a" has two.
        if r["category"] == "a":
            low, high = r["speedup_ci"]
            assert low <= r["speedup"] <= high
            low, high = r["tau_vs_baseline_ci"]
            assert low <= r["tau_vs_baseline"] <= high
            if r["drafter"] == "base":
                assert r["speedup_vs_baseline_ci"] == [1.0, 1.0] and r["tau_vs_baseline_ci"] == [1.0, 1.0]
        else:
            assert r["speedup_ci"] is None and r["speedup_vs_baseline_ci"] is None and r["tau_vs_baseline_ci"] is None
    groups = {}
    for r in rows:
        groups.setdefault((r["k"], r["temperature"], r["category"]), []).append(r)
    for group in groups.values():  # one fastest drafter per configuration, the one with the highest speed-up
        fastest = max(group, key=lambda r: r["speedup"])
        assert [r["drafter"] for r in group if r["vs_fastest"] == "fastest"] == [fastest["drafter"]]
        assert fastest["speedup_vs_fastest"] == 1.0 and all(r["fastest"] == fastest["drafter"] for r in group)
        assert all(r["speedup_vs_fastest"] <= 1.0 for r in group)
        # Plain decoding ran once per prompt for all drafters: one plain throughput per configuration.
        assert len({r["ar_tokens_per_s"] for r in group}) == 1 and all(r["sd_tokens_per_s"] > 0 for r in group)
        for r in group:
            assert r["vs_fastest"] in ("fastest", "slower", "tied", "too few prompts")
            assert (r["vs_fastest"] == "too few prompts") == (r["category"] != "a" and r is not fastest)
    selfrows = [r for r in rows if r["drafter"] == "self" and r["temperature"] == 0.0]
    for r in selfrows:  # drafting with the target itself: every guess is kept
        assert r["acceptance_rate"] == 1.0 and r["zero_accept_rate"] == 0.0
    agg = next(r for r in rows if r["category"] == ALL and r["drafter"] == "self" and r["k"] == 3 and r["temperature"] == 0)
    assert agg["prompts"] == 3
    assert agg["rounds"] == sum(r["rounds"] for r in selfrows if r["k"] == 3 and r["category"] != ALL)


def test_a_greedy_output_that_is_not_plain_decodings_says_where_it_parts(setup, monkeypatch):
    """Greedy speculative decoding must write plain decoding's tokens. A row where it did not (here one generation
    with its third token changed) is not lossless and says on how many generations, and how near a tie of the
    target's logits each parts at: the target's logit of plain's token minus the written one's there. The report
    prints it under the summary; rows that match have no note."""
    target, drafters, prompts = setup
    odd = prompts["b"][0]
    real = evaluate_module.speculative_generate

    def altered(target_, drafter, prompt_ids, **kw):
        gen = real(target_, drafter, prompt_ids, **kw)
        if torch.equal(prompt_ids, odd):
            gen = dataclasses.replace(gen, tokens=[*gen.tokens[:2], (gen.tokens[2] + 1) % VOCAB, *gen.tokens[3:]])
        return gen

    monkeypatch.setattr(evaluate_module, "speculative_generate", altered)
    plan = EvalPlan(ks=[3], temperatures=[0.0], max_new_tokens=12, repeats=1, warmup=0)
    rows = {r["category"]: r for r in evaluate(target, drafters[1:2], prompts, plan, progress=False)}
    plain = autoregressive_generate(target, odd, sampling=Sampling(temperature=0.0), max_new_tokens=12).tokens
    with torch.inference_mode():
        logits = target(input_ids=torch.cat([odd, torch.tensor(plain[:2])])[None]).logits[0, -1].float()
    gap = float(logits[plain[2]] - logits[(plain[2] + 1) % VOCAB])
    assert gap > 0  # plain decoding chose its token
    assert rows["a"]["lossless"] is True and rows["a"]["lossless_note"] is None
    for category, total in (("b", 1), (ALL, 3)):
        assert rows[category]["lossless"] is False
        assert rows[category]["lossless_note"] == (
            f"its output differs from plain decoding on 1 of {total} generations; where each parts from plain, "
            f"draftsmith's target (float32) scores plain's token above the drafter's by {gap:.2f} (logits; near 0: a "
            "near tie)")
    lines = lossless_lines(list(rows.values()))
    assert lines[1].startswith("Not lossless here") and len(lines) == 5  # blank, intro, blank, b and all
    assert lines[3] == f"- b, self, k=3, B=1: {rows['b']['lossless_note']}"
    assert lossless_lines([rows["a"]]) == []


def test_acceptance_is_split_by_prompt_length(setup):
    target, drafters, _ = setup
    g = torch.Generator().manual_seed(1)
    prompts = {"a": [torch.randint(0, VOCAB, (n,), generator=g) for n in (6, 140, 9)]}
    rows = evaluate(target, drafters[1:2], prompts, EvalPlan(ks=[2], max_new_tokens=8, repeats=2, warmup=0),
                    progress=False)
    for r in rows:
        by_length = r["acceptance_by_length"]
        assert list(by_length) == ["<128", "128–511"]
        assert [b["prompts"] for b in by_length.values()] == [2, 1]  # each prompt once, whatever the repeats
        assert sum(b["rounds"] for b in by_length.values()) == r["rounds"]
        # The buckets' τ, weighted by their rounds, is the row's τ: they split its rounds, nothing else.
        assert sum(b["tau"] * b["rounds"] for b in by_length.values()) / r["rounds"] == pytest.approx(
            r["acceptance_length"])


def test_reserved_category_and_empty_prompts_are_errors(setup):
    target, drafters, prompts = setup
    plan = EvalPlan(ks=[2], repeats=1, max_new_tokens=4)
    with pytest.raises(ValueError, match="reserved"):
        evaluate(target, drafters, {"all": prompts["a"]}, plan, progress=False)
    with pytest.raises(ValueError, match="no prompts"):
        evaluate(target, drafters, {"a": []}, plan, progress=False)
    with pytest.raises(ValueError, match="unique"):
        evaluate(target, [drafters[0], drafters[0]], prompts, plan, progress=False)


@pytest.mark.parametrize("kwargs, match", [(dict(ks=[0, 2]), "k .* must be >= 1"), (dict(ks=[]), "k"),
                                           (dict(repeats=0), "repeats"), (dict(temperatures=[-1.0]), "temperature")])
def test_bad_plans_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EvalPlan(**kwargs)


def test_batch_sizes_give_rows_per_batch_size_with_their_own_verdicts(setup):
    """batch_sizes=[1, 3]: every configuration is measured at both; a batch-3 row decodes a category's prompts
    through three slots kept busy (category "b" has one prompt: extra rows fill the other two), losslessly,
    with its own best k and verdict, and counts each prompt once."""
    target, drafters, prompts = setup
    plan = EvalPlan(ks=[1, 3], max_new_tokens=12, repeats=1, warmup=0, batch_sizes=[1, 3])
    rows = evaluate(target, drafters, prompts, plan, progress=False)
    assert len(rows) == 3 * 2 * 3 * 2  # drafters x ks x (2 categories + all) x batch sizes
    assert {r["batch_size"] for r in rows} == {1, 3}
    for r in rows:
        assert r["lossless"] is True and r["rounds"] > 0
        same = [x for x in rows if (x["drafter"], x["category"], x["batch_size"]) ==
                (r["drafter"], r["category"], r["batch_size"])]
        assert r["best_k"] == max(same, key=lambda x: x["speedup"])["k"]
    by = {(r["drafter"], r["k"], r["category"], r["batch_size"]): r for r in rows}
    for b in (1, 3):
        assert by["base", 3, "b", b]["prompts"] == len(prompts["b"]) and by["base", 3, "a", b]["prompts"] == len(prompts["a"])
    # Greedy acceptance does not depend on the batch: the same prompts keep the same guesses.
    assert by["self", 3, "a", 3]["acceptance_length"] == by["self", 3, "a", 1]["acceptance_length"]
    with pytest.raises(ValueError, match="batch size must be >= 1"):
        EvalPlan(batch_sizes=[0])


def test_trees_are_rows_of_their_own_beside_the_chains(setup, caplog):
    """trees=[...]: every drafter that drafts trees gets `<name>@<shape>` rows at k = the depth, greedy rows
    lossless, the tree's τ over its chain's at that depth, and the fastest of its shapes named on all its rows;
    the n-gram drafter stays a chain; batch > 1 measures chains only, and says so."""
    target, drafters, prompts = setup
    plan = EvalPlan(ks=[2, 3], trees=["d3t2n6", "d2t3n6"], batch_sizes=[1, 2], max_new_tokens=12, repeats=1,
                    warmup=0)
    with caplog.at_level("INFO", logger="eval.evaluate"):
        rows = evaluate(target, drafters, prompts, plan, progress=False)
    assert "trees are verified at batch 1 only" in caplog.text and "['ngram'] draft chains only" in caplog.text
    trees = [r for r in rows if r["tree"]]
    assert {r["drafter"] for r in trees} == {"base@d3t2n6", "base@d2t3n6", "self@d3t2n6", "self@d2t3n6"}
    assert all(r["batch_size"] == 1 for r in trees)
    for r in trees:
        assert r["k"] == int(r["tree"][1]) and r["lossless"] is True and r["acceptance_length_iid"] is None
        assert r["mean_proposed"] == 6 and r["accept_hist"] and len(r["accept_hist"]) == r["k"] + 1
        chain = next(c for c in rows if c["drafter"] == r["drafter"].split("@")[0] and c["k"] == r["k"]
                     and c["category"] == r["category"] and c["batch_size"] == 1)
        assert r["tau_vs_chain"] == pytest.approx(r["acceptance_length"] / chain["acceptance_length"])
    for name in ("base", "self"):
        mine = [r for r in rows if r["drafter"].split("@")[0] == name and r["category"] == ALL and r["batch_size"] == 1]
        best = max(mine, key=lambda r: r["speedup"])
        want = f"tree {best['tree']}" if best["tree"] else f"chain k={best['k']}"
        assert {r["best_shape"] for r in mine} == {want}
        assert all("keeps τ" in r["best_shape_why"] and "positions against" in r["best_shape_why"] for r in mine)


def test_trees_need_a_drafter_that_drafts_them(setup):
    target, _, prompts = setup
    with pytest.raises(ValueError, match="none of the drafters \\['ngram'\\] drafts trees"):
        evaluate(target, [NgramDrafter()], prompts, EvalPlan(ks=[2], trees=["d2t2n4"], max_new_tokens=8, repeats=1),
                 progress=False)
    with pytest.raises(ValueError, match="d<depth>t<topk>n<nodes>"):
        EvalPlan(trees=["4x4"])


def test_a_static_tree_is_swept_like_a_dynamic_one(setup):
    target, drafters, prompts = setup
    plan = EvalPlan(ks=[2], trees=["static:0,1,0.0"], max_new_tokens=12, repeats=1, warmup=0)
    rows = evaluate(target, drafters[:1], prompts, plan, progress=False)
    tree = next(r for r in rows if r["tree"] and r["category"] == ALL)
    assert tree["drafter"] == "base@static:0,1,0.0" and tree["k"] == 2 and tree["lossless"] is True
    assert tree["mean_proposed"] == 3 and "for 3+1 positions" in tree["best_shape_why"]
