"""Memory per GPU of a layout: parameters, gradients, optimizer states, activations, buffers.

States follow FSDP2 with bf16 compute and fp32 master weights, gradients and AdamW moments, all
sharded over dp_shard (dim 0 of each tensor, as torch.chunk: rank 0 holds the ceiling), after
tensor parallelism has split them (column-parallel weights on dim 0, row-parallel on dim 1,
vocabulary- and position-parallel embeddings and output; norms and row-parallel biases
replicated: parallel/tensor_parallel.py's plan):
  zero3  parameters 4 (fp32 shard)          gradients 4 (shard)          optimizer 8 (shard)
  zero2  + 2 bytes: the gathered bf16 copy, kept through all micro-batches of the step
  zero1  + the bf16 copy, and gradients accumulate unsharded in fp32 until the last micro-batch
(bytes per parameter), as parallel/fsdp.py does; with Muon (assumptions.optimizer) a hidden matrix keeps one 4-byte
state instead of AdamW's 8, and its step's buffers count where they pass the activations (optimizer.py). The root
(embeddings, final norm, output) is never resharded after forward, so under zero3 its bf16 copy is held through the
step too. A pipeline schedule turns gradient sync off until the last micro-batch and keeps its stages gathered from
their first backward on, whatever the mode, so with pp > 1 every mode costs zero1's bytes (measured in gloo runs by
`trillion estimate`, trainer/tools/estimate/dry_run.py). Its stages hold a received hidden state for every
micro-batch in flight (parallel/pipeline_stage.py), counted with the buffers. Activations per layer are
activations.py's, by checkpointing mode; under parallel.defer_weight_grads a chunk's input pass leaves what it queued
until its W (deferred_weights.py). Context parallelism (cp): a rank holds s / cp of every sequence, so its
activations are those of s / cp tokens, plus the whole sequence's K and V that attention gathers per block: kept for
backward by every block that is not checkpointed, held once while one block runs. FSDP shards the states over
dp_shard x cp (the cp ranks hold the same weights).
"""

import math
from dataclasses import dataclass
from functools import lru_cache, partial

from trillion.models import parts
from trillion.models.args import ModelArgs
from trillion.models.parts.spec import Linear, Norm
from trillion.parallel import modes
from trillion.parallel.layout import Layout, StageLayers
from trillion.parallel.planner import schedules
from trillion.parallel.planner.activations import (
    ACTIVATION_BYTES,
    ahead_module_bytes,
    checkpointed_layers,
    layer_bytes,
    loss_backward_bytes,
    output_activation_bytes,
)
from trillion.parallel.planner.assumptions import Assumptions
from trillion.parallel.planner.deferred_weights import chunk_deferred_bytes, defers, queued_in_flight
from trillion.parallel.planner.moe import expert_numel, expert_shards, pairs, routed_tokens
from trillion.parallel.planner.optimizer import state_bytes, step_buffer_bytes
from trillion.parallel.planner.shards import ParamSpec, local_numel
from trillion.parallel.pp_layout import split_units

FRAMEWORK_BYTES = 1e9  # CUDA/HIP context, BLAS workspaces
MEMORY_HEADROOM = 0.9  # share of device memory a plan may fill; the rest is allocator fragmentation


def block_linears(args: ModelArgs, routed: bool = False) -> list[tuple[str, int, int, int | None]]:
    """(name, out_features, in_features, dimension of the weight TP splits) of the linears one block runs per
    token (models/parts): a dense block's, or (`routed`) an MoE block's attention and shared experts (moe.py
    counts its router and routed experts)."""
    return [(x.name, x.out_features, x.in_features, x.tp_dim) for x in parts.block(args, routed).linears]


# float8 converts a block's linear whose in and out features, as each TP rank holds them, are multiples
# of this (the fp8 GEMM's constraint; parallel/float8.py; a recipe's own dim_multiple, parallel/modes.py: 32 for
# MX, 128 for NVFP4); the output projection and embeddings never
FLOAT8_DIM_MULTIPLE = 16


def tp_local_linears(
    args: ModelArgs, tp: int, routed: bool = False, multiple: int = FLOAT8_DIM_MULTIPLE
) -> list[tuple[int, int, bool]]:
    """(in_features, out_features, converted by float8) of each block linear on one of `tp` ranks: converted where
    both are multiples of `multiple`."""
    local = []
    for _, out_f, in_f, tp_dim in block_linears(args, routed):
        k, n = math.ceil(in_f / tp) if tp_dim == 1 else in_f, math.ceil(out_f / tp) if tp_dim == 0 else out_f
        local.append((k, n, k % multiple == 0 and n % multiple == 0))
    return local


def float8_numel(args: ModelArgs, layers: int, tp: int, routed_layers: int = 0) -> int:
    """Weight elements (after TP) of the float8-converted linears of `layers` blocks (`routed_layers` of them
    MoE: their shared experts' linears; routed experts stay bf16): what FSDP's float8 all-gather gathers at
    1 byte (their biases and every other parameter stay bf16)."""
    kinds = ((layers - routed_layers, False), (routed_layers, True))
    return sum(
        count * sum(k * n for k, n, converted in tp_local_linears(args, tp, routed) if converted)
        for count, routed in kinds
        if count
    )


def linear_params(linear: Linear) -> list[ParamSpec]:
    """A column-parallel bias is split with its rows; a row-parallel one is replicated."""
    weight = ParamSpec(f"{linear.name}.weight", (linear.out_features, linear.in_features), linear.tp_dim)
    bias = [ParamSpec(f"{linear.name}.bias", (linear.out_features,), 0 if linear.tp_dim == 0 else None)]
    return [weight] + (bias if linear.bias else [])


def norm_params(norm: Norm, prefix: str = "") -> list[ParamSpec]:
    specs = [ParamSpec(f"{prefix}{norm.name}.weight", (norm.features,), None)]
    return specs + ([ParamSpec(f"{prefix}{norm.name}.bias", (norm.features,), None)] if norm.bias else [])


def block_params(args: ModelArgs, routed: bool = False) -> list[ParamSpec]:
    """Parameters of one transformer block, named as in models/transformer.py; of an MoE block (`routed`) all
    but the routed experts (moe.py): the router, replicated over TP as torchtitan's, and the shared experts."""
    block = parts.block(args, routed)
    specs = [spec for n in (*block.norms, *block.inner_norms) for spec in norm_params(n)]
    gate = [block.routing.gate] if block.routing else []
    return specs + [spec for linear in (*gate, *block.linears) for spec in linear_params(linear)]


def first_stage_params(args: ModelArgs) -> list[ParamSpec]:
    return [ParamSpec(f"{t.name}.weight", (t.rows, t.dim), 0) for t in parts.model_root(args).tables]


def last_stage_params(args: ModelArgs) -> list[ParamSpec]:
    root = parts.model_root(args)
    output = [] if root.tied else linear_params(root.output)
    return norm_params(root.norm) + output


def ahead_params(args: ModelArgs) -> list[ParamSpec]:
    """A look-ahead module's parameters besides its block (models/parts ahead_modules: multi-token prediction's),
    named inside "ahead." (the planner counts them, it never looks them up)."""
    _, ahead = parts.ahead_modules(args)
    if ahead is None:
        return []
    linears = [ParamSpec(f"ahead.{s.name}", s.shape, s.tp_dim) for x in ahead.linears for s in linear_params(x)]
    return [spec for n in ahead.norms for spec in norm_params(n, "ahead.")] + linears


@lru_cache(maxsize=4096)
def _numel(args: ModelArgs, part: str, tp: int, dp_shard: int) -> tuple[int, int]:
    blocks = {"block": block_params, "routed_block": partial(block_params, routed=True)}
    specs = {**blocks, "first": first_stage_params, "last": last_stage_params, "ahead": ahead_params}[part](args)
    pairs = [local_numel(s, tp, dp_shard) for s in specs]
    return sum(p[0] for p in pairs), sum(p[1] for p in pairs)


def replicated_numel(args: ModelArgs, rank: "RankParams") -> int:
    """Elements of the parameters TP replicates (norms, row-parallel biases, routers) on this rank."""
    dense, routed = rank.blocks(args)
    specs = (
        block_params(args) * dense
        + (block_params(args, routed=True) * routed if routed else [])
        + (last_stage_params(args) if rank.last else [])
        + ahead_params(args) * rank.ahead_modules
    )
    return sum(math.prod(s.shape) for s in specs if s.tp_dim is None)


@dataclass(frozen=True)
class RankParams:
    layers: int
    first: bool  # holds the embeddings
    last: bool  # holds the final norm and the output layer
    chunks: tuple[int, ...] = ()  # layers of each of its pipeline chunks (stage modules); () = one of `layers`
    routed_layers: int = 0  # of its layers, those with routed experts (moe.py)
    ahead_modules: int = 0  # multi-token prediction modules it holds besides its layers (models/parts): the last rank's
    chunk_routed: tuple[int, ...] = ()  # of each chunk's layers, those with routed experts

    def blocks(self, args: ModelArgs) -> tuple[int, int]:
        """(dense, MoE) transformer blocks it holds: its layers' and its MTP modules'."""
        ahead_routed = self.ahead_modules if parts.routed_layer(args, args.n_layers) else 0
        return self.layers - self.routed_layers + self.ahead_modules - ahead_routed, self.routed_layers + ahead_routed

    def checkpointed(self, mode: str) -> int:
        """Layers checkpointed: the trainer applies the mode to each stage module's own blocks."""
        return sum(checkpointed_layers(mode, c) for c in (self.chunks or (self.layers,)))

    @property
    def embedding(self) -> bool:
        """Holds the embedding: the first rank's, or a copy on the last, whose multi-token prediction modules read
        it (parallel/pipeline_ahead.py)."""
        return self.first or (self.last and self.ahead_modules > 0)

    def numel(self, args: ModelArgs, tp: int, dp_shard: int, ep: int = 1, etp: int = 0) -> tuple[int, int]:
        """(after TP, after TP and FSDP) parameter elements of this rank; `dp_shard` the FSDP ranks (dp_shard x
        cp), the routed experts split over etp (Layout.expert_tp; 0: tp) and over ep of the ranks, sharded over the
        rest (moe.py expert_shards)."""
        dense, routed = self.blocks(args)
        first, last = self.embedding, self.last
        return _rank_numel(args, dense, routed, first, last, tp, dp_shard, ep, self.ahead_modules, etp or tp)


@lru_cache(maxsize=65536)
def _rank_numel(
    args: ModelArgs, dense: int, routed: int, first: bool, last: bool, tp: int, d: int, ep: int, ahead: int, etp: int
) -> tuple[int, int]:
    """(after TP, after TP and FSDP over `d` ranks) elements of `dense` and `routed` blocks (their experts over ep,
    split over etp), the root's parts and `ahead` multi-token prediction modules."""
    kinds = [("block", dense), ("routed_block", routed), ("first", int(first)), ("last", int(last)), ("ahead", ahead)]
    totals = [(count * a, count * b) for kind, count in kinds if count for a, b in [_numel(args, kind, tp, d)]]
    experts = expert_numel(args, routed, etp, ep, expert_shards(tp, d, ep, etp))
    return sum(t[0] for t in totals) + experts[0], sum(t[1] for t in totals) + experts[1]


def pipeline_ranks(args: ModelArgs, layout: Layout) -> list[RankParams]:
    """What each pipeline rank holds: its stages' units (rank_units), on the ranks the schedule places them (V
    schedules put the first and the last stage on rank 0)."""
    dense, (ahead, _) = parts.first_routed_layer(args), parts.ahead_modules(args)
    written = layout.stage_layers.written
    return _pipeline_ranks(args.n_layers, layout.pp, layout.virtual_stages, layout.pp_schedule, dense, ahead, written)


@lru_cache(maxsize=4096)
def _pipeline_ranks(
    n_layers: int, pp: int, v: int, schedule_name: str, dense_layers: int = -1, mtp: int = 0, written: str = ""
) -> list[RankParams]:
    """`dense_layers`: the first layers without routed experts (-1: all); `mtp` modules with the output head."""
    first_routed = n_layers if dense_layers < 0 else dense_layers
    ranks = []
    for held in _rank_units(n_layers, pp, v, schedule_name, written, mtp):
        chunks = tuple(sum(1 for unit in units if 1 <= unit <= n_layers) for units in held)
        chunk_routed = tuple(sum(1 for unit in units if first_routed < unit <= n_layers) for units in held)
        last = any(n_layers + 1 in units for units in held)
        first = any(0 in units for units in held)
        ranks.append(RankParams(sum(chunks), first, last, chunks, sum(chunk_routed), mtp if last else 0, chunk_routed))
    return ranks


def layers_from(args: ModelArgs, layout: Layout, first: int) -> list[int]:
    """Each pipeline rank's layers at index `first` or later (a 4-bit recipe's bf16 tail: cost.py)."""
    shape = (layout.pp, layout.virtual_stages, layout.pp_schedule, layout.stage_layers.written)
    held = _rank_units(args.n_layers, *shape, parts.ahead_modules(args)[0])
    return [sum(1 for units in ranges for unit in units if first < unit <= args.n_layers) for ranges in held]


@lru_cache(maxsize=4096)
def _rank_units(n_layers: int, pp: int, v: int, schedule_name: str, written: str, mtp: int) -> list[list[range]]:
    """Each pipeline rank's stages as ranges of units (0 the embedding, 1..n the layers, n + 1 the output head with
    the MTP modules: parallel/pp_layout.py): parallel.pp_layout as written (the planner writes `auto` out:
    stage_balance.py), else the planner's even split of the layers over the pp x v stages in order (earlier stages
    take the remainder), the embedding with the first, the head with the last."""
    schedule = modes.schedule(schedule_name, "--pp-schedule")
    stages = pp * v if pp > 1 else 1
    if written and stages > 1:
        ranges = split_units(n_layers, stages, StageLayers(written=written), mtp)
    else:
        counts = [n_layers // stages + (1 if k < n_layers % stages else 0) for k in range(stages)]
        ends = [1 + sum(counts[: k + 1]) for k in range(stages)]
        ends[-1] += 1  # the output head
        ranges = [range(0 if k == 0 else ends[k - 1], ends[k]) for k in range(stages)]
    held: list[list[range]] = [[] for _ in range(pp)]
    for k, units in enumerate(ranges):
        held[schedules.rank_of_virtual_stage(k, pp, schedule) if pp > 1 else 0].append(units)
    return held


@dataclass(frozen=True)
class Memory:
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers

    def as_gb(self) -> dict:
        return {
            k: round(getattr(self, k) / 1e9, 3)
            for k in ("parameters", "gradients", "optimizer", "activations", "buffers", "total")
        }


def states_bytes(tp_numel: int, shard_numel: int, mode: str) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes by ZeRO mode (see the module docstring)."""
    parameters = 4 * shard_numel + (2 * tp_numel if mode in ("zero1", "zero2") else 0)
    gradients = 4 * (tp_numel if mode == "zero1" else shard_numel)
    return parameters, gradients, 8 * shard_numel


def rank_memory(
    args: ModelArgs,
    layout: Layout,
    seq_len: int,
    assumed: Assumptions,
    rank: RankParams,
    in_flight: float,
    received: float | None = None,
) -> Memory:
    """`in_flight` micro-batches (through all its layers) held at its peak; `received`: the hidden states its stages
    hold received then (default: `in_flight` for each of its chunks but the model's first stage)."""
    tp, ms, cp = layout.tp, layout.micro_batch_size, layout.cp
    tokens = ms * seq_len // cp
    sp = layout.sequence_parallel
    tp_numel, shard_numel = rank.numel(args, tp, layout.dp_shard * cp, layout.ep, layout.expert_tp)
    mode = "zero1" if layout.pp > 1 else layout.dp_shard_mode
    parameters, gradients, _ = states_bytes(tp_numel, shard_numel, mode)
    dtype = assumed.optimizer_state_dtype
    optimizer = state_bytes(args, layout, assumed.optimizer, rank, shard_numel, dtype)  # AdamW's or Muon's
    n_ckpt = rank.checkpointed(layout.activation_checkpoint)
    dense_layer, moe_layer, kept = _layer_kinds(args, layout, seq_len, assumed, kept=True)
    dense_layers = rank.layers - rank.routed_layers
    full_layer = (dense_layer * dense_layers + moe_layer * rank.routed_layers) / max(rank.layers, 1)
    gathered_kv = ms * seq_len * parts.block(args).heads.kv_width / tp * ACTIVATION_BYTES if cp > 1 else 0
    per_microbatch = n_ckpt * kept + (rank.layers - n_ckpt) * (full_layer + gathered_kv)
    per_microbatch += rank.ahead_modules * (ahead_module_bytes(args, tokens, dense_layer, moe_layer) + gathered_kv)
    output = output_activation_bytes(args, tokens, tp, sp) * (1 + rank.ahead_modules) if rank.last else 0
    if modes.pairs_interleaved(layout):
        output *= 2  # the paired Interleaved1F1B's last stage holds a forward's outputs beside the backward it pairs
    activations = in_flight * per_microbatch + output
    # Muon's step buffers live after the backward, where the activations were: only what passes them adds
    optimizer += max(0.0, step_buffer_bytes(args, layout, assumed.optimizer, rank, ACTIVATION_BYTES) - activations)

    d = layout.dp_shard * cp
    dense_blocks, moe_blocks = rank.blocks(args)
    layer_tp = _gathered_block(args, dense_blocks > 0, moe_blocks > 0, tp, d, layout.ep, layout.expert_tp)
    root_tp = _rank_numel(args, 0, 0, rank.embedding, rank.last, tp, d, 1, 0, tp)[0]
    # zero3: two gathered blocks (in use, prefetched) and the held root; all modes: an fp32 block's reduce-scatter
    fsdp = 4 * layer_tp + (2 * 2 * layer_tp + 2 * root_tp if mode == "zero3" else 0)
    recompute = max(dense_layer, moe_layer if rank.routed_layers else 0) if n_ckpt else 0  # one layer, rebuilt
    received = in_flight * ((len(rank.chunks) or 1) - rank.first) if received is None else received
    hidden = tokens * args.dim / (tp if sp else 1) * ACTIVATION_BYTES
    pipeline = schedules.held_receives(received, len(rank.chunks) or 1, rank.last) * hidden if layout.pp > 1 else 0
    logits_grad = loss_backward_bytes(args, tokens, tp) if rank.last else 0
    # the loss backward runs before any layer is rebuilt (the log-softmax it holds freed by then): the larger of the two
    buffers = FRAMEWORK_BYTES + fsdp + max(recompute, logits_grad) + pipeline + gathered_kv
    return Memory(parameters, gradients, optimizer, activations, buffers)


@lru_cache(maxsize=4096)
def _gathered_block(args: ModelArgs, dense: bool, routed: bool, tp: int, d: int, ep: int, etp: int) -> int:
    """Elements of the largest block FSDP gathers on a rank: a dense one, or an MoE one with its E / ep experts (their
    etp slices)."""
    if not routed:
        return _numel(args, "block", tp, d)[0] if dense else 0
    experts = expert_numel(args, 1, etp, ep, expert_shards(tp, d, ep, etp))[0]
    return max(_numel(args, "block", tp, d)[0] if dense else 0, _numel(args, "routed_block", tp, d)[0] + experts)


def _layer_kinds(args: ModelArgs, layout: Layout, seq_len: int, assumed: Assumptions, kept: bool = False) -> tuple:
    """(a dense layer's, an MoE layer's activations per micro-batch; with `kept` a checkpointed layer's input too)."""
    tokens = layout.micro_batch_size * seq_len // layout.cp
    experts = (layout.ep, assumed.moe_load_imbalance, layout.expert_tp, routed_tokens(tokens, layout))
    recomputes_sublayers = modes.checkpoint_mode(layout.activation_checkpoint).sublayers
    float8_cache = layout.float8 is not None and layout.float8.cache_activations  # the experts' activations in float8
    found = layer_bytes(args, tokens, layout.tp, layout.sequence_parallel, *experts, recomputes_sublayers, float8_cache)
    return found if kept else found[:2]


def _chunk_bytes(args: ModelArgs, layout: Layout, seq_len: int, layers: tuple, rank: RankParams) -> tuple:
    """What each of a rank's pipeline chunks keeps of one micro-batch, as rank_memory counts a rank's: its checkpointed
    layers' inputs, its other layers whole (`layers`: _layer_kinds'), the MTP modules in the model's last stage."""
    (dense, moe, kept), held = layers, []
    for n, routed in zip(rank.chunks, rank.chunk_routed):
        checkpointed = checkpointed_layers(layout.activation_checkpoint, n)
        held.append(checkpointed * kept + (n - checkpointed) * (dense * (n - routed) + moe * routed) / max(n, 1))
    if rank.ahead_modules:
        tokens = layout.micro_batch_size * seq_len // layout.cp
        held[-1] += rank.ahead_modules * ahead_module_bytes(args, tokens, dense, moe)
    return tuple(held)


def layout_memory(args: ModelArgs, layout: Layout, seq_len: int, assumed: Assumptions) -> Memory:
    """Memory of the fullest GPU under what the plan assumes (`assumed`): each kind's earliest rank (DualPipeV's
    chunks trade counts across the ranks: every rank), in flight falling from the first rank's to the last's."""
    schedule, candidates = modes.schedule(layout.pp_schedule, "--pp-schedule"), []
    if layout.pp > 1 and (schedule.in_flight in ("pipeline+1", "interleaved") or defers(layout)):  # unequal chunks
        extra = modes.INTERLEAVED_EXTRA_WARMUP if modes.pairs_interleaved(layout) else 0
        layers = _layer_kinds(args, layout, seq_len, assumed, kept=True)
        kinds = enumerate(pipeline_ranks(args, layout)) if schedule.v_shape else _earliest_of_each_kind(args, layout)
        for index, rank in kinds:
            held = _chunk_bytes(args, layout, seq_len, layers, rank)
            if defers(layout):  # what the input passes leave queued too, in the schedule's order
                in_flight, counts = queued_in_flight(
                    layout, index, held, chunk_deferred_bytes(args, layout, seq_len, rank)
                )
            elif schedule.v_shape:  # DualPipeV
                in_flight = schedules.dualpipe_in_flight(layout.pp, layout.microbatches, index, held)
                counts = schedules.dualpipe_chunks_in_flight(layout.pp, layout.microbatches, index)
            else:
                p, v, m = layout.pp, layout.virtual_stages, layout.microbatches
                in_flight, counts = schedules.interleaved_in_flight(p, v, m, index, held, extra)
            received = sum(counts) - (counts[0] if rank.first else 0)  # rank 0's first chunk: the model's first stage
            candidates.append(rank_memory(args, layout, seq_len, assumed, rank, in_flight, received))
        return max(candidates, key=lambda m: m.total)
    first, last = schedules.in_flight_microbatches(schedule, layout.pp, layout.microbatches)
    if pairs(layout):  # two micro-batches in flight (parallel/expert_overlap.py)
        first = last = 2.0
    span = max(layout.pp - 1, 1)
    for index, rank in _earliest_of_each_kind(args, layout):
        in_flight = last if rank.last and index else first + (last - first) * index / span
        candidates.append(rank_memory(args, layout, seq_len, assumed, rank, in_flight))
    return max(candidates, key=lambda m: m.total)


def _earliest_of_each_kind(args: ModelArgs, layout: Layout) -> tuple:
    """((its index, rank's parts), ...): the first pipeline rank of each distinct RankParams."""
    earliest: dict = {}
    for index, rank in enumerate(pipeline_ranks(args, layout)):
        earliest.setdefault(rank, index)
    return tuple((index, rank) for rank, index in earliest.items())
