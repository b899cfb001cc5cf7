"""Bad company-log records never pass silently: each error names file, line and field."""

import json

import pytest

from helpers import masked_spans
from traffic.records import UNCATEGORIZED, RecordError, load_records, prompt_ids

GOOD = {"id": "a1", "category": "code", "messages": [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "hello"}]}


def write_jsonl(tmp_path, lines, name="logs.jsonl"):
    path = tmp_path / name
    path.write_bytes(b"\n".join(line if isinstance(line, bytes) else json.dumps(line).encode() for line in lines) + b"\n")
    return path


def test_loads_chat_and_prompt_records(tmp_path):
    path = write_jsonl(tmp_path, [GOOD, {"prompt": "2+2?", "response": "4", "route": "math", "id": 7}])
    records, summary = load_records(str(path))
    assert [r.category for r in records] == ["code", "math"]
    assert records[1].messages == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert records[1].id == "7" and records[1].line == 2
    assert records[0].prompt_messages == GOOD["messages"][:1]
    assert summary.loaded == 2


BAD = [
    (b'{"messages": [', "invalid JSON", None),
    (b"\xff\xfe{}", "not valid UTF-8", None),
    ([1, 2], "expected a JSON object", None),
    ({"category": "code"}, "a record needs one of the keys", None),
    ({"messages": []}, "empty conversation", "messages"),
    ({"messages": "hi"}, "expected a list", "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "expected one of", "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "expected a string", "messages[0].content"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "no user turn", "messages"),
    ({"prompt": ""}, "non-empty string", "prompt"),
    ({"prompt": "x", "response": 5}, "expected a string", "response"),
    ({"prompt": "x", "category": "all"}, "reserved", "category"),
    ({"prompt": "x", "category": 3}, "non-empty string", "category"),
    ({"prompt": "x", "id": [1]}, "string or integer", "id"),
]


@pytest.mark.parametrize("line, problem, field", BAD, ids=[b[1] for b in BAD])
def test_bad_record_names_file_line_and_field(tmp_path, line, problem, field):
    path = write_jsonl(tmp_path, [GOOD, line, GOOD])
    with pytest.raises(RecordError) as info:
        load_records(str(path))
    err = info.value
    assert err.line == 2 and err.source == str(path) and err.field_name == field
    assert problem in str(err) and f"{path}:2" in str(err)


def test_skip_mode_counts_bad_records(tmp_path):
    path = write_jsonl(tmp_path, [GOOD, b"not json", {"messages": []}, b"\xff", b"", {"prompt": "no category"}])
    records, summary = load_records(str(path), on_bad_record="skip")
    assert len(records) == 2 and summary.loaded == 2
    assert summary.skipped == {"invalid JSON": 1, "empty conversation": 1, "not valid UTF-8": 1}
    assert summary.uncategorized == 1 and records[-1].category == UNCATEGORIZED
    assert "3 skipped" in str(summary) and "uncategorized" in str(summary)


def test_empty_file_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="no usable records"):
        load_records(str(path))


def test_glob_and_missing_files(tmp_path):
    write_jsonl(tmp_path, [{"prompt": "a"}], "a.jsonl")
    write_jsonl(tmp_path, [{"prompt": "b"}, {"prompt": "c"}], "b.jsonl")
    records, _ = load_records(str(tmp_path / "*.jsonl"))
    assert len(records) == 3
    with pytest.raises(FileNotFoundError):
        load_records(str(tmp_path / "nothing-*.jsonl"))


def test_parquet_goes_through_datasets(tmp_path):
    import datasets

    path = tmp_path / "logs.parquet"
    datasets.Dataset.from_list([{"prompt": "hello", "category": "prose"}, {"prompt": "x", "category": "all"}]).to_parquet(path)
    with pytest.raises(RecordError, match="reserved"):
        load_records(str(path))
    records, summary = load_records(str(path), on_bad_record="skip")
    assert [r.category for r in records] == ["prose"] and sum(summary.skipped.values()) == 1


def test_prompt_ids_use_the_chat_template(tiny_world):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_world / "target")
    records, _ = load_records(str(tiny_world / "company_logs" / "eval.jsonl"))
    ids = prompt_ids(records[0], tok)
    text = tok.decode(ids)
    assert text.startswith("<|bos|><|system|>") and text.endswith("<|assistant|>\n")
    assert records[0].messages[-1]["content"] not in text  # the answer is not in the prompt
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        prompt_ids(records[0], tok)



def test_duplicate_ids_are_errors_or_skipped(tmp_path):
    path = write_jsonl(tmp_path, [GOOD, {"prompt": "x"}, GOOD])
    with pytest.raises(RecordError, match=r"duplicate id 'a1' \(first at .*:1\)") as info:
        load_records(str(path))
    assert info.value.line == 3 and info.value.field_name == "id"
    records, summary = load_records(str(path), on_bad_record="skip")
    assert len(records) == 2 and sum(summary.skipped.values()) == 1


def test_loss_mask_covers_exactly_the_assistant_turns(tiny_world):
    from transformers import AutoTokenizer

    from traffic.records import Record, tokenize_record

    tok = AutoTokenizer.from_pretrained(tiny_world / "target")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"},
                {"role": "assistant", "content": "Green, or maybe red."}]
    ex = tokenize_record(Record(messages, "prose", "r", "mem", 1), tok)
    assert len(ex.input_ids) == len(ex.loss_mask)
    # Each masked span is one assistant turn: its content and the end-of-turn token the model must learn.
    assert masked_spans(ex, tok) == ["Blue.<|end|>\n", "Green, or maybe red.<|end|>\n"]
    with pytest.raises(RecordError, match="longer than the context"):
        tokenize_record(Record(messages, "prose", "r", "mem", 1), tok, max_length=10)
