"""The simulated ranks of one layout's dry run (trainer/tools/estimate/dry_run.py): each built as `rank`
of a fake world by trainer/tools/estimate/rank.py, what ranks of the same stage shapes (and dp_shard and
cp coordinates, for the sharded states) share built once, and the bytes of each kind a rank holds."""

from __future__ import annotations

import logging

from trillion.errors import ConfigError
from trillion.models import ModelArgs, parts
from trillion.parallel.dims import ParallelDims
from trillion.parallel.muon.matrices import hidden_matrices
from trillion.trainer.config.schema import Config
from trillion.trainer.tools.estimate.activations import local_tensor
from trillion.trainer.tools.estimate.pipeline_schedule import in_flight_peak, receive_bytes, schedule_of, with_receives
from trillion.trainer.tools.estimate.rank import (
    REDUCE_DTYPE,
    StagePlan,
    StageSource,
    coords_of,
    fake_world,
    gathered_and_reduce_bytes,
    hidden_state,
    item_bytes,
    meshed_dims,
    micro_batch_data,
    quiet,
    rank_parts,
    stage_facts,
    state_bytes,
    target_dtype,
)

log = logging.getLogger("trillion")


class Simulation:
    """One layout's ranks, each built as `rank` of a fake world; what ranks of the same stage shapes
    (and dp_shard and cp coordinates, for the sharded states) share is built once."""

    def __init__(
        self,
        config: Config,
        model_args: ModelArgs,
        dims: ParallelDims,
        measure: bool,
        prediction: dict | None,
        notes: list[str],
    ):
        self.config, self.dims = config, dims
        self.micro_batch, self.microbatches = dims.layout.micro_batch_size, dims.layout.microbatches
        self.measure, self.prediction, self.notes = measure, prediction, notes
        routed = frozenset(i for i in range(model_args.n_layers) if parts.routed_layer(model_args, i))
        self.plan = StagePlan(dims.layout, model_args.n_layers, routed, parts.ahead_modules(model_args)[0])
        self.source = StageSource(model_args, dims.pp)
        self.muon = frozenset(hidden_matrices(model_args) if config.optimizer.name == "muon" else ())
        self.moment_bytes = 2 if config.optimizer.state_dtype == "bfloat16" else 0  # AdamW's moments (0: fp32)
        self.states, self.facts = {}, {}  # (stage shapes, (dp_shard, cp) coordinates) -> States; StageShape -> ...
        self.hidden_bytes = None  # pp > 1: one micro-batch's residual stream between stages, local bytes
        self.schedule = None  # pp > 1: every pipeline rank's actions and how it holds receive buffers

    def _key(self, rank: int) -> tuple:
        coords = coords_of(self.dims, rank)
        # FSDP's torch.chunk shards follow the flattened dp_shard x cp coordinate (the routed experts' its efsdp part)
        return self.plan.rank_shapes(coords.get("pp", 0)), (coords.get("dp_shard", 0), coords.get("cp", 0))

    def _simulate(self, rank: int) -> None:
        """Build, as `rank` of a fake world, whatever `rank` needs that no earlier rank built."""
        key = self._key(rank)
        missing = [shape for shape in dict.fromkeys(key[0]) if shape not in self.facts]
        pipelined = self.dims.pp > 1
        if key in self.states and not missing and (self.schedule is not None or not pipelined):
            return
        with fake_world(rank, self.dims.world_size), quiet():
            dims = meshed_dims(self.dims)
            hidden = None  # a DTensor under TP, on this world's mesh: made again in every world that needs it
            if pipelined and (missing or self.hidden_bytes is None):
                hidden = hidden_state(self.config, self.source, dims, self.micro_batch)
                self.hidden_bytes = local_tensor(hidden).untyped_storage().nbytes()
            for shape in missing:
                self.facts[shape] = self._stage_facts(shape, dims, hidden)
            if key not in self.states or self.schedule is None and pipelined:
                parts, pipeline = rank_parts(self.config, self.source.whole(), dims)
                assert [len(part.layers) for part in parts] == [shape.layers for shape in key[0]], "split diverged"
                self.states[key] = state_bytes(parts, self.muon, self.moment_bytes)
                if pipelined and self.schedule is None:
                    self.schedule = schedule_of(pipeline)

    def _stage_facts(self, shape, dims, hidden):
        index = self.plan.index_of(shape)
        inputs, target = micro_batch_data(self.config, shape, hidden, self.micro_batch, self.dims.cp)

        def run(measure):
            return stage_facts(self.config, self.source, dims, self.plan.ranges[index], shape, inputs, target, measure)

        if self.measure:
            try:
                return run(True)
            except Exception as error:  # a fake/meta run that cannot be trusted is not reported as measured
                self.measure = False
                self.notes.append(
                    f"activation run on meta tensors failed ({type(error).__name__}: "
                    f"{str(error)[:200]}); the activation figure is the planner's prediction"
                )
                log.warning("estimate: %s", self.notes[-1])
        return run(False)

    def most_parameters_rank(self) -> int:
        """The first rank of the pipeline rank whose stages hold the most parameters, at dp_shard
        coordinate 0 (FSDP's ceiling shards)."""
        per_stage = self.dims.world_size // self.dims.pp
        candidates = {}
        for pp_rank in range(self.dims.pp):
            candidates.setdefault(self.plan.rank_shapes(pp_rank), pp_rank * per_stage)
        for rank in candidates.values():
            self._simulate(rank)
        return max(candidates.values(), key=lambda r: (self.states[self._key(r)].parameters, -r))

    def rank(self, rank: int) -> dict:
        """The RankEstimate fields of `rank` (all but capacity and the planner's figures)."""
        self._simulate(rank)
        coords = coords_of(self.dims, rank)
        pp_rank, pipelined = coords.get("pp", 0), self.dims.pp > 1
        shapes, _ = key = self._key(rank)
        states, facts = self.states[key], [self.facts[shape] for shape in shapes]
        memory = {index: self.facts[self.plan.shape(index)].memory for index in self.plan.indices(pp_rank)}
        shards, accumulation = self._gradients(states, facts)
        activations, source, in_flight = self._activations(pp_rank, memory)
        gathered, reduce = (
            gathered_and_reduce_bytes(facts, pipelined, self.dims.layout.dp_shard_mode, target_dtype(self.config))
            if self.dims.fsdp_enabled
            else (0, 0)
        )
        receive = (
            receive_bytes(self.plan, pp_rank, self.microbatches, self.hidden_bytes)
            if pipelined and not self.schedule.receives_in_flight
            else 0
        )
        return dict(
            rank=rank,
            coords=coords,
            stage=pp_rank,
            parameters=states.parameters,
            gradients=max(shards, accumulation),
            optimizer=states.optimizer,
            activations=activations,
            activations_source=source,
            buffers=gathered + reduce + receive,
            parameter_count=states.count,
            detail={
                "stages": self.plan.indices(pp_rank),
                "tp_local_parameters": sum(f.numel for f in facts),
                "routed_expert_parameters": states.routed_experts,
                "gradient_shards": shards,
                "gradient_accumulation": accumulation,
                "fsdp_gathered": gathered,
                "reduce_scatter": reduce,
                "pipeline_receive": receive,
                "in_flight": in_flight,
            },
        )

    def _gradients(self, states, facts) -> tuple[int, int]:
        """(the gradients the optimizer steps on, the unsharded fp32 ones accumulated through the step)."""
        measured = all(f.memory is not None for f in facts)
        # autograd's gradients, as measured: under TP a vocabulary-parallel embedding's is the whole table
        elements = sum(f.memory.grad_elements for f in facts) if measured else sum(f.numel for f in facts)
        if not self.dims.fsdp_enabled:
            return (elements * states.gradient_item if measured else states.gradient_shards), 0
        accumulates = self.dims.pp > 1 or self.dims.layout.dp_shard_mode == "zero1" and self.microbatches > 1
        return states.gradient_shards, elements * item_bytes(REDUCE_DTYPE) if accumulates else 0

    def _activations(self, pp_rank: int, memory: dict) -> tuple[int, str, int | None]:
        """(peak, "measured" or "predicted", micro-batch chunks in flight)."""
        if None in memory.values():
            if self.prediction is None:
                raise ConfigError(
                    "The activation peak could not be measured and the planner has no model of "
                    "this layout's activation checkpointing; use --parallel.activation_checkpoint="
                    "none, selective or full."
                )
            return int(self.prediction["activations"]), "predicted", None
        if self.dims.pp == 1:
            return memory[0].peak, "measured", 1
        if self.schedule.receives_in_flight:
            memory = with_receives(memory, self.plan.last_index, self.hidden_bytes)
        peak, in_flight = in_flight_peak(self.schedule.order[pp_rank], memory, self.dims.layout.defer_weight_grads)
        return peak, "measured", in_flight
