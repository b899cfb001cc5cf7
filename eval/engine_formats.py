"""A drafter in the formats the serving engines load, and the collapse guard that refuses, before anything
is written, a head an engine would load and then accept nothing from (the field's most reported export
failure). `python -m train.export` (train/export.py) writes a training run's drafter in them; `python -m
eval engine=llamacpp` (eval/engine.py) serves a trained EAGLE-3 head in llama.cpp through them.

- `hf` (draft LM): plain Hugging Face weights and the target's tokenizer, LoRA already merged: what
  vLLM's and SGLang's draft-model speculation and transformers' `assistant_model` load (the model's own
  `save_pretrained`, in train/export.py).
- `sglang` (EAGLE-3): SGLang's `LlamaForCausalLMEagle3` (SpecForge's format): `midlayer.*`, `fc`, `norm`,
  `lm_head` (the head's own output head, or the target's rows of the draft vocabulary it drafts through),
  `d2t` (offsets), `t2d` (bool), no embedding. The aux layer ids are written twice, nested in SGLang's
  convention (0-based layer outputs) and top-level in vLLM's (inputs of layers, the index into Hugging
  Face's `output_hidden_states`, which is draftsmith's), with an explicit `norm_before_residual`, so
  vLLM's native `Eagle3LlamaForCausalLM` and llama.cpp's converter read the same directory.
- `speculators` (EAGLE-3): the speculators library's `Eagle3Speculator` format, which `vllm serve <dir>`
  detects: `layers.0.*` weights, the target's `embed_tokens`, and a `speculators_config` naming the verifier. A
  P-EAGLE head (drafters/peagle.py) is written as its `PEagleSpeculator` (`speculators_model_type: "peagle"`, the
  `mask_token_id`, `mask_hidden` (1, 1, L*d) in the weights), which vLLM serves as `eagle3` with
  `parallel_drafting`.
- `vllm` (EAGLE-1): vLLM's `EagleLlamaForCausalLM` (`"method": "eagle"`, the EAGLE authors' layout):
  `fc` (2d -> d, embedding first), `layers.0.*` without an input norm, no embedding or output head (vLLM
  shares the target's), a Llama config of the one layer with the target's vocabulary and RoPE. Neither
  SGLang nor llama.cpp reads this layout from a draftsmith directory: vLLM only.
- `dflash` (DFlash): z-lab's `DFlashDraftModel` layout, which vLLM's `qwen3_dflash.py` and llama.cpp's converter
  read: a flat Qwen3 config of the drafter's layers with `block_size` and `dflash_config` (`mask_token_id`, and
  `target_layer_ids` as 0-based layer outputs, draftsmith's feature layers less one), the weights under the
  drafter's own names (`fc`, `hidden_norm`, `layers.{i}.*`, `norm`; no `model.` prefix, no embedding or output
  head: both engines take the target's), the target's tokenizer.
- `gguf`: llama.cpp's own converter (eval/llama_cpp.py) on the `hf`, `sglang` or `dflash` export; an EAGLE-3 or
  DFlash GGUF is converted with the target's directory, as llama.cpp requires.

The guard refuses `d2t`/`t2d` that disagree, a draft vocabulary without the target's EOS, aux layer ids an
engine cannot capture, or a missing `fc` / output head, never overridable; a head whose recorded held-out
top-1 agreement is at chance is refused unless `force=true`.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from drafters.eagle import NORM_FLAGS, check_vocab_maps
from eval.llama_cpp import convert_to_gguf
from traffic import models

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


def target_directory(name_or_path: str) -> Path:
    """A local directory holding the target's config and tokenizer (what llama.cpp's converter and
    speculators' loader read): toyworld:// and directories as they are, a GGUF file's dequantized
    directory (traffic/models.py), a hub id from the local cache or the Hub."""
    local = Path(models.resolve(name_or_path))
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download  # only where a hub id is fetched

    return Path(snapshot_download(name_or_path))


# --- the collapse guard -------------------------------------------------------------------------------


def check_eagle3(state: dict[str, torch.Tensor], head_config: dict, target_config, *, eos_token_id: int | None,
                 best: dict | None, force: bool = False, where: str = "head") -> torch.Tensor:
    """Refuse a head that would load and then accept nothing; return its target ids (draft id -> target id)."""
    missing = [name for name in EAGLE3_OWN if name not in state]
    if missing:
        raise ExportRefused(f"{where}: weights {missing} are missing; an engine would load them as random")
    _refuse_activation(head_config, where)
    if not head_config.get("head_norm", True):  # SpecForge's norm_output=false, as drafters/eagle.py export_norms reads
        raise ExportRefused(f"{where}/config.json: head_norm is false (an output head on the un-normed state), which "
                            "neither the engines' EAGLE-3 nor its norm_output can express")
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


def vllm_eagle1(head_dir: Path, target, target_dir: Path, *, best: dict | None, force: bool, dtype: torch.dtype):
    """The writer of the `vllm` export of an EAGLE-1 head, guarded before it is returned."""
    head_config = json.loads((head_dir / "config.json").read_text())
    state = load_file(str(head_dir / "model.safetensors"))
    check_eagle1(state, head_config, target.config, best=best, force=force, where=str(head_dir))
    tc = target.config
    config = {
        "architectures": ["EagleLlamaForCausalLM"],  # what vLLM makes of LlamaForCausalLM with method "eagle"
        "model_type": "llama",
        "num_hidden_layers": 1,
        **{key: head_config[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                             "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act")},
        **_rope(head_config),
        "max_position_embeddings": tc.max_position_embeddings,
        "vocab_size": tc.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": tc.bos_token_id,
        "eos_token_id": tc.eos_token_id,
        "pad_token_id": tc.pad_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    tensors = {name.replace("layer.", "layers.0.", 1): state[name].to(dtype).contiguous() for name in EAGLE1_OWN}

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        copy_tokenizer(target_dir, tmp)

    return write


# --- EAGLE-3 --------------------------------------------------------------------------------------------


def _rope(head_config: dict) -> dict:
    """rope_theta / rope_scaling as engines read them (transformers 5 keeps both in rope_parameters)."""
    params = dict(head_config.get("rope_parameters") or {})
    theta = params.pop("rope_theta", head_config.get("rope_theta", 10000.0))
    scaling = params if params.get("rope_type", "default") != "default" else None
    return {"rope_theta": theta, "rope_scaling": scaling}


def eagle3_tensors(head_dir: Path, target, *, best: dict | None, force: bool = False,
                   dtype: torch.dtype | None = None, k: int | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """The head's weights for an engine, guarded, and its config.json: the head's own weights plus
    `lm_head`: its own output head where it trained one (`drafter.own_lm_head`), else the target's output-head
    rows of the draft vocabulary (the head drafts through exactly those rows, so the engine's separate lm_head
    computes the same logits). A P-EAGLE head's `mask_hidden` too, and its depths checked against k, the draft
    length the export records."""
    head_config = json.loads((head_dir / "config.json").read_text())
    state = load_file(str(head_dir / "model.safetensors"))
    target_ids = check_eagle3(state, head_config, target.config, eos_token_id=target.config.eos_token_id,
                              best=best, force=force, where=str(head_dir))
    tensors = {name: state[name] for name in EAGLE3_OWN}
    if head_config.get("draftsmith_kind") == "peagle":  # P-EAGLE's stand-in for the features at depth >= 1
        fused = len(head_config["feature_layers"]) * head_config["target_hidden_size"]
        if tuple(state.get("mask_hidden", torch.empty(0)).shape) != (1, 1, fused):
            raise ExportRefused(f"{head_dir}: mask_hidden is missing or not (1, 1, {fused}); vLLM refuses a P-EAGLE "
                                "head without it (and speculators would fill it at random)")
        if k is not None and k > head_config["num_depths"]:
            raise ExportRefused(f"{head_dir}: num_speculative_tokens={k} is more than the {head_config['num_depths']} "
                                "depths the P-EAGLE head was trained on: an engine would draft the rest from depths "
                                "it never learned")
        tensors["mask_hidden"] = state["mask_hidden"]
    if "input_norm.weight" in state:  # EAGLE-3.1's norm over the fused features (norm_before_fc)
        tensors["input_norm.weight"] = state["input_norm.weight"]
    if "lm_head.weight" in state:  # its own, trained with the rest
        tensors["lm_head.weight"] = state["lm_head.weight"]
    else:
        output = target.get_output_embeddings()
        if output is None or output.weight.shape[0] != target.config.vocab_size:
            raise ExportRefused(f"{head_dir}: the target has no output head of {target.config.vocab_size} rows to "
                                "take the draft vocabulary's lm_head from")
        tensors["lm_head.weight"] = output.weight.detach()[target_ids].to(state["fc.weight"].dtype)
    if dtype is not None:
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    return {k: v.contiguous() for k, v in tensors.items()}, head_config


def sglang_config(head_config: dict, target_config, dtype: str) -> dict:
    """config.json of SGLang's LlamaForCausalLMEagle3, with vLLM's top-level aux ids beside it."""
    layers = list(head_config["feature_layers"])
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": head_config["hidden_size"],
        "intermediate_size": head_config["intermediate_size"],
        "num_attention_heads": head_config["num_attention_heads"],
        "num_key_value_heads": head_config["num_key_value_heads"],
        "head_dim": head_config["head_dim"],
        "rms_norm_eps": head_config["rms_norm_eps"],
        "hidden_act": head_config["hidden_act"],
        **_rope(head_config),
        # The head's RoPE whole as well (transformers 5's name): rope_theta/rope_scaling drop keys such as GPT-NeoX's
        # partial_rotary_factor, and draftsmith's loader (drafters/heads.py export_rope) replays what this carries.
        **({"rope_parameters": head_config["rope_parameters"]} if head_config.get("rope_parameters") else {}),
        "max_position_embeddings": target_config.max_position_embeddings,
        "tie_word_embeddings": False,
        "vocab_size": target_config.vocab_size,
        "draft_vocab_size": head_config.get("draft_vocab_size") or target_config.vocab_size,
        "target_hidden_size": head_config["target_hidden_size"],
        "bos_token_id": target_config.bos_token_id,
        "eos_token_id": target_config.eos_token_id,
        "pad_token_id": target_config.pad_token_id,
        "torch_dtype": dtype,
        # EAGLE-3.1's norms, as the head is built (off: EAGLE-3's pre-norm residual, un-normed fc input and
        # hand-over between draft steps).
        **{flag: bool(head_config.get(flag, False)) for flag in NORM_FLAGS},
        # vLLM's convention, read first by vLLM and llama.cpp: the input of layer i.
        "eagle_aux_hidden_state_layer_ids": layers,
        # SGLang's: 0-based layer outputs (it adds 1 itself).
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers], "use_aux_hidden_state": True},
    }


def speculators_config(head_config: dict, target_config, verifier: str, dtype: str, k: int) -> dict:
    """config.json of speculators' Eagle3Speculator (vLLM serves the directory directly)."""
    layer = sglang_config(head_config, target_config, dtype)
    transformer = {key: layer[key] for key in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "rms_norm_eps", "hidden_act", "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size",
        "bos_token_id", "eos_token_id", "pad_token_id")}
    if "rope_parameters" in layer:  # the head's RoPE whole (sglang_config), where speculators builds the layer from
        transformer["rope_parameters"] = layer["rope_parameters"]
    transformer.update({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
                        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False})
    peagle = head_config.get("draftsmith_kind") == "peagle"
    if peagle:  # vLLM's Llama EAGLE-3 sizes mask_hidden by this, else by 3 (llama_eagle3.py)
        transformer["num_aux_hidden_states"] = len(layer["eagle_aux_hidden_state_layer_ids"])
    return {
        "architectures": ["PEagleSpeculator" if peagle else "Eagle3Speculator"],
        "speculators_model_type": "peagle" if peagle else "eagle3",
        "speculators_version": "0.9.0",
        "torch_dtype": dtype,
        # Explicit: absent, transformers' default ties lm_head to the embedding it loads from the verifier.
        "tie_word_embeddings": False,
        "draft_vocab_size": layer["draft_vocab_size"],
        "target_hidden_size": layer["target_hidden_size"],
        # Every norm switch explicit: speculators' defaults differ from a head's (norm_before_residual is true
        # when absent).
        **{flag: layer[flag] for flag in NORM_FLAGS},
        "fc_norm": False,
        "eagle_aux_hidden_state_layer_ids": layer["eagle_aux_hidden_state_layer_ids"],
        "transformer_layer_config": transformer,
        # P-EAGLE: the token its mask entries carry (vLLM's pard_token); speculators records the depths trained as
        # the draft length, which a serving command's num_speculative_tokens may lower.
        **({"mask_token_id": head_config["mask_token_id"]} if peagle else {}),
        "speculators_config": {
            "algorithm": "peagle" if peagle else "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": head_config["num_depths"] if peagle else k,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": list(target_config.architectures or [])},
        },
    }


# --- DFlash ---------------------------------------------------------------------------------------------

DFLASH_OWN = ("fc.weight", "hidden_norm.weight", "norm.weight")
DFLASH_LAYER = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                "self_attn.k_norm.weight", *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
                *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")))


def dflash_tensors(head_dir: Path, target, *, best: dict | None, force: bool = False,
                   dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """A DFlash drafter's weights for the engines, guarded, and its config.json: every weight it owns, under the
    names the z-lab layout gives them (draftsmith's own)."""
    head_config = json.loads((head_dir / "config.json").read_text())
    state = load_file(str(head_dir / "model.safetensors"))
    where, n = str(head_dir), target.config.num_hidden_layers
    expected = [*DFLASH_OWN, *(f"layers.{i}.{name}" for i in range(head_config["num_layers"]) for name in DFLASH_LAYER)]
    missing = [name for name in expected if name not in state]
    if missing:
        raise ExportRefused(f"{where}: weights {missing[:4]} are missing; an engine would load them as random")
    _refuse_activation(head_config, where)
    layers = list(head_config["feature_layers"])
    if not all(1 <= i <= n - 1 for i in layers) or layers != sorted(set(layers)):
        raise ExportRefused(f"{where}: feature layers {layers} must be increasing and within 1..{n - 1}: the "
                            f"engines hand DFlash the outputs of decoder layers 0..{n - 2} of a {n}-layer target, "
                            "in layer order")
    if head_config["hidden_size"] != target.config.hidden_size:
        raise ExportRefused(f"{where}: a DFlash drafter is as wide as its target in llama.cpp and vLLM")
    if not 0 <= head_config["mask_token_id"] < target.config.vocab_size:
        raise ExportRefused(f"{where}: mask_token_id {head_config['mask_token_id']} is not a row of the target's "
                            "embedding")
    _refuse_at_chance(best, target.config.vocab_size, "target tokens", force=force, where=where)
    tensors = {name: state[name] for name in expected}
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    return {k: v.contiguous() for k, v in tensors.items()}, head_config


def dflash_config(head_config: dict, target_config, dtype: str) -> dict:
    """config.json of z-lab's `DFlashDraftModel` (a Qwen3 config of the drafter's layers), as vLLM 0.33's
    `qwen3_dflash.py` and llama.cpp's converter (`conversion/qwen.py`) read it."""
    n = head_config["num_layers"]
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": head_config["hidden_size"],
        "num_hidden_layers": n,
        "num_attention_heads": head_config["num_attention_heads"],
        "num_key_value_heads": head_config["num_key_value_heads"],
        "head_dim": head_config.get("head_dim") or head_config["hidden_size"] // head_config["num_attention_heads"],
        "intermediate_size": head_config["intermediate_size"],
        "hidden_act": "silu",
        "rms_norm_eps": head_config["rms_norm_eps"],
        **_rope(head_config),  # rope_theta written out: vLLM's DFlash falls back to 1e6 without it
        "max_position_embeddings": head_config["max_position_embeddings"],
        "vocab_size": target_config.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * n,
        "use_sliding_window": False,
        "sliding_window": None,
        "block_size": head_config["block_size"],
        "num_target_layers": target_config.num_hidden_layers,
        "target_hidden_size": head_config["target_hidden_size"],
        "dflash_config": {"mask_token_id": head_config["mask_token_id"],
                          "target_layer_ids": [i - 1 for i in head_config["feature_layers"]]},
        "torch_dtype": dtype,
    }


def dflash_writer(tensors: dict[str, torch.Tensor], head_config: dict, target_config, target_dir: Path, dtype: str):
    """The writer of the `dflash` export (`dflash_tensors`): its weights, its config and the target's tokenizer."""
    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(dflash_config(head_config, target_config, dtype), indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        copy_tokenizer(target_dir, tmp)

    return write


def dflash_gguf(head_dir: str | Path, target, target_name_or_path: str, out_file: str | Path,
                dtype: str = "float32") -> Path:
    """A saved DFlash drafter as a llama.cpp GGUF: the `dflash` export beside `out_file`, guarded, then llama.cpp's
    converter with the target's directory (`--target-model-dir`). What `python -m eval engine=llamacpp` serves."""
    head_dir, out_file = Path(head_dir), Path(out_file)
    best_file = head_dir / "best.json"
    best = json.loads(best_file.read_text()) if best_file.exists() else None
    tensors, head_config = dflash_tensors(head_dir, target, best=best)
    target_dir = target_directory(target_name_or_path)
    exported = write_dir(out_file.with_suffix(".dflash"), dflash_writer(tensors, head_config, target.config,
                                                                         target_dir, "float32"))
    return write_gguf(exported, out_file, dtype, target_dir=target_dir)


# --- writing ----------------------------------------------------------------------------------------------


def write_dir(out: Path, write) -> Path:
    """Run write(tmp) into a temporary sibling and rename it into place: an interrupted export never
    leaves a directory that looks complete."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer files of the model directory `src` that exist, into `dst`."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "tokenizer.model"):
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


def sglang_writer(tensors: dict[str, torch.Tensor], head_config: dict, target_config, target_dir: Path, dtype: str):
    """The writer of the `sglang` export of an EAGLE-3 head (`eagle3_tensors`): its weights, its config and the
    target's tokenizer."""
    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(sglang_config(head_config, target_config, dtype), indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        copy_tokenizer(target_dir, tmp)

    return write


def speculators_writer(tensors: dict[str, torch.Tensor], head_config: dict, target, verifier: str, target_dir: Path,
                       dtype: str, k: int):
    """The writer of the `speculators` export of an EAGLE-3 head (`eagle3_tensors`): its layer renamed to
    speculators' `layers.0.*`, the target's embedding, and a config naming `verifier` and the draft length k."""
    def write(tmp: Path) -> None:
        config = speculators_config(head_config, target.config, verifier, dtype, k)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        renamed = {name.replace("midlayer.", "layers.0.", 1): t for name, t in tensors.items()}
        # speculators keeps the embedding in the checkpoint: absent, its loader neither reports it nor fills it
        # from the verifier (it stays uninitialised memory), so the target's is written.
        renamed["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().to(tensors["fc.weight"].dtype)
        save_file(renamed, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        copy_tokenizer(target_dir, tmp)

    return write


def llama_cpp_cannot_serve(head_config: dict) -> str | None:
    """Why llama.cpp would draft other tokens than an EAGLE-3 head does (its config), or None where it drafts the
    same: llama.cpp's EAGLE-3 graph (src/models/eagle3.cpp) hands the layer's un-normed output to its next draft
    step."""
    if head_config.get("norm_output"):
        return ("an EAGLE-3.1 head with norm_output hands the normed state to its next draft step, which llama.cpp's "
                "EAGLE-3 graph does not do: it would draft other tokens there (export it as sglang or speculators: "
                "vLLM and SGLang serve it)")
    return None


def eagle3_gguf(head_dir: str | Path, target, target_name_or_path: str, out_file: str | Path,
                dtype: str = "float32") -> Path:
    """A saved EAGLE-3 head (a `best/` directory of a run) as a llama.cpp GGUF, its weights in `dtype`: the
    SGLang export beside `out_file`, guarded as every export is, then llama.cpp's converter with the target's
    directory. What `python -m eval engine=llamacpp` serves."""
    head_dir, out_file = Path(head_dir), Path(out_file)
    best_file = head_dir / "best.json"
    best = json.loads(best_file.read_text()) if best_file.exists() else None
    tensors, head_config = eagle3_tensors(head_dir, target, best=best)
    if why := llama_cpp_cannot_serve(head_config):
        raise ExportRefused(f"{head_dir}: {why}")
    target_dir = target_directory(target_name_or_path)
    sglang = write_dir(out_file.with_suffix(".sglang"), sglang_writer(tensors, head_config, target.config,
                                                                       target_dir, "float32"))
    return write_gguf(sglang, out_file, dtype, target_dir=target_dir)


GGUF_OUTTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # torch dtype name -> the converter's


def write_gguf(model_dir: Path, out_file: Path, dtype: str, target_dir: Path | None = None) -> Path:
    """The `hf` or `sglang` export in `model_dir` through llama.cpp's converter, its weights in `dtype`."""
    return convert_to_gguf(model_dir, out_file, outtype=GGUF_OUTTYPE[dtype], target_dir=target_dir)


def draft_lm_gguf(model_dir: Path, out_file: Path, dtype: str, target_name_or_path: str) -> Path:
    """A draft LM's GGUF by llama.cpp's converter (`write_gguf`); for a target given as a GGUF file, with that
    file's vocabulary, which llama-server requires of a draft (`with_tokenizer_of`)."""
    gguf = write_gguf(model_dir, out_file, dtype)
    if (served := models.gguf_file(target_name_or_path)) is not None:
        with_tokenizer_of(gguf, served)
    return gguf


def with_tokenizer_of(gguf_file: str | Path, source: str | Path) -> bool:
    """Give `gguf_file`, a draft LM llama.cpp's converter wrote, the tokenizer metadata of `source`, the target's
    GGUF as the team serves it, where their tokenizer models differ; every other field and every tensor is kept.
    Returns whether it rewrote the file.

    llama-server drafts only with a draft whose vocabulary type is the target's. A draft LM shares the target's
    tokens, but it is converted from the Hugging Face directory transformers dequantizes the target's GGUF into,
    which has no SentencePiece `tokenizer.model`: Gemma-3's converter then writes a BPE vocabulary, where the
    shipped file has a SentencePiece one, and llama-server refuses the pair. The target's own token list, scores
    and types are the draft's (same ids, same texts), so they are copied over by the `gguf` package's own
    metadata rewriter (`gguf_new_metadata.copy_with_new_metadata`)."""
    import gguf  # only where a GGUF file is written
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    gguf_file = Path(gguf_file)
    draft, target = gguf.GGUFReader(gguf_file), gguf.GGUFReader(source)
    model = "tokenizer.ggml.model"
    if model not in draft.fields or model not in target.fields \
            or draft.fields[model].contents() == target.fields[model].contents():
        return False
    before, after = draft.fields[model].contents(), target.fields[model].contents()
    tokenizer = {f.name: MetadataDetails(f.types[0], f.contents(),
                                         sub_type=f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
                 for f in target.fields.values() if f.name.startswith("tokenizer.")}
    dropped = [name for name in draft.fields if name.startswith("tokenizer.") and name not in tokenizer]
    partial = gguf_file.with_name(gguf_file.name + ".partial")
    writer = gguf.GGUFWriter(partial, arch=draft.fields["general.architecture"].contents(), endianess=draft.endianess)
    if "general.alignment" in draft.fields:
        writer.data_alignment = draft.fields["general.alignment"].contents()
    copy_with_new_metadata(draft, writer, tokenizer, dropped)
    partial.replace(gguf_file)
    log.info("%s: the target's tokenizer (%s, from %s) in place of the converter's (%s)", gguf_file, after, source,
             before)
    return True
