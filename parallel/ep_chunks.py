"""A MoE layer's tokens on their way through expert parallelism's all-to-alls (parallel/expert_parallel.py), a chunk
of them at a time: with parallel.ep_overlap a layer's tokens go in two chunks where no other micro-batch is paired
with it, so each chunk's all-to-alls travel beside the other's compute. Each step posts and so hands a paired side
its turn (parallel/ep_exchange.py); the dispatch runs the steps of all its chunks in order, one step at a time."""

import torch

from trillion.models.expert_rows import run_experts
from trillion.parallel.ep_exchange import Exchange
from trillion.parallel.ep_routing import Hop, Payload, combine, pack_routing, place, unpack_routing


class Chunk:
    """Some of a layer's tokens on their way through one hop (expert_parallel.py ExpertDispatch._one_hop)."""

    def __init__(self, x, ids, weights, dispatch):
        self.x, self.ids, self.weights = x, ids, weights
        self.hop = Hop.plan(ids, lambda e: e // dispatch.per_rank, dispatch.ep)

    def placed(self, send: list[int], slots: int, recv: list[int] | None = None, capacity: int = 0) -> None:
        """Sizes known: rows to and from each member, the filled slots arriving in all (at most, with a capacity)."""
        self.send, self.recv, self.slots = send, send if recv is None else recv, slots
        self.placement = place(self.hop, send, capacity)

    def post(self, exchange: Exchange, payload: Payload) -> None:
        """The rows and their routing posted to the members owning their experts."""
        self.payload, self.routing = post_rows(exchange, payload, self.x, self.ids, self.weights, self.hop, self)

    def run_experts(self, experts, held: range, exchange: Exchange, gradient_wire=None) -> None:
        """The rows that arrived through this rank's experts, their weighted sums posted back (their gradient to
        return in `gradient_wire`'s form, float8.combine_gradient)."""
        received = self.payload.wait()
        expert_ids, expert_weights = unpack_routing(self.routing.wait())
        out = run_experts(experts, received, expert_ids, expert_weights, held, self.slots, self.recv)
        self.returning = exchange.rows(out, self.recv, self.send, "combine", back_wire=gradient_wire)
        self.impl = experts.permute_impl

    def combined(self, choices: int) -> torch.Tensor:
        """Each token's sum of what came back (per-expert rows summed over the token's `choices`, if any)."""
        out = combine(self.returning.wait(), self.placement, self.impl)
        return out.view(-1, choices, out.shape[-1]).sum(dim=1) if choices else out


class NodeChunk:
    """Some of a layer's tokens on their way to their nodes, to their ranks there and back (the per-node mode:
    expert_parallel.py ExpertDispatch._by_node)."""

    def __init__(self, x, ids, weights, dispatch):
        self.x, self.ids, self.weights, self.dispatch = x, ids, weights, dispatch
        per_node = dispatch.per_rank * dispatch.members
        self.hop = Hop.plan(ids, lambda e: e // per_node, dispatch.nodes)
        self.by_rank = Hop.plan(ids, lambda e: e // dispatch.per_rank, dispatch.ep)

    def placed(self, sizes: list[int]) -> None:
        """This chunk's split sizes (expert_parallel.py ExpertDispatch._exchange_node_counts's order)."""
        n, m = self.dispatch.nodes, self.dispatch.members
        self.send, self.recv, onward = sizes[:n], sizes[n : 2 * n], sizes[2 * n : 2 * n + m]
        second_in = [sizes[2 * n + m + j * (n + 1) :][: n + 1] for j in range(m)]  # from each member
        self.sources = [rows for member in second_in for rows in member[:n]]  # in (member, source node) order
        self.slots = sum(member[n] for member in second_in)
        self.in_node = InNode(onward, [sum(member[:n]) for member in second_in])
        self.placement = place(self.hop, self.send)

    def post_to_nodes(self) -> None:
        d = self.dispatch
        self.to_node = post_rows(d.inter, d.payload, self.x, self.ids, self.weights, self.hop, self)

    def post_in_node(self) -> None:
        """The rows that reached this rank forwarded to the ranks of its node holding their experts."""
        d, hop = self.dispatch, self.in_node
        received = self.to_node[0].wait()
        ids, weights = unpack_routing(self.to_node[1].wait())
        plan = Hop.plan(ids, lambda e: (e // d.per_rank) % d.members, d.members)
        hop.placement = place(plan, hop.send)
        self.to_rank = post_rows(d.intra, d.payload, received, ids, weights, plan, hop)

    def run_experts(self) -> None:
        d, hop = self.dispatch, self.in_node
        rows = self.to_rank[0].wait()
        expert_ids, expert_weights = unpack_routing(self.to_rank[1].wait())
        out = run_experts(d.experts, rows, expert_ids, expert_weights, d.held, self.slots, self.sources)
        self.from_rank = d.intra.rows(out, hop.recv, hop.send, "combine", back_wire=d.payload.gradient_wire)

    def return_to_node(self) -> None:
        d = self.dispatch
        sums = combine(self.from_rank.wait(), self.in_node.placement, d.experts.permute_impl)
        self.from_node = d.inter.rows(sums, self.recv, self.send, "combine", back_wire=d.payload.gradient_wire)

    def combined(self) -> torch.Tensor:
        return combine(self.from_node.wait(), self.placement, self.dispatch.experts.permute_impl)


class InNode:
    """The second hop's rows to (`send`) and from (`recv`) each member of the node, and where they go (`placement`,
    once the routing of the rows it forwards is there)."""

    def __init__(self, send: list[int], recv: list[int]):
        self.send, self.recv, self.placement = send, recv, None


def post_rows(exchange: Exchange, payload: Payload, x, ids, weights, hop, sizes):
    """(the rows, their routing) posted to each member as `sizes` (its send, recv and placement) says, in one turn."""
    packed = exchange.rows(payload.pack(x, sizes.placement.rows), sizes.send, sizes.recv, "dispatch", payload.wire)
    routing = pack_routing(hop, sizes.placement, ids, weights)
    return packed, exchange.rows(routing, sizes.send, sizes.recv, "routing", beside=packed)


class Beside:
    """Work on the layer's rows beside the dispatch (the shared experts: rows -> rows), run piece by piece in row
    order where the dispatch has time (`upto`), its pieces joined (`result`; None without work)."""

    def __init__(self, work, x: torch.Tensor):
        self.work, self.x, self.done, self.pieces = work, x, 0, []

    def upto(self, end: int) -> None:
        if self.work is not None and end > self.done:
            self.pieces.append(self.work(self.x[self.done : end]))
            self.done = end

    def result(self) -> torch.Tensor | None:
        self.upto(self.x.shape[0])
        return (self.pieces[0] if len(self.pieces) == 1 else torch.cat(self.pieces)) if self.pieces else None
