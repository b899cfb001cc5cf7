"""Regeneration by the target: resumable after an interruption, nothing lost, nothing duplicated."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from drafters.sampling import Sampling
from helpers import CHAT, TOOL_TEMPLATE, TOOLS
from traffic.records import load_records
from train.regenerate import regenerate, write_records

N_RECORDS = 10


@pytest.fixture(scope="module")
def world(tiny_world):
    target = AutoModelForCausalLM.from_pretrained(tiny_world / "target").eval()
    tok = AutoTokenizer.from_pretrained(tiny_world / "target")
    records, _ = load_records(str(tiny_world / "company_logs" / "train.jsonl"))
    # Include multi-turn conversations: every assistant turn is regenerated.
    records = sorted(records, key=lambda r: -len(r.messages))[:N_RECORDS]
    return target, tok, records


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0, top_k=20)], ids=["greedy", "sampled"])
def test_interrupted_and_resumed_run_equals_an_uninterrupted_one(world, tmp_path, monkeypatch, sampling):
    target, tok, records = world
    kwargs = dict(sampling=sampling, max_new_tokens=12, batch_size=3, seed=5, progress=False)
    full, stats = regenerate(records, target, tok, tmp_path / "full.jsonl", **kwargs)
    assert stats.jobs == sum(m["role"] == "assistant" for r in records for m in r.messages) > N_RECORDS
    assert stats.resumed == 0 and stats.new_tokens > 0

    # Interrupt during the third batch, then tear the file as a crash mid-write would.
    calls = {"n": 0}
    real_generate = target.generate

    def flaky_generate(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_generate(*args, **kw)

    monkeypatch.setattr(target, "generate", flaky_generate)
    with pytest.raises(KeyboardInterrupt):
        regenerate(records, target, tok, tmp_path / "resumed.jsonl", **kwargs)
    monkeypatch.setattr(target, "generate", real_generate)
    cache = tmp_path / "resumed.jsonl"
    assert len(cache.read_text().splitlines()) == 6  # two complete batches of 3
    with open(cache, "a") as f:
        f.write('{"batch": 2, "id": "x", "tu')  # a torn line
    resumed, stats = regenerate(records, target, tok, cache, **kwargs)
    assert stats.resumed == 6
    assert [r.messages for r in resumed] == [r.messages for r in full]
    lines = [json.loads(line) for line in cache.read_text().splitlines()]
    assert len(lines) == len({(e["id"], e["turn"]) for e in lines}) == stats.jobs  # nothing duplicated
    assert (tmp_path / "full.jsonl").read_text() == cache.read_text()


def test_regenerated_answers_are_the_targets_greedy_answers(world, tmp_path):
    from eval.speculative import autoregressive_generate
    from traffic.records import prompt_ids

    target, tok, records = world
    out, _ = regenerate(records[:2], target, tok, tmp_path / "c.jsonl", max_new_tokens=10, batch_size=1,
                        progress=False)
    for original, regen in zip(records[:2], out):
        assert [m["role"] for m in regen.messages] == [m["role"] for m in original.messages]
        first_assistant = next(i for i, m in enumerate(original.messages) if m["role"] == "assistant")
        ids = torch.tensor(prompt_ids(type(original)(original.messages[:first_assistant + 1], "c", "i", "s", 1), tok))
        ref = autoregressive_generate(target, ids, sampling=Sampling(), max_new_tokens=10,
                                      eos_token_id=tok.eos_token_id).tokens
        ref = ref[:-1] if ref[-1] == tok.eos_token_id else ref
        assert regen.messages[first_assistant]["content"] == tok.decode(ref)


def test_cache_for_other_records_is_refused_and_keep_logged_passes_through(world, tmp_path):
    target, tok, records = world
    regenerate(records[:2], target, tok, tmp_path / "c.jsonl", max_new_tokens=4, progress=False)
    with pytest.raises(ValueError, match="other records or settings"):
        regenerate(records[:3], target, tok, tmp_path / "c.jsonl", max_new_tokens=4, progress=False)
    same, stats = regenerate(records, target, tok, tmp_path / "d.jsonl", keep_logged=True)
    assert same is records and stats.jobs == 0


def test_written_records_load_back(world, tmp_path):
    _, _, records = world
    write_records(records, tmp_path / "r.jsonl")
    back, _ = load_records(str(tmp_path / "r.jsonl"))
    assert [(r.id, r.category, r.messages) for r in back] == [(r.id, r.category, r.messages) for r in records]


def test_an_agent_conversation_is_regenerated_with_its_tools_and_each_turn_becomes_the_targets_text(world, tmp_path):
    target, tok, _ = world
    tok = AutoTokenizer.from_pretrained(tok.name_or_path)
    tok.chat_template = TOOL_TEMPLATE
    path = tmp_path / "agent.jsonl"
    path.write_text(json.dumps(CHAT) + "\n")
    records, _ = load_records(str(path))
    seen = []
    real_generate = target.generate

    def recording_generate(*args, **kw):
        seen.extend(tok.batch_decode(kw["input_ids"]))
        return real_generate(*args, **kw)

    target.generate = recording_generate
    try:
        regenerated, stats = regenerate(records, target, tok, tmp_path / "cache.jsonl", max_new_tokens=8,
                                        progress=False)
    finally:
        target.generate = real_generate
    assert stats.jobs == 2 and all("# Tools" in prompt for prompt in seen)  # the target saw the tools offered
    turns = regenerated[0].messages
    assert regenerated[0].tools == TOOLS and turns[3] == records[0].messages[3]  # the tool's answer stays
    for i in (2, 4):  # the target's own text, as it wrote it: the logged tool calls and reasoning go
        assert set(turns[i]) == {"role", "content"} and turns[i]["role"] == "assistant"
    write_records(regenerated, tmp_path / "out.jsonl")
    again, _ = load_records(str(tmp_path / "out.jsonl"))
    assert again[0].tools == TOOLS and again[0].messages == turns
