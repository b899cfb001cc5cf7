"""The drafter kinds, one descriptor each (drafters/kinds/<kind>.py, beside the drafter's own drafters/<kind>.py):
everything the code above a drafter needs to know about its kind, so that none of it names one.

A kind's module holds its schema (the `drafter=<kind>` keys, with their defaults) and `KIND`, a `Kind`: the recipe
that trains it, its head class, whether it drafts its guesses in one forward, the target layers it reads by default,
the formats it is exported in and the engines that serve them, and its Hub model card. `train/config.py`,
`train/hidden_states.py`, `train/export.py`, `train/hub.py`, `drafters/registry.py`, `eval/run.py` and
`eval/engines/llama_cpp_drafters.py` read the descriptors from here: a new kind is its drafter, its recipe, its descriptor,
its YAML and its tests (docs/architecture.md).

Kinds outside this package (a team's own) are found through the `draftsmith.kinds` entry points: each names a module
with a `KIND`.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import entry_points
from typing import Callable, Optional

from omegaconf import MISSING
from torch import nn


@dataclass
class DrafterConfig:
    """What to train: the keys every kind has. Each kind's schema (in its drafters/kinds/<kind>.py) adds its own,
    with its defaults (there and nowhere else: conf/drafter/<kind>.yaml only names the schema), so a key another kind
    reads is an error naming this kind and its keys."""

    kind: str = MISSING
    init_from: Optional[str] = None  # where training starts: a model (draft_lm) or a saved head of this kind and shape


@dataclass
class HeadConfig(DrafterConfig):
    """What every head on the target's hidden states has (train/heads.py). init_from: a saved head of this kind
    and shape (a run's best/) to start from."""

    layers: Optional[list[int]] = None  # indices into output_hidden_states; null = the kind's default
    # online: the frozen target runs inside each step | offline: shards, computed once | vllm: the same shards, computed
    # by a vLLM server on the target (`make vllm`; train/hidden_states.py write_shards_from_vllm) | llamacpp: computed
    # by llama.cpp on the target's GGUF, quantized as it is served (`make llama-cpp`; write_shards_from_llama_cpp) |
    # files: read from the hs_{i}.safetensors files an engine wrote into hidden_states_dir (speculators' data
    # generation; the files' layers are the head's `layers` and the last one, as the engine was started)
    hidden_states: str = "online"
    hidden_states_dir: Optional[str] = None  # files: the folder of hs_{i}.safetensors files
    hidden_states_tensor_parallel: int = 1  # vllm: the workers (GPUs) its server shards the target over
    offline_dtype: str = "float16"  # every cached way: the shards' dtype
    offline_max_gib: Optional[float] = 20.0  # every cached way: refuse to start when the shards' estimate is larger
    # all: the target loaded whole | ends: its embedding, final norm and output head only (eval/run.py
    # load_target_ends), for a target beyond one device: the features from an engine (vllm, llamacpp, files), held-out
    # ones too, answers from an engine or kept; no final evaluation in draftsmith's loop
    target_weights: str = "all"
    label_temperature: float = 1.0  # token-loss label: softmax(target logits / T); 0 = the target's argmax (greedy serving)


@dataclass
class DraftVocabularyConfig(HeadConfig):
    """A head whose output head can keep a draft vocabulary (EAGLE-3, DFlash: the `d2t` / `t2d` maps the engines
    read), sized by these keys (train/eagle3.py `DraftVocabularyRecipe`)."""

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


@dataclass(frozen=True)
class Engines:
    """How the serving engines take a kind's export (None: that engine does not serve it)."""

    vllm: Optional[str] = None  # vLLM's speculative method
    vllm_extra: str = ""  # further keys of vLLM's --speculative-config (JSON, each with its leading comma)
    vllm_format: Optional[str] = None  # the export format vLLM reads (a vLLM server serves it: eval/engines/vllm.py)
    sglang: Optional[str] = None  # SGLang's --speculative-algorithm
    gguf: Optional[str] = None  # the export's GGUF file name
    llama_cpp: Optional[str] = None  # llama-server's --spec-type for that file
    llama_cpp_cannot: Optional[str] = None  # why llama.cpp cannot serve this kind, where it cannot


    def vllm_config(self, model: str, k: int) -> dict:
        """vLLM's `--speculative-config` for the export at `model`, drafting k tokens a round."""
        if self.vllm is None:
            raise ValueError("vLLM serves no export of this kind")
        return {"method": self.vllm, "model": model, "num_speculative_tokens": k,
                **json.loads("{" + self.vllm_extra.lstrip(", ") + "}")}


@dataclass(frozen=True)
class Kind:
    """One drafter kind, as the code above the drafters sees it."""

    name: str  # drafter.kind, and `draftsmith_kind` in a saved head's config.json
    schema: type[DrafterConfig]
    recipe: str  # the module whose run(cfg) trains it (train/__main__.py)
    summary: str  # what it is, in a few words (errors and listings)
    head: Optional[type[nn.Module]] = None  # a head on the target's hidden states: its class (drafters/registry.py)
    # The engines' exports of the kind that draftsmith reads back as its head: their config.json `architectures`, and
    # the loader, (directory, its config.json, target, dtype) -> head (drafters/registry.py `load_head`)
    reads: tuple[str, ...] = ()
    load_export: Optional[Callable] = None
    # A standalone LM kind: its drafter class (`from_pretrained`, eval/run.py), and what in a model's transformers
    # config says it is of this kind (None: any LM no other kind recognizes)
    lm: Optional[type] = None
    recognizes: Optional[Callable[[object], bool]] = None
    parallel: bool = False  # drafts its k guesses in one forward (its drafters' `parallel`)
    # The feature layers it reads by default, for a target of n layers (train/hidden_states.py's convention)
    layers: Optional[Callable[[int], list[int]]] = None
    aliases: tuple[str, ...] = ()  # other names of the kind where layers are asked for (prepare's hidden_states.kind)
    formats: tuple[str, ...] = ()  # the export formats (train/export.py)
    # What writes them: "module:function", (eval/engines/formats/writing.py ExportJob, formats, directory) -> {format: path};
    # named, not imported, as eval/ sits above the drafters
    exporter: Optional[str] = None
    no_format: Optional[str] = None  # no formats: why no engine loads this kind
    hub_root: Optional[str] = None  # the format at the root of its Hub repository (train/hub.py)
    engines: Engines = field(default_factory=Engines)
    # A head llama.cpp serves: "module:function" converting a saved one to its GGUF, (directory, target, target's
    # name, out file, dtype) -> path (eval/engines/llama_cpp_drafters.py)
    llama_cpp_gguf: Optional[str] = None
    tag: Optional[str] = None  # the Hub tag of the kind
    library: Optional[str] = None  # the Hub card's library_name: the library that loads the root format
    # The model card's first paragraph: (target, the run's drafter settings, its feature layers) -> text
    describe: Optional[Callable[[str, dict, Optional[list]], str]] = None
    # The model card's recipe rows beyond the shared ones: (drafter settings, the run's config, best.json) -> rows
    card_rows: Callable[[dict, dict, dict], list[list]] = lambda d, cfg, best: []


@cache
def kinds() -> dict[str, Kind]:
    """Every kind: the modules of this package, then the `draftsmith.kinds` entry points, by name."""
    modules = [importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)]
    modules += [e.load() for e in entry_points(group="draftsmith.kinds")]
    found: dict[str, Kind] = {}
    for module in modules:
        kind = getattr(module, "KIND", None)
        if not isinstance(kind, Kind):
            raise TypeError(f"{module.__name__} has no KIND (a drafters.kinds.Kind)")
        if kind.name in found:
            raise ValueError(f"two drafter kinds are named {kind.name!r}: {module.__name__} and another")
        found[kind.name] = kind
    return found


def kind(name: str) -> Kind:
    """The kind named `name` (or one of its aliases); an error listing the known kinds otherwise."""
    for k in kinds().values():
        if name == k.name or name in k.aliases:
            return k
    raise ValueError(f"unknown drafter kind {name!r}; known: {', '.join(sorted(kinds()))}")


def of_head(config: dict) -> Optional[Kind]:
    """The kind of a saved head from its config.json: its `draftsmith_kind`, or, for an engine's export, the kind whose
    `reads` holds one of its architectures; None for neither."""
    if config.get("draftsmith_kind"):
        return kinds().get(config["draftsmith_kind"])
    architectures = set(config.get("architectures") or [])
    return next((k for k in kinds().values() if architectures & set(k.reads)), None)


def of_lm(config) -> Kind:
    """The kind of a standalone draft LM from its transformers config (None: a GGUF file, an ordinary draft LM): the
    LM kind that recognizes it, else the one that takes any other."""
    lms = [k for k in kinds().values() if k.lm is not None]
    if config is not None:
        for k in lms:
            if k.recognizes is not None and k.recognizes(config):
                return k
    return next(k for k in lms if k.recognizes is None)


def function(ref: str) -> Callable:
    """The function a descriptor names as "module:function" (its exporter, its GGUF converter): named, not imported,
    where it lives above the drafters (eval/engines/formats/)."""
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)
