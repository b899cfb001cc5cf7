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
    files = {dest / "bin" / "llama-server": b"#!/bin/sh\n", dest / "bin" / "patches.sha256": b"another digest\n",
             dest / "src" / "convert_hf_to_gguf.py": b"# the converter\n"}
    for path, content in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    (dest / "bin" / "llama-server").chmod(0o755)
    return files


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
    a_build(dest)
    patches = SCRIPT.parents[1] / "eval" / "llama_cpp_patches"
    digest = subprocess.run(f"cat {patches}/*.patch | sha256sum", shell=True, capture_output=True, text=True,
                            env={**os.environ, "LC_ALL": "C"}).stdout.split()[0]
    (dest / "bin" / "patches.sha256").write_text(digest + "\n")
    (dest / "bin" / "backend").write_text("cuda\n")
    kept = build(dest, PATH="/usr/bin:/bin")  # no nvcc needed: nothing is built
    assert kept.returncode == 0 and kept.stdout.strip() == str(dest) and not kept.stderr
    rebuilt = build(dest, LLAMA_CPP_BACKEND="cpu", LLAMA_CPP_SOURCE=str(tmp_path / "nowhere"))
    assert rebuilt.returncode == 2 and "holds no llama.cpp source" in rebuilt.stderr  # it went on to rebuild
