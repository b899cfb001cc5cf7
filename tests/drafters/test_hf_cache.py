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


def test_rows_that_join_a_running_batch_compute_what_they_compute_alone():
    """Continuous batching: a batch that has run (rows dropped, rolled back) absorbs another batch's prefilled
    rows (`absorb`, `RaggedRows.extend`); afterwards every row's logits are its batch-1 forward's."""
    target = tiny_llama(VOCAB, seed=0, logit_scale=4.0)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (4, 11, 2, 6, 3)]
    rows = RaggedRows(3, torch.device("cpu"))
    cache = RaggedCache(target, rows)
    forward_rows(target, seqs[:3], cache, logits_for="last")
    forward_rows(target, [[3, 9], [4, 5], [7, 7]], cache, logits_for="all")
    rows.crop([len(seqs[0]) + 1, len(seqs[1]) + 2, len(seqs[2]) + 2])  # rows 0 and 2 keep 1 and 2 of theirs
    rows.select([0, 2])  # row 1 finished
    kept = [seqs[0] + [3], seqs[2] + [7, 7]]
    joining = RaggedRows(2, torch.device("cpu"))
    other = RaggedCache(target, joining)
    forward_rows(target, seqs[3:], other, logits_for="last")
    cache.absorb(other)
    rows.extend(joining)
    assert rows.lengths == [len(s) for s in kept + seqs[3:]]
    more = [[30], [31, 32], [33, 34, 35], [36]]
    after, _, _ = forward_rows(target, more, cache, logits_for="all")
    with torch.no_grad():
        for b, sequence in enumerate(kept + seqs[3:]):
            alone = target(torch.tensor([sequence + more[b]])).logits[0, len(sequence):]
            torch.testing.assert_close(after[b, : len(more[b])], alone, rtol=1e-5, atol=1e-5)
