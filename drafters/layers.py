"""Pieces the feature-reading heads (EAGLE-3, EAGLE-1, MTP) share.

- `KVCache`: a key/value cache for drafting (a head's own, and the lean draft LM's), in preallocated
  buffers; rollback is an integer. With `RaggedRows`, a batch's cache with a length per row
  (drafters/hf_cache.py explains the layout).
- `Attention`: Llama attention (RoPE, grouped-query) whose input width may differ from the hidden size
  (EAGLE-3 feeds [embedding; feature], 2d wide), used three ways: over a whole training sequence, one
  drafting step on top of a `KVCache`, and in EAGLE-3's training-time test, where each position also
  attends to the head's own earlier draft entries for that position ("diagonal" keys).
- `DecoderLayer`: the standard pre-norm Llama block on that attention.
- `decode` methods (`Attention.decode`, `DecoderLayer.decode`, `mlp_decode`): the drafting-time
  forward, inference only, on the same weights: q/k/v and gate/up each as one matmul (`Fused`) and RoPE
  (`rope`, with `Rotary.decode`'s tables) applied to queries and keys together in fewer ops, so a
  drafted token runs fewer, larger ops. With `last=True` a call over several entries (the first step
  of a drafting round) caches every entry's keys and values but computes the last entry's output
  alone: a one-layer head reads nothing else.
- `SharedTarget`: the target's embedding and output head, referenced, never copied or trained.
- `RMSNorm`, `Rotary`: Llama's RMSNorm and RoPE with the same weights and values, cheaper per call (a
  drafting step runs a handful of tiny ops, so per-call overhead is most of a head's cost c).
- `causal_mask`: the boolean masks all of the above use (True = may attend).

Module names follow Hugging Face Llama (`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, ...)
so the weights map one to one onto the formats serving engines load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRotaryEmbedding, apply_rotary_pos_emb


class RMSNorm(nn.Module):
    """Llama's RMSNorm (statistics in fp32, then scaled by `weight`) as one call of torch's `rms_norm`
    where `LlamaRMSNorm` makes six: per-call overhead is most of the cost on one drafted token. Same
    parameter name, so checkpoints and exports are unchanged."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm as a function: statistics in fp32, cast back, then scaled by `weight`."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


class Rotary(nn.Module):
    """RoPE cos/sin of positions start..start+length-1, looked up in a table computed by Llama's own
    rotary embedding (so the values are the same) and grown on demand. Positions are Python ints:
    drafting never waits on the device to learn where it is. RoPE types that rescale with the sequence
    length (dynamic, longrope) are computed per call instead.

    `forward` gives (cos, sin) for `apply_rotary_pos_emb` (training); `decode` gives them in the form the
    drafting path's `rope` takes: (1, 1, length, head_dim) and with sin's first half negated."""

    def __init__(self, config) -> None:
        super().__init__()
        self.rope = LlamaRotaryEmbedding(config)
        self.static = not ("dynamic" in self.rope.rope_type or self.rope.rope_type == "longrope")
        self._table: dict = {}  # (device, dtype) -> (cos, sin, cos (1, 1, N, hd), signed sin (1, 1, N, hd))

    def forward(self, x: torch.Tensor, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.static:
            return self.rope(x, torch.arange(start, start + length, device=x.device)[None])
        cos, sin = self._lookup(x, start + length)[:2]
        return cos[:, start:start + length], sin[:, start:start + length]

    def decode(self, x: torch.Tensor, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) for `rope`, each (1, 1, length, head_dim)."""
        if not self.static:
            cos, sin = self.forward(x, start, length)
            return cos[:, None], signed_sin(sin)[:, None]
        cos, sin = self._lookup(x, start + length)[2:]
        return cos[:, :, start:start + length], sin[:, :, start:start + length]

    def decode_rows(self, x: torch.Tensor, positions: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode` for a batch whose rows sit at different positions: positions (B, q), all below `end`
        -> (cos, signed sin), each (B, 1, q, head_dim)."""
        if not self.static:
            cos, sin = self.rope(x, positions)
            return cos[:, None], signed_sin(sin)[:, None]
        cos, sin = self._lookup(x, end)[2:]
        return cos[0, 0][positions][:, None], sin[0, 0][positions][:, None]

    def _lookup(self, x: torch.Tensor, end: int) -> tuple:
        key = (x.device, x.dtype)
        table = self._table.get(key)
        if table is None or table[0].shape[1] < end:
            size = max(end, 2 * (0 if table is None else table[0].shape[1]), 256)
            # Normal tensors even when the first call comes from the (inference-mode) drafting loop,
            # so that training afterwards may save them for backward.
            with torch.inference_mode(False):
                cos, sin = self.rope(x, torch.arange(size, device=x.device)[None])
                table = (cos, sin, cos[:, None], signed_sin(sin)[:, None])
            self._table[key] = table
        return table


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x) * sin == x.roll(head_dim // 2, -1) * signed_sin(sin)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's RoPE, x * cos + rotate_half(x) * sin, for drafting: `cos` and `sin` from `Rotary.decode`.
    rotate_half(x) = [-x2, x1] is written as the roll [x2, x1] times a sin whose first half is negated,
    one op in place of two slices, a negation and a concatenation; the products and the sum are the
    same, so the values are too."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


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


class Fused:
    """Several `nn.Linear`s on the same input as one matmul: their weights (and biases) concatenated,
    for drafting (inference only). The concatenation is a copy, rebuilt whenever a source changes in
    place (an optimizer step, `load_state_dict`) or is replaced (a move to another device or dtype), so
    drafting always runs the current weights. (Weights that are themselves inference tensors carry no
    version counter: only their replacement is seen.)"""

    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self._key: tuple | None = None
        self._weight = self._bias = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., sum of the out_features), the outputs side by side in the given order."""
        # Parameters are read from `_parameters` (a dict lookup) rather than as module attributes (which
        # go through nn.Module.__getattr__): this check runs on every drafted token.
        params = [(lin._parameters["weight"], lin._parameters.get("bias")) for lin in self.linears]
        key = tuple((t.data_ptr(), t.device, t.dtype, 0 if t.is_inference() else t._version)
                    for pair in params for t in pair if t is not None)
        if key != self._key:
            with torch.no_grad():
                self._weight = torch.cat([w for w, _ in params])
                self._bias = None
                if any(b is not None for _, b in params):
                    self._bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in params])
            self._key = key
        return F.linear(x, self._weight, self._bias)


def mlp_decode(mlp: LlamaMLP, x: torch.Tensor) -> torch.Tensor:
    """`mlp(x)` for drafting (inference only): gate and up projections as one matmul."""
    fused = mlp.__dict__.get("_fused_gate_up")
    if fused is None:
        fused = mlp.__dict__["_fused_gate_up"] = Fused(mlp.gate_proj, mlp.up_proj)
    gate, up = fused(x).chunk(2, dim=-1)
    act = F.silu(gate) if isinstance(mlp.act_fn, nn.SiLU) else mlp.act_fn(gate)
    return _linear(act * up, mlp.down_proj)


def take_last(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """x (B, ...) with only entry index[b] of dimension `dim` kept in row b (the dimension keeps size 1)."""
    shape = [x.shape[0]] + [1] * (x.dim() - 1)
    shape[dim] = 1
    expanded = list(x.shape)
    expanded[dim] = 1
    return x.gather(dim, index.view(shape).expand(expanded))


def last_entries(x: torch.Tensor, last) -> torch.Tensor:
    """x (B, T, d) as a decode step with `last` returns it: every entry (False), the last one (True), or
    row b's entry last[b] (a tensor: a ragged batch)."""
    if isinstance(last, torch.Tensor):
        return take_last(x, last, dim=1)
    return x[:, -1:] if last else x


def _linear(x: torch.Tensor, module: nn.Linear) -> torch.Tensor:
    """module(x) without the module call (a few microseconds each, per drafted token)."""
    params = module._parameters
    return F.linear(x, params["weight"], params.get("bias"))


def norm(x: torch.Tensor, module: "RMSNorm") -> torch.Tensor:
    """module(x) for an `RMSNorm`, without the module call."""
    return rms_norm(x, module._parameters["weight"], module.eps)


def causal_mask(q_len: int, past: int, device: torch.device, key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """(B or 1, 1, q_len, past + q_len) bool: query i (at position past + i) sees keys 0..past + i.

    key_valid: optional (B, past + q_len) bool, False for padding keys."""
    mask = torch.ones(q_len, past + q_len, dtype=torch.bool, device=device).tril(past)[None, None]
    if key_valid is not None:
        mask = mask & key_valid[:, None, None, :]
    return mask


class Attention(nn.Module):
    def __init__(self, config, input_size: int | None = None) -> None:
        super().__init__()
        d = config.hidden_size
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or d // self.heads
        width = input_size or d
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)
        self.fused_qkv = Fused(self.q_proj, self.k_proj, self.v_proj)  # drafting's q/k/v (not a parameter)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
        base: tuple[torch.Tensor, torch.Tensor] | None = None,
        diagonal: list[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x: (B, T, width). Returns the output (B, T, d) and this call's rotated (keys, values).

        Sequence mode (base None): keys are the cache's (if any) followed by x's own; `mask` is
        (B|1, 1, T, keys) or None for a single query. Training-time-test mode (base given): position t
        attends to base keys under `mask` (B|1, 1, T, T) plus, position by position, the keys in
        `diagonal` and its own key (the head's earlier draft entries for that position, then this one).
        """
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        own = (k, v)
        if base is None:
            keys, values = cache.append(k, v) if cache is not None else (k, v)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                 enable_gqa=self.kv_heads != self.heads)
        else:
            out = self._ttt_attention(q, base, [*diagonal, own], mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), own

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
               cache: KVCache, last: bool = False) -> torch.Tensor:
        """`forward(x, cos, sin, mask, cache)[0]` for drafting (inference only), with cos/sin from
        `Rotary.decode`: q/k/v as one matmul and RoPE (`rope`) on queries and keys in one pass, the same
        arithmetic element for element.

        last: the output of the last position only, (B, 1, d). Every position's keys and values still
        go into the cache, but only the last query attends (it sees every key, so no mask) and only
        its row goes through `o_proj`: what the last layer of a model needs when nothing reads the
        other positions' outputs (the first step of a drafting round feeds several entries and drafts
        from the last)."""
        B, T, _ = x.shape
        H, Hkv = self.heads, self.kv_heads
        qkv = self.fused_qkv(x).view(B, T, H + 2 * Hkv, self.head_dim).transpose(1, 2)
        qk = rope(qkv[:, : H + Hkv], cos, sin)
        keys, values = cache.append(qk[:, H:], qkv[:, H + Hkv:])
        q = qk[:, :H]
        if isinstance(last, torch.Tensor):  # a ragged batch: each row's own last entry (and its mask row)
            q, mask, T = take_last(q, last, dim=2), take_last(mask, last, dim=2), 1
        elif last and T > 1:
            q, mask, T = q[:, :, -1:], None, 1
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=Hkv != H)
        return _linear(out.transpose(1, 2).reshape(B, T, -1), self.o_proj)

    def _ttt_attention(self, q, base, diagonal, mask):
        rep = self.heads // self.kv_heads
        k0, v0 = (t.repeat_interleave(rep, dim=1) for t in base)
        scale = self.head_dim ** -0.5
        scores = (q @ k0.transpose(-1, -2)) * scale  # (B, H, T, T)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        diag_k = torch.stack([k.repeat_interleave(rep, dim=1) for k, _ in diagonal], dim=-2)  # (B, H, T, S, hd)
        diag_v = torch.stack([v.repeat_interleave(rep, dim=1) for _, v in diagonal], dim=-2)
        diag_scores = (q.unsqueeze(-2) * diag_k).sum(-1) * scale  # (B, H, T, S)
        probs = torch.softmax(torch.cat([scores, diag_scores], dim=-1).float(), dim=-1).to(q.dtype)
        T = scores.shape[-1]
        return probs[..., :T] @ v0 + (probs[..., T:].unsqueeze(-1) * diag_v).sum(-2)


class DecoderLayer(nn.Module):
    """The pre-norm Llama block: x + attn(norm(x)), then + mlp(norm(.)). `input_norm=False` drops the
    first norm (attention reads x itself), as EAGLE-1's layer does."""

    def __init__(self, config, input_norm: bool = True) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if input_norm else None
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, cos, sin, mask):
        h, _ = self.self_attn(x if self.input_layernorm is None else self.input_layernorm(x), cos, sin, mask)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode(self, x, cos, sin, mask, cache: KVCache, last: bool = False):
        """`forward` on top of `cache` for drafting (inference only), on the fused ops. `last`: the last
        position's output only, every position's keys and values cached (`Attention.decode`)."""
        h = self.self_attn.decode(x if self.input_layernorm is None else norm(x, self.input_layernorm),
                                  cos, sin, mask, cache, last)
        x = last_entries(x, last) + h
        return x + mlp_decode(self.mlp, norm(x, self.post_attention_layernorm))


class SharedTarget:
    """The frozen target's token embedding and output head, shared by reference (a plain object, so
    the head's state dict, optimizer and checkpoints never contain them)."""

    def __init__(self, target) -> None:
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.config = target.config

    def embed_tokens(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows of the target's embedding matrix, looked up as the engines' EAGLE layers do: vLLM, SGLang
        and speculators share the target's embedding weight with the head, not its module, so a family's
        scaling of the embedding (Gemma-3's sqrt(d), inside its embedding module in transformers) is not applied.
        A head trained on the scaled rows would draft from other inputs in the engine (EAGLE-1's fc reads them
        unnormed)."""
        return F.embedding(ids, self.embed.weight).to(dtype)

    def logits(self, h: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Output-head logits (fp32) of features h; `weight` replaces the head's rows (a draft vocabulary)."""
        w = self.lm_head.weight if weight is None else weight
        bias = getattr(self.lm_head, "bias", None) if weight is None else None
        return finish_logits(self.config, F.linear(h.to(w.dtype), w, bias).float())


def finish_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """What the target's forward does to its output head's logits before returning them: Gemma-2's (and
    Gemma-3's) final soft-capping, Granite's division by `logits_scaling`, Cohere's multiplication by
    `logit_scale`. Without it a head would learn, and draft from, a distribution that is not the target's.
    Elementwise, so it holds for a draft vocabulary's rows too."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    if getattr(config, "logits_scaling", None) is not None:  # Granite
        logits = logits / config.logits_scaling
    if getattr(config, "logit_scale", None) is not None and config.model_type.startswith("cohere"):
        logits = logits * config.logit_scale
    return logits


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked positions of -sum_x p(x) log q(x): the token loss against the target's distribution."""
    per_pos = -(target_probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
    mask = mask.float()
    return (per_pos * mask).sum() / mask.sum().clamp_min(1.0)


def label_cross_entropy(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`soft_cross_entropy` against one-hot labels, over rows (N, V): the mean of -log q(label), where
    `index` is the label's column, or -1 for a label the logits cannot express (it adds 0, as a one-hot
    row with no mass on these columns would, and still counts in the mean)."""
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, index.clamp_min(0)[:, None])[:, 0]
    return -(logp * (index >= 0)).sum() / max(index.numel(), 1)


@torch.no_grad()
def label_stats(logits: torch.Tensor, labels: torch.Tensor, index: torch.Tensor,
                draft_ids: torch.Tensor | None = None, at: tuple | None = None,
                hits: bool = False) -> dict[str, torch.Tensor]:
    """`step_stats` against one-hot labels (target ids, (N,)): sum_x min(p, q) is q(label); `index` is the
    label's column in the logits (-1: none), `draft_ids` the target ids of the logits' columns; `at` and
    `hits` as in `step_stats`."""
    q = torch.softmax(logits.float(), -1)
    accept = q.gather(-1, index.clamp_min(0)[:, None])[:, 0] * (index >= 0)
    guess = q.argmax(-1)
    if draft_ids is not None:
        guess = draft_ids[guess]
    agree = guess == labels
    return {"accept": accept.sum(), "top1": agree.float().sum(),
            "count": torch.tensor(float(labels.numel()), device=labels.device),
            **(_hits(agree, at) if hits else {})}


def _hits(agree: torch.Tensor, at: tuple | None = None, mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """{"hits": (B, T) bool, where each row's greedy guess agreed, placed at its (rows, entries) of `at` or
    at the mask's positions in a (B, T) grid}: what train/heads.py `greedy_rounds` replays; {} without either."""
    if mask is not None:
        return {"hits": torch.zeros_like(mask).masked_scatter_(mask, agree)}
    if at is None:
        return {}
    rows, entries, shape = at
    hits = torch.zeros(shape, dtype=torch.bool, device=agree.device)
    hits[rows, entries] = agree
    return {"hits": hits}


class ReadRows:
    """The target's next-token distributions at the positions a loss reads, and nowhere else: `rows` (n, V)
    and `index` (B, T) into them (-1 where nothing reads). Indexed like the dense (B, T, V) tensor it stands
    for (`probs[b, t]` for read positions), so a head's loss takes either; a 262,144-token vocabulary (Gemma-3)
    at every position of a batch is gigabytes, most of them never read."""

    def __init__(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        self.index, self.rows = index, rows

    def __getitem__(self, key) -> torch.Tensor:
        return self.rows[self.index[key]]

    def is_floating_point(self) -> bool:
        return True


@torch.no_grad()
def step_stats(draft_probs: torch.Tensor, target_probs: torch.Tensor, mask: torch.Tensor | None = None,
               draft_ids: torch.Tensor | None = None, at: tuple | None = None,
               hits: bool = False) -> dict[str, torch.Tensor]:
    """Sums (over masked positions, or every row without a mask) of the sampling acceptance estimate
    sum_x min(p, q) and of greedy top-1 agreement, plus the count: summed across batches and processes,
    then divided. `draft_ids`: the target ids of draft_probs' last dimension (a draft vocabulary; q is 0
    elsewhere, so the sum runs over those ids alone). With `hits` (held-out evaluation; training steps skip
    it) also "hits": the agreements in a (B, T) grid, placed by the mask (B, T) or by `at` = (rows, entries,
    (B, T)) naming where unmasked rows sit."""
    if mask is not None:
        mask = mask.bool()
        draft_probs, target_probs = draft_probs[mask], target_probs[mask]
    guess = draft_probs.argmax(-1)
    if draft_ids is not None:
        guess = draft_ids[guess]
        accept = torch.minimum(draft_probs, target_probs[..., draft_ids]).sum(-1)
    else:
        accept = torch.minimum(draft_probs, target_probs).sum(-1)
    agree = guess == target_probs.argmax(-1)
    return {"accept": accept.sum(), "top1": agree.float().sum(),
            "count": torch.tensor(float(agree.numel()), device=agree.device),
            **(_hits(agree, at, mask) if hits else {})}
