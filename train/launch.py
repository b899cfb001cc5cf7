"""One run directory for every process of a launch, and waits on rank 0 that no collective times out.

`hydra.run.dir` (conf/train.yaml) is `runs/train/<kind>/${name}`, and `name` defaults to `${run_stamp:}`, the
launch's start time. Hydra resolves it in each process before any process group exists, so under `accelerate
launch` or `torchrun` each rank would read its own clock, and ranks started on either side of a second boundary
would write, and look for checkpoints, in different directories. `run_stamp` gives every rank rank 0's clock:
rank 0 writes its stamp into the store that torchrun's agent hosts for the launch (the one `init_process_group`
meets in later), and the others read it there. A restart by the launcher (`--max-restarts`) finds the stamp
already there and keeps the directory, so `trainer.resume=auto` continues in it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from datetime import timedelta
from typing import Callable, Iterator

from omegaconf import OmegaConf

log = logging.getLogger(__name__)

STAMP_FORMAT = "%Y-%m-%d_%H-%M-%S"
STAMP_KEY = "draftsmith/run_stamp"


@functools.cache
def run_stamp() -> str:
    """This launch's start time (STAMP_FORMAT), the same in every process of a distributed launch."""
    stamp = time.strftime(STAMP_FORMAT)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return stamp
    rank = int(os.environ.get("RANK", "0"))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        # Another launcher (srun, mpirun) hosts no store the ranks can meet in before the process group exists.
        raise ValueError(f"rank {rank} of {world} was started without torchrun's store (accelerate launch and torchrun "
                         f"host one), so the processes cannot agree on a time-stamped run directory: name the run, "
                         f"name=<run name>, and every process writes to runs/train/<kind>/<run name>")
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(minutes=5))
    if rank == 0 and not store.check([STAMP_KEY]):  # a restarted launch keeps the stamp of its first attempt
        store.set(STAMP_KEY, stamp)
    return store.get(STAMP_KEY).decode()


def register_resolver() -> None:
    """`${run_stamp:}` for the configs (conf/train.yaml)."""
    if not OmegaConf.has_resolver("run_stamp"):
        OmegaConf.register_new_resolver("run_stamp", run_stamp)


@contextlib.contextmanager
def rank0_first(acc, done: Callable[[], bool], what: str) -> Iterator[None]:
    """Rank 0 runs the block first (writing a cache on the shared disk that `done()` then finds); the other ranks
    wait for `done()` by polling the disk, then run the block (which finds the cache), and all meet in one barrier.

    Accelerate's `main_process_first` waits in a barrier instead, which the process group's timeout ends (NCCL's
    is 10 minutes): regenerating thousands of answers with an 8B target, or its features, takes hours. If rank 0
    dies meanwhile, the launcher (torchrun's agent) stops the others."""
    if acc.num_processes > 1 and not acc.is_main_process:
        started = last = time.monotonic()
        while not done():
            time.sleep(1.0)
            if time.monotonic() - last > 600:
                last = time.monotonic()
                log.info("rank %d: waiting for rank 0 to write %s (%.0f min so far)", acc.process_index, what,
                         (last - started) / 60)
    yield
    acc.wait_for_everyone()
