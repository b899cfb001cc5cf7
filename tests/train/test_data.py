"""train/data.py: where a split's answers are prepared, and what makes them be prepared anew."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir

from traffic.records import Record
from train.data import split_directory

CONF = Path(__file__).resolve().parents[2] / "conf"


def _directory(records: list[Record], *overrides: str) -> Path:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["regenerate.engine=llamacpp", *overrides])
    return split_directory(cfg, "train", records, [len(records)])


def test_the_answers_are_keyed_by_what_writes_them_and_not_by_the_servers_threads():
    records = [Record(messages=[{"role": "user", "content": f"question {i}"}], category="chat", id=f"r{i}",
                      source="train.jsonl", line=i + 1) for i in range(3)]
    first = _directory(records)
    assert first.parent == Path("runs/prepared") and first.name.split("-")[1] == "train"
    # An interrupted run continued with fewer llama-server threads finds the answers it has already written.
    assert _directory(records, "regenerate.threads=1") == first
    # What changes an answer prepares it anew: the settings, the records' content, the target.
    assert _directory(records, "regenerate.max_new_tokens=7") != first
    assert _directory(records, "regenerate.parallel=1") != first
    edited = [*records[:2], Record(messages=[{"role": "user", "content": "another"}], category="chat", id="r2",
                                   source="train.jsonl", line=3)]
    assert _directory(edited) != first
    assert _directory(records, "target=smollm2") != first
