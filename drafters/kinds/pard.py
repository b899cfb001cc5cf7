"""`drafter=pard`: PARD, a draft LM that guesses k tokens in one forward from appended mask tokens
(drafters/pard.py), trained by train/pard.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from drafters.kinds import Engines, Kind
from drafters.kinds.draft_lm import DraftLMConfig, lm_rows
from drafters.pard import PardLM, pard_settings
from drafters.parallel import COD_MIN_RATIO, COD_RATIO, MAX_ANCHORS


@dataclass
class PardConfig(DraftLMConfig):
    """`drafter=pard`: PARD, the draft LM trained to guess k tokens in one forward from k - 1 appended mask tokens
    (drafters/pard.py, train/pard.py): the draft LM recipe's objectives, on PARD's rows. Its defaults are PARD's."""

    kind: str = "pard"
    num_depths: int = 8  # depths trained (the bonus token's guess and num_depths - 1 masks): k up to this
    # the token the masks carry (a row of the draft's embedding, trained with it); null: the tokenizer's mask token,
    # else the first embedding row no token uses, else pad, end-of-sequence, unknown (as for DFlash)
    mask_token_id: Optional[int] = None
    cod_ratio: float = COD_RATIO  # conditional drop: depth d keeps max(cod_ratio ** d, cod_min_ratio) of the anchors
    cod_min_ratio: float = COD_MIN_RATIO
    max_anchors: int = MAX_ANCHORS  # anchors per sequence the deeper depths are drawn from (all stay at depth 0)


def chain_rows(d: dict) -> list[list]:
    """The model-card rows of a kind trained on every depth at once (PARD, P-EAGLE)."""
    return [["depths trained (k up to)", d["num_depths"]],
            ["conditional drop: depth d keeps", f"max({d['cod_ratio']}^d, {d['cod_min_ratio']}) of the anchors"]]


KIND = Kind(
    name="pard", schema=PardConfig, recipe="train.pard", summary="PARD, a draft LM guessing k tokens in one forward",
    lm=PardLM, recognizes=lambda config: pard_settings(config) is not None, parallel=True,
    exporter="eval.engines.formats.writing:export_lm", formats=("hf",), hub_root="hf", tag="pard", library="transformers",
    engines=Engines(vllm="draft_model", vllm_format="hf", vllm_extra=', "parallel_drafting": true',
                    llama_cpp_cannot="a PARD draft guesses k tokens in one forward from mask tokens, which llama.cpp "
                                     "does not do (its draft-simple would run it one token at a time, another drafter "
                                     "than the one measured); vLLM serves it (draft_model with parallel_drafting)"),
    describe=lambda target, d, layers: (f"A PARD draft model for `{target}`, sharing its tokenizer: it guesses up to "
                                        f"{d.get('num_depths')} tokens in one forward from appended mask tokens "
                                        "(`pard_token` in its config)."),
    card_rows=lambda d, cfg, best: chain_rows(d) + lm_rows(d, cfg))
