"""Pipeline stages hold receive buffers only for the micro-batches in flight, not one per micro-batch of
the step as torch's PipelineStage does (2 m hidden states per stage: parallel/pipeline_stage.py).

Two ranks, 8 micro-batches, a single-stage schedule (1F1B) and a V (ZBVZeroBubble: two stages per
rank, split backward, one hand-over between stages on the same rank). Every buffer a receive posts
into is followed by a weak reference, so the count alive after each stage action gives the peak of a
step. Torch's own stage, the control, holds one per micro-batch and direction for good."""

import dataclasses
import json
import weakref
from pathlib import Path

import torch
from torch.distributed.pipelining import PipelineStage

import trillion.parallel.pipeline_stage
from tests.helpers.parity import FAMILIES, SEED, SEQ_LEN, RandomWindows
from tests.helpers.spawn import run_ranks
from trillion.models import Transformer
from trillion.parallel import modes
from trillion.parallel.dims import ParallelDims
from trillion.parallel.layout import layout_on
from trillion.parallel.pipeline import Pipeline

PP, MICRO_BATCHES = 2, 8
SCHEDULES = {"1F1B": 1, "ZBVZeroBubble": 2}  # stages per rank
ACTIONS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class ReceiveBuffers:
    """The buffers the stages' receives post into: how many the receive infos hold, and the peak alive."""

    def __init__(self, stages):
        self.stages, self.refs, self.peak, self.peak_bytes = stages, {}, 0, 0
        for stage in stages:
            stage.get_fwd_recv_ops = self._posting(stage.get_fwd_recv_ops, stage.args_recv_info)
            stage.get_bwd_recv_ops = self._posting(stage.get_bwd_recv_ops, stage.grad_recv_info)
            for name in ACTIONS:
                setattr(stage, name, self._counting(getattr(stage, name)))

    def _posting(self, get_recv_ops, recv_info: dict):
        def call(chunk):
            ops = get_recv_ops(chunk)
            for info in recv_info.get(chunk, ()):
                if info.buffer is not None:
                    self.refs.setdefault(id(info.buffer), weakref.ref(info.buffer))
            self._count()
            return ops

        return call

    def _counting(self, action):
        def call(*args, **kwargs):
            result = action(*args, **kwargs)
            self._count()
            return result

        return call

    def _count(self) -> None:
        alive = [buffer for buffer in (ref() for ref in self.refs.values()) if buffer is not None]
        self.peak = max(self.peak, len(alive))
        self.peak_bytes = max(self.peak_bytes, sum(b.numel() * b.element_size() for b in alive))

    def held(self) -> int:
        return sum(
            info.buffer is not None
            for stage in self.stages
            for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
            for info in infos
            if not info.is_root_arg
        )


def count_receive_buffers(rank: int, world_size: int, micro_batches: int, out: str) -> None:
    """For each schedule, with torch's stage and ours: buffers held after two steps, peak alive, its bytes."""
    args = FAMILIES["llama"]
    degrees = layout_on(world_size, pp=PP)
    windows = RandomWindows(args.vocab_size, SEQ_LEN + 1).next_windows(micro_batches)
    batch = [(w[None, :-1], w[None, 1:]) for w in windows]
    ours, counts = trillion.parallel.pipeline_stage.InFlightReceiveStage, {}
    for schedule in SCHEDULES:
        for stage_class in (PipelineStage, ours):
            trillion.parallel.pipeline_stage.InFlightReceiveStage = stage_class  # what Pipeline builds its stages with
            with torch.device("meta"):
                model = Transformer(args)
            shape = modes.schedule(schedule)
            layout = dataclasses.replace(
                degrees,
                pp_schedule=shape.name,
                virtual_stages=modes.stages_per_rank(shape, 0),
                microbatches=micro_batches,
            )
            dims = ParallelDims(layout, world_size)
            dims.build_mesh("cpu")
            pipeline = Pipeline(model, dims, torch.device("cpu"))
            for part in pipeline.parts:
                part.to_empty(device="cpu")
                part.init_weights(SEED)
            pipeline.build()
            buffers = ReceiveBuffers(pipeline.stages)
            for _ in range(2):  # the first step also infers the shapes
                pipeline.step(batch, torch.tensor(micro_batches * SEQ_LEN))
            counts[f"{schedule} {stage_class.__name__}"] = (buffers.held(), buffers.peak, buffers.peak_bytes)
    trillion.parallel.pipeline_stage.InFlightReceiveStage = ours
    Path(f"{out}.{rank}").write_text(json.dumps(counts))


def measure(micro_batches: int, folder: Path) -> list[dict]:
    run_ranks(count_receive_buffers, PP, micro_batches, str(folder / "counts"))
    return [json.loads((folder / f"counts.{rank}").read_text()) for rank in range(PP)]


def test_stages_hold_receive_buffers_only_for_micro_batches_in_flight(tmp_path):
    for rank, counts in enumerate(measure(MICRO_BATCHES, tmp_path)):
        for schedule, stages_per_rank in SCHEDULES.items():
            held, peak, _ = counts[f"{schedule} PipelineStage"]
            assert held >= MICRO_BATCHES and peak >= MICRO_BATCHES, (schedule, rank, held, peak)  # the control
            held, peak, _ = counts[f"{schedule} InFlightReceiveStage"]
            # at most PP micro-batches in flight per stage, each with an activation and a gradient coming in
            assert held == 0 and peak <= 2 * PP * stages_per_rank < MICRO_BATCHES * stages_per_rank, (
                schedule,
                rank,
                held,
                peak,
            )
