"""scripts/bench_peers.py: draftsmith's, SpecForge's and speculators' trainers on the same records of the tiny world,
each peer reading what draftsmith trained on, every head measured by draftsmith's held-out replay."""

import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

from traffic import toyworld
from train.hidden_states import ShardReader

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv"


@pytest.fixture(scope="module")
def bench(tiny_world, tmp_path_factory):
    """Three steps of every trainer, two seeds, the ladder's ends and the control, on tiny_deep's company traffic, in
    windows of 128 tokens (the rungs between are test_the_ladder_adds_one_group_at_a_time_the_learning_rate_first)."""
    world = toyworld.build("tiny_deep")
    out = tmp_path_factory.mktemp("peers")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_peers.py"), "--data",
                           str(world / "company_logs" / "train.jsonl"), "--steps", "3", "--heldout", "6", "--seeds",
                           "2", "--curve", "3", "--threads", "1", "--settings", "defaults,matched,target-head", "--out",
                           str(out), "--overrides", "experiment=smoke", "target=tiny_deep",
                           "trainer.max_length=128"],  # shorter than some records: features of their first 128 tokens
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads((out / "peers.json").read_text()), done.stdout


def test_every_trainer_and_setting_writes_a_row_measured_on_the_same_held_out_records(bench):
    out, report, stdout = bench
    rows = report["rows"]
    runs = [(r["trainer"], r["settings"], r["seed"]) for r in rows]
    assert runs == [("draftsmith", "recipe", 0), ("draftsmith", "recipe", 1),
                    *((p, s, seed) for p in ("specforge", "speculators") for s in ("defaults", "matched")
                      + (("target-head",) if p == "specforge" else ()) for seed in (0, 1))]
    held = datasets.load_from_disk(str(next((out / "data").glob("*-eval-*")) / "tokenized"))
    for r in rows:
        assert r["steps"] == 3 and r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["train_s"] > 0
        assert 1.0 <= r["heldout_tau"] <= 5.0 and set(r["heldout_tau_by_category"]) == set(held["category"]), r
        assert Path(r["head"], "config.json").exists()
        # every head by the one referee, on the same records in the same order
        assert [c for c, _, _ in r["rounds"]] == held["category"]
        tokens, rounds = (sum(x[i] for x in r["rounds"]) for i in (1, 2))
        assert abs(tokens / rounds - r["heldout_tau"]) < 1e-3
        # the time to τ: a head saved at each curve step, each measured by the referee, the last the final head
        steps, seconds, taus = zip(*r["curve"])
        assert list(steps) == [1, 2, 3] and list(seconds) == sorted(seconds) and 0 < seconds[0]
        assert abs(seconds[-1] - r["train_s"]) < 0.05 and taus[-1] == r["heldout_tau"]
        assert r["time_to_tau_s"] == next(t for t, x in zip(seconds, taus) if x >= 0.95 * taus[-1])
        assert all(1.0 <= x <= 5.0 for x in taus)
    # The referee's replay of draftsmith's head is the number its own run logged at its last step.
    metrics = [json.loads(line) for line in (out / "draftsmith-recipe-s0" / "metrics.jsonl").read_text().splitlines()]
    assert round(metrics[-1]["heldout_tau_greedy"], 4) == rows[0]["heldout_tau"]
    # Seeds train different heads; a peer's own depth is replayed too where it is not the recipe's (speculators: 3).
    assert rows[0]["head"] != rows[1]["head"]
    depths = {(r["trainer"], r["settings"]): r["depth"] for r in rows}
    assert depths[("speculators", "defaults")] == 3 and depths[("specforge", "defaults")] == 7
    assert depths[("speculators", "matched")] == depths[("draftsmith", "recipe")] == 4
    for r in rows:
        assert (r["tau_at_depth"] is None) == (r["depth"] == 4)
    # The control starts SpecForge's output head from the target's rows.
    settings = {(r["trainer"], r["settings"]): r["notes"]["settings"] for r in rows if r["trainer"] != "draftsmith"}
    assert settings[("specforge", "defaults")] == {} and settings[("specforge", "target-head")]["target_head"]
    assert (out / "specforge-target-head-s0" / "warm_start" / "config.json").exists()
    # Each peer's export is its own format, read by draftsmith as it is.
    formats = {r["trainer"]: json.loads(Path(r["head"], "config.json").read_text())["architectures"] for r in rows[2:]}
    assert formats == {"specforge": ["LlamaForCausalLMEagle3"], "speculators": ["Eagle3Speculator"]}
    defaults = json.loads(Path(next(r for r in rows if r["settings"] == "defaults" and r["trainer"] == "speculators")
                               ["head"], "config.json").read_text())
    assert defaults["norm_before_residual"] and defaults["norm_output"]  # EAGLE-3.1's
    # SpecForge's draft trains with the target's RoPE, not the default base its config copy falls back to.
    draft = json.loads((out / "specforge-matched-s0" / "draft_config.json").read_text())
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(toyworld.resolve("toyworld://tiny_deep/target"))
    assert draft["rope_parameters"]["rope_theta"] == target.rope_parameters["rope_theta"]
    # SpecForge's tokens are counted step by step, not estimated.
    counted = [int(x) for x in (out / "specforge-matched-s0" / "tokens.txt").read_text().split()]
    assert next(r for r in rows if r["trainer"] == "specforge")["tokens"] > 0 and len(counted) >= 3
    # The summary pools the seeds, with an interval, and says win, tie or loss for draftsmith per category.
    summary = {(s["trainer"], s["settings"]): s for s in report["summary"]}
    assert set(summary) == {(r["trainer"], r["settings"]) for r in rows}
    ours = summary[("draftsmith", "recipe")]
    assert ours["tau_by_seed"] == [rows[0]["heldout_tau"], rows[1]["heldout_tau"]] and len(ours["interval"]) == 2
    assert ours["interval"][0] <= ours["tau"] <= ours["interval"][1]
    for key, s in summary.items():
        assert set(s["by_category"]) == set(held["category"])
        if key[0] != "draftsmith":
            assert s["draftsmith"] in ("win", "tie", "loss")
            assert all(f["tau"] is None or f["draftsmith"] in ("win", "tie", "loss") for f in s["by_category"].values())
    text = (out / "peers.md").read_text()
    assert "| speculators | defaults | 1 | 3 |" in text and "peers.md" in stdout
    # every trainer's earlier heads are its own: draftsmith's checkpoint, SpecForge's and speculators' exports
    for run, name in (("draftsmith-recipe-s0", "curve/step-000001"), ("specforge-matched-s0", "export-step1"),
                      ("speculators-matched-s0", "export-step2")):
        assert (out / run / name / "config.json").exists(), (run, name)
    assert (out / "speculators-matched-s0" / "checkpoints" / "step1").is_dir()
    # --summarize gives the same summary from the rows alone, nothing trained or measured again
    copy = out / "again" / "peers.json"
    copy.parent.mkdir()
    copy.write_text((out / "peers.json").read_text())
    again = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_peers.py"), "--summarize", str(copy)],
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(copy.read_text())["summary"] == report["summary"]
    assert (copy.parent / "peers.md").read_text() == text


def test_the_interval_holds_the_seeds_spread_as_well_as_the_records():
    """A trainer whose seeds disagree gets a wider interval than one whose seeds agree on the same records; a
    trainer against itself is a tie at 1; one that keeps more on every record of every seed wins."""
    sys.path.insert(1, str(ROOT / "scripts"))
    import bench_peers
    import numpy as np

    rng = np.random.default_rng(0)
    strata = ["a"] * 20 + ["b"] * 20
    rounds = rng.integers(10, 30, size=(3, 40)).astype(float)
    steady = rounds * 3.0 + rng.normal(0, 1, size=(3, 40))
    apart = steady * np.array([[0.8], [1.0], [1.2]])  # the same records, seeds that disagree
    _, narrow = bench_peers.bootstrap((steady, rounds), strata)
    _, wide = bench_peers.bootstrap((apart, rounds), strata)
    assert wide[1] - wide[0] > 3 * (narrow[1] - narrow[0])
    ratio, (low, high) = bench_peers.bootstrap((steady, rounds), strata, (steady, rounds))
    assert ratio == 1.0 and low <= 1 <= high
    ratio, (low, high) = bench_peers.bootstrap((steady, rounds), strata, (steady * 1.1, rounds))
    assert abs(ratio - 1.1) < 1e-9 and low > 1


def test_the_ladder_adds_one_group_at_a_time_the_learning_rate_first():
    sys.path.insert(1, str(ROOT / "scripts"))
    import bench_peers
    from peers import LADDER

    from train.__main__ import train  # noqa: F401  (registers the configs bench_peers composes)

    cfg = bench_peers.compose_cfg(["experiment=smollm2_eagle"])
    for name in ("specforge", "speculators"):
        rungs = [bench_peers.peer_settings(name, rung, cfg, "bfloat16") for rung in LADDER]
        assert rungs[0] == {} and rungs[-1] == bench_peers.PEERS[name].matched(cfg, "bfloat16")
        for before, after in zip(rungs, rungs[1:]):  # each rung keeps the one before and adds to it
            assert before.items() <= after.items() and len(after) > len(before)
    assert bench_peers.peer_settings("specforge", "+lr", cfg, "bfloat16") == {"lr": cfg.trainer.lr}
    assert bench_peers.peer_settings("speculators", "+lr", cfg, "bfloat16") == {
        "optimizer": "adamw", "lr": cfg.trainer.lr, "weight_decay": cfg.trainer.weight_decay}
    # speculators learns from the target's argmax where the recipe does (the SmolLM2 recipe's label_temperature 0)
    assert bench_peers.peer_settings("speculators", "matched", cfg, "bfloat16")["loss_fn"] == "ce"
    assert bench_peers.peer_settings("specforge", "target-head", cfg, "bfloat16")["target_head"]


def _draftsmith_data(out: Path):
    """The tokenized training records, their features, and records to compare: the first and last with an assistant
    token in the window, and the first the window cuts."""
    rows = datasets.load_from_disk(str(next((out / "data").glob("*-train-*")) / "tokenized"))
    trained = [i for i, r in enumerate(rows) if any(r["loss_mask"][:128])]
    cut = [i for i in trained if len(rows[i]["input_ids"]) > 128]
    assert cut  # the windows cut records the peers must read as draftsmith does
    return rows, ShardReader(next((out / "data").glob("hidden-*"))), [trained[0], cut[0], trained[-1]]


def test_specforge_reads_the_features_and_predictions_draftsmith_trained_on(bench):
    """SpecForge's own offline reader on the converted files: the same tokens and features, and its loss mask on
    exactly the entries draftsmith's loss reads (entry t predicts token t + 2 in SpecForge's offline step)."""
    out, _, _ = bench
    sys.path.append(str(VENV / "specforge"))
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import list_feature_files

    rows, shards, chosen = _draftsmith_data(out)
    files = list_feature_files(str(next(out.glob("features-specforge-*"))))
    assert len(files) == len(rows)
    for i in chosen:
        sample = normalize_offline_sample(load_feature_file(files[i]), 10_000)
        hidden = shards[i]["hidden"]  # the first trainer.max_length tokens of the record: what draftsmith trains on
        ids = torch.tensor(rows[i]["input_ids"][: hidden.shape[0]])
        assert torch.equal(sample["input_ids"][0], ids)
        torch.testing.assert_close(sample["hidden_state"][0], hidden[:, :3].flatten(1).to(sample["hidden_state"]))
        torch.testing.assert_close(sample["target"][0], hidden[:, 3].to(sample["target"]))
        trained = torch.tensor(rows[i]["loss_mask"][: hidden.shape[0]]).bool()
        assert torch.equal(sample["loss_mask"][0, :-2].bool(), trained[2:])
        assert trained[2:].any()


def test_speculators_reads_the_features_and_predictions_draftsmith_trained_on(bench):
    """speculators' own dataset on the converted directory: the same tokens and auxiliary features, a last state its
    final norm maps to draftsmith's cached one, and its loss mask where draftsmith's predictions are (its position t
    trains the distribution predicting token t + 1)."""
    out, _, _ = bench
    sys.path.append(str(VENV / "speculators"))
    from speculators.train.data import ArrowDataset

    from eval.run import load_target

    rows, shards, chosen = _draftsmith_data(out)
    data = ArrowDataset(10_000, str(out / "features-speculators"), on_missing="raise", hidden_states_dtype=torch.float32)
    target, _ = load_target("toyworld://tiny_deep/target", device=torch.device("cpu"))
    for i in chosen:
        item, hidden = data._get_raw_data(i), shards[i]["hidden"]
        assert torch.equal(item["input_ids"], torch.tensor(rows[i]["input_ids"][: hidden.shape[0]]))
        torch.testing.assert_close(item["hidden_states"].float(), hidden[:, :3].flatten(1).float())
        with torch.no_grad():
            post = target.model.norm(item["verifier_last_hidden_states"].float())
        torch.testing.assert_close(post, hidden[:, 3].float(), atol=2e-2, rtol=1e-2)  # fp16 features
        trained = torch.tensor(rows[i]["loss_mask"][: hidden.shape[0]]).bool()
        assert torch.equal(item["loss_mask"][:-1].bool(), trained[1:]) and not item["loss_mask"][-1]


def test_time_to_tau_is_the_first_saved_step_within_95_percent_of_the_final_one():
    sys.path.insert(1, str(ROOT / "scripts"))
    import bench_peers

    curve = [[20, 10.0, 1.10], [40, 20.0, 1.27], [60, 30.0, 1.20], [80, 40.0, 1.33]]
    assert bench_peers.time_to_tau(curve) == 20.0  # 1.27 >= 0.95 × 1.33
    assert bench_peers.time_to_tau(curve[-1:]) is None  # --curve 1: the final step alone says nothing
    assert bench_peers.curve_steps(100, 5) == [20, 40, 60, 80, 100] and bench_peers.curve_steps(3, 5) == [1, 2, 3]
