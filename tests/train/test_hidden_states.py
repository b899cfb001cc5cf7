"""Hidden-state capture: layer-index convention, offline shards equal the online computation."""

import json

import pytest
import torch

from helpers import tiny_llama
from traffic.records import Example
from train.hidden_states import (ShardReader, bytes_per_token, capture, default_layers, estimate_bytes,
                                 write_shards)

LAYERS = 4


@pytest.fixture(scope="module")
def target():
    return tiny_llama(50, hidden=32, layers=LAYERS, seed=0)


def examples(n=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 20, (1,), generator=g))
        ids = torch.randint(0, 50, (length,), generator=g).tolist()
        out.append(Example(str(i), "c", ids, [int(j >= length // 2) for j in range(length)]))
    return out


def test_layer_index_is_the_output_hidden_states_index(target):
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        ref = target.model(input_ids=ids, output_hidden_states=True)
        emb = target.model.embed_tokens(ids)
    got = capture(target, ids, None, [0, 1, LAYERS])
    torch.testing.assert_close(got[:, :, 0], emb)  # 0: the embedding output
    torch.testing.assert_close(got[:, :, 1], ref.hidden_states[1])  # 1: output of decoder layer 0
    torch.testing.assert_close(got[:, :, 2], ref.last_hidden_state)  # n: the final (normed) hidden state
    # The feature at index n is what the LM head reads: it reproduces the logits.
    torch.testing.assert_close(target.lm_head(got[:, :, 2]), target(input_ids=ids).logits)
    with pytest.raises(ValueError, match=r"must be in 0\.\.4"):
        capture(target, ids, None, [LAYERS + 1])


def test_default_layers():
    assert default_layers("eagle1", 32) == [32]
    assert default_layers("eagle3", 32) == [2, 16, 29]  # vLLM's [2, n//2, n-3]
    assert default_layers("eagle3", 6) == [1, 3, 5]  # too shallow for [2, 3, 3]
    assert default_layers("eagle", 2) == [0, 1, 2]  # test targets: embedding, middle, last
    with pytest.raises(ValueError, match="too shallow"):
        default_layers("eagle3", 1)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_offline_shards_read_back_equal_online(target, tmp_path, dtype):
    exs = examples()
    layers = [1, 2, LAYERS]
    manifest = write_shards(exs, target, layers, tmp_path, dtype=dtype, batch_size=3, shard_tokens=40, progress=False)
    meta = json.loads(manifest.read_text())
    assert len(meta["shards"]) > 1  # several shards
    reader = ShardReader(tmp_path)
    assert len(reader) == len(exs) and reader.layers == layers
    for i, e in enumerate(exs):
        item = reader[i]
        online = capture(target, torch.tensor([e.input_ids]), None, layers)[0]  # unpadded, one example
        assert item["input_ids"].tolist() == e.input_ids and item["loss_mask"].int().tolist() == e.loss_mask
        assert item["hidden"].dtype == getattr(torch, dtype) and item["hidden"].shape == online.shape
        # Equal up to the storage dtype's rounding (and fp32 noise from batching with padding).
        torch.testing.assert_close(item["hidden"].float(), online.to(getattr(torch, dtype)).float(),
                                   rtol=1e-2, atol=1e-2)
    total = sum(s["tokens"] for s in meta["shards"])
    assert total == sum(len(e.input_ids) for e in exs)
    assert estimate_bytes(exs, 32, 3, dtype) == total * bytes_per_token(32, 3, dtype) == total * (32 * 3 * 2 + 5)


def test_size_cap_and_resume(target, tmp_path):
    exs = examples()
    with pytest.raises(ValueError, match="over the cap"):
        write_shards(exs, target, [LAYERS], tmp_path, max_bytes=100, progress=False)
    # Write the first shards, then finish: a rerun skips the shards already written.
    write_shards(exs[:6], target, [LAYERS], tmp_path / "part", batch_size=3, shard_tokens=1, progress=False)
    first = json.loads((tmp_path / "part" / "manifest.json").read_text())
    assert first["examples"] == 6
    with pytest.raises(ValueError, match="other settings or examples"):
        write_shards(exs, target, [LAYERS], tmp_path / "part", progress=False)
    out = tmp_path / "resume"
    write_shards(exs, target, [LAYERS], out, batch_size=3, shard_tokens=1, progress=False)
    meta = json.loads((out / "manifest.json").read_text())
    meta["shards"] = meta["shards"][:2]  # as if interrupted after two shards
    (out / "manifest.json").write_text(json.dumps(meta))
    before = (out / "shard-00000.safetensors").stat().st_mtime_ns
    write_shards(exs, target, [LAYERS], out, batch_size=3, shard_tokens=1, progress=False)
    assert (out / "shard-00000.safetensors").stat().st_mtime_ns == before
    assert len(ShardReader(out)) == len(exs)
    meta["shards"] = meta["shards"][:1]
    (out / "manifest.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="incomplete"):
        ShardReader(out)


def test_states_beyond_float16_are_an_error_not_inf_shards(tmp_path):
    """A target whose residual stream outgrows float16 (Gemma's does) would write inf and train NaN: the error
    says so and names bfloat16; bfloat16 stores the same states."""
    big = tiny_llama(50, hidden=32, layers=2, seed=0)
    with torch.no_grad():
        big.model.embed_tokens.weight.mul_(1e9)  # states far past float16's 65504
    with pytest.raises(ValueError, match=r"beyond float16's range: set drafter.offline_dtype=bfloat16"):
        write_shards(examples(3), big, [1, 2], tmp_path / "fp16", dtype="float16", progress=False)
    write_shards(examples(3), big, [1, 2], tmp_path / "bf16", dtype="bfloat16", progress=False)
    assert torch.isfinite(ShardReader(tmp_path / "bf16")[0]["hidden"].float()).all()
