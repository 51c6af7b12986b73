"""Bad input stops `trillion train` before any work, with one paragraph naming the setting and a fix."""

import json
import subprocess
import sys

import pytest

from trillion.trainer.cli.main import main


def run_cli(args, capsys):
    status = main(["train", *args])
    return status, capsys.readouterr().err


@pytest.fixture
def empty_jsonl(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n".join(json.dumps({"text": ""}) for _ in range(3)) + "\n")
    return path


CASES = {
    "unknown preset": (["--model.name=gpt-9000"], ["model.name", "debug", "gpt-1t"]),
    "heads do not divide hidden": (["--model.n_heads=7"], ["model.n_heads=7", "model.dim=256", "e.g. 8"]),
    "kv heads do not divide heads": (["--model.n_kv_heads=3"], ["model.n_kv_heads=3", "model.n_heads=8"]),
    "missing data file": (["--data.path=/nonexistent/corpus.jsonl"], ["data.path", "no such file"]),
    "seq_len beyond the model": (["--training.seq_len=4096"], ["training.seq_len=4096", "1024"]),
    "unknown config key": (["--training.stepz=3"], ["training.stepz", "steps"]),
    "unknown section": (["--trainer.steps=3"], ["trainer.steps", "Sections"]),
    "wrong type": (["--training.steps=many"], ["--training.steps", "int"]),
    "batch not divisible": (
        ["--training.global_batch_size=6", "--training.micro_batch_size=4"],
        ["global_batch_size=6", "micro_batch_size=4"],
    ),
    "unknown tokenizer file": (
        ["--tokenizer.kind=hf", "--tokenizer.path=/no/tokenizer.json"],
        ["tokenizer.path", "byte"],
    ),
    "vocabulary too small": (["--model.vocab_size=128"], ["257 ids", "--model.vocab_size=320"]),
    "unknown dtype": (["--training.dtype=fp8"], ["training.dtype", "bf16"]),
    "missing config file": (["--config", "/no/such.toml"], ["--config", "no such file"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_user_error_names_setting_and_fix(case, capsys, tmp_path):
    args, expected = CASES[case]
    out = tmp_path / "run"
    status, err = run_cli([*args, f"--job.output_dir={out}", "--logging.wandb=false"], capsys)
    assert status == 2
    for fragment in expected:
        assert fragment in err, (fragment, err)
    assert not out.exists(), "an invalid run must not start writing its run directory"


def test_empty_dataset(empty_jsonl, capsys, tmp_path):
    out = tmp_path / "run"
    status, err = run_cli([f"--data.path={empty_jsonl}", f"--job.output_dir={out}"], capsys)
    assert status == 2 and "holds no text" in err and "data.text_field" in err
    assert not out.exists()


def test_wrong_text_field(empty_jsonl, capsys, tmp_path):
    status, err = run_cli(
        [f"--data.path={empty_jsonl}", "--data.text_field=body", f"--job.output_dir={tmp_path}/r"], capsys
    )
    assert status == 2 and "data.text_field='body'" in err and "text" in err


def test_error_is_one_paragraph_without_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "trillion", "train", "--model.name=nope"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0 and "model.name='nope'" in result.stderr
