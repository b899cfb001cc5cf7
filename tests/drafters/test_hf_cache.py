"""A Hugging Face model on its KV cache (drafters/hf_cache.py): the cache's keyword, and the ragged cache whose
rows each compute what they compute alone."""

from __future__ import annotations

import inspect

import torch

from drafters.hf_cache import RaggedCache, cache_keyword, forward_rows
from drafters.layers import RaggedRows
from helpers import tiny_llama

VOCAB = 64


def test_the_cache_keyword_is_the_one_the_models_forward_takes():
    # transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and goes in 5.40); a model
    # whose forward still takes `past_key_values` (earlier releases, remote code) gets that.
    target = tiny_llama(VOCAB, seed=0)
    expected = "cache" if "cache" in inspect.signature(type(target).forward).parameters else "past_key_values"
    assert cache_keyword(target) == expected

    class OldSignature(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, logits_to_keep=0):
            raise AssertionError("not called")

    assert cache_keyword(OldSignature()) == "past_key_values"


def test_ragged_forwards_give_each_rows_logits_alone():
    """Rows of different lengths, fed different numbers of entries, then cropped by different amounts:
    every row's logits are the ones a batch-1 forward of its own sequence gives."""
    target = tiny_llama(VOCAB, seed=0, logit_scale=4.0)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (4, 11, 2)]
    rows = RaggedRows(3, torch.device("cpu"))
    cache = RaggedCache(target, rows)
    forward_rows(target, seqs, cache, logits_for="last")
    extra = [[3, 9, 12], [4], [7, 7]]
    logits, _, _ = forward_rows(target, extra, cache, logits_for="all")
    rows.crop([len(s) + len(e) - drop for s, e, drop in zip(seqs, extra, (2, 0, 1))])  # roll back 2, 0 and 1
    kept = [s + e[: len(e) - drop] for s, e, drop in zip(seqs, extra, (2, 0, 1))]
    more = [[30], [31, 32], [33]]
    after, _, _ = forward_rows(target, more, cache, logits_for="all")
    with torch.no_grad():
        for b in range(3):
            alone = target(torch.tensor([seqs[b] + extra[b]])).logits[0, len(seqs[b]):]
            torch.testing.assert_close(logits[b, : len(extra[b])], alone, rtol=1e-5, atol=1e-5)
            alone = target(torch.tensor([kept[b] + more[b]])).logits[0, len(kept[b]):]
            torch.testing.assert_close(after[b, : len(more[b])], alone, rtol=1e-5, atol=1e-5)
