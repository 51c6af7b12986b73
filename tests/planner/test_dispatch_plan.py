"""The planner's expert dispatch (parallel/planner/moe.py) against the trainer's: the rows a token sends in each mode
and stage against those the dispatch's own all-to-alls count (experiments/bench/ep_dispatch.py simulates the ranks
in threads around the real ExpertDispatch), the kernels between the host read and the all-to-all counted from the
code, the overlap's exposed share from its mechanism, and the modes as `trillion plan` lays them out."""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from experiments.bench.ep_dispatch import random_routing, simulate
from tests.helpers.loopback import Loopback
from trillion.models.args import MoEArgs
from trillion.models.presets import get_preset
from trillion.parallel.ep_exchange import STAGES
from trillion.parallel.ep_routing import Hop, gather_rows, pack_routing, place
from trillion.parallel.layout import Layout
from trillion.parallel.planner.moe import HOST_READ_LAUNCHES, dispatch_rows, exposed_all_to_alls

EP, PER_NODE, TOKENS = 8, 2, 64
MOE = MoEArgs(n_experts=16, top_k=4, expert_ffn_dim=8, score_func="sigmoid", n_groups=4, topk_groups=2)
ARGS = dataclasses.replace(get_preset("debug-deepseek"), moe=MOE)


@pytest.fixture(scope="module")
def routing():
    return random_routing(MOE, EP, TOKENS, seed=5)


@pytest.mark.parametrize("mode", ["expert", "rank", "node"])
def test_rows_per_token_by_stage_match_the_counted_all_to_alls(routing, mode):
    """Within 10% per stage (random routing is not exactly the model's even spread over the chosen groups)."""
    traffic = simulate(routing, MOE, EP, PER_NODE, 32, mode)
    planned = [sum(hop[i] for hop in dispatch_rows(ARGS, mode, EP, PER_NODE)) for i in (0, 1)]
    counted = [traffic.per_token("dispatch", stage, rows=True) for stage in STAGES]
    assert planned == pytest.approx(counted, rel=0.1), (planned, counted)


class _Launches(TorchDispatchMode):
    """Counts the ops that launch a kernel (views, scalars and fresh constants launch none)."""

    FREE = ("view", "unsqueeze", "expand", "slice", "scalar_tensor", "lift_fresh")

    def __init__(self):
        super().__init__()
        self.launches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.launches += not any(name in str(func) for name in self.FREE)
        return func(*args, **(kwargs or {}))


def test_the_host_read_stall_counts_the_kernels_between_the_read_and_the_all_to_all():
    """What the dropless dispatch launches after reading its split sizes and before posting the rows (_Chunk.placed
    and .post, parallel/expert_parallel.py): the planner's HOST_READ_LAUNCHES."""
    ids, weights = torch.randint(0, 16, (32, 4)), torch.rand(32, 4)
    hop = Hop.plan(ids, lambda e: e // 2, 8)
    send = hop.counts()[:, 0].tolist()
    with _Launches() as counted:
        placement = place(hop, send)
        gather_rows(torch.randn(32, 8), placement.rows)
        pack_routing(hop, placement, ids, weights)
    assert counted.launches == HOST_READ_LAUNCHES


def test_overlap_hides_what_the_mechanism_puts_beside_each_all_to_all():
    off, on = Layout(ep=8, ep_dispatch="rank"), Layout(ep=8, ep_dispatch="rank", ep_overlap=True)
    assert exposed_all_to_alls(off, [1.0], [1.0], 0.1, 5.0, 5.0) == pytest.approx(2.1)
    # dropless: the counts hide behind the first chunk's shared experts, the first dispatch half is exposed
    assert exposed_all_to_alls(on, [1.0], [1.0], 0.1, 5.0, 5.0) == pytest.approx(0.5)
    # a float8 dispatch (half the combine's bytes): its own time where the dispatch's is taken, the combine's stays
    assert exposed_all_to_alls(off, [0.5], [1.0], 0.1, 5.0, 5.0) == pytest.approx(1.6)
    assert exposed_all_to_alls(on, [0.5], [1.0], 0.1, 5.0, 5.0) == pytest.approx(0.25)
    # with a capacity nothing is exposed once the compute beside each half is longer than it
    assert exposed_all_to_alls(on, [1.0], [1.0], 0.0, 5.0, 5.0) == 0.0
    # no compute beside: all of it, as without overlap
    assert exposed_all_to_alls(on, [1.0], [1.0], 0.0, 0.0, 0.0) == pytest.approx(2.0)


def test_the_per_node_dispatch_in_two_chunks_is_priced_in_the_order_it_runs():
    """Two chunks in ExpertDispatch._by_node's order, hops of 1.0 over the network and 0.5 in the node each way,
    the counts behind the first shared half: the host waits for both chunks' network hop before the first experts
    (1.0), after the experts (1.0 to 3.0) for the second chunk's return in the node (to 3.25), and that chunk's
    return over the network, queued behind the first's (to 3.5), ends at 4.0 with the second shared half beside it
    (0.65). Without the overlap (one chunk) all 3.1."""
    node = Layout(ep=64, ep_dispatch="node", ep_overlap=True)
    hops = ([1.0, 0.5], [0.5, 1.0], 0.1, 0.2, 2.0)
    assert exposed_all_to_alls(node, *hops) == pytest.approx(1.0 + 0.25 + 0.65)
    assert exposed_all_to_alls(dataclasses.replace(node, ep_overlap=False), *hops) == pytest.approx(3.1)


class _Logged(Loopback):
    """A Loopback that logs each rows' post and its wait as (event, hop, what), `hop` its name."""

    def __init__(self, log: list, hop: str):
        super().__init__()
        self.log, self.hop, self.what = log, hop, ""

    def post(self, x, send, recv, what="", hand_over=True):
        self.what = what
        if what in ("dispatch", "combine"):
            self.log.append(("post", self.hop, what))
        return super().post(x, send, recv, what, hand_over)

    def _all_to_all(self, out, x, recv, send):
        out.copy_(x)
        return _LoggedWait(self.log, self.hop, self.what)


class _LoggedWait:
    def __init__(self, log, hop, what):
        self.log, self.hop, self.what = log, hop, what

    def wait(self):
        if self.what in ("dispatch", "combine"):
            self.log.append(("wait", self.hop, self.what))


def test_the_per_node_price_replays_the_order_the_dispatch_runs_its_chunks_in(monkeypatch):
    """node_chunks_exposed assumes ExpertDispatch._by_node's order with two chunks: both to their nodes; each on in
    its node once arrived; each through its experts and back in the node; each back over the network once returned
    in the node; then the waits for both. The trainer's own posts and waits, logged, run in exactly that order."""
    import trillion.parallel.ep_chunks as ep_chunks
    from trillion.models import PRESETS, Transformer
    from trillion.models.moe import moe_layers
    from trillion.parallel.expert_parallel import ExpertDispatch

    log, real = [], ep_chunks.run_experts
    monkeypatch.setattr(ep_chunks, "run_experts", lambda *a, **k: log.append(("experts",)) or real(*a, **k))
    torch.manual_seed(0)
    model = Transformer(PRESETS["debug-moe"])
    model.init_weights(0)  # the constructor leaves the weights uninitialised
    layer = next(iter(moe_layers(model).values()))
    dispatch = ExpertDispatch(layer, "node", _Logged(log, "ep"), _Logged(log, "network"), _Logged(log, "node"))
    dispatch.overlap = True
    ids = torch.randint(0, layer.moe.n_experts, (6, layer.moe.top_k))
    dispatch(torch.randn(6, layer.experts.w1.shape[-1]), ids, torch.rand(6, layer.moe.top_k))
    to_node, in_node = ("network", "dispatch"), ("node", "dispatch")
    back_in_node, back_to_node = ("node", "combine"), ("network", "combine")
    expected = [("post", *to_node)] * 2
    expected += [("wait", *to_node), ("post", *in_node)] * 2
    expected += [("wait", *in_node), ("experts",), ("post", *back_in_node)] * 2
    expected += [("wait", *back_in_node), ("post", *back_to_node)] * 2
    expected += [("wait", *back_to_node)] * 2
    assert log == expected
