"""Tree proposals: the shape a drafter proposes when it guesses several continuations at once (EAGLE-2's dynamic
tree), the attention a verifier gives it, and the lossless choice of the path the target keeps.

A tree hangs below the last committed token (the root, node -1). Node i holds a guessed token and its parent,
which comes before it (`parents[i] < i`), so a tree is also a topological order. Verifying a tree is one target
forward over [root, node 0, ..., node n-1], each position seeing the committed prefix and its own ancestors
(`ancestor_mask`), at position prefix + depth (`depths`). The target's distributions at those n+1 positions
decide which path it keeps (`accept_path`):

- greedy: from the root, follow the child whose token is the target's argmax at its parent, while there is one;
  the next token is the argmax after the last node kept. The kept path is exactly the target's greedy
  continuation.
- sampled: at each node the target's distribution p is checked against the node's children in their order,
  each a deterministic guess (EAGLE-2 proposes the top-k children, not draws): child x is kept with probability
  p(x) / sum(p), and if it is not, x's mass is removed from p (the residual max(p - onehot(x), 0)) before the
  next sibling. When no child is kept, the next token is drawn from what is left of p; when the path reaches a
  leaf, from the target's distribution there (the bonus). The emitted token at each depth is then distributed
  exactly as p: P(child j) = prod_{i<j} (1 - r_i) * r_j telescopes to p(x_j), and the residual carries the rest.
  (This is the multi-candidate rule of SpecInfer and EAGLE-2, with one-hot draft distributions.)

`dynamic_tree` builds EAGLE-2's context-aware tree from any drafter that can score a set of nodes: depth by depth,
it expands the top-k children of the `topk` nodes with the highest cumulative draft log-probability, then keeps
the `nodes` best of all candidates. A child's score never exceeds its parent's, and ties go to the earlier node,
so every kept node's ancestors are kept.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Tree:
    """Guessed tokens (n,) int64 and their parents (n,) int64 (-1: the root), parents[i] < i; `scores`: each node's
    cumulative draft log-probability where the drafter gives one (children of a node are ordered by it)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.tokens.shape != self.parents.shape or self.tokens.dim() != 1:
            raise ValueError(f"a tree needs tokens and parents of one shape (n,), got {tuple(self.tokens.shape)} "
                             f"and {tuple(self.parents.shape)}")
        n = self.tokens.numel()
        if n and not bool((self.parents < torch.arange(n, device=self.parents.device)).all()):
            raise ValueError("every node's parent must come before it (parents[i] < i; -1 is the root)")
        if n and int(self.parents.min()) < -1:
            raise ValueError("a parent index below -1")

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def children(self, node: int) -> list[int]:
        """The children of `node` (-1: the root), in the order they are tried."""
        return (self.parents == node).nonzero().flatten().tolist()

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node` (empty for the root)."""
        path = []
        while node != -1:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]


def depths(parents: torch.Tensor) -> torch.Tensor:
    """(n,) each node's depth below the root (the root's children: 1)."""
    out = torch.zeros(parents.numel(), dtype=torch.long, device=parents.device)
    for i, p in enumerate(parents.tolist()):
        out[i] = 1 if p < 0 else out[p] + 1
    return out


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """(n+1, n+1) bool over [root, nodes]: entry (i, j) is True where position j is position i itself or one of its
    ancestors (the root is everyone's). A verifier's attention over the tree, beside the committed prefix."""
    n = parents.numel()
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=parents.device)
    mask[:, 0] = True
    for i, p in enumerate(parents.tolist()):
        mask[i + 1] = mask[p + 1]
        mask[i + 1, i + 1] = True
    return mask


def accept_path(tree: Tree, target_probs: torch.Tensor, *, greedy: bool,
                generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """The path the target keeps and its next token (module docstring). target_probs: (n+1, V), the target's
    distribution after the root (row 0) and after each node (row i+1), already processed by the sampling settings
    (greedy: only its argmax is read). Returns (kept nodes from the root down, next token)."""
    tokens = tree.tokens.tolist()
    path, node = [], -1
    while True:
        p = target_probs[node + 1]
        children = tree.children(node)
        if greedy:
            best = int(p.argmax())
            kept = next((c for c in children if tokens[c] == best), None)
            if kept is None:
                return path, best
        else:
            p = p.clone()
            kept = None
            for c in children:
                total = p.sum()
                mass = p[tokens[c]]
                # Kept with probability mass / total; written u * total < mass so a zero total never divides.
                if float(torch.rand((), generator=generator, device=p.device) * total) < float(mass):
                    kept = c
                    break
                p[tokens[c]] = 0.0  # the residual max(p - onehot(x), 0)
            if kept is None:
                return path, int(torch.multinomial(p / p.sum(), 1, generator=generator))
        path.append(kept)
        node = kept
        if not tree.children(node):  # a leaf: the bonus token from the target's distribution after it
            after = target_probs[node + 1]
            return path, int(after.argmax()) if greedy else int(torch.multinomial(after, 1, generator=generator))


@dataclass(frozen=True)
class TreeShape:
    """An EAGLE-2 dynamic tree's size: `depth` draft steps, the `topk` most likely nodes expanded at each (each into
    its `topk` most likely children), and the `nodes` most likely of all candidates verified. `depth`, `topk` 1 and
    `nodes` = `depth` is the greedy chain of `depth` guesses. Written `d4t4n16` in rows, reports and on the command
    line (`trees=[d4t4n16]`)."""

    depth: int
    topk: int
    nodes: int

    def __post_init__(self) -> None:
        if self.depth < 1 or self.topk < 1 or self.nodes < 1:
            raise ValueError(f"a tree needs depth, topk and nodes >= 1, got {self.label}")
        built = self.topk + (self.depth - 1) * self.topk ** 2
        if self.nodes > built:
            raise ValueError(f"tree {self.label}: {self.nodes} nodes is more than the {built} candidates {self.depth} "
                             f"steps of top-{self.topk} build (topk + (depth - 1) * topk^2)")

    @property
    def label(self) -> str:
        return f"d{self.depth}t{self.topk}n{self.nodes}"

    @classmethod
    def parse(cls, text: "str | TreeShape | StaticTree") -> "TreeShape | StaticTree":
        """`d4t4n16` (depth 4, top-4, 16 nodes) -> TreeShape(4, 4, 16); `static:0,1,0.0` -> a StaticTree."""
        if isinstance(text, (TreeShape, StaticTree)):
            return text
        if str(text).strip().startswith("static:"):
            return StaticTree.parse(text)
        match = re.fullmatch(r"d(\d+)t(\d+)n(\d+)", str(text).strip())
        if not match:
            raise ValueError(f"a tree shape is written d<depth>t<topk>n<nodes> (e.g. d4t4n16) or static:<rank paths> "
                             f"(e.g. static:0,1,0.0); got {text!r}")
        return cls(*(int(g) for g in match.groups()))

    def grow(self, expand: Callable, vocab: torch.Tensor | None = None) -> "Tree":
        """This shape's tree from a drafter's `expand` (see `dynamic_tree`)."""
        return dynamic_tree(expand, depth=self.depth, topk=self.topk, nodes=self.nodes, vocab=vocab)


@dataclass(frozen=True)
class StaticTree:
    """A tree of fixed shape whatever the context (EAGLE-1's trees, vLLM's `speculative_token_tree`): each node is a
    path of child ranks from the root, (0,) the drafter's most likely first token, (0, 1) the second most likely
    after it. Every path's parent path is in the tree. Written `static:0,1,0.0,0.1` (ranks joined by dots, paths by
    commas)."""

    paths: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValueError("a static tree needs at least one node")
        seen = set()
        for path in self.paths:
            if not path or min(path) < 0:
                raise ValueError(f"static tree {self.label}: {path} is not a path of ranks >= 0")
            if path in seen:
                raise ValueError(f"static tree {self.label}: {path} twice")
            if len(path) > 1 and path[:-1] not in seen:
                raise ValueError(f"static tree {self.label}: {path} comes before its parent {path[:-1]} (list each "
                                 "node after its parent)")
            seen.add(path)

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def nodes(self) -> int:
        return len(self.paths)

    @property
    def label(self) -> str:
        return "static:" + ",".join(".".join(str(r) for r in p) for p in self.paths)

    @classmethod
    def parse(cls, text: str) -> "StaticTree":
        body = str(text).strip().removeprefix("static:")
        try:
            return cls(tuple(tuple(int(r) for r in path.split(".")) for path in body.split(",")))
        except ValueError as err:
            if "invalid literal" in str(err):
                raise ValueError(f"a static tree is written static:<paths of ranks>, e.g. static:0,1,0.0; got {text!r}")
            raise

    def grow(self, expand: Callable, vocab: torch.Tensor | None = None) -> "Tree":
        """The tree for this context: depth by depth, the drafter's logits after each node with children give each
        child the token of its rank. Scores are cumulative draft log-probabilities, as in `dynamic_tree`."""
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        index: dict[tuple[int, ...], int] = {(): -1}
        for level in range(1, self.depth + 1):
            children = [p for p in self.paths if len(p) == level and p[:-1] in index]
            if not children:
                break
            frontier = list(dict.fromkeys(index[p[:-1]] for p in children))
            logp = torch.log_softmax(expand(frontier, tokens, parents).float(), dim=-1)  # (f, V')
            ranked = logp.topk(min(max(p[-1] for p in children) + 1, logp.shape[-1]), dim=-1)
            for path in children:
                row, rank = frontier.index(index[path[:-1]]), path[-1]
                if rank >= ranked.indices.shape[-1]:
                    continue  # a vocabulary smaller than the rank: no such child (nor any below it)
                token = ranked.indices[row, rank]
                index[path] = len(tokens)
                tokens.append(int(token if vocab is None else vocab[token]))
                parents.append(index[path[:-1]])
                scores.append((scores[index[path[:-1]]] if len(path) > 1 else 0.0) + float(ranked.values[row, rank]))
        return Tree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                    torch.tensor(scores))


def dynamic_tree(expand: Callable[[list[int], list[int], list[int]], torch.Tensor], *, depth: int, topk: int,
                 nodes: int, vocab: torch.Tensor | None = None) -> Tree:
    """EAGLE-2's dynamic tree (module docstring). `expand(frontier, tokens, parents)` gives the drafter's logits
    (len(frontier), V') after each frontier node: -1 (the root) first, then nodes of the previous depth, as indices
    into `tokens` and `parents`, the candidates built so far (a node's path is read through them). `vocab` maps the
    logits' columns to token ids (a head's draft vocabulary); None: columns are token ids. Returns the `nodes`
    kept, parents before children."""
    TreeShape(depth, topk, nodes)  # validates
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    frontier, frontier_scores = [-1], torch.zeros(1)
    for level in range(depth):
        logp = torch.log_softmax(expand(frontier, tokens, parents).float(), dim=-1)  # (f, V')
        width = min(topk, logp.shape[-1])
        top = logp.topk(width, dim=-1)
        cand = frontier_scores.to(logp.device)[:, None] + top.values  # (f, width)
        ids = top.indices if vocab is None else vocab[top.indices]
        first = len(tokens)
        tokens += ids.flatten().tolist()
        parents += [p for p in frontier for _ in range(width)]
        flat = cand.flatten()
        scores += flat.tolist()
        if level == depth - 1:
            break
        best = flat.topk(min(topk, flat.numel())).indices.sort().values  # this depth's most likely, in node order
        frontier = [first + int(b) for b in best.tolist()]
        frontier_scores = flat[best].cpu()
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[:nodes]
    kept = sorted(order)  # node order: parents (earlier depths) first
    index = {old: new for new, old in enumerate(kept)}
    return Tree(torch.tensor([tokens[i] for i in kept], dtype=torch.long),
                torch.tensor([index[parents[i]] if parents[i] >= 0 else -1 for i in kept], dtype=torch.long),
                torch.tensor([scores[i] for i in kept]))


def entry_mask(frontier: list[int], parents: list[int], slots: dict[int, int], start: int, committed: int,
               device: torch.device) -> tuple[torch.Tensor, int]:
    """A drafter growing a tree on its own KV cache, one depth per call: the (q, start + q) bool mask of the
    frontier's q entries, written at cache slots start..start+q-1, each seeing the `committed` first entries, its
    ancestors' entries and its own; and the frontier's depth. `slots` (node -> cache slot) gains the frontier."""
    q = len(frontier)
    mask = torch.zeros(q, start + q, dtype=torch.bool, device=device)
    mask[:, :committed] = True
    depth = 0
    for i, node in enumerate(frontier):
        slots[node] = start + i
        mask[i, start + i] = True
        depth, up = 1, parents[node]
        while up != -1:
            mask[i, slots[up]] = True
            depth, up = depth + 1, parents[up]
    return mask, depth
