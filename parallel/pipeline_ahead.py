"""Multi-token prediction under a pipeline (models/mtp.py): its modules run on the last stage with the output head,
and they embed later tokens with the first stage's embedding.

The embedding: the last stage holds its own copy (pipeline.stage_module keeps what `Transformer.output_end_reads`
names), under the same parameter name, drawn from the same seed, so the two start equal; after each step's
backward their gradients are summed between the first and the last pipeline rank (the first stage's gradient
holds the trunk's use, the last stage's the modules'), so both copies take the same optimizer step and stay
equal. This is Megatron's way with tied embeddings (an embedding group of the first and last stage). The V-shaped
schedules (ZBVZeroBubble, DualPipeV) put both ends on one rank, as DeepSeek's DualPipe does: the two stages keep
their own modules (FSDP shards each stage apart, so one module cannot serve both), the rank's parameters (its
stages as one module: the optimizer's and the checkpoint's) hold the first stage's, the copy's gradient is added to
it after each backward, and the copy takes the optimized values before the next step: no communication at all.
The gradient norm counts the copy once (the last stage's is marked `counted_elsewhere`: parallel/clip.py); a
checkpoint holds one `tok_embeddings.weight` (both ranks save the same values under the same name).

The tokens the modules read travel as the schedule's keyword input `ahead` (each micro-batch's, to every
stage; the stages without the modules ignore it), cut from the labels the step stacked (models/mtp.py
lookahead_labels). The last stage's loss is the trunk's plus the weighted mean of the depths'; the step reports
the trunk's and the depths' apart, as without a pipeline.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trillion.models import parts
from trillion.models.mtp import lookahead_tokens
from trillion.parallel.forward_backward import lookahead_loss, token_loss

# torch's first step infers the stages' shapes with one forward and loss of its own (pipeline_stage.py): not a
# micro-batch of the step, so its loss is not recorded
_INFERRING = contextvars.ContextVar("pipeline_shape_inference", default=False)


@contextlib.contextmanager
def shape_inference():
    token = _INFERRING.set(True)
    try:
        yield
    finally:
        _INFERRING.reset(token)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class AheadOutputs:
    """A pipeline's multi-token prediction: the depths it trains (0: none), their inputs, losses and the
    embedding copies' gradients."""

    def __init__(self, args, shared_modules: list[str]):
        self.depths, self.weight = parts.ahead_modules(args)[0], args.mtp_loss_weight
        self.shared_modules = shared_modules
        self.copies: list[torch.nn.Parameter] = []  # this rank's end of the first/last pair
        self.originals: list[torch.nn.Parameter] = []  # a V: the first stage's, beside the copies on this rank
        self.pair, self.group = [], None
        self.recorded: torch.Tensor | None = None  # (trunk, depths) losses summed over the step's micro-batches
        self.loss: torch.Tensor | None = None

    def find_copies(self, stage_parts, pp_mesh, pp_rank: int, v_shape: bool = False) -> None:
        """After the stages are materialized: this rank's copies of the shared modules' parameters (on the first
        and the last pipeline rank, or both on the first under a `v_shape` schedule; the last stage's marked
        counted_elsewhere for the gradient norm)."""
        if not self.depths or not self.shared_modules:
            return
        ranks = pp_mesh.mesh.flatten().tolist()
        self.pair = [ranks[0], ranks[-1]]
        last_rank = 0 if v_shape else len(ranks) - 1
        if pp_rank == 0:
            self.copies = self._shared(stage_parts[0])
        if pp_rank == last_rank:
            last = self._shared(stage_parts[-1])
            for param in last:
                param.counted_elsewhere = True
            self.originals, self.copies = (self.copies, last) if v_shape else ([], last)
        self.group = pp_mesh.get_group() if len(ranks) == 2 else None

    def _shared(self, part) -> list[torch.nn.Parameter]:
        return [p for name, p in part.named_parameters() if name.split(".", 1)[0] in self.shared_modules]

    def stage_inputs(self, micro_batches) -> dict:
        """The schedule's keyword inputs of a training step: each micro-batch's tokens further on."""
        if not self.depths:
            return {}
        return {"ahead": torch.cat([lookahead_tokens(labels) for _, labels in micro_batches])}

    @torch.no_grad()
    def start_step(self, device) -> None:
        self.recorded = torch.zeros(2, device=device) if self.depths else None
        for original, copy in zip(self.originals, self.copies):  # a V: the copy takes the optimized values
            _local(copy).copy_(_local(original))

    def loss_to_differentiate(self, output: tuple, labels: torch.Tensor, tokens) -> torch.Tensor:
        """The last stage's loss of one micro-batch: the trunk's plus the weighted mean of the depths'; both
        recorded apart for the step's report."""
        trunk = token_loss(output[0], labels[..., 0], tokens)
        depths = lookahead_loss(output[1:], labels, tokens)
        if not _INFERRING.get():
            self.recorded += torch.stack([_local(trunk).detach(), _local(depths).detach()])
        return trunk + self.weight * depths

    def finish_step(self, pp_group) -> None:
        """After the schedule: the copies' gradients summed, the recorded losses summed over the pipeline ranks."""
        if not self.depths:
            return
        if self.originals:  # a V: both on this rank, only the first stage's is stepped
            for original, copy in zip(self.originals, self.copies):
                _local(original.grad).add_(_local(copy.grad))
                copy.grad = None
        elif self.copies:
            if self.group is None:  # every first/last pair makes its own group; only its two ranks take part
                self.group = dist.new_group(self.pair, use_local_synchronization=True)
            for param in self.copies:
                dist.all_reduce(_local(param.grad), group=self.group)
        dist.all_reduce(self.recorded, group=pp_group)
        self.loss = self.recorded[1]

    def trunk_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss to report: the trunk's (the schedule's holds the depths' too)."""
        return self.recorded[0] if self.depths else loss
