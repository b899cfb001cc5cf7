"""A Hugging Face model on its KV cache (drafters/hf_cache.py): the cache's keyword, and the ragged cache whose
rows each compute what they compute alone."""

from __future__ import annotations

import inspect

import torch

from drafters.hf_cache import RaggedCache, cache_keyword, forward_rows
from drafters.kv_cache import RaggedRows
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


def test_a_verified_tree_leaves_the_cache_of_the_kept_path_exactly():
    """One forward over a tree (its mask and position ids) gives each node the logits of its own path, and
    after `keep_path` the cache is the cache of the prefix plus that path: the next token's logits equal a
    plain forward of the whole text."""
    from transformers import DynamicCache

    from drafters.hf_cache import keep_path, tree_attention_mask
    from drafters.tree import depths

    model = tiny_llama(40, seed=2)
    prefix, root = [3, 17, 5, 9], 21
    #         root
    #        /    \
    #      0(4)   1(8)
    #      /  \      \
    #   2(6)  3(1)   4(2)
    #          |
    #         5(7)
    parents = torch.tensor([-1, -1, 0, 0, 1, 3])
    tokens = [4, 8, 6, 1, 2, 7]
    cache = DynamicCache()
    model(input_ids=torch.tensor([prefix]), cache=cache, use_cache=True)
    positions = len(prefix) + torch.cat([torch.zeros(1, dtype=torch.long), depths(parents)])[None]
    out = model(input_ids=torch.tensor([[root, *tokens]]), position_ids=positions, cache=cache, use_cache=True,
                attention_mask=tree_attention_mask(model, len(prefix), parents, torch.device("cpu")))
    for node, path in {-1: [], 2: [0, 2], 5: [0, 3, 5], 4: [1, 4]}.items():
        text = prefix + [root] + [tokens[i] for i in path]
        torch.testing.assert_close(out.logits[0, node + 1], model(input_ids=torch.tensor([text])).logits[0, -1],
                                   atol=1e-5, rtol=1e-4)
    keep_path(cache, len(prefix), [0, 1, 4, 6])  # the root, then nodes 0, 3, 5
    assert cache.get_seq_length() == len(prefix) + 4
    nxt = model(input_ids=torch.tensor([[30]]), cache=cache, use_cache=True).logits[0, -1]
    whole = model(input_ids=torch.tensor([prefix + [root, 4, 1, 7, 30]])).logits[0, -1]
    torch.testing.assert_close(nxt, whole, atol=1e-5, rtol=1e-4)
