"""Hidden-state capture: layer-index convention, offline shards equal the online computation, and the same cache
read from an engine's hs_{i}.safetensors files."""

import json

import pytest
import torch

from helpers import engine_states, tiny_llama
from traffic.records import Example
from safetensors.torch import save_file
from train.hidden_states import (ShardReader, bytes_per_token, capture, default_layers, estimate_bytes,
                                 write_shards, write_shards_from_files)

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


def test_an_engines_files_are_read_into_the_cache_pytorch_would_write(target, tmp_path):
    """drafter.hidden_states=files: hs_{i}.safetensors files in any order, each record found by its token ids (a record
    cut at max_length reads its file's first positions), the last layer through the final norm: the shards PyTorch's
    capture writes, and the manifest names the folder."""
    exs, layers = examples(), [1, 2, LAYERS]
    folder = tmp_path / "hidden_states"
    folder.mkdir()
    for i, e in enumerate(reversed(exs)):  # the files' order is not the records'
        save_file({"hidden_states": engine_states(target, e.input_ids, layers), "token_ids": torch.tensor(e.input_ids)},
                  folder / f"hs_{i}.safetensors")
    cut = [Example(e.id, e.category, e.input_ids[:5], e.loss_mask[:5]) for e in exs]  # trainer.max_length=5
    for name, records in (("whole", exs), ("cut", cut)):
        manifest = write_shards_from_files(records, target, folder, layers, tmp_path / name, dtype="float32",
                                           batch_size=3, shard_tokens=40, progress=False)
        assert json.loads(manifest.read_text())["meta"]["engine"] == f"files {folder.resolve()}"
        reader = ShardReader(tmp_path / name)
        for i, e in enumerate(records):
            torch.testing.assert_close(reader[i]["hidden"], capture(target, torch.tensor([e.input_ids]), None, layers)[0])
            assert reader[i]["input_ids"].tolist() == e.input_ids


def test_files_that_do_not_hold_the_records_are_errors_naming_the_file_or_the_record(target, tmp_path):
    exs, layers = examples(3), [1, 2, LAYERS]
    folder = tmp_path / "hs"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match="no hs_\\*.safetensors files"):
        write_shards_from_files(exs, target, folder, layers, tmp_path / "out", progress=False)
    for i, e in enumerate(exs[:2]):
        save_file({"hidden_states": engine_states(target, e.input_ids, layers), "token_ids": torch.tensor(e.input_ids)},
                  folder / f"hs_{i}.safetensors")
    with pytest.raises(ValueError, match="token ids of 1 of the 3 training records \\(first: '2'\\)"):
        write_shards_from_files(exs, target, folder, layers, tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match=r"hs_0.safetensors: hidden_states of shape \(\d+, 3, 32\); this target and "
                                         r"layers \[1, 2, 3, 4\] take \(T, 4, 32\)"):
        write_shards_from_files(exs[:2], target, folder, [1, 2, 3, LAYERS], tmp_path / "other", progress=False)
    (folder / "hs_1.safetensors.lock").touch()  # the engine still writing it
    with pytest.raises(ValueError, match="hs_1.safetensors: its .lock is still there"):
        write_shards_from_files(exs[:2], target, folder, layers, tmp_path / "out", progress=False)
    (folder / "hs_1.safetensors.lock").unlink()
    whole = (folder / "hs_1.safetensors").read_bytes()
    (folder / "hs_1.safetensors").write_bytes(whole[: len(whole) // 2])  # a copy cut short
    with pytest.raises(ValueError, match="hs_1.safetensors: not a whole safetensors file"):
        write_shards_from_files(exs[:2], target, folder, layers, tmp_path / "out", progress=False)
