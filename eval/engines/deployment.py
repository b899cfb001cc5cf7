"""The verdict from a team's own deployment: `python -m eval engine=openai` measures any OpenAI-compatible server
(vLLM, SGLang, llama-server, a gateway in front of them) with its drafter and without it, from outside.

The team serves the same model twice, with the drafter (`engine.spec_url`) and without (`engine.plain_url`).
For each batch size B of `batch_sizes` and each category of the traffic, both servers get the same prompts
(token ids, greedy, the same `max_new_tokens`), streamed, B requests in flight: a client per slot sends the next
prompt as soon as its answer is back, and extra requests keep B in flight until every prompt is answered
(eval/engines/endpoint.py's `stream`, what `engine=llamacpp` does with llama-server's slots). Per category and B:

- τ from the server's own counters, read from its Prometheus `/metrics` before and after the category: vLLM's
  `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens` and
  `..._num_accepted_tokens_per_pos` (vllm/v1/spec_decode/metrics.py) and llama-server's `llamacpp:` counters of
  the same names (with --metrics): τ = 1 + accepted / drafts, and acceptance by position = accepted at position
  i / drafts. The counters are the server's, so they include the extra requests and any other client's; a
  server that exposes none (SGLang keeps only a running average, `sglang:spec_accept_length`) gets no τ.
- the speed-up: each answer's tokens after the first over the time from its first token to its last (what
  decoding took; the prompt's processing and the queue are left out, as `engine=llamacpp` leaves them out),
  pooled over prompts and repeats, with its 95 % interval over prompts (eval/compare.py) and the verdict;
- what a user feels: time to first token and time per output token after it (p50 and p90 over answers), and
  the throughput of the whole stream (tokens over its wall-clock time), with and without the drafter;
- losslessness: the drafter's greedy answer equals the plain server's, text for text.

The rows of the drafter the deployment drafts with (`engine.drafter`, at `engine.k`) get these figures beside
draftsmith's τ and speed-up; without `engine.drafter` they are rows of their own (report.json's
`engine_results`). With `engine_costs` given too, draftsmith's τ also predicts the deployment's speed-up from
them, beside the measured one.
"""

from __future__ import annotations

import operator
import statistics
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from eval.compare import Timings, compare, tau_counts, verdict
from eval.engines.costs import FIELDS as ENGINE_FIELDS
from eval.engines.costs import tau_to_pay
from eval.engines.endpoint import Endpoint, Streamed, stream
from eval.evaluate import ALL
from eval.metrics import predicted_speedup

NAME = "your deployment"
# The counter names vLLM and llama-server share, behind their prefixes.
PREFIXES = ("vllm:", "llamacpp:")
# Each server's count of generated tokens, which shows when its speculative counters have caught up.
GENERATED = ("vllm:generation_tokens", "llamacpp:tokens_predicted")
# llama.cpp's engine fields, and what a deployment measured through its API adds to them.
FIELDS = (*ENGINE_FIELDS, "engine_acceptance_by_position", "engine_throughput_ratio", "engine_ttft_ms",
          "engine_tpot_ms", "engine_speedup_vs_baseline", "engine_speedup_vs_baseline_ci")


@dataclass
class SpecCounters:
    """A server's speculative-decoding counters: verifications (drafts), tokens drafted, drafts accepted, and
    accepted drafts by position; tokens generated, where the server counts them."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: tuple[float, ...] = ()
    generated: float | None = None

    @classmethod
    def parse(cls, exposition: str) -> "SpecCounters | None":
        """The counters in a Prometheus exposition (summed over its label sets: vLLM labels each engine), or
        None where it has no speculative counters."""
        from prometheus_client.parser import text_string_to_metric_families  # vLLM's: only with engine=openai

        totals: dict[str, float] = {}
        positions: dict[int, float] = {}
        generated = None
        for family in text_string_to_metric_families(exposition):
            samples = [s for s in family.samples if not s.name.endswith("_created")]
            if family.name in GENERATED:
                generated = (generated or 0.0) + sum(s.value for s in samples)
            prefix = next((p for p in PREFIXES if family.name.startswith(p + "spec_decode_")), None)
            if prefix is None:
                continue
            what = family.name[len(prefix) + len("spec_decode_"):]
            for s in samples:
                if what == "num_accepted_tokens_per_pos":
                    position = int(s.labels["position"])
                    positions[position] = positions.get(position, 0.0) + s.value
                else:
                    totals[what] = totals.get(what, 0.0) + s.value
        if "num_drafts" not in totals:
            return None
        return cls(totals["num_drafts"], totals.get("num_draft_tokens", 0.0), totals.get("num_accepted_tokens", 0.0),
                   tuple(positions.get(i, 0.0) for i in range(max(positions, default=-1) + 1)), generated)

    def _combine(self, other: "SpecCounters", op) -> "SpecCounters":
        width = max(len(self.per_position), len(other.per_position))
        pad = lambda p: list(p) + [0.0] * (width - len(p))  # noqa: E731
        generated = None if self.generated is None or other.generated is None else op(self.generated, other.generated)
        return SpecCounters(op(self.drafts, other.drafts), op(self.draft_tokens, other.draft_tokens),
                            op(self.accepted, other.accepted),
                            tuple(op(a, b) for a, b in zip(pad(self.per_position), pad(other.per_position))), generated)

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        return self._combine(other, operator.sub)

    def __add__(self, other: "SpecCounters") -> "SpecCounters":
        return self._combine(other, operator.add)

    @property
    def tau(self) -> float | None:
        """Tokens per verification: 1 + accepted drafts per verification (vLLM's mean acceptance length)."""
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def by_position(self) -> list[float]:
        """The share of verifications that kept the guess at each position."""
        return [a / self.drafts for a in self.per_position] if self.drafts else []


def read_counters(endpoint: Endpoint) -> SpecCounters | None:
    exposition = endpoint.metrics()
    return None if exposition is None else SpecCounters.parse(exposition)


def settled_counters(endpoint: Endpoint, before: SpecCounters | None, generated: int,
                     timeout: float = 10.0) -> SpecCounters | None:
    """The counters once they hold every request sent since `before`: a server can count a request just after
    its answer is sent. Waits until the server's count of generated tokens has grown by `generated` (the
    tokens its answers carried), or, on a server without that count, until two reads agree."""
    deadline = time.monotonic() + timeout
    last = read_counters(endpoint)
    while last is not None and before is not None and time.monotonic() < deadline:
        if last.generated is not None and before.generated is not None:
            if last.generated - before.generated >= generated:
                break
        time.sleep(0.05)
        now = read_counters(endpoint)
        if last.generated is None and now == last:
            break
        last = now
    return last


@dataclass
class Answers:
    """Every answer of one server at one batch size, by (repeat, category): the prompts' answers in order, the
    stream's wall-clock seconds and tokens (extra requests included), and the speculative counters of each
    category's stream (None for the plain server or one without counters)."""

    answers: dict = field(default_factory=dict)
    wall: dict = field(default_factory=dict)
    counters: dict = field(default_factory=dict)
    # at batch 1, each prompt's counters in order (one request at a time: a request's own), for τ paired by prompt
    prompt_counters: dict = field(default_factory=dict)


def measure(spec: Endpoint, plain: Endpoint | None, prompts: dict[str, list[list[int]]], *, max_new_tokens: int,
            batch_sizes: list[int], repeats: int, progress: bool = True) -> dict[int, dict[str, Answers]]:
    """Both servers over every category's prompts at each batch size, `repeats` times; within a repeat each
    category goes to the plain server and then to the drafting one, so both see the same moment of a shared
    machine. Each server answers one prompt first, untimed. At batch 1 the drafting server's counters are read
    around each request too (outside its timed stream), so that two drafters' τ can be paired by prompt."""
    servers = {"plain": plain, "spec": spec} if plain is not None else {"spec": spec}
    first = next(iter(prompts.values()))[0]
    for endpoint in servers.values():
        endpoint.stream(first, max_tokens=max_new_tokens)
    total = sum(len(ps) for ps in prompts.values()) * len(servers) * repeats * len(batch_sizes)
    bar = tqdm(total=total, desc=f"{NAME} (OpenAI API)", unit="req", disable=not progress)
    measured: dict[int, dict[str, Answers]] = {}
    for batch in batch_sizes:
        runs = measured[batch] = {name: Answers() for name in servers}
        for rep in range(repeats):
            for category, chosen in prompts.items():
                for name, endpoint in servers.items():
                    sent: list[Streamed] = []
                    per_prompt: list[SpecCounters | None] = []  # batch 1: requests go one at a time, in order
                    lock = threading.Lock()
                    count = name == "spec" and batch == 1

                    def complete(prompt, endpoint=endpoint, sent=sent, lock=lock, per_prompt=per_prompt, count=count):
                        first = read_counters(endpoint) if count else None
                        answer = endpoint.stream(prompt, max_tokens=max_new_tokens)
                        if first is not None:
                            last = settled_counters(endpoint, first, answer.tokens)
                            per_prompt.append(None if last is None else last - first)
                        with lock:
                            sent.append(answer)
                        return answer

                    before = read_counters(endpoint) if name == "spec" else None
                    start = time.perf_counter()
                    answers, _ = stream(complete, chosen, batch, bar.update)
                    wall = time.perf_counter() - start
                    out = runs[name]
                    out.answers[rep, category] = answers
                    out.wall[rep, category] = (wall, sum(a.tokens for a in sent))
                    if before is not None:
                        after = settled_counters(endpoint, before, sum(a.tokens for a in sent))
                        out.counters[rep, category] = None if after is None else after - before
                    if count and len(per_prompt) == len(chosen):
                        out.prompt_counters[rep, category] = per_prompt
    bar.close()
    return measured


def _percentiles(values: list[float]) -> list[float] | None:
    return [float(np.percentile(values, 50)), float(np.percentile(values, 90))] if values else None


def decode_timings(served: Answers, keys: list[str], repeats: int) -> tuple[Timings, list[str]]:
    """Decode tokens (all but the first) and seconds (first token to last) per prompt, (repeats, prompts)."""
    rows = [[a for c in keys for a in served.answers[rep, c]] for rep in range(repeats)]
    strata = [c for c in keys for _ in served.answers[0, c]]
    return (Timings(np.array([[max(a.tokens - 1, 0) for a in row] for row in rows], dtype=float),
                    np.array([[max(a.decode, 1e-6) for a in row] for row in rows])), strata)


def figures(measured: dict[str, Answers], category: str, *, repeats: int, pays_off_at: float, seed: int = 0) -> dict:
    """The deployment's figures for one category (or ALL) at one batch size."""
    spec, plain = measured["spec"], measured.get("plain")
    keys = [c for c in dict.fromkeys(c for _, c in spec.answers) if category in (ALL, c)]
    counted = [spec.counters.get((rep, c)) for rep in range(repeats) for c in keys]
    counters = sum(counted, SpecCounters()) if counted and None not in counted else None
    answers = lambda served: [a for rep in range(repeats) for c in keys for a in served.answers[rep, c]]  # noqa: E731
    ttft = lambda served: _percentiles([a.ttft * 1000 for a in answers(served)])  # noqa: E731
    tpot = lambda served: _percentiles([a.decode / (a.tokens - 1) * 1000 for a in answers(served) if a.tokens > 1])  # noqa: E731

    def throughput(served: Answers) -> float:
        walls = [sum(served.wall[rep, c][1] for c in keys) / sum(served.wall[rep, c][0] for c in keys)
                 for rep in range(repeats)]
        return statistics.median(walls)

    out = {**dict.fromkeys(FIELDS), "engine": NAME,
           "engine_acceptance_length": counters.tau if counters else None,
           "engine_mean_proposed": counters.draft_tokens / counters.drafts if counters and counters.drafts else None,
           "engine_acceptance_by_position": [round(p, 4) for p in counters.by_position] if counters else None,
           "engine_ttft_ms": {"spec": ttft(spec)}, "engine_tpot_ms": {"spec": tpot(spec)}}
    spec_t, strata = decode_timings(spec, keys, repeats)
    out["engine_sd_tokens_per_s"] = spec_t.median_tokens_per_s()
    if counters is None:
        out["engine_note"] = "the server exposes no speculative-decoding counters at /metrics: no τ"
    if plain is None:
        note = "no engine.plain_url: τ and latency only, no speed-up"
        out["engine_note"] = f"{out['engine_note']}; {note}" if out["engine_note"] else note
        return out
    plain_t, _ = decode_timings(plain, keys, repeats)
    vs_plain = compare(spec_t, plain_t, strata, seed=seed)
    differ = sum(a.text != b.text for a, b in zip(answers(spec), answers(plain)))
    out.update(engine_ar_tokens_per_s=plain_t.median_tokens_per_s(), engine_speedup=vs_plain.ratio,
               engine_speedup_ci=vs_plain.interval, engine_verdict=verdict(vs_plain.ratio, vs_plain.interval, pays_off_at),
               engine_lossless=differ == 0, engine_throughput_ratio=throughput(spec) / throughput(plain))
    if differ:  # how many, so a reader can weigh near ties (a bfloat16 server's batch shapes) against a bug
        note = f"{category}: {differ} of {len(answers(plain))} answers differ from the plain server's"
        out["engine_note"] = f"{out['engine_note']}; {note}" if out["engine_note"] else note
    out["engine_ttft_ms"]["plain"], out["engine_tpot_ms"]["plain"] = ttft(plain), tpot(plain)
    return out


def add_figures(rows: list[dict], measured: dict[int, dict[str, Answers]], *, drafter: str | None, k: int | None,
                repeats: int, pays_off_at: float, costs=None, seed: int = 0) -> list[dict]:
    """Rows of `drafter` at `k` (greedy, per batch size and category) gain the deployment's figures, and
    with `costs` (c, β entered for it) the speed-up draftsmith's τ predicts there; the other rows are left as they
    are. Returns the deployment's rows of its own where no drafter is named, else []."""
    own = []
    for batch, served in measured.items():
        categories = [*dict.fromkeys(c for _, c in served["spec"].answers), ALL]
        found = {c: figures(served, c, repeats=repeats, pays_off_at=pays_off_at, seed=seed) for c in categories}
        if drafter is None:
            first = next(iter(found.values()))
            width = k or len(first["engine_acceptance_by_position"] or []) or None
            own += [{"category": c, "drafter": "deployment", "k": width, "batch_size": batch, "temperature": 0.0,
                     "engine_only": "openai", **f} for c, f in found.items()]
            continue
        for r in rows:
            if (r["drafter"], r["k"], r.get("batch_size", 1), r["temperature"]) != (drafter, k, batch, 0.0):
                continue
            r.update(found[r["category"]])
            if costs is not None and costs.beta is not None and costs.c is not None:
                r.update(engine_cost_ratio=costs.c, engine_verify_overhead=costs.beta,
                         engine_predicted_speedup=predicted_speedup(r["acceptance_length"], r["mean_proposed"],
                                                                    costs.c, costs.beta),
                         engine_tau_to_pay=tau_to_pay(r["mean_proposed"], costs.c, costs.beta, pays_off_at))
    return own


def prompt_taus(served: Answers, keys: list[str], repeats: int) -> Timings | None:
    """Each prompt's verifications and kept drafts from its own counters (batch 1), (repeats, prompts) as
    `tau_counts` has them; None where a request's counters are missing."""
    rows = [[s for c in keys for s in served.prompt_counters.get((rep, c)) or [None]] for rep in range(repeats)]
    if any(s is None for row in rows for s in row):
        return None
    return tau_counts(np.array([[s.drafts for s in row] for row in rows]),
                      np.array([[s.accepted for s in row] for row in rows]))


def add_versus(rows: list[dict], measured: dict[str, dict[int, dict[str, Answers]]], baseline: str, *, k: int,
               repeats: int, seed: int = 0) -> None:
    """Rows of each drafter served in turn beside the same plain server (`measured`: by drafter, as `measure`
    returns them) gain, where `baseline` was served too, its speed and its τ over the baseline's in the engine, on
    the same prompts, with the paired 95 % intervals (eval/compare.py): the speed from each answer's decoding time,
    as its speed-up over the plain server in its own pass over the baseline's in the baseline's (a machine that
    drifted between the passes cancels), τ from each request's own counters (batch 1 only, where requests go one
    at a time)."""
    if baseline not in measured:
        return
    for name, served in measured.items():
        for batch, runs in served.items():
            base = measured[baseline].get(batch)
            if base is None:
                continue
            for r in rows:
                if (r["drafter"], r["k"], r.get("batch_size", 1), r["temperature"]) != (name, k, batch, 0.0):
                    continue
                keys = [c for c in dict.fromkeys(c for _, c in runs["spec"].answers) if r["category"] in (ALL, c)]
                ours, strata = decode_timings(runs["spec"], keys, repeats)
                plains = [runs.get("plain"), base.get("plain")]  # each drafter's pass measured plain beside it
                plains = None if None in plains else tuple(decode_timings(p, keys, repeats)[0] for p in plains)
                speed = compare(ours, decode_timings(base["spec"], keys, repeats)[0], strata, baselines=plains,
                                seed=seed)
                r.update(engine_speedup_vs_baseline=speed.ratio, engine_speedup_vs_baseline_ci=speed.interval)
                taus = prompt_taus(runs["spec"], keys, repeats), prompt_taus(base["spec"], keys, repeats)
                if all(t is not None for t in taus):
                    tau = compare(*taus, strata, seed=seed)
                    r.update(engine_tau_vs_baseline=tau.ratio, engine_tau_vs_baseline_ci=tau.interval)


def connect(engine, ks: list[int], drafters: list[str]) -> tuple[Endpoint, Endpoint | None]:
    """The two servers of `engine` (an EngineConfig with name openai), checked before anything is measured: each
    reachable and serving the configured model (or just one), `engine.drafter` one of `drafters` and `engine.k` one
    of `ks`. The API key is read from the environment variable `engine.api_key_env` at each request."""
    if not engine.spec_url:
        raise ValueError("engine=openai needs engine.spec_url, the base URL of the server that drafts")
    if engine.drafter is not None:
        if not isinstance(engine.drafter, str):
            raise ValueError(f"engine.drafter={list(engine.drafter)}: engine={engine.name} measures the one server "
                             "at engine.spec_url, so it names one drafter (engine=vllm serves a list in turn)")
        if engine.drafter not in drafters:
            raise ValueError(f"engine.drafter={engine.drafter!r} is not one of drafters {drafters}")
        if engine.k not in ks:
            raise ValueError(f"engine.k={engine.k!r}: the tokens the deployment drafts per round, one of ks={ks} "
                             f"(draftsmith's rows of {engine.drafter!r} at that k get its figures)")
    body = engine.get("extra_body")
    extra = dict(OmegaConf.to_container(body) if OmegaConf.is_config(body) else body or {})
    made = [Endpoint(url, model=engine.model, api_key_env=engine.api_key_env, timeout=engine.timeout,
                     retries=engine.retries, extra_body=extra) if url else None for url in (engine.spec_url, engine.plain_url)]
    for endpoint in made:
        if endpoint is not None:
            endpoint.check()
    return made[0], made[1]


def measure_into(rows: list[dict], endpoints: tuple[Endpoint, Endpoint | None], prompts: dict[str, list[list[int]]],
                 plan, *, drafter: str | None, k: int | None, costs=None,
                 progress: bool = True) -> tuple[dict[int, dict[str, Answers]], list[dict]]:
    """The deployment at `endpoints` measured on `prompts` (token ids per category) with `plan`'s budget, batch sizes
    and repeats, and its figures added to the rows of `drafter` at `k` (`add_figures`; the prediction where `costs`
    were given). Returns what `measure` measured and the deployment's own rows (where no drafter is named)."""
    spec, plain = endpoints
    measured = measure(spec, plain, prompts, max_new_tokens=plan.max_new_tokens, batch_sizes=list(plan.batch_sizes),
                       repeats=plan.repeats, progress=progress)
    own = add_figures(rows, measured, drafter=drafter, k=k, repeats=plan.repeats, pays_off_at=plan.pays_off_at,
                      costs=costs if costs is not None and costs.given else None, seed=plan.seed)
    return measured, own


def run(rows: list[dict], endpoints: tuple[Endpoint, Endpoint | None], prompts: dict[str, list[list[int]]], plan,
        engine, costs=None, progress: bool = True) -> dict:
    """Everything `engine=openai` adds: the deployment measured on `prompts` and its figures added to `rows`
    (`measure_into`). Returns the settings to report, with the deployment's own rows under `engine_only` where no
    drafter is named."""
    spec, plain = endpoints
    _, own = measure_into(rows, endpoints, prompts, plan, drafter=engine.drafter, k=engine.k, costs=costs,
                          progress=progress)
    return {"name": NAME, "spec_url": spec.base, "plain_url": plain.base if plain else None, "model": spec.model,
            "drafter": engine.drafter, "k": engine.k, "batch_sizes": list(plan.batch_sizes), "engine_only": own}
