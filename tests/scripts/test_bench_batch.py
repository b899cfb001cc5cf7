"""scripts/bench_batch.py: the cliff table and the cost model's error per batch size, from a report."""

import json
import sys

from helpers import load_script


def test_the_cliff_is_read_from_the_best_k_per_batch_size(tmp_path, monkeypatch, capsys):
    def row(b, k, speedup, predicted):
        return {"category": "code", "drafter": "eagle3", "temperature": 0.0, "batch_size": b, "k": k,
                "best_k": {1: 4, 8: 2}[b], "speedup": speedup, "speedup_ci": [speedup - 0.1, speedup + 0.1],
                "predicted_speedup": predicted, "cost_ratio": 0.1 * b, "verify_overhead": 0.2 * b}

    rows = [row(1, 2, 1.5, 1.5), row(1, 4, 1.8, 1.7), row(8, 2, 0.9, 0.95), row(8, 4, 0.7, 0.9)]
    (tmp_path / "report.json").write_text(json.dumps({"settings": {"pays_off_at": 1.05}, "results": rows}))
    monkeypatch.setattr(sys, "argv", ["bench_batch.py", str(tmp_path)])
    load_script("bench_batch").main()
    out = capsys.readouterr().out
    assert "| code | eagle3 | 1.80× k=4 (1.70–1.90) | 0.90× k=2 (0.80–1.00) | 1 | below 1 from B=8 |" in out
    assert "| 1 | 0.100 | 0.200 | 2 | 2/2 | 0.944–1.000 |" in out
    assert "| 8 | 0.800 | 1.600 | 2 | 1/2 | 1.056–1.286 |" in out
