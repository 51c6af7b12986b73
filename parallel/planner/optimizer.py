"""The optimizer's state and step on one rank, by the optimizer the plan assumes (assumptions.py `optimizer`):
AdamW's, or Muon's (parallel/muon/).

State (fp32, on the rank's FSDP shard): AdamW two moments, 8 bytes per parameter; Muon one momentum buffer,
4 bytes per hidden-matrix element (parallel/muon/matrices.py: every 2-D weight of the blocks and of the
multi-token prediction modules, the router's gate, every routed expert) and AdamW's 8 for the rest (embeddings,
output head, norms, biases). Muon's step also holds, for its length only (after the backward has freed the
activations), its updates in the Newton-Schulz dtype (one per hidden-matrix element of the rank) and one round's
exchange buffers (MUON_ROUND_BUFFERS x a round of at most parallel/muon/plan.py ROUND_ELEMENTS), plus the
Newton-Schulz workspace of its largest matrix; memory.py charges them where they pass the activation peak.

Step time (nothing overlapped: parallel/muon/distributed.py runs gather, compute and scatter in turn):
  element-wise  AdamW: OPTIMIZER_BYTES_PER_PARAM per parameter (work.py); Muon: MUON_FIXED_BYTES plus
                MUON_NS_ELEMENTS x the Newton-Schulz element size per hidden-matrix element (counted below)
  Newton-Schulz each hidden matrix of the stage whole, once, on one of the stage's ranks (tp x cp x dp_shard x
                dp_replicate of them): the stage's total over its ranks, or its largest matrix if that is longer;
                each of the steps is three GEMMs (X X^T, A A, B X) at the device's GEMM rate (timing._gemm), in
                the compute dtype (the trainer's newton_schulz_dtype=auto: bfloat16 on GPUs)
  exchange      two all-to-alls over the stage's ranks, each moving the rank's hidden-matrix shard in that dtype
                (an upper bound under replicas: HSDP's replicas gather one copy of each piece, and receive all)
The parameters' moving average (optimizer.ema_decay, parallel/host_ema.py) takes no GPU memory: a float32 average
of each parameter of the rank's shard and, on an accelerator, a staging copy in the parameter's dtype (the fp32
master weights), both in host memory, folded by a host thread beside the next step; the checkpoint saves the
average (host_ema_bytes). Its time is not priced, and bounded: the copy into the staging buffer runs on the compute
stream, so the next step's kernels queue behind it, 4 bytes a parameter of the shard over the host link (PCIe 5.0
x16: 64 GB/s a direction by its specification): DeepSeek-V3's layout (pp 16, ep 64, zero1 over 128) copies 1.44 GB,
about 23 ms of its planned 27 s step (0.1%). The fold reads and writes about 18 bytes of host memory a parameter
(6.5 GB a step there, well under a second on one core at an assumed 10 GB/s) and delays the next step only where
it outlasts a step.
The QK-clip (optimizer.qk_clip) is not costed: a step scales two weights' rows, and the forward's max-logit probe
adds a QK^T product per attention (models/logit_probe.py).
"""

import math
from functools import lru_cache

from trillion.models import parts
from trillion.models.args import ModelArgs
from trillion.parallel.muon.matrices import NEWTON_SCHULZ_STEPS, block_matrices, newton_schulz_flops
from trillion.parallel.muon.plan import ROUND_ELEMENTS
from trillion.parallel.planner.hardware import HardwareProfile
from trillion.parallel.planner.moe import expert_numel, routed_block
from trillion.parallel.planner.shards import ParamSpec, local_numel
from trillion.parallel.planner.timing import _gemm, _memory_bound, all_to_all_time
from trillion.parallel.planner.work import OPTIMIZER_BYTES_PER_PARAM

ADAMW_STATE_BYTES, MUON_STATE_BYTES = 8, 4  # fp32 moments per parameter: AdamW two, Muon one
# Muon's element-wise passes per hidden-matrix element, counted from parallel/muon/optimizer.py and distributed.py:
# fp32 bytes: clipping reads and scales the gradient 12, the momentum lerp_ reads buffer and gradient and writes the
# buffer 12, the Nesterov lerp reads both 8, the decay mul_ reads and writes the weight 8, the update add_ reads and
# writes it 8: MUON_FIXED_BYTES; in the Newton-Schulz dtype: the Nesterov result written 1, packed for the gather
# 2, unpacked on the owner 2, stacked for the batched Newton-Schulz 2, packed for the scatter 2, unpacked 2, read
# by the add_ 1: MUON_NS_ELEMENTS
MUON_FIXED_BYTES, MUON_NS_ELEMENTS = 48, 12
# A round's buffers alive at once, per element, in the Newton-Schulz dtype (distributed.py): the gather's send and
# receive, the owned matrices and their stacked copy for the batched Newton-Schulz (the scatter's replace them)
MUON_ROUND_BUFFERS = 4


def muon_numel(args: ModelArgs, rank, tp: int, dp_shard: int, ep: int, etp: int = 0) -> tuple[int, int]:
    """(after TP, after TP and FSDP) hidden-matrix elements of `rank` (memory.RankParams; `dp_shard`: the FSDP
    ranks, x cp; `etp` the ranks each routed expert is split over, Layout.expert_tp, 0: tp)."""
    dense, routed = rank.blocks(args)
    return _muon_numel(args, dense, routed, tp, dp_shard, ep, rank.ahead_modules, etp or tp)


@lru_cache(maxsize=4096)
def _muon_numel(
    args: ModelArgs, dense: int, routed: int, tp: int, d: int, ep: int, ahead: int, etp: int
) -> tuple[int, int]:
    specs = _block_specs(args, False) * dense + (_block_specs(args, True) * routed if routed else [])
    specs += _ahead_specs(args) * ahead
    pairs = [local_numel(s, tp, d) for s in specs]
    experts = expert_numel(args, routed, etp, ep, d * (tp // etp) // ep)
    return sum(p[0] for p in pairs) + experts[0], sum(p[1] for p in pairs) + experts[1]


def _block_specs(args: ModelArgs, routed: bool) -> list[ParamSpec]:
    """A block's hidden matrices but its routed experts, as the planner's parameter specs."""
    return [
        ParamSpec(m.name, (m.rows, m.cols), m.tp_dim)
        for m in block_matrices(parts.block(args, routed), "")
        if not m.stacked
    ]


def _ahead_specs(args: ModelArgs) -> list[ParamSpec]:
    """A multi-token prediction module's projection (its block counts as a block)."""
    _, ahead = parts.ahead_modules(args)
    return [ParamSpec(x.name, (x.out_features, x.in_features), x.tp_dim) for x in ahead.linears] if ahead else []


def state_bytes(args: ModelArgs, layout, optimizer: str, rank, shard_numel: int, state_dtype: str = "float32") -> float:
    """The state of `optimizer` (adamw | muon) on this rank: AdamW's moments in `state_dtype` (optimizer.state_dtype:
    bfloat16 halves them, parallel/adamw_states.py), Muon's momentum in fp32."""
    adamw = ADAMW_STATE_BYTES // 2 if state_dtype == "bfloat16" else ADAMW_STATE_BYTES
    if optimizer != "muon":
        return adamw * shard_numel
    hidden = muon_numel(args, rank, layout.tp, layout.dp_shard * layout.cp, layout.ep, layout.expert_tp)[1]
    return MUON_STATE_BYTES * hidden + adamw * (shard_numel - hidden)


def step_buffer_bytes(args: ModelArgs, layout, optimizer: str, rank, element_bytes: int) -> float:
    """Muon's updates, one round's exchange buffers and its largest Newton-Schulz workspace (X, A = X X^T, A A and
    B X), alive during the step only; 0 for AdamW."""
    if optimizer != "muon":
        return 0.0
    hidden = muon_numel(args, rank, layout.tp, layout.dp_shard * layout.cp, layout.ep, layout.expert_tp)[1]
    largest = max(((min(r, c), max(r, c)) for r, c, _ in _stage_matrices(args, rank)), default=(0, 0), key=math.prod)
    m, n = largest
    return element_bytes * (hidden + MUON_ROUND_BUFFERS * min(hidden, ROUND_ELEMENTS) + 3 * m * n + 2 * m * m)


def _stage_matrices(args: ModelArgs, rank) -> list[tuple[int, int, int]]:
    """(rows, cols, count) of every hidden matrix this rank's pipeline stage holds, whole."""
    dense, routed = rank.blocks(args)
    found = [(s.shape[0], s.shape[1], dense) for s in _block_specs(args, False)] if dense else []
    if routed:
        found += [(s.shape[0], s.shape[1], routed) for s in _block_specs(args, True)]
        found += [(e.in_features, e.out_features, routed * e.n_experts) for e in routed_block(args).experts]
    found += [(s.shape[0], s.shape[1], rank.ahead_modules) for s in _ahead_specs(args)]
    return [f for f in found if f[2]]


def newton_schulz_seconds(hw: HardwareProfile, rows: int, cols: int, count: int = 1) -> float:
    """`count` matrices of rows x cols orthogonalized as one batch: each step's three GEMMs with the batch folded
    into their rows (parallel/muon/newton_schulz.py)."""
    m, n = min(rows, cols), max(rows, cols)
    return NEWTON_SCHULZ_STEPS * (_gemm(hw, count * m, n, m) + _gemm(hw, count * m, m, m) + _gemm(hw, count * m, m, n))


def step_seconds(args: ModelArgs, hw: HardwareProfile, layout, optimizer: str, rank, shard_numel: int) -> float:
    """The step of `optimizer` (adamw | muon) on this rank beyond FSDP's copies (cost.py adds those)."""
    if optimizer != "muon":
        return _memory_bound(hw, OPTIMIZER_BYTES_PER_PARAM * shard_numel)
    ranks = layout.tp * layout.cp * layout.dp_shard * layout.dp_replicate  # a pipeline stage's
    hidden = muon_numel(args, rank, layout.tp, layout.dp_shard * layout.cp, layout.ep, layout.expert_tp)[1]
    e = hw.element_bytes
    elementwise = _memory_bound(
        hw, OPTIMIZER_BYTES_PER_PARAM * (shard_numel - hidden) + (MUON_FIXED_BYTES + MUON_NS_ELEMENTS * e) * hidden
    )
    matrices = _stage_matrices(args, rank)
    total = sum(newton_schulz_seconds(hw, r, c, count) for r, c, count in matrices)
    largest = max((newton_schulz_seconds(hw, r, c) for r, c, _ in matrices), default=0.0)
    exchange = 2 * all_to_all_time(hw, e * hidden, ranks, 1)
    return elementwise + max(total / ranks, largest) + exchange


def newton_schulz_flops_per_step(args: ModelArgs, rank) -> float:
    """FLOPs of one Muon step's orthogonalizations on this rank's stage, all its ranks together."""
    return sum(count * newton_schulz_flops(r, c) for r, c, count in _stage_matrices(args, rank))


# parallel/host_ema.py, per parameter element of the rank's shard: its float32 average, and on an accelerator the
# staging copy the step's parameters land in, in their dtype (fp32 master weights: memory.py)
EMA_AVERAGE_BYTES = 4
EMA_STAGING_BYTES = 4


def host_ema_bytes(shard_numel: int) -> tuple[int, int]:
    """(host memory, checkpoint share) of the parameters' average on a rank whose shard has `shard_numel`
    elements."""
    return (EMA_AVERAGE_BYTES + EMA_STAGING_BYTES) * shard_numel, EMA_AVERAGE_BYTES * shard_numel


def host_ema_line(decay: float, shard_numel: int, gpus_per_node: int) -> str:
    """The plan's line for the parameters' average (optimizer.ema_decay `decay` > 0) on the largest shard."""
    host = host_ema_bytes(shard_numel)[0] / 1e9
    return (
        f"parameter average in host memory (optimizer.ema_decay {decay:g}): {host:.3g} GB a rank, "
        f"{host * gpus_per_node:.3g} GB a node of {gpus_per_node} GPUs (a float32 average and a staging copy of "
        "each parameter of the rank's shard: parallel/host_ema.py), none in GPU memory; folded by a host thread beside "
        "the next step, saved with the checkpoint"
    )
