"""train/data.py: where a split's answers are prepared, and what makes them be prepared anew; the order an epoch reads
the training records in."""

from __future__ import annotations

from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from traffic.records import Record
from train.data import GROUP_BATCHES, EpochOrders, epoch_order, split_directory

CONF = Path(__file__).resolve().parents[2] / "conf"


def _directory(records: list[Record], *overrides: str) -> Path:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["regenerate.engine=llamacpp", *overrides])
    return split_directory(cfg, "train", records, [len(records)])


def test_the_answers_are_keyed_by_what_writes_them_and_not_by_the_servers_threads():
    records = [Record(messages=[{"role": "user", "content": f"question {i}"}], category="chat", id=f"r{i}",
                      source="train.jsonl", line=i + 1) for i in range(3)]
    first = _directory(records)
    assert first.parent == Path("runs/prepared") and first.name.split("-")[1] == "train"
    # An interrupted run continued with fewer llama-server threads finds the answers it has already written.
    assert _directory(records, "regenerate.threads=1") == first
    # What changes an answer prepares it anew: the settings, the records' content, the target.
    assert _directory(records, "regenerate.max_new_tokens=7") != first
    assert _directory(records, "regenerate.parallel=1") != first
    edited = [*records[:2], Record(messages=[{"role": "user", "content": "another"}], category="chat", id="r2",
                                   source="train.jsonl", line=3)]
    assert _directory(edited) != first
    assert _directory(records, "target=smollm2") != first


def _windows(n: int, lengths: torch.Tensor | None, global_batch: int, steps: int, seed: int = 0) -> list[list[int]]:
    """The records each step reads, as the recipe takes them (`EpochOrders`): global_batch positions a step."""
    order = EpochOrders(n, seed, global_batch, lengths)
    return [[order[pos] for pos in range(step * global_batch, (step + 1) * global_batch)] for step in range(steps)]


def test_the_stream_of_records_is_each_epochs_order_across_the_epochs_ends():
    n, global_batch = 10, 4
    lengths = torch.arange(n)
    windows = _windows(n, lengths, global_batch, steps=8)  # 32 positions: 3 epochs and a bit
    stream = [i for w in windows for i in w]
    assert stream == [int(i) for e in range(4) for i in epoch_order(n, 0, e, lengths, global_batch)][:32]


def test_without_lengths_an_epoch_is_the_seeded_permutation_runs_have_always_read():
    # The order runs trained in before group_by_length existed: the same records, the same steps.
    for epoch in range(3):
        expected = torch.randperm(50, generator=torch.Generator().manual_seed(7 * 100_003 + epoch))
        assert torch.equal(epoch_order(50, 7, epoch), expected)


def test_grouped_by_length_each_epoch_reads_every_record_once_and_each_batch_pads_less():
    n, global_batch = 1_003, 8  # not a multiple: batches straddle the epochs' ends
    lengths = torch.randint(20, 512, (n,), generator=torch.Generator().manual_seed(1))
    for epoch in range(4):
        order = epoch_order(n, 0, epoch, lengths, global_batch)
        assert sorted(order.tolist()) == list(range(n))
        assert torch.equal(order, epoch_order(n, 0, epoch, lengths, global_batch))  # a function of the epoch: resume
    steps = n  # 8 whole epochs

    def padded(windows):
        return sum(len(w) * max(int(lengths[i]) for i in w) for w in windows)

    plain, grouped = _windows(n, None, global_batch, steps), _windows(n, lengths, global_batch, steps)
    assert sum(int(lengths[i]) for w in grouped for i in w) == sum(int(lengths[i]) for w in plain for i in w)  # same records
    # Random batches of 8 pad to about 8/9 of the longest possible; grouped ones to barely more than their own.
    real = sum(int(lengths[i]) for w in grouped for i in w)
    assert padded(grouped) < 1.1 * real < 0.75 * padded(plain)
    # Within a run of GROUP_BATCHES batches, a batch is a stretch of the run sorted by length.
    spreads = [max(int(lengths[i]) for i in w) - min(int(lengths[i]) for i in w) for w in grouped]
    assert sorted(spreads)[len(spreads) // 2] < (512 - 20) / GROUP_BATCHES


def test_grouped_batches_change_between_epochs_and_seeds():
    n, global_batch = 640, 4
    lengths = torch.randint(20, 512, (n,), generator=torch.Generator().manual_seed(2))
    batches = lambda seed, epoch: {tuple(sorted(b.tolist()))
                                   for b in epoch_order(n, seed, epoch, lengths, global_batch).split(global_batch)}
    assert batches(0, 0) != batches(0, 1) and batches(0, 0) != batches(1, 0)
