"""`python -m train drafter=eagle|eagle1|mtp|medusa`: the head recipe on the tiny world."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file, save_file

from drafters.registry import build_head
from drafters.sampling import Sampling
from eval.run import build_drafter, load_target
from eval.speculative import autoregressive_generate, speculative_generate
from helpers import engine_states, tiny_llama, trained_to_self, write_engine_files
from train.__main__ import train
from train.heldout import greedy_rounds
from train.export import ExportSettings, export
from train.hidden_states import ShardReader, capture, default_layers

CONF = Path(__file__).resolve().parents[2] / "conf"
KINDS = ["eagle", "eagle1", "mtp", "medusa", "dflash", "peagle"]
# Medusa's residual blocks start at zero (the head = the target's own output head) and the tiny
# target's features say little about tokens further ahead: it needs a larger step to move in 12.
LR = {"eagle": 5e-3, "eagle1": 5e-3, "mtp": 5e-3, "medusa": 3e-2, "dflash": 5e-3, "peagle": 5e-3}


def make_cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def smoke(tmp_path, *overrides, run="run"):
    return make_cfg("experiment=smoke", "progress=false", f"out_dir={tmp_path / run}",
                    f"data_cache={tmp_path / 'data'}", *overrides)


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_greedy_selection_picks_the_best_replayed_tau(tiny_world, tmp_path):
    summary = train(smoke(tmp_path, "drafter=medusa", "trainer.max_steps=9", "trainer.eval_every=3",
                          f"trainer.lr={LR['medusa']}", "evaluate.enabled=false", "trainer.select_by=top1"))
    evals = [r for r in metrics(tmp_path / "run") if "heldout_tau_greedy" in r]
    assert all(1.0 <= r["heldout_tau_greedy"] <= 5.0 for r in evals)
    assert all(r["heldout_tau_greedy_by_category"] and min(r["heldout_tau_greedy_by_category"].values()) >= 1.0
               for r in evals)
    best = max(evals, key=lambda r: r["heldout_tau_greedy"])
    assert summary["best"]["step"] == best["step"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_head_config_composes(kind):
    cfg = make_cfg(f"drafter={kind}")
    assert cfg.drafter.kind == kind and cfg.drafter.hidden_states == "online"


@pytest.mark.parametrize("kind", KINDS)
def test_training_lowers_the_loss_and_saves_a_head_that_reloads(tiny_world, tmp_path, kind):
    summary = train(smoke(tmp_path, f"drafter={kind}", "trainer.max_steps=12", "trainer.eval_every=6",
                          f"trainer.lr={LR[kind]}", "trainer.warmup_steps=1", "evaluate.enabled=false"))
    rows = metrics(tmp_path / "run")
    losses = [r["loss"] for r in rows]
    assert sum(losses[-4:]) < sum(losses[:4])  # batches differ step to step: compare a few of each
    evals = [r for r in rows if "heldout_tokens_per_round" in r]
    assert len(evals) == 2
    assert summary["best"]["tokens_per_round"] == max(r["heldout_tokens_per_round"] for r in evals)
    assert summary["best"]["tokens_per_round_greedy"] in [r["heldout_tokens_per_round_greedy"] for r in evals]
    # The saved head holds its own weights only (the target's embedding and output head are shared)
    # and reloads through the evaluation's drafter spec.
    best = tmp_path / "run" / "best"
    weights = load_file(str(best / "model.safetensors"))
    assert not any("embed" in k or k.startswith("lm_head") for k in weights)
    target, tok = load_target("toyworld://tiny/target", device=torch.device("cpu"))
    drafter = build_drafter({"name": kind, "kind": "head", "path": str(best)}, target=target, tokenizer=tok)
    assert drafter.feature_layers == json.loads((best / "config.json").read_text())["feature_layers"]


def test_bf16_mixed_precision_trains_a_head_like_float32(tiny_world, tmp_path):
    """trainer.precision=bf16 on the CPU (what `auto` picks on one with AVX512-BF16 or AMX): the products run in
    bf16, so the losses differ from float32's by bf16's rounding, and the saved head keeps float32 weights."""
    from accelerate.state import AcceleratorState

    common = ["drafter=eagle", "trainer.max_steps=6", "trainer.eval_every=6", "trainer.lr=3e-3",
              "trainer.warmup_steps=1", "evaluate.enabled=false"]
    train(smoke(tmp_path, *common, run="fp32"))
    AcceleratorState._reset_state(reset_partial_state=True)  # one precision per process, as Accelerate keeps it
    try:
        train(smoke(tmp_path, *common, "trainer.precision=bf16", run="bf16"))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    fp32, bf16 = ([r["loss"] for r in metrics(tmp_path / run)] for run in ("fp32", "bf16"))
    assert fp32 != bf16  # autocast ran
    assert all(abs(a - b) < 0.05 * a for a, b in zip(fp32, bf16)), (fp32, bf16)
    weights = load_file(str(tmp_path / "bf16" / "best" / "model.safetensors"))
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.float32}


def test_end_to_end_eagle_with_a_draft_vocabulary_prints_coverage(tiny_world, tmp_path, capsys):
    summary = train(smoke(tmp_path, "drafter=eagle", "drafter.draft_vocab_size=200"))
    report = json.loads(Path(summary["report"]).read_text())
    assert report["baseline"] == "off_the_shelf"
    assert {r["drafter"] for r in report["results"]} == {"off_the_shelf", "trained_eagle"}
    assert "coverage of held-out assistant tokens per category" in capsys.readouterr().out
    best = json.loads((tmp_path / "run" / "best" / "best.json").read_text())
    assert set(best["vocabulary_coverage"]) == {"code", "json", "prose"}
    assert all(0 < c <= 1 for c in best["vocabulary_coverage"].values())
    # ... and the share of the target's probability the 200 tokens hold, per held-out category.
    assert set(best["vocabulary_probability"]) == {"code", "json", "prose"}
    assert all(0 < m < 1 for m in best["vocabulary_probability"].values())


def test_draft_vocabulary_sized_by_coverage_of_the_training_tokens(tiny_world, tmp_path, capsys):
    import datasets

    from drafters.eagle import draft_vocabulary
    from drafters.registry import load_head

    train(smoke(tmp_path, "drafter=eagle", "drafter.draft_vocab_coverage=0.9", "trainer.max_steps=1",
                "trainer.eval_every=1", "evaluate.enabled=false"))
    target, tok = load_target("toyworld://tiny/target", device=torch.device("cpu"))
    rows_dir = next((tmp_path / "data").glob("tiny-train-*"))
    rows = datasets.load_from_disk(str(rows_dir / "tokenized"))
    counts = torch.zeros(target.config.vocab_size)
    for row in rows:
        counts += torch.bincount(torch.tensor(row["input_ids"])[torch.tensor(row["loss_mask"], dtype=torch.bool)],
                                 minlength=counts.numel()).float()
    head = load_head(tmp_path / "run" / "best", target)
    size = head.d2t.numel()
    assert 1 < size < target.config.vocab_size
    # The saved vocabulary holds at least 90 % of the training traffic's assistant tokens; one token
    # fewer would not.
    assert counts[head.t2d].sum() / counts.sum() >= 0.9
    _, smaller = draft_vocabulary(counts, size - 1, always=[tok.eos_token_id])
    assert counts[smaller].sum() / counts.sum() < 0.9
    with pytest.raises(ValueError, match="draft_vocab_coverage must be in"):
        train(smoke(tmp_path, "drafter=eagle", "drafter.draft_vocab_coverage=1.5", run="bad"))
    # A vocabulary that leaves held-out tokens out: the recipe warns, naming the categories.
    capsys.readouterr()
    train(smoke(tmp_path, "drafter=eagle", "drafter.draft_vocab_size=2", "trainer.max_steps=1",
                "trainer.eval_every=1", "evaluate.enabled=false", run="two"))
    best = json.loads((tmp_path / "two" / "best" / "best.json").read_text())
    short = [c for c, v in best["vocabulary_coverage"].items() if v < 0.99]
    assert short
    warning = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:"))
    assert "draft vocabulary of 2 tokens" in warning
    assert all(f"of held-out {c} tokens" in warning for c in short)
    assert "never in the training answers" not in warning  # the tiny world's held-out tokens all occur in training
    # Held-out answers with tokens the training answers lack: those are named apart (no share of the
    # training traffic's tokens covers them).
    path = tmp_path / "unseen.jsonl"
    answers = ["a a a a b b b b"] * 12 + ["q x z q x z 9 9"] * 8  # the last 8 (trainer.eval_examples) are held out
    path.write_text("".join(json.dumps({"id": str(i), "category": "code" if i % 2 or i >= 12 else "chat", "messages": [
        {"role": "user", "content": "say it"}, {"role": "assistant", "content": a}]}) + "\n"
        for i, a in enumerate(answers)))
    capsys.readouterr()
    train(smoke(tmp_path, "data=jsonl", f"data.path={path}", "data.max_records=null", "regenerate.enabled=false",
                "drafter=eagle", "drafter.draft_vocab_size=2", "trainer.max_steps=1", "trainer.eval_every=1",
                "evaluate.enabled=false", run="unseen"))
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    # ... and the held-out records, all code, choose a checkpoint for chat as well: the recipe says so.
    assert any("the 8 records that choose the best checkpoint" in w and "hold no chat records" in w
               and "trainer.heldout=per_category" in w for w in warnings)
    warning = next(w for w in warnings if "draft vocabulary" in w)
    _, tok = load_target("toyworld://tiny/target", device=torch.device("cpu"))
    seen, held = set(tok("a a a a b b b b")["input_ids"]), tok("q x z q x z 9 9", add_special_tokens=False)["input_ids"]
    assert any(t not in seen for t in held), "the test needs held-out tokens the training answers lack"
    assert "never in the training answers)" in warning and "need traffic that has them" in warning


def test_expected_token_counts_sum_the_targets_distribution_at_assistant_positions(tiny_world):
    from train.eagle3 import expected_token_counts

    target, _ = load_target("toyworld://tiny/target", device=torch.device("cpu"))
    rows = [{"input_ids": [5, 9, 14, 20, 7], "loss_mask": [0, 0, 1, 1, 1], "category": "code"},
            {"input_ids": [3, 8, 11], "loss_mask": [0, 1, 1], "category": "json"},
            {"input_ids": [4, 6, 12, 13], "loss_mask": [0, 0, 0, 1], "category": "code"}]
    got = expected_token_counts(target, rows, batch_size=2, max_length=16, pad_id=0, device=torch.device("cpu"))
    with torch.no_grad():
        def alone(row):  # unpadded, one record at a time: position t predicts token t + 1
            probs = torch.softmax(target(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1].float(), -1)
            return probs[torch.tensor(row["loss_mask"][1:], dtype=torch.bool)]
        code = torch.cat([alone(rows[0]), alone(rows[2])])
        json_ = alone(rows[1])
    assert set(got) == {"code", "json"}
    assert got["code"][1] == 4 and got["json"][1] == 2
    torch.testing.assert_close(got["code"][0], code.sum(0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["json"][0], json_.sum(0), atol=1e-5, rtol=1e-5)
    assert got["code"][0].sum().item() == pytest.approx(4.0, abs=1e-4)


def test_draft_vocabulary_from_the_targets_probabilities(tiny_world, tmp_path, capsys):
    import datasets

    from drafters.eagle import draft_vocabulary
    from drafters.registry import load_head
    from train.eagle3 import expected_token_counts

    train(smoke(tmp_path, "drafter=eagle", "drafter.draft_vocab_size=120", "drafter.draft_vocab_from=target_probabilities",
                "drafter.draft_vocab_examples=10", "trainer.max_steps=1", "trainer.eval_every=1",
                "evaluate.enabled=false"))
    assert "share of the target's probability" in capsys.readouterr().out
    # The saved vocabulary is the top 120 (plus EOS) of the target's expected counts over the first 10
    # training records, which differs from the count-ranked one.
    target, tok = load_target("toyworld://tiny/target", device=torch.device("cpu"))
    rows = datasets.load_from_disk(str(next((tmp_path / "data").glob("tiny-train-*")) / "tokenized"))
    expected = expected_token_counts(target, rows.select(range(10)), batch_size=4, max_length=384, pad_id=0,
                                     device=torch.device("cpu"))
    counts = sum(total for total, _ in expected.values())
    _, t2d = draft_vocabulary(counts, 120, always=[tok.eos_token_id])
    head = load_head(tmp_path / "run" / "best", target)
    assert torch.equal(head.t2d, t2d)
    tokens = torch.zeros(target.config.vocab_size)
    for row in rows:
        tokens += torch.bincount(torch.tensor(row["input_ids"])[torch.tensor(row["loss_mask"], dtype=torch.bool)],
                                 minlength=tokens.numel()).float()
    assert not torch.equal(draft_vocabulary(tokens, 120, always=[tok.eos_token_id])[1], t2d)
    with pytest.raises(ValueError, match="draft_vocab_from must be tokens or target_probabilities"):
        train(smoke(tmp_path, "drafter=eagle", "drafter.draft_vocab_from=probabilities", run="bad"))


def test_offline_hidden_states_train_like_online(tiny_world, tmp_path):
    """Same data order, same init: the step-1 loss from fp32 online features and from fp16 shards agree
    to fp16 precision, and the shards are written once and reused."""
    common = ["drafter=eagle", "trainer.max_steps=2", "evaluate.enabled=false", "drafter.offline_dtype=float32"]
    train(smoke(tmp_path, *common, run="online"))
    train(smoke(tmp_path, *common, "drafter.hidden_states=offline", run="offline"))
    online, offline = metrics(tmp_path / "online"), metrics(tmp_path / "offline")
    assert offline[0]["loss"] == pytest.approx(online[0]["loss"], rel=1e-4)
    shards = list((tmp_path / "data").glob("hidden-*/manifest.json"))
    assert len(shards) == 1
    stamp = shards[0].stat().st_mtime_ns
    train(smoke(tmp_path, *common, "drafter.hidden_states=offline", run="offline2"))
    assert shards[0].stat().st_mtime_ns == stamp  # reused, not recomputed
    # drafter.hidden_states=files: the same features as an engine writes them (the last layer before the final norm),
    # one hs_{i}.safetensors file per record, train as the shards did, from a cache of their own.
    target, _ = load_target("toyworld://tiny/target", device=torch.device("cpu"))
    cached = ShardReader(shards[0].parent)
    folder = tmp_path / "engine" / "hidden_states"
    folder.mkdir(parents=True)
    for i in range(len(cached)):
        ids = cached[i]["input_ids"]
        save_file({"hidden_states": engine_states(target, ids.tolist(), cached.layers), "token_ids": ids},
                  folder / f"hs_{i}.safetensors")
    train(smoke(tmp_path, *common, "drafter.hidden_states=files", f"drafter.hidden_states_dir={folder}", run="files"))
    assert metrics(tmp_path / "files")[0]["loss"] == pytest.approx(offline[0]["loss"], rel=1e-5)
    assert len(list((tmp_path / "data").glob("hidden-files-*/manifest.json"))) == 1


def test_a_head_trains_on_its_targets_ends_alone_as_on_the_whole_target(tiny_world, tmp_path, caplog):
    """drafter.target_weights=ends: the target's decoder layers are never loaded. The features of the training and
    the held-out records come from an engine's files; the steps, the held-out figures, the draft vocabulary's
    probability mass and the export are those of a run that loaded the whole target on the same files."""
    common = ["target=tiny_deep", "drafter=eagle", "trainer.max_steps=2", "trainer.eval_every=2",
              "evaluate.enabled=false", "regenerate.enabled=false", "data.on_bad_record=skip", "drafter.offline_dtype=float32",
              "drafter.draft_vocab_size=200"]
    train(smoke(tmp_path, *common, "drafter.hidden_states=offline", run="offline"))
    # The engine's files, one a record, the training and the held-out records alike.
    target, _ = load_target("toyworld://tiny_deep/target", device=torch.device("cpu"))
    folder = write_engine_files(target, tmp_path / "data", tmp_path / "engine" / "hidden_states")
    files = ["drafter.hidden_states=files", f"drafter.hidden_states_dir={folder}"]
    train(smoke(tmp_path, *common, *files, run="all"))
    with caplog.at_level("INFO", logger="eval.run"):
        train(smoke(tmp_path, *common, *files, "drafter.target_weights=ends", run="ends"))
    assert "embedding, final norm and output head only" in caplog.text and "its 4 decoder layers left out" in caplog.text
    assert len(list((tmp_path / "data").glob("hidden-files-*/manifest.json"))) == 2  # the held-out records' too
    whole, ends = metrics(tmp_path / "all"), metrics(tmp_path / "ends")
    assert [r["loss"] for r in ends] == pytest.approx([r["loss"] for r in whole], rel=1e-6)
    # Held out: the whole target's own features against the engine's float32 files.
    assert ends[-1]["heldout_acceptance"] == pytest.approx(whole[-1]["heldout_acceptance"], rel=1e-4)
    best = [json.loads((tmp_path / run / "best" / "best.json").read_text()) for run in ("all", "ends")]
    assert best[1]["vocabulary_probability"] == pytest.approx(best[0]["vocabulary_probability"], abs=1e-4)
    assert best[1]["vocabulary_coverage"] == best[0]["vocabulary_coverage"]
    exported = [export(tmp_path / run, tmp_path / run / "out", ExportSettings(formats=["speculators"], force=True))[
                    "speculators"]
                for run in ("all", "ends")]
    a, b = (load_file(str(next(Path(path).glob("*.safetensors")))) for path in exported)
    assert a.keys() == b.keys() and "embed_tokens.weight" in a and all(torch.equal(a[k], b[k]) for k in a)


def test_a_head_on_its_targets_ends_refuses_what_would_run_the_target(tiny_world, tmp_path):
    ends = ["drafter=eagle", "drafter.target_weights=ends", "evaluate.enabled=false", "regenerate.enabled=false",
            "drafter.hidden_states=files", f"drafter.hidden_states_dir={tmp_path}"]
    with pytest.raises(ValueError, match="drafter.target_weights must be one of \\['all', 'ends'\\], got 'half'"):
        train(smoke(tmp_path, "drafter=eagle", "drafter.target_weights=half"))
    with pytest.raises(ValueError, match="held-out records' too, must come from an engine .* not offline"):
        train(smoke(tmp_path, *ends, "drafter.hidden_states=offline", "drafter.hidden_states_dir=null"))
    with pytest.raises(RuntimeError, match="layer 0 was not loaded: .* regenerate.engine=llamacpp or regenerate.endpoint"):
        train(smoke(tmp_path, *ends, "regenerate.enabled=true"))  # answers the target would write in PyTorch
    with pytest.raises(ValueError, match="set evaluate.enabled=false and measure the export in the engine"):
        train(smoke(tmp_path, *ends, "evaluate.enabled=true"))
    with pytest.raises(ValueError, match="draft_vocab_from=target_probabilities runs the target"):
        train(smoke(tmp_path, *ends, "drafter.draft_vocab_from=target_probabilities"))


@pytest.mark.parametrize("grouped", [False, True], ids=["permuted", "grouped_by_length"])
def test_resume_continues_exactly(tiny_world, tmp_path, grouped):
    steps = ["drafter=mtp", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=10", "evaluate.enabled=false",
             f"trainer.group_by_length={grouped}"]
    train(smoke(tmp_path, *steps, "trainer.max_steps=4", run="full"))
    # A run that stopped after step 2: only the step-2 checkpoint of the same run exists.
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step-000002", tmp_path / "part" / "checkpoints" / "step-000002")
    # It had logged step 3 (marked, to tell it from the resumed run's) and died writing step 4's line.
    full_lines = (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    stale = {**json.loads(full_lines[2]), "loss": -1.0}
    (tmp_path / "part" / "metrics.jsonl").write_text("\n".join(full_lines[:2] + [json.dumps(stale), '{"step": 4, "lo']))
    summary = train(smoke(tmp_path, *steps, "trainer.max_steps=4", "trainer.resume=auto", run="part"))
    resumed = metrics(tmp_path / "part")
    assert summary["steps"] == 4 and [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in metrics(tmp_path / "full")], rel=1e-5)
    a = load_file(str(tmp_path / "full" / "checkpoints" / "step-000004" / "model.safetensors"))
    b = load_file(str(tmp_path / "part" / "checkpoints" / "step-000004" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_head_config_errors_are_clear(tiny_world, tmp_path):
    with pytest.raises(ValueError, match="drafter.hidden_states must be online, offline, vllm, llamacpp or files"):
        train(smoke(tmp_path, "drafter=eagle", "drafter.hidden_states=disk"))
    with pytest.raises(ValueError, match="drafter.hidden_states=files reads drafter.hidden_states_dir"):
        train(smoke(tmp_path, "drafter=eagle", "drafter.hidden_states=files"))
    with pytest.raises(ValueError, match="drafter.hidden_states_tensor_parallel is 2: it shards the target over"):
        train(smoke(tmp_path, "drafter=eagle", "drafter.hidden_states=offline", "drafter.hidden_states_tensor_parallel=2"))
    with pytest.raises(ValueError, match="layer indices must be in 0..2"):
        train(smoke(tmp_path, "drafter=eagle", "drafter.layers=[0,1,3]"))
    with pytest.raises(ValueError, match="drafter.label_temperature must be >= 0"):
        train(smoke(tmp_path, "drafter=eagle", "drafter.label_temperature=-0.5"))
    with pytest.raises(ValueError, match="drafter.intermediate_size must be >= 1"):
        train(smoke(tmp_path, "drafter=eagle", "drafter.intermediate_size=0"))


def test_head_mlp_width_is_a_recipe_setting(tiny_world, tmp_path):
    train(smoke(tmp_path, "drafter=eagle", "drafter.intermediate_size=16", "trainer.max_steps=1",
                "trainer.eval_every=1", "evaluate.enabled=false"))
    config = json.loads((tmp_path / "run" / "best" / "config.json").read_text())
    assert config["intermediate_size"] == 16
    weights = load_file(str(tmp_path / "run" / "best" / "model.safetensors"))
    assert weights["midlayer.mlp.down_proj.weight"].shape[1] == 16
    default = train(smoke(tmp_path, "drafter=eagle", "trainer.max_steps=1", "trainer.eval_every=1",
                          "evaluate.enabled=false", run="default"))
    target_width = json.loads((tiny_world / "target" / "config.json").read_text())["intermediate_size"]
    assert json.loads((tmp_path / "default" / "best" / "config.json").read_text())["intermediate_size"] == target_width
    assert default["best"]["step"] == 1


def test_label_distribution_sharpens_to_the_argmax():
    from train.heads import label_distribution

    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0 - 1e-3], [0.0, -1.0, 5.0, 4.0]])
    torch.testing.assert_close(label_distribution(logits, 1.0), torch.softmax(logits, -1))
    torch.testing.assert_close(label_distribution(logits, 0.5), torch.softmax(2 * logits, -1))
    assert torch.equal(label_distribution(logits, 0), torch.tensor([[0.0, 1, 0, 0], [0, 0, 1, 0]]))


def test_label_temperature_sets_the_training_label_only(tiny_world, tmp_path, monkeypatch):
    """The token loss reads the label at drafter.label_temperature; the held-out estimates (acceptance
    is sum min(p, q) under the target's own distribution) always read temperature 1."""
    import train.heads as heads

    seen, original = [], heads.label_distribution
    monkeypatch.setattr(heads, "label_distribution", lambda logits, t: seen.append(t) or original(logits, t))
    train(smoke(tmp_path, "drafter=medusa", "drafter.label_temperature=0", "trainer.max_steps=3",
                "trainer.eval_every=3", "evaluate.enabled=false"))
    held_out_batches = -(-8 // 4)  # experiment=smoke: 8 held-out records in batches of 4, evaluated once
    assert seen.count(0) == 3 and set(seen) == {0, 1.0}
    assert seen.count(1.0) == held_out_batches


def test_draft_vocabulary_size_from_share_or_count():
    from omegaconf import OmegaConf

    from train.eagle3 import draft_vocab_size

    def size(**kw):
        return draft_vocab_size(OmegaConf.create({"draft_vocab_size": None, "draft_vocab_share": None, **kw}), 4096)

    assert size(draft_vocab_share=0.25) == 1024  # the default: a quarter, as EAGLE-3 on Llama 3
    assert size(draft_vocab_share=0.25, draft_vocab_size=300) == 300  # a count wins
    assert size() is None and size(draft_vocab_share=1.0) is None and size(draft_vocab_size=4096) is None
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="draft_vocab_share must be in"):
            size(draft_vocab_share=bad)



@pytest.mark.parametrize("family", ["gemma2", "gpt2", "granite", "qwen3_moe"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_recipe_and_eval_run_end_to_end_on_other_families(tiny_world, tmp_path, family, kind):
    """`python -m train drafter=<kind>` and `python -m eval` with a target of another family (a tiny random
    one, with the tiny world's tokenizer and traffic): the head trains, and the evaluation is lossless."""
    from transformers import AutoTokenizer

    import eval.__main__ as evaluate_entry
    from helpers import tiny

    tok = AutoTokenizer.from_pretrained(tiny_world / "target")
    target_dir = tmp_path / family
    tiny(family, vocab=len(tok), sharpen=1.0).save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    run = tmp_path / "run"
    train(smoke(tmp_path, f"drafter={kind}", f"target.name_or_path={target_dir}", "evaluate.enabled=false"))
    assert (run / "best" / "model.safetensors").exists()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="eval", overrides=[
            "target=tiny", f"target.name_or_path={target_dir}", "ks=[2]", "repeats=1", "max_new_tokens=12",
            "data.max_prompts_per_category=2", "progress=false", f"out_dir={tmp_path / 'report'}",
            f"drafters=[{{name: head, kind: head, path: '{run / 'best'}'}}]"])
    report = evaluate_entry.run(cfg)
    assert all(r["lossless"] for r in report["results"])


def test_a_head_trains_on_agent_traffic_and_the_final_evaluation_reports_the_agent_category(tiny_world, tmp_path):
    """`python -m train drafter=eagle target=tiny_agent`: tool-calling conversations are regenerated by the
    target, trained on, and measured as their own category, losslessly."""
    train(smoke(tmp_path, "drafter=eagle", "target=tiny_agent"))
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert "agent" in {r["category"] for r in report["results"]}
    assert all(r["lossless"] for r in report["results"])


def test_a_head_starts_from_a_saved_one_with_its_own_draft_vocabulary(tiny_world, tmp_path):
    """drafter.init_from: a saved head's weights are where training starts (with lr 0 they are what it saves);
    EAGLE-3's draft vocabulary is the new run's; a head of another kind or shape is refused with the reason."""
    first = ["drafter=eagle", "trainer.max_steps=4", "trainer.eval_every=4", "evaluate.enabled=false"]
    train(smoke(tmp_path, *first, "drafter.draft_vocab_size=200", run="first"))
    again = ["drafter=eagle", f"drafter.init_from={tmp_path / 'first' / 'best'}", "drafter.draft_vocab_size=150",
             "trainer.max_steps=1", "trainer.eval_every=1", "trainer.lr=0", "trainer.warmup_steps=0",
             "evaluate.enabled=false"]
    train(smoke(tmp_path, *again, run="again"))
    a = load_file(str(tmp_path / "first" / "best" / "model.safetensors"))
    b = load_file(str(tmp_path / "again" / "best" / "model.safetensors"))
    assert a["d2t"].numel() == 200 and b["d2t"].numel() == 150
    assert all(torch.equal(a[k], b[k]) for k in a if k not in ("d2t", "t2d"))
    from train.export import read_run
    from train.hub import model_card

    card = model_card(read_run(tmp_path / "again"), {}, repo_id="acme/h", license=None, k=4)
    assert f"| started from the head | {tmp_path / 'first' / 'best'} |" in card
    assert "| output head | the target's, frozen |" in card
    assert "started from" not in model_card(read_run(tmp_path / "first"), {}, repo_id="acme/h", license=None, k=4)
    # trainer.max_steps=0: the saved head's held-out numbers alone, and it is what best/ keeps.
    only = train(smoke(tmp_path, *[o for o in again if not o.startswith("trainer.")], "trainer.max_steps=0",
                       run="only"))
    row = metrics(tmp_path / "only")
    assert only["steps"] == 0 and [r["step"] for r in row] == [0] and row[0]["heldout_tau_greedy"] >= 1.0
    d = load_file(str(tmp_path / "only" / "best" / "model.safetensors"))
    assert all(torch.equal(a[k], d[k]) for k in a if k not in ("d2t", "t2d"))
    with pytest.raises(ValueError, match="trainer.max_steps must be 0"):
        train(smoke(tmp_path, *again, "trainer.max_steps=-1", run="negative"))
    fresh = train(smoke(tmp_path, *[o for o in again if not o.startswith("drafter.init_from")], run="fresh"))
    c = load_file(str(tmp_path / "fresh" / "best" / "model.safetensors"))
    assert fresh["steps"] == 1 and not torch.equal(a["fc.weight"], c["fc.weight"])
    with pytest.raises(ValueError, match="drafter.init_from=.*intermediate_size|do not fit this run's head"):
        train(smoke(tmp_path, *again, "drafter.intermediate_size=16", run="narrow"))
    train(smoke(tmp_path, "drafter=mtp", "trainer.max_steps=1", "trainer.eval_every=1", "evaluate.enabled=false",
                run="mtp"))
    with pytest.raises(ValueError, match="a mtp head on layers .* not the eagle head"):
        train(smoke(tmp_path, *again[:1], f"drafter.init_from={tmp_path / 'mtp' / 'best'}", *again[2:], run="wrong"))


def test_an_own_output_head_starts_from_the_targets_rows_and_trains(tiny_world, tmp_path):
    """drafter.own_lm_head: the head's output head starts as the target's rows of the draft vocabulary (lr 0 saves
    exactly them), trains with the rest, and a run started from it keeps its rows, token by token, under the new
    run's vocabulary; the target's rows fill the tokens the saved vocabulary lacked."""
    target, _ = load_target("toyworld://tiny/target", device=torch.device("cpu"))
    rows = target.get_output_embeddings().weight.detach()
    steps = ["trainer.eval_every=1", "trainer.warmup_steps=0", "evaluate.enabled=false"]
    train(smoke(tmp_path, "drafter=eagle", "drafter.own_lm_head=true", "drafter.draft_vocab_size=200",
                "trainer.max_steps=1", "trainer.lr=0", *steps, run="zero"))
    zero = load_file(str(tmp_path / "zero" / "best" / "model.safetensors"))
    assert torch.equal(zero["lm_head.weight"], rows[torch.arange(200) + zero["d2t"]])
    train(smoke(tmp_path, "drafter=eagle", "drafter.own_lm_head=true", "drafter.draft_vocab_size=200",
                "trainer.max_steps=4", "trainer.lr=5e-3", *steps, run="trained"))
    trained = load_file(str(tmp_path / "trained" / "best" / "model.safetensors"))
    ids = torch.arange(200) + trained["d2t"]
    assert not torch.allclose(trained["lm_head.weight"], rows[ids], atol=1e-4)
    train(smoke(tmp_path, "drafter=eagle", "drafter.own_lm_head=true", "drafter.draft_vocab_size=250",
                f"drafter.init_from={tmp_path / 'trained' / 'best'}", "trainer.max_steps=1", "trainer.lr=0", *steps,
                run="again"))
    again = load_file(str(tmp_path / "again" / "best" / "model.safetensors"))
    new_ids = torch.arange(250) + again["d2t"]
    saved_at = {int(t): i for i, t in enumerate(ids)}
    for j, t in enumerate(new_ids.tolist()):
        expected = trained["lm_head.weight"][saved_at[t]] if t in saved_at else rows[t]
        assert torch.equal(again["lm_head.weight"][j], expected), t
    assert len(set(new_ids.tolist()) - set(saved_at)) == 50  # the rows the saved vocabulary lacked
    from train.export import read_run
    from train.hub import model_card

    assert "| output head | its own, trained |" in model_card(read_run(tmp_path / "again"), {}, repo_id="acme/h",
                                                             license=None, k=4)
    with pytest.raises(ValueError, match="trained an output head of its own; set drafter.own_lm_head=true"):
        train(smoke(tmp_path, "drafter=eagle", "drafter.draft_vocab_size=250", "trainer.max_steps=1", *steps,
                    f"drafter.init_from={tmp_path / 'trained' / 'best'}", run="dropped"))


def _self_trained_head(kind, target, settings):
    """A head given a few steps on the target's own greedy text: its guesses mix hits and misses."""
    torch.manual_seed(0)
    head = build_head(kind, target, default_layers(kind, target.config.num_hidden_layers), **settings)
    return trained_to_self(target, head, steps=40)


@pytest.mark.parametrize("kind, settings", [
    ("eagle", dict(ttt_steps=4, ttt_decay=0.8)), ("eagle1", dict(token_loss_weight=0.1)),
    ("mtp", dict(depth=3, module_decay=0.8)), ("medusa", dict(num_heads=4, num_layers=1, head_decay=0.8)),
    ("dflash", dict(num_layers=2, block_size=5, mask_token_id=63, loss_decay_gamma=4.0, max_anchors=64)),
    ("peagle", dict(num_depths=4, mask_token_id=63, cod_ratio=0.7, cod_min_ratio=0.2, max_anchors=512))])
def test_the_greedy_replay_keeps_what_the_loop_keeps(kind, settings):
    # The held-out τ the recipe selects by replays greedy drafting on teacher-forced answers: on the
    # target's own greedy answer it must give the loop's rounds and tokens exactly.
    target = tiny_llama(64, hidden=32, layers=4, seed=0, logit_scale=4.0).requires_grad_(False)
    head = _self_trained_head(kind, target, settings)
    hits_and_misses = 0
    for n in (2, 5, 9):
        prompt = torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n))
        ids = torch.cat([prompt, torch.tensor(autoregressive_generate(target, prompt, sampling=Sampling(),
                                                                      max_new_tokens=40).tokens)])[None]
        attn, answer = torch.ones_like(ids), torch.zeros_like(ids)
        answer[:, n:] = 1
        feats = capture(target, ids, attn, list(head.config.feature_layers)).flatten(2)
        with torch.no_grad():
            labels = torch.nn.functional.one_hot(target(input_ids=ids).logits.argmax(-1), 64).float()
            _, stats = head(feats, ids, attn, answer, labels)
        hits = [st["hits"] for st in stats]
        with torch.no_grad():  # a training step places no hits: the replay's grid is built for evaluation only
            assert not any("hits" in st for st in head.train()(feats, ids, attn, answer, labels)[1])
        head.eval()
        out = speculative_generate(target, head.drafter(kind), prompt, k=len(hits), sampling=Sampling(),
                                   max_new_tokens=40)
        assert out.tokens == ids[0, n:].tolist()
        assert greedy_rounds(hits, answer) == [(sum(r.accepted + 1 for r in out.rounds), len(out.rounds))], n
        hits_and_misses += len({r.accepted for r in out.rounds})
    assert hits_and_misses > 3  # rounds that kept different numbers of guesses: not all hits, not all misses
