"""The `vllm` export of an EAGLE-1 head: vLLM's `EagleLlamaForCausalLM` (`"method": "eagle"`, the EAGLE authors'
layout): `fc` (2d -> d, embedding first), `layers.0.*` without an input norm, no embedding or output head (vLLM
shares the target's), a Llama config of the one layer with the target's vocabulary and RoPE. Neither SGLang nor
llama.cpp reads this layout from a draftsmith directory: vLLM only. Guarded by `check_eagle1` (eval/engines/formats/checks.py)
before it is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eval.engines.formats.checks import EAGLE1_OWN, check_eagle1
from eval.engines.formats.writing import ExportJob, _rope, copy_tokenizer, write_dir


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


def export_eagle1(job: ExportJob, formats: list[str], out: Path) -> dict[str, Path]:
    """An EAGLE-1 head as vLLM's `vllm` format under `out`."""
    write = vllm_eagle1(job.best, job.target, job.target_dir, best=job.best_record, force=job.force, dtype=job.dtype)
    return {"vllm": write_dir(out / "vllm", write)}
