"""The planner's DeepSeek blocks (as models/parts declares them): multi-head latent attention, multi-token prediction
and the DeepSeek MoE block, against the published parameter counts and under tensor and pipeline parallelism."""

import dataclasses
import math

import pytest

from tests.helpers.documentation import documentation_text
from trillion.models.flops import count_params, model_flops_per_token
from trillion.models.presets import get_preset
from trillion.parallel.layout import Layout
from trillion.parallel.planner.assumptions import ASSUMED
from trillion.parallel.planner.block_cost import attention_flops, block_passes, output_passes
from trillion.parallel.planner.cost import rank_passes
from trillion.parallel.planner.hardware import load_profile
from trillion.parallel.planner.memory import (
    ahead_params,
    block_linears,
    block_params,
    last_stage_params,
    layout_memory,
    pipeline_ranks,
    rank_memory,
)
from trillion.parallel.planner.timing import _gemm

H100 = load_profile("dgx-h100")


def _one_rank(args, **layout):
    fields = {"tp": 1, "pp": 1, "dp_replicate": 1, "dp_shard": 1, "dp_shard_mode": "zero3", "pp_schedule": "1F1B"}
    fields |= {"virtual_stages": 1, "micro_batch_size": 1, "microbatches": 8, "activation_checkpoint": "none"}
    return pipeline_ranks(args, Layout(**(fields | layout)))


def _active_params(args) -> int:
    """The parameters one token's forward reaches beside the embedding, from the planner's specs: each block's (an
    MoE block's norms, attention, router, shared experts and top_k routed experts), each MTP module's block, norms
    and projection, the final norm and the output head, once for the trunk and once more per MTP module."""
    h, moe = args.dim, args.moe

    def count(specs) -> int:
        return sum(math.prod(spec.shape) for spec in specs)

    def block(index: int) -> int:
        if not args.is_moe_layer(index):
            return count(block_params(args))
        return count(block_params(args, routed=True)) + moe.top_k * 3 * h * moe.expert_ffn_dim

    blocks = sum(block(index) for index in range(args.n_layers + args.mtp_modules))
    heads = args.mtp_modules * args.vocab_size * h
    return blocks + args.mtp_modules * count(ahead_params(args)) + count(last_stage_params(args)) + heads


@pytest.mark.parametrize(
    "name", ["debug-moe", "qwen3-30b-a3b", "debug-deepseek", "deepseek-v2-lite", "deepseek-v3-671b", "kimi-k2"]
)
@pytest.mark.parametrize("mtp", [0, 1])
def test_the_planners_model_flops_equal_the_trainers(name, mtp):
    """The planner's parameters and causal attention give models/flops.py's model FLOPs per token (6 per active
    parameter, norms included as PaLM counts them, and the full attention square: twice the causal forward's), with
    and without an MTP module."""
    args = dataclasses.replace(get_preset(name), mtp_modules=mtp)
    seq = 4096
    attention = 2 * 3 * (args.n_layers + mtp) * attention_flops(args, 1, seq, 1)
    assert 6 * _active_params(args) + attention == model_flops_per_token(args, seq)


# Published sizes: DeepSeek-V3 technical report (arXiv 2412.19437) abstract, 671B total and 37B activated per token,
# and its Hugging Face card, 685B with the 14B MTP module (which stores its own copy of the embedding and the
# head, 2 x 0.93B, where the planner shares them); Kimi K2 (arXiv 2507.20534) abstract: 1.04T total, 32B activated.
# The active figures include the embedding lookup's table, which the planner's matmul count leaves out.
@pytest.mark.parametrize(
    "name,total,with_mtp,active,tolerance",
    [("deepseek-v3-671b", 671e9, 685e9 - 2 * 0.927e9, 37e9, 0.02), ("kimi-k2", 1.04e12, None, 32e9, 0.03)],
)
def test_parameter_counts_match_the_published_figures(name, total, with_mtp, active, tolerance):
    args = get_preset(name)
    (main,) = _one_rank(dataclasses.replace(args, mtp_modules=0))
    assert main.numel(args, 1, 1)[0] == pytest.approx(total, rel=tolerance)
    if with_mtp:
        (rank,) = _one_rank(args)
        assert rank.ahead_modules == 1
        assert rank.numel(args, 1, 1)[0] == pytest.approx(with_mtp, rel=0.01)
    embedding = args.vocab_size * args.dim
    trunk = dataclasses.replace(args, mtp_modules=0)
    assert _active_params(trunk) + embedding == pytest.approx(active, rel=tolerance)


def test_tensor_parallelism_splits_heads_and_keeps_the_down_projections_whole():
    args = get_preset("deepseek-v3-671b")
    mla, h = args.mla, args.dim
    names = [name for name, *_ in block_linears(args)][:5]
    assert names == ["attention.wq_a", "attention.wq_b", "attention.wkv_a", "attention.wkv_b", "attention.wo"]
    (one,), (eight,) = _one_rank(args), _one_rank(args, tp=8)
    down = h * (mla.q_lora_rank + mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.q_lora_rank + mla.kv_lora_rank
    layers = args.n_layers + args.mtp_modules
    whole_one, whole_eight = one.numel(args, 1, 1)[0], eight.numel(args, 8, 1)[0]
    # what TP 8 saves is 7/8 of everything but the replicated parts; the down projections are among those
    replicated = whole_eight - (whole_one - whole_eight) / 7
    assert replicated >= layers * down
    # attention at query/key head dim 192 and value head dim 128 (causal: half the square)
    assert attention_flops(args, 4096, 4096, 8) == 4096 * 4096 * 128 * (192 + 128) / 8


def test_the_mtp_module_sits_on_the_last_stage_and_costs_a_block_and_the_head():
    args = get_preset("deepseek-v3-671b")
    ranks = _one_rank(args, pp=4)
    assert [r.ahead_modules for r in ranks] == [0, 0, 0, 1]
    embedding = args.vocab_size * args.dim  # the last stage's copy, which the MTP module reads (pipeline_ahead.py)
    assert sum(r.numel(args, 1, 1)[0] for r in ranks) == _one_rank(args)[0].numel(args, 1, 1)[0] + embedding
    last, without = ranks[-1], dataclasses.replace(ranks[-1], ahead_modules=0)
    layout = Layout(tp=8)
    with_mtp = rank_passes(args, H100, layout, 4096, ASSUMED, last)[0]
    plain = rank_passes(args, H100, layout, 4096, ASSUMED, without)[0]
    block = block_passes(args, H100, layout, 4096, ASSUMED, routed=True)
    added = with_mtp.forward - plain.forward
    head = output_passes(args, H100, 4096, 8).forward
    projection = _gemm(H100, 4096, 2 * args.dim, args.dim)  # 2 dim -> dim, whole on every tp rank
    assert added == pytest.approx(block.forward + head + projection)


@pytest.mark.parametrize(
    "axis, schedule", [("pp", "GPipe"), ("pp", "ZBVZeroBubble"), ("cp", "1F1B"), ("tp", "1F1B"), ("ep", "1F1B")]
)
def test_the_planner_refuses_what_the_trainer_refuses_of_deepseek_s_objectives(axis, schedule):
    """`trillion plan` never proposes a layout `trillion train` refuses (trainer/assemble.py: the parts' refusals and
    the pipeline's): multi-token prediction and the sequence-wise balance loss train under every layout, a V-shaped
    schedule's included (the first and last stage on one rank: parallel/pipeline_ahead.py)."""
    from trillion.errors import ConfigError
    from trillion.models import parts
    from trillion.parallel.pipeline import validate_pipeline
    from trillion.parallel.planner.search import trainer_refusal

    preset = get_preset("debug-deepseek")
    assert preset.mtp_modules and preset.moe.seq_aux_loss_coef > 0
    degrees = {"pp": 1, "cp": 1, "tp": 1, "ep": 1, "dp_shard": 2} | {axis: 2}
    virtual = 2 if schedule == "ZBVZeroBubble" else 1
    layout = Layout(**degrees, pp_schedule=schedule, microbatches=4, virtual_stages=virtual)
    outcomes = []
    for args in (preset, dataclasses.replace(preset, mtp_modules=0)):
        try:  # check_model_layout's parts' refusal and pipeline check
            if refused := parts.layout_refusal(args, layout):
                raise ConfigError(refused)
            validate_pipeline(layout, args.n_layers, ahead_modules=args.mtp_modules)
            trainer = ""
        except ConfigError as error:
            trainer = str(error)
        planner = trainer_refusal(args, layout)
        assert bool(planner) == bool(trainer), (axis, planner, trainer)
        outcomes.append(bool(trainer))
    assert outcomes == [False, False]


@pytest.mark.parametrize("name", ["debug-deepseek", "deepseek-v2-lite", "moonlight-16b-a3b", "deepseek-v3-671b"])
def test_a_one_stage_rank_holds_every_parameter_the_model_builds(name):
    """The planner's states of a one-stage rank (tp 1, no FSDP) are the model's parameters, counted by
    models/flops.py's count_params (which tests/test_flops.py checks against the built model)."""
    args = get_preset(name)
    (rank,) = _one_rank(args)
    assert rank.numel(args, 1, 1)[0] == count_params(args).total


def test_plan_mtp_modules_flag_plans_and_writes_the_setting(tmp_path, capsys):
    """`trillion plan --mtp-modules 0` plans debug-deepseek without its MTP module and writes model.mtp_modules=0;
    with the preset's module the plan keeps to layouts the trainer runs it in; a negative count is refused."""
    from trillion.trainer.cli.main import main
    from trillion.trainer.config.schema import load_config

    plan = ["plan", "--model", "debug-deepseek", "--hardware", "dgx-h100", "--gpus", "8", "--global-batch", "16"]
    plan += ["--seq-len", "1024", "--format", "json"]
    assert main([*plan, "--mtp-modules", "0", "--config-out", str(tmp_path / "off.toml")]) == 0
    assert load_config(str(tmp_path / "off.toml")).model.mtp_modules == 0
    assert main([*plan, "--config-out", str(tmp_path / "on.toml")]) == 0
    capsys.readouterr()
    on = load_config(str(tmp_path / "on.toml")).parallel
    assert on.pp == 1 or on.pp_schedule not in ("ZBVZeroBubble", "DualPipeV")  # MTP's copy of the embedding
    assert main([*plan, "--mtp-modules", "-1"]) == 2
    assert "--mtp-modules -1 must be 0 or more" in capsys.readouterr().err


def test_the_fullest_rank_can_be_a_middle_one():
    """deepseek-v3-671b's first three blocks are dense: at pp 32 (two blocks a stage) the first rank holds dense
    blocks and the embedding, the middle ranks routed experts. The planner's memory is the fullest rank's, which
    here is a middle one (`trillion estimate` measured 70 GB there against 19 GB on the first rank)."""
    args = dataclasses.replace(get_preset("deepseek-v3-671b"), mtp_modules=0)
    layout = Layout(pp=32, dp_shard=64, dp_shard_mode="zero1", microbatches=240, activation_checkpoint="full", ep=4)
    ranks = pipeline_ranks(args, layout)
    assert ranks[0].routed_layers == 0 and ranks[16].routed_layers == 2
    first, last = (rank_memory(args, layout, 4096, ASSUMED, ranks[i], n).total for i, n in ((0, 32), (31, 1)))
    assert layout_memory(args, layout, 4096, ASSUMED).total > 1.2 * max(first, last)  # 60.6 GB against 21.8 and 47.9


DEEPSEEK_PLAN = ["plan", "--model", "deepseek-v3-671b", "--hardware", "dgx-h800", "--gpus", "2048"]
DEEPSEEK_PLAN += [
    "--global-batch",
    "15360",
    "--seq-len",
    "4096",
    "--tokens",
    "14.8e12",
    "--format",
    "json",
    "--top",
    "1",
]
DEEPSEEK_LAYOUT = ["--pp", "16", "--ep", "64", "--dp-shard", "128", "--dp-shard-mode", "zero1", "--float8"]
DEEPSEEK_LAYOUT += ["--float8-experts", "blockwise", "--float8-dispatch"]


def test_deepseeks_own_layout_plans_with_mtp_per_node_and_its_cost_beside_the_published(tmp_path, capsys):
    """DeepSeek-V3's layout (pp 16, ep 64 over 8 nodes, zero1) in its float8 recipe plans with its MTP module, the
    per-node dispatch and its stages balanced, and the plan file carries them; the guide quotes the planner's
    figures."""
    import json

    from trillion.trainer.cli.main import main
    from trillion.trainer.config.schema import load_config

    assert main([*DEEPSEEK_PLAN, *DEEPSEEK_LAYOUT, "--config-out", str(tmp_path / "ds.toml")]) == 0
    row = json.loads(capsys.readouterr().out)["candidates"][0]
    assert (row["pp"], row["ep"], row["ep_dispatch"], row["ep_overlap"]) == (16, 64, "node", True)
    config = load_config(str(tmp_path / "ds.toml"))
    assert config.model.mtp_modules == -1 and get_preset("deepseek-v3-671b").mtp_modules == 1  # the preset's MTP
    assert (config.job.world_size, config.job.hardware, config.parallel.ep_dispatch) == (2048, "dgx-h800", "auto")
    assert row["pp_layout"] and config.parallel.pp_layout == row["pp_layout"]  # the balanced split, written out
    docs, shares = documentation_text(), row["time_shares"]
    quoted = [
        f"now proposes a balanced split: {row['tokens_per_s'] / 2048:,.0f} tokens/s per GPU (498 before)",
        f"full recompute, imbalance {100 * shares['imbalance']:.1f}% (17.6% before)",
    ]
    for text in quoted:
        assert text in docs, text


@pytest.mark.slow  # about 30 s (70k layouts) and the 2048-rank dry run about 15 s on two cores
def test_deepseek_v3_on_2048_h800_plans_with_mtp_and_its_own_layout_dry_runs(tmp_path, capsys):
    import json

    from trillion.trainer.cli.main import main

    assert main([*DEEPSEEK_PLAN, "--config-out", str(tmp_path / "searched.toml")]) == 0
    assert json.loads(capsys.readouterr().out)["request"]["model"] == "deepseek-v3-671b"
    assert main([*DEEPSEEK_PLAN, *DEEPSEEK_LAYOUT, "--config-out", str(tmp_path / "ds.toml")]) == 0
    capsys.readouterr()
    code = main(["estimate", "--config", str(tmp_path / "ds.toml"), "--format", "json"])
    data = json.loads(capsys.readouterr().out)
    assert code in (0, 1) and data["world_size"] == 2048 and len(data["ranks"]) == 5
    assert all(rank["activations_source"] == "measured" for rank in data["ranks"])


DEEPSEEK_RECIPE = ["--pp-schedule", "DualPipeV", "--activation-checkpoint", "deepseek"]
DEEPSEEK_RECIPE += ["--optimizer-state-dtype", "bfloat16", "--float8-combine-gradient", "--float8-cache-activations"]


def test_deepseeks_recipe_fits_the_plans_memory_with_the_float8_activation_cache(tmp_path, capsys):
    """DeepSeek's layout as DeepSeek ran it, no full recompute: with the experts' activations cached in float8 (w2's
    input rebuilt from SwiGLU's cached inputs) its fullest rank fits the 72 GB a plan may fill, and the plan file
    carries the cache, the combine's float8 gradient and the pairing's phase; without the cache it does not fit the
    GPU and the plan is refused."""
    import json

    from trillion.trainer.cli.main import main
    from trillion.trainer.config.schema import load_config

    assert main([*DEEPSEEK_PLAN, *DEEPSEEK_LAYOUT, *DEEPSEEK_RECIPE, "--config-out", str(tmp_path / "ds.toml")]) == 0
    row = json.loads(capsys.readouterr().out)["candidates"][0]
    assert row["fits"] and row["memory_gb"] <= 72 and row["activation_checkpoint"] == "deepseek", row["memory_gb"]
    assert row["pp_schedule"] == "DualPipeV" and row["float8_cache_activations"]
    config = load_config(str(tmp_path / "ds.toml"))
    assert config.float8.cache_activations and config.parallel.activation_checkpoint == "deepseek"
    assert row["ep_pairing_phase"] == config.parallel.ep_pairing_phase == 4  # the pairing's phase the plan timed
    assert row["float8_combine_gradient"] and config.float8.combine_gradient
    # its weight gradients deferred, as DeepSeek's WeightGradStore defers them (searched on and off: on is faster)
    assert row["defer_weight_grads"] and config.parallel.defer_weight_grads
    uncached = [*DEEPSEEK_PLAN, *DEEPSEEK_LAYOUT, *DEEPSEEK_RECIPE[:-1], "--config-out", ""]
    assert main(uncached) != 0
    assert "fits in memory: of 4 valid layouts the smallest needs 98.1 GB" in capsys.readouterr().err
