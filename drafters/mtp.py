"""Multi-token prediction, DeepSeek-V3 style (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", 2.2):
a chain of `depth` modules sharing the target's embedding and output head.

Module k (1-based) at position i combines RMSNorm(h^{k-1}_i) with RMSNorm(embedding of token i+k)
through `eh_proj` (2d -> d) and one Llama decoder layer, giving h^k_i, which through its own `norm` and
the target's output head predicts token i+k+1. h^0 is the target's last-layer feature. Every module
attends causally over its own sequence, so training is one teacher-forced pass per module; loss:
cross-entropy against the target's distribution, module k weighted by `module_decay ** (k-1)`.

Drafting after committed tokens x_0..x_m (features h^0 for positions 0..m-1): module k's output at
position m-1 is guess g_k, so a round drafts min(k, depth) tokens. Module k's entries at positions
i <= m-k use committed tokens only ("stable"): they are cached once. Entries m-k+1..m-1 read guesses
(tokens after x_m) and are recomputed each round on top of the stable cache, then dropped: that is
this drafter's rollback, and it makes drafting exactly the training computation with the guesses in
place of the unknown tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from drafters.base import Chains, Proposal
from drafters.head_losses import soft_cross_entropy, step_stats
from drafters.heads import FeatureBatch, FeatureDrafter
from drafters.kv_cache import KVCache, RaggedRows
from drafters.layers import DecoderLayer, RMSNorm, Rotary, SharedTarget, causal_mask
from drafters.sampling import Sampling, draw


class MTPModule(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d = config.hidden_size
        self.enorm = RMSNorm(d, eps=config.rms_norm_eps)
        self.hnorm = RMSNorm(config.target_hidden_size, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(d + config.target_hidden_size, d, bias=False)
        self.block = DecoderLayer(config)
        self.norm = RMSNorm(d, eps=config.rms_norm_eps)

    def forward(self, hidden, embeds, cos, sin, mask, cache=None):
        """Training (no cache; cos/sin from `Rotary`) or drafting on top of `cache` (inference only, the
        fused ops; cos/sin from `Rotary.decode`)."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.block(x, cos, sin, mask) if cache is None else self.block.decode(x, cos, sin, mask, cache)


class MTP(nn.Module):
    """The modules. config: drafters.heads.head_config(..., depth=D, module_decay=...)."""

    def __init__(self, config) -> None:
        super().__init__()
        if len(config.feature_layers) != 1:
            raise ValueError(f"MTP reads one feature layer (the last), got {list(config.feature_layers)}")
        self.config = config
        self.layers = nn.ModuleList(MTPModule(config) for _ in range(config.depth))
        self.rotary = Rotary(config)
        self.shared: SharedTarget | None = None

    def attach(self, target) -> None:
        self.shared = SharedTarget(target)

    def run(self, k: int, hidden, tokens, start: int, mask, cache=None) -> torch.Tensor:
        """Module k (0-based) on (hidden (B, q, d), tokens (B, q)) at positions start..start+q-1."""
        rotary = self.rotary if cache is None else self.rotary.decode  # decode: the drafting path's tables
        cos, sin = rotary(hidden, start, hidden.shape[1])
        return self.layers[k](hidden, self.shared.embed_tokens(tokens, hidden.dtype), cos, sin, mask, cache)

    def logits(self, k: int, h: torch.Tensor) -> torch.Tensor:
        return self.shared.logits(self.layers[k].norm(h))

    def unroll(self, features, input_ids, attention_mask) -> list[torch.Tensor]:
        """Every module over whole sequences (teacher forced): logits (B, T, V) of module k at position i
        predict token i+k+1 (k 1-based)."""
        B, T = input_ids.shape
        ids = torch.cat([input_ids, input_ids.new_zeros(B, self.config.depth)], dim=1)
        key_valid = attention_mask.bool().clone()
        key_valid[:, 0] = True
        mask = causal_mask(T, 0, input_ids.device, key_valid)
        hidden, logits = features, []
        for k in range(1, self.config.depth + 1):
            hidden = self.run(k - 1, hidden, ids[:, k: k + T], 0, mask)
            logits.append(self.logits(k - 1, hidden))
        return logits

    def forward(self, features, input_ids, attention_mask, loss_mask, target_probs):
        """Training loss; shapes as in drafters/eagle.py. Returns (loss, [stats per module])."""
        B, T = input_ids.shape
        D = self.config.depth
        pad = lambda t: torch.cat([t, t.new_zeros((B, D + 1, *t.shape[2:]))], dim=1)  # noqa: E731
        lmask, valid, probs = pad(loss_mask), pad(attention_mask), pad(target_probs)
        loss, stats = 0.0, []
        for k, logits in enumerate(self.unroll(features, input_ids, attention_mask), start=1):
            p = probs[:, k: k + T]  # position i+k: the target's distribution of token i+k+1
            m = lmask[:, k + 1: k + 1 + T].bool() & valid[:, k + 1: k + 1 + T].bool()
            loss = loss + self.config.module_decay ** (k - 1) * soft_cross_entropy(logits, p, m)
            stats.append(step_stats(torch.softmax(logits.detach(), -1), p, m, hits=not self.training))
        return loss, stats

    def drafter(self, name: str = "mtp", stop_below: float = 0.0, stop_rule: str = "propose") -> "MTPDrafter":
        return MTPDrafter(self, name, stop_below, stop_rule)

    def batch_drafter(self, name: str = "mtp", stop_below: float = 0.0, stop_rule: str = "propose") -> "MTPBatch":
        return MTPBatch(self, name, stop_below, stop_rule)

    def run_rows(self, k: int, hidden, tokens, rows: RaggedRows, cache: KVCache) -> torch.Tensor:
        """`run` for a ragged batch (eval/batching.py): row b's entries at its own next positions on top of
        `cache` (over `rows`; the caller advances them)."""
        q = hidden.shape[1]
        cos, sin = self.rotary.decode_rows(hidden, rows.positions(q), rows.end(q))
        return self.layers[k](hidden, self.shared.embed_tokens(tokens, hidden.dtype), cos, sin, rows.mask(q), cache)


class MTPDrafter(FeatureDrafter):
    """Drafts min(k, depth) tokens; module caches hold stable entries only (see the module docstring).

    Module j (0-based here) has stable entries for positions 0..m-j-1 and tentative ones for
    max(m-j, 0)..m-1. `outputs[j]` keeps module j's stable outputs from position `base[j]` on, as
    long as module j+1 has not consumed them into its own cache.
    """

    def start(self, prompt_ids, features=None) -> None:
        super().start(prompt_ids, features)
        depth = self.head.config.depth
        self.caches = [KVCache() for _ in range(depth)]
        self.outputs = [self.pending[:0] for _ in range(depth)]
        self.base = [0] * depth

    def _run(self, j: int, hidden: torch.Tensor, tokens: list[int], lo: int) -> torch.Tensor:
        """Module j on entries at positions lo..lo+q-1 on top of its cache (which must hold lo entries)."""
        q, cache = hidden.shape[0], self.caches[j]
        assert len(cache) == lo, (len(cache), lo)
        mask = causal_mask(q, lo, self.device) if q > 1 else None
        ids = torch.tensor([tokens], device=self.device)
        return self.head.run(j, hidden[None], ids, lo, mask, cache)[0]

    def _stable(self, j: int, lo: int, hi: int) -> torch.Tensor:
        return self.outputs[j][lo - self.base[j]: hi - self.base[j]]

    @torch.inference_mode()
    def propose(self, k: int, sampling: Sampling, generator: torch.Generator | None = None) -> Proposal:
        head, m = self.head, len(self.ids) - 1
        depth = head.config.depth
        if m == 0:
            self.guesses = []
            return Proposal(torch.empty(0, dtype=torch.long, device=self.device))
        ids = list(self.ids)  # committed tokens, then each guess as it is made
        guesses, dists = [], []
        tentative = self.pending[:0]
        for j in range(min(k, depth)):
            # Stable entries not cached yet: positions c..m-j-1, every input committed.
            c, end = len(self.caches[j]), m - j
            if end > c:
                hidden = self.pending if j == 0 else self._stable(j - 1, c, end)
                out = self._run(j, hidden, ids[c + j + 1: end + j + 1], c)
                if j < depth - 1:  # the last module's outputs feed nobody
                    self.outputs[j] = torch.cat([self.outputs[j], out])
            if j == 0:
                self.pending = self.pending[:0]
                last = self._stable(0, m - 1, m)  # module 0's entry m-1 is stable
                tentative = self.pending[:0]
            else:
                # Tentative entries max(m-j, 0)..m-1: module j-1's outputs there (stable, then its own
                # tentative ones) and tokens that include guesses. Computed, read, then dropped.
                lo = max(m - j, 0)
                hidden = torch.cat([self._stable(j - 1, lo, max(m - j + 1, 0)), tentative])
                keep = len(self.caches[j])
                tentative = self._run(j, hidden, ids[lo + j + 1: m + j + 1], lo)
                self.caches[j].crop(keep)
                last = tentative[-1:]
            logits = head.logits(j, last)[-1]
            token, q = draw(logits, sampling, generator)
            unsure = bool(self.stop) and self.stop.unsure(logits, q, token)
            if unsure and self.stop.drops:
                break  # later modules catch up on their stable entries in a later round
            if q is not None:
                dists.append(q)
            guesses.append(token)
            ids.append(int(token))
            if unsure:
                break
        # Forget stable outputs the next module has cached (it never reads below its cache length).
        for j in range(depth - 1):
            drop = len(self.caches[j + 1]) - self.base[j]
            if drop > 0:
                self.outputs[j], self.base[j] = self.outputs[j][drop:], self.base[j] + drop
        self.guesses = [int(t) for t in guesses]
        if not guesses:  # the first guess was dropped
            return Proposal(torch.empty(0, dtype=torch.long, device=self.device))
        return Proposal(torch.stack(guesses), torch.stack(dists) if dists else None)


class MTPBatch(FeatureBatch):
    """`MTPDrafter` for a batch: module j keeps one ragged cache over its own `RaggedRows` (each row's
    stable entries); every module step is one call for all rows, each feeding its own number of stable
    entries (rows with none feed padding that is never attended), then its tentative entries, which are
    cropped again per row."""

    def start(self, prompts, features=None) -> None:
        super().start(prompts, features)
        depth, B = self.head.config.depth, len(prompts)
        self.rows = [RaggedRows(B, self.device) for _ in range(depth)]
        self.caches = [KVCache(rows) for rows in self.rows]
        self.outputs = [[p[:0] for p in self.pending] for _ in range(depth)]  # [module][row]: stable outputs
        self.base = [[0] * B for _ in range(depth)]  # [module][row]: position of outputs[module][row][0]
        self._prefill()

    @torch.inference_mode()
    def _prefill(self) -> None:
        """Cache, in every module, the stable entries of the prompt without its newest feature, which the
        first round's module 0 feeds (and drafts from): the prompt is read here, not inside a round."""
        B = len(self.ids)
        m = [len(ids) - 2 for ids in self.ids]  # positions 0..m-1 of module 0: every prompt feature but the newest
        for j in range(self.head.config.depth):
            c = self.rows[j].lengths
            end = [mb - j for mb in m]
            hidden = [self.pending[b][:-1] if j == 0 else self._stable(j - 1, b, c[b], max(end[b], c[b]))
                      for b in range(B)]
            if not any(h.shape[0] for h in hidden):
                break
            out = self._call(j, hidden, [self.ids[b][c[b] + j + 1: max(end[b], c[b]) + j + 1] for b in range(B)])
            for b, h in enumerate(hidden):
                self.outputs[j][b] = torch.cat([self.outputs[j][b], out[b, : h.shape[0]]])
        self.pending = [p[-1:] for p in self.pending]

    def _call(self, j: int, hidden: list[torch.Tensor], tokens: list[list[int]]) -> torch.Tensor:
        """Module j on row b's entries (hidden[b] (n_b, d), tokens[b]) at its cache's next positions; returns
        (B, q, d); the rows advance by n_b."""
        counts = [h.shape[0] for h in hidden]
        q = max(counts)
        width = hidden[0].shape[-1]
        padded = torch.stack([torch.cat([h, h.new_zeros(q - h.shape[0], width)]) for h in hidden])
        ids = torch.tensor([t + [0] * (q - len(t)) for t in tokens], device=self.device)
        out = self.head.run_rows(j, padded, ids, self.rows[j], self.caches[j])
        self.rows[j].advance(counts)
        return out

    def _stable(self, j: int, b: int, lo: int, hi: int) -> torch.Tensor:
        return self.outputs[j][b][lo - self.base[j][b]: hi - self.base[j][b]]

    @torch.inference_mode()
    def propose(self, k: int, sampling: Sampling, generator: torch.Generator | None = None) -> list[Proposal]:
        head, depth, B = self.head, self.head.config.depth, len(self.ids)
        m = [len(ids) - 1 for ids in self.ids]
        ids = [list(x) for x in self.ids]  # committed tokens, then each row's guesses as they are made
        chains = Chains(B, self.stop)
        tentative = [p[:0] for p in self.pending]
        for j in range(min(k, depth)):
            # Stable entries not cached yet, per row: positions c..m-j-1, every input committed.
            c = self.rows[j].lengths
            end = [mb - j for mb in m]
            hidden = [self.pending[b] if j == 0 else self._stable(j - 1, b, c[b], max(end[b], c[b]))
                      for b in range(B)]
            if any(h.shape[0] for h in hidden):
                out = self._call(j, hidden, [ids[b][c[b] + j + 1: end[b] + j + 1] for b in range(B)])
                if j < depth - 1:  # the last module's outputs feed nobody
                    for b, h in enumerate(hidden):
                        self.outputs[j][b] = torch.cat([self.outputs[j][b], out[b, : h.shape[0]]])
            if j == 0:
                # Module 0's entry m-1 is stable, the last it just cached for every row.
                last = torch.stack([out[b, h.shape[0] - 1] for b, h in enumerate(hidden)])
                self.pending = [p[:0] for p in self.pending]
            else:
                # Tentative entries max(m-j, 0)..m-1 per row: module j-1's outputs there (stable, then its
                # own tentative ones) and tokens that include guesses. Computed, read, then cropped.
                lo = [max(mb - j, 0) for mb in m]
                hidden = [torch.cat([self._stable(j - 1, b, lo[b], max(m[b] - j + 1, 0)), tentative[b]])
                          for b in range(B)]
                keep = list(self.rows[j].lengths)
                out = self._call(j, hidden, [ids[b][lo[b] + j + 1: m[b] + j + 1] for b in range(B)])
                self.rows[j].crop(keep)
                tentative = [out[b, : h.shape[0]] for b, h in enumerate(hidden)]
                last = torch.stack([t[-1] for t in tentative])
            logits = head.logits(j, last)  # (B, V)
            tokens, q = draw(logits, sampling, generator)  # every row at once
            for row, token in zip(ids, tokens.tolist()):
                row.append(token)
            if chains.add(logits, tokens, q):
                break  # later modules catch up on their stable entries in a later round
        # Forget stable outputs the next module has cached (it never reads below its cache length).
        for j in range(depth - 1):
            for b in range(B):
                drop = self.rows[j + 1].lengths[b] - self.base[j][b]
                if drop > 0:
                    self.outputs[j][b], self.base[j][b] = self.outputs[j][b][drop:], self.base[j][b] + drop
        proposals = chains.proposals()
        self.guesses = [p.tokens.tolist() for p in proposals]
        return proposals

    def keep(self, rows: list[int]) -> None:
        for r in self.rows:
            r.select(rows)
        self.outputs = [[per_row[r] for r in rows] for per_row in self.outputs]
        self.base = [[per_row[r] for r in rows] for per_row in self.base]
        super().keep(rows)

    def absorb(self, other: "MTPBatch") -> None:
        for cache, rows, theirs, their_rows in zip(self.caches, self.rows, other.caches, other.rows):
            cache.absorb(theirs)
            rows.extend(their_rows)
        self.outputs = [mine + theirs for mine, theirs in zip(self.outputs, other.outputs)]
        self.base = [mine + theirs for mine, theirs in zip(self.base, other.base)]
        super().absorb(other)


HEAD = MTP
