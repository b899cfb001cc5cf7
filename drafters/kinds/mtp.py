"""`drafter=mtp`: DeepSeek-V3's multi-token prediction (drafters/mtp.py), trained by train/heads.py."""

from __future__ import annotations

from dataclasses import dataclass

from drafters import mtp
from drafters.kinds import HeadConfig, Kind
from drafters.kinds.eagle1 import last_layer


@dataclass
class MtpConfig(HeadConfig):
    """`drafter=mtp`: DeepSeek-V3 multi-token prediction, chained modules sharing the target's embedding and
    output head (drafters/mtp.py)."""

    kind: str = "mtp"
    depth: int = 3  # modules; a round drafts min(k, depth) tokens
    module_decay: float = 0.8  # loss weight of module k: module_decay ** (k-1)


KIND = Kind(
    name="mtp", schema=MtpConfig, recipe="train.heads", summary="multi-token prediction modules", head=mtp.HEAD,
    layers=last_layer,
    no_format="the engines' MTP formats are one module of the target's own architecture that the engine chains k "
              "times (speculators' `mtp`, vLLM's per-family MTP models), not draftsmith's k separate modules")
