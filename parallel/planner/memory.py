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
state instead of AdamW's 8, and its step's buffers count where they pass the activations (optimizer.py). The
root (embeddings, final norm, output) is never resharded after forward, so under zero3 its bf16 copy is held
through the step too. A
pipeline schedule turns gradient sync off until the last micro-batch and keeps its stages
gathered from their first backward on, whatever the mode, so with pp > 1 every mode costs zero1's
bytes (measured in gloo runs by `trillion estimate`, trainer/tools/estimate/dry_run.py).
Activations follow Korthikanti et al. 2022 without dropout and with flash
attention (no s^2 terms): 34 s b h bytes per GPT layer in bf16. With sequence parallelism the
norm inputs are split over TP ranks, but DTensor saves the all-gathered inputs of the
column-parallel linears whole, so those stay s b h each.
Context parallelism (cp): a rank holds s / cp of every sequence, so its activations are those of
s / cp tokens, plus the whole sequence's K and V that attention gathers per block: kept for backward
by every block that is not checkpointed, held once while one block runs. FSDP shards the states over
dp_shard x cp (the cp ranks hold the same weights).
"""

import math
from dataclasses import dataclass
from functools import lru_cache, partial

from trillion.models import parts
from trillion.models.args import ModelArgs
from trillion.models.parts.spec import Linear, Norm
from trillion.parallel import modes
from trillion.parallel.layout import Layout
from trillion.parallel.modes import checkpointed_blocks
from trillion.parallel.planner.assumptions import Assumptions
from trillion.parallel.planner.moe import expert_numel, expert_shards, moe_activation_bytes, pairs, routed_tokens
from trillion.parallel.planner.optimizer import state_bytes, step_buffer_bytes
from trillion.parallel.planner.schedules import in_flight_microbatches, rank_of_virtual_stage, stage_layers
from trillion.parallel.planner.shards import ParamSpec, local_numel

ACTIVATION_BYTES = 2  # bf16
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
    """What each pipeline rank holds; V schedules put the first and the last stage on rank 0."""
    dense, (ahead, _) = parts.first_routed_layer(args), parts.ahead_modules(args)
    return _pipeline_ranks(args.n_layers, layout.pp, layout.virtual_stages, layout.pp_schedule, dense, ahead)


@lru_cache(maxsize=4096)
def _pipeline_ranks(
    n_layers: int, pp: int, v: int, schedule_name: str, dense_layers: int = -1, mtp: int = 0
) -> list[RankParams]:
    """`dense_layers`: the first layers without routed experts (-1: all); `mtp` modules on the last rank."""
    schedule = modes.schedule(schedule_name, "--pp-schedule")
    chunks = stage_layers(n_layers, pp, v, schedule)
    last_rank = 0 if schedule.v_shape and pp > 1 else pp - 1
    first_moe = n_layers if dense_layers < 0 else dense_layers
    starts = _virtual_stage_starts(n_layers, pp, v, schedule)
    ranks = []
    for r, c in enumerate(chunks):
        moe = sum(max(0, start + count - max(first_moe, start)) for start, count in zip(starts[r], c))
        ranks.append(RankParams(sum(c), r == 0, r == last_rank, tuple(c), moe, mtp if r == last_rank else 0))
    return ranks


def layers_from(args: ModelArgs, layout: Layout, first: int) -> list[int]:
    """Each pipeline rank's layers at index `first` or later (a 4-bit recipe's bf16 tail: cost.py)."""
    schedule = modes.schedule(layout.pp_schedule, "--pp-schedule")
    chunks = stage_layers(args.n_layers, layout.pp, layout.virtual_stages, schedule)
    starts = _virtual_stage_starts(args.n_layers, layout.pp, layout.virtual_stages, schedule)
    return [sum(max(0, s + n - max(first, s)) for s, n in zip(starts[r], c)) for r, c in enumerate(chunks)]


def _virtual_stage_starts(n_layers: int, pp: int, v: int, schedule) -> list[list[int]]:
    """First layer index of each rank's chunks, in the order stage_layers lists them."""
    stages = pp * v
    counts = [n_layers // stages + (1 if k < n_layers % stages else 0) for k in range(stages)]
    starts: list[list[int]] = [[] for _ in range(pp)]
    for k in range(stages):
        starts[rank_of_virtual_stage(k, pp, schedule)].append(sum(counts[:k]))
    return starts


def layer_activation_bytes(
    args: ModelArgs,
    tokens: int,
    tp: int,
    sequence_parallel: bool,
    checkpointed: bool,
    dtype_bytes: int = ACTIVATION_BYTES,
    routed: bool = False,
) -> float:
    """Bytes one layer keeps for backward for `tokens` (= micro-batch size x sequence length).

    Replicated over TP ranks (split by sequence parallelism): the two norm inputs. Always whole:
    the two norm outputs, which the column-parallel linears save (all-gathered under SP).
    Split by TP: q, k, v and the attention output (kept by flash attention), the output
    projection's input, the MLP's hidden activations (GELU: input and output; SwiGLU: w1 and w3
    outputs, silu output, product). Flash attention adds an fp32 log-sum-exp per head. Latent attention adds
    its latents, whole on every TP rank. Each part declares what it keeps (models/parts, `saved`).
    A checkpointed layer keeps only its input. `routed`: an MoE layer's (its attention and shared experts; its
    routed experts moe.moe_activation_bytes counts).
    """
    h, block = args.dim, parts.block(args, routed)
    split = tp if sequence_parallel else 1
    if checkpointed:
        return tokens * h / split * dtype_bytes
    norm_inputs = sum(n.features for n in block.norms)
    replicated = norm_inputs / split
    whole = norm_inputs + sum(p.saved.whole for p in block.parts)
    sharded = sum(p.saved.split / tp for p in block.parts)
    logsumexp = 4 * block.heads.heads / tp
    return tokens * ((replicated + whole + sharded) * dtype_bytes + logsumexp)


def output_activation_bytes(
    args: ModelArgs, tokens: int, tp: int, sequence_parallel: bool, dtype_bytes: int = ACTIVATION_BYTES
) -> float:
    """Final norm input and output, and the fp32 log-softmax the cross-entropy keeps."""
    split = tp if sequence_parallel else 1
    return tokens * ((args.dim / split + args.dim) * dtype_bytes + 4 * args.vocab_size / tp)


def checkpointed_layers(mode: str, n_layers: int) -> int:
    """How many of a stage module's layers are checkpointed (the trainer applies the mode to each
    stage module's own blocks: selective checkpoints every second one, starting with the first)."""
    return len(checkpointed_blocks(mode, n_layers))


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
    args: ModelArgs, layout: Layout, seq_len: int, assumed: Assumptions, rank: RankParams, in_flight: float
) -> Memory:
    tp, ms, cp = layout.tp, layout.micro_batch_size, layout.cp
    tokens = ms * seq_len // cp
    sp = layout.sequence_parallel
    tp_numel, shard_numel = rank.numel(args, tp, layout.dp_shard * cp, layout.ep, layout.expert_tp)
    mode = "zero1" if layout.pp > 1 else layout.dp_shard_mode
    parameters, gradients, _ = states_bytes(tp_numel, shard_numel, mode)
    optimizer = state_bytes(args, layout, assumed.optimizer, rank, shard_numel)  # AdamW's or Muon's (optimizer.py)

    n_ckpt = rank.checkpointed(layout.activation_checkpoint)
    experts = (layout.ep, assumed.moe_load_imbalance, layout.expert_tp, routed_tokens(tokens, layout))
    float8_cache = layout.float8 is not None and layout.float8.cache_activations  # the experts' activations in float8
    dense_layer, moe_layer, kept = _layer_bytes(args, tokens, tp, sp, *experts, float8_cache)
    full_layer = (dense_layer * (rank.layers - rank.routed_layers) + moe_layer * rank.routed_layers) / max(
        rank.layers, 1
    )
    gathered_kv = ms * seq_len * parts.block(args).heads.kv_width / tp * ACTIVATION_BYTES if cp > 1 else 0
    per_microbatch = n_ckpt * kept + (rank.layers - n_ckpt) * (full_layer + gathered_kv)
    # an MTP module (models/parts), not checkpointed: its block, its projection's input; its output as the root's
    mtp_block = moe_layer if parts.routed_layer(args, args.n_layers) else dense_layer
    mtp = mtp_block + 2 * tokens * args.dim * ACTIVATION_BYTES + gathered_kv
    per_microbatch += rank.ahead_modules * mtp
    output = output_activation_bytes(args, tokens, tp, sp) * (1 + rank.ahead_modules) if rank.last else 0
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
    pipeline = (
        2 * layout.virtual_stages * tokens * args.dim / (tp if sp else 1) * ACTIVATION_BYTES if layout.pp > 1 else 0
    )
    logits_grad = (4 + 2) * tokens * args.vocab_size / tp if rank.last else 0
    buffers = FRAMEWORK_BYTES + fsdp + recompute + pipeline + logits_grad + gathered_kv
    return Memory(parameters, gradients, optimizer, activations, buffers)


@lru_cache(maxsize=65536)
def _layer_bytes(
    args: ModelArgs, tokens: int, tp: int, sp: bool, ep: int, imbalance: float, etp: int, routed: int, float8: bool
) -> tuple[float, float, float]:
    """(a dense layer's, an MoE layer's activations kept for backward, a checkpointed layer's input); an MoE layer's
    routed part for the `routed` tokens the rank routes (moe.py routed_tokens) and its experts' etp slices, in
    float8 with `float8` (float8.cache_activations)."""
    dense = layer_activation_bytes(args, tokens, tp, sp, checkpointed=False)
    kept = layer_activation_bytes(args, tokens, tp, sp, checkpointed=True)
    if not parts.routed_experts(args):
        return dense, 0.0, kept
    moe = layer_activation_bytes(args, tokens, tp, sp, checkpointed=False, routed=True) + moe_activation_bytes(
        args, routed, etp, ep, imbalance, ACTIVATION_BYTES, float8
    )
    return dense, moe, kept


@lru_cache(maxsize=4096)
def _gathered_block(args: ModelArgs, dense: bool, routed: bool, tp: int, d: int, ep: int, etp: int) -> int:
    """Elements of the largest block FSDP gathers on a rank: a dense one, or an MoE one with its E / ep experts (their
    etp slices)."""
    if not routed:
        return _numel(args, "block", tp, d)[0] if dense else 0
    experts = expert_numel(args, 1, etp, ep, expert_shards(tp, d, ep, etp))[0]
    return max(_numel(args, "block", tp, d)[0] if dense else 0, _numel(args, "routed_block", tp, d)[0] + experts)


def layout_memory(args: ModelArgs, layout: Layout, seq_len: int, assumed: Assumptions) -> Memory:
    """Memory of the fullest GPU under what the plan assumes (`assumed`): the earliest rank of each kind (in-flight
    micro-batches fall linearly from the first rank's to the last's, as 1F1B's p - r). An MoE model's all-expert
    middle ranks can pass a first rank of dense blocks (deepseek-v3-671b: `trillion estimate` measured 100 GB on one
    where the first rank held 21)."""
    schedule = modes.schedule(layout.pp_schedule, "--pp-schedule")
    first, last = in_flight_microbatches(schedule, layout.pp, layout.virtual_stages, layout.microbatches)
    if pairs(layout):  # two micro-batches in flight (parallel/expert_overlap.py)
        first = last = 2.0
    span, candidates = max(layout.pp - 1, 1), []
    for rank, index in _earliest_of_each_kind(args, layout.pp, layout.virtual_stages, layout.pp_schedule):
        in_flight = last if rank.last and index else first + (last - first) * index / span
        candidates.append(rank_memory(args, layout, seq_len, assumed, rank, in_flight))
    return max(candidates, key=lambda m: m.total)


@lru_cache(maxsize=4096)
def _earliest_of_each_kind(args: ModelArgs, pp: int, v: int, schedule_name: str) -> tuple:
    """((rank's parts, its index), ...): the first pipeline rank of each distinct RankParams."""
    earliest: dict = {}
    for index, rank in enumerate(pipeline_ranks(args, Layout(pp=pp, pp_schedule=schedule_name, virtual_stages=v))):
        earliest.setdefault(rank, index)
    return tuple(earliest.items())
