"""The formats production traffic is logged in (traffic/formats.py): each read into chat messages, bad fields
named, reasoning kept or dropped, and the training mask covering exactly what the assistant generated
(its reasoning, text and tool calls) as a tool-aware chat template renders it."""

import json

import pytest

from helpers import CHAT, TOOL_TEMPLATE, TOOLS, masked_spans
from traffic.records import Record, RecordError, load_records, prompt_ids, tokenize_record

PLAIN_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PAIR = {"id": "p1", "request": {"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS},
        "response": {"choices": [{"message": {"role": "assistant", "content": "Hello!"}}]}}
SHAREGPT = {"id": "s1", "conversations": [{"from": "system", "value": "Be kind."}, {"from": "human", "value": "Hi"},
                                           {"from": "gpt", "value": "Hello."}]}
QUESTIONS = {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now a limerick."]}
ALPACA = {"instruction": "Translate to French.", "input": "cat", "output": "chat"}


def write(tmp_path, rows):
    path = tmp_path / "logs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_every_format_is_read_into_chat_messages(tmp_path):
    records, summary = load_records(write(tmp_path, [CHAT, PAIR, SHAREGPT, QUESTIONS, ALPACA]))
    chat, pair, sharegpt, questions, alpaca = records
    assert chat.tools == TOOLS and chat.category == "agent"
    assert chat.messages == [
        {"role": "developer", "content": "Answer with the order's status."},
        {"role": "user", "content": "Where is order 42?"},  # the image part skipped, counted below
        {"role": "assistant", "content": "", "reasoning_content": "I should look it up.",
         "tool_calls": [{"type": "function", "id": "call_1", "function": {"name": "lookup_order", "arguments": {"order": 42}}}]},
        {"role": "tool", "content": "{\"status\": \"shipped\"}", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "Order 42 has shipped.", "reasoning_content": "It shipped."},
    ]
    assert pair.messages == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert pair.tools == TOOLS
    assert sharegpt.messages == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "Hello."}]
    assert questions.messages == [{"role": "user", "content": "Write a haiku."}] and questions.id == "81"
    assert questions.category == "writing"
    assert alpaca.messages == [{"role": "user", "content": "Translate to French.\n\ncat"},
                               {"role": "assistant", "content": "chat"}]
    assert summary.formats == {"chat": 1, "pair": 1, "sharegpt": 1, "questions": 1, "alpaca": 1}
    text = str(summary)
    assert "1× non-text content parts skipped (image_url)" in text
    assert "1× follow-up question turns not used" in text


def test_reasoning_can_be_dropped(tmp_path):
    records, summary = load_records(write(tmp_path, [CHAT]), reasoning="drop")
    assert not any("reasoning_content" in m for m in records[0].messages)
    assert records[0].messages[-1]["content"] == "Order 42 has shipped."
    assert summary.notes["reasoning blocks dropped"] == 2
    with pytest.raises(ValueError, match="data.reasoning must be one of"):
        load_records(write(tmp_path, [CHAT]), reasoning="hide")


BAD = [
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]},
     "messages[1].content", "no tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "not valid JSON"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"function": {}}]}]},
     "messages[1].tool_calls[0].function.name", "function name"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages[0].content[0]", "'type'"),
    ({"messages": [{"role": "tool", "content": None}]}, "messages[0].content", "got null"),
    ({"request": {"messages": [{"role": "user", "content": "x"}]}, "response": {"choices": []}}, "response",
     "choices[0].message"),
    ({"conversations": [{"from": "robot", "value": "x"}]}, "conversations[0].from", "expected one of"),
    ({"turns": []}, "turns", "non-empty list"),
    ({"instruction": "x", "output": 3}, "output", "expected a string"),
]


@pytest.mark.parametrize("row, field, problem", BAD, ids=[b[1] for b in BAD])
def test_a_bad_field_is_named_with_file_and_line(tmp_path, row, field, problem):
    path = write(tmp_path, [PAIR, row])
    with pytest.raises(RecordError) as info:
        load_records(path)
    assert info.value.line == 2 and info.value.field_name == field and problem in str(info.value)


def test_a_named_format_reads_every_record_as_that_format(tmp_path):
    path = write(tmp_path, [SHAREGPT, PAIR])
    records, _ = load_records(path, format="sharegpt", on_bad_record="skip")
    assert [r.id for r in records] == ["s1"]
    with pytest.raises(RecordError, match="data.format=sharegpt reads every record as that format .*looks like 'pair'"):
        load_records(path, format="sharegpt")
    with pytest.raises(ValueError, match="data.format must be one of"):
        load_records(path, format="openai")


@pytest.fixture
def tool_tokenizer(tiny_world):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_world / "target")
    tok.chat_template = TOOL_TEMPLATE
    return tok


def test_the_mask_covers_exactly_what_the_assistant_generated_in_every_format(tmp_path, tool_tokenizer):
    records, _ = load_records(write(tmp_path, [CHAT, PAIR, SHAREGPT, QUESTIONS, ALPACA]))
    spans = {r.id: masked_spans(tokenize_record(r, tool_tokenizer), tool_tokenizer) for r in records}
    assert spans["c1"] == [  # its reasoning and its tool call are the assistant's tokens; the tool's answer is not
        '<think>\nI should look it up.\n</think>\n<tool_call>{"name": "lookup_order", "arguments": {"order": 42}}'
        "</tool_call><|end|>\n",
        "<think>\nIt shipped.\n</think>\nOrder 42 has shipped.<|end|>\n",
    ]
    assert spans["p1"] == ["Hello!<|end|>\n"]
    assert spans["s1"] == ["Hello.<|end|>\n"]
    assert spans["81"] == []  # a question file holds prompts only
    assert spans[f"{tmp_path / 'logs.jsonl'}:5"] == ["chat<|end|>\n"]


def test_prompts_carry_the_tools_and_a_developer_message_becomes_system_unless_the_template_knows_it(
        tmp_path, tool_tokenizer):
    records, _ = load_records(write(tmp_path, [CHAT]))
    text = tool_tokenizer.decode(prompt_ids(records[0], tool_tokenizer))
    assert '# Tools\n{"type": "function"' in text and "<|system|>\nAnswer with the order's status." in text
    tool_tokenizer.chat_template = TOOL_TEMPLATE.replace("{{ bos_token }}", "{{ bos_token }}{# developer #}")
    text = tool_tokenizer.decode(prompt_ids(records[0], tool_tokenizer))
    assert "<|developer|>\nAnswer with the order's status." in text
    assert text.endswith("<|assistant|>\n") and "Order 42 has shipped." not in text


def test_reasoning_goes_inline_when_the_template_does_not_read_it(tiny_world):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_world / "target")  # the toy template: role and content only
    record = Record([{"role": "user", "content": "2+2?"},
                     {"role": "assistant", "content": "4", "reasoning_content": "Add them."}], "math", "r", "mem", 1)
    assert masked_spans(tokenize_record(record, tok), tok) == ["<think>\nAdd them.\n</think>\n\n4<|end|>\n"]


def test_an_empty_think_block_the_template_inserts_is_not_the_assistants(tool_tokenizer):
    # As reasoning models' templates do for a turn without reasoning: an empty block before the answer.
    tool_tokenizer.chat_template = TOOL_TEMPLATE.replace(
        "{% if m.get('reasoning_content') %}", "{% if m['role'] == 'assistant' and not m.get('reasoning_content') %}"
        "<think>\n\n</think>\n\n{% endif %}{% if m.get('reasoning_content') %}")
    record = Record([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}], "c", "r", "mem", 1)
    example = tokenize_record(record, tool_tokenizer)
    assert "<|assistant|>\n<think>\n\n</think>\n\nHello.<|end|>" in tool_tokenizer.decode(example.input_ids)
    assert masked_spans(example, tool_tokenizer) == ["Hello.<|end|>\n"]


def test_a_template_that_does_not_render_tool_calls_is_an_error(tmp_path, tiny_world):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_world / "target")
    tok.chat_template = PLAIN_TEMPLATE  # role and content only: tool_calls are ignored
    records, _ = load_records(write(tmp_path, [CHAT]))
    with pytest.raises(RecordError, match=r"messages\[2\].tool_calls.*does not render tool calls \(lookup_order"):
        tokenize_record(records[0], tok)
