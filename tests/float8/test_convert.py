"""Which linears the float8 swap converts (parallel/float8.py): the blocks' projections, not the output
projection, a router, or a linear whose dimensions (per tensor-parallel rank) are not multiples of 16;
the log says which. And what TP makes of a block with some linears kept: plain styles for those."""

import dataclasses
import logging

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from tests.float8.layouts import converted_linears
from trillion.models import get_preset
from trillion.parallel.float8 import convert, is_float8_linear, kept_reason
from trillion.parallel.layout import Float8Training
from trillion.parallel.tensor_parallel import _Styles

DEBUG = get_preset("debug")  # dim 256, 8 heads (4 kv) of 32, ffn 704, vocab 320: all multiples of 16


def test_the_blocks_are_converted_and_the_output_kept(caplog):
    with caplog.at_level(logging.INFO, logger="trillion"):
        decisions, model = converted_linears(DEBUG)
    converted = sorted(name for name, why in decisions.items() if why is None)
    assert len(converted) == 7 * DEBUG.n_layers
    assert {name.split(".", 2)[2] for name in converted} == {
        f"{part}.{w}" for part, ws in (("attention", "wq wk wv wo"), ("feed_forward", "w1 w2 w3")) for w in ws.split()
    }
    assert decisions["output"] == "the output projection"
    assert type(model.output) is nn.Linear and is_float8_linear(model.layers["0"].attention.wq)
    assert model.layers["0"].attention.wq.weight.dtype == torch.float32  # the master weight stays high precision
    assert "layers.*.attention.wq (4)" in caplog.text and "output (the output projection)" in caplog.text
    assert "emulated" in caplog.text and "not faster" in caplog.text


def test_dimensions_not_multiples_of_16_stay_high_precision():
    decisions, model = converted_linears(dataclasses.replace(DEBUG, ffn_dim=700))
    assert decisions["layers.0.feed_forward.w1"] == "700 x 256: not multiples of 16"
    assert decisions["layers.0.feed_forward.w2"] == "256 x 700: not multiples of 16"
    assert decisions["layers.0.attention.wq"] is None
    assert type(model.layers["0"].feed_forward.w3) is nn.Linear


def test_the_per_rank_shard_counts_under_tensor_parallelism():
    # wk/wv: 4 kv heads x 32 = 128 outputs: 16 per rank at tp 8, 8 at tp 16; wo (row-wise) splits its input
    assert converted_linears(DEBUG, tp=8)[0]["layers.0.attention.wk"] is None
    at_16 = converted_linears(DEBUG, tp=16)[0]
    assert at_16["layers.0.attention.wk"] == "8 x 256 per tensor-parallel rank (tp=16): not multiples of 16"
    assert at_16["layers.0.attention.wo"] is None  # 256 x 16
    assert at_16["layers.0.feed_forward.w2"] == "256 x 44 per tensor-parallel rank (tp=16): not multiples of 16"


def test_routers_stay_high_precision():
    linear = nn.Linear(64, 16, bias=False)
    assert kept_reason("layers.0.moe.router", linear) == "a router"
    assert kept_reason("layers.0.feed_forward.gate", linear) == "a router"
    assert kept_reason("layers.0.feed_forward.w1", linear) is None


def test_tensor_parallel_styles_follow_the_conversion():
    with torch.device("meta"):
        model = nn.Module()
        block = nn.Module()
        block.attention, block.feed_forward = nn.Module(), nn.Module()
        for name in ("wq", "wk", "wv", "wo"):
            setattr(block.attention, name, nn.Linear(64, 64))
        block.feed_forward.w1, block.feed_forward.w3 = nn.Linear(64, 96), nn.Linear(64, 100)  # w3 kept
        block.feed_forward.w2 = nn.Linear(96, 64)
        model.layers = nn.ModuleDict({"0": block})
    convert(model, Float8Training(emulate=True))
    styles = _Styles(block, float8_tp=True)
    assert type(styles.colwise("attention.wq")).__name__ == "Float8ColwiseParallel"
    assert type(styles.rowwise("attention.wo")).__name__ == "Float8RowwiseParallel"
    assert type(styles.prepare(["attention.wq", "attention.wk", "attention.wv"])).__name__ == "PrepareFloat8ModuleInput"
    assert type(styles.colwise("feed_forward.w1")).__name__ == "Float8ColwiseParallel"
    assert type(styles.colwise("feed_forward.w3")) is ColwiseParallel  # a kept linear: the plain style
    assert type(styles.prepare(["feed_forward.w1", "feed_forward.w3"])) is PrepareModuleInput  # w3 reads it in fp32
    plain = _Styles(block, float8_tp=False)  # rowwise recipes: torchao's float8 styles cast tensorwise
    assert type(plain.rowwise("attention.wo")) is RowwiseParallel
