"""The planner: every valid parallel layout of a model on a machine, pruned by memory, ranked by
predicted throughput, with time, energy and cost for a token budget.

planner_layout (layouts, schedules), planner_memory (bytes per GPU) and planner_cost (seconds per
step) hold the model; this file enumerates, checks requests and turns step times into the figures
a person plans with. The search tries, for each tensor-parallel degree that divides the heads and
fits in a node and each pipeline degree up to the layer count: micro-batch sizes 1-8, every
schedule (interleaved ones at 2 chunks per rank unless --virtual-stages says otherwise),
activation checkpointing none/selective/full, and dp_shard over 1, one node's worth and all
data-parallel ranks, with each ZeRO mode; and context-parallel degrees that split the sequence into
2 cp chunks (x tp) within a node, whose ranks come out of the data-parallel ones (its K/V exchange is
smaller than TP's activation collectives, so it can also win at short sequences; against torchtitan's
long-sequence CP runs the planner is up to a quarter more optimistic about cp 4-8 than about cp 1-2:
experiments/validation/CONTEXT_PARALLEL.md).
"""

import dataclasses
import math
from dataclasses import dataclass, field

from trillion.errors import ConfigError
from trillion.models.args import ModelArgs
from trillion.models.flops import (
    count_params,
    hardware_flops_per_token,
    megatron_flops_per_iteration,
    model_flops_per_token,
)
from trillion.parallel import modes
from trillion.parallel.modes import DEFAULT_VIRTUAL_STAGES, SCHEDULES, ZERO_MODES, check_schedule
from trillion.parallel.planner.caveats import memory_warning, utilisation_warning
from trillion.parallel.planner.cost import StepTime, step_time
from trillion.parallel.planner.deepseek import whole_sequence_refusal
from trillion.parallel.planner.hardware import HardwareProfile, float8_peak_tflops
from trillion.parallel.planner.layout import SEARCHED_CHECKPOINT_MODES, Layout
from trillion.parallel.planner.memory import MEMORY_HEADROOM, Memory, layout_memory, pipeline_ranks
from trillion.parallel.planner.moe import MOE_LOAD_IMBALANCE, ep_degrees

MICRO_BATCH_SIZES = (1, 2, 4, 8)
LAYOUT_FIELDS = (
    "tp",
    "pp",
    "dp_replicate",
    "dp_shard",
    "dp_shard_mode",
    "pp_schedule",
    "virtual_stages",
    "micro_batch_size",
    "activation_checkpoint",
    "cp",
    "compile",
    "float8",
    "ep",
    "moe_load_imbalance",
)


@dataclass(frozen=True)
class Request:
    model: str
    args: ModelArgs
    hardware: HardwareProfile
    gpus: int
    global_batch: int  # sequences per optimizer step
    seq_len: int
    tokens: float = 0.0  # training budget; 0 = no time-to-train figures
    price_per_gpu_hour: float | None = None  # None: the hardware profile's
    fixed: dict = field(default_factory=dict)  # LAYOUT_FIELDS the user set

    @property
    def capacity_bytes(self) -> float:
        return self.hardware.device.memory_gb * 1e9


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    step: StepTime | None  # None: not timed, because it does not fit
    memory: Memory
    fits: bool


def evaluate(request: Request, layout: Layout, only_if_fits: bool = False) -> Candidate:
    """The layout's memory and, unless it does not fit and only_if_fits, its step time."""
    memory = layout_memory(request.args, layout, request.seq_len)
    fits = memory.total <= MEMORY_HEADROOM * request.capacity_bytes
    step = step_time(request.args, request.hardware, layout, request.seq_len) if fits or not only_if_fits else None
    return Candidate(layout, step, memory, fits)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def tp_degrees(args: ModelArgs, gpus_per_node: int) -> list[int]:
    """Degrees that split heads, key/value heads, the MLP and the vocabulary evenly, inside a node."""
    return [
        t
        for t in _divisors(gpus_per_node)
        if args.n_heads % t == 0 and args.kv_heads % t == 0 and args.ffn_hidden % t == 0 and args.vocab_size % t == 0
    ]


def _options(request: Request, name: str, default: list) -> list:
    return [request.fixed[name]] if name in request.fixed else default


def _dp_shard_options(dp: int, tp: int, gpus_per_node: int) -> list[int]:
    """No sharding, one node's worth (HSDP: sharding on the fast links), all ranks (least memory).
    Degrees in between cost the same network bandwidth per GPU as `dp` and save less memory."""
    node = gpus_per_node // tp
    return sorted({1, dp} | ({node} if node > 1 and dp % node == 0 else set()))


def layouts(request: Request):
    """Every layout the search considers, with the user's fixed settings."""
    args, gpus = request.args, request.gpus
    for tp in _options(request, "tp", tp_degrees(args, request.hardware.gpus_per_node)):
        if gpus % tp:
            continue
        for pp in _options(request, "pp", [p for p in _divisors(gpus // tp) if p <= args.n_layers]):
            if (gpus // tp) % pp:
                continue
            for cp in _options(request, "cp", _cp_degrees(request, tp, gpus // (tp * pp))):
                dp = gpus // (tp * pp * cp)
                if dp * cp * tp * pp != gpus or request.global_batch % dp:
                    continue
                yield from _layouts_for(request, tp, pp, dp, cp)


def _cp_degrees(request: Request, tp: int, ranks: int) -> list[int]:
    """1, and degrees that split the sequence into 2 cp chunks (each rank's share over tp) and keep the
    cp group inside a node with its tp group: the K/V exchange runs on every layer, unhidden."""
    return [
        c
        for c in _divisors(ranks)
        if c == 1 or request.seq_len % (2 * c * tp) == 0 and c * tp <= request.hardware.gpus_per_node
    ]


def _layouts_for(request: Request, tp: int, pp: int, dp: int, cp: int = 1):
    args = request.args
    replicate = request.fixed.get("dp_replicate")
    shards = (
        [dp // replicate]
        if replicate and "dp_shard" not in request.fixed
        else _options(request, "dp_shard", _dp_shard_options(dp, tp * cp, request.hardware.gpus_per_node))
    )
    schedules = _options(request, "pp_schedule", list(SCHEDULES) if pp > 1 else ["1F1B"])
    for dp_shard in shards:
        if dp % dp_shard or (replicate and replicate * dp_shard != dp):
            continue
        zero_modes = _options(request, "dp_shard_mode", list(ZERO_MODES) if dp_shard * cp > 1 else ["zero3"])
        for ep in _options(request, "ep", ep_degrees(args, dp_shard * cp)):
            if ep in ep_degrees(args, dp_shard * cp):
                yield from _schedules_for(request, tp, pp, dp, cp, dp_shard, ep, schedules, zero_modes)


def _schedules_for(request: Request, tp: int, pp: int, dp: int, cp: int, dp_shard: int, ep: int, schedules, zero_modes):
    """The layouts of one (tp, pp, dp, cp, dp_shard, ep): schedules, micro-batch sizes, checkpointing, ZeRO modes."""
    args = request.args
    for name in schedules:
        schedule = modes.schedule(name, "--pp-schedule")
        any_v = [request.fixed.get("virtual_stages", DEFAULT_VIRTUAL_STAGES)]
        for v in (schedule.virtual_stages or any_v) if pp > 1 else [1]:
            if pp * v > args.n_layers or ("virtual_stages" in request.fixed and request.fixed["virtual_stages"] != v):
                continue
            for mb in _options(request, "micro_batch_size", list(MICRO_BATCH_SIZES)):
                if (request.global_batch // dp) % mb:
                    continue
                m = request.global_batch // (dp * mb)
                for ac in _options(request, "activation_checkpoint", list(SEARCHED_CHECKPOINT_MODES)):
                    for mode in zero_modes:
                        yield Layout(
                            tp=tp,
                            pp=pp,
                            dp_replicate=dp // dp_shard,
                            dp_shard=dp_shard,
                            dp_shard_mode=mode,
                            pp_schedule=name,
                            virtual_stages=v,
                            micro_batch_size=mb,
                            microbatches=m,
                            activation_checkpoint=ac,
                            compile=request.fixed.get("compile", False),
                            cp=cp,
                            float8=request.fixed.get("float8", False),
                            ep=ep,
                            moe_load_imbalance=request.fixed.get("moe_load_imbalance", MOE_LOAD_IMBALANCE),
                        )


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
    (parallel/modes.py check_schedule, which its validate_pipeline calls), so the search never
    proposes what the trainer refuses (DualPipeV with fewer than 2 pp micro-batches, a
    split-backward schedule under compile, an objective that needs whole sequences under cp, ...)."""
    if refused := whole_sequence_refusal(args, layout):
        return refused
    try:
        check_schedule(
            layout.pp_schedule,
            layout.pp,
            layout.microbatches,
            layout.virtual_stages,
            layout.compile,
            n_layers=args.n_layers,
            experts_recomputed=layout.ep > 1 and layout.activation_checkpoint != "none",
        )
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
    result = SearchResult(ranked, considered, too_big, smallest, refusal)
    if not ranked:
        raise ConfigError(_no_layout_message(request, result))
    return result


def check_request(request: Request) -> None:
    args = request.args
    for key, value in request.fixed.items():
        if (
            key in ("tp", "pp", "dp_replicate", "dp_shard", "virtual_stages", "micro_batch_size", "cp", "ep")
            and value < 1
        ):
            raise ConfigError(f"--{key.replace('_', '-')} {value} must be at least 1.")
    if request.fixed.get("ep", 1) > 1 and args.moe is None:
        raise ConfigError(
            f"--ep {request.fixed['ep']}: {request.model} has no routed experts; use --ep 1 or leave it out."
        )
    if request.fixed.get("moe_load_imbalance", 1.0) < 1.0:
        raise ConfigError(
            f"--moe-load-imbalance {request.fixed['moe_load_imbalance']:g} must be at least 1 (the busiest rank's "
            "routed tokens over the mean)."
        )
    if "dp_shard_mode" in request.fixed and request.fixed["dp_shard_mode"] not in ZERO_MODES:
        raise ConfigError(
            f"--dp-shard-mode {request.fixed['dp_shard_mode']!r} is not known. Use {', '.join(ZERO_MODES)}."
        )
    if (
        "activation_checkpoint" in request.fixed
        and request.fixed["activation_checkpoint"] not in SEARCHED_CHECKPOINT_MODES
    ):
        raise ConfigError(
            f"--activation-checkpoint {request.fixed['activation_checkpoint']!r} is not known. "
            f"Use {', '.join(SEARCHED_CHECKPOINT_MODES)}."
        )
    if "pp_schedule" in request.fixed:
        modes.schedule(request.fixed["pp_schedule"], "--pp-schedule")
    if request.gpus < 1 or request.global_batch < 1:
        raise ConfigError(f"--gpus {request.gpus} and --global-batch {request.global_batch} must be at least 1.")
    if request.seq_len > args.max_seq_len and args.positions != "rope":  # rotary: train with --model.max_seq_len
        raise ConfigError(
            f"--seq-len {request.seq_len} is longer than {request.model}'s max_seq_len {args.max_seq_len}."
        )
    hw = request.hardware
    if request.fixed.get("float8"):
        float8_peak_tflops(hw)  # refuses hardware without float8 tensor cores, naming it
    if request.gpus > hw.gpus_per_node and hw.node_bandwidth_gbs <= 0:
        raise ConfigError(
            f"Hardware profile {hw.name!r} has no measured network (node_bandwidth_gbs = 0: it was "
            f"calibrated on one node), so it cannot plan {request.gpus} GPUs over nodes of "
            f"{hw.gpus_per_node}. Calibrate under a torchrun job of two or more nodes, or plan at most "
            f"{hw.gpus_per_node} GPUs."
        )
    tps = tp_degrees(args, request.hardware.gpus_per_node)
    most = max(tps) * args.n_layers * request.global_batch
    if request.gpus > most:
        raise ConfigError(
            f"{request.model} cannot use {request.gpus} GPUs with --global-batch {request.global_batch}: at most "
            f"tp {max(tps)} x pp {args.n_layers} (one layer per stage) x dp {request.global_batch} (one sequence per "
            f"data-parallel rank) = {most}. Use fewer GPUs or a larger global batch."
        )


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
            f"{request.gpus // max(tp_degrees(request.args, request.hardware.gpus_per_node))}, or other fixed settings."
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


def metrics(request: Request, candidate: Candidate) -> dict:
    """The figures of one candidate, as the table and `--format json` show them. MFU and HFU are shares
    of the bf16 peak, with float8 too (its GEMMs' FLOPs counted as they are, so both can pass what bf16
    reaches)."""
    args, layout, hw = request.args, candidate.layout, request.hardware
    step = candidate.step.total
    tokens_per_step = request.global_batch * request.seq_len
    tokens_per_s = tokens_per_step / step
    peak = hw.device.peak_tflops_bf16 * 1e12
    model_flops = model_flops_per_token(args, request.seq_len) * tokens_per_s / request.gpus
    recompute = recompute_fraction(args, layout)
    hardware_flops = hardware_flops_per_token(args, request.seq_len, recompute) * tokens_per_s / request.gpus
    megatron = megatron_flops_per_iteration(args, request.global_batch, request.seq_len, recompute == 1.0)
    out = {
        **layout.as_dict(),
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
