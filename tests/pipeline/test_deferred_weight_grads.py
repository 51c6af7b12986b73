"""Deferred weight gradients (parallel.defer_weight_grads, parallel/deferred_weight_grads.py): a backward computes
the input gradients and queues the plain linears' and routed experts' weight gradients, which a later run of the
queue adds, equal to autograd's; under DualPipeV with DeepSeek's recompute (where a second backward pass is refused
and, without deferral, each weight pass runs inside its input pass) training equals one process; a layout without a
schedule weight pass is refused."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

from tests.float8.test_experts_parity import check_wide_model, emulated
from tests.helpers.spawn import run_ranks
from tests.moe.harness import check_cases
from tests.moe.test_ep_config import refusal
from tests.pipeline.test_dualpipe_pairing import DEEPSEEK_KIND, PAIRED
from trillion.kernels.float8_grouped_gemm import Float8GroupedMM
from trillion.models import PRESETS
from trillion.models.moe import MoE
from trillion.parallel.deferred_weight_grads import defer_weight_grads
from trillion.parallel.float8 import torchao_float8
from trillion.parallel.layout import Layout
from trillion.parallel.modes import joins_weight_passes


class _Block(nn.Module):
    """A linear, a norm and the routed experts: what defers and what does not."""

    def __init__(self):
        super().__init__()
        moe = PRESETS["debug-moe"].moe
        self.up = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.moe = MoE(16, moe)  # its routed experts, called directly
        self.experts = self.moe.experts
        for w in (self.experts.w1, self.experts.w2, self.experts.w3):
            nn.init.normal_(w, std=0.2)  # made empty
        self.n_experts = moe.n_experts

    def forward(self, x):
        rows = self.norm(self.up(x))
        counts = torch.full((self.n_experts,), rows.shape[0] // self.n_experts)
        return self.experts(rows, counts, torch.linspace(0.5, 1.5, rows.shape[0], dtype=rows.dtype))


class _Model(nn.Module):
    """A block under `layers` (where products defer) and an output head (which does not)."""

    def __init__(self, block: nn.Module, dim: int):
        super().__init__()
        self.layers = nn.ModuleDict({"0": block})
        self.output = nn.Linear(dim, 4, bias=False)

    def forward(self, x):
        return self.output(self.layers["0"](x))


@pytest.mark.parametrize("float8", [None, "blockwise", "blockwise-kept"])
def test_a_backward_queues_the_weight_gradients_and_the_queue_adds_autograds(float8):
    """The experts in high precision, or float8 by the project's blockwise product (emulated; its activations kept
    in float8 too): every weight gradient equals the undeferred product's, bitwise."""
    torch.manual_seed(0)
    inner = _Block()
    if float8:
        inner.experts.float8 = Float8GroupedMM("blockwise", True, keep_float8=float8.endswith("kept"))
    block = _Model(inner, 16) if float8 else _Model(inner, 16).double()
    reference = copy.deepcopy(block)
    x = torch.randn(24, 16, dtype=torch.float64 if float8 is None else torch.float32)
    queue = defer_weight_grads(block)
    x_deferred, x_reference = x.clone().requires_grad_(), x.clone().requires_grad_()
    with queue.deferring(True):
        block(x_deferred).square().sum().backward()
    reference(x_reference).square().sum().backward()
    torch.testing.assert_close(x_deferred.grad, x_reference.grad, rtol=1e-12, atol=0)
    used = {name for name, p in reference.named_parameters() if p.grad is not None}
    waiting = {name for name, p in block.named_parameters() if p.grad is None and name in used}
    experts = {f"layers.0.moe.experts.{w}" for w in ("w1", "w2", "w3")}
    assert waiting == {"layers.0.up.weight", *experts} and len(queue) == 4  # not the head's
    queue.take()()
    assert len(queue) == 0 and queue.computed == 4
    for (name, p), q in zip(block.named_parameters(), reference.parameters()):
        if name in used:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0, msg=name)


def test_a_backward_outside_an_input_pass_computes_its_weight_gradients_as_it_goes():
    torch.manual_seed(0)
    block = _Model(_Block(), 16).double()
    reference = copy.deepcopy(block)
    queue = defer_weight_grads(block)
    x = torch.randn(24, 16, dtype=torch.float64)
    block(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert len(queue) == 0
    for p, q in zip(block.parameters(), reference.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_float8_linears_deferred_weight_gradient_is_torchaos_own(recipe):
    """torchao's Float8Linear (emulated): the input gradient now and the queued weight gradient equal its own
    backward's, bitwise; the bias's is not deferred."""
    float8 = torchao_float8()
    Float8LinearConfig, convert_to_float8_training = float8.Float8LinearConfig, float8.convert_to_float8_training

    torch.manual_seed(0)
    model = _Model(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32, bias=False)), 32)
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=dataclasses.replace(config, emulate=True))
    reference = copy.deepcopy(model)
    queue = defer_weight_grads(model)
    x = torch.randn(4, 8, 32)
    x_deferred, x_reference = x.clone().requires_grad_(), x.clone().requires_grad_()
    with queue.deferring(True):
        model(x_deferred).square().sum().backward()
    assert [p.grad is None for p in model.parameters()] == [True, False, True, False] and len(queue) == 2
    queue.take()()
    reference(x_reference).square().sum().backward()
    assert torch.equal(x_deferred.grad, x_reference.grad)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_deferral_unjoins_the_weight_passes_checkpointing_would_join():
    layout = Layout(pp=2, pp_schedule="DualPipeV", virtual_stages=2, ep=2, activation_checkpoint="deepseek")
    assert joins_weight_passes(layout)
    assert not joins_weight_passes(Layout(**{**layout.__dict__, "defer_weight_grads": True}))


def test_dualpipev_with_deepseeks_recompute_and_deferred_weight_gradients_equals_one_process():
    run_ranks(
        check_cases,
        4,
        [
            {
                "name": "dualpipev-paired-deepseek-recompute-deferred",
                **PAIRED,
                **DEEPSEEK_KIND,
                "ac": "deepseek",
                "ep_pairing_phase": 1,
                "defer_weight_grads": True,
            },
        ],
    )


@pytest.mark.slow  # about three minutes on two cores
def test_deferred_weight_gradients_breadth():
    deferred = {**PAIRED, **DEEPSEEK_KIND, "defer_weight_grads": True}
    run_ranks(
        check_cases,
        4,
        [
            {
                "name": "deferred-zbv-selective",
                **deferred,
                "schedule": "ZBVZeroBubble",
                "ep_overlap": False,
                "paired": False,
                "ac": "selective",
            },
            {"name": "deferred-paired-full", **deferred, "ac": "full"},
            {"name": "deferred-paired-zero3-deepseek", **deferred, "mode": "zero3", "ac": "deepseek"},
            {
                "name": "deferred-paired-per-node",
                **deferred,
                "ep_dispatch": "node",
                "ranks_per_node": 1,
                "ep_pairing_phase": 4,
                "ac": "deepseek",
            },
        ],
    )


@pytest.mark.slow  # about a minute on two cores
def test_deferred_weight_gradients_with_float8_linears_and_experts():
    wide = {**PAIRED, "model": "wide", "steps": 2, "mode": "zero1", "ac": "deepseek", "defer_weight_grads": True}
    run_ranks(
        check_wide_model,
        4,
        [
            {"name": "deferred-float8-experts", **wide, "float8": emulated("blockwise")},
            # not under DeepSeek's recompute, which rebuilds w2's input from float8 (lossy against one process)
            {"name": "deferred-float8-cache", **wide, "ac": "none", "float8": emulated("blockwise", True, cache=True)},
        ],
    )


@pytest.mark.parametrize(
    "parallel, world, words",
    [
        ({"dp_shard": 2}, 2, ["parallel.pp=1", "DualPipeV", "ZBVZeroBubble"]),
        ({"pp": 2, "pp_schedule": "1F1B"}, 2, ["pp_schedule=1F1B", "DualPipeV", "ZBVZeroBubble"]),
        ({"pp": 2, "tp": 2, "pp_schedule": "ZBVZeroBubble"}, 4, ["parallel.tp=2", "--parallel.tp=1"]),
    ],
)
def test_deferral_where_it_cannot_run_is_refused(parallel, world, words):
    message = refusal({**parallel, "defer_weight_grads": True}, world, PRESETS["debug"])
    for word in ["parallel.defer_weight_grads", *words]:
        assert word in message, message
