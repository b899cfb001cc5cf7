"""`drafter=draft_lm`: a standalone draft LM sharing the target's tokenizer (drafters/draft_lm.py), fine-tuned or
distilled by train/distill.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from drafters.draft_lm import DraftLM
from drafters.kinds import DrafterConfig, Engines, Kind


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
class DraftLMConfig(DrafterConfig):
    """`drafter=draft_lm`: a standalone draft LM sharing the target's tokenizer, fine-tuned or distilled
    (train/distill.py)."""

    kind: str = "draft_lm"
    init_from: Optional[str] = "${target.off_the_shelf_draft}"  # a hub id or directory: the off-the-shelf draft
    init_layers: Optional[int] = None  # init_from's first N layers and head (a cheaper draft), or the target's
    loss: str = "forward_kl"  # sft | forward_kl | reverse_kl | jsd | tvd
    temperature: float = 1.0  # distillation temperature (both sides)
    beta: float = 0.5  # JSD(beta) only
    target_logits: str = "online"  # online (target forward in each step) | cached (top-k, computed once)
    cached_top_k: int = 64  # target_logits=cached: the target's k most likely tokens per position (the rest one bucket)
    lora: LoraSettings = field(default_factory=LoraSettings)
    on_policy: OnPolicySettings = field(default_factory=OnPolicySettings)


def lm_rows(d: dict, cfg: dict) -> list[list]:
    """A draft LM's model-card rows: its objective and where it started."""
    source, layers = d["init_from"] or "the target", d.get("init_layers")
    started = (f"{source}'s first {layers} layers" if layers
               else d["init_from"] or cfg["target"]["off_the_shelf_draft"])
    return [["objective", d["loss"]], ["started from", started]]


KIND = Kind(
    name="draft_lm", schema=DraftLMConfig, recipe="train.distill", summary="a standalone draft LM", lm=DraftLM,
    exporter="eval.engines.formats.writing:export_lm",
    formats=("hf", "gguf"), hub_root="hf", tag="draft-model", library="transformers",
    engines=Engines(vllm="draft_model", vllm_format="hf",
                    sglang="STANDALONE", gguf="draft.gguf", llama_cpp="draft-simple"),
    describe=lambda target, d, layers: f"A standalone draft model for `{target}`, sharing its tokenizer.",
    card_rows=lambda d, cfg, best: lm_rows(d, cfg))
