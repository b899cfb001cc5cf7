"""Shared fixtures: the tiny toy world, built once per session."""

from __future__ import annotations

import os

import pytest

from helpers import train_tiny_deep

# Tests never reach a hub: everything they load is built in the test or by the toy world.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory):
    """The `tiny` toy world, built once per test session into a temporary DRAFTSMITH_HOME."""
    from traffic import toyworld

    home = os.environ.get("DRAFTSMITH_TEST_HOME") or str(tmp_path_factory.mktemp("draftsmith_home"))
    old = os.environ.get("DRAFTSMITH_HOME")
    os.environ["DRAFTSMITH_HOME"] = home
    try:
        yield toyworld.build("tiny")
    finally:
        if old is None:
            os.environ.pop("DRAFTSMITH_HOME", None)
        else:
            os.environ["DRAFTSMITH_HOME"] = old


@pytest.fixture(scope="session")
def eagle_run(tiny_world, tmp_path_factory):
    """An EAGLE-3 head on tiny_deep trained for greedy serving, with a reduced draft vocabulary (120 of 320):
    what the export and engine tests ship."""
    return train_tiny_deep(tmp_path_factory.mktemp("runs") / "eagle", "drafter=eagle", "trainer.max_steps=150",
                           "trainer.eval_every=30", "trainer.checkpoint_every=30", "trainer.lr=5e-3",
                           "drafter.label_temperature=0", "trainer.select_by=top1", "drafter.draft_vocab_size=120")


@pytest.fixture(scope="session")
def eagle1_run(tiny_world, tmp_path_factory):
    """An EAGLE-1 head on tiny_deep, trained a few dozen steps: what the `vllm` export ships."""
    return train_tiny_deep(tmp_path_factory.mktemp("runs") / "eagle1", "drafter=eagle1", "trainer.max_steps=60",
                           "trainer.eval_every=30", "trainer.checkpoint_every=30", "trainer.lr=5e-3",
                           "trainer.select_by=top1")


@pytest.fixture(scope="session")
def draft_run(tiny_world, tmp_path_factory):
    """A draft LM distilled by SFT from tiny_deep's off-the-shelf draft on the target's answers."""
    return train_tiny_deep(tmp_path_factory.mktemp("runs") / "draft_lm", "drafter=draft_lm", "drafter.loss=sft",
                           "trainer.max_steps=60", "trainer.lr=3e-3", "trainer.eval_every=30",
                           "trainer.checkpoint_every=30", "trainer.select_by=top1")


def pytest_configure(config):
    # The test models are tiny: one intra-op thread is fastest for them, and it keeps timings and
    # results independent of how many cores the machine has.
    import torch

    torch.set_num_threads(1)
