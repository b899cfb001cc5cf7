"""Every command a user reads is run, or skipped here with its reason; the traffic a user names is the traffic
measured.

The guides (README.md and docs/*.md) are instructions: each command in their shell blocks either runs here on the
tiny world (the user's models and files replaced by the tiny world's, a few tokens) or matches a rule of SKIPPED
that says why not (it needs a GPU, a server, minutes on a real model) and which test covers it instead; a command
with neither fails. A command for GPUs is also composed with exactly its own options and its resolved config checked. The pages under docs/benchmarks/ are records of measurements, each command beside the commit it
measured, minutes to hours on real models: not run here.

Every command in a `conf/` YAML header or a guide that names a data file (`data.path=`, `data.eval_path=`) must
write reports (report.json, report.md, the console, prepare.json) that name the file with its record count. Every
composition of the config groups with `data.path=F` alone measures F.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
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


# The pages a user follows; docs/benchmark-log.md, like docs/benchmarks/, records what was run.
GUIDES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmark-log.md")]


def _block_commands(page: Path) -> list[str]:
    """Commands in a page's shell blocks, continuation lines (a backslash, an open quote) joined; comment lines
    are not commands."""
    commands, block, current = [], False, ""
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            block = not block and line.strip() in ("```bash", "```sh")
            if current:
                commands.append(current.strip())
                current = ""
            continue
        if block and (current or not line.lstrip().startswith("#")):
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
    for page in [*GUIDES, ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs" / "benchmarks").glob("*.md"))]:
        assert _lines_inside_a_quote(page.read_text()) == [], page.name


def documented_commands() -> list[tuple[str, str, list[str], str]]:
    """(where, module, arguments, command) of every documented command that names a data file."""
    found = [(str(p.relative_to(ROOT)), c) for p in sorted(CONF.rglob("*.yaml")) for c in _header_commands(p)]
    found += [(str(page.relative_to(ROOT)), c) for page in GUIDES for c in _block_commands(page)]
    out = []
    for where, command in found:
        match = COMMAND.search(command)
        if not match:
            continue
        args = shlex.split(re.split(r"\s\(", match.group(2))[0], comments=True)  # not a remark in parentheses
        if any(a.split("=", 1)[0] in DATA_KEYS for a in args):
            out.append((where, match.group(1), args, command))
    return out


COMMANDS = documented_commands()


def test_the_documented_data_commands_are_found():
    # The ones this file was written against; more are welcome, fewer means the parser lost some.
    modules = {(where, module) for where, module, _, _ in COMMANDS}
    assert {("conf/eval.yaml", "eval"), ("conf/train.yaml", "train"), ("conf/prepare.yaml", "train.prepare"),
            ("conf/data/jsonl.yaml", "eval"), ("README.md", "eval"), ("docs/data.md", "train.prepare")} <= modules


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
        elif key == "drafters" and "runs/train/" in value:  # a run of the user's own: the tiny world's draft instead
            overrides.append("drafters=[{name: trained, kind: draft_lm, path: toyworld://tiny/draft}]")
        elif (key == "engine" and value == "openai") or key.startswith("engine."):
            continue  # the user's deployment is not here: tests/eval/engines/test_deployment.py runs it on real llama-servers
        elif key == "engine" and value == "llamacpp":
            continue  # tests/eval/engines/test_llama_cpp.py serves the tiny world in llama-server
        elif key == "device":
            continue  # a GPU the user has: this machine's device instead
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
@pytest.mark.parametrize("where,module,args,command", COMMANDS, ids=[f"{w}:{' '.join(a)}" for w, _, a, _ in COMMANDS])
def test_a_documented_command_measures_the_file_it_names(where, module, args, command, tiny_world, tmp_path, capsys):
    reason = skip_reason(command)
    if reason:
        pytest.skip(reason)
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


# --- every command in the guides ----------------------------------------------------------------------------

# (pattern, why this test does not run a command that matches it, and what runs it instead). First match wins.
SKIPPED = [
    (r"^make (demo|demo-real)\b", "minutes on 2 cores (the toy world built, or SmolLM2 fetched and answered): "
                                  "docs/benchmarks/demo.md and demo-real.md time them from a fresh clone"),
    (r"PIP_EXTRA_INDEX_URL=", "needs PyTorch's own index (download.pytorch.org), which CI cannot reach"),
    (r"LLAMA_CPP_BACKEND=cuda", "needs nvcc and an NVIDIA GPU"),
    (r"LLAMA_CPP_SOURCE=", "needs a copy of llama.cpp's source at the path it names"),
    (r"^make (install|test|llama-cpp|vllm)$", "CI itself: `make test` runs `make install`, `make llama-cpp` and "
     "`make vllm` first"),
    (r"-m pytest\b", "the test suite itself"),
    (r"accelerate launch --multi_gpu|experiment=llama3_8b_eagle|trainer=gpu",
     "needs NVIDIA GPUs (and an 8B model): composed as written by test_every_gpu_command_composes_as_written; "
     "tests/train/test_gpu_recipe.py trains two steps of the GPU recipe on a tiny model of its architecture; "
     "tests/train/test_launch.py launches --multi_gpu on CPUs, killed and launched again"),
    (r"^(vllm serve|python -m sglang|llama-server )|vllm\.entrypoints", "an engine serving the user's model: the "
     "engines' own code loads every export in tests/train/test_export.py, llama-server serves them in "
     "tests/eval/engines/test_llama_cpp.py and a vLLM server in tests/eval/engines/test_vllm.py"),
    (r"hidden_states=vllm", "vLLM computing the user's target's features: tests/eval/engines/test_vllm.py trains a "
     "head on them on the tiny_vllm world (vLLM's CPU attention takes heads of 32 dimensions and up)"),
    (r"evaluate\.enabled=false", "trains without its final evaluation, so no report names the file it measured: "
     "tests/train/ train with evaluate.enabled=false throughout"),
    (r"hidden_states=llamacpp", "llama.cpp computing the user's target's features: "
     "tests/eval/engines/test_llama_cpp_features.py trains a head on them on the tiny world's target"),
    (r"hidden_states=files", "reads the user's engine's files (a folder the docs name): tests/train/test_heads.py "
     "trains on such files, and tests/eval/engines/test_vllm.py reads files vLLM wrote"),
    (r"engine=vllm", "vLLM serving the user's model: tests/eval/engines/test_vllm.py runs engine=vllm on the tiny_vllm "
     "world (vLLM's CPU attention takes heads of 32 dimensions and up, the tiny world's have 16)"),
    (r"scripts/synthesize_prompts\.py", "samples SmolLM2 through llama-server for minutes: "
                                        "tests/scripts/test_synthesize_prompts.py runs it on the tiny world"),
    (r"scripts/bench_data_scaling\.py", "trains the recipe on several shares of real answers for hours: "
                                        "tests/scripts/test_bench_data_scaling.py runs it on the tiny world"),
    (r"scripts/real_traffic\.py", "reads the benchmark files beside the clone: tests/scripts/test_real_traffic.py"),
    (r"scripts/target_gguf\.py", "converts SmolLM2, fetched from PyPI: tests/scripts/test_target_gguf.py"),
    (r"scripts/check_export\.py", "tests/scripts/test_check_export.py runs it on a trained tiny run"),
]
RUN = re.compile(r"python -m (eval|train\.prepare|train\.export|train)\b(.*)|python -c (.*)")


def _names_a_data_file(command: str) -> bool:
    """Run by test_a_documented_command_measures_the_file_it_names, which checks the file is what is measured."""
    match = COMMAND.search(command)
    return bool(match) and any(a.split("=", 1)[0] in DATA_KEYS
                               for a in shlex.split(re.split(r"\s\(", match.group(2))[0], comments=True))


GUIDE_COMMANDS = [(str(page.relative_to(ROOT)), c) for page in GUIDES for c in _block_commands(page)
                  if not _names_a_data_file(c)]


def skip_reason(command: str) -> str | None:
    bare = " ".join(shlex.split(command, comments=True))  # without a trailing remark
    return next((why for pattern, why in SKIPPED if re.search(pattern, bare)), None)


def test_the_guides_commands_are_found():
    assert any("python -m train.export" in c for _, c in GUIDE_COMMANDS)
    assert any(w == "docs/your-model.md" and "--multi_gpu" in c for w, c in GUIDE_COMMANDS)
    assert skip_reason("accelerate launch --multi_gpu -m train") and not skip_reason("python -m eval ks=[4]")
    assert _block_commands(ROOT / "README.md")[0].startswith("make install")


@pytest.mark.slow
@pytest.mark.parametrize("where,command", GUIDE_COMMANDS, ids=[f"{w}:{c[:90]}" for w, c in GUIDE_COMMANDS])
def test_every_guide_command_runs_or_says_why(where, command, tiny_world, eagle_run, tmp_path):
    reason = skip_reason(command)
    if reason:
        pytest.skip(reason)
    match = RUN.search(command)
    assert match, f"{where}: `{command}` is neither run by this test nor skipped with a reason (SKIPPED)"
    if match.group(3):  # python -c: a check the user runs as it is
        code = shlex.split(match.group(3))[0]
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        return
    module, args = match.group(1), shlex.split(re.split(r"\s\(", match.group(2))[0], comments=True)
    if module == "train.export":
        overrides = [f"run={eagle_run}" if a.startswith("run=") else a for a in args]
        if any(a.startswith("hub.repo_id=") for a in args):
            overrides.append("hub.dry_run=true")  # no network here, and no token: the card and files, not the upload
        written = run_export([*overrides, f"out_dir={tmp_path / 'export'}"])
        formats = next((a.split("=", 1)[1].strip("[]").split(",") for a in args if a.startswith("formats=")), [])
        assert set(formats) <= set(written), (formats, written)
        return
    overrides, _ = _concrete(module, args, tmp_path)
    run_module(module, overrides)
    assert (tmp_path / "out" / ("prepare.json" if module == "train.prepare" else "report.json")).exists()


def run_export(overrides: list[str]) -> dict:
    from train.export import run

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="export", overrides=overrides)
    return run(cfg)


# --- the commands that need GPUs: composed with their own options ----------------------------------------------

ON_GPUS = re.compile(r"accelerate launch --multi_gpu|experiment=llama3_8b_eagle|trainer=gpu|device=cuda")
ENTRY = re.compile(r"(?:python|accelerate launch\b.*?) -m (eval|train)\b(.*)")
GPU_COMMANDS = [(where, command) for where, command in
                [*((str(p.relative_to(ROOT)), c) for p in sorted(CONF.rglob("*.yaml")) for c in _header_commands(p)),
                 *((str(page.relative_to(ROOT)), c) for page in GUIDES for c in _block_commands(page))]
                if ON_GPUS.search(command) and ENTRY.search(command)]


def test_the_gpu_commands_are_found():
    pages = {where for where, _ in GPU_COMMANDS}
    assert {"docs/your-model.md", "docs/training.md", "README.md", "conf/experiment/llama3_8b_eagle.yaml"} <= pages
    assert any("accelerate launch" in c for _, c in GPU_COMMANDS)


@pytest.mark.parametrize("where,command", GPU_COMMANDS, ids=[f"{w}:{c[:90]}" for w, c in GPU_COMMANDS])
def test_every_gpu_command_composes_as_written(where, command):
    """What runs on the user's GPUs cannot run here, so each such command is composed with exactly its options (its
    models, files and run name, no stand-in) and its resolved config is checked before any work: a real target held
    in bf16, a draft that belongs to the target, a run directory the same command finds again, the k it serves at."""
    from train.launch import run_stamp

    module, rest = ENTRY.search(command).groups()
    args = shlex.split(re.split(r"\s\(", rest)[0], comments=True)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name=CONFIG_NAME[module], overrides=args)
    said = f"{where}: `{command}`"
    if not cfg.target.name_or_path.startswith("toyworld://"):  # a real target: float32 doubles its memory
        assert cfg.target.dtype in ("bfloat16", "float16"), f"{said} holds the target in {cfg.target.dtype}"
    for path in [cfg.target.off_the_shelf_draft] if module == "train" else [d.get("path") for d in cfg.drafters]:
        world = re.match(r"toyworld://[^/]+/", path or "")  # the built-in world's draft belongs to its target only
        assert not world or cfg.target.name_or_path.startswith(world.group()), f"{said} drafts with {path}"
    if module == "eval":
        if cfg.engine and cfg.engine.get("k") is not None:
            assert cfg.engine.k in cfg.ks, f"{said} serves k = {cfg.engine.k}, which it does not measure"
        return
    # Launched again after an interruption, the same command must find its run: a named directory, resume on.
    assert cfg.name != run_stamp(), f"{said} names no run (name=...): launched again it starts a new directory"
    assert cfg.trainer.resume == "auto", f"{said} does not resume (trainer.resume={cfg.trainer.resume})"
    if any(a.startswith("experiment=") for a in args):
        assert len(cfg.evaluate.ks) > 1, f"{said}: its evaluation measures one k, so the verdict cannot choose k"
