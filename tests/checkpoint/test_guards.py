"""A step with a non-finite loss or gradient norm changes nothing and is counted; too many in a
row stop the run with a message naming the setting. Config changes that would make a resumed run
a different run are refused; a checkpoint of another model shape names the parameters."""

import logging
import math

import pytest
import torch

from tests.helpers.fault_record import last_line, report
from tests.helpers.flags import TINY
from tests.helpers.runs import read_checkpoint, run
from trillion.parallel.clip import clip_grad_norm_
from trillion.trainer.cli.main import main
from trillion.trainer.config.schema import ConfigError
from trillion.trainer.resilience import TrainingDiverged
from trillion.trainer.step import train_step
from trillion.trainer.train import RunHooks


def poisoned(bad_steps: set[int]) -> RunHooks:
    """Hooks under which the gradient norm of these steps (1-based) comes out NaN, as after an overflow."""
    calls = []

    def clip(parameters, max_norm, *args):
        calls.append(1)
        norm = clip_grad_norm_(parameters, max_norm, *args)
        return torch.full_like(norm, math.nan) if len(calls) in bad_steps else norm

    return RunHooks(clip=clip)


@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
def test_nonfinite_steps_are_skipped_and_counted(tmp_path, caplog, implementation):
    """Steps 2 and 3 (NaN gradient norm) change no weight (bitwise) and no optimizer state, its step
    count included, under every optimizer.implementation: the fused AdamW step is masked on the device,
    the foreach and for-loop steps left out by the host."""
    hooks, unchanged = poisoned({2, 3}), []
    asked = {"fused": ("fused", True), "foreach": ("foreach", True), "for-loop": ("foreach", False)}[implementation]

    def watched_step(runner, micro_batches, optimizer, *args, **kwargs):
        assert bool(optimizer.defaults[asked[0]]) == asked[1]  # the optimizer is the implementation asked for
        before = [p.detach().clone() for p in runner.model.parameters()]
        out = train_step(runner, micro_batches, optimizer, *args, **kwargs)
        unchanged.append(all(torch.equal(b, p) for b, p in zip(before, runner.model.parameters())))
        return out

    hooks.step = watched_step
    with caplog.at_level(logging.WARNING, logger="trillion"):
        record = run(tmp_path / "run", f"--optimizer.implementation={implementation}", steps=5, hooks=hooks)
    assert unchanged == [False, True, True, False, False]
    state = read_checkpoint(tmp_path / "run", step=5)
    counts = {k: float(v) for k, v in state.items() if k.startswith("optimizer.state.") and k.endswith(".step")}
    assert counts and set(counts.values()) == {3.0}  # AdamW counted three updates, not five
    assert record["step"] == 5 and record["skipped_steps"] == 2 and math.isfinite(record["loss"])
    assert "update skipped: 3 (gradient norm) (2 in a row, 2 in this run)" in caplog.text
    if implementation == "fused":  # the fault matrix's row is the default run's
        report(
            "NaN gradient",
            last_line(caplog.text, "update skipped: 3") + " (skipped_steps in metrics.jsonl)",
            0,
            None,
            0.0,
            "gradient norm NaN in steps 2 and 3: weights and optimizer state untouched (the fused step masked on the "
            "device), counted and logged at the next logging step; the run goes on (the final loss differs from an "
            "unbroken run's by design: two updates fewer)",
        )


def test_too_many_nonfinite_steps_in_a_row_stop_the_run(tmp_path):
    with pytest.raises(TrainingDiverged, match=r"3 steps in a row up to step 4.*training.max_nonfinite_skips=3"):
        run(tmp_path / "run", "--training.max_nonfinite_skips=3", steps=6, hooks=poisoned({2, 3, 4}))


def test_settings_that_change_the_run_are_refused_on_resume(tmp_path):
    out = tmp_path / "run"
    run(out, "--training.exit_interval=1", steps=4)
    with pytest.raises(ConfigError) as error:
        run(out, "--training.seq_len=16", "--training.global_batch_size=8", steps=4)
    message = str(error.value)
    assert "training.seq_len was 32 there and is 16 now" in message and "training.global_batch_size was 4" in message
    assert "--training.global_batch_size=4 --training.seq_len=32" in message and "--job.output_dir" in message
    run(out, "--optimizer.lr=0.001", steps=5)  # allowed: a new peak LR and a longer schedule


def test_weights_of_another_shape_name_the_parameters(tmp_path):
    source = tmp_path / "source"
    run(source, steps=1)
    with pytest.raises(ConfigError) as error:
        run(
            tmp_path / "new",
            f"--checkpoint.initial_load={source}/checkpoints/step-00000001",
            "--model.dim=32",
            "--model.n_heads=2",
            "--model.n_kv_heads=1",
            steps=1,
        )
    message = str(error.value)
    assert "tok_embeddings.weight is (320, 64) there but (320, 32) here" in message
    assert "--checkpoint.initial_load=" in message and "config.toml" in message


@pytest.mark.parametrize(
    "setting, message",
    [
        (
            "--checkpoint.async_mode=background",
            "checkpoint.async_mode='background' is not known. Use one of: disabled, async",
        ),
        (
            "--checkpoint.initial_load=/no/such/weights",
            "checkpoint.initial_load='/no/such/weights' no such file or folder",
        ),
        ("--training.exit_after_minutes=-5", "training.exit_after_minutes=-5.0 is out of range: it must be at least 0"),
    ],
)
def test_checkpoint_settings_are_checked_before_any_work(tmp_path, setting, message, capsys):
    assert main(["train", *TINY, f"--job.output_dir={tmp_path}", setting]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "config.toml").exists()  # stopped before the run directory was written
