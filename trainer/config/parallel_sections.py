"""The [parallel] section: the layout's degrees, the pipeline's schedule and split, recomputation."""

from dataclasses import dataclass

from trillion.parallel.layout import EP_DISPATCH
from trillion.parallel.modes import CHECKPOINT_MODES, DEFAULT_VIRTUAL_STAGES, SCHEDULES, SELECTIVE_EVERY, ZERO_MODES
from trillion.trainer.config.checks import Flag, OneOf, Range, Text
from trillion.trainer.config.fields import POSITIVE, doc


def _names(**rule) -> str:
    """The schedules whose table entries match `rule`, e.g. placement="v"."""
    return ", ".join(s.name for s in SCHEDULES.values() if all(getattr(s, k) == v for k, v in rule.items()))


SCHEDULE_DOC = (
    f"Pipeline schedule from torch.distributed.pipelining: {' | '.join(SCHEDULES)}; each has a parity test. "
    f"All but {_names(min_microbatches='')} need at least pp micro-batches per step, "
    f"{_names(min_microbatches='stages')} "
    f"2 pp. The zero-bubble ones ({_names(split_backward=True)}) split the backward and refuse compile."
)


@dataclass
class Parallel:
    dp_replicate: int = doc(1, "Data-parallel replicas (DDP/HSDP outer dimension).", POSITIVE)
    dp_shard: int = doc(
        -1,
        "Sharded data parallelism (FSDP2) degree; -1 = what the world size leaves.",
        Range(1, also={-1: "what the world size leaves"}),
    )
    dp_shard_mode: str = doc(
        "zero3", f"{' | '.join(ZERO_MODES)}: what FSDP keeps sharded between uses.", OneOf(tuple(ZERO_MODES))
    )
    tp: int = doc(1, "Tensor-parallel degree (keep inside a node).", POSITIVE)
    ep: int = doc(
        1,
        "Expert-parallel degree (MoE models): the routed experts are split over ep ranks (which ones: etp); tokens "
        "reach them by all-to-all. ep divides the expert count.",
        POSITIVE,
    )
    etp: int = doc(
        0,
        "Expert tensor parallelism, 1 or tp (with ep > 1). 1: MoE parallel folding, ep borrows the tp ranks, then "
        "cp, then dp_shard (ep a multiple of cp x tp dividing dp_shard x cp x tp), each tp rank routing and sending "
        "only its own sequence-parallel tokens to whole experts. tp: the experts tensor-parallel like the shared "
        "ones, ep inside dp_shard x cp, every tp rank sending the tp group's tokens. 0 = auto: 1 where ep can fold "
        "(the fewest bytes), else tp; the log names the choice.",
        Range(1, also={0: "auto: the fewest bytes"}),
    )
    ep_dispatch: str = doc(
        "auto",
        "How tokens reach the routed experts under ep: expert (a row per chosen expert) | rank (one row per ep rank "
        "holding any of the token's experts, which sums their outputs before the return trip) | node (one row per "
        "node over the network, then on to that node's ranks; group-limited routing with one group per node keeps "
        "a token to topk_groups nodes) | auto (node when the ep group spans nodes, else rank).",
        OneOf(("auto", *EP_DISPATCH)),
    )
    ranks_per_node: int = doc(
        0,
        "Processes per node, for the per-node dispatch (0 = the launcher's LOCAL_WORLD_SIZE, torchrun's or SLURM's; "
        "else job.hardware's GPUs per node; else one node). Tests on one machine set it to call 4 ranks 2 nodes of 2.",
        Range(1, also={0: "from the launcher"}),
    )
    ep_overlap: bool = doc(
        False,
        "Overlap the expert all-to-alls with compute: the shared experts run while the dispatch is in flight, and "
        "each MoE layer's tokens go in two chunks, one chunk's all-to-all beside the other's experts (forward and "
        "backward; parallel/expert_overlap.py); with one pipeline stage and zero1/zero2, two micro-batches' forwards "
        "take turns at the all-to-alls; under pp_schedule=DualPipeV each OVERLAP_F_B's forward and backward do, and "
        "under Interleaved1F1B each steady-state forward and the backward after it, with one extra warm-up forward "
        "per rank (Kimi K2's recipe; parallel/pipeline_pairing.py).",
        Flag(),
    )
    ep_pairing_phase: int = doc(
        -1,
        "Where each paired backward starts against its forward under pp_schedule=DualPipeV or Interleaved1F1B with "
        "parallel.ep_overlap: it hands the turn straight back this many times first. The two sides then alternate, "
        "so this sets which segment of the other side's layer (its attention, shared experts or routed experts) each "
        "expert all-to-all travels beside. From 0 to one less than the turns a side takes a MoE layer: 3 per rank or "
        "per expert dropless, 2 with a capacity, 5 per node. -1 = auto, once the model is known: the phase that puts "
        "the rows, the combine and their reverses beside the other side's routed experts and the heavier (in FLOPs a "
        "token) of its attention and shared experts: per rank or per expert 1, or 0 where the shared experts are the "
        "heavier; per node 4, or 2; 0 with a capacity (parallel/ep_checks.py). `trillion plan` writes the phase "
        "that leaves the fewest all-to-alls exposed at the layout's shapes (planner/pairing.py).",
        Range(0, also={-1: "auto"}),
    )
    defer_weight_grads: bool = doc(
        False,
        "Under a pipeline schedule that splits each backward (ZBVZeroBubble, DualPipeV, the zero-bubble ones), a "
        "stage's backward runs once and queues the weight gradients of its plain linears and bf16/fp32 routed "
        "experts for the schedule's weight-gradient action (DeepSeek-V3's WeightGradStore, Megatron-Core's "
        "--delay-wgrad-compute). Without it, under activation checkpointing that splits cannot run twice (selective "
        "or sublayer modes; replayed MoE blocks) each weight pass runs with its input pass, and the schedule's "
        "fill at the pipeline's ends is lost. Costs the memory of each queued product's input and output gradient "
        "until its W. Float8 linears and experts and tensor-parallel linears compute theirs in the input pass "
        "(parallel/deferred_weight_grads.py).",
        Flag(),
    )
    tp_overlap: int = doc(
        0,
        "Hide tensor parallelism's collectives on any backend (NCCL, RCCL, gloo), eager: each rank's slice of the "
        "sequence is cut into this many chunks, and each chunk's all-gather (before the attention's and MLP's column "
        "linears and the output head) or reduce-scatter (after their row linears) travels while another chunk's GEMM "
        "runs, forward and backward (parallel/tp_overlap.py). Must divide seq_len / cp / tp. 0 = off (DTensor's "
        "collectives, exposed).",
        Range(1, also={0: "off"}),
    )
    async_tp: bool = doc(
        False,
        "torch's async TP on CUDA: under compile, Inductor fuses each TP all-gather and reduce-scatter with its GEMM "
        "over symmetric memory (float8 included), as torchtitan's enable_async_tensor_parallel. Needs tp > 1, "
        "compile.enabled and a torch with symmetric memory for the GPU; elsewhere use tp_overlap.",
        Flag(),
    )
    pp: int = doc(1, "Pipeline-parallel degree.", POSITIVE)
    pp_schedule: str = doc("1F1B", SCHEDULE_DOC, OneOf(tuple(SCHEDULES), case_sensitive=False))
    pp_virtual_stages: int = doc(
        0,
        f"Pipeline stages per rank for looped schedules ({_names(placement='looped')}); 0 = {DEFAULT_VIRTUAL_STAGES}. "
        f"One for {_names(placement='single')}; two for {_names(placement='v')}.",
        Range(1, also={0: "the schedule's default"}),
    )
    pp_layout: str = doc(
        "",
        "What each pipeline stage holds: stages separated by |, a stage's parts by +: E (the embedding), a count of "
        "transformer layers, M (multi-token prediction modules, beside O) and O (the output head), S*k repeating a "
        "stage, e.g. 'E+3 | 2*29 | M+O' (pp x stages per rank stages; the layers add up to model.n_layers) | auto "
        "(balanced by each unit's forward and backward FLOPs: a dense layer, an MoE layer's active experts, the head "
        "with the multi-token prediction modules) | '' (the even split, or the three settings below, which "
        "pp_layout replaces).",
        Text(),
    )
    pp_layers_per_stage: int = doc(
        0,
        "Transformer layers on each pipeline stage (0 = split automatically, balanced, counting the embedding and the "
        "output as one layer each). First + (stages - 2) x this + last must equal model.n_layers; stages = pp x "
        "virtual stages.",
        Range(1, also={0: "automatic"}),
    )
    pp_first_stage_layers: int = doc(
        -1,
        "Transformer layers on the first pipeline stage, beside the embedding (-1 = pp_layers_per_stage - 1, as the "
        "embedding counts as a layer; automatic when that is 0 too). 0 = the embedding alone.",
        Range(0, also={-1: "from pp_layers_per_stage"}),
    )
    pp_last_stage_layers: int = doc(
        -1,
        "Transformer layers on the last pipeline stage, beside the final norm and output (-1 = pp_layers_per_stage - "
        "1; automatic when that is 0 too). 0 = the output alone.",
        Range(0, also={-1: "from pp_layers_per_stage"}),
    )
    cp: int = doc(
        1,
        "Context-parallel degree: each rank holds 1/cp of every sequence (a head and a tail chunk, balanced for "
        "causal attention); training.seq_len must divide by 2 cp (x tp).",
        POSITIVE,
    )
    activation_checkpoint: str = doc(
        "none",
        f"{' | '.join(CHECKPOINT_MODES)} | selective:N (every N-th block): which blocks recompute their activations "
        f"in backward (selective: every {SELECTIVE_EVERY}nd; selective:op: every block, saving matmul outputs; "
        "deepseek: DeepSeek-V3's, no block replayed, the norms, latent attention's up-projections and the experts' "
        "SwiGLU recomputed: latent-attention models only).",
        OneOf((*CHECKPOINT_MODES, "selective:N")),
    )
