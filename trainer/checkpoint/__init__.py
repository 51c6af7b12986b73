"""Checkpoints: the manager that saves, publishes, prunes and resumes (manager.py), what is saved (state.py),
checksums (verify.py), the checks a resume makes (resume_check.py) and the Hugging Face export (export.py)."""

from trillion.trainer.checkpoint.manager import CONFIG_FILE, CheckpointError, CheckpointManager, complete_checkpoints

__all__ = ["CONFIG_FILE", "CheckpointError", "CheckpointManager", "complete_checkpoints"]
