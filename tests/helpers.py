"""Helpers the tests import: tiny models built in the test and stub drafters."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafters.base import Proposal
from eval.sampling import Sampling

def tiny_llama(vocab: int = 64, hidden: int = 32, layers: int = 2, seed: int = 0, logit_scale: float = 1.0,
               eos: int | None = None) -> LlamaForCausalLM:
    """A random Llama small enough to run thousands of times in a test. logit_scale > 1 sharpens its
    distributions (random init is close to uniform, which would hide sampling bugs)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=eos)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


class ScriptedDrafter:
    """A stub drafter that knows the target's greedy continuation and is right exactly where told.

    policy(position) -> bool says whether the guess for generated position `position` is right; a
    wrong guess is the right token + 1 (mod vocab).
    """

    def __init__(self, reference: list[int], vocab: int, policy, name: str = "scripted") -> None:
        self.reference, self.vocab, self.policy, self.name = reference, vocab, policy, name

    def start(self, prompt_ids):
        self.committed = 0  # generated tokens committed so far
        self.device = prompt_ids.device

    def propose(self, k, sampling: Sampling, generator=None):
        guesses = []
        for i in range(k):
            pos = self.committed + i
            right = self.reference[pos] if pos < len(self.reference) else 0
            guesses.append(right if self.policy(pos) else (right + 1) % self.vocab)
        return Proposal(torch.tensor(guesses, device=self.device), None)

    def commit(self, n_accepted, next_token):
        self.committed += n_accepted + 1
