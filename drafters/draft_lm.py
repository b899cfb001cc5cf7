"""A standalone draft language model: any Hugging Face causal LM that shares the target's tokenizer.

The drafter keeps its own KV cache across rounds. The cache always covers a prefix of the committed
sequence plus whatever guesses it has fed itself; tokens committed but not yet in the cache (the
target's correction, or the last guess when all k were kept) are fed at the start of the next
proposal, so a round costs exactly k draft forwards and the prefix is never recomputed.

At batch > 1 (`batched()`, eval/batching.py) every draft step is one forward for all rows, on a ragged
KV cache (a length per row; drafters/hf_cache.py): rows keep different numbers of guesses and none
recomputes its prefix.

Llama-family drafts (Llama, Mistral, Qwen2) run on `drafters.llama_decode.LeanLlama`, the same weights
and arithmetic without the Hugging Face forward's per-call overhead, which is most of a small draft's
cost; other models, and `lean=False`, draft through the Hugging Face forward and `DynamicCache`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from drafters.base import Chains, ConfidenceStop, Proposal
from drafters.hf_cache import RaggedCache, cache_keyword, forward_rows, keep_path, masks_for
from drafters.kv_cache import RaggedRows
from drafters.llama_decode import LeanLlama
from drafters.sampling import Sampling, draw
from drafters.tree import StaticTree, Tree, TreeShape, entry_mask


class TokenizerMismatchError(ValueError):
    """The drafter and the target do not speak the same token ids."""


def check_same_vocabulary(
    target_tokenizer: PreTrainedTokenizerBase,
    draft_tokenizer: PreTrainedTokenizerBase | None,
    target_vocab_size: int,
    draft_vocab_size: int,
    draft_name: str,
) -> None:
    """Raise TokenizerMismatchError unless the two models map text to the same ids and logits.

    Speculative decoding compares token ids and probability vectors position by position; a draft
    with another vocabulary would be silently rejected (or, worse, accepted for the wrong text).
    """
    if draft_vocab_size != target_vocab_size:
        raise TokenizerMismatchError(
            f"drafter {draft_name!r} has an output vocabulary of {draft_vocab_size} logits but the target "
            f"has {target_vocab_size}; a draft LM must share the target's tokenizer and vocabulary"
        )
    if draft_tokenizer is None:
        return
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda kv: kv[1])[:5]
        raise TokenizerMismatchError(
            f"drafter {draft_name!r} uses a different tokenizer than the target "
            f"({len(draft_vocab)} vs {len(target_vocab)} entries; first differing (token, id) pairs: {differing})"
        )
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(target_tokenizer, attr) != getattr(draft_tokenizer, attr):
            raise TokenizerMismatchError(
                f"drafter {draft_name!r} has {attr}={getattr(draft_tokenizer, attr)} but the target has "
                f"{getattr(target_tokenizer, attr)}"
            )


class DraftLM:
    """Drafts with a small causal LM and its own KV cache."""

    parallel = False  # its k guesses cost k draft steps (drafters/base.py `Drafter.parallel`)

    def __init__(self, model: PreTrainedModel, name: str = "draft_lm", lean: bool = True,
                 stop_below: float = 0.0, stop_rule: str = "propose") -> None:
        self.model = model.eval()
        self.name = name
        self.stop = ConfidenceStop(stop_below, stop_rule, name)  # confidence stop (drafters/base.py); 0 = off
        self.device = next(model.parameters()).device
        # The lean path when asked for and the model is one it reproduces; else Hugging Face's forward.
        self.lean = LeanLlama(model) if lean and LeanLlama.supports(model) else None
        self.cache: DynamicCache | None = None  # the Hugging Face path's cache (the lean path keeps its own)
        self.ids: list[int] = []  # the committed sequence (prompt + generated)
        self._fed = 0  # how many tokens of ids + pending guesses are in the cache
        self._guesses: list[int] = []  # the last proposal, to know what commit() keeps

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path,
        *,
        target: PreTrainedModel,
        target_tokenizer: PreTrainedTokenizerBase,
        name: str | None = None,
        dtype: torch.dtype | None = None,
        trust_remote_code: bool = False,
        lean: bool = True,
        stop_below: float = 0.0,
        stop_rule: str = "propose",
    ) -> "DraftLM":
        """Load a draft LM from a hub id or a local directory and check it against the target."""
        name = name or str(name_or_path)
        device = next(target.parameters()).device
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path, dtype=dtype or target.dtype, trust_remote_code=trust_remote_code
        ).to(device)
        try:
            draft_tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            draft_tokenizer = None  # weights only: the vocabulary-size check below still applies
        check_same_vocabulary(
            target_tokenizer,
            draft_tokenizer,
            target.get_output_embeddings().weight.shape[0],
            model.get_output_embeddings().weight.shape[0],
            name,
        )
        return cls(model, name=name, lean=lean, stop_below=stop_below, stop_rule=stop_rule)

    def start(self, prompt_ids: torch.Tensor) -> None:
        if self.lean is not None:
            self.lean.reset()
        else:
            self.cache = DynamicCache()
        self.ids = prompt_ids.tolist()
        self._fed = 0
        self._guesses = []

    @torch.inference_mode()
    def propose(self, k: int, sampling: Sampling, generator: torch.Generator | None = None) -> Proposal:
        # Feed every committed token the cache has not seen yet (1 or 2 of them), then one guess at a time.
        pending = self.ids[self._fed :]
        tokens, dists, dropped = [], [], False
        inputs = torch.tensor([pending], device=self.device)
        for _ in range(k):
            if self.lean is not None:
                logits = self.lean.forward(inputs[0])
            else:
                # logits_to_keep=1: the prefill needs only the last position's logits, not a (T, V) matrix.
                out = self.model(input_ids=inputs, **{cache_keyword(self.model): self.cache}, use_cache=True,
                                 logits_to_keep=1)
                logits = out.logits[0, -1]
            token, q = draw(logits, sampling, generator)
            unsure = bool(self.stop) and self.stop.unsure(logits, q, token)
            if unsure and self.stop.drops:
                dropped = True
                break
            if q is not None:
                dists.append(q)
            tokens.append(token)
            if unsure:
                break
            inputs = token.view(1, 1)
        # The cache now holds ids plus every guess but the last (which was never fed), or plus every guess
        # when the stop dropped the next one.
        self._fed = len(self.ids) + len(tokens) - 1 + dropped
        if not tokens:  # the first guess was dropped
            proposal = Proposal(torch.empty(0, dtype=torch.long, device=self.device))
        else:
            proposal = Proposal(torch.stack(tokens), torch.stack(dists) if dists else None)
        self._guesses = proposal.tokens.tolist()
        return proposal

    def commit(self, n_accepted: int, next_token: int) -> None:
        kept = self._guesses[:n_accepted]
        # Rollback: the cache is valid up to the last kept guess it has seen; drop the rest.
        valid = min(len(self.ids) + n_accepted, self._fed)
        if self.lean is not None:
            self.lean.crop(valid)
        else:
            self.cache.crop(valid - self.cache.get_seq_length())
        self._fed = valid
        self.ids.extend(kept)
        self.ids.append(next_token)

    @torch.inference_mode()
    def propose_tree(self, shape: TreeShape | StaticTree, sampling: Sampling,
                     generator: torch.Generator | None = None) -> Tree:
        """A tree (drafters/tree.py: EAGLE-2's dynamic `TreeShape`, or a `StaticTree`) drafted by this LM, batch 1.
        The committed tokens the cache has not seen go in first; their last logits score the root's children.
        Then, depth by depth, the expanded nodes of one depth go in as one call of q entries at the depth's
        position, each seeing the committed prefix and its ancestors' entries. `commit_path` keeps the entries of
        the kept path (moved in place after the prefix) and drops the others."""
        pending = torch.tensor(self.ids[self._fed:], device=self.device)
        if self.lean is not None:
            root = self.lean.forward(pending)
        else:
            root = self.model(input_ids=pending[None], **{cache_keyword(self.model): self.cache}, use_cache=True,
                              logits_to_keep=1).logits[0, -1]
        base = self._fed = len(self.ids)
        self._slots: dict[int, int] = {}  # node -> its entry's index in the cache
        drafted: list[int] = []  # the positions of the drafted entries, in cache order

        def expand(frontier: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
            if frontier == [-1]:
                return root[None].float()
            q = len(frontier)
            mask, depth = entry_mask(frontier, parents, self._slots, self._length(), base, self.device)
            ids = torch.tensor([tokens[node] for node in frontier], device=self.device)
            position = base + depth - 1
            if self.lean is not None:
                return self.lean.forward_tree(ids, position, mask).float()
            positions = torch.tensor([[position] * q], device=self.device)
            drafted.extend([position] * q)  # each drafted entry sits at its own depth's position
            key_positions = torch.cat([torch.arange(base, device=self.device), torch.tensor(drafted, device=self.device)])
            out = self.model(input_ids=ids[None], position_ids=positions,
                             attention_mask=masks_for(self.model, mask, positions[0], key_positions),
                             **{cache_keyword(self.model): self.cache}, use_cache=True)
            return out.logits[0].float()

        self.tree = shape.grow(expand)
        return self.tree

    def commit_path(self, path: list[int], next_token: int) -> None:
        """The target kept the tree's nodes `path` and added `next_token`: keep the entries of the kept nodes the
        cache holds (all but a last node never expanded), in place after the prefix; drop every other node's."""
        fed = [self._slots[node] - self._fed for node in path if node in self._slots]
        if self.lean is not None:
            self.lean.keep(self._fed, fed)
        else:
            keep_path(self.cache, self._fed, fed)
        self._fed += len(fed)
        self.ids.extend(self.tree.tokens[path].tolist())
        self.ids.append(next_token)

    def _length(self) -> int:
        return self.lean.length if self.lean is not None else self.cache.get_seq_length()

    def batched(self) -> "DraftLMBatch":
        return DraftLMBatch(self)



class DraftLMBatch:
    """The draft LM for B rows at once (drafters/base.py `BatchDrafter`): a draft step is one forward of
    the whole batch; each row feeds its own pending committed tokens (1 or 2) in the first step of a
    round, then its last guess. A row whose confidence stop fires keeps drafting with the others (its
    extra guesses are cropped like rejected ones), and the round ends early once every row has stopped."""

    parallel = False  # its k guesses cost k draft steps (drafters/base.py `Drafter.parallel`)

    def __init__(self, drafter: DraftLM) -> None:
        self.drafter = drafter
        self.model, self.name, self.stop = drafter.model, drafter.name, drafter.stop
        self.device, self.lean = drafter.device, drafter.lean  # the lean path when the drafter has it

    def start(self, prompts: list[torch.Tensor], features=None) -> None:
        self.rows = RaggedRows(len(prompts), self.device)
        if self.lean is not None:
            self.caches = self.lean.start_rows(self.rows)
        else:
            self.cache = RaggedCache(self.model, self.rows)
        self.ids = [p.tolist() for p in prompts]
        self.fed = [0] * len(prompts)  # how many of each row's ids and pending guesses its cache holds
        self.guesses: list[list[int]] = [[] for _ in prompts]
        self._prefill()

    def _forward(self, feed: list[list[int]]) -> torch.Tensor:
        """Row b feeds feed[b] on top of its cache; (B, V) logits after each row's last entry."""
        if self.lean is not None:
            return self.lean.forward_rows(feed, self.rows, self.caches)
        return forward_rows(self.model, feed, self.cache, logits_for="last")[0]

    @torch.inference_mode()
    def _prefill(self) -> None:
        """Read every row's prompt but its last token, which the first round's first draft step feeds: the
        prompt is read here, with the target's prefill, not inside a round. (A batch with a 1-token prompt
        reads its prompts in that first step instead.)"""
        feed = [ids[:-1] for ids in self.ids]
        if all(feed):
            self._forward(feed)
            self.fed = [len(f) for f in feed]

    def join(self, prompts: list[torch.Tensor], features=None) -> None:
        """New rows after the running ones, each started on its prompt as `start` starts a batch."""
        other = DraftLMBatch(self.drafter)
        other.start(prompts)
        if self.lean is not None:
            for mine, theirs in zip(self.caches, other.caches):
                mine.absorb(theirs)
        else:
            self.cache.absorb(other.cache)
        self.rows.extend(other.rows)
        self.ids, self.fed, self.guesses = self.ids + other.ids, self.fed + other.fed, self.guesses + other.guesses

    @torch.inference_mode()
    def propose(self, k: int, sampling: Sampling, generator: torch.Generator | None = None) -> list[Proposal]:
        feed = [ids[fed:] for ids, fed in zip(self.ids, self.fed)]
        chains = Chains(len(self.ids), self.stop)
        for step in range(1, k + 1):
            logits = self._forward(feed)  # (B, V)
            tokens, q = draw(logits, sampling, generator)  # every row at once
            if chains.add(logits, tokens, q) or step == k:
                break
            feed = [[t] for t in tokens.tolist()]
        # Each row's cache holds its ids plus the first step - 1 guesses it drew (the last was never fed).
        self.fed = [len(ids) + step - 1 for ids in self.ids]
        proposals = chains.proposals()
        self.guesses = [p.tokens.tolist() for p in proposals]
        return proposals

    def commit(self, accepted: list[int], next_tokens: list[int], features=None) -> None:
        valid = [min(len(ids) + a, fed) for ids, a, fed in zip(self.ids, accepted, self.fed)]
        self.rows.crop(valid)
        self.fed = valid
        for ids, guesses, a, token in zip(self.ids, self.guesses, accepted, next_tokens):
            ids.extend(guesses[:a])
            ids.append(token)

    def keep(self, rows: list[int]) -> None:
        self.rows.select(rows)
        self.ids, self.fed, self.guesses = ([xs[r] for r in rows] for xs in (self.ids, self.fed, self.guesses))
