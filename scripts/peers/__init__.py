"""The peer trainers scripts/bench_peers.py sets beside draftsmith's: one module each (specforge.py, speculators.py),
with what the peer reads (a converter from draftsmith's feature cache), its settings (`defaults`, the rungs towards
`matched`), its run (its own CLI in a subprocess, `python scripts/bench_peers.py _peer <name> ...`) and its exporter.

A peer runs its own kernels wherever an accelerator is present; the shims a CPU needs (each with its reason, in the
peer's `main`) are applied only where none is.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# Installed beside the project with `pip --target` (Makefile: make install): on sys.path after the project's own
# packages, so the venv's torch and transformers are the ones imported.
INSTALLED = {"specforge": ROOT / ".venv" / "specforge", "speculators": ROOT / ".venv" / "speculators"}
# The ladder from a peer's defaults to `matched`, one group of settings added at a time (the learning rate first):
# what each rung adds is the peer module's RUNGS.
LADDER = ("defaults", "+lr", "+schedule", "+ttt", "matched")


def on_cpu() -> bool:
    """No accelerator: the peers' CPU shims apply."""
    return not torch.cuda.is_available()


def on_path(name: str) -> None:
    if str(INSTALLED[name]) not in sys.path:
        sys.path.append(str(INSTALLED[name]))


def rung_settings(name: str, matched: dict, rungs: dict) -> dict:
    """The settings of LADDER's rung `name` for a peer: its defaults plus the matched values of every group up to and
    including that rung's (`matched` itself: all of them)."""
    if name not in LADDER:
        raise ValueError(f"unknown setting {name!r}: the ladder is {LADDER}")
    if name == "matched":
        return dict(matched)
    keys = [key for rung in LADDER[1:LADDER.index(name) + 1] for key in rungs[rung]]
    return {key: matched[key] for key in keys if key in matched}


def curve_steps(steps: int, points: int) -> list[int]:
    """The steps each trainer saves its head at for the time to τ: `points` of them evenly spaced, the last one the
    final step."""
    every = max(1, steps // max(1, points))
    return sorted({*range(every, steps, every), steps})


def elapsed_at(step_seconds: list[float], steps: list[int]) -> list[float]:
    """The training seconds up to and including each of `steps` (1-based), from each step's seconds."""
    return [round(sum(step_seconds[:s]), 2) for s in steps]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_peer(name: str, argv: list[str], env: dict, log: Path, threads: int, drop: tuple = ()) -> float:
    """`python scripts/bench_peers.py _peer <name> argv...` (the shims, then the peer's CLI) in a subprocess on
    `threads` threads, its output in `log`; the seconds it ran. A peer that fails stops the benchmark with the log's
    tail."""
    environ = {k: v for k, v in os.environ.items() if k not in drop}
    environ.update(env)
    environ.update({"OMP_NUM_THREADS": str(threads), "BENCH_PEERS_THREADS": str(threads)})
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")])
    started = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_peers.py"), "_peer", name, *argv],
                              env=environ, stdout=f, stderr=subprocess.STDOUT, cwd=log.parent)
    if proc.returncode:
        raise SystemExit(f"{name} failed (exit {proc.returncode}); the end of {log}:\n{log.read_text()[-3000:]}")
    return round(time.perf_counter() - started, 1)


def pin_threads() -> None:
    """In a peer's subprocess: the torch threads every trainer gets (run_peer's `threads`)."""
    torch.set_num_threads(int(os.environ.get("BENCH_PEERS_THREADS", torch.get_num_threads())))
