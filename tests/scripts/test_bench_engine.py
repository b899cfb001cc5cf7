"""scripts/bench_engine.py: the engine's figures against draftsmith's, and the engine's speed-up per batch size."""

import json
import sys

from helpers import load_script


def test_batch_one_rows_are_checked_and_each_batch_size_gets_the_best_k(tmp_path, monkeypatch, capsys):
    def row(b, k, speedup, engine_speedup):
        one = b == 1
        return {"category": "code", "drafter": "eagle3", "temperature": 0.0, "batch_size": b, "k": k,
                "acceptance_length": 3.0, "speedup": speedup, "verdict": "pays off",
                "engine_speedup": engine_speedup, "engine_speedup_ci": [engine_speedup - 0.1, engine_speedup + 0.1],
                "engine_acceptance_length": 2.9 if one else None, "engine_cost_ratio": 0.2 if one else None,
                "engine_verify_overhead": 1.0 if one else None, "engine_predicted_speedup": 1.25 if one else None,
                "engine_verdict": "pays off" if engine_speedup >= 1.05 else "turn it off", "engine_lossless": True}

    rows = [row(1, 2, 1.5, 1.2), row(1, 4, 1.8, 1.1), row(4, 2, 1.3, 0.9), row(4, 4, 1.2, 0.8)]
    (tmp_path / "report.json").write_text(json.dumps({"settings": {"pays_off_at": 1.05}, "results": rows}))
    monkeypatch.setattr(sys, "argv", ["bench_engine.py", str(tmp_path)])
    load_script("bench_engine").main()
    out = capsys.readouterr().out
    assert "| eagle3 | 2 | code | 3.00 | 2.90 | 0.967 | 0.200 | 1.000 | 1.20× (1.10–1.30) | 1.25× | 1.042 |" in out
    assert "predicted speed-up within ±10 % of measured: 1/2" in out  # batch-1 rows only
    assert "| eagle3 | code | 1.20× k=2 (1.10–1.30) | 1.80× k=4 | 0.90× k=2 (0.80–1.00) | 1.30× k=2 |" in out
    assert "every llama.cpp row lossless (greedy output = its plain output at the same batch size): True" in out
