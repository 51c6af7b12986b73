"""The mixture-of-experts layer (models/moe.py) against independent references: transformers' DeepSeek-V3
MoE block (sigmoid scores, group-limited top-k, the selection bias, the routed scale, a shared expert)
in float64; transformers' Mixtral load-balancing loss for the auxiliary loss's gradient; the per-expert
loop for the grouped GEMM; and the rules of capacity dropping, recompute counting and the bias step."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trillion.kernels.grouped_gemm import grouped_mm, grouped_mm_unavailable
from trillion.models.args import ModelArgs, MoEArgs
from trillion.models.moe import AUX_TIMES_TOKENS, DROPPED, TOKENS, MoE, moe_step_hooks
from trillion.models.transformer import FeedForward

DIM, HIDDEN = 32, 16


def build_moe(moe: MoEArgs, dtype=torch.float64, shared: bool = False, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    ffn_args = ModelArgs(n_layers=1, dim=DIM, n_heads=4, vocab_size=64, max_seq_len=16)
    layer = MoE(DIM, moe, FeedForward(ffn_args, hidden=moe.n_shared_experts * HIDDEN) if shared else None)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return layer.to(dtype)


def test_layer_equals_transformers_deepseek_v3_moe_block():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    moe = MoEArgs(
        n_experts=8,
        top_k=3,
        expert_ffn_dim=HIDDEN,
        n_shared_experts=1,
        score_func="sigmoid",
        route_scale=2.5,
        n_groups=4,
        topk_groups=2,
        bias_update_rate=1e-3,
        experts_impl="loop",
    )
    ours = build_moe(moe, shared=True)
    ours.router.expert_bias.copy_(torch.randn(8, dtype=torch.float64) * 0.1)
    config = DeepseekV3Config(
        hidden_size=DIM,
        moe_intermediate_size=HIDDEN,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    theirs = DeepseekV3MoE(config).to(torch.float64)
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.gate.weight)
        theirs.gate.e_score_correction_bias.copy_(ours.router.expert_bias)
        e = ours.experts
        theirs.experts.gate_up_proj.copy_(torch.cat([e.w1.transpose(1, 2), e.w3.transpose(1, 2)], dim=1))
        theirs.experts.down_proj.copy_(e.w2.transpose(1, 2))
        s = ours.shared_experts
        for mine, hf in ((s.w1, theirs.shared_experts.gate_proj), (s.w3, theirs.shared_experts.up_proj)):
            hf.weight.copy_(mine.weight)
        theirs.shared_experts.down_proj.weight.copy_(s.w2.weight)
    x = torch.randn(3, 10, DIM, dtype=torch.float64)
    # transformers routes in float32 whatever the input dtype; ours keeps float64 here
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-5)
    _, our_choice, _ = ours.router(x.view(-1, DIM))
    _, _, their_choice = theirs.gate(x)
    assert torch.equal(our_choice.sort(dim=1).values, their_choice.sort(dim=1).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_gemm_equals_the_per_expert_loop_forward_and_backward(dtype):
    counts = torch.tensor([3, 0, 5, 1])  # an empty expert, and rows past the last group (dropped slots)
    offsets = counts.cumsum(0).to(torch.int32)
    x = torch.randn(11, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(4, 16, 24, dtype=dtype, requires_grad=True)
    assert grouped_mm_unavailable(x, weight) is None
    grad = torch.randn(11, 24, dtype=dtype)
    results = []
    for impl in ("torch", "loop"):
        out = grouped_mm(x, weight, offsets, impl)
        results.append((out, *torch.autograd.grad(out, (x, weight), grad)))
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-3, "atol": 2e-2}
    for fast, reference in zip(*results):
        torch.testing.assert_close(fast, reference, **tolerance)
    assert results[0][0][9:].abs().max() == 0  # the rows past the groups stay zero
    # a summed output's expanded gradient is not contiguous; _ContiguousGrad makes it so
    grouped_mm(x, weight, offsets, "torch").sum().backward()


def test_the_auxiliary_loss_gradient_is_mixtral_s_load_balancing_loss():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    coef = 0.05
    with_aux = build_moe(MoEArgs(n_experts=8, top_k=2, expert_ffn_dim=HIDDEN, aux_loss_coef=coef))
    plain = build_moe(MoEArgs(n_experts=8, top_k=2, expert_ffn_dim=HIDDEN))
    x = torch.randn(2, 12, DIM, dtype=torch.float64)
    with_aux(x).sum().backward()
    logits = plain.router.gate(x.view(-1, DIM))
    aux = load_balancing_loss_func((logits,), num_experts=8, top_k=2)
    (plain(x).sum() + coef * aux).backward()
    for (name, ours), theirs in zip(with_aux.named_parameters(), plain.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-6, atol=1e-8, msg=name)  # theirs: float32 inside
    recorded = with_aux.load_tally[AUX_TIMES_TOKENS] / with_aux.load_tally[TOKENS]
    torch.testing.assert_close(recorded.double(), aux.detach().double(), rtol=1e-5, atol=0)


def test_capacity_drops_the_last_tokens_in_token_order_and_counts_them():
    moe = MoEArgs(n_experts=4, top_k=1, expert_ffn_dim=HIDDEN, capacity_factor=1.0)
    layer = build_moe(moe)
    x = torch.randn(1, 16, DIM, dtype=torch.float64)
    _, chosen, weights = layer.router(x.view(-1, DIM))
    capacity = math.ceil(16 / 4)
    kept = torch.zeros(16, dtype=torch.bool)
    for expert in range(4):  # the first `capacity` tokens choosing each expert, in token order
        kept[(chosen[:, 0] == expert).nonzero().flatten()[:capacity]] = True
    unlimited = build_moe(MoEArgs(n_experts=4, top_k=1, expert_ffn_dim=HIDDEN))
    expected = unlimited(x).view(16, DIM) * kept.unsqueeze(1)
    torch.testing.assert_close(layer(x).view(16, DIM), expected)
    assert not kept.all(), "the seed must overload some expert, or the test shows nothing"
    assert layer.load_tally[DROPPED].item() == (~kept).sum().item()
    layer.last_step_tally = layer.load_tally.clone()
    stats = moe_step_hooks(layer_container(layer))[0].statistics()
    assert stats["moe/layer0/dropped"] == pytest.approx((~kept).sum().item() / 16)


def test_a_recomputed_forward_routes_as_the_first_and_is_counted_once():
    layer = build_moe(MoEArgs(n_experts=8, top_k=2, expert_ffn_dim=HIDDEN), dtype=torch.float32)
    x = torch.randn(2, 8, DIM, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert layer.load_tally[TOKENS].item() == 16
    assert layer.load_tally[:8].sum().item() == 16 * 2
    reference = build_moe(MoEArgs(n_experts=8, top_k=2, expert_ffn_dim=HIDDEN), dtype=torch.float32)
    x_ref = x.detach().clone().requires_grad_()
    reference(x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_the_bias_step_moves_selection_toward_the_underloaded_experts():
    layer = build_moe(MoEArgs(n_experts=4, top_k=1, expert_ffn_dim=HIDDEN, bias_update_rate=0.1))
    layer.router.expert_bias.zero_()
    layer.load_tally[:4] = torch.tensor([10.0, 0.0, 2.0, 4.0])
    layer.load_tally[TOKENS] = 16
    summed = []
    moe_step_hooks(layer_container(layer))[0].after_step(lambda tally: summed.append(tally.clone()))
    # mean load 4: over (+), under (-), under (-), even (0); centred so the bias sums to zero
    expected = torch.tensor([-0.1, 0.1, 0.1, 0.0], dtype=torch.float64) - 0.025
    torch.testing.assert_close(layer.router.expert_bias, expected)
    assert layer.load_tally.abs().sum() == 0 and len(summed) == 1
    stats = moe_step_hooks(layer_container(layer))[0].statistics()
    assert stats["moe/layer0/tokens_per_expert"] == [10, 0, 2, 4]
    assert stats["moe/layer0/max_mean"] == pytest.approx(2.5)
    assert stats["moe/layer0/bias_spread"] == pytest.approx(0.2)


def layer_container(layer: MoE) -> torch.nn.Module:
    """The layer where a Transformer keeps it (layers.0.feed_forward), for the functions that find MoE layers."""
    block = torch.nn.Module()
    block.feed_forward = layer
    root = torch.nn.Module()
    root.layers = torch.nn.ModuleDict({"0": block})
    return root


def test_softmax_routing_renormalises_the_chosen_scores_and_scales_them():
    moe = MoEArgs(n_experts=6, top_k=2, expert_ffn_dim=HIDDEN, route_scale=1.5)
    layer = build_moe(moe)
    x = torch.randn(5, DIM, dtype=torch.float64)
    scores, chosen, weights = layer.router(x)
    expected_scores = F.softmax(layer.router.gate(x), dim=-1)
    torch.testing.assert_close(scores, expected_scores)
    top = expected_scores.topk(2, dim=-1)
    assert torch.equal(chosen, top.indices)
    torch.testing.assert_close(weights, 1.5 * top.values / top.values.sum(-1, keepdim=True))
