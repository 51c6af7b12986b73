"""Guide claims with no other fast test: fp16 with dynamic loss scaling in one process (the paper's
precision) trains the fp32 run's curve within fp16's precision and scales the loss; TensorBoard event
files hold the logged metrics."""

import math

import torch

from tests.helpers.runs import losses, run


def test_fp16_loss_scaling_follows_the_fp32_run(straight, tmp_path, monkeypatch):
    _, expected = straight
    scales = []
    original = torch.amp.GradScaler.update

    def recording_update(self, *args, **kwargs):
        scales.append(self.get_scale())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.amp.GradScaler, "update", recording_update)
    run(tmp_path / "fp16", "--training.dtype=fp16")
    half = losses(tmp_path / "fp16")
    assert [s for s, _ in half] == [s for s, _ in expected]
    assert all(math.isclose(a, b, rel_tol=2e-2) for (_, a), (_, b) in zip(half, expected, strict=True)), (
        half,
        expected,
    )
    assert scales and all(s > 1 for s in scales)  # the loss was scaled up before backward


def test_tensorboard_event_files_hold_the_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(tmp_path / "tb", "--logging.tensorboard=true", steps=3)
    events = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    logged = [loss for _, loss in losses(tmp_path / "tb")]
    assert all(
        math.isclose(e.value, loss, rel_tol=1e-6) for e, loss in zip(events.Scalars("loss"), logged, strict=True)
    )
