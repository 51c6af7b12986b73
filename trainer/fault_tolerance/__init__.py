"""Fault-tolerant replica groups (torchft): the checks before any work and the group's run directory (checks.py),
the Manager and its quorum (replicas.py), the committed step (step.py), live recovery (recovery.py), DiLoCo."""

from trillion.trainer.fault_tolerance.checks import check_fault_tolerance, replica_group_config

__all__ = ["check_fault_tolerance", "replica_group_config"]
