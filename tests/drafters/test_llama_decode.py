"""The lean decode path reproduces the Hugging Face forward, and refuses what it cannot reproduce."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

from drafters.llama_decode import LeanLlama
from helpers import tiny_llama

V = 48
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)


def random_init(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # norms and biases away from their init values, so that using them matters
    return model.eval()


MODELS = {
    "llama": lambda: random_init(LlamaForCausalLM(LlamaConfig(**SMALL))),
    "llama_biases_tied": lambda: random_init(LlamaForCausalLM(LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True,
                                                                          tie_word_embeddings=True))),
    "llama_linear_rope": lambda: random_init(LlamaForCausalLM(LlamaConfig(
        **SMALL, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}))),
    "mistral": lambda: random_init(MistralForCausalLM(MistralConfig(**SMALL, sliding_window=None))),
    "qwen2": lambda: random_init(Qwen2ForCausalLM(Qwen2Config(**SMALL, use_sliding_window=False))),
}


def feed_and_compare(model, lean, seq, chunks):
    """Feed seq in chunks through the lean decoder; each chunk's last logits must match a full forward."""
    with torch.inference_mode():
        full = model(input_ids=seq[None]).logits[0]
        start = 0
        for size in chunks:
            logits = lean.forward(seq[start:start + size])
            start += size
            torch.testing.assert_close(logits, full[start - 1], rtol=1e-4, atol=1e-4)
        assert lean.length == start


@pytest.mark.parametrize("name", sorted(MODELS))
def test_matches_the_hugging_face_forward(name):
    model = MODELS[name]()
    assert LeanLlama.supports(model), LeanLlama.unsupported(model)
    seq = torch.randint(0, V, (40,), generator=torch.Generator().manual_seed(1))
    feed_and_compare(model, LeanLlama(model), seq, [17, 1, 2, 1, 1, 5, 13])


def test_crop_rolls_back_to_a_prefix():
    model = MODELS["llama"]()
    lean = LeanLlama(model)
    seq = torch.randint(0, V, (30,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        full = model(input_ids=seq[None]).logits[0]
        lean.forward(seq[:20])
        lean.forward(torch.tensor([1, 2, 3, 4]))  # rejected guesses
        lean.crop(20)
        torch.testing.assert_close(lean.forward(seq[20:25]), full[24], rtol=1e-4, atol=1e-4)
        lean.crop(100)  # never extends
        assert lean.length == 25
        lean.reset()
        torch.testing.assert_close(lean.forward(seq[:3]), full[2], rtol=1e-4, atol=1e-4)


def test_cache_grows_past_its_first_allocation():
    model = MODELS["llama"]()
    seq = torch.randint(0, V, (600,), generator=torch.Generator().manual_seed(3))
    lean = LeanLlama(model)
    feed_and_compare(model, lean, seq, [250, 1, 5, 300, 1, 43])
    assert all(cache.k.shape[2] >= 600 for cache in lean.caches)  # every layer's buffers grew past 256


@pytest.mark.parametrize("module", ["down_proj", "q_proj", "v_proj", "up_proj"])
def test_reads_the_models_current_weights(module):
    model = MODELS["llama_biases_tied"]()
    lean = LeanLlama(model)
    seq = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(4))
    feed_and_compare(model, lean, seq, [12])  # q/k/v and gate/up concatenated for this step
    layer = model.model.layers[1]
    linear = getattr(layer.self_attn if module.endswith(("q_proj", "v_proj")) else layer.mlp, module)
    with torch.no_grad():  # e.g. an optimizer step or a LoRA merge, after the lean path has run
        linear.weight.mul_(3.0)
        linear.bias.add_(0.5)
    lean.reset()
    feed_and_compare(model, lean, seq, [12])


def test_half_precision_stays_close():
    model = MODELS["llama"]().to(torch.bfloat16)
    lean = LeanLlama(model)
    seq = torch.randint(0, V, (20,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        full = model(input_ids=seq[None]).logits[0].float()
        logits = lean.forward(seq).float()
    assert logits.dtype == torch.float32 and (logits - full[-1]).abs().max() < 0.05 * full[-1].abs().max()


def test_refuses_what_it_cannot_reproduce():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2))
    assert "model type 'gpt2'" in LeanLlama.unsupported(gpt2)
    sliding = MistralForCausalLM(MistralConfig(**SMALL, sliding_window=16))
    assert "sliding" in LeanLlama.unsupported(sliding)
    lora = get_peft_model(tiny_llama(V), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert "adapters" in LeanLlama.unsupported(lora)
    with pytest.raises(ValueError, match="lean decoder cannot run"):
        LeanLlama(gpt2)
    gelu = LlamaForCausalLM(LlamaConfig(**SMALL, hidden_act="gelu"))
    assert "activation" in LeanLlama.unsupported(gelu)
