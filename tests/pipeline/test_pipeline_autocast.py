"""Mixed precision reaches the stages: with training.dtype=bf16 every linear layer of every stage
computes in bfloat16 under a pipeline schedule, as it does without one (parameters stay fp32 with
pp alone, so only autocast can do it)."""

import torch
from torch import nn

from tests.helpers.runs import run
from tests.helpers.spawn import as_launched, run_ranks


def _linear_output_dtypes(rank, world_size, root):
    as_launched(rank, world_size)
    seen = set()
    hook = nn.modules.module.register_module_forward_hook(
        lambda module, _, output: seen.add(output.dtype) if isinstance(module, nn.Linear) else None
    )
    try:
        run(
            root,
            "--model.n_layers=2",
            "--parallel.pp=2",
            "--parallel.pp_schedule=1F1B",
            "--training.dtype=bf16",
            "--checkpoint.interval=0",
            "--checkpoint.save_final=false",
            steps=1,
        )
    finally:
        hook.remove()
    assert seen == {torch.bfloat16}, f"rank {rank}: linear outputs in {seen}"


def test_pipeline_stages_run_under_autocast(tmp_path):
    run_ranks(_linear_output_dtypes, 2, tmp_path / "bf16")
