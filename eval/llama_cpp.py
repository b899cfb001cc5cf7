"""llama.cpp, a real serving engine that runs here: its converter (HF -> GGUF) and `llama-server`.

The build is llama.cpp as vendored by the llama-cpp-python source distribution on PyPI, compiled once
by `scripts/build_llama_cpp.sh` (`make llama-cpp`) into `$DRAFTSMITH_LLAMA_CPP`, by default
`$DRAFTSMITH_HOME/llama.cpp/llama-cpp-python-<version>/` (bin/llama-server, src/ with
convert_hf_to_gguf.py and gguf-py/). Nothing of llama.cpp is edited or reimplemented here: conversion runs
its own script, serving its own server, and what it reports (`timings.draft_n`, `draft_n_accepted`) is
read as it reports it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python's sdist, whose vendored llama.cpp is built


def home() -> Path:
    """The llama.cpp build: $DRAFTSMITH_LLAMA_CPP, else the cache scripts/build_llama_cpp.sh fills."""
    if os.environ.get("DRAFTSMITH_LLAMA_CPP"):
        return Path(os.environ["DRAFTSMITH_LLAMA_CPP"])
    from train import toyworld

    return toyworld.home() / "llama.cpp" / f"llama-cpp-python-{VERSION}"


def available() -> bool:
    return (home() / "bin" / "llama-server").exists() and (home() / "src" / "convert_hf_to_gguf.py").exists()


def _require() -> Path:
    if not available():
        raise FileNotFoundError(f"llama.cpp is not built at {home()}: run `make llama-cpp` "
                                "(scripts/build_llama_cpp.sh, about 15 minutes on 2 cores) or set DRAFTSMITH_LLAMA_CPP")
    return home()
