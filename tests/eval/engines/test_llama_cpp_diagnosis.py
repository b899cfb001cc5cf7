"""What a user reads when llama-server dies while loading (eval/engines/llama_cpp.py): the signal by name, the likely
cause and the way around it. The server is a stand-in script in a build directory made here, which dies the
way the real one does, so these run on every machine, with or without llama.cpp built."""

from __future__ import annotations

import pytest

from eval.engines import llama_cpp

AMX_CPU = "flags\t\t: fpu sse2 avx512f avx512_vnni amx_bf16 avx512_fp16 amx_tile amx_int8\n"
OTHER_CPU = "flags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16\n"


@pytest.fixture
def build(tmp_path, monkeypatch):
    """A build directory whose llama-server logs a few lines and kills itself with the signal it is told."""
    home = tmp_path / "llama.cpp"
    (home / "bin").mkdir(parents=True)
    (home / "src").mkdir()
    (home / "src" / "convert_hf_to_gguf.py").write_text("")
    (home / "bin" / "patches.sha256").write_text(llama_cpp.patches_digest() + "\n")
    (home / "bin" / "llama-quantize").write_text("#!/bin/sh\n")
    (home / "bin" / "llama-hidden-states").write_text("#!/bin/sh\n")
    monkeypatch.setenv("DRAFTSMITH_LLAMA_CPP", str(home))

    def dying_of(signal: str, amx: str) -> None:
        server = home / "bin" / "llama-server"
        server.write_text(f"#!/bin/sh\necho 'load_model: loading model'\nkill -{signal} $$\n")
        (home / "bin" / "amx").write_text(amx + "\n")
        for binary in (home / "bin").iterdir():
            binary.chmod(0o755)
    return dying_of


def test_a_segfault_on_a_build_with_amx_kernels_names_them_and_the_way_around(build, tmp_path):
    build("SEGV", amx="on")
    with pytest.raises(RuntimeError) as error:
        with llama_cpp.LlamaServer(tmp_path / "model-Q4_1.gguf", timeout=20):
            pass
    message = str(error.value)
    assert message.startswith(f"llama-server was killed by SIGSEGV (signal 11) while loading {tmp_path}/model-Q4_1.gguf")
    assert "AMX kernels" in message and "make llama-cpp" in message and "LLAMA_ARG_REPACK=0" in message
    assert message.endswith("load_model: loading model")  # and the log's end


def test_a_segfault_without_amx_kernels_blames_nothing_it_cannot_know(build, tmp_path):
    build("SEGV", amx="off")
    with pytest.raises(RuntimeError, match=r"killed by SIGSEGV \(signal 11\)") as error:
        with llama_cpp.LlamaServer(tmp_path / "model.gguf", timeout=20):
            pass
    assert "AMX" not in str(error.value)


def test_an_illegal_instruction_says_the_build_is_for_another_cpu(build, tmp_path):
    build("ILL", amx="none")
    with pytest.raises(RuntimeError, match=r"killed by SIGILL \(signal 4\).*compiled for another CPU"):
        with llama_cpp.LlamaServer(tmp_path / "model.gguf", timeout=20):
            pass


def test_amx_is_read_from_the_cpus_flags_and_the_builds_record(build, tmp_path):
    (tmp_path / "amx").write_text(AMX_CPU)
    (tmp_path / "other").write_text(OTHER_CPU)
    assert llama_cpp.cpu_has_amx(tmp_path / "amx") and not llama_cpp.cpu_has_amx(tmp_path / "other")
    assert not llama_cpp.cpu_has_amx(tmp_path / "nowhere")
    build("SEGV", amx="off")
    assert llama_cpp.amx_kernels() == "off"
