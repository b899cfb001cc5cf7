"""The shared head pieces against the Hugging Face Llama modules they stand in for."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from drafters.layers import DecoderLayer, Fused, RMSNorm, Rotary, causal_mask, rope
from drafters.kv_cache import KVCache


def _config(**kw):
    return LlamaConfig(**{"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                          "max_position_embeddings": 4096, **kw})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_llama(dtype):
    torch.manual_seed(0)
    ours, ref = RMSNorm(64, eps=1e-6), LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ours.weight.normal_()
    ref.load_state_dict(ours.state_dict())  # same parameter names: checkpoints load either way
    ours, ref = ours.to(dtype), ref.to(dtype)
    x = torch.randn(3, 5, 64, dtype=dtype) * 4
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours(x), ref(x), atol=tol, rtol=tol)
    assert ours(x).dtype == dtype


def test_rmsnorm_gradient_matches_llama():
    torch.manual_seed(1)
    ours, ref = RMSNorm(64), LlamaRMSNorm(64)
    x = torch.randn(2, 7, 64, requires_grad=True)
    y = torch.randn(2, 7, 64)
    (ours(x) * y).sum().backward()
    g_ours, w_ours = x.grad.clone(), ours.weight.grad.clone()
    x.grad = None
    (ref(x) * y).sum().backward()
    torch.testing.assert_close(g_ours, x.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w_ours, ref.weight.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}])
def test_rotary_table_equals_llama_rotary_at_every_position(rope):
    config = _config(**({"rope_parameters": rope} if rope else {}))
    ours, ref = Rotary(config), LlamaRotaryEmbedding(config)
    x = torch.zeros(1, 1, 64)
    # Out of order, and far enough to make the table grow twice (it starts at 256 positions).
    for start, length in [(0, 1), (5, 3), (255, 2), (300, 1), (0, 40), (900, 7), (17, 1)]:
        cos, sin = ours(x, start, length)
        ref_cos, ref_sin = ref(x, torch.arange(start, start + length)[None])
        assert cos.shape == (1, length, 16)
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin), (start, length)
    # A second dtype gets its own table in that dtype.
    cos, _ = ours(x.to(torch.bfloat16), 10, 2)
    assert cos.dtype == torch.bfloat16
    assert torch.equal(cos, ref(x.to(torch.bfloat16), torch.arange(10, 12)[None])[0])


def test_rotary_has_no_weights_in_the_state_dict():
    assert Rotary(_config()).state_dict() == {}


def test_dynamic_rope_is_computed_per_call():
    config = _config(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    ours, ref = Rotary(config), LlamaRotaryEmbedding(config)
    assert not ours.static
    x = torch.zeros(1, 1, 64)
    cos, sin = ours(x, 3, 4)
    ref_cos, ref_sin = ref(x, torch.arange(3, 7)[None])
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


@pytest.mark.parametrize("rope_parameters", [None, {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}])
def test_drafting_rope_equals_llama_rope(rope_parameters):
    """`rope` on `Rotary.decode`'s tables (a roll and a signed sin) gives exactly the values of Llama's
    apply_rotary_pos_emb on `Rotary`'s (cos, sin), queries and keys alike, at any position."""
    config = _config(**({"rope_parameters": rope_parameters} if rope_parameters else {}))
    rotary = Rotary(config)
    x = torch.zeros(1, 1, 64)
    q, k = torch.randn(1, 4, 9, 16), torch.randn(1, 2, 9, 16)
    for start in (0, 3, 250, 600):
        ref_q, ref_k = apply_rotary_pos_emb(q, k, *rotary(x, start, 9))
        cos, sin = rotary.decode(x, start, 9)
        assert cos.shape == sin.shape == (1, 1, 9, 16)
        assert torch.equal(rope(q, cos, sin), ref_q) and torch.equal(rope(k, cos, sin), ref_k), start
        both = rope(torch.cat([q, k], dim=1), cos, sin)  # queries and keys in one pass, as decode runs it
        assert torch.equal(both, torch.cat([ref_q, ref_k], dim=1))


def test_rotary_table_built_while_drafting_still_trains():
    """The loop drafts under inference_mode; a table built there must not be an inference tensor, or
    training the same head afterwards fails when autograd saves cos/sin for backward."""
    rotary = Rotary(_config())
    with torch.inference_mode():
        rotary(torch.zeros(1, 1, 64), 0, 4)
    q = torch.randn(1, 4, 16, requires_grad=True)
    cos, sin = rotary(torch.zeros(1, 1, 64), 0, 4)
    (q * cos + q * sin).sum().backward()
    assert q.grad is not None


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_decode_is_forward_on_a_cache(kv_heads):
    """Drafting's fused path (`decode`) against the training path (`forward`) of the same layer: the
    prompt in one call, then single tokens, then a rollback and a chunk, as the loop feeds it."""
    torch.manual_seed(2)
    config = _config(num_key_value_heads=kv_heads, intermediate_size=96)
    layer, rotary = DecoderLayer(config), Rotary(config)
    for p in layer.parameters():  # no ones-initialised norms: every weight matters
        torch.nn.init.normal_(p, std=0.3)
    seq = torch.randn(1, 12, 64)
    reference = layer(seq, *rotary(seq, 0, 12), causal_mask(12, 0, seq.device))  # teacher forced, no cache
    cache = KVCache()
    with torch.inference_mode():
        outs = [layer.decode(seq[:, :5], *rotary.decode(seq, 0, 5), causal_mask(5, 0, seq.device), cache)]
        for i in range(5, 9):
            outs.append(layer.decode(seq[:, i: i + 1], *rotary.decode(seq, i, 1), None, cache))
        cache.crop(7)
        outs = outs[:3] + [layer.decode(seq[:, 7:], *rotary.decode(seq, 7, 5), causal_mask(5, 7, seq.device), cache)]
    ours = torch.cat([outs[0], *[o for o in outs[1:3]], outs[3]], dim=1)
    torch.testing.assert_close(ours, reference.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["decoder_layer", "eagle3_layer"])
def test_decode_of_the_last_entry_alone_keeps_every_entrys_keys(kind):
    """`decode(..., last=True)`, the first step of a drafting round, gives the last entry's output of
    a full `decode` and caches the same keys and values for every entry, so the next step agrees too."""
    from drafters.eagle import Eagle3Layer

    torch.manual_seed(3)
    config = _config(intermediate_size=96, rms_norm_eps=1e-6)
    layer, rotary = (DecoderLayer(config) if kind == "decoder_layer" else Eagle3Layer(config)), Rotary(config)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    seq = torch.randn(1, 10, 64)
    inputs = (lambda a, b: (seq[:, a:b],)) if kind == "decoder_layer" else (lambda a, b: (seq[:, a:b], seq[:, a:b] * 2))
    full, last = KVCache(), KVCache()
    with torch.inference_mode():
        for cache in (full, last):
            layer.decode(*inputs(0, 4), *rotary.decode(seq, 0, 4), causal_mask(4, 0, seq.device), cache)
        reference = layer.decode(*inputs(4, 9), *rotary.decode(seq, 4, 5), causal_mask(5, 4, seq.device), full)
        ours = layer.decode(*inputs(4, 9), *rotary.decode(seq, 4, 5), causal_mask(5, 4, seq.device), last, last=True)
        assert ours.shape == (1, 1, 64)
        torch.testing.assert_close(ours, reference[:, -1:], atol=1e-5, rtol=1e-5)
        assert len(last) == len(full) == 9
        torch.testing.assert_close(last.k[:, :, :9], full.k[:, :, :9])
        torch.testing.assert_close(last.v[:, :, :9], full.v[:, :, :9])
        after = [layer.decode(*inputs(9, 10), *rotary.decode(seq, 9, 1), None, cache) for cache in (full, last)]
    torch.testing.assert_close(after[1], after[0])


def test_kv_cache_appends_rolls_back_and_grows():
    """The cache holds exactly what was appended and not rolled back, through a growth of its buffers."""
    cache, reference = KVCache(), []
    gen = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for length, keep in [(5, None), (1, None), (3, 4), (250, None), (1, 100), (300, None), (2, 3)]:
            k, v = torch.randn(2, 1, 2, length, 8, generator=gen)
            keys, values = cache.append(k, v)
            reference.append((k, v))
            assert torch.equal(keys, torch.cat([r[0] for r in reference], dim=2))
            assert torch.equal(values, torch.cat([r[1] for r in reference], dim=2))
            assert len(cache) == keys.shape[2]
            if keep is not None:
                cache.crop(keep)
                flat_k, flat_v = (torch.cat([r[i] for r in reference], dim=2)[:, :, :keep] for i in (0, 1))
                reference = [(flat_k, flat_v)]
                assert len(cache) == keep
        cache.crop(10_000)  # never extends
        assert len(cache) == sum(r[0].shape[2] for r in reference)


def test_fused_linears_follow_their_weights():
    """The concatenated copy is rebuilt after an optimizer step, a load_state_dict and a dtype move,
    and carries the biases (zeros for a linear without one)."""
    torch.manual_seed(3)
    a, b = torch.nn.Linear(8, 3), torch.nn.Linear(8, 5, bias=False)
    fused = Fused(a, b)
    x = torch.randn(2, 8)
    expected = lambda: torch.cat([a(x), b(x)], dim=-1).detach()  # noqa: E731
    torch.testing.assert_close(fused(x), expected())
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.5)
    (a(x).sum() + b(x).square().sum()).backward()
    opt.step()
    torch.testing.assert_close(fused(x), expected())
    b.load_state_dict({"weight": torch.randn(5, 8)})
    torch.testing.assert_close(fused(x), expected())
    a.to(torch.float64), b.to(torch.float64)
    x = x.double()
    assert fused(x).dtype == torch.float64
    torch.testing.assert_close(fused(x), expected())
    a.weight = torch.nn.Parameter(torch.randn(3, 8, dtype=torch.float64))  # a parameter replaced outright
    torch.testing.assert_close(fused(x), expected())
