"""Shared fixtures: the tiny toy world and the trained runs the export and engine tests ship, each built once
per test run, whether one process runs the tests or several (`pytest -n 2`, pytest-xdist: the workers share
one directory and build each piece under a file lock; the first builds it, the others wait and read it)."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import pytest

from helpers import train_tiny_deep

# Tests never reach a hub: everything they load is built in the test or by the toy world.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """A directory of this test run that every xdist worker shares (one process: its own base temp)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(out: Path, build) -> Path:
    """`out`, built by `build(out)` by the first process to get here; the others wait, then reuse it. A
    `.done` marker, written last, tells a complete build from one a failed process left behind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.with_name(out.name + ".done").exists():
            shutil.rmtree(out, ignore_errors=True)
            build(out)
            out.with_name(out.name + ".done").touch()
    return out


@pytest.fixture(scope="session")
def tiny_world(shared_dir):
    """The `tiny` toy world, built once per test run into a temporary DRAFTSMITH_HOME (the toy world's own
    build lock lets several workers share it)."""
    from traffic import toyworld

    home = os.environ.get("DRAFTSMITH_TEST_HOME") or str(shared_dir / "draftsmith_home")
    old = os.environ.get("DRAFTSMITH_HOME")
    os.environ["DRAFTSMITH_HOME"] = home
    try:
        yield toyworld.build("tiny")
    finally:
        if old is None:
            os.environ.pop("DRAFTSMITH_HOME", None)
        else:
            os.environ["DRAFTSMITH_HOME"] = old


def trained(shared_dir: Path, name: str, *overrides: str) -> Path:
    """A `python -m train` run on tiny_deep (tests/helpers.py), trained once per test run; its data cache
    is its own, so runs that workers train at the same time never write one directory."""
    return built_once(shared_dir / "runs" / name / "run", lambda out: train_tiny_deep(out, *overrides))


@pytest.fixture(scope="session")
def eagle_run(tiny_world, shared_dir):
    """An EAGLE-3 head on tiny_deep trained for greedy serving, with a reduced draft vocabulary (120 of 320):
    what the export and engine tests ship."""
    return trained(shared_dir, "eagle", "drafter=eagle", "trainer.max_steps=150", "trainer.eval_every=30",
                   "trainer.checkpoint_every=30", "trainer.lr=5e-3", "drafter.label_temperature=0",
                   "trainer.select_by=top1", "drafter.draft_vocab_size=120")


@pytest.fixture(scope="session")
def eagle_own_run(tiny_world, shared_dir):
    """`eagle_run`'s head with an output head of its own (`drafter.own_lm_head=true`), trained with the rest."""
    return trained(shared_dir, "eagle_own", "drafter=eagle", "trainer.max_steps=150", "trainer.eval_every=30",
                   "trainer.checkpoint_every=30", "trainer.lr=5e-3", "drafter.label_temperature=0",
                   "trainer.select_by=top1", "drafter.draft_vocab_size=120", "drafter.own_lm_head=true")


@pytest.fixture(scope="session")
def eagle31_run(tiny_world, shared_dir):
    """`eagle_run`'s head with EAGLE-3.1's norms (`drafter.norm_before_fc`, `norm_before_residual`, `norm_output`:
    speculators' defaults), trained a few dozen steps."""
    return trained(shared_dir, "eagle31", "drafter=eagle", "trainer.max_steps=60", "trainer.eval_every=30",
                   "trainer.checkpoint_every=30", "trainer.lr=5e-3", "drafter.label_temperature=0",
                   "trainer.select_by=top1", "drafter.draft_vocab_size=120", "drafter.norm_before_fc=true",
                   "drafter.norm_before_residual=true", "drafter.norm_output=true")


@pytest.fixture(scope="session")
def eagle1_run(tiny_world, shared_dir):
    """An EAGLE-1 head on tiny_deep, trained a few dozen steps: what the `vllm` export ships."""
    return trained(shared_dir, "eagle1", "drafter=eagle1", "trainer.max_steps=60", "trainer.eval_every=30",
                   "trainer.checkpoint_every=30", "trainer.lr=5e-3", "trainer.select_by=top1")


@pytest.fixture(scope="session")
def dflash_run(tiny_world, shared_dir):
    """A DFlash drafter on tiny_deep trained for greedy serving at k = 4 (block_size 5): what the `dflash` and
    `gguf` exports ship."""
    return trained(shared_dir, "dflash", "drafter=dflash", "trainer.max_steps=150", "trainer.eval_every=30",
                   "trainer.checkpoint_every=30", "trainer.lr=5e-3", "drafter.label_temperature=0",
                   "trainer.select_by=top1", "drafter.block_size=5")


@pytest.fixture(scope="session")
def dflash_vocab_run(tiny_world, shared_dir):
    """`dflash_run`'s drafter with a draft vocabulary (120 of 320 tokens): what the exports ship with `d2t`."""
    return trained(shared_dir, "dflash_vocab", "drafter=dflash", "trainer.max_steps=150", "trainer.eval_every=30",
                   "trainer.checkpoint_every=30", "trainer.lr=5e-3", "drafter.label_temperature=0",
                   "trainer.select_by=top1", "drafter.block_size=5", "drafter.draft_vocab_size=120")


@pytest.fixture(scope="session")
def peagle_run(tiny_world, shared_dir):
    """A P-EAGLE head on tiny_deep trained for greedy serving on 4 depths, with a reduced draft vocabulary and
    EAGLE-3.1's input norms (speculators' P-EAGLE defaults): what the `speculators` export ships."""
    return trained(shared_dir, "peagle", "drafter=peagle", "trainer.max_steps=60", "trainer.eval_every=30",
                   "trainer.checkpoint_every=30", "trainer.lr=5e-3", "drafter.label_temperature=0",
                   "trainer.select_by=top1", "drafter.draft_vocab_size=120", "drafter.num_depths=4",
                   "drafter.norm_before_fc=true", "drafter.norm_before_residual=true")


@pytest.fixture(scope="session")
def pard_run(tiny_world, shared_dir):
    """A PARD draft on tiny_deep adapted from its off-the-shelf draft for 4 depths: what the `hf` export ships."""
    return trained(shared_dir, "pard", "drafter=pard", "trainer.max_steps=40", "trainer.eval_every=20",
                   "trainer.checkpoint_every=20", "trainer.lr=3e-3", "trainer.select_by=top1", "drafter.num_depths=4")


@pytest.fixture(scope="session")
def draft_run(tiny_world, shared_dir):
    """A draft LM distilled by SFT from tiny_deep's off-the-shelf draft on the target's answers."""
    return trained(shared_dir, "draft_lm", "drafter=draft_lm", "drafter.loss=sft", "trainer.max_steps=60",
                   "trainer.lr=3e-3", "trainer.eval_every=30", "trainer.checkpoint_every=30", "trainer.select_by=top1")


def pytest_configure(config):
    # The test models are tiny: one intra-op thread is fastest for them, and it keeps timings and
    # results independent of how many cores the machine has.
    import torch

    torch.set_num_threads(1)


UNGROUPED = "this pytest and pytest-xdist do not keep an xdist_group on one worker: constraints.txt pins a pair that does"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # `--dist loadgroup` keeps an xdist_group's tests on one worker by suffixing their node ids with the group's name
    # (the llama.cpp and vLLM modules start their servers once per worker). pytest 9.2 keeps node ids where
    # pytest-xdist 3.8 no longer writes, and the groups split silently; a worker's collection error reaches the
    # controller as a bare INTERNALERROR, so each ungrouped test fails with the reason instead.
    if getattr(config.option, "loadgroup", False):
        for item in items:
            if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
                item.add_marker(pytest.mark.ungrouped)


def pytest_runtest_setup(item):
    if item.get_closest_marker("ungrouped"):
        pytest.fail(UNGROUPED, pytrace=False)
