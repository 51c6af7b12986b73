"""Run a function on N local processes joined in a gloo process group (CPU), for parity tests.

`run_ranks(fn, world_size, *args)` spawns fresh interpreters (the `spawn` start method, so no
state leaks from pytest), rendezvous through a FileStore in a temporary folder, runs
`fn(rank, world_size, *args)` on each, and raises with the failing rank's traceback. Each rank
uses one intra-op thread: the machine has few cores and results must not depend on threading.
`fn` must be importable by name (a module-level function of a module under `tests`): the children
get pytest's sys.path, the repository root on it. A rank that runs the trainer calls `as_launched`
first, so that `train()` joins the group the harness already made.
"""

import glob
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException


def as_launched(rank: int, world_size: int) -> None:
    """What torchrun would have set: train() then joins the group the harness already made."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))


def _entry(rank: int, fn, world_size: int, store_path: str, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:
        with open(f"{store_path}.rank{rank:03d}.error", "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    # Every rank passed the barrier, so every assertion has run. Leave without the interpreter's
    # finalization: there gloo's C++ threads can still be torn down beside Python's, and a rare
    # "terminate called without an active exception" (SIGABRT) made spawn fail a test that had passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, *args) -> None:
    """Raises AssertionError with every failed rank's traceback, the root cause (a rank that did not
    merely lose its peers) first."""
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        try:
            mp.spawn(_entry, args=(fn, world_size, store, args), nprocs=world_size, join=True)
        except ProcessException as error:
            reports = [open(path).read() for path in sorted(glob.glob(f"{store}.rank*.error"))]
            reports.sort(key=lambda text: "Connection closed by peer" in text or "Connection reset" in text)
            raise AssertionError("\n".join(reports) or str(error)) from None
