"""A team's own deployment measured through its OpenAI-compatible API (eval/engines/deployment.py): real llama-servers on
127.0.0.1 with a drafter and without, and vLLM's own speculative-decoding counters."""

import http.server
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import eval.__main__ as entry
from eval.engines import deployment, llama_cpp
from eval.engines.deployment import SpecCounters
from eval.engines.endpoint import Endpoint, EndpointError
from traffic import toyworld

ROOT = Path(__file__).resolve().parents[3]
VLLM_DIR = ROOT / ".venv" / "vllm"
needs_llama_cpp = pytest.mark.skipif(not llama_cpp.available(), reason=(
    f"llama.cpp is not built at {llama_cpp.home()}: `make llama-cpp` (make test builds it)"))
K = 4


def make_cfg(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="eval", overrides=list(overrides))


class Exposition:
    """A Prometheus exposition served at /metrics on 127.0.0.1, as a server's own endpoint serves it."""

    def __init__(self, text: str) -> None:
        owner = self
        self.text = text

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                data = owner.text.encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


VLLM_SCRIPT = """
import sys
sys.path.append(sys.argv[1])
from types import SimpleNamespace
import prometheus_client
from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

# Two engines of one server, as vLLM labels them, each observing its own drafts (drafted, accepted) per step.
prom = SpecDecodingProm(SimpleNamespace(num_speculative_tokens=3), ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
for engine, steps in enumerate([[[(3, 3), (3, 0)], [(3, 1)]], [[(2, 2), (3, 3)]]]):
    for drafts in steps:
        stats = SpecDecodingStats.new(3)
        for drafted, accepted in drafts:
            stats.observe_draft(drafted, accepted)
        prom.observe(stats, engine_idx=engine)
sys.stdout.write(prometheus_client.generate_latest().decode())
"""


@pytest.mark.skipif(not (VLLM_DIR / "vllm").is_dir(), reason=f"vLLM is not installed at {VLLM_DIR} (make install)")
def test_vllm_counters_give_tau_and_acceptance_by_position_exactly():
    """vLLM's own SpecDecodingProm records a known sequence of drafts; its exposition, served on 127.0.0.1, reads
    back as exactly that sequence's τ and per-position acceptance."""
    text = subprocess.run([sys.executable, "-c", VLLM_SCRIPT, str(VLLM_DIR)], capture_output=True, text=True,
                          check=True, timeout=300).stdout
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in text
    served = Exposition(text)
    try:
        counters = deployment.read_counters(Endpoint(served.url))
    finally:
        served.close()
    drafts = [(3, 3), (3, 0), (3, 1), (2, 2), (3, 3)]
    assert counters.drafts == 5 and counters.draft_tokens == 14 and counters.accepted == 9
    assert counters.tau == 1 + 9 / 5
    assert counters.by_position == [4 / 5, 3 / 5, 2 / 5]  # kept at position 0, 1, 2 (of 5 verifications)
    assert counters.by_position == [sum(a > i for _, a in drafts) / 5 for i in range(3)]
    nothing = SpecCounters.parse(text) - counters  # two reads with no traffic between them
    assert nothing.drafts == 0 and nothing.tau is None and nothing.by_position == []
    both = counters + counters
    assert both.tau == counters.tau and both.per_position == (8.0, 6.0, 4.0)


def test_a_server_without_speculative_counters_has_none_and_a_missing_metrics_endpoint_is_none():
    assert SpecCounters.parse("# TYPE process_cpu_seconds counter\nprocess_cpu_seconds_total 1.0\n") is None
    served = Exposition("")
    try:
        endpoint = Endpoint(served.url + "/v1")
        assert endpoint.metrics() == "" and deployment.read_counters(endpoint) is None
        endpoint.base += "/nothing-here"  # a server without /metrics answers 404
        assert endpoint.metrics() is None
    finally:
        served.close()


def test_figures_pool_decode_time_and_catch_a_different_answer():
    """The speed-up is tokens after the first over first-to-last-token time, pooled over prompts and repeats; one
    answer that differs from the plain server's makes the row not lossless, its note counting them; τ sums the
    categories' counters."""
    from eval.engines.endpoint import Streamed

    def served(decode, texts, counters=None):
        out = deployment.Answers()
        for rep in range(2):
            for c in ("code", "chat"):
                out.answers[rep, c] = [Streamed(t, 11, 0.01, d, "length") for t, d in zip(texts, decode)]
                out.wall[rep, c] = (sum(decode), 11 * len(decode))
                if counters is not None:
                    out.counters[rep, c] = counters
        return out

    spec = served([0.5, 0.5, 1.0], ["a", "b", "c"], SpecCounters(10, 40, 20, (8.0, 6.0, 4.0, 2.0)))
    plain = served([1.0, 1.0, 2.0], ["a", "b", "c"])
    f = deployment.figures({"spec": spec, "plain": plain}, "all", repeats=2, pays_off_at=1.05)
    assert f["engine_speedup"] == pytest.approx(2.0) and f["engine_verdict"] == "pays off"
    assert f["engine_acceptance_length"] == pytest.approx(3.0)  # 1 + 80 accepted / 40 verifications
    assert f["engine_acceptance_by_position"] == [0.8, 0.6, 0.4, 0.2]
    assert f["engine_lossless"] is True and f["engine_throughput_ratio"] == pytest.approx(2.0)
    assert f["engine_tpot_ms"]["spec"][0] == pytest.approx(50.0)  # 0.5 s over 10 tokens after the first
    plain.answers[1, "chat"][2] = Streamed("other", 11, 0.01, 2.0, "length")
    parted = deployment.figures({"spec": spec, "plain": plain}, "chat", repeats=2, pays_off_at=1.05)
    assert parted["engine_lossless"] is False
    assert parted["engine_note"] == "chat: 1 of 6 answers differ from the plain server's"
    # The rows of the named drafter at its k get the figures, and with costs entered, draftsmith's prediction.
    from eval.engines.costs import EngineCosts

    rows = [{"drafter": d, "k": k, "batch_size": 1, "temperature": 0.0, "category": c, "acceptance_length": 3.0,
             "mean_proposed": 4.0} for d, k in (("head", 4), ("head", 2), ("ngram", 4)) for c in ("code", "chat", "all")]
    own = deployment.add_figures(rows, {1: {"spec": spec, "plain": plain}}, drafter="head", k=4, repeats=2,
                                 pays_off_at=1.05, costs=EngineCosts(c=0.05, beta=0.2))
    assert own == []
    for r in rows:
        if (r["drafter"], r["k"]) == ("head", 4):
            assert r["engine"] == deployment.NAME and r["engine_acceptance_length"] == pytest.approx(3.0)
            assert r["engine_predicted_speedup"] == pytest.approx(3.0 / (1 + 4 * 0.05 + 0.2))
            assert r["engine_tau_to_pay"] == pytest.approx(1.05 * (1 + 4 * 0.05 + 0.2))
        else:
            assert "engine" not in r
    spec.counters[0, "code"] = None  # a server without counters
    assert deployment.figures({"spec": spec, "plain": plain}, "all", repeats=2, pays_off_at=1.05)[
        "engine_acceptance_length"] is None


def test_drafters_served_in_turn_are_compared_with_the_baseline_on_the_same_prompts():
    """engine=vllm serving several drafters in turn: each drafter's rows gain its decoding speed over the baseline
    drafter's and, from each request's own counters (batch 1), its τ over the baseline's, paired by prompt with
    their intervals; the baseline's own rows are 1. Without every request's counters there is no τ ratio."""
    from eval.engines.endpoint import Streamed

    def served(decode, kept, categories=("code", "chat")):  # kept: each prompt's accepted drafts of 10 verifications
        out = deployment.Answers()
        for c in categories:
            out.answers[0, c] = [Streamed("a", 11, 0.01, d, "length") for d in decode]
            out.prompt_counters[0, c] = [SpecCounters(10, 40, a) for a in kept]
        return {1: {"spec": out}}

    base = served([1.0, 1.0, 1.2], [10, 12, 8])  # τ 2.0 over all prompts
    trained = served([0.5, 0.5, 0.6], [20, 24, 16])  # twice as fast, τ 3.0 (twice the kept drafts)
    rows = [{"drafter": d, "k": 4, "batch_size": 1, "temperature": 0.0, "category": c}
            for d in ("base", "trained", "other") for c in ("code", "chat", "all")]
    deployment.add_versus(rows, {"base": base, "trained": trained}, "base", k=4, repeats=1)
    for r in rows:
        if r["drafter"] == "trained":
            assert r["engine_speedup_vs_baseline"] == pytest.approx(2.0), r["category"]
            assert r["engine_tau_vs_baseline"] == pytest.approx(1.5), r["category"]  # 3.0 / 2.0
            low, high = r["engine_tau_vs_baseline_ci"]
            assert low <= 1.5 <= high and low > 1  # every prompt kept twice as many
        elif r["drafter"] == "base":
            assert r["engine_speedup_vs_baseline"] == pytest.approx(1.0)
            assert r["engine_tau_vs_baseline"] == pytest.approx(1.0)
        else:
            assert "engine_speedup_vs_baseline" not in r  # not served
    trained[1]["spec"].prompt_counters[0, "chat"][1] = None  # a request whose counters were not read
    rows = [{"drafter": "trained", "k": 4, "batch_size": 1, "temperature": 0.0, "category": c} for c in ("code", "chat")]
    deployment.add_versus(rows, {"base": base, "trained": trained}, "base", k=4, repeats=1)
    assert rows[0]["engine_tau_vs_baseline"] == pytest.approx(1.5) and "engine_tau_vs_baseline" not in rows[1]
    assert rows[1]["engine_speedup_vs_baseline"] == pytest.approx(2.0)
    rows = [{"drafter": "trained", "k": 4, "batch_size": 1, "temperature": 0.0, "category": "all"}]
    deployment.add_versus(rows, {"trained": trained}, "base", k=4, repeats=1)  # the baseline was not served
    assert "engine_speedup_vs_baseline" not in rows[0]
    # With the plain server measured in each pass, the speed is each drafter's speed-up over its own pass's plain
    # answers: a machine 25 % slower through the trained drafter's pass (its plain answers too) cancels.
    base[1]["plain"] = served([2.0, 2.0, 2.4], [0, 0, 0])[1]["spec"]
    slow = served([0.625, 0.625, 0.75], [20, 24, 16])
    slow[1]["plain"] = served([2.5, 2.5, 3.0], [0, 0, 0])[1]["spec"]
    rows = [{"drafter": "trained", "k": 4, "batch_size": 1, "temperature": 0.0, "category": c} for c in ("code", "all")]
    deployment.add_versus(rows, {"base": base, "trained": slow}, "base", k=4, repeats=1)
    for r in rows:
        assert r["engine_speedup_vs_baseline"] == pytest.approx(2.0), r["category"]
        low, high = r["engine_speedup_vs_baseline_ci"]
        assert low == pytest.approx(2.0) and high == pytest.approx(2.0)  # every prompt twice as fast
    del slow[1]["plain"]  # without it, the drift stays in the ratio
    deployment.add_versus(rows, {"base": base, "trained": slow}, "base", k=4, repeats=1)
    assert rows[0]["engine_speedup_vs_baseline"] == pytest.approx(1.6)


# --- real llama-servers ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny_world, tmp_path_factory):
    """tiny_deep's target and its off-the-shelf draft LM as llama.cpp serves them, converted once."""
    out = tmp_path_factory.mktemp("deployment")
    target = llama_cpp.convert_to_gguf(Path(toyworld.resolve("toyworld://tiny_deep/target")), out / "target.gguf")
    draft = llama_cpp.convert_to_gguf(Path(toyworld.resolve("toyworld://tiny_deep/draft")), out / "draft.gguf")
    return {"target": target, "draft": draft}


def servers(served, parallel=1):
    return (llama_cpp.LlamaServer(served["target"], draft=served["draft"], spec_type="draft-simple", k=K,
                                  parallel=parallel),
            llama_cpp.LlamaServer(served["target"], parallel=parallel))


COMMON = ["target=tiny_deep", f"ks=[{K}]", "repeats=1", "max_new_tokens=32", "data.max_prompts_per_category=3",
          "progress=false", "threads=1",
          "drafters=[{name: off_the_shelf, kind: draft_lm, path: toyworld://tiny_deep/draft}]"]


@pytest.mark.slow
@needs_llama_cpp
def test_a_deployment_measured_through_its_api_agrees_with_engine_llamacpp(served, tmp_path, monkeypatch, capfd):
    """`engine=openai` against two llama-servers (the draft LM at k=4, and none) gives the τ llama.cpp's own counters
    give under engine=llamacpp on the same prompts, losslessly, with latency, at batch 1 and 2; the API key
    is sent but never shown."""
    monkeypatch.setenv("DEPLOY_KEY", "sk-never-shown-42")
    spec_server, plain_server = servers(served, parallel=2)
    with spec_server as spec, plain_server as plain:
        report = entry.run(make_cfg(*COMMON, "engine=openai", f"engine.spec_url={spec.url}/v1",
                                    f"engine.plain_url={plain.url}", "engine.drafter=off_the_shelf", f"engine.k={K}",
                                    "engine.api_key_env=DEPLOY_KEY", "batch_sizes=[1,2]", f"out_dir={tmp_path / 'api'}"))
    llama = entry.run(make_cfg(*COMMON, "engine=llamacpp", f"out_dir={tmp_path / 'llama'}"))
    settings = report["settings"]["engine"]
    assert settings["name"] == deployment.NAME and settings["drafter"] == "off_the_shelf"
    rows = {(r["category"], r["batch_size"]): r for r in report["results"]}
    assert {b for _, b in rows} == {1, 2}
    for (category, batch), r in rows.items():
        assert r["engine"] == deployment.NAME
        assert r["engine_lossless"] is True, (category, batch)
        assert 1 <= r["engine_acceptance_length"] <= 1 + K
        assert len(r["engine_acceptance_by_position"]) == K
        assert r["engine_speedup"] > 0 and r["engine_throughput_ratio"] > 0
        for which in ("spec", "plain"):
            p50, p90 = r["engine_ttft_ms"][which]
            assert 0 < p50 <= p90
            p50, p90 = r["engine_tpot_ms"][which]
            assert 0 < p50 <= p90
    theirs = {r["category"]: r["engine_acceptance_length"] for r in llama["results"]}
    for category, tau in theirs.items():  # the same server, prompts and k: its counters, read two ways
        assert rows[category, 1]["engine_acceptance_length"] == pytest.approx(tau, rel=0.02), category
    md = (tmp_path / "api" / "report.md").read_text()
    assert f"## In {deployment.NAME}" in md and "time to first token" in md
    out = capfd.readouterr()
    assert "sk-never-shown" not in out.out + out.err + md + (tmp_path / "api" / "report.json").read_text()


@pytest.mark.slow
@needs_llama_cpp
def test_without_a_named_drafter_the_deployment_has_rows_of_its_own_and_without_a_plain_server_no_speedup(
        served, tmp_path):
    spec_server, _ = servers(served)
    with spec_server as spec:
        report = entry.run(make_cfg(*COMMON, "engine=openai", f"engine.spec_url={spec.url}", f"out_dir={tmp_path}"))
    own = report["engine_results"]
    assert {r["drafter"] for r in own} == {"deployment"} and {r["k"] for r in own} == {K}
    assert all(r["engine_speedup"] is None and "no engine.plain_url" in r["engine_note"] for r in own)
    assert all(1 <= r["engine_acceptance_length"] <= 1 + K for r in own)
    assert all(r.get("engine") is None for r in report["results"])  # draftsmith's rows are left as they are


@pytest.mark.slow
@needs_llama_cpp
def test_a_server_that_fails_mid_run_stops_the_run_with_its_url(served, tmp_path, monkeypatch):
    spec_server, plain_server = servers(served)
    calls = {"n": 0}
    original = Endpoint.stream

    def failing(self, prompt_ids, *, max_tokens):
        calls["n"] += self.base == spec.url
        if calls["n"] == 3 and self.base == spec.url:  # the drafting server goes down part-way through
            spec.process.kill()
            spec.process.wait()
        return original(self, prompt_ids, max_tokens=max_tokens)

    monkeypatch.setattr(Endpoint, "stream", failing)
    with spec_server as spec, plain_server as plain:
        with pytest.raises(EndpointError, match=rf"{spec.url}/v1/completions failed 2 times"):
            entry.run(make_cfg(*COMMON, "engine=openai", f"engine.spec_url={spec.url}", f"engine.plain_url={plain.url}",
                               "engine.retries=1", "engine.timeout=10", f"out_dir={tmp_path}"))


def test_a_deployment_is_checked_before_anything_is_measured(tiny_world, tmp_path, monkeypatch):
    def measured(*args, **kwargs):
        raise AssertionError("draftsmith's loop ran before the deployment was checked")

    monkeypatch.setattr(entry, "evaluate", measured)
    with pytest.raises(EndpointError, match=r"http://127.0.0.1:9/v1/models failed"):
        entry.run(make_cfg(*COMMON, "engine=openai", "engine.spec_url=http://127.0.0.1:9", "engine.retries=0",
                           "engine.timeout=2", f"out_dir={tmp_path}"))
    with pytest.raises(ValueError, match=r"engine.drafter='trained' is not one of drafters \['off_the_shelf'\]"):
        entry.run(make_cfg(*COMMON, "engine=openai", "engine.spec_url=http://127.0.0.1:9", "engine.drafter=trained",
                           f"out_dir={tmp_path}"))
    with pytest.raises(ValueError, match=r"engine=openai measures the one server at engine.spec_url, so it names one"):
        entry.run(make_cfg(*COMMON, "engine=openai", "engine.spec_url=http://127.0.0.1:9",
                           "engine.drafter=[off_the_shelf,trained]", f"out_dir={tmp_path}"))
    with pytest.raises(ValueError, match=r"engine.k=8: the tokens the deployment drafts per round, one of ks=\[4\]"):
        entry.run(make_cfg(*COMMON, "engine=openai", "engine.spec_url=http://127.0.0.1:9",
                           "engine.drafter=off_the_shelf", "engine.k=8", f"out_dir={tmp_path}"))
