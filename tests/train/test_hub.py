"""Uploading an export to the Hub with its model card, through the real huggingface_hub client against a
stand-in Hub on 127.0.0.1 (tests/fake_hub.py)."""

import json
import logging
from pathlib import Path

import huggingface_hub.constants
import pytest

from eval.engines import llama_cpp
from fake_hub import FakeHub
from helpers import train_tiny_deep
from train.export import ExportSettings, export
from train.hub import HubSettings

TOKEN = "hf_test_token_never_printed"


@pytest.fixture(scope="module")
def evaluated_run(tiny_world, tmp_path_factory):
    """A head trained a few steps with the final evaluation on: its report.json feeds the model card."""
    return train_tiny_deep(tmp_path_factory.mktemp("runs") / "eagle", "drafter=eagle", "trainer.max_steps=4",
                           "drafter.draft_vocab_size=120", "evaluate.enabled=true", "evaluate.ks=[2]",
                           "evaluate.max_new_tokens=8", "evaluate.repeats=1", "evaluate.prompts_per_category=1")


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The stand-in Hub, as the one huggingface_hub talks to, with the user's token in HF_TOKEN."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # tests/conftest.py turns it on
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no stored login of the machine's
    with FakeHub(token=TOKEN) as server:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.url)  # read once at import
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        yield server


def settings(**hub) -> ExportSettings:
    return ExportSettings(formats=["sglang", "speculators", "gguf"] if hub.pop("gguf", False) else
                          ["sglang", "speculators"], force=True, hub=HubSettings(**hub))


def test_every_file_arrives_byte_identical_and_the_token_is_never_shown(evaluated_run, hub, tmp_path, capsys,
                                                                         caplog):
    with caplog.at_level(logging.DEBUG):
        written = export(evaluated_run, tmp_path / "out", settings(repo_id="acme/eagle3", license="apache-2.0",
                                                                    commit_message="first drafter"))
    repo = hub.repos["acme/eagle3"]
    assert repo["private"] is True and repo["commits"][0]["message"] == "first drafter"
    staged = {str(p.relative_to(written["hub"])): p.read_bytes() for p in written["hub"].rglob("*") if p.is_file()}
    assert repo["revisions"]["main"] == staged
    assert {"README.md", "config.json", "model.safetensors", "speculators/config.json",
            "speculators/model.safetensors"} <= set(staged)
    assert staged["model.safetensors"] == (written["sglang"] / "model.safetensors").read_bytes()
    out = capsys.readouterr()
    assert TOKEN not in out.out + out.err + caplog.text
    assert written["hub_commit"] in out.out


def test_the_model_card_states_what_was_measured(evaluated_run, hub, tmp_path):
    written = export(evaluated_run, tmp_path / "out", settings(repo_id="acme/eagle3", license="apache-2.0",
                                                                dry_run=True))
    card = (written["hub"] / "README.md").read_text()
    meta = card.split("---")[1]
    for line in ["base_model: toyworld://tiny_deep/target", "- speculative-decoding", "- eagle3", "- draftsmith",
                 "license: apache-2.0", "library_name:"]:
        assert line in meta
    report = json.loads((evaluated_run / "report.json").read_text())
    trained = report["settings"]["trained_on"]
    assert f"{trained['records']} conversations" in card
    assert all(f"{c} {n}" in card for c, n in trained["categories"].items())
    for row in report["results"]:  # every measured tau and speed-up, per category
        assert f"| {row['category']} | {row['drafter']} | {row['k']} | {row['acceptance_length']:.2f} | " \
               f"{row['speedup']:.2f}× |" in card
    assert (report["hardware"]["gpu"] or report["hardware"]["cpu"]) in card  # the processor that ran the loop
    assert "draft vocabulary: held-out assistant tokens covered" in card
    assert "--speculative-algorithm EAGLE3 --speculative-draft-model-path acme/eagle3" in card
    assert '"method": "eagle3", "model": "acme/eagle3"' in card
    records = [json.loads(line) for line in
               Path(evaluated_run.parent, "data").glob("*-train-*/regenerated.jsonl").__next__().open()]
    assert not any(m["content"] in card for r in records[:20] for m in r["messages"] if len(m["content"]) > 20)


def test_a_dry_run_lists_and_sends_nothing(evaluated_run, hub, tmp_path, capsys):
    export(evaluated_run, tmp_path / "out", settings(repo_id="acme/eagle3", dry_run=True))
    printed = capsys.readouterr().out
    assert "dry run: would upload to acme/eagle3 (private)" in printed and "speculators/model.safetensors" in printed
    assert hub.requests == []


def test_a_branch_gets_the_commit(evaluated_run, hub, tmp_path):
    export(evaluated_run, tmp_path / "out", settings(repo_id="acme/eagle3", revision="v2", private=False))
    assert set(hub.repos["acme/eagle3"]["revisions"]) >= {"v2"} and hub.repos["acme/eagle3"]["private"] is False


def test_no_token_and_a_refused_upload_are_clear_errors(evaluated_run, hub, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(ValueError, match="no Hugging Face token: set HF_TOKEN"):
        export(evaluated_run, tmp_path / "a", settings(repo_id="acme/eagle3"))
    assert hub.requests == []
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.reject_commits = True
    with pytest.raises(ValueError, match=r"the Hub refused the upload to acme/eagle3 \(HTTP 403\)") as e:
        export(evaluated_run, tmp_path / "b", settings(repo_id="acme/eagle3"))
    assert TOKEN not in str(e.value)


@pytest.mark.skipif(not llama_cpp.available(), reason=(  # its converter writes the GGUF
    f"llama.cpp is not built at {llama_cpp.home()}: `make llama-cpp` (make test builds it)"))
def test_a_draft_lm_card_serves_it_as_a_draft_model(draft_run, hub, tmp_path):
    written = export(draft_run, tmp_path / "out", ExportSettings(formats=["hf", "gguf"], num_speculative_tokens=6,
                                                                 hub=HubSettings(repo_id="acme/draft", dry_run=True)))
    card = (written["hub"] / "README.md").read_text()
    assert "- draft-model" in card and "(the run has no final evaluation report" in card
    assert '"method": "draft_model", "model": "acme/draft", "num_speculative_tokens": 6' in card
    assert "--speculative-algorithm STANDALONE" in card and "--spec-type draft-simple --spec-draft-n-max 6" in card
    assert (written["hub"] / "config.json").exists() and (written["hub"] / "gguf" / "draft.gguf").exists()


def test_an_eagle1_card_serves_it_with_vllm_only(eagle1_run, hub, tmp_path):
    written = export(eagle1_run, tmp_path / "out", ExportSettings(formats=["vllm"], num_speculative_tokens=3,
                                                                  hub=HubSettings(repo_id="acme/eagle1", dry_run=True)))
    card = (written["hub"] / "README.md").read_text()
    assert "- eagle\n" in card and "library_name: vllm" in card and "An EAGLE-1 draft head" in card
    assert '"method": "eagle", "model": "acme/eagle1", "num_speculative_tokens": 3' in card
    assert "sglang" not in card and "llama-server" not in card and "GGUF" not in card
    assert json.loads((written["hub"] / "config.json").read_text())["architectures"] == ["EagleLlamaForCausalLM"]


def test_a_dflash_card_serves_it_with_vllm_and_llama_cpp(dflash_run, hub, tmp_path):
    written = export(dflash_run, tmp_path / "out", ExportSettings(formats=["dflash", "gguf"], num_speculative_tokens=4,
                                                                  hub=HubSettings(repo_id="acme/dflash", dry_run=True)))
    card = (written["hub"] / "README.md").read_text()
    assert "- dflash\n" in card and "A DFlash drafter" in card and "a block of 4 tokens in one forward" in card
    assert '"method": "dflash", "model": "acme/dflash", "num_speculative_tokens": 4' in card
    assert "--spec-type draft-dflash --spec-draft-n-max 4" in card and "sglang" not in card
    config = json.loads((written["hub"] / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and (written["hub"] / "gguf" / "dflash.gguf").exists()


def test_a_peagle_card_serves_it_with_vllms_parallel_drafting(peagle_run, hub, tmp_path):
    """vLLM serves P-EAGLE as eagle3 with parallel_drafting (a local target must ask for it); SGLang and llama.cpp
    have no P-EAGLE, so the card gives neither."""
    written = export(peagle_run, tmp_path / "out", ExportSettings(num_speculative_tokens=4,
                                                                  hub=HubSettings(repo_id="acme/peagle", dry_run=True)))
    card = (written["hub"] / "README.md").read_text()
    assert "- p-eagle\n" in card and "library_name: vllm" in card and "A P-EAGLE draft head" in card
    assert ('"method": "eagle3", "model": "acme/peagle", "num_speculative_tokens": 4, "parallel_drafting": true'
            in card)
    assert "| depths trained (k up to) | 4 |" in card
    assert "sglang" not in card and "llama-server" not in card
    assert json.loads((written["hub"] / "config.json").read_text())["speculators_model_type"] == "peagle"


def test_a_pard_card_serves_it_with_vllms_parallel_draft_model(pard_run, hub, tmp_path):
    written = export(pard_run, tmp_path / "out", ExportSettings(num_speculative_tokens=4,
                                                                hub=HubSettings(repo_id="acme/pard", dry_run=True)))
    card = (written["hub"] / "README.md").read_text()
    assert "- pard\n" in card and "A PARD draft model" in card and "| depths trained (k up to) | 4 |" in card
    assert ('"method": "draft_model", "model": "acme/pard", "num_speculative_tokens": 4, "parallel_drafting": true'
            in card)
    assert "sglang" not in card and "llama-server" not in card
    assert json.loads((written["hub"] / "config.json").read_text())["pard_token"] is not None


def test_the_card_gives_sglang_the_tree_the_evaluation_favours(evaluated_run, hub, tmp_path):
    """A final evaluation whose fastest shape over all traffic was a tree (here written into the report): the card
    adds SGLang's command with that tree's settings, and says on what ground it was chosen."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(evaluated_run, run)
    report = json.loads((run / "report.json").read_text())
    for r in report["results"]:
        r["best_shape"] = "tree d3t4n12" if r["category"] == "all" else "chain k=2"
    (run / "report.json").write_text(json.dumps(report))
    card = (export(run, tmp_path / "out", settings(repo_id="acme/eagle3", dry_run=True))["hub"] / "README.md").read_text()
    assert "# fastest in draftsmith's measurement: a dynamic tree" in card
    assert ("--speculative-draft-model-path acme/eagle3 --speculative-num-steps 3 --speculative-eagle-topk 4 "
            "--speculative-num-draft-tokens 13") in card
    for r in report["results"]:
        r["best_shape"] = "chain k=2"
    (run / "report.json").write_text(json.dumps(report))
    card = (export(run, tmp_path / "out2", settings(repo_id="acme/eagle3", dry_run=True))["hub"] / "README.md").read_text()
    assert "dynamic tree" not in card
