"""The planner: every valid parallel layout of a model on a machine, pruned by memory, ranked by
predicted throughput, with time, energy and cost for a token budget.

parallel/layout.py (the layout), planner/assumptions.py (what a plan assumes beyond it), planner/schedules.py
(pipeline schedules), planner/memory.py (bytes per GPU) and
planner/cost.py (seconds per step) hold the model; planner/space.py checks a request and enumerates its
layouts; this file evaluates and ranks them and turns step times into the figures a person plans with.
"""

import dataclasses
import math
from dataclasses import dataclass

from trillion.errors import ConfigError
from trillion.models import parts
from trillion.models.args import ModelArgs
from trillion.models.flops import (
    count_params,
    hardware_flops_per_token,
    megatron_flops_per_iteration,
    model_flops_per_token,
)
from trillion.parallel.ep_checks import check_ep_dispatch, check_expert_shards, ep_nodes, pairing_turns
from trillion.parallel.float8_recipes import FLOAT8_RECIPES, check_block_scaled_layout
from trillion.parallel.layout import Layout
from trillion.parallel.modes import check_layout_schedule, checkpoint_refusal, pairs_across_stages
from trillion.parallel.planner.block_cost import block_passes
from trillion.parallel.planner.caveats import memory_warning, utilisation_warning
from trillion.parallel.planner.cost import StepTime, step_time
from trillion.parallel.planner.memory import MEMORY_HEADROOM, Memory, layout_memory, pipeline_ranks
from trillion.parallel.planner.optimizer import host_ema_bytes, state_bytes
from trillion.parallel.planner.space import Request, check_request, layouts, tp_degrees
from trillion.parallel.planner.stage_balance import balanced


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    step: StepTime | None  # None: not timed, because it does not fit
    memory: Memory
    fits: bool


def evaluate(request: Request, layout: Layout, only_if_fits: bool = False) -> Candidate:
    """The layout's memory and, unless it does not fit and only_if_fits, its step time."""
    assumed = request.assumptions
    memory = layout_memory(request.args, layout, request.seq_len, assumed)
    fits = memory.total <= MEMORY_HEADROOM * request.capacity_bytes
    timed = fits or not only_if_fits
    if timed and pairs_across_stages(layout) and "ep_pairing_phase" not in request.fixed:
        layout = dataclasses.replace(layout, ep_pairing_phase=best_pairing_phase(request, layout))
    step = step_time(request.args, request.hardware, layout, request.seq_len, assumed) if timed else None
    return Candidate(layout, step, memory, fits)


def best_pairing_phase(request: Request, layout: Layout) -> int:
    """The pairing's phase (parallel.ep_pairing_phase) that leaves a routed layer's all-to-alls least exposed
    (planner/pairing.py), a layer's figure standing for the step's: every routed layer pairs alike."""

    def exposed(phase: int) -> float:
        at = dataclasses.replace(layout, ep_pairing_phase=phase)
        layer = block_passes(request.args, request.hardware, at, request.seq_len, request.assumptions, routed=True)
        return layer.ep_forward + layer.ep_backward

    return min(range(pairing_turns(layout)), key=exposed)


@dataclass
class SearchResult:
    # fitting candidates, fastest first; where none fits in the plan's headroom, those that fit in the device
    # (fits False: each row carries a memory warning instead of the plan being refused)
    ranked: list[Candidate]
    considered: int
    too_big: int  # valid layouts that did not fit in memory
    smallest_memory: Candidate | None  # among those that did not fit, for the error message
    refusal: str = ""  # the trainer's reason for refusing the first layout it refused


def trainer_refusal(args: ModelArgs, layout: Layout) -> str:
    """Why `trillion train` would refuse the layout's pipeline, or "": the trainer's own rule
    (parallel/modes.py check_layout_schedule, which its validate_pipeline calls), so the search never
    proposes what the trainer refuses (DualPipeV with fewer than 2 pp micro-batches, a
    split-backward schedule under compile, an objective that needs whole sequences under cp, ...)."""
    if refused := parts.layout_refusal(args, layout) or checkpoint_refusal(layout.activation_checkpoint, args):
        return refused  # what a part cannot train under (models/parts), or recompute
    try:
        if layout.ep > 1:
            check_ep_dispatch(layout, ep_nodes(layout), args, warn=False)
            check_expert_shards(layout, args)
        f8 = layout.float8
        recipe = FLOAT8_RECIPES[f8.recipe] if f8 is not None and f8.linears else None
        if recipe is not None and recipe.block and not recipe.untrainable:
            check_block_scaled_layout(layout.tp)  # the trainer's MXFP8 linears take no TP
        check_layout_schedule(layout, args.n_layers)
    except ConfigError as error:
        return str(error)
    return ""


def search(request: Request) -> SearchResult:
    check_request(request)
    ranked, tight, considered, too_big, smallest, refusal = [], [], 0, 0, None, ""
    for layout in layouts(request):
        refused = trainer_refusal(request.args, layout)
        if refused:
            refusal = refusal or refused
            continue
        considered += 1
        candidate = evaluate(request, layout, only_if_fits=True)
        if candidate.fits:
            ranked.append(candidate)
        else:
            too_big += 1
            if candidate.memory.total <= request.capacity_bytes:
                tight.append(layout)
            if smallest is None or candidate.memory.total < smallest.memory.total:
                smallest = candidate
    if not ranked:  # only the headroom objects: evaluate them, each with its memory warning (metrics)
        ranked = [evaluate(request, layout) for layout in tight]
    ranked.sort(key=lambda c: (c.step.total, c.memory.total))
    ranked = balance_stages(request, ranked)
    result = SearchResult(ranked, considered, too_big, smallest, refusal)
    if not ranked:
        raise ConfigError(_no_layout_message(request, result))
    return result


# The fastest pipelined layouts of a search whose stages it balances (--pp-layout auto, the default), where the even
# split leaves more than IMBALANCE_WORTH_BALANCING of their step to stage imbalance: up to half a second each at
# 128 stages (parallel/pp_layout.py balance), so not every layout of a search of thousands
BALANCED_CANDIDATES = 4
IMBALANCE_WORTH_BALANCING = 0.01


def balance_stages(request: Request, ranked: list[Candidate]) -> list[Candidate]:
    """`ranked` with the stages of its fastest pipelined layouts balanced by the planner's cost of each unit
    (stage_balance.py) where that is faster and fits as well, ranked again."""
    if request.fixed.get("pp_layout", "auto") != "auto":
        return ranked
    out = []
    for index, candidate in enumerate(ranked):
        uneven = candidate.step.imbalance > IMBALANCE_WORTH_BALANCING * candidate.step.total
        if index < BALANCED_CANDIDATES and candidate.layout.pp > 1 and uneven:
            layout = balanced(request.args, request.hardware, candidate.layout, request.seq_len, request.assumptions)
            other = evaluate(request, layout, only_if_fits=True)
            if other.fits >= candidate.fits and other.step and other.step.total < candidate.step.total:
                candidate = other
        out.append(candidate)
    return sorted(out, key=lambda c: (c.step.total, c.memory.total))


def _no_layout_message(request: Request, result: SearchResult) -> str:
    where = f"{request.model} on {request.gpus} x {request.hardware.name}"
    fixed = ", ".join(f"{k}={v}" for k, v in request.fixed.items())
    if result.considered == 0 and result.refusal:
        return f"No layout of {where}{' with ' + fixed if fixed else ''} runs in the trainer: {result.refusal}"
    if result.considered == 0:
        return (
            f"No valid layout for {where} with --global-batch {request.global_batch}"
            f"{' and ' + fixed if fixed else ''}: the data-parallel degree gpus / (tp x pp) must divide the global "
            f"batch, tp must divide the heads ({request.args.n_heads}) and fit in a node, pp at most the layers "
            f"({request.args.n_layers}), and pipelines other than GPipe need at least pp micro-batches. "
            "Try a global batch that is a multiple of "
            f"{request.gpus // max(tp_degrees(request.args, request.hardware.scale_up))}, or other fixed settings."
        )
    best = result.smallest_memory
    return (
        f"No layout of {where}{' with ' + fixed if fixed else ''} fits in memory: of {result.considered} valid "
        f"layouts the smallest needs {best.memory.total / 1e9:.1f} GB per GPU "
        f"({_describe(best.layout)}), more than the device's {request.hardware.device.memory_gb:g} GB. "
        "Use more GPUs, a smaller micro-batch, or release fixed settings."
        + (f" Other layouts the trainer refuses: {result.refusal}" if result.refusal else "")
    )


def _describe(layout: Layout) -> str:
    return (
        f"tp {layout.tp}, pp {layout.pp}, dp {layout.dp_replicate}x{layout.dp_shard} {layout.dp_shard_mode}, "
        f"cp {layout.cp}, ep {layout.ep}, micro-batch {layout.micro_batch_size}, "
        f"checkpointing {layout.activation_checkpoint}"
    )


def rank_states(request: Request, layout: Layout) -> list[tuple[int, float]]:
    """(parameter shard elements, optimizer state bytes) of each distinct pipeline rank: what it checkpoints (a save
    waits for the rank that writes the most, which need not be the fullest in memory)."""
    args, assumed, found = request.args, request.assumptions, []
    for rank in set(pipeline_ranks(args, layout)):
        shard = _shard(args, layout, rank)
        found.append((shard, state_bytes(args, layout, assumed.optimizer, rank, shard, assumed.optimizer_state_dtype)))
    return found


def _shard(args: ModelArgs, layout: Layout, rank) -> int:
    return rank.numel(args, layout.tp, layout.dp_shard * layout.cp, layout.ep, layout.expert_tp)[1]


def metrics(request: Request, candidate: Candidate) -> dict:
    """The figures of one candidate, as the table and `--format json` show them. MFU and HFU are shares
    of the bf16 peak, with float8 too (its GEMMs' FLOPs counted as they are, so both can pass what bf16
    reaches)."""
    args, layout, hw = request.args, candidate.layout, request.hardware
    step = candidate.step.total
    tokens_per_step = request.global_batch * request.seq_len
    tokens_per_s = tokens_per_step / step
    peak = hw.device.peak_tflops_bf16 * 1e12
    share = request.assumptions.attention_share  # document masking: MFU counts the attention work done
    model_flops = model_flops_per_token(args, request.seq_len, share) * tokens_per_s / request.gpus
    recompute = recompute_fraction(args, layout)
    hardware_flops = hardware_flops_per_token(args, request.seq_len, recompute, share) * tokens_per_s / request.gpus
    megatron = megatron_flops_per_iteration(args, request.global_batch, request.seq_len, recompute == 1.0)
    out = {
        **layout.as_dict(),
        **request.assumptions.as_dict(),
        "dp": layout.dp,
        "step_time_s": step,
        "tokens_per_s": tokens_per_s,
        "tflops_per_gpu": model_flops / 1e12,
        "mfu": model_flops / peak,
        "hfu": hardware_flops / peak,
        "megatron_share_of_peak": megatron / (step * request.gpus * peak),
        "time_shares": candidate.step.shares(),
        "memory_gb": candidate.memory.total / 1e9,
        "memory": candidate.memory.as_gb(),
        "memory_capacity_gb": hw.device.memory_gb,
        "fits": candidate.fits,
        "memory_warning": memory_warning(candidate.memory.total / 1e9, hw.device.memory_gb, candidate.fits),
    }
    out["utilisation_warning"] = utilisation_warning(hw.device.name, out)
    if request.assumptions.ema_decay:  # the parameters' average: host memory of the largest shard's rank
        out["host_ema_gb"] = host_ema_bytes(max(shard for shard, _ in rank_states(request, layout)))[0] / 1e9
    if request.tokens > 0:
        out.update(budget(request, step))
    return out


def recompute_fraction(args: ModelArgs, layout: Layout) -> float:
    """Share of the blocks whose forward runs twice: each stage module checkpoints its own blocks,
    so one layer per stage under selective recomputes every layer, not every second one."""
    return sum(rank.checkpointed(layout.activation_checkpoint) for rank in pipeline_ranks(args, layout)) / args.n_layers


def budget(request: Request, step_seconds: float) -> dict:
    """Time, GPU-hours, energy and cost of training on request.tokens. Power: every GPU at its
    board power plus its share of the node's other parts, times the site's PUE."""
    hw = request.hardware
    steps = math.ceil(request.tokens / (request.global_batch * request.seq_len))
    seconds = steps * step_seconds
    gpu_hours = seconds * request.gpus / 3600
    watts_per_gpu = (hw.device.power_w + hw.node_overhead_w / hw.gpus_per_node) * hw.pue
    price = hw.price_per_gpu_hour if request.price_per_gpu_hour is None else request.price_per_gpu_hour
    return {
        "steps": steps,
        "time_to_train_days": seconds / 86400,
        "gpu_hours": gpu_hours,
        "energy_mwh": gpu_hours * watts_per_gpu / 1e6,
        "cost_usd": gpu_hours * price,
    }


def model_summary(request: Request) -> dict:
    params = count_params(request.args)
    return {
        "model": request.model,
        "parameters": params.total,
        "hardware": request.hardware.name,
        "device": request.hardware.device.name,
        "gpus": request.gpus,
        "global_batch": request.global_batch,
        "seq_len": request.seq_len,
        "tokens": request.tokens,
        "float8": bool(request.fixed.get("float8", False)),
        "float8_recipe": request.fixed.get("float8_recipe", "tensorwise") if request.fixed.get("float8") else None,
        "optimizer": request.fixed.get("optimizer", "adamw"),
    }


def scaling(request: Request, gpu_counts: list[int], weak: bool) -> list[tuple[int, float, dict]]:
    """(gpus, efficiency, best row) per count: tokens/s per GPU relative to the first count. Weak
    scaling grows the global batch with the GPUs (from request's at request.gpus); strong keeps it."""
    points = []
    for gpus in gpu_counts:
        batch = request.global_batch * gpus // request.gpus if weak else request.global_batch
        scaled = dataclasses.replace(request, gpus=gpus, global_batch=batch, tokens=0.0)
        best = metrics(scaled, search(scaled).ranked[0])
        points.append((gpus, best["tokens_per_s"] / gpus, best))
    base = points[0][1]
    return [(gpus, per_gpu / base, row) for gpus, per_gpu, row in points]
