"""Checkpoints with torch.distributed.checkpoint (DCP), written atomically.

A checkpoint is `checkpoints/step-NNNNNNNN/`: DCP shards of the model, optimizer and training
state, plus a `COMPLETE` marker written last. It is written into a hidden temporary directory and
published by a rename, so a crash or an error during a save never damages an earlier checkpoint,
and a directory without the marker is never taken for a checkpoint.
"""
import logging
import shutil
import warnings
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

log = logging.getLogger("trillion")
MARKER = "COMPLETE"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Published checkpoints, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / MARKER).is_file())


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(root: Path, step: int, model, optimizer, training_state: dict, *, is_rank0: bool,
                    keep_latest: int) -> Path:
    """Write step `step` on every rank; rank 0 publishes it and prunes old ones."""
    final, staging = step_dir(root, step), root / f".staging-step-{step:08d}"
    if is_rank0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "training": training_state,
    }
    with warnings.catch_warnings():  # a single process is a supported DCP case, not a mistake
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(staging))
    _barrier()
    if is_rank0:
        (staging / MARKER).write_text(f"step {step}\n")
        if final.exists():  # a rerun into the same directory: replace only once the new one is whole
            replaced = root / f".replaced-step-{step:08d}"
            shutil.rmtree(replaced, ignore_errors=True)
            final.rename(replaced)
            staging.rename(final)
            shutil.rmtree(replaced)
        else:
            staging.rename(final)
        if keep_latest > 0:
            for old in complete_checkpoints(root)[:-keep_latest]:
                shutil.rmtree(old)
        log.info("saved checkpoint %s", final)
    _barrier()
    return final
