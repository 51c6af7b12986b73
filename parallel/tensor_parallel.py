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

Mixture-of-experts blocks (models/moe.py): the MoE layer takes its input all-gathered (every TP rank
routes the same tokens, so the router, its balancing tallies and the auxiliary loss are the one-process
ones), the router and the routed experts stay whole and replicated over tp (under expert parallelism
each ep rank's experts, expert_parallel.py), the shared experts are column/row-wise with an all-reduce
out, and the layer's output is handed back sequence-parallel (a local slice, no communication).

Latent attention (models/mla.py): heads split as above (wq or wq_b and wkv_b column-wise, wo row-wise),
the low-rank down projections wq_a, wkv_a and their norms replicated. Its tensors stay DTensors (the
rotary table passed in as a replicated one) until `attend`, which gets this rank's heads as plain tensors:
the key's rotary part is one head shared by all, so its gradient is a sum over every rank's heads, which
DTensor's autograd does (a partial sum reduced on the way back) and plain local tensors would not.

Output: column-wise over the vocabulary with the logits left as a DTensor sharded on the vocab
dimension; the cross-entropy then runs under `loss_parallel()` and never gathers the full logits
(batch x seq x vocab would be the largest activation of the model).
"""

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from trillion.models.mla import MLAttention
from trillion.models.moe import MoE


def apply_tensor_parallel(model: nn.Module, tp_mesh, *, float8_tp: bool = False, expert_parallel: bool = False) -> None:
    """Shard `model` (built from models.transformer) over the 1-D `tp_mesh`, in place. `float8_tp`: the
    blocks' float8 linears (parallel/float8.py, tensorwise) take torchao's float8 styles, which cast the
    activations to float8 before the all-gather (half the bytes, one cast for q, k and v).
    `expert_parallel`: the routed experts go to the ep mesh next (not replicated over tp here)."""
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
        style = _Styles(block, float8_tp)
        latent = isinstance(block.attention, MLAttention)
        plan = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
        plan |= _mla_plan(block.attention) if latent else _attention_plan(style)
        plan |= _moe_plan(block.feed_forward) if isinstance(block.feed_forward, MoE) else _mlp_plan(block, style)
        parallelize_module(block, tp_mesh, plan)
        if latent:
            _replicate_latent(block.attention, tp_mesh)
        if isinstance(block.feed_forward, MoE):
            _replicate_routing(block.feed_forward, tp_mesh, experts=not expert_parallel)


def _attention_plan(style) -> dict:
    return {
        "attention": style.prepare(
            "attention", ("wq", "wk", "wv"), input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wq": style.colwise("attention.wq"),
        "attention.wk": style.colwise("attention.wk"),
        "attention.wv": style.colwise("attention.wv"),
        "attention.wo": style.rowwise("attention.wo", output_layouts=Shard(1), use_local_output=False),
    }


def _mla_plan(attention: MLAttention) -> dict:
    """Latent attention: input and rotary table replicated DTensors, the head-making projections column-wise
    with DTensor outputs, wo row-wise (the replicated parts: _replicate_latent). Plain styles: float8
    tensor parallelism of latent attention is not built."""
    query = "attention.wq" if attention.wq is not None else "attention.wq_b"
    return {
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), Replicate()), desired_input_layouts=(Replicate(), Replicate())
        ),
        query: ColwiseParallel(use_local_output=False),
        "attention.wkv_b": ColwiseParallel(use_local_output=False),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def _replicate_latent(attention: MLAttention, tp_mesh) -> None:
    """The down projections and their norms whole on every tp rank (replicated DTensors, as their inputs are),
    and the attention itself on this rank's heads."""
    for module in (attention.wq_a, attention.q_norm, attention.wkv_a, attention.kv_norm):
        if module is not None:
            distribute_module(module, tp_mesh)
    attention.attend = _LocalHeads(attention.attend)


class _LocalHeads:
    """Latent attention's `attend` under TP: q, k, v (DTensors, heads sharded) -> the wrapped attend (a backend,
    or context parallelism's) on this rank's heads as plain tensors; its output is this rank's slice of wo's input."""

    def __init__(self, attend):
        self.attend = attend

    def __call__(self, q, k, v, **kwargs):
        return self.attend(*(t.redistribute(placements=[Shard(1)]).to_local() for t in (q, k, v)), **kwargs)


def _replicate_routing(moe: MoE, tp_mesh, experts: bool) -> None:
    """The router (and the routed experts, unless expert-parallel) as DTensors replicated over tp, so
    that every parameter is a DTensor (foreach optimizers take no mix); they compute on local tensors."""
    distribute_module(
        moe.router.gate,
        tp_mesh,
        input_fn=lambda _module, inputs, mesh: tuple(
            DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in inputs
        ),
        output_fn=lambda _module, output, _mesh: output.to_local(),
    )
    if experts:  # RoutedExperts reads its weights' local tensors
        distribute_module(moe.experts, tp_mesh)


def _mlp_plan(block: nn.Module, style) -> dict:
    plan = {
        "feed_forward": style.prepare(
            "feed_forward", ("w1", "w3"), input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": style.colwise("feed_forward.w1"),
        "feed_forward.w2": style.rowwise("feed_forward.w2", output_layouts=Shard(1), use_local_output=False),
    }
    if block.feed_forward.w3 is not None:
        plan["feed_forward.w3"] = style.colwise("feed_forward.w3")
    return plan


def _moe_plan(moe: MoE) -> dict:
    """All-gathered in, sequence-parallel out; router and routed experts replicated; shared experts TP."""
    plan = {
        "feed_forward": PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=False,
        )
    }
    shared = moe.shared_experts
    if shared is not None:
        plan["feed_forward.shared_experts.w1"] = ColwiseParallel()
        plan["feed_forward.shared_experts.w2"] = RowwiseParallel(output_layouts=Replicate())
        if shared.w3 is not None:
            plan["feed_forward.shared_experts.w3"] = ColwiseParallel()
    return plan


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

    def prepare(self, parent: str, linears: tuple[str, ...], **kwargs):
        names = [f"{parent}.{linear}" for linear in linears if getattr(self.block.get_submodule(parent), linear)]
        return (self.float8_styles[2] if self._float8(*names) else PrepareModuleInput)(**kwargs)


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
