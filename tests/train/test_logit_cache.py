"""Cached top-k target log-probabilities: read back equal to the online computation, laid out on the
batch grid the loss reads."""

import pytest
import torch

from helpers import tiny_llama
from traffic.records import Example
from train.logit_cache import LogitCache, bytes_per_token, write_logit_cache

VOCAB = 50


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, hidden=32, layers=2, seed=0)


def examples(n=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 20, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        out.append(Example(str(i), "c", ids, [int(j >= length // 2) for j in range(length)]))
    return out


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_cache_reads_back_the_targets_top_k(target, tmp_path, temperature):
    exs = examples()
    write_logit_cache(exs, target, tmp_path, top_k=5, temperature=temperature, batch_size=4, progress=False)
    cache = LogitCache(tmp_path)
    assert len(cache) == len(exs) and cache.meta == {"top_k": 5, "temperature": temperature, "vocab_size": VOCAB}
    for i, e in enumerate(exs):
        item = cache[i]
        with torch.no_grad():  # unpadded, one example
            log_p = torch.log_softmax(target(input_ids=torch.tensor([e.input_ids])).logits[0] / temperature, -1)
        positions = [t for t in range(len(e.input_ids) - 1) if e.loss_mask[t + 1]]
        values, indices = log_p[positions].topk(5, -1)
        assert item["top_idx"].tolist() == indices.tolist()
        torch.testing.assert_close(item["top_logp"], values, rtol=1e-5, atol=1e-5)
    # Dense layout: row r, position t holds the entry of the t-th predicted position of its example.
    logp, idx = cache.dense([3, 0], width=max(len(exs[3].input_ids), len(exs[0].input_ids)))
    for row, i in enumerate([3, 0]):
        positions = [t for t in range(len(exs[i].input_ids) - 1) if exs[i].loss_mask[t + 1]]
        assert idx[row, positions].tolist() == cache[i]["top_idx"].tolist()
        others = [t for t in range(logp.shape[1]) if t not in positions]
        assert (logp[row, others] == 0).all()


def test_bad_settings_and_size_cap(target, tmp_path):
    exs = examples()
    with pytest.raises(ValueError, match="cached_top_k must be in 1..50"):
        write_logit_cache(exs, target, tmp_path, top_k=51, temperature=1.0, progress=False)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        write_logit_cache(exs, target, tmp_path, top_k=5, temperature=0.0, progress=False)
    with pytest.raises(ValueError, match="over the cap"):
        write_logit_cache(exs, target, tmp_path, top_k=5, temperature=1.0, max_bytes=10, progress=False)
    assert bytes_per_token(64) == 64 * 8 + 5
