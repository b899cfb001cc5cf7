"""A client for the OpenAI-compatible completions API that serving engines expose (vLLM, SGLang, llama-server,
or a gateway in front of them): what draftsmith uses to have a team's own deployment write answers
(train/regenerate.py), and to measure it with its drafter and without (`stream`, timed as a client sees it, and
the server's Prometheus `metrics`: eval/engines/deployment.py).

Prompts go out as token ids (`/v1/completions` takes a list of ids in vLLM, SGLang and llama-server), so no
second tokenizer stands between draftsmith's chat template and the server. The API key, when the server
wants one, is read from the environment at each request and never printed or logged; a request that fails
is retried a bounded number of times and then surfaces with the URL and the server's own words; a server
that serves another model than the one configured is an error before any traffic is sent.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


@dataclass
class EndpointAnswer:
    """One completion: its text, how many tokens the server generated, and why it stopped."""

    text: str
    tokens: int
    finish_reason: str | None


class EndpointError(ConnectionError):
    """A server that could not be reached or kept failing, named by its URL."""


class EndpointRefused(ValueError):
    """A request the server refused (a 4xx answer: retrying will not help), with its status `code`."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class Endpoint:
    """An OpenAI-compatible server at `url` (its base, with or without `/v1`), serving `model` (None: the one
    model its `/v1/models` lists). `api_key_env` names the environment variable holding its API key (unset:
    no key is sent); `timeout` is per request, in seconds; a request that fails with a connection error, a
    timeout or a 5xx answer is tried `retries` more times, a second apart and then longer."""

    def __init__(self, url: str, *, model: str | None = None, api_key_env: str = "OPENAI_API_KEY",
                 timeout: float = 600.0, retries: int = 2, top_k_off: int | None = None,
                 extra_body: dict | None = None) -> None:
        base = url.rstrip("/")
        self.base = base[: -len("/v1")] if base.endswith("/v1") else base
        self.model, self.api_key_env, self.timeout, self.retries = model, api_key_env, timeout, retries
        # The value this server reads as "no top-k", sent when a request has none; None: the field is left out
        # and the server's default holds (a llama-server started greedy has top-k 1 until a request says 0).
        self.top_k_off = top_k_off
        # Fields added to every completion request, as the OpenAI client's `extra_body` adds them: a server's own
        # extensions (llama-server's {"cache_prompt": false}, vLLM's {"ignore_eos": true}).
        self.extra_body = dict(extra_body or {})

    def __repr__(self) -> str:  # never the key
        return f"Endpoint({self.base!r}, model={self.model!r})"

    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _retrying(self, path: str, body: dict | None, read):
        """`read(response, sent)` of a request to `path` (POST with a JSON `body`, else GET; `sent`: its
        time.perf_counter() when it went out), tried again after a connection error, a timeout (also while the
        answer streams in) or a 5xx answer, at most `retries` times."""
        url = self.base + path
        data = json.dumps(body).encode() if body is not None else None
        last = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(2.0 ** (attempt - 1), 8.0))
            request = urllib.request.Request(url, data=data, headers=self._headers(), method="POST" if data else "GET")
            sent = time.perf_counter()
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as r:
                    return read(r, sent)
            except urllib.error.HTTPError as e:
                detail = e.read().decode("utf-8", "replace")[:500]
                if e.code < 500:  # the request itself is wrong: retrying will not help
                    raise EndpointRefused(f"{url} answered {e.code}: {detail}", e.code) from None
                last = f"{e.code}: {detail}"
            except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException) as e:
                last = str(getattr(e, "reason", e)) or type(e).__name__
        raise EndpointError(f"{url} failed {self.retries + 1} times; the last: {last}")

    def _request(self, path: str, body: dict | None = None) -> dict:
        return self._retrying(path, body, lambda r, _: json.loads(r.read()))

    def metrics(self) -> str | None:
        """The server's Prometheus exposition at `/metrics` (vLLM, SGLang with --enable-metrics, llama-server with
        --metrics), or None where it has none."""
        try:
            return self._retrying("/metrics", None, lambda r, _: r.read().decode("utf-8"))
        except EndpointRefused as e:
            if e.code == 404:  # not exposed
                return None
            raise

    def check(self) -> str:
        """The model this server serves, checked against the configured one; an unreachable server or one
        serving another model is an error naming the URL."""
        served = [m["id"] for m in self._request("/v1/models").get("data", [])]
        if self.model is None:
            if len(served) != 1:
                raise ValueError(f"{self.base} serves {served or 'no model'}: name the one to use")
            self.model = served[0]
        elif self.model not in served:
            raise ValueError(f"{self.base} serves {served}, not {self.model!r}")
        return self.model

    def _body(self, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float, top_k: int,
              seed: int | None) -> dict:
        body = {"model": self.model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p}
        if top_k or self.top_k_off is not None:
            body["top_k"] = top_k or self.top_k_off  # an extension vLLM, SGLang and llama-server all take
        if seed is not None:
            body["seed"] = seed
        return {**body, **self.extra_body}

    def complete(self, prompt_ids: list[int], *, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None) -> EndpointAnswer:
        """One completion of the token ids: greedy at temperature 0, else sampled with `seed`; ends at the
        model's end of turn or after max_tokens."""
        out = self._request("/v1/completions", self._body(prompt_ids, max_tokens, temperature, top_p, top_k, seed))
        choice = out["choices"][0]
        tokens = (out.get("usage") or {}).get("completion_tokens")
        if tokens is None:
            raise ValueError(f"{self.base}/v1/completions gave no usage.completion_tokens")
        return EndpointAnswer(choice["text"], int(tokens), choice.get("finish_reason"))

    def stream(self, prompt_ids: list[int], *, max_tokens: int) -> "Streamed":
        """One greedy completion, streamed as a client sees it: its text, tokens, time to the first token and
        the time from the first token to the last (what decoding the rest took, the prompt's processing left
        out). A request that fails part-way is sent again whole (greedy: the same answer) within `retries`."""
        body = {**self._body(prompt_ids, max_tokens, 0.0, 1.0, 0, None), "stream": True,
                "stream_options": {"include_usage": True}}

        def read(r, start: float) -> Streamed:
            first, last, text, tokens, finish = None, None, [], None, None
            for raw in r:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    raise ValueError(f"{self.base}/v1/completions: {chunk['error']}")
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        last = time.perf_counter()
                        first = first or last
                        text.append(choice["text"])
                    finish = choice.get("finish_reason") or finish
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
            if tokens is None:
                raise ValueError(f"{self.base}/v1/completions streamed no usage.completion_tokens "
                                 "(it needs stream_options.include_usage)")
            if first is None:
                first = last = time.perf_counter()
            return Streamed("".join(text), int(tokens), first - start, last - first, finish)

        return self._retrying("/v1/completions", body, read)


@dataclass
class Streamed:
    """A streamed completion: its text and tokens, seconds to its first token (the prompt's processing and the
    queue) and from the first token to the last (decoding the other tokens - 1)."""

    text: str
    tokens: int
    ttft: float
    decode: float
    finish_reason: str | None


def stream(complete, prompts: list, concurrency: int, on_done=None) -> tuple[list, int]:
    """The prompts served as an engine under constant load serves them: `concurrency` clients, each sending the
    next prompt as soon as its previous answer is back (`complete(prompt)`), and extra requests (cycling through
    the prompts, their answers dropped) keep every client busy until every prompt is answered. Returns the
    prompts' answers, in order, and the number of requests sent; `on_done()` is called as each answer arrives.
    A request that raises stops the other clients, and the error surfaces."""
    lock = threading.Lock()
    answers: list = [None] * len(prompts)
    state = {"next": 0, "open": len(prompts)}

    def client() -> None:
        while True:
            with lock:
                if not state["open"]:
                    return
                request = state["next"]
                state["next"] += 1
            try:
                answer = complete(prompts[request % len(prompts)])
            except BaseException:
                with lock:
                    state["open"] = 0  # the other clients stop too; the error surfaces from this one
                raise
            if request < len(prompts):
                with lock:
                    answers[request] = answer
                    state["open"] -= 1
                if on_done is not None:
                    on_done()

    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(client) for _ in range(concurrency)]:
            future.result()
    return answers, state["next"]
