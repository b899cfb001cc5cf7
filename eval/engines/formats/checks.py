"""The collapse guard: before anything is written, it refuses a head an engine would load and then accept nothing
from (the field's most reported export failure).

It refuses `d2t`/`t2d` that disagree, a draft vocabulary without the target's EOS, aux layer ids an engine cannot
capture, or a missing `fc` / output head, never overridable; a head whose recorded held-out top-1 agreement is at
chance is refused unless `force=true`. `check_eagle3` guards the EAGLE-3 exports (eval/engines/formats/eagle3.py),
`check_eagle1` the EAGLE-1 one (eval/engines/formats/eagle1.py); the DFlash export's checks (eval/engines/formats/dflash.py)
share `check_draft_vocabulary`, `_refuse_activation` and `_refuse_at_chance`.
"""

from __future__ import annotations

import logging

import torch

from drafters.eagle import check_vocab_maps

log = logging.getLogger(__name__)

# EAGLE-3 weights the head itself stores (and `lm_head.weight` where it owns its output head, see `eagle3_tensors`).
EAGLE3_OWN = ("fc.weight", "norm.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
              "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
              *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
              *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")))
# A head's held-out top-1 agreement at most this many times a uniform guess's (1 / draft vocabulary) is
# "at chance": a head that learned nothing, or whose vocabulary maps are scrambled.
CHANCE_FACTOR = 2.0


class ExportRefused(ValueError):
    """A checkpoint the collapse guard will not export; nothing was written."""


def check_draft_vocabulary(state: dict[str, torch.Tensor], target_config, *, eos_token_id: int | list | None,
                           where: str) -> torch.Tensor:
    """Refuse a head's draft vocabulary (`d2t`, `t2d`) that an engine would read wrong: maps that disagree, a
    `t2d` not over the target's vocabulary, a vocabulary without the target's EOS. Return its target ids."""
    try:
        target_ids = check_vocab_maps(state["d2t"], state["t2d"])
    except ValueError as e:
        raise ExportRefused(f"{where}: {e}") from None
    if state["t2d"].numel() != target_config.vocab_size:
        raise ExportRefused(f"{where}: t2d covers {state['t2d'].numel()} tokens but the target has "
                            f"{target_config.vocab_size}")
    for eos in [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or []):
        if not bool(state["t2d"][eos]):
            raise ExportRefused(f"{where}: the draft vocabulary lacks the target's EOS token {eos}: the head could "
                                "never propose the end of an answer")
    return target_ids


def draft_vocabulary_rows(target, target_ids: torch.Tensor, dtype: torch.dtype, where: str) -> torch.Tensor:
    """The target's output-head rows of a draft vocabulary: the `lm_head` an engine gives a head that drafts
    through exactly those rows (its own separate lm_head then computes the same logits)."""
    output = target.get_output_embeddings()
    if output is None or output.weight.shape[0] != target.config.vocab_size:
        raise ExportRefused(f"{where}: the target has no output head of {target.config.vocab_size} rows to take the "
                            "draft vocabulary's lm_head from")
    return output.weight.detach()[target_ids.to(output.weight.device)].to(dtype).cpu()


def check_eagle3(state: dict[str, torch.Tensor], head_config: dict, target_config, *, eos_token_id: int | None,
                 best: dict | None, force: bool = False, where: str = "head") -> torch.Tensor:
    """Refuse a head that would load and then accept nothing; return its target ids (draft id -> target id)."""
    missing = [name for name in EAGLE3_OWN if name not in state]
    if missing:
        raise ExportRefused(f"{where}: weights {missing} are missing; an engine would load them as random")
    _refuse_activation(head_config, where)
    # SpecForge's norm_output=false, as drafters/eagle_export.py export_norms reads it
    if not head_config.get("head_norm", True):
        raise ExportRefused(f"{where}/config.json: head_norm is false (an output head on the un-normed state), which "
                            "neither the engines' EAGLE-3 nor its norm_output can express")
    target_ids = check_draft_vocabulary(state, target_config, eos_token_id=eos_token_id, where=where)
    n = target_config.num_hidden_layers
    layers = list(head_config["feature_layers"])
    bad = [i for i in layers if not 1 <= i <= n - 1]
    if bad:
        raise ExportRefused(f"{where}: aux hidden-state layers {layers} (indices into output_hidden_states) include "
                            f"{bad}, outside 1..{n - 1}: engines capture the inputs of layers 1..{n - 1} of a "
                            f"{n}-layer target, not the embedding (0) or the normed last state ({n})")
    expected_fc = (head_config["hidden_size"], len(layers) * head_config["target_hidden_size"])
    if tuple(state["fc.weight"].shape) != expected_fc:
        raise ExportRefused(f"{where}: fc.weight is {tuple(state['fc.weight'].shape)}, expected {expected_fc}")
    if head_config.get("own_lm_head") and "lm_head.weight" not in state:
        raise ExportRefused(f"{where}: config.json says own_lm_head but lm_head.weight is missing; an engine would "
                            "load it as random")
    expected_lm_head = (target_ids.numel(), head_config["hidden_size"])
    if "lm_head.weight" in state and tuple(state["lm_head.weight"].shape) != expected_lm_head:
        raise ExportRefused(f"{where}: lm_head.weight is {tuple(state['lm_head.weight'].shape)}, expected "
                            f"{expected_lm_head} (the draft vocabulary's rows)")
    _refuse_at_chance(best, target_ids.numel(), "draft tokens", force=force, where=where)
    return target_ids


def _refuse_activation(head_config: dict, where: str) -> None:
    """Refuse a head whose layer's MLP is not SiLU (saved by a draftsmith that took the target's activation):
    vLLM's and SGLang's Llama block refuse it, and llama.cpp's EAGLE-3 graph computes SiLU whatever the file
    says (src/models/eagle3.cpp), which would draft with another function than the one measured."""
    act = head_config.get("hidden_act", "silu")
    if act != "silu":
        raise ExportRefused(f"{where}: the head's MLP activation is {act!r}; the engines' EAGLE layers compute SiLU "
                            "(vLLM and SGLang refuse another, llama.cpp ignores it). Train it again: heads use SiLU "
                            "whatever the target's activation")


def _refuse_at_chance(best: dict | None, vocabulary: int, what: str, *, force: bool, where: str) -> None:
    """Refuse (unless forced) a head whose recorded held-out top-1 agreement is at most CHANCE_FACTOR times a
    uniform guess over the `vocabulary` tokens it drafts from."""
    if best is None or best.get("top1") is None:
        return
    chance = CHANCE_FACTOR / vocabulary
    if best["top1"] <= chance:
        message = (f"{where}: held-out top-1 agreement {best['top1']:.4f} is at chance (<= {chance:.4f}, "
                   f"{CHANCE_FACTOR:g}x a uniform guess over {vocabulary} {what})")
        if not force:
            raise ExportRefused(message + "; export it anyway with force=true")
        log.warning("%s; exporting because force=true", message)


EAGLE1_OWN = ("fc.weight", "layer.post_attention_layernorm.weight",
              *(f"layer.self_attn.{p}_proj.weight" for p in "qkvo"),
              *(f"layer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")))


def check_eagle1(state: dict[str, torch.Tensor], head_config: dict, target_config, *, best: dict | None,
                 force: bool = False, where: str = "head") -> None:
    """Refuse an EAGLE-1 head vLLM would load into something else than the head that was measured."""
    missing = [name for name in EAGLE1_OWN if name not in state]
    if missing:
        raise ExportRefused(f"{where}: weights {missing} are missing; an engine would load them as random")
    _refuse_activation(head_config, where)
    if head_config.get("input_norm", True):
        raise ExportRefused(f"{where}: this head has a norm before its layer's attention (saved by a draftsmith "
                            "before the layer lost it); vLLM's EAGLE-1 layer has none: train it again")
    n = target_config.num_hidden_layers
    if list(head_config["feature_layers"]) != [n]:
        raise ExportRefused(f"{where}: the head reads layers {head_config['feature_layers']}; vLLM hands an EAGLE-1 "
                            f"head the target's last (normed) state, [{n}]")
    d = target_config.hidden_size
    if head_config["hidden_size"] != d or tuple(state["fc.weight"].shape) != (d, 2 * d):
        raise ExportRefused(f"{where}: fc.weight is {tuple(state['fc.weight'].shape)}, vLLM's EAGLE-1 fc is ({d}, {2 * d})")
    _refuse_at_chance(best, target_config.vocab_size, "tokens", force=force, where=where)
