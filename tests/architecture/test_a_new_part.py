"""A new part is its module and its declaration, and nothing else: a gated attention (the attention output
multiplied by sigmoid of one more column-parallel projection of the block's input, per head, before wo) is
written and declared here, registered by name, and then trains under tensor parallelism 2 exactly as in one
process and is counted and costed by the planner, with no edit to models/, parallel/ or trainer/."""

import dataclasses

import pytest
import torch
from torch import nn

from tests.helpers import parity
from tests.helpers.spawn import run_ranks
from trillion.models import Transformer
from trillion.models.attention import Attention
from trillion.models.flops import count_params
from trillion.models.parts import ATTENTION_KINDS, AttentionKind, block, gqa, register_attention
from trillion.models.parts.spec import COLUMN, Linear, PerToken
from trillion.models.rope import apply_rope
from trillion.parallel.layout import Layout
from trillion.parallel.planner.activations import layer_activation_bytes
from trillion.parallel.planner.assumptions import ASSUMED
from trillion.parallel.planner.block_cost import layer_passes
from trillion.parallel.planner.hardware import load_profile
from trillion.parallel.planner.memory import block_params, layout_memory
from trillion.parallel.planner.timing import _gemm


class GatedAttention(Attention):
    def __init__(self, args):
        super().__init__(args)
        self.wgate = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.bias)

    def forward(self, x, rope, cache=None):
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = self.attend(q, k, v, impl=self.impl, causal=True).transpose(1, 2).reshape(batch, seq, -1)
        return self.wo(out * torch.sigmoid(self.wgate(x)))  # -1 above: under TP, this rank's heads and gates


def declare_gated(args):
    """Grouped-query attention's declaration plus the gate: one more column linear, and it keeps the gate's
    output and the gated product for backward."""
    plain, width = gqa.declare(args), args.n_heads * args.head_dim
    gate = Linear("attention.wgate", args.dim, width, COLUMN, args.bias)
    return dataclasses.replace(
        plain,
        linears=(*plain.linears[:3], gate, plain.linears[3]),
        saved=plain.saved + PerToken(split=2 * width),
    )


GATED = AttentionKind(declare_gated, GatedAttention)
PLAIN = parity.FAMILIES["llama"]
TOY = dataclasses.replace(PLAIN, attention="gated")


def register() -> None:
    register_attention("gated", GATED)


@pytest.fixture
def gated():
    register()
    yield
    del ATTENTION_KINDS["gated"]
    block.cache_clear()


def _train_both_ways(rank: int, world_size: int) -> None:
    register()  # a fresh process: the test module registers its part, as a user's module would
    parity.FAMILIES["gated"] = TOY
    parity.check_cases(rank, world_size, [{"family": "gated", "tp": 2}])


def test_the_gated_attention_trains_under_tp_2_as_in_one_process():
    # every loss, gradient norm and gradient (the gate's included, each nonzero) of 3 steps equals one process's
    run_ranks(_train_both_ways, 2)


def test_the_declaration_counts_the_real_module(gated):
    with torch.device("meta"):
        model = Transformer(TOY)
    assert count_params(TOY).total == sum(p.numel() for p in model.parameters())
    names = {spec.name: spec.tp_dim for spec in block_params(TOY)}
    assert names["attention.wgate.weight"] == 0  # split with the heads it gates
    assert set(names) == {name for name, _ in model.layers["0"].named_parameters()}


def test_the_planner_costs_the_gate(gated):
    hw, tokens, tp = load_profile("dgx-h100"), 2 * 1024, 2
    width = PLAIN.n_heads * PLAIN.head_dim
    extra_gemm = _gemm(hw, tokens, PLAIN.dim, width // tp)
    gated_step, plain_step = (layer_passes(a, hw, 2, 1024, tp, False) for a in (TOY, PLAIN))
    assert gated_step.weight_grad - plain_step.weight_grad == pytest.approx(extra_gemm, rel=1e-12)
    kept = layer_activation_bytes(TOY, tokens, tp, True, False) - layer_activation_bytes(PLAIN, tokens, tp, True, False)
    assert kept == pytest.approx(tokens * 2 * width / tp * 2)  # bf16 activations, split over tp
    layout = Layout(tp=tp, microbatches=2, micro_batch_size=2)
    assert layout_memory(TOY, layout, 1024, ASSUMED).total > layout_memory(PLAIN, layout, 1024, ASSUMED).total
