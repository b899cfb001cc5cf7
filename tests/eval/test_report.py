import json

from eval.report import SCHEMA, build_report, console_summary, markdown, write_report


def row(drafter, k, category, speedup, tau):
    return {"drafter": drafter, "k": k, "temperature": 0.0, "category": category, "prompts": 2, "rounds": 4,
            "accept_hist": [1, 1, 2][: k + 1] + [0] * max(0, k - 2), "mean_accepted": 1.0, "median_accepted": 1.0,
            "p10_accepted": 0.0, "p90_accepted": 2.0, "zero_accept_rate": 0.25, "full_hit_rate": 0.5,
            "acceptance_rate": 0.5, "position_acceptance": [0.75] + [None] * (k - 1), "acceptance_length": tau,
            "acceptance_length_iid": 1.5, "ar_tokens_per_s": 100.0, "sd_tokens_per_s": 100.0 * speedup,
            "speedup": speedup, "cost_ratio": 0.1, "verify_overhead": 0.2, "predicted_speedup": 1.1,
            "lossless": True, "tau_vs_baseline": 1.0, "speedup_vs_baseline": 1.0, "best_k": 2,
            "verdict": "pays off" if speedup >= 1.05 else "turn it off"}


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
    assert "| code | base | 2 | 0.00 | 2.00 |" in md
    assert "**code**, base, T=0.00: best k=2, speed-up 1.30× → pays off" in md
    assert "turn it off" in console_summary(report)
