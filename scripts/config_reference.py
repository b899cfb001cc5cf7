"""Write the configuration reference, docs/configuration.md, from the structured configs themselves, so the page
cannot drift from the schemas Hydra checks:

    python scripts/config_reference.py > docs/configuration.md
    python scripts/config_reference.py --check docs/configuration.md    # exit 1 when the page is stale

Keys, types and defaults come from the dataclasses eval/config.py and train/config.py store in Hydra's ConfigStore
(found through the `<name>_schema` entry each conf/*.yaml composes); a key's meaning is the comment on its line and
the comment lines directly above it in the source; the config groups are conf/<group>/*.yaml, each described by the
first line of its comment header.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import io
import re
import sys
import tokenize
import types
import typing
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

import eval.config
import train.config

CONF = Path(__file__).resolve().parents[1] / "conf"
# Each entry point and the primary config its @hydra.main reads (conf/<name>.yaml).
ENTRY_POINTS = {"python -m eval": "eval", "python -m train": "train", "python -m train.prepare": "prepare",
                "python -m train.export": "export"}
INTRO = """# Configuration reference

Every key of the four entry points (`python -m eval`, `python -m train`, `python -m train.prepare`,
`python -m train.export`) with its type, default and meaning, and the options of each config group in conf/. The page
is generated from the structured configs (eval/config.py, train/config.py) and the comments beside their fields by
`python scripts/config_reference.py > docs/configuration.md`; tests/scripts/test_config_reference.py fails when it is
stale. The configs are checked when they are composed: a mistyped key or a value of the wrong type is an error.
Defaults are the schemas'; the conf files an entry point composes (listed in its section) set some others.
`???` marks a value that must be given; `${...}` is an interpolation, resolved when the config is read.
"""


def schema_of(yaml_file: Path, group: str = "") -> type:
    """The dataclass a conf file composes: the `*_schema` entry of its defaults list, looked up in the ConfigStore."""
    name = next(d for d in OmegaConf.load(yaml_file).defaults if isinstance(d, str) and d.endswith("_schema"))
    node = ConfigStore.instance().load(f"{group}/{name}.yaml" if group else f"{name}.yaml").node
    return OmegaConf.get_type(node)


def variants(tp: type) -> list[tuple[str, type]]:
    """The per-kind schemas of a field holding one of several kinds, each with what selects it; [] for others."""
    if tp is eval.config.AnyDrafterSpec:
        return [(f"kind: {kind}", spec) for kind, spec in eval.config.SPECS.items()]
    if tp is train.config.DrafterConfig:
        return [(f"drafter={f.stem}", schema_of(f, "drafter")) for f in sorted((CONF / "drafter").glob("*.yaml"))]
    return []


def held(tp: typing.Any) -> tuple[typing.Any, str]:
    """What a field holds through Optional and list, and the key step to its fields (`.` or `.<i>.`)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is list:
        return typing.get_args(tp)[0], ".<i>."
    return tp, "."


@functools.cache
def source(path: str) -> tuple[ast.Module, dict[int, str], list[str]]:
    """A module's syntax tree, its comments by line (without the `#`) and its lines."""
    text = Path(path).read_text()
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    comments = {t.start[0]: t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT}
    return ast.parse(text), comments, text.splitlines()


def class_node(klass: type) -> ast.ClassDef | None:
    """The class statement of a dataclass in its module's source (None for one made at run time)."""
    tree, _, _ = source(sys.modules[klass.__module__].__file__)
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == klass.__name__), None)


def meanings(cls: type) -> dict[str, str]:
    """Each field's comment: the comment lines directly above its declaration, then the one on its line. A field a
    subclass declares again without a comment keeps its base's."""
    found: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        _, comments, lines = source(sys.modules[klass.__module__].__file__)
        node = class_node(klass)
        for stmt in node.body if node else []:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above, line = [], stmt.lineno - 1
            while line in comments and lines[line - 1].lstrip().startswith("#"):
                above.insert(0, comments[line])
                line -= 1
            lead = " ".join(above)
            tail = " ".join(comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments)
            joint = " " if lead.endswith((".", ";", ":")) else "; "  # the two read as separate clauses
            text = lead + joint + tail if lead and tail else lead or tail
            if text or stmt.target.id not in found:
                found[stmt.target.id] = text
    return found


def shown(value: typing.Any) -> str:
    """A default as it is written in YAML or on the command line, compactly."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(shown, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{shown(k)}: {shown(v)}" for k, v in value.items()) + "}"
    return '""' if value == "" else str(value)


def cell(text: str) -> str:
    """Text safe in a table cell: `|` escaped everywhere, `<` and `*` outside code spans (not read as HTML or
    emphasis)."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(re.sub(r"([<*])", r"\\\1", p) if i % 2 == 0 else p for i, p in enumerate(parts))


def type_name(annotation: typing.Any) -> str:
    """The annotation as the source writes it."""
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def tables(cls: type, obj: typing.Any, prefix: str, title: str, docs: set[str]) -> list[str]:
    """The table of one dataclass's fields, then those of the dataclasses it holds, depth first in field order.
    A docstring already shown in this section (a base's) is not repeated."""
    hints, notes, nested = typing.get_type_hints(cls), meanings(cls), []
    out = [f"### {title}", ""]
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        doc = ast.get_docstring(node) if (node := class_node(klass)) else None
        if doc and doc not in docs and (klass is cls or klass.__dict__.get("__annotations__")):
            docs.add(doc)
            out += [line for para in doc.split("\n\n") for line in (cell(" ".join(para.split())), "")]
    out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        value, key = getattr(obj, f.name), prefix + f.name
        tp, step = held(hints[f.name])
        for selector, schema in variants(tp) or ([("", tp)] if dataclasses.is_dataclass(tp) else []):
            fallback = value if dataclasses.is_dataclass(value) else tp()  # a field whose default is null
            where, held_obj = (f" with `{selector}`", schema()) if selector else ("", fallback)
            nested += tables(schema, held_obj, key + step, f"`{key}`{where}: {schema.__name__}", docs)
        default = f"table `{key}`" if dataclasses.is_dataclass(value) else f"`{shown(value)}`"
        out.append(f"| `{key}` | {cell(type_name(f.type))} | {cell(default)} | {cell(notes.get(f.name, ''))} |")
    return out + [""] + nested


def header(yaml_file: Path) -> str:
    """The first line of a conf file's leading comment header (a `@package` directive skipped), with the lines that
    close a parenthesis it leaves open."""
    text = ""
    for line in yaml_file.read_text().splitlines():
        if not line.startswith("#") or (text and text.count("(") <= text.count(")")):
            break
        if (words := " ".join(line.lstrip("#").split())) and not words.startswith("@package"):
            text = f"{text} {words}".strip()
    return text


def render() -> str:
    """The whole page."""
    eval.config.register()
    train.config.register()
    out = [INTRO]
    for command, name in ENTRY_POINTS.items():
        schema = schema_of(CONF / f"{name}.yaml")
        module = schema.__module__.replace(".", "/") + ".py"
        picks = [f"`{group.split()[-1]}={option}`" for d in OmegaConf.load(CONF / f"{name}.yaml").defaults
                 if not isinstance(d, str) for group, option in d.items() if option is not None]
        out += [f"## `{command}`", "", f"conf/{name}.yaml composes {schema.__name__} ({module})"
                + (f" and picks {', '.join(picks)}." if picks else "."), ""]
        out += tables(schema, schema(), "", f"`{command}`: top-level keys", set())
    out += ["## Config groups", "", "Pick a group's option on the command line as `group=option` (`conf/<group>/`).",
            "", "| option | what it is |", "| --- | --- |"]
    for group in sorted(p for p in CONF.iterdir() if p.is_dir()):
        out += [f"| `{group.name}={f.stem}` | {cell(header(f))} |" for f in sorted(group.glob("*.yaml"))]
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", type=Path, help="exit 1 when this file differs from the generated page")
    args = parser.parse_args()
    text = render()
    if args.check is None:
        sys.stdout.write(text)
        return 0
    if args.check.exists() and args.check.read_text() == text:
        return 0
    print(f"{args.check} is stale (it differs from the structured configs): regenerate it with "
          f"`python scripts/config_reference.py > {args.check}`", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
