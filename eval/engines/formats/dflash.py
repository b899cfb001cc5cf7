"""The `dflash` export of a DFlash drafter: z-lab's `DFlashDraftModel` layout, which vLLM's `qwen3_dflash.py` and
llama.cpp's converter read: a flat Qwen3 config of the drafter's layers with `block_size` and `dflash_config`
(`mask_token_id`, and `target_layer_ids` as 0-based layer outputs, draftsmith's feature layers less one), the weights
under the drafter's own names (`fc`, `hidden_norm`, `layers.{i}.*`, `norm`; no `model.` prefix, no embedding or
output head: both engines take the target's), the target's tokenizer. A drafter with a draft vocabulary adds
`draft_vocab_size` and, as EAGLE-3's export does, `d2t` (offsets), `t2d` and `lm_head` (the target's rows of the
draft vocabulary, which it drafts through). Its `gguf` (`dflash_gguf`) is llama.cpp's converter on it, with the
target's directory, as llama.cpp requires."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eval.engines.formats.checks import (ExportRefused, _refuse_activation, _refuse_at_chance, check_draft_vocabulary,
                                         draft_vocabulary_rows)
from eval.engines.formats.writing import ExportJob, _rope, copy_tokenizer, target_directory, write_dir, write_gguf

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
    tensors = {name: state[name] for name in expected}
    if "d2t" in state and state["d2t"].numel() < target.config.vocab_size:  # a draft vocabulary (drafter.draft_vocab_*)
        target_ids = check_draft_vocabulary(state, target.config, eos_token_id=target.config.eos_token_id, where=where)
        # The drafter drafts through the target's rows of its vocabulary: the engines read them as its own lm_head
        # (vLLM's DFlash sizes lm_head by draft_vocab_size and keeps a head of another shape than the target's).
        tensors.update(d2t=state["d2t"], t2d=state["t2d"],
                       **{"lm_head.weight": draft_vocabulary_rows(target, target_ids, state["fc.weight"].dtype, where)})
        _refuse_at_chance(best, target_ids.numel(), "draft tokens", force=force, where=where)
    else:
        _refuse_at_chance(best, target.config.vocab_size, "target tokens", force=force, where=where)
    if dtype is not None:
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    return {k: v.contiguous() for k, v in tensors.items()}, head_config


# llama.cpp's converter reads a draft vocabulary (`d2t`, written as absolute target ids; `t2d` dropped) only in its
# class for DSpark, DFlash with an optional Markov head on the same DFLASH architecture; its DFlash class cannot map
# `d2t`. Without the Markov head the runtime graph is DFlash's (`src/models/dflash.cpp` scatters the block's logits
# through `d2t`), so a drafter with a draft vocabulary is converted as that class and served as `draft-dflash`.
LLAMA_CPP_ARCHITECTURE = {False: "DFlashDraftModel", True: "DSparkDraftModel"}


def dflash_config(head_config: dict, target_config, dtype: str, architecture: str = "DFlashDraftModel") -> dict:
    """config.json of z-lab's `DFlashDraftModel` (a Qwen3 config of the drafter's layers), as vLLM 0.33's
    `qwen3_dflash.py` and llama.cpp's converter (`conversion/qwen.py`) read it; with a draft vocabulary,
    `draft_vocab_size` (vLLM sizes the drafter's own `lm_head` by it and scatters its logits through `d2t`)."""
    n = head_config["num_layers"]
    draft_vocab = head_config.get("draft_vocab_size") or target_config.vocab_size
    return {
        "architectures": [architecture],
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
        **({"draft_vocab_size": draft_vocab} if draft_vocab < target_config.vocab_size else {}),
        "dflash_config": {"mask_token_id": head_config["mask_token_id"],
                          "target_layer_ids": [i - 1 for i in head_config["feature_layers"]]},
        "torch_dtype": dtype,
    }


def dflash_writer(tensors: dict[str, torch.Tensor], head_config: dict, target_config, target_dir: Path, dtype: str,
                  architecture: str = "DFlashDraftModel"):
    """The writer of the `dflash` export (`dflash_tensors`): its weights, its config and the target's tokenizer."""
    def write(tmp: Path) -> None:
        config = dflash_config(head_config, target_config, dtype, architecture)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        copy_tokenizer(target_dir, tmp)

    return write


def _gguf(tensors: dict[str, torch.Tensor], head_config: dict, target_config, target_dir: Path, dtype: str,
          out_file: Path) -> Path:
    """llama.cpp's converter, with the target's directory as it requires, on the drafter written beside `out_file`
    for the converter class that reads it (`LLAMA_CPP_ARCHITECTURE`)."""
    architecture = LLAMA_CPP_ARCHITECTURE["d2t" in tensors]
    source = write_dir(out_file.with_suffix(".dflash"), dflash_writer(tensors, head_config, target_config, target_dir,
                                                                       dtype, architecture))
    return write_gguf(source, out_file, dtype, target_dir=target_dir)


def dflash_gguf(head_dir: str | Path, target, target_name_or_path: str, out_file: str | Path,
                dtype: str = "float32") -> Path:
    """A saved DFlash drafter as a llama.cpp GGUF: guarded (`dflash_tensors`), then llama.cpp's converter (`_gguf`).
    What `python -m eval engine=llamacpp` serves."""
    head_dir, out_file = Path(head_dir), Path(out_file)
    best_file = head_dir / "best.json"
    best = json.loads(best_file.read_text()) if best_file.exists() else None
    tensors, head_config = dflash_tensors(head_dir, target, best=best)
    return _gguf(tensors, head_config, target.config, target_directory(target_name_or_path), dtype, out_file)


def export_dflash(job: ExportJob, formats: list[str], out: Path) -> dict[str, Path]:
    """A DFlash drafter as the `dflash` format and its `gguf` under `out`."""
    tensors, head_config = dflash_tensors(job.best, job.target, best=job.best_record, force=job.force, dtype=job.dtype)
    written = {}
    if "dflash" in formats:
        written["dflash"] = write_dir(out / "dflash", dflash_writer(tensors, head_config, job.target.config,
                                                                    job.target_dir, job.dtype_name))
    if "gguf" in formats:
        gguf = out / "gguf" / "dflash.gguf"
        written["gguf"] = _gguf(tensors, head_config, job.target.config, job.target_dir, job.dtype_name, gguf)
        shutil.rmtree(gguf.with_suffix(".dflash"))  # the converter's input, written for it alone
    return written
