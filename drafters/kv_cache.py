"""Key/value caches for drafting (a head's own, and the lean draft LM's), in preallocated buffers, where
rollback is an integer: `KVCache`, and with `RaggedRows` a batch's cache with a length per row
(drafters/hf_cache.py explains the layout).
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of one attention layer for drafting (inference only): preallocated buffers
    (batch, kv_heads, capacity, head_dim) that grow by doubling, so an append writes the new positions
    in place instead of copying the whole cache, and a rollback is an integer. The heads and the draft
    LM's lean path (drafters/llama_decode.py) both keep one per attention layer."""

    def __init__(self, rows: "RaggedRows | None" = None) -> None:
        self.k: torch.Tensor | None = None  # the buffers; positions 0..length-1 are valid
        self.v: torch.Tensor | None = None
        self.length = 0
        # A batch with a length per row (drafters/hf_cache.py): appends land at each row's own length, and
        # the caller masks each row's keys and advances, crops and selects rows through `rows`.
        self.rows = rows
        self._generation = rows.generation if rows is not None else 0

    def __len__(self) -> int:
        return self.length

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add k, v (batch, kv_heads, T, head_dim) after the valid positions; return all valid keys and values.
        Ragged (`rows`): after each row's own length; returns keys and values up to the longest row's end."""
        if self.rows is not None:
            self._follow()
            self.k, self.v = ragged_write(self.k, k, self.rows), ragged_write(self.v, v, self.rows)
            end = self.rows.end(k.shape[2])
            return self.k[:, :, :end], self.v[:, :, :end]
        start, end = self.length, self.length + k.shape[2]
        if self.k is None or end > self.k.shape[2] or self.k.dtype != k.dtype or self.k.device != k.device:
            size = max(end, 2 * (0 if self.k is None else self.k.shape[2]), 256)
            keys = k.new_empty((*k.shape[:2], size, k.shape[3]))
            values = v.new_empty((*v.shape[:2], size, v.shape[3]))
            if start:
                keys[:, :, :start], values[:, :, :start] = self.k[:, :, :start], self.v[:, :, :start]
            self.k, self.v = keys, values
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def crop(self, keep: int) -> None:
        """Roll back to the first `keep` positions."""
        self.length = min(self.length, keep)

    def _follow(self) -> None:
        """Drop the rows the batch dropped since the last call (ragged caches)."""
        self.k = follow(self.k, self.rows, self._generation)
        self.v = follow(self.v, self.rows, self._generation)
        self._generation = self.rows.generation

    def absorb(self, other: "KVCache") -> None:
        """Take the rows of `other`, the same layer's cache of another ragged batch, after this batch's rows
        (a request joining a running batch; `RaggedRows.extend` then adds their lengths)."""
        self._follow()
        other._follow()
        self.k = stack_rows(self.k, len(self.rows), other.k, len(other.rows))
        self.v = stack_rows(self.v, len(self.rows), other.v, len(other.rows))


class RaggedRows:
    """The committed length of each row of a batch, shared by every layer of a cache (and by a drafter's
    caches). Lengths are kept on the host (the loop's bookkeeping) and on the device (the masks)."""

    def __init__(self, batch: int, device: torch.device) -> None:
        self.lengths = [0] * batch
        self.device = device
        self._on_device: torch.Tensor | None = None
        self.selections: list[list[int]] = []  # every `select` so far, for buffers to follow in order

    @property
    def generation(self) -> int:
        return len(self.selections)

    def since(self, generation: int) -> list[int] | None:
        """The rows of the batch as it was at `generation` that are still in it, in order (None: all)."""
        if generation == len(self.selections):
            return None
        rows = self.selections[generation]
        for later in self.selections[generation + 1:]:
            rows = [rows[r] for r in later]
        return rows

    def __len__(self) -> int:
        return len(self.lengths)

    def lengths_tensor(self) -> torch.Tensor:
        if self._on_device is None:
            self._on_device = torch.tensor(self.lengths, device=self.device)
        return self._on_device

    def positions(self, q: int) -> torch.Tensor:
        """(B, q): the positions a call of q entries per row writes, row by row."""
        return self.lengths_tensor()[:, None] + torch.arange(q, device=self.device)

    def end(self, q: int) -> int:
        """How many key slots a call of q entries per row reads (the longest row's)."""
        return max(self.lengths) + q

    def mask(self, q: int, window: int | None = None) -> torch.Tensor:
        """(B, 1, q, end) bool: query i of row b (at position len_b + i) sees keys 0 .. len_b + i, and
        with `window`, only the last `window` of them (sliding-window attention)."""
        query = self.positions(q)[:, None, :, None]  # (B, 1, q, 1)
        key = torch.arange(self.end(q), device=self.device)  # (end,)
        allowed = key <= query
        if window is not None:
            allowed = allowed & (query - key < window)
        return allowed

    def advance(self, counts: list[int]) -> None:
        """After a call: row b holds counts[b] more real entries."""
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]
        self._on_device = None

    def crop(self, keep: list[int]) -> None:
        """Roll row b back to its first keep[b] positions."""
        self.lengths = [min(n, m) for n, m in zip(self.lengths, keep)]
        self._on_device = None

    def select(self, rows: list[int]) -> None:
        """Keep only `rows` (indices into the current batch, in order)."""
        self.lengths = [self.lengths[r] for r in rows]
        self._on_device = None
        self.selections.append(list(rows))

    def extend(self, other: "RaggedRows") -> None:
        """Append the rows of another batch, whose buffers the caches following this one have absorbed
        (`KVCache.absorb`, `RaggedLayer.absorb`): requests joining a running batch."""
        self.lengths = self.lengths + other.lengths
        self._on_device = None


def follow(buffer: torch.Tensor | None, rows: RaggedRows, generation: int) -> torch.Tensor | None:
    """`buffer` (B, ...) with only the rows still in the batch since `generation`."""
    kept = rows.since(generation)
    if kept is None or buffer is None:
        return buffer
    return buffer[torch.tensor(kept, device=buffer.device)]


def stack_rows(buffer: torch.Tensor | None, rows: int, other: torch.Tensor | None, other_rows: int) -> torch.Tensor | None:
    """Cache buffers (B, heads, capacity, head_dim) of two ragged batches as one, `other`'s rows after
    `buffer`'s, the capacities padded to the larger; a buffer never written (None) gives empty rows."""
    if buffer is None and other is None:
        return None
    like = buffer if buffer is not None else other
    size = max(b.shape[2] for b in (buffer, other) if b is not None)
    out = like.new_zeros((rows + other_rows, like.shape[1], size, like.shape[3]))
    if buffer is not None:
        out[:rows, :, : buffer.shape[2]] = buffer
    if other is not None:
        out[rows:, :, : other.shape[2]] = other.to(like.dtype)
    return out


def ragged_write(buffer: torch.Tensor | None, new: torch.Tensor, rows: RaggedRows) -> torch.Tensor:
    """Write `new` (B, heads, q, head_dim) at each row's own length into `buffer` (B, heads, capacity,
    head_dim), grown by doubling as needed; returns the buffer (possibly a new one)."""
    B, H, q, D = new.shape
    end = rows.end(q)
    if buffer is None or end > buffer.shape[2] or buffer.dtype != new.dtype or buffer.device != new.device:
        size = max(end, 2 * (0 if buffer is None else buffer.shape[2]), 256)
        grown = new.new_zeros((B, H, size, D))
        if buffer is not None:
            used = min(buffer.shape[2], size)
            grown[:, :, :used] = buffer[:, :, :used]
        buffer = grown
    index = rows.positions(q)  # (B, q)
    batch = torch.arange(B, device=new.device)[:, None]
    buffer[batch, :, index] = new.transpose(1, 2)  # (B, q, H, D) at [b, :, len_b + i]
    return buffer
