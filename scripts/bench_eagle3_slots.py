"""llama.cpp's EAGLE-3 acceptance with one slot and with several: the minimal reproduction behind
docs/benchmarks/smollm2.md. Unpatched, its acceptance fell when requests decoded together (its draft models' did not): the draft
context's top-k samplers shared one buffer (eval/engines/llama_cpp_patches/eagle3-backend-sampler-outputs.patch).

    python scripts/bench_eagle3_slots.py --target pypi://smollm2 --head runs/demo-real/run2/export/gguf/eagle3.gguf \
        --prompts runs/real_traffic/eval.jsonl [--slots 4] [--k 4] [--threads 2]

The same prompts, greedy, 64 new tokens each, served by llama-server with the head (`--spec-type draft-eagle3`):
one slot; `--slots` slots with the requests sent one at a time; the same slots with the requests sent together;
and together with a unified KV cache (`-kvu`). τ is 1 + accepted drafts per verification from the server's own
`statistics` log line; each configuration also says whether its outputs equal the one-slot outputs.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from transformers import AutoTokenizer

from eval.engines import llama_cpp
from eval.engines.engine import stop_on_sigterm
from eval.engines.llama_cpp_measure import _STATS, _counters
from traffic import models


def serve(target: Path, head: str, prompts: list[list[int]], *, slots: int, together: bool, k: int, threads: int,
          log: Path, extra: tuple[str, ...] = ()) -> tuple[float, list[list[int]]]:
    server = llama_cpp.LlamaServer(target, draft=head, spec_type="draft-eagle3", k=k, parallel=slots, ctx_size=1024,
                                   threads=threads, log_verbosity=4, log_file=log)
    command = server.command
    server.command = lambda port: command(port) + list(extra)
    with server:
        if together:
            with ThreadPoolExecutor(slots) as pool:
                outs = list(pool.map(lambda p: server.complete(p, 64), prompts))
        else:
            outs = [server.complete(p, 64) for p in prompts]
        time.sleep(1)  # the statistics of the last request are logged as its slot is released
    stats = _counters(_STATS.findall(log.read_text())[-1])
    return 1 + stats.accepted / stats.verifications, [o.tokens for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="a GGUF file or pypi://<real model>")
    ap.add_argument("--head", required=True, help="the EAGLE-3 head's GGUF (python -m train.export formats=[gguf])")
    ap.add_argument("--prompts", required=True, help="chat records (JSONL); every tenth of the first 80 is served")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--logs", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    target = models.gguf_file(args.target)
    tok = AutoTokenizer.from_pretrained(models.resolve(args.target))
    records = [json.loads(line) for line in open(args.prompts)][:80:10]
    prompts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
               for r in records]
    runs = [("1 slot", 1, False, ()), (f"{args.slots} slots, one request at a time", args.slots, False, ()),
            (f"{args.slots} slots, requests together", args.slots, True, ()),
            (f"{args.slots} slots, requests together, -kvu", args.slots, True, ("-kvu",))]
    reference = None
    for name, slots, together, extra in runs:
        log = args.logs / f"eagle3-slots-{slots}-{'together' if together else 'one'}{''.join(extra)}.log"
        tau, outputs = serve(target, args.head, prompts, slots=slots, together=together, k=args.k,
                             threads=args.threads, log=log, extra=extra)
        reference = reference or outputs
        print(f"{name:<42} tau {tau:.2f}   outputs equal the 1-slot outputs: {outputs == reference}", flush=True)


if __name__ == "__main__":
    stop_on_sigterm()
    main()
