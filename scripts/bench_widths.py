"""What one target forward costs by the positions it takes, in each dtype: the shape of β (a verification of k
guesses takes k + 1 positions) and of a parallel drafter's round on this machine (docs/benchmarks/parallel-drafting.md).

    python scripts/bench_widths.py                                         # the toy world's target
    python scripts/bench_widths.py --target pypi://smollm2 --dtypes float32,bfloat16 --context 256

Each width w feeds w tokens on top of a cached context of `--context` tokens and is rolled back, as a verification
does; widths alternate in blocks so machine noise hits each alike, and medians are reported. Beside the whole forward,
the output head's matrix product alone (w rows of the hidden size against the vocabulary), where a CPU's BLAS shows
its shape most plainly: on some CPUs a float32 product of 2 or 3 rows costs 2 or 3 single rows while 4 or 5 cost
about 1.5, which makes a round of 2 guesses dearer than one of 4 in draftsmith's float32 loop.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from drafters.hf_cache import cache_keyword
from eval.run import dtype_of, load_target
from eval.speculative import rollback


def forward_times(model, context: torch.Tensor, widths: list[int], blocks: int, per_block: int) -> dict[int, list]:
    """Seconds of one forward of w positions on top of `context`, for each width, interleaved in blocks."""
    cache = DynamicCache()
    kw = {cache_keyword(model): cache}
    with torch.inference_mode():
        model(input_ids=context[None], **kw, use_cache=True, logits_to_keep=1)
        times: dict[int, list] = {w: [] for w in widths}
        for _ in range(blocks):
            for w in widths:
                ids = torch.full((1, w), 7)
                for _ in range(per_block):
                    t0 = time.perf_counter()
                    model(input_ids=ids, **kw, use_cache=True, logits_to_keep=w)
                    times[w].append(time.perf_counter() - t0)
                    rollback(cache, context.numel())
    return times


def head_times(weight: torch.Tensor, widths: list[int], blocks: int, per_block: int) -> dict[int, list]:
    """Seconds of the output head's product for w rows, for each width, interleaved in blocks."""
    times: dict[int, list] = {w: [] for w in widths}
    with torch.inference_mode():
        for _ in range(blocks):
            for w in widths:
                x = torch.randn(w, weight.shape[1], dtype=weight.dtype)
                for _ in range(per_block):
                    t0 = time.perf_counter()
                    torch.nn.functional.linear(x, weight)
                    times[w].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="toyworld://toy/target")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16, float16")
    ap.add_argument("--widths", default="1,2,3,4,5,6,7,8,9", help="positions per forward, comma-separated")
    ap.add_argument("--context", type=int, default=256, help="cached tokens the forwards sit on")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--per-block", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    if 1 not in widths:
        widths = [1, *widths]  # every figure is a ratio to one position
    print(f"target {args.target}, context {args.context}, {torch.get_num_threads()} threads; medians of "
          f"{args.blocks * args.per_block} forwards a width, as a multiple of one position's (1 + β for a verification)")
    print("\n| dtype | part | " + " | ".join(f"{w}" for w in widths) + " | one position |")
    print("|---|---|" + "---|" * len(widths) + "---|")
    for name in args.dtypes.split(","):
        dtype_of(name)
        model, _ = load_target(args.target, device=torch.device("cpu"), dtype=name)
        context = torch.randint(0, model.config.vocab_size, (args.context,),
                                generator=torch.Generator().manual_seed(0))
        for part, times in (
                ("forward", forward_times(model, context, widths, args.blocks, args.per_block)),
                ("output head", head_times(model.get_output_embeddings().weight.detach(), widths, args.blocks,
                                           args.per_block))):
            med = {w: statistics.median(t) for w, t in times.items()}
            cells = " | ".join(f"{med[w] / med[1]:.2f}" for w in widths)
            print(f"| {name} | {part} | {cells} | {med[1] * 1e3:.2f} ms |", flush=True)


if __name__ == "__main__":
    main()
