"""scripts/config_reference.py and docs/configuration.md: the committed page is the script's output, and that output
has every key of every schema, so a field renamed, added or re-commented without regenerating the page fails here."""

import sys
from dataclasses import fields, is_dataclass
from difflib import unified_diff
from pathlib import Path
from types import UnionType
from typing import Union, get_args, get_origin, get_type_hints

import pytest

from eval.config import SPECS, AnyDrafterSpec, EvalConfig
from helpers import load_script
from train.config import KINDS, DrafterConfig, ExportConfig, PrepareConfig, TrainConfig

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
REGENERATE = "python scripts/config_reference.py > docs/configuration.md"
SCHEMAS = {"python -m eval": EvalConfig, "python -m train": TrainConfig, "python -m train.prepare": PrepareConfig,
           "python -m train.export": ExportConfig}


@pytest.fixture(scope="module")
def page() -> str:
    return load_script("config_reference").render()


def section(page: str, command: str) -> str:
    """One entry point's part of the page."""
    return page.split(f"## `{command}`\n")[1].split("\n## ")[0]


def keys(cls: type, prefix: str = ""):
    """Every dotted key of a schema, walked with dataclasses.fields (not the script's walk): through Optional and
    lists (`.<i>.`), and into each kind's schema where a field holds one of several kinds."""
    hints = get_type_hints(cls)
    for f in fields(cls):
        yield prefix + f.name
        held, step = hints[f.name], "."
        if get_origin(held) in (Union, UnionType):
            held = next(a for a in get_args(held) if a is not type(None))
        if get_origin(held) is list:
            held, step = get_args(held)[0], ".<i>."
        schemas = SPECS.values() if held is AnyDrafterSpec else KINDS.values() if held is DrafterConfig else [held]
        for schema in schemas:
            if is_dataclass(schema):
                yield from keys(schema, prefix + f.name + step)


def test_the_committed_page_is_the_generated_one(page):
    diff = list(unified_diff(PAGE.read_text().splitlines(), page.splitlines(), "docs/configuration.md", "generated",
                             lineterm="", n=0))
    assert not diff, f"docs/configuration.md is stale: regenerate it with `{REGENERATE}`\n" + "\n".join(diff[:20])


def test_every_field_of_every_schema_is_a_key_in_its_entry_point_s_section(page):
    missing = [f"{command}: {key}" for command, schema in SCHEMAS.items() for key in keys(schema)
               if f"| `{key}` |" not in section(page, command)]
    assert not missing, f"keys missing from the generated page: {missing}"
    assert [kind for kind in KINDS if f"with `drafter={kind}`" not in section(page, "python -m train")] == []
    assert [kind for kind in SPECS if f"`drafters` with `kind: {kind}`" not in section(page, "python -m eval")] == []


def test_a_field_s_comment_is_its_meaning(page):
    train = section(page, "python -m train")
    assert ("| `regenerate.enabled` | bool | `true` | false: keep the logged responses (when they came from this "
            "target) |") in train
    # comment lines above a field come first, then the one on its line; no comment: an empty cell
    assert "| `trainer.heldout` | str | `last` | Which: last (the file's last eval_examples records) \\| " in train
    assert "| `drafter.kind` | str | `eagle` |  |" in train
    assert "| `drafter.init_from` | Optional[str] | `${target.off_the_shelf_draft}` | a hub id or directory" in train


def test_check_exits_1_on_a_stale_page(page, tmp_path, monkeypatch, capsys):
    script = load_script("config_reference")
    (tmp_path / "current.md").write_text(page)
    (tmp_path / "stale.md").write_text(page.replace("`trainer.lr`", "`trainer.learning_rate`"))
    monkeypatch.setattr(sys, "argv", ["config_reference.py", "--check", str(tmp_path / "current.md")])
    assert script.main() == 0
    monkeypatch.setattr(sys, "argv", ["config_reference.py", "--check", str(tmp_path / "stale.md")])
    assert script.main() == 1
    assert "stale.md is stale" in capsys.readouterr().err
