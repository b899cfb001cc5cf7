"""An EAGLE-3 head (drafters/eagle.py) read back from the formats the engines load: SGLang's
`LlamaForCausalLMEagle3` (SpecForge's, or draftsmith's `sglang` export) and speculators' `Eagle3Speculator`
(eval/engines/formats/eagle3.py writes both), as drafters/registry.py `load_head` reads a directory of either (and
drafters/peagle.py a P-EAGLE export, through `load_engine_eagle3`). The head is built with the export's own RoPE
(drafters/heads.py `export_rope`) and norm switches (`export_norms`, where SpecForge's `norm_output` means another
thing than speculators' and the engines'), and keeps an output head of its own where the export carries one.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from drafters.eagle import NORM_FLAGS, Eagle3, check_vocab_maps
from drafters.heads import beside, export_rope, head_config, load_engine_state

log = logging.getLogger(__name__)


def export_norms(raw: dict) -> dict:
    """The head's norm switches for an export's config.json, where `norm_output` has two meanings. speculators' (and
    the engines'): EAGLE-3.1's, the final norm's output is what the output head reads AND what the next draft step gets
    (speculators/models/eagle3/core.py, Eagle3DraftModel.forward). SpecForge 0.2.0's (LlamaForCausalLMEagle3.
    compute_logits in specforge/modeling/draft/llama3_eagle.py): only whether lm_head reads norm(h), true when absent;
    the next step always gets `backbone`'s un-normed output (the TTT loop of specforge/algorithms/eagle3/model.py). So
    SpecForge's true is plain EAGLE-3 and its false an output head on the un-normed state (`head_norm` false). Its
    class reads neither norm_before_fc nor norm_before_residual, which draftsmith's sglang export writes (with the
    engines' norm_output, eval/engines/formats/eagle3.py): a LlamaForCausalLMEagle3 with neither is read as SpecForge's."""
    specforge = "LlamaForCausalLMEagle3" in (raw.get("architectures") or [])
    if specforge and not {"norm_before_fc", "norm_before_residual"} & set(raw):
        return {"norm_before_fc": False, "norm_before_residual": False, "norm_output": False,
                "head_norm": bool(raw.get("norm_output", True))}
    return {flag: bool(raw.get(flag, False)) for flag in NORM_FLAGS}


def load_engine_eagle3(path, raw: dict, target, dtype: torch.dtype | None = None, cls: type = Eagle3,
                       kind: str = "eagle", settings: dict | None = None) -> Eagle3:
    """An EAGLE-3 head from an engine-format export (SGLang's LlamaForCausalLMEagle3 or speculators'
    Eagle3Speculator, as eval/engines/formats/eagle3.py writes them), attached to `target`. `cls`, `kind` and `settings`:
    a head built on EAGLE-3's (P-EAGLE, drafters/peagle.py), its kind and its own settings.

    An export carries the output head the head drafts through as its `lm_head`: the target's rows of the draft
    vocabulary (the head then shares the target's, as draftsmith heads do by default), or an output head of its
    own (`drafter.own_lm_head`, or a head trained elsewhere, as EAGLE-3's reference recipe trains one), which the
    head then keeps and drafts through, as the engines do. Its RoPE and norm switches are the export's own
    (`export_rope`, `export_norms`): what the engines and the trainer's class build the head with.
    """
    path = Path(path)
    state = load_file(str(path / "model.safetensors"))
    state = {name.replace("layers.0.", "midlayer.", 1): t for name, t in state.items()}
    layer = raw.get("transformer_layer_config", raw)  # speculators nests the layer's geometry
    layers = raw.get("eagle_aux_hidden_state_layer_ids")  # top level: vLLM's convention, draftsmith's
    if layers is None:
        raise ValueError(f"{path}/config.json: no top-level eagle_aux_hidden_state_layer_ids (vLLM's convention); "
                         "cannot tell which target layers the head reads")
    if raw.get("fc_norm", False):
        raise ValueError(f"{path}/config.json: fc_norm=true heads (a norm per auxiliary layer) are not supported")
    if (raw.get("target_hidden_size") or target.config.hidden_size) != target.config.hidden_size:  # null: the draft's
        raise ValueError(f"{path}/config.json: target_hidden_size {raw['target_hidden_size']} is not the target's "
                         f"{target.config.hidden_size}")
    if "d2t" not in state:  # a head over the whole vocabulary: vLLM's form carries no maps (identity)
        size = raw.get("draft_vocab_size") or layer.get("vocab_size") or target.config.vocab_size
        if size != target.config.vocab_size:
            raise ValueError(f"{path}/model.safetensors: no d2t, but its draft vocabulary of {size} tokens is not the "
                             f"target's {target.config.vocab_size}: the maps between draft and target ids are missing")
        state["d2t"] = torch.zeros(size, dtype=torch.long)
        state["t2d"] = torch.ones(size, dtype=torch.bool)
    draft_vocab = state["d2t"].numel()
    lm_head = state.get("lm_head.weight")
    if lm_head is None:
        raise ValueError(f"{path}/model.safetensors: no lm_head; an EAGLE-3 export carries the output head its head "
                         "drafts through")
    target_ids = check_vocab_maps(state["d2t"], state["t2d"])
    weight = target.get_output_embeddings().weight.detach()  # on the target's device (a GPU), the file's on the CPU
    shared = weight[target_ids.to(weight.device)].to(lm_head.device)
    if lm_head.shape != shared.shape:
        raise ValueError(f"{path}/model.safetensors: lm_head is {tuple(lm_head.shape)}, expected {tuple(shared.shape)} "
                         "(a row per draft token, the head's width)")
    own = not torch.equal(lm_head, shared.to(lm_head.dtype))
    if not own:
        state.pop("lm_head.weight")
    rope = export_rope(raw)  # the RoPE the engines and the trainer's own class build the head's attention with
    if rope is None:
        log.info("%s/config.json carries no RoPE (rope_parameters, rope_theta, rope_scaling): the head takes the "
                 "target's", path)
    config = head_config(target.config, kind, list(layers), intermediate_size=layer["intermediate_size"], rope=rope,
                         draft_vocab_size=draft_vocab if draft_vocab < target.config.vocab_size else None,
                         ttt_steps=1, ttt_decay=1.0, own_lm_head=own, **export_norms(raw), **(settings or {}))
    head = cls(config)
    embed = state.pop("embed_tokens.weight", None)  # speculators stores the target's; SGLang's format has none
    if embed is not None and not torch.equal(embed, target.get_input_embeddings().weight.detach().to(embed)):
        raise ValueError(f"{path}: embed_tokens is not the target's embedding; draftsmith drafts with the target's")
    load_engine_state(head, state, path)
    return beside(head, target, dtype)
