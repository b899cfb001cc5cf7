"""scripts/check_export.py: speculators' and SpecForge's classes read a run's EAGLE-3 exports and give its head's
draft logits; an export they would read as another head fails the check."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import load_script
from train.export import ExportSettings, export
from traffic import toyworld

VENV = Path(__file__).resolve().parents[2] / ".venv"
pytestmark = pytest.mark.skipif(not all((VENV / p / ".installed").exists() for p in ("speculators", "specforge")),
                                reason=f"speculators and SpecForge are not installed beside {VENV}: `make install`")


def test_the_engines_classes_give_the_heads_logits_and_a_misread_export_fails(eagle_run, tmp_path):
    run = Path(shutil.copytree(eagle_run, tmp_path / "run"))
    export(run, run / "export", ExportSettings(formats=["sglang", "speculators"]))
    prompts = Path(toyworld.resolve("toyworld://tiny_deep/target")).parent / "company_logs" / "eval.jsonl"
    check = load_script("check_export")
    with pytest.raises(SystemExit) as done:
        check.main([str(run), "--prompts", str(prompts), "--n", "2", "--atol", "1e-5"])
    assert done.value.code == 0
    # The same weights read with the other residual convention: speculators computes another head.
    config = run / "export" / "speculators" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "norm_before_residual": True}))
    with pytest.raises(SystemExit) as done:
        check.main([str(run), "--prompts", str(prompts), "--n", "2", "--atol", "1e-5"])
    assert done.value.code == 1
