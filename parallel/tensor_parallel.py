"""Tensor parallelism with DTensor `parallelize_module`, Megatron-style, for both model families.

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

Output: column-wise over the vocabulary with the logits left as a DTensor sharded on the vocab
dimension; the cross-entropy then runs under `loss_parallel()` and never gathers the full logits
(batch x seq x vocab would be the largest activation of the model).
"""

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """Shard `model` (built from models.transformer) over the 1-D `tp_mesh`, in place."""
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
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, tp_mesh, top)

    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        }
        if block.feed_forward.w3 is not None:
            plan["feed_forward.w3"] = ColwiseParallel()
        parallelize_module(block, tp_mesh, plan)


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
