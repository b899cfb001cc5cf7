"""What the parallel drafters share (DFlash, P-EAGLE, PARD: k guesses in one forward from mask tokens): the mask
token they carry, the training chains drawn by conditional drop with the mask that lets each entry see what it will
see when drafting, and a round's proposal cut by a confidence stop.

A training chain at anchor a is the entry at a (depth 0: the real context through a) followed by mask entries at
depths 1, 2, … (positions a + 1, a + 2, …), each standing for the token it is trained to guess. Depth d keeps a
share of the anchors, each drawn among depth d - 1's (`draw_chains`), so every kept chain is whole; entry (a, d)
sees the depth-0 entries through a and its own chain through d (`chain_mask`), exactly the causal view of mask d
drafting after a. P-EAGLE (drafters/peagle.py) and PARD (drafters/pard.py) train on these rows; DFlash trains
blocks of its own (drafters/dflash.py).
"""

from __future__ import annotations

import re

import torch

# The conditional drop P-EAGLE and PARD train with by default (speculators' P-EAGLE recipe and PARD's): depth d keeps
# max(COD_RATIO ** d, COD_MIN_RATIO) of the anchors, drawn from at most MAX_ANCHORS a sequence.
COD_RATIO, COD_MIN_RATIO, MAX_ANCHORS = 0.7, 0.2, 512


def mask_token_for(tokenizer, vocab_size: int) -> int:
    """The token a parallel drafter's masked positions carry (DFlash's block, P-EAGLE's and PARD's mask entries), as
    SpecForge picks DFlash's: the tokenizer's mask token, else the first row of the embedding matrix no token uses (a
    model's vocabulary is often padded past its tokenizer), else the pad, end-of-sequence or unknown token. Its row of
    the target's (frozen) embedding is what the engines embed.

    A tokenizer read from a GGUF file lists the padding rows too: llama.cpp's converter names each unused row i
    `[PAD<i>]` (token type UNUSED), so that `len(tokenizer)` covers the whole embedding. The first such row is the
    unused one here, the same id the model's Hugging Face tokenizer gives (Qwen2.5: 151665), where a text token such as
    `<|endoftext|>` would be read as one the drafter has seen in training."""
    candidates = [tokenizer.mask_token_id, len(tokenizer) if len(tokenizer) < vocab_size else None,
                  unused_row(tokenizer, vocab_size), tokenizer.pad_token_id, tokenizer.eos_token_id,
                  tokenizer.unk_token_id]
    found = next((c for c in candidates if c is not None and 0 <= c < vocab_size), None)
    if found is None:
        raise ValueError("a parallel drafter needs a mask token: the tokenizer has none, no unused embedding row, and "
                         "no pad, end-of-sequence or unknown token; set drafter.mask_token_id")
    return int(found)


_PADDING_ROW = re.compile(r"\[PAD(\d+)\]")


def unused_row(tokenizer, vocab_size: int) -> int | None:
    """The first row a GGUF vocabulary marks as padding (`[PAD<i>]` at id i, llama.cpp's converter's name for the
    rows past the tokenizer), or None."""
    rows = [i for token, i in tokenizer.get_vocab().items()
            if i < vocab_size and (m := _PADDING_ROW.fullmatch(token)) and int(m.group(1)) == i]
    return min(rows, default=None)


def draw_chains(reads: torch.Tensor, n_entries: int, depths: int, ratio: float, min_ratio: float, max_anchors: int,
                keep_all: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's entries (anchors, depths): every entry 0..n_entries-1 at depth 0, then depth d's chains, drawn by
    conditional drop among depth d-1's anchors a whose token reads[a + d] the loss reads (speculators' and PARD's
    sizes: int((n - d) * max(ratio ** d, min_ratio)) of the n seeds, at most `max_anchors` of them). `keep_all`:
    every chain (a held-out evaluation)."""
    device = reads.device
    seeds = reads[:n_entries].nonzero()[:, 0]
    if seeds.numel() > max_anchors and not keep_all:
        seeds = seeds[torch.randperm(seeds.numel(), device=device)[:max_anchors]].sort().values
    anchors = [torch.arange(n_entries, device=device)]
    levels = [torch.zeros(n_entries, dtype=torch.long, device=device)]
    pool = seeds
    for d in range(1, depths):
        pool = pool[reads[pool + d]]
        size = pool.numel() if keep_all else min(pool.numel(), int((seeds.numel() - d) * max(ratio ** d, min_ratio)))
        if size <= 0:
            break
        pool = pool[torch.randperm(pool.numel(), device=device)[:size]].sort().values
        anchors.append(pool)
        levels.append(torch.full_like(pool, d))
    return torch.cat(anchors), torch.cat(levels)


def pack_chains(picks: list[tuple[torch.Tensor, torch.Tensor]], device) -> tuple[torch.Tensor, ...]:
    """Rows' (anchors, depths) from `draw_chains` as (B, N) tensors `anchors`, `depth` and `used` (False: padding to
    the longest row, at anchor 0, depth 0)."""
    N = max(len(a) for a, _ in picks)
    anchors = torch.zeros(len(picks), N, dtype=torch.long, device=device)
    depth = torch.zeros_like(anchors)
    used = torch.zeros(len(picks), N, dtype=torch.bool, device=device)
    for b, (a, d) in enumerate(picks):
        anchors[b, : len(a)], depth[b, : len(a)], used[b, : len(a)] = a, d, True
    return anchors, depth, used


def chain_mask(anchors: torch.Tensor, depth: torch.Tensor, key_ok: torch.Tensor) -> torch.Tensor:
    """(B, N, N) bool: entry (a, d) may attend to (a', d') iff d' = 0 and a' <= a (the real context through its
    anchor), or a' = a and d' <= d (its own chain), and the key is real (`key_ok` (B, N))."""
    aq, ak = anchors[:, :, None], anchors[:, None, :]
    dq, dk = depth[:, :, None], depth[:, None, :]
    return (((dk == 0) & (ak <= aq)) | ((ak == aq) & (dk <= dq))) & key_ok[:, None, :]


def cut_at_stop(stop, logits: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor | None) -> list[int]:
    """How many of each row's guesses (B, n) to propose under a confidence stop: through the first unsure one, or
    up to it when the stop drops it; all of them without a stop."""
    if not stop:
        return [tokens.shape[1]] * tokens.shape[0]
    unsure = stop.rows_unsure(logits, probs, tokens)
    return [next((i + (not stop.drops) for i, u in enumerate(row) if u), len(row)) for row in unsure]
