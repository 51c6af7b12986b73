"""Stage splitting (names stay global, balanced by layer count with embedding and output counted as
layers, or sized explicitly), the bubble fraction, and every refused pipeline configuration with its
reason and fix, from the trainer's pipeline checks (tests/helpers/schedules.py) and from its config check."""

import pytest
import torch

from tests.helpers.schedules import trainer_pipeline
from trillion.errors import ConfigError
from trillion.models import PRESETS, Transformer
from trillion.parallel.layout import StageLayers
from trillion.parallel.pipeline import bubble_fraction, stage_indices, stage_module
from trillion.parallel.pp_layout import describe, split_units
from trillion.trainer.assemble import build_parallel_dims, resolve_layout
from trillion.trainer.config.schema import load_config
from trillion.trainer.launch.env import LaunchEnv

LLAMA = PRESETS["debug"]  # 4 layers


def test_split_counts_embedding_and_output_as_layers():
    assert split_units(2, 2) == [range(0, 2), range(2, 4)]
    assert split_units(4, 2) == [range(0, 3), range(3, 6)]
    assert [len(r) for r in split_units(8, 4)] == [3, 2, 3, 2] or [len(r) for r in split_units(8, 4)] == [2, 3, 3, 2]
    assert [len(r) for r in split_units(4, 6)] == [1] * 6
    ranges = split_units(61, 16)
    assert ranges[0].start == 0 and ranges[-1].stop == 63 and max(map(len, ranges)) - min(map(len, ranges)) <= 1
    assert stage_indices(1, 4, 2) == [1, 5]
    assert stage_indices(1, 4, 2, "InterleavedZeroBubble") == [1, 5]
    assert stage_indices(1, 4, 2, "ZBVZeroBubble") == stage_indices(1, 4, 2, "DualPipeV") == [1, 6]  # a V


def test_stages_keep_global_names_and_together_hold_the_model():
    with torch.device("meta"):
        model = Transformer(LLAMA)
    names = set()
    for units in split_units(LLAMA.n_layers, 3):
        part = stage_module(model, units)
        own = {n for n, _ in part.named_parameters()}
        assert not own & names
        names |= own
    assert names == {n for n, _ in model.named_parameters()}
    first = stage_module(model, split_units(LLAMA.n_layers, 3)[0])
    assert first.output is None and first.norm is None and "tok_embeddings.weight" in dict(first.named_parameters())


def test_bubble_fraction():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, virtual=2) == pytest.approx(3 / 19)
    assert bubble_fraction(1, 8) == 0


# (pp, schedule, micro-batches, extra keywords, words the message must contain)
REFUSED = [
    (7, "1F1B", 8, {}, ["parallel.pp=7", "4 layers", "--parallel.pp=6"]),
    (2, "Interleaved1F1B", 8, {"virtual": 4}, ["8 pipeline stages", "--parallel.pp=1"]),
    (4, "1F1B", 2, {}, ["1F1B", "2 < parallel.pp=4", "GPipe"]),
    (4, "Interleaved1F1B", 3, {"virtual": 1}, ["Interleaved1F1B", "3 < parallel.pp=4"]),
    (4, "Interleaved1F1B", 9, {"virtual": 1}, ["multiple of the 2 rounds", "8 or 12"]),
    (2, "NoSuchSchedule", 8, {}, ["'NoSuchSchedule' is not known", "GPipe"]),
    (2, "ZBVZeroBubble", 8, {"virtual": 3}, ["pp_virtual_stages=3", "exactly two stages per rank"]),
    (2, "DualPipeV", 3, {}, ["DualPipeV", "(2 x parallel.pp = 4)", "= 3", "ZBVZeroBubble"]),
    (4, "InterleavedZeroBubble", 9, {"virtual": 1}, ["InterleavedZeroBubble", "multiple of the 2 rounds"]),
    (2, "ZBVZeroBubble", 8, {"compile": True}, ["ZBVZeroBubble", "compiled", "--compile.enabled=false"]),
    (2, "1F1B", 8, {"virtual": 2}, ["pp_virtual_stages=2", "one stage per rank"]),
    (2, "1F1B", 8, {"tie_embeddings": True}, ["tied", "tie_embeddings"]),
    (0, "1F1B", 8, {}, ["parallel.pp=0", "positive"]),
]


@pytest.mark.parametrize("pp, schedule, micro, extra, words", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_refused_pipeline_names_the_setting_and_the_reason(pp, schedule, micro, extra, words):
    with pytest.raises(ConfigError) as error:
        trainer_pipeline(pp, schedule, LLAMA.n_layers, micro, **extra)
    for word in words:
        assert word in str(error.value), f"{word!r} not in: {error.value}"


def test_accepted_pipelines():
    assert trainer_pipeline(2, "gpipe", 4, 1) == ("GPipe", 1)  # GPipe takes any number of micro-batches
    assert trainer_pipeline(6, "1F1B", 4, 6) == ("1F1B", 1)
    assert trainer_pipeline(2, "Interleaved1F1B", 4, 4) == ("Interleaved1F1B", 2)
    assert trainer_pipeline(3, "LoopedBFS", 4, 3, virtual=2) == ("LoopedBFS", 2)
    assert trainer_pipeline(1, "ZBVZeroBubble", 4, 1)[0] == "ZBVZeroBubble"  # pp 1: no pipeline, nothing refused
    assert trainer_pipeline(2, "zbvzerobubble", 4, 2) == ("ZBVZeroBubble", 2)
    assert trainer_pipeline(2, "DualPipeV", 4, 4) == ("DualPipeV", 2)
    assert trainer_pipeline(2, "InterleavedZeroBubble", 4, 4, virtual=3) == ("InterleavedZeroBubble", 3)
    assert trainer_pipeline(2, "1F1B", 4, 2, compile=True) == ("1F1B", 1)


def _sizes(n_layers: int, stages: int, layers: StageLayers) -> str:
    return describe([len(r) for r in split_units(n_layers, stages, layers)], n_layers)


def test_explicit_stage_sizes():
    assert _sizes(10, 4, StageLayers(3)) == "E+2 | 3 | 3 | 2+O"  # first/last: one layer less by default
    assert _sizes(8, 4, StageLayers(3, first=1, last=1)) == "E+1 | 3 | 3 | 1+O"
    assert _sizes(8, 4, StageLayers(4, first=0, last=0)) == "E+0 | 4 | 4 | 0+O"
    assert _sizes(8, 2, StageLayers(first=5, last=3)) == "E+5 | 3+O"
    # only the first/last stage sized: the other stages share the rest evenly, the remainder in the middle
    assert _sizes(8, 4, StageLayers(first=0)) == "E+0 | 3 | 3 | 2+O"
    assert _sizes(9, 5, StageLayers(first=0, last=0)) == "E+0 | 3 | 3 | 3 | 0+O"
    assert _sizes(61, 16, StageLayers()) == describe([len(r) for r in split_units(61, 16)], 61)  # defaults: automatic
    ranges = split_units(126, 32, StageLayers(4, first=3, last=3))  # llama3-405b-like: 3 + 30 x 4 + 3
    assert [len(r) for r in ranges] == [4] * 32 and ranges[-1].stop == 128


# (n_layers, stages, StageLayers, words the message must contain)
BAD_SIZES = [
    (
        8,
        4,
        StageLayers(3),
        [
            "pp_layers_per_stage=3",
            "10 transformer layers",
            "8 (model.n_layers)",
            "--parallel.pp_layers_per_stage=3 --parallel.pp_first_stage_layers=1 --parallel.pp_last_stage_layers=1",
        ],
    ),
    (
        8,
        4,
        StageLayers(5, first=0, last=0),
        [
            "10 transformer layers",
            "--parallel.pp_layers_per_stage=4 --parallel.pp_first_stage_layers=0 --parallel.pp_last_stage_layers=0",
        ],
    ),
    (
        8,
        2,
        StageLayers(first=5, last=5),
        [
            "pp_first_stage_layers=5",
            "must equal 8",
            "--parallel.pp_first_stage_layers=4 --parallel.pp_last_stage_layers=4",
        ],
    ),
    (
        8,
        4,
        StageLayers(first=8),
        ["leaving 1 for the other 3 stage(s)", "at least one", "--parallel.pp_first_stage_layers=-1"],
    ),
    (8, 4, StageLayers(first=5, last=5), ["leaving 0 for the other 2 stage(s)"]),
    (8, 4, StageLayers(-1), ["parallel.pp_layers_per_stage=-1 must be 0 or more"]),
    (8, 4, StageLayers(last=-2), ["parallel.pp_last_stage_layers=-2 must be -1 or more"]),
]


@pytest.mark.parametrize("n_layers, stages, layers, words", BAD_SIZES, ids=[str(i) for i in range(len(BAD_SIZES))])
def test_stage_sizes_that_do_not_fit_are_refused(n_layers, stages, layers, words):
    with pytest.raises(ConfigError) as error:
        split_units(n_layers, stages, layers)
    for word in words:
        assert word in str(error.value), f"{word!r} not in: {error.value}"


# --section.field=value overrides, world size, words: the trainer refuses these before any work
TRAINER_REFUSED = [
    (["--parallel.pp=7", "--training.micro_batch_size=1"], 7, ["parallel.pp=7", "4 layers", "--parallel.pp=6"]),
    (
        ["--parallel.pp=4", "--training.global_batch_size=4", "--training.micro_batch_size=2"],
        4,
        ["parallel.pp_schedule=1F1B", "2 < parallel.pp=4", "--parallel.pp_schedule=GPipe"],
    ),
    (
        ["--parallel.pp=2", "--parallel.dp_shard=2", "--training.global_batch_size=6", "--training.micro_batch_size=2"],
        4,
        ["training.global_batch_size=6", "2 data-parallel ranks", "--training.micro_batch_size=1"],
    ),
    (
        ["--parallel.pp=2", "--parallel.pp_layers_per_stage=2", "--training.micro_batch_size=4"],
        2,
        ["parallel.pp_layers_per_stage=2", "must equal 4"],
    ),
    (
        [
            "--parallel.pp=2",
            "--parallel.pp_schedule=Interleaved1F1B",
            "--parallel.pp_first_stage_layers=4",
            "--training.micro_batch_size=4",
        ],
        2,
        ["pp_first_stage_layers=4", "leaving 1 for the other 3 stage(s)"],
    ),
]


@pytest.mark.parametrize("overrides, world, words", TRAINER_REFUSED, ids=[str(i) for i in range(len(TRAINER_REFUSED))])
def test_trainer_refuses_bad_pipelines_before_any_work(overrides, world, words):
    config = load_config(None, overrides)
    env = LaunchEnv(rank=0, world_size=world, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ConfigError) as error:
        build_parallel_dims(resolve_layout(config, world), LLAMA, config.training.seq_len, env)
    for word in words:
        assert word in str(error.value), f"{word!r} not in: {error.value}"
