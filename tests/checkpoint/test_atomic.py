"""A save that fails halfway leaves the last good checkpoint loadable and the run resumable, and
the user reads one paragraph saying what happened and what to do (no space, unwritable folder)."""

import errno
import io
import json
import time
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemWriter

from tests.helpers.fault_record import first_step_time, report
from tests.helpers.flags import TINY
from tests.helpers.runs import checkpoints, losses, run
from trillion.trainer.checkpoint.manager import CheckpointError
from trillion.trainer.cli.main import main
from trillion.trainer.metrics import meters


def fail_on_save(monkeypatch, method: str, error: Exception, after: int = 1):
    """Let `after` saves through, then raise `error` from FileSystemWriter.<method> in the next."""
    original, calls = getattr(FileSystemWriter, method), []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > after:
            raise error
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, method, failing)


@pytest.mark.parametrize(
    "method, error, message",
    [
        # the data files are written, the metadata is not: the middle of a save
        (
            "finish",
            OSError(errno.ENOSPC, "No space left on device"),
            "No space left on the device while saving checkpoint step 4",
        ),
        ("write_data", RuntimeError("injected"), "Saving checkpoint step 4"),
    ],
)
def test_failed_save_keeps_the_last_checkpoint_and_the_run_resumes(
    straight, tmp_path, monkeypatch, method, error, message
):
    _, expected = straight
    out = tmp_path / "run"
    fail_on_save(monkeypatch, method, error)
    with pytest.raises(CheckpointError, match=message) as failure:
        run(out, "--checkpoint.interval=2")
    assert (
        "step-00000002, is intact" in str(failure.value) and "run the same command again" in str(failure.value).lower()
    )
    assert checkpoints(out) == ["step-00000002"]  # the staging dir of step 4 is gone, step 2 untouched
    failed_at, reached = time.time(), losses(out)[-1][0]

    monkeypatch.undo()
    run(out, "--checkpoint.interval=2")
    assert losses(out) == expected
    if method == "finish":
        report(
            "disk full mid-save",
            str(failure.value).split(" Free space")[0] + " (exit 1, no traceback)",
            reached - 2,
            True,
            first_step_time(out / "metrics.jsonl", 3) - failed_at,
            "ENOSPC from DCP's writer while saving step 4 (checkpoint.interval=2); the same command again",
        )


def test_no_space_is_one_paragraph_and_exit_status_1(tmp_path, monkeypatch, capsys):
    fail_on_save(monkeypatch, "finish", OSError(errno.ENOSPC, "No space left on device"), after=0)
    assert (
        main(["train", *TINY, "--training.steps=2", f"--job.output_dir={tmp_path / 'run'}"]) == 1
    )  # a runtime failure
    err = capsys.readouterr().err
    assert "No space left" in err and "room for one whole checkpoint" in err and "Traceback" not in err


@pytest.mark.parametrize("keep_latest", [1, 0])
def test_no_space_advice_fits_checkpoint_keep_latest(keep_latest, tmp_path, monkeypatch):
    """keep_latest=1 already keeps the fewest: the advice says what the disk must hold instead of suggesting it
    again; keeping all (0) is told that keep_latest=1 would keep one, and which older ones to move."""
    fail_on_save(monkeypatch, "finish", OSError(errno.ENOSPC, "No space left on device"), after=2)
    out = tmp_path / "run"
    with pytest.raises(CheckpointError) as failure:
        run(out, "--checkpoint.interval=1", f"--checkpoint.keep_latest={keep_latest}", steps=3)
    message, newest = str(failure.value), "step-00000002"
    size = sum(f.stat().st_size for f in (out / "checkpoints" / newest).rglob("*") if f.is_file())
    assert f"room for one more whole checkpoint (about {size / 1e6:.1f} MB, as {newest})" in message
    assert "older ones are removed only once a newer one is complete" in message
    if keep_latest == 1:
        assert checkpoints(out) == [newest] and "keep_latest=1" not in message
    else:
        assert "--checkpoint.keep_latest=1 (now 0)" in message and "move the older ones (step-00000001)" in message


def test_unwritable_directory_fails_before_training(tmp_path, monkeypatch):
    original = Path.write_text

    def refuse(self, *args, **kwargs):
        if self.parent.name == "checkpoints":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", refuse)
    with pytest.raises(CheckpointError, match=r"checkpoints is not writable \(Permission denied\).*--job.output_dir"):
        run(tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # stopped before the first step


class FullDiskAfter(io.FileIO):
    """A file on a disk that fills up during the `full_at`-th write: half of that write lands, then ENOSPC."""

    writes = 0
    full_at = 0

    def write(self, data):
        FullDiskAfter.writes += 1
        if FullDiskAfter.writes == FullDiskAfter.full_at:
            super().write(bytes(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)


def test_a_full_disk_while_writing_metrics_is_one_paragraph_and_no_half_line(straight, tmp_path, monkeypatch, capsys):
    _, expected = straight
    out = tmp_path / "run"
    original_open = open

    def open_on_full_disk(path, mode="r", buffering=-1, **kwargs):
        if Path(path).name != "metrics.jsonl":
            return original_open(path, mode, buffering, **kwargs)
        assert buffering == 0 and "b" in mode  # each record one unbuffered write: nothing left for close to flush
        return FullDiskAfter(path, mode.replace("b", ""))

    FullDiskAfter.writes, FullDiskAfter.full_at = 0, 5  # the step-4 record (the step-0 evaluation, steps 1-3 before it)
    monkeypatch.setattr(meters, "open", open_on_full_disk, raising=False)
    flags = [*TINY, "--training.steps=6", "--checkpoint.interval=2", f"--job.output_dir={out}"]
    assert main(["train", *flags]) == 1
    err = capsys.readouterr().err
    assert "No space left on the device while writing" in err and "metrics.jsonl" in err
    assert "Traceback" not in err and "During handling" not in err
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3] and all(line.endswith("\n") for line in lines)
    failed_at = time.time()

    monkeypatch.undo()
    assert main(["train", *flags]) == 0
    assert losses(out) == expected
    report(
        "disk full while writing metrics.jsonl",
        err.strip().splitlines()[-1].split(" Checkpoints are")[0] + " (exit 1, no traceback)",
        2,  # steps 3 and 4, trained after the step-2 checkpoint
        True,
        first_step_time(out / "metrics.jsonl", 3) - failed_at,
        "ENOSPC halfway through the step-4 record of metrics.jsonl (checkpoint.interval=2); the same command again",
    )
