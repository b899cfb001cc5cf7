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

from drafters.parallel import COD_MIN_RATIO, COD_RATIO, MAX_ANCHORS
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


@dataclass
class LoraSettings:
    """LoRA through peft; merged into the weights when the drafter is saved."""

    enabled: bool = False
    r: int = 8
    alpha: int = 16  # LoRA scaling numerator (scale = alpha / r)
    dropout: float = 0.0  # dropout on the LoRA branch
    target_modules: str = "all-linear"  # peft's target_modules: every linear layer but the output head


@dataclass
class OnPolicySettings:
    """On-policy data: sequences sampled from the draft, scored by the target (GKD, DistillSpec)."""

    ratio: float = 0.0  # share of training steps on draft samples (0 = off-policy only)
    max_new_tokens: int = 64
    temperature: float = 1.0


@dataclass
class DrafterConfig:
    """What to train: the keys every kind has. Each kind's schema below adds its own, with its defaults (here
    and nowhere else: conf/drafter/<kind>.yaml only names the schema), so a key another kind reads is an error
    naming this kind and its keys. `KINDS` maps each kind to its schema; train/__main__.py to its recipe."""

    kind: str = MISSING
    init_from: Optional[str] = None  # where training starts: a model (draft_lm) or a saved head of this kind and shape


@dataclass
class DraftLMConfig(DrafterConfig):
    """`drafter=draft_lm`: a standalone draft LM sharing the target's tokenizer, fine-tuned or distilled
    (train/distill.py)."""

    kind: str = "draft_lm"
    init_from: Optional[str] = "${target.off_the_shelf_draft}"  # a hub id or directory: the off-the-shelf draft
    init_layers: Optional[int] = None  # or, with init_from=null: the target's own first N layers and head (a self-draft)
    loss: str = "forward_kl"  # sft | forward_kl | reverse_kl | jsd | tvd
    temperature: float = 1.0  # distillation temperature (both sides)
    beta: float = 0.5  # JSD(beta) only
    target_logits: str = "online"  # online (target forward in each step) | cached (top-k, computed once)
    cached_top_k: int = 64  # target_logits=cached: the target's k most likely tokens per position (the rest one bucket)
    lora: LoraSettings = field(default_factory=LoraSettings)
    on_policy: OnPolicySettings = field(default_factory=OnPolicySettings)


@dataclass
class PardConfig(DraftLMConfig):
    """`drafter=pard`: PARD, the draft LM trained to guess k tokens in one forward from k - 1 appended mask tokens
    (drafters/pard.py, train/pard.py): the draft LM recipe's objectives, on PARD's rows. Its defaults are PARD's."""

    kind: str = "pard"
    num_depths: int = 8  # depths trained (the bonus token's guess and num_depths - 1 masks): k up to this
    # the token the masks carry (a row of the draft's embedding, trained with it); null: the tokenizer's mask token,
    # else the first embedding row no token uses, else pad, end-of-sequence, unknown (as for DFlash)
    mask_token_id: Optional[int] = None
    cod_ratio: float = COD_RATIO  # conditional drop: depth d keeps max(cod_ratio ** d, cod_min_ratio) of the anchors
    cod_min_ratio: float = COD_MIN_RATIO
    max_anchors: int = MAX_ANCHORS  # anchors per sequence the deeper depths are drawn from (all stay at depth 0)


@dataclass
class HeadConfig(DrafterConfig):
    """What every head on the target's hidden states has (train/heads.py). init_from: a saved head of this kind
    and shape (a run's best/) to start from."""

    layers: Optional[list[int]] = None  # indices into output_hidden_states; null = the kind's default
    hidden_states: str = "online"  # online: the frozen target runs inside each step | offline: shards, computed once
    offline_dtype: str = "float16"  # offline: the shards' dtype
    offline_max_gib: Optional[float] = 20.0  # offline: refuse to start when the shards' estimate is larger
    label_temperature: float = 1.0  # token-loss label: softmax(target logits / T); 0 = the target's argmax (greedy serving)


@dataclass
class Eagle3Layout(HeadConfig):
    """What an EAGLE-3 head's layer has, whichever way it drafts (`drafter=eagle` and `drafter=peagle`): fused
    low/middle/high target features, one decoder layer, a draft vocabulary. Layers default to [2, n//2, n-3] (vLLM's
    convention)."""

    # true: an output head of its own over the draft vocabulary, started from the target's rows and trained with the
    # rest (EAGLE-3's reference recipe); false: draft through the target's output head, frozen
    own_lm_head: bool = False
    intermediate_size: Optional[int] = None  # the head's MLP width; null = the target's, smaller = cheaper steps
    # The draft vocabulary (d2t / t2d maps): the most frequent share of the target's tokens; null = all. The recipe
    # warns when a held-out category's tokens are under 99 % covered (greedy serving rejects the rest).
    draft_vocab_share: Optional[float] = 0.25
    draft_vocab_size: Optional[int] = None  # or a number of tokens, e.g. 1024 (wins over the share and the coverage)
    # or the fewest tokens that make up this share (e.g. 0.999) of the training traffic's ranked counts (wins over
    # the share)
    draft_vocab_coverage: Optional[float] = None
    # rank by counts in the (regenerated) responses (tokens) | by the target's next-token probabilities there
    # (target_probabilities: keeps what sampled serving draws, not just the argmax)
    draft_vocab_from: str = "tokens"
    draft_vocab_examples: int = 256  # draft_vocab_from=target_probabilities: the first N training records are scored
    # EAGLE-3.1's norms (speculators' defaults, under its names): an RMS norm over the fused target features before fc
    # (norm_before_fc); the normed hidden state as the layer's residual (norm_before_residual); the final norm's output
    # handed to the next draft step (norm_output; llama.cpp's EAGLE-3 graph does not read it, vLLM's does).
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False


@dataclass
class EagleConfig(Eagle3Layout):
    """`drafter=eagle`: EAGLE-3, drafting on its own outputs, trained by training-time test (drafters/eagle.py)."""

    kind: str = "eagle"
    ttt_steps: int = 4  # the head unrolled on its own outputs for this many draft steps: as deep as it drafts (k=4)
    ttt_decay: float = 0.8  # loss weight of step s: ttt_decay ** s


@dataclass
class PEagleConfig(Eagle3Layout):
    """`drafter=peagle`: P-EAGLE, EAGLE-3's layer drafting k guesses in one forward from mask entries, trained on
    every depth at once (drafters/peagle.py). Its defaults are speculators' P-EAGLE recipe."""

    kind: str = "peagle"
    num_depths: int = 8  # depths trained, and the most guesses one forward drafts (k up to this)
    # the token the mask entries carry (its row of the target's embedding); null: the tokenizer's mask token, else
    # the first embedding row no token uses, else pad, end-of-sequence, unknown (as for DFlash)
    mask_token_id: Optional[int] = None
    cod_ratio: float = COD_RATIO  # conditional drop: depth d keeps max(cod_ratio ** d, cod_min_ratio) of the anchors
    cod_min_ratio: float = COD_MIN_RATIO
    max_anchors: int = MAX_ANCHORS  # anchors per sequence the deeper depths are drawn from (all stay at depth 0)


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


@dataclass
class Eagle1Config(HeadConfig):
    """`drafter=eagle1`: EAGLE-1, the last hidden state and the token embedding through fc, one decoder layer
    (drafters/eagle1.py)."""

    kind: str = "eagle1"
    token_loss_weight: float = 0.1  # feature regression (smooth L1) + this x token cross-entropy


@dataclass
class MtpConfig(HeadConfig):
    """`drafter=mtp`: DeepSeek-V3 multi-token prediction, chained modules sharing the target's embedding and
    output head (drafters/mtp.py)."""

    kind: str = "mtp"
    depth: int = 3  # modules; a round drafts min(k, depth) tokens
    module_decay: float = 0.8  # loss weight of module k: module_decay ** (k-1)


@dataclass
class MedusaConfig(HeadConfig):
    """`drafter=medusa`: K residual heads on the last hidden state, the target frozen (drafters/medusa.py)."""

    kind: str = "medusa"
    num_heads: int = 4  # head i predicts token t+i+1; a round drafts min(k, num_heads) tokens
    num_layers: int = 1  # residual blocks per head
    head_decay: float = 0.8  # loss weight of head i: head_decay ** (i-1)


# Each kind's schema: conf/drafter/<kind>.yaml composes `<kind>_schema` from the ConfigStore (register()).
@dataclass
class DFlashConfig(HeadConfig):
    """`drafter=dflash`: DFlash, a block of guesses in one forward from several layers' features (drafters/dflash.py).
    Its defaults and objective are SpecForge's DFlash recipe, the loss decay speculators'."""

    kind: str = "dflash"
    num_layers: int = 1  # decoder layers of the drafter (SpecForge's default; z-lab's Qwen3-8B drafter has 5)
    block_size: int = 5  # the anchor and block_size - 1 masked positions: serve at k = block_size - 1
    # the token the masked positions carry (its row of the target's embedding); null: the tokenizer's mask token,
    # else the first embedding row no token uses, else pad, end-of-sequence, unknown (SpecForge's order)
    mask_token_id: Optional[int] = None
    loss_decay_gamma: Optional[float] = 4.0  # block position j's loss weighs exp(-(j-1)/gamma); null: all alike
    max_anchors: int = 256  # blocks trained per sequence, drawn from its answer's positions (SpecForge: 512)


KINDS: dict[str, type[DrafterConfig]] = {"draft_lm": DraftLMConfig, "eagle": EagleConfig, "eagle1": Eagle1Config,
                                         "mtp": MtpConfig, "medusa": MedusaConfig, "dflash": DFlashConfig,
                                         "peagle": PEagleConfig, "pard": PardConfig}


# The module whose run(cfg) trains each kind (train/__main__.py dispatches on it).
RECIPES: dict[str, str] = {"draft_lm": "train.distill", "eagle": "train.eagle3", "eagle1": "train.heads",
                           "mtp": "train.heads", "medusa": "train.heads", "dflash": "train.dflash",
                           "peagle": "train.peagle", "pard": "train.pard"}


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
    # EAGLE-2 dynamic trees measured beside the chains (`d4t4n16`; eval/evaluate.py EvalPlan.trees), at batch 1
    trees: list[str] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=lambda: [1])  # rows decoded at once (eval/batching.py)
    max_new_tokens: int = 64
    repeats: int = 3
    prompts_per_category: int = 8  # held-out prompts measured per category
    engine: Optional[str] = None  # llamacpp: also measure the drafters in llama.cpp (eval/engine.py)
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
