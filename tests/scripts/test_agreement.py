"""scripts/agreement.py: the teacher-forced replay gives the loop's own rounds, and the confidence split."""

import json

import pytest
import torch

from drafters.draft_lm import DraftLM
from drafters.sampling import Sampling
from eval.run import load_prompts, load_target
from eval.speculative import speculative_generate
from helpers import load_script

agreement = load_script("agreement")


def test_replay_keeps_the_run_of_hits_at_most_k_and_what_the_answer_has_left():
    hits = [True, True, False, True, True, True, True, True, True]
    assert agreement.replay_rounds(hits, k=4) == [2, 4, 1]  # 2 kept + own, 4 kept + own, 1 kept (the answer's end)
    assert agreement.replay_rounds([False] * 3, k=4) == [0, 0, 0]
    assert agreement.replay_rounds([True] * 6, k=8) == [6]
    assert agreement.replay_rounds([], k=4) == []
    assert agreement.tau([[True, True, False], [False]], k=4) == pytest.approx(1 + (2 + 0) / 2)


def test_misses_turned_into_hits_by_the_targets_confidence():
    pos = agreement.Positions(target_p=[[0.95, 0.3, 0.7, 0.99]], rank=[[0, 1, 0, 3]])
    s = agreement.summarize(pos, k=8)
    assert s["positions"] == 4 and s["top1"] == 0.5 and s["top2"] == 0.75
    assert s["unsure"]["share"] == 0.25 and s["unsure"]["top1"] == 0.0
    assert s["sure"]["share"] == 0.5 and s["sure"]["top1"] == 0.5
    assert s["unsure"]["share_of_misses"] == 0.5 and s["sure"]["share_of_misses"] == 0.5
    assert s["tau"] == pytest.approx(1 + (1 + 1) / 2)  # hit, miss | hit, miss
    assert s["tau_unsure_fixed"] == pytest.approx(1 + 3 / 1)  # hit hit hit, then the sure miss
    assert s["tau_sure_fixed"] == pytest.approx(1 + (1 + 2) / 2)  # hit, miss | hit, hit (the answer's end)
    assert s["tau_top2"] == pytest.approx(1 + 3 / 1)
    assert sum(b["positions"] for b in s["curve"]) == 4


@pytest.mark.slow
def test_the_replay_gives_the_loops_rounds_on_the_tiny_world(tiny_world, tmp_path):
    data = str(tiny_world / "company_logs" / "eval.jsonl")
    argv = ["--target", str(tiny_world / "target"), "--data", data, "--drafter", f"toy={tiny_world / 'draft'}",
            "--drafter", f"itself={tiny_world / 'target'}", "--per-category", "2", "--max-new-tokens", "24",
            "--k", "3", "--out", str(tmp_path)]
    report = agreement.main(argv)
    assert json.loads((tmp_path / "agreement.json").read_text())["drafters"].keys() == {"toy", "itself"}
    assert "| toy |" in (tmp_path / "agreement.md").read_text()
    assert (tmp_path / "agreement.png").stat().st_size > 1000
    # The target drafting for itself agrees everywhere: nothing left to fix.
    for s in report["drafters"]["itself"].values():
        assert s["top1"] == 1.0 and s["tau"] == s["tau_unsure_fixed"] == s["tau_sure_fixed"]
    # Its τ over the toy draft's (the first drafter) is the ratio of their replayed τ, on the same answers.
    for category, vs in report["versus"]["itself"].items():
        if category != "all":
            ratio = report["drafters"]["itself"][category]["tau"] / report["drafters"]["toy"][category]["tau"]
            assert vs["ratio"] == pytest.approx(ratio) and vs["interval"][0] <= vs["ratio"] <= vs["interval"][1]
    assert report["versus"]["itself"]["all"]["ratio"] >= 1
    # The toy draft's replayed rounds are the loop's, round for round.
    target, tok = load_target(str(tiny_world / "target"), device=torch.device("cpu"))
    draft = DraftLM.from_pretrained(tiny_world / "draft", target=target, target_tokenizer=tok, name="toy")
    prompts = load_prompts(data, tok, device=torch.device("cpu"), max_per_category=2)
    answers = [json.loads(line)["answer"] for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    compared = 0
    for category, items in prompts.items():
        raw = report["drafters"]["toy"][category]["raw"]
        for prompt, ranks in zip(items, raw["rank"]):
            g = speculative_generate(target, draft, prompt, k=3, sampling=Sampling(0.0), max_new_tokens=24,
                                     eos_token_id=tok.eos_token_id)
            assert g.tokens in answers
            assert [r.accepted for r in g.rounds] == agreement.replay_rounds([r == 0 for r in ranks], 3)
            compared += 1
    assert compared == 2 * len(prompts)
    # A second run, on one category and without the second drafter, reuses the answers the first wrote.
    before = (tmp_path / "answers.jsonl").read_text()
    category = sorted(prompts)[0]
    again = agreement.main(argv[:6] + argv[8:] + ["--category", category])
    assert (tmp_path / "answers.jsonl").read_text() == before
    assert again["drafters"]["toy"][category]["raw"] == report["drafters"]["toy"][category]["raw"]
