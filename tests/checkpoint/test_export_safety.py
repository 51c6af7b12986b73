"""`trillion export` and `trillion generate` as careful as training: export never replaces a folder's
files, reads only checkpoints whose files match their manifest (falling back to the intact one beside
a damaged one), leaves nothing half-written on a full disk, and writes files as readable as any other."""

import errno
import os
import stat

import pytest

from tests.helpers.fault_record import report
from tests.helpers.runs import run
from trillion.trainer.cli.main import main

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A run with checkpoints at steps 1 and 2."""
    out = tmp_path_factory.mktemp("export") / "run"
    run(out, "--checkpoint.interval=1", "--checkpoint.keep_latest=2", steps=2)
    return out


def export(source, out) -> int:
    return main(["export", "--checkpoint", str(source), "--format", "hf", str(out)])


def shard(step):
    return next(p for p in sorted(step.iterdir()) if p.suffix == ".distcp")


def test_export_refuses_a_non_empty_folder(source, tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert export(source, tmp_path / "hf") == 2
    err = capsys.readouterr().err
    assert "not an empty folder" in err and "Give a new OUT folder" in err and "Traceback" not in err
    assert (tmp_path / "hf" / "config.json").read_text() == "{}"
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json"]
    report("export into a non-empty folder", err.strip().splitlines()[-1], None, None, None, "export refuses, exit 2")


def test_exported_files_are_readable_like_any_other(source, tmp_path):
    old = os.umask(0o022)
    try:
        assert export(source, tmp_path / "hf") == 0
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()}
    assert set(modes) >= {"model.safetensors", "config.json"} and set(modes.values()) == {0o644}, modes


def test_a_damaged_shard_is_named_and_the_intact_checkpoint_beside_it_used(source, tmp_path, caplog, capsys):
    damaged = source / "checkpoints" / "step-00000002"
    path = shard(damaged)
    original = path.read_bytes()
    try:
        path.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # one flipped bit
        assert export(source, tmp_path / "hf") == 0
        assert "step-00000001" in capsys.readouterr().out
        assert "CHECKPOINT" in caplog.text and "IS DAMAGED" in caplog.text and "CRC-32 differs" in caplog.text
        path.write_bytes(original[: len(original) // 2])  # truncated: generate says so, and uses step 1
        caplog.clear()
        assert main(["generate", "--checkpoint", str(source), "--max-new-tokens", "2", "--prompt", "a"]) == 0
        assert "truncated" in caplog.text and "step-00000001" in caplog.text
        capsys.readouterr()
        assert export(damaged, tmp_path / "again") == 1  # a damaged step named directly: refused, never swapped
        err = capsys.readouterr().err
        assert "IS DAMAGED" in err and f"give the intact {source / 'checkpoints' / 'step-00000001'}" in err
        assert not (tmp_path / "again").exists() and damaged.is_dir()  # read-only: not set aside as training does
    finally:
        path.write_bytes(original)
    warning = next(line for line in caplog.text.splitlines() if "IS DAMAGED" in line)
    report(
        "export or generate from a damaged checkpoint",
        warning.split("WARNING")[-1].strip(),
        None,
        None,
        None,
        "the damage named, the intact checkpoint beside it read",
    )


def test_a_full_disk_leaves_nothing_half_written(source, tmp_path, monkeypatch, capsys):
    import safetensors.torch

    def full(tensors, filename, metadata=None):
        with open(filename, "wb") as handle:
            handle.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    assert export(source, tmp_path / "hf") == 1
    err = capsys.readouterr().err
    assert "the disk is full" in err and str(tmp_path / "hf") in err and "Traceback" not in err
    assert not (tmp_path / "hf").exists()
    (tmp_path / "empty").mkdir()
    assert export(source, tmp_path / "empty") == 1
    assert list((tmp_path / "empty").iterdir()) == []
