"""One optimizer step's forward and backward over its micro-batches, with the one loss both ways of
running them share: the micro-batch loop here (gradient accumulation) and the pipeline schedule
(pipeline.Pipeline). Each returns this rank's loss summed over its micro-batches, before the
data-parallel sum; what FSDP and TP need around them (which micro-batch is the last, the loss
parallel over the vocabulary) stays in here and in pipeline.py.

The loss is the sum of the token losses divided by the target-token count of the whole global
batch (`tokens`, summed over data-parallel ranks), so accumulating micro-batches or summing
gradients over ranks changes nothing: it is the mean over every target token of the global batch,
not a mean of per-micro-batch means.
"""

from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trillion.parallel.fsdp import set_micro_batch
from trillion.parallel.tensor_parallel import loss_context

IGNORE_INDEX = -100  # a label the loss skips (a masked target); torch's own default


def token_loss(logits: torch.Tensor, labels: torch.Tensor, tokens: torch.Tensor | int) -> torch.Tensor:
    """Summed cross-entropy of (batch, seq, vocab) logits against (batch, seq) labels over `tokens`."""
    return (
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum")
        / tokens
    )


def lookahead_loss(depth_logits: list[torch.Tensor], labels: torch.Tensor, tokens: torch.Tensor | int) -> torch.Tensor:
    """The multi-token prediction modules' mean loss: depth k's logits (batch, seq - k, vocab) against the labels
    shifted k more, each summed over `tokens` as DeepSeek-V3 divides by the trunk's target count (its eq. 24-25)."""
    losses = [token_loss(logits, labels[:, depth:], tokens) for depth, logits in enumerate(depth_logits, start=1)]
    return sum(losses) / len(losses)


class MicroBatch(tuple):
    """(inputs, labels), unpacking as the pair a micro-batch has always been, with the model's inputs besides the
    tokens: `document_ids` (batch, seq) of the documents packed into each sequence (data.document_mask: attention
    stays within them) and `positions` (batch, seq) restarting at each document (data.reset_positions). Under
    context parallelism the ids stay whole (attention reads every key's) while the rest is sharded."""

    document_ids: torch.Tensor | None
    positions: torch.Tensor | None

    def __new__(cls, inputs, labels, document_ids=None, positions=None):
        batch = super().__new__(cls, (inputs, labels))
        batch.document_ids, batch.positions = document_ids, positions
        return batch


def model_inputs(micro_batch) -> dict:
    """The model's keyword inputs a micro-batch carries besides its tokens; none for a plain (inputs, labels) pair."""
    found = {name: getattr(micro_batch, name, None) for name in ("document_ids", "positions")}
    return {name: value for name, value in found.items() if value is not None}


def map_tensors(micro_batch, fn, whole=None):
    """`micro_batch` with `fn` applied to each of its tensors (`whole` to its document ids, if given), of its kind."""
    inputs, labels = micro_batch
    extra = model_inputs(micro_batch)
    if not extra:
        return fn(inputs), fn(labels)
    ids = extra.get("document_ids")
    return MicroBatch(
        fn(inputs),
        fn(labels),
        document_ids=None if ids is None else (whole or fn)(ids),
        positions=fn(extra["positions"]) if "positions" in extra else None,
    )


def target_tokens(micro_batches) -> torch.Tensor:
    """The target tokens of this rank's micro-batches (labels not IGNORE_INDEX)."""
    return sum((labels != IGNORE_INDEX).sum() for _, labels in micro_batches)


class Runner(Protocol):
    """What the training step needs of a way to run the micro-batches: the module holding this rank's
    parameters (to clip and to optimize), the process group its gradient norm spans beyond the sharded
    layout (the pipeline ranks; None without a pipeline), and the forward and backward of one step
    returning this rank's summed loss; `ahead_loss`: the step's multi-token prediction loss summed likewise
    (None without it). MicroBatchLoop and pipeline.Pipeline are the two."""

    model: nn.Module
    clip_group: dist.ProcessGroup | None
    ahead_loss: torch.Tensor | None

    def forward_backward(self, micro_batches, tokens: torch.Tensor, autocast, scaler) -> torch.Tensor: ...


class MicroBatchLoop:
    """Gradient accumulation: each micro-batch's forward and backward in turn, on the whole model
    (parallelized by parallelize.py). `clip_group` is None: the gradient norm spans no pipeline.
    `ahead_weight` > 0: the model trains multi-token prediction modules (models/mtp.py), whose mean loss
    joins the backward with this weight; the returned loss stays the trunk's (comparable with runs
    without them and with the evaluation's), the modules' in `ahead_loss`."""

    clip_group = None

    def __init__(
        self, model: nn.Module, tp_enabled: bool = False, dp_shard_mode: str = "zero3", ahead_weight: float = 0.0
    ):
        self.model, self.tp_enabled, self.dp_shard_mode = model, tp_enabled, dp_shard_mode
        self.ahead_weight = ahead_weight
        self.ahead_loss: torch.Tensor | None = None

    def forward_backward(self, micro_batches, tokens: torch.Tensor, autocast, scaler) -> torch.Tensor:
        device = micro_batches[0][0].device
        loss_sum = torch.zeros((), device=device)
        self.ahead_loss = torch.zeros((), device=device) if self.ahead_weight else None
        for index, (inputs, labels) in enumerate(micro_batches):
            set_micro_batch(self.model, self.dp_shard_mode, is_last=index == len(micro_batches) - 1)
            extra = model_inputs(micro_batches[index])
            with autocast:
                if self.ahead_weight:
                    logits, ahead = self.model(inputs, with_mtp=True, **extra)
                else:
                    logits, ahead = self.model(inputs, **extra), []
            with loss_context(self.tp_enabled):
                loss = total = token_loss(logits, labels, tokens)
                if ahead:
                    depth_loss = lookahead_loss(ahead, labels, tokens)
                    self.ahead_loss += depth_loss.detach()
                    total = loss + self.ahead_weight * depth_loss
                scaler.scale(total).backward()
            loss_sum += loss.detach().to_local() if self.tp_enabled else loss.detach()
        return loss_sum
