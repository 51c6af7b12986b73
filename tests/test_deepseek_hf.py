"""Latent attention against Hugging Face transformers (an independent implementation, float64): our Transformer
and DeepseekV3ForCausalLM / DeepseekV2ForCausalLM built offline from hf_config give the same logits, every
gradient of debug-deepseek and the same greedy tokens from the same weights (the rotary rows permuted between
our half-split layout and their interleaved pairs); weights round-trip exactly; from_pretrained loads what the
export writes; the published presets map to their family and back."""

import dataclasses
import functools
import json

import pytest
import torch

from tests.helpers.hf_pair import ours_and_theirs_float64
from trillion.models import PRESETS, Transformer
from trillion.models.args import YaRNArgs
from trillion.models.hf import args_from_hf_config, from_hf_state_dict, hf_config, to_hf_state_dict

transformers = pytest.importorskip("transformers")

# MTP and the sequence-wise balance loss off: neither is exported, and transformers' training forward has neither
_DEBUG = PRESETS["debug-deepseek"]
V3 = dataclasses.replace(
    _DEBUG, mtp_modules=0, mtp_loss_weight=0.0, moe=dataclasses.replace(_DEBUG.moe, seq_aux_loss_coef=0.0)
)
_V2_MOE = dict(score_func="softmax", route_norm=False, n_groups=1, topk_groups=1, route_scale=1.5, bias_update_rate=0)
V2 = dataclasses.replace(  # DeepSeek-V2-Lite's kind at debug size: full-rank queries, softmax scores, YaRN
    V3,
    n_layers=3,
    max_seq_len=64,
    mla=dataclasses.replace(V3.mla, q_lora_rank=0),
    moe=dataclasses.replace(V3.moe, **_V2_MOE),
    yarn=YaRNArgs(factor=40, original_max_seq_len=16, mscale=0.707, mscale_all_dim=0.707),
)
FAMILIES = {"deepseek_v3": (V3, "DeepseekV3ForCausalLM"), "deepseek_v2": (V2, "DeepseekV2ForCausalLM")}


@functools.cache  # built once per family for the tests below (each sets the mode it needs)
def ours_and_theirs(family: str):
    """Norm weights and the balancing bias perturbed (the bias is exported as e_score_correction_bias)."""
    return ours_and_theirs_float64(*FAMILIES[family], perturbed=("norm", "expert_bias"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_in_float64(family):
    ours, theirs = (model.eval() for model in ours_and_theirs(family))
    assert type(theirs).__name__ == FAMILIES[family][1]
    tokens = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, actual = theirs(tokens).logits, ours(tokens)
    # transformers' RMSNorm and router round through float32, hence not float64's last digits
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6)


def test_debug_deepseek_logits_and_every_gradient_match_a_float64_reference():
    """debug-deepseek whole (MTP off), one training forward and backward: transformers' DeepseekV3 in float64
    is the reference; its gradients map to our names through the import (which un-permutes the rotary rows)."""
    ours, theirs = ours_and_theirs("deepseek_v3")
    for model in (ours, theirs):
        model.train().zero_grad(set_to_none=True)
    tokens = torch.randint(0, 320, (2, 65), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits, expected = ours(inputs), theirs(inputs).logits
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=1e-6)
    for model_logits in (logits, expected):
        torch.nn.functional.cross_entropy(model_logits.flatten(0, 1), targets.flatten()).backward()
    their_grads = {name: p.grad for name, p in theirs.named_parameters()}
    mapped = from_hf_state_dict(their_grads, V3)
    grads = {name: p.grad for name, p in ours.named_parameters()}
    assert sorted(grads) == sorted(n for n in mapped if "expert_bias" not in n)
    for name, grad in grads.items():
        scale = grad.abs().max().item()
        assert scale > 0, name  # every parameter takes part (the experts too: 2 x 64 tokens reach them)
        torch.testing.assert_close(grad, mapped[name], atol=1e-6 * max(scale, 1e-3), rtol=1e-5, msg=name)


def test_greedy_generation_matches_transformers():
    from trillion.trainer.cli.generate import Sampling, generate

    ours, theirs = (model.eval() for model in ours_and_theirs("deepseek_v3"))
    prompt = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(1))
    theirs.generation_config.eos_token_id = None
    expected = theirs.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 12:].tolist()
    greedy = Sampling(max_new_tokens=8, temperature=0)
    with torch.no_grad():  # our generation runs on the KV cache (the expanded keys and values)
        got = list(generate(ours, prompt[0].tolist(), greedy, vocab_size=320, stop_id=None))
    assert got == expected


@pytest.mark.parametrize("layout", ["legacy", "fused"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_weights_round_trip_exactly(family, layout):
    args = FAMILIES[family][0]
    model = Transformer(args)
    model.init_weights(seed=5)
    state = model.state_dict()
    theirs = to_hf_state_dict(state, args, layout=layout)
    bias = [n for n in theirs if n.endswith("e_score_correction_bias")]
    assert len(bias) == (args.n_layers - 1 if family == "deepseek_v3" else 0)  # DeepseekV2 has no such bias
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in theirs
    back = from_hf_state_dict(theirs, args)
    assert sorted(back) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name
    # a checkpoint's multi-token prediction layer (DeepSeek-V3's model.layers.61) is left out
    extra = {k.replace("layers.1.", f"layers.{args.n_layers}.", 1): v for k, v in theirs.items() if ".layers.1." in k}
    assert sorted(from_hf_state_dict({**theirs, **extra}, args)) == sorted(state)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_from_pretrained_loads_our_export_layout(family, tmp_path):
    from safetensors.torch import save_file

    args = FAMILIES[family][0]
    model = Transformer(args)
    model.init_weights(seed=2)
    save_file(to_hf_state_dict(model.state_dict(), args), str(tmp_path / "model.safetensors"))
    hf_config(args).save_pretrained(str(tmp_path))
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    assert type(theirs).__name__ == FAMILIES[family][1]
    expected = to_hf_state_dict(model.state_dict(), args, layout="fused")  # what transformers holds
    assert sorted(theirs.state_dict()) == sorted(expected)
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("preset", ["deepseek-v2-lite", "moonlight-16b-a3b", "deepseek-v3-671b", "kimi-k2"])
def test_the_published_presets_map_to_their_family_and_back(preset):
    args = PRESETS[preset]
    config = json.loads(hf_config(args).to_json_string())
    assert config["model_type"] == ("deepseek_v2" if preset == "deepseek-v2-lite" else "deepseek_v3")
    assert config.get("num_nextn_predict_layers", 0) == 0  # MTP is not exported
    back = args_from_hf_config(config)
    # what config.json does not carry: the training-only MTP and sequence-wise balance loss
    no_training_losses = dataclasses.replace(args.moe, seq_aux_loss_coef=0.0)
    assert back == dataclasses.replace(args, mtp_modules=0, mtp_loss_weight=0.0, moe=no_training_losses)
    hub = {**config, "model_type": "kimi_k2", "rope_scaling": config.pop("rope_parameters")}  # a Hub config.json
    hub["rope_theta"] = hub["rope_scaling"].pop("rope_theta")
    if preset == "kimi-k2":
        assert args_from_hf_config(hub) == back


@pytest.mark.parametrize(
    "family, change, named",
    [
        ("deepseek_v2", {"route_norm": True}, "route_norm"),
        ("deepseek_v2", {"n_groups": 2, "topk_groups": 1}, "n_groups"),
        ("deepseek_v3", {"capacity_factor": 1.25}, "capacity_factor"),
        ("deepseek_v3", {"n_shared_experts": 0}, "n_shared_experts"),
    ],
)
def test_what_a_family_cannot_express_is_refused_by_name(family, change, named):
    args = FAMILIES[family][0]
    args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, **change))
    with pytest.raises(ValueError, match=named):
        hf_config(args)
    with pytest.raises(ValueError, match=named):
        to_hf_state_dict({}, args)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"rope_interleave": False}, "rope_interleave"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "'linear'"),
    ],
)
def test_configs_this_transformer_cannot_compute_are_refused(change, named):
    config = json.loads(hf_config(V3).to_json_string())
    with pytest.raises(ValueError, match=named):
        args_from_hf_config({**config, **change})
