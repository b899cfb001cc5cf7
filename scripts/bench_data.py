"""Benchmark the data pipeline on the toy world (figures in docs/benchmarks/data-pipeline.md).

    python scripts/bench_data.py                          # toy world
    python scripts/bench_data.py --preset tiny --records 16   # smoke run

Reports: the toy world's build time (from its build.json), regeneration throughput in new tokens/s at
several batch sizes on the same records (greedy, median of repeats), and the offline hidden-state
cache's bytes per token and total size for EAGLE-1 and EAGLE-3 layer choices, measured on disk.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from eval.run import load_target
from traffic import toyworld
from traffic.records import load_records
from train.hidden_states import default_layers, write_shards
from train.prepare import tokenize_all
from train.regenerate import regenerate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="toy")
    ap.add_argument("--records", type=int, default=48, help="records to regenerate per measurement")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    world = toyworld.build(args.preset)
    build = json.loads((world / "build.json").read_text())
    target, tok = load_target(str(world / "target"), device=torch.device("cpu"))
    records, _ = load_records(str(world / "company_logs" / "train.jsonl"))
    records = records[: args.records]
    results = {"preset": args.preset, "build_seconds": build["build_seconds"], "threads": torch.get_num_threads()}
    print(f"toy world {args.preset!r}: built in {build['build_seconds']} s (build.json), final losses "
          f"{ {k: round(v, 3) for k, v in build['final_loss'].items()} }")

    with tempfile.TemporaryDirectory() as tmp:
        tps: dict[int, list[float]] = {int(b): [] for b in args.batch_sizes.split(",")}
        for r in range(args.repeats):
            for b in tps:  # interleaved: each repeat measures every batch size once
                _, stats = regenerate(records, target, tok, Path(tmp) / f"regen-{b}-{r}.jsonl",
                                      max_new_tokens=args.max_new_tokens, batch_size=b, progress=False)
                tps[b].append(stats.tokens_per_s)
        results["regen_tokens_per_s"] = {b: statistics.median(v) for b, v in tps.items()}
        for b, v in tps.items():
            print(f"regeneration, batch {b}: {statistics.median(v):.0f} new tokens/s (median of {len(v)}; "
                  f"{len(records)} records, max {args.max_new_tokens} new tokens)")

        examples, _ = tokenize_all(records, tok, target.config.max_position_embeddings, progress=False)
        n_tokens = sum(len(e.input_ids) for e in examples)
        results["cache"] = {}
        for kind in ("eagle1", "eagle3"):
            layers = default_layers(kind, target.config.num_hidden_layers)
            out = Path(tmp) / f"hidden-{kind}"
            write_shards(examples, target, layers, out, dtype="float16", progress=False)
            size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
            results["cache"][kind] = {"layers": layers, "tokens": n_tokens, "bytes": size,
                                      "bytes_per_token": size / n_tokens}
            print(f"offline cache {kind} layers {layers} fp16: {size / n_tokens:.0f} bytes/token on disk "
                  f"({size / 2**20:.1f} MiB for {n_tokens} tokens)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
