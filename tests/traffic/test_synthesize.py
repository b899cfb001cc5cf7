"""Requests synthesized through the target's chat template: the prefix, what is kept, resuming."""

import json
import zlib

import pytest
from transformers import AutoTokenizer

from eval.engines.endpoint import EndpointAnswer
from traffic.records import RecordError, load_records, render
from traffic.synthesize import normalized, synthesize, user_turn_prefix

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok(tiny_world):
    return AutoTokenizer.from_pretrained(tiny_world / "target")


@pytest.mark.parametrize("system", [None, "You write poems."])
@pytest.mark.parametrize("lead", ["", "Write a"])
def test_the_prefix_is_the_template_up_to_the_users_words(tok, system, lead):
    """A conversation whose user turn starts with `lead` renders as the prefix followed by the rest of its words."""
    prefix = user_turn_prefix(tok, system, lead)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": lead + " haiku about the sea"}]
    text = render(tok, messages, False)
    assert text.startswith(tok.decode(prefix))
    assert tok.decode(prefix).endswith(lead)
    assert (system or "") in tok.decode(prefix)


def test_templates_that_cannot_give_a_prefix_are_refused_with_the_reason(tok):
    import copy

    dropped = copy.copy(tok)
    dropped.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{% endfor %}"
    with pytest.raises(ValueError, match="does not write the user's words"):
        user_turn_prefix(dropped)
    system_last = copy.copy(tok)
    system_last.chat_template = ("{% for m in messages if m['role'] != 'system' %}{{ m['content'] }}{% endfor %}"
                                 "{% for m in messages if m['role'] == 'system' %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="after the user's words"):
        user_turn_prefix(system_last, "Be brief.")
    refuses = copy.copy(tok)
    refuses.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                             "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}"
                             "{% endfor %}")
    with pytest.raises(ValueError, match="cannot render a system turn"):
        user_turn_prefix(refuses, "Be brief.")


class _Sampler:
    """A stand-in for the server: request `seed`'s answer is a function of the seed alone (so a resumed run
    can be compared with an uninterrupted one); one in five is cut off, one in seven too short, and the words
    repeat across seeds (duplicates). `fail_at`: the call that raises, as an interruption would."""

    model = "stand-in"

    def __init__(self, fail_at=None):
        self.calls, self.fail_at, self.prompts = 0, fail_at, []

    def complete(self, prompt_ids, *, max_tokens, temperature, top_p, seed):
        self.calls += 1
        if self.calls == self.fail_at:
            raise KeyboardInterrupt
        self.prompts.append(tuple(prompt_ids))
        assert temperature == 1.0 and max_tokens == 40
        if seed % 5 == 0:
            return EndpointAnswer("a request that never ends", 40, "length")
        if seed % 7 == 0:
            return EndpointAnswer(" hi", 1, "stop")
        return EndpointAnswer(f"  how do I do task number {seed % 23}?\n", 9, "stop")


def _run(path, sampler, **kw):
    settings = dict(count=12, category="writing", leads=["Please", "Kindly"], max_tokens=40, parallel=3,
                    batch_size=4, seed=3, progress=False)
    return synthesize(sampler, [[1, 2], [1, 3]], path, **settings | kw)


def test_synthesis_keeps_finished_distinct_requests_and_resumes_to_the_same_file(tmp_path):
    whole = _run(tmp_path / "whole.jsonl", _Sampler())
    assert whole.kept == 12 and whole.sampled == whole.kept + whole.cut_off + whole.too_short + whole.duplicate
    assert whole.cut_off and whole.too_short and whole.duplicate
    records, _ = load_records(str(tmp_path / "whole.jsonl"))
    texts = [r.messages[0]["content"] for r in records]
    assert all(r.category == "writing" and [m["role"] for m in r.messages] == ["user"] for r in records)
    assert len({normalized(t) for t in texts}) == 12
    for r, text in zip(records, texts):  # request i continues prefix i % 2 and starts with its lead
        i = int(r.id.rsplit("-", 1)[1])
        seed = zlib.crc32(f"3-{i}".encode())
        assert text == ["Please", "Kindly"][i % 2] + f"  how do I do task number {seed % 23}?"
    interrupted = _Sampler(fail_at=10)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path / "resumed.jsonl", interrupted)
    resumed = _run(tmp_path / "resumed.jsonl", _Sampler())
    assert 0 < resumed.resumed < 12
    assert (tmp_path / "resumed.jsonl").read_bytes() == (tmp_path / "whole.jsonl").read_bytes()
    more = _run(tmp_path / "whole.jsonl", _Sampler(), count=15)  # a larger count adds to the file
    assert more.resumed == 12 and more.kept == 15
    with pytest.raises(ValueError, match="other settings"):
        _run(tmp_path / "whole.jsonl", _Sampler(), seed=4)


def test_a_model_that_never_ends_its_requests_stops_after_its_batches(tmp_path, capsys):
    class Endless(_Sampler):
        def complete(self, prompt_ids, **kw):
            self.calls += 1
            return EndpointAnswer("and so on", 40, "length")

    sampler = Endless()
    stats = synthesize(sampler, [[1]], tmp_path / "x.jsonl", count=5, max_tokens=40, batch_size=4, progress=False)
    assert stats.kept == 0 and sampler.calls == 20  # 4 × count requests, in batches of 4
    assert "holds 0 of the 5 requests" in capsys.readouterr().err


def test_runs_given_their_own_id_prefix_join_into_one_data_set(tmp_path):
    _run(tmp_path / "a.jsonl", _Sampler(), count=4)
    _run(tmp_path / "b.jsonl", _Sampler(), count=4, seed=5)
    joined = tmp_path / "joined.jsonl"
    joined.write_bytes((tmp_path / "a.jsonl").read_bytes() + (tmp_path / "b.jsonl").read_bytes())
    with pytest.raises(RecordError, match="duplicate id 'writing-synth-"):
        load_records(str(joined))
    _run(tmp_path / "c.jsonl", _Sampler(), count=4, seed=5, id_prefix="writing-open")
    joined.write_bytes((tmp_path / "a.jsonl").read_bytes() + (tmp_path / "c.jsonl").read_bytes())
    records, _ = load_records(str(joined))
    assert [r.id.startswith("writing-open-") for r in records] == [False] * 4 + [True] * 4
    # A file written before ids could be chosen resumes as the default prefix, and refuses another.
    meta = tmp_path / "a.jsonl.meta.json"
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "id_prefix"}))
    assert _run(tmp_path / "a.jsonl", _Sampler(), count=6).resumed == 4
    with pytest.raises(ValueError, match="other settings"):
        _run(tmp_path / "a.jsonl", _Sampler(), count=8, id_prefix="writing-open")
