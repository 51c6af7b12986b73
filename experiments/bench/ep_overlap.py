"""Latency injection: how much of the expert all-to-alls' time the overlap hides, measured on gloo ranks.

Every all-to-all of the expert dispatch (counts, rows, their routing, the combine; forward and backward) is made
to complete D ms late (parallel/ep_exchange.py: its wait sleeps to the deadline, so the delay costs no CPU). The exposed
communication is the step time with D minus the step time without (both measured in the same round, the median over
the rounds of that difference), with parallel.ep_overlap off and on:

    hidden = 1 - exposed(on) / exposed(off)

D is set from the layer's own compute (the step without delay, per MoE layer and pass: forward, input and weight
gradients), times each --scales factor. debug-moe's shape widened so the experts dominate, ep 2 x dp_shard 2 (zero2:
the two micro-batches of a step, 4 x 128 tokens each, in flight together with the overlap), fp32; dropless and with
a per-rank capacity.

    python experiments/bench/ep_overlap.py [--ranks 2] [--steps 6] [--scales 0.5,1,2] [--out DIR]
    python experiments/bench/ep_overlap.py --smoke         # tiny, seconds (tested)

With --pp 2 the same on a pipeline: pp 2 x ep 2 x dp_shard 2 on 4 ranks under pp_schedule=DualPipeV (zero1, the
model split as parallel.pp_layout=auto splits it for the pairing, both runs alike), --microbatches a step of
1 x 128 tokens each; overlap on pairs each OVERLAP_F_B's forward and backward across the rank's two stages
(parallel/pipeline_pairing.py), off runs them one after the other. The delay's unit is again a layer's pass of
compute: the step without delay over (MoE layers x micro-batches x 3), a stage's layers counted once per micro-batch.
With --schedule Interleaved1F1B the pipeline runs Kimi K2's pairing instead: 2 stages a rank, interleaved 1F1B with
one extra warm-up forward, each steady-state forward paired with the backward after it (the stages split by auto's
plain balance). --pairing-phase sets parallel.ep_pairing_phase (default the trainer's auto). Every all-to-all here
is delayed alike, the counts too, so the phase moves less than it does where the counts are short and the dispatch
travels in float8 (planner/pairing.py).

    python experiments/bench/ep_overlap.py --pp 2 [--schedule Interleaved1F1B] [--microbatches 16] [--steps 4]
        [--stage-layers 2] [--pairing-phase -1]      # MoE layers a stage holds (the model grows with it)
"""

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.bench.timing import in_turns, median_difference  # noqa: E402
from trillion.models import PRESETS, Transformer  # noqa: E402
from trillion.parallel.dims import ParallelDims  # noqa: E402
from trillion.parallel.expert_parallel import expert_dispatches  # noqa: E402
from trillion.parallel.forward_backward import MicroBatchLoop  # noqa: E402
from trillion.parallel.parallelize import parallelize  # noqa: E402
from trillion.trainer.step import train_step  # noqa: E402


def moe_layers_of(args) -> list[int]:
    """The trunk's MoE layers (each runs once per micro-batch in a step, whichever stage holds it)."""
    return [index for index in range(args.n_layers) if args.is_moe_layer(index)]


def model_args(smoke: bool, capacity: float, pp: int = 1, stage_layers: int = 2):
    base = PRESETS["debug-moe"]
    moe = dataclasses.replace(base.moe, rank_capacity_factor=capacity, capacity_ranks=2 if capacity else 1)
    if smoke:  # a V of 2 pp stages a rank needs a layer per stage
        return dataclasses.replace(base, n_layers=2 * pp, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, moe=moe)
    moe = dataclasses.replace(moe, expert_ffn_dim=512, n_shared_experts=2)
    # a dense first layer, then stage_layers MoE layers for each of the 4 stages of a V on pp 2 (8 by default: few
    # edges of the pairing; DeepSeek-V3's own stage holds about 4, 58 MoE layers over 16)
    n_layers = 1 + 4 * stage_layers
    return dataclasses.replace(base, n_layers=n_layers, dim=256, n_heads=4, n_kv_heads=2, ffn_dim=512, moe=moe)


class Run:
    """One model on the ep group, its step timed under any (overlap, delay): both are read at every step."""

    def __init__(self, args, world: int, batch: tuple):
        layout = ParallelDims.of(world, dp_shard=world, ep=world).layout
        layout = dataclasses.replace(layout, ep_overlap=True, dp_shard_mode="zero2", microbatches=batch[2])
        self.dims = ParallelDims(layout, world)
        self.dims.build_mesh("cpu")
        with torch.device("meta"):
            model = Transformer(args)
        parallelize(model, self.dims)  # zero2: the blocks stay gathered, so micro-batches pair
        model.to_empty(device="cpu")
        model.init_weights(0)
        self.dispatches = expert_dispatches(model)
        self.runner = MicroBatchLoop(model, self.dims.layout)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        self.args, self.batch = args, batch
        self.generator = torch.Generator().manual_seed(self.dims.dp_rank)

    def step(self, overlap: bool, delay_s: float) -> float:
        self.runner.paired = overlap  # as assemble.py sets it for parallel.ep_overlap at pp 1 and zero2
        for dispatch in self.dispatches:
            dispatch.overlap = overlap
            for exchange in {dispatch.exchange, *dispatch.exchanges()}:
                exchange.delay_s = delay_s
        micro, seq, count = self.batch
        windows = torch.randint(0, self.args.vocab_size, (count, micro, seq + 1), generator=self.generator)
        micro_batches = [(w[:, :-1], w[:, 1:]) for w in windows]
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        exchanges = {e for d in self.dispatches for e in (d.exchange, *d.exchanges())}
        blocked = sum(e.blocked_s for e in exchanges)
        dist.barrier()
        start = time.perf_counter()
        train_step(self.runner, micro_batches, self.optimizer, scaler, contextlib.nullcontext(), 1.0, dims=self.dims)
        self.blocked = sum(e.blocked_s for e in exchanges) - blocked  # this step's waits on the delayed all-to-alls
        return time.perf_counter() - start


class PipelineRun:
    """The model on a pipeline over pp 2 x ep 2 x dp_shard 2 (DualPipeV or Interleaved1F1B, 2 stages a rank), twice:
    paired (ep_overlap) and not."""

    def __init__(self, args, world: int, batch: tuple, schedule: str, phase: int):
        from trillion.parallel.layout import StageLayers
        from trillion.parallel.pipeline import Pipeline
        from trillion.trainer.assemble import resolve_with_model

        micro, seq, count = batch
        self.args, self.batch, self.pipelines, self.optimizers = args, batch, {}, {}
        degrees = ParallelDims.of(world, pp=2, dp_shard=world // 2, ep=world // 2).layout
        paired = dataclasses.replace(
            degrees,
            pp_schedule=schedule,
            virtual_stages=2,
            stage_layers=StageLayers(written="auto"),
            microbatches=count,
            ep_overlap=True,
            ep_pairing_phase=phase,  # -1: the trainer's auto
            dp_shard_mode="zero1",
        )
        paired = resolve_with_model(paired, args, seq)  # one split for both: the one auto gives the pairing
        self.phase = paired.ep_pairing_phase
        for overlap in (False, True):
            self.dims = ParallelDims(dataclasses.replace(paired, ep_overlap=overlap), world)
            self.dims.build_mesh("cpu")
            with torch.device("meta"):
                model = Transformer(args)
            pipeline = Pipeline(model, self.dims, torch.device("cpu"), parallelize_fn=self.layout)
            for part in pipeline.parts:
                part.to_empty(device="cpu")
                part.init_weights(0)
            pipeline.build()
            self.pipelines[overlap] = pipeline
            self.optimizers[overlap] = torch.optim.AdamW(pipeline.model.parameters(), lr=1e-4, foreach=True)
        self.dispatches = {
            o: [d for part in p.parts for d in expert_dispatches(part)] for o, p in self.pipelines.items()
        }
        self.generator = torch.Generator().manual_seed(self.dims.dp_rank)

    def layout(self, part):
        return parallelize(part, self.dims)

    def step(self, overlap: bool, delay_s: float) -> float:
        exchanges = {e for d in self.dispatches[overlap] for e in (d.exchange, *d.exchanges())}
        for exchange in exchanges:
            exchange.delay_s = delay_s
        micro, seq, count = self.batch
        windows = torch.randint(0, self.args.vocab_size, (count, micro, seq + 1), generator=self.generator)
        micro_batches = [(w[:, :-1], w[:, 1:]) for w in windows]
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        blocked = sum(e.blocked_s for e in exchanges)
        dist.barrier()
        start = time.perf_counter()
        runner, optimizer = self.pipelines[overlap], self.optimizers[overlap]
        train_step(runner, micro_batches, optimizer, scaler, contextlib.nullcontext(), 1.0, dims=self.dims)
        self.blocked = sum(e.blocked_s for e in exchanges) - blocked
        return time.perf_counter() - start


def measure(run: Run, settings: list[tuple], rounds: int) -> dict:
    """Step seconds of each (overlap, delay) setting over the rounds, in round order (timing.in_turns); the busiest
    rank's median seconds blocked on the delayed all-to-alls in `run.blocked_medians`."""
    readings = in_turns(lambda *setting: (run.step(*setting), run.blocked), settings, rounds)
    blocked = [statistics.median(b for _, b in values) for values in readings.values()]
    medians = torch.tensor(blocked, dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the busiest rank's (one of no MoE layer blocks on none)
    run.blocked_medians = dict(zip(readings, medians.tolist()))
    return {setting: [seconds for seconds, _ in values] for setting, values in readings.items()}


def _rank(rank: int, world: int, store: str, ns, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    if ns.pp > 1:
        batch = (1, 32, 4) if ns.smoke else (1, 128, ns.microbatches)
    else:
        batch = (2, 32, 2) if ns.smoke else (4, 128, 2)  # micro-batch, sequence, micro-batches per step
    rows = []
    for capacity in (0.0,) if ns.pp > 1 else (0.0, 1.5):
        args = model_args(ns.smoke, capacity, ns.pp, ns.stage_layers)
        run = PipelineRun(args, world, batch, ns.schedule, ns.pairing_phase) if ns.pp > 1 else Run(args, world, batch)
        base = measure(run, [(False, 0.0)], ns.steps)
        layers = len(moe_layers_of(args))  # each MoE layer's pass of one micro-batch, once per step
        layer_s = statistics.median(base[False, 0.0]) / (layers * batch[2] * 3)  # a layer's pass of one micro-batch
        for scale in ns.scales:
            delay = scale * layer_s
            steps = measure(run, [(False, 0.0), (True, 0.0), (False, delay), (True, delay)], ns.steps)
            timed = {setting: statistics.median(values) for setting, values in steps.items()}
            exposed = {o: median_difference(steps[o, delay], steps[o, 0.0]) for o in (False, True)}  # same round
            row = {
                "mode": ("capacity 1.5" if capacity else "dropless")
                + (f" {ns.schedule} pp 2 phase {run.phase}" if ns.pp > 1 else ""),
                "delay_ms": 1e3 * delay,
                "delay_per_layer_compute": scale,
                "step_s": timed[False, 0.0],
                "step_overlap_s": timed[True, 0.0],
                "exposed_off_s": exposed[False],
                "exposed_on_s": exposed[True],
                "hidden": 1 - exposed[True] / exposed[False] if exposed[False] > 0 else float("nan"),
                # the same, read off the waits: seconds a step blocked on the delayed all-to-alls (rank 0)
                "blocked_off_s": run.blocked_medians[False, delay],
                "blocked_on_s": run.blocked_medians[True, delay],
                "hidden_by_waits": 1 - run.blocked_medians[True, delay] / max(run.blocked_medians[False, delay], 1e-9),
            }
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        Path(out).write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    dist.destroy_process_group()


def table(rows: list[dict]) -> str:
    lines = [
        "| dispatch | delay ms (x layer compute) | step s off / on | exposed s, overlap off / on | hidden "
        "| blocked in waits s, off / on | hidden by the waits |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['delay_ms']:.1f} ({r['delay_per_layer_compute']:g}x) | {r['step_s']:.3f} / "
            f"{r['step_overlap_s']:.3f} | {r['exposed_off_s']:.3f} / {r['exposed_on_s']:.3f} | {r['hidden']:.0%} "
            f"| {r['blocked_off_s']:.3f} / {r['blocked_on_s']:.3f} | {r['hidden_by_waits']:.0%} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--scales", default="0.5,1,2", help="delays as multiples of a layer's pass of compute")
    p.add_argument("--out", default="experiments/bench/results")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--pp", type=int, default=1, choices=(1, 2), help="2: DualPipeV over pp 2 x ep 2 on 4 ranks")
    p.add_argument("--microbatches", type=int, default=16, help="with --pp 2: micro-batches a step (at least 4)")
    p.add_argument("--schedule", default="DualPipeV", choices=("DualPipeV", "Interleaved1F1B"), help="with --pp 2")
    p.add_argument("--stage-layers", type=int, default=2, help="MoE layers per pipeline stage (DeepSeek-V3: about 4)")
    p.add_argument("--pairing-phase", type=int, default=-1, help="with --pp 2: parallel.ep_pairing_phase (-1: auto)")
    ns = p.parse_args(argv)
    if ns.pp > 1:
        ns.ranks = 4
    ns.scales = [float(s) for s in ns.scales.split(",")]
    if ns.smoke:
        ns.steps, ns.scales = 2, [1.0]
    Path(ns.out).mkdir(parents=True, exist_ok=True)
    pipelined = f"ep_overlap_pp2{'' if ns.schedule == 'DualPipeV' else '_' + ns.schedule.lower()}.jsonl"
    out = str(Path(ns.out) / ("ep_overlap.jsonl" if ns.pp == 1 else pipelined))
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(ns.ranks, f"{folder}/store", ns, out), nprocs=ns.ranks, join=True)
    print(table([json.loads(line) for line in Path(out).read_text().splitlines()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
