"""Structured configs for the Hydra entry points: a mistyped key or a wrong type is an error.

Only the `__main__` entry points read these; the library (`eval.evaluate`, `drafters`) takes plain
arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class TargetConfig:
    """The model being accelerated."""

    name: str = MISSING  # short name; for the built-in world also its preset (toy, tiny)
    name_or_path: str = MISSING  # hub id, local directory, or toyworld://<preset>/target
    off_the_shelf_draft: Optional[str] = None  # the draft users would pick without draftsmith
    dtype: str = "float32"  # float32 | bfloat16 | float16
    trust_remote_code: bool = False  # never on unless the user turns it on


@dataclass
class DataConfig:
    """Company traffic: JSONL/Parquet path, glob or hub dataset id (see README, "Company logs")."""

    path: str = MISSING  # training traffic
    eval_path: Optional[str] = None  # held-out traffic for evaluation; defaults to `path`
    split: str = "train"  # split name for hub datasets
    on_bad_record: str = "error"  # error | skip
    max_prompts_per_category: Optional[int] = None  # first N per category (None = all)
    max_prompt_tokens: int = 1024  # longer prompts are an error naming the record


@dataclass
class DrafterSpec:
    """A drafter to measure. kind: draft_lm (a causal LM at `path`) or ngram (prompt lookup)."""

    name: str = MISSING
    kind: str = MISSING
    path: Optional[str] = None
    max_ngram: int = 3
    min_ngram: int = 1


@dataclass
class TrackingConfig:
    """Weights & Biases; offline when WANDB_API_KEY is not set."""

    wandb: bool = False
    project: str = "draftsmith"
    entity: Optional[str] = None


@dataclass
class EvalConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafters: list[DrafterSpec] = field(default_factory=list)  # the first is the baseline
    ks: list[int] = field(default_factory=lambda: [2, 4])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    repeats: int = 3
    warmup: int = 1
    seed: int = 0
    pays_off_at: float = 1.05  # measured speed-up needed for the verdict "pays off"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: Optional[int] = None  # torch intra-op threads (None = torch's default)
    out_dir: str = "${hydra:runtime.output_dir}"
    progress: bool = True
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


def register() -> None:
    ConfigStore.instance().store(name="eval_schema", node=EvalConfig)
