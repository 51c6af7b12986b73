"""`trillion estimate` on mixture-of-experts presets with expert parallelism: the routed experts are
built with the trainer's own parallelize (ep over the dp_shard x cp ranks, FSDP over the efsdp ranks
left), so each rank holds exactly E / ep experts sharded over efsdp, and the planner's model states
agree; the activation peak is measured on meta tensors through the balanced all-to-all dispatch."""

import json

import pytest
import torch

from trillion.models import Transformer, get_preset
from trillion.models.moe import RoutedExperts
from trillion.trainer.cli.main import main
from trillion.trainer.config.schema import load_config
from trillion.trainer.tools.estimate.dry_run import estimate

MOE = [
    "--model.name=debug-moe",
    "--training.seq_len=128",
    "--training.global_batch_size=16",
    "--training.micro_batch_size=1",
]


def _routed_expert_elements(name: str, **changes) -> int:
    import dataclasses

    with torch.device("meta"):
        model = Transformer(dataclasses.replace(get_preset(name), **changes))
    return sum(p.numel() for m in model.modules() if isinstance(m, RoutedExperts) for p in m.parameters())


def test_each_rank_holds_its_share_of_the_routed_experts_and_the_planner_agrees():
    """16 ranks, dp_shard 16, ep 4: 2 of the 8 experts a rank, FSDP-sharded over the efsdp 4 ranks left."""
    overrides = [*MOE, "--parallel.dp_shard=16", "--parallel.ep=4", "--parallel.dp_shard_mode=zero3"]
    result = estimate(load_config(None, overrides), 16, ranks="first,middle,last")
    assert result.layout["ep"] == 4 and result.layout["efsdp"] == 4 and not result.notes
    share = _routed_expert_elements("debug-moe") // (4 * 4) * 4  # fp32 shards
    for rank in result.ranks:
        assert rank.detail["routed_expert_parameters"] == share, (rank.rank, rank.detail)
        assert rank.activations_source == "measured"
        for kind in ("parameters", "gradients", "optimizer"):  # the dense estimate's tolerance
            assert getattr(rank, kind) == pytest.approx(rank.planner[kind], rel=0.01), (rank.rank, kind)
    # zero3 gathers one block's E / ep experts (and the prefetched one): less than without ep
    dense = estimate(load_config(None, [*overrides[:-2], "--parallel.ep=1", overrides[-1]]), 16, ranks="first")
    assert result.ranks[0].buffers < dense.ranks[0].buffers


def test_the_planners_qwen3_layout_shape_at_32_ranks_with_pipeline_cp_and_hsdp(capsys):
    """qwen3-30b-a3b cut to 4 layers in the shape `trillion plan` picks for qwen3-235b-a22b (ZBV pp, cp 4,
    HSDP 2 x 2, ep 8 = dp_shard x cp so efsdp 1): each stage holds its MoE layers' E / ep experts whole, the
    unsharded accumulation holds them once in fp32, and the MoE layers are measured on meta."""
    flags = [
        "estimate",
        "--model",
        "qwen3-30b-a3b",
        "--model.n_layers=4",
        "--world-size",
        "32",
        "--ep",
        "8",
        *MOE[1:],
        "--training.global_batch_size=16",
        "--parallel.pp=2",
        "--parallel.pp_schedule=ZBVZeroBubble",
        "--parallel.dp_replicate=2",
        "--parallel.dp_shard=2",
        "--parallel.cp=4",
        "--parallel.dp_shard_mode=zero1",
        "--hardware",
        "dgx-h100",
        "--format",
        "json",
    ]
    assert main(flags) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layout"]["ep"] == 8 and data["layout"]["efsdp"] == 1 and data["notes"] == []
    per_layer = _routed_expert_elements("qwen3-30b-a3b", n_layers=1)
    units = data["layout"]["stage_units"]  # the trainer's split of embedding, 4 blocks and output
    for rank in data["ranks"]:
        layers = sum(1 for s in rank["detail"]["stages"] for u in range(*units[s]) if 1 <= u <= 4)
        assert rank["detail"]["routed_expert_parameters"] == layers * per_layer // 8 * 4, rank["rank"]
        assert rank["activations_source"] == "measured"
        assert rank["detail"]["gradient_accumulation"] == 4 * rank["detail"]["tp_local_parameters"]


@pytest.mark.slow  # about 25 s of four gloo processes on two cores
def test_expert_parallel_states_equal_a_real_gloo_run(tmp_path):
    """dp_shard 4 x ep 2 (efsdp 2) on 4 gloo processes: one real step of the trainer's layout holds
    exactly the parameter, gradient and optimizer bytes the fake-group estimate reads off its shards."""
    from tests.helpers.flags import DEBUG_SMALL
    from tests.helpers.real_run import measure_rank
    from tests.helpers.spawn import run_ranks

    overrides = [
        *DEBUG_SMALL,
        "--model.name=debug-moe",
        "--training.global_batch_size=4",
        "--training.micro_batch_size=1",
        "--optimizer.implementation=foreach",
        "--parallel.dp_shard=4",
        "--parallel.ep=2",
    ]
    out = str(tmp_path / "real")
    run_ranks(measure_rank, 4, overrides, out)
    result = estimate(load_config(None, overrides), 4, ranks="all")
    for rank, predicted in enumerate(result.ranks):
        measured = json.load(open(f"{out}.{rank}"))
        figures = {**predicted.detail, "parameters": predicted.parameters, "optimizer": predicted.optimizer}
        for kind in ("parameters", "gradient_shards", "optimizer"):
            assert figures[kind] == measured[kind], (rank, kind, figures[kind], measured[kind])


def _simulated(overrides: list[str], world_size: int):
    """The dry run's Simulation of `overrides` on `world_size` fake ranks, with its model args and layout dims."""
    from trillion.trainer.tools.estimate import dry_run
    from trillion.trainer.tools.estimate.simulation import Simulation

    config = load_config(None, overrides)
    dims, args = dry_run.layout_dims(config, world_size)
    return Simulation(config, args, dims, True, None, []), args, dims


def _pipeline_stage_held(ep: int, mode: str):
    """(held bytes of one micro-batch per stage shape, the second pipeline rank's chunks in flight, model args, layout)
    of debug-moe on 16 fake ranks: pp 2 under ZBVZeroBubble (v 2), dp_shard 8, ep over nodes of 2 ranks."""
    overrides = [
        *MOE[:1],
        "--training.seq_len=256",
        "--training.global_batch_size=32",
        "--training.micro_batch_size=2",
        "--parallel.dp_shard=8",
        f"--parallel.ep={ep}",
        "--parallel.pp=2",
        "--parallel.pp_schedule=ZBVZeroBubble",
        *[f"--parallel.ep_dispatch={mode}"] * (ep > 1),  # with ep 1 there is no dispatch (config/effects.py)
        "--parallel.ranks_per_node=2",
        "--parallel.activation_checkpoint=none",
    ]
    simulation, args, dims = _simulated(overrides, 16)
    in_flight = simulation.rank(8)["detail"]["in_flight"]  # pipeline rank 1: stages 1 and 2
    return {shape: facts.memory.held for shape, facts in simulation.facts.items()}, in_flight, args, dims.layout


@pytest.mark.parametrize("mode", ["node", "rank"])
def test_the_dispatch_keeps_no_rows_beyond_one_process_and_a_v_schedules_in_flight(mode):
    """Per MoE layer the dispatch keeps, beyond one process, nothing a row wide: the experts apply the routing weights
    before w2 and their outputs return summed, the sums keeping only their indices (models/expert_rows.py), so the
    planner counts the same bytes with ep as without (activations.py moe_activation_bytes). The dry run measures the
    same stage with ep 4 over 2 nodes and with ep 1: the difference per routed layer, the hops' int64 indices, is
    under a quarter of a hidden state a token (the weighted outputs were top_k of them). And every rank of the V
    schedule holds as many micro-batches as the first (planner: in_flight_microbatches)."""
    from trillion.parallel import modes
    from trillion.parallel.planner.activations import moe_activation_bytes
    from trillion.parallel.planner.moe import dispatch_mode
    from trillion.parallel.planner.schedules import in_flight_microbatches

    held, in_flight, args, layout = _pipeline_stage_held(4, mode)
    alone, _, _, _ = _pipeline_stage_held(1, "rank")
    assert dispatch_mode(layout) == mode
    tokens = layout.micro_batch_size * 256
    assert moe_activation_bytes(args, tokens, 1, 4, 1.0, 2) == moe_activation_bytes(args, tokens, 1, 1, 1.0, 2)
    for shape, measured in held.items():
        if shape.routed_layers:
            per_layer = (measured - alone[shape]) / shape.routed_layers
            assert 0 <= per_layer < tokens * args.dim * 2 / 4, (shape, per_layer)
    first, last = in_flight_microbatches(modes.schedule(layout.pp_schedule, ""), 2, layout.microbatches)
    assert in_flight == layout.virtual_stages * last == layout.virtual_stages * first


def test_a_checkpointed_moe_stage_holds_its_block_outputs_not_its_received_input():
    """Under full checkpointing a middle pipeline stage keeps, per micro-batch, one hidden state per block (its output:
    the next block's input, the last the stage's output) and nothing of the expert dispatch; the hidden state it
    received is its receive buffer, which the schedule counts apart (pipeline_schedule.with_receives), so the
    measurement leaves it out. Allowance: the rotary table's
    slice (an eighth of a hidden state at this size, under a hundredth at DeepSeek-V3's)."""
    overrides = [
        *MOE[:1],
        "--training.seq_len=256",
        "--training.global_batch_size=32",
        "--training.micro_batch_size=2",
        "--parallel.dp_shard=4",
        "--parallel.ep=2",
        "--parallel.pp=2",
        "--parallel.pp_schedule=Interleaved1F1B",
        "--parallel.ep_dispatch=node",
        "--parallel.ranks_per_node=1",
        "--parallel.activation_checkpoint=full",
    ]
    simulation, _, _ = _simulated(overrides, 8)
    simulation.rank(4)  # the second pipeline rank: its first stage (1 of 4) receives and sends hidden states
    later = [(s, facts.memory.held) for s, facts in simulation.facts.items() if not (s.first or s.last)]
    assert later and all(shape.routed_layers for shape, _ in later)
    for shape, held in later:
        blocks = shape.layers * simulation.hidden_bytes
        assert blocks <= held <= blocks + simulation.hidden_bytes / 8, (shape, held, blocks, simulation.hidden_bytes)


def _last_stage_held(mtp_modules: int) -> tuple[int, int]:
    """(held bytes of one micro-batch on the last stage, the elements of its logits) of debug-deepseek at pp 2."""
    overrides = [
        "--model.name=debug-deepseek",
        f"--model.mtp_modules={mtp_modules}",
        "--training.seq_len=256",
        "--training.global_batch_size=8",
        "--training.micro_batch_size=2",
        "--parallel.pp=2",
    ]
    simulation, args, _ = _simulated(overrides, 2)
    simulation.rank(1)
    (held,) = [facts.memory.held for shape, facts in simulation.facts.items() if shape.last]
    return held, 2 * 256 * args.vocab_size


def test_the_last_stage_runs_its_multi_token_prediction_module_as_the_trainer_does():
    """The dry run measures the last stage's forward with the MTP module the trainer runs there (its block, its
    logits and their loss), not the trunk alone: the depth's logits at least (bf16, batch x seq x vocab) are held
    beyond the stage without the module."""
    with_module, logits_elements = _last_stage_held(1)
    without, _ = _last_stage_held(0)
    assert with_module - without >= 2 * logits_elements, (with_module, without, logits_elements)


@pytest.mark.parametrize("etp, ep, experts_per_rank", [(1, 8, 1), pytest.param(2, 4, 2, marks=pytest.mark.slow)])
def test_a_folded_layout_holds_whole_experts_over_the_tp_ranks(etp, ep, experts_per_rank):
    """16 ranks, tp 2 x dp_shard 8: ep 8 folded over the tp ranks (etp 1: one whole expert a rank, FSDP over the
    efsdp 2 ranks left), or ep 4 in dp_shard with each expert split over tp (etp 2: two experts' halves a rank, FSDP
    over 2); the planner's model states agree either way."""
    overrides = [*MOE, "--parallel.tp=2", "--parallel.dp_shard=8", f"--parallel.ep={ep}", f"--parallel.etp={etp}"]
    result = estimate(load_config(None, overrides), 16, ranks="first,last")
    assert (result.layout["ep"], result.layout["etp"], result.layout["efsdp"]) == (ep, etp, 2), result.layout
    whole = _routed_expert_elements("debug-moe") // 8  # one expert's, of every layer
    for rank in result.ranks:  # fp32 shards
        assert rank.detail["routed_expert_parameters"] == whole * experts_per_rank // (2 * etp) * 4, rank.detail
        for kind in ("parameters", "gradients", "optimizer"):
            assert getattr(rank, kind) == pytest.approx(rank.planner[kind], rel=0.01), (rank.rank, kind)
