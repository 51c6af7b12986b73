"""Checkpoints with torch.distributed.checkpoint (DCP): atomic, resumable, loadable under any layout.

A checkpoint is `checkpoints/step-NNNNNNNN/`: DCP shards of the model, optimizer, training state
(step and token counters, LR schedule, data position) and RNG states, the resolved `config.toml`,
and a `COMPLETE` marker written last. It is written into a hidden staging directory and published
by a rename, so a crash or an error during a save never damages an earlier checkpoint, and a
directory without the marker is never taken for a checkpoint (it is removed on the next start).

Tensors are saved under their parameter names with their global shapes (DTensor shards are
described, not gathered), so DCP re-slices them on load for any parallel layout; the data position
is layout-independent (trainer/data/loader.py). Model parts and optimizers are lists, so pipeline stages,
which keep global parameter names, save into one checkpoint. What is saved: state.py; the folders on disk: folders.py.
"""

import logging
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from trillion.errors import ConfigError
from trillion.trainer.checkpoint.folders import (
    CONFIG_FILE,
    MARKER,
    complete_checkpoints,
    remove_partial,
    step_dir,
    sync_dir,
    write_synced,
)
from trillion.trainer.checkpoint.load_step import loadable
from trillion.trainer.checkpoint.resume_check import (
    check_resume_config,
    check_shapes,
    saved_config,
    settings,
    trim_metrics,
)
from trillion.trainer.checkpoint.save_errors import CheckpointError, save_error
from trillion.trainer.checkpoint.state import RunStates, load_model_weights, saved_model_shapes
from trillion.trainer.checkpoint.verify import ChecksummedWriter, newest_intact, write_manifest
from trillion.trainer.config.schema import Checkpoint as CheckpointConfig
from trillion.trainer.config.schema import Data as DataConfig
from trillion.trainer.data import fingerprint as corpus_fingerprint

log = logging.getLogger("trillion")
# DCP warns on every save and load in one process, also from the async writer's thread (which a
# catch_warnings block cannot reach); one process is a supported case, not a mistake.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
SAVE_FAILURES = (Exception, CheckpointException)  # DCP's exception derives from BaseException


@dataclass(frozen=True)
class RunRecord:
    """What a checkpoint keeps of the run beside its tensors, and a resume checks against: the resolved
    config as config.toml holds it, and the data section whose corpus the fingerprint describes."""

    config_toml: str
    data: DataConfig


class CheckpointManager:
    """Saves (sync or async), publishes, prunes and resumes one run's checkpoints.

    Collectives of the checkpoint (barriers, agreement, DCP's own planning) run on a dedicated
    gloo group: it works beside NCCL, and an async save's background thread never interleaves
    with the training collectives on the default group."""

    def __init__(self, output_dir: Path, cfg: CheckpointConfig, run: RunStates, record: RunRecord, *, is_rank0: bool):
        self.root, self.output_dir, self.cfg, self.is_rank0 = (
            Path(output_dir) / "checkpoints",
            Path(output_dir),
            cfg,
            is_rank0,
        )
        self.run, self.record, self.counters = run, record, run.counters
        self.states = run.stateful()
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.pending = None  # (future, staging dir, step, start time) of the async save in flight
        self.blocked_seconds = 0.0  # how long the async save in flight held training up
        self.unconfirmed = None  # the step of the newest checkpoint no finite step after it has vouched for yet
        self.last_saved_step = None  # the step of the last save this job started
        # Whether this job writes the checkpoints: fault-tolerant replica groups leave it to the first one alive.
        self.elected = lambda: True
        self._check_writable()

    # --- agreement across ranks -------------------------------------------------------------------
    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def _agree(self, error: Exception | None, what: str) -> None:
        """Raise on every rank if `what` failed on any (else the others would wait forever)."""
        failed = torch.tensor([error is not None], dtype=torch.int32)
        if self.group is not None:
            dist.all_reduce(failed, group=self.group)
        if error is not None:
            raise error
        if failed.item():
            raise CheckpointError(f"Another rank failed to {what}; its log says why.")

    def _check_writable(self) -> None:
        error = None
        if self.is_rank0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                probe = self.root / f".write-test-{os.getpid()}"
                probe.write_text("ok")
                probe.unlink()
            except OSError as problem:
                error = CheckpointError(
                    f"The checkpoint directory {self.root} is not writable ({problem.strerror or problem}). Point "
                    f"--job.output_dir at a folder this job may write, or fix its permissions."
                )
        self._agree(error, f"write into {self.root}")

    # --- resume -----------------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the newest complete checkpoint, else the `checkpoint.initial_load` weights; returns the step reached."""
        if self.is_rank0 and (removed := remove_partial(self.root)):
            log.warning(
                "removed %d unfinished checkpoint director%s in %s (a save was interrupted): %s",
                len(removed),
                "y" if len(removed) == 1 else "ies",
                self.root,
                ", ".join(removed),
            )
        self._barrier()
        checkpoints = loadable(complete_checkpoints(self.root), self.cfg.load_step, self.root, self.is_rank0)
        self._barrier()  # the later checkpoints are set aside before anyone reads the folder again
        if not checkpoints:
            if self.cfg.initial_load:
                start = time.perf_counter()
                load_model_weights(
                    Path(self.cfg.initial_load),
                    self.run.model_parts,
                    self.run.model_args,
                    "--checkpoint.initial_load",
                    self.run.whole_model,
                )
                log.info("initial weights from %s (%.2fs)", self.cfg.initial_load, time.perf_counter() - start)
            return 0
        latest = newest_intact(checkpoints, self.group, self.is_rank0)
        check_resume_config(saved_config(latest / CONFIG_FILE), settings(self.record.config_toml), latest)
        error = None
        try:
            corpus_fingerprint.check(latest, self.record.data, self.cfg.accept_data_change)
        except ConfigError as changed:
            error = changed
        self._agree(error, "accept the data corpus")  # a node whose copy of the data differs stops every rank
        check_shapes(
            saved_model_shapes(latest), self.states["model"].state_dict(), f"checkpoint {latest}", self.run.whole_model
        )
        if self.cfg.initial_load:
            log.info("checkpoint.initial_load is ignored: the run resumes from its own checkpoint %s", latest)
        metadata = FileSystemReader(str(latest)).read_metadata().state_dict_metadata
        self.states["rng"].saved_keys = {k.split(".")[1] for k in metadata if k.startswith("rng.")}
        states = self.states
        if "ema" in states and not any(k.startswith("ema.") for k in metadata):
            log.info("optimizer.ema_decay: %s holds no moving average; it starts from the loaded weights", latest)
            states = {k: v for k, v in states.items() if k != "ema"}
        start = time.perf_counter()
        dcp.load(states, checkpoint_id=str(latest), process_group=self.group, no_dist=self.group is None)
        if states is not self.states:
            self.states["ema"].load_state_dict(self.states["model"].state_dict())
        log.info(
            "resumed from %s: step %d, %d tokens seen (loaded in %.2fs)",
            latest,
            self.counters.step,
            self.counters.tokens,
            time.perf_counter() - start,
        )
        if self.is_rank0 and (dropped := trim_metrics(self.output_dir / "metrics.jsonl", self.counters.step)):
            log.info(
                "metrics.jsonl: dropped %d records logged after step %d; those steps run again",
                dropped,
                self.counters.step,
            )
        return self.counters.step

    # --- save -------------------------------------------------------------------------------------
    def save(self, step: int, *, blocking: bool = False) -> None:
        """Checkpoint `step` on every rank. Async mode returns once the state is copied to host memory;
        the write goes on in the background and is published by `poll`, the next save or `close`."""
        self.wait()
        self.unconfirmed = self.last_saved_step = step
        staging = self.root / f".staging-step-{step:08d}"
        start, error = time.perf_counter(), None
        if self.is_rank0:
            try:
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)
                (staging / CONFIG_FILE).write_text(self.record.config_toml)
                corpus_fingerprint.write(staging, self.record.data)
            except OSError as problem:
                error = save_error(problem, step, self.root, self.cfg.keep_latest)
        self._agree(error, f"prepare checkpoint step {step}")
        try:
            if self.cfg.async_mode == "async" and not blocking:
                future = dcp.async_save(
                    self.states,
                    storage_writer=ChecksummedWriter(staging),
                    process_group=self.group,
                    no_dist=self.group is None,
                )
                self.pending = (future, staging, step, start)
                self.blocked_seconds = time.perf_counter() - start
                return
            dcp.save(
                self.states,
                storage_writer=ChecksummedWriter(staging),
                process_group=self.group,
                no_dist=self.group is None,
            )
        except SAVE_FAILURES as problem:
            self._abandon(staging)
            raise save_error(problem, step, self.root, self.cfg.keep_latest) from problem
        # dcp.save returns on a rank only after the coordinator has gathered every rank's write
        # results and written the metadata, so the checkpoint is whole: publish without a barrier.
        self._publish(staging, step, start, time.perf_counter() - start)

    def due(self, step: int, *, last: bool, stopping_early: bool) -> bool:
        """Whether `maybe_save` saves after `step`."""
        periodic = self.cfg.interval > 0 and step % self.cfg.interval == 0
        return periodic or (last and (self.cfg.save_final or stopping_early))

    def maybe_save(self, step: int, *, last: bool, stopping_early: bool) -> float:
        """Save every checkpoint.interval steps and after the job's last step (with checkpoint.save_final,
        and always when the job stops early); otherwise let an async save in flight move on. The last
        save blocks until written. Returns the seconds spent here."""
        start = time.perf_counter()
        if self.due(step, last=last, stopping_early=stopping_early) and self._healthy(step) and self.elected():
            self.save(step, blocking=last)
        else:
            self.poll()
        return time.perf_counter() - start

    def _healthy(self, step: int) -> bool:
        """False while the run is skipping non-finite steps (the guard read their flags at this save):
        a checkpoint then would hold the diverged state and could replace or prune past a good one."""
        skipping = self.counters.consecutive_skips
        if skipping and self.is_rank0:
            kept = ", ".join(c.name for c in complete_checkpoints(self.root)) or "none"
            log.warning(
                "not saving checkpoint step %d: the last %d step%s skipped as non-finite; the checkpoints kept are "
                "the ones before (%s)",
                step,
                skipping,
                " was" if skipping == 1 else "s were",
                kept,
            )
        return not skipping

    @property
    def awaiting_confirmation(self) -> bool:
        """Whether the newest checkpoint waits for a step after it to be known finite before older ones go."""
        return self.unconfirmed is not None

    def confirm(self, step: int) -> None:
        """Once a step after the newest checkpoint is known finite (the guard read its flag), prune past it
        (checkpoint.keep_latest); a run diverging right after a save keeps every checkpoint it had."""
        if self.unconfirmed is not None and step > self.unconfirmed:
            self._vouch()

    def _vouch(self) -> None:
        if not self.counters.consecutive_skips:
            self.unconfirmed = None
            self._prune()

    def _prune(self) -> None:
        if self.is_rank0 and self.cfg.keep_latest > 0:
            for old in complete_checkpoints(self.root)[: -self.cfg.keep_latest]:
                shutil.rmtree(old)

    def poll(self) -> None:
        """Publish the async save in flight if its write has finished; never blocks."""
        if self.pending is not None and self.pending[0].done():
            self._finish_pending()

    def wait(self) -> None:
        """Block until the async save in flight (if any) is written and published."""
        if self.pending is not None:
            self._finish_pending()

    def close(self) -> None:
        """End of training: finish the save in flight. While another error is already propagating,
        a failure here is logged instead of masking that error."""
        if sys.exc_info()[1] is None:
            self.wait()
            if self.unconfirmed is not None:  # the job's last checkpoint: no later step of this job vouches for it
                self._vouch()
            return
        try:
            self.wait()
        except SAVE_FAILURES as problem:
            log.error("the checkpoint save in flight failed too: %s", problem)

    def _finish_pending(self) -> None:
        future, staging, step, start = self.pending
        self.pending = None
        try:
            future.result()
        except SAVE_FAILURES as problem:
            self._abandon(staging)
            raise save_error(problem, step, self.root, self.cfg.keep_latest) from problem
        # A rank's future completes after DCP's final gather of all ranks' write results, so rank 0
        # seeing its own done means every rank has written.
        self._publish(staging, step, start, self.blocked_seconds)

    def _publish(self, staging: Path, step: int, start: float, blocked: float) -> None:
        if not self.is_rank0:
            return
        final = step_dir(self.root, step)
        checksum_start = time.perf_counter()
        write_manifest(staging)  # sizes and checksums first: a checkpoint with a marker always has them
        checksum_seconds = time.perf_counter() - checksum_start
        write_synced(staging / MARKER, f"step {step}\n")
        if final.exists():  # a rerun of the same step: replace only once the new one is whole
            replaced = self.root / f".replaced-step-{step:08d}"
            shutil.rmtree(replaced, ignore_errors=True)
            final.rename(replaced)
            staging.rename(final)
            shutil.rmtree(replaced)
        else:
            staging.rename(final)
        sync_dir(self.root)
        log.info(
            "saved checkpoint %s (training blocked %.2fs, written in %.2fs, checksummed in %.2fs)",
            final,
            blocked,
            time.perf_counter() - start,
            checksum_seconds,
        )

    def _abandon(self, staging: Path) -> None:
        if self.is_rank0:
            shutil.rmtree(staging, ignore_errors=True)
