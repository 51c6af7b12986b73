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

import copy
import functools
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from trillion.models.mtp import lookahead_labels, lookahead_tokens
from trillion.parallel.expert_overlap import Pair, pairs_micro_batches
from trillion.parallel.fsdp import set_micro_batch
from trillion.parallel.layout import Layout
from trillion.parallel.tensor_parallel import loss_context

IGNORE_INDEX = -100  # a label the loss skips (a masked target); torch's own default
ONE_PROCESS = Layout()


def token_loss(logits: torch.Tensor, labels: torch.Tensor, tokens: torch.Tensor | int) -> torch.Tensor:
    """Summed cross-entropy of (batch, seq, vocab) logits against (batch, seq) labels over `tokens`."""
    return (
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum")
        / tokens
    )


def lookahead_loss(depth_logits, stacked: torch.Tensor, tokens: torch.Tensor | int) -> torch.Tensor:
    """The multi-token prediction modules' mean loss: depth k's logits (batch, seq, vocab) against column k of the
    stacked labels (models/mtp.py lookahead_labels), each summed over `tokens` as DeepSeek-V3 divides by the trunk's
    target count (its eq. 24-25)."""
    losses = [token_loss(logits, stacked[..., depth], tokens) for depth, logits in enumerate(depth_logits, start=1)]
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


def carried_inputs(micro_batches) -> dict:
    """What the micro-batches carry for the model besides their tokens (document ids, positions), joined along the
    batch as the tokens are: the schedule splits keyword inputs back into micro-batches and hands every stage, not
    only the first, its micro-batch's, so each stage's attention masks the documents of the micro-batch it runs."""
    carried = [model_inputs(mb) for mb in micro_batches]
    return {name: torch.cat([inputs[name] for inputs in carried]) for name in carried[0]}


def with_labels(micro_batch, labels: torch.Tensor):
    """`micro_batch` with other labels, of its kind (its other inputs kept)."""
    extra = model_inputs(micro_batch)
    return MicroBatch(micro_batch[0], labels, **extra) if extra else (micro_batch[0], labels)


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


def trunk_labels(labels: torch.Tensor) -> torch.Tensor:
    """The trunk's (batch, seq) labels, from plain labels or from labels stacked for multi-token prediction."""
    return labels[..., 0] if labels.dim() == 3 else labels


def with_lookahead(micro_batches, depths: int) -> list:
    """Each (inputs, labels) with its labels stacked for `depths` multi-token prediction depths (models/mtp.py
    lookahead_labels); unchanged without them. Done before the batch is split along the sequence."""
    if not depths:
        return micro_batches
    return [with_labels(batch, lookahead_labels(batch[1], depths, IGNORE_INDEX)) for batch in micro_batches]


def target_tokens(micro_batches) -> torch.Tensor:
    """The target tokens of this rank's micro-batches (the trunk's labels not IGNORE_INDEX)."""
    return sum((trunk_labels(labels) != IGNORE_INDEX).sum() for _, labels in micro_batches)


class Runner(Protocol):
    """What the training step needs of a way to run the micro-batches: the module holding this rank's
    parameters (to clip and to optimize), the process group its gradient norm spans beyond the sharded
    layout (the pipeline ranks; None without a pipeline), and the forward and backward of one step
    returning this rank's summed loss; `lookahead`: the multi-token prediction depths it trains (0: none;
    the step stacks their labels, `with_lookahead`); `ahead_loss`: the step's multi-token prediction loss
    summed likewise (None without it). MicroBatchLoop and pipeline.Pipeline are the two."""

    model: nn.Module
    clip_group: dist.ProcessGroup | None
    lookahead: int
    ahead_loss: torch.Tensor | None

    def forward_backward(self, micro_batches, tokens: torch.Tensor, autocast, scaler) -> torch.Tensor: ...


class MicroBatchLoop:
    """Gradient accumulation: each micro-batch's forward and backward in turn, on the whole model
    (parallelized by parallelize.py). `clip_group` is None: the gradient norm spans no pipeline.
    `lookahead` depths of multi-token prediction modules (models/mtp.py) train with it: their mean loss
    joins the backward with `ahead_weight`; the returned loss stays the trunk's (comparable with runs
    without them and with the evaluation's), the modules' in `ahead_loss`."""

    clip_group = None

    def __init__(self, model: nn.Module, layout: Layout = ONE_PROCESS, ahead_weight: float = 0.0, lookahead: int = 0):
        """`layout`: the run's (tensor parallelism's loss, the ZeRO mode's last micro-batch, and whether two
        micro-batches run in flight at once: parallel/expert_overlap.py)."""
        self.model, self.tp_enabled, self.dp_shard_mode = model, layout.tp > 1, layout.dp_shard_mode
        self.ahead_weight, self.lookahead, self.paired = ahead_weight, lookahead, pairs_micro_batches(layout)
        self.ahead_loss: torch.Tensor | None = None

    def forward_backward(self, micro_batches, tokens: torch.Tensor, autocast, scaler) -> torch.Tensor:
        device = micro_batches[0][0].device
        loss_sum = torch.zeros((), device=device)
        self.ahead_loss = torch.zeros((), device=device) if self.lookahead else None
        size = 2 if self.paired else 1
        for start in range(0, len(micro_batches), size):
            group = micro_batches[start : start + size]
            set_micro_batch(self.model, self.dp_shard_mode, is_last=start + len(group) == len(micro_batches))
            forwards = [functools.partial(self._forward, batch, autocast) for batch in group]
            outputs = Pair().run(*forwards) if len(forwards) == 2 else [forwards[0]()]
            with loss_context(self.tp_enabled):
                losses = [self.losses(output, labels, tokens) for output, (_, labels) in zip(outputs, group)]
                scaler.scale(sum(total for _, total in losses)).backward()
            for loss, _ in losses:
                loss_sum += loss.detach().to_local() if self.tp_enabled else loss.detach()
        return loss_sum

    def _forward(self, micro_batch, autocast):
        (inputs, labels), extra = micro_batch, model_inputs(micro_batch)
        if self.lookahead:
            extra["ahead"] = lookahead_tokens(labels)
        with copy.copy(autocast):  # its own: a paired forward runs in a thread of its own
            return self.model(inputs, **extra)

    def losses(self, output, labels: torch.Tensor, tokens) -> tuple[torch.Tensor, torch.Tensor]:
        """(the trunk's loss, the loss to differentiate) of one micro-batch's output: the logits, or with
        multi-token prediction (logits, each depth's logits), whose mean loss is added to `ahead_loss`."""
        if not isinstance(output, tuple):
            loss = token_loss(output, trunk_labels(labels), tokens)
            return loss, loss
        loss = token_loss(output[0], labels[..., 0], tokens)
        depth_loss = lookahead_loss(output[1:], labels, tokens)
        self.ahead_loss += depth_loss.detach().to_local() if isinstance(depth_loss, DTensor) else depth_loss.detach()
        return loss, loss + self.ahead_weight * depth_loss
