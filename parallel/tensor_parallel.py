"""Tensor parallelism with DTensor `parallelize_module`, Megatron-style, each block as its parts declare
(models/parts: every linear's split, COLUMN / ROW / REPLICATED, and every part's TP style below).

Per block: q/k/v and the MLP input projections (w1, w3) are column-wise (each rank holds a slice of
the heads / of the FFN width), wo and w2 are row-wise, so a block costs one all-gather on the way in
and one reduce-scatter on the way out of attention and of the MLP. Between those, the residual
stream and the norms are sequence-parallel: each rank holds seq_len / tp positions (norm weights
and biases replicated), which divides the activation memory outside the matmuls by tp.

Embedding: vocabulary-parallel (row-wise: each rank owns vocab / tp rows and the partial results
are reduce-scattered straight into the sequence-parallel layout). GPT's learned position table is
row-parallel the same way; its output (seq, dim) is reduce-scattered on the sequence (dim 0), so
tokens + positions add shard by shard.

The residual stream is a DTensor (Shard(1)) from the embedding to the final norm, between and
across blocks: the embeddings and the row-wise wo / w2 return DTensors instead of their local
shards. Numerically it is the same; it is what lets a block be compiled on its own (see
compile.py: with plain tensors at the boundary the compiled backward crashed or, under FSDP, gave
the embedding a wrong gradient), and what a pipeline stage sends: PipelineStage passes the local
shard and the next stage rebuilds the same DTensor, whichever part of the model a stage begins with.

ROUTED parts (the mixture of experts, models/moe.py): laid out by parallel.etp, with their experts tensor-parallel
over all-gathered tokens or ep folded over the tp ranks (expert_tensor_parallel.py).

DTENSOR_HEADS parts (latent attention, models/mla.py): heads split as above (wq or wq_b and wkv_b column-wise,
wo row-wise), the low-rank down projections wq_a, wkv_a and their norms replicated. Its tensors stay DTensors
(the rotary table passed in as a replicated one) until `attend`, which gets this rank's heads as plain
tensors: the key's rotary part is one head shared by all, so its gradient is a sum over every rank's heads,
which DTensor's autograd does (a partial sum reduced on the way back) and plain local tensors would not.

Output: column-wise over the vocabulary with the logits left as a DTensor sharded on the vocab
dimension; the cross-entropy then runs under `loss_parallel()` and never gathers the full logits
(batch x seq x vocab would be the largest activation of the model).

With parallel.tp_overlap the HEADS parts and the output head take tp_overlap.py's sharding instead of these styles:
the same placements, their all-gathers and reduce-scatters run in chunks beside their GEMMs.
"""

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from trillion.models import parts
from trillion.models.parts.spec import COLUMN, DTENSOR_HEADS, HEADS, REPLICATED, ROUTED, ROW, Part
from trillion.parallel.expert_tensor_parallel import place_routed, routed_plan
from trillion.parallel.tp_overlap import TpCollectives, overlap_head, overlap_sublayer

# How the block calls each sublayer (models/transformer.py TransformerBlock): the attention with the
# normed stream and the rotary table (None for learned positions), the feed-forward with the stream.
SUBLAYER_INPUTS = {"attention": 2, "feed_forward": 1}


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh,
    *,
    float8_tp: bool = False,
    expert_parallel: bool = False,
    folded: bool = False,
    overlap_chunks: int = 0,
) -> None:
    """Shard `model` (built from models.transformer) over the 1-D `tp_mesh`, in place, each block as its parts
    declare (models/parts: each linear's split, each part's TP style). `float8_tp`: the blocks' float8 linears
    (parallel/float8.py, tensorwise) take torchao's float8 styles, which cast the activations to float8 before
    the all-gather (half the bytes, one cast for q, k and v). `expert_parallel`: the routed experts go to the
    ep mesh next (not split over tp here); `folded`: ep borrows the tp ranks (parallel.etp=1). `overlap_chunks` > 0
    (parallel.tp_overlap): the HEADS parts and the output head run their all-gathers and reduce-scatters in that many
    chunks beside their GEMMs (tp_overlap.py) instead of DTensor's styles."""
    comm = TpCollectives(tp_mesh, overlap_chunks) if overlap_chunks else None
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        )
    if model.pos_embeddings is not None:
        top["pos_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(0), use_local_output=False
        )
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None and comm is None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, tp_mesh, top)
    if model.output is not None and comm is not None:
        overlap_head(model.output, comm)

    for index, block in model.blocks().items():  # the trunk's, then any multi-token prediction module's
        declared = parts.layer_block(model.args, int(index))
        style = _Styles(block, float8_tp)
        plan = {norm.name: SequenceParallel() for norm in declared.norms}
        overlapped = [part for part in declared.sublayers if comm is not None and part.tp_style == HEADS]
        for part in declared.sublayers:
            if part.tp_style == ROUTED:
                plan |= routed_plan(part, folded)
            elif part not in overlapped:
                plan |= SUBLAYER_PLANS[part.tp_style](part, style)
        parallelize_module(block, tp_mesh, plan)
        for part in declared.sublayers:
            if part in overlapped:
                overlap_sublayer(block, part, comm)
            if part.tp_style == ROUTED:
                place_routed(block, part, tp_mesh, folded, experts_here=not expert_parallel)
            else:
                _replicate_whole(block, part, tp_mesh)
    _, ahead = parts.ahead_modules(model.args)
    for module in model.ahead_modules().values():  # their norms on the stream, their projection replicated
        parallelize_module(module, tp_mesh, {norm.name: SequenceParallel() for norm in ahead.norms})
        for linear in ahead.linears:
            distribute_module(module.get_submodule(linear.name), tp_mesh)


def _heads_plan(part: Part, style) -> dict:
    """Input all-gathered from the sequence-parallel stream (in float8 where every column linear is), column
    linears with local outputs, the row linear reduce-scattered back to the stream as a DTensor."""
    columns = [x.name for x in part.linears if x.split == COLUMN]
    inputs = SUBLAYER_INPUTS[part.module]
    plan = {
        part.module: style.prepare(
            columns,
            input_layouts=(Shard(1),) + (None,) * (inputs - 1),
            desired_input_layouts=(Replicate(),) + (None,) * (inputs - 1),
        )
    }
    for linear in part.linears:
        if linear.split == COLUMN:
            plan[linear.name] = style.colwise(linear.name)
        elif linear.split == ROW:
            plan[linear.name] = style.rowwise(linear.name, output_layouts=Shard(1), use_local_output=False)
    return plan


def _dtensor_heads_plan(part: Part, style) -> dict:
    """Input and rotary table replicated DTensors, the head-making projections column-wise with DTensor outputs,
    the row linear back to the stream (the replicated parts: _replicate_whole). Plain styles: float8 tensor
    parallelism of such a part is not built."""
    plan = {
        part.module: PrepareModuleInput(
            input_layouts=(Shard(1), Replicate()), desired_input_layouts=(Replicate(), Replicate())
        )
    }
    for linear in part.linears:
        if linear.split == COLUMN:
            plan[linear.name] = ColwiseParallel(use_local_output=False)
        elif linear.split == ROW:
            plan[linear.name] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return plan


SUBLAYER_PLANS = {HEADS: _heads_plan, DTENSOR_HEADS: _dtensor_heads_plan}


def _replicate_whole(block: nn.Module, part: Part, tp_mesh) -> None:
    """What a part keeps whole on every tp rank, as replicated DTensors, so that every parameter is a DTensor
    (foreach optimizers take no mix): a DTENSOR_HEADS part's replicated linears and norms compute on DTensors
    (their inputs are), and its `attend` gets this rank's heads."""
    if part.tp_style == DTENSOR_HEADS:
        whole = [x.name for x in part.linears if x.split == REPLICATED] + [n.name for n in part.norms]
        for name in whole:
            distribute_module(block.get_submodule(name), tp_mesh)
        module = block.get_submodule(part.module)
        module.attend = _LocalHeads(module.attend)


class _LocalHeads:
    """A DTENSOR_HEADS attention's `attend` under TP: q, k, v (DTensors, heads sharded) -> the wrapped attend (a
    backend, or context parallelism's) on this rank's heads as plain tensors; its output is this rank's slice of
    the row linear's input."""

    def __init__(self, attend):
        self.attend = attend

    def __call__(self, q, k, v, **kwargs):
        return self.attend(*(t.redistribute(placements=[Shard(1)]).to_local() for t in (q, k, v)), **kwargs)


class _Styles:
    """The TP style of each of a block's linears: torchao's float8 one for a float8 linear under `float8_tp`,
    the plain one otherwise (a linear kept in high precision, or float8 TP off); a module's input is
    prepared in float8 only when every linear reading it is float8."""

    def __init__(self, block: nn.Module, float8_tp: bool):
        self.block, self.float8_tp = block, float8_tp
        if float8_tp:
            from trillion.parallel.float8 import tp_styles

            self.float8_styles = tp_styles()

    def _float8(self, *names: str) -> bool:
        from trillion.parallel.float8 import is_float8_linear

        return self.float8_tp and all(is_float8_linear(self.block.get_submodule(name)) for name in names)

    def colwise(self, name: str, **kwargs):
        return (self.float8_styles[0] if self._float8(name) else ColwiseParallel)(**kwargs)

    def rowwise(self, name: str, **kwargs):
        return (self.float8_styles[1] if self._float8(name) else RowwiseParallel)(**kwargs)

    def prepare(self, linears: list[str], **kwargs):
        """The input preparation of the module whose column `linears` read its input."""
        return (self.float8_styles[2] if self._float8(*linears) else PrepareModuleInput)(**kwargs)


def loss_context(tp_enabled: bool):
    """The context the loss (forward and backward) must run in: loss parallelism under TP."""
    return loss_parallel() if tp_enabled else contextlib.nullcontext()


def reduce_partial_grads(parameters) -> None:
    """Sum, once per step, the gradients DTensor leaves as Partial, in one all-reduce per mesh.

    A sequence-parallel norm's weight is replicated but each TP rank saw only its own positions, so
    its gradient is a Partial sum (FSDP, when on, reduces it inside its reduce-scatter). Left
    Partial, every foreach op that reads it (the clipping norm, then AdamW's lerp and two addcmuls)
    all-reduces it again: 4 small collectives per norm per step, each paying the latency and the
    ranks' drift. Megatron reduces these gradients once, coalesced, after the backward; so does this."""
    pending: dict = {}
    for p in parameters:
        grad = p.grad
        if isinstance(grad, DTensor) and any(placement.is_partial("sum") for placement in grad.placements):
            pending.setdefault((grad.device_mesh, grad.placements), []).append(p)
    for (mesh, placements), params in pending.items():
        local = [p.grad.to_local() for p in params]
        flat = torch.cat([t.reshape(-1) for t in local])
        for dim, placement in enumerate(placements):
            if placement.is_partial("sum"):
                dist.all_reduce(flat, group=mesh.get_group(dim))
        summed = tuple(Replicate() if placement.is_partial("sum") else placement for placement in placements)
        for p, chunk, part in zip(params, flat.split([t.numel() for t in local]), local):
            p.grad = DTensor.from_local(
                chunk.view_as(part), mesh, summed, run_check=False, shape=p.grad.shape, stride=p.grad.stride()
            )
