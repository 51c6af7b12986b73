"""DeepSeek-V3's sequence-wise balance loss (models/moe.py) against the paper's formulas written out here
in float64 (arXiv 2412.19437, section 2.1.2, eq. 17-20), value and the gradient reaching the router; and
that the statistics are per sequence: a batch gives the mean of its sequences' losses; the `moe.` setting reaches
the layer and the step's value is logged."""

import pytest
import torch

from tests.test_moe_layer import DIM, build_moe, layer_container
from trillion.models.args import MoEArgs
from trillion.models.moe import SEQ_AUX_TIMES_TOKENS, TOKENS, moe_step_hooks
from trillion.parallel.layout import Layout
from trillion.trainer.assemble import build_model_args
from trillion.trainer.config.schema import load_config

ALPHA, E, K = 0.01, 8, 3
MOE = MoEArgs(n_experts=E, top_k=K, expert_ffn_dim=16, score_func="sigmoid", route_scale=2.5, seq_aux_loss_coef=ALPHA)


def paper_loss(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """alpha * sum_i f_i P_i per sequence (eq. 17-20), averaged over the batch's sequences; x (B, T, dim)."""
    losses = []
    for sequence in x:  # (T, dim)
        s = torch.sigmoid(sequence @ gate.T)  # s_{i,t}, (T, E)
        T = s.shape[0]
        top = s.topk(K, dim=-1).indices  # the router's choice: the top K affinities (no bias, one group)
        f = torch.stack([(top == i).any(dim=-1).double().sum() * E / (K * T) for i in range(E)])
        s_norm = s / s.sum(dim=-1, keepdim=True)  # s'_{i,t}
        P = s_norm.mean(dim=0)
        losses.append(ALPHA * (f * P).sum())
    return torch.stack(losses).mean()


def test_value_and_router_gradient_equal_the_paper_s_formulas():
    layer = build_moe(MOE)
    x = torch.randn(3, 10, DIM, dtype=torch.float64)
    out = layer(x)
    out.backward(torch.zeros_like(out))  # only the balance loss sends a gradient
    gate = layer.router.gate.weight.detach().clone().requires_grad_()
    expected = paper_loss(x, gate)
    expected.backward()
    recorded = layer.load_tally[SEQ_AUX_TIMES_TOKENS] / layer.load_tally[TOKENS]
    torch.testing.assert_close(ALPHA * recorded, expected.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(layer.router.gate.weight.grad, gate.grad, rtol=1e-10, atol=1e-14)
    assert gate.grad.abs().max() > 1e-6, "the balance loss must reach the router, or the test shows nothing"


def test_per_sequence_statistics_are_not_the_batch_s():
    """The loss of a batch is the mean of its sequences' (not the loss of their pooled tokens)."""
    layer = build_moe(MOE)
    x = torch.randn(2, 10, DIM, dtype=torch.float64)
    scores, chosen, _ = layer.router(x.view(-1, DIM))
    batch = layer._sequence_aux_loss(scores, chosen, 2)
    each = [layer._sequence_aux_loss(scores[i * 10 : (i + 1) * 10], chosen[i * 10 : (i + 1) * 10], 1) for i in (0, 1)]
    torch.testing.assert_close(batch, (each[0] + each[1]) / 2, rtol=1e-14, atol=0)
    pooled = layer._sequence_aux_loss(scores, chosen, 1)
    assert not torch.isclose(batch, pooled, rtol=1e-6), "pooled statistics would hide the per-sequence imbalance"


def test_the_setting_reaches_the_model_and_the_loss_is_logged_without_alpha():
    config = load_config(None, ["--model.name=debug-moe", "--moe.seq_aux_loss_coef=0.001"])
    assert build_model_args(config, 257, Layout()).moe.seq_aux_loss_coef == 0.001
    layer = build_moe(MOE)
    x = torch.randn(2, 10, DIM, dtype=torch.float64)
    layer(x)  # a training forward tallies it
    scores, chosen, _ = layer.router(x.view(-1, DIM))
    layer.last_step_tally = layer.load_tally.clone()
    logged = moe_step_hooks(layer_container(layer))[0].statistics()["moe/layer0/seq_aux_loss"]
    assert logged == pytest.approx(layer._sequence_aux_loss(scores, chosen, 2).item(), rel=1e-12)
