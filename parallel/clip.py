"""Gradient clipping by the exact total norm of the whole model's gradient.

Under FSDP and TP a gradient is a DTensor whose local part is a shard (or a replica) of the full
gradient. Each DTensor norm is a partial result that `full_tensor()` reduces correctly over its
mesh (sums of squares over shards, nothing over replicas), so the total is the norm of the one
logical gradient, whatever the layout. Plain tensors (one process) and DTensors on different meshes
are grouped separately and combined as squares. Pipeline stages each hold different parameters:
pass the pipeline process group and the stage totals are summed (as squares) across it.

Under expert parallelism the routed experts' gradients live on another mesh (ep with the
data-parallel ranks it leaves) than the rest (FSDP's): each mesh's group is reduced on its own mesh,
and the scaling multiplies each group's local shards by the one global coefficient (DTensor will
not mix meshes in one foreach op).
"""

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _by_mesh(grads) -> dict:
    groups: dict = {}
    for grad in grads:
        key = grad.device_mesh if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(grad)
    return groups


def total_grad_norm(parameters, pp_group=None) -> torch.Tensor:
    """The norm of every gradient but those of parameters marked `counted_elsewhere` (a pipeline's copy of a
    parameter another stage holds: parallel/pipeline_ahead.py), whose gradient the other copy's equals."""
    groups = _by_mesh(p.grad for p in parameters if p.grad is not None and not getattr(p, "counted_elsewhere", False))
    squares = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    total_sq = torch.stack(squares).sum() if squares else torch.zeros(())
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt()


def clip_grad_norm_(parameters, max_norm: float, pp_group=None) -> torch.Tensor:
    """Scale gradients so their total norm is at most `max_norm` (<= 0 or inf: no scaling); returns the norm."""
    parameters = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(parameters, pp_group)
    if max_norm > 0 and not math.isinf(max_norm):
        groups = _by_mesh(p.grad for p in parameters)
        if len(groups) == 1:
            torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach=True)
        else:  # as clip_grads_with_norm_ does, on each mesh's local shards
            coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
            for group in groups.values():
                local = [g.to_local() if isinstance(g, DTensor) else g for g in group]
                torch._foreach_mul_(local, coefficient.to(local[0].device))
    return total
