"""The planner's search space: the settings a request fixes, the checks a request must pass, and every
layout the search considers for it (parallel/planner/search.py evaluates and ranks them).

For each tensor-parallel degree that divides the heads and fits in a node and each pipeline degree up
to the layer count: micro-batch sizes 1-8, every schedule (interleaved ones at 2 chunks per rank unless
--virtual-stages says otherwise), activation checkpointing none/selective/full, and dp_shard over 1, one
node's worth and all data-parallel ranks, with each ZeRO mode; and context-parallel degrees that split
the sequence into 2 cp chunks (x tp) within a node, whose ranks come out of the data-parallel ones (its
K/V exchange is smaller than TP's activation collectives, so it can also win at short sequences; against
torchtitan's long-sequence CP runs the planner is up to a quarter more optimistic about cp 4-8 than about
cp 1-2: experiments/validation/CONTEXT_PARALLEL.md).
"""

import itertools
import math
from dataclasses import dataclass, field

from trillion.errors import ConfigError
from trillion.models import parts
from trillion.models.args import ModelArgs
from trillion.parallel import modes
from trillion.parallel.ep_checks import ep_nodes, resolve_dispatch
from trillion.parallel.float8_recipes import low_precision_recipe
from trillion.parallel.layout import AUTOMATIC_STAGES, Float8Training, Layout, StageLayers, resolve_float8
from trillion.parallel.modes import CHECKPOINT_MODES, DEFAULT_VIRTUAL_STAGES, SCHEDULES, ZERO_MODES
from trillion.parallel.planner.assumptions import Assumptions
from trillion.parallel.planner.block_cost import layer_passes
from trillion.parallel.planner.hardware import HardwareProfile, low_precision_peak_tflops
from trillion.parallel.planner.tp_hiding import Hiding
from trillion.parallel.pp_layout import parse

MICRO_BATCH_SIZES = (1, 2, 4, 8)
# The checkpointing modes the search tries: selective:op keeps matmul outputs, which the memory
# model (activations.py) does not count yet; selective:N (every N-th block) is the trainer's only; deepseek where the
# model's parts have its up-projections (search.py trainer_refusal drops it for the others).
SEARCHED_CHECKPOINT_MODES = tuple(name for name, mode in CHECKPOINT_MODES.items() if not mode.op_level)
OPTIMIZERS = ("adamw", "muon")  # optimizer.name: not searched (it changes the training), costed as given
LAYOUT_FIELDS = tuple(  # the Layout's settings a plan may fix, as `trillion plan` flags name them
    "tp pp dp_replicate dp_shard dp_shard_mode pp_schedule virtual_stages micro_batch_size activation_checkpoint cp "
    "compile float8 float8_recipe float8_linears float8_experts float8_dispatch float8_cache_activations "
    "float8_combine_gradient ep etp ep_dispatch ep_capacity ep_overlap ep_pairing_phase defer_weight_grads tp_overlap "
    "async_tp "
    "pp_layout".split()
)
ASSUMPTION_FIELDS = ("moe_load_imbalance", "optimizer", "optimizer_state_dtype", "attention_share", "ema_decay")
OPTIMIZER_STATE_DTYPES = ("float32", "bfloat16")  # optimizer.state_dtype: costed as given, never searched
# --pp-layout: the stages balanced by the planner's cost of each unit (auto: stage_balance.py), or written out
# (parallel/pp_layout.py); `even` is the planner's even split of the layers
PP_LAYOUT_CHOICES = ("auto", "even")  # planner/assumptions.py's, fixed too
# parallel.tp_overlap's chunk counts the search weighs where they divide the local sequence (0: DTensor's exposed
# collectives); more chunks hide more of each transfer and pay its latency, and smaller GEMMs, more often (tp_hiding.py)
OVERLAP_CHUNKS = (0, 1, 2, 4, 8)


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
    fixed: dict = field(default_factory=dict)  # LAYOUT_FIELDS and ASSUMPTION_FIELDS the user set

    @property
    def capacity_bytes(self) -> float:
        return self.hardware.device.memory_gb * 1e9

    @property
    def assumptions(self) -> Assumptions:
        """What the plan assumes beyond each layout: the fixed ones, else the planner's defaults."""
        return Assumptions(**{name: self.fixed[name] for name in ASSUMPTION_FIELDS if name in self.fixed})


def check_request(request: Request) -> None:
    args = request.args
    for key, value in request.fixed.items():
        if (
            key in ("tp", "pp", "dp_replicate", "dp_shard", "virtual_stages", "micro_batch_size", "cp", "ep")
            and value < 1
        ):
            raise ConfigError(f"--{key.replace('_', '-')} {value} must be at least 1.")
    if request.fixed.get("etp", 1) > 1 and request.fixed["etp"] != request.fixed.get("tp", request.fixed["etp"]):
        raise ConfigError(
            f"--etp {request.fixed['etp']} is neither 1 nor --tp {request.fixed['tp']}: the routed experts are whole "
            "with ep folded over the tp ranks (--etp 1) or tensor-parallel over tp (--etp equal to --tp)."
        )
    if request.fixed.get("ep", 1) > 1 and not parts.routed_experts(args):
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
    if request.fixed.get("optimizer_state_dtype", "float32") not in OPTIMIZER_STATE_DTYPES:
        raise ConfigError(
            f"--optimizer-state-dtype {request.fixed['optimizer_state_dtype']!r} is not known. Use "
            f"{' or '.join(OPTIMIZER_STATE_DTYPES)} (optimizer.state_dtype: AdamW's moments)."
        )
    if request.fixed.get("optimizer", "adamw") not in OPTIMIZERS:
        raise ConfigError(f"--optimizer {request.fixed['optimizer']!r} is not known. Use {' or '.join(OPTIMIZERS)}.")
    _check_stages(request)
    if "pp_schedule" in request.fixed:
        modes.schedule(request.fixed["pp_schedule"], "--pp-schedule")
    _check_hiding(request.fixed)
    if request.gpus < 1 or request.global_batch < 1:
        raise ConfigError(f"--gpus {request.gpus} and --global-batch {request.global_batch} must be at least 1.")
    if request.seq_len > args.max_seq_len and args.positions != "rope":  # rotary: train with --model.max_seq_len
        raise ConfigError(
            f"--seq-len {request.seq_len} is longer than {request.model}'s max_seq_len {args.max_seq_len}."
        )
    hw = request.hardware
    _check_low_precision(request.fixed, hw)
    if request.gpus > hw.scale_up and hw.node_bandwidth_gbs <= 0:
        raise ConfigError(
            f"Hardware profile {hw.name!r} has no measured network (node_bandwidth_gbs = 0: it was "
            f"calibrated on one node), so it cannot plan {request.gpus} GPUs over nodes of "
            f"{hw.scale_up}. Calibrate under a torchrun job of two or more nodes, or plan at most "
            f"{hw.scale_up} GPUs."
        )
    tps = tp_degrees(args, request.hardware.scale_up)
    most = max(tps) * args.n_layers * request.global_batch
    if request.gpus > most:
        raise ConfigError(
            f"{request.model} cannot use {request.gpus} GPUs with --global-batch {request.global_batch}: at most "
            f"tp {max(tps)} x pp {args.n_layers} (one layer per stage) x dp {request.global_batch} (one sequence per "
            f"data-parallel rank) = {most}. Use fewer GPUs or a larger global batch."
        )


def _check_stages(request: Request) -> None:
    """--pp-layout: auto, even, or a layout for the fixed --pp (its stages: pp x the schedule's stages per rank)."""
    written = request.fixed.get("pp_layout", "auto")
    if written in PP_LAYOUT_CHOICES:
        return
    if "pp" not in request.fixed or "pp_schedule" not in request.fixed:
        raise ConfigError(
            f"--pp-layout {written!r} writes the stages out, which needs their count: give --pp and --pp-schedule "
            "(and --virtual-stages for a looped schedule), or --pp-layout auto."
        )
    schedule = modes.schedule(request.fixed["pp_schedule"], "--pp-schedule")
    v = modes.stages_per_rank(schedule, request.fixed.get("virtual_stages", 0))
    parse(written, request.args.n_layers, request.fixed["pp"] * v, parts.ahead_modules(request.args)[0])


def _check_hiding(fixed: dict) -> None:
    """The plan's refusals of tp_checks.py's, for what a request fixes (the search proposes only what passes)."""
    if fixed.get("async_tp") and not fixed.get("compile"):
        raise ConfigError("--async-tp on is a pass of torch.compile's Inductor: give --compile too.")
    if fixed.get("async_tp") and fixed.get("tp_overlap"):
        raise ConfigError("--async-tp on and --tp-overlap hide the same collectives: give one of them.")
    if fixed.get("tp_overlap", 0) < 0:
        raise ConfigError(f"--tp-overlap {fixed['tp_overlap']} must be 0 (off) or a chunk count.")
    if fixed.get("tp_overlap") and fixed.get("float8"):
        raise ConfigError("--tp-overlap with --float8 is not built (tp_checks.py): give --async-tp on, or one of them.")


def _check_low_precision(fixed: dict, hw: HardwareProfile) -> None:
    """--float8 and --float8-recipe: a recipe the planner knows, and a format the hardware's matrix units have
    (refused in one paragraph naming the hardware, the format and its formats)."""
    if "float8_recipe" not in fixed and not fixed.get("float8"):
        return
    recipe = low_precision_recipe(fixed.get("float8_recipe", "tensorwise"), "--float8-recipe")
    if not fixed.get("float8"):
        raise ConfigError(
            f"--float8-recipe {recipe.name} prices the linears in {recipe.format}, which needs --float8 (the blocks' "
            f"linears in low precision). Add --float8, or drop --float8-recipe."
        )
    setting = "--float8" if "float8_recipe" not in fixed else f"--float8 --float8-recipe {recipe.name}"
    low_precision_peak_tflops(hw, recipe.format, setting)  # refuses hardware without the format, naming it


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def tp_degrees(args: ModelArgs, scale_up: int) -> list[int]:
    """Degrees that split heads, key/value heads, the MLP and the vocabulary evenly, inside a scale-up domain (a
    node, or an NVL72 rack's 72 GPUs: TP's collectives run on every layer, so they stay on the fast links)."""
    return [
        t
        for t in _divisors(scale_up)
        if args.n_heads % t == 0 and args.kv_heads % t == 0 and args.ffn_hidden % t == 0 and args.vocab_size % t == 0
    ]


def _options(request: Request, name: str, default: list) -> list:
    return [request.fixed[name]] if name in request.fixed else default


def _dp_shard_options(dp: int, tp: int, scale_up: int) -> list[int]:
    """No sharding, one scale-up domain's worth (HSDP: sharding on the fast links), all ranks (least memory).
    Degrees in between cost the same network bandwidth per GPU as `dp` and save less memory."""
    node = scale_up // tp
    return sorted({1, dp} | ({node} if node > 1 and dp % node == 0 else set()))


def layouts(request: Request):
    """Every layout the search considers, with the user's fixed settings."""
    args, gpus = request.args, request.gpus
    for tp in _options(request, "tp", tp_degrees(args, request.hardware.scale_up)):
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


def ep_degrees(args: ModelArgs, shard_ranks: int) -> list[int]:
    """Expert-parallel degrees: divisors of dp_shard x cp that divide the experts; 1 for a dense model."""
    experts = parts.routed_experts(args)
    if not experts:
        return [1]
    return [e for e in range(1, shard_ranks + 1) if shard_ranks % e == 0 and experts % e == 0]


def expert_layouts(args: ModelArgs, tp: int, cp: int, dp_shard: int) -> list[tuple[int, int]]:
    """(ep, etp) pairs the trainer runs for these degrees: ep 1 (etp tp: nothing to fold); ep within dp_shard x cp with
    the experts tensor-parallel (etp tp); and with tp > 1 ep folded over the tp ranks (etp 1: a multiple of cp x tp
    dividing dp_shard x cp x tp, parallel/layout.py's rule), each ep dividing the experts."""
    pairs = [(ep, tp) for ep in ep_degrees(args, dp_shard * cp)]
    if tp > 1:
        pairs += [(ep, 1) for ep in ep_degrees(args, dp_shard * cp * tp) if ep > 1 and ep % (cp * tp) == 0]
    return pairs


def _cp_degrees(request: Request, tp: int, ranks: int) -> list[int]:
    """1, and degrees that split the sequence into 2 cp chunks (each rank's share over tp) and keep the
    cp group inside a node with its tp group: the K/V exchange runs on every layer, unhidden."""
    return [
        c
        for c in _divisors(ranks)
        if c == 1 or request.seq_len % (2 * c * tp) == 0 and c * tp <= request.hardware.scale_up
    ]


def _layouts_for(request: Request, tp: int, pp: int, dp: int, cp: int = 1):
    args = request.args
    replicate = request.fixed.get("dp_replicate")
    shards = (
        [dp // replicate]
        if replicate and "dp_shard" not in request.fixed
        else _options(request, "dp_shard", _dp_shard_options(dp, tp * cp, request.hardware.scale_up))
    )
    schedules = _options(request, "pp_schedule", list(SCHEDULES) if pp > 1 else ["1F1B"])
    for dp_shard in shards:
        if dp % dp_shard or (replicate and replicate * dp_shard != dp):
            continue
        zero_modes = _options(request, "dp_shard_mode", list(ZERO_MODES) if dp_shard * cp > 1 else ["zero3"])
        for ep, etp in expert_layouts(args, tp, cp, dp_shard):
            if request.fixed.get("ep", ep) == ep and request.fixed.get("etp", etp) in (etp, 0):
                experts = {"ep": ep, "etp": etp}
                yield from _schedules_for(request, tp, pp, dp, cp, dp_shard, experts, schedules, zero_modes)


def _schedules_for(
    request: Request, tp: int, pp: int, dp: int, cp: int, dp_shard: int, experts: dict, schedules, zero_modes
):
    """The layouts of one (tp, pp, dp, cp, dp_shard, ep, etp): schedules, micro-batch sizes, checkpointing, ZeRO
    modes."""
    args, dispatch, ep = request.args, _dispatch(request, tp, **experts), experts["ep"]
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
                for ac, mode, hiding in itertools.product(
                    _options(request, "activation_checkpoint", list(SEARCHED_CHECKPOINT_MODES)),
                    zero_modes,
                    _hiding_options(request, tp, cp, mb),
                ):
                    for deferred in _deferral(request, tp, pp, name, ac, ep):
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
                            float8=_float8(request, dp * cp > 1, ep),
                            stage_layers=_written_stages(request, pp),
                            defer_weight_grads=deferred,
                            **experts,
                            **dispatch,
                            **hiding,
                        )


def _deferral(request: Request, tp: int, pp: int, schedule: str, checkpoint: str, ep: int) -> list[bool]:
    """parallel.defer_weight_grads as fixed, else both where it changes the step (a split-backward schedule whose
    weight passes the checkpointing would otherwise join, modes.joins_weight_passes, with whole linears: tp 1): the
    filled bubble against the memory of the queues; off elsewhere."""
    if "defer_weight_grads" in request.fixed:
        return [request.fixed["defer_weight_grads"]]
    joined = modes.joins_weight_passes(Layout(pp=pp, pp_schedule=schedule, ep=ep, activation_checkpoint=checkpoint))
    return [True, False] if tp == 1 and joined else [False]


def _written_stages(request: Request, pp: int) -> StageLayers:
    """The stages --pp-layout writes out (checked by _check_stages); auto and even: the planner's even split, which
    search.py balances for auto."""
    written = request.fixed.get("pp_layout", "auto")
    return AUTOMATIC_STAGES if pp == 1 or written in PP_LAYOUT_CHOICES else StageLayers(written=written)


def _hiding_options(request: Request, tp: int, cp: int, micro_batch: int) -> list[dict]:
    """How TP's collectives run: async TP where asked (--async-tp on: it needs a CUDA build with symmetric memory,
    which the plan cannot see, and compile); else the chunk count fixed, or of OVERLAP_CHUNKS (0: exposed) that divide
    the local sequence the one that leaves a layer the least TP time (tp_hiding.py). That choice depends on the
    layer's shape alone, so it is made once per shape rather than multiplying the layouts; none with float8, which
    the chunked overlap refuses (tp_checks.py)."""
    fixed = request.fixed
    if tp == 1 or fixed.get("float8"):
        return [{"tp_overlap": 0, "async_tp": tp > 1 and bool(fixed.get("async_tp"))}]
    if fixed.get("async_tp"):
        return [{"tp_overlap": 0, "async_tp": True}]
    local = request.seq_len // cp // tp
    chunks = [c for c in _options(request, "tp_overlap", list(OVERLAP_CHUNKS)) if not c or local % c == 0]
    shape = (request.args, request.hardware, micro_batch, request.seq_len, tp, fixed.get("compile", False), cp)
    best = min(chunks, key=lambda c: _tp_seconds(*shape, c), default=None)
    return [] if best is None else [{"tp_overlap": best, "async_tp": False}]


def _tp_seconds(args, hw, micro_batch, seq_len, tp, compiled, cp, chunks) -> float:
    """A dense layer's exposed TP seconds, forward and backward, with the chunked overlap at `chunks` (0: exposed)."""
    passes = layer_passes(args, hw, micro_batch, seq_len, tp, compiled, cp, hiding=Hiding(chunks) if chunks else None)
    return passes.tp_forward + passes.tp_backward


def _float8(request: Request, fsdp_enabled: bool, ep: int) -> Float8Training | None:
    """Float8 as `trillion plan --float8` costs it: the recipe (--float8-recipe, else the trainer's default,
    tensorwise) resolved as the trainer resolves it (FSDP float8 all-gather where FSDP shards and the recipe has it,
    the experts' auto as a block-scaled recipe's own), the linears and the experts' recipe as fixed, float8 dispatch
    only under ep > 1 (as the trainer allows it)."""
    fixed = request.fixed
    if not fixed.get("float8", False):
        return None
    return resolve_float8(
        fixed.get("float8_recipe", "tensorwise"),
        fsdp_enabled=fsdp_enabled,
        experts=fixed.get("float8_experts", "auto"),
        dispatch=fixed.get("float8_dispatch", False) and ep > 1,
        linears=fixed.get("float8_linears", True),
        cache_activations=fixed.get("float8_cache_activations", False),
        combine_gradient=fixed.get("float8_combine_gradient", False) and ep > 1,
    )


def _dispatch(request: Request, tp: int, ep: int, etp: int) -> dict:
    """The expert dispatch's Layout fields: ranks per node the hardware's scale-up domain (the per-node dispatch
    crosses the network once per domain); the mode as `auto` resolves it (per node where the ep group spans domains)
    unless fixed; overlap on with ep unless fixed (the model never loses by it); the per-rank capacity as fixed (0:
    dropless)."""
    fixed, node = request.fixed, request.hardware.scale_up
    probe = Layout(tp=tp, ep=ep, etp=etp, ranks_per_node=node)
    mode = fixed.get("ep_dispatch", "auto")
    return {
        "ranks_per_node": node,
        "ep_dispatch": resolve_dispatch(mode, ep_nodes(probe)[0]),
        "ep_capacity": fixed.get("ep_capacity", 0.0),
        "ep_overlap": fixed.get("ep_overlap", ep > 1),
        "ep_pairing_phase": fixed.get("ep_pairing_phase", 0),  # unless fixed, search.py evaluate's best
    }
