"""The planner's timing primitives: one pass's seconds by kind (Passes), a GEMM at the device's
large-GEMM rate or the bandwidth its operands need (the roofline), a memory pass, float8 casts, ring
collectives and the all-to-all of expert parallelism on the links a group spans (cost.py's docstring
gives the model; moe.py uses the all-to-all)."""

from dataclasses import dataclass, fields

from trillion.parallel.float8_recipes import Float8Recipe
from trillion.parallel.planner.hardware import HardwareProfile, low_precision_peak_tflops
from trillion.parallel.planner.work import cast_bytes


@dataclass(frozen=True)
class Passes:
    """Seconds of one pass on one GPU; tp is the TP communication inside them."""

    forward: float = 0.0
    input_grad: float = 0.0
    weight_grad: float = 0.0
    tp_forward: float = 0.0
    tp_backward: float = 0.0
    cp_forward: float = 0.0
    cp_backward: float = 0.0
    ep_forward: float = 0.0  # expert parallelism's exposed all-to-alls (moe.py)
    ep_backward: float = 0.0
    ep_recompute: float = 0.0  # in a recomputed forward (no counts exchanged: the route is replayed)

    def __add__(self, other: "Passes") -> "Passes":
        return Passes(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Passes)))

    def __mul__(self, k: float) -> "Passes":
        return Passes(*(getattr(self, f.name) * k for f in fields(Passes)))


def _gemm(
    hw: HardwareProfile, m: int, k: int, n: int, recipe: Float8Recipe | None = None, float8_share: float = 1.0
) -> float:
    """Seconds of an m x k x n GEMM; with a low-precision `recipe`, at its format's peak and plateau, its operands
    quantised (with their scales); `float8_share` scales that rate (a grouped low-precision GEMM's, moe.py)."""
    flops = 2.0 * m * k * n
    device = hw.device
    if recipe is not None:  # quantised operands, output in the compute dtype
        peak = low_precision_peak_tflops(hw, recipe.format)
        rate = peak * 1e12 * device.gemm_share_of_peak(flops, recipe.format) * float8_share
        compute = flops / (rate * device.sustained)
        operands = _memory_bound(hw, recipe.quantised_bytes(m * k + k * n) + hw.element_bytes * m * n)
    else:
        compute = flops / (device.peak_tflops_bf16 * 1e12 * device.gemm_share_of_peak(flops) * device.sustained)
        operands = _memory_bound(hw, hw.element_bytes * (m * k + k * n + m * n))
    return max(compute, operands) + device.kernel_overhead_us * 1e-6


def float8_casts(hw: HardwareProfile, tokens: int, k: int, n: int, recipe: Float8Recipe) -> tuple[float, float, float]:
    """Seconds of one converted linear's casts to `recipe`'s format in (forward, input gradient, weight gradient):
    the weight gradient casts the saved input, and, where the recipe quantises along each dim apart, the output's
    gradient along the tokens too."""
    launch, per_element = hw.device.kernel_overhead_us * 1e-6, cast_bytes(recipe)
    forward = _memory_bound(hw, per_element * (tokens * k + k * n)) + 2 * launch  # input, weight
    input_grad = _memory_bound(hw, per_element * (tokens * n + k * n)) + 2 * launch  # output's gradient, weight
    again = (tokens * n, 1) if recipe.requantizes else (0, 0)  # the output's gradient along the tokens
    weight_grad = _memory_bound(hw, per_element * (tokens * k + again[0])) + (1 + again[1]) * launch
    return forward, input_grad, weight_grad


def _memory_bound(hw: HardwareProfile, nbytes: float) -> float:
    return nbytes / (hw.device.memory_bandwidth_gbs * 1e9 * hw.device.memory_efficiency)


def collective_time(hw: HardwareProfile, nbytes: float, group: int, span: int, kind: str) -> float:
    """Seconds of a ring collective of `nbytes` (the full, unsharded payload) among `group` GPUs
    whose ranks span `span` consecutive GPUs. kind: all_reduce | all_gather | reduce_scatter.

    Across nodes NCCL runs one ring per NIC (channel): each ring crosses every node boundary once, so a group
    with k ranks in each node moves its data over k NICs at once, k times one GPU's share of the network
    (NVIDIA/nccl issue 812, an NCCL developer: "On an Nvidia DGX-A100 system we have 8x200Gbit/s IB cards and
    we measure 192GB/s AllReduce BusBW", the 8 NICs' 200 GB/s, not one NIC's 25), at most the node's link."""
    if group <= 1:
        return 0.0
    spans_nodes = span > hw.scale_up  # beyond one scale-up domain (a node, or an NVL72 rack)
    bandwidth, latency = hw.collective_link(group if not spans_nodes else span, spans_nodes, kind)
    if spans_nodes:
        per_node = max(1, min(hw.scale_up, group * hw.scale_up // span))
        bandwidth = min(per_node * bandwidth, hw.collective_link(per_node, False, kind)[0])
    factor = 2.0 if kind == "all_reduce" else 1.0
    return factor * ((group - 1) / group * nbytes / bandwidth + (group - 1) * latency)


def all_to_all_time(hw: HardwareProfile, nbytes: float, group: int, tp: int) -> float:
    """Seconds of an all-to-all in which each of `group` ranks (taken every `tp`-th GPU: the ep group sits just
    outside tp in the mesh, or folded over it every GPU, tp 1) sends `nbytes` split evenly over the group (its own
    share stays). The
    shares for peers in its node go over the node's link and those for other nodes over its share of the
    network, at the same time; NCCL posts every peer's send and receive at once (one latency)."""
    if group <= 1:
        return 0.0
    in_node = max(1, min(group, hw.scale_up // tp))  # the group's ranks in this rank's scale-up domain
    intra, inter = nbytes * (in_node - 1) / group, nbytes * (group - in_node) / group
    seconds, latency = 0.0, 0.0
    if in_node > 1:
        bandwidth, latency = hw.collective_link(in_node * tp, False, "all_to_all")
        seconds = intra / bandwidth
    if group > in_node:
        bandwidth, latency = hw.collective_link(group * tp, True, "all_to_all")
        seconds = max(seconds, inter / bandwidth)
    return seconds + latency
