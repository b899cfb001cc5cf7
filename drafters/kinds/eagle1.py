"""`drafter=eagle1`: EAGLE-1 (drafters/eagle1.py), trained by train/heads.py."""

from __future__ import annotations

from dataclasses import dataclass

from drafters import eagle1
from drafters.heads import ENGINE_EAGLE1
from drafters.kinds import Engines, HeadConfig, Kind


@dataclass
class Eagle1Config(HeadConfig):
    """`drafter=eagle1`: EAGLE-1, the last hidden state and the token embedding through fc, one decoder layer
    (drafters/eagle1.py)."""

    kind: str = "eagle1"
    token_loss_weight: float = 0.1  # feature regression (smooth L1) + this x token cross-entropy


def last_layer(num_layers: int) -> list[int]:
    """The target's last hidden state, [n]: what EAGLE-1, MTP and Medusa read."""
    return [num_layers]


KIND = Kind(
    name="eagle1", schema=Eagle1Config, recipe="train.heads", summary="an EAGLE-1 head", head=eagle1.HEAD,
    reads=ENGINE_EAGLE1, load_export=eagle1.load_engine_eagle1,
    layers=last_layer, exporter="eval.engines.formats.eagle1:export_eagle1",
    formats=("vllm",), hub_root="vllm", tag="eagle", library="vllm", engines=Engines(vllm="eagle", vllm_format="vllm"),
    describe=lambda target, d, layers: (f"An EAGLE-1 draft head for `{target}`: one decoder layer extrapolating the "
                                        "target's last (normed) hidden state from it and the next token's embedding, "
                                        "drafting through the target's own embedding and output head."),
    card_rows=lambda d, cfg, best: [["token loss weight (beside the feature regression)", d["token_loss_weight"]]])
