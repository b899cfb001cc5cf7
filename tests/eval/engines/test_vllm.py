"""A real vLLM server (its CPU build, eval/engines/vllm.py) serving draftsmith's exports: plain decoding as
draftsmith's loop decodes, each drafter's greedy output equal to the plain server's, and τ from the server's own
counters (`/metrics`) beside draftsmith's loop on the same prompts, k and budget. The target is the tiny_vllm world's
(tiny_deep with 32-dimensional attention heads, the smallest vLLM's CPU attention takes); each server takes about
a minute to start, so the module starts each one once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import eval.__main__ as entry
from conftest import built_once
from hydra import compose, initialize_config_dir

from drafters import kinds
from drafters.sampling import Sampling
from eval.engines import vllm
from eval.engines.deployment import SpecCounters
from eval.evaluate import EvalPlan
from eval.run import build_drafter, load_target
from eval.speculative import autoregressive_generate, speculative_generate
from helpers import train_tiny_deep
from traffic import toyworld
from traffic.records import Example
from train.config import ExportSettings
from train.export import export
from train.hidden_states import ShardReader, write_shards, write_shards_from_files, write_shards_from_vllm

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm"), pytest.mark.skipif(not vllm.available(), reason=(
    f"vLLM is not installed at {vllm.ENVIRONMENT}: `make vllm` (make test installs it)"))]

TARGET, DRAFT = "toyworld://tiny_vllm/target", "toyworld://tiny_vllm/draft"
K, NEW_TOKENS, PROMPTS = 4, 32, 8
TAU_TOLERANCE = 0.05  # vLLM's τ against draftsmith's loop, same drafter, prompts, k and budget


@pytest.fixture(scope="module")
def world(tiny_world):
    """The target, its tokenizer and held-out prompts as token ids, and the target's own greedy answers to them."""
    target_dir = Path(toyworld.resolve(TARGET))
    target, tok = load_target(TARGET, device=torch.device("cpu"))
    records = [json.loads(line) for line in (target_dir.parent / "company_logs" / "eval.jsonl").open()][:PROMPTS]
    prompts = [tok.apply_chat_template(r["messages"][:-1], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for r in records]
    greedy = [autoregressive_generate(target, torch.tensor(p), sampling=Sampling(), max_new_tokens=NEW_TOKENS).tokens
              for p in prompts]
    return {"dir": target_dir, "target": target, "tok": tok, "prompts": prompts, "greedy": greedy}


def test_an_interrupt_while_vllm_loads_stops_its_process_group(world, monkeypatch):
    """Ctrl-C or `kill` in vLLM's minutes of loading (before `with` has a server to exit) stops the server and its
    engine core, which run in their own process group."""
    import os
    import urllib.request

    group = []

    def interrupted(*args, **kwargs):
        group.append(server.process.pid)
        raise KeyboardInterrupt

    monkeypatch.setattr(urllib.request, "urlopen", interrupted)  # the first health check
    server = vllm.VllmServer(world["dir"])
    with pytest.raises(KeyboardInterrupt):
        server.__enter__()
    with pytest.raises(ProcessLookupError):
        os.killpg(group[0], 0)


def eagle_run(shared_dir, name: str, *overrides: str) -> Path:
    """An EAGLE-3 head on tiny_vllm trained for greedy serving, once per test run."""
    return built_once(shared_dir / "runs" / name / "run", lambda out: train_tiny_deep(
        out, "drafter=eagle", "trainer.max_steps=150", "trainer.eval_every=50", "trainer.checkpoint_every=50",
        "trainer.lr=5e-3", "drafter.label_temperature=0", "trainer.select_by=top1", *overrides, target="tiny_vllm"))


# The draft vocabulary: EAGLE-3's default share of the target's (its export maps draft ids to target ids), and the
# whole vocabulary (no maps: vLLM refuses a checkpoint that carries them then).
VOCABULARIES = {"draft_vocabulary": (), "whole_vocabulary": ("drafter.draft_vocab_share=1",)}


def serve(world, speculative_config=None) -> tuple[list[list[int]], SpecCounters | None]:
    """Every prompt's greedy answer from a vLLM server, and its speculative counters (None: plain decoding)."""
    with vllm.VllmServer(world["dir"], speculative_config=speculative_config) as server:
        answers = [server.complete(p, NEW_TOKENS) for p in world["prompts"]]
        return answers, SpecCounters.parse(server.metrics())


def draftsmith_rounds(world, drafter) -> tuple[float, list[float]]:
    """draftsmith's loop on the same prompts, k and budget (greedy, the end of sequence ignored as vLLM is told): τ,
    and by position the share of rounds that kept the guess there (what vLLM's per-position counters give)."""
    kept = []
    for p, answer in zip(world["prompts"], world["greedy"]):
        g = speculative_generate(world["target"], drafter, torch.tensor(p), k=K, sampling=Sampling(),
                                 max_new_tokens=NEW_TOKENS)
        assert g.tokens == answer
        kept += [r.accepted for r in g.rounds]
    return 1 + sum(kept) / len(kept), [sum(a > i for a in kept) / len(kept) for i in range(K)]


def assert_as_the_loop(counters: SpecCounters, ours: tuple[float, list[float]]) -> None:
    """vLLM's τ within TAU_TOLERANCE of the loop's, and its acceptance at each position within 0.05."""
    tau, by_position = ours
    assert abs(counters.tau / tau - 1) <= TAU_TOLERANCE, (tau, counters.tau)
    assert counters.by_position == pytest.approx(by_position, abs=0.05), (by_position, counters.by_position)


def test_vllm_decodes_as_draftsmiths_loop_does_and_times_its_steps_by_its_own_clock(world):
    with vllm.VllmServer(world["dir"]) as server:
        answers = [server.complete(p, NEW_TOKENS) for p in world["prompts"]]
        counters = SpecCounters.parse(server.metrics())
        costs = server.step_costs(max(world["prompts"], key=len), [K + 1], repeats=3)
    assert answers == world["greedy"]
    assert counters is None  # no drafter, no speculative counters
    # The forwards ran after a prefix of whole KV-cache blocks (128 tokens on a CPU) served from the cache (checked by
    # its hit counter inside step_costs), at the width asked and at one.
    assert costs.cached >= 128 and costs.cached % 128 == 0
    assert set(costs.forward_s) == {1, K + 1} and costs.step_s > 0 and min(costs.forward_s.values()) > 0
    assert costs.beta(1) == 0


class ClockedServer(vllm.VllmServer):
    """A vLLM server's /metrics, simulated: a forward over n new positions costs 10 ms + 2 ms·n, a decode step 5 ms,
    and its prefix cache serves whole 16-token blocks of prompts it has seen (none with `caching` off)."""

    def __init__(self, caching=True):
        super().__init__("model")
        self.caching, self.seen = caching, set()
        self.hits = self.prefill = self.decode = 0.0

    def metrics(self):
        return (f'vllm:cache_config_info{{block_size="16",engine="0"}} 1.0\n'
                f'vllm:prefix_cache_hits_total{{engine="0"}} {self.hits}\n'
                f'vllm:request_prefill_time_seconds_sum{{engine="0"}} {self.prefill}\n'
                f'vllm:request_decode_time_seconds_sum{{engine="0"}} {self.decode}\n')

    def _completion(self, prompt, max_tokens, **fields):
        cached = 0
        while self.caching and cached + 16 <= len(prompt) and tuple(prompt[:cached + 16]) in self.seen:
            cached += 16
        self.seen |= {tuple(prompt[:n]) for n in range(16, len(prompt) + 1, 16)}
        self.hits += cached
        self.prefill += 0.010 + 0.002 * (len(prompt) - cached)
        self.decode += 0.005 * (max_tokens - 1)
        return {}


def test_step_costs_time_the_forward_over_the_new_positions_alone_and_refuse_an_uncached_prefix():
    prompt = list(range(100, 150))  # 50 tokens: a prefix of three 16-token blocks
    costs = ClockedServer().step_costs(prompt, [5, 9], repeats=3)
    assert costs.cached == 48
    assert costs.step_s == pytest.approx(0.005)
    assert costs.forward_s == pytest.approx({1: 0.012, 5: 0.020, 9: 0.028})
    assert costs.beta(5) == pytest.approx(0.008 / 0.005) and costs.beta(9) == pytest.approx(0.016 / 0.005)
    assert vllm.StepCosts(0.005, {1: 0.012, 5: 0.011}, 48).beta(5) == 0  # noise on a model too small to tell
    with pytest.raises(RuntimeError, match="served 0 of the 48 prefix tokens from its cache"):
        ClockedServer(caching=False).step_costs(prompt, [5])
    with pytest.raises(ValueError, match="distinct tokens"):
        ClockedServer().step_costs([7] * 300, [5])
    # engine=vllm keeps what the servers measured where β cannot be timed, and says why.
    costs, why = vllm.measured_step_costs(ClockedServer(caching=False), prompt, 5)
    assert costs is None and "served 0 of the 48 prefix tokens" in why
    assert vllm.measured_step_costs(ClockedServer(), prompt, 5)[0].beta(5) == pytest.approx(1.6)


@pytest.mark.parametrize("vocabulary", VOCABULARIES)
def test_the_exported_eagle3_head_is_served_by_vllm_as_draftsmith_drafts_it(world, shared_dir, vocabulary, tmp_path):
    eagle_vllm_run = eagle_run(shared_dir, f"eagle_vllm_{vocabulary}", *VOCABULARIES[vocabulary])
    written = export(eagle_vllm_run, tmp_path / "export", ExportSettings(formats=["speculators"],
                                                                         num_speculative_tokens=K))
    engines = kinds.kind("eagle").engines
    answers, counters = serve(world, engines.vllm_config(str(written[engines.vllm_format]), K))
    assert answers == world["greedy"]  # lossless in the engine
    head = build_drafter({"name": "head", "kind": "head", "path": str(eagle_vllm_run / "best")},
                         target=world["target"], tokenizer=world["tok"])
    ours = draftsmith_rounds(world, head)
    assert ours[0] > 1.5  # it keeps guesses: the comparison is not between two heads that keep nothing
    assert_as_the_loop(counters, ours)
    # The export in vLLM's form (the maps between draft and target ids only where the draft vocabulary is not the
    # whole one) reads back as the head it was written from.
    keys = safe_open(written["speculators"] / "model.safetensors", "pt").keys()
    assert ("d2t" in keys) == (vocabulary == "draft_vocabulary")
    exported = build_drafter({"name": "export", "kind": "head", "path": str(written["speculators"])},
                             target=world["target"], tokenizer=world["tok"])
    assert draftsmith_rounds(world, exported) == ours


def test_the_off_the_shelf_draft_lm_is_served_by_vllm_as_draftsmith_drafts_it(world):
    engines = kinds.kind("draft_lm").engines
    answers, counters = serve(world, engines.vllm_config(toyworld.resolve(DRAFT), K))
    assert answers == world["greedy"]
    draft = build_drafter({"name": "draft", "kind": "draft_lm", "path": DRAFT}, target=world["target"],
                          tokenizer=world["tok"])
    ours = draftsmith_rounds(world, draft)
    assert ours[0] > 1.05  # the tiny off-the-shelf draft keeps a little (τ 1.14 here)
    assert_as_the_loop(counters, ours)


# The other kinds vLLM serves, each trained as tests/conftest.py trains its tiny_deep run (fewer steps where that run
# keeps enough): its kind, its training overrides, and how draftsmith's loop builds it from best/.
DFLASH = ("drafter=dflash", "trainer.max_steps=150", "trainer.eval_every=50", "trainer.checkpoint_every=50",
          "trainer.lr=5e-3", "drafter.label_temperature=0", "trainer.select_by=top1", "drafter.block_size=5")
KINDS = {
    "eagle1": ("eagle1", ("drafter=eagle1", "trainer.max_steps=60", "trainer.eval_every=30",
                          "trainer.checkpoint_every=30", "trainer.lr=5e-3", "trainer.select_by=top1"), "head"),
    "peagle": ("peagle", ("drafter=peagle", "trainer.max_steps=60", "trainer.eval_every=30",
                          "trainer.checkpoint_every=30", "trainer.lr=5e-3", "drafter.label_temperature=0",
                          "trainer.select_by=top1", "drafter.num_depths=4", "drafter.norm_before_fc=true",
                          "drafter.norm_before_residual=true"), "head"),
    "dflash": ("dflash", DFLASH, "head"),
    "dflash_vocab": ("dflash", (*DFLASH, "drafter.draft_vocab_size=120"), "head"),  # d2t, its own lm_head rows
    "pard": ("pard", ("drafter=pard", "trainer.max_steps=40", "trainer.eval_every=20", "trainer.checkpoint_every=20",
                      "trainer.lr=3e-3", "trainer.select_by=top1", "drafter.num_depths=4"), "draft_lm"),
}


@pytest.mark.parametrize("name", KINDS)
def test_every_other_export_vllm_serves_is_served_as_draftsmith_drafts_it(world, shared_dir, name, tmp_path):
    kind, overrides, entry = KINDS[name]
    run = built_once(shared_dir / "runs" / f"{name}_vllm" / "run",
                     lambda out: train_tiny_deep(out, *overrides, target="tiny_vllm"))
    engines = kinds.kind(kind).engines
    written = export(run, tmp_path / "export", ExportSettings(formats=[engines.vllm_format], num_speculative_tokens=K))
    answers, counters = serve(world, engines.vllm_config(str(written[engines.vllm_format]), K))
    assert answers == world["greedy"]
    drafter = build_drafter({"name": kind, "kind": entry, "path": str(run / "best")}, target=world["target"],
                            tokenizer=world["tok"])
    ours = draftsmith_rounds(world, drafter)
    assert ours[0] > 1.05, ours
    assert_as_the_loop(counters, ours)


@pytest.mark.parametrize("drafter", ["head", "[draft,head]"])
def test_engine_vllm_measures_the_drafter_in_two_vllm_servers_beside_draftsmiths_loop(world, shared_dir, drafter,
                                                                                      tmp_path, monkeypatch):
    """`python -m eval engine=vllm`: draftsmith exports the head (or serves the draft LM's directory as it is), serves
    the target with it and without it, and reports vLLM's τ (its counters), speed-up, latency and losslessness beside
    the loop's rows, per category. Each server takes the run's longest request and a round's drafts, not the
    model's whole context (whose KV cache a CPU may not hold), and its worker binds the run's `threads`. With a list
    (the draft LM, then the head), each is served in turn beside the one plain server, and the head's rows gain its
    speed and τ over the baseline draft LM's in vLLM, τ as the loop's ratio."""
    run = eagle_run(shared_dir, "eagle_vllm_draft_vocabulary")
    served = drafter.strip("[]").split(",")
    specs = {"head": f"{{name: head, kind: head, path: {run / 'best'}}}",
             "draft": f"{{name: draft, kind: draft_lm, path: {DRAFT}}}"}
    spec = ", ".join(specs[name] for name in served)
    groups = []  # the process group of every server this run starts (other workers' servers are not ours to count)
    enter = vllm.VllmServer.__enter__

    sizes, asked = [], {}  # each server's --max-model-len and cores; the prompts the run measures
    tokenize = entry.tokenize_prompts

    def recorded(server):
        started = enter(server)
        groups.append(server.process.pid)
        sizes.append((server.max_model_len, server.threads))
        return started

    monkeypatch.setattr(vllm.VllmServer, "__enter__", recorded)
    monkeypatch.setattr(entry, "tokenize_prompts", lambda *a, **kw: asked.setdefault("prompts", tokenize(*a, **kw)))
    conf = str(Path(__file__).resolve().parents[3] / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose(config_name="eval", overrides=[
            "target=tiny_vllm", f"ks=[{K}]", "repeats=1", f"max_new_tokens={NEW_TOKENS}",
            "data.max_prompts_per_category=2", "progress=false", "threads=1", "engine=vllm",
            f"engine.drafter={drafter}", f"engine.k={K}", f"drafters=[{spec}]", f"out_dir={tmp_path}"])
    report = entry.run(cfg)
    settings = report["settings"]["engine"]
    assert settings["name"].startswith("vLLM 0.32.0")
    assert {n: c["method"] for n, c in settings["speculative_config"].items()} == {
        n: {"head": "eagle3", "draft": "draft_model"}[n] for n in served}
    rows = [r for r in report["results"] if r["drafter"] in served]
    assert {r["drafter"] for r in rows} == set(served) and {r["engine"] for r in rows} == {settings["name"]}
    for r in rows:
        if len(served) > 1 and r["drafter"] == "head":  # against the baseline, the draft LM served before it
            assert r["engine_tau_vs_baseline"] == pytest.approx(r["tau_vs_baseline"], rel=2 * TAU_TOLERANCE)
            assert r["engine_speedup_vs_baseline"] > 0 and len(r["engine_tau_vs_baseline_ci"]) == 2
        assert r["engine_lossless"] is True, r["category"]
        assert r["engine_acceptance_length"] == pytest.approx(r["acceptance_length"], rel=TAU_TOLERANCE), r["category"]
        assert r["engine_speedup"] > 0
        # vLLM's costs: β from the plain server's clock, the ceilings from it, c from the measured speed-up.
        beta, tau = r["engine_verify_overhead"], r["engine_acceptance_length"]
        assert r["engine_ceiling"] == pytest.approx((K + 1) / (1 + beta))
        assert r["engine_tau_ceiling"] == pytest.approx(tau / (1 + beta))
        assert r["engine_mean_proposed"] == K
        pays_off_at = report["settings"].get("pays_off_at", EvalPlan.pays_off_at)
        assert r["engine_tau_to_pay"] == pytest.approx(pays_off_at * tau / r["engine_speedup"])
    assert settings["step_costs"]["cached_prefix"] >= 128 and set(settings["step_costs"]["forward_ms"]) == {1, K + 1}
    longest = max(len(p) for ps in asked["prompts"].values() for p in ps)
    assert sizes == [(vllm.max_model_len(longest, NEW_TOKENS, K), 1)] * (1 + len(served))
    markdown = (tmp_path / "report.md").read_text()
    assert "## In vLLM 0.32.0" in markdown and "vLLM's costs, at B = 1" in markdown
    assert "synthetic acceptance" not in markdown.split("## In vLLM 0.32.0")[1]  # llama.cpp's legend is llama.cpp's
    logs = sorted(p.name for p in (tmp_path / "engine").glob("vllm-*.log"))
    assert logs == sorted([*(f"vllm-{name}.log" for name in served), "vllm-plain.log"])
    # Every server ended with the run, each with its whole process group (its engine core and workers).
    assert len(groups) == 1 + len(served)
    for group in groups:
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)


def test_features_from_vllm_are_pytorchs(world, tmp_path, monkeypatch):
    """The hidden states a vLLM server computes (extract_hidden_states, its connector on a CPU) written into
    draftsmith's feature cache equal PyTorch's within 1e-4 relative in float32, the last layer's after the final
    norm, record by record, with each record's token ids checked; the cache records the engine. The server takes
    the longest record and its one token, not the model's whole context."""
    examples = [Example(f"r{i}", "c", p + a, [0] * len(p) + [1] * len(a))
                for i, (p, a) in enumerate(zip(world["prompts"], world["greedy"]))]
    lengths, enter = [], vllm.VllmServer.__enter__
    monkeypatch.setattr(vllm.VllmServer, "__enter__", lambda server: lengths.append(server.max_model_len) or enter(server))
    layers = [1, 2, 4]  # an EAGLE-3 head's inputs and the last layer, whose state gives the labels
    ours = ShardReader(write_shards(examples, world["target"], layers, tmp_path / "torch", dtype="float32",
                                    shard_tokens=256).parent)
    theirs = ShardReader(write_shards_from_vllm(examples, world["target"], world["dir"], layers, tmp_path / "vllm",
                                                dtype="float32", batch_size=4, shard_tokens=256).parent)
    assert len(theirs) == len(ours) == len(examples) and theirs.meta["engine"] == f"vllm {vllm.VERSION}"
    assert lengths == [max(len(e.input_ids) for e in examples) + 1]
    for i in range(len(examples)):
        a, b = theirs[i]["hidden"], ours[i]["hidden"]
        assert theirs[i]["input_ids"].tolist() == examples[i].input_ids
        for j, layer in enumerate(layers):
            error = float((a[:, j] - b[:, j]).norm() / b[:, j].norm())
            assert error <= 1e-4, (i, layer, error)


def test_features_from_a_target_sharded_over_two_vllm_workers_are_pytorchs(world, tmp_path):
    """Tensor parallelism, as a target beyond one GPU is served: vLLM shards the target over two workers (on a CPU two
    processes, a core each) and the features its first rank writes are still PyTorch's within 1e-4 relative."""
    examples = [Example(f"r{i}", "c", p + a, [0] * len(p) + [1] * len(a))
                for i, (p, a) in enumerate(zip(world["prompts"][:4], world["greedy"][:4]))]
    layers = [1, 2, 4]
    ours = ShardReader(write_shards(examples, world["target"], layers, tmp_path / "torch", dtype="float32").parent)
    theirs = ShardReader(write_shards_from_vllm(examples, world["target"], world["dir"], layers, tmp_path / "vllm",
                                                dtype="float32", batch_size=2, tensor_parallel_size=2).parent)
    log = (tmp_path / "vllm.vllm.log").read_text()
    assert "tensor_parallel_size=2" in log and "world_size=2" in log
    for i in range(len(examples)):
        for j, layer in enumerate(layers):
            a, b = theirs[i]["hidden"][:, j], ours[i]["hidden"][:, j]
            assert float((a - b).norm() / b.norm()) <= 1e-4, (i, layer)


def test_the_hidden_states_connector_is_vllms_own_on_an_accelerator_and_draftsmiths_on_a_cpu(monkeypatch, tmp_path):
    """vLLM's own connector copies through a CUDA stream into pinned memory, which a CPU build refuses: the server
    takes it where vLLM's torch has an accelerator, draftsmith's CPU connector (its plugin module) where it has none
    (this machine's), and shards the target with its workers as processes."""
    assert vllm.accelerator() is torch.cuda.is_available()  # vLLM's environment sees this machine's devices

    def transfer(server) -> dict:
        cmd = server.command(8000)
        return json.loads(cmd[cmd.index("--kv-transfer-config") + 1])

    for seen, expected in ((True, {"kv_connector": "ExampleHiddenStatesConnector"}),
                           (False, {"kv_connector": "CpuHiddenStatesConnector",
                                    "kv_connector_module_path": vllm.CONNECTOR})):
        monkeypatch.setattr(vllm, "accelerator", lambda seen=seen: seen)
        config = transfer(vllm.VllmServer("m", features=([1, 2], tmp_path)))
        assert {k: config[k] for k in config if k.startswith("kv_connector") and k != "kv_connector_extra_config"} \
            == expected
        assert config["kv_connector_extra_config"] == {"shared_storage_path": str(tmp_path)}
    server = vllm.VllmServer("m", features=([1, 2], tmp_path), tensor_parallel_size=2, connector="stock")
    cmd = server.command(8000)
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2" and "--distributed-executor-backend" in cmd
    assert server.environment()["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1  # a core range for each worker
    with pytest.raises(ValueError, match="connector must be one of"):
        vllm.VllmServer("m", connector="gpu")


def test_speculators_files_that_vllm_wrote_read_into_pytorchs_feature_cache(world, tmp_path):
    """A folder as speculators' data generation leaves it: each request's file from vLLM's connector moved to
    hs_{i}.safetensors (speculators' own FileTransfer reads each back), read by drafter.hidden_states=files into a cache
    equal to PyTorch's within 1e-4 relative in float32, the last layer's after the final norm."""
    import shutil
    import sys

    sys.path.append(str(Path(vllm.ROOT) / ".venv" / "speculators"))
    from hs_connectors import FileTransfer

    examples = [Example(f"r{i}", "c", p + a, [0] * len(p) + [1] * len(a))
                for i, (p, a) in enumerate(zip(world["prompts"], world["greedy"]))]
    layers = [1, 2, 4]
    folder = tmp_path / "hidden_states"
    folder.mkdir()
    with vllm.VllmServer(world["dir"], features=(layers, tmp_path / "staging")) as server:
        for i, e in enumerate(examples):
            shutil.move(server.hidden_states_file(list(e.input_ids)), folder / f"hs_{i}.safetensors")
    for i, e in enumerate(examples):
        assert FileTransfer(folder).get_cached(i)["token_ids"].tolist() == e.input_ids
    ours = ShardReader(write_shards(examples, world["target"], layers, tmp_path / "torch", dtype="float32").parent)
    theirs = ShardReader(write_shards_from_files(examples, world["target"], folder, layers, tmp_path / "files",
                                                 dtype="float32").parent)
    for i in range(len(examples)):
        for j, layer in enumerate(layers):
            a, b = theirs[i]["hidden"][:, j], ours[i]["hidden"][:, j]
            assert float((a - b).norm() / b.norm()) <= 1e-4, (i, layer)


def test_a_head_trained_on_vllms_features_keeps_what_one_trained_on_pytorchs_keeps(shared_dir):
    """drafter.hidden_states=vllm: the recipe has vLLM compute the feature cache, the target sharded over two workers
    (drafter.hidden_states_tensor_parallel=2, as a target beyond one GPU is); the head trained on it reaches the
    held-out τ of the same recipe on PyTorch's cache (float32 caches, so the two differ by vLLM's numerics only)."""
    common = ("drafter.offline_dtype=float32", "trainer.max_steps=60", "trainer.eval_every=30")
    sharded = {"offline": (), "vllm": ("drafter.hidden_states_tensor_parallel=2",)}
    runs = {source: eagle_run(shared_dir, f"eagle_features_{source}", f"drafter.hidden_states={source}", *common,
                              *sharded[source]) for source in ("offline", "vllm")}
    log = min((runs["vllm"].parent / "data").glob("hidden-vllm-*.vllm.log"), key=lambda p: p.stat().st_mtime).read_text()
    assert "tensor_parallel_size=2" in log and "world_size=2" in log  # the recipe's key reached the server
    best = {source: json.loads((run / "best" / "best.json").read_text()) for source, run in runs.items()}
    assert best["vllm"]["tau_greedy"] > 1.5
    assert best["vllm"]["tau_greedy"] == pytest.approx(best["offline"]["tau_greedy"], rel=0.02), best
    # A target beyond one device: the same head on the target's ends alone (drafter.target_weights=ends), the answers
    # and training features those of the run above (its data cache), the held-out records' features from vLLM too.
    ends = eagle_run(shared_dir, "eagle_features_vllm_ends", "drafter.hidden_states=vllm", *common,
                     *sharded["vllm"], "drafter.target_weights=ends", f"data_cache={runs['vllm'].parent / 'data'}")
    caches = sorted((runs["vllm"].parent / "data").glob("hidden-vllm-*/manifest.json"))
    assert len(caches) == 2 and len(list((runs["vllm"].parent / "data").glob("hidden-vllm-*.vllm.log"))) == 2
    steps = {name: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
             for name, run in (("all", runs["vllm"]), ("ends", ends))}
    assert [r["loss"] for r in steps["ends"]] == pytest.approx([r["loss"] for r in steps["all"]], rel=1e-6)
    ends_best = json.loads((ends / "best" / "best.json").read_text())
    assert ends_best["tau_greedy"] == pytest.approx(best["vllm"]["tau_greedy"], rel=0.01), (ends_best, best)
