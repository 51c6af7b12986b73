"""Config errors say where the value was written: a TOML file's line, or the flag. One rule for
booleans (and every type): a TOML value is of its TOML type; only command-line text is parsed. The
missing-manifest message gives a prepare-data command that works."""

import pytest

from tests.helpers.fault_record import report
from trillion.errors import ConfigError
from trillion.trainer.cli.main import main
from trillion.trainer.config.schema import load_config
from trillion.trainer.data.token_store import TokenStore


def test_a_wrong_type_in_toml_names_the_file_line_and_key(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('# a comment\n[training]\nseq_len = 64\nsteps = "five"\n')
    with pytest.raises(ConfigError) as refused:
        load_config(str(path))
    message = str(refused.value)
    assert f"{path}, line 4" in message and "training.steps" in message and "steps = 8" in message
    assert "--training.steps" not in message
    report(
        "a wrong type in a TOML file",
        message.replace(str(tmp_path), "<dir>"),
        None,
        None,
        None,
        "refused before any work, exit 2",
    )


@pytest.mark.parametrize("value", ['"yes"', "1", '"true"'])
def test_a_toml_boolean_must_be_true_or_false(tmp_path, value):
    path = tmp_path / "run.toml"
    path.write_text(f"[logging]\nwandb = {value}\n")
    with pytest.raises(
        ConfigError, match=r"line 2: wandb = .* not a valid bool \(logging.wandb\)\. Write true or false"
    ):
        load_config(str(path))


def test_command_line_booleans_are_parsed_from_text():
    for text, expected in [("true", True), ("1", True), ("yes", True), ("off", False), ("0", False), ("no", False)]:
        assert load_config(None, [f"--logging.wandb={text}"]).logging.wandb is expected
    with pytest.raises(ConfigError, match=r"--logging.wandb='maybe' is not a valid bool"):
        load_config(None, ["--logging.wandb=maybe"])


def test_the_missing_manifest_message_gives_a_command_prepare_data_accepts(tmp_path, capsys):
    folder = tmp_path / "tokens"
    folder.mkdir()
    with pytest.raises(ConfigError) as refused:
        TokenStore(folder)
    command = str(refused.value).split("`")[1]
    assert command.startswith("trillion prepare-data --out ") and str(folder) != command.split()[-1]
    fresh = command.split()[-1]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "def f(x):\\n    return x\\n"}\n' * 4)
    assert main(["prepare-data", "--out", fresh, "--workers", "1", f"--data.path={corpus}"]) == 0
    assert TokenStore(fresh).n_tokens > 0
    with pytest.raises(ConfigError, match=rf"prepare-data --out {tmp_path / 'absent'}` "):
        TokenStore(tmp_path / "absent")
