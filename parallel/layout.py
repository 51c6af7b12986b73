"""A run's parallel layout as one frozen value, resolved once from the config (trainer/assemble.py
`resolve_layout`): the degree of every axis and the shape of a step (ZeRO mode, pipeline schedule, its chunks and
stage split, micro-batches, activation checkpointing, compile, float8, the expert dispatch).

ParallelDims (dims.py) builds the mesh of its degrees, parallelize (parallelize.py), the pipeline and the
micro-batch loop read every setting from it, and the planner, the memory pre-flight and `trillion estimate` cost
the same value; what the planner assumes beyond a layout (load imbalance, the optimizer it costs, the attention
document masking leaves) is the planner's own (parallel/planner/assumptions.py). `check_degrees` is the one rule
for which degrees make a world of ranks. No torch here: the planner imports it and starts fast.
"""

from dataclasses import asdict, dataclass

from trillion.errors import ConfigError
from trillion.parallel.float8_recipes import float8_cache, float8_combine_gradient, float8_recipe

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # the mesh's axes, outermost first (dims.py)
# parallel.ep_dispatch: a token travels to each expert it chose (as torchtitan's standard dispatcher), once to each
# ep rank holding some of them, or once to each node and then on to the node's ranks (DeepSeek's DeepEP);
# "auto" resolves to "node" when the ep group spans nodes, else "rank" (parallel/expert_parallel.py)
EP_DISPATCH = ("expert", "rank", "node")


@dataclass(frozen=True)
class Float8Training:
    """Low-precision training as the run trains it (float8.py applies it, the planner costs it): the recipe
    (float8_recipes.py: tensorwise or rowwise float8, block-scaled mxfp8; the planner also prices the 4-bit ones),
    emulation, whether FSDP2 gathers the converted weights in float8 (resolved: only where FSDP shards and the
    recipe supports it), the routed experts' recipe, float8 dispatch, and whether the blocks' linears convert."""

    recipe: str = "tensorwise"
    emulate: bool = False
    fsdp_all_gather: bool = False
    experts: str = "auto"  # float8.experts: the routed experts' grouped GEMMs ("off": bf16; float8_experts.py)
    dispatch: bool = False  # float8.dispatch: the expert all-to-all's tokens in float8 (float8_dispatch.py)
    linears: bool = True  # float8.linears: the blocks' linears convert (false: only the routed experts)
    cache_activations: bool = False  # float8.cache_activations: the experts keep their activations in float8
    combine_gradient: bool = False  # float8.combine_gradient: the combine's gradient travels back in float8

    @property
    def float8_tp(self) -> bool:
        """Tensor parallelism with torchao's float8 styles (activations all-gathered in float8)."""
        return float8_recipe(self.recipe).float8_tp


def resolve_float8(
    recipe: str,
    *,
    fsdp_enabled: bool,
    fsdp_all_gather: str = "auto",
    emulate: bool = False,
    experts: str = "auto",
    dispatch: bool = False,
    linears: bool = True,
    cache_activations: bool = False,
    combine_gradient: bool = False,
) -> Float8Training:
    """The Float8Training of a layout: float8 all-gather of the converted linears where asked for (or, with auto,
    supported) and FSDP on, a combination torchao lacks refused (float8_recipes.py); float8.experts=auto under a
    block-scaled recipe (mxfp8) takes that recipe (torchao's MX grouped GEMM, as torchtitan pairs them);
    float8.cache_activations refused where the experts' products cannot keep their float8 (float8_recipes.py), and
    float8.combine_gradient without the float8 dispatch whose wire it uses."""
    chosen = float8_recipe(recipe, fsdp_all_gather)
    supported = fsdp_all_gather == "on" or (fsdp_all_gather == "auto" and chosen.fsdp_float8_all_gather)
    experts = recipe if experts == "auto" and chosen.block else experts
    float8_cache(cache_activations, experts)
    float8_combine_gradient(combine_gradient, dispatch)
    gather = fsdp_enabled and linears and supported
    return Float8Training(recipe, emulate, gather, experts, dispatch, linears, cache_activations, combine_gradient)


@dataclass(frozen=True)
class StageLayers:
    """The pipeline stages' sizes: parallel.pp_layout written out (`written`, parallel/pp_layout.py: e.g.
    "E+3 | 2*29 | M+O"; `auto` until the model is known, trainer/assemble.py resolve_stage_split), or in
    transformer layers parallel.pp_layers_per_stage (0 = automatic), pp_first_stage_layers and pp_last_stage_layers
    (-1 = pp_layers_per_stage - 1, since the embedding and the output count as a layer each; automatic when that is
    0 too). pp_layout.py split_units applies them."""

    per_stage: int = 0
    first: int = -1
    last: int = -1
    written: str = ""

    def fixed_units(self, num_stages: int) -> dict[int, int]:
        """Units of the stages these settings size (first/last count their embedding/output)."""
        for name, value, least in (
            ("pp_layers_per_stage", self.per_stage, 0),
            ("pp_first_stage_layers", self.first, -1),
            ("pp_last_stage_layers", self.last, -1),
        ):
            if value < least:
                raise ConfigError(
                    f"parallel.{name}={value} must be {least} or more ({'0' if least == 0 else '-1'} = "
                    "automatic); it counts transformer layers."
                )
        first = self.first if self.first >= 0 else self.per_stage - 1
        last = self.last if self.last >= 0 else self.per_stage - 1
        sizes = {stage: self.per_stage for stage in range(1, num_stages - 1)} if self.per_stage else {}
        if first >= 0:
            sizes[0] = first + 1
        if last >= 0:
            sizes[num_stages - 1] = last + 1
        return sizes

    def describe(self) -> str:
        if self.written:
            return f"parallel.pp_layout={self.written!r}"
        return (
            f"parallel.pp_layers_per_stage={self.per_stage}, pp_first_stage_layers={self.first}, "
            f"pp_last_stage_layers={self.last}"
        )


AUTOMATIC_STAGES = StageLayers()


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The defaults are one process: every degree 1, one micro-batch of one sequence, nothing recomputed."""

    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    dp_shard_mode: str = "zero3"
    pp_schedule: str = "1F1B"
    virtual_stages: int = 1  # pipeline chunks per rank (1 without a pipeline)
    stage_layers: StageLayers = AUTOMATIC_STAGES  # the pipeline stages' sizes (automatic: even)
    micro_batch_size: int = 1  # sequences per micro-batch per data-parallel rank
    microbatches: int = 1  # per step per pipeline (gradient accumulation when pp == 1)
    activation_checkpoint: str = "none"
    compile: bool = False  # torch.compile of each block: fuses its element-wise kernels
    cp: int = 1  # context parallelism: each rank holds 1/cp of every sequence; FSDP shards over dp_shard x cp
    float8: Float8Training | None = None  # the blocks' linears compute in float8 (None: off)
    ep: int = 1  # expert parallelism: routed experts over ep ranks (which ones: etp)
    # expert tensor parallelism, 1 or tp: with 1 (and ep > 1) ep folds over the tp ranks, then cp, then dp_shard (each
    # rank routes its own sequence-parallel tokens to whole experts); with tp the experts are tensor-parallel like the
    # shared ones and ep comes out of dp_shard x cp. With ep 1 there is nothing to fold: the experts are tensor-parallel
    etp: int = 1
    ep_dispatch: str = "rank"  # how tokens reach the experts: one row per expert, per rank or per node (EP_DISPATCH)
    ranks_per_node: int = 8  # the processes of one node (the per-node dispatch's two hops; the planner's node)
    ep_capacity: float = 0.0  # rows per destination rank as a multiple of the even share (0: dropless)
    ep_overlap: bool = False  # the dispatch's all-to-alls run beside the shared experts and the other micro-batch
    # turns a paired backward hands straight back before it starts (pipeline_pairing.py); -1 (auto) until the model is
    # known (trainer/assemble.py resolve_with_model)
    ep_pairing_phase: int = 0
    # a pipeline stage's backward queues its products' weight gradients for the schedule's W (deferred_weight_grads.py)
    defer_weight_grads: bool = False
    tp_overlap: int = 0  # chunks per rank of TP's all-gathers and reduce-scatters run beside their GEMMs (0: off)
    async_tp: bool = False  # torch's micro-pipelined TP: symmetric-memory collectives fused with the GEMMs (CUDA)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1  # the trainer always pairs TP with sequence parallelism

    @property
    def folded(self) -> bool:
        """Whether ep borrows the tp ranks (MoE parallel folding): each tp rank routes its own tokens."""
        return self.ep > 1 and self.etp == 1 and self.tp > 1

    @property
    def expert_tp(self) -> int:
        """The ranks one routed expert is split over by tensor parallelism: 1 folded, else tp."""
        return 1 if self.folded else self.tp

    @property
    def efsdp(self) -> int:
        """The data-parallel ranks the routed experts are sharded over once ep has its share: the expert region
        (dp_shard x cp, x tp when folded) over ep."""
        return self.dp_shard * self.cp * (self.tp if self.folded else 1) // self.ep

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 wraps the model: more than one data-parallel or context-parallel rank."""
        return self.dp * self.cp > 1

    def as_dict(self) -> dict:
        """The layout as flat JSON fields (`trillion plan --format json`): float8 as `float8` on or off and its
        `float8_*` settings, the stage sizes as `pp_layout` and the `pp_*_layers` settings."""
        flat = {name: value for name, value in asdict(self).items() if name not in ("float8", "stage_layers")}
        f8 = self.float8 or Float8Training()
        flat |= {"float8": self.float8 is not None, "float8_recipe": f8.recipe, "float8_all_gather": f8.fsdp_all_gather}
        flat |= {"float8_experts": f8.experts, "float8_dispatch": f8.dispatch, "float8_linears": f8.linears}
        flat["float8_cache_activations"] = f8.cache_activations
        flat["float8_combine_gradient"] = f8.combine_gradient
        s = self.stage_layers
        return flat | {
            "pp_layout": s.written,
            "pp_layers_per_stage": s.per_stage,
            "pp_first_stage_layers": s.first,
            "pp_last_stage_layers": s.last,
        }


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in divisors(n) if d <= limit)


def check_degrees(world_size: int, *, pp=1, dp_replicate=1, dp_shard=-1, cp=1, tp=1, ep=1, etp=1) -> int:
    """dp_shard (-1: what the world size leaves), once the degrees are known to make `world_size` ranks
    and ep to fit in the ranks it borrows (etp: _check_ep); a ConfigError naming the setting and the fix otherwise."""
    degrees = {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp}
    for name in AXES:
        value = degrees[name]
        if value < 1 and not (name == "dp_shard" and value == -1):
            raise ConfigError(
                f"parallel.{name}={value} must be a positive degree"
                f"{' (or -1 to infer it)' if name == 'dp_shard' else ''}; use 1 to turn it off."
            )
    others = pp * dp_replicate * cp * tp
    if dp_shard == -1:
        if world_size % others:
            raise ConfigError(
                f"parallel.pp * dp_replicate * cp * tp = {others} does not divide the world size "
                f"{world_size}, so parallel.dp_shard=-1 cannot be inferred. "
                f"Pick degrees whose product divides {world_size} "
                f"(e.g. --parallel.tp={_largest_divisor_at_most(world_size, tp)})."
            )
        dp_shard = world_size // others
    product = others * dp_shard
    if product != world_size:
        raise ConfigError(
            f"parallel degrees pp={pp} x dp_replicate={dp_replicate} x dp_shard={dp_shard} x "
            f"cp={cp} x tp={tp} = {product}, but the world size is {world_size}. "
            "Make the product equal the number of processes, e.g. --parallel.dp_shard=-1 to infer it, "
            f"or launch {product} processes."
        )
    _check_ep(ep, etp, dp_shard, cp, tp)
    return dp_shard


def _check_ep(ep: int, etp: int, dp_shard: int, cp: int, tp: int) -> None:
    """torchtitan's rule: with etp 1 (folded) ep takes every tp and cp rank and some of dp_shard, so cp x tp divides ep
    and ep divides dp_shard x cp x tp; with etp = tp ep divides dp_shard x cp."""
    if ep < 1:
        raise ConfigError(f"parallel.ep={ep} must be a positive degree; use 1 to turn it off.")
    if etp not in (1, tp):
        raise ConfigError(
            f"parallel.etp={etp} is neither 1 nor parallel.tp={tp}: the routed experts are either whole on each rank "
            f"with ep folded over the tp ranks (--parallel.etp=1) or tensor-parallel like the rest of the block "
            f"(--parallel.etp={tp}); --parallel.etp=auto picks the one that sends fewer bytes."
        )
    if ep > 1 and etp == 1 and tp > 1:
        _check_folded_ep(ep, dp_shard, cp, tp)
        return
    region = dp_shard * cp
    if region % ep:
        valid = ", ".join(map(str, divisors(region)))
        raise ConfigError(
            f"parallel.ep={ep} does not divide parallel.dp_shard x cp = {dp_shard} x {cp} = "
            f"{region}: the expert-parallel ranks are taken from the sharded data-parallel ones (and the "
            f"context-parallel ones). Use an ep that divides {region} (valid: {valid}), or raise "
            "--parallel.dp_shard."
        )


def _check_folded_ep(ep: int, dp_shard: int, cp: int, tp: int) -> None:
    borrowed, region = cp * tp, dp_shard * cp * tp
    if ep % borrowed or region % ep:
        valid = ", ".join(str(d) for d in divisors(region) if d % borrowed == 0 and d > 1)
        raise ConfigError(
            f"parallel.ep={ep} with parallel.etp=1 folds the expert-parallel group over the tp ranks, then the cp "
            f"ones, then dp_shard (MoE parallel folding), so it must be a multiple of cp x tp = {cp} x {tp} = "
            f"{borrowed} and divide dp_shard x cp x tp = {region}. Use an ep among {valid}, or "
            f"--parallel.etp={tp} to keep ep inside dp_shard x cp (the experts then tensor-parallel over tp)."
        )


def resolve_etp(requested: int, *, tp: int, ep: int, cp: int = 1, dp_shard: int = 1) -> tuple[int, str]:
    """parallel.etp (0: auto) and why, for the log: auto is 1 (ep folded over the tp ranks: each rank dispatches
    only its sequence-parallel 1/tp of the tokens) wherever the folding rule allows it, the fewest bytes; else tp
    (every tp rank sends the whole tp group's tokens). With tp 1 or ep 1 there is nothing to fold."""
    if requested:
        return requested, "as set"
    if tp == 1 or ep == 1:
        return tp, f"nothing to fold (tp {tp}, ep {ep})"
    if ep % (cp * tp) or (dp_shard * cp * tp) % ep:
        return tp, (
            f"ep {ep} cannot fold over cp x tp = {cp * tp} (not a multiple of it, or not dividing dp_shard x cp x tp): "
            f"ep stays in dp_shard x cp, the experts tensor-parallel, and every tp rank sends its tp group's tokens"
        )
    return 1, (
        f"ep {ep} folded over the tp ranks: each rank dispatches its 1/{tp} of the tokens, 1/{tp} of the all-to-all "
        f"bytes of etp {tp} (where every tp rank sends the whole tp group's tokens), no all-gather into the experts"
    )


def degrees_of(layout: Layout) -> dict:
    """The degrees `check_degrees` takes, from a layout."""
    return {name: getattr(layout, name) for name in (*AXES, "ep", "etp")}


def layout_on(world_size: int, **fields) -> Layout:
    """The Layout of `fields` on `world_size` ranks, its degrees checked and dp_shard (-1 or left out: what the
    world size leaves) resolved: for meshes built in code (tests, benchmarks); a run's comes from its config."""
    degrees = {name: fields.pop(name) for name in (*AXES, "ep", "etp") if name in fields}
    return Layout(**fields, **(degrees | {"dp_shard": check_degrees(world_size, **degrees)}))
