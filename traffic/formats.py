"""The formats production traffic is logged in, each read into one conversation: OpenAI-style chat
messages (what traffic/records.py's Record holds) and the record's tools.

A record's format is detected from the key that marks it (or named for every record: `data.format=`, and
a record without that key is then an error naming its line):

- `chat`: `{"messages": [...], "tools": [...]}`, the OpenAI chat format as gateways and vLLM/SGLang servers
  log it. Roles system, developer, user, assistant, tool. An assistant turn may carry `tool_calls`
  (`content` then may be null) and reasoning (`reasoning_content`, `reasoning`, or an inline
  `<think>...</think>` at the start of its content); a tool turn answers a `tool_call_id`. `content` is a
  string or a list of parts: text parts are joined with newlines, other parts (images, audio, files) are
  skipped and counted in the load summary. `tools` (optional) is the tool list the request offered.
- `pair`: a request/response log pair, `{"request": {"messages": [...], "tools": [...]}, "response":
  {"choices": [{"message": {...}}]}}`: the request's conversation followed by the response's message.
- `sharegpt`: `{"conversations": [{"from": "system" | "human" | "gpt", "value": "..."}]}`.
- `questions`: benchmark question files as MT-Bench and Spec-Bench ship them, `{"turns": [...],
  "category": ...}`. Only the first turn is a prompt: a later turn follows the model's answer to the one
  before, which the file does not have (they are counted in the load summary).
- `alpaca`: `{"instruction", "input", "output"}`: instruction and input (blank-line separated) as the user
  turn, output as the assistant's.
- `prompt`: `{"prompt", "response"}`.

Every format keeps `id`, `category` (or `route`) as traffic/records.py reads them. Reasoning is kept by default
(`data.reasoning=keep`: the target emits it at serving time, so the drafter should learn it) or removed
(`drop`). Tool-call arguments are parsed into objects (chat templates render them); they are assistant
tokens the drafter learns.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field

FORMATS = {"chat": "messages", "pair": "request", "sharegpt": "conversations", "questions": "turns",
           "alpaca": "instruction", "prompt": "prompt"}  # format -> the key that marks it
ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING = ("keep", "drop")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "tool": "tool"}
_THINK = re.compile(r"\A\s*<think>(.*?)</think>\s*", re.DOTALL)


class FieldError(ValueError):
    """A record's field that cannot be read (traffic/records.py adds the file and line)."""

    def __init__(self, field_name: str | None, problem: str) -> None:
        super().__init__(problem)
        self.field_name, self.problem = field_name, problem


@dataclass
class Conversation:
    """One record's conversation, read: chat messages, the tools offered, and what was left out."""

    messages: list[dict]
    tools: list[dict] | None = None
    notes: Counter = field(default_factory=Counter)


def detect(raw: dict) -> str | None:
    """The format a record's keys mark, or None."""
    return next((name for name, key in FORMATS.items() if raw.get(key) is not None), None)


def check_options(format: str | None, reasoning: str) -> None:
    if format is not None and format not in FORMATS:
        raise ValueError(f"data.format must be one of {sorted(FORMATS)} (or null to detect it), got {format!r}")
    if reasoning not in REASONING:
        raise ValueError(f"data.reasoning must be one of {REASONING}, got {reasoning!r}")


def read(raw: dict, format: str, reasoning: str = "keep") -> Conversation:
    """The conversation of a record in `format` (its marking key must be there)."""
    if raw.get(FORMATS[format]) is None:
        found = detect(raw)
        raise FieldError(FORMATS[format], f"missing: data.format={format} reads every record as that format"
                         + (f" (this one looks like {found!r})" if found else ""))
    notes: Counter = Counter()
    if format == "chat":
        messages = _messages(raw["messages"], "messages", reasoning, notes)
        tools = _tools(raw.get("tools"), "tools")
    elif format == "pair":
        request, response = raw["request"], raw.get("response")
        if not isinstance(request, dict):
            raise FieldError("request", f"expected an object, got {type(request).__name__}")
        messages = _messages(request.get("messages"), "request.messages", reasoning, notes)
        tools = _tools(request.get("tools"), "request.tools")
        if response is not None:
            try:
                answer = response["choices"][0]["message"]
            except (KeyError, IndexError, TypeError):
                raise FieldError("response", "expected response.choices[0].message") from None
            messages.append(_message(answer, "response.choices[0].message", reasoning, notes))
    elif format == "sharegpt":
        messages, tools = _sharegpt(raw["conversations"], reasoning, notes), None
    elif format == "questions":
        turns = raw["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise FieldError("turns", "expected a non-empty list of non-empty strings")
        messages, tools = [{"role": "user", "content": turns[0]}], None
        if len(turns) > 1:
            notes["follow-up question turns not used (they need the model's answer before them)"] += len(turns) - 1
    elif format == "alpaca":
        instruction, extra, output = raw["instruction"], raw.get("input"), raw.get("output")
        for name, value in (("instruction", instruction), ("input", extra), ("output", output)):
            if value is not None and not isinstance(value, str):
                raise FieldError(name, f"expected a string, got {type(value).__name__}")
        if not instruction.strip():
            raise FieldError("instruction", "empty")
        messages = [{"role": "user", "content": instruction + (f"\n\n{extra}" if extra and extra.strip() else "")}]
        if output is not None:
            messages.append(_assistant_text(output, reasoning, notes))
        tools = None
    else:  # prompt
        if not isinstance(raw["prompt"], str) or not raw["prompt"].strip():
            raise FieldError("prompt", f"expected a non-empty string, got {raw['prompt']!r}")
        messages, tools = [{"role": "user", "content": raw["prompt"]}], None
        if raw.get("response") is not None:
            if not isinstance(raw["response"], str):
                raise FieldError("response", f"expected a string, got {type(raw['response']).__name__}")
            messages.append(_assistant_text(raw["response"], reasoning, notes))
    if not any(m["role"] == "user" for m in messages):
        raise FieldError(FORMATS[format], "no user turn")
    return Conversation(messages, tools, notes)


def _messages(messages, where: str, reasoning: str, notes: Counter) -> list[dict]:
    if not isinstance(messages, list):
        raise FieldError(where, f"expected a list, got {type(messages).__name__}")
    if not messages:
        raise FieldError(where, "empty conversation")
    return [_message(m, f"{where}[{i}]", reasoning, notes) for i, m in enumerate(messages)]


def _message(m, where: str, reasoning: str, notes: Counter) -> dict:
    if not isinstance(m, dict):
        raise FieldError(where, f"expected an object, got {type(m).__name__}")
    role = m.get("role")
    if role not in ROLES:
        raise FieldError(f"{where}.role", f"expected one of {ROLES}, got {role!r}")
    content = _content(m.get("content"), f"{where}.content", notes)
    if role != "assistant":
        if content is None:
            raise FieldError(f"{where}.content", "expected a string or a list of parts, got null")
        out = {"role": role, "content": content}
        if role == "tool" and m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str):
                raise FieldError(f"{where}.tool_call_id", f"expected a string, got {type(m['tool_call_id']).__name__}")
            out["tool_call_id"] = m["tool_call_id"]
        return out
    calls = _tool_calls(m.get("tool_calls"), f"{where}.tool_calls")
    if content is None and not calls:
        raise FieldError(f"{where}.content", "null, and the turn has no tool_calls")
    out = _assistant_text(content or "", reasoning, notes)
    stated = m.get("reasoning_content", m.get("reasoning"))
    if stated is not None:
        if not isinstance(stated, str):
            raise FieldError(f"{where}.reasoning_content", f"expected a string, got {type(stated).__name__}")
        if reasoning == "keep" and stated.strip():
            out["reasoning_content"] = stated.strip()
        elif reasoning == "drop" and stated.strip():
            notes["reasoning blocks dropped"] += 1
    if calls:
        out["tool_calls"] = calls
    return out


def _assistant_text(content: str, reasoning: str, notes: Counter) -> dict:
    """An assistant turn's text, an inline reasoning block at its start taken out into reasoning_content
    (or dropped)."""
    found = _THINK.match(content)
    if not found:
        return {"role": "assistant", "content": content}
    rest, thought = content[found.end():], found.group(1).strip()
    if not thought:
        return {"role": "assistant", "content": rest}
    if reasoning == "drop":
        notes["reasoning blocks dropped"] += 1
        return {"role": "assistant", "content": rest}
    return {"role": "assistant", "content": rest, "reasoning_content": thought}


def _content(content, where: str, notes: Counter) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(where, f"expected a string, a list of parts or null, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise FieldError(f"{where}[{j}]", "expected a part object with a 'type'")
        if part["type"] in ("text", "input_text", "output_text"):
            if not isinstance(part.get("text"), str):
                raise FieldError(f"{where}[{j}].text", f"expected a string, got {type(part.get('text')).__name__}")
            texts.append(part["text"])
        else:
            notes[f"non-text content parts skipped ({part['type']})"] += 1
    return "\n".join(texts)


def _tool_calls(calls, where: str) -> list[dict]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise FieldError(where, f"expected a list, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise FieldError(f"{where}[{j}].function.name", "expected a tool call with a function name")
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise FieldError(f"{where}[{j}].function.arguments", f"not valid JSON ({e.msg})") from None
        if not isinstance(arguments, dict):
            raise FieldError(f"{where}[{j}].function.arguments", f"expected a JSON object, got {type(arguments).__name__}")
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
        if call.get("id") is not None:
            entry["id"] = str(call["id"])
        out.append(entry)
    return out


def _tools(tools, where: str) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise FieldError(where, "expected a list of tool objects")
    return tools or None


def _sharegpt(turns, reasoning: str, notes: Counter) -> list[dict]:
    if not isinstance(turns, list) or not turns:
        raise FieldError("conversations", "expected a non-empty list")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise FieldError(f"conversations[{i}]", f"expected an object, got {type(turn).__name__}")
        role = SHAREGPT_ROLES.get(turn.get("from"))
        if role is None:
            raise FieldError(f"conversations[{i}].from", f"expected one of {sorted(SHAREGPT_ROLES)}, got {turn.get('from')!r}")
        if not isinstance(turn.get("value"), str):
            raise FieldError(f"conversations[{i}].value", f"expected a string, got {type(turn.get('value')).__name__}")
        messages.append(_assistant_text(turn["value"], reasoning, notes) if role == "assistant"
                        else {"role": role, "content": turn["value"]})
    return messages


# --- rendering through a chat template -------------------------------------------------------------------


def template_messages(messages: list[dict], chat_template: str) -> list[dict]:
    """Messages as `chat_template` reads them: a developer message as a system message unless the template
    knows the role; reasoning inline as `<think>...</think>` before the content unless the template reads
    `reasoning_content` itself (the convention of the reasoning models that write it inline)."""
    knows_developer, knows_reasoning = "developer" in chat_template, "reasoning_content" in chat_template
    out = []
    for m in messages:
        m = dict(m)
        if m["role"] == "developer" and not knows_developer:
            m["role"] = "system"
        if "reasoning_content" in m and not knows_reasoning:
            m["content"] = f"<think>\n{m.pop('reasoning_content')}\n</think>\n\n{m['content']}"
        out.append(m)
    return out
