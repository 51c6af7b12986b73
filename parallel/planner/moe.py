"""The mixture-of-experts block as the planner sees it (models/moe.py; expert parallelism as torchtitan
lays it out, `parallel.ep`): what an MoE layer adds to a block whose MLP is only its shared experts.

Per MoE layer and micro-batch, on one rank whose tp group holds `tokens` (= micro-batch x seq / cp). The rank
routes `routed` of them (parallel/expert_tensor_parallel.py, routed_tokens): folded (parallel.etp = 1, ep over the
tp ranks) its own sequence-parallel 1/tp; with the experts tensor-parallel (etp = tp) all of them, every tp rank
the same; the shared experts are TP-split either way:
  router     one GEMM routed x dim x E (replicated over tp), forward, input and weight gradient.
  experts    E / ep local experts, each three GEMMs at its own shape: rows x dim x f / etp (w1, w3) and
             rows x f / etp x dim (w2), rows = routed x top_k x ep / E x imbalance (f the expert width, split over
             etp = Layout.expert_tp), one grouped-GEMM launch per projection; the same again for each gradient.
             With etp = tp the gradients of the tokens and the router's weights are partial sums over tp: one
             all-reduce of routed x dim in the backward (expert_tensor_parallel.py SummedOverTensorParallel).
  imbalance  `moe_load_imbalance` (assumptions.py): the busiest rank's routed tokens over the mean. It applies with
             ep > 1, where the all-to-alls make every rank wait for the busiest one; with ep 1 a rank runs
             every expert on all its tokens (tokens x top_k rows in all, whatever the balance), so there it
             is 1. MOE_LOAD_IMBALANCE is its default (see its note).
  all-to-all per MoE layer forward: the counts' exchange (latency) and the host read's stall (host_read_stall;
             none with a capacity, parallel.ep_capacity), the dispatch and the combine; backward the two again
             (their gradients). The rows a token sends per hop and stage (network, the node's link) follow the
             dispatch mode the trainer runs (dispatch_rows: per expert, per rank, per node; the ep group's ranks are
             ep_stride apart: folded ep consecutive GPUs, else ep x tp), each row the token and its routing
             (row_bytes), at the imbalance (dispatch_seconds). With parallel.ep_overlap what hides is what the
             mechanism puts beside each all-to-all's wait (exposed_all_to_alls; paired micro-batches, two forwards
             on one stage or a forward beside a backward across stages: exposed_seconds); else all of it.
  element-wise  per routed token: the fused permutation into expert order and back
             (kernels/permute.py, kernels.permutation=auto on GPUs; PERMUTATION_ROWS; under ep the dispatch's
             own gathers in torch, DISPATCH_PERMUTATION_ROWS), SwiGLU on the expert hidden 5 k f / etp
             (kernels/swiglu.py; the routing weights' product on it is counted in the rows above), the router's
             softmax and top-k 3 E (read scores, write them, read for top-k), its loss-free bias 2 E (the add:
             read, write) and DeepSeek-V3's group-limited choice 3 E (the per-group top-2 reads the scores, the
             mask of the other groups reads and writes them: Router.forward); the same under torch.compile (the
             data-dependent shapes break the graph).
  float8     (layout.float8 with its experts not off, parallel/float8_experts.py) the experts' grouped GEMMs,
             forward and both gradients, at the recipe's float8 rate (float8_experts.py FLOAT8_EXPERT_SHARE, here in
             the planner), plus their casts (each GEMM casts both operands: FLOAT8_CAST_BYTES per element); with
             float8 dispatch the forward dispatch all-to-all carries float8 rows and their scales (dispatch_row_bytes),
             with float8.combine_gradient the combine's reverse too; the combine and the rows' reverse stay bf16.
Memory: expert parameters total / (ep x etp x efsdp), efsdp = dp_shard x cp (x tp folded) / ep
(Layout.efsdp), so a rank's states are those of its E / ep experts split over etp and sharded over efsdp (the
states per rank do not depend on ep; FSDP's gathered copies, its buffers and its traffic do: one layer's E / ep
experts' etp slices, all-gathered over the efsdp ranks). Activations of an MoE layer (not checkpointed), per
routed token: the router's fp32 scores E x 4 bytes, the permuted tokens k h, the experts' w1 and w3 outputs and w2's
input 3 k f / etp (their outputs return summed with nothing kept, the routing weights applied before w2:
models/expert_rows.py), all times imbalance where it applies, bf16; with float8.cache_activations the permuted
tokens and the three k f in float8 with their scales instead (activations.py moe_activation_bytes).
"""

import math

from trillion.models import parts
from trillion.models.args import ModelArgs
from trillion.models.parts import Block
from trillion.models.parts.moe import member_reach
from trillion.parallel.ep_checks import ep_stride
from trillion.parallel.modes import checkpoint_mode
from trillion.parallel.planner.float8_experts import (
    FLOAT8_EXPERT_SHARE,
    dispatch_row_bytes,
    expert_number_format,
    float8_expert_recipe,
)
from trillion.parallel.planner.hardware import HardwareProfile
from trillion.parallel.planner.in_layer_overlap import chunks_exposed, exposed_paired
from trillion.parallel.planner.pairing import Segments, backward_turns, exposed_at_phase, forward_turns
from trillion.parallel.planner.schedules import paired_share
from trillion.parallel.planner.timing import Passes, _gemm, _memory_bound, all_to_all_time, collective_time
from trillion.parallel.planner.work import BACKWARD_ELEMENTWISE, cast_bytes

# The busiest rank's routed tokens over the mean, by default. MEASURED on debug-moe (sigmoid scores, loss-free
# bias 1e-2; `trillion train --model.name=debug-moe --training.steps=100 --metrics.log_freq=10`, default corpus):
# its `moe/layer*/tokens_per_expert` over steps 50-100, layers 1-3, through rank_load_imbalance with 2 experts
# per rank (ep 4 of 8): mean 1.16, max 1.26 (4 experts per rank: 1.06; 1 per rank: 1.37). Two experts per rank
# is the conservative end: a rank of a real model holds more (qwen3-235b-a22b at ep 8: 16), which averages out.
# Give another figure with `trillion plan --moe-load-imbalance X`. It is a rank's figure: rank_load_imbalance
# turns per-expert loads into it for an ep (an expert's max/mean overstates it when a rank holds several).
MOE_LOAD_IMBALANCE = 1.16
# Rows of dim the fused permutation (kernels/permute.py) reads and writes per token, as (per choice, per token), as
# counted when the combine also weighted the rows: forward, permute reads the token's row and writes a copy per choice
# (k + 1), the combine reads the k routed rows and writes their sum (k + 1); backward, permute's gradient reads the k
# copies' and writes one (k + 1), the weighted combine's read the output's gradient, the k routed rows, and wrote their
# k gradients (2 k + 1). The combine no longer weights (models/expert_rows.py: the weights are applied before w2,
# its backward is the permutation's forward, k + 1), so the backward's count is high by k rows a token; kept until the
# validation rows that price it are re-planned with the change (torch's path: 7 per choice and 1 forward, twice that
# backward, 57 and 114 at top-8; the fused one 18 and 26).
PERMUTATION_ROWS = {"forward": (2, 2), "backward": (3, 2)}
# Under expert parallelism the dispatch permutes the rows itself, in torch (parallel/ep_routing.py: the rows
# gathered per destination, the receivers' gather into expert order, the sum back and the combine's gather and
# sum), counted as torch's path above: 7 per choice and 1 forward, twice that backward (the weighting of the experts'
# outputs among them, which now happens on the experts' hidden rows inside SwiGLU: high, as PERMUTATION_ROWS; and the
# hop's combine, now the fused one on a GPU, reads each returned row once instead of gathering top_k per row).
DISPATCH_PERMUTATION_ROWS = {"forward": (7, 1), "backward": (14, 2)}
# Kernels the dropless dispatch launches between reading its split sizes on the host and posting its all-to-all:
# counted by tests/planner/test_dispatch_plan.py, which runs that stretch under a dispatch mode
HOST_READ_LAUNCHES = 39
# float8.cache_activations' scale block: one float32 scale per 128 float8 elements (kernels/float8_scaling.py BLOCK,
# DeepSeek-V3's 1 x 128 tiles; rowwise recipes keep fewer, so this bounds them from above)
FLOAT8_CACHE_BLOCK = 128


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


def routed_tokens(tokens: int, layout) -> int:
    """The tokens of a tp group's `tokens` one rank routes: folded (parallel.etp = 1) its sequence-parallel share,
    else all of them (parallel/expert_tensor_parallel.py)."""
    return tokens // layout.tp if layout.folded else tokens


def expert_rows(args: ModelArgs, tokens: int, ep: int, imbalance: float) -> int:
    """Rows of each local expert's GEMMs on the busiest rank, of `tokens` routed by each rank."""
    routing = routed_block(args).routing
    return math.ceil(tokens * routing.top_k * ep / routing.n_experts * effective_imbalance(ep, imbalance))


def members_per_node(layout) -> int:
    """The ep group's ranks on one node of layout.ranks_per_node (the planner's: its hardware's GPUs per node): its
    ranks are ep_stride apart (folded: ep consecutive GPUs; else just outside tp, ep x tp consecutive GPUs)."""
    return max(1, min(layout.ep, layout.ranks_per_node // ep_stride(layout)))


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


def row_bytes(args: ModelArgs, mode: str, payload_bytes: int) -> int:
    """A dispatched row: its payload (the token: dim x the compute dtype's bytes, or a float8 wire row), and its weights
    and expert ids in float32 (ep_routing.py)."""
    slots = 1 if mode == "expert" else routed_block(args).routing.top_k
    return payload_bytes + 2 * slots * 4


def dispatch_seconds(
    args: ModelArgs, hw: HardwareProfile, tokens: int, layout, imbalance: float, payload_bytes: int = 0
) -> float:
    """One direction's all-to-alls of `tokens` routed by the rank (the dispatch, its rows of `payload_bytes`, default
    the token in the compute dtype; the combine takes as long in that dtype) on the busiest rank, at the load
    `imbalance` (assumptions.py): the hops one after the other (dispatch_hops)."""
    return sum(dispatch_hops(args, hw, tokens, layout, imbalance, payload_bytes))


def dispatch_hops(
    args: ModelArgs, hw: HardwareProfile, tokens: int, layout, imbalance: float, payload_bytes: int = 0
) -> list[float]:
    """dispatch_seconds's hops, each its network and node-link shares at once and a latency; none without ep."""
    ep, stride = layout.ep, ep_stride(layout)
    if ep <= 1:
        return []
    members, mode = members_per_node(layout), dispatch_mode(layout)
    row = row_bytes(args, mode, payload_bytes or args.dim * hw.element_bytes)
    size = tokens * row * effective_imbalance(ep, imbalance)
    hops = []
    for network, link in dispatch_rows(args, mode, ep, members):
        hop, latency = 0.0, 0.0
        if link:
            bandwidth, latency = hw.collective_link(members * stride, False, "all_to_all")
            hop = size * link / bandwidth
        if network:
            bandwidth, latency = hw.collective_link(ep * stride, True, "all_to_all")
            hop = max(hop, size * network / bandwidth)
        hops.append(hop + latency)
    return hops


def exposed_all_to_alls(layout, first: list, second: list, counts: float, shared: float, experts: float) -> float:
    """Seconds of one pass's all-to-alls left exposed: `first` (the dispatch's hops; in a backward the combine's
    reverse: per node over the network, then in the node), `second` (the way back: per node in the node, then over
    the network) and `counts` (the split sizes' exchange and read; 0 where none: a capacity, a recompute, the
    backward), beside the pass's `shared` experts and routed `experts`: all of it without overlap, else what the
    layer's two chunks of tokens leave (in_layer_overlap.py)."""
    if not layout.ep_overlap:
        return counts + sum(first) + sum(second)
    return chunks_exposed(dispatch_mode(layout), first, second, counts, shared, experts)


def pairs(layout) -> bool:
    """parallel.ep_overlap pairs micro-batches here (parallel/expert_overlap.py pairs_micro_batches's rule)."""
    gathered = layout.dp_shard * layout.cp == 1 or layout.dp_shard_mode != "zero3"
    return layout.ep_overlap and layout.ep > 1 and layout.pp == 1 and layout.microbatches > 1 and gathered


def permutation_rows(ep: int) -> dict:
    """Rows of dim per token the permutation into expert order and back moves, (per choice, per token) forward and
    backward: the fused permutation's in one process, the dispatch's own gathers under ep."""
    return PERMUTATION_ROWS if ep == 1 else DISPATCH_PERMUTATION_ROWS


def moe_passes(
    args: ModelArgs, hw: HardwareProfile, tokens: int, layout, imbalance: float, around: Passes | None = None
) -> Passes:
    """What one MoE layer adds to its block's attention and shared experts (`around`; the module docstring) for a tp
    group's `tokens`, at the load `imbalance`, with the layout's float8 experts (float8_expert_recipe) and dispatch."""
    block, h, launch = routed_block(args), args.dim, hw.device.kernel_overhead_us * 1e-6
    ep, etp = layout.ep, layout.expert_tp
    routed = routed_tokens(tokens, layout)
    float8 = float8_expert_recipe(layout.float8)
    routing, f = block.routing, expert_width(block)
    experts = expert_gemm_seconds(args, hw, routed, etp, ep, imbalance, float8)
    casts = expert_float8_casts(args, hw, routed, ep, imbalance, float8, etp) if float8 else (0.0, 0.0, 0.0)
    router = _gemm(hw, routed, routing.gate.in_features, routing.gate.out_features)
    k, imb = routing.top_k, effective_imbalance(ep, imbalance)
    swiglu = routed * (5 * k * f / etp * imb + routing.elements)
    forward_rows, backward_rows = (routed * (c * k * imb + t) * h for c, t in permutation_rows(ep).values())
    elementwise = _memory_bound(hw, (swiglu + forward_rows) * hw.element_bytes) + routing.kernels * launch
    backward_elementwise = (
        _memory_bound(hw, (BACKWARD_ELEMENTWISE * swiglu + backward_rows) * hw.element_bytes)
        + BACKWARD_ELEMENTWISE * routing.kernels * launch
    )
    summed = collective_time(hw, routed * h * hw.element_bytes, etp, etp, "all_reduce") if etp > 1 else 0.0
    forward, input_grad, weight_grad = (
        router + experts + casts[0] + elementwise,
        router + experts + casts[1] + backward_elementwise + summed,
        router + experts + casts[2],
    )
    exposed = [0.0, 0.0, 0.0]  # forward, backward, recomputed forward
    if ep > 1:
        passes = (forward, input_grad + weight_grad)
        exposed = exposed_seconds(args, hw, tokens, layout, imbalance, float8, experts, passes, around)
    return Passes(
        forward=forward + exposed[0],
        input_grad=input_grad + exposed[1],
        weight_grad=weight_grad,
        tp_backward=summed,
        ep_forward=exposed[0],
        ep_backward=exposed[1],
        ep_recompute=exposed[2],
    )


def exposed_seconds(
    args, hw, tokens: int, layout, imbalance: float, float8, experts: float, routed: tuple, around
) -> list[float]:
    """Seconds of the all-to-alls left exposed in (the forward, the backward, a recomputed forward) of one MoE layer
    under ep: the dispatch in float8 in the forwards with float8 dispatch, and the combine's reverse with its gradient
    (the rest in the compute dtype); beside the shared and routed `experts`, or with paired micro-batches beside the
    other's layer (`routed`: its routed forward and backward, both gradients, `around` its attention and shared)."""
    tp, ep, rows = layout.tp, layout.ep, routed_tokens(tokens, layout)
    hops, shared = dispatch_hops(args, hw, rows, layout, imbalance), shared_expert_seconds(args, hw, tokens, tp)
    wire = dispatch_row_bytes(args.dim, float8) if float8 and layout.float8.dispatch else 0
    sent = dispatch_hops(args, hw, rows, layout, imbalance, wire) if wire else hops  # the dispatch's, a hop each
    back = sent if wire and layout.float8.combine_gradient else hops  # the combine's reverse
    one_way, dispatch, returned = sum(hops), sum(sent), sum(back)
    counts = 0.0 if layout.ep_capacity else all_to_all_time(hw, 0.0, ep, ep_stride(layout)) + host_read_stall(hw)
    way_back = hops[::-1]  # the combine's hops, in the order it sends them (per node: in the node first)
    alone = [
        exposed_all_to_alls(layout, sent, way_back, counts, shared, experts),
        exposed_all_to_alls(layout, back, way_back, 0.0, 2 * shared, 2 * experts),
        exposed_all_to_alls(layout, sent, way_back, 0.0, shared, experts),
    ]
    share = paired_share(layout) if around is not None else 0.0
    if not share and not (around is not None and pairs(layout)):
        return alone
    forward = around.forward - around.tp_forward - around.cp_forward + routed[0]  # the other side's layer, beside
    backward = around.input_grad + around.weight_grad - around.tp_forward - around.cp_forward + routed[1]
    turns = 3 if counts else 2  # a forward hands the turn over after the counts, the rows, the combine
    if not share:  # two forwards paired, then two backwards (one pipeline stage)
        return [
            exposed_paired(dispatch, one_way, counts, forward / turns),
            exposed_paired(returned, one_way, 0.0, backward / 2),
            exposed_paired(dispatch, one_way, 0.0, forward / 2),
        ]
    # across stages (DualPipeV, Interleaved1F1B): a forward beside a backward, which hands over as often a layer
    # (after the combine's reverse, the rows' and their routing's, and where the counts were: turn_in_backward)
    if checkpoint_mode(layout.activation_checkpoint).replays_blocks:  # a recompute's posts too: the mean segment
        paired = [exposed_paired(dispatch, one_way, counts, backward / turns)]
        paired.append(exposed_paired(returned, one_way, 0.0, forward / turns))
    else:  # each post beside the segment it meets (pairing.py)
        mode, capacity = dispatch_mode(layout), bool(layout.ep_capacity)
        ahead = Segments(forward - shared - routed[0], shared, routed[0])
        behind = Segments(backward - 2 * shared - routed[1], 2 * shared, routed[1])
        turns_of = (
            forward_turns(mode, capacity, counts, sent, hops, ahead),
            backward_turns(mode, capacity, back, hops, behind),
        )
        paired = list(exposed_at_phase(*turns_of, layout.ep_pairing_phase))
    paired.append(exposed_paired(dispatch, one_way, 0.0, forward / turns))
    return [share * p + (1 - share) * a for p, a in zip(paired, alone)]


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


def expert_gemm_seconds(
    args: ModelArgs, hw: HardwareProfile, tokens: int, etp: int, ep: int, imbalance: float, float8: str | None = None
) -> float:
    """One pass of the routed experts' three grouped GEMMs on the busiest rank, for `tokens` routed by each rank:
    each local expert's GEMMs at its own shape (rows x dim x f / etp twice, rows x f / etp x dim: `etp` the ranks
    each expert is split over, ExpertStack's split), one launch per projection; `float8`: at that recipe's float8
    rate."""
    block, launch = routed_block(args), hw.device.kernel_overhead_us * 1e-6
    rows, local = expert_rows(args, tokens, ep, imbalance), block.routing.n_experts // ep
    share = FLOAT8_EXPERT_SHARE[float8] if float8 else 1.0
    number_format = expert_number_format(float8) if float8 else None
    per_expert = sum(_gemm(hw, rows, *_split(s, etp), number_format, share) - launch for s in block.experts)
    return local * per_expert + len(block.experts) * launch


def _split(stack, etp: int) -> tuple[int, int]:
    """(in, out) features of one expert's projection on one of `etp` ranks (its declared split)."""
    if stack.tp_dim == 2:
        return stack.in_features, stack.out_features // etp
    return stack.in_features // etp, stack.out_features


def expert_float8_casts(
    args: ModelArgs, hw: HardwareProfile, tokens: int, ep: int, imbalance: float, recipe: str = "rowwise", etp: int = 1
) -> tuple[float, float, float]:
    """Seconds of the float8 experts' casts in (forward, input gradient, weight gradient) on the busiest rank: each
    grouped GEMM casts its two operands, the local experts' rows and weights (forward: input and weight; input
    gradient: the output's gradient and the weight; weight gradient: input and output's gradient along the
    tokens), at the recipe's bytes per element (work.cast_bytes: FLOAT8_CAST_BYTES in fp8, a scale per block more
    in MX), two launches each; each expert's slice on one of `etp` ranks."""
    block, launch = routed_block(args), hw.device.kernel_overhead_us * 1e-6
    rows = expert_rows(args, tokens, ep, imbalance) * (block.routing.n_experts // ep)
    shapes = [_split(s, etp) for s in block.experts]
    weights = [s.n_experts // ep * k * n for s, (k, n) in zip(block.experts, shapes)]
    forward = sum(rows * k + w for (k, _), w in zip(shapes, weights))
    input_grad = sum(rows * n + w for (_, n), w in zip(shapes, weights))
    weight_grad = sum(rows * (k + n) for k, n in shapes)
    launches = 2 * len(block.experts) * launch
    per_element = cast_bytes(expert_number_format(recipe))
    return tuple(_memory_bound(hw, per_element * n) + launches for n in (forward, input_grad, weight_grad))


def expert_numel(args: ModelArgs, routed_layers: int, etp: int, ep: int, efsdp: int) -> tuple[int, int]:
    """(after EP and expert TP, after those and expert-FSDP) elements of the routed experts of `routed_layers` layers
    on one rank: each of w1, w2, w3 is (E / ep, dim, f) locally, split over `etp` as declared (1: whole, the tp ranks
    folded into ep), dim 0 chunked over efsdp (the ceiling on rank 0, as torch.chunk)."""
    if not routed_layers or not parts.routed_experts(args):
        return 0, 0
    local = [s.n_experts // ep * s.in_features * s.out_features // etp for s in routed_block(args).experts]
    return routed_layers * sum(local), routed_layers * sum(math.ceil(n / efsdp) for n in local)


def expert_shards(tp: int, dp_shard: int, ep: int, etp: int) -> int:
    """The ranks FSDP shards a rank's routed experts over: dp_shard (x cp) x the tp ranks not splitting them, over
    ep (Layout.efsdp)."""
    return dp_shard * (tp // etp) // ep
