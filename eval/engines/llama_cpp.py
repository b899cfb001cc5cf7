"""llama.cpp, a real serving engine that runs here: its converter (HF -> GGUF) and `llama-server`.

The build is llama.cpp as vendored by the llama-cpp-python source distribution on PyPI, compiled once
by `scripts/build_llama_cpp.sh` (`make llama-cpp`) into `$DRAFTSMITH_LLAMA_CPP`, by default
`~/.cache/draftsmith/llama.cpp/llama-cpp-python-<version>/` (bin/llama-server, src/ with
convert_hf_to_gguf.py and gguf-py/). Nothing of llama.cpp is reimplemented here: conversion runs its own
script, serving its own server, and what it reports (`timings.draft_n`, `draft_n_accepted`) is read as it
reports it. Its source is built as vendored but for the patches in eval/engines/llama_cpp_patches/, each with its
reason at its head (`PATCHES`); a build made with other patches is rebuilt (`make llama-cpp`).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python's sdist, whose vendored llama.cpp is built


def home() -> Path:
    """The llama.cpp build: $DRAFTSMITH_LLAMA_CPP, else the cache scripts/build_llama_cpp.sh fills
    (~/.cache/draftsmith/llama.cpp/..., apart from $DRAFTSMITH_HOME, which tests point at temporary worlds)."""
    if os.environ.get("DRAFTSMITH_LLAMA_CPP"):
        return Path(os.environ["DRAFTSMITH_LLAMA_CPP"])
    return Path.home() / ".cache" / "draftsmith" / "llama.cpp" / f"llama-cpp-python-{VERSION}"


BINARIES = ("llama-server", "llama-quantize", "llama-hidden-states")
PATCHES = Path(__file__).resolve().parent / "llama_cpp_patches"  # applied by scripts/build_llama_cpp.sh, in name order


def patches_digest() -> str:
    """sha256 of the patches concatenated in name order: what scripts/build_llama_cpp.sh records in
    bin/patches.sha256 for the build it made."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(PATCHES.glob("*.patch")))).hexdigest()


def built_with() -> str | None:
    """The digest of the patches the build at home() was made with (None: no record, an older build)."""
    stamp = home() / "bin" / "patches.sha256"
    return stamp.read_text().strip() if stamp.exists() else None


def available() -> bool:
    return (all((home() / "bin" / b).exists() for b in BINARIES) and (home() / "src" / "convert_hf_to_gguf.py").exists()
            and built_with() == patches_digest())


def require() -> Path:
    """The build's directory, or a FileNotFoundError saying how to build it."""
    if not available():
        if (home() / "bin" / BINARIES[0]).exists():
            raise FileNotFoundError(f"llama.cpp at {home()} was built by an older scripts/build_llama_cpp.sh (other "
                                    f"patches than {PATCHES}, or without bin/{', bin/'.join(BINARIES[1:])}): run "
                                    "`make llama-cpp` to rebuild it (about 5 minutes on 2 cores)")
        raise FileNotFoundError(f"llama.cpp is not built at {home()} (bin/{', bin/'.join(BINARIES)}, src/): run "
                                "`make llama-cpp` (scripts/build_llama_cpp.sh, about 5 minutes on 2 cores) or set "
                                "DRAFTSMITH_LLAMA_CPP to a build")
    return home()


def binary(name: str) -> Path:
    return require() / "bin" / name


# --- conversion: llama.cpp's own convert_hf_to_gguf.py -----------------------------------------------------


def tokenizer_pre_of(model_dir: str | Path) -> str:
    """llama.cpp's name for the pre-tokenizer of a Hugging Face tokenizer.json, for tokenizers its
    converter does not recognise by hash (one trained here, like the toy world's).

    The converter names a BPE pre-tokenizer by hashing how the tokenizer splits a probe text; a tokenizer
    it has not seen has an unknown hash. A byte-level BPE whose only pre-tokenizer is ByteLevel with
    GPT-2's regex, no prefix space and no normalizer splits text exactly as GPT-2's does: llama.cpp's
    `gpt-2` pre-tokenizer. A SentencePiece-style BPE (byte fallback, a decoder sequence, and no
    pre-tokenizer, Llama-2's layout and what scripts/import_llama2c.py writes, or Gemma-3's split at spaces
    after they are replaced by "▁") needs no name: the converter reads it as a Llama vocabulary (its
    LlamaHfVocab), and "" is returned. Any other is an error naming what was found; pass the name explicitly
    then.
    """
    tok = json.loads((Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    pre, normalizer, model = tok.get("pre_tokenizer"), tok.get("normalizer"), tok.get("model", {})
    gemma_split = (pre == {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}
                   and normalizer == {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"})
    if ((pre is None or gemma_split) and model.get("type") == "BPE" and model.get("byte_fallback")
            and (tok.get("decoder") or {}).get("type") == "Sequence"):
        return ""
    if pre and pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 1:
        pre = pre["pretokenizers"][0]
    if (normalizer is None and model.get("type") == "BPE" and pre and pre.get("type") == "ByteLevel"
            and pre.get("use_regex", True) and not pre.get("add_prefix_space", False)):
        return "gpt-2"
    raise ValueError(f"{model_dir}/tokenizer.json: no llama.cpp pre-tokenizer is known to match pre_tokenizer={pre!r}, "
                     f"normalizer={normalizer!r}; name one (tokenizer_pre=..., see llama.cpp's "
                     "convert_hf_to_gguf_update.py for the names)")


def convert_to_gguf(model_dir: str | Path, out_file: str | Path, *, outtype: str = "f32",
                    target_dir: str | Path | None = None, tokenizer_pre: str = "auto") -> Path:
    """GGUF of a Hugging Face model directory (a draft LM, a target) or an EAGLE-3 export (with
    `target_dir`, the target's config and tokenizer, as llama.cpp requires), by llama.cpp's converter."""
    src = require() / "src"
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = Path(target_dir or model_dir)
    pre, unnamed = tokenizer_pre, None
    if tokenizer_pre == "auto" and (tokenizer_dir / "tokenizer.json").exists():
        try:
            pre = tokenizer_pre_of(tokenizer_dir)
        except ValueError as error:  # the converter's own table may know it by hash: a released model's tokenizer
            pre, unnamed = "auto", error
    args = [str(model_dir), "--outfile", str(out_file), "--outtype", outtype]
    if target_dir is not None:
        args += ["--target-model-dir", str(target_dir)]
    proc = subprocess.run([sys.executable, "-m", "eval.engines.llama_cpp", "convert", str(src), pre, *args],
                          capture_output=True, text=True)
    if proc.returncode != 0 or not out_file.exists():
        raise RuntimeError(f"llama.cpp's converter failed on {model_dir} (exit {proc.returncode}):\n"
                           + "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
                           + (f"\n(and {unnamed})" if unnamed else ""))
    return out_file


def quantize(gguf: str | Path, out_file: str | Path, qtype: str) -> Path:
    """`gguf` (f32, f16 or bf16) quantized to `qtype` (Q4_1, Q8_0, Q4_K_M, ...: llama-quantize's names) by
    llama.cpp's own quantizer, the tool that makes the quantized files teams deploy."""
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([str(binary("llama-quantize")), str(gguf), str(out_file), qtype], capture_output=True,
                          text=True)
    if proc.returncode != 0 or not out_file.exists():
        raise RuntimeError(f"llama-quantize failed on {gguf} to {qtype} (exit {proc.returncode}):\n"
                           + "\n".join((proc.stdout + proc.stderr).splitlines()[-15:]))
    return out_file


def _convert_main(src: str, tokenizer_pre: str, args: list[str]) -> None:
    """Run the converter with one thing told: the pre-tokenizer of a tokenizer its hash table lacks.

    The converter is imported as a module (its own file, unedited) and its hash lookup is wrapped in
    memory: a hash it knows keeps its own answer; an unknown one gets `tokenizer_pre` instead of the
    error "BPE pre-tokenizer was not recognized".
    """
    sys.argv = [str(Path(src) / "convert_hf_to_gguf.py"), *args]
    sys.path.insert(0, src)
    import convert_hf_to_gguf  # puts its gguf-py first on sys.path
    from conversion.base import TextModel

    known = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            if tokenizer_pre in ("auto", ""):
                raise
            return tokenizer_pre

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    convert_hf_to_gguf.main()


# --- serving: llama-server on 127.0.0.1 ----------------------------------------------------------------------


@dataclass
class Completion:
    """One greedy completion as llama-server reports it."""

    tokens: list[int]  # the generated token ids
    draft_n: int  # tokens the drafter proposed
    draft_n_accepted: int  # of those, accepted by the target
    predicted_ms: float  # llama-server's own time for generating them


class LogReader:
    """Reads a growing log file from where the last read stopped, through a descriptor of its own (the
    server writes through another, so neither moves the other's position). llama-server logs token
    pieces, which can be partial UTF-8: a sequence split between reads is decoded whole, a broken one
    replaced, never an error."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "rb")
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def new(self) -> str:
        """What was written since the previous call (since the file was created, on the first)."""
        return self._decoder.decode(self._file.read())

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        self._file.close()


_DEVICE = re.compile(r"using device (\S+) \(([^)]*)\)")
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")


def served_on(log: str) -> str:
    """The device a llama-server log says the model runs on: `NVIDIA H200 (CUDA0), 31/31 layers` where a build
    with a GPU backend offloads to it (llama-server offloads every layer it can by default), else `CPU`."""
    devices = dict.fromkeys(_DEVICE.findall(log))
    offloaded = _OFFLOADED.search(log)
    if not devices or (offloaded and offloaded[1] == "0"):
        return "CPU"
    return ", ".join(f"{name} ({device})" for device, name in devices) + (
        f", {offloaded[1]}/{offloaded[2]} layers" if offloaded else "")


def died(returncode: int) -> str:
    """How a process ended, for an error: `was killed by SIGSEGV (signal 11)` or `exited with 1`."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "an unknown signal"
        return f"was killed by {name} (signal {-returncode})"
    return f"exited with {returncode}"


def cpu_has_amx(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether the CPU has Intel's AMX for int8 (Sapphire Rapids and later Xeons), as Linux lists it."""
    try:
        return "amx_int8" in Path(cpuinfo).read_text().split()
    except OSError:
        return False


def amx_kernels() -> str:
    """Whether the build at home() runs ggml's AMX kernels: `on`, `off` (left out on an AMX CPU) or `none` (no
    AMX on the CPU it was built for), as scripts/build_llama_cpp.sh records it in bin/amx; a build without that
    record predates the choice and has them wherever the CPU has AMX."""
    record = home() / "bin" / "amx"
    if record.exists():
        return record.read_text().strip()
    return "on" if cpu_has_amx() else "none"


def why_it_died(returncode: int, log: str) -> str:
    """The likely cause of llama-server dying on a signal while loading, and the way around it ("" when none
    is known), from how it died, the build's record and its log (whose system_info line, logged at -lv 4,
    names the CPU features its kernels were built with)."""
    if returncode == -signal.SIGSEGV and (amx_kernels() == "on" or "AMX_INT8 = 1" in log):
        return ("; this build runs ggml's AMX kernels, which crash on some CPUs with AMX in their first decode of "
                "a quantized model (llama.cpp issue 20824): rebuild with `make llama-cpp`, which leaves them out on "
                "such a CPU (scripts/build_llama_cpp.sh), or serve without repacking: LLAMA_ARG_REPACK=0 in the "
                "environment (llama-server's --no-repack)")
    if returncode == -signal.SIGILL:
        return ("; an illegal instruction: this build was compiled for another CPU (GGML_NATIVE); rebuild it on this "
                "machine with `make llama-cpp`")
    if returncode == -signal.SIGKILL:
        return "; killed from outside, most often by the kernel when memory runs out: check `dmesg`, or use a smaller ctx_size"
    return ""


# llama.cpp's own model-free speculation (common/speculative.cpp), and the flag that sets how many tokens
# each drafts: what a llama.cpp user has without any draft model. Their lookup lengths stay llama.cpp's.
NGRAM_TYPES = {"ngram-simple": "--spec-ngram-simple-size-m", "ngram-map-k": "--spec-ngram-map-k-size-m",
               "ngram-map-k4v": "--spec-ngram-map-k4v-size-m", "ngram-mod": "--spec-ngram-mod-n-max",
               "ngram-cache": "--spec-draft-n-max"}
# Those whose draft length llama.cpp fixes whatever the flag says: ngram-cache drafts up to 8 tokens
# (common/speculative.cpp, create_state_ngram_cache sets `n_draft = 8`, not read from the config; the server truncates
# a draft only to what the context and the budget leave), so it is served, measured and reported at that k alone.
FIXED_K = {"ngram-cache": 8}


class LlamaServer:
    """`llama-server` serving `model` (a GGUF) on 127.0.0.1 at a free port, optionally with a drafter:
    `draft` (a GGUF) and `spec_type` (`draft-simple` for a draft LM, `draft-eagle3` for an EAGLE-3 head),
    or one of llama.cpp's model-free `NGRAM_TYPES` without a draft, drafting `k` tokens per round (a draft
    stops early at its first guess below `p_min`, which it drops: llama.cpp's confidence stop). Greedy, deterministic; `parallel` slots of `ctx_size` tokens each, whose
    requests the server decodes together (one slot: a request at a time). Use as a context manager.

    log_verbosity 4 makes it log its drafting statistics (eval/engines/llama_cpp_measure.py reads its drafting timer there).
    `accept_none=True` is llama.cpp's synthetic acceptance for benchmarking (`--spec-synth-len 1`): every
    round drafts and verifies as usual but keeps none of the drafts, so each round emits the target's own
    token (the output stays the plain output) and costs what a round costs, whatever the drafter's skill."""

    def __init__(self, model: str | Path, *, draft: str | Path | None = None, spec_type: str | None = None,
                 k: int = 4, ctx_size: int = 2048, threads: int = 1, timeout: float = 120.0,
                 log_file: str | Path | None = None, log_verbosity: int | None = None,
                 accept_none: bool = False, parallel: int = 1, p_min: float = 0.0) -> None:
        if spec_type in NGRAM_TYPES:
            if draft is not None:
                raise ValueError(f"{spec_type} drafts without a model: no `draft`")
            if FIXED_K.get(spec_type, k) != k:
                raise ValueError(f"llama.cpp's {spec_type} drafts up to {FIXED_K[spec_type]} tokens whatever the "
                                 f"maximum it is given: k must be {FIXED_K[spec_type]}, got {k}")
        elif (draft is None) != (spec_type is None):
            raise ValueError("a drafter needs both `draft` (its GGUF) and `spec_type`")
        if accept_none and spec_type is None:
            raise ValueError("accept_none needs a drafter")
        self.model, self.draft, self.spec_type, self.k = Path(model), draft, spec_type, k
        self.ctx_size, self.threads, self.timeout, self.log_file = ctx_size, threads, timeout, log_file
        self.log_verbosity, self.accept_none, self.parallel = log_verbosity, accept_none, parallel
        if p_min and self.draft is None:
            raise ValueError("p_min is a draft model's confidence stop: it needs `draft`")
        self.p_min = p_min
        self._log: LogReader | None = None
        self._temporary_log: Path | None = None
        self.process: subprocess.Popen | None = None

    def command(self, port: int) -> list[str]:
        cmd = [str(binary("llama-server")), "-m", str(self.model), "--host", "127.0.0.1",
               "--port", str(port), "-c", str(self.ctx_size * self.parallel), "-np", str(self.parallel), "-t",
               str(self.threads), "-tb",
               str(self.threads), "--temp", "0", "--top-k", "1", "--seed", "0", "--no-webui", "--metrics"]
        if self.spec_type in NGRAM_TYPES:
            cmd += ["--spec-type", self.spec_type, NGRAM_TYPES[self.spec_type], str(self.k)]
            if self.spec_type == "ngram-mod":  # its minimum draft (48 by default) must not exceed the maximum
                cmd += ["--spec-ngram-mod-n-min", "1"]
        elif self.draft is not None:
            cmd += ["-md", str(self.draft), "--spec-type", self.spec_type, "--spec-draft-n-max", str(self.k),
                    "--spec-draft-n-min", "0", "-td", str(self.threads), "--spec-draft-p-min", str(self.p_min)]
        if self.accept_none:
            cmd += ["--spec-synth-len", "1"]
        if self.log_verbosity is not None:
            cmd += ["-lv", str(self.log_verbosity)]
        return cmd

    def __enter__(self) -> "LlamaServer":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        # Its log goes to a file (a temporary one unless log_file is given), whose end an error quotes.
        if self.log_file is None:
            fd, path = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
            os.close(fd)
            self._temporary_log = Path(path)
        log_path = Path(self.log_file) if self.log_file is not None else self._temporary_log
        with open(log_path, "wb") as log:  # the server's own descriptor (Popen gives it a copy)
            self.process = subprocess.Popen(self.command(port), stdout=log, stderr=subprocess.STDOUT)
        self._log = LogReader(log_path)
        try:
            self._wait_until_serving()
        except BaseException:  # a failed start, or Ctrl-C or `kill` while it loads: the server must not outlive it
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_until_serving(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log, tail = self._log.path.read_text(encoding="utf-8", errors="replace"), self._log.tail()
                raise RuntimeError(f"llama-server {died(self.process.returncode)} while loading {self.model}"
                                   + (f" and {self.draft}" if self.draft else "") + f"{why_it_died(self.process.returncode, log)}"
                                   f"; the end of its log:\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self._check_drafting()
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"llama-server did not come up in {self.timeout:.0f} s")

    def _check_drafting(self) -> None:
        """llama-server that cannot set up the drafter it was given (a draft whose vocabulary type is not the
        target's, say) logs the error and serves on without speculation: raise that error (and so stop it)."""
        if self.spec_type is None:
            return
        log = self._log.path.read_text(encoding="utf-8", errors="replace")
        failed = next((line for line in log.splitlines() if "failed to initialize speculative decoding" in line), None)
        if failed is not None:
            raise RuntimeError(f"llama-server could not set up {self.spec_type}"
                               + (f" with {self.draft}" if self.draft else "") + f" for {self.model}: "
                               f"{failed.split('load_model: ', 1)[-1]}; the end of its log:\n{self._log.tail()}")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._temporary_log is not None:
            self._temporary_log.unlink(missing_ok=True)
            self._temporary_log = None

    def device(self) -> str:
        """Where it runs the model, from its log (`served_on`)."""
        return served_on(self._log.path.read_text(encoding="utf-8", errors="replace"))

    def new_log(self) -> str:
        """What the server has logged since the previous call (since its start, on the first)."""
        return self._log.new()

    def _post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            return json.loads(r.read())

    def complete(self, prompt_ids: list[int], max_new_tokens: int) -> Completion:
        """Greedy continuation of the token ids (sent as ids, so no tokenizer stands between), at most
        max_new_tokens, stopping at end of generation as llama.cpp decides."""
        out = self._post("/completion", {"prompt": list(prompt_ids), "n_predict": max_new_tokens, "temperature": 0,
                                         "top_k": 1, "seed": 0, "cache_prompt": False, "return_tokens": True})
        t = out["timings"]
        return Completion(list(out["tokens"]), int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0)),
                          float(t["predicted_ms"]))


if __name__ == "__main__":  # what convert_to_gguf runs, in a process of its own
    if len(sys.argv) < 4 or sys.argv[1] != "convert":
        sys.exit("usage: python -m eval.engines.llama_cpp convert LLAMA_CPP_SRC TOKENIZER_PRE CONVERTER_ARGS...")
    _convert_main(sys.argv[2], sys.argv[3], sys.argv[4:])
