"""Checkpoints with torch.distributed.checkpoint (DCP): atomic, resumable, loadable under any layout.

A checkpoint is `checkpoints/step-NNNNNNNN/`: DCP shards of the model, optimizer, training state
(step and token counters, LR schedule, data position) and RNG states, the resolved `config.toml`,
and a `COMPLETE` marker written last. It is written into a hidden staging directory and published
by a rename, so a crash or an error during a save never damages an earlier checkpoint, and a
directory without the marker is never taken for a checkpoint (it is removed on the next start).

Tensors are saved under their parameter names with their global shapes (DTensor shards are
described, not gathered), so DCP re-slices them on load for any parallel layout; the data position
is layout-independent (trainer/data/loader.py). Model parts and optimizers are lists, so pipeline stages,
which keep global parameter names, save into one checkpoint. What is saved: checkpoint_state.py.
"""

import errno
import logging
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import tomllib
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from trillion.errors import ConfigError, RunAborted
from trillion.trainer.checkpoint.resume_check import (
    check_resume_config,
    check_shapes,
    saved_config,
    settings,
    trim_metrics,
)
from trillion.trainer.checkpoint.state import RunStates, load_model_weights, saved_model_shapes
from trillion.trainer.checkpoint.verify import ChecksummedWriter, newest_intact, write_manifest
from trillion.trainer.config.schema import Checkpoint as CheckpointConfig
from trillion.trainer.config.schema import Data as DataConfig
from trillion.trainer.data import fingerprint as corpus_fingerprint

log = logging.getLogger("trillion")
# DCP warns on every save and load in one process, also from the async writer's thread (which a
# catch_warnings block cannot reach); one process is a supported case, not a mistake.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
MARKER = "COMPLETE"
CONFIG_FILE = "config.toml"
PARTIAL_PREFIXES = (".staging-", ".replaced-")
SAVE_FAILURES = (Exception, CheckpointException)  # DCP's exception derives from BaseException


class CheckpointError(RunAborted):
    """A checkpoint could not be written or read; the message says where and what to do."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Published checkpoints, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if is_complete(p))


def check_run_directory(output_dir: Path, *, overwrite: bool, restarted: bool) -> None:
    """Refuse, before any work, a run directory this run would damage: a config.toml that does not
    parse (the record of an earlier run's settings, never silently replaced), or an earlier run's
    metrics with no checkpoint to continue from (a fresh start would replace them; job.overwrite
    allows it, and a restart of the same job continues its own records)."""
    config_file = output_dir / CONFIG_FILE
    if config_file.is_file():
        try:
            tomllib.loads(config_file.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
            raise ConfigError(
                f"{config_file} does not parse ({error}): it records the settings of the run in "
                f"job.output_dir={output_dir}. Repair or remove it, or give another --job.output_dir."
            ) from None
    metrics = output_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size and not complete_checkpoints(output_dir / "checkpoints"):
        if overwrite or restarted:
            log.warning(
                "%s holds an earlier run's metrics and no checkpoint: starting afresh, replacing them", output_dir
            )
            return
        raise ConfigError(
            f"job.output_dir={output_dir} holds the metrics of an earlier run but no checkpoint to continue it from; "
            "a fresh start would replace them. Give a new --job.output_dir, or pass --job.overwrite=true to start "
            "afresh there."
        )


def write_run_config(output_dir: Path, config_toml: str) -> None:
    """config.toml, once the run is accepted (after the resume checks), replaced atomically."""
    staged = output_dir / f".{CONFIG_FILE}.staging"
    _write_synced(staged, config_toml)
    os.replace(staged, output_dir / CONFIG_FILE)


def remove_partial(root: Path) -> list[str]:
    """Delete what an interrupted save left behind: staging dirs and step dirs without the marker."""
    if not root.is_dir():
        return []
    partial = [
        p
        for p in root.iterdir()
        if p.is_dir() and (p.name.startswith(PARTIAL_PREFIXES) or (p.name.startswith("step-") and not is_complete(p)))
    ]
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return sorted(p.name for p in partial)


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
        checkpoints = complete_checkpoints(self.root)
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
        start = time.perf_counter()
        dcp.load(self.states, checkpoint_id=str(latest), process_group=self.group, no_dist=self.group is None)
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
        staging = self.root / f".staging-step-{step:08d}"
        start, error = time.perf_counter(), None
        if self.is_rank0:
            try:
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)
                (staging / CONFIG_FILE).write_text(self.record.config_toml)
                corpus_fingerprint.write(staging, self.record.data)
            except OSError as problem:
                error = _save_error(problem, step, self.root)
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
            raise _save_error(problem, step, self.root) from problem
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
        if self.due(step, last=last, stopping_early=stopping_early):
            self.save(step, blocking=last)
        else:
            self.poll()
        return time.perf_counter() - start

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
            raise _save_error(problem, step, self.root) from problem
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
        _write_synced(staging / MARKER, f"step {step}\n")
        if final.exists():  # a rerun of the same step: replace only once the new one is whole
            replaced = self.root / f".replaced-step-{step:08d}"
            shutil.rmtree(replaced, ignore_errors=True)
            final.rename(replaced)
            staging.rename(final)
            shutil.rmtree(replaced)
        else:
            staging.rename(final)
        _sync_dir(self.root)
        if self.cfg.keep_latest > 0:
            for old in complete_checkpoints(self.root)[: -self.cfg.keep_latest]:
                shutil.rmtree(old)
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


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _os_error(error: BaseException) -> OSError | None:
    """The OSError behind a save failure, looking through DCP's per-rank wrapping."""
    seen = set()
    stack = [error]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        stack += [current.__cause__, current.__context__]
        if isinstance(current, CheckpointException):  # {rank: (exception, traceback)}
            stack += [exception for exception, _ in current.failures.values()]
    return None


def _save_error(error: BaseException, step: int, root: Path) -> CheckpointError:
    previous = complete_checkpoints(root)
    kept = f"The last good checkpoint, {previous[-1].name}, is intact." if previous else "No earlier checkpoint exists."
    os_error = _os_error(error)
    if os_error is not None and os_error.errno == errno.ENOSPC:
        return CheckpointError(
            f"No space left on the device while saving checkpoint step {step} into {root}. {kept} Free space there, "
            f"keep fewer checkpoints (--checkpoint.keep_latest=1) or point --job.output_dir at a larger filesystem, "
            f"then run the same command again to resume."
        )
    if os_error is not None and os_error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return CheckpointError(
            f"Cannot write checkpoint step {step} into {root} ({os_error.strerror}). {kept} Fix the permissions or "
            f"point --job.output_dir at a writable folder, then run the same command again to resume."
        )
    cause = os_error or _first_failure(error)
    return CheckpointError(
        f"Saving checkpoint step {step} into {root} failed ({type(cause).__name__}: {cause}). "
        f"{kept} Run the same command again to resume from it."
    )


def _first_failure(error: BaseException) -> BaseException:
    if isinstance(error, CheckpointException) and error.failures:
        return next(iter(error.failures.values()))[0]
    return error
