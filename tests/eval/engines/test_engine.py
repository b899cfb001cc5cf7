"""The verdict in the engine (eval/engines/engine.py): llama.cpp measured beside draftsmith's loop, and a prediction
for an engine that cannot run here from the c and β a team measured in it."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import eval.__main__ as entry
from eval.engines import llama_cpp
from eval.engines.costs import EngineCosts
from eval.engines.llama_cpp_drafters import llama_cpp_drafter
from eval.engines.llama_cpp_figures import CHAINS_ONLY, NOTHING_DRAFTED
from eval.engines.engine import LlamaCpp, add_costs, engine_for
from eval.metrics import predicted_speedup
from eval.compare import verdict


CONF = str(Path(__file__).resolve().parents[3] / "conf")


needs_llama_cpp = pytest.mark.skipif(not llama_cpp.available(), reason=(
    f"llama.cpp is not built at {llama_cpp.home()}: `make llama-cpp` (make test builds it)"))


def make_cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="eval", overrides=list(overrides))


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

    with pytest.raises(MissingConfigException, match=r"(?s)Could not find 'engine/sglang'.*llamacpp\n\topenai\n\tvllm"):
        make_cfg("engine=sglang", "data.path=/nonexistent.jsonl", f"out_dir={tmp_path}")
    with pytest.raises(ValueError, match="engine='sglang' is not one draftsmith runs"):  # the library's own check
        engine_for("sglang", EngineCosts())
    with pytest.raises(ValueError, match="set one or the other"):
        entry.run(make_cfg("engine=llamacpp", "engine_costs.beta=0.1", "data.path=/nonexistent.jsonl",
                           f"out_dir={tmp_path}"))
    # vLLM reads its CPU KV cache as whole GiB (VLLM_CPU_KVCACHE_SPACE): a fraction fails here, not in its server
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match=r"engine.kv_cache_gib=0.25"):
        make_cfg("engine=vllm", "engine.kv_cache_gib=0.25", "data.path=/nonexistent.jsonl", f"out_dir={tmp_path}")


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
    (build / "bin" / "llama-quantize").write_text("")  # a build has them; this test never runs them
    (build / "bin" / "llama-hidden-states").write_text("")
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


def test_vllms_costs_read_the_round_off_the_measured_speedup_through_the_cost_model():
    """engine=vllm's costs: β from the plain server's clock gives the ceilings; c is what makes the cost model return
    the measured speed-up, so τ to pay is the pay-off line times τ over that speed-up; B > 1 rows get none."""
    row = {"batch_size": 1, "engine_acceptance_length": 3.0, "engine_speedup": 1.2, "engine_mean_proposed": 4.0}
    add_costs(row, beta=0.5, k=4, pays_off_at=1.05)
    assert row["engine_verify_overhead"] == 0.5
    assert row["engine_ceiling"] == pytest.approx(5 / 1.5) and row["engine_tau_ceiling"] == pytest.approx(3 / 1.5)
    assert row["engine_cost_ratio"] == pytest.approx((3 / 1.2 - 1.5) / 4)
    assert predicted_speedup(3.0, 4.0, row["engine_cost_ratio"], 0.5) == pytest.approx(1.2)
    assert row["engine_tau_to_pay"] == pytest.approx(1.05 * 3 / 1.2)
    busy = {"batch_size": 4, "engine_acceptance_length": 3.0, "engine_speedup": 1.2}
    add_costs(busy, beta=0.5, k=4, pays_off_at=1.05)
    assert "engine_ceiling" not in busy and "engine_cost_ratio" not in busy
    # No speed-up measured (no plain server): the ceilings, but no c.
    alone = {"batch_size": 1, "engine_acceptance_length": 3.0, "engine_speedup": None}
    add_costs(alone, beta=0.5, k=4, pays_off_at=1.05)
    assert alone["engine_ceiling"] == pytest.approx(5 / 1.5) and "engine_cost_ratio" not in alone
