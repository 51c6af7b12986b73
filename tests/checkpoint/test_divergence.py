"""A diverging run never costs the checkpoints it found: no checkpoint is saved while steps are skipped
as non-finite, none is pruned past until a step after it is known finite, and
`checkpoint.load_step` resumes from an earlier one, setting the later ones aside."""

import hashlib
import logging
import math
import time

import pytest

from tests.checkpoint.test_guards import poisoned
from tests.helpers.fault_record import last_line, report
from tests.helpers.runs import read_checkpoint, run
from trillion.trainer.checkpoint.verify import damaged_files
from trillion.trainer.config.schema import ConfigError

EVERY_5 = ("--checkpoint.interval=5", "--checkpoint.keep_latest=2")


def contents(folder) -> dict[str, str]:
    """Each file of a checkpoint folder by its SHA-256: equal means untouched, byte for byte."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def kept(out) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_a_diverged_run_keeps_its_good_checkpoints_and_load_step_goes_back(tmp_path, caplog):
    out = tmp_path / "run"
    run(out, *EVERY_5, steps=20)
    good = {name: contents(out / "checkpoints" / name) for name in ("step-00000015", "step-00000020")}
    assert kept(out) == sorted(good)

    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="trillion"):  # a peak LR of 1e4: finite ruin, then NaN
        diverged = run(out, *EVERY_5, "--optimizer.lr=1e4", steps=30)
    assert diverged["skipped_steps"] > 0 and not math.isfinite(diverged["grad_norm"])
    refused = last_line(caplog.text, "not saving checkpoint step 30")
    assert "the checkpoints kept are the ones before (step-00000015, step-00000020)" in refused
    assert kept(out) == sorted(good)  # the ruinous steps 21-24 were finite, but no save came before the skips
    for name, files in good.items():  # every good checkpoint still there, untouched, intact and loadable
        assert contents(out / "checkpoints" / name) == files
        assert damaged_files(out / "checkpoints" / name) == []
        state = read_checkpoint(out, step=int(name.removeprefix("step-")))
        assert state["training.counters.consecutive_skips"] == 0

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trillion"):
        back = run(out, *EVERY_5, "--checkpoint.load_step=15", steps=20)
    assert "resumed from" in caplog.text and "step-00000015: step 15" in caplog.text
    assert "abandoned-step-00000020" in last_line(caplog.text, "set aside the later checkpoint")
    assert back["step"] == 20 and back["skipped_steps"] == 0 and math.isfinite(back["loss"])
    assert "abandoned-step-00000020" in kept(out) and "step-00000020" in kept(out)  # the old one set aside

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trillion"):  # the same command, a longer run: it goes on from 20
        run(out, *EVERY_5, "--checkpoint.load_step=15", steps=25)
    assert "step-00000020: step 20" in last_line(caplog.text, "resumed from")
    report(
        "divergence after good checkpoints",
        refused.replace(str(out), "<output_dir>"),
        0,
        None,
        time.perf_counter() - start,
        "a 20-step run checkpointed every 5 (keep_latest=2) resumed with --optimizer.lr=1e4 to step 30: the "
        "skipped steps save nothing, step-15 and step-20 stay byte for byte and load; "
        "--checkpoint.load_step=15 then resumes from 15 (recover: the divergence to that run's end)",
    )


def test_a_checkpoint_just_before_the_divergence_prunes_nothing(tmp_path, caplog):
    """Step 15 is saved while finite, then 16-20 are non-finite: with keep_latest=1, step 10 stays,
    because no step after 15 ever vouched for it."""
    out = tmp_path / "run"
    run(out, "--checkpoint.interval=5", "--checkpoint.keep_latest=1", steps=10)
    with caplog.at_level(logging.WARNING, logger="trillion"):
        record = run(
            out, "--checkpoint.interval=5", "--checkpoint.keep_latest=1", steps=20, hooks=poisoned(set(range(6, 11)))
        )
    assert record["skipped_steps"] == 5
    assert kept(out) == ["step-00000010", "step-00000015"]
    assert "not saving checkpoint step 20" in caplog.text


def test_a_healthy_run_prunes_to_keep_latest(tmp_path):
    out = tmp_path / "run"
    run(out, "--checkpoint.interval=2", "--checkpoint.keep_latest=1", steps=5)
    assert kept(out) == ["step-00000005"]


def test_load_step_names_the_checkpoints_there_are(tmp_path):
    out = tmp_path / "run"
    run(out, "--checkpoint.interval=2", steps=4)
    with pytest.raises(ConfigError) as error:
        run(out, "--checkpoint.load_step=3", steps=4)
    message = str(error.value)
    assert "checkpoint.load_step=3" in message and "(the complete ones: 2, 4)" in message
    assert "checkpoint.load_step=0 to resume from the newest" in message
    assert kept(out) == ["step-00000002", "step-00000004"]  # a refused choice sets nothing aside
