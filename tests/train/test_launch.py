"""train/launch.py: every process of a launch writes to one run directory, a named run launched again resumes, and
the ranks wait for rank 0's caches on the disk, not in a collective."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from eval.run import load_target
from helpers import write_engine_files
from traffic import checkpoint

ROOT = Path(__file__).resolve().parents[2]
STAMP = "from train.launch import run_stamp; print(run_stamp(), flush=True)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_store():
    """A store as torchrun's agent hosts it for a launch, and the environment it hands each worker."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    return store, env


def rank_env(env: dict, rank: int) -> dict:
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0"}


def start_ranks_apart(env: dict, argv: list[str], cwd: Path, gap: float = 1.5) -> list[subprocess.Popen]:
    """Rank 0, then rank 1 `gap` seconds later: on either side of a second boundary, whatever the clock reads."""
    procs = []
    for rank in (0, 1):
        procs.append(subprocess.Popen(argv, cwd=cwd, env=rank_env(env, rank), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
        if rank == 0:
            time.sleep(gap)
    return procs


def test_ranks_started_a_second_apart_share_rank_0s_stamp_and_a_restart_keeps_it(tmp_path):
    store, env = agent_store()
    procs = start_ranks_apart(env, [sys.executable, "-c", STAMP], tmp_path)
    stamps = [p.communicate(timeout=120)[0].strip().splitlines()[-1] for p in procs]
    assert all(p.returncode == 0 for p in procs), stamps
    assert stamps[0] == stamps[1] == store.get("draftsmith/run_stamp").decode()
    # The launcher restarts the workers (--max-restarts) with the same store: they keep the first attempt's stamp.
    time.sleep(1.1)
    again = start_ranks_apart(env, [sys.executable, "-c", STAMP], tmp_path, gap=0)
    assert [p.communicate(timeout=120)[0].strip().splitlines()[-1] for p in again] == stamps


def test_a_launch_without_torchruns_store_must_name_the_run(tmp_path):
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    proc = subprocess.run([sys.executable, "-c", STAMP], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "name=<run name>" in proc.stderr


def test_one_process_reads_its_own_clock():
    from train.launch import STAMP_FORMAT, run_stamp

    assert time.strptime(run_stamp(), STAMP_FORMAT)


TRAIN = [sys.executable, "-m", "train", "experiment=smoke", "progress=false", "evaluate.enabled=false"]


@pytest.mark.slow
def test_two_ranks_started_a_second_apart_train_in_one_run_directory(tiny_world, tmp_path):
    """The default run directory, runs/train/<kind>/<time>, as Hydra resolves it in each process: one for both."""
    _, env = agent_store()
    procs = start_ranks_apart(env, [*TRAIN, "trainer.max_steps=2"], tmp_path)
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    runs = list((tmp_path / "runs" / "train" / "draft_lm").iterdir())
    assert len(runs) == 1 and (runs[0] / "train_summary.json").exists()
    assert "rank 1 of 2: done" in outs[1]


def launch(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    """The documented multi-GPU command, on two CPU processes (`--multi_gpu` with Accelerator(cpu=True) runs two
    gloo ranks on a machine without GPUs), run from tmp_path so the run lands under tmp_path/runs."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--main_process_port", str(free_port()),
           "-m", "train", *TRAIN[3:], *overrides]
    return subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)},
                            start_new_session=True)


@pytest.mark.slow
def test_a_named_two_process_run_killed_and_launched_again_resumes_to_the_same_weights(tiny_world, tmp_path):
    steps = ["trainer.max_steps=6", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=10", "trainer.resume=auto"]
    (tmp_path / "full").mkdir()
    (tmp_path / "killed").mkdir()
    full = launch(tmp_path / "full", *steps, "name=mine")
    out = full.communicate(timeout=900)[0]
    assert full.returncode == 0, out[-3000:]

    victim = launch(tmp_path / "killed", *steps, "name=mine")
    run = tmp_path / "killed" / "runs" / "train" / "draft_lm" / "mine"
    deadline = time.time() + 600
    while not (run / "checkpoints" / "step-000003" / checkpoint.MARKER).exists():
        assert victim.poll() is None and time.time() < deadline, "training ended before it could be killed"
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)  # the launcher and both ranks, as a node going down would
    victim.wait()
    assert not (run / "train_summary.json").exists()

    resumed = launch(tmp_path / "killed", *steps, "name=mine")  # the same command, launched again
    out = resumed.communicate(timeout=900)[0]
    assert resumed.returncode == 0, out[-3000:]
    assert "resumed from" in out and "starting from scratch" not in out
    assert [p.name for p in (tmp_path / "killed" / "runs" / "train" / "draft_lm").iterdir()] == ["mine"]
    a = load_file(str(tmp_path / "full" / "runs/train/draft_lm/mine/checkpoints/step-000006/model.safetensors"))
    b = load_file(str(run / "checkpoints" / "step-000006" / "model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.mark.slow
def test_a_head_on_its_targets_ends_trains_in_two_processes_as_in_one(tiny_world, tmp_path):
    """The training command of a 70B target's recipe (docs/training.md) on two CPU processes: each rank loads only the
    target's ends and reads an engine's files; the two ranks take the steps one process takes with the same global
    batch (a record a micro-batch, so both group the same records)."""
    head = ["target=tiny_deep", "drafter=eagle", "regenerate.enabled=false", "data.on_bad_record=skip",
            "drafter.offline_dtype=float32", "trainer.max_steps=3", "trainer.eval_every=3", "trainer.batch_size=1"]
    prepared = subprocess.run([*TRAIN, *head, "drafter.hidden_states=offline", "name=prepare"], cwd=tmp_path,
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert prepared.returncode == 0, prepared.stdout[-3000:] + prepared.stderr[-3000:]
    target, _ = load_target("toyworld://tiny_deep/target", device=torch.device("cpu"))
    folder = write_engine_files(target, tmp_path / "runs" / "prepared", tmp_path / "engine")
    ends = [*head, "drafter.hidden_states=files", f"drafter.hidden_states_dir={folder}", "drafter.target_weights=ends"]
    one = subprocess.run([*TRAIN, *ends, "trainer.grad_accum=2", "name=one"], cwd=tmp_path, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    two = launch(tmp_path, *ends, "name=two")
    out = two.communicate(timeout=900)[0]
    assert two.returncode == 0, out[-3000:]
    assert out.count("its 4 decoder layers left out") == 2  # each rank: the ends alone
    runs = tmp_path / "runs" / "train" / "eagle"
    losses = {name: [json.loads(line)["loss"] for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
              for name in ("one", "two")}
    assert losses["two"] == pytest.approx(losses["one"], rel=1e-5)
    summary = json.loads((runs / "two" / "train_summary.json").read_text())
    assert len(set(summary["rank_checksums"])) == 1 and len(summary["rank_checksums"]) == 2


@pytest.mark.slow
def test_a_run_launched_again_without_its_name_says_which_to_resume(tiny_world, tmp_path):
    runs = tmp_path / "runs" / "train" / "draft_lm"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.run([*TRAIN, "trainer.max_steps=4", "trainer.checkpoint_every=2", "name=first"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    (runs / "first" / "train_summary.json").unlink()  # as if it had been stopped after its checkpoint
    again = subprocess.run([*TRAIN, "trainer.max_steps=4", "trainer.resume=auto"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "with name=first resumes it" in again.stdout and "step-000004" in again.stdout


class FakeAccelerator:
    """What rank0_first reads of an Accelerator: this process's place, and the barrier, counted."""

    def __init__(self, main: bool) -> None:
        self.num_processes, self.is_main_process, self.process_index, self.barriers = 2, main, int(not main), 0

    def wait_for_everyone(self) -> None:
        self.barriers += 1


def test_ranks_wait_for_rank_0s_cache_on_the_disk_then_meet_once(tmp_path):
    from train.launch import rank0_first

    done = tmp_path / "prepare.json"
    other, ran = FakeAccelerator(main=False), []
    started = time.monotonic()
    threading.Timer(1.5, done.touch).start()  # rank 0 finishes its cache
    with rank0_first(other, done.exists, "the answers"):
        ran.append(done.exists())
    # it waited for the file, not in a barrier (a collective the process-group timeout would end), then met once
    assert ran == [True] and time.monotonic() - started >= 1.4 and other.barriers == 1
    main = FakeAccelerator(main=True)
    done.unlink()
    with rank0_first(main, done.exists, "the answers"):
        done.touch()  # rank 0 runs the block at once
    assert main.barriers == 1
