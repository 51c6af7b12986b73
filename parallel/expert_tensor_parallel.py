"""A mixture-of-experts layer (a ROUTED part: models/parts/moe.py) under tensor parallelism, in one of the two ways
parallel.etp names (MoE parallel folding, Megatron-Core's arXiv 2504.14960: attention and experts each decompose
the same ranks their own way; torchtitan's etp):

- experts tensor-parallel (etp = tp, and always with ep = 1): the layer takes its input all-gathered from the
  sequence-parallel stream and every tp rank routes the same tokens (the router replicated, so its statistics are
  one process's). Each routed expert is split like an MLP, w1 and w3 by their hidden columns and w2 by its rows
  (with ep > 1 on the 2-D (ep, etp) mesh, expert_parallel.py), the shared experts column/row-wise; both leave
  partial sums, which one reduce-scatter returns to the stream. The routed experts compute on local tensors, so
  their gradients of the tokens and of the router's weights are partial sums too: the dispatch sums them over tp
  in the backward (SummedOverTensorParallel, Megatron's copy to the tensor-parallel region) before they reach the
  router. Under ep every tp rank of a group sends the same rows: tp times the all-to-all traffic of the folded
  layout.
- folded (etp = 1 with ep > 1: ep borrows the tp ranks): the layer keeps the sequence-parallel shard each tp rank
  holds. The router runs on it (its weight's gradient a partial sum over tp, reduced as a sequence-parallel norm's),
  the dispatch sends only those tokens to whole experts on the ep ranks and the combine returns them to it
  (expert_parallel.py). The shared experts all-gather from the tp ranks the rows they are given and reduce-scatter
  their output back (so under parallel.ep_overlap they still run chunk by chunk beside the all-to-alls). No tp
  rank routes, sends or computes another's tokens. Statistics that need the micro-batch whole are summed over the
  ranks holding its other positions (cp x tp, the layer's `sequence_shards`: its auxiliary losses), and the step's
  tallies over every rank routing other tokens (ParallelDims.all_reduce_routed).
"""

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
)

from trillion.models.moe import moe_layers
from trillion.models.parts.spec import COLUMN, ROW, ExpertStack, Part


def routed_plan(part: Part, folded: bool) -> dict:
    """parallelize_module's plan for an MoE layer (the module docstring): its input and output, and its shared
    experts' linears (the router and the expert stacks: place_routed)."""
    module = PrepareModuleInputOutput(
        input_layouts=(Shard(1),),
        desired_input_layouts=(Shard(1) if folded else Replicate(),),
        use_local_input=True,
        output_layouts=(Shard(1) if folded else Partial(),),
        desired_output_layouts=(Shard(1),),
        use_local_output=False,
    )
    plan = {part.module: module}
    shared = {linear.name.rsplit(".", 1)[0] for linear in part.linears}
    if folded:  # the rows it is given, gathered from the tp ranks and their outputs scattered back
        gathered = PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),))
        plan |= dict.fromkeys(shared, gathered)
    for linear in part.linears:
        if linear.split == COLUMN:
            plan[linear.name] = ColwiseParallel()
        elif linear.split == ROW:  # partial sums stay DTensors: place_routed hands them on (_partial_out)
            plan[linear.name] = RowwiseParallel(
                output_layouts=Shard(0) if folded else Partial(), use_local_output=folded
            )
    return plan


def place_routed(block: nn.Module, part: Part, tp_mesh, folded: bool, experts_here: bool) -> None:
    """The router's gate replicated over tp (computing on the tokens this rank routes: all of them, or folded its own
    rows); with `experts_here` (ep = 1) the expert stacks split over tp (expert_placements), else expert parallelism
    places them next."""
    rows = Shard(0) if folded else Replicate()
    distribute_module(
        block.get_submodule(part.routing.gate.name),
        tp_mesh,
        input_fn=lambda _module, inputs, mesh: tuple(
            DTensor.from_local(t, mesh, [rows], run_check=False) for t in inputs
        ),
        output_fn=lambda _module, output, _mesh: output.to_local(),
    )
    for linear in part.linears if not folded else ():
        if linear.split == ROW:
            block.get_submodule(linear.name).register_forward_hook(_partial_out)
    for stack in part.experts if experts_here else ():
        module, name = stack.name.rsplit(".", 1)
        experts = block.get_submodule(module)
        param = getattr(experts, name)
        sharded = distribute_tensor(param.data, tp_mesh, [Shard(stack.tp_dim)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _partial_out(_module, _inputs, output: DTensor) -> torch.Tensor:
    """A shared expert's partial sum as this rank's local tensor, to add to the routed experts' (the layer's output is
    reduce-scattered once, routed_plan): the sum's gradient is every addend's, so the gradient is the same replicated
    one on every rank (to_local's default would take it for a partial sum too, and count it tp times)."""
    return output.to_local(grad_placements=(Replicate(),))


def expert_placements(stack: ExpertStack, tensor_parallel: bool) -> tuple:
    """A stack's placements under expert parallelism: its experts over ep (dim 0), and each split over etp as its
    declaration says with parallel.etp = tp."""
    return (Shard(0), Shard(stack.tp_dim)) if tensor_parallel else (Shard(0),)


class SummedOverTensorParallel:
    """An MoE layer's `dispatch` (models/moe.py) whose routed experts are split over tp (parallel.etp = tp): the
    tokens and the router's weights enter the routed experts unchanged, and their gradients, partial sums over the
    tp ranks (each computed through its slice of every expert), are summed over them on the way back. The work beside
    (the shared experts, whose tensor parallelism sums their gradient itself) gets the tokens as they came. `inner`:
    the dispatch it wraps (the local experts', or expert parallelism's)."""

    def __init__(self, inner, group):
        self.inner, self.group = inner, group

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, beside=None):
        summed, weights = _SumGradients.apply(x, weights, self.group)
        return self.inner(summed, ids, weights, None if beside is None else _InRowOrder(beside, x))


class _InRowOrder:
    """Work beside the dispatch (rows -> rows) on the rows of `x` itself: the dispatch hands it its own copy's rows
    piece by piece in row order (expert_parallel.py _Beside), and each piece is taken from `x` at the same place."""

    def __init__(self, work, x: torch.Tensor):
        self.work, self.x, self.done = work, x, 0

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        piece = self.x[self.done : self.done + rows.shape[0]]
        self.done += rows.shape[0]
        return self.work(piece)


class _SumGradients(torch.autograd.Function):
    """Identity forward on two tensors; backward, their gradients summed over `group` in one all-reduce."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weights: torch.Tensor, group):
        ctx.group, ctx.like = group, (torch.empty_like(x, device="meta"), torch.empty_like(weights, device="meta"))
        ctx.device = x.device
        return x.view_as(x), weights.view_as(weights)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        grads = [g if g is not None else torch.zeros_like(like, device=ctx.device) for g, like in zip(grads, ctx.like)]
        flat = torch.cat([grads[0].reshape(-1), grads[1].reshape(-1).to(grads[0].dtype)])
        summed = funcol.wait_tensor(funcol.all_reduce(flat, "sum", ctx.group)).split([g.numel() for g in grads])
        return *(total.view_as(g).to(g.dtype) for total, g in zip(summed, grads)), None


def sum_expert_gradients(model: nn.Module, tp_mesh) -> None:
    """Every MoE layer's dispatch wrapped in SummedOverTensorParallel (call after expert parallelism has set it)."""
    for layer in moe_layers(model).values():
        layer.dispatch = SummedOverTensorParallel(layer.dispatch, tp_mesh.get_group())
