"""The verdict in the engine a team deploys: the same drafters measured inside a serving engine, and the
engine's cost model, which turns draftsmith's acceptance into a predicted speed-up for engines that cannot
run here.

Acceptance carries over between engines; cost does not (BENCHMARKS.md section 8). llama.cpp decodes the
toy target several times faster than draftsmith's PyTorch loop, so one draft step costs it relatively more,
and a drafter that pays in one engine can lose in another. `python -m eval engine=llamacpp` therefore
measures, beside draftsmith's loop and on the same prompts, k and budget (greedy):

- every drafter that has an engine format (a draft LM, an EAGLE-3 head) served by llama-server on
  127.0.0.1 (eval/llama_cpp.py), the plain server and every speculative one up together, each prompt sent to
  each in turn (the machine's speed drifts over minutes; prompts seconds apart see the same machine);
- the engine's acceptance length from its own counters (1 + accepted drafts per round, its draft calls, from
  the drafting statistics llama-server logs for each request; per verification at B > 1), its
  generation speed (tokens over llama-server's `predicted_ms`: the prompt's processing, the same with and
  without a drafter, is left out) with and without the drafter, the speed-up pooled over prompts and
  repeats with a 95 % interval over prompts (eval/compare.py), its verdict, and whether its greedy output
  equals its plain output (losslessness, in the engine);
- the engine's costs, each from the engine's own clock, measured by a second llama-server per drafter and
  k that drafts and verifies as usual but keeps none of the drafts (llama.cpp's synthetic acceptance for
  benchmarking, `--spec-synth-len 1`; its output is still the plain output), on the first
  `cost_prompts` prompts of each category: c = its drafting time (its `dur(g)` statistic) per drafted
  token over the plain server's time per token; β = the rest of its round, everything the round spends
  outside drafting (the target's forward over k+1 positions, sampling and checking them, the batch and
  cache bookkeeping), over the plain time per token, minus 1. Those costs depend on no acceptance, so
  with draftsmith's τ per category they predict the engine's speed-up, τ / (1 + n·c + β) (n = guesses
  per round), printed beside the one measured with real acceptance. (A bare forward of k+1 tokens, as
  llama-bench times it, leaves out about one target step per round that llama-server spends around it:
  BENCHMARKS.md section 8.)

With `batch_sizes`, llama.cpp is measured at each batch size B too: llama-server with B slots, each
category's prompts streamed through them as under constant load (`stream`: a client per slot sends the
next prompt as soon as its answer is back, and extra requests keep every slot busy until every prompt is
answered), the plain server and each speculative one alike. A request's generation time is then its own
wall-clock time with the other slots decoding beside it, so pooled tokens over time is the server's
throughput over B, and the speed-up, its interval, the verdict and losslessness are measured per B. The
engine's τ at B is its counters' over each category's stream (the server's, extra requests included); c
and β, and so the prediction, stay batch-1 figures.

A team whose engine cannot run here (vLLM or SGLang on GPUs) measures c and β in it and enters them
(`engine_costs.c`, `engine_costs.beta`, a drafter's own `engine_c`); the report then turns draftsmith's τ
into a per-category predicted speed-up and verdict for that engine, labelled a prediction.
"""

from __future__ import annotations

import json
import re
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from eval import llama_cpp
from eval.compare import Timings, compare, verdict
from eval.engine_formats import GGUF_OUTTYPE, draft_lm_gguf, eagle3_gguf, target_directory
from eval.evaluate import ALL, base_drafter
from drafters.tree import StaticTree, TreeShape
from eval.metrics import predicted_speedup
from traffic import models

ENGINES = {"llamacpp": "llama.cpp"}
# What the vendored llama.cpp verifies: common/speculative.cpp drafts a token list per sequence and the server
# verifies it as one chain; there is no tree drafting or tree attention (llama-cpp-python 0.3.36's llama.cpp).
CHAINS_ONLY = "llama.cpp drafts and verifies chains only: a tree's τ and speed are draftsmith's"
SPEC_TYPES = {"draft_lm": "draft-simple", "eagle3": "draft-eagle3"}
# Fields every result row gets (None where a drafter or a temperature has no engine figure).
FIELDS = ("engine", "engine_acceptance_length", "engine_mean_proposed", "engine_ar_tokens_per_s",
          "engine_sd_tokens_per_s", "engine_speedup", "engine_speedup_ci", "engine_verdict", "engine_lossless",
          "engine_cost_ratio",
          "engine_verify_overhead", "engine_predicted_speedup", "engine_ceiling", "engine_tau_ceiling",
          "engine_tau_to_pay", "engine_note")


@dataclass
class EngineCosts:
    """c and β measured in an engine that cannot run here, for a predicted verdict there.

    name: what they describe ("vLLM 0.11, 1x H100, batch 1"); c: one draft step over one target step in
    that engine (every drafter without its own `engine_c`); beta: one verification of k+1 positions over
    one target step, minus 1. betas: β measured at given verification widths (positions verified in one
    forward: k+1 for a chain, nodes+1 for a tree), {width: β} ('+engine_costs.betas={17: 0.3}' on the command
    line); a width not listed takes `beta`, which is what a GPU's flat cost over small widths looks like and
    what a CPU's is not: give the widths where they differ.
    A tree of depth D is charged D draft steps (each expands its top-k nodes in one forward) and β at its width.
    """

    name: str = "your engine"
    c: Optional[float] = None
    beta: Optional[float] = None
    betas: Dict[int, float] = field(default_factory=dict)

    def beta_at(self, width: int) -> float | None:
        return self.betas.get(width, self.beta)

    @property
    def given(self) -> bool:
        return self.c is not None or self.beta is not None


# --- a cost model for an engine that cannot run here ---------------------------------------------------


def predict(rows: list[dict], costs: EngineCosts, drafter_c: dict[str, float | None], pays_off_at: float) -> None:
    """Rows gain the speed-up these costs predict from draftsmith's τ, and its verdict, marked predicted."""
    if costs.beta is None:
        raise ValueError("engine_costs.beta is not set: a prediction needs β, the verification overhead measured "
                         "in your engine (one forward of k+1 positions over one decoding step, minus 1)")
    for r in rows:
        if r.get("batch_size", 1) != 1:  # c and β are a team's batch-1 measurements
            continue
        tree = TreeShape.parse(r["tree"]) if r.get("tree") else None
        base = base_drafter(r)
        c = drafter_c.get(base)
        c = costs.c if c is None else c
        # A chain verifies k+1 positions and drafts its mean proposal; a tree verifies nodes+1 and drafts depth steps.
        width = tree.nodes + 1 if tree else r["k"] + 1
        beta = costs.beta_at(width)
        figures = dict.fromkeys(FIELDS)
        figures.update(engine=f"{costs.name} (predicted)", engine_cost_ratio=c, engine_verify_overhead=beta)
        if c is None:
            figures["engine_note"] = f"no c for drafter {base!r}: set engine_costs.c or its engine_c"
        else:
            predicted = predicted_speedup(r["acceptance_length"], tree.depth if tree else r["mean_proposed"], c, beta)
            figures.update(engine_predicted_speedup=predicted,
                           engine_verdict=("pays off" if predicted >= pays_off_at else "turn it off") + " (predicted)")
        figures.update(ceilings(r["k"], r["acceptance_length"], beta),
                       engine_tau_to_pay=tau_to_pay(tree.depth if tree else r["mean_proposed"], c, beta, pays_off_at))
        r.update(figures)
    _engine_best_shape(rows)


def _engine_best_shape(rows: list[dict]) -> None:
    """Each predicted row names its drafter's shape (chains at each k, trees) the engine's costs favour per category
    and temperature: `engine_best_shape`, with the settings SGLang takes for it (`sglang_settings`)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("engine_predicted_speedup") is None or r.get("batch_size", 1) != 1:
            continue
        groups.setdefault((base_drafter(r), r["temperature"], r["category"]), []).append(r)
    for group in groups.values():
        best = max(group, key=lambda r: r["engine_predicted_speedup"])
        shape = TreeShape.parse(best["tree"]) if best.get("tree") else TreeShape(best["k"], 1, best["k"])
        for r in group:
            r["engine_best_shape"] = f"tree {shape.label}" if best.get("tree") else f"chain k={best['k']}"
            r["sglang_settings"] = sglang_settings(shape)


def sglang_settings(shape: TreeShape | StaticTree) -> str | None:
    """SGLang's EAGLE flags for a shape: steps = depth, top-k, and the tokens verified, which SGLang counts with the
    root (the last committed token), nodes + 1 (a chain of k: k + 1). None for a static tree: SGLang's trees are
    dynamic. (vLLM 0.33.0's SpeculativeConfig has no tree setting: it drafts chains.)"""
    if isinstance(shape, StaticTree):
        return None
    return (f"--speculative-num-steps {shape.depth} --speculative-eagle-topk {shape.topk} "
            f"--speculative-num-draft-tokens {shape.nodes + 1}")


# --- llama.cpp: the drafters in its formats ------------------------------------------------------------


@dataclass
class Served:
    """A drafter as llama.cpp serves it: its GGUF (none for llama.cpp's n-gram modes) and spec type, or why it
    has none."""

    name: str
    gguf: Path | None = None
    spec_type: str | None = None
    note: str | None = None
    dtype: str | None = None  # its GGUF's weights (torch's name), where it has one
    p_min: float = 0.0  # its confidence stop, llama.cpp's --spec-draft-p-min (the spec's stop_below, rule drop)

    @property
    def engine_only(self) -> bool:
        """llama.cpp's own model-free speculation: measured in the engine only, draftsmith has no loop for it."""
        return self.spec_type in llama_cpp.NGRAM_TYPES

    def ks(self, ks: list[int]) -> list[int]:
        """The k it is measured at: each of `ks`, or the one llama.cpp fixes for it (ngram-cache's 8)."""
        fixed = llama_cpp.FIXED_K.get(self.spec_type)
        return [fixed] if fixed else list(ks)


# The type of the drafters' GGUFs that llama.cpp serves: f16, as deployments serve a draft (SGLang and vLLM in
# 16 bits). In float32 a one-layer head's draft step costs about twice as much against a Q4 target (c 0.2 of a
# step on SmolLM2's Q4_1 file, BENCHMARKS.md section 13.5), which would charge a draft cost no deployment pays.
# But ggml converts a matmul's activations to its weights' type, and some targets' hidden states outgrow f16
# (Gemma-3-270M's reach 10^5 from its middle layers on): an f16 head reading them drafts from inf (0 of 178
# guesses kept). Such drafters are served in bf16, whose range is float32's (`draft_dtype`).
DRAFT_DTYPE = "float16"
F16_MAX = 65504.0


@torch.inference_mode()
def draft_dtype(model, layers: list[int] | None = None) -> str:
    """DRAFT_DTYPE, or bfloat16 where `model`'s hidden states at `layers` (all of them if None: a draft LM's own)
    reach half of f16's largest value on a probe of its first-token and 31 other ids (transformers' hidden-state
    indices; the largest activations sit at the first token). SmolLM2-135M's peak there: about 25,000."""
    vocab = model.config.vocab_size
    first = model.config.bos_token_id if model.config.bos_token_id is not None else 1
    ids = torch.tensor([[first, *range(min(100, vocab - 32), min(100, vocab - 32) + 31)]],
                       device=next(model.parameters()).device)
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    peak = max(float(hidden[i].abs().max()) for i in (layers if layers is not None else range(len(hidden))))
    return DRAFT_DTYPE if peak < F16_MAX / 2 else "bfloat16"


def llama_cpp_drafter(spec: dict, target, target_name_or_path: str, work: Path) -> Served:
    """The drafter of an eval spec ({name, kind, path}) converted for llama.cpp by its own converter; kind
    `llamacpp` is one of llama.cpp's model-free n-gram modes (`spec_type`), which needs no conversion."""
    name, kind = spec["name"], spec["kind"]
    p_min = float(spec.get("stop_below") or 0.0)
    if p_min and (spec.get("stop_rule") or "propose") != "drop":
        raise ValueError(f"drafter {name!r}: llama.cpp's confidence stop (--spec-draft-p-min) does not propose the "
                         "unsure guess: give the drafter stop_rule: drop to measure the same stop in both loops")
    if kind == "llamacpp":
        if p_min:
            raise ValueError(f"drafter {name!r}: llama.cpp's n-gram modes have no confidence stop (stop_below)")
        if spec.get("spec_type") not in llama_cpp.NGRAM_TYPES:
            raise ValueError(f"drafter {name!r} (kind llamacpp): spec_type must be one of "
                             f"{sorted(llama_cpp.NGRAM_TYPES)}, got {spec.get('spec_type')!r}")
        return Served(name, spec_type=spec["spec_type"])
    out = work / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.gguf"
    if kind == "draft_lm":
        directory = target_directory(spec["path"])
        dtype = draft_dtype(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval())
        return Served(name, draft_lm_gguf(directory, out, dtype, target_name_or_path), SPEC_TYPES["draft_lm"],
                      dtype=dtype, p_min=p_min)
    if kind != "head":
        return Served(name, note="draftsmith's n-gram drafter has no llama.cpp counterpart (llama.cpp's ngram "
                                 "drafters are other algorithms)")
    head = Path(spec["path"])
    config = json.loads((head / "config.json").read_text())
    layers = config.get("feature_layers") or config.get("eagle_aux_hidden_state_layer_ids")
    dtype = draft_dtype(target, list(layers) if layers else None)
    if "LlamaForCausalLMEagle3" in (config.get("architectures") or []):  # an SGLang export
        gguf = llama_cpp.convert_to_gguf(head, out, outtype=GGUF_OUTTYPE[dtype],
                                         target_dir=target_directory(target_name_or_path))
    elif config.get("draftsmith_kind") == "eagle":
        gguf = eagle3_gguf(head, target, target_name_or_path, out, dtype)
    else:
        what = config.get("draftsmith_kind") or "/".join(config.get("architectures") or ["unknown"])
        return Served(name, note=f"a {what} head has no llama.cpp format (llama.cpp serves draft models and "
                                 "EAGLE-3 in the SGLang export)")
    return Served(name, gguf, SPEC_TYPES["eagle3"], dtype=dtype, p_min=p_min)


# --- llama.cpp: measuring ------------------------------------------------------------------------------

_STATS = re.compile(r"statistics\s+\S+: #calls\(b,g,a\) =\s*\d+\s+(\d+)\s+(\d+),.*#gen tokens =\s*(\d+), "
                    r"#acc tokens =\s*(\d+).*dur\(b,g,a\) = [\d.]+, ([\d.]+), [\d.]+ ms")


@dataclass
class DraftStats:
    """llama-server's own drafting counters: rounds (its draft calls), verifications (its accept calls: the
    rounds whose draft was not empty), tokens drafted, drafts accepted, and milliseconds spent drafting. A
    drafter that always drafts verifies every round; one with a confidence stop, or an n-gram mode without a
    match, drafts nothing in some rounds, which the target decodes as plain steps."""

    verifications: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_ms: float = 0.0
    rounds: int = 0

    def __add__(self, other: "DraftStats") -> "DraftStats":
        return DraftStats(self.verifications + other.verifications, self.drafted + other.drafted,
                          self.accepted + other.accepted, self.draft_ms + other.draft_ms, self.rounds + other.rounds)

    def __sub__(self, other: "DraftStats") -> "DraftStats":
        return DraftStats(self.verifications - other.verifications, self.drafted - other.drafted,
                          self.accepted - other.accepted, self.draft_ms - other.draft_ms, self.rounds - other.rounds)


def _counters(groups: tuple[str, ...]) -> DraftStats:
    rounds, verifications, drafted, accepted, draft_ms = groups
    return DraftStats(int(verifications), int(drafted), int(accepted), float(draft_ms), int(rounds))


@dataclass
class RoundCosts:
    """What a server that keeps none of the drafts spent, summed over requests: generation time
    (llama-server's `predicted_ms`), tokens generated and its drafting counters. Each verification then
    emits one token; each request's first token comes from the prompt's forward (not generation time), and
    the last ones of an answer, when too few remain to draft, from plain steps."""

    requests: int = 0
    generation_ms: float = 0.0
    tokens: int = 0
    stats: DraftStats = field(default_factory=DraftStats)

    def add(self, completion: llama_cpp.Completion, stats: DraftStats) -> "RoundCosts":
        return RoundCosts(self.requests + 1, self.generation_ms + completion.predicted_ms,
                          self.tokens + len(completion.tokens), self.stats + stats)

    def c(self, step_ms: float) -> float | None:
        """Drafting time per drafted token, in plain steps."""
        return self.stats.draft_ms / self.stats.drafted / step_ms if self.stats.drafted else None

    def beta(self, step_ms: float) -> float | None:
        """A round's time outside drafting, in plain steps, minus 1: the verification's overhead."""
        if not self.stats.verifications:
            return None
        plain_steps = self.tokens - self.requests - self.stats.verifications
        verify_ms = self.generation_ms - self.stats.draft_ms - max(plain_steps, 0) * step_ms
        return verify_ms / self.stats.verifications / step_ms - 1


class DraftCounters:
    """llama-server's drafting counters as it logs them, reading only what it logged since the last call
    (the whole log each time would be quadratic in the requests of a long evaluation)."""

    def __init__(self, server: llama_cpp.LlamaServer) -> None:
        self.server, self.logged, self.partial, self.last = server, 0, "", None

    def after(self, requests: int, timeout: float = 30.0) -> DraftStats:
        """The counters once the server has logged the statistics of `requests` requests since its start:
        it logs them when it releases the slot, which can be just after its reply."""
        deadline = time.monotonic() + timeout
        while True:
            complete, _, self.partial = (self.partial + self.server.new_log()).rpartition("\n")  # whole lines only
            found = _STATS.findall(complete)
            if found:
                self.logged, self.last = self.logged + len(found), _counters(found[-1])
            if self.logged >= requests:
                return self.last
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server logged drafting statistics for {self.logged} of {requests} requests "
                                   f"in {timeout:.0f} s (it needs -lv 4)")
            time.sleep(0.01)


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


def measure_llama_cpp(target_gguf: Path, served: list[Served], prompts: dict[str, list[list[int]]], ks: list[int],
                      *, max_new_tokens: int, repeats: int, threads: int, log_dir: Path, cost_prompts: int = 4,
                      progress: bool = True, batch: int = 1) -> dict:
    """Plain and speculative llama-server over every prompt, `repeats` times (each server's first prompt is run
    once untimed); after them, each drafter and k keeping none of its drafts over the first `cost_prompts`
    prompts of each category.

    At batch 1 the configurations are measured side by side: the plain server and every speculative one up at
    once, each prompt sent to each in turn (the order rotating from prompt to prompt), so the speeds compared were
    measured seconds apart, not minutes. (The machine's speed drifts over minutes: measured once at the start,
    plain decoding read 0.97–1.06× of itself later in one run, BENCHMARKS.md section 13.7.)

    Returns the completions and, for speculative servers, the drafting counters of each request, by
    configuration and (repeat, category, prompt index), the RoundCosts of each configuration, and the
    completions of the servers that kept no drafts (`verified`: the target's own tokens, verified in rounds).

    batch > 1: servers with `batch` slots, each category's prompts streamed through them (`stream`), one
    configuration after another; the drafting counters are then the stream's (the server's, its extra requests
    included), given with the category's first prompt, and the costs are measured at batch 1 only."""
    items = [(c, i, p) for c, ps in prompts.items() for i, p in enumerate(ps)]
    cost_items = [(c, i, p) for c, i, p in items if i < cost_prompts] if batch == 1 else []
    configs = [(s, k) for s in served if s.spec_type is not None for k in s.ks(ks)]
    together = batch == 1
    calibrated = sum(1 for config in configs if not config[0].engine_only)
    bar = tqdm(total=repeats * (len(items) * (len(configs) + 1) + calibrated * len(cost_items)),
               desc="llama.cpp" if batch == 1 else f"llama.cpp (batch {batch})", unit="gen", disable=not progress)
    completions: dict = {}
    counters: dict = {}
    costs: dict = {}
    verified: dict = {}  # the servers that keep no drafts: their completions, by configuration and prompt
    device: list[str] = []  # where the plain server runs the model, from its log
    ctx = max(len(p) for _, _, p in items) + max_new_tokens + 16

    def server(config, rep: int, accept_none: bool = False) -> llama_cpp.LlamaServer:
        spec = {} if config is None else {"draft": config[0].gguf, "spec_type": config[0].spec_type, "k": config[1],
                                          "accept_none": accept_none, "p_min": config[0].p_min}
        name = "plain" if config is None else f"{config[0].name}-k{config[1]}" + ("-accept-none" if accept_none else "")
        name += f"-b{batch}" if batch > 1 else ""
        return llama_cpp.LlamaServer(target_gguf, threads=threads, ctx_size=ctx, log_verbosity=4, parallel=batch,
                                     log_file=log_dir / f"llama-server-{name}-{rep}.log", **spec)

    def serve(config, rep: int, todo: list, accept_none: bool = False):
        """(completion, its drafting counters or None) for each prompt of `todo`, from one server."""
        out = []
        with server(config, rep, accept_none) as running:
            if config is None:
                device.append(running.device())
            running.complete(todo[0][2], max_new_tokens)  # warm-up, untimed
            drafting = DraftCounters(running) if config is not None else None
            before = drafting.after(1) if config is not None else None
            if batch > 1:  # each category's prompts streamed through the slots
                sent = 1
                for category in prompts:
                    chosen = [p for c, _, p in todo if c == category]
                    answers, requests = stream(lambda p: running.complete(p, max_new_tokens), chosen,
                                               running.parallel, bar.update)
                    sent, stats = sent + requests, None
                    if config is not None:
                        now = drafting.after(sent)
                        stats, before = now - before, now
                    # The stream's counters (the server's, its extra requests included) go with the category's
                    # first prompt, zeros with the others: summed over a category, they are the stream's.
                    out += [(a, stats if n == 0 or stats is None else DraftStats()) for n, a in enumerate(answers)]
                return out
            for n, (_, _, prompt) in enumerate(todo, start=2):
                completion, stats = running.complete(prompt, max_new_tokens), None
                if config is not None:
                    now = drafting.after(n)
                    stats, before = now - before, now
                out.append((completion, stats))
                bar.update()
        return out

    def serve_together(rep: int) -> list:
        """For every prompt, the plain completion and each configuration's completion and drafting counters: every
        server up at once, each prompt sent to each in turn (the order rotating from prompt to prompt)."""
        out = []
        with ExitStack() as stack:
            servers = [stack.enter_context(server(config, rep)) for config in [None, *configs]]
            device.append(servers[0].device())
            for running in servers:
                running.complete(items[0][2], max_new_tokens)  # warm-ups, untimed
            drafting = [DraftCounters(running) for running in servers[1:]]
            before = [d.after(1) for d in drafting]
            for n, (_, _, prompt) in enumerate(items):
                answers = [None] * len(servers)
                for j in range(len(servers)):
                    which = (n + j) % len(servers)
                    answers[which] = servers[which].complete(prompt, max_new_tokens)
                    bar.update()
                now = [d.after(n + 2) for d in drafting]
                out.append((answers[0], [(a, b - b0) for a, b, b0 in zip(answers[1:], now, before)]))
                before = now
        return out

    keys = [(config[0].name, config[1]) for config in configs]
    for rep in range(repeats):
        if together:
            for (category, i, _), (reference, answers) in zip(items, serve_together(rep)):
                completions.setdefault("plain", {})[rep, category, i] = reference
                for key, (completion, stats) in zip(keys, answers):
                    completions.setdefault(key, {})[rep, category, i] = completion
                    counters.setdefault(key, {})[rep, category, i] = stats
        else:
            for (category, i, _), (completion, _) in zip(items, serve(None, rep, items)):
                completions.setdefault("plain", {})[rep, category, i] = completion
        for config, key in zip(configs, keys):
            if not together:
                for (category, i, _), (completion, stats) in zip(items, serve(config, rep, items)):
                    completions.setdefault(key, {})[rep, category, i] = completion
                    counters.setdefault(key, {})[rep, category, i] = stats
            # llama.cpp's n-gram modes draft only where the text repeats, so a server that keeps none of their
            # drafts says little of a round's cost: c and β are measured for drafters that always draft.
            if cost_items and not config[0].engine_only:
                for (category, i, _), (completion, stats) in zip(cost_items,
                                                                 serve(config, rep, cost_items, accept_none=True)):
                    costs[key] = costs.get(key, RoundCosts()).add(completion, stats)
                    verified.setdefault(key, {})[rep, category, i] = completion
    bar.close()
    return {"completions": completions, "counters": counters, "costs": costs, "verified": verified,
            "items": [(c, i) for c, i, _ in items], "device": device[0]}


def _timings(runs: dict, keys: list[tuple[str, int]], repeats: int) -> Timings:
    gens = [[runs[r, c, i] for c, i in keys] for r in range(repeats)]
    return Timings(np.array([[len(g.tokens) for g in row] for row in gens], dtype=float),
                   np.array([[g.predicted_ms / 1000 for g in row] for row in gens]))


# The verdict where a drafter proposed nothing (llama.cpp's n-gram modes on text that does not repeat): its
# generations were plain decoding, and any difference from the plain runs' speed is the machine's noise.
NOTHING_DRAFTED = "it drafted nothing here: plain decoding"


def engine_figures(rows: list[dict], measured: dict, served: list[Served], *, repeats: int, pays_off_at: float,
                   seed: int = 0, batch: int = 1, alone: bool = False, ks: list[int] | None = None,
                   gaps: PartingGaps | None = None) -> list[dict]:
    """Rows of draftsmith's report at batch size `batch` gain llama.cpp's figures for the same (drafter, k,
    category) at that batch size; rows at temperature > 0 and drafters llama.cpp cannot serve get a note
    instead. At batch > 1 the engine's τ is the server's over each category's stream, and c and β (measured
    at batch 1) and the prediction are left out. Returns the rows of the drafters only the engine runs
    (llama.cpp's n-gram modes), one per category and k as draftsmith's rows have them (ngram-cache at its
    fixed k, `Served.ks`), with the engine's figures alone.

    alone (`engine.only`: no loop of draftsmith's ran, `rows` is empty): every drafter the engine serves gets
    such rows, one per category (and all traffic) and k of `ks`, and a drafter's prediction is its engine τ
    through the engine's c and β, τ / (1 + n̄·c + f·β) with n̄ its drafted tokens per round and f the share of
    its rounds that verify a draft: the cost model checked against the speed-up measured beside it.

    gaps: a row whose outputs differ from plain decoding says how near a tie each parts at (`PartingGaps`)."""
    completions, counters, items = measured["completions"], measured["counters"], measured["items"]
    plain = completions["plain"]

    step_ms = statistics.median(sum(g.predicted_ms for (r, _, _), g in plain.items() if r == rep)
                                / sum(len(g.tokens) for (r, _, _), g in plain.items() if r == rep)
                                for rep in range(repeats))
    notes = {s.name: s.note for s in served if s.note}
    costs = {key: (rc.c(step_ms), rc.beta(step_ms)) for key, rc in measured["costs"].items()}

    def figures_of(drafter: str, k: int, category: str, tau: float | None, proposed: float | None) -> dict:
        """The engine's figures for one drafter, k and category (`tau`, `proposed`: draftsmith's, if any)."""
        key = (drafter, k)
        runs = completions[key]
        keys = [(c, i) for c, i in items if category in (ALL, c)]
        spec_t, plain_t = _timings(runs, keys, repeats), _timings(plain, keys, repeats)
        vs_plain = compare(spec_t, plain_t, [c for c, _ in keys], seed=seed)
        chosen = sum((counters[key][rep, c, i] for rep in range(repeats) for c, i in keys), DraftStats()) \
            if key in counters else DraftStats()
        c, beta = costs.get(key, (None, None))
        # Per round, as draftsmith counts τ: a round whose draft was empty (a confidence stop, an n-gram mode
        # without a match) emits the target's one token and verifies nothing. With several slots llama.cpp
        # counts a draft call per batch, not per request: there τ is per verification, as the field gives it.
        rounds = chosen.rounds if batch == 1 else chosen.verifications
        tau_engine = 1 + chosen.accepted / rounds if chosen.verifications and rounds else None
        proposed_engine = chosen.drafted / rounds if chosen.verifications and rounds else None
        verified = chosen.verifications / rounds if chosen.verifications and rounds else None
        if alone:  # no τ of draftsmith's: the engine's own through its costs
            tau, proposed = tau_engine, proposed_engine
        predicted = (predicted_speedup(tau, proposed, c, beta, verified=verified)
                     if None not in (tau, proposed, c, beta, verified) else None)
        drafted = sum(runs[rep, c, i].draft_n for rep in range(repeats) for c, i in keys)
        generations = [(rep, c, i) for rep in range(repeats) for c, i in keys]
        lossless = all(runs[g].tokens == plain[g].tokens for g in generations)
        note = None if lossless else numerics_note(runs, plain, measured.get("verified", {}).get(key, {}), generations,
                                                   gaps)
        return dict(
            engine=ENGINES["llamacpp"], engine_acceptance_length=tau_engine, engine_mean_proposed=proposed_engine,
            engine_ar_tokens_per_s=plain_t.median_tokens_per_s(), engine_sd_tokens_per_s=spec_t.median_tokens_per_s(),
            engine_speedup=vs_plain.ratio, engine_speedup_ci=vs_plain.interval,
            engine_verdict=verdict(vs_plain.ratio, vs_plain.interval, pays_off_at) if drafted else NOTHING_DRAFTED,
            engine_lossless=lossless, engine_note=note,
            engine_cost_ratio=c, engine_verify_overhead=beta, engine_predicted_speedup=predicted,
            engine_tau_to_pay=tau_to_pay(proposed, c, beta, pays_off_at, verified),
            **ceilings(k, tau_engine, beta, verified))

    greedy = [r for r in rows if r.get("batch_size", 1) == batch and r["temperature"] == 0 and not r.get("tree")]
    for r in rows:
        if r.get("batch_size", 1) != batch:
            continue
        figures = {**dict.fromkeys(FIELDS), "engine": ENGINES["llamacpp"]}
        if r["temperature"] != 0:
            figures["engine_note"] = "the engine is measured greedy (temperature 0) only"
        elif r.get("tree"):
            figures["engine_note"] = CHAINS_ONLY
        elif r["drafter"] in notes:
            figures["engine_note"] = notes[r["drafter"]]
        else:
            figures.update(figures_of(r["drafter"], r["k"], r["category"], r["acceptance_length"], r["mean_proposed"]))
        r.update(figures)
    if alone:
        cells = [(category, k) for category in [*dict.fromkeys(c for c, _ in items), ALL] for k in ks]
    else:
        cells = list(dict.fromkeys((r["category"], r["k"]) for r in greedy))
    return [{"category": category, "drafter": s.name, "k": k, "batch_size": batch, "temperature": 0.0,
             "engine_only": s.spec_type, **dict.fromkeys(FIELDS), **figures_of(s.name, k, category, None, None)}
            for s in served if s.spec_type is not None and (alone or s.engine_only)
            for category, k in dict.fromkeys((c, k) for c, k0 in cells for k in s.ks([k0]))]


class PartingGaps:
    """Where a drafter's greedy output in the engine parts from the engine's plain output: draftsmith's target's
    logit of plain's token minus the drafter's at that position, given the tokens both wrote before it (one
    forward each, cached). Near 0 is a near tie, which the engine's numerics may break either way (scoring
    several positions at once rounds differently from one); a large gap is a token the target does not come close
    to preferring, which no rounding explains."""

    def __init__(self, target, prompts: dict[str, list[list[int]]]) -> None:
        self.target, self.prompts, self._seen = target, prompts, {}
        parameter = next(target.parameters())
        self.device, self.dtype = parameter.device, str(parameter.dtype).removeprefix("torch.")

    @torch.inference_mode()
    def __call__(self, category: str, index: int, plain: list[int], other: list[int]) -> float | None:
        """The gap for prompt `index` of `category` whose plain output is `plain` and the drafter's `other`;
        None where they do not part at a token (one is the other cut short)."""
        part = next((j for j, (a, b) in enumerate(zip(plain, other)) if a != b), None)
        if part is None:
            return None
        key = (category, index, tuple(plain[:part + 1]), other[part])
        if key not in self._seen:
            ids = torch.tensor([self.prompts[category][index] + plain[:part]], device=self.device)
            logits = self.target(input_ids=ids).logits[0, -1].float()
            self._seen[key] = float(logits[plain[part]] - logits[other[part]])
        return self._seen[key]


def numerics_note(runs: dict, plain: dict, verified: dict, keys: list[tuple], gaps: PartingGaps | None = None) -> str:
    """Why a drafter's greedy output in llama.cpp differs from its plain output, where the server that kept none
    of its drafts says: if that server's output (the target's own tokens, verified k+1 positions at a time) differs
    from plain on the same prompts as the drafter's and equals the drafter's, the difference is llama.cpp's own
    numerics (a batch of positions and a single one round differently at a near tie of the target's logits), not
    the drafter's guesses. With `gaps`, draftsmith's target's logit gap where each differing output parts from
    plain's (keys are (repeat, category, prompt index)), which says how near that tie is."""
    differs = [key for key in keys if runs[key].tokens != plain[key].tokens]
    checked = [key for key in differs if key in verified]
    same = [key for key in checked if verified[key].tokens == runs[key].tokens]
    line = f"its output differs from plain decoding on {len(differs)} of {len(keys)} generations"
    if gaps is not None:
        found = [g for g in (gaps(c, i, plain[r, c, i].tokens, runs[r, c, i].tokens) for r, c, i in differs)
                 if g is not None]
        if found:
            line += (f"; where each parts from plain, draftsmith's target ({gaps.dtype}) scores plain's token above "
                     f"the drafter's by {', '.join(f'{g:.2f}' for g in sorted(found))} (logits; near 0: a near tie)")
    if checked and len(same) == len(checked):
        return (f"{line}; on the {len(checked)} of them its server that kept none of its drafts measured, that "
                "server's output (the target's own tokens, verified in rounds) is the drafter's: llama.cpp's "
                "numerics when it verifies several positions at once, not the drafter")
    return line + ("" if checked else "; none of them is a prompt the cost servers measured")


def ceilings(k: int, tau: float | None, beta: float | None, verified: float | None = 1.0) -> dict:
    """What the engine allows at zero draft cost, from its own β (verifying k+1 positions over one step, minus
    1): `engine_ceiling` = (k+1)/(1+β), a perfect drafter's speed-up; `engine_tau_ceiling` = τ/(1+f·β), the
    speed-up the engine's measured τ allows, f the share of rounds that verify (1 but for a drafter that drafts
    nothing in some rounds). Below the first, the hardware limits (a quantization whose verification is
    compute-bound, a CPU); between the measured speed-up and the second, the draft's cost."""
    if beta is None:
        return {"engine_ceiling": None, "engine_tau_ceiling": None}
    f = 1.0 if verified is None else verified
    # A drafter that leaves rounds without a draft verifies fewer than k+1 positions, so its β is not the cost of
    # a perfect drafter's round: no ceiling from it (the same drafter without its stop gives one).
    return {"engine_ceiling": (k + 1) / (1 + beta) if f == 1.0 else None,
            "engine_tau_ceiling": tau / (1 + f * beta) if tau else None}


def tau_to_pay(proposed: float | None, c: float | None, beta: float | None, pays_off_at: float,
               verified: float | None = 1.0) -> float | None:
    """The τ at which the cost model's speed-up reaches the pay-off line at these costs, pays_off_at·(1 + n̄·c +
    f·β) with n̄ the tokens drafted a round and f the share of rounds that verify: what a drafter drafting as
    much must keep in this engine to pay, beside the τ it keeps (`predicted_speedup` solved for τ)."""
    if None in (proposed, c, beta):
        return None
    return pays_off_at * (1 + proposed * c + (1.0 if verified is None else verified) * beta)


@dataclass
class Converted:
    """What llama.cpp serves: the target's GGUF and each drafter's (or why it has none)."""

    target_gguf: Path
    served: list[Served]


def convert_for_llama_cpp(drafter_specs: list[dict], target, target_name_or_path: str, work: Path) -> Converted:
    """The target and the drafters through llama.cpp's converter, into `work`: done before anything is
    measured, so a model the converter cannot read fails at once. A target given as a GGUF file is served
    as it is: the quantization the team deploys is the one measured."""
    work.mkdir(parents=True, exist_ok=True)
    llama_cpp.require()
    target_gguf = models.gguf_file(target_name_or_path) or llama_cpp.convert_to_gguf(
        target_directory(target_name_or_path), work / "target.gguf")
    served = [llama_cpp_drafter(spec, target, target_name_or_path, work) for spec in drafter_specs]
    for s in served:
        if s.note:
            print(f"llama.cpp: {s.name}: {s.note}")
    return Converted(target_gguf, served)


def run_llama_cpp(rows: list[dict], converted: Converted, prompts: dict[str, list[list[int]]], *, ks: list[int],
                  max_new_tokens: int, repeats: int, pays_off_at: float, threads: int, work: Path,
                  cost_prompts: int = 4, seed: int = 0, progress: bool = True, batch_sizes=(1,),
                  alone: bool = False, target=None) -> dict:
    """Everything `engine=llamacpp` adds once the models are converted: measure them in llama.cpp at each
    batch size (calibrating c and β at batch 1), and add the engine's figures to `rows`. Returns the
    settings to report, with the rows of the drafters only the engine runs under `engine_only` (the caller
    reports them apart: report.json's `engine_results`); with `alone` (no loop of draftsmith's ran), the rows
    of every drafter the engine serves. `target`, draftsmith's: where an output differs from plain decoding, its
    logits say how near a tie it parts at (`PartingGaps`)."""
    target_gguf, served = converted.target_gguf, converted.served
    gaps = PartingGaps(target, prompts) if target is not None else None
    engine_only, devices = [], []
    for batch in batch_sizes:
        measured = measure_llama_cpp(target_gguf, served, prompts, ks, max_new_tokens=max_new_tokens, repeats=repeats,
                                     threads=threads, log_dir=work, cost_prompts=cost_prompts, progress=progress,
                                     batch=batch)
        devices.append(measured["device"])
        engine_only += engine_figures(rows, measured, served, repeats=repeats, pays_off_at=pays_off_at, seed=seed,
                                      batch=batch, alone=alone, ks=ks, gaps=gaps)
    return {"name": ENGINES["llamacpp"], "version": llama_cpp.VERSION, "target_gguf": str(target_gguf),
            "threads": threads, "device": ", ".join(dict.fromkeys(devices)), "work_dir": str(work), "alone": alone,
            "cost_prompts_per_category": cost_prompts, "served": {s.name: s.spec_type or s.note for s in served},
            "p_min": {s.name: s.p_min for s in served if s.p_min},
            "draft_types": {s.name: s.dtype for s in served if s.dtype},
            "batch_sizes": list(batch_sizes), "engine_only": engine_only}


# --- what python -m eval and the training recipes call ---------------------------------------------------


def check(engine: str | None, costs: EngineCosts, runs: tuple[str, ...] = ("llamacpp", "openai")) -> None:
    """Before anything is loaded: a known engine (one of `runs`), built; llama.cpp measures its own costs, so
    not both it and costs to predict with (a deployment measured through its API may have both)."""
    if engine is None:
        return
    if engine not in runs:
        raise ValueError(f"engine={engine!r} is not one draftsmith runs here; known: {sorted(runs)} (for "
                         "another engine, measure c and beta there and set engine_costs.c / engine_costs.beta)")
    if engine == "llamacpp":
        if costs.given:
            raise ValueError(f"engine={engine} measures llama.cpp's own costs; engine_costs.c / engine_costs.beta are "
                             "for predicting an engine that cannot run here: set one or the other")
        llama_cpp.require()


def check_alone(engine: str | None, plan) -> None:
    """`engine.only`: what llama.cpp alone can measure. It verifies chains, greedy (eval/llama_cpp.py)."""
    if engine != "llamacpp":
        raise ValueError(f"engine.only=true measures in llama.cpp alone (engine=llamacpp); engine={engine} measures "
                         "beside draftsmith's loop")
    if list(plan.temperatures) != [0.0]:
        raise ValueError(f"engine.only=true: llama.cpp is measured greedy, set temperatures=[0.0] (got "
                         f"{list(plan.temperatures)}); sampled acceptance is draftsmith's loop's (engine.only=false)")
    if plan.trees:
        raise ValueError(f"engine.only=true: {CHAINS_ONLY}, so trees={list(plan.trees)} need draftsmith's loop "
                         "(engine.only=false)")


def convert(engine: str | None, specs: list[dict], target, target_name_or_path: str, work: Path,
            alone: bool = False) -> Converted | None:
    """Before measuring: the models converted for the engine that will serve them (engine=llamacpp), so a
    model it cannot read fails before draftsmith's own measurement, not after it. alone (`engine.only`): at
    least one drafter must be one llama.cpp serves."""
    if engine != "llamacpp":
        return None
    converted = convert_for_llama_cpp(specs, target, target_name_or_path, work)
    if alone and not any(s.spec_type for s in converted.served):
        raise ValueError("engine.only=true, but llama.cpp serves none of the drafters: "
                         + "; ".join(f"{s.name}: {s.note}" for s in converted.served))
    return converted


def add_figures(rows: list[dict], specs: list[dict], target, target_name_or_path: str,
                prompts: dict[str, list], plan, *, engine: str | None, costs: EngineCosts, threads: int, work: Path,
                converted: Converted | None = None, progress: bool = True, alone: bool = False) -> dict | None:
    """The engine's figures added to `rows` (from eval.evaluate, with `plan`, its EvalPlan, on `prompts`,
    token-id tensors per category, for the drafters `specs`): measured in llama.cpp (engine=llamacpp, the
    models `convert`ed unless given) or predicted from costs a team measured in its own engine. Returns what
    the report's settings say of it. alone: llama.cpp measures without draftsmith's loop (`rows` empty; every
    drafter's figures are rows of the engine's own, under `engine_only`)."""
    if engine == "llamacpp":
        converted = converted or convert_for_llama_cpp(specs, target, target_name_or_path, work)
        return run_llama_cpp(rows, converted, {c: [p.tolist() for p in ps] for c, ps in prompts.items()}, ks=list(plan.ks),
                             max_new_tokens=plan.max_new_tokens, repeats=plan.repeats, pays_off_at=plan.pays_off_at,
                             threads=threads, work=work, seed=plan.seed, progress=progress,
                             batch_sizes=list(plan.batch_sizes), alone=alone, target=target)
    if costs.given:
        predict(rows, costs, {s["name"]: s.get("engine_c") for s in specs}, plan.pays_off_at)
        return {"name": costs.name, "predicted": True, "c": costs.c, "beta": costs.beta,
                "drafter_c": {s["name"]: s["engine_c"] for s in specs if s.get("engine_c") is not None}}
    return None
