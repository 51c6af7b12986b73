"""Hiding TP's collectives, refused up front where it cannot run, one paragraph naming the setting and the fix:
parallel.tp_overlap (a chunk count that does not divide the local sequence, no tp, float8, both ways at once) and
parallel.async_tp (no compile; a device that is not CUDA or a torch without symmetric memory for it, pointing at the
chunked overlap), from the config through resolve_layout, check_model_layout and check_async_tp as `trillion train`
runs them; the command itself exits 2 with the paragraph. And the wiring: parallelize turns on symmetric memory for
the tp group and Inductor's micro-pipeline pass for async TP (on CPU too: the pass only runs on a GPU), and refuses a
compile backend other than Inductor."""

import dataclasses
import subprocess
import sys

import pytest
import torch

from tests.helpers.spawn import run_ranks
from trillion.errors import ConfigError
from trillion.models import PRESETS
from trillion.parallel import async_tp
from trillion.trainer.assemble import check_async_tp, check_model_layout, resolve_layout
from trillion.trainer.config.schema import Config

DEBUG = PRESETS["debug"]


def _layout(config: Config, world: int):
    """The run's Layout as `trillion train` resolves it, checked against the debug model."""
    layout = resolve_layout(config, world)
    check_model_layout(layout, DEBUG, config.training.seq_len)
    return layout


def _config(seq_len: int = 256, **parallel) -> Config:
    config = Config()
    config.training.seq_len = seq_len
    for key, value in parallel.items():
        section, field = key.split("__") if "__" in key else ("parallel", key)
        setattr(getattr(config, section), field, value)
    return config


@pytest.mark.parametrize(
    "world, settings, words",
    [
        # 256 / tp 2 = 128 positions per rank: 3 chunks do not divide them
        (
            2,
            {"tp": 2, "tp_overlap": 3},
            ["parallel.tp_overlap=3", "128 positions", "valid: 1, 2, 4, 8, 16, 32, 64, 128"],
        ),
        (4, {"tp": 2, "cp": 2, "tp_overlap": 128}, ["parallel.tp_overlap=128", "64 positions", "cp 2 / tp 2"]),
        (2, {"tp_overlap": 2}, ["parallel.tp_overlap=2", "parallel.tp=1", "--parallel.tp=2"]),
        (2, {"tp": 2, "tp_overlap": 2, "async_tp": True}, ["pick one", "--parallel.tp_overlap=N"]),
        (2, {"tp": 2, "async_tp": True}, ["parallel.async_tp=true", "--compile.enabled=true", "--parallel.tp_overlap"]),
        (2, {"tp": 2, "tp_overlap": 2, "float8__enabled": True}, ["float8.enabled=true", "--parallel.async_tp=true"]),
    ],
)
def test_bad_settings_are_refused_with_the_fix(world, settings, words):
    with pytest.raises(ConfigError) as error:
        _layout(_config(**settings), world)
    message = str(error.value)
    assert "\n" not in message and all(word in message for word in words), message


def test_a_chunk_count_that_divides_the_local_sequence_is_the_layout_s():
    layout = _layout(_config(tp=2, cp=2, tp_overlap=4), 4)
    assert (layout.tp_overlap, layout.async_tp) == (4, False)
    assert _layout(_config(tp=2, async_tp=True, compile__enabled=True), 2).async_tp


@pytest.mark.parametrize("device, words", [("cpu", ["device is cpu"]), ("cuda", ["no backend", "on cuda"])])
def test_async_tp_is_refused_off_cuda_and_without_symmetric_memory(device, words):
    """On this CPU build of torch: the CPU is not CUDA, and the build has no symmetric-memory backend for CUDA."""
    assert async_tp.symmetric_memory_backend(torch.device("cuda")) is None
    with pytest.raises(ConfigError) as error:
        check_async_tp(_layout(_config(tp=2, async_tp=True, compile__enabled=True), 2), torch.device(device))
    message = str(error.value)
    assert all(word in message for word in [*words, "--parallel.tp_overlap=N"]), message


def test_the_command_exits_2_with_the_paragraph(tmp_path):
    argv = ["train", "--parallel.tp_overlap=2", f"--job.output_dir={tmp_path}"]  # one process: no tp to hide
    done = subprocess.run([sys.executable, "-m", "trillion", *argv], capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stderr
    assert "parallel.tp_overlap=2" in done.stderr and "Traceback" not in done.stderr, done.stderr


def _wiring(rank: int, world_size: int) -> None:
    from torch.distributed._symmetric_memory import is_symm_mem_enabled_for_group

    from trillion.models import Transformer
    from trillion.parallel.dims import ParallelDims
    from trillion.parallel.layout import Layout
    from trillion.parallel.parallelize import parallelize

    dims = ParallelDims(Layout(tp=2, async_tp=True, compile=True), world_size)
    dims.build_mesh("cpu")
    args = dataclasses.replace(DEBUG, n_layers=1)
    with torch.device("meta"):
        model = Transformer(args)
    with pytest.raises(ConfigError, match="compiled with aot_eager"):
        parallelize(model, dims, compile_backend="aot_eager")
    with torch.device("meta"):
        model = Transformer(args)
    before = torch._inductor.config._micro_pipeline_tp
    parallelize(model, dims)
    assert is_symm_mem_enabled_for_group(dims.tp_mesh.get_group().group_name)
    assert torch._inductor.config._micro_pipeline_tp and not before


def test_parallelize_turns_on_symmetric_memory_and_the_inductor_pass():
    run_ranks(_wiring, 2)
