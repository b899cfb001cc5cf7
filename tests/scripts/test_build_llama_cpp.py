"""scripts/build_llama_cpp.sh: the backend and the source it builds from are checked before anything is
touched, and a build that fails leaves the build that was there as it was (runs may be using it)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_llama_cpp.sh"


def build(dest: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DRAFTSMITH_LLAMA_CPP": str(dest), **env})


def a_build(dest: Path) -> dict[Path, bytes]:
    """A stand-in for an earlier build whose patches are not this clone's, so the script rebuilds it."""
    files = {dest / "bin" / "llama-server": b"#!/bin/sh\n", dest / "bin" / "llama-quantize": b"#!/bin/sh\n",
             dest / "bin" / "llama-hidden-states": b"#!/bin/sh\n", dest / "bin" / "patches.sha256": b"another digest\n", dest / "src" / "convert_hf_to_gguf.py": b"# the converter\n"}
    for path, content in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    (dest / "bin" / "llama-server").chmod(0o755)
    (dest / "bin" / "llama-quantize").chmod(0o755)
    (dest / "bin" / "llama-hidden-states").chmod(0o755)
    return files


def a_current_build(dest: Path) -> None:
    """`a_build`, but made with this clone's patches (the digest the script computes, in the shell, itself)."""
    a_build(dest)
    patches = SCRIPT.parents[1] / "eval" / "engines" / "llama_cpp_patches"
    digest = subprocess.run(f"cat {patches}/*.patch | sha256sum", shell=True, capture_output=True, text=True,
                            env={**os.environ, "LC_ALL": "C"}).stdout.split()[0]
    (dest / "bin" / "patches.sha256").write_text(digest + "\n")


def test_an_unknown_backend_is_refused_by_name(tmp_path):
    done = build(tmp_path / "lc", LLAMA_CPP_BACKEND="metal")
    assert done.returncode == 2 and "LLAMA_CPP_BACKEND must be cpu or cuda, got 'metal'" in done.stderr
    assert not (tmp_path / "lc").exists()


@pytest.mark.skipif(shutil.which("nvcc", path="/usr/bin:/bin") is not None, reason="nvcc is in /usr/bin here")
def test_a_cuda_build_needs_nvcc(tmp_path):
    done = build(tmp_path / "lc", LLAMA_CPP_BACKEND="cuda", PATH="/usr/bin:/bin")  # no CUDA toolkit on it
    assert done.returncode == 2 and "needs CUDA's compiler, nvcc" in done.stderr


def test_a_failed_build_leaves_the_previous_one_in_place(tmp_path):
    dest = tmp_path / "lc"
    before = a_build(dest)
    done = build(dest, LLAMA_CPP_SOURCE=str(tmp_path / "nowhere"))
    assert done.returncode == 2 and "holds no llama.cpp source" in done.stderr

    source = tmp_path / "llama.cpp"  # a source tree the patches do not apply to: the build stops there
    source.mkdir()
    (source / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.14)\nproject(nothing)\n")
    (source / "convert_hf_to_gguf.py").write_text("")
    done = build(dest, LLAMA_CPP_SOURCE=str(source))
    assert done.returncode != 0 and "applying" in done.stderr
    assert {path: path.read_bytes() for path in before} == before  # the earlier build, byte for byte
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lc", "llama.cpp"]  # no scratch directory left behind
    assert sorted(p.name for p in source.iterdir()) == ["CMakeLists.txt", "convert_hf_to_gguf.py"]  # copied, not changed


def test_the_cached_builds_backend_is_kept_unless_another_is_asked_for(tmp_path):
    """`make test` after `LLAMA_CPP_BACKEND=cuda make llama-cpp` keeps the CUDA build; asking for cpu rebuilds."""
    dest = tmp_path / "lc"
    a_current_build(dest)
    (dest / "bin" / "backend").write_text("cuda\n")
    (dest / "bin" / "amx").write_text("none\n")  # built on a CPU without AMX, as this test's CPU is said to be
    (tmp_path / "cpuinfo").write_text("flags\t\t: fpu avx2\n")
    kept = build(dest, PATH="/usr/bin:/bin", DRAFTSMITH_CPUINFO=str(tmp_path / "cpuinfo"))  # no nvcc needed: nothing is built
    assert kept.returncode == 0 and kept.stdout.strip() == str(dest) and not kept.stderr
    rebuilt = build(dest, LLAMA_CPP_BACKEND="cpu", LLAMA_CPP_SOURCE=str(tmp_path / "nowhere"))
    assert rebuilt.returncode == 2 and "holds no llama.cpp source" in rebuilt.stderr  # it went on to rebuild


def fake_tools(tmp_path: Path) -> tuple[Path, Path]:
    """A `cmake` that records its configure arguments and `builds` the binaries, and a `patch` that applies
    nothing, ahead of the system's on PATH; and a source directory the script accepts: the script's own
    decisions, without a 5-minute build."""
    tools, source = tmp_path / "tools", tmp_path / "llama.cpp"
    tools.mkdir()
    source.mkdir()
    (source / "CMakeLists.txt").write_text("")
    (source / "convert_hf_to_gguf.py").write_text("")
    (tools / "patch").write_text("#!/bin/sh\ncat > /dev/null\n")
    (tools / "cmake").write_text(f"""#!/bin/sh
if [ "$1" = --build ]; then mkdir -p "$2/bin" && touch "$2/bin/llama-server" "$2/bin/llama-quantize" \\
    "$2/bin/llama-hidden-states" && chmod +x "$2/bin/llama-server" "$2/bin/llama-quantize" "$2/bin/llama-hidden-states"
    exit 0; fi
printf '%s\\n' "$@" > {tmp_path}/configure.args
""")
    for tool in tools.iterdir():
        tool.chmod(0o755)
    return tools, source


@pytest.mark.parametrize("cpu, amx, flags, record", [
    ("avx512f amx_tile amx_int8 amx_bf16", None, True, "off"),  # AMX: its kernels left out
    ("avx512f amx_tile amx_int8 amx_bf16", "on", False, "on"),  # unless asked for
    ("avx2 avx512f avx512_vnni", None, False, "none"),  # no AMX: nothing passed, as before
])
def test_the_amx_kernels_are_left_out_where_the_cpu_has_amx(tmp_path, cpu, amx, flags, record):
    tools, source = fake_tools(tmp_path)
    (tmp_path / "cpuinfo").write_text(f"flags\t\t: fpu sse2 {cpu}\n")
    env = {"PATH": f"{tools}:{os.environ['PATH']}", "LLAMA_CPP_SOURCE": str(source),
           "DRAFTSMITH_CPUINFO": str(tmp_path / "cpuinfo")}
    done = build(tmp_path / "lc", **env, **({"LLAMA_CPP_AMX": amx} if amx else {}))
    assert done.returncode == 0, done.stderr
    configure = (tmp_path / "configure.args").read_text().splitlines()
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    assert (f"-DCMAKE_C_FLAGS={no_amx}" in configure and f"-DCMAKE_CXX_FLAGS={no_amx}" in configure) == flags
    assert "-DGGML_NATIVE=ON" in configure
    assert (tmp_path / "lc" / "bin" / "amx").read_text().strip() == record
    assert (tmp_path / "lc" / "bin" / "llama-quantize").exists()
    (tmp_path / "configure.args").unlink()
    again = build(tmp_path / "lc", **env, **({"LLAMA_CPP_AMX": amx} if amx else {}))
    assert again.returncode == 0 and not (tmp_path / "configure.args").exists()  # the cached build is kept


def test_a_build_from_before_the_amx_choice_is_rebuilt_on_an_amx_cpu_only(tmp_path):
    """A build without bin/amx ran the AMX kernels wherever the CPU had them: rebuilt there, kept elsewhere."""
    dest = tmp_path / "lc"
    a_current_build(dest)
    (tmp_path / "other").write_text("flags\t\t: fpu avx2\n")
    (tmp_path / "amx").write_text("flags\t\t: fpu avx2 amx_tile amx_int8\n")
    kept = build(dest, DRAFTSMITH_CPUINFO=str(tmp_path / "other"), LLAMA_CPP_SOURCE=str(tmp_path / "nowhere"))
    assert kept.returncode == 0 and kept.stdout.strip() == str(dest)
    rebuilt = build(dest, DRAFTSMITH_CPUINFO=str(tmp_path / "amx"), LLAMA_CPP_SOURCE=str(tmp_path / "nowhere"))
    assert rebuilt.returncode == 2 and "holds no llama.cpp source" in rebuilt.stderr  # it went on to rebuild
    refused = build(dest, DRAFTSMITH_CPUINFO=str(tmp_path / "amx"), LLAMA_CPP_AMX="maybe")
    assert refused.returncode == 2 and "LLAMA_CPP_AMX must be on or off, got 'maybe'" in refused.stderr
