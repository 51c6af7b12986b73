"""checkpoint.async_mode=async: training goes on while a checkpoint is written; the COMPLETE marker
comes only after the write has finished; the next save and the end of training wait for it."""

import subprocess
import sys
import time
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter

import trillion.trainer.checkpoint.manager
from tests.helpers.runs import checkpoints, losses, run


def test_async_saves_overlap_training_and_publish_only_when_written(straight, tmp_path, monkeypatch):
    _, expected = straight
    events = []
    finish, publish, write_marker = (
        FileSystemWriter.finish,
        trillion.trainer.checkpoint.manager.CheckpointManager._publish,
        trillion.trainer.checkpoint.manager.write_synced,
    )

    def slow_finish(self, *args, **kwargs):  # the metadata, the last thing a save writes
        time.sleep(0.5)
        finish(self, *args, **kwargs)
        events.append(("written", self.path.name))

    def recording_publish(self, staging, step, *args):
        events.append(("publish", step, self.counters.step))
        publish(self, staging, step, *args)

    def recording_marker(path, text):
        events.append(("marker", path.parent.name))
        write_marker(path, text)

    monkeypatch.setattr(FileSystemWriter, "finish", slow_finish)
    monkeypatch.setattr(trillion.trainer.checkpoint.manager.CheckpointManager, "_publish", recording_publish)
    monkeypatch.setattr(trillion.trainer.checkpoint.manager, "write_synced", recording_marker)
    out = tmp_path / "async"
    run(out, "--checkpoint.async_mode=async", "--checkpoint.interval=2", "--checkpoint.keep_latest=0")

    assert losses(out) == expected  # saving in the background changes nothing
    assert checkpoints(out) == ["step-00000002", "step-00000004", "step-00000006"]
    for step in (2, 4, 6):
        staging = f".staging-step-{step:08d}"
        assert events.index(("written", staging)) < events.index(("marker", staging))
    published_during = {e[1]: e[2] for e in events if e[0] == "publish"}
    assert published_during[2] > 2 and published_during[4] > 4  # training went on while they were written
    assert published_during[6] == 6  # the last one is written before the job ends


def test_async_run_resumes_exactly(straight, tmp_path):
    _, expected = straight
    out = tmp_path / "async"
    run(out, "--checkpoint.async_mode=async", "--checkpoint.interval=2", "--training.exit_interval=3")
    assert checkpoints(out) == ["step-00000002", "step-00000003"]
    run(out, "--checkpoint.async_mode=async", "--checkpoint.interval=2")
    assert losses(out) == expected


def test_checkpoint_benchmark_smoke():
    """experiments/bench/checkpoint_io.py (the figures in RESULTS.md) runs in its smoke mode."""
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, str(root / "experiments/bench/checkpoint_io.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["none", "sync", "async"]
    assert "load (resume)" in result.stdout
