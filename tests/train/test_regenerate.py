"""Regeneration by the target: resumable after an interruption, nothing lost, nothing duplicated."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from drafters.sampling import Sampling
from helpers import CHAT, TOOL_TEMPLATE, TOOLS
from traffic.records import load_records, prompt_ids
from eval.engines import llama_cpp
from eval.engines.endpoint import Endpoint, EndpointError
from train.regenerate import answer_writer, regenerate, write_records

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



# --- answers written by a serving engine -------------------------------------------------------------------


needs_llama_cpp = pytest.mark.skipif(not llama_cpp.available(), reason=(
    f"llama.cpp is not built at {llama_cpp.home()}: `make llama-cpp`"))


@needs_llama_cpp
@pytest.mark.slow
def test_llama_server_writes_the_targets_greedy_answers_and_resumes_like_torch(world, tiny_world, tmp_path,
                                                                               monkeypatch):
    """regenerate.engine=llamacpp: a real llama-server on the target converted by llama.cpp (float32) writes
    the greedy answers PyTorch writes, the cache says which engine wrote them, and an interrupted run resumes
    to what an uninterrupted one wrote."""
    target, tok, _ = world
    # llama-server holds a slot to the target's context (384 tokens); PyTorch would run past it.
    records, _ = load_records(str(tiny_world / "company_logs" / "train.jsonl"))
    records = sorted((r for r in records if len(prompt_ids(r, tok)) + 12 < target.config.max_position_embeddings),
                     key=lambda r: -len(r.messages))[:N_RECORDS]
    settings = {"engine": "llamacpp", "parallel": 3, "threads": 1}
    kwargs = dict(max_new_tokens=12, batch_size=3, seed=5, progress=False)
    torch_out, _ = regenerate(records, target, tok, tmp_path / "torch.jsonl", **kwargs)
    with answer_writer(settings, tok, str(tiny_world / "target"), records, max_new_tokens=12, work=tmp_path) as w:
        assert w.name.startswith("llama.cpp") and (tmp_path / "target-f32.gguf").exists()
        full, stats = regenerate(records, target, tok, tmp_path / "full.jsonl", writer=w, **kwargs)
        assert stats.new_tokens > 0
        calls = {"n": 0}
        real = w.endpoint.complete

        def flaky(*args, **kw):
            calls["n"] += 1
            if calls["n"] == 7:  # inside the third batch
                raise KeyboardInterrupt
            return real(*args, **kw)

        monkeypatch.setattr(w.endpoint, "complete", flaky)
        with pytest.raises(KeyboardInterrupt):
            regenerate(records, target, tok, tmp_path / "resumed.jsonl", writer=w, **kwargs)
        monkeypatch.setattr(w.endpoint, "complete", real)
        resumed, stats = regenerate(records, target, tok, tmp_path / "resumed.jsonl", writer=w, **kwargs)
    assert stats.resumed == 6
    assert [r.messages for r in resumed] == [r.messages for r in full]
    assert [r.messages for r in full] == [r.messages for r in torch_out]  # float32 in both: the same text
    assert json.loads((tmp_path / "full.meta.json").read_text())["writer"] == w.name
    with pytest.raises(ValueError, match="other records or settings"):  # torch will not resume llama.cpp's cache
        regenerate(records, target, tok, tmp_path / "full.jsonl", **kwargs)


class _Server:
    """An OpenAI-compatible stand-in on 127.0.0.1 for the client's own behaviour (retries, errors, the key):
    it serves `model`, fails the first `failures` completions with a 503, and records each request."""

    def __init__(self, model="m", failures=0, status=200):
        import http.server
        import threading

        self.requests, self.failures = [], failures
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                owner.requests.append(("GET", self.path, dict(self.headers), None))
                self._send(200, {"data": [{"id": model}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append(("POST", self.path, dict(self.headers), body))
                if owner.failures:
                    owner.failures -= 1
                    return self._send(503, {"error": "busy"})
                if status != 200:
                    return self._send(status, {"error": "bad key"})
                self._send(200, {"choices": [{"text": f"echo {len(body['prompt'])}", "finish_reason": "stop"}],
                                 "usage": {"completion_tokens": 2}})

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_the_endpoint_client_retries_checks_the_model_and_never_shows_the_key(monkeypatch, capfd):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-123")
    with _Server(model="smol", failures=2) as server:
        endpoint = Endpoint(server.url, timeout=10, retries=2)
        assert endpoint.check() == "smol" and "sk-secret" not in repr(endpoint)
        answer = endpoint.complete([1, 2, 3], max_tokens=5, seed=7)
        assert (answer.text, answer.tokens, answer.finish_reason) == ("echo 3", 2, "stop")
        posts = [r for r in server.requests if r[0] == "POST"]
        assert len(posts) == 3  # two 503s retried, then the answer
        assert posts[-1][2]["Authorization"] == "Bearer sk-secret-123"
        assert posts[-1][3] == {"model": "smol", "prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0.0,
                                "top_p": 1.0, "seed": 7}
        # A server's own extensions go into every request (the OpenAI client's extra_body).
        Endpoint(server.url, model="smol", extra_body={"cache_prompt": False}).complete([1], max_tokens=1)
        assert server.requests[-1][3]["cache_prompt"] is False
        # A server whose default top-k is not "none" is told so when a request has no top-k.
        Endpoint(server.url, model="smol", top_k_off=0).complete([1], max_tokens=1, temperature=1.0)
        assert server.requests[-1][3]["top_k"] == 0
        with pytest.raises(ValueError, match=r"serves \['smol'\], not 'other'"):
            Endpoint(server.url, model="other").check()
    with _Server(failures=5) as server:
        with pytest.raises(EndpointError, match=r"127.0.0.1:\d+/v1/completions failed 2 times; the last: 503"):
            Endpoint(server.url, model="m", retries=1).complete([1], max_tokens=1)
    with _Server(status=401) as server:
        with pytest.raises(ValueError, match=r"answered 401: .*bad key") as info:
            Endpoint(server.url, model="m").complete([1], max_tokens=1)
        assert "sk-secret" not in str(info.value)
    with pytest.raises(EndpointError, match=r"http://127.0.0.1:9/v1/models failed"):
        Endpoint("http://127.0.0.1:9", retries=0, timeout=2).check()
    out = capfd.readouterr()
    assert "sk-secret" not in out.out + out.err


def test_regenerate_endpoint_sends_each_batch_in_flight_with_its_own_seed(world, tmp_path):
    """regenerate.endpoint=URL: the chat-templated prompts go out as token ids, each with a seed derived from
    its batch and row (so a batch writes the same answers whenever it runs), and the answers are the server's."""
    target, tok, records = world
    with _Server(model="smol") as server:
        settings = {"endpoint": server.url, "parallel": 2}
        with answer_writer(settings, tok, "unused", records, max_new_tokens=6, work=tmp_path) as writer:
            out, stats = regenerate(records, target, tok, tmp_path / "c.jsonl", writer=writer, max_new_tokens=6,
                                    batch_size=4, sampling=Sampling(temperature=0.7), progress=False)
    assert writer.name == f"smol at {server.url[:-3]}"
    posts = [r[3] for r in server.requests if r[0] == "POST"]
    assert len(posts) == stats.jobs and len({p["seed"] for p in posts}) == stats.jobs
    assert all(p["temperature"] == 0.7 and p["max_tokens"] == 6 for p in posts)
    assert stats.new_tokens == 3 * stats.jobs  # two tokens and the end of turn, per answer
    first = next(i for i, m in enumerate(out[0].messages) if m["role"] == "assistant")
    assert out[0].messages[first]["content"].startswith("echo ")
    with pytest.raises(ValueError, match="set one or the other"):
        with answer_writer({"engine": "llamacpp", "endpoint": server.url}, tok, "x", records, max_new_tokens=1,
                           work=tmp_path):
            pass


def test_a_prompt_without_its_answer_gets_the_targets_answer_appended(world, tmp_path):
    """Benchmark prompts and logged requests without responses end with a user turn: the target's answer
    is appended, so they become training examples."""
    from traffic.records import Record

    target, tok, _ = world
    records = [Record([{"role": "user", "content": "Write a Python function that adds two numbers."}], "code", "q1",
                      "bench", 1)]
    out, stats = regenerate(records, target, tok, tmp_path / "c.jsonl", max_new_tokens=8, progress=False)
    ref, _ = regenerate([Record(records[0].messages + [{"role": "assistant", "content": "logged"}], "code", "q1",
                                "bench", 1)], target, tok, tmp_path / "d.jsonl", max_new_tokens=8, progress=False)
    assert stats.jobs == 1 and [m["role"] for m in out[0].messages] == ["user", "assistant"]
    assert out[0].messages == ref[0].messages
