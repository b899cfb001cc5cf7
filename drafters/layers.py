"""Pieces the feature-reading heads (EAGLE-3, EAGLE-1, MTP) share.

- `Attention`: Llama attention (RoPE, grouped-query) whose input width may differ from the hidden size
  (EAGLE-3 feeds [embedding; feature], 2d wide), used three ways: over a whole training sequence, one
  drafting step on top of a `KVCache` (drafters/kv_cache.py), and in EAGLE-3's training-time test, where each position also
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

The heads' training losses are drafters/head_losses.py's.

Module names follow Hugging Face Llama (`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, ...)
so the weights map one to one onto the formats serving engines load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRotaryEmbedding, apply_rotary_pos_emb

from drafters.kv_cache import KVCache


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


