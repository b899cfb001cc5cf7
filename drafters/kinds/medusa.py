"""`drafter=medusa`: Medusa heads (drafters/medusa.py), trained by train/heads.py."""

from __future__ import annotations

from dataclasses import dataclass

from drafters import medusa
from drafters.kinds import HeadConfig, Kind
from drafters.kinds.eagle1 import last_layer


@dataclass
class MedusaConfig(HeadConfig):
    """`drafter=medusa`: K residual heads on the last hidden state, the target frozen (drafters/medusa.py)."""

    kind: str = "medusa"
    num_heads: int = 4  # head i predicts token t+i+1; a round drafts min(k, num_heads) tokens
    num_layers: int = 1  # residual blocks per head
    head_decay: float = 0.8  # loss weight of head i: head_decay ** (i-1)


KIND = Kind(
    name="medusa", schema=MedusaConfig, recipe="train.heads", summary="Medusa heads", head=medusa.HEAD,
    layers=last_layer, no_format="vLLM dropped Medusa and speculators, SGLang and llama.cpp never had it")
