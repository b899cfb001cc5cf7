"""scripts/target_answers.py: greedy answers against the answers the records logged."""

import json

import torch
from transformers import AutoTokenizer

from helpers import load_script


class Reciting:
    """A stand-in target that answers each prompt with a fixed text: the logged answer, or a wrong one."""

    def __init__(self, tok, answers: dict[tuple, str]):
        self.tok, self.answers = tok, answers

    def generate(self, ids, max_new_tokens, **_):
        text = self.answers[tuple(ids[0].tolist())]
        new = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return torch.cat([ids, torch.tensor([new[:max_new_tokens]])], dim=1)


def write_logs(tok, path, turns: list[tuple[str, str, str]]):
    """Records of (category, request, logged answer) written as JSONL to `path`; returns each record's
    prompt ids as a tuple (the stand-in target's key)."""
    records = [{"id": f"r{i}", "category": category,
                "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
               for i, (category, q, a) in enumerate(turns)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return [tuple(tok.apply_chat_template(r["messages"][:1], add_generation_prompt=True, tokenize=True,
                                          return_dict=False)) for r in records]


def test_reference_agreement_counts_what_the_target_reproduces(tiny_world, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_world / "target")
    logged = ["def f(x):\n    return x + 1", "def g(y):\n    return y * 2", "{\"a\": 1}"]
    data = tmp_path / "logs.jsonl"
    prompts = write_logs(tok, data, [("code" if i < 2 else "json", f"question {i}", a) for i, a in enumerate(logged)])
    module = load_script("target_answers")
    # the first code answer exact; the second right up to its last line; JSON wrong from the start
    answers = {prompts[0]: logged[0], prompts[1]: "def g(y):\n    return None", prompts[2]: "nothing"}
    rows = module.reference_agreement(Reciting(tok, answers), tok, str(data), per_category=5, max_new_tokens=64)
    assert [e for e, _ in rows["code"]] == [True, False] and rows["json"] == [(False, 0.0)]
    first, second = rows["code"][0][1], rows["code"][1][1]
    assert first == 1.0 and 0.3 < second < 1.0


def test_reference_agreement_keeps_only_matching_requests(tiny_world, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_world / "target")
    requests = ["Look up employee 101 in the directory.", "Where is my order 12345?", "Look up employee 202 in it."]
    data = tmp_path / "logs.jsonl"
    prompts = write_logs(tok, data, [("json", q, "{}") for q in requests])
    module = load_script("target_answers")
    # only the lookups are answered right: a filter that let the order through would count a miss
    answers = {prompts[0]: "{}", prompts[1]: "wrong", prompts[2]: "{}"}
    target = Reciting(tok, answers)
    rows = module.reference_agreement(target, tok, str(data), per_category=5, max_new_tokens=16, match="Look up")
    assert rows["json"] == [(True, 1.0), (True, 1.0)]
    assert len(module.reference_agreement(target, tok, str(data), per_category=5, max_new_tokens=16)["json"]) == 3
