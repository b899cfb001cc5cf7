"""The speculative decoding loop, and plain decoding to compare it with.

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"). The prompt's own
forward gives the first new token, as in the serving engines (vLLM, SGLang, llama.cpp); then rounds:

1. The drafter proposes n <= k tokens x_1..x_n (with the distributions q_i it drew them from).
2. The target scores the last committed token and all n guesses in ONE forward of n+1 positions,
   giving p_1..p_{n+1}, on top of its KV cache of the committed prefix.
3. Guess i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), in order, until the first
   rejection (greedy: accepted while it equals argmax p_i).
4. At the first rejection j the target adds a token drawn from normalize(max(0, p_j - q_j)); if all n
   passed, it adds a bonus token drawn from p_{n+1}. A round therefore yields accepted + 1 tokens.
5. Rollback: the target's cache is cropped to the committed prefix (it never recomputes it), and the
   drafter is told how many guesses were kept so it can crop its own state.

The output distribution is exactly the target's (tests/eval/test_speculative.py checks greedy
equality token for token and sampled outputs against the target's distribution).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from drafters.base import Drafter, Proposal
from drafters.heads import features_of
from drafters.hf_cache import cache_keyword, keep_path, tree_attention_mask
from drafters.sampling import Sampling, choose, probs_from_logits
from drafters.tree import StaticTree, Tree, TreeShape, accept_path, depths


@dataclass
class Round:
    """One draft-then-verify round: how many guesses were proposed and kept, and what it cost: drafting,
    verification (the target's forward and the acceptance test), and the whole round (both, plus the
    rollback and the bookkeeping until the next round starts; None where not timed)."""

    proposed: int
    accepted: int
    draft_s: float
    verify_s: float
    round_s: float | None = None
    depth: int | None = None  # a tree's depth (`proposed` is then its nodes); None for a chain


@dataclass
class Generation:
    """The new tokens of one generation and, for speculative decoding, its rounds."""

    tokens: list[int]
    seconds: float
    target_forwards: int  # the prompt's forward included
    rounds: list[Round] = field(default_factory=list)
    # Plain decoding: one entry per decoding step, the whole step (choosing the token, the target's 1-token
    # forward and the bookkeeping); the first token comes from the prefill.
    step_s: list[float] = field(default_factory=list)
    # The time from the start to the first decoding step or round: the target's prefill, its first token,
    # and (speculative decoding) the drafter's start on the prompt. None where not timed. Batched decoding
    # (eval/batching.py): `seconds` and `prefill_s` are the prompt's shares of the batch's time.
    prefill_s: float | None = None


def _sync(device: torch.device) -> None:
    # Kernels run asynchronously on accelerators; wall-clock timing of a phase needs them finished.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _since(start: float, device: torch.device, timed: bool) -> float | None:
    """Seconds since `start` with the device's work finished, for a timed loop; None when not timed."""
    if not timed:
        return None
    _sync(device)
    return time.perf_counter() - start


def accept_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy acceptance: keep guesses while they equal the target's argmax.

    draft_tokens: (n,); target_logits: (n+1, V). Returns (accepted, next token), where the next token
    is the target's argmax after the last kept guess (its correction, or the bonus token).
    """
    target_tokens = target_logits.argmax(-1)  # (n+1,)
    n = draft_tokens.numel()
    accepted = (draft_tokens == target_tokens[:n]).int().cumprod(0).sum()  # 0-d, stays on device
    # One host sync per round: read both numbers together.
    a, token = torch.stack([accepted, target_tokens[accepted]]).tolist()
    return a, token


def accept_sampled(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Lossless stochastic acceptance (steps 3-4 of the module docstring), vectorised, one host sync.

    draft_tokens: (n,); draft_probs: (n, V) or None for deterministic guesses (one-hot q);
    target_probs: (n+1, V), already processed by the same `Sampling` as the draft's.
    Returns (accepted, next token).
    """
    n = draft_tokens.numel()
    idx = torch.arange(n, device=target_probs.device)
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_tokens, target_probs.shape[-1]).to(target_probs.dtype)
    p_x = target_probs[idx, draft_tokens]  # (n,)
    q_x = draft_probs[idx, draft_tokens]  # (n,)
    u = torch.rand(n, device=target_probs.device, generator=generator)
    # Accept iff u < p/q, written as u*q < p to avoid dividing by a zero q (a guess q could not draw).
    accepted = (u * q_x < p_x).int().cumprod(0).sum()  # 0-d
    # The distribution of the target's token for every possible outcome: the residual
    # normalize(max(0, p_i - q_i)) after a rejection at i, or p_{n+1} (the bonus) after none.
    residual = (target_probs[:n] - draft_probs).clamp_min(0)
    total = residual.sum(-1, keepdim=True)
    # Numerical guard: a rejection implies p != q, so the residual has mass; if rounding ate it all,
    # p is the right fallback (what the residual tends to as p - q -> 0 elementwise).
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), target_probs[:n])
    outcomes = torch.cat([residual, target_probs[n:]])  # (n+1, V)
    token = torch.multinomial(outcomes[accepted], 1, generator=generator)[0]
    a, t = torch.stack([accepted, token]).tolist()
    return a, t


def rollback(cache: DynamicCache, keep: int) -> None:
    """Drop cached positions beyond the first `keep` (transformers 5: crop takes a negative count)."""
    cache.crop(keep - cache.get_seq_length())


def _forward(model: PreTrainedModel, ids: list[int], cache: DynamicCache, device: torch.device, keep_logits: int):
    inputs = torch.tensor([ids], device=device)
    out = model(input_ids=inputs, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=keep_logits)
    return out.logits[0]


def _forward_with_features(model, ids, cache, device, keep_logits, layers):
    """Logits and, for drafters that read them, the hidden states at `layers` of every fed position:
    (logits (keep, V), features (len(ids), len(layers), d))."""
    inputs = torch.tensor([ids], device=device)
    out = model(input_ids=inputs, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=keep_logits,
                output_hidden_states=True)
    return out.logits[0], features_of(out.hidden_states, layers)[0]


def _forward_tree(model, last: int, tree: Tree, cache, device, layers):
    """The target's logits (n+1, V) after the root and each node of `tree`, in one forward on top of `cache`
    (drafters/tree.py: each entry sees the prefix and its ancestors, at position prefix + depth), and with
    `layers` the features of every fed entry (n+1, len(layers), d)."""
    past = cache.get_seq_length()
    ids = torch.tensor([[last, *tree.tokens.tolist()]], device=device)
    positions = past + torch.cat([tree.parents.new_zeros(1), depths(tree.parents)]).to(device)[None]
    out = model(input_ids=ids, attention_mask=tree_attention_mask(model, past, tree.parents, device),
                position_ids=positions, **{cache_keyword(model): cache}, use_cache=True,
                output_hidden_states=bool(layers))
    return out.logits[0], (features_of(out.hidden_states, layers)[0] if layers else None)


def _finish(new: list[int], max_new_tokens: int, eos_token_id: int | None) -> tuple[list[int], bool]:
    """Cut new tokens at the budget and after the first EOS; say whether generation is over."""
    if eos_token_id is not None and eos_token_id in new:
        return new[: new.index(eos_token_id) + 1][:max_new_tokens], True
    return new[:max_new_tokens], len(new) >= max_new_tokens


@torch.inference_mode()
def speculative_generate(
    target: PreTrainedModel,
    drafter: Drafter,
    prompt_ids: torch.Tensor,
    *,
    k: int,
    sampling: Sampling,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    timed: bool = False,
    tree: TreeShape | StaticTree | None = None,
) -> Generation:
    """Generate up to max_new_tokens after prompt_ids (T,) with drafter proposals verified by target.

    With `timed`, each round's draft and verify phases are timed separately (device synchronised), so
    the cost ratio c and the verification overhead can be measured in the same run.

    With `tree`, each round drafts a tree of that shape (EAGLE-2's dynamic tree, or a static one) instead of
    a chain of k (`drafter.propose_tree`), the target verifies all its nodes in one forward (a tree mask on its KV
    cache), keeps the longest path the acceptance rule allows (drafters/tree.py `accept_path`, lossless
    greedy and sampled), gathers that path's cache entries in place and tells the drafter the path
    (`drafter.commit_path`). A round's `proposed` is then the nodes verified, `depth` the tree's.
    """
    if tree is not None:
        if not hasattr(drafter, "propose_tree"):
            raise ValueError(f"drafter {drafter.name!r} drafts chains only: a tree ({tree.label}) needs a drafter "
                             "with propose_tree (EAGLE-3, EAGLE-1 heads and draft LMs)")
        k = tree.depth
    if k < 1:
        raise ValueError(f"k (draft tokens per round) must be >= 1, got {k}")
    if prompt_ids.numel() == 0:
        raise ValueError("the prompt is empty: speculative decoding needs at least one token to start from")
    device = prompt_ids.device
    clock = time.perf_counter
    t_start = clock()
    prompt = prompt_ids.tolist()
    cache = DynamicCache()
    # Drafters that read the target's hidden states (EAGLE, MTP, Medusa heads) name the layers; the
    # target then returns them with its logits and the drafter gets those of committed positions.
    layers = getattr(drafter, "feature_layers", None)
    # Prefill the whole prompt and take the first new token from its forward, as serving engines do
    # (vLLM, SGLang, llama.cpp): drafting starts after it, and every round then feeds exactly one
    # committed token (the last one) followed by the guesses, one forward of n+1 positions.
    if layers:
        logits, features = _forward_with_features(target, prompt, cache, device, 1, layers)
    else:
        logits, features = _forward(target, prompt, cache, device, keep_logits=1), None
    first = int(choose(logits[-1], sampling, generator).item())
    forwards = 1
    new, done = _finish([first], max_new_tokens, eos_token_id)
    if done:
        _sync(device)
        return Generation(new, clock() - t_start, forwards)
    # The drafter reads the prompt and the first token; a head also the features of every position but
    # that last one (the prompt's), as it pairs the features at position i with the token at i + 1.
    committed = torch.cat([prompt_ids, prompt_ids.new_tensor([first])])
    if layers:
        drafter.start(committed, features)
    else:
        drafter.start(committed)
    last, length = first, len(prompt) + 1  # the last committed token, and how many are committed
    rounds: list[Round] = []
    prefill_s = _since(t_start, device, timed)
    while True:
        if timed:
            _sync(device)
        t0 = clock()
        if tree is not None:
            done, last, length, new = _tree_round(target, drafter, tree, sampling, generator, cache, device, layers,
                                                  last, length, new, rounds, max_new_tokens, eos_token_id, timed, t0)
            forwards += 1
            if done:
                break
            continue
        proposal: Proposal = drafter.propose(k, sampling, generator)
        if len(proposal) > k:
            raise RuntimeError(f"drafter {drafter.name!r} proposed {len(proposal)} tokens, more than k={k}")
        if timed:
            _sync(device)
        t1 = clock()
        guesses = proposal.tokens.tolist()
        if layers:
            logits, features = _forward_with_features(target, [last, *guesses], cache, device, len(guesses) + 1,
                                                      layers)
        else:
            logits = _forward(target, [last, *guesses], cache, device, keep_logits=len(guesses) + 1)
        forwards += 1
        if sampling.greedy:
            accepted, next_token = accept_greedy(proposal.tokens, logits)
        else:
            target_probs = probs_from_logits(logits, sampling)
            accepted, next_token = accept_sampled(proposal.tokens, proposal.probs, target_probs, generator)
        t2 = clock()
        # Kept: the accepted guesses the answer emits, as llama.cpp counts them; none after an accepted
        # end-of-answer token (the target confirms guesses past it, which are never emitted) or the budget.
        kept = accepted
        if eos_token_id is not None and eos_token_id in guesses[:accepted]:
            kept = guesses.index(eos_token_id) + 1
        kept = min(kept, max_new_tokens - len(new))
        # The cache now holds the committed tokens and all guesses; keep the committed and the accepted.
        rollback(cache, length + accepted)
        if layers:  # features of the committed positions: the last token and the kept guesses
            drafter.commit(accepted, next_token, features[: accepted + 1])
        else:
            drafter.commit(accepted, next_token)
        step = guesses[:accepted] + [next_token]
        new, done = _finish(new + step, max_new_tokens, eos_token_id)
        rounds.append(Round(len(guesses), kept, t1 - t0, t2 - t1, _since(t0, device, timed)))
        if done:
            break
        last, length = next_token, length + len(step)
    _sync(device)
    return Generation(new, clock() - t_start, forwards, rounds, prefill_s=prefill_s)


def _tree_round(target, drafter, shape: TreeShape | StaticTree, sampling, generator, cache, device, layers, last,
                length, new, rounds, max_new_tokens, eos_token_id, timed, t0):
    """One round of tree drafting and verification (`speculative_generate` with `tree`). Returns (done, the last
    committed token, how many are committed, the new tokens so far) and appends the round."""
    clock = time.perf_counter
    proposal: Tree = drafter.propose_tree(shape, sampling, generator)
    if timed:
        _sync(device)
    t1 = clock()
    logits, features = _forward_tree(target, last, proposal, cache, device, layers)
    probs = logits if sampling.greedy else probs_from_logits(logits, sampling)
    path, next_token = accept_path(proposal, probs, greedy=sampling.greedy, generator=generator)
    t2 = clock()
    guesses = proposal.tokens[path].tolist()
    kept = len(path)
    if eos_token_id is not None and eos_token_id in guesses:
        kept = guesses.index(eos_token_id) + 1
    kept = min(kept, max_new_tokens - len(new))
    # The cache holds the committed prefix, the root and every node; keep the root and the path, in order.
    entries = [0, *(p + 1 for p in path)]
    keep_path(cache, length - 1, entries)
    if layers:
        drafter.commit_path(path, next_token, features[entries])
    else:
        drafter.commit_path(path, next_token)
    new, done = _finish(new + guesses + [next_token], max_new_tokens, eos_token_id)
    rounds.append(Round(len(proposal), kept, t1 - t0, t2 - t1, _since(t0, device, timed), depth=shape.depth))
    return done, next_token, length + len(guesses) + 1, new


@torch.inference_mode()
def autoregressive_generate(
    target: PreTrainedModel,
    prompt_ids: torch.Tensor,
    *,
    sampling: Sampling,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    timed: bool = False,
) -> Generation:
    """Plain target-only decoding with a KV cache, one token per forward: the reference and the baseline."""
    if prompt_ids.numel() == 0:
        raise ValueError("the prompt is empty: decoding needs at least one token to start from")
    device = prompt_ids.device
    clock = time.perf_counter
    t_start = clock()
    cache = DynamicCache()
    logits = _forward(target, prompt_ids.tolist(), cache, device, keep_logits=1)[-1]
    new: list[int] = []
    steps: list[float] = []
    forwards = 1
    prefill_s = _since(t_start, device, timed)
    while True:
        t0 = clock()  # a step: choose the token, then the forward that gives the next one's logits
        token = int(choose(logits, sampling, generator).item())
        new.append(token)
        if len(new) >= max_new_tokens or token == eos_token_id:
            break
        logits = _forward(target, [token], cache, device, keep_logits=1)[-1]
        if timed:
            _sync(device)
            steps.append(clock() - t0)
        forwards += 1
    _sync(device)
    return Generation(new, clock() - t_start, forwards, step_s=steps, prefill_s=prefill_s)
