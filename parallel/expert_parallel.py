"""Expert parallelism: each MoE layer's routed experts split over the ep ranks (ParallelDims.ep_mesh),
the tokens carried to them and back by all-to-alls.

`apply_expert_parallel` makes w1, w2, w3 of every RoutedExperts a DTensor sharded on the expert
dimension (Shard(0): rank r of ep holds experts r*E/ep .. (r+1)*E/ep - 1; init_weights draws the full
tensor and keeps this shard, so the values do not depend on the layout) and replaces each MoE's
`dispatch` (models/moe.py: tokens, their chosen experts and weights in, each token's weighted sum of its
experts' outputs out) by an ExpertDispatch in one of three modes (parallel.ep_dispatch):

- expert: a token travels once per chosen expert (top_k rows), as torchtitan's standard dispatcher;
- rank: once per ep rank holding any of its experts, with its weights and expert ids (ep_routing.py); that
  rank runs them and sums their weighted outputs, so the combine also returns one row per (token, rank);
- node: the ep group spans nodes (ParallelDims.ep_nodes): once per node over the network, to the rank of that
  node with this rank's place in its node, which forwards it once to each rank of its node holding some of
  the token's experts (two hops on the (ep_node, ep_local) sub-meshes); with group-limited routing lined up
  with the nodes (each group one node's experts) a token crosses the network at most topk_groups times.

Split sizes. Dropless (the default): the rows to each member are counted on the device and exchanged
(per node: the node counts with the per-rank counts inside them, then the second hop's among the node's
ranks), then read on the host once per layer and forward: the copy to the host is issued as soon as the
counts are there, and the shared experts run before it is waited on. With moe.rank_capacity_factor each rank
sends each member a fixed C rows (the capacity models/moe.py's rank_capacity_mask applied: the same tokens
dropped as in one process): no host read at all.

Activation checkpointing: in a recomputed block the routing is the first forward's (the same input
and weights choose the same experts), so the split sizes are kept from the first forward of a
checkpointed block (`recompute_from_cache`), keyed by the block's input, and replayed by its recompute with the
number of chunks its tokens went in (which can differ from the recompute's moment: a forward alone, its backward
paired), with no second exchange of counts and no host read (in any order of recomputes: micro-batches paired
by the overlap recompute the other's blocks first); the token all-to-alls and the experts run again. Under
selective:op the dispatch stays outside the op-level policy (as under full AC): torch 2.13's
selective checkpointing requires the recompute to issue exactly the first forward's ops, and the
cached route and the experts' own FSDP group (all-gathers inside the checkpointed block) do not;
the routed experts' grouped matmuls are recomputed either way. The dispatch runs eager under
torch.compile: the rest of the block is compiled.

Placement in parallelize: after tensor parallelism (attention and shared experts tensor-parallel; the MoE layer
folded over the tp ranks, each routing its own tokens to whole experts, or with each expert split over tp on the
(ep, etp) mesh: expert_tensor_parallel.py), before activation checkpointing and compile; FSDP then shards the
experts over the data-parallel ranks ep leaves (fsdp.py, ParallelDims.expert_fsdp_mesh) and everything else as
without ep.
"""

import contextlib
import math
from collections import deque

import torch
from torch import nn
from torch.distributed.tensor import distribute_tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from trillion.models import parts
from trillion.models.moe import MoE, moe_layers, rank_capacity
from trillion.models.parts.moe import reach_share
from trillion.parallel.activation_checkpoint import recompute_key
from trillion.parallel.ep_chunks import Beside, Chunk, NodeChunk
from trillion.parallel.ep_exchange import Exchange
from trillion.parallel.ep_routing import Payload
from trillion.parallel.expert_overlap import paired, turn_in_backward
from trillion.parallel.expert_tensor_parallel import expert_placements


class _HostCopy:
    """Split sizes copied to the host as soon as they exist, waited on only when `read` (the one host read)."""

    def __init__(self, sizes: torch.Tensor):
        if sizes.device.type == "cuda":
            self.host = torch.empty(sizes.shape, dtype=sizes.dtype, pin_memory=True)
            self.host.copy_(sizes, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host, self.ready = sizes, None

    def read(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


class ExpertDispatch:
    """An MoE layer's `dispatch` under expert parallelism (a plain callable, not a module: no new names)."""

    def __init__(self, layer: MoE, mode: str, exchange: Exchange, inter=None, intra=None, payload=Payload()):
        """`exchange`: the ep group's; `inter`, `intra` (the node mode's): the ranks with this rank's place in their
        node, one a node, and this rank's node; `payload`: how the rows travel (float8 dispatch's wire)."""
        moe = layer.moe
        self.experts, self.mode, self.top_k = layer.experts, mode, moe.top_k
        self.ep = exchange.size
        self.per_rank = moe.n_experts // self.ep
        self.held = range(exchange.me * self.per_rank, (exchange.me + 1) * self.per_rank)
        self.capacity_factor = moe.rank_capacity_factor  # 0: dropless
        self.exchange, self.inter, self.intra, self.payload = exchange, inter, intra, payload
        self.overlap = False  # parallel.ep_overlap: the module docstring's overlap
        self.pairs = False  # the layout pairs micro-batches (expert_overlap.py): a backward mirrors the counts' turn
        if mode == "node":
            self.nodes, self.members = inter.size, intra.size
        self.recompute_from_cache = False  # set for checkpointed blocks (parallelize.py)
        # each checkpointed forward's split sizes by its block's input, for its recompute (whichever comes first)
        self.routes = WeakTensorKeyDictionary()
        self.host_reads = 0  # split-size reads on the host (tests count them)

    def capacity(self, tokens: int) -> int:
        """Rows to each ep rank with a per-rank capacity (0: dropless)."""
        if not self.capacity_factor:
            return 0
        return rank_capacity(tokens, self.top_k, self.per_rank * self.ep, self.ep, self.capacity_factor)

    def exchanges(self) -> list[Exchange]:
        return [self.inter, self.intra] if self.mode == "node" else [self.exchange]

    def even_sizes(self, tokens: int, parts: int = 1) -> list[int]:
        """The split sizes `_sizes` reads for `tokens` in `parts` chunks, as even routing would make them (the dry
        run's, on meta tensors): a member gets top_k / ep of every source's slots."""
        experts, tokens = self.per_rank * self.ep, tokens // parts
        slots = math.ceil(tokens * self.top_k / self.ep)
        if self.mode == "expert":
            return [slots, slots] * 2 * self.ep * parts
        rank = math.ceil(tokens * reach_share(experts, self.top_k, self.per_rank))
        if self.mode == "rank":
            return [rank, slots] * 2 * self.ep * parts
        node = math.ceil(tokens * reach_share(experts, self.top_k, self.per_rank * self.members))
        return (
            [node] * 2 * self.nodes
            + [rank * self.nodes] * self.members
            + ([rank] * self.nodes + [slots * self.nodes]) * self.members
        ) * parts

    def exchanges_counts(self, tokens: int) -> bool:
        """Whether the forward exchanges split sizes (dropless), handing the paired side its turn after them. The
        node mode's second exchange (among the node's ranks, Exchange.counts) is waited for at once and hands
        nothing over: a forward hands over once for its counts, as its paired backward does (turn_in_backward)."""
        return self.mode == "node" or not self.capacity(tokens)

    @torch._disable_dynamo  # torch.compiler.disable's, imported on the first call (models/moe.py says why)
    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, beside=None):
        if self.pairs and self.exchanges_counts(x.shape[0]):
            with _outside_selective_checkpoint():
                x = turn_in_backward(x)  # the counts' turn, mirrored in a paired backward
        beside = Beside(beside, x)  # the shared experts, a function of rows
        if not self.overlap:
            beside.upto(x.shape[0])  # all of them first: nothing runs beside the all-to-alls
        with _outside_selective_checkpoint():
            if self.exchange.traffic is not None and torch._C._current_graph_task_id() == -1:
                self.exchange.traffic.tokens += x.shape[0]
            out = (
                self._by_node(x, ids, weights, beside)
                if self.mode == "node"
                else self._one_hop(x, ids, weights, beside)
            )
        return out, beside.result()

    def _one_hop(self, x, ids, weights, beside):
        """Rows to the ranks owning their experts and back (the expert and rank modes); with overlap in two chunks
        of the tokens (`_parts`), the second's all-to-alls beside the first's experts and the first's beside the
        second's."""
        tokens, replayed = x.shape[0], self._replayed_route()
        parts = replayed[0] if replayed else self._parts(tokens)
        bounds = [(tokens * c // parts, tokens * (c + 1) // parts) for c in range(parts)]
        chunks = [Chunk(*self._rows(x[a:b], ids[a:b], weights[a:b]), self) for a, b in bounds]
        capacity = self.capacity(tokens)
        if capacity:  # each chunk's rows to a member are at most the whole layer's (models/moe.py dropped the rest)
            if replayed is None:
                self._remember(parts, None)
            for chunk in chunks:
                size = min(capacity, chunk.x.shape[0])
                chunk.placed(
                    [size] * self.ep, capacity=size, slots=size * self.ep * min(chunk.ids.shape[1], self.per_rank)
                )
        else:
            sizes = self._sizes(lambda: self._exchange_counts(chunks), beside, bounds[0][1], x, parts, replayed)
            half = len(sizes) // 2  # sent, then received: each member's (rows, slots) of chunk 0, chunk 1, ...
            for c, chunk in enumerate(chunks):
                rows, received = sizes[2 * c : half : 2 * parts], sizes[half + 2 * c :: 2 * parts]
                chunk.placed(rows, recv=received, slots=sum(sizes[half + 2 * c + 1 :: 2 * parts]))
        for chunk in chunks:
            chunk.post(self.exchange, self.payload)
        beside.upto(bounds[0][1])  # the first chunk's shared experts while the dispatch travels
        for chunk in chunks:
            chunk.run_experts(self.experts, self.held, self.exchange, self.payload.gradient_wire)
        beside.upto(tokens)  # the rest beside the last chunk's combine
        return torch.cat([chunk.combined(self.top_k if self.mode == "expert" else 0) for chunk in chunks])

    def _rows(self, x, ids, weights):
        """(rows, their expert ids, weights): the tokens, or under the per-expert mode each (token, choice)."""
        if self.mode == "expert":
            return x.repeat_interleave(self.top_k, 0), ids.reshape(-1, 1), weights.reshape(-1, 1)
        return x, ids, weights

    def _exchange_counts(self, chunks):
        """Posts the chunks' counts to every member; returns what gives (sent, received) counts once they arrive."""
        counts = torch.stack([chunk.hop.counts() for chunk in chunks], dim=1).flatten()  # (member, chunk, 2)
        even = [2 * len(chunks)] * self.ep
        arriving, work = self.exchange.post(counts, even, even, "counts")

        def arrived():
            work.wait()
            return torch.cat([counts, arriving])

        return arrived

    def _by_node(self, x, ids, weights, beside):
        """Once to each node over the network, then once to each rank of the node (the module docstring); with
        overlap in two chunks of the tokens (`_parts`), each chunk's hop beside the other's, its experts beside the
        other's hops in the node."""
        tokens, replayed = x.shape[0], self._replayed_route()
        parts = replayed[0] if replayed else self._parts(tokens)
        bounds = [(tokens * c // parts, tokens * (c + 1) // parts) for c in range(parts)]
        chunks = [NodeChunk(x[a:b], ids[a:b], weights[a:b], self) for a, b in bounds]
        sizes = self._sizes(lambda: self._exchange_node_counts(chunks), beside, bounds[0][1], x, parts, replayed)
        block = len(sizes) // parts
        for c, chunk in enumerate(chunks):
            chunk.placed(sizes[c * block : (c + 1) * block])
        for step in (NodeChunk.post_to_nodes, NodeChunk.post_in_node, NodeChunk.run_experts, NodeChunk.return_to_node):
            for chunk in chunks:
                step(chunk)
        beside.upto(tokens)  # the rest beside the last chunk's way back
        return torch.cat([chunk.combined() for chunk in chunks])

    def _exchange_node_counts(self, chunks):
        """Posts each chunk's rows to each node with its ranks' (rows, slots) inside them; returns what gives each
        chunk's split sizes of both hops once they arrive (the second hop's exchanged among the node's ranks): its
        rows to and from each node, to each member, then from each member by source node with the member's slots."""
        n, m, parts = self.nodes, self.members, len(chunks)
        tables = []
        for chunk in chunks:
            node_counts, inner = chunk.hop.counts()[:, 0], chunk.by_rank.counts().view(n, m, 2)
            tables.append(torch.cat([node_counts.unsqueeze(1), inner[..., 0], inner[..., 1]], dim=1))  # (node, 1 + 2m)
        table = torch.stack(tables, dim=1)  # (node, chunk, 1 + 2m): each node's share contiguous
        width = [parts * (1 + 2 * m)] * n
        arriving, work = self.inter.post(table.flatten(), width, width)

        def arrived():
            work.wait()
            came = arriving.view(n, parts, 1 + 2 * m)
            rows_from = came[:, :, 1 : 1 + m]  # (source node, chunk, member): the rows this rank forwards
            # to each member: each chunk's rows from each source node (its experts' tiles restart there), its slots
            slots = came[:, :, 1 + m :].sum(dim=0).t().unsqueeze(2)  # (member, chunk, 1)
            onward = torch.cat([rows_from.permute(2, 1, 0), slots], dim=2)  # (member, chunk, n + 1)
            second_in = self.intra.counts(onward.flatten()).view(m, parts, n + 1)
            return torch.cat(
                [
                    torch.cat([table[:, c, 0], came[:, c, 0], rows_from[:, c].sum(dim=0), second_in[:, c].flatten()])
                    for c in range(parts)
                ]
            )

        return arrived

    def _parts(self, tokens: int) -> int:
        """The chunks a forward splits its tokens into: two with overlap where no other micro-batch is paired with
        it now (expert_overlap.paired: a pairing layout's unpaired actions, DualPipeV's ends, chunk too), else one,
        the partner's compute beside the all-to-alls instead. Every rank of an ep group runs the same actions, so
        they agree; a recompute replays its first forward's count (`_replayed_route`)."""
        return 2 if self.overlap and not paired() and tokens > 1 else 1

    def _replayed_route(self) -> tuple | None:
        """The (chunks, split sizes) a checkpointed block's first forward kept for its recompute, which must issue
        the same ops, taken once the recompute reaches the layer (None elsewhere, or where none was kept)."""
        key = recompute_key()
        if torch._C._current_graph_task_id() != -1 and key is not None and self.routes.get(key):
            return self.routes[key].popleft()
        return None

    def _remember(self, parts: int, sizes: list[int] | None) -> None:
        """The route of a checkpointed block's first forward, for its recompute (`_replayed_route`)."""
        key = recompute_key()
        first_forward = torch._C._current_graph_task_id() == -1 and torch.is_grad_enabled()
        if self.recompute_from_cache and first_forward and key is not None:
            self.routes.setdefault(key, deque()).append((parts, sizes))

    def _sizes(self, start, beside, beside_rows: int, x: torch.Tensor, parts: int, replayed) -> list[int]:
        """The split sizes on the host, read once: `start()` posts the counts and returns what gives them on the
        device once they arrive; the shared experts of the first `beside_rows` rows run meanwhile (on a GPU after the
        copy to the host is issued, the device keeping the order). A checkpointed block's recompute replays the
        first forward's sizes (`replayed`). (`x`, in `parts` chunks: the rows routed; the dry run's meta tensors hold
        no counts: even_sizes.)"""
        if replayed is not None:
            beside.upto(beside_rows)  # where the first forward ran it: the recompute saves tensors in the same order
            return replayed[1]
        arrived = start()
        if x.device.type == "cuda":
            copy = _HostCopy(arrived())
            beside.upto(beside_rows)
        else:  # the host itself waits for a CPU collective: the shared experts first
            beside.upto(beside_rows)
            copy = _HostCopy(arrived())
        sizes = copy.read()
        self.host_reads += 1
        self._remember(parts, sizes)
        return sizes


@contextlib.contextmanager
def _outside_selective_checkpoint():
    """The ops inside run as if no op-level checkpoint policy were active (they are recomputed)."""
    mode = _get_current_dispatch_mode()
    if isinstance(mode, (_CachingTorchDispatchMode, _CachedTorchDispatchMode)):
        with _pop_mode_temporarily():
            yield
    else:
        yield


def apply_expert_parallel(
    model: nn.Module,
    ep_mesh,
    mode: str = "rank",
    ranks_per_node: int = 1,
    node_mesh=None,
    payload=Payload(),
    expert_tp_mesh=None,
):
    """Shard every MoE layer's routed experts over the 1-D `ep_mesh` and route its tokens by all-to-all (`mode`
    the module docstring's; `node_mesh` the (ep_node, ep_local) view of ep_mesh for the per-node mode; `payload` how
    the rows travel: float8 dispatch gives its wire, parallel/float8_dispatch.py). `expert_tp_mesh`: with
    parallel.etp = tp, the (ep, etp) mesh each expert is also split over as declared (expert_tensor_parallel.py)."""
    stacks = parts.block(model.args, True).experts
    for layer in moe_layers(model).values():
        experts = layer.experts
        if layer.moe.n_experts % ep_mesh.size():
            raise AssertionError("dims.check_layout checks that ep divides the experts")
        for stack in stacks:
            name = stack.name.rsplit(".", 1)[1]
            param = getattr(experts, name)
            placements = expert_placements(stack, expert_tp_mesh is not None)
            mesh = ep_mesh if expert_tp_mesh is None else expert_tp_mesh
            sharded = distribute_tensor(param.data, mesh, placements, src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        exchanges = [Exchange(ep_mesh, ranks_per_node)]
        if mode == "node":
            exchanges += [Exchange(node_mesh[name], ranks_per_node) for name in ("ep_node", "ep_local")]
        layer.dispatch = ExpertDispatch(layer, mode, *exchanges, payload=payload)


def expert_dispatches(module: nn.Module) -> list[ExpertDispatch]:
    """The ExpertDispatch of every MoE layer `module` holds under expert parallelism (inside a wrapper that sums the
    gradients over tp: expert_tensor_parallel.py)."""
    found = (getattr(m.dispatch, "inner", m.dispatch) for m in module.modules() if isinstance(m, MoE))
    return [dispatch for dispatch in found if isinstance(dispatch, ExpertDispatch)]


def cache_routes_for_recompute(block: nn.Module) -> None:
    """A checkpointed block: its recompute replays the first forward's routes (no second exchange)."""
    for dispatch in expert_dispatches(block):
        dispatch.recompute_from_cache = True


def forget_routes(module: nn.Module) -> None:
    """Drop the routes cached for recomputes that will not come (pipeline metadata inference)."""
    for dispatch in expert_dispatches(module):
        dispatch.routes.clear()


def expert_parallel_modules(block: nn.Module) -> list[nn.Module]:
    """The RoutedExperts of `block` whose weights live on the ep mesh (FSDP shards them apart)."""
    return [dispatch.experts for dispatch in expert_dispatches(block)]
