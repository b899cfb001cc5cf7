"""`engine=openai` against `engine=llamacpp` on the same prompts (docs/benchmarks/deployment.md): a deployment measured
through its OpenAI-compatible API gives what llama.cpp's own measurement gives.

    python scripts/bench_deployment.py --target pypi://smollm2 --drafter 'self_draft:draft_lm::8' \
        --data runs/real_traffic2/eval.jsonl --prompts 4 --k 4 --out runs/bench/deployment

Starts two llama-servers on the target's GGUF (the drafter at k, and none; `--metrics`, two threads each unless
told otherwise), runs `python -m eval engine=openai` against them, then `python -m eval engine=llamacpp` on the
same prompts, drafter, k and budget, and prints per category: τ from the servers' /metrics against τ from
llama-server's logged statistics (goal: within 2 %), each run's losslessness and verdict. engine=llamacpp turns
llama-server's prompt cache off in every request; an OpenAI client leaves it on (the server's default) unless
`--no-prompt-cache` sends {cache_prompt: false} too.

--drafter NAME:KIND:PATH[:LAYERS] is one of eval's drafter specs (`draft_lm` with a path or, with no path and
LAYERS, the target's first layers; `head` with a trained head's directory).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

import eval.__main__ as entry
from eval.engines import llama_cpp
from eval.config import register
from eval.engines.engine import stop_on_sigterm
from eval.engines.llama_cpp_drafters import llama_cpp_drafter
from eval.run import load_target, resolve_specs
from traffic import models

ROOT = Path(__file__).resolve().parents[1]


def spec_of(text: str) -> dict:
    name, kind, path, *layers = text.split(":")
    spec = {"name": name, "kind": kind, "path": path or None}
    if layers and layers[0]:
        spec["layers"] = int(layers[0])
    return spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="pypi://smollm2")
    ap.add_argument("--target-name", default="smollm2")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per category")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("runs/bench/deployment"))
    ap.add_argument("--no-prompt-cache", action="store_true",
                    help="send llama-server's {cache_prompt: false} (engine.extra_body), as engine=llamacpp's requests do")
    args = ap.parse_args()
    register()
    spec = spec_of(args.drafter)
    source = models.source(args.target)
    target_gguf = models.gguf_file(args.target)
    if target_gguf is None:
        raise SystemExit(f"{args.target}: a GGUF target (the file llama-server serves) is needed here")
    target, _ = load_target(source, device=torch.device("cpu"))
    resolved = resolve_specs([spec], source, "llamacpp")[0]
    args.out.mkdir(parents=True, exist_ok=True)
    served = llama_cpp_drafter(resolved, target, source, args.out / "converted")
    drafters = "[{" + ", ".join(f"{k}: {v}" for k, v in spec.items() if v is not None) + "}]"
    common = [f"target.name={args.target_name}", f"target.name_or_path={args.target}", "data=jsonl",
              f"data.path={args.data}", f"data.max_prompts_per_category={args.prompts}", f"ks=[{args.k}]",
              f"max_new_tokens={args.max_new_tokens}", f"repeats={args.repeats}", f"threads={args.threads}",
              f"drafters={drafters}"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        llama_cfg = compose(config_name="eval", overrides=[*common, "engine=llamacpp", f"out_dir={args.out / 'llamacpp'}"])
        ctx = 4096
        with llama_cpp.LlamaServer(target_gguf, draft=served.gguf, spec_type=served.spec_type, k=args.k,
                                   threads=args.threads, ctx_size=ctx) as spec_server, \
                llama_cpp.LlamaServer(target_gguf, threads=args.threads, ctx_size=ctx) as plain_server:
            api_cfg = compose(config_name="eval", overrides=[
                *common, "engine=openai", f"engine.spec_url={spec_server.url}/v1",
                f"engine.plain_url={plain_server.url}/v1", f"engine.drafter={spec['name']}", f"engine.k={args.k}",
                f"out_dir={args.out / 'openai'}",
                *(["engine.extra_body={cache_prompt: false}"] if args.no_prompt_cache else [])])
            api = entry.run(api_cfg)
    llama = entry.run(llama_cfg)
    theirs = {r["category"]: r for r in llama["results"]}
    print("\n| category | τ draftsmith | τ /metrics (openai) | τ logged (llamacpp) | ratio | lossless openai / llamacpp "
          "| speed-up openai | speed-up llamacpp | verdict openai | verdict llamacpp |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in api["results"]:
        other = theirs[r["category"]]
        ratio = r["engine_acceptance_length"] / other["engine_acceptance_length"]
        print(f"| {r['category']} | {r['acceptance_length']:.2f} | {r['engine_acceptance_length']:.3f} | "
              f"{other['engine_acceptance_length']:.3f} | {ratio:.4f} | {r['engine_lossless']} / {other['engine_lossless']} "
              f"| {r['engine_speedup']:.2f} | {other['engine_speedup']:.2f} | {r['engine_verdict']} | {other['engine_verdict']} |")
    (args.out / "summary.json").write_text(json.dumps({"openai": api["results"], "llamacpp": llama["results"]},
                                                      indent=1, default=str))
    print(f"\nreports: {args.out / 'openai' / 'report.md'}, {args.out / 'llamacpp' / 'report.md'}")


if __name__ == "__main__":
    stop_on_sigterm()
    main()
