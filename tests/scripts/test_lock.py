"""scripts/lock.py and constraints.txt: the lock pins every package draftsmith[test] needs, at the version installed."""

from importlib import metadata
from pathlib import Path

from packaging.utils import canonicalize_name

from helpers import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_the_closure_is_what_is_installed():
    pinned = load_script("lock").closure("draftsmith", ("test",))
    for name in ("torch", "transformers", "accelerate", "hydra-core", "pytest", "safetensors"):
        assert pinned[name] == metadata.version(name).split("+")[0]
    assert "+" not in "".join(pinned.values())  # local build labels dropped
    assert "draftsmith" not in pinned


def test_constraints_txt_pins_every_dependency_at_the_installed_version():
    """A dependency added to pyproject.toml without `make lock` would install unpinned: this test fails then."""
    lines = [line for line in (ROOT / "constraints.txt").read_text().splitlines() if line and not line.startswith("#")]
    locked = {canonicalize_name(name): version for name, version in (line.split("==") for line in lines)}
    needed = load_script("lock").closure("draftsmith", ("test",))
    assert {name: locked.get(name) for name in needed} == needed
