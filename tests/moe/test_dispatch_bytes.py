"""The expert dispatch's bytes, counted where it posts its all-to-alls (parallel/ep_exchange.py), against the rows
each mode must send, computed here from the routing alone: per expert one row per (token, expert on another rank);
per rank one per (token, other rank holding any of its experts); per node one per (token, other node) across the
network, at most topk_groups when each routing group is one node's experts. 8 ranks as 4 nodes of 2, simulated in
threads around the real ExpertDispatch (experiments/bench/ep_dispatch.py), which also checks every token gets back
the weighted sum of its rows."""

import pytest

from experiments.bench.ep_dispatch import random_routing, simulate
from trillion.models.args import MoEArgs
from trillion.parallel.ep_exchange import STAGES

EP, PER_NODE, TOKENS, DIM = 8, 2, 24, 32
MOE = MoEArgs(n_experts=16, top_k=4, expert_ffn_dim=8, score_func="sigmoid", n_groups=4, topk_groups=2)


def _owners(routing, per_owner: int, rank_of_owner=lambda owner: owner, distinct: bool = True) -> list[int]:
    """Per rank, each token's owners (experts // per_owner; once each if `distinct`) other than the rank's own."""
    counts = []
    for rank, (ids, _) in enumerate(routing):
        for token in ids.tolist():
            owners = [expert // per_owner for expert in token if expert // per_owner != rank_of_owner(rank)]
            counts.append(len(set(owners)) if distinct else len(owners))
    return counts


@pytest.fixture(scope="module")
def routing():
    return random_routing(MOE, EP, TOKENS, seed=3)


def _rows(traffic, stages=STAGES) -> float:
    return sum(traffic.sent_rows.get(("dispatch", stage), 0) for stage in stages)


def test_per_expert_sends_a_row_per_choice_on_another_rank(routing):
    traffic = simulate(routing, MOE, EP, PER_NODE, DIM, "expert")
    assert _rows(traffic) == sum(_owners(routing, MOE.n_experts // EP, distinct=False))


def test_per_rank_sends_a_row_per_destination_rank(routing):
    traffic = simulate(routing, MOE, EP, PER_NODE, DIM, "rank")
    per_rank = MOE.n_experts // EP
    assert _rows(traffic) == sum(_owners(routing, per_rank)) < sum(_owners(routing, per_rank, distinct=False))
    assert traffic.tokens == EP * TOKENS


def test_per_node_crosses_the_network_at_most_topk_groups_times_per_token(routing):
    traffic = simulate(routing, MOE, EP, PER_NODE, DIM, "node")
    nodes = EP // PER_NODE
    assert MOE.n_groups == nodes  # one routing group per node: a token's experts lie in topk_groups nodes
    distinct = _owners(routing, MOE.n_experts // nodes, rank_of_owner=lambda rank: rank // PER_NODE)
    assert _rows(traffic, (STAGES[0],)) == sum(distinct)
    assert max(distinct) <= MOE.topk_groups
    rank = simulate(routing, MOE, EP, PER_NODE, DIM, "rank")
    network = [t.per_token("dispatch", STAGES[0]) + t.per_token("routing", STAGES[0]) for t in (traffic, rank)]
    assert network[0] < 0.8 * network[1]  # fewer network bytes than per rank (measured 0.6)


@pytest.mark.parametrize("mode", ["expert", "rank", "node"])
def test_float8_dispatch_sends_the_wire_row_and_combines_in_the_compute_dtype(routing, mode):
    """float8.dispatch in every mode: each dispatched row is posted as its float8 bytes and scales
    (parallel/float8_dispatch.py), the same rows as in bf16; the combine sends bf16 rows back."""
    from trillion.parallel.ep_routing import Payload
    from trillion.parallel.float8_dispatch import Float8Wire, wire_bytes_per_row

    plain = simulate(routing, MOE, EP, PER_NODE, DIM, mode)
    wired = simulate(routing, MOE, EP, PER_NODE, DIM, mode, Payload(wire=Float8Wire("blockwise", emulate=True)))
    for stage in STAGES:
        rows = wired.sent_rows.get(("dispatch", stage), 0)
        assert rows == plain.sent_rows.get(("dispatch", stage), 0)
        assert wired.sent_bytes.get(("dispatch", stage), 0) == rows * wire_bytes_per_row(DIM, "blockwise")
        assert wired.sent_bytes.get(("combine", stage), 0) == plain.sent_bytes.get(("combine", stage), 0)
    assert plain.sent_bytes["dispatch", STAGES[0]] == plain.sent_rows["dispatch", STAGES[0]] * DIM * 2  # bf16


@pytest.mark.parametrize("mode", ["rank", "node"])
def test_the_experts_get_their_rows_per_source_rank(routing, mode, monkeypatch):
    """What run_experts is told of the rows' sources (the float8 weight gradient's tiles restart there): split at those
    sizes, each segment holds exactly one source rank's slots of this rank's experts. Per rank the sources are the ep
    ranks in order; per node the rows come through each member of the node from each node, so segment (member m,
    node n) is rank n x PER_NODE + m's."""
    import threading

    import trillion.parallel.ep_chunks as ep_chunks

    seen, lock, real = [], threading.Lock(), ep_chunks.run_experts

    def recording(experts, x, ids, weights, held=None, slots=None, sources=None):
        with lock:
            seen.append((held, ids.clone(), sources))
        return real(experts, x, ids, weights, held, slots, sources)

    monkeypatch.setattr(ep_chunks, "run_experts", recording)
    simulate(routing, MOE, EP, PER_NODE, DIM, mode)
    assert len(seen) == EP
    nodes = EP // PER_NODE
    for held, ids, sources in seen:
        assert sum(sources) == ids.shape[0] and len(sources) == EP
        for index, segment in enumerate(ids.split(sources)):
            source = index if mode == "rank" else (index % nodes) * PER_NODE + index // nodes
            chosen = routing[source][0]
            for expert in held:
                assert (segment == expert).sum() == (chosen == expert).sum(), (held, index, expert)


def test_a_wrong_route_is_caught(routing, monkeypatch):
    """The simulation checks the rows that come back: a dispatch that loses a token's slot fails it."""
    import trillion.parallel.ep_routing as ep_routing

    def losing_a_slot(hop, send, capacity=0):
        placement = ep_routing.place(hop, send, capacity)
        placement.combine_index = placement.combine_index.clone()
        placement.combine_index[0, 0] = placement.total  # token 0's first slot comes back as zeros
        return placement

    monkeypatch.setattr("trillion.parallel.ep_chunks.place", losing_a_slot)
    with pytest.raises(AssertionError):
        simulate(routing, MOE, EP, PER_NODE, DIM, "rank")


def test_a_rank_that_receives_no_rows_runs_no_expert():
    """An ep rank to which no token goes this micro-batch (seen with one sequence a micro-batch at ep 4) gets no rows
    and no filled slots: its experts run on nothing, and its combine sends nothing back."""
    import dataclasses

    import torch

    from trillion.models.expert_rows import run_experts
    from trillion.models.moe import RoutedExperts

    experts = RoutedExperts(8, dataclasses.replace(MOE, n_experts=2))  # this rank's 2 of the 16: experts 2 and 3
    for weight in experts.parameters():
        torch.nn.init.normal_(weight)
    none = torch.zeros(0, 4, dtype=torch.long)
    assert run_experts(experts, torch.zeros(0, 8), none, torch.zeros(0, 4), range(2, 4), slots=0).shape == (0, 8)
    elsewhere = torch.full((3, 4), -1)  # rows whose slots are all another rank's
    rows = run_experts(experts, torch.ones(3, 8), elsewhere, torch.ones(3, 4), range(2, 4), slots=0)
    assert torch.equal(rows, torch.zeros(3, 8))
