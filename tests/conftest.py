"""Shared fixtures: the tiny toy world, built once per session."""

from __future__ import annotations

import os

import pytest

# Tests never reach a hub: everything they load is built in the test or by the toy world.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory):
    """The `tiny` toy world, built once per test session into a temporary DRAFTSMITH_HOME."""
    from train import toyworld

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


def pytest_configure(config):
    # The test models are tiny: one intra-op thread is fastest for them, and it keeps timings and
    # results independent of how many cores the machine has.
    import torch

    torch.set_num_threads(1)
