"""Muon's bad input, each through `trillion train` as a user runs it: exit 2 and one paragraph naming the setting
and the fix, raised before any model is built (the optimizer change on resume: tests/muon/test_checkpoint.py)."""

import pytest

from tests.helpers.flags import TINY
from trillion.trainer.cli.main import main

CASES = {
    "Muon settings with adamw": (
        ["--optimizer.momentum=0.9", "--optimizer.qk_clip=100"],
        ("optimizer.momentum=0.9 and optimizer.qk_clip=100.0 do nothing in this run", "--optimizer.name=muon"),
    ),
    "Newton-Schulz steps out of range": (
        ["--optimizer.name=muon", "--optimizer.newton_schulz_steps=0"],
        ("optimizer.newton_schulz_steps=0", "at least 1 and at most 20"),
    ),
    "qk_clip without attention logits to clip": (
        ["--model.name=qwen3-30b-a3b", "--model.n_experts=8", "--optimizer.name=muon", "--optimizer.qk_clip=100"],
        ("optimizer.qk_clip=100", "QK norms", "--optimizer.qk_clip=0"),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_muon_input_is_one_paragraph(case, tmp_path, capsys):
    flags, names = CASES[case]
    assert main(["train", *TINY, f"--job.output_dir={tmp_path}", *flags]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "Traceback" not in error, error
    for name in names:
        assert name in error, error
    assert not (tmp_path / "checkpoints").exists()
