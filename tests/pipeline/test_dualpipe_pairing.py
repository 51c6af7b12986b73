"""DualPipe's pairing across pipeline stages (parallel/pipeline_pairing.py): under pp_schedule=DualPipeV with
parallel.ep_overlap each OVERLAP_F_B runs one micro-batch's forward and another's backward in two threads taking
turns at the expert all-to-alls. Checked: the turns (the backward side known by its autograd graph task, a
recompute's posts included; a layer's backward handing over as often as its forward; a phase starting the backward
later), and parity with one process on
gloo, fp32, at pp 2 x ep 2 (4 ranks): debug-deepseek's kind (latent attention, group-limited routing, a dense first
block, MTP on) over 8 steps, losses, gradient norms and the first step's gradients within 1e-6 relative and every
gradient of every step within the harness's elementwise tolerance (tests/moe/harness.py; later steps' Adam
normalisation magnifies rounding), with zero1 and selective or DeepSeek's recompute (at phase 1), each OVERLAP_F_B of
a rank whose two stages hold MoE layers handing the turn over. The breadth (full recompute, zero2, zero3, the per-expert
and per-node dispatch, a per-rank capacity, selective:op, context parallelism, float8 experts and dispatch, their
activations kept in float8) is under -m slow."""

import pytest
import torch

from tests.float8.test_experts_parity import check_wide_model, emulated
from tests.helpers.loopback import Loopback
from tests.helpers.spawn import run_ranks
from tests.moe.harness import check_cases
from trillion.parallel.expert_overlap import Pair, after_post, paired, turn_in_backward

PAIRED = {"pp": 2, "dp_shard": 2, "ep": 2, "ep_overlap": True, "schedule": "DualPipeV", "micro": 1, "paired": True}
DEEPSEEK_KIND = {"model": "mla", "variant": "mtp", "mode": "zero1", "steps": 8, "relative": 1e-6}


class _Post(torch.autograd.Function):
    """Stands in for an all-to-all's wait: its backward posts the reverse all-to-all (ep_exchange.py)."""

    @staticmethod
    def forward(ctx, x, log, name):
        ctx.log, ctx.name = log, name
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(f"B{ctx.name}")
        after_post()
        return grad, None, None


@pytest.mark.parametrize(
    "lead, order",
    [(0, ["Fa", "B3", "Fb", "B2", "Fc", "B1"]), (1, ["Fa", "Fb", "B3", "Fc", "B2", "B1"])],
    ids=["phase-0", "phase-1"],
)
def test_the_forward_and_the_backward_take_turns_at_each_post(lead, order):
    """The forward side hands the turn over after each post; the backward side after each post its graph task
    makes (a checkpointed recompute's too: it runs inside the same graph task), so the log alternates. With a phase
    (parallel.ep_pairing_phase, the Pair's lead) the backward first hands the turn straight back that many times, so
    each of its posts meets a later segment of the forward: the forward's first posts and the backward's last then
    travel beside nothing (B1's turn: the forward is done, so 6 hand-overs either way)."""
    log = []
    x = torch.ones(3, requires_grad=True)
    y = x
    for name in "123":
        y = _Post.apply(y, log, name)
    loss = y.sum()

    def forward():
        for name in "abc":
            log.append(f"F{name}")
            after_post()

    def backward():
        assert paired()
        loss.backward()

    pair = Pair(backward_side=True, lead=lead)
    pair.run(forward, backward)
    assert log == order and pair.handovers == 6
    assert not paired()


class _Loopback(Loopback):
    """An expert layer's posts and turns without a group; each reverse post is logged by its rows' width."""

    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def post(self, x, send, recv, what="", hand_over=True):
        if not what:
            self.log.append(f"B{x.shape[1]}")
        return super().post(x, send, recv, what, hand_over)


def test_a_backward_hands_over_as_often_a_layer_as_the_forward():
    """An expert layer's backward hands the turn over three times, as its forward does (after the counts, the rows
    with their routing, the combine): after the combine's reverse, once after the two reverses of the rows and their
    routing (a turn of the forward between them would sit beside almost nothing), and where the forward exchanged the
    counts (turn_in_backward). So the paired forward's three posts each find a backward segment beside them."""
    log = []
    exchange = _Loopback(log)
    x = torch.ones(5, 4, requires_grad=True)
    weights = torch.full((5, 2), 0.5, requires_grad=True)
    rows = turn_in_backward(x)
    payload = exchange.rows(rows, [5], [5], "dispatch")
    routing = exchange.rows(weights, [5], [5], "routing", beside=payload)
    out = payload.wait()[:, :3] * routing.wait()[:, :1]
    loss = exchange.rows(out, [5], [5], "combine").wait().sum()

    def forward():
        for name in "abc":
            log.append(f"F{name}")
            after_post()

    pair = Pair(backward_side=True)
    pair.run(forward, loss.backward)
    assert log[:3] == ["Fa", "B3", "Fb"] and sorted(log[3:5]) == ["B2", "B4"] and log[5:] == ["Fc"], log
    assert pair.handovers == 6  # three each way: the mirrored counts' turn is the backward's last
    assert x.grad is not None and weights.grad is not None


def test_dualpipev_pairing_at_pp2_x_ep2_equals_one_process():
    run_ranks(
        check_cases,
        4,
        [
            {"name": "dualpipev-paired-selective", **PAIRED, **DEEPSEEK_KIND, "ac": "selective"},
            # the phase the planner gives DeepSeek-V3's per-rank layouts (planner/pairing.py)
            {
                "name": "dualpipev-paired-deepseek-recompute",
                **PAIRED,
                **DEEPSEEK_KIND,
                "ac": "deepseek",
                "ep_pairing_phase": 1,
            },
        ],
    )


@pytest.mark.slow  # about four minutes on two cores
def test_dualpipev_pairing_breadth():
    run_ranks(
        check_cases,
        4,
        [
            {"name": "dualpipev-paired", **PAIRED, **DEEPSEEK_KIND},
            {"name": "dualpipev-paired-full", **PAIRED, **DEEPSEEK_KIND, "ac": "full"},
            {"name": "dualpipev-paired-zero2-selective", **PAIRED, **DEEPSEEK_KIND, "mode": "zero2", "ac": "selective"},
            {"name": "dualpipev-paired-zero3", **PAIRED, "mode": "zero3", "relative": 1e-6},
            {"name": "dualpipev-paired-per-expert", **PAIRED, "mode": "zero1", "ep_dispatch": "expert"},
            # each rank its own node: the per-node dispatch's two hops, one across "nodes"
            {
                "name": "dualpipev-paired-per-node",
                **PAIRED,
                "ep_dispatch": "node",
                "ranks_per_node": 1,
                "ep_pairing_phase": 4,
            },
            {"name": "dualpipev-paired-capacity", **PAIRED, "mode": "zero1", "variant": "capacity"},
            {"name": "dualpipev-paired-op", **PAIRED, "mode": "zero1", "ac": "selective:op"},
            {"name": "dualpipev-paired-cp2", **{**PAIRED, "dp_shard": 1, "cp": 2, "micro": 2}, **DEEPSEEK_KIND},
        ],
    )


@pytest.mark.slow  # about a minute on two cores
def test_dualpipev_pairing_with_float8_experts_and_dispatch():
    wide = {**PAIRED, "model": "wide", "steps": 2, "mode": "zero1"}
    run_ranks(
        check_wide_model,
        4,
        [
            {"name": "dualpipev-paired-float8-experts", **wide, "float8": emulated("blockwise")},
            {"name": "dualpipev-paired-float8-dispatch", **wide, "float8": emulated("blockwise", True)},
            {"name": "dualpipev-paired-float8-cache", **wide, "float8": emulated("blockwise", True, cache=True)},
        ],
    )


class _Posts(Loopback):
    """Counts the rows' posts (each chunk of tokens posts its rows once)."""

    def __init__(self):
        super().__init__()
        self.dispatches = 0

    def post(self, x, send, recv, what="", hand_over=True):
        self.dispatches += what == "dispatch"
        return super().post(x, send, recv, what, hand_over)


@pytest.mark.parametrize("mode", ["rank", "node"])
def test_a_forward_no_micro_batch_pairs_with_splits_its_tokens_in_two(mode):
    """Under a pairing layout the schedule's unpaired actions (DualPipeV's warm-up and cool-down) have no partner
    beside their all-to-alls: with ep_overlap they run the in-layer overlap, two chunks of tokens (the planner prices
    them so: planner/moe.py exposed_all_to_alls), each chunk posting its rows once a hop (per node: to the node, then
    in it), while a paired forward sends its tokens in one. What comes back is the same either way."""
    from trillion.models import PRESETS, Transformer
    from trillion.models.moe import moe_layers
    from trillion.parallel.expert_parallel import ExpertDispatch

    torch.manual_seed(0)
    model = Transformer(PRESETS["debug-moe"])
    model.init_weights(0)  # the constructor leaves the weights uninitialised
    layer = next(iter(moe_layers(model).values()))
    exchanges = [_Posts() for _ in range(3 if mode == "node" else 1)]
    dispatch = ExpertDispatch(layer, mode, *exchanges)
    dispatch.overlap = dispatch.pairs = True
    x = torch.randn(6, layer.experts.w1.shape[-1])
    ids = torch.randint(0, layer.moe.n_experts, (6, layer.moe.top_k))
    weights = torch.rand(6, layer.moe.top_k)
    posted = lambda: [exchange.dispatches for exchange in dispatch.exchanges()]  # noqa: E731
    alone, _ = dispatch(x, ids, weights)
    assert posted() == [2] * len(dispatch.exchanges())
    both = Pair().run(*[lambda: dispatch(x, ids, weights)[0]] * 2)
    assert posted() == [4] * len(dispatch.exchanges())  # one each
    for out in both:
        torch.testing.assert_close(out, alone)
