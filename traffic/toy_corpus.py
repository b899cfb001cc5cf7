"""The toy world's text and company traffic (traffic/toyworld.py): code from the standard library's own source,
prose from `pydoc_data.topics`, generated JSON documents, the company's own wiki (an employee directory and a
codebase, generated from the seed), and the company's chat and agent records built from them.
"""

from __future__ import annotations

import ast
import functools
import json
import random
import sysconfig
import zlib
from pathlib import Path


def corpus(seed: int) -> dict[str, list[str]]:
    """Code, prose and JSON documents from the running Python installation, deterministic in seed."""
    rng = random.Random(seed)
    json_docs = [json.dumps(_generic_json(rng), indent=1) for _ in range(600)]
    paragraphs = _reference_paragraphs()
    return {"code": list(_stdlib_functions()), "prose": [p for _, p in paragraphs],
            "prose_topic": [t for t, _ in paragraphs], "json": json_docs}


@functools.lru_cache(maxsize=1)
def _stdlib_functions() -> tuple[str, ...]:
    """Top-level functions (4-31 lines, ASCII) of the standard library's modules, sorted by module.

    A line scan finds candidates (a `def` at column 0 up to the next line of code at column 0) and
    each candidate must parse on its own; parsing whole modules instead costs ten times as long.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, ValueError):
            continue
        starts = [i for i, line in enumerate(lines) if line.startswith("def ")]
        for start in starts:
            end = start + 1
            while end < len(lines) and (not lines[end] or lines[end][0] in " \t)"):
                end += 1
            while end > start and not lines[end - 1].strip():
                end -= 1
            segment = "\n".join(lines[start:end])
            if not 4 <= end - start <= 31 or not segment.isascii():
                continue
            try:
                ast.parse(segment)
            except SyntaxError:
                continue
            name = lines[start][4:].split("(")[0].strip()
            code.append(f"# {path.stem}.{name}\n{segment}")
    return tuple(code)


@functools.lru_cache(maxsize=1)
def _reference_paragraphs() -> tuple[tuple[str, str], ...]:
    """(topic, paragraph) of the language reference topics shipped in pydoc_data."""
    from pydoc_data.topics import topics  # a large module: only when the world's text is built

    return tuple((name, p.strip()) for name in sorted(topics) for p in topics[name].split("\n\n")
                 if 80 <= len(p.strip()) <= 1200 and p.strip().isascii() and not p.startswith("   "))


_FIRST = ["Ada", "Grace", "Alan", "Linus", "Guido", "Barbara", "Ken", "Margaret", "Dennis", "Frances"]


_LAST = ["Lovelace", "Hopper", "Turing", "Torvalds", "Rossum", "Liskov", "Thompson", "Hamilton", "Ritchie", "Allen"]


_CITIES = ["Paris", "Lagos", "Lima", "Oslo", "Pune", "Osaka", "Quito", "Perth", "Turin", "Accra"]


_ITEMS = ["keyboard", "monitor", "cable", "laptop", "mouse", "dock", "headset", "webcam"]


_STATUSES = ["paid", "shipped", "refunded"]


_TEAMS = ["payments", "search", "billing", "support", "infra", "mobile", "security", "data"]


COMPANY_MODULES = ("billing", "shipping", "routing", "quotas")  # the company codebase's modules


_PLANS = ["free", "team", "business", "enterprise"]


def company_directory(seed: int, size: int) -> list[dict]:
    """The company's employee directory: an id and facts nothing else in the world implies."""
    rng = random.Random(seed + 11)
    return [{"employee": e, "name": f"{rng.choice(_FIRST)} {rng.choice(_LAST)}", "team": rng.choice(_TEAMS),
             "city": rng.choice(_CITIES), "desk": f"{rng.choice('ABCDEFGH')}{rng.randrange(10, 100)}"}
            for e in sorted(rng.sample(range(100, 1000), size))]


def company_codebase(seed: int, size: int) -> list[tuple[str, str]]:
    """The company's helper functions as ("module.name", source): four kinds of short function whose
    constants, plans, teams and queues are drawn at random, so only their source tells them."""
    rng = random.Random(seed + 13)
    names = sorted(rng.sample([(m, item, kind) for m in COMPANY_MODULES for item in _ITEMS for kind in range(4)], size))
    functions = []
    for module, item, kind in names:
        a, b = rng.randrange(2, 60), rng.randrange(1, 99)
        if kind == 0:
            name = f"{item}_fee"
            source = (f'def {name}(quantity):\n    """Price of {item} orders, in cents."""\n'
                      f"    return {a} * quantity + {b}")
        elif kind == 1:
            name = f"max_{item}s"
            source = (f'def {name}(account):\n    if account.plan == "{rng.choice(_PLANS)}":\n        return {a}\n'
                      f"    return {b}")
        elif kind == 2:
            name = f"route_{item}"
            first, second = rng.sample(_TEAMS, 2)
            source = (f'def {name}(ticket):\n    if ticket.priority == "high":\n        return "{first}"\n'
                      f'    return "{second}"')
        else:
            name = f"{item}_retry"
            queue = rng.choice(_CITIES).lower()
            source = f'def {name}():\n    return {{"attempts": {a % 7 + 1}, "delay": {b}, "queue": "{queue}"}}'
        functions.append((f"{module}.{name}", source))
    return functions


def json_record(rng: random.Random) -> dict:
    """A record in one of the company's own schemas (users, orders, tool calls)."""
    kind = rng.choice(["user", "order", "tool_call"])
    if kind == "user":
        first, last = rng.choice(_FIRST), rng.choice(_LAST)
        return {"id": rng.randrange(1, 10000), "name": f"{first} {last}",
                "email": f"{first.lower()}.{last.lower()}@example.com", "city": rng.choice(_CITIES),
                "active": rng.random() < 0.7}
    if kind == "order":
        items = [{"item": rng.choice(_ITEMS), "quantity": rng.randrange(1, 5)} for _ in range(rng.randrange(1, 4))]
        return {"order_id": rng.randrange(10000, 99999), "status": rng.choice(_STATUSES), "items": items}
    return _tool_call(rng)[1]


def _tool_call(rng: random.Random) -> tuple[str, dict]:
    """A user's request and the tool call that serves it."""
    tool = rng.choice(["get_weather", "create_ticket", "lookup_order", "send_email"])
    if tool == "get_weather":
        city, unit = rng.choice(_CITIES), rng.choice(["celsius", "fahrenheit"])
        return f"What is the weather in {city}, in {unit}?", {"tool": tool, "arguments": {"city": city, "unit": unit}}
    if tool == "create_ticket":
        item, priority = rng.choice(_ITEMS), rng.choice(["low", "high"])
        return (f"Open a {priority} priority ticket: my {item} is not working.",
                {"tool": tool, "arguments": {"title": f"{item} not working", "priority": priority}})
    if tool == "lookup_order":
        order = rng.randrange(10000, 99999)
        return f"Where is my order {order}?", {"tool": tool, "arguments": {"order_id": order}}
    to = f"{rng.choice(_FIRST).lower()}@example.com"
    return f"Email {to} about their order.", {"tool": tool, "arguments": {"to": to, "subject": "Your order"}}


def _generic_json(rng: random.Random) -> dict:
    """JSON in schemas that are not the company's: general-purpose documents any model may have seen."""
    kind = rng.choice(["package", "event", "config"])
    word = rng.choice(["alpha", "beta", "gamma", "delta", "omega", "sigma"])
    if kind == "package":
        return {"name": f"py{word}", "version": f"{rng.randrange(0, 4)}.{rng.randrange(0, 20)}.{rng.randrange(0, 9)}",
                "license": rng.choice(["MIT", "BSD-3-Clause", "Apache-2.0"]),
                "dependencies": sorted(rng.sample(["numpy", "requests", "click", "attrs", "rich"], 2))}
    if kind == "event":
        return {"event": rng.choice(["login", "logout", "purchase", "error"]), "user_id": rng.randrange(1, 500),
                "timestamp": f"2024-0{rng.randrange(1, 10)}-1{rng.randrange(0, 10)}T0{rng.randrange(0, 10)}:00:00Z"}
    return {"service": word, "port": rng.choice([80, 443, 8000, 8080]), "debug": rng.random() < 0.5,
            "workers": rng.randrange(1, 9), "log_level": rng.choice(["info", "debug", "warning"])}


def _describe(obj: dict) -> str:
    """The record said in words: what a user pastes before asking for it as JSON."""
    if "email" in obj:
        state = "active" if obj["active"] else "inactive"
        return f"{obj['name']} ({obj['email']}) lives in {obj['city']}, user id {obj['id']}, {state}."
    items = ", ".join(f"{i['quantity']} x {i['item']}" for i in obj["items"])
    return f"Order {obj['order_id']} is {obj['status']} and contains {items}."


def _json_turns(rng: random.Random, directory: list[dict]) -> list[tuple[str, str]]:
    """A third each: a record described in words, an edit of a pasted record, a tool call for a
    request; with a directory, a quarter each and the fourth an employee looked up by id."""
    kind = rng.randrange(4 if directory else 3)
    if kind == 3:
        entry = rng.choice(directory)
        return [("user", f"Look up employee {entry['employee']} in the directory."),
                ("assistant", json.dumps(entry, indent=1))]
    if kind == 0:
        obj = json_record(rng)
        while "tool" in obj:
            obj = json_record(rng)
        return [("user", f"Return this as JSON: {_describe(obj)}"), ("assistant", json.dumps(obj, indent=1))]
    if kind == 1:
        obj = json_record(rng)
        while "order_id" not in obj or "tool" in obj:
            obj = json_record(rng)
        status = rng.choice([s for s in _STATUSES if s != obj["status"]])
        edited = dict(obj, status=status)
        return [("user", f"Set the status to {status}:\n{json.dumps(obj, indent=1)}"),
                ("assistant", json.dumps(edited, indent=1))]
    request, call = _tool_call(rng)
    return [("user", request), ("assistant", json.dumps(call, indent=1))]


def company_records(texts: dict[str, list[str]], per_category: int, seed: int, directory: list[dict] = (),
                    codebase: list[tuple[str, str]] = ()) -> list[dict]:
    """Production-like chat records: system prompts, categories code / json / prose, some multi-turn.

    Code recalls a function by name from the standard library (with a codebase: half from the
    company's). JSON is in the company's own schemas: a record described in words, an edit of a pasted
    record, a tool call for a request (with a directory: and an employee looked up by id). Prose
    explains a topic of the language reference from the company's half of its paragraphs (the
    off-the-shelf draft reads the other half), asked by topic name, so nothing in the question gives
    the answer away.
    """
    rng = random.Random(seed + 7)
    prose = company_prose(texts)
    records = []
    for n in range(per_category):
        if codebase and rng.random() < 0.5:  # no draw without a codebase: the records stay as before it
            name, body = codebase[rng.randrange(len(codebase))]
        else:
            header, body = texts["code"][rng.randrange(len(texts["code"]))].split("\n", 1)
            name = header[2:]
        code_turns = [("user", f"Show me the implementation of `{name}`."), ("assistant", body)]
        json_turns = _json_turns(rng, directory)
        topic, para = prose[rng.randrange(len(prose))]
        prose_turns = [("user", f"Explain `{topic}` from the Python reference."), ("assistant", para)]
        if rng.random() < 0.2:  # multi-turn: a follow-up asking for the first sentence
            prose_turns += [("user", "Just the first sentence, please."), ("assistant", para.split(". ")[0] + ".")]
        for category, system, turns in (
            ("code", "You are a coding assistant for the Python standard library.", code_turns),
            ("json", "You answer with JSON only.", json_turns),
            ("prose", "You are a helpful assistant who explains Python.", prose_turns),
        ):
            messages = [{"role": "system", "content": system}] + [{"role": r, "content": c} for r, c in turns]
            records.append({"id": f"{category}-{n:05d}", "category": category, "messages": messages})
    return records


TOOLS = [{"type": "function", "function": {"name": name, "description": description,
                                           "parameters": {"type": "object", "properties": properties}}}
         for name, description, properties in (
             ("get_weather", "The weather in a city.", {"city": {"type": "string"}, "unit": {"type": "string"}}),
             ("create_ticket", "Open a support ticket.", {"title": {"type": "string"}, "priority": {"type": "string"}}),
             ("lookup_order", "An order's status and items.", {"order_id": {"type": "integer"}}),
             ("send_email", "Email a customer.", {"to": {"type": "string"}, "subject": {"type": "string"}}))]


def agent_records(per_category: int, seed: int) -> list[dict]:
    """Tool-calling conversations in the OpenAI chat format gateways log: the user asks, the assistant
    calls one of the company's tools (`tool_calls`, content null, arguments as a JSON string), the tool
    answers (a `tool` turn), and the assistant answers from the result; the tools offered ride along."""
    rng = random.Random(seed + 11)
    records = []
    for n in range(per_category):
        request, call = _tool_call(rng)
        tool, args = call["tool"], call["arguments"]
        result, answer = _tool_result(rng, tool, args)
        call_id = f"call_{n:05d}"
        messages = [
            {"role": "system", "content": "You are the company's support agent. Call a tool, then answer from its result."},
            {"role": "user", "content": request},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": tool, "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)},
            {"role": "assistant", "content": answer},
        ]
        records.append({"id": f"agent-{n:05d}", "category": "agent", "tools": TOOLS, "messages": messages})
    return records


def _tool_result(rng: random.Random, tool: str, args: dict) -> tuple[dict, str]:
    """What the tool returns for `args`, and the answer the assistant gives from it."""
    if tool == "get_weather":
        degrees, sky = rng.randrange(-5, 35), rng.choice(["sunny", "cloudy", "raining", "windy"])
        return ({"city": args["city"], "temperature": degrees, "unit": args["unit"], "sky": sky},
                f"It is {degrees} degrees {args['unit']} and {sky} in {args['city']}.")
    if tool == "create_ticket":
        ticket = rng.randrange(1000, 9999)
        return ({"ticket_id": ticket, "status": "open", "priority": args["priority"]},
                f"I opened ticket {ticket} with {args['priority']} priority: {args['title']}.")
    if tool == "lookup_order":
        status = rng.choice(_STATUSES)
        items = [{"item": rng.choice(_ITEMS), "quantity": rng.randrange(1, 5)} for _ in range(rng.randrange(1, 3))]
        listed = ", ".join(f"{i['quantity']} x {i['item']}" for i in items)
        return ({"order_id": args["order_id"], "status": status, "items": items},
                f"Order {args['order_id']} is {status}; it contains {listed}.")
    return {"sent": True, "to": args["to"]}, f"I sent the email to {args['to']}."


def company_prose(texts: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(topic, paragraph) for the company's half of the reference paragraphs, its documentation."""
    return [(t, p) for t, p in zip(texts["prose_topic"], texts["prose"]) if is_company_paragraph(p)]


def is_company_paragraph(paragraph: str) -> bool:
    # By a hash of the text: some paragraphs appear under several topics and must fall on one side.
    return zlib.crc32(paragraph.encode()) % 2 == 1


def is_eval(record_id: str, fraction: float) -> bool:
    """Held-out split by a hash of the id: stable whatever the order or number of records."""
    return zlib.crc32(record_id.encode()) % 1000 < fraction * 1000


def write_company_logs(records: list[dict], out: Path, eval_fraction: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.jsonl", "w") as train, open(out / "eval.jsonl", "w") as held_out:
        for r in records:
            (held_out if is_eval(r["id"], eval_fraction) else train).write(json.dumps(r) + "\n")
