"""A training run's data, as the recipe sets it up (train/recipe.py `Recipe._setup_data`): the records of
`data.path` split into the training set and the held-out examples that choose the best checkpoint
(`split_records`), each split prepared once, its answers regenerated and tokenized, into the data cache
(`prepare_splits`), the order an epoch reads them in (`epoch_order`, `EpochOrders`), batches of its tokenized records
(`records_batch`), and the warnings about prompts the drafter never trains on (`warn_long_prompts`).

The held-out examples that choose the best checkpoint are `trainer.eval_examples` records of the training traffic
(the last ones, or as many of each category: trainer.heldout): never trained on, and never the prompts the final
evaluation measures (those come from the held-out traffic), so the reported numbers are not selected on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from drafters.sampling import Sampling
from eval.run import reading, resolve_data, target_source, tokenize_prompts
from traffic.records import LoadSummary, Record, load_records
from train.launch import rank0_first
from train.prepare import held_out_indices, prepare
from train.regenerate import answer_writer

log = logging.getLogger(__name__)


@dataclass
class Split:
    """The records of a run's data file as training reads them."""

    train: list[Record]  # the training records, at most data.max_records of them
    held: list[Record]  # the held-out examples that choose the best checkpoint
    summary: LoadSummary  # what loading the file skipped or defaulted
    trained_on: dict  # what the report says the drafter trained on


def split_records(cfg: DictConfig, warn: bool = True) -> Split:
    """The records of `cfg.data.path`, split into the training set and the held-out examples (the module docstring);
    with `warn`, a warning where the held-out examples hold no record of a category the training set has."""
    records, summary = load_records(resolve_data(cfg.data.path), **reading(cfg.data))
    log.info("%s: %s", cfg.data.path, summary)
    held, how = cfg.trainer.eval_examples, cfg.trainer.heldout
    if len(records) <= held:
        raise ValueError(f"{cfg.data.path}: {len(records)} usable records, but training holds "
                         f"{'the last ' if how == 'last' else ''}trainer.eval_examples={held} out to choose the "
                         f"best checkpoint; lower trainer.eval_examples or add records")
    held_idx = held_out_indices([r.category for r in records], held, how)
    held_records, held_set = [records[i] for i in held_idx], set(held_idx)
    train_records = [r for i, r in enumerate(records) if i not in held_set]
    n_train = len(train_records)
    if cfg.data.max_records is not None:
        n_train = min(n_train, cfg.data.max_records)
    trained_on = {"path": cfg.data.path, "records": n_train, "checkpoint_chosen_on": held,
                  "categories": dict(Counter(r.category for r in train_records[:n_train]))}
    missing = sorted(set(trained_on["categories"]) - {r.category for r in held_records})
    if missing and warn:
        # The checkpoint is then chosen on traffic unlike part of what the drafter serves.
        fix = ("order the file so its end mixes every category, or set trainer.heldout=per_category"
               if how == "last" else f"raise trainer.eval_examples to at least {len(set(r.category for r in records))}")
        msg = (f"the {held} records that choose the best checkpoint (trainer.heldout={how} of {cfg.data.path}) "
               f"hold no {', '.join(missing)} records; {fix}")
        log.warning(msg)
        print(f"warning: {msg}")
    return Split(train_records[:n_train], held_records, summary, trained_on)


def split_directory(cfg: DictConfig, name: str, chosen: list, which: list) -> Path:
    """Where under `data_cache` the split `name` of the records `chosen` is prepared: keyed by the records' content,
    not their path (a file edited in place is prepared anew), the target, the answer settings and `which`."""
    content = [[r.id, r.category, r.messages] + ([r.tools] if r.tools else []) for r in chosen]
    regen = OmegaConf.to_container(cfg.regenerate, resolve=True)
    # llama-server's threads split each product by rows, so they do not change its answers: not in the key.
    answers_from = {**regen, "threads": None}
    key = zlib.crc32(json.dumps([target_source(cfg.target), content, answers_from, *which]).encode())
    return Path(cfg.data_cache) / f"{cfg.target.name}-{name}-{key:08x}"


def prepare_splits(cfg: DictConfig, split: Split, target, tokenizer, acc, progress: bool) -> dict[str, Path]:
    """The directory under `data_cache` of each split ("train", "eval"), prepared there (`train/prepare.py` `prepare`:
    the target's answers where `regenerate.enabled`, tokenized) unless an earlier run did: rank 0 first, the other
    ranks of `acc` (an Accelerator) then read what it wrote."""
    regen = OmegaConf.to_container(cfg.regenerate, resolve=True)
    sampling = Sampling(regen["temperature"], regen["top_k"], regen["top_p"])
    splits = {"train": (split.train, [len(split.train)]),
              "eval": (split.held, [cfg.trainer.heldout, cfg.trainer.eval_examples])}
    data_dirs = {}
    for name, (chosen, which) in splits.items():
        data_dirs[name] = directory = split_directory(cfg, name, chosen, which)
        with rank0_first(acc, (directory / "prepare.json").exists, f"the {name} set's answers"):
            if not (directory / "prepare.json").exists():
                with answer_writer(regen, tokenizer, target_source(cfg.target), chosen, work=directory,
                                   max_new_tokens=regen["max_new_tokens"]) \
                        if regen["enabled"] else contextlib.nullcontext() as writer:
                    prepare(chosen, target, tokenizer, directory, sampling=sampling,
                            regenerate_responses=regen["enabled"], max_new_tokens=regen["max_new_tokens"],
                            on_bad_record=cfg.data.on_bad_record, progress=progress, writer=writer)
    return data_dirs


def warn_long_prompts(cfg: DictConfig, traffic, tokenizer) -> None:
    """Warn when the prompts the final evaluation serves from `traffic` (with the tokens it generates) reach past the
    windows the drafter trains on, `trainer.max_length`: it never trained at those positions, and heads keep
    less of their acceptance there (the report's τ by prompt length shows how much)."""
    e, window = cfg.evaluate, cfg.trainer.max_length
    prompts = tokenize_prompts(traffic, tokenizer, device=torch.device("cpu"),
                               max_per_category=e.prompts_per_category, on_bad_record=cfg.data.on_bad_record)
    reach = {c: [p.numel() + e.max_new_tokens for p in ps] for c, ps in prompts.items()}
    past = {c: n for c, ns in reach.items() if (n := sum(m > window for m in ns))}
    longest = max((n for ns in reach.values() for n in ns), default=0)
    if past:
        msg = (f"{sum(past.values())} of the {sum(map(len, reach.values()))} prompts the final evaluation serves ("
               + ", ".join(f"{c}: {n} of {len(reach[c])}" for c, n in sorted(past.items()))
               + f") reach past trainer.max_length={window} tokens with their {e.max_new_tokens} new ones (the "
                 f"longest to {longest}): the drafter never trains that far into a sequence, and its acceptance "
                 f"there is likely lower; trainer.max_length={longest} trains on windows that long")
        log.warning(msg)
        print(f"warning: {msg}")


# Global batches whose records are sorted by length together when trainer.group_by_length is on.
GROUP_BATCHES = 16


def epoch_order(n: int, seed: int, epoch: int, lengths: torch.Tensor | None = None,
                global_batch: int = 1) -> torch.Tensor:
    """The order `epoch` reads the n training records in: a permutation seeded by (seed, epoch), so a resumed run
    reads what an uninterrupted one would.

    With `lengths` (each record's tokens as trained, trainer.group_by_length) the permutation is regrouped so that a
    global batch holds records of about one length and pads less: each run of GROUP_BATCHES global batches of it is
    sorted by length and cut into batches, which are then put in a seeded order (Hugging Face's group_by_length
    does likewise). Steps read global_batch records from position step * global_batch on, so epoch e's first
    (-e * n) mod global_batch records complete the batch the previous epoch began; the batches are cut after them,
    and an epoch's last, partial batch stays last, for the next epoch to complete."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(n, generator=generator)
    if lengths is None:
        return order
    head = min((-epoch * n) % global_batch, n)
    pieces = [order[:head]]
    rest = order[head:]
    for start in range(0, len(rest), global_batch * GROUP_BATCHES):
        run = rest[start:start + global_batch * GROUP_BATCHES]
        batches = list(run[torch.argsort(lengths[run], descending=True, stable=True)].split(global_batch))
        last = [batches.pop()] if len(batches[-1]) < global_batch else []
        pieces += [batches[i] for i in torch.randperm(len(batches), generator=generator)] + last
    return torch.cat(pieces)


class EpochOrders:
    """Position p of the run's stream of training records (step s reads positions s * global_batch onwards): record
    `epoch_order(...)[p mod n]` of epoch p div n, the current epoch's order kept."""

    def __init__(self, n: int, seed: int, global_batch: int, lengths: torch.Tensor | None = None) -> None:
        self.n, self.seed, self.global_batch, self.lengths = n, seed, global_batch, lengths
        self.epoch, self.order = -1, None

    def __getitem__(self, position: int) -> int:
        epoch, offset = divmod(position, self.n)
        if epoch != self.epoch:
            self.epoch, self.order = epoch, epoch_order(self.n, self.seed, epoch, self.lengths, self.global_batch)
        return int(self.order[offset])


def record_lengths(records, limit: int) -> torch.Tensor:
    """Each tokenized record's tokens as the steps see them (cut at `limit`), for trainer.group_by_length."""
    return torch.tensor([min(len(ids), limit) for rows in records.iter(batch_size=1024) for ids in rows["input_ids"]])


def pad_rows(rows: list[list[int]], value: int, left: bool = False) -> torch.Tensor:
    """Token rows as one (B, T) tensor, padded with `value` on the right (or the left) to the longest."""
    width = max(len(r) for r in rows)
    return torch.tensor([([value] * (width - len(r)) + r) if left else (r + [value] * (width - len(r))) for r in rows])


def records_batch(rows, pad_id: int, max_length: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Tokenized records (input_ids, loss_mask), cut at max_length and right-padded: input_ids,
    attention_mask and loss_mask (B, T) on `device`."""
    return {"input_ids": pad_rows([r["input_ids"][:max_length] for r in rows], pad_id).to(device),
            "attention_mask": pad_rows([[1] * min(len(r["input_ids"]), max_length) for r in rows], 0).to(device),
            "loss_mask": pad_rows([r["loss_mask"][:max_length] for r in rows], 0).to(device)}
