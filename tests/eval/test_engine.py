"""The verdict in the engine (eval/engine.py): llama.cpp measured beside draftsmith's loop, and a prediction
for an engine that cannot run here from the c and β a team measured in it."""

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import eval.__main__ as entry
from eval import llama_cpp
from eval.costs import EngineCosts, ceilings, predict, verified_width
from eval.endpoint import stream
from eval.formats import writing
from eval.llama_cpp_drafters import Served, draft_dtype, llama_cpp_drafter
from eval.llama_cpp_figures import CHAINS_ONLY, NOTHING_DRAFTED, engine_figures, numerics_note
from eval.llama_cpp_measure import DraftCounters, DraftStats, RoundCosts
from eval.metrics import PartingGaps, predicted_speedup
from eval.engine import LlamaCpp, engine_for
from eval.compare import verdict

CONF = str(Path(__file__).resolve().parents[2] / "conf")
needs_llama_cpp = pytest.mark.skipif(not llama_cpp.available(), reason=(
    f"llama.cpp is not built at {llama_cpp.home()}: `make llama-cpp` (make test builds it)"))


def make_cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="eval", overrides=list(overrides))


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


class FakeServer:
    """Hands out a log in the chunks given, as llama-server's log file grows between reads."""

    def __init__(self, *chunks):
        self.chunks = list(chunks)

    def new_log(self):
        return self.chunks.pop(0) if self.chunks else ""


STATS_1 = ("spec common_specu: statistics     draft-eagle3: #calls(b,g,a) =   10     94     94, #gen drafts =     94, "
           "#acc drafts =    81, #gen tokens =    373, #acc tokens =   274, #mean acc len = 3.91, dur(b,g,a) = 0.013, "
           "66.426, 0.043 ms\n")
STATS_2 = ("spec common_specu: statistics     draft-eagle3: #calls(b,g,a) =   11    109    109, #gen drafts =    109, "
           "#acc drafts =    95, #gen tokens =    433, #acc tokens =   321, #mean acc len = 3.94, dur(b,g,a) = 0.015, "
           "76.950, 0.051 ms\n")


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


def test_draft_counters_read_the_statistics_line_of_each_request_even_when_split_across_reads():
    counters = DraftCounters(FakeServer(STATS_1 + "slot release\n" + STATS_2[:60], "", STATS_2[60:]))
    assert counters.after(1) == DraftStats(verifications=94, drafted=373, accepted=274, draft_ms=66.426, rounds=94)
    assert counters.after(2) == DraftStats(verifications=109, drafted=433, accepted=321, draft_ms=76.950, rounds=109)
    with pytest.raises(RuntimeError, match="statistics for 2 of 3 requests"):
        counters.after(3, timeout=0.05)


def test_round_costs_split_a_round_into_drafting_and_the_rest():
    """Two answers of 11 tokens from a server that keeps no draft: each 1 token from the prompt, 9 from
    verifications and 1 from a plain step (too few left to draft). The plain step is 2 ms."""
    costs = RoundCosts()
    for _ in range(2):
        costs = costs.add(llama_cpp.Completion(list(range(11)), 36, 0, predicted_ms=9 * (4 * 1.0 + 6.0) + 2.0),
                          DraftStats(verifications=9, drafted=36, accepted=0, draft_ms=36.0))
    assert costs.requests == 2 and costs.tokens == 22 and costs.stats.verifications == 18
    assert costs.c(2.0) == pytest.approx(0.5)  # 1 ms per drafted token over a 2 ms step
    assert costs.beta(2.0) == pytest.approx(6.0 / 2.0 - 1)  # 6 ms of each round outside drafting
    assert RoundCosts().c(2.0) is None and RoundCosts().beta(2.0) is None


def test_the_log_reader_keeps_its_own_position_and_decodes_utf8_split_between_reads(tmp_path):
    path = tmp_path / "server.log"
    with open(path, "wb") as server:  # the server's descriptor: its writes move only its own position
        reader = llama_cpp.LogReader(path)
        server.write(b"first line\ntoken piece '\xc4")  # the first byte of a two-byte character
        server.flush()
        assert reader.new() == "first line\ntoken piece '"
        server.write(b"\x80' then statistics\nbroken \xff byte\n")
        server.flush()
        assert reader.new() == "\u0100' then statistics\nbroken \ufffd byte\n"  # whole, and a bad byte replaced
        assert reader.new() == ""
        server.write(b"last line\n")
        server.flush()
        assert reader.new() == "last line\n" and reader.tail(2) == "broken \ufffd byte\nlast line"
    reader.close()


def test_unknown_engine_and_engine_with_costs_are_errors_before_anything_loads(tmp_path):
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match=r"(?s)Could not find 'engine/vllm'.*llamacpp\n\topenai"):
        make_cfg("engine=vllm", "data.path=/nonexistent.jsonl", f"out_dir={tmp_path}")
    with pytest.raises(ValueError, match="engine='vllm' is not one draftsmith runs"):  # the library's own check
        engine_for("vllm", EngineCosts())
    with pytest.raises(ValueError, match="set one or the other"):
        entry.run(make_cfg("engine=llamacpp", "engine_costs.beta=0.1", "data.path=/nonexistent.jsonl",
                           f"out_dir={tmp_path}"))


@pytest.mark.slow
def test_costs_from_another_engine_give_a_predicted_verdict_per_category(tiny_world, tmp_path):
    cfg = make_cfg("target=tiny", "ks=[2]", "trees=[d2t2n4]", "repeats=1", "max_new_tokens=12",
                   "data.max_prompts_per_category=2", "progress=false", "engine_costs.name=vLLM on 1x H100",
                   "engine_costs.c=0.02", "engine_costs.beta=0.05", "+engine_costs.betas={5: 0.3}",
                   "drafters.1.engine_c=0.001", f"out_dir={tmp_path}")
    report = entry.run(cfg)
    assert report["settings"]["engine"] == {"name": "vLLM on 1x H100", "predicted": True, "c": 0.02, "beta": 0.05,
                                            "drafter_c": {"ngram": 0.001}}
    assert {r["drafter"] for r in report["results"] if r["tree"]} == {"off_the_shelf@d2t2n4"}
    for r in report["results"]:
        c = 0.001 if r["drafter"] == "ngram" else 0.02
        # A chain drafts its proposal and verifies k+1 positions; the tree drafts depth steps and verifies 4+1.
        drafted, beta = (r["k"], 0.3) if r["tree"] else (r["mean_proposed"], 0.05)
        assert r["engine_predicted_speedup"] == pytest.approx(r["acceptance_length"] / (1 + drafted * c + beta))
        # What a drafter costing nothing could reach there: with every guess kept, and with the measured τ.
        assert r["engine_ceiling"] == pytest.approx((r["k"] + 1) / (1 + beta))
        assert r["engine_tau_ceiling"] == pytest.approx(r["acceptance_length"] / (1 + beta))
    md = (tmp_path / "report.md").read_text()
    assert "## Predicted for vLLM on 1x H100" in md and "A prediction, not a measurement" in md
    assert "## Trees and chains" in md and "The settings SGLang takes for the shape these costs favour" in md


@pytest.mark.slow
@needs_llama_cpp
def test_eval_in_llama_cpp_reports_the_engines_acceptance_speedup_and_costs(tiny_world, eagle_run, tmp_path):
    """`python -m eval engine=llamacpp` on tiny_deep: the off-the-shelf draft LM and an EAGLE-3 head served by
    llama-server, the n-gram drafter noted as having no llama.cpp counterpart; at batch 2 served by a
    two-slot server, the prompts streamed through it."""
    out = tmp_path / "report"
    cfg = make_cfg("target=tiny_deep", "engine=llamacpp", "ks=[2,4]", "trees=[d3t2n6]", "repeats=2", "max_new_tokens=32",
                   "data.max_prompts_per_category=4", "progress=false", "threads=1", "batch_sizes=[1,2]",
                   f"drafters=[{{name: off_the_shelf, kind: draft_lm, path: toyworld://tiny_deep/draft}}, "
                   f"{{name: head, kind: head, path: '{eagle_run / 'best'}'}}, {{name: ngram, kind: ngram}}]",
                   f"out_dir={out}")
    report = entry.run(cfg)
    settings = report["settings"]["engine"]
    assert settings["name"] == "llama.cpp" and settings["served"]["head"] == "draft-eagle3"
    assert settings["served"]["off_the_shelf"] == "draft-simple" and "n-gram" in settings["served"]["ngram"]
    assert settings["batch_sizes"] == [1, 2]
    batch2 = [r for r in report["results"] if r["batch_size"] == 2]
    for r in batch2:  # two slots: speed-up, verdict, losslessness and the server's τ; c and β are batch-1 figures
        assert r["engine"] == "llama.cpp"
        if r["drafter"] == "ngram":
            continue
        assert r["engine_lossless"] is True, (r["drafter"], r["k"], r["category"])
        assert r["engine_speedup"] > 0 and r["engine_ar_tokens_per_s"] > 0 and r["engine_sd_tokens_per_s"] > 0
        assert 1 <= r["engine_acceptance_length"] <= 1 + r["k"] and r["engine_predicted_speedup"] is None
    assert list((out / "engine").glob("llama-server-head-k4-b2-*.log"))
    rows = {(r["drafter"], r["k"], r["category"]): r for r in report["results"] if r["batch_size"] == 1}
    for (drafter, k, category), r in rows.items():
        assert r["engine"] == "llama.cpp"
        if r["tree"]:  # draftsmith's loop verifies trees; llama.cpp chains only
            assert r["engine_speedup"] is None and r["engine_note"] == CHAINS_ONLY and r["lossless"] is True
            continue
        if drafter == "ngram":
            assert r["engine_speedup"] is None and "no llama.cpp counterpart" in r["engine_note"]
            continue
        assert r["engine_lossless"] is True, (drafter, k, category)  # greedy output = the engine's plain output
        assert r["engine_speedup"] > 0
        assert r["engine_verdict"] == verdict(r["engine_speedup"], r["engine_speedup_ci"], 1.05)
        assert r["engine_cost_ratio"] > 0 and r["engine_verify_overhead"] > -1
        assert r["engine_predicted_speedup"] == pytest.approx(
            r["acceptance_length"] / (1 + r["mean_proposed"] * r["engine_cost_ratio"] + r["engine_verify_overhead"]))
        assert r["engine_ceiling"] == pytest.approx((r["k"] + 1) / (1 + r["engine_verify_overhead"]))
        assert r["engine_tau_ceiling"] == pytest.approx(r["engine_acceptance_length"] / (1 + r["engine_verify_overhead"]))
        assert r["engine_tau_to_pay"] == pytest.approx(1.05 * (1 + r["mean_proposed"] * r["engine_cost_ratio"]
                                                               + r["engine_verify_overhead"]))
        assert r["engine_ar_tokens_per_s"] > 0 and r["engine_sd_tokens_per_s"] > 0
    for k in (2, 4):  # the same head, features and prompts in both loops: acceptance carries over
        ours, theirs = rows["head", k, "all"]["acceptance_length"], rows["head", k, "all"]["engine_acceptance_length"]
        assert abs(theirs / ours - 1) <= 0.05, (k, ours, theirs)
    md = (out / "report.md").read_text()
    assert "## In llama.cpp" in md and "ngram: draftsmith's n-gram drafter has no llama.cpp counterpart" in md
    assert "At B > 1 llama.cpp serves with B slots" in md
    assert f"- llama.cpp on: {report['hardware']['cpu']}, " in md  # the device its log names: this build's CPU
    assert json.loads((out / "report.json").read_text())["results"][0]["engine"] == "llama.cpp"
    assert list((out / "engine").glob("llama-server-*.log"))  # the engine's own logs are kept
    assert list((out / "engine").glob("llama-server-head-k4-accept-none-*.log"))  # and those c and β came from


@needs_llama_cpp
def test_a_model_llama_cpp_cannot_convert_fails_before_draftsmith_measures_anything(tiny_world, tmp_path, monkeypatch):
    def unreadable(model_dir, *args, **kwargs):
        raise ValueError(f"{model_dir}/tokenizer.json: no llama.cpp pre-tokenizer is known to match ...")

    def measured(*args, **kwargs):
        raise AssertionError("draftsmith's loop ran before the conversion failed")

    monkeypatch.setattr(llama_cpp, "convert_to_gguf", unreadable)
    monkeypatch.setattr(entry, "evaluate", measured)
    with pytest.raises(ValueError, match="no llama.cpp pre-tokenizer"):
        entry.run(make_cfg("target=tiny", "engine=llamacpp", "ks=[2]", "repeats=1", "progress=false",
                           "data.max_prompts_per_category=1", f"out_dir={tmp_path}"))


def test_an_unknown_engine_at_the_end_of_training_fails_before_training(tiny_world, tmp_path):
    from helpers import train_tiny_deep

    for name in ("sglang", "openai"):  # a deployment is measured with python -m eval engine=openai, not here
        with pytest.raises(ValueError, match=f"engine='{name}' is not one draftsmith runs here; known: \\['llamacpp'\\]"):
            train_tiny_deep(tmp_path / "run", "drafter=eagle", "evaluate.enabled=true", f"evaluate.engine={name}")
    assert not (tmp_path / "run" / "best").exists()


@pytest.mark.slow
@needs_llama_cpp
def test_training_ends_with_the_verdict_in_llama_cpp(tiny_world, tmp_path):
    from helpers import train_tiny_deep

    run = train_tiny_deep(tmp_path / "run", "drafter=eagle", "trainer.max_steps=20", "evaluate.enabled=true",
                          "evaluate.engine=llamacpp", "evaluate.ks=[2]", "evaluate.repeats=1",
                          "evaluate.prompts_per_category=2", "evaluate.max_new_tokens=16")
    report = json.loads((run / "report.json").read_text())
    assert report["settings"]["engine"]["served"] == {"off_the_shelf": "draft-simple", "trained_eagle": "draft-eagle3"}
    assert all(r["engine_lossless"] is True and r["engine_speedup"] > 0 for r in report["results"])
    assert "## In llama.cpp" in (run / "report.md").read_text()


class _Server:
    """A stand-in for a llama-server with `parallel` slots that answers each prompt with its own ids."""

    def __init__(self, parallel, fail_at=None):
        self.parallel, self.fail_at, self.calls = parallel, fail_at, 0

    def complete(self, prompt, max_new_tokens):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise ConnectionError("llama-server went away")
        return llama_cpp.Completion(list(prompt), 0, 0, 1.0)


def test_a_stream_answers_every_prompt_in_order_and_keeps_the_slots_busy():
    prompts = [[i] for i in range(5)]
    server = _Server(3)
    answers, sent = stream(lambda p: server.complete(p, 8), prompts, server.parallel)
    assert [a.tokens for a in answers] == prompts and sent >= len(prompts)


def test_a_failed_request_stops_the_stream_with_its_error():
    with pytest.raises(ConnectionError, match="went away"):
        server = _Server(3, fail_at=4)
        stream(lambda p: server.complete(p, 8), [[i] for i in range(20)], server.parallel)


@pytest.mark.slow
@needs_llama_cpp
def test_a_target_without_a_draft_is_measured_against_llama_cpps_own_speculation_and_a_self_draft(tiny_world,
                                                                                                   tmp_path):
    """The baselines of a team without an off-the-shelf draft: draftsmith's n-gram drafter, the target's first
    layers as a self-draft (built once, served by llama.cpp too), and llama.cpp's own n-gram modes, measured
    in the engine only (report.json's engine_results): lossless, with the engine's τ, speed-up and ceiling;
    ngram-cache at the k llama.cpp fixes for it (8), not the k asked for."""
    out = tmp_path / "report"
    cfg = make_cfg("target=tiny_deep", "target.off_the_shelf_draft=null", "engine=llamacpp", "ks=[3]", "repeats=1",
                   "max_new_tokens=24", "data.max_prompts_per_category=3", "progress=false", "threads=1",
                   "drafters=[{name: ngram, kind: ngram}, {name: self_draft, kind: draft_lm, layers: 2}, "
                   "{name: simple, kind: llamacpp, spec_type: ngram-simple}, "
                   "{name: mod, kind: llamacpp, spec_type: ngram-mod}, "
                   "{name: cache, kind: llamacpp, spec_type: ngram-cache}]", f"out_dir={out}")
    report = entry.run(cfg)
    assert report["settings"]["engine"]["served"] == {
        "ngram": report["settings"]["engine"]["served"]["ngram"], "self_draft": "draft-simple",
        "simple": "ngram-simple", "mod": "ngram-mod", "cache": "ngram-cache"}
    self_rows = [r for r in report["results"] if r["drafter"] == "self_draft"]
    assert self_rows and all(r["lossless"] and r["engine_lossless"] for r in self_rows)
    assert all(r["engine_acceptance_length"] > 1 for r in self_rows)  # half the target's layers guess some
    own = report["engine_results"]
    assert {(r["drafter"], r["k"], r["category"]) for r in own} == {
        (d, k, c) for d, k in (("simple", 3), ("mod", 3), ("cache", 8)) for c in ("code", "json", "prose", "all")}
    for r in own:
        assert r["engine_only"] in ("ngram-simple", "ngram-mod", "ngram-cache") and "acceptance_length" not in r
        assert r["engine_lossless"] is True and r["engine_speedup"] > 0
        assert r["engine_verify_overhead"] is None and r["engine_ceiling"] is None  # not calibrated: drafts sometimes
        assert r["engine_acceptance_length"] is None or 1 <= r["engine_acceptance_length"] <= r["k"] + 1
        assert r["engine_verdict"] == (verdict(r["engine_speedup"], r["engine_speedup_ci"], 1.05)
                                       if r["engine_acceptance_length"] else NOTHING_DRAFTED)
    md = (out / "report.md").read_text()
    assert "cache (ngram-cache), mod (ngram-mod), simple (ngram-simple): llama.cpp's own model-free speculation" in md
    assert "| prose | mod | 3 | – |" in md


@pytest.mark.slow
@needs_llama_cpp
def test_llama_cpp_alone_measures_every_drafter_it_serves_without_draftsmiths_loop(tiny_world, eagle_run, tmp_path,
                                                                                    monkeypatch):
    """engine.only=true: no loop of draftsmith's runs (its evaluate is never called); every drafter llama.cpp serves,
    llama.cpp's own n-gram mode first, gets the engine's rows per category and k: lossless, its τ and drafted
    tokens per round from its counters, c and β for the drafters that always draft, and the cost model's
    prediction from the engine's own τ. A drafter with no llama.cpp format is named and left out."""
    def no_loop(*args, **kwargs):
        raise AssertionError("draftsmith's loop ran with engine.only=true")

    monkeypatch.setattr(entry, "evaluate", no_loop)
    out = tmp_path / "report"
    cfg = make_cfg("target=tiny_deep", "target.off_the_shelf_draft=null", "engine=llamacpp", "engine.only=true",
                   "ks=[2,3]", "repeats=1", "max_new_tokens=24", "data.max_prompts_per_category=3", "progress=false",
                   "threads=1", "drafters=[{name: mod, kind: llamacpp, spec_type: ngram-mod}, "
                   f"{{name: head, kind: head, path: '{eagle_run / 'best'}'}}, {{name: ngram, kind: ngram}}]",
                   f"out_dir={out}")
    report = entry.run(cfg)
    assert report["results"] == [] and report["settings"]["engine"]["alone"] is True
    rows = report["engine_results"]
    cells = {(c, k) for c in ("code", "json", "prose", "all") for k in (2, 3)}
    assert {(r["drafter"], r["category"], r["k"]) for r in rows} == {(d, c, k) for d in ("mod", "head")
                                                                     for c, k in cells}
    for r in rows:
        assert r["engine_lossless"] is True and r["engine_speedup"] > 0 and "acceptance_length" not in r
    for r in (r for r in rows if r["drafter"] == "head"):
        assert r["engine_only"] == "draft-eagle3" and r["engine_acceptance_length"] > 1
        assert 1 <= r["engine_mean_proposed"] <= r["k"]
        c, beta = r["engine_cost_ratio"], r["engine_verify_overhead"]
        assert c > 0 and beta is not None
        assert r["engine_predicted_speedup"] == pytest.approx(
            r["engine_acceptance_length"] / (1 + r["engine_mean_proposed"] * c + beta))
        assert r["engine_tau_to_pay"] == pytest.approx(1.05 * (1 + r["engine_mean_proposed"] * c + beta))
        assert r["engine_ceiling"] == pytest.approx((r["k"] + 1) / (1 + beta))
    # This build offloads nothing to a GPU (a CPU build, or a GPU build without a GPU): the report says so.
    assert report["settings"]["engine"]["device"] == "CPU"
    md = (out / "report.md").read_text()
    assert md.startswith("# draftsmith evaluation: llama.cpp alone")
    assert f"- hardware: {report['hardware']['cpu']}, 1 engine threads" in md
    assert f"- served: llama.cpp {llama_cpp.VERSION} on `" in md and "; head as f16" in md  # the file and types served
    assert "llama.cpp's own model-free speculation" in md and "head (draft-eagle3)" not in md
    assert "### Verdict per category in llama.cpp (each drafter at its best k)" in md
    assert "- ngram: draftsmith's n-gram drafter has no llama.cpp counterpart" in md
    assert (out / "engine_k_speedup.png").stat().st_size > 0 and "![engine_k_speedup.png]" in md


def test_llama_cpp_alone_takes_what_llama_cpp_measures(tiny_world, tmp_path):
    """engine.only=true is llama.cpp's: greedy chains, and at least one drafter it serves."""
    from eval.evaluate import EvalPlan

    with pytest.raises(ValueError, match="engine.only=true measures in llama.cpp alone"):
        engine_for("openai", EngineCosts()).check(EvalPlan(), alone=True)
    with pytest.raises(ValueError, match=r"set temperatures=\[0.0\]"):
        LlamaCpp(EngineCosts()).check(EvalPlan(temperatures=[0.0, 1.0]), alone=True)
    with pytest.raises(ValueError, match="chains only"):
        LlamaCpp(EngineCosts()).check(EvalPlan(trees=["d2t2n4"]), alone=True)
    LlamaCpp(EngineCosts()).check(EvalPlan(ks=[2, 8]), alone=True)
    if llama_cpp.available():
        with pytest.raises(ValueError, match="llama.cpp serves none of the drafters: ngram: draftsmith's n-gram"):
            LlamaCpp(EngineCosts()).convert([{"name": "ngram", "kind": "ngram"}], None, "toyworld://tiny_deep/target",
                                            tmp_path, alone=True)


def test_engine_verdict_lines_rank_each_drafters_best_k():
    def r(drafter, k, x, verdict_):
        return {"category": "code", "drafter": drafter, "k": k, "engine_speedup": x, "engine_speedup_ci": (x - .1, x + .1),
                "engine_verdict": verdict_}

    from eval.report_engine import engine_verdict_lines

    (line,) = engine_verdict_lines([r("head", 2, 0.8, "turn it off"), r("head", 4, 1.2, "pays off"),
                                    r("mod", 2, 0.99, "undecided"), {**r("mod", 4, 1.0, None), "engine_speedup": None}])
    assert line == ("- **code**: head k=4 1.20× (1.10–1.30) → pays off; mod k=2 0.99× (0.89–1.09) → undecided")
    slow = {**r("head", 2, 0.74, "turn it off"), "engine_acceptance_length": 1.56, "engine_tau_to_pay": 2.2}
    (line,) = engine_verdict_lines([slow])  # what it keeps, and what it would need to keep to pay
    assert line == "- **code**: head k=2 0.74× (0.64–0.84) → turn it off (τ 1.56; it pays from τ 2.20 here)"
    lucky = {**slow, "engine_speedup": 1.1, "engine_verdict": "pays off"}  # measured above what the costs predict
    assert engine_verdict_lines([lucky]) == ["- **code**: head k=2 1.10× (0.64–0.84) → pays off"]


def test_llama_cpps_own_drafters_need_the_engine_and_cannot_be_the_baseline(tiny_world, tmp_path):
    from eval.run import resolve_specs

    simple = {"name": "simple", "kind": "llamacpp", "spec_type": "ngram-simple"}
    with pytest.raises(ValueError, match="measured in the engine only, set engine=llamacpp"):
        resolve_specs([{"name": "ngram", "kind": "ngram"}, simple], "toyworld://tiny/target", None)
    with pytest.raises(ValueError, match="the first drafter is the baseline"):
        resolve_specs([simple], "toyworld://tiny/target", "llamacpp")
    with pytest.raises(ValueError, match="spec_type must be one of"):
        llama_cpp_drafter({"name": "x", "kind": "llamacpp", "spec_type": "ngram-magic"}, None, "", tmp_path)
    spec, = resolve_specs([{"name": "self", "kind": "draft_lm", "layers": 1}], "toyworld://tiny/target", None)
    assert json.loads((Path(spec["path"]) / "config.json").read_text())["num_hidden_layers"] == 1


def test_a_drafter_is_served_in_bf16_where_the_targets_hidden_states_outgrow_f16():
    """ggml converts a matmul's activations to its weights' type: an f16 head reading features past f16's range
    drafts from inf (Gemma-3-270M's reach 10^5), so such drafters are served in bf16, the others in f16."""
    from helpers import tiny

    target = tiny("llama")
    assert draft_dtype(target) == draft_dtype(target, [0, 3]) == "float16"
    with torch.no_grad():
        target.get_input_embeddings().weight.mul_(1e6)  # massive activations from the first layer's input on
    assert draft_dtype(target, [0]) == draft_dtype(target) == "bfloat16"


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


def test_a_confidence_stop_is_served_as_llama_cpps_p_min_only_with_its_rule(tmp_path, monkeypatch):
    """llama.cpp drops the unsure guess (--spec-draft-p-min): a drafter whose stop proposes it is not what
    the engine would run, so the engine refuses it rather than measure another drafter under its name."""
    spec = {"name": "h", "kind": "head", "path": str(tmp_path), "stop_below": 0.5}
    with pytest.raises(ValueError, match="drafter 'h': llama.cpp's confidence stop .* stop_rule: drop"):
        llama_cpp_drafter(spec, None, "target", tmp_path)
    with pytest.raises(ValueError, match="drafter 'm': llama.cpp's n-gram modes have no confidence stop"):
        llama_cpp_drafter({"name": "m", "kind": "llamacpp", "spec_type": "ngram-mod", "stop_below": 0.5,
                                  "stop_rule": "drop"}, None, "target", tmp_path)
    monkeypatch.setattr(llama_cpp, "binary", lambda name: Path("llama.cpp/bin") / name)  # a command, not a build
    server = llama_cpp.LlamaServer("t.gguf", draft="d.gguf", spec_type="draft-eagle3", k=4, p_min=0.5)
    assert server.command(8080)[-2:] == ["--spec-draft-p-min", "0.5"]
    with pytest.raises(ValueError, match="p_min is a draft model's confidence stop"):
        llama_cpp.LlamaServer("t.gguf", spec_type="ngram-mod", p_min=0.5)


def test_ngram_cache_is_served_and_reported_at_the_draft_length_llama_cpp_fixes_for_it(monkeypatch):
    """llama.cpp's ngram-cache drafts up to 8 tokens whatever --spec-draft-n-max says: a server asked for
    another k is an error, and the engine measures and reports it at k 8 alone, whatever ks are asked for."""
    with pytest.raises(ValueError, match="ngram-cache drafts up to 8 tokens .* k must be 8, got 4"):
        llama_cpp.LlamaServer("t.gguf", spec_type="ngram-cache", k=4)
    monkeypatch.setattr(llama_cpp, "binary", lambda name: Path("llama.cpp/bin") / name)  # a command, not a build
    assert "ngram-cache" in llama_cpp.LlamaServer("t.gguf", spec_type="ngram-cache", k=8).command(8080)
    cache, mod = Served("cache", spec_type="ngram-cache"), Served("mod", spec_type="ngram-mod")
    assert cache.ks([2, 4]) == [8] and mod.ks([2, 4]) == [2, 4]

    def gen(ms, n):
        return llama_cpp.Completion(tokens=list(range(10)), draft_n=n, draft_n_accepted=n // 2, predicted_ms=ms)

    items = [("code", i) for i in range(3)]
    measured = {"items": items, "costs": {},
                "completions": {"plain": {(0, c, i): gen(100.0, 0) for c, i in items},
                                ("cache", 8): {(0, c, i): gen(90.0, 4) for c, i in items},
                                **{("mod", k): {(0, c, i): gen(95.0, 2) for c, i in items} for k in (2, 4)}},
                "counters": {key: {(0, c, i): DraftStats(verifications=2, rounds=4, drafted=4, accepted=2)
                                   for c, i in items} for key in [("cache", 8), ("mod", 2), ("mod", 4)]}}
    greedy = [dict(row("ngram", 1.5, 2.0, k=k, category="code"), batch_size=1) for k in (2, 4)]
    served = [Served("ngram", note="no llama.cpp counterpart"), cache, mod]
    rows = engine_figures(greedy, measured, served, repeats=1, pays_off_at=1.05)
    assert sorted((r["drafter"], r["k"]) for r in rows) == [("cache", 8), ("mod", 2), ("mod", 4)]
    alone = engine_figures([], measured, served, repeats=1, pays_off_at=1.05, alone=True, ks=[2, 4])
    assert sorted({(r["drafter"], r["k"]) for r in alone}) == [("cache", 8), ("mod", 2), ("mod", 4)]
    assert all(r["engine_acceptance_length"] == pytest.approx(1.5) for r in alone)  # 1 + 2 accepted / 4 rounds


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


FAKE_SERVER = """#!{python}
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
print("load_model: failed to initialize speculative decoding context: draft model vocab type must match target "
      "model to use speculation", flush=True)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_a_server_that_could_not_set_up_its_drafter_is_an_error_naming_why(tmp_path, monkeypatch):
    """llama-server logs a drafter it cannot use (a draft whose vocabulary type is not the target's) and serves on
    without speculation: measured, that would read as a drafter that never drafts. A stand-in server that does
    just that: starting it raises llama-server's own reason, and the server is stopped."""
    import sys

    build = tmp_path / "llama.cpp"
    (build / "bin").mkdir(parents=True)
    (build / "src").mkdir()
    (build / "src" / "convert_hf_to_gguf.py").write_text("")
    (build / "bin" / "patches.sha256").write_text(llama_cpp.patches_digest())
    (build / "bin" / "llama-quantize").write_text("")  # a build has it; this test never runs it
    server = build / "bin" / "llama-server"
    server.write_text(FAKE_SERVER.format(python=sys.executable))
    server.chmod(0o755)
    monkeypatch.setenv("DRAFTSMITH_LLAMA_CPP", str(build))
    with llama_cpp.LlamaServer("t.gguf", timeout=30) as plain:  # no drafter: nothing to set up
        assert plain.process.poll() is None
    running = llama_cpp.LlamaServer("t.gguf", draft="d.gguf", spec_type="draft-simple", timeout=30)
    with pytest.raises(RuntimeError, match="could not set up draft-simple with d.gguf for t.gguf: failed to "
                                           "initialize speculative decoding context: draft model vocab type must"):
        running.__enter__()
    assert running.process.poll() is not None


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


def test_a_draft_lm_gets_the_vocabulary_type_of_the_target_file_it_is_served_with(tmp_path):
    """llama-server drafts only with a draft whose vocabulary type is the target's. The converter writes a BPE
    vocabulary for a Gemma-3 directory without tokenizer.model where the shipped file has SentencePiece's: the
    draft's GGUF then takes the target file's tokenizer metadata, every other field and tensor unchanged; where the
    types already agree it is left alone."""
    import gguf
    import numpy as np

    def write(path, tokenizer: dict, tensors: dict):
        writer = gguf.GGUFWriter(path, arch="gemma3")
        writer.add_block_count(4)
        for key, (value, kind, sub_type) in tokenizer.items():
            writer.add_key_value(key, value, kind, sub_type=sub_type)
        for name, array in tensors.items():
            writer.add_tensor(name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    A, S, F, I = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.INT32
    tokens = ["<pad>", "<eos>", "a", "b"]
    weights = {"token_embd.weight": np.arange(8, dtype=np.float16).reshape(4, 2),
               "output_norm.weight": np.ones(2, dtype=np.float32)}
    write(tmp_path / "draft.gguf", {"tokenizer.ggml.model": ("gpt2", S, None), "tokenizer.ggml.tokens": (tokens, A, S),
                                    "tokenizer.ggml.merges": (["a b"], A, S)}, weights)
    write(tmp_path / "target.gguf", {"tokenizer.ggml.model": ("llama", S, None), "tokenizer.ggml.tokens": (tokens, A, S),
                                     "tokenizer.ggml.scores": ([0.0, 0.0, -1.0, -2.0], A, F),
                                     "tokenizer.ggml.token_type": ([3, 3, 1, 1], A, I)}, {})
    assert writing.with_tokenizer_of(tmp_path / "draft.gguf", tmp_path / "target.gguf")
    draft = gguf.GGUFReader(tmp_path / "draft.gguf")
    assert draft.fields["tokenizer.ggml.model"].contents() == "llama" and "tokenizer.ggml.merges" not in draft.fields
    assert draft.fields["tokenizer.ggml.scores"].contents() == [0.0, 0.0, -1.0, -2.0]
    assert draft.fields["general.architecture"].contents() == "gemma3" and draft.fields["gemma3.block_count"].contents() == 4
    assert {t.name: t.data.tolist() for t in draft.tensors} == {n: a.tolist() for n, a in weights.items()}
    assert not writing.with_tokenizer_of(tmp_path / "draft.gguf", tmp_path / "target.gguf")  # types agree now


GPU_LOG = """llama_model_load_from_file_impl: using device CUDA0 (NVIDIA H200) (0000:00:05.0) - 142629 MiB free
load_tensors: offloading 30 repeating layers to GPU
load_tensors: offloading output layer to GPU
load_tensors: offloaded 31/31 layers to GPU
"""


def test_the_device_llama_server_runs_on_comes_from_its_log():
    """A build with a GPU backend names the device and the layers it offloads (llama-server offloads all it can by
    default); a CPU build names no device; a GPU build told to offload nothing runs on the CPU."""
    assert llama_cpp.served_on(GPU_LOG) == "NVIDIA H200 (CUDA0), 31/31 layers"
    assert llama_cpp.served_on("load_tensors:   CPU_Mapped model buffer size =    98.06 MiB\n") == "CPU"
    assert llama_cpp.served_on(GPU_LOG.replace("31/31", "0/31")) == "CPU"
    two = GPU_LOG + "llama_model_load_from_file_impl: using device CUDA1 (NVIDIA H200) (0000:00:06.0) - 1 MiB free\n"
    assert llama_cpp.served_on(two) == "NVIDIA H200 (CUDA0), NVIDIA H200 (CUDA1), 31/31 layers"


def test_the_report_names_the_device_the_engine_ran_on():
    """torch's view of the machine is not llama.cpp's: a GPU torch sees can sit idle under a CPU build, and a CUDA
    build offloads where torch has no GPU. The engine's lines name the device from llama-server's log; a report
    written before it was recorded keeps torch's."""
    from eval import report_engine as report_md

    hw = {"cpu": "AMD EPYC", "gpu": "NVIDIA H200", "torch_threads": 2, "torch": "2.13.0"}
    on = lambda device: {"hardware": hw, "settings": {"engine": {"name": "llama.cpp", "threads": 4,
                                                                  **({"device": device} if device else {})}}}
    assert report_md.engine_device(on("NVIDIA H200 (CUDA0), 31/31 layers")) == "NVIDIA H200 (CUDA0), 31/31 layers"
    assert report_md.engine_device(on("CPU")) == "AMD EPYC"
    assert report_md.engine_device(on(None)) == "NVIDIA H200"
