"""Where a drafter's round goes: its `propose` calls profiled inside real speculative generations, each function's
share of them (docs/benchmarks/parallel-drafting.md).

    python scripts/profile_propose.py                                       # the toy world's off-the-shelf draft
    python scripts/profile_propose.py --target pypi://smollm2 --dtype bfloat16 --k 4 \\
        --data runs/real_traffic/eval.jsonl --drafter "{name: dflash, kind: head, path: runs/s2/dflash_b5/best}"

The drafter is built as `python -m eval` builds it (`--drafter` takes one entry of its `drafters` list) and drafts
for the target's greedy verification on the first `--prompts` prompts of each category of `--data`. cProfile runs
only while the loop is inside `propose`, after one unprofiled pass over the same prompts (warm-up), so the shares
are of drafting alone: which part of a round (the drafter's layers, the output head, reading the target's features)
is worth making cheaper. cProfile's own overhead inflates small Python calls; the first line's milliseconds a round
are timed without it, in a separate pass. It runs on the CPU: cProfile sees the host's time, which on a GPU would be
kernel launches, not kernels.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from pathlib import Path

import torch
import yaml

from drafters.sampling import Sampling
from eval.run import build_drafter, load_prompts, load_target, resolve_specs, target_source
from eval.speculative import speculative_generate

ROOT = Path(__file__).resolve().parents[1]


def _where(key: tuple) -> str:
    """A cProfile key as `path:line(function)`, the path relative to the repository or to site-packages."""
    filename, line, name = key
    if filename == "~":
        return name  # a built-in: `{built-in method torch._C._nn.linear}`
    path = Path(filename)
    parts = path.parts
    if "site-packages" in parts:
        shown = "/".join(parts[parts.index("site-packages") + 1:])
    elif path.resolve().is_relative_to(ROOT):
        shown = str(path.resolve().relative_to(ROOT))
    else:
        shown = filename
    return f"{shown}:{line}({name})"


def _ours(filename: str) -> bool:
    """Whether a profiled function is this repository's code (not a built-in, nor a package installed in its venv)."""
    if filename == "~":
        return False
    path = Path(filename).resolve()
    return path.is_relative_to(ROOT) and "site-packages" not in path.parts


def profile(target, drafter, prompts: list[torch.Tensor], k: int, max_new_tokens: int, eos: int | None):
    """(profile of the propose calls, the profile's key of the drafter's propose, seconds of each propose call timed
    without the profiler, rounds profiled)."""
    original = drafter.propose
    timings: list[float] = []
    profiler = cProfile.Profile()
    state = {"profiling": False, "rounds": 0}

    def propose(*args, **kwargs):
        if state["profiling"]:
            state["rounds"] += 1
            profiler.enable()
            try:
                return original(*args, **kwargs)
            finally:
                profiler.disable()
        started = time.perf_counter()
        out = original(*args, **kwargs)
        timings.append(time.perf_counter() - started)
        return out

    drafter.propose = propose
    try:
        for profiling in (False, False, True):  # warm-up, timed, profiled
            if not profiling:
                timings.clear()
            state["profiling"] = profiling
            for ids in prompts:
                speculative_generate(target, drafter, ids, k=k, sampling=Sampling(), max_new_tokens=max_new_tokens,
                                     eos_token_id=eos)
    finally:
        drafter.propose = original
    code = getattr(original, "__func__", original).__code__
    return pstats.Stats(profiler), (code.co_filename, code.co_firstlineno, code.co_name), timings, state["rounds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="toyworld://toy/target")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--drafter", default="{name: off_the_shelf, kind: draft_lm, path: toyworld://toy/draft}",
                    help="one entry of python -m eval's drafters list, as YAML")
    ap.add_argument("--data", default="toyworld://toy/company_logs/eval.jsonl")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per category")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=12, help="rows of each table")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = yaml.safe_load(args.drafter)
    if not isinstance(spec, dict) or not {"name", "kind"} <= spec.keys():
        raise SystemExit(f"--drafter must be a mapping with name and kind, as in python -m eval's drafters: "
                         f"got {args.drafter!r}")
    device = torch.device("cpu")
    target, tokenizer = load_target(args.target, device=device, dtype=args.dtype)
    spec = resolve_specs([spec], target_source({"name_or_path": args.target}), own_drafters=False)[0]
    drafter = build_drafter(spec, target=target, tokenizer=tokenizer)
    by_category = load_prompts(args.data, tokenizer, device=device, max_per_category=args.prompts)
    prompts = [ids for ids_of in by_category.values() for ids in ids_of]
    stats, outermost, timings, rounds = profile(target, drafter, prompts, args.k, args.max_new_tokens,
                                                tokenizer.eos_token_id)

    table = stats.stats  # (file, line, function) -> (primitive calls, calls, own seconds, cumulative seconds, callers)
    total = table[outermost][3]  # the drafter's propose, callees included (not the profiler switching itself)
    table = {key: row for key, row in table.items() if "_lsprof.Profiler" not in key[2]}
    print(f"{spec['name']} ({spec['kind']}) on {args.target} in {args.dtype}, k = {args.k}, {len(prompts)} prompts, "
          f"{torch.get_num_threads()} threads: {rounds} rounds profiled; propose {statistics.median(timings) * 1e3:.2f} "
          f"ms a round (median of {len(timings)}, unprofiled)")
    ours = sorted(((key, row) for key, row in table.items() if _ours(key[0])), key=lambda item: -item[1][3])
    print("\ndraftsmith's functions, by their share of propose's time (callees included):\n")
    print("| share | calls a round | function |\n|---|---|---|")
    for key, (_, calls, _, cumulative, _) in ours[: args.top]:
        print(f"| {cumulative / total:.3f} | {calls / rounds:.1f} | {_where(key)} |")
    print("\nthe operations, by their own share of propose's time:\n")
    print("| share | calls a round | operation |\n|---|---|---|")
    for key, (_, calls, own, _, _) in sorted(table.items(), key=lambda item: -item[1][2])[: args.top]:
        print(f"| {own / total:.3f} | {calls / rounds:.1f} | {_where(key)} |")


if __name__ == "__main__":
    main()
