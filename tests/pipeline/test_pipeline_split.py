"""Stage splitting (names stay global, balanced by layer count with embedding and output counted as
layers), the bubble fraction, and every refused pipeline configuration with its reason and fix."""
import dataclasses

import pytest
import torch

from models import PRESETS, Transformer
from parallel.pipeline import bubble_fraction, split_units, stage_indices, stage_module, validate_pipeline
from trainer.errors import ConfigError

LLAMA = PRESETS["debug"]  # 4 layers


def test_split_counts_embedding_and_output_as_layers():
    assert split_units(2, 2) == [range(0, 2), range(2, 4)]
    assert split_units(4, 2) == [range(0, 3), range(3, 6)]
    assert [len(r) for r in split_units(8, 4)] == [3, 2, 3, 2] or [len(r) for r in split_units(8, 4)] == [2, 3, 3, 2]
    assert [len(r) for r in split_units(4, 6)] == [1] * 6
    ranges = split_units(61, 16)
    assert ranges[0].start == 0 and ranges[-1].stop == 63 and max(map(len, ranges)) - min(map(len, ranges)) <= 1
    assert stage_indices(1, 4, 2) == [1, 5]


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
    (2, "ZBVZeroBubble", 8, {}, ["refused", "not verified; known wrong gradients with FSDP", "1F1B"]),
    (2, "InterleavedZeroBubble", 8, {}, ["not verified; known wrong gradients with FSDP"]),
    (2, "DualPipeV", 8, {}, ["not verified; known wrong gradients with FSDP"]),
    (2, "1F1B", 8, {"virtual": 2}, ["pp_virtual_stages=2", "one stage per rank"]),
    (2, "1F1B", 8, {"tie_embeddings": True}, ["tied", "tie_embeddings"]),
    (0, "1F1B", 8, {}, ["parallel.pp=0", "positive"]),
]


@pytest.mark.parametrize("pp, schedule, micro, extra, words", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_refused_pipeline_names_the_setting_and_the_reason(pp, schedule, micro, extra, words):
    with pytest.raises(ConfigError) as error:
        validate_pipeline(pp, schedule, LLAMA.n_layers, micro, **extra)
    for word in words:
        assert word in str(error.value), f"{word!r} not in: {error.value}"


def test_accepted_pipelines():
    assert validate_pipeline(2, "gpipe", 4, 1) == ("GPipe", 1)  # GPipe takes any number of micro-batches
    assert validate_pipeline(6, "1F1B", 4, 6) == ("1F1B", 1)
    assert validate_pipeline(2, "Interleaved1F1B", 4, 4) == ("Interleaved1F1B", 2)
    assert validate_pipeline(3, "LoopedBFS", 4, 3, virtual=2) == ("LoopedBFS", 2)
    assert validate_pipeline(1, "ZBVZeroBubble", 4, 1)[0] == "ZBVZeroBubble"  # pp 1: no pipeline, nothing refused
