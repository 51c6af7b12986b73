"""Start-up across ranks that fails fast: one rank's start-up error ends every rank within seconds,
with that rank's message, instead of leaving the others in the rendezvous until its timeout.

Under srun (or any launcher that only sets MASTER_ADDR/MASTER_PORT) rank 0 hosts a TCPStore and
every rank checks in there before the process group is made; a rank that fails before it joins
posts its message to the store (`post_startup_error`), and the ranks waiting read it and stop. Only
a rank that cannot reach the store at all leaves the others to the rendezvous timeout
(job.collective_timeout_s), which stays long enough for thousands of ranks to start. torchrun
needs none of this: its agent ends every worker as soon as one exits.
"""

import datetime
import logging
import os
import time

import torch.distributed as dist

from trillion.errors import ConfigError, RunAborted

log = logging.getLogger("trillion")
ARRIVED, FAILED, SEEN = "trillion/arrived", "trillion/startup_error", "trillion/error_seen"
POLL_S, LINGER_S, POST_TIMEOUT_S = 0.2, 20.0, 30.0
_store = None  # this process's connection, once it has one


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def join(rank: int, world_size: int, addr: str, port: int, timeout_s: float):
    """Check in at the rendezvous; returns the store for init_process_group once all ranks have, or
    raises the error another rank posted (ConfigError for a setting, RunAborted otherwise)."""
    global _store
    try:
        _store = dist.TCPStore(
            addr,
            port,
            world_size=None,
            is_master=rank == 0,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as error:  # rank 0 never came up, or its port is taken
        raise RunAborted(
            f"Rank {rank} of {world_size}: cannot {'host' if rank == 0 else 'reach'} the rendezvous at "
            f"{addr}:{port} ({str(error).splitlines()[0]}). Rank 0's log says why it did not start; if the "
            "port is taken by another job on the node, set MASTER_PORT to a free one."
        ) from None
    _store.add(ARRIVED, 1)
    deadline = time.monotonic() + timeout_s
    while True:
        _raise_posted(rank, world_size)
        arrived = _store.add(ARRIVED, 0)
        if arrived >= world_size:
            return _store
        if time.monotonic() > deadline:
            raise RunAborted(
                f"Rank {rank} of {world_size}: only {arrived} ranks reached the rendezvous at {addr}:{port} "
                f"within job.collective_timeout_s={timeout_s:g} s; the others' logs say why (or they never "
                "started: check the task count of the launch)."
            )
        time.sleep(POLL_S)


def _raise_posted(rank: int, world_size: int) -> None:
    if not _store.check([FAILED]):
        return
    status, _, message = _store.get(FAILED).decode().partition(" ")
    _store.add(SEEN, 1)
    if rank == 0:  # the others read the message from this process's store: stay until they have
        _linger(world_size)
    error = ConfigError if status == "2" else RunAborted
    raise error(f"Stopping rank {rank}: another rank failed at start. {message}")


def _linger(readers: int) -> None:
    deadline = time.monotonic() + LINGER_S
    while _store.add(SEEN, 0) < readers and time.monotonic() < deadline:
        time.sleep(POLL_S)


def post_startup_error(message: str, status: int) -> None:
    """Tell the other ranks why this one stops (best effort; a no-op in one process, under torchrun or
    once the process group exists, where a lost rank ends the others' collectives)."""
    if dist.is_initialized() or under_torchrun():
        return
    env = _launch_variables()
    if env is None:
        return
    rank, world_size, addr, port = env
    global _store
    try:
        if _store is None:
            _store = dist.TCPStore(
                addr,
                port,
                world_size=None,
                is_master=rank == 0,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=POST_TIMEOUT_S),
            )
        _store.compare_set(FAILED, "", f"{status} Rank {rank} of {world_size}: {message}")  # the first error wins
        _store.add(SEEN, 1)
        if rank == 0:
            _linger(world_size)
    except (RuntimeError, OSError) as error:  # the rendezvous host is gone or unreachable
        log.warning(
            "could not tell the other ranks why rank %d stops (%s); they stop at the rendezvous timeout", rank, error
        )


def _launch_variables() -> tuple[int, int, str, int] | None:
    from trillion.trainer.launch.slurm import torch_env_from_slurm

    environ = dict(os.environ)
    if "RANK" not in environ and "SLURM_PROCID" in environ:
        try:
            environ.update(torch_env_from_slurm(environ))
        except ConfigError:
            return None
    try:
        rank, world_size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        addr, port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
    except (KeyError, ValueError):
        return None
    return (rank, world_size, addr, port) if world_size > 1 and addr else None
