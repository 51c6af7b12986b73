"""The pipeline's stages balanced by the planner's own cost of each unit (`trillion plan --pp-layout auto`, the
default): the split whose busiest pipeline rank is least busy, written out as parallel.pp_layout, so the trainer runs
exactly the split the plan timed (its own `auto` balances FLOPs, which leave out what a layer's time has beyond its
GEMMs: the MoE layer's all-to-alls, permutation and element-wise work, the head's cross-entropy).

A unit's seconds are one micro-batch's forward, input- and weight-gradient passes and recomputed forward (cost.py):
the embedding's lookup and its gradient as memory passes (EMBEDDING_ROW_PASSES), each layer's block (dense or MoE),
the output head with the multi-token prediction modules beside it. parallel/pp_layout.py `balance` splits them (exact
for a V and for one stage per rank; `balance_paired` under DualPipeV's pairing, as the trainer's `auto`).
"""

import dataclasses
from functools import lru_cache

from trillion.models import parts
from trillion.models.args import ModelArgs
from trillion.parallel import modes
from trillion.parallel.layout import Layout, StageLayers
from trillion.parallel.planner.assumptions import Assumptions
from trillion.parallel.planner.block_cost import block_passes, output_passes
from trillion.parallel.planner.cost import ahead_module_passes, pipeline_part
from trillion.parallel.planner.hardware import HardwareProfile
from trillion.parallel.planner.timing import Passes, _memory_bound
from trillion.parallel.pp_layout import balance, balance_paired, describe, stage_ranks

# Rows of dim per token the embedding moves: the forward reads the table's row and writes the hidden state (2), the
# backward reads the hidden state's gradient and adds it into the row's gradient (read and write: 3). Counted from the
# lookup and its scatter-add, not measured: a few microseconds a micro-batch, against a layer's tens of milliseconds
EMBEDDING_ROW_PASSES = 5


def unit_seconds(args: ModelArgs, hw: HardwareProfile, layout: Layout, seq_len: int, assumed: Assumptions) -> list:
    """Seconds of one micro-batch through each unit (the module docstring), in order."""
    part = pipeline_part(layout)
    replays = modes.checkpoint_mode(layout.activation_checkpoint)
    recomputed = 1 / replays.every if replays.every and not replays.op_level else 0.0

    def whole(passes: Passes, again: float = 0.0) -> float:
        return passes.forward * (1 + again) + passes.input_grad + passes.weight_grad

    tokens = layout.micro_batch_size * seq_len // layout.cp
    kinds = {parts.routed_layer(args, index) for index in range(args.n_layers)}
    seconds = {
        routed: whole(block_passes(args, hw, part, seq_len, assumed, routed=routed), recomputed) for routed in kinds
    }
    embedding = _memory_bound(hw, EMBEDDING_ROW_PASSES * tokens * args.dim * hw.element_bytes)
    output = whole(output_passes(args, hw, tokens, layout.tp))
    count = parts.ahead_modules(args)[0]
    output += count * whole(ahead_module_passes(args, hw, part, seq_len, assumed)) if count else 0.0
    return [embedding, *(seconds[parts.routed_layer(args, index)] for index in range(args.n_layers)), output]


def balanced(args: ModelArgs, hw: HardwareProfile, layout: Layout, seq_len: int, assumed: Assumptions) -> Layout:
    """`layout` with its stages balanced by unit_seconds, written out (parallel.pp_layout); as it is without a
    pipeline."""
    if layout.pp == 1:
        return layout
    costs = tuple(unit_seconds(args, hw, layout, seq_len, assumed))
    ranks = tuple(stage_ranks(layout.pp, layout.virtual_stages, layout.pp_schedule))
    counts = _balance(costs, ranks, modes.pairs_in_a_v(layout))
    written = describe(counts, args.n_layers, parts.ahead_modules(args)[0], compact=True)
    return dataclasses.replace(layout, stage_layers=StageLayers(written=written))


@lru_cache(maxsize=1024)
def _balance(costs: tuple, ranks: tuple, paired: bool) -> tuple[int, ...]:
    """The trainer's own split of `costs` (pp_layout.balance; balance_paired under DualPipeV's pairing, whose stages
    each need compute to hide the other's all-to-alls)."""
    return (balance_paired if paired else balance)(list(costs), list(ranks))
