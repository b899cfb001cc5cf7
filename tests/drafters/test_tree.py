"""Tree proposals (drafters/tree.py): the verifier's mask, the kept path (greedy and sampled, against the target's
distribution by a chi-squared test that also catches a planted wrong residual) and EAGLE-2's dynamic tree."""

from collections import Counter

import pytest
import torch

from drafters.tree import StaticTree, Tree, TreeShape, accept_path, ancestor_mask, depths, dynamic_tree
from helpers import accept_path_without_residual, chi2_pvalue

#        root
#       /    \
#      0(1)   1(3)
#     /   \      \
#   2(2)  3(0)   4(4)
#    |
#   5(1)
PARENTS = torch.tensor([-1, -1, 0, 0, 1, 2])
TOKENS = torch.tensor([1, 3, 2, 0, 4, 1])


def test_depths_and_the_mask_show_each_node_its_ancestors_only():
    assert depths(PARENTS).tolist() == [1, 1, 2, 2, 2, 3]
    mask = ancestor_mask(PARENTS)
    sees = {i - 1: (mask[i].nonzero().flatten() - 1).tolist() for i in range(1, 7)}
    assert sees == {0: [-1, 0], 1: [-1, 1], 2: [-1, 0, 2], 3: [-1, 0, 3], 4: [-1, 1, 4], 5: [-1, 0, 2, 5]}
    assert mask[0].tolist() == [True] + [False] * 6  # the root sees itself (and the committed prefix) only


def test_a_parent_after_its_child_is_an_error():
    with pytest.raises(ValueError, match="parents\\[i\\] < i"):
        Tree(torch.tensor([1, 2]), torch.tensor([1, -1]))
    with pytest.raises(ValueError, match="one shape"):
        Tree(torch.tensor([1, 2]), torch.tensor([-1]))


def one_hot_rows(argmaxes, vocab=5):
    return torch.nn.functional.one_hot(torch.tensor(argmaxes), vocab).float()


def test_greedy_keeps_the_targets_own_continuation():
    tree = Tree(TOKENS, PARENTS)
    # Rows: after the root, then after nodes 0..5. The target's argmax: 1 (node 0), 2 (node 2), 1 (node 5), then 3.
    rows = one_hot_rows([1, 2, 0, 1, 0, 0, 3])
    assert accept_path(tree, rows, greedy=True) == ([0, 2, 5], 3)
    rows = one_hot_rows([3, 0, 2, 0, 0, 0, 0])  # node 1 (token 3), then the target wants 2: node 1 has only 4
    assert accept_path(tree, rows, greedy=True) == ([1], 2)
    rows = one_hot_rows([4, 0, 0, 0, 0, 0, 0])  # no child of the root: the target's own token
    assert accept_path(tree, rows, greedy=True) == ([], 4)


def _outcomes(accept, tree, probs, samples, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = Counter()
    tokens = tree.tokens.tolist()
    for _ in range(samples):
        path, nxt = accept(tree, probs, greedy=False, generator=g)
        emitted = [tokens[i] for i in path] + [nxt]
        counts[tuple(emitted[:2]) if len(emitted) > 1 else (emitted[0], None)] += 1
    return counts


def _expected(tree, probs):
    """The law of the first two emitted tokens if each is drawn from the target: the first from p after the root;
    a second only when the first is a child's token (node c), drawn from p after c."""
    child_of_root = {int(tree.tokens[c]): c for c in tree.children(-1)}
    out = {}
    for x in range(probs.shape[1]):
        if x in child_of_root:
            c = child_of_root[x]
            for y in range(probs.shape[1]):
                out[x, y] = float(probs[0, x] * probs[c + 1, y])
        else:
            out[x, None] = float(probs[0, x])
    return out


def _pvalue(accept, tree, probs, samples=6000):
    expected = _expected(tree, probs)
    counts = _outcomes(accept, tree, probs, samples)
    if not set(counts) <= set(expected):  # an outcome the target's law never produces
        return 0.0
    keys = sorted(expected, key=str)
    return chi2_pvalue(torch.tensor([float(counts.get(k, 0)) for k in keys]),
                       torch.tensor([expected[k] for k in keys], dtype=torch.float64))


def _unnormalized(tree, target_probs, *, greedy, generator=None):
    """A subtler planted mistake: the residual drops a rejected sibling's mass but the next sibling is still
    kept with probability p(x), not p(x) over what is left: every outcome possible, the law wrong."""
    tokens = tree.tokens.tolist()
    path, node = [], -1
    while True:
        p = target_probs[node + 1].clone()
        kept = None
        for c in tree.children(node):
            if float(torch.rand((), generator=generator)) < float(p[tokens[c]]):
                kept = c
                break
            p[tokens[c]] = 0.0
        if kept is None:
            return path, int(torch.multinomial(p / p.sum(), 1, generator=generator))
        path.append(kept)
        node = kept
        if not tree.children(node):
            return path, int(torch.multinomial(target_probs[node + 1], 1, generator=generator))


def test_sampled_acceptance_emits_the_targets_distribution_and_a_wrong_residual_is_caught():
    tree = Tree(TOKENS, PARENTS)
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(7, 5, generator=g) * 1.5, -1)
    assert _pvalue(accept_path, tree, probs) > 1e-3
    assert _pvalue(accept_path_without_residual, tree, probs) < 1e-6
    assert _pvalue(_unnormalized, tree, probs) < 1e-6


def _table_expand(vocab=6, seed=0):
    """Logits after each node, a fixed function of the path to it (what a drafter's expansion returns)."""
    g = torch.Generator().manual_seed(seed)
    table = {}

    def expand(frontier, tokens, parents):
        rows = []
        for node in frontier:
            key = []
            while node != -1:
                key.append(tokens[node])
                node = parents[node]
            key = tuple(key[::-1])
            if key not in table:
                table[key] = torch.randn(vocab, generator=g) * 2
            rows.append(table[key])
        return torch.stack(rows)

    return expand, table


def test_a_dynamic_tree_of_width_one_is_the_drafters_greedy_chain():
    expand, _ = _table_expand()
    tree = dynamic_tree(expand, depth=4, topk=1, nodes=4)
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    chain = []
    for _ in range(4):  # the greedy chain, read from the same table
        chain.append(int(expand([len(chain) - 1], chain, list(range(-1, len(chain) - 1)))[0].argmax()))
    assert tree.tokens.tolist() == chain


def test_a_dynamic_tree_keeps_the_most_likely_candidates_with_their_ancestors():
    vocab, depth, topk, nodes = 6, 3, 3, 7
    expand, table = _table_expand(vocab)
    built = {}

    def recording(frontier, tokens, parents):
        built.update(tokens=tokens, parents=parents)
        return expand(frontier, tokens, parents)

    tree = dynamic_tree(recording, depth=depth, topk=topk, nodes=nodes)
    assert len(built["tokens"]) == topk + (depth - 1) * topk ** 2
    assert len(tree) == nodes
    parents = tree.parents.tolist()
    assert all(p < i for i, p in enumerate(parents))
    for i, p in enumerate(parents):  # a child never outscores its parent
        if p >= 0:
            assert tree.scores[i] <= tree.scores[p] + 1e-6
    # The kept nodes' scores are the `nodes` highest of all candidates built.
    all_scores = []
    for t, p in zip(built["tokens"], built["parents"]):
        path, node = [t], p
        while node != -1:
            path.append(built["tokens"][node])
            node = built["parents"][node]
        path = path[::-1]
        score = sum(float(torch.log_softmax(table[tuple(path[:d])], -1)[path[d]]) for d in range(len(path)))
        all_scores.append(score)
    want = sorted(all_scores, reverse=True)[:nodes]
    assert sorted(tree.scores.tolist(), reverse=True) == pytest.approx(want, abs=1e-5)
    # Siblings are tried most likely first.
    for node in [-1, *range(len(tree))]:
        kids = tree.children(node)
        assert [float(tree.scores[c]) for c in kids] == sorted((float(tree.scores[c]) for c in kids), reverse=True)


def test_a_dynamic_tree_maps_a_draft_vocabulary_to_token_ids():
    expand, _ = _table_expand(4)
    vocab = torch.tensor([3, 10, 11, 40])
    plain = dynamic_tree(expand, depth=3, topk=2, nodes=5)
    mapped = dynamic_tree(lambda f, t, p: expand(f, [int((vocab == x).nonzero()) for x in t], p), depth=3, topk=2,
                          nodes=5, vocab=vocab)
    assert mapped.tokens.tolist() == vocab[plain.tokens].tolist()
    assert mapped.parents.tolist() == plain.parents.tolist()


def test_tree_shapes_parse_and_refuse_what_cannot_be_built():
    assert TreeShape.parse("d4t4n16") == TreeShape(4, 4, 16)
    assert TreeShape(4, 4, 16).label == "d4t4n16"
    with pytest.raises(ValueError, match="d<depth>t<topk>n<nodes>"):
        TreeShape.parse("4x4")
    with pytest.raises(ValueError, match="more than the 4 candidates"):
        TreeShape(4, 1, 5)


def test_a_static_tree_gives_each_path_the_token_of_its_ranks():
    expand, table = _table_expand()
    static = TreeShape.parse("static:0,1,0.0,0.1,1.0,0.0.0")
    assert isinstance(static, StaticTree) and (static.depth, static.nodes) == (3, 6)
    assert static.label == "static:0,1,0.0,0.1,1.0,0.0.0"
    tree = static.grow(expand)
    assert tree.parents.tolist() == [-1, -1, 0, 0, 1, 2]
    root = torch.log_softmax(table[()], -1).argsort(descending=True)
    first, second = int(root[0]), int(root[1])
    assert tree.tokens[:2].tolist() == [first, second]
    after_first = torch.log_softmax(table[(first,)], -1).argsort(descending=True)
    assert tree.tokens[2:4].tolist() == after_first[:2].tolist()
    assert int(tree.tokens[4]) == int(torch.log_softmax(table[(second,)], -1).argmax())
    want = float(torch.log_softmax(table[()], -1)[first] + torch.log_softmax(table[(first,)], -1)[after_first[1]])
    assert float(tree.scores[3]) == pytest.approx(want)
    # A chain of rank-0 paths is the greedy chain, as the dynamic tree of width one is.
    chain = TreeShape.parse("static:0,0.0,0.0.0").grow(expand)
    assert chain.tokens.tolist() == TreeShape(3, 1, 3).grow(expand).tokens.tolist()


def test_static_trees_refuse_what_is_not_a_tree():
    with pytest.raises(ValueError, match="comes before its parent"):
        StaticTree.parse("static:0,1.0")
    with pytest.raises(ValueError, match="twice"):
        StaticTree.parse("static:0,0")
    with pytest.raises(ValueError, match="static:<paths of ranks>"):
        TreeShape.parse("static:0,a")
