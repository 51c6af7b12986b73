"""Pipeline checkpoints: with two stages per rank (Interleaved1F1B, pp 2) a chained job resumes
bitwise where the unbroken one went, the checkpoint holds the whole model and optimizer under the
one-process names, and one process continues from it on the same loss curve."""

import shutil

import torch

from tests.helpers.runs import losses, read_checkpoint, run
from tests.helpers.spawn import as_launched, run_ranks

TWO_LAYERS = ["--model.n_layers=2"]  # 4 units: embedding, 2 layers, output -> one per stage
LOOPED_PP = [
    *TWO_LAYERS,
    "--parallel.pp=2",
    "--parallel.pp_schedule=Interleaved1F1B",
    "--parallel.pp_virtual_stages=2",
    "--checkpoint.interval=2",
    "--checkpoint.keep_latest=0",
]


def _straight_and_chained(rank, world_size, root):
    as_launched(rank, world_size)
    run(root / "straight", *LOOPED_PP, steps=4)
    run(root / "chained", *LOOPED_PP, "--training.exit_interval=2", steps=4)
    run(root / "chained", *LOOPED_PP, steps=4)


def test_looped_pipeline_resumes_exactly_and_loads_in_one_process(tmp_path):
    run_ranks(_straight_and_chained, 2, tmp_path)
    assert losses(tmp_path / "chained") == losses(tmp_path / "straight")
    assert [step for step, _ in losses(tmp_path / "chained")] == [1, 2, 3, 4]

    run(tmp_path / "one-process", *TWO_LAYERS, steps=1)
    pipelined, single = (
        read_checkpoint(tmp_path / "straight", step=4),
        read_checkpoint(tmp_path / "one-process", step=1),
    )
    assert pipelined.keys() == single.keys()  # every parameter and optimizer state, under its global name
    assert any(k.startswith("optimizer.state.layers.1.") for k in pipelined)

    continued = tmp_path / "continued"
    shutil.copytree(tmp_path / "straight", continued)
    shutil.rmtree(continued / "checkpoints" / "step-00000004")
    run(continued, *TWO_LAYERS, steps=4)  # one process resumes the pp 2 checkpoint of step 2
    reference = losses(tmp_path / "straight")
    assert losses(continued)[:2] == reference[:2]
    torch.testing.assert_close(
        [loss for _, loss in losses(continued)[2:]], [loss for _, loss in reference[2:]], rtol=1e-5, atol=0
    )
