"""One drafting step of a draft LM: the Hugging Face forward against the lean decode path (docs/benchmarks/toy-drafters.md).

    python scripts/bench_draft_step.py                       # the toy world's off-the-shelf draft and target
    python scripts/bench_draft_step.py --draft DIR --target DIR --context 512
    python scripts/bench_draft_step.py --eagle runs/bench_heads/eagle/best   # also an EAGLE-3 head's layer
    python scripts/bench_draft_step.py --draft runs/bench_heads/draft_lm_sft/best --eagle runs/bench_heads/eagle/best
    python scripts/bench_draft_step.py --eagle runs/bench_heads/eagle/best --draft-layers 3   # a deeper draft's cost

A step feeds one token on top of a cached context, as drafting does. The two paths alternate in
blocks, so machine noise hits both alike; medians are reported, and each draft step also as a share of
one target step through the Hugging Face forward (the target's cost in the loop), which is the cost
ratio c a drafter contributes. With `--eagle`, the table adds a trained EAGLE-3 head's decoder layer
on the same context, through its training-path forward (module calls, separate q/k/v and gate/up
matmuls) and through `decode`, the fused path drafting uses, and whole drafting rounds of the head and
of the draft LM (propose k = 4 greedily, then commit 2 accepted and a correction, as the loop does;
`--accepted N` commits N instead, so the next round's first step feeds N + 1 entries),
alone and with a 5-token target forward before each round, as verification runs between rounds.
`--draft-layers N` times, in place of the draft, a randomly initialised model of its width and N layers:
what a draft of another depth would cost (a step's time does not depend on the weights' values).
`--eagle-intermediate N,M` adds rounds of the same head with its MLP narrowed to N (then M) units, the
MLP randomly initialised: what a cheaper head would cost.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from drafters.draft_lm import DraftLM
from drafters.heads import features_of
from drafters.registry import load_head
from drafters.hf_cache import cache_keyword
from drafters.kv_cache import KVCache
from drafters.llama_decode import LeanLlama
from drafters.sampling import Sampling
from eval.speculative import rollback
from traffic import models


def hf_steps(model, context: torch.Tensor, n: int) -> list[float]:
    cache = DynamicCache()
    kw = {cache_keyword(model): cache}
    model(input_ids=context[None], **kw, use_cache=True, logits_to_keep=1)
    token, times = torch.tensor([[7]]), []
    for _ in range(n):
        t0 = time.perf_counter()
        model(input_ids=token, **kw, use_cache=True, logits_to_keep=1)
        times.append(time.perf_counter() - t0)
        rollback(cache, context.numel())  # stay at the same length: every step costs the same
    return times


def lean_steps(model, context: torch.Tensor, n: int) -> list[float]:
    lean = LeanLlama(model)
    lean.forward(context)
    token, times = torch.tensor([7]), []
    for _ in range(n):
        t0 = time.perf_counter()
        lean.forward(token)
        times.append(time.perf_counter() - t0)
        lean.crop(context.numel())
    return times


def eagle_layer_steps(fused: bool):
    """One EAGLE-3 layer step (embedding, RoPE and the output head excluded: the same on both paths)."""
    def run(head, context: torch.Tensor, n: int) -> list[float]:
        length = context.numel()
        hidden = torch.randn(1, length, head.config.hidden_size, generator=torch.Generator().manual_seed(0))
        cache = KVCache()
        head.step(hidden, context, 0, cache)
        h, layer = hidden[:, -1:], head.midlayer
        cos, sin = head.rotary(h, length, 1)
        cos_d, sin_d = head.rotary.decode(h, length, 1)  # the drafting path's form of the same values
        embeds = head.shared.embed_tokens(context[None, -1:], h.dtype)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            if fused:
                layer.decode(embeds, h, cos_d, sin_d, None, cache)
            else:
                layer(embeds, h, cos, sin, None, cache=cache)
            times.append(time.perf_counter() - t0)
            cache.crop(length)
        return times
    return run


def drafting_rounds(target, verify_between: bool, accepted: int = 2):
    """Rounds of propose(k=4) then commit(`accepted`, a correction) over the context's second half,
    restarting from its first half when it runs out; optionally a 5-token target forward (rolled back)
    before each round. The drafter is a DraftLM or a head's drafter (which reads the target's features)."""
    def run(drafter, context: torch.Tensor, n: int) -> list[float]:
        half, greedy = context.numel() // 2, Sampling()
        feats = None
        if hasattr(drafter, "feature_layers"):
            out = target(input_ids=context[None], output_hidden_states=True)
            feats = features_of(out.hidden_states, drafter.feature_layers)[0]
        cache = DynamicCache()
        target(input_ids=context[None, :half], **{cache_keyword(target): cache}, use_cache=True, logits_to_keep=1)

        def start() -> int:
            drafter.start(context[:half], *([] if feats is None else [feats[: half - 1]]))
            return half

        pos, times = start(), []
        for _ in range(n):
            if verify_between:
                target(input_ids=context[None, half: half + 5], **{cache_keyword(target): cache}, use_cache=True,
                       output_hidden_states=feats is not None)
                rollback(cache, half)
            t0 = time.perf_counter()
            drafter.propose(4, greedy)
            times.append(time.perf_counter() - t0)
            token = int(context[pos + accepted])
            if feats is None:
                drafter.commit(accepted, token)
            else:
                drafter.commit(accepted, token, feats[pos - 1: pos + accepted])
            pos += accepted + 1
            if pos + accepted + 1 >= context.numel():
                pos = start()
        return times
    return run


def narrowed(head, width: int, target):
    """The head with its decoder layer's MLP `width` units wide (MLP weights randomly initialised, the
    rest copied): for timing only."""
    config = copy.deepcopy(head.config)
    config.intermediate_size = width
    torch.manual_seed(0)
    narrow = type(head)(config)
    missing, unexpected = narrow.load_state_dict({k: v for k, v in head.state_dict().items() if ".mlp." not in k},
                                                 strict=False)
    if unexpected or any(".mlp." not in k for k in missing):
        raise RuntimeError(f"narrowing the MLP: missing {missing}, unexpected {unexpected}")
    narrow.attach(target)
    return narrow.eval()


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", default="toyworld://toy/draft")
    ap.add_argument("--target", default="toyworld://toy/target")
    ap.add_argument("--context", type=int, default=128, help="tokens already in the cache")
    ap.add_argument("--steps", type=int, default=200, help="steps per block")
    ap.add_argument("--blocks", type=int, default=5, help="alternating blocks per path")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--eagle", default=None, help="a saved EAGLE-3 head for the target: time its layer too")
    ap.add_argument("--eagle-intermediate", default=None,
                    help="comma-separated MLP widths: also time rounds of the --eagle head with a narrower MLP")
    ap.add_argument("--accepted", type=int, default=2, choices=range(0, 5),
                    help="guesses committed after each round (0..4): the next round's first step feeds this + 1 entries")
    ap.add_argument("--draft-layers", type=int, default=None,
                    help="time a randomly initialised draft of the same width with this many layers instead")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    draft = AutoModelForCausalLM.from_pretrained(models.resolve(args.draft)).eval()
    if args.draft_layers:
        config = copy.deepcopy(draft.config)
        config.num_hidden_layers = args.draft_layers
        torch.manual_seed(0)
        draft = AutoModelForCausalLM.from_config(config).eval()
    target = AutoModelForCausalLM.from_pretrained(models.resolve(args.target)).eval()
    vocab = min(draft.config.vocab_size, target.config.vocab_size)
    context = torch.randint(3, vocab, (args.context,), generator=torch.Generator().manual_seed(0))
    runs = {"target, Hugging Face forward": (hf_steps, target), "draft, Hugging Face forward": (hf_steps, draft),
            "draft, lean path": (lean_steps, draft), "target, lean path": (lean_steps, target)}
    if args.eagle:
        head = load_head(models.resolve(args.eagle), target)
        if not hasattr(head, "midlayer"):
            raise SystemExit(f"--eagle {args.eagle}: not an EAGLE-3 head (config.json draftsmith_kind "
                             f"{head.config.draftsmith_kind!r})")
        runs["EAGLE-3 layer, forward"] = (eagle_layer_steps(False), head)
        runs["EAGLE-3 layer, fused decode"] = (eagle_layer_steps(True), head)
        runs["EAGLE-3 round"] = (drafting_rounds(target, False, args.accepted), head.drafter("eagle"))
        runs["draft round, lean path"] = (drafting_rounds(target, False, args.accepted), DraftLM(draft))
        runs["EAGLE-3 round after target"] = (drafting_rounds(target, True, args.accepted), head.drafter("eagle"))
        runs["draft round after target"] = (drafting_rounds(target, True, args.accepted), DraftLM(draft))
        for width in (int(w) for w in args.eagle_intermediate.split(",")) if args.eagle_intermediate else ():
            runs[f"EAGLE-3 round, MLP {width}, after target"] = (drafting_rounds(target, True, args.accepted),
                                                                 narrowed(head, width, target).drafter("eagle"))
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn, model in runs.values():  # warm-up: allocator, kernels
        fn(model, context, 20)
    for _ in range(args.blocks):
        for name, (fn, model) in runs.items():
            times[name] += fn(model, context, args.steps)
    median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    base = median["target, Hugging Face forward"]
    print(f"one decoding step (rounds: one propose of k = 4, then {args.accepted} accepted) on a {args.context}-token context, "
          f"{torch.get_num_threads()} threads, median of {args.blocks} x {args.steps} per path (alternating blocks)")
    print(f"draft: {draft.config.num_hidden_layers} layers, hidden size {draft.config.hidden_size}"
          + (" (randomly initialised: --draft-layers)" if args.draft_layers else ""))
    print(f"{'path':<32}{'ms':>8}{'vs target (HF)':>16}")
    for name, ms in median.items():
        print(f"{name:<32}{ms:>8.3f}{ms / base:>15.3f}x")
    print(f"draft: the lean path takes {median['draft, lean path'] / median['draft, Hugging Face forward']:.2f} "
          f"of the Hugging Face forward's time")
    if args.eagle:
        print(f"EAGLE-3 layer: the fused decode takes "
              f"{median['EAGLE-3 layer, fused decode'] / median['EAGLE-3 layer, forward']:.2f} of the forward's time")
        print(f"EAGLE-3 round / draft round: {median['EAGLE-3 round'] / median['draft round, lean path']:.2f} alone, "
              f"{median['EAGLE-3 round after target'] / median['draft round after target']:.2f} after a target forward")
        for name in (n for n in median if ", MLP " in n):
            print(f"{name} / draft round after target: {median[name] / median['draft round after target']:.2f}")


if __name__ == "__main__":
    main()
