"""A restarted job continues exactly where its last checkpoint left it: bitwise the same losses
as one unbroken run, metrics appended, interrupted saves cleaned up, early exits chained."""

import json
import logging

import torch

from tests.helpers.runs import checkpoints, losses, read_checkpoint, run
from trillion.trainer.checkpoint.manager import MARKER


def test_chained_jobs_equal_one_unbroken_run(straight, tmp_path, caplog):
    _, expected = straight
    out = tmp_path / "chained"
    run(out, "--training.exit_interval=2")  # steps 1-2, checkpoint, exit 0
    assert checkpoints(out) == ["step-00000002"]
    run(out, "--training.exit_after_minutes=1e-9")  # the time limit: one step, checkpoint, exit
    assert checkpoints(out) == ["step-00000002", "step-00000003"]

    # what a crash leaves behind: a half-written save, a step dir without its marker, records
    # logged after the last checkpoint and a line cut short
    (out / "checkpoints" / ".staging-step-00000005").mkdir()
    (out / "checkpoints" / "step-00000004").mkdir()
    with open(out / "metrics.jsonl", "a") as metrics:
        metrics.write(json.dumps({"step": 4, "loss": 0.0}) + "\n" + '{"step": 5, "lo')
    with caplog.at_level(logging.INFO, logger="trillion"):
        run(out, "--checkpoint.keep_latest=0")
    assert "removed 2 unfinished checkpoint directories" in caplog.text
    assert "resumed from" in caplog.text and "step 3" in caplog.text
    assert "training.exit_after_minutes 1e-09 -> 0.0" in caplog.text  # allowed changes are logged

    # bitwise: float equality of every logged loss, in order, no step twice
    assert losses(out) == expected
    assert checkpoints(out) == ["step-00000002", "step-00000003", "step-00000006"]
    assert all((out / "checkpoints" / name / MARKER).is_file() for name in checkpoints(out))


def test_resume_restores_every_state(straight, tmp_path):
    """Weights, optimizer moments, LR, data position and counters after a resume equal the straight run's."""
    straight_out, _ = straight
    out = tmp_path / "resumed"
    run(out, "--training.exit_interval=3")
    run(out)
    ours, reference = read_checkpoint(out), read_checkpoint(straight_out)
    assert ours.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(ours[name], value) if isinstance(value, torch.Tensor) else ours[name] == value, name
    assert any(k.startswith("optimizer.state.") and k.endswith("exp_avg_sq") for k in reference)
    assert "rng.cpu" in reference and reference["training.counters.step"] == 6
    assert (reference["training.data.doc_index"], reference["training.data.offset"]) != (0, 0) and reference[
        "training.lr_scheduler.last_epoch"
    ] == 6
