"""The mixture-of-experts block as the planner sees it (models/moe.py; expert parallelism as torchtitan
lays it out, `parallel.ep`): what an MoE layer adds to a block whose MLP is only its shared experts.

Per MoE layer and micro-batch, on one rank whose tp group holds `tokens` (= micro-batch x seq / cp; the
MoE input is all-gathered over tp and every tp rank routes and runs the same tokens: the router and the routed
experts stay whole, replicated over tp, parallel/tensor_parallel.py; the shared experts are TP-split):
  router     one GEMM tokens x dim x E (replicated over tp), forward, input and weight gradient.
  experts    E / ep local experts, each three GEMMs at its own shape: rows x dim x f (w1, w3) and
             rows x f x dim (w2), rows = tokens x top_k x ep / E x imbalance (f the expert width, not split
             over tp), one grouped-GEMM launch per projection; the same again for each gradient.
  imbalance  `moe_load_imbalance` (Layout): the busiest rank's routed tokens over the mean. It applies with
             ep > 1, where the all-to-alls make every rank wait for the busiest one; with ep 1 a rank runs
             every expert on all its tokens (tokens x top_k rows in all, whatever the balance), so there it
             is 1. MOE_LOAD_IMBALANCE is its default (see its note).
  all-to-all per MoE layer forward: the dispatch (an all-to-all of the per-expert counts, latency only,
             then the tokens with uneven splits) and the combine; backward the two again (their gradients).
             Each moves tokens x top_k x dim x bytes x imbalance per rank, (ep - 1) / ep of it to peers
             (timing.all_to_all_time): on the node's link for the ep ranks in the node (the ep group sits
             just outside tp: ep x tp consecutive GPUs), on the network for the rest. On the compute
             stream, never overlapped (the dispatch needs the counts before it can size its buffers).
  element-wise  per token of the tp group: the permutation into expert order and back (x[order], the
             inverse gather) 2 x 2 k h, the weighting by the scores 2 k h, their sum k h + h, SwiGLU on the
             expert hidden 5 k f, the router's softmax and top-k 3 E (read scores, write them, read
             for top-k), its loss-free bias 2 E (the add: read, write) and DeepSeek-V3's group-limited choice
             3 E (the per-group top-2 reads the scores, the mask of the other groups reads and writes them:
             Router.forward); the same under torch.compile (the data-dependent shapes break the graph).
Memory: expert parameters total / (ep x efsdp), efsdp = dp_shard x cp / ep, so a rank's states are
those of its E / ep experts sharded over efsdp (the states per rank do not depend on ep; FSDP's gathered
copies, its buffers and its traffic do: one layer's E / ep experts, all-gathered over the efsdp ranks).
Activations of an MoE layer (not checkpointed): the router's fp32 scores tokens x E x 4 bytes, the
permuted tokens k h, the experts' w1 and w3 outputs, silu and product 4 k f, their outputs k h, all
times imbalance where it applies, bf16.
"""

import math

from trillion.models import parts
from trillion.models.args import ModelArgs
from trillion.models.parts import Block
from trillion.models.parts.moe import member_reach
from trillion.parallel.planner.hardware import HardwareProfile
from trillion.parallel.planner.timing import Passes, _gemm, _memory_bound, all_to_all_time
from trillion.parallel.planner.work import BACKWARD_ELEMENTWISE

# The busiest rank's routed tokens over the mean, by default. MEASURED on debug-moe (sigmoid scores, loss-free
# bias 1e-2; `trillion train --model.name=debug-moe --training.steps=100 --metrics.log_freq=10`, default corpus):
# its `moe/layer*/tokens_per_expert` over steps 50-100, layers 1-3, through rank_load_imbalance with 2 experts
# per rank (ep 4 of 8): mean 1.16, max 1.26 (4 experts per rank: 1.06; 1 per rank: 1.37). Two experts per rank
# is the conservative end: a rank of a real model holds more (qwen3-235b-a22b at ep 8: 16), which averages out.
# Give another figure with `trillion plan --moe-load-imbalance X`. It is a rank's figure: rank_load_imbalance
# turns per-expert loads into it for an ep (an expert's max/mean overstates it when a rank holds several).
MOE_LOAD_IMBALANCE = 1.16
# Rows of dim one routed (token, expert) pair's routing reads and writes in a forward (the module docstring's
# element-wise line: the permutation and its inverse 4, the weighting 2, the sum 1)
ROUTING_ROWS_PER_CHOICE = 7
# Kernels the dropless dispatch launches between reading its split sizes on the host and posting its all-to-all:
# counted by tests/planner/test_dispatch_plan.py, which runs that stretch under a dispatch mode
HOST_READ_LAUNCHES = 39


def routed_block(args: ModelArgs) -> Block:
    """An MoE block's declaration (models/parts/moe.py): its routing and expert stacks."""
    return parts.block(args, True)


def expert_width(block: Block) -> int:
    """A routed expert's hidden width: its up projections' out features (w1, w3; models/parts/moe.py)."""
    return block.experts[0].out_features


def rank_load_imbalance(loads: list[float], ep: int) -> float:
    """Max over mean of the tokens each of `ep` ranks receives, from per-expert loads: rank r holds experts
    r x E / ep to (r + 1) x E / ep - 1 (the experts' dim 0 sharded over ep)."""
    per_rank = len(loads) // ep
    totals = [sum(loads[r * per_rank : (r + 1) * per_rank]) for r in range(ep)]
    return max(totals) / (sum(totals) / ep)


def effective_imbalance(ep: int, imbalance: float) -> float:
    return imbalance if ep > 1 else 1.0


def expert_rows(args: ModelArgs, tokens: int, ep: int, imbalance: float) -> int:
    """Rows of each local expert's GEMMs on the busiest rank."""
    routing = routed_block(args).routing
    return math.ceil(tokens * routing.top_k * ep / routing.n_experts * effective_imbalance(ep, imbalance))


def members_per_node(layout) -> int:
    """The ep group's ranks on one node of layout.ranks_per_node (the planner's: its hardware's GPUs per node; the group
    sits just outside tp: ep x tp consecutive GPUs)."""
    return max(1, min(layout.ep, layout.ranks_per_node // layout.tp))


def dispatch_mode(layout) -> str:
    """The layout's dispatch mode as it runs: the per-node one only where the ep group spans nodes."""
    if layout.ep_dispatch == "node" and layout.ep <= members_per_node(layout):
        return "rank"
    return layout.ep_dispatch


def dispatch_rows(args: ModelArgs, mode: str, ep: int, members: int) -> tuple[tuple[float, float], ...]:
    """Per hop, the rows one rank sends per token of its MoE input in one direction (the combine sends as many back),
    (over the network, over the node's link), as parallel/expert_parallel.py sends them: per expert one a choice on
    another rank; per rank one a reached rank; per node one a reached node over the network, then one a reached rank
    of that node besides the one it arrived at (models/parts/moe.py member_reach). Tested against the rows the
    dispatch's own all-to-alls count (tests/planner/test_dispatch_plan.py)."""
    routing = routed_block(args).routing
    per_rank, nodes = routing.n_experts // ep, max(1, ep // members)
    if mode == "expert":
        return ((routing.top_k * (ep - members) / ep, routing.top_k * (members - 1) / ep),)
    rank = member_reach(routing, per_rank)
    if mode == "rank" or nodes == 1:
        return (((ep - members) * rank, (members - 1) * rank),)
    node = member_reach(routing, per_rank * members)
    return (((nodes - 1) * node, 0.0), (0.0, ep * rank * (members - 1) / members))


def row_bytes(args: ModelArgs, mode: str, element_bytes: int) -> int:
    """A dispatched row: the token in the compute dtype, and its weights and expert ids in float32 (ep_routing.py)."""
    slots = 1 if mode == "expert" else routed_block(args).routing.top_k
    return args.dim * element_bytes + 2 * slots * 4


def dispatch_seconds(args: ModelArgs, hw: HardwareProfile, tokens: int, layout) -> float:
    """One direction's all-to-alls (the dispatch; the combine takes as long) on the busiest rank: each hop's network
    and node-link shares at once, the hops one after the other, a latency each."""
    ep, tp = layout.ep, layout.tp
    if ep <= 1:
        return 0.0
    members, mode = members_per_node(layout), dispatch_mode(layout)
    size = tokens * row_bytes(args, mode, hw.element_bytes) * effective_imbalance(ep, layout.moe_load_imbalance)
    seconds = 0.0
    for network, link in dispatch_rows(args, mode, ep, members):
        hop, latency = 0.0, 0.0
        if link:
            bandwidth, latency = hw.collective_link(members * tp, False, "all_to_all")
            hop = size * link / bandwidth
        if network:
            bandwidth, latency = hw.collective_link(ep * tp, True, "all_to_all")
            hop = max(hop, size * network / bandwidth)
        seconds += hop + latency
    return seconds


def exposed_all_to_alls(layout, hw, one_way: float, counts: float, shared: float, experts: float) -> float:
    """Seconds of one pass's all-to-alls left exposed: the dispatch and the combine (`one_way` each) and `counts` (the
    split sizes' exchange and read; 0 where none: a capacity, a recompute, the backward), beside the pass's `shared`
    experts and routed `experts`. Without overlap all of it. With it (parallel/expert_parallel.py) each all-to-all's
    wait sees the compute run since its post: the counts the first chunk's shared experts; of two chunks (the expert
    and rank modes) posted together, the first dispatch half the first shared experts with a capacity (dropless:
    nothing), the second the first chunk's experts, the first combine half the second chunk's experts, the last the
    second shared experts. The per-node mode runs in one chunk: only the counts hide, behind the shared experts."""
    if not layout.ep_overlap:
        return counts + 2 * one_way
    if dispatch_mode(layout) == "node":
        return max(0.0, counts - shared) + 2 * one_way
    half = one_way / 2
    first = max(0.0, half - (0.0 if counts else shared / 2))
    return max(0.0, counts - shared / 2) + first + 2 * max(0.0, half - experts / 2) + max(0.0, half - shared / 2)


def pairs(layout) -> bool:
    """parallel.ep_overlap pairs micro-batches here (parallel/expert_overlap.py pairs_micro_batches's rule)."""
    gathered = layout.dp_shard * layout.cp == 1 or layout.dp_shard_mode != "zero3"
    return layout.ep_overlap and layout.ep > 1 and layout.pp == 1 and layout.microbatches > 1 and gathered


def exposed_paired(one_way: float, counts: float, segment: float) -> float:
    """Seconds of one pass's all-to-alls left exposed with two micro-batches in flight: each waits beside one
    segment of the other's compute, its pass between two of its posts (`segment`)."""
    return sum(max(0.0, phase - segment) for phase in (counts, one_way, one_way) if phase)


def moe_passes(args: ModelArgs, hw: HardwareProfile, tokens: int, layout, around: Passes | None = None) -> Passes:
    """What one MoE layer adds to its block's attention and shared experts (`around`; the module docstring)."""
    block, h, launch = routed_block(args), args.dim, hw.device.kernel_overhead_us * 1e-6
    tp, ep, imbalance = layout.tp, layout.ep, layout.moe_load_imbalance
    routing, f = block.routing, expert_width(block)  # the routed experts are whole on every tp rank
    experts = expert_gemm_seconds(args, hw, tokens, tp, ep, imbalance)
    router = _gemm(hw, tokens, routing.gate.in_features, routing.gate.out_features)
    k, imb = routing.top_k, effective_imbalance(ep, imbalance)
    elements = tokens * ((ROUTING_ROWS_PER_CHOICE * k * h + 5 * k * f) * imb + h + routing.elements)
    elementwise = _memory_bound(hw, elements * hw.element_bytes) + routing.kernels * launch
    exposed = [0.0, 0.0, 0.0]  # forward, backward, recomputed forward
    if ep > 1:
        one_way, shared = dispatch_seconds(args, hw, tokens, layout), shared_expert_seconds(args, hw, tokens, tp)
        counts = 0.0 if layout.ep_capacity else all_to_all_time(hw, 0.0, ep, tp) + host_read_stall(hw)
        exposed = [
            exposed_all_to_alls(layout, hw, one_way, counts, shared, experts),
            exposed_all_to_alls(layout, hw, one_way, 0.0, 2 * shared, 2 * experts),
            exposed_all_to_alls(layout, hw, one_way, 0.0, shared, experts),
        ]
        if around is not None and pairs(layout):  # the other micro-batch's layer computes beside each all-to-all
            forward = around.forward - around.tp_forward - around.cp_forward + router + experts + elementwise
            backward = forward + around.input_grad + around.weight_grad - around.forward + experts + router
            turns = 3 if counts else 2  # a forward hands the turn over after the counts, the rows, the combine
            exposed = [
                exposed_paired(one_way, counts, forward / turns),
                exposed_paired(one_way, 0.0, backward / 2),
                exposed_paired(one_way, 0.0, forward / 2),
            ]
    return Passes(
        forward=router + experts + elementwise + exposed[0],
        input_grad=router + experts + BACKWARD_ELEMENTWISE * elementwise + exposed[1],
        weight_grad=router + experts,
        ep_forward=exposed[0],
        ep_backward=exposed[1],
        ep_recompute=exposed[2],
    )


def shared_expert_seconds(args: ModelArgs, hw: HardwareProfile, tokens: int, tp: int) -> float:
    """One forward of the shared experts' GEMMs (tp-split as declared): what the overlap runs beside the dispatch."""
    part = next(p for p in routed_block(args).parts if p.routing is not None)
    split = {0: (1, tp), 1: (tp, 1), None: (1, 1)}
    return sum(
        _gemm(hw, tokens, x.in_features // split[x.tp_dim][0], x.out_features // split[x.tp_dim][1])
        for x in part.linears
    )


def host_read_stall(hw: HardwareProfile) -> float:
    """The device's idle time per dropless MoE forward: the host waits for the split sizes, then launches the
    HOST_READ_LAUNCHES kernels before the all-to-all one by one onto an empty queue."""
    return HOST_READ_LAUNCHES * hw.device.kernel_overhead_us * 1e-6


def expert_gemm_seconds(args: ModelArgs, hw: HardwareProfile, tokens: int, tp: int, ep: int, imbalance: float) -> float:
    """One pass of the routed experts' three grouped GEMMs on the busiest rank: each local expert's GEMMs at its
    own shape (rows x dim x f twice, rows x f x dim), one launch per projection; `tp` does not split them
    (each tp rank runs the same tokens through whole experts)."""
    block, launch = routed_block(args), hw.device.kernel_overhead_us * 1e-6
    rows, local = expert_rows(args, tokens, ep, imbalance), block.routing.n_experts // ep
    per_expert = sum(_gemm(hw, rows, s.in_features, s.out_features) - launch for s in block.experts)
    return local * per_expert + len(block.experts) * launch


def expert_numel(args: ModelArgs, routed_layers: int, tp: int, ep: int, efsdp: int) -> tuple[int, int]:
    """(after TP and EP, after TP, EP and expert-FSDP) elements of the routed experts of `routed_layers` layers
    on one rank: each of w1, w2, w3 is (E / ep, dim, f) locally (whole on every tp rank, so `tp` does not divide
    them), dim 0 chunked over efsdp (the ceiling on rank 0, as torch.chunk)."""
    if not routed_layers or not parts.routed_experts(args):
        return 0, 0
    local = [s.n_experts // ep * s.in_features * s.out_features for s in routed_block(args).experts]
    return routed_layers * sum(local), routed_layers * sum(math.ceil(n / efsdp) for n in local)


def moe_activation_bytes(args: ModelArgs, tokens: int, tp: int, ep: int, imbalance: float, dtype_bytes: int) -> float:
    """Bytes an MoE layer keeps for backward beyond its attention and shared experts (the module docstring)."""
    block = routed_block(args)
    k, f, imb = block.routing.top_k, expert_width(block), effective_imbalance(ep, imbalance)
    return tokens * (4 * block.routing.n_experts + (2 * k * args.dim + 4 * k * f) * imb * dtype_bytes)


def ep_degrees(args: ModelArgs, shard_ranks: int) -> list[int]:
    """Expert-parallel degrees: divisors of dp_shard x cp that divide the experts; 1 for a dense model."""
    experts = parts.routed_experts(args)
    if not experts:
        return [1]
    return [e for e in range(1, shard_ranks + 1) if shard_ranks % e == 0 and experts % e == 0]
