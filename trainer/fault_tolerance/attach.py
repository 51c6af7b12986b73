"""Fault tolerance attached to a run that is set up: the group joins the others (after resuming from its own
checkpoint), and the loop's seams (RunHooks.step and .iteration, the step hooks, the checkpoint manager's
`elected`) take the group's part. None of it exists without fault_tolerance.enabled."""

import contextlib
import dataclasses

from trillion.trainer.checkpoint.state import RNGStates, RunStates, TrainingState
from trillion.trainer.config.schema import Config
from trillion.trainer.fault_tolerance.recovery import LiveState
from trillion.trainer.fault_tolerance.replicas import ReplicaGroups
from trillion.trainer.fault_tolerance.semi_sync import SemiSynchronous
from trillion.trainer.fault_tolerance.step import SynchronousStep


class FaultTolerantRun:
    """The group's side of the loop: `wrap` puts it around RunHooks' step and iteration (the commit vote in
    each step, the quorum before each iteration), `step_hooks` adds the group's figures to the logged records."""

    def __init__(self, groups: ReplicaGroups, semi: SemiSynchronous | None):
        self.groups, self.semi = groups, semi
        self.step_hooks = (groups,)

    def wrap(self, hooks):
        """RunHooks (trillion.trainer.set_up) with the group's part around its own step and iteration."""
        return dataclasses.replace(hooks, step=self.step(hooks.step), iteration=self.iteration(hooks.iteration))

    def step(self, inner):
        return inner if self.semi else SynchronousStep(self.groups, inner)

    def iteration(self, inner):
        if self.semi:
            return inner

        @contextlib.contextmanager
        def quorum_then_inner(step: int):
            with self.groups.iteration(step), inner(step):
                yield

        return quorum_then_inner

    def close(self) -> None:
        if self.semi is not None:
            self.semi.close()
        self.groups.close()


def join_replica_groups(config: Config, rank: int, world_size: int, states: RunStates, checkpointer):
    """This group among the others, or None without fault tolerance. Synchronous groups take the first quorum
    here (a group behind the others recovers live before its first step) and only the first group alive writes
    checkpoints; semi-synchronous ones each write their own and meet first after sync_steps steps."""
    cfg = config.fault_tolerance
    if not cfg.enabled:
        return None
    model, optimizer = states.model_parts[0], states.optimizers[0]
    synchronous = cfg.semi_sync_method == "none"
    progress = (TrainingState(states.counters, states.scheduler, states.loader), RNGStates(states.device))
    live = LiveState(model, optimizer, *(progress if synchronous else (None, None)))
    groups = ReplicaGroups(cfg, rank, world_size, states.device, live)
    if not synchronous:  # the manager counts meetings: a group resumed from an older checkpoint is behind
        groups.manager.load_state_dict({"step": states.counters.step // cfg.sync_steps, "batches_committed": 0})
        return FaultTolerantRun(groups, SemiSynchronous(cfg, groups.manager, model, optimizer))
    groups.join(states.counters.step)
    checkpointer.elected = groups.elected
    return FaultTolerantRun(groups, None)
