"""A target's features from llama.cpp (`drafter.hidden_states=llamacpp`): the build's `llama-hidden-states`
(eval/engines/llama_cpp_patches/hidden-states-tool.patch) computes the layer inputs llama.cpp's own EAGLE-3 drafts
read, on the GGUF as served, into speculators' per-record files, and train/hidden_states.py reads them into the
feature cache a head trains on. On a float32 GGUF they are PyTorch's to llama.cpp's rounding; a run resumes without
computing a finished record again; bad input is named by file and line.
"""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from hydra import compose, initialize_config_dir
from transformers import AutoTokenizer

from eval.engines import llama_cpp
from eval.run import load_target
from helpers import tiny
from traffic import toyworld
from traffic.records import Example
from train.__main__ import train
from train.hidden_states import ShardReader, capture, write_shards_from_llama_cpp

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("llama_cpp"), pytest.mark.skipif(not llama_cpp.available(), reason=(
    f"llama.cpp is not built at {llama_cpp.home()}: `make llama-cpp` (make test builds it)"))]

TARGET = "toyworld://tiny_deep/target"
CONF = Path(__file__).resolve().parents[3] / "conf"
# llama.cpp's float32 features against PyTorch's float32 ones, relative (Frobenius) error of each record's layer, with
# llama.cpp's defaults (as llama-server computes them: K and V cached in float16, flash attention on): measured at most
# 2.2e-4 (Llama) and 2.8e-4 (Qwen2) on these targets, under 1e-5 with a float32 cache and flash attention off.
FEATURE_RTOL = 1e-3


def examples(vocab: int, n: int = 6, seed: int = 0) -> list[Example]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 40, (n,), generator=generator).tolist()
    return [Example(f"r{i}", "chat", torch.randint(3, vocab, (t,), generator=generator).tolist(), [1] * t)
            for i, t in enumerate(lengths)]


def qwen2_target(directory: Path):
    """A tiny Qwen2 target (the attention biases Llama lacks) with the toy world's tokenizer, as a directory. Its
    vocabulary has room to spare: loaded as a Qwen2 tokenizer (as llama.cpp's converter does) the toy tokenizer gains
    Qwen2's <|endoftext|>."""
    tok = AutoTokenizer.from_pretrained(toyworld.resolve(TARGET))
    model = tiny("qwen2", vocab=len(tok) + 16)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return model


def relative_errors(cache: Path, target, records: list[Example], layers: list[int]) -> list[float]:
    shards = ShardReader(cache)
    errors = []
    for i, e in enumerate(records):
        ours = capture(target, torch.tensor([e.input_ids]), None, layers)[0].float()
        theirs = shards[i]["hidden"].float()
        assert torch.equal(shards[i]["input_ids"], torch.tensor(e.input_ids))
        errors += [float((theirs[:, j] - ours[:, j]).norm() / ours[:, j].norm()) for j in range(len(layers))]
    return errors


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_cpps_features_are_pytorchs_on_a_float32_gguf(tiny_world, tmp_path, family):
    """Every layer input llama.cpp computes, and its last layer through the target's final norm, equals what
    PyTorch's copy of the target gives, record by record; the files are gone once the cache is whole."""
    if family == "llama":
        target, _ = load_target(TARGET, device=torch.device("cpu"))
        directory = Path(toyworld.resolve(TARGET))
    else:
        directory = tmp_path / "qwen2"
        target = qwen2_target(directory)
    n = target.config.num_hidden_layers
    gguf = llama_cpp.convert_to_gguf(directory, tmp_path / "target.gguf")
    layers = [0, 1, n - 1, n]
    records = examples(target.config.vocab_size)
    cache = tmp_path / "cache"
    write_shards_from_llama_cpp(records, target, gguf, layers, cache, dtype="float32", threads=2, progress=False)
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["meta"]["engine"] == f"llama.cpp {llama_cpp.VERSION} (target.gguf)"
    assert max(relative_errors(cache, target, records, layers)) <= FEATURE_RTOL
    assert not (tmp_path / "cache.llama.cpp").exists()


def test_llama_hidden_states_resumes_and_names_bad_input(tiny_world, tmp_path):
    """The tool as a team's script drives it: a finished record is skipped on a rerun (a killed run resumes where it
    stopped), each file holds its record's token ids, and bad input is an error naming the file and line."""
    target_dir = Path(toyworld.resolve(TARGET))
    gguf = llama_cpp.convert_to_gguf(target_dir, tmp_path / "target.gguf")
    records = examples(64, n=3)
    lines = tmp_path / "records.txt"
    lines.write_text("".join(" ".join(map(str, e.input_ids)) + "\n" for e in records))
    out = tmp_path / "out"

    def run(layer_ids="1,4", source=lines):
        return subprocess.run([str(llama_cpp.binary("llama-hidden-states")), "-m", str(gguf), "-l", layer_ids,
                               "-i", str(source), "-o", str(out), "-t", "2"], capture_output=True, text=True)

    first = run()
    assert first.returncode == 0, first.stderr
    assert first.stdout.split("\n")[:3] == [f"done {i} {len(e.input_ids)}" for i, e in enumerate(records)]
    for i, e in enumerate(records):
        written = load_file(out / f"hs_{i}.safetensors")
        assert written["token_ids"].tolist() == e.input_ids
        assert written["hidden_states"].shape == (len(e.input_ids), 2, 64)
    (out / "hs_1.safetensors").unlink()
    again = run()
    assert again.returncode == 0 and again.stdout.split("\n")[:3] == [
        f"skip 0 {len(records[0].input_ids)}", f"done 1 {len(records[1].input_ids)}", f"skip 2 {len(records[2].input_ids)}"]
    bad = tmp_path / "bad.txt"
    bad.write_text("5 6 7\n5 99999 7\n")
    failed = run(source=bad)
    assert failed.returncode == 1 and f"{bad}:2: token id 99999 is not in the model's vocabulary" in failed.stderr
    bad.write_text("5 6 7\n\n")
    assert f"{bad}:2: a record without tokens" in run(source=bad).stderr
    assert "layer ids are 0 ... 4 for this model of 4 layers" in run(layer_ids="1,5").stderr


def test_a_head_trains_on_llama_cpps_features_as_on_pytorchs(tiny_world, tmp_path):
    """`drafter.hidden_states=llamacpp` on the smoke recipe's target (converted to a float32 GGUF once, beside the
    caches): the step losses are the offline cache's to llama.cpp's rounding, from a cache of its own, reused."""
    common = ["experiment=smoke", "progress=false", f"data_cache={tmp_path / 'data'}", "drafter=eagle",
              "trainer.max_steps=3", "evaluate.enabled=false", "drafter.offline_dtype=float32"]

    def cfg(hidden_states, run):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose(config_name="train", overrides=[*common, f"drafter.hidden_states={hidden_states}",
                                                            f"out_dir={tmp_path / run}"])

    train(cfg("offline", "offline"))
    train(cfg("llamacpp", "engine"))
    losses = {run: [r["loss"] for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines())]
              for run in ("offline", "engine")}
    assert losses["engine"] == pytest.approx(losses["offline"], rel=1e-4)
    assert (tmp_path / "data" / "llama.cpp" / "target-f32.gguf").exists()
    caches = list((tmp_path / "data").glob("hidden-llamacpp-*/manifest.json"))
    assert len(caches) == 1 and json.loads(caches[0].read_text())["meta"]["engine"].startswith("llama.cpp ")
    stamp = caches[0].stat().st_mtime_ns
    train(cfg("llamacpp", "engine2"))
    assert caches[0].stat().st_mtime_ns == stamp  # reused, not computed again
