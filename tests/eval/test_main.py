"""`python -m eval`: every config composes, typos are errors, and a run writes the report contract."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

import eval.__main__ as entry
from eval.report import SCHEMA

CONF = str(Path(__file__).resolve().parents[2] / "conf")
TARGETS = sorted(p.stem for p in Path(CONF, "target").glob("*.yaml"))
DATA = sorted(p.stem for p in Path(CONF, "data").glob("*.yaml"))


def make_cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="eval", overrides=list(overrides))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("data", DATA)
def test_every_config_composes(target, data):
    cfg = make_cfg(f"target={target}", f"data={data}", "data.path=x.jsonl")
    assert cfg.target.name == target and cfg.drafters[0].name == "off_the_shelf"
    assert cfg.drafters[0].path == cfg.target.off_the_shelf_draft  # interpolation resolves


def test_mistyped_key_and_wrong_type_are_errors():
    with pytest.raises(ConfigCompositionException):
        make_cfg("repeat=3")  # the key is `repeats`
    with pytest.raises((ConfigCompositionException, ValidationError)):
        make_cfg("ks=[two]")


def test_unknown_drafter_kind_is_an_error(tiny_world, tmp_path):
    cfg = make_cfg("target=tiny", "drafters=[{name: x, kind: eagle9}]", f"out_dir={tmp_path}")
    with pytest.raises(ValueError, match="unknown kind 'eagle9'"):
        entry.run(cfg)


@pytest.mark.slow
def test_end_to_end_on_the_tiny_world_writes_the_report(tiny_world, tmp_path):
    cfg = make_cfg("target=tiny", "ks=[1,3]", "temperatures=[0.0,0.7]", "repeats=2", "max_new_tokens=16",
                   "data.max_prompts_per_category=2", "progress=false", f"out_dir={tmp_path}")
    entry.run(cfg)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["schema"] == SCHEMA and report["baseline"] == "off_the_shelf"
    assert {"target", "hardware", "results"} <= set(report)
    assert {"cpu", "torch", "torch_threads"} <= set(report["hardware"])
    categories = {r["category"] for r in report["results"]}
    assert categories == {"code", "json", "prose", "all"}
    assert len(report["results"]) == 4 * 2 * 2 * 2  # categories x drafters x ks x temperatures
    assert all(r["lossless"] is True for r in report["results"] if r["temperature"] == 0.0)
    for category in categories:
        assert (tmp_path / f"accept_hist_{category}.png").stat().st_size > 1000
    md = (tmp_path / "report.md").read_text()
    assert "## Summary" in md and "Verdict per category" in md


@pytest.mark.slow
def test_bad_input_exits_with_a_message_not_a_traceback(tiny_world, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "eval", "target=tiny", f"data.path={empty}",
         f"out_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, env={**__import__("os").environ}, timeout=300,
    )
    assert proc.returncode == 2
    assert "no usable records" in proc.stderr and "Traceback" not in proc.stderr
