"""scripts/real_traffic.py: public benchmark prompts into the five categories a chat model serves, as records
draftsmith reads; on the real files of ../shared/data where they are, on a small copy of their formats here."""

import gzip
import json
from pathlib import Path

import pytest

from helpers import load_script
from traffic import models
from traffic.records import load_records

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


def _jsonl(path: Path, rows: list[dict], opener=open) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with opener(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


@pytest.fixture
def data(tmp_path):
    """Each source's format, a few records each (HumanEval's stubs, GSM8K's splits, the two question files,
    TinyStories' paragraphs)."""
    d = tmp_path / "data"
    _jsonl(d / "humaneval" / "HumanEval.jsonl.gz",
           [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x + {i}.\"\"\"\n"} for i in range(6)],
           gzip.open)
    _jsonl(d / "gsm8k" / "test.jsonl", [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(5)])
    _jsonl(d / "gsm8k" / "train.jsonl", [{"question": f"What is {i} * 2?", "answer": "x"} for i in range(9)])
    _jsonl(d / "vicuna_bench" / "question.jsonl", [{"question_id": i, "category": c, "turns": [f"vicuna {c} {i}"]}
                                                   for i, c in enumerate(["generic", "writing", "knowledge", "roleplay"])])
    _jsonl(d / "mt_bench" / "question.jsonl", [{"question_id": 80 + i, "category": c, "turns": [f"mt {c} {i}", "more"]}
                                               for i, c in enumerate(["writing", "math", "coding", "stem"])])
    (d / "tinystories").mkdir()
    (d / "tinystories" / "tinystories_val.txt").write_text(
        "\n\n".join(f"Once upon a time, there was a cat named Tom{i}. Tom liked milk." for i in range(4))
        + "\n\nThey played all day. Then they slept.")
    return d


def test_each_category_holds_out_its_first_prompts_and_trains_on_the_rest(data, tmp_path, monkeypatch, capsys):
    script = load_script("real_traffic")
    monkeypatch.setattr("sys.argv", ["real_traffic.py", str(data), str(tmp_path / "out"), "--eval-per-category", "2",
                                     "--train-per-category", "3"])
    script.main()
    held, _ = load_records(str(tmp_path / "out" / "eval.jsonl"))
    trained, _ = load_records(str(tmp_path / "out" / "train.jsonl"))
    by = lambda records: {c: [r for r in records if r.category == c] for c in {r.category for r in records}}  # noqa: E731
    assert {c: len(r) for c, r in by(held).items()} == {"code": 2, "maths": 2, "chat": 2, "writing": 2, "stories": 2}
    # Training takes the rest, at most 3 each; maths trains on GSM8K's train split; writing has 3 in all.
    assert {c: len(r) for c, r in by(trained).items()} == {"code": 3, "maths": 3, "chat": 3, "writing": 1, "stories": 2}
    assert all(r.messages[-1]["role"] == "user" and len(r.messages) == 1 for r in held + trained)  # answers: the target's
    texts = lambda records: {r.messages[0]["content"] for r in records}  # noqa: E731
    assert not texts(held) & texts(trained)
    assert {t.split()[1] for t in texts(by(held)["writing"] + by(trained)["writing"])} == {"writing", "roleplay"}
    assert all(t.startswith("Complete this Python function.\n\n```python\ndef f") for t in texts(by(held)["code"]))
    assert all("Once upon a time, there was a cat named Tom" in t and "milk" not in t for t in texts(by(held)["stories"]))
    assert "code 2, maths 2, chat 2, writing 2, stories 2" in capsys.readouterr().out


def test_a_larger_training_set_excludes_the_prompts_an_earlier_one_holds(data, tmp_path, monkeypatch):
    """--train-per-category grows a set under the same ids; --exclude leaves out the earlier set's prompts (answered
    there or not), so only the new ones are written, and both files together are the larger set."""
    script = load_script("real_traffic")
    run = lambda dest, *extra: (monkeypatch.setattr("sys.argv", ["real_traffic.py", str(data), str(tmp_path / dest),  # noqa: E731
                                                                 "--eval-per-category", "1", *extra]), script.main())
    run("small", "--train-per-category", "2")
    run("large", "--train-per-category", "4")
    answered = tmp_path / "answered.jsonl"  # the small set as the target answered it
    answered.write_text("".join(json.dumps({**json.loads(line), "messages": json.loads(line)["messages"] + [
        {"role": "assistant", "content": "ok"}]}) + "\n" for line in (tmp_path / "small" / "train.jsonl").open()))
    run("new", "--train-per-category", "4", "--exclude", str(answered))
    ids = lambda dest: {r.id: r.messages[0]["content"] for r in load_records(str(tmp_path / dest / "train.jsonl"))[0]}  # noqa: E731
    small, large, new = ids("small"), ids("large"), ids("new")
    assert small.items() <= large.items()  # the same prompts under the same ids
    assert new and not new.keys() & small.keys() and {**small, **new} == large
    assert (tmp_path / "new" / "eval.jsonl").read_text() == (tmp_path / "large" / "eval.jsonl").read_text()


def test_a_prompt_is_written_once_never_both_held_out_and_trained_on():
    script = load_script("real_traffic")
    found = {"stories": (["a", "b", "a", "c", "b", "d"], None), "maths": (["q1", "q2"], ["q1", "q3", "q2", "q3"])}
    held, trained = script.split(found, eval_per_category=2, train_per_category=10)
    prompts = lambda records, c: [p for category, _, p in records if category == c]  # noqa: E731
    assert sorted(prompts(held, "stories") + prompts(trained, "stories")) == ["a", "b", "c", "d"]
    assert sorted(prompts(held, "maths")) == ["q1", "q2"] and prompts(trained, "maths") == ["q3"]


def test_a_missing_source_is_skipped_and_humaneval_comes_from_its_wheel(data, tmp_path, monkeypatch, capsys):
    import shutil

    script = load_script("real_traffic")
    shutil.rmtree(data / "gsm8k")
    wheel_copy = tmp_path / "HumanEval.jsonl.gz"
    (data / "humaneval" / "HumanEval.jsonl.gz").rename(wheel_copy)
    monkeypatch.setattr(models, "fetch", lambda name: {"humaneval": wheel_copy}[name])
    found = script.sources(data)
    assert sorted(found) == ["chat", "code", "stories", "writing"] and len(found["code"][0]) == 6
    assert "maths: skipped" in capsys.readouterr().err


@pytest.mark.skipif(not (SHARED / "gsm8k").exists(), reason=f"the real benchmark files are not at {SHARED}")
def test_the_real_benchmark_files_give_every_category(tmp_path, monkeypatch):
    script = load_script("real_traffic")
    monkeypatch.setattr("sys.argv", ["real_traffic.py", str(SHARED), str(tmp_path)])
    script.main()
    held, _ = load_records(str(tmp_path / "eval.jsonl"))
    trained, _ = load_records(str(tmp_path / "train.jsonl"))
    assert len(held) == 80 and {r.category for r in held} == {"code", "maths", "chat", "writing", "stories"}
    assert len(trained) > 500
    texts = [r.messages[0]["content"] for r in held + trained]
    assert len(set(texts)) == len(texts)  # TinyStories' repeated openings once each, none held out and trained on
    # Interleaved: the last 64 records (what training holds out to choose its checkpoint) hold every category.
    assert {r.category for r in trained[-64:]} == {r.category for r in held}


def _module(root: Path, name: str, text: str) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_coding_mix_completes_asks_about_and_fixes_real_code_each_function_in_one_category(data, tmp_path,
                                                                                                monkeypatch, capsys):
    """completion, code_qa, maths and chat; the standard library's documented public functions, each in one category,
    read from a folder laid out as the standard library is (private and test modules left out)."""
    script = load_script("real_traffic")
    lib = tmp_path / "lib"
    body = "\n".join(f"    x{i} = x{i - 1} + 1 if i <= {i} else x{i - 1}" for i in range(1, 6))
    for m in range(12):
        _module(lib, f"pkg/mod{m}.py", f'def func{m}(x0, i):\n    """Step {m}."""\n{body}\n    return x5\n\n\n'
                f'def undocumented{m}(x):\n{body}\n    return x\n')
    _module(lib, "_private.py", 'def hidden(x):\n    """Private."""\n' + body + "\n    return x\n")
    _module(lib, "test/test_x.py", 'def test_it(x):\n    """A test."""\n' + body + "\n    return x\n")
    _module(lib, "short.py", 'def tiny(x):\n    """Too short to ask about."""\n    return x\n')
    found = script.stdlib_functions(lib)
    assert [name for name, _, _ in found] == [f"pkg.mod{m}.func{m}" for m in (0, 1, 10, 11, 2, 3, 4, 5, 6, 7, 8, 9)]
    assert all(stub.endswith(f'"""Step {name[-1]}."""') or stub.endswith('."""') for name, stub, _ in found)
    monkeypatch.setattr(script, "stdlib_functions", lambda: found)
    monkeypatch.setattr("sys.argv", ["real_traffic.py", str(data), str(tmp_path / "out"), "--mix", "coding",
                                     "--eval-per-category", "1"])
    script.main()
    records = load_records(str(tmp_path / "out" / "eval.jsonl"))[0] + load_records(str(tmp_path / "out" / "train.jsonl"))[0]
    by = {c: [r.messages[0]["content"] for r in records if r.category == c] for c in {r.category for r in records}}
    assert sorted(by) == ["chat", "code_qa", "completion", "maths"]
    # completion: HumanEval's 6 stubs and the functions the hash gives it, stubs without their bodies.
    completed = {n for n, _, _ in found if script._for_completion(n)}
    assert 0 < len(completed) < len(found) and len(by["completion"]) == 6 + len(completed)
    assert all(p.startswith("Complete this Python function.") and "x1 = x0" not in p for p in by["completion"])
    # code_qa: MT-Bench's coding question, then each other function explained, fixed or tested, its whole source.
    asked = [p for p in by["code_qa"] if "```python" in p]
    assert "mt coding 2" in by["code_qa"] and len(asked) == len(found) - len(completed)
    names = lambda prompts: {m.split("(")[0] for p in prompts for m in p.split("def ")[1:]}  # noqa: E731
    assert not names(by["completion"]) & names(asked)
    fixes = [p for p in asked if p.startswith("This function has a bug.")]
    assert fixes and all("if i < " in p for p in fixes)  # the first planted change: `<=` became `<` once
    assert all(p.count("<=") == 4 for p in fixes)
    assert any(p.startswith("Explain what") for p in asked) and any(p.startswith("Write pytest") for p in asked)
    # chat: the question files without their coding and maths questions.
    assert sorted(by["chat"]) == ["mt stem 3", "mt writing 0", "vicuna generic 0", "vicuna knowledge 2",
                                  "vicuna roleplay 3", "vicuna writing 1"]
    assert "completion 1, code_qa 1, maths 1, chat 1" in capsys.readouterr().out
