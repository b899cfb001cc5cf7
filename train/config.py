"""Structured configs for the training entry points (`python -m train.prepare`, `python -m train`,
`python -m train.export`): a mistyped key or a wrong type is an error. The groups they share with
`python -m eval` (`target`, `data`, `tracking`) are eval/config.py's.

Only the entry points and the recipes (train/recipe.py and its kinds) read these; the library calls
(`train.prepare.prepare`, `train.export.export`) take plain arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from drafters.kinds import DrafterConfig, kinds
from eval.config import AnyDrafterSpec, DataConfig, TargetConfig, TrackingConfig
from train.hub import HubSettings
from train.launch import register_resolver

# --- python -m train.prepare --------------------------------------------------------------------------


@dataclass
class RegenerateConfig:
    """Regeneration of every assistant turn by the target (see train/regenerate.py)."""

    enabled: bool = True  # false: keep the logged responses (when they came from this target)
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # sampled answers: keep the k likeliest (0 = all)
    top_p: float = 1.0  # sampled answers: nucleus mass
    # Sized with trainer=cpu (max_length 384) for the toy world, whose code answers rarely end: 128 covers
    # the evaluation's 64 new tokens twice. For real traffic raise it with trainer.max_length (e.g. 1024).
    max_new_tokens: int = 128
    # What writes the answers: torch (the target in PyTorch) | llamacpp (llama-server on the target's GGUF: the
    # file itself when target.name_or_path names one: the deployed quantization, faster than PyTorch on a CPU)
    engine: str = "torch"
    # Or an OpenAI-compatible server already serving the target (vLLM, SGLang, llama-server): its base URL.
    # API key from $OPENAI_API_KEY when the server wants one.
    endpoint: Optional[str] = None
    endpoint_model: Optional[str] = None  # the served model's name (null: the one the server lists)
    parallel: int = 4  # engine, endpoint: requests in flight (llama-server: its slots)
    threads: Optional[int] = None  # engine=llamacpp: llama-server threads (null: every core)


@dataclass
class HiddenStatesConfig:
    """Offline hidden-state cache (see train/hidden_states.py for the layer-index convention)."""

    kind: Optional[str] = None  # eagle1 | eagle3 | mtp | medusa: picks default layers; null = no cache
    layers: Optional[list[int]] = None  # explicit indices into output_hidden_states (overrides kind)
    dtype: str = "float16"  # float16 | bfloat16 | float32
    max_gib: Optional[float] = 20.0  # refuse to start when the estimate is larger


@dataclass
class PrepareConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    hidden_states: HiddenStatesConfig = field(default_factory=HiddenStatesConfig)
    max_length: Optional[int] = None  # context for training examples; null = the target's max positions
    batch_size: int = 8
    seed: int = 0
    device: str = "auto"
    out_dir: str = "${hydra:runtime.output_dir}"
    progress: bool = True


# --- python -m train ----------------------------------------------------------------------------------


def check_chains(drafter) -> None:
    """The depths and conditional drop P-EAGLE's and PARD's recipes train with (`num_depths`, `cod_ratio`,
    `cod_min_ratio`, `max_anchors`), checked before any work."""
    if drafter.num_depths < 1:
        raise ValueError(f"drafter.num_depths must be >= 1 (the guesses one forward drafts), got {drafter.num_depths}")
    if not 0 < drafter.cod_ratio <= 1 or not 0 <= drafter.cod_min_ratio <= 1:
        raise ValueError(f"drafter.cod_ratio must be in (0, 1] and drafter.cod_min_ratio in [0, 1], got "
                         f"{drafter.cod_ratio} and {drafter.cod_min_ratio}")
    if drafter.max_anchors < 1:
        raise ValueError(f"drafter.max_anchors must be >= 1, got {drafter.max_anchors}")


# Each kind's schema, from its descriptor (drafters/kinds/): conf/drafter/<kind>.yaml composes `<kind>_schema` from
# the ConfigStore (register()).
KINDS: dict[str, type[DrafterConfig]] = {name: k.schema for name, k in kinds().items()}
# The module whose run(cfg) trains each kind (train/__main__.py dispatches on it).
RECIPES: dict[str, str] = {name: k.recipe for name, k in kinds().items()}


def drafter_keys(kind: str) -> list[str]:
    """The keys a drafter kind has, in its schema's order."""
    return [f.name for f in fields(KINDS[kind])]


@dataclass
class TrainerConfig:
    """Optimisation, precision, checkpoints. batch_size is per process; the global batch is
    batch_size x processes x grad_accum."""

    max_steps: int = 200  # optimizer steps; 0: evaluate the starting weights only
    batch_size: int = 8
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 1e-3  # peak learning rate (AdamW), after warm-up, cosine decay after
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    warmup_steps: int = 10  # linear warm-up from 0
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    max_grad_norm: float = 1.0  # gradient clipping
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW's (beta1, beta2)
    max_length: int = 512  # training sequences are truncated to this many tokens
    # Batches of records of about one length (sorted within runs of 16 global batches, the batches then shuffled),
    # so fewer padded positions are computed; off: a plain seeded permutation per epoch (train/data.py epoch_order)
    group_by_length: bool = False
    # no | bf16 | fp16 (accelerate mixed precision) | auto: bf16 where the hardware multiplies it natively (a GPU
    # with bf16, a CPU with AVX512-BF16 or AMX), else no
    precision: str = "no"
    checkpoint_every: int = 50  # steps between resumable checkpoints
    keep_checkpoints: int = 2  # the newest N kept (best/ apart)
    eval_every: int = 50  # steps between held-out scores (the best is kept in best/)
    eval_examples: int = 64  # held-out examples for the acceptance estimate
    # Which: last (the file's last eval_examples records) | per_category (taken in turn from each category's last
    # records, so every category the file has weighs alike in the choice of checkpoint and the held-out τ)
    heldout: str = "last"
    # How the best checkpoint is chosen on them, the same for every kind (train/heldout.py): acceptance (the most
    # tokens per round when sampling, from each depth's sum_x min(p, q)) | top1 (the highest greedy τ, replayed on
    # the held-out answers)
    select_by: str = "acceptance"
    resume: str = "none"  # none | auto (newest complete checkpoint in the run dir) | a checkpoint path
    seed: int = 0
    cpu: bool = False  # train on the CPU even when a GPU is present


@dataclass
class FinalEvalConfig:
    """The evaluation instrument run at the end: off-the-shelf draft (baseline) vs the trained one."""

    enabled: bool = True
    ks: list[int] = field(default_factory=lambda: [4])
    # EAGLE-2 dynamic trees measured beside the chains (`d4t4n16`; eval/evaluate.py EvalPlan.trees), at batch 1
    trees: list[str] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=lambda: [1])  # rows decoded at once (eval/batching.py)
    max_new_tokens: int = 64
    repeats: int = 3
    prompts_per_category: int = 8  # held-out prompts measured per category
    engine: Optional[str] = None  # llamacpp: also measure the drafters in llama.cpp (eval/engines/engine.py)
    # More drafters measured beside the trained one (python -m eval's specs), after the off-the-shelf draft: the
    # baselines of a target without one (n-gram, a layer-skip self-draft, llama.cpp's own n-gram modes).
    drafters: list[AnyDrafterSpec] = field(default_factory=list)  # each one of eval/config.py SPECS' kinds


@dataclass
class ExportSettings:
    """What `export` writes: formats, dtype of the weights, and the draft length recorded for engines."""

    formats: list[str] = field(default_factory=lambda: ["auto"])  # auto = every format the kind has
    dtype: str = "float32"  # float32 | bfloat16 | float16 (the weights as written)
    num_speculative_tokens: int = 4  # the k recorded in the speculators config and the model card's commands
    force: bool = False  # export a head whose held-out agreement is at chance (a warning then)
    hub: HubSettings = field(default_factory=HubSettings)  # upload to the Hugging Face Hub (train/hub.py)



@dataclass
class TrainConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = MISSING  # one of KINDS' schemas, from conf/drafter/<kind>.yaml
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    evaluate: FinalEvalConfig = field(default_factory=FinalEvalConfig)
    # Export at the end into <run>/export/ (python -m train.export's settings); no formats = no export.
    export: ExportSettings = field(default_factory=lambda: ExportSettings(formats=[]))
    data_cache: str = "runs/prepared"  # regenerated + tokenized data, shared by runs on the same data
    # The run's directory under runs/train/<kind>/ (conf/train.yaml's hydra.run.dir). Default: the launch's start
    # time, one for every process of a multi-GPU launch (train/launch.py). Name a run to resume it: the same command
    # launched again with trainer.resume=auto finds its checkpoints.
    name: str = "${run_stamp:}"
    out_dir: str = "${hydra:runtime.output_dir}"
    progress: bool = True


# --- python -m train.export ---------------------------------------------------------------------------


@dataclass
class ExportConfig(ExportSettings):
    """`python -m train.export`: which run and where to, plus the settings of train.export.export."""

    run: str = MISSING  # a `python -m train` run directory
    out_dir: str = "${run}/export"


def register() -> None:
    """Store the training entry points' schemas (conf/prepare.yaml's `prepare_schema`, conf/train.yaml's
    `train_schema`, conf/export.yaml's `export_schema`) and each drafter kind's (`drafter/<kind>_schema`,
    which conf/drafter/<kind>.yaml composes) in Hydra's ConfigStore, and the `${run_stamp:}` resolver."""
    register_resolver()
    cs = ConfigStore.instance()
    cs.store(name="prepare_schema", node=PrepareConfig)
    for kind, schema in KINDS.items():
        cs.store(group="drafter", name=f"{kind}_schema", node=schema)
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="export_schema", node=ExportConfig)
