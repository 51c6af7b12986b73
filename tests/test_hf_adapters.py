"""The registry of Hugging Face family adapters (models/hf.py): every ModelArgs has exactly one family,
export and import name the same one, and every message that lists families takes the list from it."""

import dataclasses
import json

import pytest

from trillion.models import PRESETS
from trillion.models.hf import (
    ADAPTERS,
    BY_MODEL_TYPE,
    adapter_for_args,
    args_from_hf_config,
    family_classes,
    hf_config,
)

pytest.importorskip("transformers")

# debug-moe's and llama4-scout's shared expert beside non-latent attention: no family of Trillion's has it
EXPRESSIBLE = [name for name in PRESETS if name not in ("debug-moe", "llama4-scout")]


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_is_claimed_by_exactly_one_family(preset):
    assert [adapter.model_type for adapter in ADAPTERS if adapter.claims(PRESETS[preset])] == [
        adapter_for_args(PRESETS[preset]).model_type
    ]


@pytest.mark.parametrize("preset", EXPRESSIBLE)
def test_export_and_import_choose_the_same_family(preset):
    config = json.loads(hf_config(PRESETS[preset]).to_json_string())
    assert config["model_type"] == adapter_for_args(PRESETS[preset]).model_type
    assert BY_MODEL_TYPE[config["model_type"]] is adapter_for_args(PRESETS[preset])


def test_an_unknown_model_type_is_refused_naming_every_registered_one():
    with pytest.raises(ValueError) as refused:
        args_from_hf_config({"model_type": "mamba"})
    assert all(model_type in str(refused.value) for model_type in BY_MODEL_TYPE)
    assert "kimi_k2" in BY_MODEL_TYPE  # published in DeepSeek-V3's layout under a model_type of its own


def test_the_export_refusal_lists_every_family_class():
    assert all(adapter.hf_class in family_classes() for adapter in ADAPTERS)


@pytest.mark.parametrize(
    "preset, change, named",
    [
        ("debug", {"norm": "layernorm"}, "model.norm"),
        ("debug", {"positions": "learned"}, "model.positions"),
        ("debug", {"qk_norm": True}, "model.qk_norm"),
        ("debug", {"explicit_head_dim": 64}, "model.explicit_head_dim"),
        ("debug-gpt", {"norm": "rmsnorm"}, "model.norm"),
        ("debug-gpt", {"n_kv_heads": 4}, "model.n_kv_heads"),
        ("debug-gpt", {"bias": False}, "model.bias"),
    ],
)
def test_what_a_dense_family_cannot_express_is_refused_by_name(preset, change, named):
    args = dataclasses.replace(PRESETS[preset], **change)
    with pytest.raises(ValueError, match=f"{adapter_for_args(args).hf_class} cannot express this model: .*{named}"):
        hf_config(args)
