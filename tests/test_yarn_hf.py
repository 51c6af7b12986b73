"""YaRN's attention factor against transformers for the configs whose factor is not 1.

Every preset sets mscale == mscale_all_dim, which makes the factor that multiplies the rotary table exactly
1.0: a table scaled wrongly (only its cosines, say) or a config imported with the wrong default would pass
every other test. Here the factor is not 1: mscale and mscale_all_dim differ, or one of them (or both) is
missing from the Hub's config.json. The table is compared with transformers' from the same config.json, the
exported config with that one, and the logits with transformers' model in float64."""

import json

import pytest
import torch

from tests.helpers.hf_pair import ours_and_theirs_float64
from trillion.models import PRESETS
from trillion.models.hf import args_from_hf_config, hf_config
from trillion.models.rope import model_rope_cache, yarn_attention_factor

transformers = pytest.importorskip("transformers")

FACTOR, ORIGINAL = 40.0, 16  # DeepSeek's factor, at a debug context (stretched to 640 positions)
MSCALES = {  # the mscale keys of rope_scaling, and transformers' attention factor they give at factor 40
    "mscale_differs": ({"mscale": 1.0, "mscale_all_dim": 0.707}, 1.0857),
    "mscale_all_dim_zero": ({"mscale": 0.707, "mscale_all_dim": 0.0}, 1.3689),
    "only_mscale": ({"mscale": 0.707}, 1.3689),
    "only_mscale_all_dim": ({"mscale_all_dim": 0.707}, 1.3689),
    "neither": ({}, 1.3689),
}


def _hub_config(mscales: dict) -> dict:
    """debug-deepseek's config.json (MTP off) with DeepSeek's rope_scaling as the Hub writes it."""
    config = json.loads(hf_config(PRESETS["debug-deepseek"]).to_json_string())
    theta = config.pop("rope_parameters")["rope_theta"]
    scaling = {"type": "yarn", "factor": FACTOR, "original_max_position_embeddings": ORIGINAL, **mscales}
    return {**config, "rope_theta": theta, "rope_scaling": scaling, "max_position_embeddings": int(FACTOR * ORIGINAL)}


def _transformers_table(config) -> tuple[torch.Tensor, float]:
    """cos and sin as transformers' YaRN rope computes them (its rope init), and its attention factor."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    angles = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()]).repeat(1, 1, 2) * factor, factor


@pytest.mark.parametrize("case", list(MSCALES))
def test_yarn_table_matches_transformers_when_the_attention_factor_is_not_one(case):
    mscales, factor = MSCALES[case]
    hub = _hub_config(mscales)
    args = args_from_hf_config(hub)
    expected, their_factor = _transformers_table(transformers.DeepseekV3Config(**hub))
    assert their_factor == pytest.approx(factor, abs=1e-4)  # not 1: a wrong factor shows in the table
    assert yarn_attention_factor(args.yarn) == pytest.approx(their_factor, rel=1e-12)
    torch.testing.assert_close(model_rope_cache(args), expected, atol=0, rtol=0)
    _, exported_factor = _transformers_table(hf_config(args))  # what our export tells transformers
    assert exported_factor == pytest.approx(their_factor, rel=1e-12)


@pytest.mark.parametrize("case", ["mscale_differs", "only_mscale_all_dim"])
def test_yarn_logits_match_transformers_when_the_attention_factor_is_not_one(case):
    """The whole model in float64 from the imported config: the table's factor reaches the logits."""
    args = args_from_hf_config(_hub_config(MSCALES[case][0]))
    ours, theirs = ours_and_theirs_float64(args, "DeepseekV3ForCausalLM", perturbed=("norm", "expert_bias"))
    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, actual = theirs(tokens).logits, ours(tokens)
    # transformers' RMSNorm and router round through float32, hence not float64's last digits
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6)
