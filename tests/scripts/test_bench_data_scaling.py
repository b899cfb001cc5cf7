"""scripts/bench_data_scaling.py: balanced shares with one held-out set, the fit, and a sweep on the tiny world."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_data_scaling.py"
scaling = load_script("bench_data_scaling")


def lines_of(categories):
    return [json.dumps({"id": f"{c}-{i}", "category": c}) for i, c in enumerate(categories)]


def test_every_share_keeps_every_nth_training_record_and_the_same_held_out_ones_last():
    lines = lines_of(["a"] * 8 + ["b"] * 8)  # grouped by category, as prepared files are
    shares = scaling.split_shares(lines, Path("x.jsonl"), [1, 2, 4], heldout=4)
    held = [line for line in lines if json.loads(line)["id"] in {"a-6", "a-7", "b-14", "b-15"}]
    rest = [line for line in lines if line not in held]
    assert shares[1] == rest + held
    assert shares[2] == rest[::2] + held
    assert [json.loads(line)["id"] for line in shares[4]] == ["a-0", "a-4", "b-10", "a-6", "a-7", "b-14", "b-15"]


def test_a_record_without_category_is_named_by_file_and_line():
    lines = lines_of(["a", "b"]) + [json.dumps({"id": "x"})]
    with pytest.raises(ValueError, match=r"x\.jsonl:3: field 'category'"):
        scaling.split_shares(lines, Path("x.jsonl"), [1], heldout=1)
    with pytest.raises(ValueError, match=r"x\.jsonl:2: not valid JSON"):
        scaling.split_shares(lines_of(["a"]) + ["{"], Path("x.jsonl"), [1], heldout=1)
    with pytest.raises(ValueError, match="keeps none"):
        scaling.split_shares(lines_of(["a"] * 4), Path("x.jsonl"), [8], heldout=2)


def test_more_records_double_the_file_so_its_shares_are_the_doubled_files_even_shares():
    lines = lines_of(["a"] * 6 + ["b"] * 4 + ["a"] * 2)  # held out (2): the last a and the last b
    more = [json.dumps({"id": f"new-{c}-{i}", "category": c}) for i, c in enumerate(["b"] * 3 + ["a"] * 7)]
    both = scaling.doubled(lines, Path("x.jsonl"), more, Path("more.jsonl"), heldout=2)
    assert len(both) == len(lines) + len(more) and set(both) == set(lines) | set(more)
    once, twice = (scaling.split_shares(f, Path("x.jsonl"), [1, 2, 4], heldout=2) for f in (lines, both))
    assert twice[2] == once[1] and twice[4] == once[2]
    ids = [json.loads(line)["id"] for line in twice[1]]
    assert ids[-2:] == ["b-9", "a-11"] and ids[:4] == ["a-0", "new-a-3", "a-1", "new-a-4"]
    with pytest.raises(ValueError, match=r"more\.jsonl: \{'a': 7, 'b': 2\} records by category, but x\.jsonl trains "
                                         r"on \{'a': 7, 'b': 3\}"):
        scaling.doubled(lines, Path("x.jsonl"), more[1:], Path("more.jsonl"), heldout=2)


def point(records, tau, by_category=None):
    return scaling.Point(share=1, records=records, steps=1, step=1, top1=0.5, tau=tau, tau_by_category=by_category or {})


def test_the_fit_gives_the_gain_per_doubling_and_where_the_line_meets_the_goal():
    points = [point(r, 1 + 0.1 * math.log2(r), {"a": 2 + 0.3 * math.log2(r), "b": 1.5}) for r in (100, 200, 400, 800)]
    result = scaling.fit(points, goal=2.0)
    assert result.per_doubling == pytest.approx(0.1)
    assert result.per_doubling_by_category == pytest.approx({"a": 0.3, "b": 0.0})
    assert "| per doubling | | | | | +0.100 | +0.300 | +0.000 |" in scaling.table(points, result)
    assert result.records_for_goal == pytest.approx(2 ** 10)
    assert result.tau_at(1600) == pytest.approx(1 + 0.1 * math.log2(1600))
    flat = scaling.fit([point(100, 1.5), point(200, 1.5), point(400, 1.4)], goal=2.0)
    assert flat.per_doubling < 0 and flat.records_for_goal is None
    assert "does not rise" in scaling.table([point(100, 1.5), point(200, 1.5), point(400, 1.4)], flat)


def test_the_goals_records_are_costed_at_the_largest_runs_pace():
    points = [point(r, 1 + 0.1 * math.log2(r)) for r in (100, 200, 400)]
    for p, steps, step_s in zip(points, (25, 50, 100), (9.0, 9.0, 2.0)):
        p.steps, p.step_s = steps, step_s
    result = scaling.fit(points, goal=2.0)  # the goal at 2 ** 10 records: 1024 / 400 times the largest run
    compute = scaling.goal_compute(points, result)
    assert compute["steps"] == pytest.approx(1024 / 4) and compute["hours"] == pytest.approx(256 * 2.0 / 3600)
    assert "would train about 256 steps, 0.1 hours of training steps alone" in scaling.table(points, result, compute)
    points[-1].step_s = None  # a run from before step times were logged
    assert scaling.goal_compute(points, result) is None
    flat = [point(100, 1.5), point(200, 1.4)]
    assert scaling.goal_compute(flat, scaling.fit(flat, goal=2.0)) is None


def test_a_sweep_on_the_tiny_world_trains_each_share_once_and_fits_them(tiny_world, tmp_path):
    """With --steps-per-share scaled, share 1/2 trains half the steps of the whole file."""
    records = (tiny_world / "company_logs" / "train.jsonl").read_text().splitlines()[:40]
    data = tmp_path / "records.jsonl"
    data.write_text("\n".join(records) + "\n")
    cmd = [sys.executable, str(SCRIPT), "--data", str(data), "--shares", "1,2", "--steps", "4",
           "--steps-per-share", "scaled", "--heldout", "6", "--goal", "9", "--out", str(tmp_path / "scaling"), "--overrides", "experiment=smoke",
           f"data_cache={tmp_path / 'cache'}", "drafter=eagle", "trainer.eval_every=2",
           "trainer.checkpoint_every=2"]
    subprocess.run(cmd, capture_output=True, text=True, check=True)
    result = json.loads((tmp_path / "scaling" / "scaling-scaled.json").read_text())
    assert [(p["share"], p["records"], p["steps"]) for p in result["points"]] == [(1, 34, 4), (2, 17, 2)]
    assert [p["step"] for p in result["points"]] == [4, 2] and all(p["tau"] >= 1 for p in result["points"])
    assert all(p["step_s"] > 0 for p in result["points"])  # the trainer's step times, read back
    assert (tmp_path / "scaling" / "scaling-scaled.png").stat().st_size > 0
    # Both runs held out the same six records, last in their files.
    one, two = ((tmp_path / "scaling" / "data" / f"{n}records.jsonl").read_text().splitlines() for n in (34, 17))
    assert one[-6:] == two[-6:] and len(two) == 17 + 6
    # A second invocation trains nothing again.
    summaries = [tmp_path / "scaling" / run / "train_summary.json" for run in ("34records-4steps", "17records-2steps")]
    stamps = [s.stat().st_mtime_ns for s in summaries]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert [s.stat().st_mtime_ns for s in summaries] == stamps
    assert "τ per doubling of the records" in out and "each step up in the records, smallest first: " in out
    # Twice the records with --more (the trained-on records again, under new ids) and twice the steps: only the
    # doubled file trains; the two runs above are its shares 1/2 and 1/4.
    held = set(one[-6:])
    more = tmp_path / "more.jsonl"
    more.write_text("".join(json.dumps({**json.loads(line), "id": f"again-{i}"}) + "\n"
                            for i, line in enumerate(records) if line not in held))
    doubled = [*cmd[:cmd.index("--shares")], "--more", str(more), "--shares", "1,2,4", "--steps", "8",
               *cmd[cmd.index("--steps") + 2:]]
    subprocess.run(doubled, capture_output=True, text=True, check=True)
    assert [s.stat().st_mtime_ns for s in summaries] == stamps
    result = json.loads((tmp_path / "scaling" / "scaling-scaled.json").read_text())
    assert [(p["share"], p["records"], p["steps"]) for p in result["points"]] == [(1, 68, 8), (2, 34, 4), (4, 17, 2)]
    # A finished run is never read as another file's share.
    (tmp_path / "scaling" / "data" / "17records.jsonl").write_text(two[0] + "\n")
    run = subprocess.run(doubled, capture_output=True, text=True)
    assert run.returncode != 0 and "17records-2steps trained on other records" in run.stderr
