"""Hugging Face causal LMs (the target, a draft LM) decoding on a KV cache: the keyword their forward takes
the cache under, and a ragged cache (a length per row) with the batched forward over it.

**Ragged KV caches.** In a batch of speculative decoding, after a round row b has kept a_b guesses and row c
another number, so the rows' committed lengths differ. Each cache here keeps, per row, its own length in
one preallocated buffer (B, kv_heads, capacity, head_dim) that grows by doubling:

- a forward feeds every row the same number q of entries (shorter rows padded at the end) and writes
  row b's entries at positions len_b .. len_b + q - 1 of its own row of the buffer;
- row b's queries see its keys 0 .. len_b + i (a mask built per row; key index = position, since rows
  never have holes), so padded entries and stale keys beyond a row's length are never attended;
- after the forward each row's length advances by its real entries only, and a rollback sets a row's
  length back: a rejected guess costs no copy and no prefix is ever recomputed;
- a row that finishes leaves the batch (its row is dropped from every buffer), as a request leaves a
  serving engine's batch; the others continue at the smaller batch.

`RaggedCache` gives a Hugging Face model this layout through transformers' cache interface, with
explicit per-row `position_ids` and a 4-D mask (boolean for SDPA, additive for eager attention; per
attention type for families with sliding-window layers). `RaggedRows` (drafters/kv_cache.py) holds the
lengths; the same module's `KVCache` takes a `RaggedRows` for the heads and the lean draft LM. The target
decodes on it in eval/batching.py's loops, and the draft LM's batch (drafters/draft_lm.py) drafts on it.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from drafters.heads import features_of
from drafters.kv_cache import RaggedRows, follow, ragged_write, stack_rows
from drafters.tree import ancestor_mask, depths


def cache_keyword(model: PreTrainedModel) -> str:
    """The keyword a Hugging Face model's forward takes its KV cache under: `cache` in transformers 5.24
    (which deprecates `past_key_values` with a FutureWarning, to be removed in 5.40), `past_key_values`
    in earlier releases and in remote-code models that keep the old signature."""
    return _cache_keyword(type(model))


@functools.cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


class RaggedLayer(CacheLayerMixin):
    """One attention layer of a `RaggedCache`: keys and values at per-row offsets (module docstring)."""

    is_sliding = False
    is_croppable = False

    def __init__(self, rows: RaggedRows) -> None:
        super().__init__()
        self.rows = rows
        self._generation = rows.generation

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def _follow(self) -> None:
        """Drop the rows the batch dropped since the last call."""
        self.keys = follow(self.keys, self.rows, self._generation)
        self.values = follow(self.values, self.rows, self._generation)
        self._generation = self.rows.generation

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._follow()
        self.keys = ragged_write(self.keys, key_states, self.rows)
        self.values = ragged_write(self.values, value_states, self.rows)
        end = self.rows.end(key_states.shape[2])
        return self.keys[:, :, :end], self.values[:, :, :end]

    def absorb(self, other: "RaggedLayer") -> None:
        """Take the rows of `other` (the same layer of another batch's cache) after this batch's rows."""
        if not other.is_initialized:
            return  # nothing written there: rows with no entries yet read nothing from the buffers
        if not self.is_initialized:
            self.lazy_initialization(other.keys, other.values)
        self._follow()
        other._follow()
        self.keys = stack_rows(self.keys, len(self.rows), other.keys, len(other.rows))
        self.values = stack_rows(self.values, len(self.rows), other.values, len(other.rows))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.rows.end(query_length), 0

    def get_seq_length(self) -> int:
        return max(self.rows.lengths, default=0)

    def get_max_length(self) -> int:
        return -1


class RaggedCache(Cache):
    """A Hugging Face KV cache with a length per row (module docstring), one `RaggedLayer` per layer."""

    def __init__(self, model: PreTrainedModel, rows: RaggedRows) -> None:
        config = model.config.get_text_config()
        super().__init__(layers=[RaggedLayer(rows) for _ in range(config.num_hidden_layers)])
        self.rows = rows

    def absorb(self, other: "RaggedCache") -> None:
        """Requests joining a running batch: `other` (their prefill's cache, another batch) gives its rows
        to this one, after the rows already here; then `self.rows.extend(other.rows)` adds their lengths."""
        for mine, theirs in zip(self.layers, other.layers):
            mine.absorb(theirs)


def attention_mask(model: PreTrainedModel, rows: RaggedRows, q: int) -> torch.Tensor | dict[str, torch.Tensor]:
    """The 4-D mask(s) a batched call of q entries per row passes to `model`, in the form its attention
    implementation reads (bool for SDPA, additive for eager), per attention type for families whose
    layers differ (Gemma-2/3's sliding-window layers)."""
    return _model_masks(model, lambda window: rows.mask(q, window), "batched decoding")


def tree_attention_mask(model: PreTrainedModel, past: int, parents: torch.Tensor,
                        device: torch.device) -> torch.Tensor | dict[str, torch.Tensor]:
    """The 4-D mask(s) for verifying a tree (drafters/tree.py) in one forward on top of `past` cached positions:
    the fed entries are [root, node 0, ..., node n-1], each at position past + its depth (the root's: 0); each
    sees the whole prefix (with a sliding window, its last `window` positions) and its own ancestors in the tree."""
    tree = ancestor_mask(parents).to(device)  # (n+1, n+1)
    query = past + torch.cat([parents.new_zeros(1), depths(parents)]).to(device)[:, None]  # (n+1, 1)
    key = torch.arange(past, device=device)

    def allowed(window: int | None) -> torch.Tensor:
        prefix = (key < query) & ((query - key < window) if window is not None else True)
        return torch.cat([prefix, tree], dim=1)[None, None]

    return _model_masks(model, allowed, "tree verification")


def masks_for(model: PreTrainedModel, allowed: torch.Tensor, query_positions: torch.Tensor,
              key_positions: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """An explicit (q, keys) bool mask in the form `model` reads, with each sliding-window layer type also
    limited to keys within the window of each query's position (positions given per query and per key)."""
    def limited(window: int | None) -> torch.Tensor:
        if window is None:
            return allowed[None, None]
        return (allowed & (query_positions[:, None] - key_positions[None, :] < window))[None, None]

    return _model_masks(model, limited, "tree drafting")


def entry_masks(model: PreTrainedModel, allowed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | dict:
    """A batch's explicit (B, N, N) bool masks over entries at `positions` (B, N) (PARD's training rows,
    drafters/pard.py) in the form `model` reads, each sliding-window layer type also limited to keys within the
    window."""
    def limited(window: int | None) -> torch.Tensor:
        if window is None:
            return allowed[:, None]
        return (allowed & (positions[:, :, None] - positions[:, None, :] < window))[:, None]

    return _model_masks(model, limited, "PARD's training")


def _model_masks(model: PreTrainedModel, allowed, what: str) -> torch.Tensor | dict[str, torch.Tensor]:
    """`allowed(window)` (bool, True where a query may attend) in the form `model` reads: bool for SDPA, additive
    for eager attention, one per attention type where its layers differ."""
    config = model.config.get_text_config()
    implementation = config._attn_implementation
    if implementation not in ("sdpa", "eager"):
        raise ValueError(f"{what} passes its own 4-D attention masks, which the {implementation!r} attention does "
                         "not take: load the target with attn_implementation='sdpa' or 'eager'")
    dtype = model.dtype

    def form(mask: torch.Tensor) -> torch.Tensor:
        if implementation == "sdpa":
            return mask
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)

    window = getattr(config, "sliding_window", None)
    types = set(getattr(config, "layer_types", None) or [])
    if types:
        return {kind: form(allowed(window if kind == "sliding_attention" else None)) for kind in types}
    if window is not None and getattr(config, "use_sliding_window", True):
        return form(allowed(window))
    return form(allowed(None))


def keep_path(cache: Cache, start: int, kept: list[int]) -> None:
    """After a tree's verification: of the entries written from position `start` on, keep those at offsets `kept`
    (increasing; the root's 0 and each kept node's), moved in place to start, start+1, ...; drop the rest. The
    prefix before `start` is not touched."""
    if kept != list(range(len(kept))):  # a chain-shaped path is already in place
        index = torch.tensor(kept, device=cache.layers[0].keys.device) + start
        for layer in cache.layers:
            layer.keys[:, :, start:start + len(kept)] = layer.keys.index_select(2, index)
            layer.values[:, :, start:start + len(kept)] = layer.values.index_select(2, index)
    cache.crop(start + len(kept) - cache.get_seq_length())  # transformers 5: crop takes a negative count


def pad_rows(sequences: list[list[int]], pad: int) -> tuple[torch.Tensor, list[int]]:
    """(B, q) ids, each row padded at the end with `pad` to the longest, and each row's real count."""
    q = max(len(s) for s in sequences)
    return torch.tensor([s + [pad] * (q - len(s)) for s in sequences]), [len(s) for s in sequences]


def forward_rows(model: PreTrainedModel, sequences: list[list[int]], cache: RaggedCache, *, logits_for: str = "all",
                 layers: list[int] | None = None):
    """Feed row b its own entries `sequences[b]` on top of its cached prefix; advance the rows.

    logits_for: "all" -> (B, q, V) logits of every fed position (verification), "last" -> (B, V) of each
    row's last real entry (a prefill). With `layers`, also the hidden states there, (B, q, len(layers), d)."""
    rows = cache.rows
    device = rows.device
    ids, counts = pad_rows(sequences, pad=sequences[0][-1])
    ids = ids.to(device)
    q = ids.shape[1]
    keep: int | torch.Tensor = 0
    last = None
    if logits_for == "last":  # the distinct last positions only, not a (B, q, V) matrix
        unique, last = torch.tensor(counts).sub(1).unique(return_inverse=True)
        keep = unique.to(device)
    out = model(input_ids=ids, attention_mask=attention_mask(model, rows, q), position_ids=rows.positions(q),
                **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=keep,
                output_hidden_states=bool(layers))
    rows.advance(counts)
    logits = out.logits
    if last is not None:
        logits = logits[torch.arange(len(counts)), last.to(device)]
    features = features_of(out.hidden_states, layers) if layers else None
    return logits, features, counts
