"""The verdict in the engine a team deploys. Acceptance carries over between engines; cost does not
(docs/benchmarks/llama-cpp-toy.md): llama.cpp decodes the toy target several times faster than draftsmith's PyTorch loop,
so one draft step costs it relatively more, and a drafter that pays in one engine can lose in another. One
interface, `Engine`, for the three ways draftsmith knows an engine's costs:

- `LlamaCpp` (`engine=llamacpp`): llama.cpp runs here. The drafters are converted to its formats
  (eval/engines/llama_cpp_drafters.py), served by llama-server beside draftsmith's loop on the same prompts, k and budget
  (eval/engines/llama_cpp_measure.py), and the engine's τ, speed-up, costs, ceilings and verdict added to the report's
  rows (eval/engines/llama_cpp_figures.py).
- `Deployment` (`engine=openai`): a team's own OpenAI-compatible servers, with and without the drafter, measured
  from outside (eval/engines/deployment.py).
- `Vllm` (`engine=vllm`): vLLM's CPU build runs here (eval/engines/vllm.py). draftsmith serves the target twice, with
  the drafter `engine.drafter` in vLLM's format and without it, and measures the two servers as `engine=openai`
  measures a deployment.
- `EnteredCosts` (`engine_costs.c`, `engine_costs.beta`): c and β a team measured in an engine that cannot run
  here turn draftsmith's τ into a predicted speed-up and verdict there (eval/engines/costs.py).

`engine_for` is the one place an engine is chosen by its name. `python -m eval` and a training run's final
evaluation call `check` before anything is loaded, `connect` and `convert` before anything is measured, and
`add_figures` after draftsmith's loop.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path

from omegaconf import OmegaConf

from eval.engines import deployment, llama_cpp, vllm
from eval.engines.costs import EngineCosts, ceilings, predict, tau_to_pay
from eval.engines.llama_cpp_drafters import Converted, convert_for_llama_cpp
from eval.engines.llama_cpp_figures import CHAINS_ONLY, run_llama_cpp

ENGINES = ("llamacpp", "openai", "vllm")  # the engines draftsmith runs or reaches: conf/engine/<name>.yaml


class Engine:
    """How an evaluation learns what its drafters cost in the engine a team deploys (nothing, here: no engine)."""

    name: str | None = None  # its `engine.name`
    serves_own_drafters = False  # whether llama.cpp's own model-free drafters (drafters of kind llamacpp) run in it

    def check(self, plan, alone: bool = False) -> None:
        """Before anything is loaded: what it can measure of `plan` (an EvalPlan; None from a training run), and
        with `alone` (`engine.only`) without draftsmith's loop."""
        if alone:
            raise ValueError(f"engine.only=true measures in llama.cpp alone (engine=llamacpp); engine={self.name} "
                             "measures beside draftsmith's loop")

    def connect(self, ks: list[int], drafters: list[str]) -> None:
        """Before anything is measured: the servers it measures reachable and serving what was asked."""

    def convert(self, specs: list[dict], target, target_name_or_path: str, work: Path, alone: bool = False,
                request: tuple[int, int] | None = None, threads: int | None = None) -> None:
        """Before draftsmith's own measurement: the drafters in the engine's formats, so one it cannot read fails
        first. `request`: the run's longest prompt and its new tokens, for an engine that sizes its servers to them;
        `threads`: the cores the run measures on, for an engine whose servers start here."""

    def add_figures(self, rows: list[dict], specs: list[dict], target, target_name_or_path: str,
                    prompts: dict[str, list], plan, *, threads: int, work: Path, progress: bool = True,
                    alone: bool = False) -> dict | None:
        """The engine's figures added to `rows` (from eval.evaluate, with `plan` on `prompts`, token-id tensors per
        category, for the drafters `specs`). Returns what the report's settings say of the engine, with the rows
        of its own (drafters only it runs, or every drafter with `alone`) under `engine_only`; None: nothing."""
        return None


class EnteredCosts(Engine):
    """c and β a team measured in its engine (`engine_costs`), which predict draftsmith's rows' speed-up there."""

    def __init__(self, costs: EngineCosts) -> None:
        self.costs = costs

    def add_figures(self, rows, specs, target, target_name_or_path, prompts, plan, *, threads, work, progress=True,
                    alone=False) -> dict | None:
        if not self.costs.given:
            return None
        predict(rows, self.costs, {s["name"]: s.get("engine_c") for s in specs}, plan.pays_off_at,
                {s["name"]: dict(s.get("engine_cs") or {}) for s in specs})
        return {"name": self.costs.name, "predicted": True, "c": self.costs.c, "beta": self.costs.beta,
                "drafter_c": {s["name"]: s["engine_c"] for s in specs if s.get("engine_c") is not None}}


class LlamaCpp(Engine):
    """llama.cpp, built here (`make llama-cpp`): the drafters served by llama-server and measured in it."""

    name = "llamacpp"
    serves_own_drafters = True

    def __init__(self, costs: EngineCosts) -> None:
        self.costs = costs
        self.converted: Converted | None = None

    def check(self, plan, alone: bool = False) -> None:
        """llama.cpp measures its own costs, so not also costs to predict with; it verifies chains, greedy."""
        if self.costs.given:
            raise ValueError("engine=llamacpp measures llama.cpp's own costs; engine_costs.c / engine_costs.beta are "
                             "for predicting an engine that cannot run here: set one or the other")
        llama_cpp.require()
        if not alone:
            return
        if list(plan.temperatures) != [0.0]:
            raise ValueError(f"engine.only=true: llama.cpp is measured greedy, set temperatures=[0.0] (got "
                             f"{list(plan.temperatures)}); sampled acceptance is draftsmith's loop's (engine.only=false)")
        if plan.trees:
            raise ValueError(f"engine.only=true: {CHAINS_ONLY}, so trees={list(plan.trees)} need draftsmith's loop "
                             "(engine.only=false)")

    def convert(self, specs, target, target_name_or_path, work, alone=False, request=None, threads=None) -> None:
        """The target and the drafters through llama.cpp's converter. alone (`engine.only`): at least one drafter
        must be one llama.cpp serves."""
        self.converted = convert_for_llama_cpp(specs, target, target_name_or_path, work)
        if alone and not any(s.spec_type for s in self.converted.served):
            raise ValueError("engine.only=true, but llama.cpp serves none of the drafters: "
                             + "; ".join(f"{s.name}: {s.note}" for s in self.converted.served))

    def add_figures(self, rows, specs, target, target_name_or_path, prompts, plan, *, threads, work, progress=True,
                    alone=False) -> dict:
        if self.converted is None:
            self.convert(specs, target, target_name_or_path, work, alone)
        return run_llama_cpp(rows, self.converted, {c: [p.tolist() for p in ps] for c, ps in prompts.items()},
                             ks=list(plan.ks), max_new_tokens=plan.max_new_tokens, repeats=plan.repeats,
                             pays_off_at=plan.pays_off_at, threads=threads, work=work, seed=plan.seed,
                             progress=progress, batch_sizes=list(plan.batch_sizes), alone=alone, target=target)


class Deployment(Engine):
    """A team's OpenAI-compatible deployment (`engine=openai`, conf/engine/openai.yaml), measured through its API;
    with `engine_costs` too, draftsmith's τ also predicts its speed-up from them."""

    name = "openai"

    def __init__(self, config, costs: EngineCosts) -> None:
        self.config, self.costs = config, costs
        self.endpoints = None

    def connect(self, ks, drafters) -> None:
        self.endpoints = deployment.connect(self.config, ks, drafters)

    def add_figures(self, rows, specs, target, target_name_or_path, prompts, plan, *, threads, work, progress=True,
                    alone=False) -> dict:
        if self.endpoints is None:
            self.connect(list(plan.ks), [s["name"] for s in specs])
        return deployment.run(rows, self.endpoints, {c: [p.tolist() for p in ps] for c, ps in prompts.items()}, plan,
                              self.config, self.costs, progress=progress)


class Vllm(Deployment):
    """vLLM run here (`engine=vllm`, conf/engine/vllm.yaml): the target served by a plain vLLM server and by one
    drafting with `engine.drafter` at `engine.k`, measured as a deployment is. `engine.drafter` may list several of
    `drafters`: each is served in turn (one drafting server at a time beside the same plain server) and measured
    against plain, and each gains its speed and τ over the run's baseline drafter in vLLM (`deployment.add_versus`)
    where the baseline is among them."""

    name = "vllm"

    def __init__(self, config, costs: EngineCosts) -> None:
        super().__init__(config, costs)
        self.servers = contextlib.ExitStack()
        self.drafting = contextlib.ExitStack()  # the drafting server being measured; the next one starts after it ends
        self.servers.callback(self.drafting.close)
        self.asked: tuple[list[int], list[str]] | None = None
        self.served: dict[str, tuple[Path, dict]] = {}  # by drafter: the target's directory and --speculative-config
        self.sizing: dict = {}
        self.work: Path | None = None
        self.plain: vllm.VllmServer | None = None  # the plain server, whose own clock gives β

    def drafters(self) -> list[str]:
        """`engine.drafter`: one of `drafters`, or a list of them, in the order they are served."""
        named = self.config.drafter
        return [named] if isinstance(named, str) else [str(n) for n in named or []]

    def check(self, plan, alone: bool = False) -> None:
        super().check(plan, alone)
        if not vllm.available():
            raise ValueError(f"engine=vllm needs vLLM's environment at {vllm.ENVIRONMENT}: `make vllm` installs it")
        if not self.drafters() or self.config.k is None:
            raise ValueError("engine=vllm needs engine.drafter (which of `drafters` the server drafts with, or a list "
                             "of them, served in turn) and engine.k")
        if len(set(self.drafters())) != len(self.drafters()):
            raise ValueError(f"engine.drafter={self.drafters()} names a drafter twice")

    def connect(self, ks, drafters) -> None:
        self.asked = (ks, drafters)  # the servers start once the drafters are in vLLM's format (convert)

    def convert(self, specs, target, target_name_or_path, work, alone=False, request=None, threads=None) -> None:
        """Every listed drafter exported in vLLM's format, then the plain server and the first drafter's started and
        checked, before draftsmith measures (a drafter vLLM cannot read fails here). Each server takes requests up to
        `engine.max_model_len` tokens, else what the run sends it (`vllm.max_model_len`), and its worker binds the
        run's `threads` cores (vLLM's own default on a CPU keeps one core for its front end)."""
        by_name = {s["name"]: s for s in specs}
        for name in self.drafters():
            if name not in by_name:
                raise ValueError(f"engine.drafter={name!r} is not one of drafters {self.asked[1]}")
            self.served[name] = vllm.served_drafter(by_name[name], target, target_name_or_path, Path(work),
                                                    self.config.k)
        model = self.served[self.drafters()[0]][0]
        longest = self.config.max_model_len or (vllm.max_model_len(*request, self.config.k) if request else None)
        self.sizing = {"dtype": str(target.dtype).removeprefix("torch."), "kv_cache_gib": self.config.kv_cache_gib,
                       "max_model_len": longest, "threads": threads}
        self.work = Path(work)
        try:
            self.plain = self.servers.enter_context(vllm.VllmServer(
                model, **self.sizing, log_file=self.work / "vllm-plain.log"))
            self._serve(self.drafters()[0])
        except BaseException:
            self.servers.close()
            raise

    def _serve(self, name: str) -> None:
        """The drafting server of `name` started (the one before it stopped first) and both servers checked."""
        self.drafting.close()
        model, speculative = self.served[name]
        drafting = self.drafting.enter_context(vllm.VllmServer(
            model, speculative_config=speculative, **self.sizing, log_file=self.work / f"vllm-{name}.log"))
        self.config = OmegaConf.merge(self.config, {"spec_url": drafting.url, "plain_url": self.plain.url,
                                                    "model": str(model)})
        self.endpoints = deployment.connect(self._for(name), *self.asked)

    def _for(self, name: str):
        """The engine's settings as a deployment drafting with `name` alone."""
        return OmegaConf.create({**OmegaConf.to_container(self.config), "drafter": name})

    def add_figures(self, rows, specs, target, target_name_or_path, prompts, plan, *, threads, work, progress=True,
                    alone=False) -> dict:
        asked = {c: [p.tolist() for p in ps] for c, ps in prompts.items()}
        measured = {}  # by drafter, what deployment.measure returns
        try:
            for i, name in enumerate(self.drafters()):
                if i:
                    self._serve(name)
                measured[name], _ = deployment.measure_into(rows, self.endpoints, asked, plan, drafter=name,
                                                            k=self.config.k, costs=self.costs, progress=progress)
            # β at the width the drafting server verifies, on the longest prompt (the context a round sees).
            longest = max((p for ps in asked.values() for p in ps), key=len)
            steps, why = vllm.measured_step_costs(self.plain, longest, self.config.k + 1)
        finally:
            self.servers.close()
        deployment.add_versus(rows, measured, specs[0]["name"], k=self.config.k, repeats=plan.repeats, seed=plan.seed)
        for row in rows:
            if row.get("engine") == deployment.NAME:
                row["engine"] = vllm.SERVED
                if steps is not None:
                    add_costs(row, steps.beta(self.config.k + 1), self.config.k, plan.pays_off_at)
                else:
                    row["engine_note"] = "; ".join(filter(None, [row.get("engine_note"), f"no β: {why}"]))
        return {"name": vllm.SERVED, "plain_url": self.plain.url, "model": self.config.model,
                "drafter": self.config.drafter if isinstance(self.config.drafter, str) else self.drafters(),
                "k": self.config.k, "batch_sizes": list(plan.batch_sizes), "engine_only": [],
                "speculative_config": {name: config for name, (_, config) in self.served.items()},
                "step_costs": None if steps is None else {
                    "decode_step_ms": steps.step_s * 1000, "cached_prefix": steps.cached,
                    "forward_ms": {w: t * 1000 for w, t in steps.forward_s.items()}}}


def add_costs(row: dict, beta: float, k: int, pays_off_at: float) -> None:
    """A vLLM row's costs: β from the plain server's clock (`vllm.StepCosts.beta`), and from it the engine's ceiling,
    the τ ceiling and, at batch 1, c: what the drafting server's round spends beyond that verification per drafted
    token, read off its measured speed-up S through the cost model (S = τ / (1 + n̄·c + β), n̄ its drafted tokens
    per round), and the τ that round cost would need to pay. A batch-1 figure, as llama.cpp's are."""
    if row.get("batch_size", 1) != 1:
        return
    tau, speedup = row.get("engine_acceptance_length"), row.get("engine_speedup")
    row.update(ceilings(k, tau, beta), engine_verify_overhead=beta)
    proposed = row.get("engine_mean_proposed") or k
    if tau and speedup:
        c = (tau / speedup - 1 - beta) / proposed
        row.update(engine_cost_ratio=c, engine_tau_to_pay=tau_to_pay(proposed, c, beta, pays_off_at))


def stop_on_sigterm() -> None:
    """`kill` (SIGTERM) ends a run as Ctrl-C does: its `finally` blocks and context managers run, so the servers it
    started (llama-server, vLLM's servers and their workers) stop with it. Python's default ends the process at once
    and leaves them running, holding their memory. For the entry points that may start servers (`python -m eval`,
    `python -m train`, `python -m train.prepare`, and the scripts)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def engine_for(name: str | None, costs: EngineCosts, config=None, runs: tuple[str, ...] = ENGINES) -> Engine:
    """The engine `name` (`engine.name`; None: costs entered, or none), among those a caller `runs` (a training
    run's final evaluation runs llama.cpp only); `config` is the `engine` group (a deployment's URLs)."""
    if name is None:
        return EnteredCosts(costs)
    if name not in runs:
        raise ValueError(f"engine={name!r} is not one draftsmith runs here; known: {sorted(runs)} (for "
                         "another engine, measure c and beta there and set engine_costs.c / engine_costs.beta)")
    return {"llamacpp": lambda: LlamaCpp(costs), "vllm": lambda: Vllm(config, costs)}.get(
        name, lambda: Deployment(config, costs))()
