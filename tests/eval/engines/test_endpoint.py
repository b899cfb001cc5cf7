"""The OpenAI-compatible client (eval/engines/endpoint.py): a stream of prompts over busy slots, and a failed request."""

import pytest

from eval.engines import llama_cpp
from eval.engines.endpoint import stream


class _Server:
    """A stand-in for a llama-server with `parallel` slots that answers each prompt with its own ids."""

    def __init__(self, parallel, fail_at=None):
        self.parallel, self.fail_at, self.calls = parallel, fail_at, 0

    def complete(self, prompt, max_new_tokens):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise ConnectionError("llama-server went away")
        return llama_cpp.Completion(list(prompt), 0, 0, 1.0)


def test_a_stream_answers_every_prompt_in_order_and_keeps_the_slots_busy():
    prompts = [[i] for i in range(5)]
    server = _Server(3)
    answers, sent = stream(lambda p: server.complete(p, 8), prompts, server.parallel)
    assert [a.tokens for a in answers] == prompts and sent >= len(prompts)


def test_a_failed_request_stops_the_stream_with_its_error():
    with pytest.raises(ConnectionError, match="went away"):
        server = _Server(3, fail_at=4)
        stream(lambda p: server.complete(p, 8), [[i] for i in range(20)], server.parallel)
