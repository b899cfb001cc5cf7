"""train/config.py: one schema per drafter kind. `drafter=<kind>` composes exactly its kind's keys, each default
set in one place (the schema), and a key of another kind stops `python -m train` before any work with an error
naming the kind and its keys."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from train.__main__ import check_drafter_keys
from train.config import KINDS, DrafterConfig, drafter_keys

CONF = Path(__file__).resolve().parents[2] / "conf"


def make_cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_composes_its_own_keys_with_its_schemas_defaults(kind):
    drafter = make_cfg(f"drafter={kind}").drafter
    assert list(drafter) == drafter_keys(kind) and drafter.kind == kind
    defaults = {f.name: f.default for f in dataclasses.fields(KINDS[kind]) if f.default is not dataclasses.MISSING}
    for key, value in defaults.items():
        if not str(value).startswith("${"):  # an interpolation resolves against the target
            assert drafter[key] == value, key
    # The YAML holds no value of its own: each default lives in the schema alone.
    yaml_file = yaml.safe_load((CONF / "drafter" / f"{kind}.yaml").read_text())
    assert yaml_file == {"defaults": [f"{kind}_schema", "_self_"]}


def test_every_kind_has_a_yaml_and_every_yaml_a_kind():
    assert sorted(p.stem for p in (CONF / "drafter").glob("*.yaml")) == sorted(KINDS)
    assert all(issubclass(schema, DrafterConfig) for schema in KINDS.values())


@pytest.mark.parametrize("kind, foreign", [("medusa", "ttt_steps"), ("eagle", "num_heads"), ("draft_lm", "layers"),
                                           ("mtp", "loss"), ("eagle1", "draft_vocab_share")])
def test_a_key_of_another_kind_is_an_error_naming_the_kind_and_its_keys(kind, foreign, capsys):
    with pytest.raises(ConfigCompositionException, match=f"Could not override 'drafter.{foreign}'"):  # Hydra's refusal
        make_cfg(f"drafter={kind}", f"drafter.{foreign}=1")
    with pytest.raises(SystemExit) as stop:
        check_drafter_keys([f"drafter={kind}", f"drafter.{foreign}=1", "hydra.run.dir=/nowhere"])
    assert stop.value.code == 2
    message = capsys.readouterr().err
    assert message.startswith(f"error: drafter kind '{kind}' has no key '{foreign}'; its keys: ")
    assert ", ".join(drafter_keys(kind)) in message


def test_the_kind_an_experiment_composes_is_the_one_checked(capsys):
    check_drafter_keys(["experiment=smollm2_eagle", "drafter.ttt_steps=6", "+drafter.ttt_decay=0.5"])  # eagle's keys
    check_drafter_keys(["-m", "drafter=eagle,medusa", "trainer.lr=1e-3"])  # nothing to check, a sweep left to Hydra
    with pytest.raises(SystemExit):
        check_drafter_keys(["experiment=smollm2_eagle", "drafter.num_heads=3"])
    assert "drafter kind 'eagle' has no key 'num_heads'" in capsys.readouterr().err


def test_an_experiment_composes_with_its_own_kind_only():
    """experiment=smollm2_eagle sets a head's keys (offline features, greedy labels): with a draft LM chosen beside
    it, they are keys a draft LM does not have, an error rather than settings silently dropped; another head kind
    has them and takes them."""
    assert make_cfg("experiment=smollm2_eagle").drafter.kind == "eagle"
    assert make_cfg("experiment=smollm2_eagle", "drafter=medusa").drafter.hidden_states == "offline"
    with pytest.raises(ConfigCompositionException):
        make_cfg("experiment=smollm2_eagle", "drafter=draft_lm")
