"""DFlash (z-lab, "DFlash: Block Diffusion for Flash Speculative Decoding"): a small stack of decoder layers that
drafts a whole block in one forward, from the target's features of several layers.

The target's states at `config.feature_layers` (indices into Hugging Face `output_hidden_states`: the outputs of
decoder layers l = index - 1, never the last, which transformers replaces by the final-normed state) are
concatenated and fused once per position, `ctx = hidden_norm(fc(features))`. Every layer projects that context
with its own `k_proj`/`v_proj` (keys through `k_norm` and RoPE at the context's positions; no input norm) and
attends to it beside the block. The block is the last committed token (the anchor, at position p) followed by k
copies of `mask_token_id`, embedded with the target's embedding at positions p..p+k; attention inside the block is
non-causal and every block position sees every context position before p. After the final norm the target's
output head turns row j (1..k) into the guess for the token at position p+j: k guesses in one forward. Layers are
Qwen3's (q_norm and k_norm per head, SwiGLU), as the engines build DFlash's (vLLM 0.33's `qwen3_dflash.py`,
llama.cpp's `src/models/dflash.cpp`).

Training follows SpecForge's DFlash recipe (`dflash_family_model.py`): in each answer, anchors p where the tokens
at p and p+1 are both answer tokens; each anchor's block [x_p, mask, ...] of `block_size` positions sees the
context strictly before p and its own block, every block in one forward; block position j is trained towards the
target's distribution of token p+j, its loss weighted exp(-(j-1)/`loss_decay_gamma`) (speculators' decay).

The drafting state keeps only the context's keys and values, one cache per layer; the block's are written past
them for one forward and dropped, so nothing is rolled back at commit. A round drafts min(k, block_size - 1)
tokens; the engines draft with a block of k + 1 positions too (vLLM's num_speculative_tokens, llama.cpp's
--spec-draft-n-max), so serve at the k the head was trained for, k = block_size - 1. Chains only: no trees.

Draft vocabulary (`config.draft_vocab_size`, as EAGLE-3's, drafters/eagle.py `DraftVocabulary`): the output head keeps
only the target's rows of the most frequent tokens of the training traffic, so each guess costs a (d x N) matmul
instead of (d x V); the block's logits are spread back over the target's vocabulary (-inf elsewhere), as vLLM's
`DFlashQwen3ForCausalLM.compute_logits` and llama.cpp's graph spread them through `d2t`.

Module names are those of the z-lab checkpoints (`fc`, `hidden_norm`, `layers.{i}.self_attn.q_norm`, `norm`), so
the weights map one to one onto the `DFlashDraftModel` layout vLLM's and llama.cpp's converters read
(eval/engines/formats/dflash.py `dflash_writer`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP

from drafters.base import Proposal
from drafters.eagle import DraftVocabulary
from drafters.head_losses import label_cross_entropy, label_stats, soft_cross_entropy, step_stats
from drafters.heads import BatchOfOne, FeatureBatch
from drafters.kv_cache import KVCache, RaggedRows
from drafters.layers import RMSNorm, Rotary, SharedTarget, norm, rope
from drafters.parallel import cut_at_stop
from drafters.sampling import Sampling, draw


class DFlashAttention(nn.Module):
    """Qwen3 attention (per-head RMSNorm on queries and keys, RoPE, grouped-query, no biases) whose keys and values
    are the context's, projected by this layer, followed by the block's."""

    def __init__(self, config) -> None:
        super().__init__()
        d = config.hidden_size
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or d // self.heads
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.view(*x.shape[:2], heads, self.head_dim).transpose(1, 2)  # (B, heads, T, hd)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, d) at positions whose RoPE is cos/sin (`Rotary.decode_rows`) -> rotated keys and values
        (B, kv, T, hd)."""
        k = rope(norm(self._split(self.k_proj(x), self.kv_heads), self.k_norm), cos, sin)
        return k, self._split(self.v_proj(x), self.kv_heads)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                context: "tuple[torch.Tensor, torch.Tensor] | KVCache", mask: torch.Tensor | None) -> torch.Tensor:
        """The block x (B, q, d) attending to the context and to itself, under `mask` (B|1, 1, q, keys) or None
        (every key). `context`: this layer's (keys, values) (B, kv, C, hd), followed by the block's; or, drafting, its
        cache of them, into which the block's go after each row's context (the rows are not advanced: the next
        write overwrites them)."""
        q = rope(norm(self._split(self.q_proj(x), self.heads), self.q_norm), cos, sin)
        k, v = self.keys_values(x, cos, sin)
        if isinstance(context, KVCache):
            keys, values = context.append(k, v)
        else:
            keys, values = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


class DFlashLayer(nn.Module):
    """A pre-norm Qwen3 block over the block's positions; the context enters through the attention's keys only."""

    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, cos, sin, context, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlash(DraftVocabulary, nn.Module):
    """The drafter. config: drafters.heads.head_config(..., num_layers, block_size, mask_token_id,
    loss_decay_gamma, max_anchors), their defaults drafters/kinds/dflash.py `DFlashConfig`'s."""

    def __init__(self, config) -> None:
        super().__init__()
        if config.hidden_size != config.target_hidden_size:
            raise ValueError("DFlash's width is the target's (llama.cpp requires it)")
        if list(config.feature_layers) != sorted(set(config.feature_layers)):
            raise ValueError(f"DFlash's feature layers must be increasing (vLLM concatenates them in layer order), "
                             f"got {list(config.feature_layers)}")
        if config.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (the anchor and at least one masked position), got "
                             f"{config.block_size}")
        if getattr(config, "mask_token_id", None) is None or not 0 <= config.mask_token_id < config.vocab_size:
            raise ValueError(f"mask_token_id must be a row of the target's embedding, got "
                             f"{getattr(config, 'mask_token_id', None)}")
        self.config = config
        d = config.hidden_size
        self.fc = nn.Linear(len(config.feature_layers) * config.target_hidden_size, d, bias=False)
        self.hidden_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.rotary = Rotary(config)
        self._init_vocabulary(config, maps_always=False)
        self.shared: SharedTarget | None = None

    def attach(self, target) -> None:
        last = target.config.num_hidden_layers
        if max(self.config.feature_layers) >= last:
            raise ValueError(f"DFlash reads the outputs of decoder layers before the last (feature layers below "
                             f"{last}); got {list(self.config.feature_layers)}: transformers replaces the last "
                             "state by the final-normed one, which neither vLLM nor llama.cpp hands a drafter")
        self.shared = SharedTarget(target)
        self._rows = None

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The output head on final-normed block states (..., d): logits over the draft vocabulary (..., N)."""
        return self.shared.logits(out, self._target_rows() if self.reduced else None)

    def target_logits(self, out: torch.Tensor) -> torch.Tensor:
        """`logits` spread over the target's vocabulary (..., V), -inf on the tokens the head cannot propose."""
        logits = self.logits(out)
        if not self.reduced:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.target_ids(), logits)

    @property
    def steps(self) -> int:
        """Guesses per block: the positions after the anchor."""
        return self.config.block_size - 1

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features (B, T, L*d_target) fused into the context every layer attends to (B, T, d)."""
        return norm(self.fc(features), self.hidden_norm)

    def blocks(self, context: list, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
               end: int | None = None) -> torch.Tensor:
        """The layers over block tokens ids (B, q) at `positions` (B, q), all below `end` (None: their largest + 1),
        layer i attending to `context[i]` (its context's keys and values, or its cache of them:
        `DFlashAttention.forward`) and the block under `mask`; the final-normed states (B, q, d)."""
        x = self.shared.embed_tokens(ids, self.fc.weight.dtype)
        cos, sin = self.rotary.decode_rows(x, positions, int(positions.max()) + 1 if end is None else end)
        for layer, kv in zip(self.layers, context):
            x = layer(x, cos, sin, kv, mask)
        return norm(x, self.norm)

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor,
                   end: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values of the context ctx (B, C, d) at `positions` (B, C), all below `end`."""
        cos, sin = self.rotary.decode_rows(ctx, positions, int(positions.max()) + 1 if end is None else end)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def forward(self, features, input_ids, attention_mask, loss_mask, target_probs):
        """Training loss, every anchor's block in one forward: features (B, T, L*d_target); input_ids,
        attention_mask, loss_mask (B, T); target_probs (B, T, V), the target's next-token distribution, or (B, T)
        labels. Returns (loss, [stats per block position]): the stats of position j sit at entry p - 1 of its anchor
        p (the features through p - 1, tokens through p), the grid train/heads.py `greedy_rounds` replays."""
        B, T = input_ids.shape
        Bs = self.config.block_size
        device = input_ids.device
        answer = loss_mask.bool() & attention_mask.bool()
        valid = torch.zeros_like(answer)
        valid[:, :-1] = answer[:, :-1] & answer[:, 1:]  # anchors: an answer token followed by one
        valid[:, 0] = False  # (never in practice: position 0 opens the prompt) its entry would be -1
        anchors, used = self._anchors(valid)  # (B, A) positions, (B, A) bool
        A = anchors.shape[1]
        ctx = self.context(features)
        positions = torch.arange(T, device=device).expand(B, T)
        context = self.context_kv(ctx, positions, T)
        offsets = torch.arange(Bs, device=device)
        block_pos = (anchors[:, :, None] + offsets).view(B, A * Bs)
        ids = torch.full((B, A, Bs), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[:, :, 0] = input_ids.gather(1, anchors)
        # Query (a, j) sees the context before its anchor (real positions only) and every position of its own block.
        sees_context = (torch.arange(T, device=device) < anchors[:, :, None]) & attention_mask.bool()[:, None, :]
        own_block = torch.eye(A, dtype=torch.bool, device=device).repeat_interleave(Bs, 0).repeat_interleave(Bs, 1)
        mask = torch.cat([sees_context.repeat_interleave(Bs, 1), own_block.expand(B, -1, -1)], dim=2)[:, None]
        out = self.blocks(context, ids.view(B, A * Bs), block_pos, mask, T + Bs).view(B, A, Bs, -1)
        labels = not target_probs.is_floating_point()
        target_ids = self.target_ids() if self.reduced else None
        draft_index = self.draft_index() if labels else None  # a label's draft id, -1 where it cannot be proposed
        loss, stats = 0.0, []
        for j in range(1, Bs):
            where = anchors + j
            inside = where < T
            keep = used & inside & answer.gather(1, where.clamp(max=T - 1))
            rows, slots = keep.nonzero(as_tuple=True)
            at = (rows, anchors[rows, slots] - 1, (B, T))
            logits = self.logits(out[rows, slots, j])
            p = target_probs[rows, anchors[rows, slots] + j - 1]  # the target's distribution of token p+j
            weight = math.exp(-(j - 1) / self.config.loss_decay_gamma) if self.config.loss_decay_gamma else 1.0
            if labels:
                loss = loss + weight * label_cross_entropy(logits, draft_index[p])
                stats.append(label_stats(logits.detach(), p, draft_index[p], target_ids, at=at,
                                         hits=not self.training))
            else:
                loss = loss + weight * soft_cross_entropy(logits, self.restrict(p), torch.ones_like(rows))
                stats.append(step_stats(torch.softmax(logits.detach().float(), -1), p, draft_ids=target_ids, at=at,
                                        hits=not self.training))
        return loss, stats

    def _anchors(self, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, A) anchor positions and which are real: every valid position in evaluation, at most `max_anchors`
        of them a row, drawn at random, in training (SpecForge samples 512 per sequence)."""
        B = valid.shape[0]
        picks = []
        for b in range(B):
            where = valid[b].nonzero()[:, 0]
            if self.training and where.numel() > self.config.max_anchors:
                drawn = torch.randperm(where.numel(), device=where.device)[: self.config.max_anchors]
                where = where[drawn].sort().values
            picks.append(where)
        A = max(1, max(p.numel() for p in picks))
        anchors = torch.zeros(B, A, dtype=torch.long, device=valid.device)
        used = torch.zeros(B, A, dtype=torch.bool, device=valid.device)
        for b, p in enumerate(picks):
            anchors[b, : p.numel()], used[b, : p.numel()] = p, True
        return anchors, used

    def drafter(self, name: str = "dflash", stop_below: float = 0.0, stop_rule: str = "propose") -> "DFlashDrafter":
        return DFlashDrafter(self, name, stop_below, stop_rule)

    def batch_drafter(self, name: str = "dflash", stop_below: float = 0.0, stop_rule: str = "propose") -> "DFlashBatch":
        return DFlashBatch(self, name, stop_below, stop_rule)


class DFlashBatch(FeatureBatch):
    """DFlash for B rows (drafters/base.py `BatchDrafter`); batch 1 is `DFlashDrafter`. Each layer keeps the
    context's keys and values on a ragged cache (one length per row: the positions whose features it read); a round
    first reads the features committed since the last one, then writes every row's block after its context, drafts,
    and leaves the block's entries to be overwritten."""

    parallel = True  # its k guesses cost one forward (eval/metrics.py `cost_model` charges a round so)

    def start(self, prompts, features=None) -> None:
        super().start(prompts, features)
        self.rows = RaggedRows(len(prompts), self.device)
        self.caches = [KVCache(self.rows) for _ in self.head.layers]
        self._read_context()  # the prompt's features, with the target's prefill

    @torch.inference_mode()
    def _read_context(self) -> None:
        counts = [p.shape[0] for p in self.pending]
        q = max(counts)
        if q == 0:
            return
        width = self.pending[0].shape[1]
        hidden = torch.stack([torch.cat([p, p.new_zeros(q - p.shape[0], width)]) for p in self.pending])
        ctx = self.head.context(hidden)
        context = self.head.context_kv(ctx, self.rows.positions(q), self.rows.end(q))
        for cache, (k, v) in zip(self.caches, context):
            cache.append(k, v)
        self.rows.advance(counts)
        self.pending = [p[:0] for p in self.pending]

    @torch.inference_mode()
    def propose(self, k: int, sampling: Sampling, generator: torch.Generator | None = None) -> list[Proposal]:
        self._read_context()
        B, n = len(self.ids), min(k, self.head.steps)
        ids = torch.full((B, n + 1), self.head.config.mask_token_id, dtype=torch.long, device=self.device)
        ids[:, 0] = torch.tensor([row[-1] for row in self.ids], device=self.device)
        positions, end = self.rows.positions(n + 1), self.rows.end(n + 1)
        # Each row's block sees its context and its whole block: keys before its own length + n + 1.
        mask = (torch.arange(end, device=self.device) < positions[:, -1:] + 1)[:, None, None]
        out = self.head.blocks(self.caches, ids, positions, mask, end)
        logits = self.head.target_logits(out[:, 1:])  # (B, n, V)
        tokens, probs = draw(logits, sampling, generator)
        cut = cut_at_stop(self.stop, logits, tokens, probs)
        proposals = [Proposal(tokens[b, :c], None if probs is None else probs[b, :c]) for b, c in enumerate(cut)]
        self.guesses = [p.tokens.tolist() for p in proposals]
        return proposals

    def keep(self, rows: list[int]) -> None:
        self.rows.select(rows)
        super().keep(rows)

    def absorb(self, other: "DFlashBatch") -> None:
        for mine, theirs in zip(self.caches, other.caches):
            mine.absorb(theirs)
        self.rows.extend(other.rows)
        super().absorb(other)


class DFlashDrafter(BatchOfOne):
    """DFlash at batch 1: the batch drafter's state for one row."""

    batch_class = DFlashBatch
    parallel = True  # its k guesses cost one forward (eval/metrics.py `cost_model` charges a round so)


HEAD = DFlash
