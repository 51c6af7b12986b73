"""The [fault_tolerance] section: torchft replica groups (torchtitan's setting names), the Lighthouse at
TORCHFT_LIGHTHOUSE. Each group is its own job (its own torchrun or srun); together they are the
data-parallel replicas, joined by torchft's managed all-reduce (docs/checkpoints.md, "Fault tolerance")."""

from dataclasses import dataclass

from trillion.errors import ConfigError
from trillion.trainer.config.checks import Flag, OneOf, Range
from trillion.trainer.config.fields import NONNEGATIVE, POSITIVE, doc

SEMI_SYNC_METHODS = ("none", "diloco", "local_sgd")  # none: every step synchronous


@dataclass
class FaultTolerance:
    enabled: bool = doc(
        False,
        "Train as one of fault_tolerance.group_size torchft replica groups: a group that fails leaves the others "
        "training, and rejoins live when restarted. Needs `pip install 'trillion[ft]'` and a Lighthouse at "
        "TORCHFT_LIGHTHOUSE.",
        Flag(),
    )
    replica_id: int = doc(
        0, "This group's index, 0 .. group_size - 1; it takes that share of every batch.", NONNEGATIVE
    )
    group_size: int = doc(
        2,
        "Replica groups in the job (torchtitan's name): each trains global_batch_size / group_size sequences of "
        "every step, sharded inside the group by its own layout.",
        POSITIVE,
    )
    min_replica_size: int = doc(
        1, "A step commits only when at least this many groups took part; fewer wait for more to join.", POSITIVE
    )
    semi_sync_method: str = doc(
        "none",
        "none (every step synchronous) | diloco | local_sgd: groups train alone and meet every sync_steps steps "
        "(DiLoCo: an outer Nesterov SGD step on the averaged change; LocalSGD: the weights averaged).",
        OneOf(SEMI_SYNC_METHODS),
    )
    sync_steps: int = doc(5, "Semi-synchronous methods: inner steps between two synchronisations.", POSITIVE)
    outer_lr: float = doc(0.7, "DiLoCo's outer learning rate (the DiLoCo paper's 0.7).", Range(0, open_low=True))
    outer_momentum: float = doc(
        0.9, "DiLoCo's outer Nesterov momentum (the DiLoCo paper's 0.9; 0: plain SGD).", Range(0, 1)
    )
    process_group: str = doc(
        "auto",
        "The collectives between groups: auto (nccl on GPUs, gloo on CPU) | gloo | nccl.",
        OneOf(("auto", "gloo", "nccl")),
    )
    process_group_timeout_ms: int = doc(
        60000,
        "A collective between groups that takes longer fails the step, which is then retried by the groups still "
        "alive; it must cover a rejoining group's live recovery and one step.",
        POSITIVE,
    )
    timeout_s: float = doc(
        60.0,
        "Reaching the Lighthouse, each quorum, each commit vote and a live recovery give up after this long (exit 1).",
        Range(0, open_low=True),
    )

    def check_relations(self) -> None:
        if not self.enabled:
            return
        if self.group_size < 2:
            raise ConfigError(
                f"fault_tolerance.group_size={self.group_size} leaves no room for a second replica group, so a failure "
                "cannot be survived: the groups are the data-parallel replicas (dp_replicate). Start at least two "
                "groups with --fault_tolerance.group_size=2 or more, or turn fault tolerance off."
            )
        if self.replica_id >= self.group_size:
            raise ConfigError(
                f"fault_tolerance.replica_id={self.replica_id} is outside the {self.group_size} replica groups "
                f"(fault_tolerance.group_size); give each group its own id from 0 to {self.group_size - 1}."
            )
        if self.min_replica_size > self.group_size:
            raise ConfigError(
                f"fault_tolerance.min_replica_size={self.min_replica_size} is more than the {self.group_size} groups "
                "(fault_tolerance.group_size): no step could ever commit. Use at most group_size."
            )

    @property
    def groups(self) -> int:
        """The replica groups that share each global batch (1 without fault tolerance)."""
        return self.group_size if self.enabled else 1

    def data_rank(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """(rank, ranks) of this data-parallel rank among every group's: group g reads the g-th share of each
        global batch, split by its own data-parallel ranks."""
        return self.replica_id * dp_size + dp_rank if self.enabled else dp_rank, dp_size * self.groups
