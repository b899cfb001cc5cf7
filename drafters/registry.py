"""Building, saving and loading a head of any kind: the registry above the head kinds (their descriptors in
drafters/kinds/ name their classes), which import what they share from drafters/heads.py and never this module.

Saved heads are a directory: `config.json` (a Llama config of the head's one layer, plus `draftsmith_kind`,
`feature_layers`, `target_hidden_size`, `draft_vocab_size` and the kind's own settings) and
`model.safetensors` (the head's own weights only: the target's embedding and output head are shared at load
time, never stored). `load_head` also reads the EAGLE-3, P-EAGLE and EAGLE-1 exports the engines load.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_model, save_file, save_model
from torch import nn
from transformers import LlamaConfig

from drafters.heads import beside, check_layers, head_config
from drafters.kinds import kinds

# Each head kind's class (its descriptor's `head`): what `draftsmith_kind` in a saved head's config.json names.
KINDS: dict[str, type[nn.Module]] = {name: k.head for name, k in kinds().items() if k.head is not None}


def head_class(kind: str) -> type[nn.Module]:
    if kind not in KINDS:
        raise ValueError(f"unknown head kind {kind!r}; known: {sorted(KINDS)}")
    return KINDS[kind]


def build_head(kind: str, target, feature_layers: list[int], **settings) -> nn.Module:
    """A freshly initialised head of `kind` for `target` (attached to its embedding and output head)."""
    cls = head_class(kind)
    config = head_config(target.config, kind, feature_layers, **{**getattr(cls, "CONFIG_DEFAULTS", {}), **settings})
    head = cls(config)
    head.attach(target)
    return head


def save_head(head: nn.Module, out_dir: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Config and weights of `head`; `state_dict` (e.g. gathered from a sharded run) replaces its own."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    head.config.save_pretrained(out)
    if state_dict is None:
        save_model(head, str(out / "model.safetensors"))
    else:
        save_file({name: t.contiguous() for name, t in state_dict.items()}, str(out / "model.safetensors"))
    return out


def load_head(path: str | Path, target, dtype: torch.dtype | None = None) -> nn.Module:
    """A saved head, checked against `target` and attached to it, in eval mode on the target's device."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a saved head: no config.json")
    raw = json.loads((path / "config.json").read_text())
    for k in kinds().values():  # an engine's export of a kind (eval/engines/formats/): read by that kind's loader
        if set(raw.get("architectures") or []) & set(k.reads):
            return k.load_export(path, raw, target, dtype)
    kind = raw.get("draftsmith_kind")
    if kind not in KINDS:
        raise ValueError(f"{path}/config.json: field draftsmith_kind is {kind!r}, expected one of {sorted(KINDS)}")
    config = LlamaConfig.from_pretrained(path)
    for field, expected in (("target_hidden_size", target.config.hidden_size), ("vocab_size", target.config.vocab_size)):
        if getattr(config, field) != expected:
            raise ValueError(f"{path}/config.json: field {field} is {getattr(config, field)} but the target has "
                             f"{expected}; this head was trained for another target")
    check_layers(list(config.feature_layers), target.config.num_hidden_layers)
    head = head_class(kind)(config)
    load_model(head, str(path / "model.safetensors"))
    return beside(head, target, dtype)
