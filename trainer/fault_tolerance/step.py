"""A synchronous step across replica groups, built around the trainer's own step (train_step, or whatever
RunHooks.step holds) through its seams, so the step itself knows nothing of groups:

- `dims` sums over the groups too (AcrossGroups): the step's target tokens and loss cover every group alive,
  so each group's gradient is its share of the mean over all their tokens (the one-process numerics);
- `clip` first sums every gradient shard over the groups alive (torchft's managed all-reduce: rank r of each
  group holds the same shards), clips, then asks the commit vote (`should_commit`: every rank of every group
  alive succeeded);
- `guard` masks the optimizer step of an attempt that did not commit (on the device, as a non-finite step is
  masked, but not counted as one), and the model's step hooks see a discarded attempt as an empty step.

An attempt that does not commit (a group died in it) is retried with the same batch by the groups still alive,
after a new quorum; the step counts once. Data rule: group g always trains the g-th share of each global batch,
so a departed group's share of a step is skipped (the global batch shrinks to the groups alive; the loss is the
mean over the tokens trained, the learning rate unchanged)."""

import itertools
import logging
import time

import torch
from torch.distributed import ReduceOp

from trillion.errors import RunAborted
from trillion.models.step_hooks import StepHooks
from trillion.trainer.fault_tolerance.recovery import local
from trillion.trainer.fault_tolerance.replicas import ReplicaGroups

log = logging.getLogger("trillion")
BUCKET_BYTES = 256 * 2**20  # gradient shards are summed in flat buckets of at most this many bytes


class AcrossGroups:
    """The step's ParallelDims, with `all_reduce_dp` summing over the replica groups alive as well."""

    def __init__(self, dims, manager):
        self._dims, self._manager = dims, manager

    def __getattr__(self, name: str):
        return getattr(self._dims, name)

    def all_reduce_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        self._dims.all_reduce_dp(tensor)
        self._manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        return tensor


def sum_over_groups(manager, params) -> None:
    """Sum every gradient shard in place over the groups alive, in flat buckets (one all-reduce each)."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    buckets, size = [[]], 0
    for grad in grads:
        fits = buckets[-1] and buckets[-1][0].dtype == grad.dtype and size + grad.nbytes <= BUCKET_BYTES
        if buckets[-1] and not fits:
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += grad.nbytes
    pending = []
    for bucket in filter(None, buckets):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        pending.append((manager.allreduce(flat, reduce_op=ReduceOp.SUM), flat, bucket))
    for work, flat, bucket in pending:
        work.wait()
        for grad, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            grad.copy_(part.view_as(grad))


class CommitGate:
    """One attempt's commit vote, standing in for the step's guard (trillion.trainer.resilience.NonFiniteGuard)."""

    def __init__(self, manager, guard):
        self.manager, self.guard, self.committed = manager, guard, False

    def clip(self, inner):
        def summed_then_clipped(params, max_norm, group=None):
            params = list(params)
            sum_over_groups(self.manager, params)
            norm = inner(params, max_norm, group)
            self.committed = self.manager.should_commit()
            return norm

        return summed_then_clipped

    def flag(self, loss: torch.Tensor, grad_norm: torch.Tensor, scaler) -> torch.Tensor:
        if not self.committed:
            return torch.ones((), device=grad_norm.device)  # change nothing; retried, not a non-finite step
        if self.guard is None:
            return torch.zeros((), device=grad_norm.device)
        return self.guard.flag(loss, grad_norm, scaler)


class Discardable(StepHooks):
    """A model part's step hooks; an attempt that did not commit counted nothing (its tallies are zeroed)."""

    def __init__(self, hooks: StepHooks, gate: CommitGate):
        self.hooks, self.gate = hooks, gate

    def before_step(self, token_scale):
        self.hooks.before_step(token_scale)

    def after_step(self, sum_over_ranks):
        self.hooks.after_step(sum_over_ranks if self.gate.committed else torch.Tensor.zero_)

    def statistics(self) -> dict:
        return self.hooks.statistics()


class SynchronousStep:
    """RunHooks.step for a synchronous replica group: `inner` (the trainer's step) attempted until the
    groups alive commit it."""

    def __init__(self, groups: ReplicaGroups, inner):
        self.groups, self.inner = groups, inner

    def __call__(self, *args, clip, step_hooks=()):
        """train_step's arguments: (runner, micro_batches, optimizer, scaler, autocast, max_grad_norm, dims, guard,
        timer); the last three are the seams taken here."""
        head, (dims, guard, timer) = args[:6], args[6:9]
        groups, manager = self.groups, self.groups.manager
        hooks = [h for h in step_hooks if h is not groups]
        start = time.monotonic()
        for attempt in itertools.count(1):
            if attempt > 1:
                groups.quorum()
            if manager.num_participants() < groups.cfg.min_replica_size:
                self._wait_for_groups(start)
                continue
            members = groups.members()
            gate = CommitGate(manager, guard)
            loss, norm = self.inner(
                *head,
                AcrossGroups(dims, manager),
                gate,
                timer,
                clip=gate.clip(clip),
                step_hooks=tuple(Discardable(h, gate) for h in hooks),
            )
            if gate.committed:
                groups.groups = members
                return loss, norm
            log.warning(
                "replica group %d: the step was not committed by every group alive (attempt %d, groups %s: %s); "
                "retrying it with the groups alive",
                groups.cfg.replica_id,
                attempt,
                members,
                manager.errored() or "a group failed",
            )
            if time.monotonic() - start > groups.cfg.timeout_s:
                raise RunAborted(
                    f"Replica group {groups.cfg.replica_id}: no attempt of the step committed within "
                    f"fault_tolerance.timeout_s={groups.cfg.timeout_s:g} s ({attempt} attempts); the last error: "
                    f"{manager.errored()}. The newest checkpoint is intact, and the same command rejoins."
                )

    def _wait_for_groups(self, start: float) -> None:
        """Too few groups for a commit: wait a second before the next quorum, at most fault_tolerance.timeout_s."""
        cfg = self.groups.cfg
        if time.monotonic() - start > cfg.timeout_s:
            raise RunAborted(
                f"Replica group {cfg.replica_id}: fewer than fault_tolerance.min_replica_size={cfg.min_replica_size} "
                f"groups were alive for fault_tolerance.timeout_s={cfg.timeout_s:g} s; start the missing groups or "
                "lower min_replica_size."
            )
        time.sleep(1.0)
