"""The traffic a user names is the traffic measured.

Every command in a `conf/` YAML header or in README.md that names a data file (`data.path=`,
`data.eval_path=`) is run on the tiny world with that file made real, and what it writes (report.json,
report.md, the console, prepare.json) must name the file with its record count. Every composition of the
config groups with `data.path=F` alone measures F.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from eval import config as eval_config
from eval.run import held_out_path
from train import config as train_config

# The structured configs the YAML files extend.
eval_config.register()
train_config.register()

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
COMMAND = re.compile(r"python -m (eval|train\.prepare|train)\b(.*)")
DATA_KEYS = ("data.path", "data.eval_path")
# What a documented command runs with here: the tiny world, a few tokens, nothing written outside tmp.
SMALL = {
    "eval": ["ks=[1]", "repeats=1", "warmup=0", "max_new_tokens=4", "data.max_prompts_per_category=2", "progress=false"],
    "train": ["experiment=smoke", "trainer.max_steps=2", "trainer.eval_every=2", "trainer.checkpoint_every=2",
              "evaluate.ks=[1]", "evaluate.max_new_tokens=4", "evaluate.prompts_per_category=1", "progress=false"],
    "train.prepare": ["regenerate.max_new_tokens=4", "progress=false"],
}
CONFIG_NAME = {"eval": "eval", "train": "train", "train.prepare": "prepare"}


def _header_commands(path: Path) -> list[str]:
    commands = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break  # the header is the leading comment block
        commands.append(line.lstrip("# "))
    return commands


def _complete(command: str) -> bool:
    try:
        shlex.split(command, comments=True)
    except ValueError:  # a quoted argument goes on on the next line
        return False
    return True


def _readme_commands() -> list[str]:
    """Commands in README.md's code blocks, continuation lines (a backslash, an open quote) joined."""
    commands, block, current = [], False, ""
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            block = not block
            if current:
                commands.append(current.strip())
                current = ""
            continue
        if block:
            current += line.rstrip().rstrip("\\").strip() + " "
            if not line.rstrip().endswith("\\") and _complete(current):
                commands.append(current.strip())
                current = ""
    return commands


def _lines_inside_a_quote(text: str) -> list[int]:
    """Lines (1-based) of shell code blocks that end inside a quoted argument without a backslash: the shell
    passes that argument with a newline in it."""
    found, block, current = [], False, ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            block, current = (not block and line.strip() in ("```bash", "```sh")), ""
            continue
        if block:
            current += line + "\n"
            if _complete(current):
                current = ""
            elif not line.rstrip().endswith("\\"):
                found.append(number)
    return found


def test_no_documented_argument_spans_lines():
    """Hydra's override parser rejects a value with a newline in it (a drafters list broken over two lines inside
    its quotes), so a README command whose quoted argument goes on on the next line fails as a user pastes it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    assert parser.parse_overrides(["drafters=[{name: a, kind: ngram}, {name: b, kind: ngram}]"])
    with pytest.raises(OverrideParseException):
        parser.parse_overrides(["drafters=[{name: a, kind: ngram},\n    {name: b, kind: ngram}]"])
    assert _lines_inside_a_quote("```bash\npython -m eval 'drafters=[{a: 1},\n    {b: 2}]'\n```\n") == [2]
    for name in ("README.md", "BENCHMARKS.md"):
        assert _lines_inside_a_quote((ROOT / name).read_text()) == [], name


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(where, module, arguments) of every documented command that names a data file."""
    found = [(str(p.relative_to(ROOT)), c) for p in sorted(CONF.rglob("*.yaml")) for c in _header_commands(p)]
    found += [("README.md", c) for c in _readme_commands()]
    out = []
    for where, command in found:
        match = COMMAND.search(command)
        if not match:
            continue
        args = shlex.split(re.split(r"\s\(", match.group(2))[0], comments=True)  # not a remark in parentheses
        if any(a.split("=", 1)[0] in DATA_KEYS for a in args):
            out.append((where, match.group(1), args))
    return out


COMMANDS = documented_commands()


def test_the_documented_data_commands_are_found():
    # The ones this file was written against; more are welcome, fewer means the parser lost some.
    modules = {(where, module) for where, module, _ in COMMANDS}
    assert {("conf/eval.yaml", "eval"), ("conf/train.yaml", "train"), ("conf/prepare.yaml", "train.prepare"),
            ("conf/data/jsonl.yaml", "eval"), ("README.md", "eval"), ("README.md", "train.prepare")} <= modules


def write_traffic(path: Path, n: int, tag: str) -> Path:
    """n chat records in two categories, their text marked with `tag` so files can be told apart."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            category = ("code", "prose")[i % 2]
            f.write(json.dumps({"id": f"{tag}-{i}", "category": category, "messages": [
                {"role": "user", "content": f"{tag} question {i}: write a function"},
                {"role": "assistant", "content": f"def f{i}(): return {i}"}]}) + "\n")
    return path


def _concrete(module: str, args: list[str], tmp_path: Path) -> tuple[list[str], dict[str, Path]]:
    """The documented arguments with every user file made real under tmp_path and every user model
    replaced by the tiny world's; returns the overrides and the files named."""
    overrides, files = [], {}
    for arg in args:
        key, _, value = arg.partition("=")
        if key in DATA_KEYS:
            files[key] = write_traffic(tmp_path / "logs" / Path(value).name, 20 if key == "data.path" else 7,
                                       key.split(".")[1])
            overrides.append(f"{key}={files[key]}")
        elif key == "target.name_or_path":
            overrides.append(f"{key}=toyworld://tiny/target")
        elif key == "target.off_the_shelf_draft":
            overrides.append(f"{key}=toyworld://tiny/draft")
        elif key in ("out_dir", "target"):
            continue  # replaced below: tmp, and the tiny world
        elif key == "drafters" and "<time>" in value:  # a run of the user's own: the tiny world's draft instead
            overrides.append("drafters=[{name: trained, kind: draft_lm, path: toyworld://tiny/draft}]")
        elif (key == "engine" and value == "openai") or key.startswith("engine."):
            continue  # the user's deployment is not here: tests/eval/test_deployment.py runs it on real llama-servers
        else:
            overrides.append(arg)
    overrides = ["target=tiny", *overrides, *SMALL[module], f"out_dir={tmp_path / 'out'}"]
    if module == "train":
        overrides.append(f"data_cache={tmp_path / 'prepared'}")
    return overrides, files


def run_module(module: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name=CONFIG_NAME[module], overrides=overrides)
    if module == "eval":
        from eval.__main__ import run
    elif module == "train":
        from train.__main__ import train as run
    else:
        from train.prepare import run
    return run(cfg)


def check_report_names(out: Path, console: str, measured: Path, records: int, held_out: bool) -> None:
    report = json.loads((out / "report.json").read_text())
    data = report["settings"]["data"]
    assert data["path"] == str(measured) and data["records"] == records
    assert bool(data["held_out"]) == held_out
    assert sum(data["prompts"].values()) > 0
    assert str(measured) in (out / "report.md").read_text()
    assert str(measured) in console


@pytest.mark.slow
@pytest.mark.parametrize("where,module,args", COMMANDS, ids=[f"{w}:{' '.join(a)}" for w, _, a in COMMANDS])
def test_a_documented_command_measures_the_file_it_names(where, module, args, tiny_world, tmp_path, capsys):
    overrides, files = _concrete(module, args, tmp_path)
    run_module(module, overrides)
    console = capsys.readouterr().out
    out = tmp_path / "out"
    if module == "train.prepare":
        prepared = json.loads((out / "prepare.json").read_text())
        assert prepared["data"] == {"path": str(files["data.path"]), "records": 20}
        return
    if module == "eval":  # the held-out file when named, else the file itself
        measured = files.get("data.eval_path", files["data.path"])
        check_report_names(out, console, measured, 7 if "data.eval_path" in files else 20, held_out=False)
        return
    measured = files.get("data.eval_path")
    if measured is not None:
        check_report_names(out, console, measured, 7, held_out=False)
    else:  # the records training held out of data.path (experiment=smoke holds out 8)
        check_report_names(out, console, files["data.path"], 8, held_out=True)
    assert json.loads((out / "report.json").read_text())["settings"]["trained_on"]["path"] == str(files["data.path"])


@pytest.mark.slow
def test_train_with_data_path_alone_measures_what_it_held_out_of_that_file(tiny_world, tmp_path, capsys):
    logs = write_traffic(tmp_path / "mine.jsonl", 20, "mine")
    run_module("train", ["target=tiny", f"data.path={logs}", *SMALL["train"], f"out_dir={tmp_path / 'out'}",
                         f"data_cache={tmp_path / 'prepared'}"])
    check_report_names(tmp_path / "out", capsys.readouterr().out, logs, 8, held_out=True)
    trained = json.loads((tmp_path / "out" / "report.json").read_text())["settings"]["trained_on"]
    assert trained == {"path": str(logs), "records": 12, "checkpoint_chosen_on": 8, "categories": {"code": 6, "prose": 6}}


def _groups(name: str) -> list[str]:
    return sorted(p.stem for p in (CONF / name).glob("*.yaml"))


COMPOSITIONS = [("eval", [f"target={t}", f"data={d}"]) for t in _groups("target") for d in _groups("data")]
# An experiment chooses its drafter kind and sets that kind's keys, so it composes with its own kind only (another
# kind has none of those keys: an error, tests/train/test_config.py).
COMPOSITIONS += [("train", [f"target={t}", f"data={d}", f"drafter={k}"])
                 for t in _groups("target") for d in _groups("data") for k in _groups("drafter")]
COMPOSITIONS += [("train", [f"target={t}", f"data={d}", f"experiment={e}"])
                 for t in _groups("target") for d in _groups("data") for e in _groups("experiment")]
COMPOSITIONS += [("train.prepare", [f"target={t}", f"data={d}"]) for t in _groups("target") for d in _groups("data")]


@pytest.mark.parametrize("module,groups", COMPOSITIONS, ids=[f"{m}:{' '.join(g)}" for m, g in COMPOSITIONS])
def test_data_path_alone_is_the_traffic_on_every_composition(module, groups):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        mine = compose(config_name=CONFIG_NAME[module], overrides=[*groups, "data.path=mine.jsonl"])
        both = compose(config_name=CONFIG_NAME[module], overrides=[*groups, "data.path=mine.jsonl",
                                                                    "data.eval_path=held.jsonl"])
    assert mine.data.path == "mine.jsonl"
    assert held_out_path(mine.data.path, mine.data.eval_path) is None  # measures mine.jsonl (or its held-out tail)
    assert held_out_path(both.data.path, both.data.eval_path) == "held.jsonl"


def test_the_built_in_world_measures_its_held_out_file():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="eval", overrides=["target=tiny"])
    assert held_out_path(cfg.data.path, cfg.data.eval_path) == "toyworld://tiny/company_logs/eval.jsonl"


@pytest.mark.slow
def test_invalid_json_in_a_named_file_is_an_error_naming_file_and_line(tiny_world, tmp_path):
    import subprocess
    import sys

    bad = write_traffic(tmp_path / "bad.jsonl", 5, "bad")
    lines = bad.read_text().splitlines()
    lines[2] = '{"id": "x", "messages": [}'
    bad.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "eval", "target=tiny", f"data.path={bad}",
                           f"out_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert f"{bad}:3:" in proc.stderr and "invalid JSON" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "report.json").exists()
