"""Pipeline parity harness: the same small models, data and optimizer as tests/helpers/parity.py,
split into pipeline stages; every rank's stage gradients are gathered by their global names and
rank 0 compares them (and losses, norms, initial weights) with the one-process run."""

import contextlib

import torch
import torch.distributed as dist

from tests.helpers import parity
from tests.helpers.parity import (
    FAMILIES,
    MAX_NORM,
    SEED,
    SEQ_LEN,
    STEPS,
    _full,
    random_loader,
    reference_key,
)
from trillion.models import Transformer
from trillion.parallel.dims import ParallelDims, check_layout
from trillion.parallel.layout import StageLayers
from trillion.parallel.parallelize import parallelize
from trillion.parallel.pipeline import Pipeline
from trillion.trainer.step import train_step


def train_pipeline_case(case: dict, world_size: int) -> dict:
    args = FAMILIES[case["family"]]
    stages = StageLayers(
        case.get("layers_per_stage", 0),
        case.get("first_stage_layers", -1),
        case.get("last_stage_layers", -1),
        written=case.get("pp_layout", ""),
    )
    layout = parity.case_layout(case, world_size, stage_layers=stages)
    check_layout(layout, args, SEQ_LEN)
    dims = ParallelDims(layout, world_size)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Transformer(args)
    backend = case.get("compile") or "inductor"
    pipeline = Pipeline(
        model, dims, torch.device("cpu"), parallelize_fn=lambda part: parallelize(part, dims, compile_backend=backend)
    )
    assert pipeline.blocks_per_stage == case.get("blocks", pipeline.blocks_per_stage), "the stages' layers differ"
    for part in pipeline.parts:
        part.to_empty(device="cpu")
        part.init_weights(SEED)
    pipeline.build()
    named = [(n, p) for part in pipeline.parts for n, p in part.named_parameters()]
    initial = {n: _full(p) for n, p in named}
    optimizer = torch.optim.AdamW([p for _, p in named], lr=3e-3, weight_decay=0.1, foreach=True)
    grads = []
    optimizer.register_step_pre_hook(lambda *_: grads.append({n: _full(p.grad) for n, p in named}))
    loader = random_loader(case, args, layout.micro_batch_size, dims)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    losses, norms = [], []
    steps = case.get("steps", STEPS)
    for _ in range(steps):
        loss, norm = train_step(
            pipeline, loader.next_batch(), optimizer, scaler, contextlib.nullcontext(), MAX_NORM, dims=dims
        )
        losses.append(loss.item())
        norms.append(norm.item())
    assert not any(stage.output_chunks for stage in pipeline.stages), "the last stage kept micro-batch logits"
    gathered = [None] * world_size
    dist.all_gather_object(gathered, {"initial": initial, "grads": grads})
    merged_initial, merged_grads = {}, [{} for _ in range(steps)]
    for result in gathered:
        merged_initial.update(result["initial"])
        for step, g in enumerate(result["grads"]):
            merged_grads[step].update(g)
    return {"losses": losses, "norms": norms, "grads": merged_grads, "initial": merged_initial}


def check_pipeline_cases(rank: int, world_size: int, cases: list[dict]) -> None:
    references = {}
    for case in cases:
        result = train_pipeline_case(case, world_size)
        if rank == 0:
            key = reference_key(case)
            if key not in references:
                references[key] = parity.train_case(dict(zip(parity.REFERENCE_KEYS, key)), world_size=1)
            parity._compare(case["name"], result, references[key], relative=case.get("relative", 0.0))
            print("PASSED", case["name"], flush=True)
        dist.barrier()
