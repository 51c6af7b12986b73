"""Lists a person reads are generated from their source of truth, so a new preset or family cannot be left out:
every preset in `trillion train --help` and in the preset errors, every MoE preset in the error for MoE
settings on a dense model, every Hugging Face family in the registry's messages."""

import pytest

from trillion.errors import ConfigError
from trillion.models import get_preset
from trillion.models.hf import ADAPTERS, family_classes, model_types
from trillion.models.parts import apply_settings
from trillion.models.presets import PRESETS, expert_presets
from trillion.parallel.layout import Layout
from trillion.trainer.assemble import part_settings
from trillion.trainer.config import Config, help_text


def test_every_preset_is_in_the_help():
    text = help_text()
    assert [name for name in PRESETS if name not in text] == []


def test_every_preset_is_in_the_unknown_preset_error():
    with pytest.raises(ConfigError) as error:
        get_preset("no-such-model")
    assert [name for name in PRESETS if name not in str(error.value)] == []


def test_every_expert_preset_is_in_the_dense_model_error():
    config = Config()
    config.model.n_experts = 4
    with pytest.raises(ConfigError) as error:
        apply_settings(get_preset("debug"), part_settings(config, Layout()))
    named = expert_presets()
    assert {"debug-moe", "deepseek-v3-671b", "kimi-k2"} <= set(named)
    assert [name for name in named if name not in str(error.value)] == []


def test_every_family_is_in_the_registry_messages():
    assert all(adapter.hf_class in family_classes() for adapter in ADAPTERS)
    assert all(adapter.model_type in model_types() for adapter in ADAPTERS)
