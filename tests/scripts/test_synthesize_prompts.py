"""scripts/synthesize_prompts.py against a real llama-server (the library: tests/traffic/test_synthesize.py)."""

import json
import sys
from pathlib import Path

import pytest

from eval.engines import llama_cpp
from helpers import gone, killed_while_serving, load_script
from traffic.records import load_records

needs_llama_cpp = pytest.mark.skipif(not llama_cpp.available(), reason=(
    f"llama.cpp is not built at {llama_cpp.home()}: `make llama-cpp`"))


@needs_llama_cpp
@pytest.mark.slow
def test_the_script_samples_requests_from_a_real_llama_server(tiny_world, tmp_path):
    """scripts/synthesize_prompts.py on the tiny world's target, converted by llama.cpp and served by llama-server:
    the file it writes loads as traffic, each request sampled after the template's user-turn header."""
    out = tmp_path / "synth" / "chat.jsonl"
    script = load_script("synthesize_prompts")
    args = [str(tiny_world / "target"), str(out), "--count", "6", "--threads", "1", "--parallel", "2",
            "--max-tokens", "48", "--min-chars", "1", "--lead", "Hello"]
    script.main(args)
    meta = json.loads(out.with_name("chat.jsonl.meta.json").read_text())
    assert meta["leads"] == ["Hello"] and meta["model"]
    assert (tmp_path / "synth" / "target-f32.gguf").exists()
    written = out.read_text().splitlines()
    records, _ = load_records(str(out))
    assert 0 < len(records) == len(written)
    assert all(r.messages[0]["content"].startswith("Hello") for r in records)
    script.main(args)  # run again: resumes, samples nothing new when the file is complete
    assert out.read_text().splitlines() == written


@needs_llama_cpp
@pytest.mark.slow
def test_kill_stops_the_llama_server_the_script_started(tiny_world, tmp_path):
    """`kill` on the script ends it as Ctrl-C does: the llama-server sampling the requests stops with it."""
    root = Path(__file__).resolve().parents[2]
    status, server = killed_while_serving(
        [sys.executable, str(root / "scripts" / "synthesize_prompts.py"), str(tiny_world / "target"),
         str(tmp_path / "chat.jsonl"), "--count", "100000", "--threads", "1"], cwd=root)
    stopped = gone(server)  # first: a failing assertion must not leave the server running
    assert status == 143 and stopped
