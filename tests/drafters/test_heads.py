"""Feature-reading heads (EAGLE-3, EAGLE-1, MTP, Medusa, DFlash, P-EAGLE): losses, masks, lossless drafting, and that
drafting in the loop is the computation the head was trained on."""

from __future__ import annotations

import json
import random

import pytest
import torch

from drafters.base import STOP_RULES, ConfidenceStop, candidate_confidence
from drafters.parallel import draw_chains
from drafters.eagle import check_vocab_maps, draft_vocabulary, vocabulary_coverage, vocabulary_size_for
from drafters.registry import build_head, load_head, save_head
from drafters.head_losses import ReadRows
from drafters.sampling import Sampling
from drafters.tree import TreeShape
from eval.batching import speculative_generate_batch
from eval.speculative import autoregressive_generate, speculative_generate
from helpers import (Recording, accept_path_without_residual, batched_pvalues, chi2_pvalue, empirical_joint,
                     exact_joint, stop_point, tiny_llama, trained_to_self)
from train.hidden_states import capture, default_layers

VOCAB = 64
GREEDY = Sampling()
SETTINGS = {
    "eagle": dict(ttt_steps=4, ttt_decay=0.8),
    "eagle1": dict(token_loss_weight=0.1),
    "mtp": dict(depth=4, module_decay=0.8),
    "medusa": dict(num_heads=4, num_layers=1, head_decay=0.8),
    "dflash": dict(num_layers=2, block_size=5, loss_decay_gamma=4.0, max_anchors=8),  # mask: the last id
    "peagle": dict(num_depths=4, cod_ratio=0.7, cod_min_ratio=0.2, max_anchors=512),  # mask: the last id
}
KINDS = sorted(SETTINGS)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, hidden=32, layers=4, seed=0, logit_scale=4.0).requires_grad_(False)


def make_head(kind, target, seed=0, **overrides):
    torch.manual_seed(seed)
    layers = default_layers(kind, target.config.num_hidden_layers)
    if kind in ("dflash", "peagle"):  # the target's last token id carries the masked positions
        overrides = {"mask_token_id": target.config.vocab_size - 1, **overrides}
    head = build_head(kind, target, layers, **{**SETTINGS[kind], **overrides})
    with torch.no_grad():  # random heads are near-uniform; sharpen them so ties and near-ties are rare
        for p in head.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return head.eval()


def batch(target, layers, seed=0, B=3, T=24):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 17:] = 0  # a padded row
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 6:] = 1  # "assistant" tokens from position 6
    loss_mask *= attn
    feats = capture(target, ids, attn, layers).flatten(2)
    with torch.no_grad():
        probs = torch.softmax(target(input_ids=ids, attention_mask=attn).logits, -1)
    return feats, ids, attn, loss_mask, probs


# --- training losses ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_one_step_lowers_the_loss(target, kind):
    head = make_head(kind, target).train()
    args = batch(target, head.config.feature_layers)
    opt = torch.optim.SGD([p for p in head.parameters() if p.requires_grad], lr=0.05)
    frozen = [p.clone() for p in target.parameters()]
    torch.manual_seed(1)  # the same draw both times where training samples (DFlash's anchors, P-EAGLE's depths)
    before, stats = head(*args)
    assert torch.isfinite(before) and all(s["count"] > 0 for s in stats)
    before.backward()
    opt.step()
    torch.manual_seed(1)
    after, _ = head(*args)
    assert after < before
    # The target's embedding and output head are shared with the head, not trained through it.
    assert all(torch.equal(a, b) for a, b in zip(frozen, target.parameters()))


@pytest.mark.parametrize("kind", KINDS)
def test_loss_ignores_padding_and_non_assistant_tokens(target, kind):
    head = make_head(kind, target)
    feats, ids, attn, loss_mask, probs = batch(target, head.config.feature_layers)
    loss, stats = head(feats, ids, attn, loss_mask, probs)
    # Step s predicts token (position + s + 2 for EAGLE, + s + 1 for the others): the count is the
    # number of assistant tokens it can reach. DFlash's block position s + 1 after an anchor that is itself an
    # answer token (the first answer token's block, at 6, guesses 7 first) reaches one fewer.
    shift = {"dflash": 7, "peagle": 2}.get(kind, 2 if kind.startswith("eagle") else 1)
    for s, st in enumerate(stats):
        assert int(st["count"]) == int(loss_mask[:, shift + s:].sum()), (kind, s)
    # Changing what sits in the padding must not change the loss.
    ids2, feats2 = ids.clone(), feats.clone()
    ids2[1, 17:] = (ids2[1, 17:] + 1) % VOCAB
    feats2[1, 17:] += 1.0
    loss2, _ = head(feats2, ids2, attn, loss_mask, probs)
    torch.testing.assert_close(loss, loss2)


def _eagle_reference(head, feats, ids, attn, loss_mask, probs):
    """EAGLE-3's loss, per-step sums and greedy hits written out over every position of `unroll` (the output
    head on all of them), the target's distribution restricted to the draft vocabulary: what forward computes."""
    B, T = ids.shape
    S = head.config.ttt_steps
    pad = lambda t: torch.cat([t, t.new_zeros((B, S + 1, *t.shape[2:]))], dim=1)  # noqa: E731
    lmask, valid, probs = pad(loss_mask), pad(attn), pad(probs)
    kept = head.target_ids() if head.reduced else torch.arange(VOCAB)
    loss, stats = 0.0, []
    for s, logits in enumerate(head.unroll(feats, ids, attn)):
        p = probs[:, 1 + s: T + s]
        m = (lmask[:, 2 + s: T + 1 + s] * valid[:, 2 + s: T + 1 + s]).bool()
        p_draft = p[..., kept] / p[..., kept].sum(-1, keepdim=True).clamp_min(1e-12)
        per_pos = -(p_draft * torch.log_softmax(logits, -1)).sum(-1)
        loss = loss + head.config.ttt_decay ** s * per_pos[m].mean()
        q = torch.zeros_like(p).index_copy_(-1, kept, torch.softmax(logits, -1))
        agree = q.argmax(-1) == p.argmax(-1)
        hits = torch.zeros(B, T, dtype=torch.bool)  # entry e's greedy guess right, at e (what greedy_rounds replays)
        hits[:, : T - 1] = agree & m
        stats.append({"accept": torch.minimum(q, p).sum(-1)[m].sum(), "top1": agree[m].float().sum(),
                      "count": m.sum().float(), "hits": hits})
    return loss, stats


@pytest.mark.parametrize("size", [None, 40])
def test_eagle_loss_reads_the_output_head_only_at_assistant_tokens_and_labels_equal_one_hot_rows(target, size):
    head = make_head("eagle", target, **({"draft_vocab_size": size} if size else {}))
    if size:  # the lowest ids are the "most frequent"; some argmax labels fall outside the vocabulary
        head.set_vocabulary(*draft_vocabulary(torch.arange(VOCAB, 0, -1).float(), size))
    feats, ids, attn, loss_mask, probs = batch(target, head.config.feature_layers)
    want_loss, want_stats = _eagle_reference(head, feats, ids, attn, loss_mask, probs)
    loss, stats = head(feats, ids, attn, loss_mask, probs)
    torch.testing.assert_close(loss, want_loss)
    assert any(st["hits"].any() for st in want_stats)  # some guesses right: their places are checked
    for got, want in zip(stats, want_stats, strict=True):
        torch.testing.assert_close(got, want)
    # Temperature 0: the argmax as token ids is the one-hot distribution, loss, sums and gradients alike.
    labels = probs.argmax(-1)
    one_hot = torch.nn.functional.one_hot(labels, VOCAB).float()
    if size:
        assert not head.t2d[labels[loss_mask.bool()]].all()  # the -1 index (outside the vocabulary) is exercised
    grads = []
    for label in (one_hot, labels):
        head.zero_grad()
        loss, stats = head(feats, ids, attn, loss_mask, label)
        loss.backward()
        grads.append(([p.grad.clone() for p in head.parameters() if p.grad is not None], loss, stats))
    (g1, l1, s1), (g2, l2, s2) = grads
    torch.testing.assert_close(l2, l1)
    for a, b in zip(s2, s1, strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(g2, g1, strict=True):
        torch.testing.assert_close(a, b)
    # The distributions only where the loss reads them (ReadRows, the held-out statistics' form) give the
    # dense tensor's loss and sums; any other row's content is never read.
    read = torch.zeros_like(loss_mask, dtype=torch.bool)
    read[:, :-1] = loss_mask[:, 1:].bool()
    index = torch.full(read.shape, -1, dtype=torch.long)
    index[read] = torch.arange(int(read.sum()))
    sparse_loss, sparse_stats = head(feats, ids, attn, loss_mask, ReadRows(index, probs[read]))
    torch.testing.assert_close(sparse_loss, want_loss)
    for got, want in zip(sparse_stats, want_stats, strict=True):
        torch.testing.assert_close(got, want)


def _peagle_reads(head, loss_mask, attn):
    """Where P-EAGLE's loss reads: entry j's depth-0 token j + 2 (drafters/peagle.py `forward`)."""
    B, T = loss_mask.shape
    pad = lambda t: torch.cat([t, t.new_zeros((B, head.depths + 1))], dim=1)  # noqa: E731
    return pad(loss_mask)[:, 2: 1 + T + head.depths].bool() & pad(attn)[:, 2: 1 + T + head.depths].bool()


def test_peagle_trains_each_drawn_entry_as_the_held_out_evaluation_computes_it(target):
    """Training's one forward over the drawn entries under the depth-aware mask gives every entry the state the
    evaluation's depth-by-depth computation (and so drafting) gives it: with nothing dropped, row for row."""
    head = make_head("peagle", target, cod_ratio=1.0, cod_min_ratio=1.0)
    feats, ids, attn, loss_mask, _ = batch(target, head.config.feature_layers)
    E = ids.shape[1] - 1
    with torch.no_grad():
        anchors, depth, used, drawn = head._sampled(feats, ids, attn, _peagle_reads(head, loss_mask, attn))
        _, _, _, every = head._every_anchor(feats, ids, attn)
    checked = 0
    for b, j in used.nonzero().tolist():
        a, d = int(anchors[b, j]), int(depth[b, j])
        if attn[b, min(a + d + 1, ids.shape[1] - 1)]:  # past a padded row's end nothing is read
            torch.testing.assert_close(drawn[b, j], every[b, d * E + a], rtol=1e-5, atol=1e-5)
            checked += int(d > 0)
    assert checked > 50  # deeper entries among them


def test_conditional_drop_keeps_whole_chains_of_the_recipes_sizes(target):
    """Depth d keeps int((n - d) * max(0.7^d, 0.2)) of the n anchors the loss reads (speculators' sizes), each
    drawn among depth d-1's, every one of them reading its own depth-d token; depth 0 keeps every entry."""
    head = make_head("peagle", target, num_depths=6, max_anchors=512)
    E = 80
    reads = torch.zeros(E + head.depths, dtype=torch.bool)
    reads[10:70] = True
    reads[40:44] = False  # a gap: chains running into it end there
    torch.manual_seed(0)
    anchors, depths = draw_chains(reads, E, head.depths, 0.7, 0.2, 512)
    assert anchors[depths == 0].tolist() == list(range(E))
    n, previous = int(reads[:E].sum()), set(reads[:E].nonzero()[:, 0].tolist())
    for d in range(1, head.depths):
        kept = anchors[depths == d].tolist()
        assert len(kept) == min(len([a for a in previous if reads[a + d]]), int((n - d) * max(0.7 ** d, 0.2)))
        assert set(kept) <= previous and all(reads[a + d] for a in kept)
        previous = set(kept)


def test_peagle_depth_zero_is_eagle3s_first_step(target):
    """Depth 0 is EAGLE-3's first draft step on the same weights: the engines' EAGLE-3 code reads the layer."""
    peagle = make_head("peagle", target)
    eagle = make_head("eagle", target)
    state = {k: v for k, v in peagle.state_dict().items() if k != "mask_hidden"}
    eagle.load_state_dict(state)
    feats, ids, attn, _, _ = batch(target, peagle.config.feature_layers)
    with torch.no_grad():
        _, _, _, states = peagle._every_anchor(feats, ids, attn)
        first = next(eagle.unroll_states(feats, ids, attn))
    torch.testing.assert_close(states[:, : ids.shape[1] - 1], first)


# --- in the loop -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in (1, 2, 9)]


def _heads(target):
    yield from ((kind, make_head(kind, target)) for kind in KINDS)
    yield from ((name, _head(name, target)) for name in [*VARIANTS, *DFLASH_VARIANTS])


def _reduced_eagle(target, size=40, own_lm_head=False, counts=None, **norms):
    head = make_head("eagle", target, draft_vocab_size=size, own_lm_head=own_lm_head, **norms)
    counts = torch.arange(VOCAB, 0, -1).float() if counts is None else counts  # the lowest ids: "most frequent"
    head.set_vocabulary(*draft_vocabulary(counts, size))
    if own_lm_head:  # an output head of its own: the target's rows, then moved off them as training would
        head.init_lm_head()
        with torch.no_grad():
            g = torch.Generator().manual_seed(5)
            head.lm_head.weight.add_(torch.randn(head.lm_head.weight.shape, generator=g) * head.lm_head.weight.std())
    return head


# EAGLE-3 variants beside the kinds: a reduced draft vocabulary, one with an output head of its own, and EAGLE-3.1's
# norms (speculators' defaults: over the fused features, before the residual, and on the state handed on).
VARIANTS = {"eagle_reduced": {}, "eagle_own": {"own_lm_head": True},
            "eagle31": {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}}


# DFlash with a draft vocabulary (the engines spread its logits back through d2t); it drafts no trees.
DFLASH_VARIANTS = ["dflash_reduced"]


def _reduced_dflash(target, size=40, counts=None):
    head = make_head("dflash", target, draft_vocab_size=size)
    counts = torch.arange(VOCAB, 0, -1).float() if counts is None else counts  # the lowest ids: "most frequent"
    head.set_vocabulary(*draft_vocabulary(counts, size))
    return head


def _head(kind, target):
    if kind in DFLASH_VARIANTS:
        return _reduced_dflash(target)
    return _reduced_eagle(target, **VARIANTS[kind]) if kind in VARIANTS else make_head(kind, target)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_target_greedy_with_every_head(target, prompts, k):
    for name, head in _heads(target):
        head = trained_to_self(target, head) if k == 3 else head
        accepted = 0
        for prompt in prompts:
            ref = autoregressive_generate(target, prompt, sampling=GREEDY, max_new_tokens=30).tokens
            out = speculative_generate(target, head.drafter(name), prompt, k=k, sampling=GREEDY, max_new_tokens=30)
            assert out.tokens == ref, (name, k, prompt.tolist())
            accepted += sum(r.accepted for r in out.rounds)
        if k == 3:  # trained briefly on the target's text: the accept-and-roll-back path is exercised
            assert accepted > 0, name


BATCHED = KINDS + list(VARIANTS) + DFLASH_VARIANTS


def test_rows_that_join_a_running_batch_draft_as_the_head_alone(target, prompts):
    """Continuous batching with every head (2 slots, an end token that ends rows at different rounds): each
    prompt joins as a row finishes, its output is its plain output at batch 1, and it keeps, round by round,
    what the head keeps drafting that prompt alone (its prefilled rows, taken over by the running batch,
    draft what a fresh start drafts)."""
    g = torch.Generator().manual_seed(4)
    chosen = [torch.randint(0, VOCAB, (n,), generator=g) for n in (12, 5)] + prompts[::-1]
    eos = autoregressive_generate(target, chosen[1], sampling=GREEDY, max_new_tokens=30).tokens[4]
    refs = [autoregressive_generate(target, p, sampling=GREEDY, max_new_tokens=30, eos_token_id=eos).tokens
            for p in chosen]
    for name, head in _heads(target):
        head = trained_to_self(target, head)
        out = speculative_generate_batch(target, head.batch_drafter(name), chosen, k=3, sampling=GREEDY,
                                         max_new_tokens=30, eos_token_id=eos, slots=2)
        assert [r.tokens for r in out.rows] == refs, name
        assert max(r.rows for r in out.rounds) == 2, name
        alone = [speculative_generate(target, head.drafter(name), p, k=3, sampling=GREEDY, max_new_tokens=30,
                                      eos_token_id=eos) for p in chosen]
        assert [[r.accepted for r in gen.rounds] for gen in out.rows] == [[r.accepted for r in a.rounds]
                                                                         for a in alone], name


@pytest.mark.parametrize("batch", [2, 5])
def test_batched_rows_equal_their_plain_greedy_output_with_every_head(target, prompts, batch):
    """eval/batching.py with each head's batch drafter: every row's greedy output is its prompt's plain
    output at batch 1, and every row keeps, round by round, the guesses the head keeps drafting that prompt
    alone (its ragged cache, rolled back per row, drafts what the batch-1 cache drafts)."""
    g = torch.Generator().manual_seed(4)
    chosen = ([torch.randint(0, VOCAB, (n,), generator=g) for n in (12, 5)] + prompts[::-1])[:batch]
    refs = [autoregressive_generate(target, p, sampling=GREEDY, max_new_tokens=30).tokens for p in chosen]
    for name, head in _heads(target):
        if name not in BATCHED:
            continue
        head = trained_to_self(target, head)
        out = speculative_generate_batch(target, head.batch_drafter(name), chosen, k=3, sampling=GREEDY,
                                         max_new_tokens=30)
        assert [r.tokens for r in out.rows] == refs, name
        alone = [speculative_generate(target, head.drafter(name), p, k=3, sampling=GREEDY, max_new_tokens=30)
                 for p in chosen]
        assert [[r.accepted for r in gen.rounds] for gen in out.rows] == [[r.accepted for r in a.rounds]
                                                                         for a in alone], name
        assert sum(r.accepted for gen in out.rows for r in gen.rounds) > 0, name


@pytest.mark.parametrize("rule", STOP_RULES)
def test_batched_confidence_stop_cuts_each_row_where_the_head_alone_cuts_it(target, prompts, rule):
    """With a confidence stop, each row proposes, round by round, as many guesses as the head drafting its
    prompt alone (rows stop at different steps; the batch's round ends when every row has stopped)."""
    g = torch.Generator().manual_seed(4)
    chosen = [torch.randint(0, VOCAB, (n,), generator=g) for n in (12, 5)] + prompts[::-1]
    for name, head in _heads(target):
        head = trained_to_self(target, head)
        out = speculative_generate_batch(target, head.batch_drafter(name, stop_below=0.5, stop_rule=rule), chosen,
                                         k=4, sampling=GREEDY, max_new_tokens=24)
        alone = [speculative_generate(target, head.drafter(name, stop_below=0.5, stop_rule=rule), p, k=4,
                                      sampling=GREEDY, max_new_tokens=24) for p in chosen]
        assert [[(r.proposed, r.accepted) for r in gen.rounds] for gen in out.rows] == \
            [[(r.proposed, r.accepted) for r in a.rounds] for a in alone], name
        assert any(r.proposed < 4 for gen in out.rows for r in gen.rounds), name  # the stop fired somewhere


SMALL_V = 6


@pytest.fixture(scope="module")
def small_target():
    return tiny_llama(SMALL_V, hidden=16, layers=4, seed=10, logit_scale=12.0)


def _small_head(kind, small_target):
    torch.manual_seed(3)
    counts = torch.tensor([5.0, 1, 4, 3, 0, 2])
    if kind in VARIANTS:
        return _reduced_eagle(small_target, 4, counts=counts, **VARIANTS[kind])
    if kind in DFLASH_VARIANTS:
        return _reduced_dflash(small_target, 4, counts=counts)
    return make_head(kind, small_target)


@pytest.mark.parametrize("slots", [None, 3])
@pytest.mark.parametrize("kind", BATCHED)
def test_batched_sampled_rows_follow_target_distribution(small_target, kind, slots):
    """Batches of 4 rows (two prompts of different lengths, twice each; with 3 slots the fourth joins as a
    row finishes): each prompt's first three tokens, pooled over its rows, follow the target's exact joint."""
    head = _small_head(kind, small_target)
    pvalues = batched_pvalues(small_target, lambda: head.batch_drafter(kind), Sampling(temperature=1.0), SMALL_V, 1000,
                              slots=slots)
    assert min(pvalues) > 1e-3


@pytest.mark.parametrize("kind", KINDS + list(VARIANTS) + DFLASH_VARIANTS)
def test_sampled_output_follows_target_distribution(small_target, kind):
    head = _small_head(kind, small_target)
    prompt = torch.tensor([1, 4, 2])
    sampling = Sampling(temperature=1.0)
    exact = exact_joint(small_target, prompt, sampling, SMALL_V)
    counts = empirical_joint(small_target, head.drafter(kind), prompt, sampling, SMALL_V, 2, 2000)
    assert chi2_pvalue(counts, exact) > 1e-3


# --- trees (drafters/tree.py, heads.py TreeDrafting) ----------------------------------------------------

TREE_KINDS = ["eagle", "eagle1", *VARIANTS]


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_a_tree_of_width_one_drafts_and_keeps_exactly_the_chain(target, prompts, kind):
    """A dynamic tree with top-1 and `depth` nodes is the greedy chain: the same guesses, round for round, through
    the tree mask, the tree's position ids and the path's cache gathering."""
    head = trained_to_self(target, _head(kind, target))
    for prompt in prompts:
        chain = speculative_generate(target, head.drafter(kind), prompt, k=3, sampling=GREEDY, max_new_tokens=30)
        tree = speculative_generate(target, head.drafter(kind), prompt, k=0, tree=TreeShape(3, 1, 3),
                                    sampling=GREEDY, max_new_tokens=30)
        assert tree.tokens == chain.tokens
        assert [(r.proposed, r.accepted) for r in tree.rounds] == [(r.proposed, r.accepted) for r in chain.rounds]


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_a_heads_tree_scores_each_node_as_drafting_its_path_alone_would(target, prompts, kind):
    """Each node's score is the head's cumulative log-probability of its path, as the head drafting that path as a
    chain (one entry at a time on its own outputs) gives it: a tree's entries see the committed ones and their own
    ancestors only, at their own depth's position."""
    head = trained_to_self(target, _head(kind, target))
    prompt = prompts[2]
    with torch.no_grad():
        out = target(input_ids=prompt[None], output_hidden_states=True)
    features = torch.stack([out.hidden_states[i][0] for i in head.config.feature_layers], dim=1)
    drafter = head.drafter(kind)
    drafter.start(prompt, features[:-1])
    tree = drafter.propose_tree(TreeShape(4, 3, 20), GREEDY)
    for node in range(len(tree)):
        want = _chain_score(head, kind, tree.tokens[tree.path_to(node)].tolist(), prompt, features)
        assert float(tree.scores[node]) == pytest.approx(want, abs=1e-4), (kind, node)


@torch.inference_mode()
def _chain_score(head, kind, tokens, prompt, features):
    """The head's cumulative log-probability of `tokens` after `prompt`, drafting them one entry at a time."""
    chain = head.drafter(kind)
    chain.start(prompt, features[:-1])
    m = len(prompt) - 1
    h = chain.first(prompt[1:], 0)
    score = 0.0
    for depth, token in enumerate(tokens):
        logp = torch.log_softmax(chain.tree_logits(h[0, -1:]).float(), -1)[0]
        column = token
        if getattr(chain, "target_ids", None) is not None:  # a draft vocabulary: the token's column in it
            column = int((chain.target_ids == token).nonzero())
        score += float(logp[column])
        h = head.step(h[:, -1:], torch.tensor([token]), m + depth, chain.cache)
    return score


@pytest.mark.parametrize("shape", ["d3t3n8", "d4t2n7", "d2t4n12", "static:0,1,2,0.0,0.1,1.0,0.0.0"])
def test_greedy_trees_equal_target_greedy_and_keep_more_than_the_chain(target, prompts, shape):
    shape = TreeShape.parse(shape)
    for kind in TREE_KINDS:
        head = trained_to_self(target, _head(kind, target))
        kept, chain_kept = 0, 0
        for prompt in prompts:
            ref = autoregressive_generate(target, prompt, sampling=GREEDY, max_new_tokens=30).tokens
            out = speculative_generate(target, head.drafter(kind), prompt, k=0, tree=shape, sampling=GREEDY,
                                       max_new_tokens=30)
            assert out.tokens == ref, (kind, shape, prompt.tolist())
            assert all(r.proposed <= shape.nodes and r.accepted <= shape.depth and r.depth == shape.depth
                       for r in out.rounds)
            chain = speculative_generate(target, head.drafter(kind), prompt, k=shape.depth, sampling=GREEDY,
                                         max_new_tokens=30)
            kept += sum(r.accepted for r in out.rounds) / len(out.rounds)
            chain_kept += sum(r.accepted for r in chain.rounds) / len(chain.rounds)
        assert kept > chain_kept, (kind, shape)  # siblings catch what the chain's first guess misses


@pytest.mark.parametrize("shape", ["d2t2n5", "static:0,1,0.0"])
@pytest.mark.parametrize("kind", TREE_KINDS)
def test_sampled_trees_follow_target_distribution(small_target, kind, shape):
    head = _small_head(kind, small_target)
    prompt = torch.tensor([1, 4, 2])
    sampling = Sampling(temperature=1.0)
    exact = exact_joint(small_target, prompt, sampling, SMALL_V)
    counts = empirical_joint(small_target, head.drafter(kind), prompt, sampling, SMALL_V, 0, 2000,
                             tree=TreeShape.parse(shape))
    assert chi2_pvalue(counts, exact) > 1e-3


def test_sampled_trees_with_a_planted_wrong_residual_are_caught(small_target, monkeypatch):
    """The same test fails when the sibling residual is skipped (a rejected child's mass left in p)."""
    import eval.speculative as loop

    head = _small_head("eagle", small_target)
    prompt = torch.tensor([1, 4, 2])
    sampling = Sampling(temperature=1.0)
    exact = exact_joint(small_target, prompt, sampling, SMALL_V)
    monkeypatch.setattr(loop, "accept_path", accept_path_without_residual)
    counts = empirical_joint(small_target, head.drafter("eagle"), prompt, sampling, SMALL_V, 0, 2000,
                             tree=TreeShape(2, 2, 5))
    assert chi2_pvalue(counts, exact) < 1e-6


@pytest.mark.parametrize("kind", ["mtp", "medusa", "dflash", "peagle"])
def test_a_drafter_without_trees_is_a_clear_error(target, prompts, kind):
    with pytest.raises(ValueError, match="drafts chains only: a tree \\(d3t2n5\\)"):
        speculative_generate(target, make_head(kind, target).drafter(kind), prompts[2], k=0,
                             tree=TreeShape(3, 2, 5), sampling=GREEDY, max_new_tokens=8)


# --- confidence stop (drafters/base.py) ----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS + list(VARIANTS) + DFLASH_VARIANTS)
def test_confidence_stop_ends_the_round_at_the_first_unsure_guess(target, prompts, kind):
    head = _head(kind, target)
    ends = [stop_point(target, lambda stop: head.drafter(kind, stop_below=stop), prompt, 4, 0.02, seed)
            for prompt in prompts[1:] for seed in range(4)]
    # Random heads are near-uniform over 64 tokens (q about 1/64): 0.02 stops some rounds, at several places.
    assert min(ends) < 4 and max(ends) > 1, ends


@pytest.mark.parametrize("rule", STOP_RULES)
@pytest.mark.parametrize("kind", KINDS + list(VARIANTS) + DFLASH_VARIANTS)
def test_greedy_with_confidence_stop_equals_target_greedy(target, prompts, kind, rule):
    head, exercised = trained_to_self(target, _head(kind, target)), []
    # The heads differ in how sure they are; over these thresholds every output is the target's, and at one
    # at least the stop cuts some rounds and not others.
    for stop in ((0.6,) if rule == "propose" else (0.1, 0.125, 0.15, 0.175, 0.2, 0.3, 0.5, 0.7)):
        proposed = []
        for prompt in prompts:
            ref = autoregressive_generate(target, prompt, sampling=GREEDY, max_new_tokens=30).tokens
            out = speculative_generate(target, head.drafter(kind, stop_below=stop, stop_rule=rule), prompt, k=4,
                                       sampling=GREEDY, max_new_tokens=30)
            assert out.tokens == ref, (kind, stop, prompt.tolist())
            proposed += [r.proposed for r in out.rounds]
        if rule == "propose":  # the unsure guess is proposed: never an empty round
            assert min(proposed) > 0, (kind, proposed)
        # Cut somewhere, and not everywhere; the drop rule (llama.cpp's) also leaves rounds without a guess.
        exercised.append(min(proposed) < (4 if rule == "propose" else 1) and max(proposed) > 0)
    assert any(exercised), kind


@pytest.mark.parametrize("rule", STOP_RULES)
@pytest.mark.parametrize("kind", KINDS + list(VARIANTS) + DFLASH_VARIANTS)
def test_sampled_output_with_confidence_stop_follows_target_distribution(small_target, kind, rule):
    head = _small_head(kind, small_target)
    prompt, sampling = torch.tensor([1, 4, 2]), Sampling(temperature=1.0)
    exact = exact_joint(small_target, prompt, sampling, SMALL_V)
    if rule == "propose":
        stop = 0.5
    else:  # llama.cpp's probability is the argmax's, whatever is drawn: a threshold that cuts some rounds only
        def lengths(stop):
            drafter = Recording(head.drafter(kind, stop_below=stop, stop_rule=rule))
            empirical_joint(small_target, drafter, prompt, sampling, SMALL_V, 2, 40)
            return {len(p) for p in drafter.proposals}
        stop = next(s for s in (0.5, 0.4, 0.6, 0.3, 0.7, 0.8) if {0, 2} <= lengths(s))
    drafter = Recording(head.drafter(kind, stop_below=stop, stop_rule=rule))
    counts = empirical_joint(small_target, drafter, prompt, sampling, SMALL_V, 2, 2000)
    assert chi2_pvalue(counts, exact) > 1e-3
    # First rounds stopped after one guess (the drop rule: before it, or after one), and not.
    assert {len(p) for p in drafter.proposals} >= ({1, 2} if rule == "propose" else {0, 2}), rule


def test_a_bad_stop_threshold_is_an_error(target):
    with pytest.raises(ValueError, match="stop_below must be in"):
        make_head("eagle", target).drafter("eagle", stop_below=1.0)
    with pytest.raises(ValueError, match="stop_rule must be one of \\['propose', 'drop'\\], got 'skip'"):
        make_head("eagle", target).drafter("eagle", stop_below=0.5, stop_rule="skip")


def test_llama_cpps_confidence_is_the_likeliest_tokens_softmax_over_the_ten_likeliest():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 64, generator=g) * 3
    p = candidate_confidence(logits)
    assert p.tolist() == pytest.approx(torch.softmax(logits.topk(10).values, -1)[:, 0].tolist())
    assert (p > torch.softmax(logits, -1).amax(-1)).all()  # renormalized: above the full softmax's
    stop, drawn = ConfidenceStop(0.5, "drop"), torch.tensor([0, 1, 2])
    assert stop.rows_unsure(logits, None, drawn) == (p < 0.5).tolist() and stop.drops  # whatever was drawn
    assert not ConfidenceStop() and not ConfidenceStop(0.5).drops


def _reference_guesses(head, kind, ids, feats, guesses):
    """What the head's training computation (or, for EAGLE-1, a cache-free recompute) drafts after the
    committed `ids` given the features `feats` (m, L*d) of positions 0..m-1 and the drafter's guesses."""
    m, n = len(ids) - 1, len(guesses)
    seq = torch.tensor([ids + guesses])
    padded = torch.cat([feats, feats.new_zeros(len(guesses) + 1, feats.shape[1])])[None]
    attn = torch.ones_like(seq)
    with torch.no_grad():
        if kind.startswith("eagle") and kind != "eagle1":  # training-time test, anchor m-1
            steps = head.unroll(padded[:, : seq.shape[1]], seq, attn)[:n]
            drafts = torch.stack([s[0, m - 1].argmax() for s in steps])
            return (head.target_ids()[drafts] if head.reduced else drafts).tolist()
        if kind == "mtp":  # every module teacher forced; module j at position m-1 is guess j+1
            return [int(s[0, m - 1].argmax()) for s in head.unroll(padded[:, : seq.shape[1]], seq, attn)[:n]]
        if kind == "medusa":
            return head.logits(feats[m - 1], n=n).argmax(-1).tolist()
        if kind == "peagle":  # the held-out evaluation's computation: every anchor at every depth, anchor m-1
            E = seq.shape[1] - 1
            _, _, _, states = head._every_anchor(padded[:, : seq.shape[1]], seq, attn)
            drafts = head.draft_logits(states[0, [d * E + m - 1 for d in range(n)]]).argmax(-1)
            return (head.target_ids()[drafts] if head.reduced else drafts).tolist()
        if kind.startswith("dflash"):  # the block [last, mask x n] over the whole context at once, no cache
            context = head.context_kv(head.context(feats[None]), torch.arange(m)[None])
            block = torch.tensor([[ids[-1]] + [head.config.mask_token_id] * n])
            out = head.blocks(context, block, torch.arange(m, m + n + 1)[None], None)
            # The whole output head, then the tokens outside a draft vocabulary struck out (what d2t leaves); a
            # drafter over the whole vocabulary has no maps.
            logits = head.shared.logits(out[0, 1:])
            if head.reduced:
                logits = logits.masked_fill(~head.t2d, float("-inf"))
            return logits.argmax(-1).tolist()
        if kind == "eagle1":  # recompute from scratch, no cache, one draft at a time
            from drafters.kv_cache import KVCache

            hidden, out = feats[None], []
            for s in range(n):
                tokens = torch.tensor(ids[1:] + guesses[:s])
                o = head.step(hidden, tokens, 0, KVCache())
                out.append(int(head.shared.logits(o[:, -1]).argmax()))
                hidden = torch.cat([hidden, o[:, -1:]], dim=1)
            return out
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", KINDS + list(VARIANTS) + DFLASH_VARIANTS)
def test_drafting_with_cache_and_rollback_is_the_training_computation(target, kind):
    """Random rounds of propose / commit (random acceptance, random corrections): every proposal must
    equal what the head computes from scratch on the committed sequence, so neither the cache, nor
    the rollback, nor the positions drift from training."""
    head = _head(kind, target)
    layers = list(head.config.feature_layers)
    rng = random.Random(0)
    drafter = head.drafter(kind)
    ids = [rng.randrange(VOCAB) for _ in range(7)]
    feats_of = lambda seq: capture(target, torch.tensor([seq]), None, layers)[0].flatten(1)  # noqa: E731
    drafter.start(torch.tensor(ids), capture(target, torch.tensor([ids[:-1]]), None, layers)[0])
    for _ in range(12):
        k = rng.choice([1, 2, 3, 4])
        guesses = drafter.propose(k, GREEDY).tokens.tolist()
        assert guesses == _reference_guesses(head, kind, ids, feats_of(ids)[:-1], guesses), (kind, len(ids))
        a = rng.randrange(len(guesses) + 1)
        nxt = rng.randrange(VOCAB)
        new_ids = ids + guesses[:a] + [nxt]
        f = capture(target, torch.tensor([new_ids[:-1]]), None, layers)[0]
        drafter.commit(a, nxt, f[len(ids) - 1:])
        ids = new_ids


class _Recorder:
    """Wraps a head drafter and records every feature the loop hands it."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.feature_layers = inner, "recorder", inner.feature_layers
        self.parallel = inner.parallel
        self.seen: list[torch.Tensor] = []

    def start(self, prompt_ids, features):
        self.seen = [features]
        self.inner.start(prompt_ids, features)

    def propose(self, k, sampling, generator=None):
        return self.inner.propose(k, sampling, generator)

    def commit(self, n, token, features):
        self.seen.append(features)
        self.inner.commit(n, token, features)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_loop_features_are_the_training_features_at_the_same_layers(target, prompts, kind):
    """The hidden states the loop passes are those train/hidden_states.capture (training, offline
    shards) computes for the same positions and layer indices: a drift by one layer fails here."""
    head = trained_to_self(target, make_head(kind, target))
    layers = list(head.config.feature_layers)
    recorder = _Recorder(head.drafter(kind))
    prompt = prompts[2]
    out = speculative_generate(target, recorder, prompt, k=3, sampling=GREEDY, max_new_tokens=20)
    seq = recorder.inner.ids  # everything committed (the output may stop inside the last round)
    assert seq[: len(prompt) + len(out.tokens)] == prompt.tolist() + out.tokens
    seen = torch.cat(recorder.seen)  # one row per committed position but the last
    assert seen.shape[0] == len(seq) - 1
    expected = capture(target, torch.tensor([seq[:-1]]), None, layers)[0]
    torch.testing.assert_close(seen, expected, rtol=1e-4, atol=1e-5)
    shifted = capture(target, torch.tensor([seq[:-1]]), None, [i - 1 for i in layers])[0]
    assert not torch.allclose(seen, shifted, atol=1e-3)


# --- draft vocabulary --------------------------------------------------------------------------------


def test_draft_vocabulary_round_trip_and_coverage():
    counts = torch.zeros(50)
    counts[[3, 7, 8, 20, 41, 49]] = torch.tensor([9.0, 5, 5, 7, 1, 2])
    d2t, t2d = draft_vocabulary(counts, 4, always=[49])
    target_ids = check_vocab_maps(d2t, t2d)
    assert target_ids.tolist() == [3, 7, 20, 49]  # the 3 most frequent (7 before 8 on a tie) plus EOS
    assert (d2t >= 0).all() and d2t.dtype == torch.int64
    # draft id -> target id -> draft id
    draft_of_target = torch.cumsum(t2d.long(), 0) - 1
    assert draft_of_target[target_ids].tolist() == list(range(4))
    assert vocabulary_coverage([3, 3, 7, 8], t2d) == 0.75


def test_vocabulary_sized_by_coverage_is_the_smallest_that_reaches_it():
    counts = torch.zeros(50)
    counts[[3, 7, 8, 20, 41, 49]] = torch.tensor([9.0, 5, 5, 7, 1, 2])  # 29 tokens in all
    # Ranked 3 (9), 20 (7), 7 (5), 8 (5), 49 (2), 41 (1): cumulative 9, 16, 21, 26, 28, 29.
    assert vocabulary_size_for(counts, 16 / 29) == 2
    assert vocabulary_size_for(counts, 16.5 / 29) == 3
    assert vocabulary_size_for(counts, 1.0) == 6  # every counted token, none of the never-seen ones
    # EOS kept whatever its count comes first: 49 (2), 3 (9), 20 (7), ... cumulative 2, 11, 18.
    assert vocabulary_size_for(counts, 18 / 29, always=[49]) == 3
    size = vocabulary_size_for(counts, 0.9, always=[49])
    _, t2d = draft_vocabulary(counts, size, always=[49])
    held = counts[t2d].sum() / counts.sum()
    _, smaller = draft_vocabulary(counts, size - 1, always=[49])
    assert held >= 0.9 > counts[smaller].sum() / counts.sum()
    for bad in (0.0, 1.01):
        with pytest.raises(ValueError, match="draft_vocab_coverage must be in"):
            vocabulary_size_for(counts, bad)


def test_a_wrong_vocabulary_map_is_caught(target):
    d2t, t2d = draft_vocabulary(torch.arange(20.0), 5)
    shifted = d2t.clone()
    shifted[2] += 1  # off by one: maps to a token t2d does not mark
    with pytest.raises(ValueError, match="disagree|same target id"):
        check_vocab_maps(shifted, t2d)
    fewer = t2d.clone()
    fewer[int(d2t[0])] = False
    with pytest.raises(ValueError, match="marks 4 target tokens"):
        check_vocab_maps(d2t, fewer)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        check_vocab_maps(d2t + 100, torch.ones(5, dtype=torch.bool))
    head = make_head("eagle", target, draft_vocab_size=5)
    bad = torch.zeros(VOCAB, dtype=torch.bool)
    bad[:4] = True
    with pytest.raises(ValueError):
        head.set_vocabulary(torch.zeros(5, dtype=torch.long), bad)


# --- saving and loading ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_save_and_load_round_trip(target, tmp_path, kind):
    head = _reduced_eagle(target) if kind == "eagle" else make_head(kind, target)
    save_head(head, tmp_path / kind)
    loaded = load_head(tmp_path / kind, target)
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    assert not any(n.startswith(("embed", "shared")) for n in loaded.state_dict())  # the target's parts stay shared
    prompt = torch.tensor([4, 5, 6, 7])
    a = speculative_generate(target, head.drafter(), prompt, k=3, sampling=GREEDY, max_new_tokens=12)
    b = speculative_generate(target, loaded.drafter(), prompt, k=3, sampling=GREEDY, max_new_tokens=12)
    assert [r.accepted for r in a.rounds] == [r.accepted for r in b.rounds]


def test_a_narrower_head_mlp_drafts_losslessly_and_keeps_its_width_when_reloaded(target, prompts, tmp_path):
    head = make_head("eagle", target, intermediate_size=24)
    assert target.config.intermediate_size != 24
    mlp = head.midlayer.mlp
    assert mlp.gate_proj.weight.shape == mlp.up_proj.weight.shape == (24, target.config.hidden_size)
    assert mlp.down_proj.weight.shape == (target.config.hidden_size, 24)
    for prompt in prompts:
        ref = autoregressive_generate(target, prompt, sampling=GREEDY, max_new_tokens=16)
        assert speculative_generate(target, head.drafter(), prompt, k=3, sampling=GREEDY,
                                    max_new_tokens=16).tokens == ref.tokens
    save_head(head, tmp_path / "narrow")
    loaded = load_head(tmp_path / "narrow", target)
    assert loaded.config.intermediate_size == 24
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    with pytest.raises(ValueError, match="intermediate_size must be >= 1"):
        make_head("eagle", target, intermediate_size=0)


def test_loading_a_head_for_another_target_is_an_error(target, tmp_path):
    save_head(make_head("eagle1", target), tmp_path / "h")
    other = tiny_llama(VOCAB, hidden=48, layers=4, seed=1)
    with pytest.raises(ValueError, match="target_hidden_size is 32 but the target has 48"):
        load_head(tmp_path / "h", other)
    with pytest.raises(FileNotFoundError, match="not a saved head"):
        load_head(tmp_path / "nothing", target)


def test_eagle1_has_no_input_norm_and_a_head_saved_with_one_still_loads_and_drafts(target, prompts, tmp_path):
    head = make_head("eagle1", target)
    assert head.layer.input_layernorm is None and not any("input_layernorm" in n for n in head.state_dict())
    # A head saved before the norm was dropped: its config has no input_norm, its weights have the norm.
    old = make_head("eagle1", target, input_norm=True)
    old.layer.input_layernorm.weight.data.uniform_(0.5, 2.0)
    save_head(old, tmp_path / "old")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    del config["input_norm"]
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    loaded = load_head(tmp_path / "old", target)
    torch.testing.assert_close(loaded.layer.input_layernorm.weight, old.layer.input_layernorm.weight)
    for prompt in prompts:
        ref = autoregressive_generate(target, prompt, sampling=GREEDY, max_new_tokens=16)
        a = speculative_generate(target, old.drafter(), prompt, k=3, sampling=GREEDY, max_new_tokens=16)
        b = speculative_generate(target, loaded.drafter(), prompt, k=3, sampling=GREEDY, max_new_tokens=16)
        assert a.tokens == b.tokens == ref.tokens
        assert [r.accepted for r in a.rounds] == [r.accepted for r in b.rounds]
