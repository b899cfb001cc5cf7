"""The drafters of an evaluation in llama.cpp's formats: a draft LM and an EAGLE-3 head converted by llama.cpp's
own converter (in f16, or bf16 where the target's hidden states outgrow f16; a draft LM in the llama-quantize type its
spec's `gguf_type` names), a draft named by its GGUF served as that file is, llama.cpp's own n-gram modes as they
are, and for every other drafter the reason llama.cpp cannot serve it. Done before anything is measured, so a
model the converter cannot read fails at once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from drafters import kinds
from eval.engines import llama_cpp
from eval.engines.formats.eagle3 import llama_cpp_cannot_serve
from eval.engines.formats.writing import GGUF_OUTTYPE, draft_lm_gguf, target_directory
from traffic import models


@dataclass
class Served:
    """A drafter as llama.cpp serves it: its GGUF (none for llama.cpp's n-gram modes) and spec type, or why it
    has none."""

    name: str
    gguf: Path | None = None
    spec_type: str | None = None
    note: str | None = None
    dtype: str | None = None  # its GGUF's weights, where it has one: torch's name, or llama.cpp's type (Q4_K_M)
    p_min: float = 0.0  # its confidence stop, llama.cpp's --spec-draft-p-min (the spec's stop_below, rule drop)

    @property
    def engine_only(self) -> bool:
        """llama.cpp's own model-free speculation: measured in the engine only, draftsmith has no loop for it."""
        return self.spec_type in llama_cpp.NGRAM_TYPES

    def ks(self, ks: list[int]) -> list[int]:
        """The k it is measured at: each of `ks`, or the one llama.cpp fixes for it (ngram-cache's 8)."""
        fixed = llama_cpp.FIXED_K.get(self.spec_type)
        return [fixed] if fixed else list(ks)


# The type of the drafters' GGUFs that llama.cpp serves: f16, as deployments serve a draft (SGLang and vLLM in
# 16 bits). In float32 a one-layer head's draft step costs about twice as much against a Q4 target (c 0.2 of a
# step on SmolLM2's Q4_1 file, docs/benchmarks/smollm2.md), which would charge a draft cost no deployment pays.
# But ggml converts a matmul's activations to its weights' type, and some targets' hidden states outgrow f16
# (Gemma-3-270M's reach 10^5 from its middle layers on): an f16 head reading them drafts from inf (0 of 178
# guesses kept). Such drafters are served in bf16, whose range is float32's (`draft_dtype`).
DRAFT_DTYPE = "float16"


F16_MAX = 65504.0


@torch.inference_mode()
def draft_dtype(model, layers: list[int] | None = None) -> str:
    """DRAFT_DTYPE, or bfloat16 where `model`'s hidden states at `layers` (all of them if None: a draft LM's own)
    reach half of f16's largest value on a probe of its first-token and 31 other ids (transformers' hidden-state
    indices; the largest activations sit at the first token). SmolLM2-135M's peak there: about 25,000."""
    vocab = model.config.vocab_size
    first = model.config.bos_token_id if model.config.bos_token_id is not None else 1
    ids = torch.tensor([[first, *range(min(100, vocab - 32), min(100, vocab - 32) + 31)]],
                       device=next(model.parameters()).device)
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    peak = max(float(hidden[i].abs().max()) for i in (layers if layers is not None else range(len(hidden))))
    return DRAFT_DTYPE if peak < F16_MAX / 2 else "bfloat16"


def llama_cpp_drafter(spec: dict, target, target_name_or_path: str, work: Path) -> Served:
    """The drafter of an eval spec ({name, kind, path}) converted for llama.cpp by its own converter; kind
    `llamacpp` is one of llama.cpp's model-free n-gram modes (`spec_type`), which needs no conversion."""
    name, kind = spec["name"], spec["kind"]
    p_min = float(spec.get("stop_below") or 0.0)
    if p_min and (spec.get("stop_rule") or "propose") != "drop":
        raise ValueError(f"drafter {name!r}: llama.cpp's confidence stop (--spec-draft-p-min) does not propose the "
                         "unsure guess: give the drafter stop_rule: drop to measure the same stop in both loops")
    if kind == "llamacpp":
        if p_min:
            raise ValueError(f"drafter {name!r}: llama.cpp's n-gram modes have no confidence stop (stop_below)")
        if spec.get("spec_type") not in llama_cpp.NGRAM_TYPES:
            raise ValueError(f"drafter {name!r} (kind llamacpp): spec_type must be one of "
                             f"{sorted(llama_cpp.NGRAM_TYPES)}, got {spec.get('spec_type')!r}")
        return Served(name, spec_type=spec["spec_type"])
    out = work / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.gguf"
    if kind == "draft_lm":
        shipped, qtype = models.gguf_file(spec["path"]), spec.get("gguf_type")
        if shipped is not None and not qtype:  # the file a team deploys, served as it is (as a GGUF target is)
            return Served(name, shipped, kinds.of_lm(None).engines.llama_cpp, dtype=models.gguf_type(shipped),
                          p_min=p_min)
        directory = target_directory(spec["path"])
        lm = kinds.of_lm(AutoConfig.from_pretrained(directory))  # its kind: a draft LM's, or PARD's
        if not lm.engines.llama_cpp:
            return Served(name, note=lm.engines.llama_cpp_cannot)
        dtype = draft_dtype(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval())
        gguf = draft_lm_gguf(directory, out, dtype, target_name_or_path)
        if qtype:  # quantized from the 16-bit conversion by llama.cpp's own quantizer
            gguf, dtype = llama_cpp.quantize(gguf, out.with_name(f"{out.stem}-{qtype}.gguf"), qtype), qtype
        return Served(name, gguf, lm.engines.llama_cpp, dtype=dtype, p_min=p_min)
    if kind != "head":
        return Served(name, note="draftsmith's n-gram drafter has no llama.cpp counterpart (llama.cpp's ngram "
                                 "drafters are other algorithms)")
    head = Path(spec["path"])
    config = json.loads((head / "config.json").read_text())
    layers = config.get("feature_layers") or config.get("eagle_aux_hidden_state_layer_ids")
    dtype = draft_dtype(target, list(layers) if layers else None)
    if why := llama_cpp_cannot_serve(config):
        return Served(name, note=why)
    kind = kinds.of_head(config)  # its descriptor (drafters/kinds/): whether and how llama.cpp serves it
    if kind is None or not kind.engines.llama_cpp:
        what = config.get("draftsmith_kind") or "/".join(config.get("architectures") or ["unknown"])
        served = ", ".join(k.summary for k in kinds.kinds().values() if k.engines.llama_cpp)
        return Served(name, note=(kind and kind.engines.llama_cpp_cannot)
                      or f"a {what} head has no llama.cpp format (llama.cpp serves {served})")
    if set(config.get("architectures") or []) & set(kind.reads):  # an engine's export (SGLang's, speculators'), as is
        gguf = llama_cpp.convert_to_gguf(head, out, outtype=GGUF_OUTTYPE[dtype],
                                         target_dir=target_directory(target_name_or_path))
    else:
        gguf = kinds.function(kind.llama_cpp_gguf)(head, target, target_name_or_path, out, dtype)
    if qtype := spec.get("gguf_type"):  # quantized from the 16-bit conversion, as a draft LM is
        gguf, dtype = llama_cpp.quantize(gguf, out.with_name(f"{out.stem}-{qtype}.gguf"), qtype), qtype
    return Served(name, gguf, kind.engines.llama_cpp, dtype=dtype, p_min=p_min)


@dataclass
class Converted:
    """What llama.cpp serves: the target's GGUF and each drafter's (or why it has none)."""

    target_gguf: Path
    served: list[Served]


def convert_for_llama_cpp(drafter_specs: list[dict], target, target_name_or_path: str, work: Path) -> Converted:
    """The target and the drafters through llama.cpp's converter, into `work`: done before anything is
    measured, so a model the converter cannot read fails at once. A target given as a GGUF file is served
    as it is: the quantization the team deploys is the one measured."""
    work.mkdir(parents=True, exist_ok=True)
    llama_cpp.require()
    target_gguf = models.gguf_file(target_name_or_path) or llama_cpp.convert_to_gguf(
        target_directory(target_name_or_path), work / "target.gguf")
    served = [llama_cpp_drafter(spec, target, target_name_or_path, work) for spec in drafter_specs]
    for s in served:
        if s.note:
            print(f"llama.cpp: {s.name}: {s.note}")
    return Converted(target_gguf, served)
