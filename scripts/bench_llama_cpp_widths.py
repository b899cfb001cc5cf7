"""What one llama.cpp forward of w positions costs, by GGUF file: the shape of a verification's cost in the engine,
for choosing the file a target is served from before any drafter is measured on it.

    .venv/bin/python scripts/bench_llama_cpp_widths.py runs/targets/q4_k_m.gguf runs/targets/q8_0.gguf --threads 2

For each file llama-server is started alone (`--threads` for generation and batches), a context of `--context`
tokens is cached, and each width w feeds w new tokens on top of it (the server's prompt cache keeps the context, so
its `prompt_n` is w) and is timed by the server's own `prompt_ms`; a decoding step is the server's
`predicted_per_token_ms` over `--decode` new tokens. Widths and decoding alternate in `--blocks` blocks so machine
noise hits each alike; medians are reported, and each width's cost in decoding steps of the same file.

A forward of w prompt positions computes logits for its last position only, where a verification computes them for
all w: this is the forward's cost without the output head's w - 1 extra rows, a lower bound on a verification's. The
whole round (sampling, bookkeeping, the drafter) is what `python -m eval engine=llamacpp` measures as β.
(scripts/bench_llama_cpp_amx.py times forwards from an empty cache, to compare llama.cpp builds.)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import urllib.request
from pathlib import Path

from eval.engines.engine import stop_on_sigterm
from eval.engines.llama_cpp import LlamaServer


def vocab_size(url: str) -> int:
    """The served model's vocabulary, from llama-server's model list."""
    with urllib.request.urlopen(url + "/v1/models", timeout=60) as r:
        return int(json.loads(r.read())["data"][0]["meta"]["n_vocab"])


def measure(gguf: Path, widths: list[int], *, context: int, decode: int, blocks: int, threads: int,
            seed: int = 0) -> dict:
    """Median milliseconds of a forward of each width on top of a cached context, and of a decoding step."""
    rng = random.Random(seed)
    times: dict[int, list[float]] = {w: [] for w in widths}
    steps: list[float] = []
    with LlamaServer(gguf, ctx_size=context + max(widths) + decode + 8, threads=threads, timeout=600) as server:
        n_vocab = vocab_size(server.url)
        # Ids from the vocabulary's lower half: ordinary tokens (special ones sit at its end in the families here).
        fresh = lambda n: [rng.randrange(n_vocab // 8, n_vocab // 2) for _ in range(n)]
        ctx = fresh(context)
        base = {"temperature": 0, "top_k": 1, "seed": 0, "cache_prompt": True}
        server._post("/completion", {**base, "prompt": ctx, "n_predict": 1})  # warm: the context cached
        for _ in range(blocks):
            for w in widths:
                t = server._post("/completion", {**base, "prompt": ctx + fresh(w), "n_predict": 1})["timings"]
                if t["prompt_n"] != w:
                    raise RuntimeError(f"{gguf}: the server evaluated {t['prompt_n']} positions for a width of {w}: "
                                       "its prompt cache did not keep the context")
                times[w].append(t["prompt_ms"])
            t = server._post("/completion", {**base, "prompt": ctx + fresh(1), "n_predict": decode,
                                             "ignore_eos": True})["timings"]
            steps.append(t["predicted_per_token_ms"])
    step = statistics.median(steps)
    return {"file": str(gguf), "bytes": gguf.stat().st_size, "step_ms": step, "tokens_per_s": 1000 / step,
            "width_ms": {w: statistics.median(v) for w, v in times.items()},
            "width_steps": {w: statistics.median(v) / step for w, v in times.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="+", type=Path, help="GGUF files of the same model at different types")
    parser.add_argument("--widths", default="1,2,3,4,5,6,8,9", help="positions per forward, comma-separated")
    parser.add_argument("--context", type=int, default=256, help="tokens cached before each forward")
    parser.add_argument("--decode", type=int, default=16, help="new tokens per decoding measurement")
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    missing = [str(g) for g in args.gguf if not g.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    results = []
    for gguf in args.gguf:
        print(f"measuring {gguf} ({args.blocks} blocks, {args.threads} threads)", file=sys.stderr)
        results.append(measure(gguf, widths, context=args.context, decode=args.decode, blocks=args.blocks,
                               threads=args.threads))
    print("| file | MB | decode tok/s | " + " | ".join(f"w={w}" for w in widths) + " |")
    print("|---|---|---|" + "---|" * len(widths))
    for r in results:
        cells = " | ".join(f"{r['width_steps'][w]:.2f}" for w in widths)
        print(f"| {Path(r['file']).name} | {r['bytes'] / 1e6:.0f} | {r['tokens_per_s']:.1f} | {cells} |")
    print(f"(a forward of w positions on top of {args.context} cached tokens, in decoding steps of the same file; "
          "medians)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    stop_on_sigterm()
    main()
