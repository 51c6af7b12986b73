"""Config: TOML, command-line overrides, help, the resolved file."""

import dataclasses

import pytest

from trillion.errors import ConfigError
from trillion.trainer.config.schema import Config, help_text, load_config, to_toml


def test_toml_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[training]\nsteps = 50\nseq_len = 128\n[optimizer]\nlr = 1e-4\n[logging]\nwandb = false\n")
    config = load_config(str(path), ["--training.steps=7", "--model.name=debug-gpt", "--optimizer.lr=2e-4"])
    assert config.training.steps == 7 and config.training.seq_len == 128
    assert config.optimizer.lr == 2e-4 and config.model.name == "debug-gpt" and config.logging.wandb is False


def test_values_are_typed():
    config = load_config(None, ["--training.steps=2e3", "--logging.wandb=off", "--metrics.peak_tflops=100"])
    assert config.training.steps == 2000 and config.logging.wandb is False and config.metrics.peak_tflops == 100.0
    with pytest.raises(ConfigError, match="is not a valid bool"):
        load_config(None, ["--logging.wandb=maybe"])


def test_toml_type_errors_name_the_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[training]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match="training.steps"):
        load_config(str(path))


def test_resolved_config_round_trips(tmp_path):
    config = load_config(None, ['--job.output_dir=out/with "quotes"', "--training.steps=3", "--lr_schedule.name=wsd"])
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(config))
    assert load_config(str(path)) == config


def test_help_lists_every_field_with_its_doc():
    text = help_text()
    for section in dataclasses.fields(Config):
        for field in dataclasses.fields(section.default_factory):
            assert f"--{section.name}.{field.name} " in text
            assert field.metadata["doc"] in text


def test_every_preset_is_listed_in_help_and_in_the_preset_error():
    # The lists are read from the presets' registry, so a new preset cannot be left out of either.
    from trillion.models.presets import PRESETS

    lines = help_text().splitlines()
    choices = lines[lines.index(next(line for line in lines if "--model.name " in line)) + 2]
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["--model.name=no-such-model"])
    for name in PRESETS:
        assert name in choices.removeprefix("      One of: ").rstrip(".").split(", ")
        assert name in str(refused.value)
