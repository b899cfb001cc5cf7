"""drafters/kinds/: one descriptor per drafter kind, complete and consistent, the code above the drafters reading
them without naming a kind, and a kind from outside the package found through the `draftsmith.kinds` entry points."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from drafters import kinds
from eval.config import SPECS
from train.export import FORMATS, formats_for
from train.hidden_states import default_layers

ROOT = Path(__file__).resolve().parents[2]
# The modules that read the descriptors: not one of them names a kind.
READERS = ["train/config.py", "train/export.py", "train/hidden_states.py", "train/hub.py", "drafters/registry.py",
           "eval/run.py", "eval/engines/llama_cpp_drafters.py"]


@pytest.mark.parametrize("name", sorted(kinds.kinds()))
def test_each_descriptor_is_complete_and_agrees_with_its_schema_recipe_yaml_and_formats(name):
    kind = kinds.kind(name)
    fields = {f.name: f.default for f in dataclasses.fields(kind.schema)}
    assert fields["kind"] == name
    assert callable(importlib.import_module(kind.recipe).run)
    assert yaml.safe_load((ROOT / "conf" / "drafter" / f"{name}.yaml").read_text())["defaults"][0] == f"{name}_schema"
    assert set(kind.formats) <= set(FORMATS)
    if kind.formats:  # written by its exporter, the Hub repository's root one of them
        assert callable(kinds.function(kind.exporter))
        assert kind.hub_root in kind.formats and kind.tag and kind.library and kind.describe
        assert kind.engines.vllm  # every exportable kind is served by vLLM
        assert ("gguf" in kind.formats) == bool(kind.engines.gguf) == bool(kind.engines.llama_cpp)
        assert not (kind.engines.llama_cpp and kind.engines.llama_cpp_cannot)
    else:  # nothing to write: why, in the error
        assert kind.no_format and kind.exporter is None
        with pytest.raises(ValueError, match=kind.no_format[:40]):
            formats_for(name, ["auto"])
    if kind.head is not None:  # a head: the layers it reads by default on a 32-layer target
        layers = default_layers(name, 32)
        assert layers == sorted(set(layers)) and 0 <= layers[0] and layers[-1] <= 32
    assert kind.parallel == ("num_depths" in fields or "block_size" in fields)


def test_aliases_and_unknown_kinds():
    assert kinds.kind("eagle3") is kinds.kind("eagle")
    with pytest.raises(ValueError, match=r"unknown drafter kind 'eagle4'; known: .*eagle, eagle1"):
        kinds.kind("eagle4")
    with pytest.raises(ValueError, match="reads no target layers; the heads that do: dflash, eagle"):
        default_layers("draft_lm", 32)


def _strings(path: Path) -> set[str]:
    return {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


@pytest.mark.parametrize("reader", READERS)
def test_the_modules_that_read_the_descriptors_name_no_kind(reader):
    names = {n for k in kinds.kinds().values() for n in (k.name, *k.aliases)}
    # What shares a kind's name and is not one: DFlash's format, and python -m eval's `kind: draft_lm` entries (any
    # draft LM: its kind is then read from its config by drafters.kinds.of_lm).
    assert not (_strings(ROOT / reader) - set(FORMATS) - set(SPECS)) & names


# A team's own kind, from one file: an EAGLE-1 layer by another name, trained by the heads' recipe, exported as vLLM's
# EAGLE-1 (it names drafters only through their public modules, as a package outside this repository would).
TEAM_KIND = '''
from dataclasses import dataclass

from drafters import eagle1
from drafters.kinds import Engines, HeadConfig, Kind


@dataclass
class TeamConfig(HeadConfig):
    kind: str = "team"
    token_loss_weight: float = 0.5


KIND = Kind(name="team", schema=TeamConfig, recipe="train.heads", summary="a team's own head", head=eagle1.HEAD,
            layers=lambda n: [n], exporter="eval.engines.formats.eagle1:export_eagle1", formats=("vllm",), hub_root="vllm",
            tag="team", library="vllm", engines=Engines(vllm="eagle"),
            describe=lambda target, d, layers: f"The team's head for {target}.")
'''


def _install_team_kind(where: Path) -> None:
    """The kind's file, its YAML under conf/drafter/, and the entry point that names it."""
    (where / "team_kind.py").write_text(TEAM_KIND)
    (where / "conf" / "drafter").mkdir(parents=True)
    (where / "conf" / "drafter" / "team.yaml").write_text("defaults:\n  - team_schema\n  - _self_\n")
    info = where / "team_kind-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: team-kind\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[draftsmith.kinds]\nteam = team_kind\n")


@pytest.mark.slow
def test_a_kind_from_one_file_trains_evaluates_and_exports(tiny_world, tmp_path):
    _install_team_kind(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "train", "experiment=smoke", "target=tiny_deep", "drafter=team", "progress=false",
           "trainer.max_steps=4", "evaluate.prompts_per_category=1", "evaluate.max_new_tokens=8",
           "export.formats=[vllm]", f"hydra.run.dir={run}", f"data_cache={tmp_path / 'data'}",
           f"hydra.searchpath=[file://{tmp_path / 'conf'}]"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert json.loads((run / "best" / "config.json").read_text())["draftsmith_kind"] == "team"
    report = json.loads((run / "report.json").read_text())
    assert {r["drafter"] for r in report["results"]} >= {"trained_team"}  # the final evaluation measured it
    exported = json.loads((run / "export" / "vllm" / "config.json").read_text())
    assert exported["architectures"] == ["EagleLlamaForCausalLM"]


def test_a_kind_outside_the_package_is_found_through_its_entry_point(tmp_path, monkeypatch):
    _install_team_kind(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    kinds.kinds.cache_clear()
    try:
        assert kinds.kind("team").summary == "a team's own head" and "eagle" in kinds.kinds()
        assert default_layers("team", 8) == [8] and formats_for("team", ["auto"]) == ["vllm"]
    finally:
        monkeypatch.undo()
        kinds.kinds.cache_clear()
        sys.modules.pop("team_kind", None)
    assert "team" not in kinds.kinds()


def test_a_saved_drafter_is_read_as_its_kind():
    from transformers import LlamaConfig

    assert kinds.of_head({"draftsmith_kind": "dflash"}).name == "dflash"
    for architecture, name in (("LlamaForCausalLMEagle3", "eagle"), ("Eagle3Speculator", "eagle"),
                               ("PEagleSpeculator", "peagle"), ("EagleLlamaForCausalLM", "eagle1")):
        assert kinds.of_head({"architectures": [architecture]}).name == name  # an engine's export
    assert kinds.of_head({"architectures": ["DeepseekV3ForCausalLM"]}) is None
    plain, pard = LlamaConfig(), LlamaConfig(pard_token=7)
    assert kinds.of_lm(plain).name == kinds.of_lm(None).name == "draft_lm" and not kinds.of_lm(plain).parallel
    assert kinds.of_lm(pard).name == "pard" and kinds.of_lm(pard).parallel
    assert kinds.of_lm(pard).engines.llama_cpp is None
    assert "vLLM serves it" in kinds.of_lm(pard).engines.llama_cpp_cannot
