"""`drafter=eagle`: EAGLE-3 (drafters/eagle.py), trained by training-time test in train/eagle3.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from drafters import eagle, eagle_export
from drafters.heads import ENGINE_EAGLE3
from drafters.kinds import DraftVocabularyConfig, Engines, Kind


@dataclass
class Eagle3Layout(DraftVocabularyConfig):
    """What an EAGLE-3 head's layer has, whichever way it drafts (`drafter=eagle` and `drafter=peagle`): fused
    low/middle/high target features, one decoder layer, a draft vocabulary. Layers default to [2, n//2, n-3] (vLLM's
    convention)."""

    # true: an output head of its own over the draft vocabulary, started from the target's rows and trained with the
    # rest (EAGLE-3's reference recipe); false: draft through the target's output head, frozen
    own_lm_head: bool = False
    intermediate_size: Optional[int] = None  # the head's MLP width; null = the target's, smaller = cheaper steps
    # EAGLE-3.1's norms (speculators' defaults, under its names): an RMS norm over the fused target features before fc
    # (norm_before_fc); the normed hidden state as the layer's residual (norm_before_residual); the final norm's output
    # handed to the next draft step (norm_output; llama.cpp's EAGLE-3 graph does not read it, vLLM's does).
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False


@dataclass
class EagleConfig(Eagle3Layout):
    """`drafter=eagle`: EAGLE-3, drafting on its own outputs, trained by training-time test (drafters/eagle.py)."""

    kind: str = "eagle"
    ttt_steps: int = 4  # the head unrolled on its own outputs for this many draft steps: as deep as it drafts (k=4)
    ttt_decay: float = 0.8  # loss weight of step s: ttt_decay ** s


def eagle3_layers(num_layers: int) -> list[int]:
    """A low, a middle and a high layer, [2, n//2, n-3] as EAGLE-3 and vLLM choose; on targets too shallow for three
    distinct layers there, [1, n//2, n-1], and on 2- or 3-layer test targets [0, n//2, n]."""
    layers = [2, num_layers // 2, num_layers - 3]
    if len(set(layers)) < 3 or min(layers) < 1:
        layers = [1, num_layers // 2, num_layers - 1]
    if len(set(layers)) < 3 or min(layers) < 1:  # very shallow (test) targets: embedding, middle, last
        layers = [0, num_layers // 2, num_layers]
    if len(set(layers)) < 3:
        raise ValueError(f"a target with {num_layers} layers is too shallow for three distinct EAGLE-3 layers")
    return layers


def output_head(d: dict) -> list:
    return ["output head", "its own, trained" if d.get("own_lm_head") else "the target's, frozen"]


def _rows(d: dict, best: dict) -> list[list]:
    rows = [["label temperature", d["label_temperature"]], ["training-time test steps", d["ttt_steps"]], output_head(d)]
    if best.get("vocabulary_coverage"):
        covered = ", ".join(f"{c} {v:.3f}" for c, v in sorted(best["vocabulary_coverage"].items()))
        rows.append(["draft vocabulary: held-out assistant tokens covered", covered])
    return rows


KIND = Kind(
    name="eagle", schema=EagleConfig, recipe="train.eagle3", summary="an EAGLE-3 head", head=eagle.HEAD,
    reads=ENGINE_EAGLE3, load_export=eagle_export.load_engine_eagle3,
    llama_cpp_gguf="eval.engines.formats.eagle3:eagle3_gguf",
    layers=eagle3_layers, aliases=("eagle3",), exporter="eval.engines.formats.eagle3:export_eagle3",
    formats=("sglang", "speculators", "gguf"), hub_root="sglang",
    tag="eagle3", library="sglang",
    engines=Engines(vllm="eagle3", vllm_format="speculators",
                    sglang="EAGLE3", gguf="eagle3.gguf", llama_cpp="draft-eagle3"),
    describe=lambda target, d, layers: (f"An EAGLE-3 draft head for `{target}`: one decoder layer reading the target's "
                                        f"hidden states at layers {layers} (inputs of those layers), drafting through "
                                        "the target's output head restricted to its draft vocabulary."),
    card_rows=lambda d, cfg, best: _rows(d, best))
