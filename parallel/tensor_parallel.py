"""Tensor parallelism with DTensor `parallelize_module`, Megatron-style, for both model families.

Per block: q/k/v and the MLP input projections (w1, w3) are column-wise (each rank holds a slice of
the heads / of the FFN width), wo and w2 are row-wise, so a block costs one all-gather on the way in
and one reduce-scatter on the way out of attention and of the MLP. Between those, the residual
stream and the norms are sequence-parallel: each rank holds seq_len / tp positions (norm weights
and biases replicated), which divides the activation memory outside the matmuls by tp.

Embedding: vocabulary-parallel (row-wise: each rank owns vocab / tp rows and the partial results
are reduced). Llama (rotary positions) reduce-scatters straight into the sequence-parallel layout.
GPT's learned positions need the full sequence to index the position table (position-parallel
the same way), so there the embeddings are all-reduced, added, and the first block takes its slice
of the sequence locally (no communication).

The residual stream stays a DTensor (Shard(1)) between and across blocks: the embedding and the
row-wise wo / w2 return DTensors instead of their local shards. Numerically it is the same; it is
what lets a block be compiled on its own (see compile.py: with plain tensors at the boundary the
compiled backward crashed or, under FSDP, gave the embedding a wrong gradient).

Output: column-wise over the vocabulary with the logits left as a DTensor sharded on the vocab
dimension; the cross-entropy then runs under `loss_parallel()` and never gathers the full logits
(batch x seq x vocab would be the largest activation of the model).
"""
import contextlib

from torch import nn
from torch.distributed.tensor import Replicate, Shard
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
    learned_positions = getattr(model, "pos_embeddings", None) is not None
    top = {}
    if model.tok_embeddings is not None:
        after_embedding = Replicate() if learned_positions else Shard(1)
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=after_embedding,
                                                use_local_output=learned_positions)
        if learned_positions:
            top["pos_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, tp_mesh, top)

    blocks = list(model.layers.values())
    for index, block in enumerate(blocks):
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
    if learned_positions and model.tok_embeddings is not None and blocks:
        # Replicated embeddings -> this rank's slice of the sequence (a local chunk; backward all-gathers).
        parallelize_module(blocks[0], tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None)))


def loss_context(tp_enabled: bool):
    """The context the loss (forward and backward) must run in: loss parallelism under TP."""
    return loss_parallel() if tp_enabled else contextlib.nullcontext()
