"""Checkpoints: saved, published, pruned and resumed (manager.py) in folders on disk (folders.py); load_step.py,
save_errors.py, state.py, verify.py, resume_check.py and export.py hold the parts their names say."""

from trillion.trainer.checkpoint.folders import CONFIG_FILE, complete_checkpoints
from trillion.trainer.checkpoint.manager import CheckpointManager
from trillion.trainer.checkpoint.save_errors import CheckpointError

__all__ = ["CONFIG_FILE", "CheckpointError", "CheckpointManager", "complete_checkpoints"]
