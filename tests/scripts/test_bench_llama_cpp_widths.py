"""scripts/bench_llama_cpp_widths.py: a forward of w positions timed by llama-server on top of a cached context, in
decoding steps of the same file, for each file given. The files are the tiny world's target written by llama.cpp's
converter at two types."""

from __future__ import annotations

import json

import pytest

from eval.engines import llama_cpp
from helpers import load_script
from traffic import toyworld

pytestmark = pytest.mark.skipif(not llama_cpp.available(), reason=(
    f"llama.cpp is not built at {llama_cpp.home()} (its server runs the forwards): `make llama-cpp`"))


def test_each_width_is_timed_on_top_of_the_cached_context_for_each_file(tiny_world, tmp_path, capsys):
    target = toyworld.resolve("toyworld://tiny/target")
    files = [llama_cpp.convert_to_gguf(target, tmp_path / f"t-{t}.gguf", outtype=t) for t in ("f16", "q8_0")]
    out = tmp_path / "widths.json"
    load_script("bench_llama_cpp_widths").main([*map(str, files), "--widths", "1,3", "--context", "24",
                                                "--decode", "4", "--blocks", "2", "--threads", "1",
                                                "--json", str(out)])
    results = json.loads(out.read_text())
    assert [r["file"] for r in results] == [str(f) for f in files]
    for r in results:
        assert set(r["width_ms"]) == {"1", "3"} and all(v > 0 for v in r["width_ms"].values())
        assert r["step_ms"] > 0 and r["tokens_per_s"] == pytest.approx(1000 / r["step_ms"])
        # A width's cost in steps is its time over the same file's decoding step.
        assert r["width_steps"]["3"] == pytest.approx(r["width_ms"]["3"] / r["step_ms"])
    table = capsys.readouterr().out
    assert "| t-f16.gguf |" in table and "| t-q8_0.gguf |" in table and "w=3" in table


def test_a_missing_file_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        load_script("bench_llama_cpp_widths").main([str(tmp_path / "none.gguf")])
    assert "none.gguf" in capsys.readouterr().err
