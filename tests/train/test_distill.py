"""`python -m train drafter=draft_lm`: configs compose, training improves the draft, resume is exact,
two processes agree."""

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from safetensors.torch import load_file

from traffic import models
from train.__main__ import train
from train.distill import DraftLMRecipe
from train.heldout import SELECT_BY

CONF = Path(__file__).resolve().parents[2] / "conf"
ROOT = CONF.parent


def groups(name):
    return sorted(p.stem for p in (CONF / name).glob("*.yaml"))


def make_cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


@pytest.mark.parametrize("target", groups("target"))
@pytest.mark.parametrize("trainer", groups("trainer"))
@pytest.mark.parametrize("tracking", groups("tracking"))
def test_every_train_config_composes(target, trainer, tracking):
    cfg = make_cfg(f"target={target}", f"trainer={trainer}", f"tracking={tracking}")
    assert cfg.drafter.init_from == cfg.target.off_the_shelf_draft


@pytest.mark.parametrize("experiment", groups("experiment"))
def test_every_experiment_composes(experiment):
    assert make_cfg(f"experiment={experiment}").trainer.max_steps > 0


def test_config_errors_are_clear(tiny_world, tmp_path):
    with pytest.raises(ConfigCompositionException):
        make_cfg("trainer.max_step=3")  # typo of max_steps
    with pytest.raises(ConfigCompositionException):
        make_cfg("trainer.lr=fast")
    with pytest.raises(ValueError, match="drafter.loss must be one of"):
        train(make_cfg("experiment=smoke", "drafter.loss=kl", f"out_dir={tmp_path}"))
    with pytest.raises(ValueError, match="on-policy data needs a divergence"):
        train(make_cfg("experiment=smoke", "drafter.loss=sft", "drafter.on_policy.ratio=0.5", f"out_dir={tmp_path}"))
    with pytest.raises(ValueError, match="trainer.select_by must be acceptance or top1"):
        train(make_cfg("experiment=smoke", "trainer.select_by=loss", f"out_dir={tmp_path}"))


def test_precision_auto_is_bf16_where_the_hardware_multiplies_it(tiny_world, monkeypatch, tmp_path):
    from train import precision

    epyc = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
    sapphire_rapids = "flags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n"
    older = "flags\t\t: fpu avx2 avx512f avx512bw\n"
    assert precision.cpu_multiplies_bf16(epyc) and precision.cpu_multiplies_bf16(sapphire_rapids)
    assert not precision.cpu_multiplies_bf16(older) and not precision.cpu_multiplies_bf16("")
    for native in (True, False):
        monkeypatch.setattr(precision, "cpu_multiplies_bf16", lambda native=native: native)
        assert precision.mixed_precision("auto", on_cpu=True) == ("bf16" if native else "no")
        assert precision.mixed_precision("no", on_cpu=True) == "no"
        assert precision.mixed_precision("fp16", on_cpu=False) == "fp16"
    with pytest.raises(ValueError, match="trainer.precision must be no, bf16, fp16 or auto, got 'half'"):
        train(make_cfg("experiment=smoke", "trainer.precision=half", f"out_dir={tmp_path}"))


@pytest.mark.parametrize("kind,lora,error", [("DEEPSPEED", False, "DeepSpeed is not supported"),
                                             ("FSDP", True, "drafter.lora with FSDP is not supported"),
                                             ("FSDP", False, None), ("MULTI_GPU", True, None)])
def test_unsupported_distributed_setups_are_refused(kind, lora, error, tmp_path):
    """Accelerate does not start DeepSpeed or FSDP without GPUs, so the check is called directly."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from train.distill import DraftLMRecipe

    recipe = DraftLMRecipe(make_cfg(f"drafter.lora.enabled={lora}", f"out_dir={tmp_path}"))
    recipe.acc = SimpleNamespace(distributed_type=DistributedType[kind])
    if error is None:
        recipe._check_distributed()
    else:
        with pytest.raises(ValueError, match=error):
            recipe._check_distributed()


def smoke(tmp_path, *overrides, run="run"):
    return make_cfg("experiment=smoke", "progress=false", f"out_dir={tmp_path / run}",
                    f"data_cache={tmp_path / 'data'}", *overrides)


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_heldout_replay_after_the_first_runs_the_draft_alone(tiny_world, tmp_path, monkeypatch):
    """The target's side of the held-out replay (its top HELDOUT_TOP_K tokens, here the whole vocabulary) is kept
    from the first replay: a later one with the target gone gives the last one's figures."""
    recipes = []
    kept = DraftLMRecipe._heldout_target
    monkeypatch.setattr(DraftLMRecipe, "_heldout_target", lambda self, ids, attn: recipes.append(self) or kept(self, ids, attn))
    train(smoke(tmp_path, "trainer.max_steps=4", "trainer.eval_every=2", "evaluate.enabled=false"))
    recipe = recipes[0]
    batches = len(recipe.heldout_target)
    assert batches > 0 and len(recipes) == 2 * batches  # two replays, the target run at the first only
    last = [r for r in metrics(tmp_path / "run") if "heldout_top1" in r][-1]
    recipe.target = None  # a replay that reached for it would fail
    again = recipe.evaluate_heldout()
    for key in ("heldout_acceptance", "heldout_top1", "heldout_tau_greedy"):
        assert again[key] == pytest.approx(last[key], rel=1e-6)


@pytest.mark.parametrize("loss", ["sft", "forward_kl", "reverse_kl", "jsd", "tvd"])
def test_a_few_steps_lower_the_loss_and_raise_acceptance(tiny_world, tmp_path, loss):
    summary = train(smoke(tmp_path, f"drafter.loss={loss}", "trainer.max_steps=12", "trainer.eval_every=6",
                          "trainer.lr=5e-3", "evaluate.enabled=false"))
    rows = metrics(tmp_path / "run")
    assert rows[-1]["loss"] < rows[0]["loss"]
    evals = [r["heldout_acceptance"] for r in rows if "heldout_acceptance" in r]
    assert len(evals) == 2 and summary["best"]["acceptance"] == max(evals)
    if loss != "sft":
        # The divergences pull q towards p, so sum min(p, q) rises. SFT fits the target's sampled tokens
        # and sharpens q, which need not raise it against a flat (barely trained) tiny target.
        assert evals[-1] > evals[0]
    assert (tmp_path / "run" / "best" / "model.safetensors").exists()


@pytest.mark.parametrize("select_by", ["acceptance", "top1"])
def test_the_best_checkpoint_is_chosen_by_the_named_estimate(tiny_world, tmp_path, select_by):
    summary = train(smoke(tmp_path, "drafter.loss=sft", "trainer.max_steps=12", "trainer.eval_every=3",
                          "trainer.lr=5e-3", "evaluate.enabled=false", f"trainer.select_by={select_by}"))
    # As for every kind (train/heldout.py): acceptance -> the tokens per round when sampling, top1 -> the replayed
    # greedy τ; a draft LM's tokens per round ranks its checkpoints as its acceptance does.
    key = SELECT_BY[select_by]
    evals = [r for r in metrics(tmp_path / "run") if "heldout_top1" in r]
    best = max(evals, key=lambda r: r[f"heldout_{key}"])
    assert summary["best"]["step"] == best["step"] and summary["best"][key] == best[f"heldout_{key}"]
    assert summary["best"]["top1"] == best["heldout_top1"] and summary["best"]["acceptance"] == best["heldout_acceptance"]
    if select_by == "acceptance":
        assert best["heldout_acceptance"] == max(r["heldout_acceptance"] for r in evals)
    saved = json.loads((tmp_path / "run" / "best" / "best.json").read_text())
    assert saved["step"] == best["step"]


def test_cached_top_k_logits_train_like_online(tiny_world, tmp_path):
    """With k = the whole vocabulary the cached loss is the online loss (same data order and init); a
    smaller k trains too, and the cache is computed once and reused."""
    common = ["drafter.loss=forward_kl", "trainer.max_steps=2", "evaluate.enabled=false"]
    vocab = 320  # the tiny world's tokenizer (conf: target=tiny)
    train(smoke(tmp_path, *common, run="online"))
    train(smoke(tmp_path, *common, "drafter.target_logits=cached", f"drafter.cached_top_k={vocab}", run="full_k"))
    online, cached = metrics(tmp_path / "online"), metrics(tmp_path / "full_k")
    assert cached[0]["loss"] == pytest.approx(online[0]["loss"], rel=1e-4)
    summary = train(smoke(tmp_path, "drafter.loss=tvd", "trainer.max_steps=6", "trainer.eval_every=3",
                          "trainer.lr=5e-3", "evaluate.enabled=false", "drafter.target_logits=cached",
                          "drafter.cached_top_k=8", run="top8"))
    rows = metrics(tmp_path / "top8")
    assert rows[-1]["loss"] < rows[0]["loss"] and summary["best"] is not None
    caches = sorted((tmp_path / "data").glob("logits-*/manifest.json"))
    assert len(caches) == 2  # one per k
    stamps = [c.stat().st_mtime_ns for c in caches]
    train(smoke(tmp_path, *common, "drafter.target_logits=cached", f"drafter.cached_top_k={vocab}", run="again"))
    assert sorted((tmp_path / "data").glob("logits-*/manifest.json")) == caches
    assert [c.stat().st_mtime_ns for c in caches] == stamps  # reused, not recomputed
    with pytest.raises(ValueError, match="target_logits=cached needs a divergence"):
        train(smoke(tmp_path, "drafter.loss=sft", "drafter.target_logits=cached", run="bad"))
    with pytest.raises(ValueError, match="drafter.target_logits must be online or cached"):
        train(smoke(tmp_path, "drafter.target_logits=offline", run="bad"))


def test_on_policy_and_lora(tiny_world, tmp_path):
    summary = train(smoke(tmp_path, "drafter.loss=tvd", "drafter.on_policy.ratio=1.0", "drafter.lora.enabled=true",
                          "drafter.lora.r=4", "trainer.max_steps=4", "evaluate.enabled=false"))
    rows = metrics(tmp_path / "run")
    assert all(r["on_policy"] for r in rows)
    # The saved best model has the LoRA merged in: a plain Llama checkpoint without adapter keys.
    best = load_file(str(tmp_path / "run" / "best" / "model.safetensors"))
    assert not any("lora" in k for k in best)
    assert summary["steps"] == 4


def test_end_to_end_writes_the_evaluation_report(tiny_world, tmp_path):
    summary = train(smoke(tmp_path))
    report = json.loads(Path(summary["report"]).read_text())
    assert report["baseline"] == "off_the_shelf"
    assert {r["drafter"] for r in report["results"]} == {"off_the_shelf", "trained_forward_kl"}


def test_a_target_without_a_draft_trains_its_own_first_layers(tiny_world, tmp_path):
    """drafter.init_layers: a target with no smaller sibling starts its draft from its own first layers and
    head (the self-draft), which is also the baseline it is measured against."""
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="drafter.init_layers=N"):
        train(smoke(tmp_path / "none", "drafter.init_from=null"))
    summary = train(smoke(tmp_path / "own", "drafter.init_from=null", "drafter.init_layers=1"))
    report = json.loads(Path(summary["report"]).read_text())
    assert report["baseline"] == "self_draft"
    assert {r["drafter"] for r in report["results"]} == {"self_draft", "trained_forward_kl"}
    assert AutoConfig.from_pretrained(tmp_path / "own" / "run" / "best").num_hidden_layers == 1


def test_a_shallower_draft_trains_the_off_the_shelf_drafts_first_layers(tiny_world, tmp_path):
    """drafter.init_layers with drafter.init_from: the draft cut to its first layers (cheaper per drafted token),
    trained, and measured against the whole draft it was cut from (here the tiny target as the draft, 2 layers)."""
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="keeps 1 to 1 of the 2 layers"):
        train(smoke(tmp_path / "deep", "drafter.init_from=toyworld://tiny/target", "drafter.init_layers=2"))
    summary = train(smoke(tmp_path / "cut", "drafter.init_from=toyworld://tiny/target", "drafter.init_layers=1"))
    report = json.loads(Path(summary["report"]).read_text())
    assert report["baseline"] == "off_the_shelf"
    assert {r["drafter"] for r in report["results"]} == {"off_the_shelf", "trained_forward_kl"}
    run = tmp_path / "cut" / "run"
    assert AutoConfig.from_pretrained(run / "best").num_hidden_layers == 1
    from train.export import read_run
    from train.hub import model_card

    card = model_card(read_run(run), {}, repo_id="acme/d", license=None, k=2)
    assert "| started from | toyworld://tiny/target's first 1 layers |" in card


def _prepared_ids(data_dir, split):
    import datasets

    (directory,) = data_dir.glob(f"tiny-{split}-*")
    return datasets.load_from_disk(str(directory / "tokenized"))["id"]


def test_checkpoints_are_chosen_on_records_neither_trained_on_nor_evaluated(tiny_world, tmp_path):
    """The held-out estimate reads the last trainer.eval_examples records of the training traffic; the
    training set stops before them and the final evaluation reads data.eval_path."""
    lines = (tiny_world / "company_logs" / "train.jsonl").read_text().splitlines()
    train(smoke(tmp_path, "trainer.max_steps=1", "evaluate.enabled=false", "data.max_records=20"))
    held, trained = _prepared_ids(tmp_path / "data", "eval"), _prepared_ids(tmp_path / "data", "train")
    assert held == [json.loads(line)["id"] for line in lines[-8:]]  # smoke: trainer.eval_examples=8
    assert trained == [json.loads(line)["id"] for line in lines[:20]]
    evaluated = {json.loads(line)["id"] for line in (tiny_world / "company_logs" / "eval.jsonl").read_text().splitlines()}
    assert not set(held) & evaluated and not set(held) & set(trained)
    with pytest.raises(ValueError, match="holds the last trainer.eval_examples=500 out"):
        train(smoke(tmp_path, "trainer.eval_examples=500", run="too_few"))


def test_a_traffic_file_edited_in_place_is_prepared_anew(tiny_world, tmp_path):
    """The prepared-data cache is keyed by the records, not the path: editing the file is never served the
    old regenerated data."""
    lines = (tiny_world / "company_logs" / "train.jsonl").read_text().splitlines()
    data = tmp_path / "traffic.jsonl"
    data.write_text("\n".join(lines[:30]) + "\n")
    run = lambda name: train(smoke(tmp_path, f"data.path={data}", "trainer.max_steps=1", "evaluate.enabled=false",
                                   run=name))
    run("first")
    run("again")  # same content: the cache is reused
    assert len(list((tmp_path / "data").glob("tiny-train-*"))) == 1
    data.write_text("\n".join(lines[1:31]) + "\n")
    run("edited")
    assert len(list((tmp_path / "data").glob("tiny-train-*"))) == 2


def test_without_eval_path_the_final_evaluation_reads_the_held_out_records(tiny_world, tmp_path, caplog):
    """One traffic file: the final evaluation reads the records training held out (the last
    trainer.eval_examples), loaded as training loaded them (here skipping a malformed line), and warns that
    they also chose the checkpoint."""
    lines = (tiny_world / "company_logs" / "train.jsonl").read_text().splitlines()
    data = tmp_path / "traffic.jsonl"
    data.write_text("\n".join([*lines[:30], "{not json", *lines[30:]]) + "\n")
    with caplog.at_level(logging.WARNING):
        summary = train(smoke(tmp_path, f"data.path={data}", "data.on_bad_record=skip", "data.max_records=20",
                              "trainer.max_steps=1"))
    assert "data.eval_path is not set" in caplog.text
    measured = json.loads(Path(summary["report"]).read_text())["settings"]["data"]
    assert measured["path"] == str(data) and measured["records"] == 8 and measured["held_out"] == 8  # smoke: 8
    assert measured["held_out_by"] == "last"
    assert _prepared_ids(tmp_path / "data", "eval") == [json.loads(line)["id"] for line in lines[-8:]]


def test_held_out_records_taken_per_category():
    from train.prepare import held_out_indices

    categories = ["a"] * 10 + ["b"] * 3 + ["a"] * 2
    assert held_out_indices(categories, 4) == [11, 12, 13, 14]  # the last 4: b b a a
    assert held_out_indices(categories, 4, "per_category") == [11, 12, 13, 14]  # the newest 2 a's, 2 b's
    assert held_out_indices(categories, 5, "per_category") == [9, 11, 12, 13, 14]  # a, b in turn, then a
    assert held_out_indices(categories, 8, "per_category") == [7, 8, 9, 10, 11, 12, 13, 14]  # b runs out at 3
    assert held_out_indices(["a", "b", "c"], 2, "per_category") == [0, 1]  # fewer than the categories: by name
    with pytest.raises(ValueError, match="trainer.heldout must be last or per_category, got 'random'"):
        held_out_indices(categories, 4, "random")


def test_per_category_held_out_records_choose_the_checkpoint(tiny_world, tmp_path, capsys):
    """trainer.heldout=per_category: a file sorted by category still holds out every category, alike, and
    trains on the rest; the final evaluation measures those records and says how they were taken."""
    lines = (tiny_world / "company_logs" / "train.jsonl").read_text().splitlines()
    rows = sorted((json.loads(line) for line in lines[:60]), key=lambda r: r["category"])
    data = tmp_path / "sorted.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for how in ("last", "per_category"):
        capsys.readouterr()
        summary = train(smoke(tmp_path / how, f"data.path={data}", "data.max_records=null", "trainer.max_steps=1",
                              f"trainer.heldout={how}", "evaluate.prompts_per_category=100"))
        held = set(_prepared_ids(tmp_path / how / "data", "eval"))
        trained = set(_prepared_ids(tmp_path / how / "data", "train"))
        by_id = {r["id"]: r["category"] for r in rows}
        counts = Counter(by_id[i] for i in held)
        assert len(held) == 8 and not held & trained and held | trained == set(by_id)  # smoke: eval_examples=8
        warned = any("hold no" in line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:"))
        measured = json.loads(Path(summary["report"]).read_text())["settings"]["data"]
        assert measured["held_out_by"] == how and sum(measured["prompts"].values()) == 8
        if how == "last":  # the file ends with its last category only
            assert len(counts) == 1 and warned
        else:
            assert set(counts) == set(by_id.values()) and max(counts.values()) - min(counts.values()) <= 1
            assert not warned


def _launch(tmp_path, *overrides, env=None):
    cmd = [sys.executable, "-m", "train", "experiment=smoke", "progress=false", "evaluate.enabled=false",
           f"hydra.run.dir={tmp_path / 'run'}", f"data_cache={tmp_path / 'data'}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or os.environ.copy())


@pytest.mark.slow
def test_sigkill_and_resume_match_an_uninterrupted_run(tiny_world, tmp_path):
    steps = ["trainer.max_steps=10", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=20",
             "drafter.on_policy.ratio=0.3", "drafter.loss=jsd"]
    full = _launch(tmp_path / "full", *steps)
    assert full.wait(timeout=600) == 0, full.stdout.read()[-3000:]

    kill_after = random.Random(os.getpid()).randint(2, 7)
    victim = _launch(tmp_path / "killed", *steps)
    checkpoints = tmp_path / "killed" / "run" / "checkpoints"
    deadline = time.time() + 600
    while not (checkpoints / f"step-{kill_after:06d}").exists():
        assert victim.poll() is None and time.time() < deadline, "training ended before it could be killed"
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    resumed = _launch(tmp_path / "killed", *steps, "trainer.resume=auto")
    out = resumed.stdout.read()
    assert resumed.wait(timeout=600) == 0, out[-3000:]
    assert "resumed from" in out
    a = load_file(str(tmp_path / "full" / "run" / "checkpoints" / "step-000010" / "model.safetensors"))
    b = load_file(str(checkpoints / "step-000010" / "model.safetensors"))
    # Bit-for-bit: the same data order, the same on-policy draws, the same optimizer state, one process.
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.mark.slow
def test_two_cpu_processes_end_with_identical_weights(tiny_world, tmp_path):
    # `--cpu --num_processes 2` silently starts one process; --multi_gpu with Accelerator(cpu=True) runs
    # two gloo ranks on a machine without GPUs, which the launch makes of one with a GPU too (two ranks on one
    # GPU are no set-up NCCL runs).
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--main_process_port", str(29500 + os.getpid() % 1000),
           "-m", "train", "experiment=smoke", "progress=false", "evaluate.enabled=false",
           f"hydra.run.dir={tmp_path / 'run'}", f"data_cache={tmp_path / 'data'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    # Both ranks still hold the process group at the end and leave without destructors: tearing gloo down
    # at interpreter exit aborts now and then (acc.end_training() used to destroy the group first).
    for rank in (0, 1):
        assert f"rank {rank} of 2: done, leaving without destructors" in proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert len(summary["rank_checksums"]) == 2 and len(set(summary["rank_checksums"])) == 1


@pytest.mark.slow
def test_multirun_sweep_lands_in_separate_directories(tiny_world, tmp_path):
    cmd = [sys.executable, "-m", "train", "-m", "experiment=smoke", "drafter.loss=sft,tvd", "trainer.max_steps=2",
           "progress=false", "evaluate.enabled=false", f"data_cache={tmp_path / 'data'}",
           f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    runs = sorted(p for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert len(runs) == 2 and all((r / "train_summary.json").exists() for r in runs)
    losses = [next(o for o in (r / ".hydra" / "overrides.yaml").read_text().split() if o.startswith("drafter.loss"))
              for r in runs]
    assert losses == ["drafter.loss=sft", "drafter.loss=tvd"]


@pytest.mark.parametrize("family", ["gemma2", "gpt2", "granite", "qwen3_moe"])
@pytest.mark.parametrize("variant", [["drafter.loss=forward_kl"], ["drafter.loss=sft"],
                                     ["drafter.loss=reverse_kl", "drafter.target_logits=cached"],
                                     ["drafter.loss=jsd", "drafter.on_policy.ratio=0.5", "drafter.lora.enabled=true"]],
                         ids=["forward_kl", "sft", "reverse_kl-cached", "jsd-on_policy-lora"])
def test_every_draft_lm_objective_trains_on_other_families(tiny_world, tmp_path, family, variant):
    """A target and a draft of another family (tiny random ones with the tiny world's tokenizer): each
    objective trains, and the final evaluation of the draft it saved is lossless."""
    from transformers import AutoTokenizer

    from helpers import tiny

    tok = AutoTokenizer.from_pretrained(tiny_world / "target")
    for name, seed in (("target", 0), ("draft", 1)):
        tiny(family, vocab=len(tok), seed=seed, sharpen=1.0).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    train(smoke(tmp_path, f"target.name_or_path={tmp_path / 'target'}", f"target.off_the_shelf_draft={tmp_path / 'draft'}",
                "trainer.max_steps=4", "trainer.eval_every=2", "trainer.checkpoint_every=2", *variant))
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["results"] and all(r["lossless"] for r in report["results"])


def _gguf_of_type(path: Path, file_type) -> Path:
    """A GGUF file holding only its header and weight type, as gguf-py (llama.cpp's own writer) writes it."""
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_file_type(file_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_off_the_shelf_draft_shipped_as_a_gguf_is_measured_as_shipped_and_the_trained_one_in_its_type(tmp_path):
    """The final evaluation's baseline is the draft's own GGUF (llama.cpp serves it as the team has it), and the
    trained draft is served quantized to that file's type; a draft from a directory or hub id keeps both as before."""
    shipped = _gguf_of_type(tmp_path / "draft-Q4_K_M.gguf", gguf.LlamaFileType.MOSTLY_Q4_K_M)
    assert models.gguf_type(shipped) == "Q4_K_M"
    recipe = SimpleNamespace(cfg=OmegaConf.create({"drafter": {"init_from": str(shipped), "loss": "sft"}}),
                             init_name="off_the_shelf", init_path=str(tmp_path / "dequantized"), out=tmp_path / "run",
                             _extra_specs=lambda: [{"name": "ngram", "kind": "ngram"}],
                             _trained_name=lambda: "trained_sft")
    assert DraftLMRecipe._final_specs(recipe) == [
        {"name": "off_the_shelf", "kind": "draft_lm", "path": str(shipped)}, {"name": "ngram", "kind": "ngram"},
        {"name": "trained_sft", "kind": "draft_lm", "path": str(tmp_path / "run" / "best"), "gguf_type": "Q4_K_M"}]
    recipe.cfg.drafter.init_from = str(tmp_path / "draft_dir")
    recipe.init_path = str(tmp_path / "draft_dir")
    assert DraftLMRecipe._final_specs(recipe)[::2] == [
        {"name": "off_the_shelf", "kind": "draft_lm", "path": str(tmp_path / "draft_dir")},
        {"name": "trained_sft", "kind": "draft_lm", "path": str(tmp_path / "run" / "best")}]
