"""Latent attention's accounting and its published shapes: parameter counts of the DeepSeek/Kimi presets against
their publishers' totals, FLOPs against PyTorch's counter, the YaRN table and softmax scale against
transformers' DeepSeek-V3, and the layouts tensor parallelism cannot split refused by name."""

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from trillion.errors import ConfigError
from trillion.models import PRESETS, Transformer
from trillion.models.flops import count_params, model_flops_per_token
from trillion.models.mla import softmax_scale
from trillion.models.rope import model_rope_cache
from trillion.parallel.dims import check_layout
from trillion.parallel.layout import layout_on


@pytest.mark.parametrize(
    "preset, total, active, input_embedding_active",
    [  # the publishers' figures (model cards, technical reports); MTP modules are not in these presets' counts
        ("deepseek-v3-671b", 671e9, 37e9, True),
        ("kimi-k2", 1.04e12, 32.6e9, True),  # Kimi K2's report; our count of its config.json shapes: 1.026e12
        ("deepseek-v2-lite", 15.7e9, 2.4e9, False),  # DeepSeek's 2.4B leaves out the input embedding (0.21B)
        ("moonlight-16b-a3b", 16e9, 3e9, True),
    ],
)
def test_the_presets_have_their_published_sizes(preset, total, active, input_embedding_active):
    counted = count_params(PRESETS[preset])
    assert counted.total == pytest.approx(total, rel=0.025)
    embedding = 0 if input_embedding_active else counted.embedding
    assert counted.active - embedding == pytest.approx(active, rel=0.1)


def test_model_flops_count_attention_at_the_query_key_and_value_widths():
    """Dense blocks (no experts), so every parameter is active: the counted matmul FLOPs are the formula's,
    with the scores at qk_head_dim and the weighted values at v_head_dim, less the norm gains."""
    args = dataclasses.replace(PRESETS["debug-deepseek"], n_layers=2, moe=None, mtp_modules=0, attention_impl="eager")
    assert args.mla.qk_head_dim != args.mla.v_head_dim
    model = Transformer(args)
    model.init_weights(0)
    tokens = torch.randint(0, args.vocab_size, (2, 64))
    with FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    elementwise = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert counter.get_total_flops() / tokens.numel() == model_flops_per_token(args, 64) - 6 * elementwise


@pytest.mark.parametrize("preset", ["deepseek-v3-671b", "kimi-k2", "deepseek-v2-lite"])
def test_yarn_table_and_softmax_scale_are_transformers(preset):
    """YaRN as transformers computes it from the same config (its frequencies, cos/sin factor, mscale^2)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    from trillion.models.hf import hf_config

    args = dataclasses.replace(PRESETS[preset], max_seq_len=4096)
    config = hf_config(PRESETS[preset])
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    angles = torch.outer(torch.arange(4096, dtype=torch.float32), inv_freq)
    expected = torch.stack([angles.cos(), angles.sin()]).repeat(1, 1, 2) * factor
    torch.testing.assert_close(model_rope_cache(args), expected, atol=0, rtol=0)
    attention_class = DeepseekV3Attention if config.model_type == "deepseek_v3" else DeepseekV2Attention
    with torch.device("meta"):
        attention = attention_class(config, 0)
    assert softmax_scale(args) == pytest.approx(attention.scaling, rel=1e-12)
    assert softmax_scale(args) > 192**-0.5  # the mscale_all_dim correction is on in all three


def test_tensor_parallel_degrees_that_do_not_split_the_heads_are_refused():
    args = PRESETS["debug-deepseek"]
    with pytest.raises(ConfigError, match="parallel.tp=3 does not divide model.n_heads=8"):
        check_layout(layout_on(tp=3, dp_shard=1, world_size=3), args, 64)
