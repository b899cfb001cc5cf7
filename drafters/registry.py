"""The head kinds, and building, saving and loading a head of any of them: the registry above the kinds
(drafters/eagle.py, eagle1.py, mtp.py, medusa.py, dflash.py, peagle.py), which import what they share from drafters/heads.py and
never this module.

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

from drafters import dflash, eagle, eagle1, eagle_export, medusa, mtp, peagle
from drafters.heads import ENGINE_EAGLE1, ENGINE_EAGLE3, ENGINE_PEAGLE, beside, check_layers, head_config

# Each kind's head class (its module's HEAD): what `draftsmith_kind` in a saved head's config.json names.
KINDS: dict[str, type[nn.Module]] = {"eagle": eagle.HEAD, "eagle1": eagle1.HEAD, "mtp": mtp.HEAD, "medusa": medusa.HEAD,
                                     "dflash": dflash.HEAD, "peagle": peagle.HEAD}


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
    if set(raw.get("architectures") or []) & set(ENGINE_PEAGLE):  # before EAGLE-3's: it is one, plus mask_hidden
        return peagle.load_engine_peagle(path, raw, target, dtype)
    if set(raw.get("architectures") or []) & set(ENGINE_EAGLE3):  # an EAGLE-3 export (eval/formats/eagle3.py)
        return eagle_export.load_engine_eagle3(path, raw, target, dtype)
    if set(raw.get("architectures") or []) & set(ENGINE_EAGLE1):
        return eagle1.load_engine_eagle1(path, raw, target, dtype)
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
