"""`drafter=peagle`: P-EAGLE, EAGLE-3's layer drafting k guesses in one forward from mask entries
(drafters/peagle.py), trained on every depth at once by train/peagle.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from drafters import peagle
from drafters.heads import ENGINE_PEAGLE
from drafters.kinds import Engines, Kind
from drafters.kinds.eagle import Eagle3Layout, eagle3_layers, output_head
from drafters.kinds.pard import chain_rows
from drafters.parallel import COD_MIN_RATIO, COD_RATIO, MAX_ANCHORS


@dataclass
class PEagleConfig(Eagle3Layout):
    """`drafter=peagle`: P-EAGLE, EAGLE-3's layer drafting k guesses in one forward from mask entries, trained on
    every depth at once (drafters/peagle.py). Its defaults are speculators' P-EAGLE recipe."""

    kind: str = "peagle"
    num_depths: int = 8  # depths trained, and the most guesses one forward drafts (k up to this)
    # the token the mask entries carry (its row of the target's embedding); null: the tokenizer's mask token, else
    # the first embedding row no token uses, else pad, end-of-sequence, unknown (as for DFlash)
    mask_token_id: Optional[int] = None
    cod_ratio: float = COD_RATIO  # conditional drop: depth d keeps max(cod_ratio ** d, cod_min_ratio) of the anchors
    cod_min_ratio: float = COD_MIN_RATIO
    max_anchors: int = MAX_ANCHORS  # anchors per sequence the deeper depths are drawn from (all stay at depth 0)


KIND = Kind(
    name="peagle", schema=PEagleConfig, recipe="train.peagle", summary="a P-EAGLE head (k guesses in one forward)",
    head=peagle.HEAD, reads=ENGINE_PEAGLE,
    load_export=peagle.load_engine_peagle, parallel=True, layers=eagle3_layers,
    exporter="eval.engines.formats.eagle3:export_eagle3", formats=("speculators",), hub_root="speculators", tag="p-eagle",
    library="vllm",
    engines=Engines(vllm="eagle3", vllm_format="speculators", vllm_extra=', "parallel_drafting": true',
                    llama_cpp_cannot="a P-EAGLE head drafts k tokens in one forward from mask entries, which "
                                     "llama.cpp's EAGLE-3 graph does not do; vLLM serves it (eagle3 with "
                                     "parallel_drafting)"),
    describe=lambda target, d, layers: (f"A P-EAGLE draft head for `{target}`: EAGLE-3's decoder layer reading the "
                                        f"target's hidden states at layers {layers} (inputs of those layers), drafting "
                                        f"up to {d.get('num_depths')} tokens in one forward from mask entries (the "
                                        "mask token and a learned `mask_hidden`), through the target's output head "
                                        "restricted to its draft vocabulary."),
    card_rows=lambda d, cfg, best: [["label temperature", d["label_temperature"]], *chain_rows(d), output_head(d)])
