"""A checkpoint damaged after it was published (truncated shard, flipped bytes, missing .metadata) is
reported by file and set aside; the run falls back to the newest intact one and ends bitwise where
an unbroken run ends, or stops with one paragraph (exit 1) when none is intact."""

import json
import logging
import shutil
import time

import pytest

from tests.helpers.fault_record import first_step_time, last_line, report
from tests.helpers.flags import TINY
from tests.helpers.runs import checkpoints, losses, run
from trillion.trainer.checkpoint.verify import MANIFEST, damaged_files
from trillion.trainer.cli.main import main


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 1-4 with checkpoints at 2 and 4, as a job cut off there leaves them."""
    out = tmp_path_factory.mktemp("saved")
    run(out, "--checkpoint.interval=2", "--training.exit_interval=4")
    assert checkpoints(out) == ["step-00000002", "step-00000004"]
    return out


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip(path):
    data = bytearray(path.read_bytes())
    start = len(data) // 3
    data[start : start + 4096] = bytes(b ^ 0xFF for b in data[start : start + 4096])
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated shard": ("__0_0.distcp", truncate),
    "flipped bytes": ("__0_0.distcp", flip),
    "missing .metadata": (".metadata", lambda p: p.unlink()),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_previous(case, saved, straight, tmp_path, caplog):
    _, expected = straight
    out = tmp_path / "run"
    shutil.copytree(saved, out)
    name, damage = DAMAGE[case]
    damage(out / "checkpoints" / "step-00000004" / name)
    damaged_at = time.time()
    with caplog.at_level(logging.INFO, logger="trillion"):
        run(out, "--checkpoint.interval=2", "--training.exit_interval=2")
    assert "step-00000004 IS DAMAGED" in caplog.text and name in caplog.text
    assert "resumed from" in caplog.text and "step 2" in caplog.text
    assert losses(out) == expected[:4]  # steps 3-4 again from step 2: the unbroken run's losses, bitwise
    assert (out / "checkpoints" / "damaged-step-00000004" / MANIFEST).is_file()  # kept for inspection
    report(
        f"corrupted newest checkpoint: {case}",
        last_line(caplog.text, "IS DAMAGED").split(". Set aside")[0],
        2,
        True,
        first_step_time(out / "metrics.jsonl", 3) - damaged_at,
        f"{name} of step-00000004 damaged after a job stopped at step 4 (checkpoints at 2 and 4); same command again",
    )


def test_no_intact_checkpoint_is_one_paragraph_exit_1(saved, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(saved, out)
    for step in ("step-00000002", "step-00000004"):
        truncate(out / "checkpoints" / step / "__0_0.distcp")
    assert main(["train", *TINY, "--training.steps=6", f"--job.output_dir={out}"]) == 1
    err = capsys.readouterr().err
    assert "No intact checkpoint" in err and "Traceback" not in err
    assert not (out / "checkpoints" / "step-00000006").exists()


def test_intact_checkpoint_verifies_and_shares_split_over_ranks(saved):
    folder = saved / "checkpoints" / "step-00000004"
    manifest = json.loads((folder / MANIFEST).read_text())
    assert {"__0_0.distcp", ".metadata", "config.toml"} <= set(manifest) and not list(folder.glob(".crc-*"))
    assert damaged_files(folder) == []
    assert damaged_files(folder, 0, 2) == [] and damaged_files(folder, 1, 2) == []


def test_checkpoint_from_before_checksums_loads_unverified_with_a_warning(saved, tmp_path, caplog):
    folder = tmp_path / "step-00000004"
    shutil.copytree(saved / "checkpoints" / "step-00000004", folder)
    (folder / MANIFEST).unlink()  # what an earlier version published
    with caplog.at_level(logging.WARNING, logger="trillion"):
        assert damaged_files(folder) == []
    assert "loading it unverified" in caplog.text
    (folder / ".metadata").unlink()  # without DCP's index nothing can load: damaged
    assert damaged_files(folder) == [f"{MANIFEST} and .metadata are missing"]
