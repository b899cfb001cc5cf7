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
    """vLLM run here (`engine=vllm`, conf/engine/vllm.yaml): the target served by two vLLM servers, one drafting with
    `engine.drafter` at `engine.k`, measured as a deployment is."""

    name = "vllm"

    def __init__(self, config, costs: EngineCosts) -> None:
        super().__init__(config, costs)
        self.servers = contextlib.ExitStack()
        self.asked: tuple[list[int], list[str]] | None = None
        self.speculative: dict | None = None  # the --speculative-config the drafting server runs
        self.plain: vllm.VllmServer | None = None  # the plain server, whose own clock gives β

    def check(self, plan, alone: bool = False) -> None:
        super().check(plan, alone)
        if not vllm.available():
            raise ValueError(f"engine=vllm needs vLLM's environment at {vllm.ENVIRONMENT}: `make vllm` installs it")
        if self.config.drafter is None or self.config.k is None:
            raise ValueError("engine=vllm needs engine.drafter (which of `drafters` the server drafts with) and engine.k")

    def connect(self, ks, drafters) -> None:
        self.asked = (ks, drafters)  # the servers start once the drafter is in vLLM's format (convert)

    def convert(self, specs, target, target_name_or_path, work, alone=False, request=None, threads=None) -> None:
        """The drafter exported in vLLM's format, both servers started and checked, before draftsmith measures. Each
        server takes requests up to `engine.max_model_len` tokens, else what the run sends it (`vllm.max_model_len`),
        and its worker binds the run's `threads` cores (vLLM's own default on a CPU keeps one core for its front end)."""
        spec = next((s for s in specs if s["name"] == self.config.drafter), None)
        if spec is None:
            raise ValueError(f"engine.drafter={self.config.drafter!r} is not one of drafters {self.asked[1]}")
        model, self.speculative = vllm.served_drafter(spec, target, target_name_or_path, Path(work), self.config.k)
        dtype = str(target.dtype).removeprefix("torch.")
        longest = self.config.max_model_len or (vllm.max_model_len(*request, self.config.k) if request else None)
        sizing = {"dtype": dtype, "kv_cache_gib": self.config.kv_cache_gib, "max_model_len": longest,
                  "threads": threads}
        try:
            plain = self.plain = self.servers.enter_context(vllm.VllmServer(
                model, **sizing, log_file=Path(work) / "vllm-plain.log"))
            drafting = self.servers.enter_context(vllm.VllmServer(
                model, speculative_config=self.speculative, **sizing, log_file=Path(work) / f"vllm-{spec['name']}.log"))
            self.config = OmegaConf.merge(self.config, {"spec_url": drafting.url, "plain_url": plain.url,
                                                        "model": str(model)})
            self.endpoints = deployment.connect(self.config, *self.asked)
        except BaseException:
            self.servers.close()
            raise

    def add_figures(self, rows, specs, target, target_name_or_path, prompts, plan, *, threads, work, progress=True,
                    alone=False) -> dict:
        try:
            settings = super().add_figures(rows, specs, target, target_name_or_path, prompts, plan, threads=threads,
                                           work=work, progress=progress, alone=alone)
            # β at the width the drafting server verifies, on the longest prompt (the context a round sees).
            longest = max((p.tolist() for ps in prompts.values() for p in ps), key=len)
            steps, why = vllm.measured_step_costs(self.plain, longest, self.config.k + 1)
        finally:
            self.servers.close()
        for row in [*rows, *settings["engine_only"]]:
            if row.get("engine") == deployment.NAME:
                row["engine"] = vllm.SERVED
                if steps is not None:
                    add_costs(row, steps.beta(self.config.k + 1), self.config.k, plan.pays_off_at)
                else:
                    row["engine_note"] = "; ".join(filter(None, [row.get("engine_note"), f"no β: {why}"]))
        return {**settings, "name": vllm.SERVED, "speculative_config": self.speculative,
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
