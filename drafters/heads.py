"""What every feature-reading head shares: its config and the drafter state.

A head (EAGLE-3 in drafters/eagle.py, EAGLE-1 in eagle1.py, MTP in mtp.py, Medusa in medusa.py) is
an `nn.Module` whose `forward` is its training loss, so Accelerate/DDP wrap it like any model, plus a
`drafter(name)` that drafts with it inside the speculative loop.

Features: a drafter declares `feature_layers`, indices into Hugging Face `output_hidden_states`
(train/hidden_states.py documents the convention). The loop then runs the target with hidden states
and hands the drafter, through `start` and `commit`, the features of every committed position exactly
once: `features_of` below is the one function that selects them, in training and in the loop alike.

For batches (eval/batching.py) `FeatureBatch` keeps the same state per row, and `ChainBatch` drafts the
EAGLE heads' chains for every row at once on a ragged cache (one length per row); each head's
`batch_drafter` gives its own.

Building, saving and loading a head of any kind is drafters/registry.py's, which knows the kinds; this module
knows none of them.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig

from drafters.base import Chains, ConfidenceStop, Proposal
from drafters.kv_cache import KVCache, RaggedRows
from drafters.sampling import Sampling
from drafters.tree import Tree, entry_mask

# config.json architectures of EAGLE-3 and EAGLE-1 checkpoints in the engines' formats, which load_head reads too.
ENGINE_EAGLE3 = ("LlamaForCausalLMEagle3", "Eagle3Speculator")
ENGINE_EAGLE1 = ("EagleLlamaForCausalLM",)
ENGINE_PEAGLE = ("PEagleSpeculator",)  # speculators' P-EAGLE (drafters/peagle.py)


def features_of(hidden_states: tuple[torch.Tensor, ...], layers: list[int]) -> torch.Tensor:
    """(B, T, len(layers), d): the hidden states at `layers` of a forward with output_hidden_states."""
    return torch.stack([hidden_states[i] for i in layers], dim=2)


def check_layers(layers: list[int], num_layers: int) -> None:
    bad = [i for i in layers if not 0 <= i <= num_layers]
    if bad or not layers:
        raise ValueError(f"hidden-state layer indices must be in 0..{num_layers} (the index into "
                         f"output_hidden_states of a {num_layers}-layer model), got {layers}")


def load_engine_state(head: nn.Module, state: dict[str, torch.Tensor], path) -> None:
    """An engine format's tensors into `head`, every one of them named as the head names it (`path`: the export, for
    the error)."""
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}/model.safetensors: missing {sorted(missing)}, unexpected {sorted(unexpected)}")


def beside(head: nn.Module, target, dtype: torch.dtype | None = None) -> nn.Module:
    """`head` on the target's device in `dtype` (float32 unless given), in eval mode, attached to the target's
    embedding and output head: a loaded head ready to draft."""
    head = head.to(device=next(target.parameters()).device, dtype=dtype or torch.float32).eval()
    head.attach(target)
    return head


def head_config(target_config, kind: str, feature_layers: list[int], intermediate_size: int | None = None,
                rope: dict | None = None, **settings) -> LlamaConfig:
    """A one-layer Llama config with the target's attention/MLP geometry and RoPE, plus the head's settings.
    `intermediate_size`: the head's MLP width, the target's when None (kept in the head's own config,
    as EAGLE-3 checkpoints keep theirs). `rope`: the head's own RoPE (transformers 5's `rope_parameters`, e.g. what an
    engine-format export carries, `export_rope`) in place of the target's."""
    check_layers(feature_layers, target_config.num_hidden_layers)
    if intermediate_size is not None and intermediate_size < 1:
        raise ValueError(f"the head's intermediate_size must be >= 1 (None = the target's), got {intermediate_size}")
    if rope is None:
        rope = getattr(target_config, "rope_parameters", None)
    if isinstance(rope, dict) and "full_attention" in rope:  # Gemma-3: one per attention type; the head's is full
        rope = rope["full_attention"]
    return LlamaConfig(
        vocab_size=target_config.vocab_size, num_hidden_layers=1, **geometry(target_config, intermediate_size),
        rope_parameters=rope, tie_word_embeddings=False,
        draftsmith_kind=kind, feature_layers=list(feature_layers), target_hidden_size=target_config.hidden_size,
        **settings,
    )


def export_rope(raw: dict) -> dict | None:
    """The RoPE an engine-format export's config.json carries, as transformers 5's `rope_parameters` (rope_type,
    rope_theta, the scaling's own keys), or None where it carries none. The engines (vLLM, SGLang) and the peers'
    classes build the draft's attention from the export's RoPE, not the target's, and a draft may have been trained
    at another base than its target's. Read, in order, speculators' nested `transformer_layer_config` then the top
    level, each's `rope_parameters` (Gemma-3's nested per attention type: the full one) or else `rope_theta` with
    `rope_scaling` (transformers 4's names, which the engines read)."""
    for where in (raw.get("transformer_layer_config") or {}, raw):
        params = where.get("rope_parameters")
        if isinstance(params, dict) and "full_attention" in params:
            params = params["full_attention"]
        if params:
            return {"rope_type": "default", **params}
        scaling = dict(where.get("rope_scaling") or {})
        if where.get("rope_theta") is None and not scaling:
            continue
        if "type" in scaling:  # transformers 4's older name of rope_type
            scaling.setdefault("rope_type", scaling.pop("type"))
        # No rope_theta beside (or inside) a scaling: the base the engines' configs default to (Llama's, 10,000).
        theta = where.get("rope_theta") or scaling.get("rope_theta") or 10000.0
        return {"rope_type": "default", **scaling, "rope_theta": float(theta)}
    return None


def geometry(target_config, intermediate_size: int | None = None) -> dict:
    """The target's width, attention and MLP shape and norm epsilon, under the names its family gives them
    (GPT-2's `n_inner`, GPT-NeoX's and GPT-2's single key/value head per query head, LayerNorm epsilons), as a
    Llama block's config names them.

    The activation is SiLU whatever the target's (Gemma's GELU, GPT-2's): the engines build a head's layer
    as their Llama block, and vLLM's and SGLang's refuse any other activation ("Only silu is supported for
    now", vLLM 0.33.0's model_executor/models/llama.py). The head is a network of its own; nothing about
    the target's MLP carries into it."""

    def first(*names, default=None):
        return next((v for v in (getattr(target_config, n, None) for n in names) if v is not None), default)

    d, heads = target_config.hidden_size, target_config.num_attention_heads
    return dict(
        hidden_size=d, num_attention_heads=heads,
        intermediate_size=intermediate_size or first("intermediate_size", "n_inner", default=4 * d),  # GPT-2: 4d
        num_key_value_heads=first("num_key_value_heads", default=heads),
        head_dim=first("head_dim", default=d // heads),
        rms_norm_eps=first("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", default=1e-6),
        hidden_act="silu",
        max_position_embeddings=first("max_position_embeddings", default=2048),
    )


class FeatureDrafter:
    """Drafter state shared by the heads: the committed ids and the features not yet read.

    The loop calls `start(prompt_ids, features)` with the features of every prompt position but the
    last (the target has not processed the last one yet), and `commit(n, token, features)` with the
    features of the positions its verification pass committed. So `len(self.ids) - 1` features have
    been delivered at any time, the last `len(self.pending)` of them still unread by the head.
    """

    parallel = False  # its k guesses cost k draft steps (drafters/base.py `Drafter.parallel`)

    def __init__(self, head: nn.Module, name: str, stop_below: float = 0.0, stop_rule: str = "propose") -> None:
        self.head, self.name = head, name
        self.stop = ConfidenceStop(stop_below, stop_rule, name)  # confidence stop (drafters/base.py); 0 = off
        self.feature_layers = list(head.config.feature_layers)
        self.device = next(head.parameters()).device
        self.dtype = next(head.parameters()).dtype

    def batched(self):
        """This drafter for a batch (drafters/base.py `BatchDrafter`): the head's batch drafter."""
        return self.head.batch_drafter(self.name, self.stop.below, self.stop.rule)

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        self.ids: list[int] = prompt_ids.tolist()
        self.pending = self._flat(features, len(self.ids) - 1)
        self.guesses: list[int] = []

    def commit(self, n_accepted: int, next_token: int, features: torch.Tensor | None = None) -> None:
        self.pending = torch.cat([self.pending, self._flat(features, n_accepted + 1)])
        self.ids.extend(self.guesses[:n_accepted])
        self.ids.append(next_token)

    def _flat(self, features: torch.Tensor | None, expected: int) -> torch.Tensor:
        """(n, len(layers), d) -> (n, len(layers) * d) in the head's dtype, checking the count."""
        if features is None:
            raise ValueError(f"drafter {self.name!r} reads the target's hidden states, but the loop passed none")
        if features.shape[0] != expected:
            raise ValueError(f"drafter {self.name!r} expected features for {expected} positions, got {features.shape[0]}")
        return features.flatten(1).to(self.dtype)


class BatchOfOne(FeatureDrafter):
    """A head's batch-1 drafter kept as its batch drafter's one row (`batch_class`: DFlash's, P-EAGLE's), where a
    round is one forward whatever the batch."""

    batch_class: type

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        self.batch = self.batch_class(self.head, self.name, self.stop.below, self.stop.rule)
        self.batch.start([prompt_ids], None if features is None else [features])

    def propose(self, k: int, sampling: Sampling, generator: torch.Generator | None = None) -> Proposal:
        return self.batch.propose(k, sampling, generator)[0]

    def commit(self, n_accepted: int, next_token: int, features: torch.Tensor | None = None) -> None:
        self.batch.commit([n_accepted], [next_token], None if features is None else [features])


class TreeDrafting:
    """Trees (drafters/tree.py: EAGLE-2's dynamic `TreeShape`, or a `StaticTree`) for a head that drafts on its own
    outputs (EAGLE-3, EAGLE-1), batch 1. The round starts as a chain's does: the head reads the features not yet read (`first`), and
    that entry's output scores the root's children. Then, depth by depth, the expanded nodes of one depth go in
    as one call of q entries, node x's entry pairing its parent's output with x's token, all at the depth's
    position, each seeing the committed entries and its own ancestors' entries (`step_tree`'s mask). At commit
    the drafted entries are dropped, as after a chain, and the head reads the target's features of the kept path.
    Needs `first(tokens, start)`, `tree_logits(h)` and the head's `step_tree`."""

    @torch.inference_mode()
    def propose_tree(self, shape, sampling: Sampling, generator: torch.Generator | None = None) -> Tree:
        head, m = self.head, len(self.ids) - 1
        if m == 0:  # a one-token prompt: no features yet, nothing to draft from
            self.tree = Tree(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))
            return self.tree
        new = self.pending.shape[0]
        h0 = self.first(torch.tensor(self.ids[m - new + 1: m + 1], device=self.device), m - new)
        self.pending, self.fed = self.pending[:0], m
        outputs = {-1: h0[0, -1]}  # node -> the head's output after it (the root's: the committed entry's)
        slots: dict[int, int] = {}  # node -> its entry's index in the cache

        def expand(frontier: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
            if frontier != [-1]:
                mask, depth = entry_mask(frontier, parents, slots, len(self.cache), self.fed, self.device)
                hidden = torch.stack([outputs[parents[node]] for node in frontier])[None]
                ids = torch.tensor([tokens[node] for node in frontier], device=self.device)
                out = head.step_tree(hidden, ids, m + depth - 1, mask, self.cache)[0]
                outputs.update(zip(frontier, out))
            return self.tree_logits(torch.stack([outputs[node] for node in frontier])).float()

        self.tree = shape.grow(expand, vocab=getattr(self, "target_ids", None))
        return self.tree

    def commit_path(self, path: list[int], next_token: int, features: torch.Tensor | None = None) -> None:
        """The target kept the tree's nodes `path` (root to leaf) and added `next_token`: the state continues as
        after a chain of those guesses."""
        self.guesses = self.tree.tokens[path].tolist()
        self.commit(len(path), next_token, features)


class FeatureBatch(FeatureDrafter):
    """`FeatureDrafter`'s state for a batch (drafters/base.py `BatchDrafter`): per row, the committed ids,
    the features not yet read and the last proposal."""

    def start(self, prompts: list[torch.Tensor], features: list[torch.Tensor] | None = None) -> None:
        if features is None:
            raise ValueError(f"drafter {self.name!r} reads the target's hidden states, but the loop passed none")
        self.ids = [p.tolist() for p in prompts]
        self.pending = [self._flat(f, len(ids) - 1) for f, ids in zip(features, self.ids)]
        self.guesses: list[list[int]] = [[] for _ in prompts]

    def commit(self, accepted: list[int], next_tokens: list[int], features: list[torch.Tensor] | None = None) -> None:
        for b, (a, token) in enumerate(zip(accepted, next_tokens)):
            self.pending[b] = torch.cat([self.pending[b], self._flat(features[b], a + 1)])
            self.ids[b].extend(self.guesses[b][:a])
            self.ids[b].append(token)

    def keep(self, rows: list[int]) -> None:
        self.ids, self.pending, self.guesses = ([xs[r] for r in rows] for xs in (self.ids, self.pending, self.guesses))

    def join(self, prompts: list[torch.Tensor], features: list[torch.Tensor] | None = None) -> None:
        """New rows after the running ones, each started on its prompt as `start` starts a batch."""
        other = type(self)(self.head, self.name, self.stop.below, self.stop.rule)
        other.start(prompts, features)
        self.absorb(other)

    def absorb(self, other: "FeatureBatch") -> None:
        """Take the rows of `other` (a batch of the same head, started on other prompts) after these."""
        self.ids, self.pending, self.guesses = self.ids + other.ids, self.pending + other.pending, self.guesses + other.guesses


class ChainBatch(FeatureBatch):
    """A head that drafts a chain on its own KV cache (EAGLE-3, EAGLE-1) for a ragged batch: the round's
    first step feeds each row its unread features (as many as it committed last round) and drafts from
    each row's last entry; later steps feed every row its last guess. The cache (one length per row) keeps
    the entries built from the target's features; drafted entries are dropped at commit. Subclasses give
    `first`, `next`, `logits` and `pick`."""

    def start(self, prompts, features=None) -> None:
        super().start(prompts, features)
        self.rows = RaggedRows(len(prompts), self.device)
        self.cache = KVCache(self.rows)
        self.fed = [0] * len(prompts)  # per row: cache entries built from the target's real features
        self._prefill()

    @torch.inference_mode()
    def _prefill(self) -> None:
        """Cache every row's prompt features but the newest, which the first round's first step feeds (and
        drafts from): the prompt is read here, with the target's prefill, not inside a round."""
        counts = [p.shape[0] - 1 for p in self.pending]
        q = max(counts)
        if q == 0:
            return
        hidden = torch.stack([torch.cat([p[:n], p[-1:].expand(q - n, -1)]) for p, n in zip(self.pending, counts)])
        tokens = torch.tensor([ids[len(ids) - n - 1: len(ids) - 1] + [ids[-1]] * (q - n)
                               for ids, n in zip(self.ids, counts)], device=self.device)
        self.first(hidden, tokens, torch.tensor(counts, device=self.device).clamp(min=1) - 1)
        self.rows.advance(counts)
        self.fed = list(self.rows.lengths)
        self.pending = [p[-1:] for p in self.pending]

    @torch.inference_mode()
    def propose(self, k: int, sampling: Sampling, generator: torch.Generator | None = None) -> list[Proposal]:
        B = len(self.ids)
        counts = [p.shape[0] for p in self.pending]
        q = max(counts)
        hidden = torch.stack([torch.cat([p, p[-1:].expand(q - len(p), -1)]) for p in self.pending])
        # Feature i of a row pairs with the token after it: a row's last len(pending) committed ids.
        tokens = torch.tensor([ids[len(ids) - n:] + [ids[-1]] * (q - n) for ids, n in zip(self.ids, counts)],
                              device=self.device)
        h = self.first(hidden, tokens, torch.tensor(counts, device=self.device) - 1)
        self.rows.advance(counts)
        self.fed = [len(ids) - 1 for ids in self.ids]
        self.pending = [p[:0] for p in self.pending]
        chains = Chains(B, self.stop)
        for step in range(1, k + 1):
            logits = self.logits(h)  # (B, V)
            tokens, q = self.pick(logits, sampling, generator)  # every row at once
            if chains.add(logits, tokens, q) or step == k:
                break
            h = self.next(h, tokens[:, None])
            self.rows.advance([1] * B)
        proposals = chains.proposals()
        self.guesses = [p.tokens.tolist() for p in proposals]
        return proposals

    def commit(self, accepted, next_tokens, features=None) -> None:
        self.rows.crop(self.fed)
        super().commit(accepted, next_tokens, features)

    def keep(self, rows: list[int]) -> None:
        self.rows.select(rows)
        self.fed = [self.fed[r] for r in rows]
        super().keep(rows)

    def absorb(self, other: "ChainBatch") -> None:
        self.cache.absorb(other.cache)
        self.rows.extend(other.rows)
        self.fed = self.fed + other.fed
        super().absorb(other)
