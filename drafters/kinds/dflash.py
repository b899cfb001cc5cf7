"""`drafter=dflash`: DFlash, a block of guesses in one forward from several layers' features (drafters/dflash.py),
trained by train/dflash.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from drafters import dflash
from drafters.kinds import DraftVocabularyConfig, Engines, Kind


@dataclass
class DFlashConfig(DraftVocabularyConfig):
    """`drafter=dflash`: DFlash, a block of guesses in one forward from several layers' features (drafters/dflash.py).
    Its defaults and objective are SpecForge's DFlash recipe, the loss decay speculators'."""

    kind: str = "dflash"
    num_layers: int = 1  # decoder layers of the drafter (SpecForge's default; z-lab's Qwen3-8B drafter has 5)
    block_size: int = 5  # the anchor and block_size - 1 masked positions: serve at k = block_size - 1
    # the token the masked positions carry (its row of the target's embedding); null: the tokenizer's mask token,
    # else the first embedding row no token uses, else pad, end-of-sequence, unknown (SpecForge's order)
    mask_token_id: Optional[int] = None
    loss_decay_gamma: Optional[float] = 4.0  # block position j's loss weighs exp(-(j-1)/gamma); null: all alike
    max_anchors: int = 256  # blocks trained per sequence, drawn from its answer's positions (SpecForge: 512)
    # all of the target's vocabulary by default (z-lab's drafters); a share, a size or a coverage keeps the most
    # frequent tokens, as EAGLE-3's does, and vLLM and llama.cpp read the maps
    draft_vocab_share: Optional[float] = None


def dflash_layers(num_layers: int) -> list[int]:
    """Up to five layers evenly spaced from 2 to n-2 (decoder layers 1 .. n-3, SpecForge's build_target_layer_ids;
    on targets under 6 layers 1 to n-1), never the last: transformers hands it over final-normed, which no engine
    gives a drafter."""
    if num_layers < 2:
        raise ValueError(f"a target with {num_layers} layer has no layer before its last for DFlash to read")
    low, high = (2, num_layers - 2) if num_layers >= 6 else (1, num_layers - 1)  # shallow (test) targets: all
    count = min(5, high - low + 1)
    return sorted({round(low + i * (high - low) / max(count - 1, 1)) for i in range(count)})


KIND = Kind(
    name="dflash", schema=DFlashConfig, recipe="train.dflash", summary="a DFlash drafter (a block in one forward)",
    head=dflash.HEAD, parallel=True, layers=dflash_layers, llama_cpp_gguf="eval.engines.formats.dflash:dflash_gguf",
    exporter="eval.engines.formats.dflash:export_dflash",
    formats=("dflash", "gguf"), hub_root="dflash",
    tag="dflash", library="vllm",
    engines=Engines(vllm="dflash", vllm_format="dflash", gguf="dflash.gguf", llama_cpp="draft-dflash"),
    describe=lambda target, d, layers: (f"A DFlash drafter for `{target}`: {d.get('num_layers')} decoder layer(s) "
                                        f"reading the target's hidden states at layers {layers} (inputs of those "
                                        f"layers) that draft a block of {d.get('block_size', 1) - 1} tokens in one "
                                        "forward, through the target's embedding and output head."),
    card_rows=lambda d, cfg, best: [["label temperature", d["label_temperature"]],
                                    ["block size (serve at k = block size - 1)", d["block_size"]],
                                    ["loss decay over the block (gamma)", d["loss_decay_gamma"]]])
