"""llama.cpp's measurements as the report's figures (eval/engines/llama_cpp_figures.py): a mode that drafted nothing,
and why an output that differs from plain decoding differs."""

import pytest
import torch

from eval.engines import llama_cpp
from eval.engines.llama_cpp_drafters import Served
from eval.engines.llama_cpp_figures import NOTHING_DRAFTED, engine_figures, numerics_note
from eval.engines.llama_cpp_measure import DraftStats
from eval.metrics import PartingGaps


def row(drafter, tau, proposed, k=4, category="all"):
    return {"drafter": drafter, "k": k, "category": category, "temperature": 0.0, "acceptance_length": tau,
            "mean_proposed": proposed, "verdict": "pays off"}


def _engine_only_rows(draft_n: int) -> list[dict]:
    """engine_figures for llama.cpp's ngram-mod beside one greedy row: 3 prompts of 10 tokens, plain decoding at
    10 ms a token, the n-gram mode at 8 ms (the machine faster while it ran) proposing `draft_n` tokens each."""
    def gen(ms, n):
        return llama_cpp.Completion(tokens=list(range(10)), draft_n=n, draft_n_accepted=0, predicted_ms=ms)

    items = [("code", i) for i in range(3)]
    measured = {"items": items, "costs": {},
                "completions": {"plain": {(0, c, i): gen(100.0, 0) for c, i in items},
                                ("mod", 4): {(0, c, i): gen(80.0 + i, draft_n) for c, i in items}},
                "counters": {("mod", 4): {(0, c, i): DraftStats(verifications=draft_n, rounds=draft_n) for c, i in items}}}
    greedy = [dict(row("ngram", 1.5, 4, category="code"), batch_size=1)]  # draftsmith's row: a note in the engine
    served = [Served("ngram", note="no llama.cpp counterpart"), Served("mod", spec_type="ngram-mod")]
    return engine_figures(greedy, measured, served, repeats=1, pays_off_at=1.05)


def test_a_drafter_that_drafted_nothing_is_not_called_faster_than_plain_decoding():
    """llama.cpp's n-gram modes draft only where text repeats: where they proposed nothing their runs were plain
    decoding, and a faster machine during them must not read as "pays off"."""
    (idle,) = _engine_only_rows(draft_n=0)
    assert idle["engine_speedup"] > 1.2 and idle["engine_verdict"] == NOTHING_DRAFTED
    (drafting,) = _engine_only_rows(draft_n=5)
    assert drafting["engine_verdict"] == "pays off"


def test_an_output_that_differs_as_the_verifying_servers_does_is_called_llama_cpps_numerics():
    def c(tokens):
        return llama_cpp.Completion(tokens, 0, 0, 1.0)

    keys = [(0, "code", 0), (0, "code", 1)]
    plain = {keys[0]: c([1, 2, 3]), keys[1]: c([4, 5, 6])}
    runs = {keys[0]: c([1, 2, 9]), keys[1]: c([4, 5, 6])}  # the first differs at a near tie
    note = numerics_note(runs, plain, {keys[0]: c([1, 2, 9])}, keys)
    assert note.startswith("its output differs from plain decoding on 1 of 2 generations") and "numerics" in note
    assert "numerics" not in numerics_note(runs, plain, {keys[0]: c([1, 2, 3])}, keys)  # the drafter's doing
    assert numerics_note(runs, plain, {}, keys).endswith("none of them is a prompt the cost servers measured")


def test_an_output_that_differs_in_the_engine_says_how_near_a_tie_it_parts_at():
    """Where llama.cpp's output with a drafter parts from its plain output, draftsmith's target scores the two
    tokens there (given what both wrote before): the gap says whether the engine's rounding could have chosen
    either. The note gives it; an output that is the other cut short has no such position."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2)).eval()
    gaps = PartingGaps(target, {"code": [[1, 2, 3]]})
    plain, other = [5, 6, 7, 8], [5, 6, 9, 10]
    with torch.inference_mode():
        logits = target(input_ids=torch.tensor([[1, 2, 3, 5, 6]])).logits[0, -1]
    expected = float(logits[7] - logits[9])
    assert gaps("code", 0, plain, other) == pytest.approx(expected) and gaps.dtype == "float32"
    assert gaps("code", 0, plain, plain[:2]) is None

    def gen(tokens):
        return llama_cpp.Completion(tokens, 0, 0, 1.0)

    key = (0, "code", 0)
    note = numerics_note({key: gen(other)}, {key: gen(plain)}, {}, [key], gaps)
    assert note.startswith("its output differs from plain decoding on 1 of 1 generations; where each parts from "
                           f"plain, draftsmith's target (float32) scores plain's token above the drafter's by "
                           f"{expected:.2f} (logits; near 0: a near tie)")
    assert "by" not in numerics_note({key: gen(plain[:2])}, {key: gen(plain)}, {}, [key], gaps)
    measured = {"items": [("code", 0)], "costs": {}, "completions": {"plain": {key: gen(plain)}, ("mod", 4): {key: gen(other)}},
                "counters": {("mod", 4): {key: DraftStats(verifications=1, rounds=3, drafted=1, accepted=0)}}}
    (row,) = engine_figures([], measured, [Served("mod", spec_type="ngram-mod")], repeats=1,
                                   pays_off_at=1.05, alone=True, ks=[4], gaps=gaps)[:1]
    assert row["engine_lossless"] is False and f"above the drafter's by {expected:.2f}" in row["engine_note"]


def test_the_engines_tau_is_compared_with_the_baselines_on_the_same_prompts():
    """Each drafter's τ in llama.cpp over the first drafter's (the evaluation's baseline), from llama-server's own
    counters per prompt, with the paired interval: a draft that keeps more on every prompt is told apart."""
    def gen(tokens):
        return llama_cpp.Completion(list(range(tokens)), draft_n=8, draft_n_accepted=4, predicted_ms=100.0)

    items = [("code", i) for i in range(4)]
    kept = {"shipped": [4, 6, 5, 3], "tuned": [8, 9, 7, 6]}  # accepted drafts in 5 rounds a prompt, k = 4
    measured = {"items": items, "costs": {},
                "completions": {"plain": {(0, c, i): gen(20) for c, i in items},
                                **{(name, 4): {(0, c, i): gen(20) for c, i in items} for name in kept}},
                "counters": {(name, 4): {(0, c, i): DraftStats(verifications=5, rounds=5, drafted=20, accepted=n)
                                         for (c, i), n in zip(items, kept[name])} for name in kept}}
    greedy = [dict(row(name, 2.0, 4.0, category=category), batch_size=1) for name in kept for category in ("code", "all")]
    engine_figures(greedy, measured, [Served(name, gguf=None, spec_type="draft-simple") for name in kept],
                   repeats=1, pays_off_at=1.05)
    shipped, _, tuned, _ = greedy
    assert shipped["engine_tau_vs_baseline"] == 1.0 and shipped["engine_tau_vs_baseline_ci"] == [1.0, 1.0]
    assert tuned["engine_acceptance_length"] == pytest.approx(1 + 30 / 20)
    assert tuned["engine_tau_vs_baseline"] == pytest.approx((1 + 30 / 20) / (1 + 18 / 20))
    low, high = tuned["engine_tau_vs_baseline_ci"]
    assert 1 < low < tuned["engine_tau_vs_baseline"] < high
