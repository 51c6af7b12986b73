"""Expert parallelism: each MoE layer's routed experts split over the ep ranks (ParallelDims.ep_mesh),
the tokens carried to them and back by all-to-alls.

`apply_expert_parallel` makes w1, w2, w3 of every RoutedExperts a DTensor sharded on the expert
dimension (Shard(0): rank r of ep holds experts r*E/ep .. (r+1)*E/ep - 1; init_weights draws the full
tensor and keeps this shard, so the values do not depend on the layout) and replaces each MoE's
`dispatch` (models/moe.py: expert-sorted rows and per-expert counts in, the experts' outputs in the
same order out) by the all-to-all path:

1. the counts exchanged: an all-to-all of the (E,) counts gives, for each source rank, how many rows
   it sends to each of this rank's experts;
2. one host read per layer and forward: the split sizes (rows to and from each ep rank), which
   `all_to_all_single` must have on the host;
3. the rows sent with uneven splits (the autograd all-to-all: its backward is the reverse one);
   they arrive grouped by source rank, then expert, and are re-sorted by local expert;
4. the local experts on the local counts, the sort undone, the combining all-to-all back; rows of
   dropped slots (past sum(counts)) stay zeros and never travel.

Activation checkpointing: in a recomputed block the routing is the first forward's (the same input
and weights choose the same experts), so the route of step 1-2 is kept from the first forward of a
checkpointed block (`recompute_from_cache`) and replayed by its recompute, first in first out, with no
second exchange of counts and no host read; the token all-to-alls and the experts run again. Under
selective:op the dispatch stays outside the op-level policy (as under full AC): torch 2.13's
selective checkpointing requires the recompute to issue exactly the first forward's ops, and the
cached route and the experts' own FSDP group (all-gathers inside the checkpointed block) do not;
the routed experts' grouped matmuls are recomputed either way. The dispatch runs eager under
torch.compile (its split sizes are data on the host): the rest of the block is compiled.

Placement in parallelize: after tensor parallelism (attention and shared experts tensor-parallel,
routed experts whole on their ep rank and replicated over tp, tensor_parallel.py), before
activation checkpointing and compile; FSDP then shards the experts over the data-parallel ranks
ep leaves (fsdp.py, ParallelDims.expert_fsdp_mesh) and everything else as without ep.
"""

import contextlib
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

from trillion.models.moe import MoE, moe_layers

EXPERT_WEIGHTS = ("w1", "w2", "w3")


@dataclass
class _Route:
    """Where one forward's rows go: split sizes on the host, the local re-sort on the device."""

    send: list[int]  # rows to each ep rank
    receive: list[int]  # rows from each ep rank
    local_counts: torch.Tensor  # (ep, E / ep) rows for each local expert from each source rank
    by_expert: torch.Tensor  # received rows, re-sorted by local expert
    back: torch.Tensor  # its inverse


class ExpertAllToAll:
    """An MoE layer's `dispatch` under expert parallelism (a plain callable, not a module: no new names)."""

    def __init__(self, layer: MoE, ep_mesh, send_tokens=funcol.all_to_all_single_autograd):
        self.experts = layer.experts
        self.send_tokens = send_tokens  # the dispatch's all-to-all: float8 dispatch swaps it (float8_dispatch.py)
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.recompute_from_cache = False  # set for checkpointed blocks (parallelize.py)
        self.routes: deque[_Route] = deque()
        self.host_reads = 0  # split-size reads on the host (tests count them)

    @torch._disable_dynamo  # torch.compiler.disable's, imported on the first call (models/moe.py says why)
    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        with _outside_selective_checkpoint():
            return self._dispatch(x, counts)

    def _dispatch(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        route = self._route(counts)
        kept = sum(route.send)
        received = self.send_tokens(x[:kept].contiguous(), route.receive, route.send, self.group)
        out = self.experts(received[route.by_expert], route.local_counts)[route.back]
        combined = funcol.all_to_all_single_autograd(out.contiguous(), route.send, route.receive, self.group)
        if kept < x.shape[0]:
            combined = torch.cat([combined, combined.new_zeros(x.shape[0] - kept, *combined.shape[1:])])
        return combined

    def _route(self, counts: torch.Tensor) -> _Route:
        recomputing = torch._C._current_graph_task_id() != -1
        if recomputing and self.routes:
            return self.routes.popleft()
        sent = counts.view(self.ep, -1)
        arriving = torch.empty_like(counts)
        dist.all_to_all_single(arriving, counts, group=self.group)  # [source rank, local expert]
        arriving = arriving.view(self.ep, -1)
        sizes = torch.cat([sent.sum(1), arriving.sum(1)]).tolist()  # the one host read
        self.host_reads += 1
        send, receive = sizes[: self.ep], sizes[self.ep :]
        local_experts = arriving.shape[1]
        block = torch.arange(arriving.numel(), device=counts.device)
        expert_of_row = block.repeat_interleave(arriving.flatten(), output_size=sum(receive)) % local_experts
        by_expert = expert_of_row.argsort(stable=True)
        back = torch.empty_like(by_expert).scatter_(0, by_expert, torch.arange(by_expert.numel(), device=counts.device))
        route = _Route(send, receive, arriving, by_expert, back)
        if self.recompute_from_cache and torch.is_grad_enabled() and not recomputing:
            self.routes.append(route)
        return route


@contextlib.contextmanager
def _outside_selective_checkpoint():
    """The ops inside run as if no op-level checkpoint policy were active (they are recomputed)."""
    mode = _get_current_dispatch_mode()
    if isinstance(mode, (_CachingTorchDispatchMode, _CachedTorchDispatchMode)):
        with _pop_mode_temporarily():
            yield
    else:
        yield


def apply_expert_parallel(model: nn.Module, ep_mesh, send_tokens=funcol.all_to_all_single_autograd) -> None:
    """Shard every MoE layer's routed experts over the 1-D `ep_mesh` and route its tokens by all-to-all
    (`send_tokens`: the dispatch's, funcol.all_to_all_single_autograd's call)."""
    for layer in moe_layers(model).values():
        experts = layer.experts
        if layer.moe.n_experts % ep_mesh.size():
            raise AssertionError("ParallelDims.validate checks that ep divides the experts")
        for name in EXPERT_WEIGHTS:
            param = getattr(experts, name)
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        layer.dispatch = ExpertAllToAll(layer, ep_mesh, send_tokens)


def cache_routes_for_recompute(block: nn.Module) -> None:
    """A checkpointed block: its recompute replays the first forward's routes (no second exchange)."""
    for module in block.modules():
        if isinstance(module, MoE) and isinstance(module.dispatch, ExpertAllToAll):
            module.dispatch.recompute_from_cache = True


def forget_routes(module: nn.Module) -> None:
    """Drop the routes cached for recomputes that will not come (pipeline metadata inference)."""
    for layer in moe_layers(module).values():
        if isinstance(layer.dispatch, ExpertAllToAll):
            layer.dispatch.routes.clear()


def expert_parallel_modules(block: nn.Module) -> list[nn.Module]:
    """The RoutedExperts of `block` whose weights live on the ep mesh (FSDP shards them apart)."""
    return [
        module.experts
        for module in block.modules()
        if isinstance(module, MoE) and isinstance(module.dispatch, ExpertAllToAll)
    ]
