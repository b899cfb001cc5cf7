"""Ship a trained drafter: write it in the formats the serving engines load.

    python -m train.export run=runs/train/eagle/<time> 'formats=[sglang,speculators,gguf]'
    python -m train.export run=runs/train/draft_lm/<time> 'formats=[hf,gguf]'
    python -m train.export run=runs/train/eagle1/<time> 'formats=[vllm]'

A training run directory (what `python -m train` writes) holds `train_config.yaml` (the composed config:
which target, which drafter kind) and `best/` (the chosen checkpoint). Formats, each described with its
layout in eval/engines/formats/, which writes them (and which `python -m eval engine=llamacpp` uses to
serve a run's head in llama.cpp):

- `hf` (draft LM): plain Hugging Face weights and the target's tokenizer, LoRA already merged;
- `sglang`, `speculators` (EAGLE-3): SGLang's `LlamaForCausalLMEagle3` and the speculators library's
  `Eagle3Speculator`;
- `vllm` (EAGLE-1): vLLM's `EagleLlamaForCausalLM`;
- `gguf`: llama.cpp's own converter on the `hf` or `sglang` export.

With `hub.repo_id`, the export goes up to the Hugging Face Hub with a model card (train/hub.py).

The collapse guard (eval/engines/formats/checks.py) runs before anything is written: a head that would load and
then accept nothing is refused, never overridable; a head whose recorded held-out top-1 agreement is at
chance is refused unless `force=true`.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from drafters import kinds
from eval.engines.formats.writing import ExportJob
from eval.run import dtype_of, load_target, target_source
from train.config import ExportSettings, register
from train.hub import HubSettings, listing, model_card, stage, upload

log = logging.getLogger(__name__)

FORMATS = ("hf", "sglang", "speculators", "vllm", "dflash", "gguf")

# --- reading a training run -------------------------------------------------------------------------


@dataclass
class TrainedRun:
    """What export needs from a `python -m train` run directory."""

    path: Path
    kind: str  # drafter.kind: one of drafters/kinds/
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
    """The formats to write for a drafter of `kind`: those requested (["auto"]: all its descriptor's), checked. A kind
    without formats (MTP, Medusa) is an error saying why, never a directory an engine would misread."""
    described = kinds.kind(kind)
    allowed = described.formats
    if not allowed:
        exportable = "; ".join(f"{k.name} -> {', '.join(k.formats)}" for k in kinds.kinds().values() if k.formats)
        raise ValueError(f"{kind} heads cannot be exported: no engine loads them ({described.no_format}); "
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
    """Write the run's best drafter in each requested format under out_dir/<format>/ (its kind's exporter,
    eval/engines/formats/); returns the paths. Everything is checked before the first file is written."""
    run = read_run(run_dir)
    formats = formats_for(run.kind, settings.formats)
    described = kinds.kind(run.kind)
    # A head trained on the target's ends alone (drafter.target_weights=ends) exports from them: its formats read the
    # target's config, embedding and output head.
    weights = run.config["drafter"].get("target_weights", "all")
    target, tokenizer = load_target(run.target, device=torch.device("cpu"), weights=weights)
    best_file = run.best / "best.json"
    job = ExportJob(best=run.best, best_record=json.loads(best_file.read_text()) if best_file.exists() else None,
                    target=target, tokenizer=tokenizer, target_name=run.target, dtype=dtype_of(settings.dtype),
                    k=settings.num_speculative_tokens, force=settings.force)
    written = kinds.function(described.exporter)(job, formats, Path(out_dir))
    return _publish(run, written, Path(out_dir), settings.hub, settings.num_speculative_tokens)


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
