"""The toy world's tokenizer and language models (traffic/toyworld.py): a byte-level BPE trained on the world's
text, and small Llama-architecture causal LMs trained on it, checkpointed so a build resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from traffic import checkpoint

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


# Role, content, and an assistant's tool calls as <tool_call> JSON (rendered only where there are some, so
# a conversation without tool calls renders as it always has).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class LMSpec:
    """A Llama-architecture LM and how long to train it."""

    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    intermediate_size: int
    steps: int
    batch_size: int
    lr: float = 3e-3


CHECKPOINT_EVERY = 100  # steps between a build's model checkpoints



def train_tokenizer(texts: dict[str, list[str]], records: list[dict], vocab_size: int):
    """A byte-level BPE tokenizer with the chat special tokens and template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    chat_text = [m["content"] or "" for r in records for m in r["messages"]]
    chat_text += [json.dumps(c["function"]) for r in records for m in r["messages"] for c in m.get("tool_calls", [])]
    tok.train_from_iterator(texts["code"] + texts["prose"] + texts["json"] + chat_text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>",
                                   pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode(tokenizer, docs: list[str], seed: int) -> torch.Tensor:
    docs = list(docs)
    random.Random(seed).shuffle(docs)
    ids = []
    for doc in docs:
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def new_llama(spec: LMSpec, tokenizer, context: int):
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=context, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def train_lm(model, stream: torch.Tensor, spec: LMSpec, seq_len: int, seed: int, desc: str,
             checkpoints: Path | None = None, every: int | None = None, stop_at: int | None = None) -> float:
    """Next-token training on random windows of a token stream; returns the mean loss of the last 10 steps.

    With `checkpoints` (a directory), the model, optimizer, schedule and batch sampler are saved there
    every `every` steps (default CHECKPOINT_EVERY; only the newest kept), and training starts from the
    newest one found: the result is the same as an uninterrupted run's. `stop_at` ends training after
    that step (checkpointed), as an interruption would."""

    every = every or CHECKPOINT_EVERY
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, spec.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / spec.steps))
    )
    model.train()
    recent: list[torch.Tensor] = []
    start = 0
    last = checkpoint.latest(checkpoints) if checkpoints is not None else None
    if last is not None:
        state = checkpoint.load(last, model, opt, sched)
        start = state["step"]
        generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))
        recent = [torch.tensor(x) for x in state["recent"]]
        print(f"[toyworld] {desc}: resuming at step {start} from {last}", file=sys.stderr)
    bar = tqdm(range(start, spec.steps), desc=desc, unit="step", file=sys.stderr, initial=start, total=spec.steps)
    # A world may be built on first use from inside torch.no_grad() (an evaluation, a script): train anyway.
    with torch.enable_grad():
        for step in bar:
            starts = torch.randint(0, len(stream) - seq_len, (spec.batch_size,), generator=generator)
            batch = torch.stack([stream[s : s + seq_len] for s in starts.tolist()])  # (B, T)
            loss = model(input_ids=batch, labels=batch).loss  # labels are shifted inside the model
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            recent = (recent + [loss.detach()])[-10:]
            if step % 10 == 0 or step == spec.steps - 1:  # .item() syncs: only when the bar shows it
                bar.set_postfix(loss=f"{torch.stack(recent).mean().item():.3f}")
            done = step + 1
            if checkpoints is not None and done < spec.steps and (done % every == 0 or done == stop_at):
                checkpoint.save(checkpoints, done, model, opt, sched, keep=1,
                                extra={"generator": generator.get_state().tolist(),
                                       "recent": [r.item() for r in recent]})
            if stop_at is not None and done >= stop_at:
                break
    model.eval()
    return torch.stack(recent).mean().item()
