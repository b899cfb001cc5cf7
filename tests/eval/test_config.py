"""eval/config.py: a `drafters` entry is checked against its kind's spec (`checked_spec`): its defaults filled
in, and a key its kind does not have, an unknown kind or a value of the wrong type an error naming the drafter,
its kind and its keys, before any work."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from eval.config import SPECS, checked_spec


def test_an_entry_gets_its_kinds_defaults_and_nothing_else():
    for kind, spec in SPECS.items():
        checked = checked_spec({"name": "d", "kind": kind})
        assert list(checked) == [f.name for f in dataclasses.fields(spec)]
    assert checked_spec({"name": "n", "kind": "ngram", "max_ngram": "4"})["max_ngram"] == 4  # converted to its type


@pytest.mark.parametrize("entry, error", [
    ({"name": "n", "kind": "ngram", "path": "/models/draft"},
     r"drafter 'n' \(kind ngram\) has no key 'path'; kind ngram's keys: name, kind, engine_c, max_ngram, min_ngram"),
    ({"name": "h", "kind": "head", "path": "run/best", "layers": 8, "lean": False},
     r"drafter 'h' \(kind head\) has no key 'layers', 'lean'; kind head's keys: name, kind, engine_c, engine_cs, path, gguf_type, stop_below"),
    ({"name": "x", "kind": "eagle"}, r"drafter 'x': unknown kind 'eagle'; known kinds: \['draft_lm', 'head'"),
    ({"name": "n", "kind": "ngram", "max_ngram": "three"}, r"drafter 'n' \(kind ngram\): Value 'three'"),
    ({"kind": "ngram"}, r"drafter None \(kind ngram\): Missing mandatory value"),
])
def test_a_wrong_entry_is_an_error_naming_the_drafter_its_kind_and_its_keys(entry, error):
    with pytest.raises(ValueError, match=error):
        checked_spec(entry)


def test_a_command_line_sets_any_key_of_an_entry_and_the_kind_still_decides():
    """The entries compose with every kind's keys, so `drafters.1.engine_c=...` needs no `+`; a key the entry's
    kind does not have is caught by checked_spec, unless it holds the default every kind shares."""
    from hydra import compose, initialize_config_dir

    from eval.config import register

    register()
    conf = str(Path(__file__).resolve().parents[2] / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose("eval", overrides=["target=tiny", "drafters.1.engine_c=0.05", "drafters.1.max_ngram=4"])
    ngram = checked_spec(OmegaConf.to_container(cfg.drafters[1], resolve=True))
    assert ngram == {"name": "ngram", "kind": "ngram", "engine_c": 0.05, "max_ngram": 4, "min_ngram": 1}
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose("eval", overrides=["target=tiny", "drafters.1.path=/models/draft"])
    with pytest.raises(ValueError, match=r"drafter 'ngram' \(kind ngram\) has no key 'path'"):
        checked_spec(OmegaConf.to_container(cfg.drafters[1], resolve=True))
