"""Ship a trained drafter: write it in the formats the serving engines load.

    python -m train.export run=runs/train/eagle/<time> 'formats=[sglang,speculators,gguf]'
    python -m train.export run=runs/train/draft_lm/<time> 'formats=[hf,gguf]'
    python -m train.export run=runs/train/eagle1/<time> 'formats=[vllm]'

A training run directory (what `python -m train` writes) holds `train_config.yaml` (the composed config:
which target, which drafter kind) and `best/` (the chosen checkpoint). Formats:

- `hf` (draft LM): plain Hugging Face weights and the target's tokenizer, LoRA already merged: what
  vLLM's and SGLang's draft-model speculation and transformers' `assistant_model` load.
- `sglang` (EAGLE-3): SGLang's `LlamaForCausalLMEagle3` (SpecForge's format): `midlayer.*`, `fc`, `norm`,
  `lm_head` (the target's output-head rows of the draft vocabulary: the head drafts through them),
  `d2t` (offsets), `t2d` (bool), no embedding. The aux layer ids are written twice, nested in SGLang's
  convention (0-based layer outputs) and top-level in vLLM's (inputs of layers, the index into Hugging
  Face's `output_hidden_states`, which is draftsmith's), with an explicit `norm_before_residual`, so
  vLLM's native `Eagle3LlamaForCausalLM` and llama.cpp's converter read the same directory.
- `speculators` (EAGLE-3): the speculators library's `Eagle3Speculator` format, which `vllm serve <dir>`
  detects: `layers.0.*` weights, the target's `embed_tokens`, and a `speculators_config` naming the verifier.
- `vllm` (EAGLE-1): vLLM's `EagleLlamaForCausalLM` (`"method": "eagle"`, the EAGLE authors' layout):
  `fc` (2d -> d, embedding first), `layers.0.*` without an input norm, no embedding or output head (vLLM
  shares the target's), a Llama config of the one layer with the target's vocabulary and RoPE. Neither
  SGLang nor llama.cpp reads this layout from a draftsmith directory: vLLM only.
- `gguf`: llama.cpp's own converter (eval/llama_cpp.py) on the `hf` or `sglang` export; an EAGLE-3 GGUF
  is converted with the target's directory, as llama.cpp requires.

With `hub.repo_id`, the export goes up to the Hugging Face Hub with a model card (train/hub.py).

The collapse guard runs before anything is written (the field's most reported export failure is a
head that loads and then accepts nothing): `d2t`/`t2d` that disagree, a draft vocabulary without the
target's EOS, aux layer ids an engine cannot capture, or a missing `fc` / output head are refused, never
overridable; a head whose recorded held-out top-1 agreement is at chance is refused unless `force=true`.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file, save_file

from train.hub import HubSettings

log = logging.getLogger(__name__)

FORMATS = ("hf", "sglang", "speculators", "vllm", "gguf")
# The formats each drafter kind can be written in. MTP and Medusa heads have none: asking for one is an
# error, never a directory an engine would misread (NO_FORMAT says why).
KIND_FORMATS = {"draft_lm": ("hf", "gguf"), "eagle": ("sglang", "speculators", "gguf"), "eagle1": ("vllm",),
                "mtp": (), "medusa": ()}
NO_FORMAT = {
    "mtp": "the engines' MTP formats are one module of the target's own architecture that the engine chains "
           "k times (speculators' `mtp`, vLLM's per-family MTP models), not draftsmith's k separate modules",
    "medusa": "vLLM dropped Medusa and speculators, SGLang and llama.cpp never had it",
}
# EAGLE-3 weights the head itself stores (the output head comes from the target, see `eagle3_tensors`).
EAGLE3_OWN = ("fc.weight", "norm.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
              "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
              *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
              *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")))
# A head's held-out top-1 agreement at most this many times a uniform guess's (1 / draft vocabulary) is
# "at chance": a head that learned nothing, or whose vocabulary maps are scrambled.
CHANCE_FACTOR = 2.0


class ExportRefused(ValueError):
    """A checkpoint the collapse guard will not export; nothing was written."""


# --- reading a training run -------------------------------------------------------------------------


@dataclass
class TrainedRun:
    """What export needs from a `python -m train` run directory."""

    path: Path
    kind: str  # draft_lm | eagle | eagle1 | mtp | medusa
    target: str  # the target's hub id, directory or toyworld:// name
    config: dict  # the run's composed config (train_config.yaml)

    @property
    def best(self) -> Path:
        return self.path / "best"


def read_run(path: str | Path) -> TrainedRun:
    """The run at `path`, checked: a config naming the target and a saved best checkpoint."""
    path = Path(path)
    config_file = path / "train_config.yaml"
    if not config_file.exists():
        raise FileNotFoundError(f"{path} is not a training run: no train_config.yaml (written by `python -m train`)")
    config = OmegaConf.to_container(OmegaConf.load(config_file))
    run = TrainedRun(path, config["drafter"]["kind"], config["target"]["name_or_path"], config)
    if not (run.best / "config.json").exists():
        raise FileNotFoundError(f"{run.best}: no saved checkpoint (config.json); did the run save a best model?")
    return run


def target_directory(name_or_path: str) -> Path:
    """A local directory holding the target's config and tokenizer (what llama.cpp's converter and
    speculators' loader read): toyworld:// and directories as they are, a hub id from the local cache or
    the Hub."""
    from traffic import toyworld

    local = Path(toyworld.resolve(name_or_path))
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name_or_path))


# --- the collapse guard -------------------------------------------------------------------------------


def check_eagle3(state: dict[str, torch.Tensor], head_config: dict, target_config, *, eos_token_id: int | None,
                 best: dict | None, force: bool = False, where: str = "head") -> torch.Tensor:
    """Refuse a head that would load and then accept nothing; return its target ids (draft id -> target id)."""
    from drafters.eagle import check_vocab_maps

    missing = [name for name in EAGLE3_OWN if name not in state]
    if missing:
        raise ExportRefused(f"{where}: weights {missing} are missing; an engine would load them as random")
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
    _refuse_at_chance(best, target_ids.numel(), "draft tokens", force=force, where=where)
    return target_ids


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
        _copy_tokenizer(target_dir, tmp)

    return write


# --- EAGLE-3 --------------------------------------------------------------------------------------------


def _rope(head_config: dict) -> dict:
    """rope_theta / rope_scaling as engines read them (transformers 5 keeps both in rope_parameters)."""
    params = dict(head_config.get("rope_parameters") or {})
    theta = params.pop("rope_theta", head_config.get("rope_theta", 10000.0))
    scaling = params if params.get("rope_type", "default") != "default" else None
    return {"rope_theta": theta, "rope_scaling": scaling}


def eagle3_tensors(head_dir: Path, target, *, best: dict | None, force: bool = False,
                   dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """The head's weights for an engine, guarded, and its config.json: the head's own weights plus
    `lm_head`, the target's output-head rows of the draft vocabulary (the head drafts through exactly
    those rows, so the engine's separate lm_head computes the same logits)."""
    head_config = json.loads((head_dir / "config.json").read_text())
    state = load_file(str(head_dir / "model.safetensors"))
    target_ids = check_eagle3(state, head_config, target.config, eos_token_id=target.config.eos_token_id,
                              best=best, force=force, where=str(head_dir))
    output = target.get_output_embeddings()
    if output is None or output.weight.shape[0] != target.config.vocab_size:
        raise ExportRefused(f"{head_dir}: the target has no output head of {target.config.vocab_size} rows to take "
                            "the draft vocabulary's lm_head from")
    tensors = {name: state[name] for name in EAGLE3_OWN}
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
        "max_position_embeddings": target_config.max_position_embeddings,
        "tie_word_embeddings": False,
        "vocab_size": target_config.vocab_size,
        "draft_vocab_size": head_config.get("draft_vocab_size") or target_config.vocab_size,
        "target_hidden_size": head_config["target_hidden_size"],
        "bos_token_id": target_config.bos_token_id,
        "eos_token_id": target_config.eos_token_id,
        "pad_token_id": target_config.pad_token_id,
        "torch_dtype": dtype,
        # Pre-norm residual (the layer adds attention to the un-normed feature), as the head is built.
        "norm_before_residual": False,
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
    transformer.update({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
                        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False})
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "torch_dtype": dtype,
        # Explicit: absent, transformers' default ties lm_head to the embedding it loads from the verifier.
        "tie_word_embeddings": False,
        "draft_vocab_size": layer["draft_vocab_size"],
        "target_hidden_size": layer["target_hidden_size"],
        # Every norm switch explicit: speculators' defaults differ from the head (norm_before_residual is
        # true when absent).
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "eagle_aux_hidden_state_layer_ids": layer["eagle_aux_hidden_state_layer_ids"],
        "transformer_layer_config": transformer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": list(target_config.architectures or [])},
        },
    }


# --- writing ----------------------------------------------------------------------------------------------


def _write_dir(out: Path, write) -> Path:
    """Run write(tmp) into a temporary sibling and rename it into place: an interrupted export never
    leaves a directory that looks complete."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "tokenizer.model"):
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


@dataclass
class ExportSettings:
    """What `export` writes: formats, dtype of the weights, and the draft length recorded for engines."""

    formats: list[str] = field(default_factory=lambda: ["auto"])  # auto = every format the kind has
    dtype: str = "float32"  # float32 | bfloat16 | float16 (the weights as written)
    num_speculative_tokens: int = 4  # the k recorded in the speculators config and the model card's commands
    force: bool = False  # export a head whose held-out agreement is at chance (a warning then)
    hub: HubSettings = field(default_factory=HubSettings)  # upload to the Hugging Face Hub (train/hub.py)


def formats_for(kind: str, requested: list[str]) -> list[str]:
    if kind not in KIND_FORMATS:
        raise ValueError(f"drafter kind {kind!r} is unknown; known: {sorted(KIND_FORMATS)}")
    allowed = KIND_FORMATS[kind]
    if not allowed:
        exportable = "; ".join(f"{k} -> {', '.join(f)}" for k, f in KIND_FORMATS.items() if f)
        raise ValueError(f"{kind} heads cannot be exported: no engine loads them ({NO_FORMAT[kind]}); "
                         f"exportable kinds: {exportable}")
    wanted = list(allowed) if list(requested) == ["auto"] else list(requested)
    unknown = [f for f in wanted if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown export formats {unknown}; known: {list(FORMATS)}")
    wrong = [f for f in wanted if f not in allowed]
    if wrong:
        raise ValueError(f"a {kind} drafter cannot be written as {wrong}: its formats are {list(allowed)}")
    return wanted


def export(run_dir: str | Path, out_dir: str | Path, settings: ExportSettings = ExportSettings()) -> dict[str, Path]:
    """Write the run's best drafter in each requested format under out_dir/<format>/; returns the paths.
    Everything is checked before the first file is written."""
    from eval.run import dtype_of, load_target

    run = read_run(run_dir)
    formats = formats_for(run.kind, settings.formats)
    dtype = dtype_of(settings.dtype)
    out = Path(out_dir)
    target, tokenizer = load_target(run.target, device=torch.device("cpu"))
    target_dir = target_directory(run.target)
    written: dict[str, Path] = {}
    if run.kind == "draft_lm":
        from transformers import AutoModelForCausalLM

        draft = AutoModelForCausalLM.from_pretrained(run.best, dtype=dtype)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ExportRefused(f"{run.best}: the draft's vocabulary ({draft.config.vocab_size}) is not the "
                                f"target's ({target.config.vocab_size}); engines require the same vocabulary")

        def write_hf(tmp: Path) -> None:
            draft.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)

        hf = _write_dir(out / "hf", write_hf)
        if "hf" in formats:
            written["hf"] = hf
        if "gguf" in formats:
            written["gguf"] = _gguf(hf, out / "gguf" / "draft.gguf", settings.dtype)
        if "hf" not in formats:
            shutil.rmtree(hf)
        return _publish(run, written, out, settings.hub, settings.num_speculative_tokens)

    best_file = run.best / "best.json"
    best = json.loads(best_file.read_text()) if best_file.exists() else None
    if run.kind == "eagle1":
        write_vllm = vllm_eagle1(run.best, target, target_dir, best=best, force=settings.force, dtype=dtype)
        written["vllm"] = _write_dir(out / "vllm", write_vllm)
        return _publish(run, written, out, settings.hub, settings.num_speculative_tokens)
    tensors, head_config = eagle3_tensors(run.best, target, best=best, force=settings.force, dtype=dtype)
    dtype_name = str(dtype).removeprefix("torch.")

    write_sglang = _sglang_writer(tensors, head_config, target.config, target_dir, dtype_name)

    def write_speculators(tmp: Path) -> None:
        config = speculators_config(head_config, target.config, run.target if not run.target.startswith("toyworld://")
                                    else str(target_dir), dtype_name, settings.num_speculative_tokens)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        renamed = {name.replace("midlayer.", "layers.0.", 1): t for name, t in tensors.items()}
        # speculators keeps the embedding in the checkpoint: absent, its loader neither reports it nor fills it
        # from the verifier (it stays uninitialised memory), so the target's is written.
        renamed["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().to(tensors["fc.weight"].dtype)
        save_file(renamed, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _copy_tokenizer(target_dir, tmp)

    sglang = _write_dir(out / "sglang", write_sglang)
    if "sglang" in formats:
        written["sglang"] = sglang
    if "speculators" in formats:
        written["speculators"] = _write_dir(out / "speculators", write_speculators)
    if "gguf" in formats:
        written["gguf"] = _gguf(sglang, out / "gguf" / "eagle3.gguf", settings.dtype, target_dir=target_dir)
    if "sglang" not in formats:
        shutil.rmtree(sglang)
    return _publish(run, written, out, settings.hub, settings.num_speculative_tokens)


def _sglang_writer(tensors: dict[str, torch.Tensor], head_config: dict, target_config, target_dir: Path, dtype: str):
    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(sglang_config(head_config, target_config, dtype), indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _copy_tokenizer(target_dir, tmp)

    return write


def eagle3_gguf(head_dir: str | Path, target, target_name_or_path: str, out_file: str | Path) -> Path:
    """A saved EAGLE-3 head (a `best/` directory of a run) as a llama.cpp GGUF: the SGLang export beside
    `out_file`, guarded as `export` guards it, then llama.cpp's converter with the target's directory.
    What `python -m eval engine=llamacpp` serves."""
    head_dir, out_file = Path(head_dir), Path(out_file)
    best_file = head_dir / "best.json"
    best = json.loads(best_file.read_text()) if best_file.exists() else None
    tensors, head_config = eagle3_tensors(head_dir, target, best=best)
    target_dir = target_directory(target_name_or_path)
    sglang = _write_dir(out_file.with_suffix(".sglang"), _sglang_writer(tensors, head_config, target.config,
                                                                        target_dir, "float32"))
    return _gguf(sglang, out_file, "float32", target_dir=target_dir)


def _publish(run: TrainedRun, written: dict[str, Path], out: Path, hub: HubSettings, k: int) -> dict[str, Path | str]:
    """With hub.repo_id: the repository staged under out/hub/ with its model card, then uploaded (or, with
    dry_run, listed)."""
    if not hub.repo_id:
        return written
    from train.hub import listing, model_card, stage, upload

    card = model_card(run, written, repo_id=hub.repo_id, license=hub.license, k=k)
    folder = stage(written, run.kind, out / "hub", card)
    if hub.dry_run:
        print(f"dry run: would upload to {hub.repo_id} ({'private' if hub.private else 'public'}"
              f"{', revision ' + hub.revision if hub.revision else ''}):")
        print("\n".join("  " + line for line in listing(folder)))
        return {**written, "hub": folder}
    url = upload(folder, hub)
    print(f"uploaded to {hub.repo_id}: {url}")
    return {**written, "hub": folder, "hub_commit": url}


def _gguf(model_dir: Path, out_file: Path, dtype: str, target_dir: Path | None = None) -> Path:
    from eval.llama_cpp import convert_to_gguf

    outtype = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[dtype]
    return convert_to_gguf(model_dir, out_file, outtype=outtype, target_dir=target_dir)


# --- python -m train.export -------------------------------------------------------------------------------


def run(cfg: DictConfig) -> dict[str, Path]:
    """What `python -m train.export` does with a composed conf/export.yaml."""
    settings = OmegaConf.to_object(cfg)  # an ExportConfig: ExportSettings plus run and out_dir
    written = export(settings.run, settings.out_dir, settings)
    for name, path in written.items():
        print(f"{name}: {path}")
    return written


@hydra.main(version_base="1.3", config_path="../conf", config_name="export")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except (ValueError, FileNotFoundError) as e:  # bad input the user can fix: say what, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    from eval.config import register  # the structured configs (eval.config imports this module)

    register()
    main()
