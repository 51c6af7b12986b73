"""The cost of each pipeline unit (the embedding, each layer, the output end with the multi-token prediction
modules), which `parallel.pp_layout=auto` and the planner's search balance the stages by (parallel/pp_layout.py).

With a hardware profile a unit costs the planner's seconds for one micro-batch through it: its forward, the
recomputed share of it under activation checkpointing, and both gradients, with its exposed TP, CP and expert
all-to-all time (cost.py's passes: a dense block, an MoE block, the head, a multi-token prediction module), and
the embedding's lookup and gradient as memory passes. Without one (a run with no job.hardware), its FLOPs per
token (models/flops.py unit_flops_per_token).
"""

from trillion.models import parts
from trillion.models.args import ModelArgs
from trillion.models.flops import unit_flops_per_token
from trillion.parallel import modes
from trillion.parallel.layout import Layout
from trillion.parallel.planner.block_cost import block_passes, output_passes
from trillion.parallel.planner.cost import ahead_module_passes, pipeline_part
from trillion.parallel.planner.hardware import HardwareProfile
from trillion.parallel.planner.layout import rank_of_virtual_stage
from trillion.parallel.planner.timing import Passes, _memory_bound
from trillion.parallel.pp_layout import balance

# The embedding's lookup writes a row per token; its backward reads the row's gradient and adds it into the table
EMBEDDING_ROW_PASSES = 3


def recomputed_share(mode: str) -> float:
    """The share of a layer's forward that activation checkpointing runs again (modes.py; the op-level policy
    recomputes no matmul)."""
    checkpoint = modes.checkpoint_mode(mode)
    return 0.0 if checkpoint.op_level or not checkpoint.every else 1 / checkpoint.every


def unit_seconds(args: ModelArgs, hw: HardwareProfile, layout: Layout, seq_len: int) -> list[float]:
    """Seconds of one micro-batch through each unit (the module docstring)."""
    part, share = pipeline_part(layout), recomputed_share(layout.activation_checkpoint)

    def whole(passes: Passes, recomputed: float = 0.0) -> float:
        return passes.forward * (1 + recomputed) + passes.input_grad + passes.weight_grad

    tokens = layout.micro_batch_size * seq_len // layout.cp
    embedding = _memory_bound(hw, EMBEDDING_ROW_PASSES * tokens * args.dim * hw.element_bytes)
    kinds = {routed: whole(block_passes(args, hw, part, seq_len, routed=routed), share) for routed in (False, True)}
    layers = [kinds[parts.routed_layer(args, index)] for index in range(args.n_layers)]
    count = parts.ahead_modules(args)[0]
    output = whole(output_passes(args, hw, tokens, layout.tp))
    output += count * whole(ahead_module_passes(args, hw, part, seq_len)) if count else 0.0
    return [embedding, *layers, output]


def stage_ranks(layout: Layout) -> list[int]:
    """The pipeline rank running each of the layout's pp x virtual stages (the schedule's placement)."""
    schedule = modes.schedule(layout.pp_schedule)
    return [rank_of_virtual_stage(k, layout.pp, schedule) for k in range(layout.pp * layout.virtual_stages)]


def unit_costs(args: ModelArgs, layout: Layout, seq_len: int, hw: HardwareProfile | None) -> tuple[list, list]:
    """(each unit's cost, each stage's rank): what parallel/pp_layout.py balance takes."""
    costs = unit_seconds(args, hw, layout, seq_len) if hw is not None else unit_flops_per_token(args, seq_len)
    return costs, stage_ranks(layout)


def balanced_stages(args: ModelArgs, layout: Layout, seq_len: int, hw: HardwareProfile | None) -> tuple[int, ...]:
    """Units per stage with the busiest pipeline rank least busy (Layout.pp_stages; () without a pipeline)."""
    if layout.pp == 1:
        return ()
    return balance(*unit_costs(args, layout, seq_len, hw))
