"""llama-server built with and without ggml's AMX kernels, on quantized GGUFs: does it load, and what does
leaving the kernels out cost? (scripts/build_llama_cpp.sh leaves them out on CPUs with AMX, where they
crash llama-server on some machines.)

    LLAMA_CPP_AMX=on DRAFTSMITH_LLAMA_CPP=/tmp/lc-amx scripts/build_llama_cpp.sh   # a build with them
    DRAFTSMITH_LLAMA_CPP=/tmp/lc-default scripts/build_llama_cpp.sh                # the default build
    python scripts/bench_llama_cpp_amx.py --build with_amx=/tmp/lc-amx --build default=/tmp/lc-default \\
        --model model-Q4_1.gguf --model model-Q8_0.gguf --threads 8 --out amx.json

For each build and model: whether the server came up (or how it died, with the reason eval/engines/llama_cpp.py
gives), whether its log shows the AMX kernels (`AMX_INT8 = 1`, an `AMX` weight buffer), and, where it
serves, the medians over `--repeats` of llama-server's own timings: one decoded token, a forward over 5 and
9 new tokens from an empty cache (the verification of k = 4 and k = 8 drafts, as ANCHORS 8 measures it)
and a 512-token prompt. Only the Python standard library and the project's eval/engines/llama_cpp.py are used, so
it runs with a bare python3 beside a build.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.engines import llama_cpp  # noqa: E402  (the checkout's package, without installing it)
from eval.engines.engine import stop_on_sigterm

WIDTHS = (1, 5, 9, 512)  # new tokens a forward scores: decode, k = 4 and k = 8 verifications, a long prompt


def timed_forward(server: llama_cpp.LlamaServer, width: int, vocab: int, salt: int) -> float:
    """Milliseconds llama-server reports for one forward over `width` new tokens on an empty cache (ids spread
    over the vocabulary; `salt` makes each request's tokens its own, so no cache is reused)."""
    ids = [(salt * 7919 + i * 104729) % (vocab - 10) + 5 for i in range(width)]
    if width == 1:  # a decode step: the second token's time, after the prompt's forward
        out = server._post("/completion", {"prompt": ids + [7], "n_predict": 17, "temperature": 0, "top_k": 1,
                                           "cache_prompt": False, "ignore_eos": True})
        return out["timings"]["predicted_ms"] / out["timings"]["predicted_n"]
    out = server._post("/completion", {"prompt": ids, "n_predict": 1, "temperature": 0, "top_k": 1,
                                       "cache_prompt": False})
    return out["timings"]["prompt_ms"]


def measure(build: str, model: Path, *, threads: int, repeats: int) -> dict:
    """One build serving one model: its row (see the module docstring). eval/engines/llama_cpp.py finds the build through
    $DRAFTSMITH_LLAMA_CPP, set for the measurement and restored after it."""
    before = os.environ.get("DRAFTSMITH_LLAMA_CPP")
    os.environ["DRAFTSMITH_LLAMA_CPP"] = build
    try:
        return _measure(build, model, threads=threads, repeats=repeats)
    finally:
        if before is None:
            os.environ.pop("DRAFTSMITH_LLAMA_CPP")
        else:
            os.environ["DRAFTSMITH_LLAMA_CPP"] = before


def _measure(build: str, model: Path, *, threads: int, repeats: int) -> dict:
    row = {"build": build, "model": model.name, "amx_record": llama_cpp.amx_kernels()}
    try:
        with llama_cpp.LlamaServer(model, threads=threads, ctx_size=1024, log_verbosity=4, timeout=300) as server:
            log = server.new_log()
            row["amx_in_build"] = "AMX_INT8 = 1" in log
            row["amx_weights"] = "AMX model buffer" in log
            with urllib.request.urlopen(server.url + "/v1/models", timeout=30) as r:
                vocab = json.loads(r.read())["data"][0]["meta"]["n_vocab"]
            for width in WIDTHS:
                times = [timed_forward(server, width, vocab, salt) for salt in range(repeats + 1)][1:]  # one warm-up
                row[f"ms_{width}"] = statistics.median(times)
            row["served"] = True
    except RuntimeError as error:
        row["served"] = False
        row["error"] = str(error).split("; the end of its log")[0]
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="append", required=True, help="NAME=DIR: a llama.cpp build to measure")
    ap.add_argument("--model", action="append", required=True, type=Path, help="a GGUF (repeatable)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    builds = dict(b.split("=", 1) for b in args.build)
    rows = []
    for model in args.model:
        for name, directory in builds.items():
            row = {"name": name, **measure(directory, model, threads=args.threads, repeats=args.repeats)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'model':28s} {'build':10s} {'AMX':>4s} {'decode ms':>10s} {'5 tok ms':>9s} {'9 tok ms':>9s} "
          f"{'512 tok ms':>11s}")
    for r in rows:
        if not r["served"]:
            print(f"{r['model']:28s} {r['name']:10s}  {r['error']}")
            continue
        print(f"{r['model']:28s} {r['name']:10s} {'yes' if r['amx_weights'] else 'no':>4s} {r['ms_1']:10.2f} "
              f"{r['ms_5']:9.2f} {r['ms_9']:9.2f} {r['ms_512']:11.1f}")
    for model in dict.fromkeys(r["model"] for r in rows):  # each build against the first, model by model
        pair = [r for r in rows if r["model"] == model and r["served"]]
        for r in pair[1:]:
            print(f"{model}: {r['name']} / {pair[0]['name']} time: " + ", ".join(
                f"{w} tok {r[f'ms_{w}'] / pair[0][f'ms_{w}']:.2f}x" for w in WIDTHS))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    stop_on_sigterm()
    main()
