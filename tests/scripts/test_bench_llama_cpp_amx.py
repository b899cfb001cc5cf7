"""scripts/bench_llama_cpp_amx.py: each build serves each quantized GGUF and is timed, or says how it died and why.
Here the built llama.cpp serves a Q4_1 file of the tiny_deep target, beside a stand-in build whose server dies
the way an AMX build's does on the machines where its kernels crash."""

from __future__ import annotations

import json

import pytest

from eval.engines import llama_cpp
from helpers import load_script
from traffic import toyworld

pytestmark = pytest.mark.skipif(not llama_cpp.available(), reason=(
    f"llama.cpp is not built at {llama_cpp.home()}: `make llama-cpp`"))


def test_a_build_that_serves_is_timed_and_one_that_dies_says_why(tiny_world, tmp_path, monkeypatch):
    home = llama_cpp.home()
    monkeypatch.setenv("DRAFTSMITH_LLAMA_CPP", str(home))  # the script points it at each build in turn
    f32 = llama_cpp.convert_to_gguf(toyworld.resolve("toyworld://tiny_deep/target"), tmp_path / "t.gguf")
    q4 = llama_cpp.quantize(f32, tmp_path / "t-Q4_1.gguf", "Q4_1")
    dying = tmp_path / "dying"
    (dying / "bin").mkdir(parents=True)
    (dying / "src").mkdir()
    (dying / "src" / "convert_hf_to_gguf.py").write_text("")
    (dying / "bin" / "patches.sha256").write_text(llama_cpp.patches_digest() + "\n")
    (dying / "bin" / "amx").write_text("on\n")  # a build with ggml's AMX kernels
    for name, script in (("llama-server", "#!/bin/sh\nkill -SEGV $$\n"), ("llama-quantize", "#!/bin/sh\n"),
                         ("llama-hidden-states", "#!/bin/sh\n")):
        (dying / "bin" / name).write_text(script)
        (dying / "bin" / name).chmod(0o755)
    out = tmp_path / "amx.json"
    load_script("bench_llama_cpp_amx").main(["--build", f"default={home}", "--build", f"with_amx={dying}",
                                             "--model", str(q4), "--threads", "1", "--repeats", "1", "--out", str(out)])
    served, died = json.loads(out.read_text())
    assert served["served"] and served["name"] == "default" and served["model"] == "t-Q4_1.gguf"
    assert served["amx_record"] == (home / "bin" / "amx").read_text().strip() and served["amx_weights"] is False
    assert all(served[f"ms_{w}"] > 0 for w in (1, 5, 9, 512)) and served["ms_512"] > served["ms_1"]
    assert not died["served"] and "killed by SIGSEGV" in died["error"] and "AMX kernels" in died["error"]
