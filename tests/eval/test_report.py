import json

import pytest

from eval.report import SCHEMA, build_report, next_report_dir, write_report
from eval.report_markdown import console_summary, markdown


def row(drafter, k, category, speedup, tau):
    return {"drafter": drafter, "k": k, "temperature": 0.0, "category": category, "prompts": 2, "rounds": 4,
            "accept_hist": [1, 1, 2][: k + 1] + [0] * max(0, k - 2), "mean_proposed": float(k),
            "mean_accepted": 1.0, "median_accepted": 1.0,
            "p10_accepted": 0.0, "p90_accepted": 2.0, "zero_accept_rate": 0.25, "full_hit_rate": 0.5,
            "acceptance_rate": 0.5, "position_acceptance": [0.75] + [None] * (k - 1), "acceptance_length": tau,
            "acceptance_length_iid": 1.5, "ar_tokens_per_s": 100.0, "sd_tokens_per_s": 100.0 * speedup,
            "speedup": speedup, "cost_ratio": 0.1, "verify_overhead": 0.2, "predicted_speedup": 1.1,
            "lossless": True, "tau_vs_baseline": 1.0, "speedup_vs_baseline": 1.0, "best_k": 2,
            "verdict": "pays off" if speedup >= 1.05 else "turn it off", "speedup_ci": [speedup - 0.1, speedup + 0.1],
            "speedup_vs_baseline_ci": None, "fastest": "base", "speedup_vs_fastest": speedup / 1.3,
            "speedup_vs_fastest_ci": [0.6, 0.8], "vs_fastest": "fastest" if drafter == "base" else "slower"}


def test_report_files(tmp_path):
    rows = [row("base", 2, "code", 1.3, 2.0), row("ngram", 2, "code", 0.9, 1.4), row("base", 2, "all", 1.2, 1.9),
            row("ngram", 2, "all", 0.8, 1.3)]
    report = build_report(rows, target="t", baseline="base", settings={"ks": [2]})
    paths = write_report(report, tmp_path / "out")
    loaded = json.loads(paths["json"].read_text())
    assert loaded["schema"] == SCHEMA and loaded["results"] == rows
    assert sorted(p.name for p in (tmp_path / "out").glob("*.png")) == ["accept_hist_all.png", "accept_hist_code.png"]
    assert not list((tmp_path / "out").glob("*.tmp"))
    md = markdown(report)
    assert "| code | base | 2 | 1 | 0.00 | 2.00 | 2.00 |" in md  # k, batch size (rows without one: 1), T, prop, τ
    assert "**code**, base, T=0.00: best k=2, speed-up 1.30× → pays off" in md
    assert "| code | base | 2 | 1 | 0.00 | 2 | 4 | 100.00 | 130.00 | 1.30 | 1.20–1.40 | 1.00 | – | 2 |" in md
    assert "batch" not in md.split("## Summary")[1]  # one batch size: no batch curves or batch labels
    assert "- code, k=2, T=0.00: fastest base; against it: ngram 0.69× (0.60–0.80) slower" in md
    console = console_summary(report)
    assert "turn it off" in console and "fastest base; against it: ngram 0.69× (0.60–0.80) slower" in console


def test_the_measurement_is_saved_before_anything_that_can_fail_afterwards(tmp_path, monkeypatch):
    import eval.report as module

    def broken(report):
        raise ImportError("a report.md renderer that fails")

    monkeypatch.setattr(module, "markdown", broken)
    report = build_report([row("base", 2, "all", 1.2, 1.9)], target="t", baseline="base", settings={"ks": [2]})
    with pytest.raises(ImportError, match="fails"):
        write_report(report, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "report.json").read_text())["results"] == report["results"]


def test_each_evaluation_gets_the_next_report_directory(tmp_path):
    assert next_report_dir(tmp_path) == tmp_path / "report-1"
    for name in ("report-1", "report-3", "report-final"):
        (tmp_path / name).mkdir()
    assert next_report_dir(tmp_path) == tmp_path / "report-4"


def test_several_batch_sizes_draw_the_cliff_and_say_where_speculation_stops_paying(tmp_path):
    speedups = {1: 1.6, 4: 1.2, 16: 0.9}
    rows = [{**row("base", 2, category, x, 2.0), "batch_size": b} for b, x in speedups.items()
            for category in ("code", "all")]
    report = build_report(rows, target="t", baseline="base", settings={"ks": [2], "pays_off_at": 1.05})
    paths = write_report(report, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").glob("batch_curve_*.png")) == ["batch_curve_all.png",
                                                                                     "batch_curve_code.png"]
    md = paths["md"].read_text()
    assert "## Speed-up against batch size" in md and "![batch_curve_code.png](batch_curve_code.png)" in md
    line = "- code, T=0.00, base: pays up to batch 4 (B=1: 1.60× (k=2), B=4: 1.20× (k=2), B=16: 0.90× (k=2))"
    assert line in md and line in console_summary(report)
    assert "**code**, base, T=0.00, batch 16: best k=2, speed-up 0.90× → turn it off" in md
    assert "| code | base | 16 | 2 | 0.00 | 2.00 | 0.10 | 0.20 | 1.10 | 0.90 |" in md


def test_trees_get_their_own_section_and_histogram_panel(tmp_path):
    """A tree measured at a depth no chain was (k = 3 beside chains at k = 2): its own histogram panel, the
    "Trees and chains" table, and the fastest shape with why in the verdict line."""
    chain = {**row("base", 2, "all", 1.2, 2.0), "tree": None, "best_shape": "tree d3t2n6",
             "best_shape_speedup": 1.4, "best_shape_why": "tree d3t2n6 keeps τ 2.60 against the chain's 2.00 (k=2)"}
    tree = {**row("base@d3t2n6", 3, "all", 1.4, 2.6), "tree": "d3t2n6", "base_drafter": "base", "mean_proposed": 6.0,
            "tau_vs_chain": 1.3, "best_k": 3, "acceptance_length_iid": None, "best_shape": "tree d3t2n6", "best_shape_speedup": 1.4}
    report = build_report([chain, tree], target="t", baseline="base", settings={"ks": [2], "trees": ["d3t2n6"]})
    paths = write_report(report, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").glob("*.png")] == ["accept_hist_all.png"]
    md = paths["md"].read_text()
    assert "## Trees and chains" in md and "| all | base@d3t2n6 | 3 | 0.00 | 6.00 | 2.60 | 1.30 |" in md
    assert ("fastest shape: tree d3t2n6 (1.40×: tree d3t2n6 keeps τ 2.60 against the chain's 2.00 (k=2))"
            in md)


def test_acceptance_is_split_by_prompt_length_where_the_prompts_differ_in_length():
    short, long = {"prompts": 3, "rounds": 30, "tau": 2.4}, {"prompts": 1, "rounds": 12, "tau": 1.3}
    rows = [row("base", 2, "code", 1.3, 2.0), row("base", 2, "all", 1.2, 1.9), row("base", 2, "rag", 1.0, 1.3)]
    rows[0]["acceptance_by_length"] = {"<128": short}
    rows[1]["acceptance_by_length"] = {"<128": short, "2048–8191": long}
    rows[2]["acceptance_by_length"] = {"2048–8191": long}
    report = build_report(rows, target="t", baseline="base", settings={"ks": [2]})
    md = markdown(report)
    section = md.split("## Acceptance by prompt length")[1].split("##")[0]
    assert "| category | drafter | k | T | <128 | 2048–8191 |" in section
    assert "| all | base | 2 | 0.00 | 2.40 (3) | 1.30 (1) |" in section
    assert "| code | base | 2 | 0.00 | 2.40 (3) |  |" in section  # a bucket the category has no prompt in: empty
    assert "- all, base, k=2, T=0.00: <128 2.40 (3), 2048–8191 1.30 (1)" in console_summary(report)
    # Every prompt in one bucket: nothing to split, no section.
    for r in rows:
        r["acceptance_by_length"] = {"<128": short}
    assert "## Acceptance by prompt length" not in markdown(build_report(rows, target="t", baseline="base",
                                                                             settings={"ks": [2]}))
    assert "τ by prompt length" not in console_summary(build_report(rows, target="t", baseline="base",
                                                                     settings={"ks": [2]}))
