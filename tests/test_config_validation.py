"""Every setting declares its check where it is declared, and every out-of-range value of every field
of every section stops `trillion train` with exit 2, the setting named, no traceback, nothing written."""

import dataclasses
import subprocess
import sys

import pytest

from trillion.errors import ConfigError
from trillion.trainer.cli.main import main
from trillion.trainer.config.checks import Text
from trillion.trainer.config.schema import Config, load_config


def fields():
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory):
            yield section.name, f


def bad_cases():
    for section, f in fields():
        check = f.metadata.get("check")
        for value in check.bad_values() if check is not None else ():
            yield pytest.param(f"{section}.{f.name}", value, id=f"{section}.{f.name}={value}")


def test_every_field_declares_its_check():
    undeclared = [f"{section}.{f.name}" for section, f in fields() if f.metadata.get("check") is None]
    assert not undeclared, (
        f"declare a check in doc(default, text, check) for: {undeclared} (see trainer/config/checks.py)"
    )
    # Only free text has no value to refuse; everything else must offer at least one.
    unwalked = [
        f"{section}.{f.name}"
        for section, f in fields()
        if not f.metadata["check"].bad_values() and not isinstance(f.metadata["check"], Text)
    ]
    assert not unwalked


def test_defaults_pass_their_own_checks():
    defaults = Config()
    refused = []
    for section, f in fields():
        value, check = getattr(getattr(defaults, section), f.name), f.metadata.get("check")
        problem = check.problem(value) if check is not None else None
        if problem:
            refused.append(f"{section}.{f.name}={value!r} {problem}")
    assert not refused
    # and together: no flag at all loads the declared defaults, relations between fields checked too
    assert load_config(None, []) == defaults


@pytest.mark.parametrize(("key", "value"), list(bad_cases()))
def test_out_of_range_value_is_refused(key, value, capsys, tmp_path):
    out = tmp_path / "run"
    args = [f"--{key}={value}"] + ([] if key == "job.output_dir" else [f"--job.output_dir={out}"])
    status = main(["train", *args, "--logging.wandb=false"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert key in err and "Traceback" not in err
    assert not out.exists() and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--training.global_batch_size=6", "--training.micro_batch_size=4"], "micro_batch_size=3"),
        (["--tokenizer.kind=hf"], "tokenizer.path"),
    ],
)
def test_relations_between_fields(args, named):
    with pytest.raises(ConfigError, match=named):
        load_config(None, args)


def test_issue_examples_exit_2_without_traceback(tmp_path, capsys):
    """The settings the issue found ending in tracebacks or training anyway; one through the real command."""
    (tmp_path / "file").write_text("a file, not a folder")
    for bad in [
        "--optimizer.lr=-1",
        "--metrics.log_freq=0",
        "--optimizer.weight_decay=-0.1",
        "--lr_schedule.warmup_steps=-1",
        f"--job.output_dir={tmp_path}/file/run",
    ]:
        assert main(["train", bad, f"--job.output_dir={tmp_path}/run"][: 3 if "output_dir" not in bad else 2]) == 2
        assert bad[2:].split("=")[0] in capsys.readouterr().err
    result = subprocess.run(
        [sys.executable, "-m", "trillion", "train", "--optimizer.beta2=1.5"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2 and "optimizer.beta2=1.5" in result.stderr and "below 1" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "run").exists()
