"""Run a function on N local processes joined in a gloo process group (CPU), for parity tests.

`run_ranks(fn, world_size, *args)` spawns fresh interpreters (the `spawn` start method, so no
state leaks from pytest), rendezvous through a FileStore in a temporary folder, runs
`fn(rank, world_size, *args)` on each, and raises with the failing rank's traceback. Each rank
uses one intra-op thread: the machine has few cores and results must not depend on threading.
"""
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn, world_size: int, store_path: str, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args) -> None:
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_entry, args=(fn, world_size, os.path.join(folder, "store"), args), nprocs=world_size, join=True)
