"""scripts/bench_heads.py on the tiny world: every kind asked for is trained, then measured in one run."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_heads.py"


def test_trains_each_kind_once_and_measures_them_side_by_side(tiny_world, tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--steps", "3", "--kinds", "draft_lm_sft,eagle_probability_vocab",
           "--temperatures", "0,1", "--prompts", "1", "--repeats", "1", "--out", str(tmp_path / "bench"),
           "--overrides", "experiment=smoke", f"data_cache={tmp_path / 'data'}", "drafter.draft_vocab_size=150"]
    subprocess.run(cmd, capture_output=True, text=True, check=True)
    report = json.loads((tmp_path / "bench" / "report-1" / "report.json").read_text())
    measured = {(r["drafter"], r["temperature"]) for r in report["results"]}
    names = {"off_the_shelf", "draft_lm_sft", "draft_lm_sft_hf_forward", "eagle_probability_vocab"}
    assert measured == {(name, t) for name in names for t in (0.0, 1.0)}
    best = json.loads((tmp_path / "bench" / "eagle_probability_vocab" / "best" / "best.json").read_text())
    assert set(best["vocabulary_probability"]) == {"code", "json", "prose"}
    # A second invocation measures again but does not train again.
    stamp = (tmp_path / "bench" / "draft_lm_sft" / "train_summary.json").stat().st_mtime_ns
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert (tmp_path / "bench" / "draft_lm_sft" / "train_summary.json").stat().st_mtime_ns == stamp
    assert "eagle_probability_vocab: best at step" in out
    # ... into a report of its own, beside the first one.
    second = json.loads((tmp_path / "bench" / "report-2" / "report.json").read_text())
    assert {(r["drafter"], r["temperature"]) for r in second["results"]} == measured
    assert json.loads((tmp_path / "bench" / "report-1" / "report.json").read_text()) == report
