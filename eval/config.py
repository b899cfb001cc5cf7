"""Structured configs for the Hydra entry points (`python -m eval`, `python -m train.prepare`,
`python -m train`): a mistyped key or a wrong type is an error.

Only the `__main__` entry points read these; the library (`eval.evaluate`, `drafters`) takes plain
arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from eval.engine import EngineCosts
from eval.evaluate import EvalPlan
from train.export import ExportSettings


@dataclass
class TargetConfig:
    """The model being accelerated."""

    name: str = MISSING  # short name; for the built-in world also its preset (toy, tiny)
    name_or_path: str = MISSING  # hub id, local directory, or toyworld://<preset>/target
    off_the_shelf_draft: Optional[str] = None  # the draft users would pick without draftsmith
    dtype: str = "float32"  # float32 | bfloat16 | float16
    trust_remote_code: bool = False  # never on unless the user turns it on
    chat_template: Optional[str] = None  # a Jinja template (or a path to one) for tokenizers without one


@dataclass
class DataConfig:
    """Company traffic: JSONL/Parquet path, glob or hub dataset id (see README, "Company logs")."""

    path: str = MISSING  # training traffic
    # Held-out traffic for evaluation. null: `python -m eval` measures `path` (the built-in world: its held-out
    # eval.jsonl) and `python -m train` the last trainer.eval_examples records it held out of `path`.
    eval_path: Optional[str] = None
    split: str = "train"  # split name for hub datasets
    on_bad_record: str = "error"  # error | skip
    format: Optional[str] = None  # chat | pair | sharegpt | questions | alpaca | prompt (traffic/formats.py); null: detected per file
    reasoning: str = "keep"  # keep | drop: assistant reasoning (reasoning_content or an inline <think> block)
    max_prompts_per_category: Optional[int] = None  # evaluation: first N prompts per category (None = all)
    max_records: Optional[int] = None  # training and preparation: first N records (None = all)
    max_prompt_tokens: int = 1024  # longer prompts are an error naming the record


@dataclass
class DrafterSpec:
    """A drafter to measure. kind: draft_lm (a causal LM at `path`), head (a trained EAGLE / MTP /
    Medusa head at `path`, as `python -m train` saves it) or ngram (prompt lookup)."""

    name: str = MISSING
    kind: str = MISSING
    path: Optional[str] = None
    lean: bool = True  # draft_lm: Llama-family models draft on the lean decode path (false: Hugging Face's forward)
    # draft_lm, head: end a round at the first guess the drafter gives a probability below this (the guess
    # is still proposed); 0 = always draft k. Lossless either way (drafters/base.py).
    stop_below: float = 0.0
    max_ngram: int = 3
    min_ngram: int = 1
    engine_c: Optional[float] = None  # c measured for this drafter in your engine (overrides engine_costs.c)


@dataclass
class TrackingConfig:
    """Weights & Biases; offline when WANDB_API_KEY is not set."""

    wandb: bool = False
    project: str = "draftsmith"
    entity: Optional[str] = None


@dataclass
class EvalConfig(EvalPlan):
    """`python -m eval`: the measurement plan (fields of eval.evaluate.EvalPlan, defaults there) plus
    what to load and where to write."""

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafters: list[DrafterSpec] = field(default_factory=list)  # the first is the baseline
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: Optional[int] = None  # torch intra-op threads (None = torch's default); the engine's too
    # Measure the drafters inside a serving engine too (eval/engine.py): llamacpp (built by `make llama-cpp`)
    engine: Optional[str] = None
    # Or: c and beta measured in an engine that cannot run here, for a predicted per-category verdict there
    engine_costs: EngineCosts = field(default_factory=EngineCosts)
    out_dir: str = "${hydra:runtime.output_dir}"
    progress: bool = True
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


@dataclass
class RegenerateConfig:
    """Regeneration of every assistant turn by the target (see train/regenerate.py)."""

    enabled: bool = True  # false: keep the logged responses (when they came from this target)
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    # Sized with trainer=cpu (max_length 384) for the toy world, whose code answers rarely end: 128 covers
    # the evaluation's 64 new tokens twice. For real traffic raise it with trainer.max_length (e.g. 1024).
    max_new_tokens: int = 128


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


@dataclass
class LoraSettings:
    """LoRA through peft; merged into the weights when the drafter is saved."""

    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: str = "all-linear"


@dataclass
class OnPolicySettings:
    """On-policy data: sequences sampled from the draft, scored by the target (GKD, DistillSpec)."""

    ratio: float = 0.0  # share of training steps on draft samples (0 = off-policy only)
    max_new_tokens: int = 64
    temperature: float = 1.0


@dataclass
class DrafterConfig:
    """What to train. kind: draft_lm (a standalone draft LM; train/distill.py) or a head on the
    target's hidden states: eagle (EAGLE-3), eagle1, mtp, medusa (train/heads.py). Each
    conf/drafter/<kind>.yaml sets the fields its kind reads."""

    kind: str = MISSING
    # draft_lm
    init_from: Optional[str] = None  # hub id or directory of the model to start from
    loss: str = "forward_kl"  # sft | forward_kl | reverse_kl | jsd | tvd
    temperature: float = 1.0  # distillation temperature (both sides)
    beta: float = 0.5  # JSD(beta)
    target_logits: str = "online"  # online (target forward in each step) | cached (top-k, computed once)
    cached_top_k: int = 64  # target_logits=cached: tokens kept per position (the rest is one bucket)
    lora: LoraSettings = field(default_factory=LoraSettings)
    on_policy: OnPolicySettings = field(default_factory=OnPolicySettings)
    # heads
    layers: Optional[list[int]] = None  # indices into output_hidden_states; null = the kind's default
    hidden_states: str = "online"  # online (computed in the step) | offline (precomputed shards)
    offline_dtype: str = "float16"
    offline_max_gib: Optional[float] = 20.0
    label_temperature: float = 1.0  # heads: token-loss label softmax(target logits / T); 0 = the target's argmax
    ttt_steps: int = 4  # eagle: training-time-test unroll (as deep as the default k drafts)
    ttt_decay: float = 0.8  # eagle: weight of step s is ttt_decay ** s
    draft_vocab_size: Optional[int] = None  # eagle: draft vocabulary in tokens (overrides draft_vocab_share)
    draft_vocab_share: Optional[float] = None  # eagle: draft vocabulary as a share of the target's (null = all)
    draft_vocab_coverage: Optional[float] = None  # eagle: the fewest tokens holding this share of the training
    #                                               tokens (overrides draft_vocab_share)
    intermediate_size: Optional[int] = None  # eagle: the head's MLP width (null = the target's)
    draft_vocab_from: str = "tokens"  # eagle: rank tokens by count (tokens) or by the target's probabilities
    draft_vocab_examples: int = 256  # eagle, draft_vocab_from=target_probabilities: training records scored
    token_loss_weight: float = 0.1  # eagle1: token loss weight next to the feature regression
    depth: int = 3  # mtp: chained modules
    module_decay: float = 0.8  # mtp
    num_heads: int = 4  # medusa: heads
    num_layers: int = 1  # medusa: residual blocks per head
    head_decay: float = 0.8  # medusa


@dataclass
class TrainerConfig:
    """Optimisation, precision, checkpoints. batch_size is per process; the global batch is
    batch_size x processes x grad_accum."""

    max_steps: int = 200
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    max_grad_norm: float = 1.0
    max_length: int = 512  # training sequences are truncated to this many tokens
    precision: str = "no"  # no | bf16 | fp16 (accelerate mixed precision)
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    eval_every: int = 50
    eval_examples: int = 64  # held-out examples for the acceptance estimate
    # How the best checkpoint is chosen on them: acceptance (sum_x min(p, q): what sampled serving
    # accepts) | top1 (greedy agreement with the target: what greedy serving accepts)
    select_by: str = "acceptance"
    resume: str = "none"  # none | auto (newest complete checkpoint in the run dir) | a checkpoint path
    seed: int = 0
    cpu: bool = False  # train on the CPU even when a GPU is present


@dataclass
class FinalEvalConfig:
    """The evaluation instrument run at the end: off-the-shelf draft (baseline) vs the trained one."""

    enabled: bool = True
    ks: list[int] = field(default_factory=lambda: [4])
    batch_sizes: list[int] = field(default_factory=lambda: [1])  # rows decoded at once (eval/batching.py)
    max_new_tokens: int = 64
    repeats: int = 3
    prompts_per_category: int = 8
    engine: Optional[str] = None  # llamacpp: also measure the drafters in llama.cpp (eval/engine.py)


@dataclass
class TrainConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    evaluate: FinalEvalConfig = field(default_factory=FinalEvalConfig)
    # Export at the end into <run>/export/ (python -m train.export's settings); no formats = no export.
    export: ExportSettings = field(default_factory=lambda: ExportSettings(formats=[]))
    data_cache: str = "runs/prepared"  # regenerated + tokenized data, shared by runs on the same data
    out_dir: str = "${hydra:runtime.output_dir}"
    progress: bool = True


# --- python -m train.export ---------------------------------------------------------------------------


@dataclass
class ExportConfig(ExportSettings):
    """`python -m train.export`: which run and where to, plus the settings of train.export.export."""

    run: str = MISSING  # a `python -m train` run directory
    out_dir: str = "${run}/export"


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="eval_schema", node=EvalConfig)
    cs.store(name="prepare_schema", node=PrepareConfig)
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="export_schema", node=ExportConfig)
