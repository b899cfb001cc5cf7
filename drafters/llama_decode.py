"""A lean decoding path for Llama-family draft LMs: the same weights and arithmetic as the Hugging Face
model, without its per-call machinery.

A draft LM spends its time in tiny forwards (one or two tokens through a few small layers), where
Python overhead, not arithmetic, sets the cost: the Hugging Face forward builds masks, cache objects
and output dataclasses on every call, and `DynamicCache` concatenates on every append. This decoder
reads the model's own parameters (shared; q/k/v and gate/up each run as one matmul on a concatenated
copy that is rebuilt whenever a weight changes, so a fine-tuned or merged model is what runs), applies
RoPE to queries and keys in one pass, and keeps its keys and values in preallocated buffers (a
`drafters.kv_cache.KVCache` per layer, the heads' cache too), so a step
is the layers' ops and nothing else and a rollback is an integer. `python scripts/bench_draft_step.py`
measures both paths side by side.

Only models it reproduces exactly are taken (`LeanLlama.supports`): Llama, Mistral without a sliding
window, and Qwen2 without one, built from the stock modules (plain `nn.Linear` projections, so a
model still wrapped with LoRA adapters is refused and runs on the Hugging Face path). Anything else
drafts through the Hugging Face forward, as before. Losslessness never depends on this path: the
target verifies every guess.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from drafters.kv_cache import KVCache, RaggedRows
from drafters.layers import Fused, Rotary, causal_mask, rms_norm, rope

_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"}
_MODEL_TYPES = {"llama", "mistral", "qwen2"}


def _weight_bias(module: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    return module.weight, module.bias


class LeanLlama:
    """Decode with a Llama-family causal LM's weights and a preallocated KV cache.

    `forward(ids)` feeds token ids at the next positions and returns the last position's logits;
    `crop(n)` rolls the cache back to its first n positions; `reset()` empties it.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        reason = self.unsupported(model)
        if reason:
            raise ValueError(f"the lean decoder cannot run this model: {reason}")
        config = model.config
        decoder = model.get_decoder()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.gqa = self.heads != self.kv_heads
        self.embed = decoder.embed_tokens.weight
        self.layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append((
                layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                Fused(attn.q_proj, attn.k_proj, attn.v_proj), _weight_bias(attn.o_proj),
                layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                Fused(mlp.gate_proj, mlp.up_proj), _weight_bias(mlp.down_proj),
            ))
        self.norm, self.norm_eps = decoder.norm.weight, decoder.norm.variance_epsilon
        self.head = _weight_bias(model.get_output_embeddings())
        self.rotary = Rotary(config).to(self.embed.device)
        self.caches = [KVCache() for _ in self.layers]  # one per layer, always the same length

    @staticmethod
    def unsupported(model: PreTrainedModel) -> str | None:
        """Why this model cannot run on the lean path, or None when it can."""
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type not in _MODEL_TYPES:
            return f"model type {model_type!r} (supported: {sorted(_MODEL_TYPES)})"
        if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
            return "sliding-window attention"
        if getattr(config, "hidden_act", "silu") != "silu":
            return f"activation {config.hidden_act!r}"
        try:
            decoder = model.get_decoder()
            layers = list(decoder.layers)
            head = model.get_output_embeddings()
        except AttributeError as err:
            return f"not a stock decoder ({err})"
        if type(decoder.embed_tokens) is not nn.Embedding or type(head) is not nn.Linear:
            return "embedding or output head is not a plain module (adapters attached?)"
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
            if any(type(p) is not nn.Linear for p in projections):
                return f"layer {i} has projections that are not plain nn.Linear (adapters attached?)"
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if any(type(n).__name__ not in _NORMS for n in norms) or hasattr(attn, "q_norm"):
                return f"layer {i} has normalisation this path does not reproduce"
            if getattr(attn, "sliding_window", None) is not None:
                return "sliding-window attention"
        if type(decoder.norm).__name__ not in _NORMS:
            return "final norm this path does not reproduce"
        return None

    @classmethod
    def supports(cls, model: PreTrainedModel) -> bool:
        return cls.unsupported(model) is None

    @property
    def length(self) -> int:
        """Positions held in the cache."""
        return len(self.caches[0])

    def reset(self) -> None:
        self.crop(0)

    def crop(self, keep: int) -> None:
        """Roll back to the first `keep` positions."""
        for cache in self.caches:
            cache.crop(keep)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, last: int = 1) -> torch.Tensor:
        """ids: (T,) token ids at positions length..length+T-1. Returns the logits (V,) after the last, or with
        `last` > 1 after each of the last `last` ids, (last, V) (a parallel draft: drafters/pard.py).
        Drafting never needs gradients: inference mode, whoever calls (the cache buffers are inference
        tensors)."""
        T, start = ids.shape[0], self.length
        x = F.embedding(ids[None], self.embed)  # (1, T, d)
        cos, sin = self.rotary.decode(x, start, T)
        # One query sees every cached key; several see the cache plus their own causal prefix.
        mask = None if T == 1 else causal_mask(T, start, x.device)
        logits = self._layers(x, cos, sin, mask, keep=last)[0]
        return logits[-1] if last == 1 else logits

    @torch.inference_mode()
    def forward_tree(self, ids: torch.Tensor, position: int, mask: torch.Tensor) -> torch.Tensor:
        """Tree drafting (drafters/draft_lm.py): ids (q,), sibling nodes of one depth, all at `position`, each
        seeing the keys `mask` (q, length + q) allows. Returns the logits (q, V) after each."""
        x = F.embedding(ids[None], self.embed)
        cos, sin = self.rotary.decode(x, position, 1)
        return self._layers(x, cos, sin, mask[None, None], keep=0)[0]

    def _layers(self, x: torch.Tensor, cos, sin, mask, keep: int) -> torch.Tensor:
        """The decoder on x (1, T, d) on top of the cache, then the final norm and head: logits (1, T or keep, V).
        `keep` > 0: only the last `keep` positions' are needed, so the last layer's attention, o_proj and MLP run
        for those positions alone (every position's keys and values are cached); 0: every position's."""
        T = x.shape[1]
        H, Hkv = self.heads, self.kv_heads
        last = len(self.layers) - 1
        for i, (ln1, eps1, qkv_p, o_p, ln2, eps2, gate_up, down) in enumerate(self.layers):
            qkv = qkv_p(rms_norm(x, ln1, eps1)).view(1, T, H + 2 * Hkv, self.head_dim).transpose(1, 2)
            qk = rope(qkv[:, : H + Hkv], cos, sin)
            keys, values = self.caches[i].append(qk[:, H:], qkv[:, H + Hkv:])
            q = qk[:, :H]
            if keep and i == last and T > keep:
                q, x, T = q[:, :, -keep:], x[:, -keep:], keep
                mask = None if keep == 1 else mask[..., -keep:, :]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.gqa)
            x = x + F.linear(out.transpose(1, 2).reshape(1, T, -1), *o_p)
            gate, up = gate_up(rms_norm(x, ln2, eps2)).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, *down)
        return F.linear(rms_norm(x, self.norm, self.norm_eps), *self.head)

    def keep(self, start: int, kept: list[int]) -> None:
        """Of the entries from `start` on, keep those at offsets `kept` (increasing), moved in place to start,
        start+1, ...; drop the rest (a tree's kept path, drafters/draft_lm.py)."""
        for cache in self.caches:
            if kept != list(range(len(kept))):
                index = torch.tensor(kept, device=cache.k.device) + start
                cache.k[:, :, start:start + len(kept)] = cache.k.index_select(2, index)
                cache.v[:, :, start:start + len(kept)] = cache.v.index_select(2, index)
            cache.crop(start + len(kept))

    def start_rows(self, rows: RaggedRows) -> list[KVCache]:
        """A batch's ragged caches over `rows`, one per layer, for `forward_rows` (the batch owns them, so
        several batches of one model can be alive at once)."""
        return [KVCache(rows) for _ in self.layers]

    @torch.inference_mode()
    def forward_rows(self, sequences: list[list[int]], rows: RaggedRows, caches: list[KVCache],
                     last: int = 1) -> torch.Tensor:
        """`forward` for a batch (`start_rows`): row b feeds `sequences[b]` at its own next positions.
        Returns (B, V), the logits after each row's last entry, or with `last` > 1 after each of its last `last`
        entries, (B, last, V); the rows advance by their entries."""
        device = self.embed.device
        q = max(len(s) for s in sequences)
        counts = [len(s) for s in sequences]
        ids = torch.tensor([s + [s[-1]] * (q - len(s)) for s in sequences], device=device)
        x = F.embedding(ids, self.embed)  # (B, q, d)
        B = x.shape[0]
        end = rows.end(q)
        cos, sin = self.rotary.decode_rows(x, rows.positions(q), end)
        mask = rows.mask(q)  # (B, 1, q, end)
        # Each row's last `last` real entries: the only outputs read.
        kept = torch.tensor(counts, device=device)[:, None] - last + torch.arange(last, device=device)
        H, Hkv = self.heads, self.kv_heads
        final = len(self.layers) - 1
        for i, (ln1, eps1, qkv_p, o_p, ln2, eps2, gate_up, down) in enumerate(self.layers):
            qkv = qkv_p(rms_norm(x, ln1, eps1)).view(B, q, H + 2 * Hkv, self.head_dim).transpose(1, 2)
            qk = rope(qkv[:, : H + Hkv], cos, sin)
            keys, values = caches[i].append(qk[:, H:], qkv[:, H + Hkv:])
            qs, m, T = qk[:, :H], mask, q
            if i == final:  # those entries alone (every entry's keys and values are cached)
                pick = kept[:, None, :, None]
                qs = qs.gather(2, pick.expand(B, H, last, self.head_dim))
                m = mask.gather(2, pick.expand(B, 1, last, mask.shape[-1]))
                x = x.gather(1, kept[:, :, None].expand(B, last, x.shape[-1]))
                T = last
            out = F.scaled_dot_product_attention(qs, keys, values, attn_mask=m, enable_gqa=self.gqa)
            x = x + F.linear(out.transpose(1, 2).reshape(B, T, -1), *o_p)
            gate, up_ = gate_up(rms_norm(x, ln2, eps2)).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up_, *down)
        rows.advance(counts)
        return F.linear(rms_norm(x[:, -1] if last == 1 else x, self.norm, self.norm_eps), *self.head)
