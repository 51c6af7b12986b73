"""Mixtures of experts against Hugging Face transformers (an independent implementation): our
Transformer and MixtralForCausalLM / Qwen3MoeForCausalLM built from hf_config give the same logits
and greedy tokens from the same weights (float64); weights round-trip exactly through both expert
layouts (per expert, as Hub checkpoints and save_pretrained have them, and fused, as transformers
holds them); `trillion export` of a short run loads with from_pretrained and imports back."""

import dataclasses
import json

import pytest
import torch

from tests.helpers.hf_pair import ours_and_theirs_float64
from trillion.models import Transformer
from trillion.models.args import ModelArgs, MoEArgs
from trillion.models.hf import args_from_hf_config, from_hf_state_dict, hf_config, to_hf_state_dict

transformers = pytest.importorskip("transformers")

BASE = ModelArgs(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=320, max_seq_len=64, ffn_dim=96)
MIXTRAL = dataclasses.replace(BASE, rope_theta=1e6, moe=MoEArgs(n_experts=8, top_k=2, expert_ffn_dim=48))
QWEN3_MOE = dataclasses.replace(  # a dense first block (mlp_only_layers), head_dim wider than dim / heads
    BASE,
    rope_theta=1e6,
    norm_eps=1e-6,
    explicit_head_dim=32,
    qk_norm=True,
    moe=MoEArgs(n_experts=8, top_k=2, expert_ffn_dim=48, n_dense_layers=1, aux_loss_coef=0.01),
)
FAMILIES = {"mixtral": (MIXTRAL, "MixtralForCausalLM"), "qwen3_moe": (QWEN3_MOE, "Qwen3MoeForCausalLM")}


def ours_and_theirs(family: str):
    return ours_and_theirs_float64(*FAMILIES[family])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_in_float64(family):
    ours, theirs = ours_and_theirs(family)
    assert type(theirs).__name__ == FAMILIES[family][1]
    assert theirs.config.router_aux_loss_coef == ours.args.moe.aux_loss_coef
    assert theirs.config.output_router_logits is False
    tokens = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, actual = theirs(tokens).logits, ours(tokens)
    # transformers' RMSNorm rounds through float32, hence not float64's last digits
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_matches_transformers(family):
    from trillion.trainer.cli.generate import Sampling, generate

    ours, theirs = ours_and_theirs(family)
    prompt = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(1))
    theirs.generation_config.eos_token_id = None
    expected = theirs.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 12:].tolist()
    greedy = Sampling(max_new_tokens=8, temperature=0)
    with torch.no_grad():
        got = list(generate(ours, prompt[0].tolist(), greedy, vocab_size=320, stop_id=None))
    assert got == expected


@pytest.mark.parametrize("layout", ["legacy", "fused"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_weights_round_trip_exactly_through_both_layouts(family, layout):
    args = dataclasses.replace(FAMILIES[family][0], tie_embeddings=family == "qwen3_moe")
    args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, bias_update_rate=1e-3))
    model = Transformer(args)
    model.init_weights(seed=5)
    state = model.state_dict()
    theirs = to_hf_state_dict(state, args, layout=layout)
    assert not any("expert_bias" in name for name in theirs)  # neither family has the balancing bias
    experts = {n for n in theirs if ".experts." in n}
    moe_layers = [i for i in range(args.n_layers) if args.is_moe_layer(i)]
    if layout == "fused":
        fused = ("gate_up_proj", "down_proj")
        assert experts == {f"model.layers.{i}.mlp.experts.{p}" for i in moe_layers for p in fused}
    else:
        block, leaf = ("block_sparse_moe", "w1") if family == "mixtral" else ("mlp", "gate_proj")
        assert f"model.layers.1.{block}.experts.7.{leaf}.weight" in experts and len(experts) == 3 * 8 * len(moe_layers)
    if args.tie_embeddings:
        theirs.pop("lm_head.weight")  # as the export and tied checkpoints store it
    back = from_hf_state_dict(theirs, args)
    assert sorted(back) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name
    # a run may start from these weights with its own routing (a capacity factor no HF family has)
    dropping = dataclasses.replace(args, moe=dataclasses.replace(args.moe, capacity_factor=1.25))
    assert sorted(from_hf_state_dict(theirs, dropping)) == sorted(state)


@pytest.mark.parametrize("layout", ["legacy", "fused"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_from_pretrained_loads_either_layout_with_our_weights(family, layout, tmp_path):
    from safetensors.torch import save_file

    args = FAMILIES[family][0]
    model = Transformer(args)
    model.init_weights(seed=2)
    save_file(to_hf_state_dict(model.state_dict(), args, layout=layout), str(tmp_path / "model.safetensors"))
    hf_config(args).save_pretrained(str(tmp_path))
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    expected = to_hf_state_dict(model.state_dict(), args, layout="fused")  # what transformers holds
    assert sorted(theirs.state_dict()) == sorted(expected)
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_the_published_presets_map_to_their_family_and_back(preset):
    from trillion.models import PRESETS

    config = json.loads(hf_config(PRESETS[preset]).to_json_string())
    assert config["model_type"] == ("mixtral" if preset.startswith("mixtral") else "qwen3_moe")
    assert args_from_hf_config(config) == PRESETS[preset]
    with pytest.raises(ValueError, match="rope_scaling of type 'yarn'"):
        args_from_hf_config({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize("family", list(FAMILIES))
def test_config_maps_back_to_the_same_args(family):
    args = FAMILIES[family][0]
    config = json.loads(hf_config(args).to_json_string())
    if family == "mixtral":  # no dense blocks: its one width is the experts'
        args = dataclasses.replace(args, ffn_dim=args.moe.expert_ffn_dim)
    assert args_from_hf_config(config) == args
    if family == "qwen3_moe":
        assert config["mlp_only_layers"] == [0] and config["decoder_sparse_step"] == 1 and config["head_dim"] == 32
        assert config["intermediate_size"] == 96 and config["moe_intermediate_size"] == 48
        assert config["norm_topk_prob"] is True


@pytest.mark.parametrize(
    "change, named",
    [
        ({"n_shared_experts": 1}, "n_shared_experts"),
        ({"score_func": "sigmoid"}, "score_func"),
        ({"n_groups": 2, "topk_groups": 1}, "n_groups"),
        ({"n_dense_layers": 1}, "n_dense_layers"),  # Mixtral only
        ({"route_norm": False}, "route_norm"),  # Mixtral only
    ],
)
def test_what_a_family_cannot_express_is_refused_by_name(change, named):
    args = dataclasses.replace(MIXTRAL, moe=dataclasses.replace(MIXTRAL.moe, **change))
    with pytest.raises(ValueError, match=named):
        hf_config(args)
    with pytest.raises(ValueError, match=named):
        to_hf_state_dict({}, args)
    qwen = dataclasses.replace(QWEN3_MOE, moe=dataclasses.replace(QWEN3_MOE.moe, **change))
    if named in ("n_dense_layers", "route_norm"):
        hf_config(qwen)  # Qwen3-MoE has both: mlp_only_layers, norm_topk_prob
    else:
        with pytest.raises(ValueError, match=named):
            hf_config(qwen)


# `trillion export` of short runs: the two families as presets the run config can name.
RUN_PRESETS = {
    "tiny-mixtral": dataclasses.replace(MIXTRAL, n_layers=1, vocab_size=320, max_seq_len=64, ffn_dim=128),
    "tiny-qwen3-moe": dataclasses.replace(QWEN3_MOE, vocab_size=320, max_seq_len=64, ffn_dim=128),
}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("preset", list(RUN_PRESETS))
def test_export_of_a_run_loads_in_transformers_and_imports_back(preset, tmp_path, monkeypatch):
    from tests.helpers.runs import run
    from trillion.models import presets
    from trillion.trainer.checkpoint.export import load_checkpoint_model
    from trillion.trainer.checkpoint.state import ModelParts, load_model_weights
    from trillion.trainer.cli.main import main

    monkeypatch.setitem(presets.PRESETS, preset, RUN_PRESETS[preset])
    source, out = tmp_path / "source", tmp_path / "hf"
    layers = ["--model.n_layers=2"] if preset == "tiny-qwen3-moe" else []
    run(source, f"--model.name={preset}", *layers, steps=2)
    assert main(["export", "--checkpoint", str(source), "--format", "hf", str(out)]) == 0

    step = source / "checkpoints" / "step-00000002"
    ours = load_checkpoint_model(step).eval()
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(theirs).__name__ == ("MixtralForCausalLM" if "mixtral" in preset else "Qwen3MoeForCausalLM")
    tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs.eval()(tokens).logits, atol=2e-5, rtol=1e-4)

    # the folder's config.json alone describes the model (`trillion generate` of a folder with no run config)
    same = ("attention_impl", "norm_impl") + (("ffn_dim",) if "mixtral" in preset else ())  # Mixtral: no dense width
    imported = args_from_hf_config(json.loads((out / "config.json").read_text()))
    assert dataclasses.replace(imported, **{k: getattr(ours.args, k) for k in same}, moe=ours.args.moe) == ours.args
    assert dataclasses.replace(imported.moe, experts_impl=ours.args.moe.experts_impl) == ours.args.moe

    from trillion.trainer.cli.generate import load_for_generation

    from_folder, _ = load_for_generation(out, torch.device("cpu"))  # `trillion generate --checkpoint OUT`
    with torch.no_grad():
        torch.testing.assert_close(from_folder(tokens), ours(tokens), atol=0, rtol=0)

    # --checkpoint.initial_load of the folder (load_model_weights is its path) gives exactly the trained weights
    fresh = load_checkpoint_model(step)
    with torch.no_grad():
        for param in fresh.parameters():
            param.zero_()
    load_model_weights(out, [fresh], fresh.args, "--checkpoint.initial_load")
    expected = ModelParts([ours]).state_dict()
    for name, tensor in ModelParts([fresh]).state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_export_refuses_by_name_what_no_family_expresses(tmp_path, monkeypatch):
    from trillion.errors import ConfigError
    from trillion.trainer.checkpoint import export

    shared = dataclasses.replace(MIXTRAL, moe=dataclasses.replace(MIXTRAL.moe, n_shared_experts=1))  # as debug-moe
    monkeypatch.setattr(export, "load_checkpoint_model", lambda step, weights: Transformer(shared))
    with pytest.raises(ConfigError, match="n_shared_experts=1"):
        export.export_hf(tmp_path / "step-00000001", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()  # refused before anything is written
