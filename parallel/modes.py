"""The layout choices and their rules, in one place: pipeline schedules, ZeRO modes and activation-
checkpointing modes (the float8 recipes are float8_recipes.py's). The trainer (pipeline.py, fsdp.py,
activation_checkpoint.py, the config docs) and the planner read these tables, and `check_schedule`
refuses for both, so the planner never proposes a layout the trainer would refuse. No torch here:
the planner imports it and starts fast.

Pipeline schedules are torch.distributed.pipelining's, by the names `parallel.pp_schedule` takes.
Placement: single (one stage per rank), looped (v stages per rank, placed r, r + pp, ...) or V (two,
placed r and 2 pp - 1 - r, the schedule's own stage-to-rank map). Split-backward schedules run each
backward as an input-gradient pass (dI) and a later weight-gradient pass (dW); torch cannot split a
compiled stage's backward, so they refuse compile.

Planner costs, per micro-batch and per stage ("chunk") in units of its forward F, recomputed forward
R (checkpointing), input-gradient pass Bi and weight-gradient pass Bw, p stages, v chunks, m micro-batches:
  GPipe, 1F1B, Interleaved1F1B, LoopedBFS: bubble (p-1)(F+R+Bi+Bw), i.e. (p-1)/(v m) of the work;
  InterleavedZeroBubble (ZB-H1): (p-1)(F+R+Bi-Bw): deferred weight passes fill the drain;
  ZBVZeroBubble, DualPipeV (ZB-V): (p-1) max(0, F+R+Bi-2Bw): the V layout fills the fill too.
`in_flight` names the rule for the micro-batches whose activations a rank holds at the peak
(planner/schedules.py: in_flight_microbatches, interleaved_in_flight, dualpipe_in_flight). DualPipeV's own
lever, hiding expert all-to-all behind compute, does nothing for dense models.
"""

from __future__ import annotations

from dataclasses import dataclass

from trillion.errors import ConfigError
from trillion.models import parts


@dataclass(frozen=True)
class Schedule:
    name: str
    placement: str  # "single" | "looped" | "v", see the module docstring
    split_backward: bool  # separate dI and dW passes; refuses compile
    min_microbatches: str  # "" (any), "pp" (at least pp per step) or "stages" (at least 2 pp: DualPipeV)
    rounds: bool  # runs micro-batches in rounds of pp: their count must be a multiple of m // pp
    bubble_weights: tuple[float, float, float, float]  # planner: multipliers of (F, R, Bi, Bw) per idle slot
    in_flight: str  # planner: "all" | "pipeline" | "pipeline+1" | "interleaved"

    @property
    def v_shape(self) -> bool:
        return self.placement == "v"

    @property
    def virtual_stages(self) -> tuple[int, ...]:
        """Allowed stages per rank; () = any v >= 2 (looped)."""
        return {"single": (1,), "v": (2,), "looped": ()}[self.placement]

    @property
    def compile_allowed(self) -> bool:
        return not self.split_backward


SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (  # each proven by a tests/pipeline parity test
        Schedule("GPipe", "single", False, "", False, (1, 1, 1, 1), "all"),
        Schedule("1F1B", "single", False, "pp", False, (1, 1, 1, 1), "pipeline"),
        Schedule("Interleaved1F1B", "looped", False, "pp", True, (1, 1, 1, 1), "interleaved"),
        Schedule("LoopedBFS", "looped", False, "pp", False, (1, 1, 1, 1), "all"),
        Schedule("InterleavedZeroBubble", "looped", True, "pp", True, (1, 1, 1, -1), "interleaved"),
        Schedule("ZBVZeroBubble", "v", True, "pp", False, (1, 1, 1, -2), "pipeline"),
        Schedule("DualPipeV", "v", True, "stages", False, (1, 1, 1, -2), "pipeline+1"),
    )
}
DEFAULT_VIRTUAL_STAGES = 2  # looped schedules' stages per rank when parallel.pp_virtual_stages=0


def schedule(name: str, setting: str = "parallel.pp_schedule") -> Schedule:
    """The schedule by its name in any case; `setting` is what the user wrote it as, for the error."""
    for known in SCHEDULES.values():
        if known.name.lower() == name.lower():
            return known
    raise ConfigError(f"{setting}={name!r} is not known. Use one of: {', '.join(SCHEDULES)}.")


def stages_per_rank(s: Schedule, requested: int) -> int:
    """1 for single-stage schedules, 2 for V-shaped ones; requested (0 = 2) for looped ones."""
    if s.placement == "v":
        if requested not in (0, 2):
            raise ConfigError(
                f"parallel.pp_virtual_stages={requested}: parallel.pp_schedule={s.name} runs exactly "
                "two stages per rank (a V). Use --parallel.pp_virtual_stages=2 (or 0), or a looped "
                "schedule (Interleaved1F1B, InterleavedZeroBubble) for other counts."
            )
        return 2
    if s.placement == "single":
        if requested > 1:
            raise ConfigError(
                f"parallel.pp_virtual_stages={requested}: parallel.pp_schedule={s.name} runs one stage "
                "per rank. Use --parallel.pp_virtual_stages=1 or a looped schedule (Interleaved1F1B)."
            )
        return 1
    return requested if requested >= 1 else DEFAULT_VIRTUAL_STAGES


def check_schedule(
    name: str,
    pp: int,
    n_microbatches: int,
    virtual_stages: int = 0,
    compile_enabled: bool = False,
    *,
    n_layers: int | None = None,
) -> tuple[Schedule, int]:
    """Raise ConfigError for a schedule the trainer cannot run with pp ranks and n_microbatches per
    step (and, given n_layers, more stages than the model's n_layers + embedding + output units);
    returns (the schedule, stages per rank). With pp = 1 no pipeline runs: only the name is checked."""
    if pp < 1:
        raise ConfigError(f"parallel.pp={pp} must be a positive degree; use 1 to turn pipelining off.")
    s = schedule(name)
    if pp == 1:
        return s, 1
    v = stages_per_rank(s, virtual_stages)
    stages = pp * v
    if n_layers is not None and stages > n_layers + 2:
        raise ConfigError(
            f"parallel.pp={pp} x {v} stage(s) per rank = {stages} pipeline stages, but the model has only "
            f"{n_layers} layers + embedding + output = {n_layers + 2} to split; each stage needs at least one. "
            f"Use --parallel.pp={max(1, (n_layers + 2) // v)} or less."
        )
    if s.min_microbatches and n_microbatches < pp:
        raise ConfigError(
            f"parallel.pp_schedule={s.name} needs at least as many micro-batches per step as pipeline ranks, but "
            f"global / (micro x data-parallel ranks) = {n_microbatches} < parallel.pp={pp}. Raise "
            f"training.global_batch_size or lower training.micro_batch_size, or use --parallel.pp_schedule=GPipe."
        )
    if s.min_microbatches == "stages" and n_microbatches < stages:
        raise ConfigError(
            f"parallel.pp_schedule={s.name} needs at least as many micro-batches per step as pipeline stages "
            f"(2 x parallel.pp = {stages}), but global / (micro x data-parallel ranks) = {n_microbatches}. Raise "
            "training.global_batch_size or lower training.micro_batch_size, or use "
            "--parallel.pp_schedule=ZBVZeroBubble."
        )
    rounds = max(1, n_microbatches // pp)
    if s.rounds and n_microbatches % rounds:
        raise ConfigError(
            f"parallel.pp_schedule={s.name} runs micro-batches in rounds of pp={pp}: {n_microbatches} "
            f"micro-batches per step must be a multiple of the {rounds} rounds. Use a global batch giving "
            f"{rounds * pp} or {(rounds + 1) * pp} micro-batches."
        )
    if compile_enabled and not s.compile_allowed:
        raise ConfigError(
            f"parallel.pp_schedule={s.name} splits each backward into input- and weight-gradient passes, "
            "which torch.distributed.pipelining does not support for compiled stages. Use "
            "--compile.enabled=false, or a schedule with a full backward (1F1B, Interleaved1F1B)."
        )
    return s, v


def check_layout_schedule(layout, n_layers: int) -> tuple[Schedule, int]:
    """check_schedule of a resolved layout (parallel/layout.py Layout), and parallel.defer_weight_grads against it:
    what the trainer (pipeline.py validate_pipeline) and the planner (planner/search.py trainer_refusal) both ask."""
    checked = check_schedule(
        layout.pp_schedule, layout.pp, layout.microbatches, layout.virtual_stages, layout.compile, n_layers=n_layers
    )
    if layout.defer_weight_grads and not (layout.pp > 1 and checked[0].split_backward):
        raise ConfigError(
            "parallel.defer_weight_grads=true queues weight gradients for a pipeline schedule's weight-gradient "
            f"action, but parallel.pp={layout.pp} with pp_schedule={layout.pp_schedule} has none. Use "
            "--parallel.pp=2 or more with --parallel.pp_schedule=DualPipeV or ZBVZeroBubble, or drop "
            "--parallel.defer_weight_grads."
        )
    if layout.defer_weight_grads and layout.tp > 1:
        raise ConfigError(
            f"parallel.defer_weight_grads=true defers the weight gradients of linears with whole weights, but "
            f"parallel.tp={layout.tp} splits them (DTensor weights, whose gradients are not deferred here). Use "
            "--parallel.tp=1 (more pipeline, expert or data parallelism instead), or drop "
            "--parallel.defer_weight_grads."
        )
    return checked


def joins_weight_passes(layout) -> bool:
    """Whether a split-backward schedule runs its weight passes with their input passes (pipeline_pairing.py
    join_weight_passes): under activation checkpointing a deferred weight pass would recompute its regions a second
    time, which selective checkpointing refuses and which would repeat the expert all-to-alls of replayed blocks.
    Plain full or every-N-th checkpointing of a model without expert parallelism recomputes twice and stays split.
    parallel.defer_weight_grads splits without a second pass (deferred_weight_grads.py): nothing is joined."""
    mode = checkpoint_mode(layout.activation_checkpoint)
    twice_refused = mode.op_level or mode.sublayers or (layout.ep > 1 and mode.replays_blocks)
    split = layout.pp > 1 and schedule(layout.pp_schedule).split_backward
    return split and twice_refused and not layout.defer_weight_grads


PAIRED_SCHEDULES = ("DualPipeV", "Interleaved1F1B")  # their steady state pairs a forward with a backward
INTERLEAVED_EXTRA_WARMUP = 1  # forwards a rank runs beyond Interleaved1F1B's warm-up when paired (pipeline_pairing.py)


def pairs_across_stages(layout) -> bool:
    """Whether parallel.ep_overlap pairs one micro-batch's forward with another's backward on each OVERLAP_F_B of
    DualPipeV, or of Interleaved1F1B with its extra warm-up (parallel/pipeline_pairing.py; the planner prices it:
    planner/moe.py)."""
    paired_schedule = schedule(layout.pp_schedule).name in PAIRED_SCHEDULES  # a config's in any case
    return layout.ep_overlap and layout.ep > 1 and layout.pp > 1 and paired_schedule


def pairs_interleaved(layout) -> bool:
    """Whether the pairing runs under Interleaved1F1B with its extra warm-up (pipeline_pairing.py
    PairedInterleaved1F1B): one chunk more in flight a rank, a second set of outputs on the last stage."""
    return pairs_across_stages(layout) and layout.pp_schedule == "Interleaved1F1B"


def pairs_in_a_v(layout) -> bool:
    """Whether the pairing runs a V's two stages on a rank against each other (DualPipeV), which the stage split
    balances so that each stage keeps compute of its own (pp_layout.balance_paired)."""
    return pairs_across_stages(layout) and schedule(layout.pp_schedule).v_shape


@dataclass(frozen=True)
class ZeroMode:
    """What FSDP keeps gathered between uses (parallel/fsdp.py has the table of costs)."""

    name: str
    reshard_after_forward: bool  # blocks give their gathered parameters back after forward
    gathered_across_microbatches: bool  # parameters stay gathered until the step's last micro-batch
    sync_every_microbatch: bool  # gradients reduce-scattered every micro-batch, else once per step


ZERO_MODES: dict[str, ZeroMode] = {
    z.name: z
    for z in (
        ZeroMode("zero1", False, True, False),
        ZeroMode("zero2", False, True, True),
        ZeroMode("zero3", True, False, True),
    )
}


def zero_mode(name: str) -> ZeroMode:
    if name not in ZERO_MODES:
        raise ConfigError(
            f"parallel.dp_shard_mode={name!r} is not known. Use zero1, zero2 or zero3 "
            "(zero3 uses the least memory; zero1 the least communication)."
        )
    return ZERO_MODES[name]


@dataclass(frozen=True)
class CheckpointMode:
    """Which blocks recompute their activations in backward (parallel/activation_checkpoint.py)."""

    name: str
    every: int  # checkpoint every N-th block; 0 = none
    op_level: bool = False  # save matmul/attention outputs, recompute only the cheap elementwise work
    # DeepSeek-V3's: no block replayed; each sublayer's norm, latent attention's up-projections and the
    # experts' SwiGLU recomputed (parallel/activation_checkpoint.py), so no expert all-to-all runs twice
    sublayers: bool = False

    @property
    def period(self) -> int:
        """Blocks after which the pattern repeats."""
        return max(1, self.every)

    @property
    def replays_blocks(self) -> bool:
        """Whether checkpointed blocks run their whole forward again in backward (the MoE dispatch included)."""
        return self.every > 0


SELECTIVE_EVERY = 2
CHECKPOINT_MODES: dict[str, CheckpointMode] = {
    c.name: c
    for c in (
        CheckpointMode("none", 0),
        CheckpointMode("full", 1),
        CheckpointMode("selective", SELECTIVE_EVERY),
        CheckpointMode("selective:op", 1, op_level=True),
        CheckpointMode("deepseek", 0, sublayers=True),
    )
}  # and selective:N, every N-th block


def checkpoint_mode(name: str) -> CheckpointMode:
    """The mode `parallel.activation_checkpoint` names: one of CHECKPOINT_MODES or selective:N."""
    if name in CHECKPOINT_MODES:
        return CHECKPOINT_MODES[name]
    every = name.split(":", 1)[1] if name.startswith("selective:") else ""
    if every.isdigit() and int(every) > 0:
        return CheckpointMode(name, int(every))
    raise ConfigError(
        f"parallel.activation_checkpoint={name!r} is not known. Use none, full, selective "
        f"(every {SELECTIVE_EVERY}nd block), selective:N (every N-th block, e.g. selective:3), "
        "selective:op (save matmul outputs, recompute the rest) or deepseek (recompute the norms, latent "
        "attention's up-projections and the experts' SwiGLU)."
    )


def checkpoint_refusal(name: str, args) -> str:
    """Why `name` cannot recompute this model's parts ("" when it can): DeepSeek's mode recomputes latent attention's
    up-projections (models/parts: Part.up_projections), which a model without them has none of."""
    if not checkpoint_mode(name).sublayers or any(part.up_projections for part in parts.block(args).parts):
        return ""
    return (
        f"parallel.activation_checkpoint={name} recomputes the norms and latent attention's up-projections in "
        "backward, but this model's attention has no up-projections (it is not latent attention: DeepSeek-V2/V3, "
        "Kimi K2, debug-deepseek). Use --parallel.activation_checkpoint=selective:op (keeps matmul outputs, "
        "recomputes the element-wise work) or full."
    )


def checkpointed_blocks(name: str, n_layers: int) -> list[int]:
    """Indices of the blocks (of a model or a pipeline stage) that `name` checkpoints."""
    mode = checkpoint_mode(name)
    return list(range(0, n_layers, mode.every)) if mode.every else []


def recompute_fraction(name: str, n_layers: int) -> float:
    """Share of the blocks' forward FLOPs that run twice (for hardware FLOPs). The op-level policy
    recomputes no matmul, and matmuls are nearly all of a block's FLOPs."""
    if checkpoint_mode(name).op_level:
        return 0.0
    return len(checkpointed_blocks(name, n_layers)) / n_layers


def stages_recompute_fraction(name: str, blocks_per_stage: list[int]) -> float:
    """recompute_fraction of a pipelined model: each stage module checkpoints its own blocks (every
    second of a stage's, starting with its first, under selective), so one block per stage under
    selective recomputes all of them, not half."""
    if checkpoint_mode(name).op_level or not sum(blocks_per_stage):
        return 0.0
    return sum(len(checkpointed_blocks(name, blocks)) for blocks in blocks_per_stage) / sum(blocks_per_stage)
