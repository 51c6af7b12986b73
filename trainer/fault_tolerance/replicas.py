"""One replica group's side of fault tolerance: torchft's Manager (its quorum through the Lighthouse, the
process group between the groups, the commit vote, live recovery), joined once the group has resumed from
its own checkpoint if it has one, and asked for a quorum at the start of every iteration.

Synchronous groups (semi_sync_method none) vote on every step (step.py); semi-synchronous ones meet every
sync_steps steps through torchft's DiLoCo or LocalSGD (semi_sync.py). Every wait is bounded
(fault_tolerance.timeout_s, process_group_timeout_ms): an unreachable Lighthouse or a lost quorum ends the
group with exit 1 instead of hanging it."""

import contextlib
import logging
import os
import socket
import time
from datetime import timedelta

import torch
from torch.distributed import ReduceOp

from trillion.errors import RunAborted
from trillion.models.step_hooks import StepHooks
from trillion.trainer.config.fault_sections import FaultTolerance
from trillion.trainer.fault_tolerance.checks import LIGHTHOUSE_COMMAND, LIGHTHOUSE_ENV
from trillion.trainer.fault_tolerance.recovery import LiveState

log = logging.getLogger("trillion")


def reach_lighthouse(address: str, timeout_s: float) -> None:
    """A bounded connection to the Lighthouse, on every rank of the group before anything waits on it."""
    from torchft._torchft import LighthouseClient

    try:
        LighthouseClient(address, connect_timeout=timedelta(seconds=timeout_s))
    except RuntimeError as error:
        raise RunAborted(
            f"The torchft Lighthouse at {LIGHTHOUSE_ENV}={address} did not answer within fault_tolerance.timeout_s="
            f"{timeout_s:g} s ({str(error).split(':')[-1].strip()}). Start it (`{LIGHTHOUSE_COMMAND}`) on a host every "
            f"group reaches, and point {LIGHTHOUSE_ENV} at it (http://HOST:29510)."
        ) from None


class ReplicaGroups(StepHooks):
    """The Manager of this group (`cfg.replica_id` of `cfg.group_size`), over the group's `world_size` ranks;
    `live` is what a restarted peer copies from it. As a StepHooks it adds the step's groups to the logged
    record: `replica_groups` (the ids that trained it) and `outer_steps` (commits between groups so far)."""

    def __init__(self, cfg: FaultTolerance, rank: int, world_size: int, device: torch.device, live: LiveState):
        import torchft

        self.cfg, self.live, self.rank = cfg, live, rank
        self.address = os.environ[LIGHTHOUSE_ENV]
        reach_lighthouse(self.address, cfg.timeout_s)
        timeout = timedelta(seconds=cfg.timeout_s)
        nccl = cfg.process_group == "nccl" or (cfg.process_group == "auto" and device.type == "cuda")
        pg_timeout = timedelta(milliseconds=cfg.process_group_timeout_ms)
        pg = torchft.ProcessGroupNCCL(timeout=pg_timeout) if nccl else torchft.ProcessGroupGloo(timeout=pg_timeout)
        self.store = None  # the group's own store when no launcher made one (a group of one process)
        if world_size == 1:
            from torch.distributed import TCPStore

            self.store = TCPStore(_store_host(), 0, is_master=True, wait_for_workers=False, timeout=timeout)
        store_addr = _store_host() if self.store else os.environ["MASTER_ADDR"]
        store_port = self.store.port if self.store else int(os.environ["MASTER_PORT"])
        self.manager = torchft.Manager(
            pg=pg,
            load_state_dict=live.load_state_dict,
            state_dict=live.state_dict,
            min_replica_size=cfg.min_replica_size,
            use_async_quorum=False,  # recovery happens before the step, which then starts from the healed state
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=rank,
            world_size=world_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=self.address,
            replica_id=f"trillion_{cfg.replica_id}",
            init_sync=False,  # every group draws the same initial weights from job.seed
        )
        self.fresh = False  # a quorum was taken for the next step (the join's) and not used yet
        self.groups: list[int] = []

    def join(self, step: int) -> None:
        """The first quorum, once the group stands at `step` (0 or its own checkpoint's): a group behind the
        others copies a healthy one's state live here, before its first step."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self.live.snapshot()
        start = time.perf_counter()
        self.quorum()
        self.fresh = True
        reached = self.manager.current_step()
        if reached != step:
            log.info(
                "replica group %d recovered live from a healthy group: step %d (was %d) in %.2fs; %d groups training",
                self.cfg.replica_id,
                reached,
                step,
                time.perf_counter() - start,
                self.manager.num_participants(),
            )

    def quorum(self) -> None:
        try:
            self.manager.start_quorum(timeout=timedelta(seconds=self.cfg.timeout_s))
        except Exception as error:  # torchft raises what the quorum's RPC raised
            raise RunAborted(
                f"Replica group {self.cfg.replica_id}: no quorum of the replica groups within fault_tolerance."
                f"timeout_s={self.cfg.timeout_s:g} s through the Lighthouse at {self.address} ({error}). Check that it "
                "still runs; this group's newest checkpoint is intact and the same command rejoins."
            ) from None

    @contextlib.contextmanager
    def iteration(self, step: int):
        """Around each loop iteration: the step's quorum before its batch is read (the join's for the first)."""
        if self.fresh:
            self.fresh = False
        else:
            self.live.snapshot()
            before = self.manager.current_step()
            self.quorum()
            if self.manager.current_step() != before:
                raise RunAborted(
                    f"Replica group {self.cfg.replica_id} fell behind the others at step {step} (a step the others "
                    f"committed failed here) and took their state live; restart it (the same command), and it "
                    "rejoins where they are."
                )
        yield

    def members(self) -> list[int]:
        """The ids of the groups in this attempt's quorum, agreed by one small all-reduce."""
        present = torch.zeros(self.cfg.group_size, dtype=torch.int64)
        present[self.cfg.replica_id] = 1
        self.manager.allreduce(present, reduce_op=ReduceOp.SUM).wait()
        return [i for i, n in enumerate(present.tolist()) if n > 0]

    def elected(self) -> bool:
        """Whether this group writes the checkpoints: the first of the groups alive (one copy is enough)."""
        rank = self.manager.participating_rank()
        return rank == 0 if rank is not None else self.cfg.replica_id == 0

    def statistics(self) -> dict:
        return {**({"replica_groups": self.groups} if self.groups else {}), "outer_steps": self.manager.current_step()}

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def _store_host() -> str:
    """Where a one-process group's store is reached from the other groups: MASTER_ADDR if set, else this host."""
    return os.environ.get("MASTER_ADDR") or socket.gethostname()
